#!/usr/bin/env bash
# gpu.sh — check and measure deltaserve on a GPU machine: the CUDA kernels and the backend against the
# CPU reference, `deltaserve bench` / `soak` / `probe`, decode A/B runs, Nsight Compute profiles and
# tensor parallelism. Each step runs under its own timeout and writes its logs, JSON and SVG files to
# the output folder; a step's failure is reported and the next step runs.
#
# Usage: scripts/gpu.sh [--out DIR] STEP [STEP...]
#        scripts/gpu.sh --stage DIR     copy deltaserve and the CUDA test binaries into DIR, for a GPU
#                                       machine without a Rust toolchain (then GPU_BIN_DIR=DIR there)
#        scripts/gpu.sh --help
#
# Build first (any machine; CUDA is loaded at run time, the kernels are compiled by NVRTC on the GPU):
#   cargo build --release -p deltaserve && cargo test -p deltaserve-cuda --release --no-run
#
# Environment:
#   GPU_BIN_DIR   where `deltaserve` and the test binaries are (default: ${CARGO_TARGET_DIR:-target}/release;
#                 test binaries are taken from its deps/ folder, the newest of each name, or from the
#                 folder itself when staged)
#   GPU_OUT       the output folder (default: gpu-results); --out DIR overrides it
#   BENCH_ARGS    replaces the `deltaserve bench` arguments of bench-bf16, bench-int4 and tp
#   SWEEP         decode: ";"-separated sets of space-separated VAR=VALUE, each an environment the int4
#                 decode points run under (default: "" and DELTASERVE_PDL=0, i.e. PDL on against off)
#   ROUNDS        decode: rounds over the sets (default 2)
#   SOAK_TARGET   soak: tokens the agent session grows to (default 131072)
#   PROBE_RUNGS, PROBE_TURNS   probe, probe-int4 and tp: the ladder's rungs and conversation turns
#   PROFILE       profile: what to profile, of decode,decode-int4,gdn,attn,w4,w4g,elementwise (default decode,decode-int4)
#   DS_OPS_FILTER ops: only the kernel cases whose name contains it
#   BACKEND_ARGS  backend: extra test arguments (e.g. --skip hf_fixtures_logits without fixtures/hf)
#
# Steps:
#   ops          kernels_check (every module built for sm_80/86/89/90) and every kernel against the CPU
#                reference (random inputs, poisoned outputs, awkward sizes)
#   gdn          the chunked DeltaNet prefill kernels at the 27B shape (M tokens/s per layer; one prompt in
#                pieces of 2,048 / 4,096 / 8,192 rows, each walk beside the next prep; then each walk the GPU
#                runs over the whole prompt: with output warps on sm_90, and in one stream)
#   w4           the int4 GEMV at the 27B shapes (GB/s against copy); w4-sweep: over shapes varying its
#                waves and groups per warp
#   attn         the attention kernels alone (tests/bench_attention.rs): decode, then prefill
#   backend      CudaBackend against the CPU engine (logits, batching, snapshots, CUDA graphs, arena,
#                int4, quantised KV, sampling, steps launched ahead)
#   backend-bench  the backend's 27B step benchmark (tests/bench_backend.rs)
#   spec         speculative decoding: tests/speculative.rs, scripts/spec_e2e.py through the server, and
#                `bench --speculative-tokens 2/3` against plain decode (chart: spec-steps.svg)
#   bench-bf16   `deltaserve bench` on the 27B shapes, bf16, all defaults: ceilings, DeltaNet kernels,
#                prefill 1K..262K, decode b1/8/32 at 1K/32K, snapshots, memory
#   bench-int4   `deltaserve bench` with int4 weights, fp8 KV, int4 lm_head, host embedding, 24 GiB
#   fp8          block-FP8 weights (sm_89+): the FP8 kernels against the CPU (ops fp8 cases), the backend's
#                fp8 tests, the FP8 linears against bf16 at the 27B shapes (tests/bench_fp8.rs), and
#                `deltaserve bench` with fp8 then bf16 weights on the 27B shapes (prefill 4K, decode b1..b32)
#   batches      decode ms per step at batches 1..64 (1K context), int4 and bf16 weights, and int4 with the
#                int4 GEMM off (DELTASERVE_W4_GEMM=0): the step from each batch to the next
#   memory       the driver-reported peak against the plan in every cell of weights (bf16, int4) x MTP
#                (K = 0, 3) x budget (24 GiB, 80 GiB), and int4 + MTP at 24 GiB with a bf16 DeltaNet state,
#                each bench timing steps launched ahead and not
#                (bf16 at 24 GiB: 16 of the 27B's 64 layers, the whole model does not fit); fails when
#                any cell's peak is above its plan (memory.md: the table)
#   decode       the int4 decode points (b1/b8 at 1K/32K, 48 steps) under each environment of SWEEP,
#                alternating, ROUNDS rounds (chart: decode-ab.svg)
#   short        short prefill chunks (16, 64, 256 new tokens) after 32K and 128K tokens, int4 + fp8 KV at
#                24 GiB: the prefill kernel's query tiles against the rows as decode queries
#   steps        where an int4 decode step's wall time goes (`bench --phases`, chart: step-phases.svg)
#   timeline     one traced int4 decode step (DELTASERVE_TRACE; table, TSV and timeline.svg)
#   soak         a 12-turn agent session to SOAK_TARGET tokens on the 27B shapes (TTFT per new token)
#   follow-up    a 12-turn agent session to FOLLOW_UP_CONTEXT tokens (default 172032), int4 + fp8 KV at 24 GiB,
#                then 3 short user follow-ups (about 24 tokens each): their time to the first token
#   saves        snapshots inside a step: the conv and chunked DeltaNet kernels cut at snapshots against the
#                CPU, the backend's cut chunks against their pieces run as steps (and MTP drafts from them),
#                then a 12-turn agent session (int4 + fp8 KV at 24 GiB) with DELTASERVE_SNAPSHOTS_IN_STEP 0
#                and 1: TTFT per turn and each request's prefill steps (saves-0/1.json, .log; SAVES_SOAKS: which
#                switch values to soak, default "0 1", empty for the tests alone)
#   probe        the ceiling ladder at the full 262,144 context, 27B bf16
#   probe-int4   the same with int4 weights and fp8 KV in 24 GiB
#   smoke        the built-in demo model served on CUDA, a short soak
#   moe          the 35B-A3B mixture of experts, int4 experts + fp8 KV in 24 GiB: the MoE tests, bench
#                without and with MTP (K = 3), the full-context probe
#   moe-shared   the MoE shared expert run with the routed experts' decode GEMVs: its ops cases and tests
#                (and block-FP8 MoE checkpoints), then 35B-A3B decode b1/8/32 with it off and on, 2 rounds
#   fp8-mma      the mma.sync FP8 GEMM (sm_89+) of prefill projections: its ops cases, the FP8 checkpoint's
#                backend test, then 27B FP8 prefill 512/4K/16K with it off (cuBLASLt) and on
#   wgmma        the Hopper attention prefill kernels (the warp-specialised one the default over bf16 KV, the
#                warpgroup one with DELTASERVE_ATTN_PREFILL=wg): ops cases, the attention benchmark (and the warp-specialised
#                kernel's build variants), the backend against the CPU with each
#   wgmma-bench  27B prefill 4K/32K/128K (bf16; int4 + fp8 KV at 24 GiB) on the wide, the warpgroup and the
#                warp-specialised kernel
#   widen        e4m3 codes widened to bf16 pairs by integer moves and one bf16x2 multiply (the default; the
#                build switch KV_WIDEN_BF16X2=0 keeps two f32 conversions): the quantised ops cases, then the
#                27B int4 + fp8 KV prefill at 24 GiB (4K/32K/128K) on both Hopper kernels with it off and on
#   w4g-tiles    the int4 tile GEMMs: w4_gemm and backend int4 tests, the kernels alone with every tile and split
#                at 24-256 rows, 27B int4 decode at batches 24-128, prefill of 128-512 tokens, MTP K = 3 at 8-32
#   host-experts routed int4 experts computed by the machine's CPU at 1..16 threads (examples/bench_host_experts,
#                build it with --example bench_host_experts; no GPU used), against the bus
#   vision       the vision tower at the real shapes: a 1024x1024 image's encode in a step, its attention
#                alone, and each op kind's time over the 27 blocks; the vision ops cases and the backend's
#                image test (its logits against the CPU engine's)
#   tp           on 2 GPUs: NCCL and TP=2 tests, `bench` at TP=2 and TP=1 (chart: tp.svg), the TP=2 probe
#                with int4 weights at 24 GiB per card
#   profile      Nsight Compute (ncu): decode step kernels' durations (bf16, int4), the DeltaNet chunk
#                kernels, attention prefill at 32K keys, the int4 pair GEMV; PROFILE=elementwise: the
#                elementwise kernels of a 4K bf16 prefill step, duration and DRAM bytes each (the bench's own
#                memory check fails under ncu, whose allocations the plan does not hold; the CSV is complete)
#   all          ops backend bench-bf16 soak probe probe-int4 bench-int4
set -uo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
BIN_DIR="${GPU_BIN_DIR:-${CARGO_TARGET_DIR:-$ROOT/target}/release}"
OUT_DIR="${GPU_OUT:-gpu-results}"
TESTS="ops kernels_check bench_w4 bench_fp8 bench_attention bench_backend bench_vision backend speculative moe w4_gemm nccl tp"
INT4="--weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --embed-on-host --memory 24GiB"
DECODE="--prompts 512 --batches 1,8 --contexts 1024,32768 --steps 48 --verify-tokens 0 --short-chunks 0"
Q27="--device cuda --preset qwen3.6-27b --random-weights"

usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }

# The binary NAME: $BIN_DIR/NAME when present (deltaserve, or a staged test), else the newest
# $BIN_DIR/deps/NAME-<hash> test binary.
bin() {
    if [[ -x "$BIN_DIR/$1" ]]; then echo "$BIN_DIR/$1"; return; fi
    if [[ -x "$BIN_DIR/examples/$1" ]]; then echo "$BIN_DIR/examples/$1"; return; fi
    ls -t "$BIN_DIR"/deps/"$1"-* 2>/dev/null | grep -v '\.d$' | head -1
}

stage() {
    local dir=$1 t b
    mkdir -p "$dir"
    cp "$BIN_DIR/deltaserve" "$dir/" || exit 1
    for t in $TESTS; do
        b=$(bin "$t")
        if [[ -n "$b" ]]; then cp "$b" "$dir/$t"; else echo "no release test binary for $t" >&2; fi
    done
    b=$(bin bench_host_experts)
    [[ -n "$b" ]] && cp "$b" "$dir/"
    ls -la "$dir"
}

t0=$(date +%s)
section() { echo "== $1 ($(( $(date +%s) - t0 )) s)"; }

# run NAME SECONDS PATTERN CMD...: CMD under a timeout into $OUT_DIR/NAME.log; prints its exit status and
# the lines matching PATTERN.
run() {
    local name=$1 secs=$2 pat=$3
    shift 3
    timeout "$secs" "$@" >"$OUT_DIR/$name.log" 2>&1
    echo "rc=$?"
    grep -E "$pat" "$OUT_DIR/$name.log" | head -40
}

