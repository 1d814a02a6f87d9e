"""A GPTQ checkpoint served end to end: `deltaserve synth --gptq` writes the tiny model's decoder linears in
the real GPTQ layout (asymmetric, act-order), `serve --model` loads it (the CPU engine dequantises it), and the
API answers; greedy output is deterministic across two identical requests."""

import subprocess

import pytest

import util


@pytest.fixture(scope="module")
def gptq_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("gptq")
    model = d / "model"
    r = subprocess.run([str(util.server_binary()), "synth", "--preset", "tiny", "--out", str(model), "--gptq",
                        "asym-act-order"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "packed" in r.stderr and "GPTQ" in r.stderr, r.stderr
    srv = util.Server(args=["--model", str(model), "--device", "cpu", "--api-key", util.API_KEY,
                            "--served-model-name", "gptq"], log_path=d / "server.log")
    srv.start()
    yield srv
    code = srv.interrupt(util.SHUTDOWN_TIMEOUT)
    srv.kill()
    assert code == 0, srv.log_tail()


def test_gptq_checkpoint_serves(gptq_server):
    import httpx
    c = httpx.Client(base_url=gptq_server.base, headers=util.OPENAI_HEADERS, timeout=60.0)
    body = {"model": "gptq", "messages": [{"role": "user", "content": "Say something."}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    a = c.post("/v1/chat/completions", json=body)
    assert a.status_code == 200, a.text
    b = c.post("/v1/chat/completions", json=body)
    assert b.status_code == 200, b.text
    ja, jb = a.json(), b.json()
    assert ja["usage"]["completion_tokens"] == 12
    msg = lambda j: (j["choices"][0]["message"].get("content") or "") + (j["choices"][0]["message"].get("reasoning_content") or "")
    assert msg(ja) == msg(jb), "greedy output differs between two identical requests"
    models = c.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["gptq"]
