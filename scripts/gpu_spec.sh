#!/usr/bin/env bash
# gpu_spec.sh — speculative decoding (MTP, issue #8) on the GPU, in one or two device calls.
#   Here:  cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#          scripts/gpu_spec.sh --stage             # copies the binaries into .carry/spec/
#   There: (carry [".carry/spec"]) STEPS=... scripts/gpu_spec.sh   # logs and JSON to $OUT/gpu_spec.tgz
# Steps (STEPS=ops,spec,backend,e2e,bench):
#   ops      every kernel against the CPU reference (gdn_recurrent verify/commit, conv accept, MTP rows incl.)
#   spec     tests/speculative.rs: verify + commit vs plain decode and the CPU oracle, agreeing head, errors
#   backend  tests/backend.rs (the forward refactor: logits, batching, snapshots, graphs, quantised paths)
#   e2e      scripts/spec_e2e.py: the server with --speculative-tokens 0/1/3 on tiny models (random and
#            agreeing heads): greedy outputs compared, acceptance from /metrics
#   bench    27B random weights: `bench --speculative-tokens 2` and 3 (draft / verify / commit ms against
#            the one-token step), and a baseline bench without speculation (decode, argmax columns)
set -uo pipefail
C=.carry/spec
source "$(dirname "$0")/gpu_steps.sh"
gpu_begin "${1:-}" "$C" gpu_spec ops,spec,backend,e2e,bench ops backend speculative
test_step ops 150 "FAIL|test result|panicked" "$C/ops" --nocapture --test-threads=1 ops_match_cpu_reference
test_step spec 150 "^test |test result|panicked|FAIL|: [0-9]+ rows|median|drafts|k = " "$C/speculative" --nocapture --test-threads=1
test_step backend 200 "^test |test result|panicked|FAIL" "$C/backend" --nocapture --test-threads=1 --skip hf_fixtures_logits
if has e2e; then
    step e2e
    timeout 240 python3 scripts/spec_e2e.py "$C/deltaserve" "$OUT/spec-e2e.json" --device cuda >"$OUT/e2e.log" 2>&1
    echo "rc=$?"; cut -c1-400 "$OUT/e2e.log" | tail -n 12
fi
B="--prompts 1024 --batches 1,8 --contexts 1024,32768 --steps 16"
if has bench; then
    for k in 2 3; do
        step "bench-spec$k"
        timeout 200 "$C/deltaserve" bench $B --speculative-tokens $k --verify-tokens $((k + 1)) --json \
            >"$OUT/bench-spec$k.json" 2>"$OUT/bench-spec$k.log"
        echo "rc=$?"; tail -n 2 "$OUT/bench-spec$k.log"
        python3 -c "import json; d=json.load(open('$OUT/bench-spec$k.json')); [print('decode', r['batch'], r['context'], r['ms_per_step'], r['ms_per_step_argmax']) for r in d['decode']]; [print('verify-shaped', r) for r in d['verify']]; [print('spec', r) for r in d['speculative']]; print(d['plan_bytes'], d['driver_peak_bytes'])" || true
    done
    python3 scripts/spec_chart.py "$OUT/spec-steps.svg" "$OUT/bench-spec2.json" "$OUT/bench-spec3.json" || true
    step bench-base
    timeout 150 "$C/deltaserve" bench $B --json >"$OUT/bench-base.json" 2>"$OUT/bench-base.log"
    echo "rc=$?"; tail -n 2 "$OUT/bench-base.log"
    python3 -c "import json; d=json.load(open('$OUT/bench-base.json')); [print('decode', r['batch'], r['context'], r['ms_per_step'], r['ms_per_step_argmax'], r['roofline_ratio']) for r in d['decode']]; [print('verify-shaped', r) for r in d['verify']]" || true
fi
step done
