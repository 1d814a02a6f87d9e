"""POST /v1/chat/completions: response shape, sampling invariants, streaming, reasoning, stop, logprobs, tools.

The demo model emits random text, so these tests check invariants (determinism, counts, consistency between
streamed and non-streamed results), never wording.
"""

import json

import pytest

import util

CHAT = "/v1/chat/completions"


def post_chat(http, **kw):
    body = util.chat_body(**kw)
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:800]}"
    return r.json()


def check_completion_shape(resp, max_tokens=None):
    assert isinstance(resp["id"], str) and resp["id"].startswith("chatcmpl-"), resp["id"]
    assert resp["object"] == "chat.completion"
    assert resp["model"] == util.MODEL
    assert isinstance(resp["created"], int)
    assert len(resp["choices"]) == 1
    ch = resp["choices"][0]
    assert ch["index"] == 0
    msg = ch["message"]
    assert msg["role"] == "assistant"
    assert msg.get("content") is None or isinstance(msg["content"], str)
    assert "reasoning_content" in msg, msg
    assert msg["reasoning_content"] is None or isinstance(msg["reasoning_content"], str)
    assert ch["finish_reason"] in ("stop", "length", "tool_calls"), ch["finish_reason"]
    u = resp["usage"]
    assert u["prompt_tokens"] > 0
    assert u["completion_tokens"] >= 0
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    cached = u["prompt_tokens_details"]["cached_tokens"]
    assert isinstance(cached, int) and 0 <= cached <= u["prompt_tokens"]
    if max_tokens is not None:
        assert u["completion_tokens"] <= max_tokens
    return ch


def text_of(resp):
    msg = resp["choices"][0]["message"]
    return (msg.get("reasoning_content") or "", msg.get("content") or "")


def test_basic_shape(http):
    resp = post_chat(http, max_tokens=8)
    check_completion_shape(resp, 8)


def test_content_parts_and_all_roles(http):
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": " world"}]},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Again"},
    ]
    resp = post_chat(http, messages=messages, max_tokens=4)
    check_completion_shape(resp, 4)


def test_system_content_parts(http):
    messages = [{"role": "system", "content": [{"type": "text", "text": "Be brief."}]},
                {"role": "user", "content": "Hi"}]
    check_completion_shape(post_chat(http, messages=messages, max_tokens=3), 3)


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_gives_length(http, field):
    body = util.chat_body(**util.greedy())
    del body["max_tokens"]
    body[field] = 5
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text
    resp = r.json()
    ch = check_completion_shape(resp, 5)
    assert resp["usage"]["completion_tokens"] == 5
    assert ch["finish_reason"] == "length"


def test_greedy_is_deterministic(http):
    a = post_chat(http, max_tokens=24, **util.greedy())
    b = post_chat(http, max_tokens=24, **util.greedy())
    assert text_of(a) == text_of(b)
    assert a["usage"]["completion_tokens"] == b["usage"]["completion_tokens"] == 24


def test_seeded_sampling(http):
    kw = dict(max_tokens=32, temperature=1.0, ignore_eos=True, **util.no_think())
    a = post_chat(http, seed=1234, **kw)
    b = post_chat(http, seed=1234, **kw)
    c = post_chat(http, seed=98765, **kw)
    assert text_of(a) == text_of(b), "same seed, different output"
    assert text_of(a) != text_of(c), "different seeds gave identical 32-token outputs"


def test_all_sampling_params_accepted(http):
    resp = post_chat(http, max_tokens=6, temperature=0.7, top_p=0.9, top_k=20, min_p=0.05, presence_penalty=0.5,
                     frequency_penalty=0.3, repetition_penalty=1.1, seed=7, stop=["\n\n\n"], user="e2e",
                     stream=False)
    check_completion_shape(resp, 6)


