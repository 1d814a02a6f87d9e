"""POST /v1/responses (OpenAI's Responses API, stateless) through the official `openai` SDK: the same
reply as the chat endpoint, the typed stream events, function calls and their outputs, bad requests."""

import json

import openai
import pytest

import util

CHAT = "/v1/chat/completions"
WEATHER = {"type": "function", "name": "get_weather", "parameters": {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 8},
    "days": {"type": "integer", "minimum": 1, "maximum": 7},
}, "required": ["city", "days"]}}


def chat(http, messages, **kw):
    r = http.post(CHAT, json={"model": util.MODEL, "messages": messages, "temperature": 0, **kw})
    assert r.status_code == 200, r.text[:500]
    return r.json()


def test_the_reply_is_the_chat_endpoints(oai, http):
    resp = oai.responses.create(model=util.MODEL, instructions="You are terse.", input="Say hello.",
                                max_output_tokens=12, temperature=0)
    ref = chat(http, [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Say hello."}],
               max_tokens=12)
    assert resp.object == "response" and resp.id.startswith("resp_")
    assert resp.output_text == ref["choices"][0]["message"]["content"]
    assert resp.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert resp.usage.output_tokens == ref["usage"]["completion_tokens"]
    assert resp.usage.total_tokens == resp.usage.input_tokens + resp.usage.output_tokens
    length = ref["choices"][0]["finish_reason"] == "length"
    assert resp.status == ("incomplete" if length else "completed")
    if length:
        assert resp.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in resp.output] == ["message"]


def test_stream_events_add_up_to_the_response(oai):
    stream = oai.responses.create(model=util.MODEL, input=[{"role": "user", "content": "Tell me a story."}],
                                  max_output_tokens=16, temperature=0, stream=True)
    events = list(stream)
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"], types
    assert types[-1] in ("response.completed", "response.incomplete"), types
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == final.output_text and text
    assert "response.output_item.added" in types and "response.output_item.done" in types
    whole = oai.responses.create(model=util.MODEL, input=[{"role": "user", "content": "Tell me a story."}],
                                 max_output_tokens=16, temperature=0)
    assert whole.output_text == final.output_text


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_function_call_is_a_function_call_item(oai, stream):
    kw = dict(model=util.MODEL, input="What is the weather?", tools=[WEATHER, {"type": "web_search"}],
              tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200, temperature=0)
    if stream:
        events = list(oai.responses.create(stream=True, **kw))
        resp = events[-1].response
        args = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
        done = [e for e in events if e.type == "response.function_call_arguments.done"]
        assert len(done) == 1 and done[0].arguments == args
    else:
        resp = oai.responses.create(**kw)
    calls = [item for item in resp.output if item.type == "function_call"]
    assert len(calls) == 1, resp.output
    assert calls[0].name == "get_weather" and calls[0].call_id
    doc = json.loads(calls[0].arguments)
    assert set(doc) == {"city", "days"} and 1 <= doc["days"] <= 7, doc
    if stream:
        assert args == calls[0].arguments


def test_a_function_calls_output_continues_the_conversation(oai, http):
    """A tool round trip as Codex sends it: the call and its output as items, the whole conversation again."""
    first = oai.responses.create(model=util.MODEL, input="What is the weather?", tools=[WEATHER],
                                 tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=200,
                                 temperature=0)
    call = next(item for item in first.output if item.type == "function_call")
    items = [{"role": "user", "content": "What is the weather?"},
             {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
             {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"}]
    second = oai.responses.create(model=util.MODEL, input=items, tools=[WEATHER], max_output_tokens=8, temperature=0)
    assert second.status in ("completed", "incomplete")
    messages = [{"role": "user", "content": "What is the weather?"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": call.call_id, "type": "function",
                 "function": {"name": call.name, "arguments": call.arguments}}]},
                {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21 C"}]
    ref = chat(http, messages, max_tokens=8, tools=[{"type": "function", "function": {
        "name": WEATHER["name"], "parameters": WEATHER["parameters"]}}])
    assert second.usage.input_tokens == ref["usage"]["prompt_tokens"]
    assert second.usage.input_tokens_details.cached_tokens > 0, "the conversation's prefix is cached"


@pytest.mark.parametrize("body,param", [
    ({"input": "hi", "previous_response_id": "resp_123"}, "previous_response_id"),
    ({}, "input"),
    ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input"),
    ({"input": "hi", "text": {"format": {"type": "grammar"}}}, "text.format"),
    ({"input": 5}, "input"),
])
def test_bad_requests_name_the_field(http, body, param):
    err = util.assert_openai_error(http.post("/v1/responses", json={"model": util.MODEL, **body}), 400)
    assert err["param"] == param, err


def test_reasoning_comes_back_and_goes_round(oai):
    """Qwen's thinking as a reasoning item (its text also in encrypted_content when asked), sent back as an input
    item of the next request."""
    kw = dict(model=util.MODEL, temperature=0, extra_body={"chat_template_kwargs": {"enable_thinking": True},
                                                           "ignore_eos": True})
    first = oai.responses.create(input="Think first.", max_output_tokens=8, include=["reasoning.encrypted_content"],
                                 **kw)
    reasoning = [item for item in first.output if item.type == "reasoning"]
    assert len(reasoning) == 1, first.output
    text = "".join(c.text for c in reasoning[0].content)
    assert text and reasoning[0].encrypted_content == text
    items = [{"role": "user", "content": "Think first."}]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append({"role": "user", "content": "Go on."})
    second = oai.responses.create(input=items, max_output_tokens=2, **kw)
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0


def test_an_empty_probe_is_answered(oai):
    resp = oai.responses.create(model=util.MODEL, input=[], max_output_tokens=1)
    assert resp.status in ("completed", "incomplete") and resp.usage.output_tokens <= 1


def test_sdk_raises_on_bad_requests(oai):
    with pytest.raises(openai.BadRequestError):
        oai.responses.create(model=util.MODEL, input="hi", previous_response_id="resp_123")
