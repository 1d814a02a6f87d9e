"""POST /v1/completions (legacy text completions)."""

import pytest

import util

COMPL = "/v1/completions"
TOKEN_IDS = [72, 101, 108, 108, 111, 32, 119, 111, 114, 108, 100]  # byte-level ids, inside the demo vocab


def body(prompt="Once upon a time", **kw):
    b = {"model": util.MODEL, "prompt": prompt, "max_tokens": 8}
    b.update(kw)
    return b


def post(http, **kw):
    r = http.post(COMPL, json=body(**kw))
    assert r.status_code == 200, f"{r.status_code}: {r.text[:800]}"
    return r.json()


def check_shape(resp, max_tokens=None):
    assert resp["id"].startswith("cmpl-"), resp["id"]
    assert resp["object"] == "text_completion"
    assert resp["model"] == util.MODEL
    assert isinstance(resp["created"], int)
    assert len(resp["choices"]) == 1
    ch = resp["choices"][0]
    assert ch["index"] == 0
    assert isinstance(ch["text"], str)
    assert ch["finish_reason"] in ("stop", "length")
    u = resp["usage"]
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    if max_tokens is not None:
        assert u["completion_tokens"] <= max_tokens
    return ch


def test_basic(http):
    check_shape(post(http), 8)


def test_length(http):
    resp = post(http, max_tokens=5, **util.greedy())
    assert check_shape(resp)["finish_reason"] == "length"
    assert resp["usage"]["completion_tokens"] == 5


def test_token_id_prompt(http):
    resp = post(http, prompt=TOKEN_IDS, max_tokens=4, **util.greedy())
    check_shape(resp, 4)
    assert resp["usage"]["prompt_tokens"] == len(TOKEN_IDS)


def test_greedy_deterministic_and_echo_false(http):
    a = post(http, max_tokens=16, echo=False, **util.greedy())
    b = post(http, max_tokens=16, **util.greedy())
    assert a["choices"][0]["text"] == b["choices"][0]["text"]
    assert not a["choices"][0]["text"].startswith("Once upon a time")


def test_seeded(http):
    kw = dict(max_tokens=32, temperature=1.0, ignore_eos=True)
    a = post(http, seed=11, **kw)["choices"][0]["text"]
    b = post(http, seed=11, **kw)["choices"][0]["text"]
    c = post(http, seed=12, **kw)["choices"][0]["text"]
    assert a == b
    assert a != c


def test_stream_matches(http):
    ref = post(http, max_tokens=20, **util.greedy())
    chunks, done = util.stream_openai(http, COMPL, body(stream=True, max_tokens=20,
                                                        stream_options={"include_usage": True}, **util.greedy()))
    assert done
    assert all(c["object"] == "text_completion" for c in chunks)
    assert len({c["id"] for c in chunks}) == 1
    text = "".join(ch["text"] for c in chunks for ch in c["choices"])
    assert text == ref["choices"][0]["text"]
    finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"] if ch.get("finish_reason")]
    assert finishes == ["length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 20


def test_stop(http):
    full = post(http, max_tokens=40, **util.greedy())["choices"][0]["text"]
    stop = util.pick_stop(full)
    assert stop, full
    resp = post(http, max_tokens=40, stop=[stop], **util.greedy())
    assert resp["choices"][0]["text"] == full[:full.find(stop)]
    assert resp["choices"][0]["finish_reason"] == "stop"


def test_logprobs_int(http):
    resp = post(http, max_tokens=5, logprobs=3, **util.greedy())
    lp = resp["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == 5
    assert "".join(lp["tokens"]) == resp["choices"][0]["text"] or all(isinstance(t, str) for t in lp["tokens"])
    for chosen, lp_val, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"]):
        assert lp_val <= 0.0
        assert isinstance(top, dict) and 1 <= len(top) <= 3 + 1
        assert max(top.values()) == pytest.approx(lp_val, abs=1e-4)
    if "text_offset" in lp:
        assert lp["text_offset"] == sorted(lp["text_offset"])


def test_sampling_params_accepted(http):
    check_shape(post(http, max_tokens=4, temperature=0.9, top_p=0.8, top_k=5, min_p=0.1, presence_penalty=1.0,
                     frequency_penalty=-0.5, repetition_penalty=1.2, seed=1), 4)


def test_sdk(oai):
    resp = oai.completions.create(model=util.MODEL, prompt="abc", max_tokens=4, temperature=0,
                                  extra_body={"ignore_eos": True})
    assert resp.object == "text_completion"
    assert resp.usage.completion_tokens == 4
    stream = oai.completions.create(model=util.MODEL, prompt="abc", max_tokens=4, temperature=0, stream=True,
                                    extra_body={"ignore_eos": True})
    assert "".join(c.choices[0].text for c in stream if c.choices) == resp.choices[0].text


def test_n_choices(http):
    kw = dict(max_tokens=10, temperature=1.0, seed=3, ignore_eos=True)
    resp = post(http, n=3, **kw)
    texts = [c["text"] for c in resp["choices"]]
    assert [c["index"] for c in resp["choices"]] == [0, 1, 2]
    assert texts[0] == post(http, **kw)["choices"][0]["text"]
    assert post(http, n=3, **kw)["choices"] == resp["choices"], "reproducible with a seed"
    single = post(http, **kw)["usage"]
    assert resp["usage"]["prompt_tokens"] == single["prompt_tokens"]
    assert resp["usage"]["completion_tokens"] == 30
    chunks, done = util.stream_openai(http, COMPL, body(n=3, stream=True, **kw))
    assert done
    streamed = ["".join(ch["text"] for c in chunks for ch in c["choices"] if ch["index"] == i) for i in range(3)]
    assert streamed == texts


def test_n_too_large_and_best_of_rejected(http):
    util.assert_openai_error(http.post(COMPL, json=body(n=9)), 400, "n")
    util.assert_openai_error(http.post(COMPL, json=body(n=2, best_of=3)), 400, "best_of")


def test_missing_prompt(http):
    util.assert_openai_error(http.post(COMPL, json={"model": util.MODEL, "max_tokens": 4}), 400)


def test_out_of_vocab_token_id(http):
    util.assert_openai_error(http.post(COMPL, json=body(prompt=[1, 2, 10_000_000])), 400)