def test_stream_matches_non_stream(http):
    kw = dict(max_tokens=24, **util.greedy())
    ref = post_chat(http, **kw)
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, **kw))
    assert done, "stream did not end with data: [DONE]"
    assert chunks, "no chunks"
    ids = {c["id"] for c in chunks}
    assert len(ids) == 1 and next(iter(ids)).startswith("chatcmpl-"), ids
    for c in chunks:
        assert c["object"] == "chat.completion.chunk", c
        assert c["model"] == util.MODEL
    first_delta = chunks[0]["choices"][0]["delta"]
    assert first_delta.get("role") == "assistant", chunks[0]
    joined = util.join_chat_stream(chunks)
    reasoning, content = text_of(ref)
    assert joined["reasoning"] == reasoning
    assert joined["content"] == content
    assert joined["finish_reason"] == ref["choices"][0]["finish_reason"]
    # finish_reason appears exactly once, on the last chunk that has choices.
    with_choices = [c for c in chunks if c["choices"]]
    finals = [c for c in with_choices if c["choices"][0].get("finish_reason")]
    assert len(finals) == 1 and finals[0] is with_choices[-1]


def test_stream_include_usage(http):
    body = util.chat_body(stream=True, stream_options={"include_usage": True}, max_tokens=7, **util.greedy())
    chunks, done = util.stream_openai(http, CHAT, body)
    assert done
    last = chunks[-1]
    assert last["choices"] == [], last
    u = last["usage"]
    assert u["completion_tokens"] == 7
    assert u["total_tokens"] == u["prompt_tokens"] + 7
    # Only the last chunk carries usage (vLLM sends null on the others, or omits it).
    assert all(not c.get("usage") for c in chunks[:-1])
    # The usage chunk comes after the finish_reason chunk.
    assert chunks[-2]["choices"][0]["finish_reason"] == "length"


def test_stream_without_include_usage_has_no_usage_chunk(http):
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, max_tokens=3))
    assert done
    assert all(c["choices"] for c in chunks), "an empty-choices chunk without include_usage"


def test_demo_model_answers_in_content_by_default(http):
    """Thinking is off by default for the built-in demo model: the reply is content, not reasoning."""
    msg = post_chat(http, max_tokens=12, **util.greedy())["choices"][0]["message"]
    assert msg["content"] and not msg["reasoning_content"], msg


def test_reasoning_split_thinking_on(http):
    """Thinking on: the demo model starts inside <think>; fields are split consistently, per field."""
    kw = dict(max_tokens=40, **util.greedy(), chat_template_kwargs={"enable_thinking": True})
    ref = post_chat(http, **kw)
    reasoning, content = text_of(ref)
    assert reasoning or content
    assert "<think>" not in content and "</think>" not in content
    assert "</think>" not in reasoning
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, **kw))
    assert done
    j = util.join_chat_stream(chunks)
    assert (j["reasoning"], j["content"]) == (reasoning, content)


def test_enable_thinking_false_has_no_reasoning(http):
    kw = dict(max_tokens=24, **util.greedy(), **util.no_think())
    resp = post_chat(http, **kw)
    msg = resp["choices"][0]["message"]
    assert not msg.get("reasoning_content"), msg
    assert msg["content"], msg
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, **kw))
    assert done
    j = util.join_chat_stream(chunks)
    assert j["reasoning"] == ""
    assert j["content"] == msg["content"]


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("as_list", [False, True], ids=["str", "list"])
def test_stop_string(http, stream, as_list):
    kw = dict(max_tokens=40, **util.greedy(), **util.no_think())
    full = post_chat(http, **kw)["choices"][0]["message"]["content"]
    stop = util.pick_stop(full)
    assert stop is not None, f"no usable stop string in {full!r}"
    prefix = full[:full.find(stop)]
    stop_param = [stop, "\x00never\x00"] if as_list else stop
    if stream:
        chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, stop=stop_param, **kw))
        assert done
        j = util.join_chat_stream(chunks)
        got, finish = j["content"], j["finish_reason"]
    else:
        resp = post_chat(http, stop=stop_param, **kw)
        got, finish = resp["choices"][0]["message"]["content"] or "", resp["choices"][0]["finish_reason"]
    assert got == prefix, f"stop={stop!r} full={full!r}"
    assert finish == "stop"


def test_logprobs(http):
    resp = post_chat(http, max_tokens=6, logprobs=True, top_logprobs=3, **util.greedy())
    lp = resp["choices"][0]["logprobs"]
    content = lp["content"]
    assert len(content) == resp["usage"]["completion_tokens"] == 6
    for entry in content:
        assert isinstance(entry["token"], str)
        assert entry["logprob"] <= 0.0
        tops = entry["top_logprobs"]
        assert len(tops) == 3, entry
        vals = [t["logprob"] for t in tops]
        assert vals == sorted(vals, reverse=True), vals
        assert all(v <= 0.0 for v in vals)
        # Greedy: the chosen token is the most likely one.
        assert abs(entry["logprob"] - tops[0]["logprob"]) < 1e-4, entry
        assert entry["token"] == tops[0]["token"] or abs(tops[0]["logprob"] - tops[1]["logprob"]) < 1e-4, entry
        if "bytes" in entry and entry["bytes"] is not None:
            assert all(isinstance(b, int) and 0 <= b < 256 for b in entry["bytes"])


