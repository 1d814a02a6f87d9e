"""Health, metrics, models, authentication and routing."""

import httpx
import openai
import pytest

import util


def test_health_needs_no_key(base):
    r = httpx.get(f"{base}/health", timeout=10)
    assert r.status_code == 200


def test_metrics_needs_no_key_and_lists_every_metric(base, http):
    # One finished request so that counters/histograms with labels have samples.
    r = http.post("/v1/chat/completions", json=util.chat_body(max_tokens=2))
    assert r.status_code == 200, r.text
    r = httpx.get(f"{base}/metrics", timeout=10)
    assert r.status_code == 200
    assert r.headers.get("content-type", "").startswith("text/plain"), r.headers.get("content-type")
    text = r.text
    missing = [m for m in util.METRIC_NAMES if m not in text]
    assert not missing, f"/metrics lacks {missing}"
    m = util.metrics(base)
    for h in ("deltaserve_request_ttft_seconds", "deltaserve_inter_token_latency_seconds",
              "deltaserve_request_queue_seconds", "deltaserve_request_prefill_seconds",
              "deltaserve_request_decode_seconds"):
        assert any(k.startswith(h + "_bucket") for k in m), f"{h} is not a histogram"
        assert f"{h}_count" in m and f"{h}_sum" in m, h
    assert m["deltaserve_kv_pages_total"] > 0
    assert m["deltaserve_request_prefill_steps_total"] >= m["deltaserve_request_prefill_seconds_count"]
    assert 0 < m["deltaserve_request_prefill_step_seconds_total"] <= m["deltaserve_request_prefill_seconds_sum"] + 1e-6
    assert 0 <= m["deltaserve_kv_pages_used"] <= m["deltaserve_kv_pages_total"]
    assert any(k.startswith("deltaserve_requests_total{") and 'endpoint=' in k and 'status=' in k for k in m), \
        [k for k in m if k.startswith("deltaserve_requests_total")]


def test_next_turn_tokenizes_only_its_new_messages(base, http):
    # The server tokenises chat prompts a message at a time and keeps each message's ids: the second
    # turn takes the system and first user message from that cache (other tests' requests can only
    # add to the counters, hence >=).
    turn1 = [
        {"role": "system", "content": "You answer in one word. " * 30},
        {"role": "user", "content": "Name a colour that is not red, green or blue, please. " * 10},
    ]
    r = http.post("/v1/chat/completions", json=util.chat_body(messages=turn1, max_tokens=2))
    assert r.status_code == 200, r.text
    first = r.json()["usage"]["prompt_tokens"]
    mid = util.metrics(base)
    turn2 = turn1 + [{"role": "assistant", "content": "Teal"}, {"role": "user", "content": "Another?"}]
    r = http.post("/v1/chat/completions", json=util.chat_body(messages=turn2, max_tokens=2))
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["prompt_tokens"] > first
    after = util.metrics(base)
    reused = after["deltaserve_prompt_tokens_tokenizer_reused_total"] - mid["deltaserve_prompt_tokens_tokenizer_reused_total"]
    # Everything of turn 1 but its generation prompt (`<|im_start|>assistant\n`, a few tokens).
    assert reused >= first - 8, (reused, first)
    assert after["deltaserve_prompt_tokenizer_cache_tokens"] > 0


def test_token_counters_advance_by_usage(base, http):
    before = util.metrics(base)
    r = http.post("/v1/chat/completions", json=util.chat_body(max_tokens=6, **util.greedy()))
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    after = util.metrics(base)
    assert after["deltaserve_prompt_tokens_total"] - before["deltaserve_prompt_tokens_total"] == usage["prompt_tokens"]
    assert (after["deltaserve_generation_tokens_total"] - before["deltaserve_generation_tokens_total"]
            == usage["completion_tokens"])
    assert after["deltaserve_request_ttft_seconds_count"] >= before["deltaserve_request_ttft_seconds_count"] + 1
    assert after["deltaserve_requests_total"] >= before["deltaserve_requests_total"] + 1


