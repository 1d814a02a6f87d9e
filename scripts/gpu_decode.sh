#!/usr/bin/env bash
# gpu_decode.sh — decode on the GPU (issues #5, #6: the int4 GEMV, decode attention), in one device call.
#   Here:  cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#          scripts/gpu_decode.sh --stage        # copies the binaries into .carry/decode/
#   There: (carry [".carry/decode"]) STEPS=... scripts/gpu_decode.sh   # logs and JSON to $OUT/gpu_decode.tgz
# Steps (STEPS=ops,w4,attn,bench4,bench4p64,bench16,bench32,bench64,backend,spec):
#   ops      every kernel against the CPU reference (int4 GEMV at every warps-per-pair, decode attention)
#   w4       tests/bench_w4.rs: the int4 GEMV at the 27B shapes (GB/s vs copy), streaming probe, prefill slices
#   gdn      tests/ops.rs bench_gdn_prefill_27b: the chunked DeltaNet kernels at the 27B shape (M tok/s per layer)
#   attn     tests/bench_attention.rs, decode kernel only: partitions 16 / 64 at batch 1 / 8, 32K
#   attnp    tests/bench_attention.rs, prefill only: the default kernel and the warp-pair kernel, 4K-262K keys
#   benchp   27B bf16 `deltaserve bench` prefill 1K / 4K / 32K / 128K (and the decode points below)
#   bench4   27B, int4 weights, fp8 KV, 24 GiB: `deltaserve bench` decode at batch 1 / 8, 1K / 32K
#   bench4p64  the same with --decode-partitions 64
#   bench4nopdl  bench4 with DELTASERVE_PDL=0 (ordinary launches of the decode GEMVs; the A/B of PDL on sm_90)
#   nvsweep  bench4's int4 decode points (512-token prompt, 48 steps) under each environment in SWEEP (";"-
#            separated sets of space-separated VAR=VALUE, e.g. DELTASERVE_NVRTC_OPTIONS=-DDEC_PART_KEYS=32 — keys
#            per decode-attention partition; default: none and that one), two rounds
#   w4sweep  tests/bench_w4.rs DS_BENCH_W4_SWEEP=1: the int4 GEMV over shapes varying its waves and groups per warp
#   bench16  27B bf16 decode (batch 1 / 8, 1K / 32K) with 16 decode partitions (the default)
#   bench32, bench64  the same with --decode-partitions 32 / 64
#   backend  tests/backend.rs (logits vs the CPU engine, batching, graphs, int4, quantised KV)
#   spec     tests/speculative.rs (verify rows' decode attention, commit, drafts)
#   w4prof   Nsight Compute on one pair-kernel int4 GEMV launch (gate+up, M = 1, 4 warps per pair)
#   gdnprof  Nsight Compute on the chunked DeltaNet kernels (gdn_chunk_prep / gdn_chunk_state) of the
#            27B-shape bench in tests/ops.rs: speed of light, warp stall reasons, top stall sources
set -uo pipefail
C=.carry/decode
source "$(dirname "$0")/gpu_steps.sh"
gpu_begin "${1:-}" "$C" gpu_decode ops,w4,attn,bench4,bench16,bench64,backend ops bench_w4 bench_attention backend speculative
test_step ops 200 "FAIL|test result|panicked" "$C/ops" --nocapture --test-threads=1 ops_match_cpu_reference
test_step w4 200 "BENCH|pair|panicked|Best|units|rows" "$C/bench_w4" --nocapture --ignored bench_w4_27b
DS_BENCH_W4_SWEEP=1 test_step w4sweep 120 "^\||panicked" "$C/bench_w4" --nocapture --ignored bench_w4_27b
test_step gdn 120 "^\||panicked|BENCH" "$C/ops" --nocapture --ignored bench_gdn_prefill_27b
DS_BENCH_ATTN=decode test_step attn 150 "attn_decode|split|panicked|^\|" "$C/bench_attention" --nocapture --ignored
DS_BENCH_ATTN=prefill test_step attnp 120 "attn_prefill|^ +[0-9]|panicked" "$C/bench_attention" --nocapture --ignored
D="--batches 1,8 --contexts 1024,32768 --steps 9 --verify-tokens 0"
for b in benchp bench4 bench4p64 bench4nopdl bench16 bench32 bench64; do
    has $b || continue
    step $b
    case $b in
        benchp) A="--prompts 1024,4096,32768,131072" ;;
        bench4) A="--prompts 512,4096 --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --embed-on-host --memory 24GiB" ;;
        bench4p64) A="--prompts 4096 --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --embed-on-host --memory 24GiB --decode-partitions 64" ;;
        bench4nopdl) A="--prompts 512,4096 --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --embed-on-host --memory 24GiB" ;;
        bench16) A="--prompts 4096 --memory 100GiB" ;;
        bench32) A="--prompts 4096 --memory 100GiB --decode-partitions 32" ;;
        bench64) A="--prompts 4096 --memory 100GiB --decode-partitions 64" ;;
    esac
    if [[ $b == bench4nopdl ]]; then export DELTASERVE_PDL=0; else unset DELTASERVE_PDL; fi
    timeout 240 "$C/deltaserve" bench $D $A --json --svg "$OUT/$b.svg" >"$OUT/$b.json" 2>"$OUT/$b.log"
    echo "rc=$?"; tail -n 2 "$OUT/$b.log"
    python3 -c "import json; d=json.load(open('$OUT/$b.json')); [print('prefill', r) for r in d['prefill']]; [print('decode', r['batch'], r['context'], r['ms_per_step'], r['roofline_ratio']) for r in d['decode']]; print(d['plan_bytes'], d['driver_peak_bytes'])" || true
