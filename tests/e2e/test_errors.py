"""User errors: always a 4xx with an error body, never a 500, and the server stays up."""

import json
import random
import socket

import httpx
import pytest

import util

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"


def raw_post(http, path, content: bytes, content_type="application/json"):
    return http.post(path, content=content, headers={"Content-Type": content_type})


@pytest.mark.parametrize("path", [CHAT, COMPL, "/v1/messages"])
@pytest.mark.parametrize("payload", [b"{", b"{\"model\": \"demo\",", b"not json", b"", b"\xff\xfe\x00",
                                     b"[1, 2", b"{\"messages\": [}"],
                         ids=["brace", "truncated", "text", "empty", "binary", "array", "bad-array"])
def test_malformed_json(http, path, payload):
    r = raw_post(http, path, payload)
    assert r.status_code == 400, f"{r.status_code}: {r.text[:300]}"
    body = r.json()
    assert "error" in body


def test_missing_messages(http):
    util.assert_openai_error(http.post(CHAT, json={"model": util.MODEL, "max_tokens": 4}), 400, "messages")


def test_empty_messages(http):
    util.assert_openai_error(http.post(CHAT, json=util.chat_body(messages=[])), 400)


def test_wrong_type_temperature(http):
    util.assert_openai_error(http.post(CHAT, json=util.chat_body(temperature="hot")), 400)


@pytest.mark.parametrize("field,value", [("temperature", "hot"), ("max_tokens", -1), ("max_tokens", "ten"),
                                         ("top_logprobs", -1), ("seed", "x"), ("stop", 5), ("messages", "hi")])
def test_type_errors_name_the_field(http, field, value):
    """Like vLLM (pydantic), a wrong-typed field is named in the message or in error.param."""
    util.assert_openai_error(http.post(CHAT, json=util.chat_body(**{field: value})), 400, field)


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0), ("top_p", 1.5), ("top_k", -5), ("min_p", 2.0), ("presence_penalty", 5),
    ("frequency_penalty", -3), ("repetition_penalty", 0), ("max_tokens", 0), ("top_logprobs", 1000),
])
def test_out_of_range(http, field, value):
    body = util.chat_body(**{field: value})
    if field == "top_logprobs":
        body["logprobs"] = True
    util.assert_openai_error(http.post(CHAT, json=body), 400, field)


def test_temperature_negative_names_field(http):
    err = util.assert_openai_error(http.post(CHAT, json=util.chat_body(temperature=-1)), 400, "temperature")
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", [CHAT, COMPL])
def test_unknown_model_404(http, path):
    body = util.chat_body() if path == CHAT else {"prompt": "hi", "max_tokens": 2}
    body["model"] = "no-such-model"
    util.assert_openai_error(http.post(path, json=body), 404, "no-such-model")


def test_unknown_model_404_anthropic(anthropic_http):
    r = anthropic_http.post("/v1/messages", json={"model": "no-such-model", "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "hi"}]})
    util.assert_anthropic_error(r, 404)


def _send_big_body(port: int, path: str, size: int) -> bytes:
    """POST `size` bytes of a JSON body over a raw socket, tolerating the server closing early; return response."""
    head = (f"POST {path} HTTP/1.1\r\nHost: {util.HOST}:{port}\r\nAuthorization: Bearer {util.API_KEY}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {size}\r\nConnection: close\r\n\r\n").encode()
    prefix = b'{"model": "demo", "max_tokens": 1, "messages": [{"role": "user", "content": "'
    suffix = b'"}]}'
    filler = size - len(prefix) - len(suffix)
    s = socket.create_connection((util.HOST, port), timeout=30)
    try:
        s.sendall(head)
        try:
            s.sendall(prefix)
            block = b"a" * 65536
            sent = 0
            while sent < filler:
                n = min(len(block), filler - sent)
                s.sendall(block[:n])
                sent += n
            s.sendall(suffix)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered and closed early: fine, read its answer
        data = b""
        try:
            while len(data) < 1 << 20:
                chunk = s.recv(65536)
                if not chunk:
                    break
                data += chunk
        except (ConnectionResetError, socket.timeout):
            pass
        return data
    finally:
        s.close()


@pytest.mark.parametrize("path", [CHAT, "/v1/messages"])
def test_body_too_large_413(server, path):
    resp = _send_big_body(server.port, path, 20 * 1024 * 1024)
    assert resp, "no response at all to a 20 MB body"
    status_line = resp.split(b"\r\n", 1)[0]
    assert status_line.split()[1] == b"413", status_line
    assert server.alive()


def test_body_too_large_413_httpx(http):
    big = {"model": util.MODEL, "max_tokens": 1, "messages": [{"role": "user", "content": "a" * (20 << 20)}]}
    try:
        r = http.post(CHAT, json=big)
    except httpx.TransportError:
        pytest.fail("the server reset the connection instead of answering 413 (httpx could not read a response)")
    util.assert_openai_error(r, 413)


def test_context_too_long_prompt_plus_max_tokens(http, max_model_len):
    r = http.post(CHAT, json=util.chat_body(max_tokens=max_model_len))
    err = util.assert_openai_error(r, 400, str(max_model_len))
    assert err["type"] == "invalid_request_error"


def test_max_tokens_alone_over_context(http, max_model_len):
    r = http.post(COMPL, json={"model": util.MODEL, "prompt": [65, 66, 67], "max_tokens": max_model_len + 10})
    util.assert_openai_error(r, 400, str(max_model_len))


def test_sdk_raises_bad_request(oai):
    import openai
    with pytest.raises(openai.BadRequestError):
        oai.chat.completions.create(model=util.MODEL, messages=[{"role": "user", "content": "x"}], temperature=-1)
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}], max_tokens=1)


