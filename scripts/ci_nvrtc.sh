#!/usr/bin/env bash
# ci_nvrtc.sh — install the pinned NVRTC wheel (CUDA 13.0, no GPU needed) into a directory and
# print the LD_LIBRARY_PATH that lets deltaserve-cuda's kernels_check find libnvrtc.so.13.
#
# Usage:  export LD_LIBRARY_PATH="$(scripts/ci_nvrtc.sh [DIR])${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
#         cargo test -p deltaserve-cuda --test kernels_check
# DIR defaults to ${NVRTC_DIR:-$HOME/.cache/deltaserve/nvrtc-13.0.88}. Idempotent: an existing
# install is reused. Only the library path goes to stdout; progress goes to stderr.
set -euo pipefail

NVRTC_VERSION=13.0.88
DIR="${1:-${NVRTC_DIR:-$HOME/.cache/deltaserve/nvrtc-$NVRTC_VERSION}}"
LIB="$DIR/nvidia/cu13/lib"

if [[ ! -f "$LIB/libnvrtc.so.13" ]]; then
    echo "installing nvidia-cuda-nvrtc==$NVRTC_VERSION into $DIR" >&2
    python3 -m pip install --quiet --no-deps --target "$DIR" "nvidia-cuda-nvrtc==$NVRTC_VERSION" >&2
    # The *.alt.so variants are not used by NVRTC's default path; drop them to save ~100 MB.
    rm -f "$LIB"/*.alt.so* 2>/dev/null || true
fi
if [[ ! -f "$LIB/libnvrtc.so.13" ]]; then
    echo "error: $LIB/libnvrtc.so.13 missing after install" >&2
    exit 1
fi
echo "$LIB"
