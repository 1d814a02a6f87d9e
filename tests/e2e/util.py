"""Helpers shared by the end-to-end tests: server processes, HTTP calls, SSE parsing, metrics.

Everything talks to 127.0.0.1 only, every request carries a timeout, and every loop is bounded.
"""

from __future__ import annotations

import json
import re
import os
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

API_KEY = "test-key"
MODEL = "demo"
HOST = "127.0.0.1"
REQUEST_TIMEOUT = 60.0  # seconds, per request (the demo model decodes ~100 tok/s on 2 cores)
STARTUP_TIMEOUT = 60.0
SHUTDOWN_TIMEOUT = 15.0

OPENAI_HEADERS = {"Authorization": f"Bearer {API_KEY}"}
ANTHROPIC_HEADERS = {"x-api-key": API_KEY, "anthropic-version": "2023-06-01"}

REPO_ROOT = Path(__file__).resolve().parents[2]

METRIC_NAMES = [
    "deltaserve_requests_running",
    "deltaserve_requests_waiting",
    "deltaserve_kv_pages_used",
    "deltaserve_kv_pages_total",
    "deltaserve_request_ttft_seconds",
    "deltaserve_inter_token_latency_seconds",
    "deltaserve_request_queue_seconds",
    "deltaserve_request_prefill_seconds",
    "deltaserve_request_decode_seconds",
    "deltaserve_request_prefill_steps_total",
    "deltaserve_request_prefill_step_seconds_total",
    "deltaserve_prompt_tokens_total",
    "deltaserve_generation_tokens_total",
    "deltaserve_requests_total",
    "deltaserve_prefix_cache_hit_tokens_total",
    "deltaserve_arena_allocations",
    "deltaserve_arena_high_water_bytes",
    "deltaserve_prompt_tokens_tokenized_total",
    "deltaserve_prompt_tokens_tokenizer_reused_total",
    "deltaserve_prompt_tokenizer_cache_tokens",
    "deltaserve_image_cache_hits_total",
    "deltaserve_image_cache_misses_total",
    "deltaserve_image_cache_images",
    "deltaserve_image_cache_bytes",
    "deltaserve_engine_step_seconds_total",
]


def server_binary() -> Path:
    """$DELTASERVE_BIN, else target/release/deltaserve (respecting $CARGO_TARGET_DIR)."""
    env = os.environ.get("DELTASERVE_BIN")
    if env:
        return Path(env)
    target = Path(os.environ.get("CARGO_TARGET_DIR") or REPO_ROOT / "target")
    if not target.is_absolute():
        target = REPO_ROOT / target
    return target / "release" / "deltaserve"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


