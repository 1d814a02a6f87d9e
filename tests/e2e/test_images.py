"""Images in chat requests on the built-in demo model (its tiny vision tower runs on the CPU backend): answered
through the OpenAI and Anthropic clients, counted (image tokens included), fetched from allowed hosts only, every
refusal a 400 that names the part; in the prefix cache the same image in the next turn is a hit and a different
image of the same size is not."""

from __future__ import annotations

import base64
import http.server
import struct
import threading
import zlib

import anthropic
import openai
import pytest

import conftest
import util

LIMIT = 2
ARGS = ["--api-key", util.API_KEY, "--served-model-name", util.MODEL, "--max-context", "256", "--max-seqs", "2",
        "--allowed-media-domains", "127.0.0.1", "--limit-images-per-request", str(LIMIT)]


def png(width: int, height: int, shift: int = 0) -> bytes:
    """An RGB PNG of a gradient (`shift` moves its values)."""
    row = lambda y: b"\x00" + bytes((x * 7 + y * 3 + shift) & 255 for x in range(width * 3))  # noqa: E731
    raw = b"".join(row(y) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b"")


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


# Qwen3.5's image processor: 32-pixel merge windows, at least 256 × 256 pixels; 256 × 256 is 64 image tokens.
SMALL = png(256, 256)
WIDE = png(512, 256)  # 128 tokens
BMP = b"BM" + b"\x00" * 60


@pytest.fixture(scope="module")
def image_server(tmp_path_factory):
    yield from conftest.run_server(tmp_path_factory, "images", ARGS)


@pytest.fixture(scope="module")
def image_host():
    """A local HTTP server: /small.png is SMALL, anything else a 404. Yields (base URL, paths requested)."""
    seen: list[str] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            seen.append(self.path)
            body, status = (SMALL, 200) if self.path == "/small.png" else (b"missing", 404)
            self.send_response(status)
            self.send_header("Content-Type", "image/png")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer((util.HOST, 0), Handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://{util.HOST}:{srv.server_address[1]}", seen
    srv.shutdown()


@pytest.fixture(scope="module")
def claude(image_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=image_server.base, api_key=util.API_KEY, max_retries=0,
                               timeout=util.REQUEST_TIMEOUT)


@pytest.fixture(scope="module")
def gpt(image_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{image_server.base}/v1", api_key=util.API_KEY, max_retries=0,
                         timeout=util.REQUEST_TIMEOUT)


def b64_block(data: bytes) -> dict:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                        "data": base64.b64encode(data).decode()}}


def count(claude, *blocks) -> int:
    content = [{"type": "text", "text": "What is in the picture?"}, *blocks]
    return claude.messages.count_tokens(model=util.MODEL, messages=[{"role": "user", "content": content}]).input_tokens


def test_count_tokens_counts_each_images_tokens(claude):
    text_only = count(claude)
    # Each image: <|vision_start|>, its image tokens, <|vision_end|>.
    assert count(claude, b64_block(SMALL)) == text_only + 2 + 64
    assert count(claude, b64_block(WIDE)) == text_only + 2 + 128
    assert count(claude, b64_block(SMALL), b64_block(WIDE)) == text_only + 4 + 64 + 128


def test_a_url_from_an_allowed_host_is_fetched(claude, image_host):
    base, seen = image_host
    by_url = count(claude, {"type": "image", "source": {"type": "url", "url": f"{base}/small.png"}})
    assert "/small.png" in seen
    assert by_url == count(claude, b64_block(SMALL))


def chat_refusal(gpt, *parts, role="user") -> str:
    content = [{"type": "text", "text": "Describe it."}, *parts]
    with pytest.raises(openai.BadRequestError) as e:
        gpt.chat.completions.create(model=util.MODEL, max_tokens=4, messages=[{"role": role, "content": content}])
    assert e.value.status_code == 400
    return str(e.value)


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