# test NAME SECONDS PATTERN TEST ARGS...: one test binary's run.
test_run() {
    local name=$1 secs=$2 pat=$3 t=$4 b
    shift 4
    b=$(bin "$t")
    [[ -n "$b" ]] || { echo "no test binary $t in $BIN_DIR (cargo test -p deltaserve-cuda --release --no-run)"; return; }
    run "$name" "$secs" "$pat" "$b" "$@"
}

TESTS_PAT="^test |test result|panicked|FAIL"

# ds NAME SECONDS ARGS...: `deltaserve ARGS --json` into $OUT_DIR/NAME.json (log: NAME.log), then its summary.
ds() {
    local name=$1 secs=$2
    shift 2
    timeout "$secs" "$DS" "$@" --json >"$OUT_DIR/$name.json" 2>"$OUT_DIR/$name.log"
    echo "rc=$?"
    tail -n 2 "$OUT_DIR/$name.log"
    python3 "$ROOT/scripts/charts.py" summary "$OUT_DIR/$name.json" || true
}

# Sample the driver-reported memory of compute processes into FILE every 2 s until smi_stop.
smi_start() { (while sleep 2; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader; done) >>"$1" 2>&1 & SMI=$!; }
smi_stop() { kill "$SMI" 2>/dev/null; sort -t, -k2 -n "$1" | tail -n 1 | sed 's/^/peak driver-reported process memory: /'; }

step_ops() {
    test_run kernels_check 120 "NVRTC|module builds|FAIL|test result" kernels_check --nocapture
    test_run ops 480 "FAIL|test result|panicked" ops --nocapture --test-threads=1 ops_match_cpu_reference
}
step_gdn() { test_run gdn 120 "^\||BENCH|panicked" ops --nocapture --ignored bench_gdn_prefill_27b; }
step_w4() { test_run w4 200 "BENCH|pair|panicked|Best|units|rows" bench_w4 --nocapture --ignored bench_w4_27b; }
step_w4-sweep() {
    DS_BENCH_W4_SWEEP=1 test_run w4-sweep 120 "^\||panicked" bench_w4 --nocapture --ignored bench_w4_27b
}
step_attn() {
    DS_BENCH_ATTN=decode test_run attn-decode 150 "attn_decode|split|panicked|^\|" bench_attention --nocapture --ignored
    DS_BENCH_ATTN=prefill test_run attn-prefill 150 "attn_prefill|^ +[0-9]|panicked" bench_attention --nocapture --ignored
    DS_BENCH_ATTN=verify test_run attn-verify 150 "attn_verify|attn_decode|panicked" bench_attention --nocapture --ignored
    python3 "$ROOT/scripts/charts.py" decode-attn "$OUT_DIR/attn-decode.log" "$OUT_DIR/attn-decode.svg" || true
}
# shellcheck disable=SC2086 # BACKEND_ARGS: extra test arguments, e.g. --skip hf_fixtures_logits
step_backend() { test_run backend 300 "$TESTS_PAT" backend --nocapture --test-threads=1 ${BACKEND_ARGS:-}; }
step_backend-bench() { test_run backend-bench 200 "BENCH|test result|panicked|rror" bench_backend --nocapture --ignored bench_27b; }

step_spec() {
    local k base="--prompts 1024 --batches 1,8 --contexts 1024,32768 --steps 16"
    test_run spec 200 "$TESTS_PAT|: [0-9]+ rows|median|drafts|k = " speculative --nocapture --test-threads=1
    run spec-e2e 240 "." python3 "$ROOT/scripts/spec_e2e.py" "$DS" "$OUT_DIR/spec-e2e.json" --device cuda
    for k in 2 3; do
        # shellcheck disable=SC2086 # word lists of arguments
        ds "bench-spec$k" 200 bench $base --speculative-tokens "$k" --verify-tokens $((k + 1))
    done
    # shellcheck disable=SC2086
    ds bench-spec-base 150 bench $base
    python3 "$ROOT/scripts/charts.py" spec "$OUT_DIR/spec-steps.svg" "$OUT_DIR/bench-spec2.json" "$OUT_DIR/bench-spec3.json" || true
}

step_bench-bf16() {
    # shellcheck disable=SC2086
    ds bench-bf16 330 bench ${BENCH_ARGS:-} --svg "$OUT_DIR/bench-bf16.svg"
}
step_bench-int4() {
    # shellcheck disable=SC2086
    ds bench-int4 240 bench ${BENCH_ARGS:---prompts 512,4096,32768 --batches 1,8 --contexts 1024,32768} $INT4 \
        --svg "$OUT_DIR/bench-int4.svg"
}

