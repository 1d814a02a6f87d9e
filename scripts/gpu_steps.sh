# gpu_steps.sh — sourced by the device scripts (gpu_final.sh, gpu_tp.sh): a work folder packed after every
# step (the device tool returns at most 8 files), step selection by $STEPS, and a test-binary step.
#   gpu_begin ARG DIR NAME DEFAULT_STEPS TEST...
#                                       a device script's start: with ARG --stage, gpu_stage DIR TEST... and
#                                       exit; else gpu_steps_init NAME DEFAULT_STEPS and the GPU's line in
#                                       $OUT/gpu.txt
#   gpu_steps_init NAME DEFAULT_STEPS   logs in $OUT (= /tmp/NAME_work), packed into ${OUT:-/tmp/NAME}/NAME.tgz
#   has STEP                            whether STEP is selected
#   step LABEL                          pack what is there, print LABEL and the elapsed seconds
#   test_step STEP SECONDS PATTERN CMD...   if selected: CMD under a timeout into $OUT/STEP.log, print the rc
#                                       and the lines matching PATTERN
#   gpu_stage DIR TEST...               here: copies target/release/deltaserve and the newest release binary
#                                       of each test into DIR (to carry)
gpu_steps_init() {
    FINAL="${OUT:-/tmp/$1}"
    TGZ="$FINAL/$1.tgz"
    W=/tmp/$1_work
    OUT=$W
    STEPS="${STEPS:-$2}"
    mkdir -p "$W" "$FINAL"
    export DELTASERVE_CACHE=/tmp/dscache RUST_LOG=info
    t0=$(date +%s)
}
has() { [[ ",$STEPS," == *",$1,"* ]]; }
step() { tar czf "$TGZ" -C "$W" . 2>/dev/null; echo "== $1 ($(( $(date +%s) - t0 )) s)"; }
test_step() {
    local name=$1 secs=$2 pat=$3
    shift 3
    has "$name" || return 0
    step "$name"
    timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
    echo "rc=$?"
    grep -E "$pat" "$OUT/$name.log" | head -30
}
gpu_stage() {
    local dir=$1 t bin
    shift
    mkdir -p "$dir"
    cp target/release/deltaserve "$dir/deltaserve" || return 1
    for t in "$@"; do
        bin=$(ls -t target/release/deps/"$t"-* 2>/dev/null | grep -v '\.d$' | head -1)
        [[ -n "$bin" ]] || { echo "no release test binary for $t" >&2; return 1; }
        cp "$bin" "$dir/$t"
    done
    ls -la "$dir"
}
gpu_begin() {
    local arg=$1 dir=$2 name=$3 steps=$4
    shift 4
    if [[ "$arg" == "--stage" ]]; then
        gpu_stage "$dir" "$@"
        exit
    fi
    gpu_steps_init "$name" "$steps"
    nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv,noheader | tee "$OUT/gpu.txt"
}
