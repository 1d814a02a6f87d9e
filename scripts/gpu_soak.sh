#!/usr/bin/env bash
# gpu_soak.sh: the server on the GPU, driven through its HTTP API by `deltaserve soak` (device tool).
# 1. the built-in demo model on CUDA (smoke); 2. Qwen3.6-27B shapes with random weights, growing an
# agent session to TARGET tokens, with the driver's memory readings sampled every 2 s.
# Usage (GPU machine): BIN=.carry/deltaserve TARGET=65536 scripts/gpu_soak.sh   (writes to $OUT)
set -uo pipefail
BIN="${BIN:-.carry/deltaserve}"
TARGET="${TARGET:-65536}"
OUT="${OUT:-/tmp/gpu_soak}"
mkdir -p "$OUT"
export DELTASERVE_CACHE=/tmp/dscache RUST_LOG=info
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
echo "== demo model on CUDA"
timeout 120 "$BIN" soak --device cuda --turns 4 --target-context 2000 --json >"$OUT/soak-gpu-demo.json" 2>"$OUT/soak-gpu-demo.log"
echo "rc=$?"; tail -n 3 "$OUT/soak-gpu-demo.log"
echo "== plan"
"$BIN" plan --preset qwen3.6-27b --memory 80GiB --max-seqs 4 | tee "$OUT/plan-27b.txt" | tail -n 4
echo "== 27B random weights, soak to $TARGET tokens"
(while true; do nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader >>"$OUT/smi.csv"; sleep 2; done) &
SMI=$!
timeout 420 "$BIN" soak --device cuda --preset qwen3.6-27b --random-weights --memory 80GiB --max-seqs 4 \
  --turns 12 --target-context "$TARGET" --json --svg "$OUT/soak-27b.svg" >"$OUT/soak-27b.json" 2>"$OUT/soak-27b.log"
echo "rc=$?"
kill $SMI
tail -n 5 "$OUT/soak-27b.log"
sort -t, -k2 -n "$OUT/smi.csv" | tail -n 1 | sed 's/^/peak driver-reported process memory: /'
python3 - "$OUT/soak-27b.json" <<'PY' || true
import json, sys
d = json.load(open(sys.argv[1]))
for t in d["turns"]:
    print(t["turn"], t["prompt_tokens"], t["cached_tokens"], t["new_tokens"], round(t["ttft_ms"], 1), round(t["ttft_per_new_token_ms"], 3))
print(d["summary"])
PY