@dataclass
class Server:
    """One `deltaserve serve` process on 127.0.0.1."""

    args: list[str]
    log_path: Path
    port: int = 0
    env: dict[str, str | None] = field(default_factory=dict)  # set (str) or removed (None) for this server
    proc: subprocess.Popen | None = None
    _log: object = field(default=None, repr=False)

    @property
    def base(self) -> str:
        return f"http://{HOST}:{self.port}"

    def start(self) -> "Server":
        binary = server_binary()
        if not binary.exists():
            raise RuntimeError(f"server binary {binary} does not exist (set DELTASERVE_BIN or build with "
                               "`cargo build --release -p deltaserve`)")
        self.port = free_port()
        cmd = [str(binary), "serve", "--host", HOST, "--port", str(self.port), *self.args]
        self._log = open(self.log_path, "wb")
        self._log.write((" ".join(cmd) + "\n").encode())
        self._log.flush()
        env = dict(os.environ)
        env.setdefault("RUST_LOG", "info")
        env.setdefault("NO_COLOR", "1")
        env.setdefault("RUST_BACKTRACE", "1")
        for k, v in self.env.items():
            if v is None:
                env.pop(k, None)
            else:
                env[k] = v
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=REPO_ROOT)
        deadline = time.monotonic() + STARTUP_TIMEOUT
        last = None
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during startup\n{self.log_tail()}")
            try:
                r = httpx.get(f"{self.base}/health", timeout=2.0)
                if r.status_code == 200:
                    return self
                last = f"status {r.status_code}"
            except httpx.HTTPError as e:
                last = repr(e)
            time.sleep(0.2)
        self.kill()
        raise RuntimeError(f"server not healthy within {STARTUP_TIMEOUT:.0f} s (last: {last})\n{self.log_tail()}")

    def log_tail(self, n: int = 60) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "---- server log (tail) ----\n" + "\n".join(lines[-n:])

    def interrupt(self, timeout: float = SHUTDOWN_TIMEOUT) -> int | None:
        """SIGINT, then wait up to `timeout` s. Returns the exit code, or None if it did not exit (then killed)."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                return None
        return self.proc.returncode

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        if self._log is not None:
            self._log.close()
            self._log = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


# ---------------------------------------------------------------------------------------------- HTTP


def client(base: str, headers: dict | None = None, timeout: float = REQUEST_TIMEOUT) -> httpx.Client:
    return httpx.Client(base_url=base, headers=OPENAI_HEADERS if headers is None else headers, timeout=timeout)


def chat_body(content: str = "Hello there", **kw) -> dict:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8}
    body.update(kw)
    return body


def greedy(**kw) -> dict:
    """A deterministic request body fragment: greedy, never stopping early on EOS."""
    d = {"temperature": 0, "ignore_eos": True}
    d.update(kw)
    return d


def no_think() -> dict:
    return {"chat_template_kwargs": {"enable_thinking": False}}


def assert_openai_error(r: httpx.Response, status: int | tuple[int, ...], *mentions: str) -> dict:
    """The response has one of the given statuses and an OpenAI error body; its message names each of `mentions`."""
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, f"expected {statuses}, got {r.status_code}: {r.text[:500]}"
    try:
        body = r.json()
    except ValueError:
        raise AssertionError(f"error body is not JSON: {r.text[:500]!r}")
    assert isinstance(body, dict) and isinstance(body.get("error"), dict), f"not an OpenAI error body: {body}"
    err = body["error"]
    for k in ("message", "type", "param", "code"):
        assert k in err, f"error body lacks {k!r}: {body}"
    assert isinstance(err["message"], str) and err["message"], body
    assert isinstance(err["type"], str) and err["type"], body
    text = json.dumps(body)
    for m in mentions:
        assert m in text, f"error body does not mention {m!r}: {body}"
    return err


def assert_anthropic_error(r: httpx.Response, status: int | tuple[int, ...], *mentions: str) -> dict:
    statuses = (status,) if isinstance(status, int) else status
    assert r.status_code in statuses, f"expected {statuses}, got {r.status_code}: {r.text[:500]}"
    body = r.json()
    assert body.get("type") == "error", body
    err = body.get("error")
    assert isinstance(err, dict) and isinstance(err.get("type"), str) and isinstance(err.get("message"), str), body
    for m in mentions:
        assert m in json.dumps(body), f"error body does not mention {m!r}: {body}"
    return err


# ----------------------------------------------------------------------------------------------- SSE


def sse_data_lines(lines) -> list[str]:
    """The payloads of `data:` lines, in order, from an iterable of text lines (blank lines and comments skipped)."""
    out = []
    for line in lines:
        if not line or line.startswith(":"):
            continue
        if line.startswith("data:"):
            out.append(line[5:].lstrip(" "))
    return out


def stream_openai(c: httpx.Client, path: str, body: dict) -> tuple[list[dict], bool]:
    """POST a streaming request; returns (the JSON chunks, whether `data: [DONE]` ended the stream)."""
    chunks: list[dict] = []
    done = False
    with c.stream("POST", path, json=body) as r:
        assert r.status_code == 200, f"{r.status_code}: {r.read()[:500]!r}"
        ctype = r.headers.get("content-type", "")
        assert ctype.startswith("text/event-stream"), ctype
        for payload in sse_data_lines(r.iter_lines()):
            assert not done, f"data after [DONE]: {payload!r}"
            if payload == "[DONE]":
                done = True
                continue
            chunks.append(json.loads(payload))
    return chunks, done


def stream_anthropic(c: httpx.Client, body: dict) -> list[tuple[str, dict]]:
    """POST /v1/messages with stream=true; returns [(event name, data)], checking event: and data.type agree."""
    events: list[tuple[str, dict]] = []
    with c.stream("POST", "/v1/messages", json=body) as r:
        assert r.status_code == 200, f"{r.status_code}: {r.read()[:500]!r}"
        assert r.headers.get("content-type", "").startswith("text/event-stream")
        name = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data = json.loads(line[5:].strip())
                assert name is None or name == data.get("type"), (name, data)
                events.append((data.get("type"), data))
                name = None
    return events


def join_chat_stream(chunks: list[dict]) -> dict:
    """Fold chat.completion.chunk objects into {content, reasoning, finish_reason, usage, tool_calls, role}."""
    content, reasoning, finish, usage, role = [], [], None, None, None
    tool_calls: dict[int, dict] = {}
    for ch in chunks:
        if ch.get("usage"):
            usage = ch["usage"]
        for choice in ch.get("choices", []):
            d = choice.get("delta") or {}
            if d.get("role"):
                role = role or d["role"]
            if d.get("content"):
                content.append(d["content"])
            if d.get("reasoning_content"):
                reasoning.append(d["reasoning_content"])
            for tc in d.get("tool_calls") or []:
                slot = tool_calls.setdefault(tc["index"], {"id": None, "name": "", "arguments": ""})
                slot["id"] = tc.get("id") or slot["id"]
                fn = tc.get("function") or {}
                slot["name"] += fn.get("name") or ""
                slot["arguments"] += fn.get("arguments") or ""
            if choice.get("finish_reason"):
                finish = choice["finish_reason"]
    return {"content": "".join(content), "reasoning": "".join(reasoning), "finish_reason": finish, "usage": usage,
            "tool_calls": tool_calls, "role": role}


# ------------------------------------------------------------------------------------------- metrics


_METRIC_LINE = re.compile(r"^([A-Za-z_:][A-Za-z0-9_:]*(?:\{.*\})?)\s+(\S+)(?:\s+\S+)?$")


def metrics(base: str) -> dict[str, float]:
    """GET /metrics (no key) → {'name{labels}': value} plus per-name sums under the bare name."""
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200, r.text[:300]
    out: dict[str, float] = {}
    sums: dict[str, float] = {}
    for line in r.text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _METRIC_LINE.match(line)
        assert m, f"unparseable metrics line: {line!r}"
        key, v = m.group(1), float(m.group(2))
        out[key] = v
        name = key.split("{", 1)[0]
        sums[name] = sums.get(name, 0.0) + v
    for k, v in sums.items():
        out.setdefault(k, v)
    return out


def wait_until(pred, timeout: float, interval: float = 0.1):
    """Poll pred() until truthy or timeout; returns the last value."""
    deadline = time.monotonic() + timeout
    v = pred()
    while not v and time.monotonic() < deadline:
        time.sleep(interval)
        v = pred()
    return v


def pick_stop(text: str, min_prefix: int = 2) -> str | None:
    """A short substring from the middle of `text` whose first occurrence leaves a non-trivial prefix."""
    n = len(text)
    for length in (4, 3, 5, 2, 6):
        for start in list(range(n // 2, n - length)) + list(range(min_prefix, n // 2)):
            sub = text[start:start + length]
            if len(sub) < length or "\ufffd" in sub or not sub.strip():
                continue
            if text.find(sub) >= min_prefix:
                return sub
    return None


def synth_cpu_server(tmp_path_factory, tag: str, synth_args: list[str], served_name: str):
    """Generator for a module fixture: `deltaserve synth {synth_args}` into a fresh directory, then a
    `serve --device cpu` of it served as `served_name`; yields (server, synth stderr) and stops it at teardown."""
    d = tmp_path_factory.mktemp(tag)
    model = d / "model"
    r = subprocess.run([str(server_binary()), "synth", *synth_args, "--out", str(model)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    srv = Server(args=["--model", str(model), "--device", "cpu", "--api-key", API_KEY, "--served-model-name",
                       served_name], log_path=d / "server.log")
    srv.start()
    yield srv, r.stderr
    code = srv.interrupt(SHUTDOWN_TIMEOUT)
    srv.kill()
    assert code == 0, srv.log_tail()


def greedy_chat_twice(srv: Server, served_name: str, content: str) -> dict:
    """Posts one greedy 12-token chat request twice; asserts both succeed with the same text; returns the first."""
    c = httpx.Client(base_url=srv.base, headers=OPENAI_HEADERS, timeout=REQUEST_TIMEOUT)
    body = {"model": served_name, "messages": [{"role": "user", "content": content}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    a = c.post("/v1/chat/completions", json=body)
    assert a.status_code == 200, a.text
    b = c.post("/v1/chat/completions", json=body)
    assert b.status_code == 200, b.text
    ja, jb = a.json(), b.json()
    assert ja["usage"]["completion_tokens"] == 12
    msg = lambda j: (j["choices"][0]["message"].get("content") or "") + (j["choices"][0]["message"].get("reasoning_content") or "")
    assert msg(ja) == msg(jb), "greedy output differs between two identical requests"
    return ja