def test_logprobs_stream(http):
    body = util.chat_body(stream=True, max_tokens=5, logprobs=True, top_logprobs=2, **util.greedy())
    chunks, done = util.stream_openai(http, CHAT, body)
    assert done
    entries = [e for c in chunks for ch in c["choices"] if ch.get("logprobs") for e in ch["logprobs"]["content"]]
    assert len(entries) == 5, entries
    assert all(len(e["top_logprobs"]) == 2 for e in entries)


def test_no_logprobs_by_default(http):
    resp = post_chat(http, max_tokens=3)
    assert resp["choices"][0].get("logprobs") is None


TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather",
        "description": "Get the weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string", "description": "City name"},
            "days": {"type": "integer", "minimum": 1},
            "options": {"type": "object", "properties": {"unit": {"type": "string", "enum": ["c", "f"]}}},
        }, "required": ["city"]},
    }},
    {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}},
]


def check_tool_calls_well_formed(msg):
    for tc in msg.get("tool_calls") or []:
        assert isinstance(tc["id"], str) and tc["id"]
        assert tc["type"] == "function"
        assert tc["function"]["name"] in ("get_weather", "noop")
        json.loads(tc["function"]["arguments"])


@pytest.mark.parametrize("tool_choice", [None, "auto", "none"])
def test_tools_accepted(http, tool_choice):
    kw = {"tools": TOOLS}
    if tool_choice:
        kw["tool_choice"] = tool_choice
    resp = post_chat(http, content="What's the weather in Paris?", max_tokens=12, **kw)
    ch = check_completion_shape(resp, 12)
    check_tool_calls_well_formed(ch["message"])
    if ch["finish_reason"] == "tool_calls":
        assert ch["message"]["tool_calls"]
    if tool_choice == "none":
        assert not ch["message"].get("tool_calls")


def test_tools_stream_accepted(http):
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, tools=TOOLS, max_tokens=12))
    assert done
    j = util.join_chat_stream(chunks)
    assert j["finish_reason"] in ("stop", "length", "tool_calls")
    for tc in j["tool_calls"].values():
        assert tc["id"] and tc["name"] in ("get_weather", "noop")
        json.loads(tc["arguments"])


def test_tool_call_history_accepted(http):
    messages = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function",
             "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\", \"days\": 1}"}},
            {"id": "call_2", "type": "function", "function": {"name": "noop", "arguments": "{}"}},
        ]},
        {"role": "tool", "tool_call_id": "call_1", "content": "{\"temp\": 21}"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "ok"}]},
    ]
    resp = post_chat(http, messages=messages, tools=TOOLS, max_tokens=8)
    check_tool_calls_well_formed(check_completion_shape(resp, 8)["message"])


def test_tool_call_history_with_sdk(oai):
    resp = oai.chat.completions.create(
        model=util.MODEL, max_tokens=6, tools=TOOLS,
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "tool_calls": [{"id": "call_9", "type": "function",
                                                   "function": {"name": "get_weather", "arguments": "{\"x\": 1}"}}]},
            {"role": "tool", "tool_call_id": "call_9", "content": "sunny"},
        ])
    assert resp.choices[0].finish_reason in ("stop", "length", "tool_calls")


@pytest.mark.parametrize("tool_choice", ["sometimes", {"type": "function", "function": {"name": "missing"}}],
                         ids=["unknown", "named-missing"])
def test_tool_choice_unsupported(http, tool_choice):
    r = http.post(CHAT, json=util.chat_body(tools=TOOLS, tool_choice=tool_choice))
    util.assert_openai_error(r, 400, "tool_choice")


