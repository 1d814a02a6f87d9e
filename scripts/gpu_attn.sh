#!/usr/bin/env bash
# gpu_attn.sh — the attention prefill kernel (issue #5: 128K prefill) on the GPU, in one device call.
#   Here:  cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#          scripts/gpu_attn.sh --stage        # copies the binaries into .carry/attn/
#   There: (carry [".carry/attn"]) STEPS=... scripts/gpu_attn.sh   # logs and JSON to $OUT/gpu_attn.tgz
# Steps (STEPS=ops,attn,gdn,backend,spec,bench,soak):
#   ops      every kernel against the CPU reference (attention prefill in every tiling, quantised KV)
#   attn     tests/bench_attention.rs: attn_prefill TFLOP/s at 4K..262K keys for every tiling, decode
#   gdn      tests/ops.rs bench_gdn_prefill_27b: the chunked DeltaNet kernels at the 27B shape
#   backend  tests/backend.rs (logits vs the CPU engine, batching, graphs, quantised paths)
#   spec     tests/speculative.rs (verify rows' decode attention, commit, drafts)
#   bench    27B random weights: `deltaserve bench $BENCH_ARGS` (default: prefill 1K..262K, decode,
#            memory; JSON + SVG)
#   soak     27B random weights: 12-turn soak to 128K (TTFT per new token per turn, JSON + SVG)
set -uo pipefail
C=.carry/attn
source "$(dirname "$0")/gpu_steps.sh"
gpu_begin "${1:-}" "$C" gpu_attn ops,attn ops backend bench_attention speculative
test_step ops 200 "FAIL|test result|panicked|attn_prefill" "$C/ops" --nocapture --test-threads=1 ops_match_cpu_reference
test_step attn 200 "attn_prefill|^ +[0-9]+ +[0-9]+ |not loaded|panicked" "$C/bench_attention" --nocapture --ignored
test_step gdn 120 "BENCH|panicked" "$C/ops" --nocapture --ignored bench_gdn_prefill_27b
test_step backend 240 "^test |test result|panicked|FAIL" "$C/backend" --nocapture --test-threads=1 --skip hf_fixtures_logits
test_step spec 200 "^test |test result|panicked|FAIL" "$C/speculative" --nocapture --test-threads=1
if has bench; then
    step bench
    timeout 300 "$C/deltaserve" bench ${BENCH_ARGS:-} --json --svg "$OUT/bench.svg" >"$OUT/bench.json" 2>"$OUT/bench.log"
    echo "rc=$?"; tail -n 2 "$OUT/bench.log"
    python3 -c "import json; d=json.load(open('$OUT/bench.json')); [print('prefill', r) for r in d['prefill']]; [print('decode', r['batch'], r['context'], r['ms_per_step'], r['roofline_ratio']) for r in d['decode']]; print(d['plan_bytes'], d['driver_peak_bytes'])" || true
fi
if has soak; then
    step soak
    timeout 300 "$C/deltaserve" soak --device cuda --preset qwen3.6-27b --random-weights --max-seqs 4 --turns 12 \
        --target-context 131072 --json --svg "$OUT/soak.svg" >"$OUT/soak.json" 2>"$OUT/soak.log"
    echo "rc=$?"; tail -n 3 "$OUT/soak.log"
fi
step done
