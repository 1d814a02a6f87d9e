"""The README's "Serve a real model" section, followed as written against a fake Hugging Face Hub.

The Hub on 127.0.0.1 (`HF_ENDPOINT`, the cache in a temporary `HF_HOME`) serves the tiny synthetic model
under a stand-in id. The section's own command lines run with that id in place of the real one and the
test's port in place of 8000: `plan` (downloads the config alone), `serve` (downloads the rest), then the
curl request, the Python example and the Anthropic one-liner, each answered by the server.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import util
from fake_hub import FakeHub

REAL_ID = "Qwen/Qwen3.6-27B"
FAKE_ID = "deltaserve-test/tiny-model"
BIN = "target/release/deltaserve"  # how the README names the binary
TIMEOUT = 120


def section() -> str:
    text = (util.REPO_ROOT / "README.md").read_text()
    start = text.index("\n## Serve a real model")
    return text[start:text.index("\n## ", start + 1)]


def fenced(lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", section(), re.S)


def line(prefix: str) -> str:
    """The first line of the section's shell blocks that starts with `prefix`, with the stand-in id."""
    for block in fenced("sh"):
        for ln in block.splitlines():
            if ln.startswith(prefix):
                return ln.replace(REAL_ID, FAKE_ID)
    raise AssertionError(f"the README's 'Serve a real model' section has no `{prefix}` command")


def json_values(text: str) -> list:
    """The JSON documents printed one after another (curl prints no newline between them)."""
    dec, out, i = json.JSONDecoder(), [], 0
    while (i := len(text) - len(text[i:].lstrip())) < len(text):
        value, i = dec.raw_decode(text, i)
        out.append(value)
    return out


def synthetic_model(tmp_path) -> dict[str, bytes]:
    out = tmp_path / "synth"
    subprocess.run([str(util.server_binary()), "synth", "--preset", "tiny", "--out", str(out)], check=True,
                   capture_output=True, timeout=TIMEOUT)
    files = {p.name: p.read_bytes() for p in out.iterdir()}
    files["README.md"] = b"# tiny model\n"  # listed by the Hub, never read by the server
    return files


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_serve_a_real_model_as_the_readme_says(tmp_path):
    with FakeHub(FAKE_ID, synthetic_model(tmp_path)) as hub:
        # The Hub and the cache of this test alone (None: removed from the environment).
        env = {"HF_ENDPOINT": hub.url, "HF_HOME": str(tmp_path / "hf"), **dict.fromkeys(
            ["HF_TOKEN", "HF_TOKEN_PATH", "HF_HUB_OFFLINE", "HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"])}
        run_env = {k: v for k, v in {**os.environ, **env}.items() if v is not None}

        # 3. Check that it fits: the config alone is downloaded.
        plan = shlex.split(line(f"{BIN} plan"))
        out = subprocess.run([str(util.server_binary()), *plan[1:]], capture_output=True, text=True,
                             timeout=TIMEOUT, env=run_env)
        assert out.returncode == 0, out.stderr
        assert "context" in out.stdout, out.stdout
        assert hub.downloaded() == {"config.json"}

        # 4. Serve: the first start downloads the model.
        serve = shlex.split(line(f"{BIN} serve"))
        assert serve[:2] == [BIN, "serve"], serve
        srv = util.Server(args=serve[2:], log_path=tmp_path / "server.log", env=env)
        try:
            srv.start()
            assert hub.downloaded() == set(hub.files) - {"README.md"}, hub.requests

            # Send a request: the curl block.
            block = next(b for b in fenced("sh") if "curl " in b and "/v1/chat/completions" in b)
            script = block.replace("localhost:8000", f"127.0.0.1:{srv.port}").replace(REAL_ID, FAKE_ID)
            out = subprocess.run(["bash", "-euo", "pipefail", "-c", script], capture_output=True, text=True,
                                 timeout=TIMEOUT)
            assert out.returncode == 0, out.stderr
            models, chat = json_values(out.stdout)
            assert [m["id"] for m in models["data"]] == [FAKE_ID]
            message = chat["choices"][0]["message"]
            assert message["role"] == "assistant"
            assert message.get("content") or message.get("reasoning_content"), chat
            assert chat["usage"]["completion_tokens"] > 0

            # The Python example (openai) and the Anthropic one-liner.
            example = fenced("python")[0].replace("http://localhost:8000", srv.base).replace(REAL_ID, FAKE_ID)
            out = subprocess.run([sys.executable, "-c", example], capture_output=True, text=True, timeout=TIMEOUT)
            assert out.returncode == 0, out.stderr
            one_liner = shlex.split(line("python3 -c").replace("http://localhost:8000", srv.base))
            out = subprocess.run([sys.executable, *one_liner[1:]], capture_output=True, text=True, timeout=TIMEOUT)
            assert out.returncode == 0, out.stderr
            assert "Block(" in out.stdout, out.stdout
        finally:
            code = srv.interrupt(util.SHUTDOWN_TIMEOUT)
            srv.kill()
        assert code == 0, srv.log_tail()