step_fp8() {
    DS_OPS_FILTER=fp8 test_run ops-fp8 300 "FAIL|false|test result|panicked" ops ops_match_cpu_reference --nocapture --test-threads=1
    test_run backend-fp8 300 "median|flips|test result|panicked" backend fp8 --nocapture --test-threads=1
    test_run bench-fp8 300 "BENCH|panicked" bench_fp8 --nocapture --ignored bench_fp8_27b
    local b="--prompts 4096 --batches 1,8,16,32 --contexts 1024 --steps 16 --verify-tokens 0 --short-chunks 0 --memory 100GiB"
    # shellcheck disable=SC2086 # word lists of arguments
    ds bench-27b-fp8 400 bench $Q27 $b --weights-dtype fp8
    # shellcheck disable=SC2086
    ds bench-27b-bf16-beside-fp8 400 bench $Q27 $b
}

step_batches() {
    local b="--prompts 512 --contexts 1024 --verify-tokens 0 --short-chunks 0 --steps 16 --batches 1,2,4,8,12,16,24,32,48,64"
    # shellcheck disable=SC2086 # word lists of arguments
    ds batches-int4 200 bench $Q27 $b --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4 --memory 40GiB
    # shellcheck disable=SC2086
    DELTASERVE_W4_GEMM=0 ds batches-int4-sliced 200 bench $Q27 $b --weights-dtype int4 --kv-cache-dtype fp8 \
        --lm-head-int4 --memory 40GiB
    # shellcheck disable=SC2086
    ds batches-bf16 200 bench $Q27 $b --kv-cache-dtype fp8 --memory 90GiB
    python3 "$ROOT/scripts/charts.py" batches "$OUT_DIR/batches.svg" "$OUT_DIR/batches-int4.json" \
        "$OUT_DIR/batches-int4-sliced.json" "$OUT_DIR/batches-bf16.json" || true
}

# One cell of step_memory: weights $1, MTP K $2, budget $3, DeltaNet state $4; appends its row to memory.md and
# returns the bench's status.
memory_cell() {
    local w=$1 k=$2 mem=$3 st=$4 extra name rc
    local b="--prompts 512 --contexts 1024 --verify-tokens 0 --short-chunks 0 --steps 6 --batches 1,8"
    extra="--weights-dtype $w --kv-cache-dtype fp8 --state-dtype $st"
    [[ $w == int4 ]] && extra+=" --lm-head-int4"
    [[ $w == int4 && $mem == 24GiB ]] && extra+=" --embed-on-host"
    [[ $w == bf16 && $mem == 24GiB ]] && extra+=" --preset-layers 16"
    [[ $k -gt 0 ]] && extra+=" --speculative-tokens $k"
    name="memory-$w-k$k-$mem-$st"
    # shellcheck disable=SC2086
    timeout 200 "$DS" bench $Q27 $b $extra --memory "$mem" --json >"$OUT_DIR/$name.json" 2>"$OUT_DIR/$name.log"
    rc=$?
    python3 - "$OUT_DIR/$name.json" "$w" "$k" "$mem" "$st" "$rc" >>"$OUT_DIR/memory.md" <<'PY' || echo "| $w | $k | $mem | $st | - | - | - | rc=$rc |" >>"$OUT_DIR/memory.md"
import json, sys
d = json.load(open(sys.argv[1]))
plan, peak = d["plan_bytes"], d.get("driver_peak_bytes") or 0
gib = lambda x: f"{x / 2**30:.3f} GiB"
print(f"| {sys.argv[2]} | {sys.argv[3]} | {sys.argv[4]} | {sys.argv[5]} | {gib(plan)} | {gib(peak)} | {peak / plan:.4f} | rc={sys.argv[6]} |")
PY
    return $rc
}

step_memory() {
    local w k mem fail=0
    echo "| weights | MTP K | budget | DeltaNet state | plan | driver peak | peak / plan | bench |" >"$OUT_DIR/memory.md"
    echo "|---|---|---|---|---|---|---|---|" >>"$OUT_DIR/memory.md"
    for w in bf16 int4; do
        for k in 0 3; do
            for mem in 24GiB 80GiB; do
                memory_cell "$w" "$k" "$mem" fp32 || fail=1
            done
        done
    done
    # The 24 GB configuration with the state stored bf16.
    memory_cell int4 3 24GiB bf16 || fail=1
    cat "$OUT_DIR/memory.md"
    [[ $fail -eq 0 ]] && echo "memory: every cell's driver peak is within its plan" || echo "memory: FAILED (a bench failed its checks)"
}

step_decode() {
    local sets i round o builds=()
    IFS=';' read -ra sets <<<"${SWEEP:-;DELTASERVE_PDL=0}"
    for ((round = 1; round <= ${ROUNDS:-2}; round++)); do
        for i in "${!sets[@]}"; do
            o="${sets[$i]}"
            # shellcheck disable=SC2086 # a set is words VAR=VALUE
            env $o timeout 150 "$DS" bench $DECODE $INT4 --json >"$OUT_DIR/decode$i-r$round.json" 2>"$OUT_DIR/decode$i-r$round.log"
            python3 -c "import json; d=json.load(open('$OUT_DIR/decode$i-r$round.json')); print('[$o] round $round', ' '.join('b%d@%d %.3f' % (r['batch'], r['context'], r['ms_per_step']) for r in d['decode']))" \
                || echo "[$o] round $round failed"
        done
    done
    for i in "${!sets[@]}"; do
        o="${sets[$i]:-default}"
        builds+=("${o//=/:}=$(ls "$OUT_DIR"/decode"$i"-r*.json | paste -sd,)")
    done
    python3 "$ROOT/scripts/charts.py" decode-ab "$OUT_DIR/decode-ab.svg" "Decode A/B, 27B int4 + fp8 KV, 24 GiB" \
        "mean of ${ROUNDS:-2} rounds" 60 "${builds[@]}" || true
}