def test_models(http):
    r = http.get("/v1/models")
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list"
    assert len(body["data"]) == 1
    m = body["data"][0]
    assert m["id"] == util.MODEL
    assert m["object"] == "model"
    assert m["owned_by"] == "deltaserve"
    assert isinstance(m["max_model_len"], int) and m["max_model_len"] > 0


def test_props_in_llama_servers_shape(base, http):
    """GET /props: the context, slots, chat template and modalities where llama.cpp's clients read them."""
    p = http.get("/props")
    assert p.status_code == 200, p.text
    p = p.json()
    m = http.get("/v1/models").json()["data"][0]
    assert p["default_generation_settings"]["n_ctx"] == m["max_model_len"]
    assert p["total_slots"] == 8, "the main server runs --max-seqs 8"
    assert "<|im_start|>" in p["chat_template"]
    assert p["model_path"] == util.MODEL
    assert isinstance(p["modalities"]["vision"], bool) and p["modalities"]["audio"] is False
    params = p["default_generation_settings"]["params"]
    assert {"temperature", "top_k", "top_p", "min_p", "repeat_penalty"} <= set(params)
    assert httpx.get(f"{base}/props", timeout=10).status_code == 401, "behind the API key"


def test_models_with_sdk(oai):
    ids = [m.id for m in oai.models.list()]
    assert ids == [util.MODEL]


def test_retrieve_model_with_sdk(oai, http):
    m = oai.models.retrieve(util.MODEL)
    assert (m.id, m.object, m.owned_by) == (util.MODEL, "model", "deltaserve")
    with pytest.raises(openai.NotFoundError):
        oai.models.retrieve("gpt-9")
    util.assert_openai_error(http.get("/v1/models/gpt-9"), 404)


@pytest.mark.parametrize("headers", [
    {},
    {"Authorization": "Bearer wrong-key"},
    {"Authorization": "test-key"},
    {"Authorization": "Basic dGVzdC1rZXk6"},
    {"x-api-key": "wrong-key"},
], ids=["missing", "wrong-bearer", "no-bearer-prefix", "basic", "wrong-x-api-key"])
@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/models"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/v1/completions"),
])
def test_openai_auth_rejected(base, headers, method, path):
    body = util.chat_body() if "chat" in path else {"model": util.MODEL, "prompt": "hi", "max_tokens": 2}
    r = httpx.request(method, f"{base}{path}", headers=headers, json=body if method == "POST" else None, timeout=10)
    util.assert_openai_error(r, 401)


def test_x_api_key_accepted_on_openai_routes(base):
    r = httpx.get(f"{base}/v1/models", headers={"x-api-key": util.API_KEY}, timeout=10)
    assert r.status_code == 200, r.text


def test_anthropic_auth_rejected(base):
    body = {"model": util.MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for headers in ({}, {"x-api-key": "nope", "anthropic-version": "2023-06-01"}):
        r = httpx.post(f"{base}/v1/messages", headers=headers, json=body, timeout=10)
        assert r.status_code == 401, r.text
        body_json = r.json()
        # Anthropic-style error body on the Anthropic route.
        assert body_json.get("type") == "error" and body_json["error"]["type"] == "authentication_error", body_json


def test_sdk_auth_error(base):
    c = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0, timeout=10)
    with pytest.raises(openai.AuthenticationError):
        c.models.list()


@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/nope"),
    ("POST", "/v1/nope"),
    ("GET", "/nope"),
    ("POST", "/v1/chat/completion"),
])
def test_unknown_route_404(base, method, path):
    r = httpx.request(method, f"{base}{path}", headers=util.OPENAI_HEADERS, json={} if method == "POST" else None,
                      timeout=10)
    assert r.status_code == 404, r.text


def test_wrong_method_is_4xx(base):
    r = httpx.get(f"{base}/v1/chat/completions", headers=util.OPENAI_HEADERS, timeout=10)
    assert r.status_code in (404, 405), r.text
