"""Fixtures for the end-to-end suite: real `deltaserve serve` processes on 127.0.0.1 (built-in demo model).

- `server`: the main server for the whole session (8 sequences, 256-token batches).
- `small_server`: a server with tiny limits (256-token context, 1 running + 1 waiting request), per module; it
  also has a default thinking budget of 3 tokens and takes cross-origin calls from one origin only.
Both are stopped with SIGINT at teardown, which must end the process with exit code 0 within 15 s.
"""

from __future__ import annotations

import openai
import pytest

import util

MAIN_ARGS = ["--api-key", util.API_KEY, "--served-model-name", util.MODEL, "--max-seqs", "8",
             "--max-batch-tokens", "256"]
SMALL_ARGS = ["--api-key", util.API_KEY, "--served-model-name", util.MODEL, "--max-context", "256",
              "--max-seqs", "1", "--max-waiting", "1", "--max-batch-tokens", "256", "--reasoning-budget", "3",
              "--allowed-origins", "https://chat.example.com"]


def run_server(tmp_path_factory, name: str, args: list[str]):
    log = tmp_path_factory.mktemp(name) / "server.log"
    srv = util.Server(args=args, log_path=log)
    try:
        srv.start()
    except Exception as e:
        pytest.fail(f"could not start `deltaserve serve`: {e}", pytrace=False)
    yield srv
    was_alive = srv.alive()
    code = srv.interrupt(util.SHUTDOWN_TIMEOUT)
    tail = srv.log_tail()
    srv.kill()
    assert was_alive, f"the server died during the tests (exit code {srv.proc.returncode})\n{tail}"
    assert code is not None, f"the server did not exit within {util.SHUTDOWN_TIMEOUT:.0f} s of SIGINT\n{tail}"
    assert code == 0, f"the server exited with code {code} after SIGINT (want 0)\n{tail}"


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    yield from run_server(tmp_path_factory, "main", MAIN_ARGS)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory):
    yield from run_server(tmp_path_factory, "small", SMALL_ARGS)


@pytest.fixture(scope="session")
def base(server) -> str:
    return server.base


@pytest.fixture
def http(base):
    """An httpx client for the main server with the OpenAI bearer key."""
    with util.client(base) as c:
        yield c


@pytest.fixture
def anthropic_http(base):
    with util.client(base, headers=util.ANTHROPIC_HEADERS) as c:
        yield c


@pytest.fixture(scope="session")
def oai(base) -> openai.OpenAI:
    """The official OpenAI SDK against the main server (no retries, bounded timeout)."""
    return openai.OpenAI(base_url=f"{base}/v1", api_key=util.API_KEY, max_retries=0, timeout=util.REQUEST_TIMEOUT)


@pytest.fixture(scope="session")
def max_model_len(base) -> int:
    with util.client(base) as c:
        r = c.get("/v1/models")
    assert r.status_code == 200, r.text
    return int(r.json()["data"][0]["max_model_len"])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """On a failure, append the tail of the server log(s) the test used."""
    outcome = yield
    rep = outcome.get_result()
    if rep.failed and call.when in ("call", "setup"):
        for name in ("server", "small_server"):
            srv = item.funcargs.get(name) if hasattr(item, "funcargs") else None
            if isinstance(srv, util.Server):
                rep.sections.append((f"{name} log", srv.log_tail(15)))
