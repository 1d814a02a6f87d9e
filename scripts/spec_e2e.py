#!/usr/bin/env python3
"""spec_e2e.py — speculative decoding end to end through the server, on a GPU machine or the CPU (stdlib only).

For each synthetic tiny model (a random MTP head: drafts rejected; agreeing heads: drafts accepted), serves
it with `--speculative-tokens K` for K in 0 (off), 1, 3 and sends the same greedy completions (several at
once, so they batch; one long prompt, so it is chunked) twice — the second round restores each prompt from
the prefix cache (DeltaNet state snapshot with the MTP head's pending row, shared KV pages) — then compares
every output with K = 0's first round and reads the acceptance counters from /metrics. Greedy outputs must be identical token for token, except where the
two forwards' bf16 logits tie (the verify runs the main model over K + 1 positions, plain decode over one:
GEMM shapes differ, so the last bits do): a divergence passes only where the K = 0 run's top-2 logprobs at
that token are within TIE nats of each other; each is reported with its position and margin.

usage: spec_e2e.py DELTASERVE_BIN OUT_JSON [--device cuda]
"""
import json
import subprocess
import sys
import threading
import time
import urllib.request

BIN, OUT = sys.argv[1], sys.argv[2]
DEVICE = sys.argv[4] if len(sys.argv) > 4 and sys.argv[3] == "--device" else "cuda"
MODELS = [("random", None), ("agreeing-0", 0.0), ("agreeing-0.3", 0.3)]
KS = [0, 1, 3]
MAX_TOKENS = 48
TIE = 0.05
PROMPTS = [[(i * 37 + 5 + 11 * j) % 900 + 3 for i in range(n)] for j, n in enumerate([5, 17, 64, 700])]


def http(port, path, body=None):
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=None if body is None else json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        data = r.read().decode()
    return json.loads(data) if path.startswith("/v1") else data


def complete(port, prompt, out, i, logprobs):
    try:
        body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True}
        if logprobs:
            body["logprobs"] = 2
        r = http(port, "/v1/completions", body)
        c = r["choices"][0]
        cached = (r.get("usage", {}).get("prompt_tokens_details") or {}).get("cached_tokens", 0)
        out[i] = (c["text"], c.get("logprobs"), cached)
    except Exception as e:  # a failed request fails the run
        out[i] = (f"ERROR {e}", None, 0)


def run(model_dir, k, port):
    cmd = [BIN, "serve", "--device", DEVICE, "--model", model_dir, "--port", str(port), "--served-model-name", "m",
           "--memory", "2GiB", "--max-seqs", "8", "--snapshot-interval", "16"]
    if k:
        cmd += ["--speculative-tokens", str(k)]
    log = open(f"/tmp/spec_serve_{port}.log", "w")
    p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    try:
        for _ in range(600):
            try:
                http(port, "/health")
                break
            except Exception:
                if p.poll() is not None:
                    raise RuntimeError(f"server exited: {open(log.name).read()[-2000:]}")
                time.sleep(0.2)
        outs = []
        t0 = time.time()
        for _round in range(2):
            o = [None] * len(PROMPTS)
            ts = [threading.Thread(target=complete, args=(port, pr, o, i, True)) for i, pr in enumerate(PROMPTS)]
            [t.start() for t in ts]
            [t.join() for t in ts]
            outs += o
        wall = time.time() - t0
        # A sampling request (rejection sampling against the head's distribution): it must complete.
        try:
            r = http(port, "/v1/completions", {"model": "m", "prompt": PROMPTS[1], "max_tokens": MAX_TOKENS,
                                                "temperature": 0.8, "top_p": 0.95, "seed": 7, "ignore_eos": True})
            sampled = r["usage"]["completion_tokens"]
        except Exception as e:
            sampled = f"ERROR {e}"
        metrics = {}
        for line in http(port, "/metrics").splitlines():
            if line.startswith("deltaserve_spec_decode_"):
                name, val = line.rsplit(" ", 1)
                metrics[name] = float(val)
        return outs, metrics, wall, sampled
    finally:
        p.terminate()
        p.wait(timeout=30)


def main():
    report = {"device": DEVICE, "max_tokens": MAX_TOKENS, "prompt_lens": [len(p) for p in PROMPTS], "models": []}
    port = 18100
    ok = True
    for name, agree in MODELS:
        d = f"/tmp/spec_model_{name}"
        cmd = [BIN, "synth", "--preset", "tiny", "--out", d, "--seed", "5"]
        if agree is not None:
            cmd += ["--mtp-agreeing", str(agree)]
        subprocess.run(cmd, check=True, capture_output=True)
        base = None
        entry = {"model": name, "runs": []}
        for k in KS:
            port += 1
            outs, metrics, wall, sampled = run(d, k, port)
            if k == 0:
                base = outs[:len(PROMPTS)]
            diverged = []
            for i, ((o, olp, _), (b, lp, _)) in enumerate(zip(outs, base + base)):
                if o != b:
                    # The first differing token (token texts: different token sequences may spell the same
                    # text for a while), and the K = 0 run's top-2 margin there.
                    ot, bt = olp["tokens"], lp["tokens"]
                    tok = next((j for j, (x, y) in enumerate(zip(ot, bt)) if x != y), min(len(ot), len(bt)))
                    top = sorted(lp["top_logprobs"][tok].values(), reverse=True)
                    margin = top[0] - top[1] if len(top) > 1 else float("inf")
                    mine = sorted(olp["top_logprobs"][tok].values(), reverse=True)
                    diverged.append({"prompt": i % len(PROMPTS), "round": 1 + i // len(PROMPTS), "token": tok,
                                     "top2_margin": round(margin, 4),
                                     "base_top2": [round(x, 4) for x in top[:2]],
                                     "spec_top2": [round(x, 4) for x in mine[:2]]})
            cached = [c for _, _, c in outs[len(PROMPTS):]]
            run_r = {"k": k, "wall_s": round(wall, 3), "identical": len(outs) - len(diverged), "of": len(outs),
                     "round2_cached_tokens": cached, "diverged": diverged, "sampled_tokens": sampled,
                     "metrics": metrics}
            entry["runs"].append(run_r)
            print(name, "K", k, json.dumps(run_r), flush=True)
            if any(d["top2_margin"] >= TIE for d in diverged) or any(o.startswith("ERROR") for o, _, _ in outs):
                ok = False
            if sampled != MAX_TOKENS:
                print(name, "K", k, f"FAILED: the sampling request gave {sampled}", flush=True)
                ok = False
            if not any(cached):
                print(name, "K", k, "FAILED: no prefix-cache hit in the second round", flush=True)
                ok = False
        report["models"].append(entry)
    report["passed"] = ok
    json.dump(report, open(OUT, "w"), indent=1)
    print("passed" if ok else "FAILED")


main()
