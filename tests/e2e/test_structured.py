"""Structured outputs on the demo model: `response_format` JSON schemas and forced tool calls (OpenAI and
Anthropic). The demo model's weights are random, so every reply being valid is the grammar's doing."""

import json
import re

import pytest

import util
from conftest import MAIN_ARGS, run_server

CHAT = "/v1/chat/completions"

SCHEMA = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "green", "blue"]},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
    },
    "required": ["color", "count", "name", "tags"],
    "additionalProperties": False,
}

TOOL = {"type": "function", "function": {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"type": "string", "enum": ["c", "f"]},
    }, "required": ["city", "days", "unit"]},
}}
OTHER = {"type": "function", "function": {"name": "noop", "parameters": {"type": "object", "properties": {}}}}


def check_schema(doc):
    assert set(doc) == {"color", "count", "name", "tags"}, doc
    assert doc["color"] in ("red", "green", "blue")
    assert isinstance(doc["count"], int) and 0 <= doc["count"] <= 99
    assert isinstance(doc["name"], str) and 1 <= len(doc["name"]) <= 6
    assert isinstance(doc["tags"], list) and len(doc["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 3 for t in doc["tags"])


def schema_body(seed, **kw):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "strict": True, "schema": SCHEMA}}
    return util.chat_body(content="Describe a thing.", max_tokens=300, temperature=1.0, seed=seed,
                          response_format=fmt, **kw)


@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_reply_is_valid(http, seed):
    r = http.post(CHAT, json=schema_body(seed))
    assert r.status_code == 200, r.text[:800]
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    check_schema(json.loads(ch["message"]["content"]))


def test_n_choices_each_follow_the_schema(http):
    """`n` = 3 under a JSON schema: the prompt runs once, each choice walks the grammar on its own."""
    r = http.post(CHAT, json=schema_body(4, n=3))
    assert r.status_code == 200, r.text[:800]
    resp = r.json()
    chs = resp["choices"]
    assert [c["index"] for c in chs] == [0, 1, 2]
    docs = []
    for ch in chs:
        assert ch["finish_reason"] == "stop", ch
        docs.append(json.loads(ch["message"]["content"]))
        check_schema(docs[-1])
    assert len({json.dumps(d, sort_keys=True) for d in docs}) > 1, docs
    single = http.post(CHAT, json=schema_body(4)).json()
    assert single["choices"][0]["message"]["content"] == chs[0]["message"]["content"], "choice 0 is the n = 1 reply"
    assert resp["usage"]["prompt_tokens"] == single["usage"]["prompt_tokens"]



def test_thinking_budget_then_the_schema(http):
    """Thinking on: the demo model never closes <think>, so the grammar (which starts after it) never starts;
    a thinking budget closes the reasoning and the reply is the schema's JSON."""
    think = {"chat_template_kwargs": {"enable_thinking": True}}
    stuck = http.post(CHAT, json=schema_body(3, **think, max_completion_tokens=40)).json()["choices"][0]
    assert stuck["finish_reason"] == "length" and not stuck["message"]["content"], stuck
    r = http.post(CHAT, json=schema_body(3, **think, thinking_token_budget=8))
    assert r.status_code == 200, r.text[:800]
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop" and ch["message"]["reasoning_content"], ch
    check_schema(json.loads(ch["message"]["content"]))

@pytest.mark.parametrize("seed", [1, 2])
def test_json_schema_stream_is_valid(http, seed):
    chunks, done = util.stream_openai(http, CHAT, schema_body(seed, stream=True))
    assert done
    j = util.join_chat_stream(chunks)
    assert j["finish_reason"] == "stop", j
    check_schema(json.loads(j["content"]))


@pytest.mark.parametrize("choice", ["required", {"type": "function", "function": {"name": "get_weather"}}])
def test_forced_tool_call_has_valid_arguments(http, choice):
    body = util.chat_body(content="Weather?", max_tokens=200, temperature=1.0, seed=3, tools=[TOOL, OTHER],
                          tool_choice=choice, parallel_tool_calls=False)
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text[:800]
    ch = r.json()["choices"][0]
    calls = ch["message"]["tool_calls"]
    assert ch["finish_reason"] == "tool_calls" and calls, ch
    for c in calls:
        assert c["function"]["name"] in ("get_weather", "noop")
        args = json.loads(c["function"]["arguments"])
        if c["function"]["name"] == "get_weather":
            assert set(args) == {"city", "days", "unit"}, args
            assert isinstance(args["days"], int) and 1 <= args["days"] <= 7 and args["unit"] in ("c", "f")
    if isinstance(choice, dict):
        assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_anthropic_forced_tool_use(anthropic_http):
    tools = [{"name": "get_weather", "input_schema": TOOL["function"]["parameters"]}]
    one = {"disable_parallel_tool_use": True}
    for choice in ({"type": "any", **one}, {"type": "tool", "name": "get_weather", **one}):
        body = {"model": util.MODEL, "max_tokens": 200, "temperature": 1.0, "tools": tools, "tool_choice": choice,
                "messages": [{"role": "user", "content": "Weather?"}]}
        r = anthropic_http.post("/v1/messages", json=body)
        assert r.status_code == 200, r.text[:800]
        m = r.json()
        uses = [b for b in m["content"] if b["type"] == "tool_use"]
        assert m["stop_reason"] == "tool_use" and uses, m
        assert [u["name"] for u in uses] == ["get_weather"]
        assert set(uses[0]["input"]) == {"city", "days", "unit"}