def test_n_choices_count_the_prompt_once_and_follow_their_seeds(http):
    """`n` = 3: three choices of one prompt; choice i samples with seed + i, so each equals a single request
    with that seed, and the usage counts the prompt once."""
    kw = dict(max_tokens=12, temperature=1.0, ignore_eos=True)
    resp = post_chat(http, n=3, seed=7, **kw)
    chs = resp["choices"]
    assert [c["index"] for c in chs] == [0, 1, 2]
    contents = [c["message"]["content"] for c in chs]
    singles = [post_chat(http, seed=7 + i, **kw) for i in range(3)]
    assert contents == [s["choices"][0]["message"]["content"] for s in singles]
    assert len(set(contents)) > 1, contents
    u = resp["usage"]
    assert u["prompt_tokens"] == singles[0]["usage"]["prompt_tokens"]
    assert u["completion_tokens"] == 3 * 12
    assert u["total_tokens"] == u["prompt_tokens"] + u["completion_tokens"]
    # Streamed: the same choices, each chunk tagged with its index; the usage once, after every choice.
    body = util.chat_body(n=3, seed=7, stream=True, stream_options={"include_usage": True}, **kw)
    chunks, done = util.stream_openai(http, CHAT, body)
    assert done
    by_index = {}
    for c in chunks:
        for ch in c["choices"]:
            by_index.setdefault(ch["index"], []).append({**c, "choices": [ch]})
    assert sorted(by_index) == [0, 1, 2]
    assert [util.join_chat_stream(by_index[i])["content"] for i in range(3)] == contents
    # The usage once, after every choice (its cached tokens depend on what ran before: not compared).
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert chunks[-1]["choices"] == [] and all(chunks[-1]["usage"][k] == u[k] for k in counts), chunks[-1]


@pytest.mark.parametrize("field,value", [("n", 0), ("n", 9), ("best_of", 2)])
def test_n_out_of_range_and_best_of_rejected(http, field, value):
    err = util.assert_openai_error(http.post(CHAT, json=util.chat_body(**{field: value})), 400, field)
    assert err["param"] == field, err


def test_n_one_ok(http):
    check_completion_shape(post_chat(http, n=1, max_tokens=3), 3)


def test_response_format_text_ok(http):
    check_completion_shape(post_chat(http, response_format={"type": "text"}, max_tokens=3), 3)


@pytest.mark.parametrize("fmt", [
    {"type": "xml"},
    {"type": "json_schema", "json_schema": {"name": "x"}},
], ids=["unknown", "no-schema"])
def test_response_format_unsupported_rejected(http, fmt):
    util.assert_openai_error(http.post(CHAT, json=util.chat_body(response_format=fmt)), 400, "response_format")


def test_prompt_tokens_grow_with_prompt(http):
    a = post_chat(http, content="hi", max_tokens=1)
    b = post_chat(http, content="hi " * 50, max_tokens=1)
    assert b["usage"]["prompt_tokens"] > a["usage"]["prompt_tokens"]


