#!/usr/bin/env bash
# cuda_ops_check.sh — run deltaserve-cuda's op tests and the DeltaNet prefill benchmark on a GPU
# machine, from test binaries built elsewhere (no Rust toolchain needed there).
#
# Build here, then carry .carry/cuda (see the report in bench/results/cuda-ops-*.md):
#   cargo test -p deltaserve-cuda --release --no-run
#   scripts/cuda_ops_check.sh --stage      # copies the test binaries into .carry/cuda/
# On the GPU machine (device tool `run`, carry [".carry/cuda"]):
#   scripts/cuda_ops_check.sh              # nvidia-smi line, kernels_check, ops table, bench
# Writes logs to $OUT when set (device tool), else to ./cuda_ops_logs/.
set -uo pipefail

CARRY=.carry/cuda
if [[ "${1:-}" == "--stage" ]]; then
    mkdir -p "$CARRY"
    for t in ops kernels_check; do
        bin=$(ls -t target/release/deps/${t}-* 2>/dev/null | grep -v '\.d$' | head -1)
        [[ -n "$bin" ]] || { echo "no release test binary for $t; run cargo test --release --no-run" >&2; exit 1; }
        cp "$bin" "$CARRY/$t"
        echo "staged $bin -> $CARRY/$t"
    done
    exit 0
fi

LOGS="${OUT:-./cuda_ops_logs}"
mkdir -p "$LOGS"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm --format=csv | tee "$LOGS/gpu.txt"
rc=0
"$CARRY/kernels_check" --nocapture 2>&1 | tee "$LOGS/kernels_check.log" | grep -E "NVRTC|module builds|FAIL|test result" || rc=1
"$CARRY/ops" --nocapture --test-threads=1 ops_match_cpu_reference 2>&1 | tee "$LOGS/ops.log" || rc=1
if [[ "${SKIP_BENCH:-0}" != 1 ]]; then
    "$CARRY/ops" --nocapture --ignored bench_gdn_prefill_27b 2>&1 | tee "$LOGS/bench.log" | grep -E "BENCH|test result|panicked" || rc=1
fi
exit $rc
