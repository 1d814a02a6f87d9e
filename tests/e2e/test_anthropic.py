"""POST /v1/messages and /v1/messages/count_tokens (Anthropic Messages API), over httpx and the anthropic SDK."""

import anthropic
import pytest

import util

MSGS = "/v1/messages"


def body(**kw):
    b = {"model": util.MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}]}
    b.update(kw)
    return b


def post(c, **kw):
    r = c.post(MSGS, json=body(**kw))
    assert r.status_code == 200, f"{r.status_code}: {r.text[:800]}"
    return r.json()


def check_message(m, max_tokens=None):
    assert m["id"].startswith("msg_"), m["id"]
    assert m["type"] == "message"
    assert m["role"] == "assistant"
    assert m["model"] == util.MODEL
    assert isinstance(m["content"], list)
    kinds = [b["type"] for b in m["content"]]
    assert set(kinds) <= {"thinking", "text", "tool_use"}, kinds
    # Thinking blocks come first.
    if "thinking" in kinds:
        assert kinds.index("thinking") == 0 and kinds.count("thinking") == 1, kinds
    for b in m["content"]:
        if b["type"] == "text":
            assert isinstance(b["text"], str)
        elif b["type"] == "thinking":
            assert isinstance(b["thinking"], str)
        else:
            assert b["id"] and b["name"] and isinstance(b["input"], dict)
    assert m["stop_reason"] in ("end_turn", "max_tokens", "stop_sequence", "tool_use"), m["stop_reason"]
    assert "stop_sequence" in m
    u = m["usage"]
    assert u["input_tokens"] > 0 and u["output_tokens"] >= 0
    if max_tokens is not None:
        assert u["output_tokens"] <= max_tokens
    if m["stop_reason"] == "max_tokens" and max_tokens is not None:
        assert u["output_tokens"] == max_tokens
    return m


def texts(m):
    t = "".join(b["text"] for b in m["content"] if b["type"] == "text")
    th = "".join(b["thinking"] for b in m["content"] if b["type"] == "thinking")
    return th, t


def test_basic(anthropic_http):
    check_message(post(anthropic_http), 8)


def test_content_blocks_and_system(anthropic_http):
    m = post(anthropic_http, system="Be brief.", messages=[
        {"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "there"}]},
        {"role": "assistant", "content": [{"type": "text", "text": "Hi!"}]},
        {"role": "user", "content": "More"},
    ])
    check_message(m, 8)


def test_system_as_blocks(anthropic_http):
    check_message(post(anthropic_http, system=[{"type": "text", "text": "Be brief."}]), 8)


def test_max_tokens_stop_reason(anthropic_http):
    m = check_message(post(anthropic_http, max_tokens=5, temperature=0, ignore_eos=True,
                           thinking={"type": "disabled"}), 5)
    assert m["stop_reason"] == "max_tokens"
    assert m["usage"]["output_tokens"] == 5


def test_thinking_disabled_has_no_thinking_block(anthropic_http):
    m = check_message(post(anthropic_http, max_tokens=12, temperature=0, thinking={"type": "disabled"}))
    assert all(b["type"] != "thinking" for b in m["content"]), m["content"]


def test_thinking_enabled(anthropic_http):
    m = check_message(post(anthropic_http, max_tokens=16, temperature=0,
                           thinking={"type": "enabled", "budget_tokens": 1024}))
    th, t = texts(m)
    assert th or t


def test_thinking_budget_closes_the_thinking_block(anthropic_http):
    # The demo model never ends its thinking: a budget of 5 tokens ends it, and the text block follows.
    kw = dict(max_tokens=24, temperature=0, ignore_eos=True)
    free = post(anthropic_http, thinking={"type": "enabled", "budget_tokens": 1024}, **kw)
    th_free, t_free = texts(check_message(free))
    assert th_free and not t_free
    th, t = texts(check_message(post(anthropic_http, thinking={"type": "enabled", "budget_tokens": 5}, **kw)))
    assert t and th and th_free.startswith(th.rstrip()), (th, t)
    r = anthropic_http.post(MSGS, json=body(thinking={"type": "enabled", "budget_tokens": -3}))
    assert r.status_code == 400 and "budget_tokens" in r.text


def test_deterministic_greedy(anthropic_http):
    kw = dict(max_tokens=16, temperature=0, thinking={"type": "disabled"})
    assert texts(post(anthropic_http, **kw)) == texts(post(anthropic_http, **kw))


def test_stop_sequences(anthropic_http):
    kw = dict(max_tokens=40, temperature=0, ignore_eos=True, thinking={"type": "disabled"})
    full = texts(post(anthropic_http, **kw))[1]
    stop = util.pick_stop(full)
    assert stop, full
    m = check_message(post(anthropic_http, stop_sequences=[stop], **kw))
    assert m["stop_reason"] == "stop_sequence"
    assert m["stop_sequence"] == stop
    assert texts(m)[1] == full[:full.find(stop)]


def test_tools_accepted(anthropic_http):
    tools = [{"name": "get_weather", "description": "weather", "input_schema": {
        "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                                         "opts": {"type": "object"}}, "required": ["city"]}}]
    m = check_message(post(anthropic_http, tools=tools, max_tokens=10))
    if m["stop_reason"] == "tool_use":
        assert any(b["type"] == "tool_use" for b in m["content"])


def test_tool_use_history_accepted(anthropic_http):
    tools = [{"name": "get_weather", "description": "weather",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}]
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Let me check."},
            {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": "21C"},
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]}]},
    ]
    check_message(post(anthropic_http, tools=tools, messages=messages, max_tokens=6))