def test_an_image_chat_is_answered(gpt, claude):
    content = [{"type": "text", "text": "Describe it."}, image_part(data_url(SMALL))]
    resp = gpt.chat.completions.create(model=util.MODEL, max_tokens=4, temperature=0,
                                       messages=[{"role": "user", "content": content}],
                                       extra_body={"ignore_eos": True})
    assert resp.choices[0].finish_reason == "length"
    assert resp.usage.completion_tokens == 4
    assert resp.usage.prompt_tokens > 64, "the image's 64 tokens are in the prompt"

    msg = claude.messages.create(model=util.MODEL, max_tokens=4,
                                 messages=[{"role": "user", "content": [b64_block(SMALL)]}])
    assert msg.stop_reason in ("max_tokens", "end_turn")
    assert msg.usage.output_tokens >= 1
    assert msg.usage.input_tokens > 64


# Turn 1 ends right after its prompt (one generated token, which is never fed) and its state is kept; with the
# thinking block kept in the history, turn 2's prompt begins with the whole of turn 1's.
NEXT_TURN = {"ignore_eos": True, "chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}


def chat_turns(gpt, image: bytes, first: bool) -> tuple[int, int]:
    """(prompt tokens, cached prompt tokens) of a turn with `image` in the first user message."""
    messages = [{"role": "user", "content": [{"type": "text", "text": "Look at this picture."},
                                             image_part(data_url(image))]}]
    if not first:
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": "And now?"}]
    resp = gpt.chat.completions.create(model=util.MODEL, max_tokens=1, temperature=0, messages=messages,
                                       extra_body=NEXT_TURN)
    return resp.usage.prompt_tokens, resp.usage.prompt_tokens_details.cached_tokens


def test_the_same_image_next_turn_is_cached_and_another_is_not(gpt, image_server):
    image, other = png(256, 256, shift=1), png(256, 256, shift=90)  # same size, other pixels
    hits = util.metrics(image_server.base).get("deltaserve_image_cache_hits_total", 0.0)
    first, _ = chat_turns(gpt, image, first=True)
    prompt, cached = chat_turns(gpt, image, first=False)
    assert prompt > first and cached >= first, (first, prompt, cached)
    # The second turn's image was not decoded and patched again: the processed-image cache had it.
    assert util.metrics(image_server.base)["deltaserve_image_cache_hits_total"] >= hits + 1
    # Another image of the same size: the same tokens, but its rows are not the cached image's.
    prompt_other, cached_other = chat_turns(gpt, other, first=False)
    assert prompt_other == prompt
    assert cached_other < 8, cached_other


@pytest.mark.parametrize("part,mentions", [
    (image_part("data:image/png;base64,aGVsbG8="), "could not be decoded"),
    (image_part(data_url(BMP, "image/bmp")), "unsupported image format BMP"),
    (image_part(data_url(png(1, 300))), "aspect ratio"),
    (image_part("data:image/png;base64,@@@"), "invalid base64"),
    (image_part("ftp://127.0.0.1/a.png"), "unsupported image URL"),
    ({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}, "not supported yet"),
], ids=["undecodable", "bmp", "aspect", "base64", "scheme", "video"])
def test_bad_image_parts_are_refused_naming_the_part(gpt, part, mentions):
    message = chat_refusal(gpt, part)
    assert "messages[0].content[1]" in message and mentions in message, message


def test_images_outside_user_messages_are_refused(gpt):
    message = chat_refusal(gpt, image_part(data_url(SMALL)), role="system")
    assert "messages[0].content[1]" in message and "user messages only" in message, message


def test_more_images_than_the_limit_are_refused(gpt):
    message = chat_refusal(gpt, *[image_part(data_url(SMALL))] * (LIMIT + 1))
    assert f"at most {LIMIT}" in message and "--limit-images-per-request" in message, message


def test_image_tokens_over_the_context_are_refused(gpt):
    message = chat_refusal(gpt, image_part(data_url(png(512, 512))))  # 256 image tokens, context 256
    assert "more than the context of 256 tokens" in message and "256 of them" in message, message


def test_fetch_failures_name_the_part(gpt, image_host):
    base, _ = image_host
    message = chat_refusal(gpt, image_part(f"{base}/missing.png"))
    assert "messages[0].content[1]" in message and "HTTP status 404" in message, message


def test_urls_are_refused_until_their_host_is_allowed(oai, image_host):
    """The main server has no --allowed-media-domains: only data: URLs."""
    base, seen = image_host
    before = len(seen)
    message = chat_refusal(oai, image_part(f"{base}/small.png"))
    assert "not allowed" in message and "--allowed-media-domains" in message, message
    assert len(seen) == before
