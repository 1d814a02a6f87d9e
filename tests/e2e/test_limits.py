"""A server with tiny limits: 256-token context, 1 running + 1 waiting request. Context errors and overload;
the server-wide flags it also has (a thinking budget, cross-origin calls from one origin)."""

import time
from concurrent.futures import ThreadPoolExecutor

import httpx

import util

CHAT = "/v1/chat/completions"
COMPL = "/v1/completions"
CTX = 256


def test_models_reports_max_context(small_server):
    with util.client(small_server.base) as c:
        assert c.get("/v1/models").json()["data"][0]["max_model_len"] == CTX


def test_prompt_longer_than_context_token_ids(small_server):
    with util.client(small_server.base) as c:
        ids = [65 + (i % 26) for i in range(300)]
        r = c.post(COMPL, json={"model": util.MODEL, "prompt": ids, "max_tokens": 4})
        err = util.assert_openai_error(r, 400, str(CTX), "300")
        assert err["type"] == "invalid_request_error"


def test_prompt_longer_than_context_chat(small_server):
    with util.client(small_server.base) as c:
        r = c.post(CHAT, json=util.chat_body(content="word " * 400, max_tokens=4))
        err = util.assert_openai_error(r, 400, str(CTX))
        numbers = [int(t) for t in __import__("re").findall(r"\d+", err["message"])]
        assert any(n > CTX for n in numbers), f"message does not state the prompt length: {err['message']}"


def test_prompt_plus_max_tokens_over_context(small_server):
    with util.client(small_server.base) as c:
        ids = [65 + (i % 26) for i in range(200)]
        r = c.post(COMPL, json={"model": util.MODEL, "prompt": ids, "max_tokens": 100})
        err = util.assert_openai_error(r, 400, str(CTX))
        msg = err["message"]
        assert "300" in msg or ("200" in msg and "100" in msg), msg


def test_prompt_plus_max_tokens_exactly_context_ok(small_server):
    with util.client(small_server.base) as c:
        ids = [65 + (i % 26) for i in range(250)]
        r = c.post(COMPL, json={"model": util.MODEL, "prompt": ids, "max_tokens": 6, "ignore_eos": True})
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 6


def test_default_max_tokens_fills_context(small_server):
    """No max_tokens (vLLM: up to the context) generates until the context is full."""
    with util.client(small_server.base) as c:
        r = c.post(CHAT, json={"model": util.MODEL, "messages": [{"role": "user", "content": "hi"}],
                               "ignore_eos": True})
        assert r.status_code == 200, r.text
        resp = r.json()
        assert resp["usage"]["total_tokens"] == CTX, resp["usage"]
        assert resp["choices"][0]["finish_reason"] == "length"


def test_context_error_anthropic(small_server):
    with util.client(small_server.base, headers=util.ANTHROPIC_HEADERS) as c:
        r = c.post("/v1/messages", json={"model": util.MODEL, "max_tokens": 4,
                                         "messages": [{"role": "user", "content": "word " * 400}]})
        util.assert_anthropic_error(r, 400, str(CTX))


def test_overload_gives_429_never_500(small_server):
    base = small_server.base
    n = 8

    def one(i):
        with util.client(base, timeout=60) as c:
            r = c.post(CHAT, json=util.chat_body(content=f"overload {i}", max_tokens=100, ignore_eos=True))
            return r.status_code, r.text

    with ThreadPoolExecutor(n) as ex:
        results = list(ex.map(one, range(n)))
    statuses = sorted(s for s, _ in results)
    assert 500 not in statuses and all(s in (200, 429, 503) for s in statuses), results
    assert statuses.count(200) >= 1, statuses
    assert any(s in (429, 503) for s in statuses), f"no request was refused with max_seqs=1, max_waiting=1: {statuses}"
    for s, text in results:
        if s in (429, 503):
            r = httpx.Response(s, content=text.encode(), headers={"content-type": "application/json"})
            util.assert_openai_error(r, (429, 503))
    # The server stays up and serves again once the queue drains.
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    with util.client(base) as c:
        r = c.post(CHAT, json=util.chat_body(max_tokens=2))
        assert r.status_code == 200, r.text


def test_overload_streaming_and_anthropic(small_server):
    base = small_server.base

    def oai(i):
        with util.client(base, timeout=60) as c:
            with c.stream("POST", CHAT, json=util.chat_body(stream=True, max_tokens=80, ignore_eos=True)) as r:
                r.read()
                return "oai", r.status_code, r.content

    def anth(i):
        with util.client(base, headers=util.ANTHROPIC_HEADERS, timeout=60) as c:
            r = c.post("/v1/messages", json={"model": util.MODEL, "max_tokens": 80, "ignore_eos": True,
                                             "messages": [{"role": "user", "content": "hi"}]})
            return "anth", r.status_code, r.content

    with ThreadPoolExecutor(8) as ex:
        futs = [ex.submit(oai if i % 2 else anth, i) for i in range(8)]
        results = [f.result() for f in futs]
    statuses = [s for _, s, _ in results]
    assert 500 not in statuses and all(s in (200, 429, 503, 529) for s in statuses), statuses
    assert any(s in (429, 503, 529) for s in statuses), statuses
    for kind, s, content in results:
        if s in (429, 503, 529):
            r = httpx.Response(s, content=content, headers={"content-type": "application/json"})
            if kind == "anth":
                util.assert_anthropic_error(r, (429, 503, 529))
            else:
                util.assert_openai_error(r, (429, 503))
    assert util.wait_until(
        lambda: util.metrics(base)["deltaserve_requests_running"] == 0
        and util.metrics(base)["deltaserve_requests_waiting"] == 0, 10)
    time.sleep(0.1)
    assert small_server.alive()


def test_server_reasoning_budget(small_server):
    """`--reasoning-budget 3`: a thinking reply is closed after 3 reasoning tokens unless the request gives
    its own budget (-1: none); the demo model never closes it itself."""
    body = {"model": util.MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 20,
            "chat_template_kwargs": {"enable_thinking": True}, **util.greedy()}
    with util.client(small_server.base) as c:
        msg = c.post(CHAT, json=body).json()["choices"][0]["message"]
        assert msg["reasoning_content"] and msg["content"], msg
        free = c.post(CHAT, json={**body, "thinking_token_budget": -1}).json()["choices"][0]["message"]
        assert free["reasoning_content"] and not free["content"], free
        assert free["reasoning_content"].startswith(msg["reasoning_content"].rstrip())


def test_cross_origin_calls_from_the_listed_origin_only(small_server):
    with util.client(small_server.base) as c:
        ok = c.options(CHAT, headers={"Origin": "https://chat.example.com", "Access-Control-Request-Method": "POST",
                                      "Access-Control-Request-Headers": "authorization, content-type"})
        assert ok.status_code == 204 and ok.headers["access-control-allow-origin"] == "https://chat.example.com"
        assert "authorization" in ok.headers["access-control-allow-headers"]
        other = c.get("/v1/models", headers={"Origin": "https://other.example.com"})
        assert other.status_code == 200 and "access-control-allow-origin" not in other.headers