def test_stream_events(anthropic_http):
    kw = dict(max_tokens=12, temperature=0, ignore_eos=True, thinking={"type": "enabled", "budget_tokens": 1024})
    ref = check_message(post(anthropic_http, **kw))
    events = util.stream_anthropic(anthropic_http, body(stream=True, **kw))
    names = [e for e, _ in events]
    assert names[0] == "message_start", names
    assert names[-1] == "message_stop", names
    assert names[-2] == "message_delta", names
    start = events[0][1]["message"]
    assert start["id"].startswith("msg_") and start["role"] == "assistant" and start["content"] == []
    assert start["usage"]["input_tokens"] == ref["usage"]["input_tokens"]
    # Blocks: start → deltas → stop, indexes consecutive from 0, no interleaving.
    open_idx, next_idx = None, 0
    blocks = {}
    for name, d in events[1:-2]:
        if name == "ping":
            continue
        if name == "content_block_start":
            assert open_idx is None and d["index"] == next_idx, (names, d)
            open_idx = d["index"]
            blocks[open_idx] = {"type": d["content_block"]["type"], "text": ""}
        elif name == "content_block_delta":
            assert d["index"] == open_idx, d
            delta = d["delta"]
            kind = blocks[open_idx]["type"]
            if delta["type"] == "text_delta":
                assert kind == "text"
                blocks[open_idx]["text"] += delta["text"]
            elif delta["type"] == "thinking_delta":
                assert kind == "thinking"
                blocks[open_idx]["text"] += delta["thinking"]
            elif delta["type"] == "signature_delta":
                assert kind == "thinking"
            elif delta["type"] == "input_json_delta":
                assert kind == "tool_use"
            else:
                raise AssertionError(f"unknown delta {delta}")
        elif name == "content_block_stop":
            assert d["index"] == open_idx, d
            open_idx = None
            next_idx += 1
        else:
            raise AssertionError(f"unexpected event {name}: {d}")
    assert open_idx is None, "a content block was never stopped"
    md = events[-2][1]
    assert md["delta"]["stop_reason"] == ref["stop_reason"] == "max_tokens"
    assert md["usage"]["output_tokens"] == ref["usage"]["output_tokens"] == 12
    streamed = ("".join(b["text"] for b in blocks.values() if b["type"] == "thinking"),
                "".join(b["text"] for b in blocks.values() if b["type"] == "text"))
    assert streamed == texts(ref)


def test_count_tokens_matches_usage(anthropic_http):
    req = dict(system="You are helpful.", messages=[{"role": "user", "content": "Count these tokens please"},
                                                   {"role": "assistant", "content": "OK"},
                                                   {"role": "user", "content": [{"type": "text", "text": "Now"}]}])
    r = anthropic_http.post("/v1/messages/count_tokens", json={"model": util.MODEL, **req})
    assert r.status_code == 200, r.text
    n = r.json()["input_tokens"]
    assert isinstance(n, int) and n > 0
    m = post(anthropic_http, max_tokens=2, **req)
    assert m["usage"]["input_tokens"] == n


