"""What a request cost, in llama.cpp's server fields: `timings` on every OpenAI response (on the finish
chunk of a stream) and `prompt_progress` chunks while a streamed prompt runs (`return_progress`)."""

import pytest

import util

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def long_prompt(tag: str) -> str:
    """About 1,200 prompt tokens (several 256-token steps on the main server), starting with `tag` so that
    no other test's prompt is its cached prefix."""
    return f"[{tag}] " + "Agents read long files, run the tests and read the logs before they answer. " * 80


def check_timings(t: dict, usage: dict):
    """The timings agree with the usage and with themselves."""
    n, cached = usage["prompt_tokens"], usage["prompt_tokens_details"]["cached_tokens"]
    assert t["cache_n"] == cached, (t, usage)
    assert t["prompt_n"] == n - cached, (t, usage)
    assert t["predicted_n"] == usage["completion_tokens"], (t, usage)
    assert t["prompt_ms"] > 0 and t["predicted_ms"] >= 0 and t["queue_ms"] >= 0, t
    # The engine steps that ran the prompt lie within its time.
    assert t["prefill_steps"] >= 1, t
    assert 0 < t["prefill_step_ms"] <= t["prompt_ms"] + 1e-6, t
    if t["prompt_n"] > 0:
        assert t["prompt_per_token_ms"] == pytest.approx(t["prompt_ms"] / t["prompt_n"])
        assert t["prompt_per_second"] == pytest.approx(t["prompt_n"] * 1e3 / t["prompt_ms"])
    if t["predicted_n"] > 1 and t["predicted_ms"] > 0:
        assert t["predicted_per_second"] == pytest.approx((t["predicted_n"] - 1) * 1e3 / t["predicted_ms"])
    assert "draft_n" not in t, "no speculative decoding on this server"


def test_chat_response_has_timings(http):
    r = http.post(CHAT, json=util.chat_body(content=long_prompt("chat timings"), max_tokens=6, **util.greedy()))
    assert r.status_code == 200, r.text[:500]
    b = r.json()
    check_timings(b["timings"], b["usage"])
    assert b["timings"]["prefill_steps"] >= 2 or b["timings"]["cache_n"] > 0, b["timings"]


def test_completion_response_has_timings(http):
    body = {"model": util.MODEL, "prompt": "Once upon a time", "max_tokens": 5, "temperature": 0, "ignore_eos": True}
    r = http.post(COMPLETIONS, json=body)
    assert r.status_code == 200, r.text[:500]
    b = r.json()
    check_timings(b["timings"], b["usage"])
    assert b["timings"]["predicted_n"] == 5


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_stream_finish_chunk_has_timings(http, path):
    if path == CHAT:
        body = util.chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=7, **util.greedy())
    else:
        body = {"model": util.MODEL, "prompt": "Hello", "max_tokens": 7, "temperature": 0, "ignore_eos": True,
                "stream": True, "stream_options": {"include_usage": True}}
    chunks, done = util.stream_openai(http, path, body)
    assert done
    finals = [c for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(finals) == 1
    assert [c for c in chunks if "timings" in c] == finals, "only the finish chunk carries timings"
    check_timings(finals[0]["timings"], chunks[-1]["usage"])


@pytest.mark.parametrize("path", [CHAT, COMPLETIONS])
def test_return_progress_reports_the_prompt_before_the_first_token(http, path):
    if path == CHAT:
        body = util.chat_body(content=long_prompt("chat progress"), stream=True, max_tokens=4, **util.greedy())
    else:
        body = {"model": util.MODEL, "prompt": long_prompt("completion progress"), "max_tokens": 4,
                "temperature": 0, "stream": True}
    chunks, done = util.stream_openai(http, path, {**body, "return_progress": True,
                                                   "stream_options": {"include_usage": True}})
    assert done
    usage = chunks[-1]["usage"]
    progress = [(i, c["prompt_progress"]) for i, c in enumerate(chunks) if "prompt_progress" in c]
    assert len(progress) >= 2, "a prompt of several steps reports each"
    first_text = next(i for i, c in enumerate(chunks)
                      if c["choices"] and (c["choices"][0].get("text") or (c["choices"][0].get("delta") or {}).get(
                          "content")))
    assert all(i < first_text for i, _ in progress), "progress comes before the first token"
    assert all(chunks[i]["choices"] == [] for i, _ in progress)
    seen = [p["processed"] for _, p in progress]
    assert seen == sorted(set(seen)), seen
    assert all(p["total"] == usage["prompt_tokens"] for _, p in progress)
    assert all(p["cache"] == usage["prompt_tokens_details"]["cached_tokens"] for _, p in progress)
    assert seen[-1] == usage["prompt_tokens"]
    times = [p["time_ms"] for _, p in progress]
    assert times == sorted(times) and times[0] >= 0


def test_no_progress_unless_asked(http):
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(content=long_prompt("no progress"), stream=True, max_tokens=2))
    assert done and not [c for c in chunks if "prompt_progress" in c]
    # Not streamed: return_progress has nothing to report on and changes nothing.
    r = http.post(CHAT, json=util.chat_body(max_tokens=2, return_progress=True))
    assert r.status_code == 200 and "prompt_progress" not in r.json()


def test_sdk_reads_progress_chunks(oai):
    """The OpenAI SDK takes the progress chunks (no choices, an extra field) in its stride."""
    stream = oai.chat.completions.create(model=util.MODEL, messages=[{"role": "user", "content": long_prompt("sdk progress")}],
                                         max_tokens=3, temperature=0, stream=True,
                                         extra_body={"return_progress": True, "ignore_eos": True})
    progress, parts = 0, 0
    for chunk in stream:
        extra = chunk.model_extra or {}
        if "prompt_progress" in extra:
            progress += 1
            assert not chunk.choices
        parts += sum(1 for ch in chunk.choices if ch.delta.content)
    assert progress >= 2 and parts >= 1
