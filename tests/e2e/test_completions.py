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


def test_echo_scores_the_prompt(http):
    """echo + logprobs, what evaluation harnesses send: the prompt's tokens come first (the first has no score),
    then the completion, which echo does not change; max_tokens 0 scores the prompt alone, the same way."""
    n = len(TOKEN_IDS)
    gen = post(http, prompt=TOKEN_IDS, max_tokens=4, logprobs=1, **util.greedy())["choices"][0]
    ch = post(http, prompt=TOKEN_IDS, max_tokens=4, echo=True, logprobs=2, **util.greedy())["choices"][0]
    lp = ch["logprobs"]
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == n + 4
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    prompt_text = "".join(lp["tokens"][:n])
    assert ch["text"] == prompt_text + gen["text"]
    assert lp["tokens"][n:] == gen["logprobs"]["tokens"]
    assert lp["token_logprobs"][n:] == pytest.approx(gen["logprobs"]["token_logprobs"], abs=1e-5)
    for value, top in zip(lp["token_logprobs"][1:], lp["top_logprobs"][1:]):
        # (alternatives are keyed by their text: two byte tokens that both decode to U+FFFD make one key)
        assert value <= 0 and 1 <= len(top) <= 2 and max(top.values()) >= value - 1e-6
    assert lp["text_offset"] == sorted(lp["text_offset"]) and lp["text_offset"][0] == 0
    only = post(http, prompt=TOKEN_IDS, max_tokens=0, echo=True, logprobs=2)
    och = only["choices"][0]
    assert och["text"] == prompt_text and och["finish_reason"] == "length"
    assert only["usage"]["completion_tokens"] == 0 and only["usage"]["prompt_tokens"] == n
    assert och["logprobs"]["tokens"] == lp["tokens"][:n]
    assert och["logprobs"]["token_logprobs"][1:] == pytest.approx(lp["token_logprobs"][1:n], abs=1e-5)
    # A text prompt is echoed as sent.
    text = post(http, prompt="Once upon a time", max_tokens=2, echo=True, **util.greedy())["choices"][0]["text"]
    assert text.startswith("Once upon a time") and len(text) > len("Once upon a time")