done
unset DELTASERVE_PDL
if has nvsweep; then
    step nvsweep
    IFS=';' read -ra sets <<<"${SWEEP:-;DELTASERVE_NVRTC_OPTIONS=-DDEC_PART_KEYS=32}"
    for round in 1 2; do
        for i in "${!sets[@]}"; do
            o="${sets[$i]}"
            # shellcheck disable=SC2086 # a set is words VAR=VALUE
            env $o timeout 120 "$C/deltaserve" bench --prompts 512 --batches 1,8 \
                --contexts 1024,32768 --steps 48 --verify-tokens 0 --weights-dtype int4 --kv-cache-dtype fp8 \
                --lm-head-int4 --embed-on-host --memory 24GiB --json >"$OUT/nvsweep$i-r$round.json" 2>/dev/null
            python3 -c "import json; d=json.load(open('$OUT/nvsweep$i-r$round.json')); print('[$o] round $round', ' '.join('b%d@%d %.3f' % (r['batch'], r['context'], r['ms_per_step']) for r in d['decode']))" || echo "[$o] round $round failed"
        done
    done
fi
test_step backend 240 "^test |test result|panicked|FAIL" "$C/backend" --nocapture --test-threads=1 --skip hf_fixtures_logits
test_step spec 200 "^test |test result|panicked|FAIL" "$C/speculative" --nocapture --test-threads=1
if has w4prof; then
    step w4prof
    # Skipping 110 w4p_hsh launches (53 per configuration: wpt 1, 2) lands in the wpt = 4 timing loop.
    DS_BENCH_W4="gate+up" timeout 120 ncu --kernel-name w4p_hsh --launch-skip 110 --launch-count 1 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section MemoryWorkloadAnalysis --section SourceCounters \
        "$C/bench_w4" --nocapture --ignored bench_w4_27b >"$OUT/w4prof.log" 2>&1
    echo "rc=$?"
    grep -E "w4p_hsh|Duration|Stall|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Memory Throughput|Registers Per|DRAM Throughput|L2 Hit" "$OUT/w4prof.log" | head -60
fi
if has gdnprof; then
    step gdnprof
    timeout 200 ncu --kernel-name regex:'gdn_chunk_(prep|state)' --launch-skip 6 --launch-count 2 \
        --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section ComputeWorkloadAnalysis --section MemoryWorkloadAnalysis --section SourceCounters \
        "$C/ops" --nocapture --ignored bench_gdn_prefill_27b >"$OUT/gdnprof.log" 2>&1
    echo "rc=$?"
    grep -E "Duration|Stall|Issue Slots Busy|Warp Cycles Per Issued|Achieved Occupancy|Registers|Memory Throughput|Compute \(SM\)|smsp__pcsamp" "$OUT/gdnprof.log" | head -60
fi
step done
