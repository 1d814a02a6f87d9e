"""POST /tokenize and /detokenize, in vLLM's and llama.cpp's shapes: the counts agree with what the
completion endpoints bill for the same prompt."""

import httpx
import pytest

import util
from test_images import data_url, png

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count these tokens, please."}]


def tokenize(http, **body) -> dict:
    r = http.post("/tokenize", json=body)
    assert r.status_code == 200, f"{r.status_code}: {r.text[:500]}"
    return r.json()


def test_a_text_counts_as_the_completion_bills_it(http):
    text = "Once upon a time, a coding agent counted its context."
    t = tokenize(http, model=util.MODEL, prompt=text)
    assert t["count"] == len(t["tokens"]) > 0 and all(isinstance(i, int) for i in t["tokens"])
    assert t["token_strs"] is None
    billed = http.post("/v1/completions", json={"model": util.MODEL, "prompt": text, "max_tokens": 1}).json()
    assert billed["usage"]["prompt_tokens"] == t["count"]
    # llama.cpp's field name, the same ids.
    assert tokenize(http, content=text)["tokens"] == t["tokens"]
    models = http.get("/v1/models").json()["data"][0]
    assert t["max_model_len"] == models["max_model_len"]


def test_messages_count_as_the_chat_bills_them(http):
    t = tokenize(http, messages=MESSAGES)
    billed = http.post(CHAT, json={"model": util.MODEL, "messages": MESSAGES, "max_tokens": 1}).json()
    assert billed["usage"]["prompt_tokens"] == t["count"]
    # Without the generation prompt: the same tokens, less the assistant message's opening.
    bare = tokenize(http, messages=MESSAGES, add_generation_prompt=False)
    assert bare["count"] < t["count"] and t["tokens"][: bare["count"]] == bare["tokens"]
    # Template variables change the rendering as they do for a chat request.
    thinking = tokenize(http, messages=MESSAGES, chat_template_kwargs={"enable_thinking": True})
    billed = http.post(CHAT, json={"model": util.MODEL, "messages": MESSAGES, "max_tokens": 1,
                                   "chat_template_kwargs": {"enable_thinking": True}}).json()
    assert billed["usage"]["prompt_tokens"] == thinking["count"]


def test_images_count_their_tokens(http):
    img = {"type": "image_url", "image_url": {"url": data_url(png(64, 96))}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "What is this?"}, img]}]
    t = tokenize(http, messages=messages)
    text_only = tokenize(http, messages=[{"role": "user", "content": "What is this?"}])
    assert t["count"] > text_only["count"]
    billed = http.post(CHAT, json={"model": util.MODEL, "messages": messages, "max_tokens": 1}).json()
    assert billed["usage"]["prompt_tokens"] == t["count"]


def test_pieces_and_detokenize_round_trip(http):
    ascii_text = "def main():\n    print('hello, world')  # the pieces join to the text\n"
    t = tokenize(http, prompt=ascii_text, return_token_strs=True)
    assert "".join(t["token_strs"]) == ascii_text
    pieces = tokenize(http, content=ascii_text, with_pieces=True)["tokens"]
    assert [p["id"] for p in pieces] == t["tokens"] and "".join(p["piece"] for p in pieces) == ascii_text
    # A piece may hold part of a multi-byte character; the whole list decodes to the text exactly.
    text = "print('héllo, wörld')  # ünïcode, 漢字\n"
    back = http.post("/detokenize", json={"model": util.MODEL, "tokens": tokenize(http, prompt=text)["tokens"]})
    assert back.status_code == 200
    assert back.json() == {"prompt": text, "content": text}


@pytest.mark.parametrize("path,body,mentions", [
    ("/tokenize", {"prompt": "a", "messages": MESSAGES}, ("exactly one",)),
    ("/tokenize", {}, ("exactly one",)),
    ("/tokenize", {"prompt": 5}, ("prompt",)),
    ("/tokenize", {"messages": []}, ("messages",)),
    ("/detokenize", {"tokens": [1, -2]}, ("tokens[1]",)),
    ("/detokenize", {"tokens": "12"}, ("tokens",)),
    ("/detokenize", {}, ("tokens",)),
    ("/detokenize", {"tokens": [10_000_000]}, ("tokens",)),
])
def test_bad_requests_are_400s_naming_the_field(http, path, body, mentions):
    util.assert_openai_error(http.post(path, json=body), 400, *mentions)


def test_unknown_model_and_missing_key_are_refused(http, base):
    util.assert_openai_error(http.post("/tokenize", json={"model": "nope", "prompt": "a"}), 404, "nope")
    r = httpx.post(f"{base}/tokenize", json={"prompt": "a"}, timeout=10)
    assert r.status_code == 401
