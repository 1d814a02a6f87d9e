#!/usr/bin/env bash
# gpu_final.sh — one device call that checks and measures everything GPU-side (device tool `run`).
#   Here:  cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#          scripts/gpu_final.sh --stage            # copies the binaries into .carry/final/
#   There: (carry [".carry/final"]) scripts/gpu_final.sh   # logs and JSON/SVG to $OUT
# Steps, each under its own timeout, in order of importance (STEPS=ops,backend,bench,soak,probe):
#   ops      every kernel against the CPU reference (random inputs, poisoned outputs, awkward sizes)
#   backend  CudaBackend against the CPU engine (logits, batching, snapshots, CUDA graphs, arena)
#   bench    `deltaserve bench`: ceilings, prefill 1K..262K, decode b1/8/32 at 1K/32K, snapshots, memory
#   soak     27B random weights, a 12-turn agent session to SOAK_TARGET tokens (default 131072)
#   probe    27B random weights, the ceiling ladder at the full 262,144 context
#   probe24  27B random int4 weights, fp8 KV, --memory 24GiB: the ladder at 262,144 (issue #6)
#   bench24  `deltaserve bench` in the same 24 GiB configuration (4-bit prefill / decode targets)
set -uo pipefail
C=.carry/final
source "$(dirname "$0")/gpu_steps.sh"
gpu_begin "${1:-}" "$C" gpu_final ops,backend,bench,soak,probe ops backend
# Logs in $OUT, packed into $OUT/gpu_final.tgz after each step (scripts/gpu_steps.sh).
SOAK_TARGET="${SOAK_TARGET:-131072}"
test_step ops 120 "FAIL|test result|panicked" "$C/ops" --nocapture --test-threads=1 ops_match_cpu_reference
test_step backend 180 "^test |test result|panicked|FAIL" "$C/backend" --nocapture --test-threads=1 \
    --skip hf_fixtures_logits
if has bench; then
    step bench
    timeout 330 "$C/deltaserve" bench --json --svg "$OUT/bench.svg" >"$OUT/bench.json" 2>"$OUT/bench.log"
    echo "rc=$?"; tail -n 3 "$OUT/bench.log"
    python3 - "$OUT/bench.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print("ceilings", d["ceilings"])
for r in d["prefill"]: print("prefill", r["tokens"], r["tokens_per_s"], "tok/s", r["tflops"], "TFLOP/s", r["roofline_ratio"], r["driver_peak_bytes"])
for r in d["decode"]: print("decode b", r["batch"], "ctx", r["context"], r["ms_per_step"], "ms", r["roofline_ratio"])
print("snapshots", d.get("snapshots_ms"), "plan", d["plan_bytes"], "driver peak", d["driver_peak_bytes"], d["skipped"])
PY
fi
if has soak; then
    step soak
    timeout 300 "$C/deltaserve" soak --device cuda --preset qwen3.6-27b --random-weights --max-seqs 4 \
        --turns 12 --target-context "$SOAK_TARGET" --json --svg "$OUT/soak-27b.svg" >"$OUT/soak-27b.json" 2>"$OUT/soak-27b.log"
    echo "rc=$?"; tail -n 2 "$OUT/soak-27b.log"
    python3 - "$OUT/soak-27b.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for t in d["turns"]: print(t["turn"], t["prompt_tokens"], t["cached_tokens"], t["new_tokens"], round(t["ttft_ms"], 1), round(t["ttft_per_new_token_ms"], 4))
print(d["summary"])
PY
fi
if has probe; then
    step probe
    timeout "${PROBE_TIMEOUT:-240}" "$C/deltaserve" probe --device cuda --preset qwen3.6-27b --random-weights --max-seqs 4 \
        --rungs "${PROBE_RUNGS:-25,50,100}" --turns "${PROBE_TURNS:-3}" --json --svg "$OUT/probe-27b.svg" >"$OUT/probe-27b.json" 2>"$OUT/probe-27b.log"
    echo "rc=$?"; tail -n 2 "$OUT/probe-27b.log"
    python3 -c "import json,sys; d=json.load(open('$OUT/probe-27b.json')); [print(r) for r in d['rungs']+d['turns']]; print(d['passed'], d['failures'], d['plan_bytes'])" || true
fi
Q24="--preset qwen3.6-27b --random-weights --weights-dtype int4 --kv-cache-dtype fp8 --memory 24GiB"
if has probe24; then
    step probe24
    timeout "${PROBE24_TIMEOUT:-300}" "$C/deltaserve" probe --device cuda $Q24 --rungs "${PROBE24_RUNGS:-25,100}" \
        --turns "${PROBE24_TURNS:-2}" --json --svg "$OUT/probe-24g.svg" >"$OUT/probe-24g.json" 2>"$OUT/probe-24g.log"
    echo "rc=$?"; grep -E "memory plan|fit|WARN|ERROR|error" "$OUT/probe-24g.log" | head -5; tail -n 2 "$OUT/probe-24g.log"
    python3 -c "import json,sys; d=json.load(open('$OUT/probe-24g.json')); [print(r) for r in d['rungs']+d['turns']]; print(d['passed'], d['failures'], d['plan_bytes'], d['idle_driver_bytes'])" || true
fi
if has bench24; then
    step bench24
    timeout "${BENCH24_TIMEOUT:-120}" "$C/deltaserve" bench --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --embed-on-host \
        --memory 24GiB --prompts 4096,32768 --batches 1,8 --contexts 1024,32768 --json >"$OUT/bench-24g.json" 2>"$OUT/bench-24g.log"
    echo "rc=$?"; tail -n 2 "$OUT/bench-24g.log"
    python3 -c "import json; d=json.load(open('$OUT/bench-24g.json')); print(d['model']); [print('prefill', r['tokens'], r['tokens_per_s'], r['roofline_ratio']) for r in d['prefill']]; [print('decode', r['batch'], r['context'], r['ms_per_step'], r['roofline_ratio']) for r in d['decode']]; print(d['plan_bytes'], d['driver_peak_bytes'], d['skipped'])" || true
fi
step done