step_short() {
    # shellcheck disable=SC2086 # word lists of arguments
    ds bench-short 240 bench --prompts 512 --batches 1 --contexts 32768,131072 --verify-tokens 0 --steps 8 \
        --short-chunks 16,64,256 $INT4
}

step_steps() {
    # shellcheck disable=SC2086
    ds steps 200 bench $DECODE $INT4 --phases
    python3 "$ROOT/scripts/charts.py" step-phases "$OUT_DIR/steps.json" "$OUT_DIR/step-phases.svg" \
        "Where a decode step's wall time goes: 27B int4 + fp8 KV, 24 GiB" || true
}

step_timeline() {
    # shellcheck disable=SC2086
    DELTASERVE_TRACE="$OUT_DIR/trace.csv" timeout 200 "$DS" bench --prompts 512 --batches 1 --contexts 1024 --steps 8 \
        --verify-tokens 0 --short-chunks 0 $INT4 --json >"$OUT_DIR/timeline-bench.json" 2>"$OUT_DIR/timeline-bench.log"
    echo "rc=$?"
    python3 "$ROOT/scripts/charts.py" timeline "$OUT_DIR/trace.csv" --svg "$OUT_DIR/timeline.svg" --tsv "$OUT_DIR/timeline.tsv" \
        --quiet || true
    gzip -f "$OUT_DIR/trace.csv"
}

step_soak() {
    smi_start "$OUT_DIR/soak-smi.csv"
    # shellcheck disable=SC2086
    ds soak 420 soak $Q27 --max-seqs 4 --turns 12 --target-context "${SOAK_TARGET:-131072}" --svg "$OUT_DIR/soak.svg"
    smi_stop "$OUT_DIR/soak-smi.csv"
}
step_follow-up() {
    # shellcheck disable=SC2086 # word lists of arguments
    ds follow-up 540 soak $Q27 $INT4 --turns 12 --target-context "${FOLLOW_UP_CONTEXT:-172032}" --follow-ups 3 \
        --follow-up-tokens 24 --svg "$OUT_DIR/follow-up.svg"
}
step_saves() {
    DS_OPS_FILTER=conv_prefill test_run ops-saves-conv 120 "FAIL|test result|panicked|snapshots" ops \
        ops_match_cpu_reference --nocapture --test-threads=1
    DS_OPS_FILTER=gdn_chunk test_run ops-saves-gdn 200 "FAIL|test result|panicked|cuts" ops \
        ops_match_cpu_reference --nocapture --test-threads=1
    test_run backend-saves 200 "$TESTS_PAT|continuation|last rows|median" backend snapshots_inside --nocapture \
        --test-threads=1
    test_run spec-saves 200 "$TESTS_PAT|drafts|median" speculative snapshot_inside --nocapture --test-threads=1
    local on
    for on in ${SAVES_SOAKS-0 1}; do
        # shellcheck disable=SC2086 # word lists of arguments
        DELTASERVE_SNAPSHOTS_IN_STEP=$on RUST_LOG=info,deltaserve_engine=debug ds "saves-$on" 420 soak $Q27 \
            --weights-dtype int4 --kv-cache-dtype fp8 --memory 24GiB --max-seqs 4 --turns 12 \
            --target-context "${SOAK_TARGET:-131072}"
        grep -o "prefill_steps=[0-9]*" "$OUT_DIR/saves-$on.log" | sort | uniq -c
    done
}
step_probe() {
    # shellcheck disable=SC2086
    ds probe 300 probe $Q27 --max-seqs 4 --rungs "${PROBE_RUNGS:-25,50,100}" --turns "${PROBE_TURNS:-3}" \
        --svg "$OUT_DIR/probe.svg"
}
step_probe-int4() {
    smi_start "$OUT_DIR/probe-int4-smi.csv"
    # shellcheck disable=SC2086
    ds probe-int4 420 probe $Q27 --weights-dtype int4 --kv-cache-dtype fp8 --memory 24GiB \
        --rungs "${PROBE_RUNGS:-25,100}" --turns "${PROBE_TURNS:-2}" --svg "$OUT_DIR/probe-int4.svg"
    smi_stop "$OUT_DIR/probe-int4-smi.csv"
}
step_smoke() { ds smoke 120 soak --device cuda --turns 4 --target-context 2000; }
# The 35B-A3B mixture of experts with int4 experts and fp8 KV in 24 GiB: its tests (bf16 and int4 experts
# against the CPU, speculation), bench without and with MTP (K = 3), and the full context.
step_moe() {
    local q="--device cuda --preset qwen3.6-35b-a3b --random-weights --weights-dtype int4 --kv-cache-dtype fp8 --memory 24GiB"
    local b="--prompts 512,4096 --contexts 1024 --steps 16"
    test_run moe-tests 300 "$TESTS_PAT|median" moe --nocapture --test-threads=1
    test_run moe-spec 200 "$TESTS_PAT|median" speculative --nocapture --test-threads=1 moe_speculation
    # shellcheck disable=SC2086 # word lists of arguments
    ds bench-moe 300 bench $q $b --batches 1,8,32 --verify-tokens 0
    # shellcheck disable=SC2086
    ds bench-moe-spec 300 bench $q $b --batches 1,8 --speculative-tokens 3
    # shellcheck disable=SC2086
    ds probe-moe 420 probe $q --rungs "${PROBE_RUNGS:-100}" --turns "${PROBE_TURNS:-2}" --svg "$OUT_DIR/probe-moe.svg"
}

