"""A mixture-of-experts model served end to end on the CPU: `deltaserve synth --preset tiny-moe` writes a
`qwen3_5_moe` checkpoint (8 experts, top 2, a gated shared expert, one tensor per expert), `serve --device cpu`
loads it, and the API answers; greedy output is deterministic across two identical requests."""

import pytest

import util


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    for srv, _ in util.synth_cpu_server(tmp_path_factory, "moe", ["--preset", "tiny-moe"], "moe"):
        yield srv


def test_moe_model_serves_deterministically(moe_server):
    util.greedy_chat_twice(moe_server, "moe", "Route this.")