def test_text_completion_response_format(http):
    fmt = {"type": "json_schema", "json_schema": {"name": "thing", "schema": SCHEMA}}
    body = {"model": util.MODEL, "prompt": "A thing:", "max_tokens": 300, "temperature": 1.0, "seed": 4,
            "response_format": fmt}
    r = http.post("/v1/completions", json=body)
    assert r.status_code == 200, r.text[:800]
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    check_schema(json.loads(ch["text"]))
    r = http.post("/v1/completions", json={**body, "guided_regex": "a+"})
    assert r.status_code == 400 and r.json()["error"]["param"] == "guided_regex", r.text

@pytest.mark.parametrize("body,param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "response_format"),
    ({"tools": [TOOL], "tool_choice": {"type": "function", "function": {"name": "missing"}}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
])
def test_bad_constraints_are_400_naming_the_field(http, body, param):
    r = http.post(CHAT, json=util.chat_body(**body))
    assert r.status_code == 400, r.text[:800]
    assert r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("seed", [1, 2])
def test_guided_extras_constrain_the_reply(http, seed):
    kw = dict(max_tokens=60, temperature=1.0, seed=seed)
    r = http.post(CHAT, json=util.chat_body(content="Pick.", guided_choice=["alpha", "beta gamma"], **kw))
    assert r.status_code == 200, r.text[:800]
    assert r.json()["choices"][0]["message"]["content"] in ("alpha", "beta gamma")
    r = http.post("/v1/completions", json={"model": util.MODEL, "prompt": "Code:", "guided_regex": "[A-Z]{2}-[0-9]{3}",
                                           **kw})
    assert r.status_code == 200, r.text[:800]
    ch = r.json()["choices"][0]
    assert re.fullmatch("[A-Z]{2}-[0-9]{3}", ch["text"]) and ch["finish_reason"] == "stop", ch
    body = util.chat_body(content="Describe a thing.", structured_outputs={"json": SCHEMA}, **{**kw, "max_tokens": 300})
    r = http.post(CHAT, json=body)
    assert r.status_code == 200, r.text[:800]
    check_schema(json.loads(r.json()["choices"][0]["message"]["content"]))


@pytest.mark.parametrize("field,value", [("guided_grammar", 'root ::= "a"'), ("guided_regex", "(unclosed"),
                                         ("structured_outputs", {"grammar": "x"})])
def test_unsupported_or_bad_guided_extras_are_refused(http, field, value):
    err = util.assert_openai_error(http.post(CHAT, json=util.chat_body(**{field: value})), 400, field)
    assert err["param"] == field, err


# ------------------------------------------------------------------------------- with MTP speculation

@pytest.fixture(scope="module")
def spec_http(tmp_path_factory):
    """A server drafting 3 tokens a step with the demo model's MTP head."""
    for srv in run_server(tmp_path_factory, "spec", MAIN_ARGS + ["--speculative-tokens", "3"]):
        with util.client(srv.base) as c:
            yield c


def drafted(c) -> int:
    m = re.search(r"^deltaserve_spec_decode_draft_tokens_total (\d+)", c.get("/metrics").text, re.M)
    return int(m.group(1)) if m else 0


@pytest.mark.parametrize("seed", [1, 2])
def test_constrained_replies_draft_and_stay_valid(spec_http, seed):
    # Drafts the grammar refuses end acceptance at verify: the replies stay valid, streamed or not.
    before = drafted(spec_http)
    r = spec_http.post(CHAT, json=schema_body(seed))
    assert r.status_code == 200, r.text[:800]
    ch = r.json()["choices"][0]
    assert ch["finish_reason"] == "stop", ch
    check_schema(json.loads(ch["message"]["content"]))
    chunks, done = util.stream_openai(spec_http, CHAT, schema_body(seed, stream=True))
    assert done
    j = util.join_chat_stream(chunks)
    assert j["finish_reason"] == "stop", j
    check_schema(json.loads(j["content"]))
    body = util.chat_body(content="Weather?", max_tokens=200, temperature=1.0, seed=seed, tools=[TOOL, OTHER],
                          tool_choice={"type": "function", "function": {"name": "get_weather"}},
                          parallel_tool_calls=False)
    r = spec_http.post(CHAT, json=body)
    assert r.status_code == 200, r.text[:800]
    calls = r.json()["choices"][0]["message"]["tool_calls"]
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    args = json.loads(calls[0]["function"]["arguments"])
    assert set(args) == {"city", "days", "unit"} and 1 <= args["days"] <= 7 and args["unit"] in ("c", "f"), args
    assert drafted(spec_http) > before, "constrained requests drafted no tokens"