# A sparse layer's shared expert run with the routed experts' decode GEMVs (DELTASERVE_MOE_SHARED_PAIRS):
# the ops moe cases (its pairs against the CPU), the MoE backend tests (shared pairs and block-FP8
# checkpoints), then 35B-A3B decode (int4 experts, fp8 KV, 24 GiB) off and on, two rounds alternating.
step_moe-shared() {
    local q="--device cuda --preset qwen3.6-35b-a3b --random-weights --weights-dtype int4 --kv-cache-dtype fp8 --memory 24GiB"
    DS_OPS_FILTER=moe test_run ops-moe 200 "FAIL|test result|panicked|shared" ops ops_match_cpu_reference --nocapture \
        --test-threads=1
    test_run moe-shared-tests 300 "$TESTS_PAT|median" moe --nocapture --test-threads=1 shared_expert_pairs fp8_checkpoint
    local r on
    for r in 1 2; do
        for on in 0 1; do
            # shellcheck disable=SC2086 # word lists of arguments
            DELTASERVE_MOE_SHARED_PAIRS=$on ds "moe-shared-$on-$r" 300 bench $q --prompts 512 --contexts 1024 \
                --steps 32 --batches 1,8,32 --verify-tokens 0 --short-chunks 0
        done
    done
}

# The mma.sync FP8 GEMM of prefill projections (DELTASERVE_FP8_MMA; Ada's path, emulated on Hopper): the ops
# fp8_gemm cases (against the CPU and cuBLASLt's), the backend's FP8 checkpoint test (every prefill path), then
# the 27B FP8 prefill off and on (on Hopper the emulation's rate, not Ada's).
step_fp8-mma() {
    DS_OPS_FILTER=fp8_gemm test_run ops-fp8-gemm 200 "FAIL|test result|panicked|mma|cuBLASLt" ops \
        ops_match_cpu_reference --nocapture --test-threads=1
    test_run backend-fp8 200 "$TESTS_PAT|median" backend fp8_checkpoint --nocapture --test-threads=1
    local on
    for on in 0 1; do
        # shellcheck disable=SC2086 # word lists of arguments
        DELTASERVE_FP8_MMA=$on ds "fp8-mma-$on" 300 bench --device cuda --preset qwen3.6-27b --random-weights \
            --weights-dtype fp8 --prompts 512,4096,16384 --contexts 1024 --batches 1 --verify-tokens 0 --short-chunks 0
    done
}

# Hopper's attention prefill kernels, the warp-specialised one (the default over a bf16 cache) and the
# warpgroup one (the default over a quantised cache; DELTASERVE_ATTN_PREFILL=wg over bf16 too): their ops
# cases against the CPU over bf16 and quantised caches (split over the keys too), the attention benchmark (and
# the warp-specialised kernel's build variants), the backend against the CPU with each.
step_wgmma() {
    DS_OPS_FILTER=attn_prefill test_run ops-wgmma 480 "FAIL|test result|panicked|attn_prefill_w" ops \
        ops_match_cpu_reference --nocapture --test-threads=1
    DS_BENCH_ATTN=prefill test_run attn-wgmma 200 "attn_prefill|^ +[0-9]|panicked" bench_attention --nocapture --ignored
    test_run backend-wgmma 300 "$TESTS_PAT|attn_prefill" backend --nocapture \
        --test-threads=1 matches_cpu_backend error_by_depth short_chunks_over_long quantized_kv
    DELTASERVE_ATTN_PREFILL=wg test_run backend-wg 300 "$TESTS_PAT|attn_prefill" backend --nocapture \
        --test-threads=1 matches_cpu_backend error_by_depth short_chunks_over_long quantized_kv
    # The warp-specialised kernel's build variants (each tile's products and softmax in turn; the
    # warpgroups taking turns) in the attention benchmark.
    local o
    for o in in-turn:-DWS_OVERLAP=0 pingpong:-DWS_PINGPONG=1; do
        DELTASERVE_NVRTC_OPTIONS="${o#*:}" DS_BENCH_ATTN=prefill test_run "attn-ws-${o%%:*}" 200 \
            "attn_prefill|^ +[0-9]|panicked" bench_attention --nocapture --ignored
    done
}

# The 27B prefill at 4K / 32K / 128K on Hopper's attention prefill kernels (bf16, and int4 weights with fp8 KV
# at 24 GiB): wide: mma.sync; wg: the warpgroup kernel; ws: the warp-specialised kernel (the default picks
# ws over bf16 KV, wg over fp8).
step_wgmma-bench() {
    local v
    for v in wide wg ws; do
        # shellcheck disable=SC2086 # word lists of arguments
        DELTASERVE_ATTN_PREFILL=$v ds "wgmma-$v" 300 bench $Q27 --prompts 4096,32768,131072 --contexts 1024 \
            --batches 1 --verify-tokens 0 --short-chunks 0
        # shellcheck disable=SC2086
        DELTASERVE_ATTN_PREFILL=$v ds "wgmma-int4-$v" 300 bench $Q27 --weights-dtype int4 --kv-cache-dtype fp8 \
            --memory 24GiB --prompts 4096,32768,131072 --contexts 1024 --batches 1 --verify-tokens 0 --short-chunks 0
    done
}