def test_count_tokens_with_tools_and_thinking(anthropic_http):
    req = dict(messages=[{"role": "user", "content": "hi"}], thinking={"type": "disabled"},
               tools=[{"name": "f", "description": "d", "input_schema": {"type": "object", "properties": {}}}])
    r = anthropic_http.post("/v1/messages/count_tokens", json={"model": util.MODEL, **req})
    assert r.status_code == 200, r.text
    assert post(anthropic_http, max_tokens=2, **req)["usage"]["input_tokens"] == r.json()["input_tokens"]


@pytest.mark.parametrize("bad", [
    {"max_tokens": None}, {"messages": None}, {"messages": "hi"}, {"max_tokens": "many"}, {"temperature": -1},
    {"messages": [{"role": "system", "content": "x"}]}, {"thinking": {"type": "sometimes"}},
    {"stop_sequences": "x"},
], ids=lambda b: next(iter(b)) + "=" + repr(next(iter(b.values()))))
def test_errors_anthropic_shape(anthropic_http, bad):
    b = body()
    for k, v in bad.items():
        if v is None:
            b.pop(k)
        else:
            b[k] = v
    r = anthropic_http.post(MSGS, json=b)
    util.assert_anthropic_error(r, 400)


def test_malformed_json_anthropic_shape(anthropic_http):
    r = anthropic_http.post(MSGS, content=b"{", headers={"content-type": "application/json"})
    util.assert_anthropic_error(r, 400)


# ------------------------------------------------------------------------------------------------ SDK


@pytest.fixture(scope="module")
def sdk(base):
    return anthropic.Anthropic(base_url=base, api_key=util.API_KEY, max_retries=0, timeout=util.REQUEST_TIMEOUT)


def test_sdk_create(sdk):
    # anthropic 2.x dropped `temperature` from create(): send it as an extra field.
    m = sdk.messages.create(model=util.MODEL, max_tokens=6, messages=[{"role": "user", "content": "hi"}],
                            thinking={"type": "disabled"}, extra_body={"temperature": 0})
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.output_tokens <= 6


def test_sdk_stream(sdk):
    kw = dict(model=util.MODEL, max_tokens=10, messages=[{"role": "user", "content": "hi"}],
              extra_body={"temperature": 0}, system="terse", thinking={"type": "disabled"})
    ref = sdk.messages.create(**kw)
    with sdk.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == "".join(b.text for b in ref.content if b.type == "text")
    assert final.stop_reason == ref.stop_reason
    assert final.usage.output_tokens == ref.usage.output_tokens


def test_sdk_count_tokens(sdk):
    n = sdk.messages.count_tokens(model=util.MODEL, messages=[{"role": "user", "content": "hello"}])
    assert n.input_tokens > 0


def test_sdk_errors(base):
    bad = anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(anthropic.AuthenticationError):
        bad.messages.create(model=util.MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}])
    good = anthropic.Anthropic(base_url=base, api_key=util.API_KEY, max_retries=0, timeout=10)
    with pytest.raises(anthropic.BadRequestError):
        good.messages.create(model=util.MODEL, max_tokens=2, messages=[{"role": "user", "content": "x"}],
                             extra_body={"temperature": -1})


@pytest.mark.parametrize("thinking", [None, {"type": "enabled", "budget_tokens": 1024}], ids=["default", "enabled"])
def test_sdk_stream_and_create_have_the_same_blocks(sdk, thinking):
    """Cut by max_tokens (mid-thinking when thinking is on): streamed and whole replies hold the same blocks,
    thinking blocks only when the request enabled thinking, and a text block at the end."""
    kw = dict(model=util.MODEL, max_tokens=5, messages=[{"role": "user", "content": "hi"}],
              extra_body={"temperature": 0, "ignore_eos": True})
    if thinking is not None:
        kw["thinking"] = thinking
    ref = sdk.messages.create(**kw)
    with sdk.messages.stream(**kw) as stream:
        final = stream.get_final_message()

    def blocks(m):
        return [(b.type, b.thinking if b.type == "thinking" else b.text) for b in m.content]

    assert blocks(final) == blocks(ref)
    kinds = [b.type for b in ref.content]
    assert kinds[-1] == "text", kinds
    if thinking is None:
        assert "thinking" not in kinds, kinds
    else:
        assert kinds in (["thinking", "text"], ["text"]), kinds
