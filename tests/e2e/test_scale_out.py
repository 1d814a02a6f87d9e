"""Scale-out: 3 demo replicas behind the Shepherd Model Gateway (`smg`), started by `scripts/scale-out`.

- 6 concurrent agent sessions × 8 turns (`deltaserve soak --sessions 6` through the gateway) keep ≥ 95% of
  each previous prompt cached from turn 2 on with the script's default policy; a second gateway with
  round_robin in front of the same replicas (started with --worker-url, the several-hosts mode over
  loopback) gives the baseline, printed beside it;
- one replica killed mid-run: every request that was not in flight on it succeeds, every session
  completes, and a session re-prefills at most once;
- SIGINT stops the gateway and every replica, and the launcher exits 0.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

import util

SCRIPT = util.REPO_ROOT / "scripts" / "scale-out"
SMG = Path(sys.executable).parent / "smg"
REPLICAS = 3
SESSIONS = 6
TURNS = 8
REPLICA_ARGS = ["--served-model-name", util.MODEL, "--max-seqs", "4", "--max-batch-tokens", "256"]
READY_TIMEOUT = 120.0


def free_ports(n: int) -> int:
    """The first of `n` consecutive free ports on 127.0.0.1."""
    for _ in range(50):
        base = util.free_port()
        if base + n >= 65535:
            continue
        try:
            socks = []
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((util.HOST, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no {n} consecutive free ports")


class Launcher:
    """One `scripts/scale-out` process; its log is on disk."""

    def __init__(self, args: list[str], log: Path):
        self.log = log
        self.port = util.free_port()
        env = {**os.environ, "DELTASERVE_BIN": str(util.server_binary()), "SMG_BIN": str(SMG), "RUST_LOG": "info",
               "NO_COLOR": "1"}
        cmd = [sys.executable, str(SCRIPT), "--port", str(self.port), "--api-key", util.API_KEY,
               "--gateway-metrics-port", str(util.free_port()),
               "--health-interval", "1", "--log-dir", str(log.parent / log.stem), *args]
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(cmd, stdout=self._out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     env=env, cwd=util.REPO_ROOT)
        deadline = time.monotonic() + READY_TIMEOUT
        while "scale-out: ready:" not in self.text():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.proc.kill()
                raise RuntimeError(f"scripts/scale-out did not become ready\n{self.text()[-4000:]}")
            time.sleep(0.2)

    @property
    def base(self) -> str:
        return f"http://{util.HOST}:{self.port}"

    def text(self) -> str:
        return self.log.read_text(errors="replace")

    def pids(self) -> dict[str, int]:
        return {m.group(1): int(m.group(2)) for m in re.finditer(r"(replica-\d+) has pid (\d+)", self.text())}

    def stop(self) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                return None
        self._out.close()
        return self.proc.returncode


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    if not SMG.exists():
        pytest.fail(f"{SMG} is missing: tests/e2e/requirements.txt pins smg", pytrace=False)
    tmp = tmp_path_factory.mktemp("scale-out")
    base = free_ports(REPLICAS)
    launcher = Launcher(["--replicas", str(REPLICAS), "--replica-port", str(base), "--", *REPLICA_ARGS],
                        tmp / "launcher.log")
    urls = [f"http://{util.HOST}:{base + i}" for i in range(REPLICAS)]
    yield launcher, urls, tmp
    pids = launcher.pids()
    code = launcher.stop()
    assert code == 0, f"scripts/scale-out exited with {code} after SIGINT\n{launcher.text()[-3000:]}"
    for name, pid in pids.items():
        alive = Path(f"/proc/{pid}").exists() and "zombie" not in Path(f"/proc/{pid}/status").read_text().lower()
        assert not alive, f"{name} (pid {pid}) still runs after the launcher stopped"


def soak(gateway: str, replicas: list[str], seed: int) -> dict:
    cmd = [str(util.server_binary()), "soak", "--url", gateway, "--api-key", util.API_KEY,
           "--sessions", str(SESSIONS), "--turns", str(TURNS), "--target-context", "900", "--max-tokens", "8",
           "--seed", str(seed), "--request-timeout-secs", "60", "--json"]
    for r in replicas:
        cmd += ["--metrics-url", r]
    out = subprocess.run(cmd, capture_output=True, timeout=300, env={**os.environ, "RUST_LOG": "warn", "NO_COLOR": "1"})
    try:
        return json.loads(out.stdout)
    except ValueError:
        raise AssertionError(f"soak printed no JSON (exit {out.returncode})\n{out.stderr.decode()[-3000:]}")


def figures(report: dict) -> str:
    sessions = report["sessions"]
    fractions = [s["cached_fraction_of_previous_context"] or 0.0 for s in sessions]
    ttft = [s["follow_up_ttft_ms_mean"] or 0.0 for s in sessions]
    return (f"cached {100 * sum(fractions) / len(fractions):.1f}% of the previous prompt (worst session "
            f"{100 * min(s['min_cached_fraction_of_previous_context'] or 0.0 for s in sessions):.1f}%), "
            f"follow-up TTFT {sum(ttft) / len(ttft):.0f} ms")


def test_sessions_stay_where_their_cache_is(fleet):
    launcher, replicas, tmp = fleet
    report = soak(launcher.base, replicas, seed=0)
    baseline = Launcher(["--replicas", "0", "--policy", "round_robin", "--no-sticky",
                         *[f"--worker-url={u}" for u in replicas]], tmp / "round-robin.log")
    try:
        rr = soak(baseline.base, replicas, seed=100)
    finally:
        assert baseline.stop() == 0, baseline.text()[-3000:]
    print(f"\n{SESSIONS} sessions x {TURNS} turns on {REPLICAS} replicas, default policy: {figures(report)}")
    print(f"{SESSIONS} sessions x {TURNS} turns, round_robin: {figures(rr)}")

    assert report["summary"]["ok"], json.dumps(report["summary"], indent=1)
    completions = sum(t["completion_tokens"] for t in report["turns"])
    assert report["summary"]["generated_tokens"] == completions > 0, report["summary"]
    assert report["summary"]["generated_tokens_per_s"] > 0, report["summary"]
    assert len(report["sessions"]) == SESSIONS
    for s in report["sessions"]:
        assert s["turns"] == TURNS, s
        assert s["min_cached_fraction_of_previous_context"] >= 0.95, s
    # The gateway spread the sessions: more than one replica prefilled prompts.
    busy = [r for r in report["replicas"] if r["prompt_tokens"]]
    assert len(busy) >= 2, report["replicas"]


def chat(c: httpx.Client, session: str, messages: list[dict]) -> dict:
    r = c.post("/v1/chat/completions", headers={"x-session-id": session},
               json={"model": util.MODEL, "messages": messages, "max_tokens": 8, "temperature": 0})
    r.raise_for_status()
    return r.json()


def test_a_killed_replica_is_routed_around(fleet):
    launcher, replicas, _ = fleet
    log: list[tuple[float, float, str, bool, str]] = []  # (start, end, session, ok, detail)
    killed_at: list[float] = []
    done = threading.Semaphore(0)

    def session(i: int) -> list[float]:
        """Runs the session; returns the cached fraction of the previous prompt for turns 2.."""
        key = f"kill-{i}"
        messages = [{"role": "system", "content": f"You are agent {i}. Work step by step."}]
        fractions, prev_prompt = [], 0
        with util.client(launcher.base) as c:
            for turn in range(1, TURNS + 1):
                messages.append({"role": "user", "content": f"Step {turn} of task {i}: " + " ".join(
                    f"item-{i}-{turn}-{k}" for k in range(40))})
                for attempt in range(2):
                    t0 = time.monotonic()
                    try:
                        reply = chat(c, key, messages)
                        log.append((t0, time.monotonic(), key, True, ""))
                        break
                    except httpx.HTTPError as e:
                        detail = getattr(getattr(e, "response", None), "text", "") or repr(e)
                        log.append((t0, time.monotonic(), key, False, detail[:300]))
                        if attempt == 1:
                            raise
                usage = reply["usage"]
                if prev_prompt:
                    fractions.append(usage["prompt_tokens_details"]["cached_tokens"] / prev_prompt)
                prev_prompt = usage["prompt_tokens"]
                messages.append({"role": "assistant", "content": reply["choices"][0]["message"]["content"] or ""})
                done.release()
        return fractions

    victim = "replica-1"
    pid = launcher.pids()[victim]
    with ThreadPoolExecutor(SESSIONS) as pool:
        futures = [pool.submit(session, i) for i in range(SESSIONS)]
        for _ in range(SESSIONS * 3):  # kill it once half the turns are done
            assert done.acquire(timeout=120), "the sessions stalled before the kill"
        killed_at.append(time.monotonic())
        subprocess.run(["kill", "-9", str(pid)], check=True)
        results = [f.result(timeout=240) for f in futures]

    kill = killed_at[0]
    failed = [e for e in log if not e[3]]
    not_in_flight = [e for e in failed if not (e[0] <= kill <= e[1])]
    assert not not_in_flight, f"requests failed that were not in flight on the killed replica: {not_in_flight}"
    assert all(len(r) == TURNS - 1 for r in results), results
    moved = 0
    for i, fractions in enumerate(results):
        # A session that lived on the killed replica re-prefills once, on another one.
        misses = [f for f in fractions if f < 0.95]
        assert len(misses) <= 1, f"session {i}: cached fractions {fractions}"
        moved += len(misses)
    print(f"\nreplica killed mid-run: {len(failed)} request(s) failed (in flight on it), "
          f"{len(log) - len(failed)} succeeded, {moved} session(s) re-prefilled once on another replica")
    assert moved >= 1, "no session lived on the killed replica: the kill tested nothing"
    # The gateway no longer lists the dead replica as healthy.
    with util.client(launcher.base) as c:
        healthy = [w["url"] for w in c.get("/workers").json().get("workers", []) if w.get("is_healthy")]
    assert len(healthy) == REPLICAS - 1, healthy


def test_replicas_on_gpus_split_a_shared_card(monkeypatch):
    """One replica per listed GPU; replicas sharing a card split it unless the memory is given."""
    import importlib.util
    from importlib.machinery import SourceFileLoader
    loader = SourceFileLoader("scale_out", str(SCRIPT))
    launcher = importlib.util.module_from_spec(importlib.util.spec_from_loader("scale_out", loader))
    loader.exec_module(launcher)
    monkeypatch.setenv("DELTASERVE_BIN", "/opt/deltaserve")

    def plan(*argv: str) -> list[tuple[str, str, list[str]]]:
        a, serve_args = launcher.parse_args(list(argv))
        return [(url, env.get("CUDA_VISIBLE_DEVICES"), cmd) for url, cmd, env in
                launcher.replica_commands(a, serve_args)]

    one_each = plan("--gpus", "0,1", "--replica-port", "9001", "--", "--model", "/m")
    assert [(u, g) for u, g, _ in one_each] == [("http://127.0.0.1:9001", "0"), ("http://127.0.0.1:9002", "1")]
    assert all("--gpu-memory-utilization" not in c and c[-2:] == ["--model", "/m"] for _, _, c in one_each)
    shared = plan("--gpus", "0", "--replicas", "2", "--", "--model", "/m")
    assert [g for _, g, _ in shared] == ["0", "0"]
    assert all(c[-2:] == ["--gpu-memory-utilization", "0.460"] for _, _, c in shared)
    sized = plan("--gpus", "0", "--replicas", "2", "--", "--memory", "40GiB")
    assert all("--gpu-memory-utilization" not in c for _, _, c in sized)
    with pytest.raises(SystemExit):
        plan("--replicas", "0")  # neither replicas nor --worker-url