# The e4m3 widening of quantised K/V by integer moves and one bf16x2 multiply (the default, -DKV_WIDEN_BF16X2=1
# through DELTASERVE_NVRTC_OPTIONS) against two f32 conversions a pair (=0): correctness in the ops table, then
# the fp8-KV prefill on the warpgroup and warp-specialised kernels.
step_widen() {
    DELTASERVE_NVRTC_OPTIONS="-DKV_WIDEN_BF16X2=1" DS_OPS_FILTER=kv_q test_run ops-widen 300 \
        "FAIL|test result|panicked" ops ops_match_cpu_reference --nocapture --test-threads=1
    local v o
    for v in wg ws; do
        for o in 0 1; do
            # shellcheck disable=SC2086 # word lists of arguments
            DELTASERVE_ATTN_PREFILL=$v DELTASERVE_NVRTC_OPTIONS="-DKV_WIDEN_BF16X2=$o" ds "widen-$v-$o" 300 bench $Q27 \
                --weights-dtype int4 --kv-cache-dtype fp8 --memory 24GiB --prompts 4096,32768,131072 --contexts 1024 \
                --batches 1 --verify-tokens 0 --short-chunks 0
        done
    done
}

# The int4 tile GEMMs: the w4_gemm tests and the backend's int4 tests, the kernels alone with every tile and
# K split at 24-256 rows (bench_w4_rows' sweep, against dequantised slices + cuBLASLt), then the 27B int4 +
# fp8 KV steps the tiles serve: decode at batches 24-128, prefill of 128-512 tokens, MTP K = 3 at batches 8-32.
step_w4g-tiles() {
    test_run w4g-tests 300 "$TESTS_PAT|^FAIL" w4_gemm --nocapture --test-threads=1
    test_run w4g-backend 300 "$TESTS_PAT|int4 GEMM" backend int4 --nocapture --test-threads=1
    DS_BENCH_W4_ROWS_SWEEP=1 DS_BENCH_W4_ROWS_M=24,32,48,64,128,256 test_run w4g-rows 300 "^\| (mlp|gdn|attn)" \
        bench_w4 --nocapture --ignored bench_w4_rows
    local b="--contexts 1024 --steps 12 --short-chunks 0 --weights-dtype int4 --kv-cache-dtype fp8 --lm-head-int4"
    # shellcheck disable=SC2086 # word lists of arguments
    ds w4g-batches 200 bench $Q27 $b --memory 40GiB --prompts 128,256,512 --batches 24,32,48,64,96,128 \
        --verify-tokens 0
    # shellcheck disable=SC2086
    ds w4g-spec 200 bench $Q27 $b --memory 40GiB --prompts 512 --batches 8,16,32 --speculative-tokens 3
}

# Routed int4 experts computed by this machine's CPU (no GPU used) at 1..16 threads, against the bus.
step_host-experts() {
    local b p t th
    b=$(bin bench_host_experts)
    [[ -n "$b" ]] || { echo "no bench_host_experts (cargo build --release -p deltaserve-cuda --example bench_host_experts)"; return; }
    for p in qwen3-next-80b-a3b qwen3.6-35b-a3b; do
        for t in 1 8; do
            for th in 1 4 8 16; do run "host-experts-$p-$t-$th" 300 "^step" "$b" "$p" "$t" "$th"; done
        done
    done
}

# The vision tower at the real shapes: one 1024x1024 image in a step against text (the tower's time, host work
# included), its attention alone, and each op kind's time over the 27 blocks (where the rest goes).
step_vision() {
    test_run vision 200 "BENCH|panicked|test result" bench_vision --ignored --nocapture --test-threads=1
    DS_OPS_FILTER=vision test_run ops-vision 200 "FAIL|test result|panicked" ops ops_match_cpu_reference \
        --nocapture --test-threads=1
    test_run backend-images 200 "$TESTS_PAT|median" backend images --nocapture --test-threads=1
}

step_tp() {
    local tp
    # NVLink multicast stays off (the backend also sets NCCL_NVLS_ENABLE=0 before its first communicator).
    export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
    { nvidia-smi topo -m; ls -l /usr/lib/x86_64-linux-gnu/libnccl* 2>/dev/null; } >"$OUT_DIR/tp-machine.txt" 2>&1
    test_run nccl 90 "$TESTS_PAT|SKIP|version" nccl --nocapture --test-threads=1
    test_run tp-tests 150 "$TESTS_PAT|SKIP|median|graphs|all-reduce|argmax" tp --nocapture --test-threads=1
    for tp in 2 1; do
        # shellcheck disable=SC2086
        ds "bench-tp$tp" 240 bench --tensor-parallel "$tp" \
            ${BENCH_ARGS:---prompts 4096,32768,131072 --batches 1,8 --contexts 1024,32768 --steps 16} --svg "$OUT_DIR/bench-tp$tp.svg"
    done
    python3 "$ROOT/scripts/charts.py" tp "$OUT_DIR/bench-tp1.json" "$OUT_DIR/bench-tp2.json" "$OUT_DIR/tp.svg" || true
    smi_start "$OUT_DIR/probe-tp2-smi.csv"
    # shellcheck disable=SC2086
    ds probe-tp2 420 probe $Q27 --tensor-parallel 2 --memory 24GiB --weights-dtype int4 \
        --rungs "${PROBE_RUNGS:-25,100}" --turns "${PROBE_TURNS:-0}" --svg "$OUT_DIR/probe-tp2.svg"
    smi_stop "$OUT_DIR/probe-tp2-smi.csv"
}

