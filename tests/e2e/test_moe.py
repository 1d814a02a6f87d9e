"""A mixture-of-experts model served end to end on the CPU: `deltaserve synth --preset tiny-moe` writes a
`qwen3_5_moe` checkpoint (8 experts, top 2, a gated shared expert, one tensor per expert), `serve --device cpu`
loads it, and the API answers; greedy output is deterministic across two identical requests."""

import subprocess

import pytest

import util


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    d = tmp_path_factory.mktemp("moe")
    model = d / "model"
    r = subprocess.run([str(util.server_binary()), "synth", "--preset", "tiny-moe", "--out", str(model)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    srv = util.Server(args=["--model", str(model), "--device", "cpu", "--api-key", util.API_KEY,
                            "--served-model-name", "moe"], log_path=d / "server.log")
    srv.start()
    yield srv
    code = srv.interrupt(util.SHUTDOWN_TIMEOUT)
    srv.kill()
    assert code == 0, srv.log_tail()


def test_moe_model_serves_deterministically(moe_server):
    import httpx
    c = httpx.Client(base_url=moe_server.base, headers=util.OPENAI_HEADERS, timeout=60.0)
    body = {"model": "moe", "messages": [{"role": "user", "content": "Route this."}], "max_tokens": 12,
            "temperature": 0, "ignore_eos": True}
    a = c.post("/v1/chat/completions", json=body)
    assert a.status_code == 200, a.text
    b = c.post("/v1/chat/completions", json=body)
    assert b.status_code == 200, b.text
    ja, jb = a.json(), b.json()
    assert ja["usage"]["completion_tokens"] == 12
    msg = lambda j: (j["choices"][0]["message"].get("content") or "") + (j["choices"][0]["message"].get("reasoning_content") or "")
    assert msg(ja) == msg(jb)