# --------------------------------------------------------------------------------------------- fuzzing

WRONG = [None, True, -1, 1.5, "x", "", [], [1, "a"], {}, {"a": 1}, 10 ** 30, -(10 ** 30)]
FIELD_SPECIFIC = {
    "messages": [None, "hi", 5, {}, [1], [None], ["hi"], [{}], [{"content": "hi"}],
                 [{"role": "wizard", "content": "hi"}], [{"role": "user", "content": 5}],
                 [{"role": "user", "content": [{"type": "image_url", "image_url": 3}]}],
                 [{"role": "user", "content": [{"type": "text"}]}], [{"role": "user", "content": [{"text": 1}]}],
                 [{"role": "assistant", "tool_calls": "x"}],
                 [{"role": "assistant", "tool_calls": [{"id": 1, "type": "function", "function": {"name": 3}}]}]],
    "model": [5, [], {}, "no-such-model"],
    "max_tokens": ["ten", -5, 0, 1.5, [], {}, True, 10 ** 20],
    "max_completion_tokens": ["ten", -5, 1.5, {}],
    "temperature": ["hot", -1, [], {}, True],
    "top_p": ["x", -0.5, 2, [], {}],
    "top_k": ["x", -7, 1.5, {}],
    "min_p": ["x", -1, 1.5, []],
    "presence_penalty": ["x", 100, [], True],
    "frequency_penalty": ["x", -100, {}],
    "repetition_penalty": ["x", -1, 0, []],
    "seed": ["x", 1.5, [], {}, "NaN"],
    "stop": [5, {}, [1, 2], [None], True],
    "n": ["x", 0, -1, 2, 1.5],
    "logprobs": ["yes", 5, [], {}],
    "top_logprobs": ["x", -1, 100, 1.5],
    "stream": ["yes", [], {}],
    "stream_options": ["x", 5, [], {"include_usage": "yes"}],
    "tools": ["x", 5, {}, [1], [{}], [{"type": "function"}], [{"type": "function", "function": {}}],
              [{"type": "function", "function": {"name": 5}}], [{"type": "bogus", "function": {"name": "f"}}]],
    "tool_choice": [5, [], "sometimes", {"type": "function"}, {"type": "function", "function": {"name": "nope"}}],
    "response_format": ["json", 5, {"type": "yaml"}, {"type": "json_object"}, {}],
    "chat_template_kwargs": ["x", 5, []],
}


def _fuzz_cases(seed=20240601, count=50):
    rng = random.Random(seed)
    cases = []
    # Whole bodies that are not a request object.
    for v in [None, 1, "str", [], [1, 2], True, 3.5, {"": ""}]:
        cases.append(("root", v))
    fields = list(FIELD_SPECIFIC)
    while len(cases) < count:
        field = rng.choice(fields)
        value = rng.choice(FIELD_SPECIFIC[field])
        cases.append((field, value))
    return cases


def _mutate(field, value):
    if field == "root":
        return value
    body = util.chat_body(max_tokens=2)
    body[field] = value
    return body


FUZZ = _fuzz_cases()


@pytest.mark.parametrize("field,value", FUZZ, ids=[f"{i}-{f}" for i, (f, _) in enumerate(FUZZ)])
def test_fuzz_chat_never_500(http, field, value):
    r = http.post(CHAT, content=json.dumps(value).encode(), headers={"Content-Type": "application/json"})
    assert r.status_code < 500, f"{field}={value!r} → {r.status_code}: {r.text[:300]}"
    assert 400 <= r.status_code < 500, f"{field}={value!r} was accepted: {r.status_code} {r.text[:300]}"
    body = r.json()
    assert "error" in body, body


def test_fuzz_random_types_per_field_never_500(http, anthropic_http):
    """Every field of each endpoint set to each wrong-typed value: never 5xx. Bounded: ~few hundred requests."""
    rng = random.Random(7)
    oai_fields = ["model", "messages", "max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "n",
                  "logprobs", "top_logprobs", "stream", "tools", "tool_choice", "response_format", "presence_penalty",
                  "frequency_penalty", "repetition_penalty", "stream_options", "chat_template_kwargs",
                  "max_completion_tokens", "ignore_eos"]
    compl_fields = ["model", "prompt", "max_tokens", "temperature", "echo", "logprobs", "stop", "seed", "stream",
                    "suffix", "best_of", "prompt_logprobs"]
    anth_fields = ["model", "max_tokens", "messages", "system", "tools", "stream", "thinking", "stop_sequences",
                   "temperature", "top_p", "top_k", "tool_choice", "metadata"]
    bad = []
    for path, fields, base_body, client in [
        (CHAT, oai_fields, util.chat_body(max_tokens=2), http),
        (COMPL, compl_fields, {"model": util.MODEL, "prompt": "hi", "max_tokens": 2}, http),
        ("/v1/messages", anth_fields,
         {"model": util.MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}, anthropic_http),
    ]:
        for field in fields:
            for value in rng.sample(WRONG, 4):
                if value is None and field in ("max_tokens", "max_completion_tokens"):
                    continue  # null max_tokens is valid and means "up to the context": slow on purpose, skip
                body = dict(base_body)
                body[field] = value
                r = client.post(path, json=body)
                if r.status_code >= 500:
                    bad.append((path, field, value, r.status_code, r.text[:200]))
                elif r.status_code >= 400:
                    try:
                        assert isinstance(r.json(), dict)
                    except Exception:
                        bad.append((path, field, value, r.status_code, "non-JSON error body: " + r.text[:200]))
    assert not bad, "\n".join(map(repr, bad))


def test_server_alive_after_errors(base):
    r = httpx.get(f"{base}/health", timeout=10)
    assert r.status_code == 200