step_profile() {
    local ncu="ncu --clock-control none --cache-control none" p skip
    local sect="--section SpeedOfLight --section WarpStateStats --section SchedulerStats --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
    local stalls="--metrics regex:smsp__average_warps_issue_stalled_.*_per_issue_active\\.ratio,smsp__inst_executed.sum,sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active,smsp__inst_executed_pipe_tensor_op_hmma.sum"
    local one="--prompts 1024 --batches 1 --contexts 1024 --steps 2 --verify-tokens 0 --short-chunks 0"
    local keep="Duration|Warp Cycles|Registers|Achieved Occ|stalled|inst_executed|hmma|Memory Throughput"
    for p in ${PROFILE//,/ }; do
        section "profile $p"
        case $p in
            # Every kernel's duration of the decode steps (graph nodes profiled one by one).
            # shellcheck disable=SC2086
            decode) run profile-decode 240 "==PROF==|rror" $ncu --metrics gpu__time_duration.sum --csv --print-units base \
                "$DS" bench $one --memory 80GiB ;;
            # shellcheck disable=SC2086
            decode-int4) run profile-decode-int4 240 "==PROF==|rror" $ncu --metrics gpu__time_duration.sum --csv \
                --print-units base "$DS" bench $one $INT4 ;;
            # shellcheck disable=SC2086
            gdn) run profile-gdn 200 "gdn_chunk|$keep" $ncu $sect $stalls --kernel-name regex:gdn_chunk --launch-skip 20 \
                --launch-count 2 "$(bin ops)" --nocapture --ignored bench_gdn_prefill_27b ;;
            # Launch 12 of bench_attention: the default tiling at 32K keys.
            # shellcheck disable=SC2086
            attn) run profile-attn 200 "attn_prefill \(|$keep" $ncu $sect $stalls --kernel-name regex:attn_prefill \
                --launch-skip 12 --launch-count 1 "$(bin bench_attention)" --nocapture --ignored ;;
            # One pair-kernel int4 GEMV launch (gate+up, M = 1, 4 warps per pair): skipping 110 w4p_hsh
            # launches (53 per configuration: 1, 2 warps per pair) lands in the 4-warp timing loop.
            # shellcheck disable=SC2086
            w4) DS_BENCH_W4="gate+up" run profile-w4 120 "w4p_hsh|$keep" $ncu $sect --section SourceCounters \
                --kernel-name w4p_hsh --launch-skip 110 --launch-count 1 "$(bin bench_w4)" --nocapture --ignored bench_w4_27b ;;
            # The int4 tile GEMM at W4G_ROWS rows (default 32 and 128: the 32-token tile and two 64-token
            # ones; gate / up, then down): one launch each, after 20.
            # shellcheck disable=SC2086
            w4g) for m in ${W4G_ROWS:-32 128}; do for lin in gate down; do
                    DS_BENCH_W4="$lin" DS_BENCH_W4_ROWS_M=$m run "profile-w4g-$lin-$m" 120 "w4g_|$keep" $ncu $sect $stalls \
                        --section SourceCounters --kernel-name regex:'w4g_[0-9]' --launch-skip 20 --launch-count 1 \
                        "$(bin bench_w4)" --nocapture --ignored bench_w4_rows
                done; done ;;
            # The elementwise kernels of one 4K prefill step: duration and DRAM bytes a launch.
            # shellcheck disable=SC2086
            elementwise) run profile-elementwise 240 "rror" ncu --clock-control none --cache-control none --csv \
                --print-units base --metrics gpu__time_duration.sum,dram__bytes_read.sum,dram__bytes_write.sum \
                --kernel-name "regex:conv_prefill|add_rms_norm_1p|rms_norm|swiglu|gdn_gate|kv_write|sigmoid_gate_mul|qk_norm|act_quant" \
                --launch-count 500 "$DS" bench $Q27 --prompts 4096 --contexts 1024 --batches 1 --steps 1 \
                --verify-tokens 0 --short-chunks 0 --json ;;
            *) echo "unknown profile $p (decode, decode-int4, gdn, attn, w4, w4g, elementwise)" ;;
        esac
    done
}

# The steps: every step_NAME function above.
STEP_NAMES=$(declare -F | sed -n 's/^declare -f step_//p')

case "${1:-}" in
    "" | -h | --help) usage; exit 0 ;;
    --stage) [[ -n "${2:-}" ]] || { echo "usage: scripts/gpu.sh --stage DIR" >&2; exit 2; }; stage "$2"; exit ;;
    --out) OUT_DIR=${2:?--out DIR}; shift 2 ;;
esac
[[ $# -gt 0 ]] || { usage; exit 2; }
steps=()
for s in "$@"; do
    if [[ $s == all ]]; then steps+=(ops backend bench-bf16 soak probe probe-int4 bench-int4); continue; fi
    [[ " ${STEP_NAMES//$'\n'/ } " == *" $s "* ]] || { echo "unknown step: $s (scripts/gpu.sh --help)" >&2; exit 2; }
    steps+=("$s")
done
DS="$(bin deltaserve)"
[[ -n "$DS" ]] || { echo "no deltaserve binary in $BIN_DIR (cargo build --release -p deltaserve)" >&2; exit 1; }
PROFILE="${PROFILE:-decode,decode-int4}"
mkdir -p "$OUT_DIR"
export RUST_LOG="${RUST_LOG:-info}"
nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT_DIR/gpu.txt"
git -C "$ROOT" rev-parse --short HEAD >"$OUT_DIR/commit.txt" 2>/dev/null
for s in "${steps[@]}"; do
    section "$s"
    "step_$s"
done
section done
