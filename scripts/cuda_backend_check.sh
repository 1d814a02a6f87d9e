#!/usr/bin/env bash
# cuda_backend_check.sh — run deltaserve-cuda's backend tests (CUDA vs CPU reference, ragged
# batches, snapshots, arena counters), the op table, and the 27B backend benchmark on a GPU
# machine from test binaries built elsewhere.
#
# Here:   cargo test -p deltaserve-cuda --release --no-run && scripts/cuda_backend_check.sh --stage
# There:  (device tool `run`, carry [".carry/cuda"]) scripts/cuda_backend_check.sh
# Env: SKIP_OPS=1 skips the op table, SKIP_BENCH=1 the benchmark, DS_BENCH_LAYERS cuts the depth.
# Logs go to $OUT when set (device tool), else ./cuda_backend_logs/.
set -uo pipefail

CARRY=.carry/cuda
if [[ "${1:-}" == "--stage" ]]; then
    mkdir -p "$CARRY"
    for t in backend bench_backend ops kernels_check; do
        bin=$(ls -t target/release/deps/${t}-* 2>/dev/null | grep -v '\.d$' | head -1)
        [[ -n "$bin" ]] || { echo "no release test binary for $t; run cargo test --release --no-run" >&2; exit 1; }
        cp "$bin" "$CARRY/$t"
        echo "staged $bin -> $CARRY/$t"
    done
    exit 0
fi

LOGS="${OUT:-./cuda_backend_logs}"
mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$LOGS/gpu.txt"
rc=0
"$CARRY/backend" --nocapture --test-threads=1 2>&1 | tee "$LOGS/backend.log" | grep -vE "^\s*$" || rc=1
if [[ "${SKIP_OPS:-0}" != 1 ]]; then
    "$CARRY/ops" --nocapture --test-threads=1 ops_match_cpu_reference 2>&1 | tee "$LOGS/ops.log" | grep -E "FAIL|test result|panicked" || rc=1
fi
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
    "$CARRY/bench_backend" --nocapture --ignored bench_27b 2>&1 | tee "$LOGS/bench.log" | grep -E "BENCH|test result|panicked|Error|error" || rc=1
fi
exit $rc
