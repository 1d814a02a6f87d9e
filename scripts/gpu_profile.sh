#!/usr/bin/env bash
# gpu_profile.sh — where the time goes, with Nsight Compute (ncu), in one device call.
#   Here:  cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#          scripts/gpu_profile.sh --stage        # copies the binaries into .carry/prof/
#   There: (carry [".carry/prof"]) STEPS=... scripts/gpu_profile.sh   # CSV and logs to $OUT/gpu_profile.tgz
# Steps (STEPS=decode,decode4,gdn,attn):
#   decode   every kernel's duration (gpu__time_duration) of `bench` decode steps at 27B shapes, bf16, batch 1
#            at 1K context (graph nodes profiled one by one; caches and clocks left alone)
#   decode4  the same with int4 weights and fp8 KV in a 24 GiB budget
#   gdn      gdn_chunk_prep / gdn_chunk_state: speed of light, warp stall reasons, occupancy
#   attn     attn_prefill at 32K keys: the same sections
set -uo pipefail
C=.carry/prof
source "$(dirname "$0")/gpu_steps.sh"
gpu_begin "${1:-}" "$C" gpu_profile decode,decode4,gdn,attn ops bench_attention
NCU="ncu --clock-control none --cache-control none"
STALLS="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_tensor_op_hmma.sum"
SECT="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
B="--prompts 1024 --batches 1 --contexts 1024 --steps 2 --verify-tokens 0"
if has decode; then
    step decode
    timeout 240 $NCU --metrics gpu__time_duration.sum --csv --print-units base \
        "$C/deltaserve" bench $B --memory 80GiB >"$OUT/decode.csv" 2>"$OUT/decode.log"
    echo "rc=$?"; wc -l "$OUT/decode.csv"; tail -n 3 "$OUT/decode.log"
fi
if has decode4; then
    step decode4
    timeout 240 $NCU --metrics gpu__time_duration.sum --csv --print-units base \
        "$C/deltaserve" bench $B --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --embed-on-host \
        --memory 24GiB >"$OUT/decode4.csv" 2>"$OUT/decode4.log"
    echo "rc=$?"; wc -l "$OUT/decode4.csv"; tail -n 3 "$OUT/decode4.log"
fi
if has gdn; then
    step gdn
    timeout 200 $NCU $SECT $STALLS --kernel-name regex:gdn_chunk --launch-skip 20 --launch-count 2 \
        "$C/ops" --nocapture --ignored bench_gdn_prefill_27b >"$OUT/gdn.txt" 2>&1
    echo "rc=$?"; grep -E "gdn_chunk|Duration|Warp Cycles|Registers|Achieved Occ|stalled|inst_executed|hmma" "$OUT/gdn.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -60
fi
if has attn; then
    # Launch 12: the default tiling at 32K keys; 155: keys 32, plain P, 3 heads per block at 32K keys
    # (bench_attention runs 36 launches per tiling, in its printed order).
    for skip in ${ATTN_SKIPS:-12 155}; do
        step "attn-$skip"
        timeout 200 $NCU $SECT $STALLS --kernel-name regex:attn_prefill --launch-skip "$skip" --launch-count 1 \
            "$C/bench_attention" --nocapture --ignored >"$OUT/attn-$skip.txt" 2>&1
        echo "rc=$?"; grep -E "attn_prefill \(|Duration|Warp Cycles Per Issued|Registers Per|Achieved Occ|stalled|inst_executed|hmma" "$OUT/attn-$skip.txt" | awk '$NF+0 > 0.05 || !/stalled/' | head -40
    done
fi
step done
