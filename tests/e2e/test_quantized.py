"""A GPTQ checkpoint served end to end: `deltaserve synth --gptq` writes the tiny model's decoder linears in
the real GPTQ layout (asymmetric, act-order), `serve --model` loads it (the CPU engine dequantises it), and the
API answers; greedy output is deterministic across two identical requests."""

import httpx
import pytest

import util


@pytest.fixture(scope="module")
def gptq_server(tmp_path_factory):
    for srv, stderr in util.synth_cpu_server(tmp_path_factory, "gptq", ["--preset", "tiny", "--gptq", "asym-act-order"],
                                             "gptq"):
        assert "packed" in stderr and "GPTQ" in stderr, stderr
        yield srv


def test_gptq_checkpoint_serves(gptq_server):
    util.greedy_chat_twice(gptq_server, "gptq", "Say something.")
    c = httpx.Client(base_url=gptq_server.base, headers=util.OPENAI_HEADERS, timeout=60.0)
    models = c.get("/v1/models").json()
    assert [m["id"] for m in models["data"]] == ["gptq"]