def test_repeated_prompt_cached_tokens_consistent(http):
    long = "The quick brown fox jumps over the lazy dog. " * 12
    a = post_chat(http, content=long, max_tokens=2, **util.greedy())
    b = post_chat(http, content=long, max_tokens=2, **util.greedy())
    assert a["usage"]["prompt_tokens"] == b["usage"]["prompt_tokens"]
    assert text_of(a) == text_of(b)
    cached = b["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert 0 <= cached < b["usage"]["prompt_tokens"]


# ------------------------------------------------------------------------------------------ OpenAI SDK


def test_sdk_chat(oai):
    resp = oai.chat.completions.create(model=util.MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert resp.object == "chat.completion"
    assert resp.id.startswith("chatcmpl-")
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 5
    assert resp.usage.prompt_tokens_details.cached_tokens >= 0


def test_sdk_chat_stream(oai):
    kw = dict(model=util.MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=10, temperature=0,
              extra_body={"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False}})
    ref = oai.chat.completions.create(**kw)
    stream = oai.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kw)
    parts, usage, finish = [], None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            if ch.delta.content:
                parts.append(ch.delta.content)
            finish = ch.finish_reason or finish
    assert "".join(parts) == ref.choices[0].message.content
    assert finish == "length"
    assert usage.completion_tokens == 10


def test_sdk_reasoning_content_attribute(oai):
    resp = oai.chat.completions.create(model=util.MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    msg = resp.choices[0].message
    reasoning = getattr(msg, "reasoning_content", None)
    assert reasoning is None or isinstance(reasoning, str)
    assert (reasoning or "") + (msg.content or "")


def test_sdk_extra_sampling_params(oai):
    resp = oai.chat.completions.create(
        model=util.MODEL, messages=[{"role": "user", "content": "Hi"}], max_completion_tokens=4, temperature=0.8,
        top_p=0.95, seed=3, presence_penalty=0.1, frequency_penalty=0.1, stop=["zzzz"],
        extra_body={"top_k": 10, "min_p": 0.01, "repetition_penalty": 1.05})
    assert resp.usage.completion_tokens <= 4


def test_prompt_logprobs(http):
    """vLLM's `prompt_logprobs` on chat: the rendered prompt's tokens scored, at the top of the response (in a
    stream, with one chunk); without it, no such field."""
    r = http.post(CHAT, json=util.chat_body(max_tokens=2, prompt_logprobs=0, **util.greedy()))
    assert r.status_code == 200, r.text
    d = r.json()
    pl = d["prompt_logprobs"]
    assert len(pl) == d["usage"]["prompt_tokens"] and pl[0] is None
    for entry in pl[1:]:
        assert len(entry) == 1, "the token itself, no alternatives"
        (tok, e), = entry.items()
        assert tok.isdigit() and e["logprob"] <= 0 and e["rank"] >= 1
    plain = http.post(CHAT, json=util.chat_body(max_tokens=2, **util.greedy())).json()
    assert plain.get("prompt_logprobs") is None
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(max_tokens=2, stream=True, prompt_logprobs=2,
                                                                 **util.greedy()))
    assert done
    scored = [c["prompt_logprobs"] for c in chunks if "prompt_logprobs" in c]
    assert len(scored) == 1 and len(scored[0]) == len(pl)
    assert [e[k]["logprob"] for e, k in zip(scored[0][1:], (next(iter(x)) for x in pl[1:]))] == \
        pytest.approx([next(iter(x.values()))["logprob"] for x in pl[1:]], abs=1e-5)


def test_thinking_budget_closes_the_reasoning(http):
    """The demo model never closes <think> itself: a budget of 6 closes it after 6 reasoning tokens, and the
    reply goes on in content; the names of vLLM, SGLang and llama.cpp all take it."""
    kw = dict(max_tokens=30, **util.greedy(), chat_template_kwargs={"enable_thinking": True})
    free_reasoning, free_content = text_of(post_chat(http, **kw))
    assert free_reasoning and not free_content, "the demo model keeps thinking"
    for name in ("thinking_token_budget", "thinking_budget", "thinking_budget_tokens"):
        resp = post_chat(http, **kw, **{name: 6})
        reasoning, content = text_of(resp)
        assert content, resp
        assert reasoning and free_reasoning.startswith(reasoning.rstrip()), (reasoning, free_reasoning)
        assert resp["usage"]["completion_tokens"] == 30
    chunks, done = util.stream_openai(http, CHAT, util.chat_body(stream=True, thinking_token_budget=6, **kw))
    assert done
    j = util.join_chat_stream(chunks)
    assert (j["reasoning"], j["content"]) == text_of(post_chat(http, **kw, thinking_token_budget=6))
    # No budget (negative), or thinking off: the budget changes nothing.
    assert text_of(post_chat(http, **kw, thinking_token_budget=-1)) == (free_reasoning, free_content)
    off = dict(max_tokens=12, **util.greedy(), **util.no_think())
    assert text_of(post_chat(http, **off, thinking_token_budget=2)) == text_of(post_chat(http, **off))


def test_reasoning_effort_turns_thinking_on_and_off(http):
    kw = dict(max_tokens=12, **util.greedy())
    on = dict(kw, chat_template_kwargs={"enable_thinking": True})
    assert text_of(post_chat(http, **kw, reasoning_effort="high")) == text_of(post_chat(http, **on))
    assert text_of(post_chat(http, **on, reasoning_effort="none")) == text_of(post_chat(http, **on)), \
        "chat_template_kwargs win"
    assert text_of(post_chat(http, **kw, reasoning_effort="none")) == text_of(post_chat(http, **util.no_think(), **kw))
    util.assert_openai_error(http.post(CHAT, json=util.chat_body(reasoning_effort="max", **kw)), 400, "reasoning_effort")
