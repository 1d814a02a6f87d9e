#!/usr/bin/env bash
# gpu_tp.sh — tensor parallelism checks and measurements on a 2-GPU machine (device tool `run`,
# kind nvidia-h200-x2), issue #9.
#   Here:  cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#          scripts/gpu_tp.sh --stage           # copies the binaries into .carry/tp/
#   There: (carry [".carry/tp"]) STEPS=... scripts/gpu_tp.sh
# Steps (STEPS, comma-separated; default all, in this order):
#   nccl     2-rank NCCL all-reduce / all-gather (crates/cuda/tests/nccl.rs)
#   tp       TpBackend at TP=2 vs one GPU vs the CPU oracle, decode graphs with the collectives
#   bench    `deltaserve bench` on the 27B shapes (bf16, random weights) at TP=1 and TP=2, same run
#   probe    `deltaserve probe` at TP=2 with 24 GiB per card (int4 weights, bf16 KV): the ladder to 262,144
#   ops      every kernel against the CPU reference (incl. the embedding's zero rows for other ranks)
# Logs and JSON/SVG are packed into $OUT/gpu_tp.tgz after every step (at most 8 files come back).
set -uo pipefail
C=.carry/tp
source "$(dirname "$0")/gpu_steps.sh"
if [[ "${1:-}" == "--stage" ]]; then
    gpu_stage "$C" ops nccl tp
    exit
fi
# NVLink multicast stays off (the shared hosts require it).
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
gpu_steps_init gpu_tp nccl,tp,bench,probe,ops
BENCH_ARGS="${BENCH_ARGS:---prompts 4096,32768,131072 --batches 1,8 --contexts 1024,32768 --steps 16}"
{
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv,noheader
    nvidia-smi topo -m
    ls -l /usr/lib/x86_64-linux-gnu/libnccl* 2>/dev/null
} >"$OUT/machine.txt" 2>&1
head -3 "$OUT/machine.txt"
test_step nccl 90 "^test |test result|panicked|SKIP|version" "$C/nccl" --nocapture --test-threads=1
test_step tp 150 "^test |test result|panicked|SKIP|median|graphs|all-reduce|argmax" "$C/tp" --nocapture \
    --test-threads=1
summary() {
    python3 - "$1" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
print("TP", d.get("tensor_parallel"), "ceilings", d["ceilings"], "startup", d["startup_s"])
for r in d["prefill"]: print("prefill", r["tokens"], r["tokens_per_s"], "tok/s", r["roofline_ratio"], "allreduce", r.get("allreduce_share"), r["driver_peak_bytes"])
for r in d["decode"]: print("decode b", r["batch"], "ctx", r["context"], r["ms_per_step"], "ms", r["roofline_ratio"], "allreduce", r.get("allreduce_share"))
print("plan", d["plan_bytes"], "driver peak", d["driver_peak_bytes"], d["skipped"])
PY
}
if has bench; then
    for tp in 2 1; do
        step "bench tp=$tp"
        # shellcheck disable=SC2086
        timeout "${BENCH_TIMEOUT:-240}" "$C/deltaserve" bench --tensor-parallel $tp $BENCH_ARGS --json \
            --svg "$OUT/bench-tp$tp.svg" >"$OUT/bench-tp$tp.json" 2>"$OUT/bench-tp$tp.log"
        echo "rc=$?"; tail -n 2 "$OUT/bench-tp$tp.log"; summary "$OUT/bench-tp$tp.json"
    done
fi
if has probe; then
    step probe
    ( while sleep 5; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done ) >"$OUT/probe-smi.log" 2>&1 &
    smi=$!
    timeout "${PROBE_TIMEOUT:-420}" "$C/deltaserve" probe --device cuda --preset qwen3.6-27b --random-weights \
        --tensor-parallel 2 --memory 24GiB --weights-dtype int4 --rungs "${PROBE_RUNGS:-25,100}" \
        --turns "${PROBE_TURNS:-0}" --json --svg "$OUT/probe-tp2.svg" >"$OUT/probe-tp2.json" 2>"$OUT/probe-tp2.log"
    echo "rc=$?"; kill $smi 2>/dev/null; tail -n 3 "$OUT/probe-tp2.log"
    python3 -c "import json,sys; d=json.load(open('$OUT/probe-tp2.json')); [print(r) for r in d['rungs']+d['turns']]; print(d['passed'], d['failures'], d['plan_bytes'])" || true
    sort -t, -k2 -n "$OUT/probe-smi.log" | tail -3
fi
test_step ops 150 "FAIL|test result|panicked|embed" "$C/ops" --nocapture --test-threads=1 ops_match_cpu_reference
step done
