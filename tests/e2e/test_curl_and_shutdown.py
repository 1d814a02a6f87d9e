"""Raw SSE framing through curl, and graceful shutdown of a server with requests in flight."""

import json
import shutil
import subprocess
import threading
import time

import httpx
import pytest

import util


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_streaming_chat(base):
    body = util.chat_body(stream=True, max_tokens=6, stream_options={"include_usage": True})
    out = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "60", f"{base}/v1/chat/completions",
         "-H", "Content-Type: application/json", "-H", f"Authorization: Bearer {util.API_KEY}",
         "-d", json.dumps(body)],
        capture_output=True, timeout=90, check=True, text=True)
    raw = out.stdout
    assert raw.rstrip("\n").endswith("data: [DONE]"), raw[-300:]
    assert raw.endswith("\n\n"), repr(raw[-20:])
    # Each event is `data: ...` followed by a blank line.
    events = [e for e in raw.replace("\r\n", "\n").split("\n\n") if e.strip()]
    assert events[-1] == "data: [DONE]"
    for ev in events:
        lines = [ln for ln in ev.split("\n") if not ln.startswith(":")]
        assert len(lines) == 1 and lines[0].startswith("data: "), repr(ev)
    chunks = [json.loads(e[len("data: "):]) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] <= 6


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_anthropic_stream(base):
    body = {"model": util.MODEL, "max_tokens": 4, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    out = subprocess.run(
        ["curl", "-sS", "-N", "--max-time", "60", f"{base}/v1/messages", "-H", "content-type: application/json",
         "-H", f"x-api-key: {util.API_KEY}", "-H", "anthropic-version: 2023-06-01", "-d", json.dumps(body)],
        capture_output=True, timeout=90, check=True, text=True)
    events = [e for e in out.stdout.replace("\r\n", "\n").split("\n\n") if e.strip()]
    names = [e.split("\n")[0] for e in events]
    assert names[0] == "event: message_start", names
    assert names[-1] == "event: message_stop", names


def long_stream(base: str, max_tokens: int):
    """The lines of a streamed chat completion of `max_tokens` tokens (EOS ignored)."""
    body = util.chat_body(stream=True, max_tokens=max_tokens, ignore_eos=True)
    with util.client(base, timeout=30) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        yield from r.iter_lines()


def test_graceful_shutdown_with_streams_in_flight(tmp_path):
    """SIGINT while streams run: the process exits 0 within 15 s and every client sees its stream end."""
    from conftest import MAIN_ARGS

    srv = util.Server(args=MAIN_ARGS, log_path=tmp_path / "server.log").start()
    ended = []
    started = threading.Event()
    errors = []

    def stream():
        try:
            for n, _ in enumerate(long_stream(srv.base, 2000)):
                if n == 2:
                    started.set()
            ended.append("eof")
        except httpx.HTTPError as e:
            ended.append(type(e).__name__)
        except Exception as e:  # noqa: BLE001
            errors.append(repr(e))

    threads = [threading.Thread(target=stream, daemon=True) for _ in range(3)]
    try:
        for t in threads:
            t.start()
        assert started.wait(30), "no stream started"
        time.sleep(0.3)
        t0 = time.monotonic()
        code = srv.interrupt(util.SHUTDOWN_TIMEOUT)
        took = time.monotonic() - t0
        for t in threads:
            t.join(timeout=20)
        assert code is not None, f"not exited {util.SHUTDOWN_TIMEOUT:.0f} s after SIGINT\n{srv.log_tail()}"
        assert code == 0, f"exit code {code}\n{srv.log_tail()}"
        assert all(not t.is_alive() for t in threads), "a client stream hung after the server exited"
        assert not errors, errors
        assert len(ended) == 3
        print(f"shutdown took {took:.2f} s; client endings: {ended}")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{srv.base}/health", timeout=2)
    finally:
        srv.kill()


def test_new_requests_during_the_shutdown_grace_get_503(tmp_path):
    """SIGINT with a stream in flight: new connections get a 503 "shutting down" (each API's error body)
    while the stream keeps going; the process exits 0 once the grace is over."""
    import signal

    import anthropic
    import openai
    from conftest import MAIN_ARGS

    grace = 4
    srv = util.Server(args=[*MAIN_ARGS, "--shutdown-grace-secs", str(grace)], log_path=tmp_path / "server.log").start()
    lines_after_signal = []
    signalled = threading.Event()
    started = threading.Event()

    def stream():
        try:
            for n, line in enumerate(long_stream(srv.base, 5000)):
                if n == 2:
                    started.set()
                if signalled.is_set() and line.startswith("data: "):
                    lines_after_signal.append(line)
        except httpx.HTTPError:
            pass  # cancelled at the end of the grace

    t = threading.Thread(target=stream, daemon=True)
    try:
        t.start()
        assert started.wait(30), "the stream did not start"
        srv.proc.send_signal(signal.SIGINT)
        signalled.set()
        deadline = time.monotonic() + 3
        while True:  # the signal is handled asynchronously
            r = httpx.post(f"{srv.base}/v1/chat/completions", json=util.chat_body(), headers=util.OPENAI_HEADERS,
                           timeout=10)
            if r.status_code != 200 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["type"] == "service_unavailable" and "shutting down" in err["message"], err
        assert r.headers.get("connection") == "close"

        oai = openai.OpenAI(base_url=f"{srv.base}/v1", api_key=util.API_KEY, max_retries=0, timeout=10)
        with pytest.raises(openai.APIStatusError) as e:
            oai.models.list()
        assert e.value.status_code == 503
        ant = anthropic.Anthropic(base_url=srv.base, api_key=util.API_KEY, max_retries=0, timeout=10)
        with pytest.raises(anthropic.APIStatusError) as e:
            ant.messages.create(model=util.MODEL, max_tokens=4, messages=[{"role": "user", "content": "hi"}])
        assert e.value.status_code == 503
        assert e.value.body["error"]["type"] == "overloaded_error", e.value.body

        code = srv.proc.wait(timeout=grace + util.SHUTDOWN_TIMEOUT)
        assert code == 0, f"exit code {code}\n{srv.log_tail()}"
        t.join(timeout=10)
        assert not t.is_alive(), "the stream hung after the server exited"
        assert len(lines_after_signal) > 5, f"the stream in flight stopped at the signal\n{srv.log_tail()}"
    finally:
        srv.kill()


def test_shutdown_when_idle_is_quick(tmp_path):
    from conftest import SMALL_ARGS

    srv = util.Server(args=SMALL_ARGS, log_path=tmp_path / "server.log").start()
    try:
        t0 = time.monotonic()
        code = srv.interrupt(util.SHUTDOWN_TIMEOUT)
        assert code == 0, f"exit code {code}\n{srv.log_tail()}"
        assert time.monotonic() - t0 < 5.0, "idle shutdown took more than 5 s"
    finally:
        srv.kill()


def test_sigterm_also_graceful(tmp_path):
    import signal
    from conftest import SMALL_ARGS

    srv = util.Server(args=SMALL_ARGS, log_path=tmp_path / "server.log").start()
    try:
        srv.proc.send_signal(signal.SIGTERM)
        code = srv.proc.wait(timeout=util.SHUTDOWN_TIMEOUT)
        assert code == 0, f"exit code {code} after SIGTERM\n{srv.log_tail()}"
    finally:
        srv.kill()


def test_second_sigint_during_the_grace_exits_at_once(tmp_path):
    """SIGINT with a stream in flight starts a long grace; a second SIGINT ends the process at once with a
    non-zero exit code and a log line saying why."""
    import signal
    from conftest import MAIN_ARGS

    srv = util.Server(args=[*MAIN_ARGS, "--shutdown-grace-secs", "600"], log_path=tmp_path / "server.log").start()
    started = threading.Event()

    def stream():
        try:
            for n, _ in enumerate(long_stream(srv.base, 5000)):
                if n == 2:
                    started.set()
        except httpx.HTTPError:
            pass  # the process exits under it

    t = threading.Thread(target=stream, daemon=True)
    try:
        t.start()
        assert started.wait(30), "the stream did not start"
        srv.proc.send_signal(signal.SIGINT)
        deadline = time.monotonic() + 10
        while "shutting down" not in srv.log_path.read_text(errors="replace") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "shutting down" in srv.log_path.read_text(errors="replace"), srv.log_tail()
        srv.proc.send_signal(signal.SIGINT)
        code = srv.proc.wait(timeout=util.SHUTDOWN_TIMEOUT)  # far inside the 600 s grace
        assert code == 130, f"exit code {code}\n{srv.log_tail()}"
        assert "second SIGINT during the shutdown grace: exiting now" in srv.log_path.read_text(errors="replace")
    finally:
        srv.kill()