def test_prompt_logprobs_in_vllm_shape(http):
    """vLLM's `prompt_logprobs`: null for the first prompt token, then each token keyed by its id with its
    rank and the most likely alternatives; the same scores echo gives; in a stream, with the first chunk."""
    n = len(TOKEN_IDS)
    ref = post(http, prompt=TOKEN_IDS, max_tokens=0, echo=True, logprobs=1)["choices"][0]["logprobs"]
    ch = post(http, prompt=TOKEN_IDS, max_tokens=2, prompt_logprobs=3, **util.greedy())["choices"][0]
    pl = ch["prompt_logprobs"]
    assert len(pl) == n and pl[0] is None
    for i, entry in enumerate(pl[1:], start=1):
        mine = entry[str(TOKEN_IDS[i])]
        assert mine["logprob"] == pytest.approx(ref["token_logprobs"][i], abs=1e-5)
        ranks = sorted(e["rank"] for e in entry.values())
        assert mine["rank"] >= 1 and 3 <= len(entry) <= 4 and ranks[:3] == [1, 2, 3], entry
        best = max(e["logprob"] for e in entry.values())
        assert all(e["logprob"] <= best for e in entry.values()) and isinstance(mine["decoded_token"], str)
    chunks, done = util.stream_openai(http, COMPL, body(prompt=TOKEN_IDS, stream=True, max_tokens=3, echo=True,
                                                        prompt_logprobs=1, **util.greedy()))
    assert done
    texts = [c["choices"][0]["text"] for c in chunks if c["choices"]]
    assert texts[0] == "".join(ref["tokens"]), "the echoed prompt comes first"
    scored = [c["choices"][0]["prompt_logprobs"] for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(scored) == 1 and len(scored[0]) == n and scored[0][0] is None
    r = http.post(COMPL, json=body(prompt=TOKEN_IDS, prompt_logprobs=21))
    assert r.status_code == 400 and "prompt_logprobs" in r.text


def test_stream_logprobs_add_up(http):
    """Streamed logprobs add up to the whole reply's: each token's with the chunk that carries it, and with echo the
    prompt's part in the echoed chunk (text offsets running on over the chunks)."""
    keys = ("tokens", "token_logprobs", "top_logprobs", "text_offset")
    for echo in (False, True):
        kw = dict(prompt=TOKEN_IDS, max_tokens=6, echo=echo, logprobs=2, **util.greedy())
        ref = post(http, **kw)["choices"][0]["logprobs"]
        chunks, done = util.stream_openai(http, COMPL, body(stream=True, **kw))
        assert done
        parts = [c["choices"][0]["logprobs"] for c in chunks if c["choices"] and c["choices"][0]["logprobs"]]
        got = {k: sum((p[k] for p in parts), []) for k in keys}
        assert got["tokens"] == ref["tokens"] and got["text_offset"] == ref["text_offset"]
        assert got["top_logprobs"] == ref["top_logprobs"] or len(got["top_logprobs"]) == len(ref["top_logprobs"])
        nums = lambda xs: [x for x in xs if x is not None]  # noqa: E731
        assert nums(got["token_logprobs"]) == pytest.approx(nums(ref["token_logprobs"]), abs=1e-5)
        assert (got["token_logprobs"][0] is None) == echo
    r = http.post(COMPL, json=body(stream=True, echo=True, logprobs=1, n=2))
    assert r.status_code == 400 and "`n`" in r.text


def test_prompt_batch(http):
    """A list of prompts, as batched clients send them: choice i * n + j continues prompt i like a request of its
    own; usage counts each prompt once; echo and scores follow each prompt (lm-eval's batched loglikelihood)."""
    a = post(http, prompt="Once upon a time", max_tokens=6, **util.greedy())
    b = post(http, prompt=TOKEN_IDS, max_tokens=6, **util.greedy())
    both = post(http, prompt=["Once upon a time", TOKEN_IDS], max_tokens=6, n=2, **util.greedy())
    texts = [c["text"] for c in sorted(both["choices"], key=lambda c: c["index"])]
    want = [a["choices"][0]["text"]] * 2 + [b["choices"][0]["text"]] * 2
    assert texts == want
    u = both["usage"]
    assert u["prompt_tokens"] == a["usage"]["prompt_tokens"] + b["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 24 and u["total_tokens"] == u["prompt_tokens"] + 24
    shorter = TOKEN_IDS[:5]
    scored = post(http, prompt=[TOKEN_IDS, shorter], max_tokens=1, echo=True, logprobs=1, temperature=0)
    lens = [len(c["logprobs"]["token_logprobs"]) for c in sorted(scored["choices"], key=lambda c: c["index"])]
    assert lens == [len(TOKEN_IDS) + 1, len(shorter) + 1]
    alone = post(http, prompt=shorter, max_tokens=1, echo=True, logprobs=1, temperature=0)["choices"][0]
    assert scored["choices"][1]["logprobs"]["token_logprobs"][1:] == \
        pytest.approx(alone["logprobs"]["token_logprobs"][1:], abs=1e-5)
    r = http.post(COMPL, json=body(prompt=["fine", [1, -2]]))
    assert r.status_code == 400 and "prompt[1]" in r.text


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


A, B = 65, 66  # two ids of the demo vocabulary's byte tokens


def detok(http, ids):
    r = http.post("/detokenize", json={"model": util.MODEL, "tokens": ids})
    assert r.status_code == 200, r.text
    return r.json()["prompt"]


def test_logit_bias_lifts_and_bans_tokens(http):
    a, b = detok(http, [A]), detok(http, [B])
    forced = post(http, max_tokens=6, logit_bias={str(A): 100, str(B): 90}, **util.greedy())["choices"][0]
    assert forced["text"] == a * 6, forced
    # llama.cpp's list form, with `false` banning an id: "B" then comes out.
    banned = post(http, max_tokens=6, logit_bias=[[A, False], [B, 90]], **util.greedy())["choices"][0]
    assert banned["text"] == b * 6, banned
    full = post(http, max_tokens=8, **util.greedy())["choices"][0]["text"]
    assert post(http, max_tokens=8, logit_bias={}, **util.greedy())["choices"][0]["text"] == full


def test_stop_token_ids_and_min_tokens(http):
    a = detok(http, [A])
    # The forced token is a stop id: the reply ends at once, with its text (a stop id that is not a special
    # token stays in the output, as in vLLM).
    kw = dict(logit_bias={str(A): 100}, stop_token_ids=[A], **util.greedy())
    one = post(http, max_tokens=8, **kw)
    assert (one["choices"][0]["text"], one["choices"][0]["finish_reason"]) == (a, "stop"), one
    assert one["usage"]["completion_tokens"] == 1
    # min_tokens bans the stop ids (the +100 bias notwithstanding) until 3 tokens are out: the 4th is it.
    four = post(http, max_tokens=8, min_tokens=3, logprobs=0, **kw)
    assert four["choices"][0]["finish_reason"] == "stop" and four["usage"]["completion_tokens"] == 4, four
    assert a not in four["choices"][0]["logprobs"]["tokens"][:3]
    # Nor does a stop string end the reply before min_tokens.
    full = post(http, max_tokens=40, **util.greedy())["choices"][0]["text"]
    stop = util.pick_stop(full)
    held = post(http, max_tokens=40, stop=[stop], min_tokens=40, **util.greedy())["choices"][0]
    assert (held["text"], held["finish_reason"]) == (full, "length")
    # The chat endpoint takes the same fields.
    chat = http.post("/v1/chat/completions", json={
        "model": util.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, **kw, **util.no_think()})
    assert chat.status_code == 200, chat.text
    assert chat.json()["choices"][0]["finish_reason"] == "stop" and chat.json()["usage"]["completion_tokens"] == 1



def test_allowed_token_ids_and_stop_string_kept(http):
    a, b = detok(http, [A]), detok(http, [B])
    for kw in (util.greedy(), dict(temperature=1.0, seed=5, ignore_eos=True)):
        r = post(http, max_tokens=12, allowed_token_ids=[A, B], logprobs=0, **kw)["choices"][0]
        assert set(r["logprobs"]["tokens"]) <= {a, b} and len(r["logprobs"]["tokens"]) == 12, r
    full = post(http, max_tokens=40, **util.greedy())["choices"][0]["text"]
    stop = util.pick_stop(full)
    kept = post(http, max_tokens=40, stop=[stop], include_stop_str_in_output=True, **util.greedy())["choices"][0]
    assert (kept["text"], kept["finish_reason"]) == (full[:full.find(stop)] + stop, "stop")

@pytest.mark.parametrize("extra,param", [
    ({"logit_bias": {"65": 101}}, "logit_bias"),
    ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {"10000000": 1}}, "logit_bias"),
    ({"logit_bias": [[65]]}, "logit_bias"),
    ({"logit_bias": "65"}, "logit_bias"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"min_tokens": 9}, "min_tokens"),
    ({"min_tokens": 2, "guided_choice": ["yes", "no"]}, "min_tokens"),
    ({"allowed_token_ids": []}, "allowed_token_ids"),
    ({"allowed_token_ids": [1, 10000000]}, "allowed_token_ids"),
    ({"allowed_token_ids": [65], "guided_choice": ["yes", "no"]}, "allowed_token_ids"),
])
def test_bad_token_rule_fields(http, extra, param):
    util.assert_openai_error(http.post(COMPL, json=body(**extra)), 400, param)
