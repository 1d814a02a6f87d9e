#!/usr/bin/env bash
# build-release.sh — the release build of the `deltaserve` binary, shared by `scripts/test` and the
# container recipe (docker/Dockerfile), so that CI runs the same build steps as the image.
#
# Usage:  scripts/build-release.sh [OUT_DIR]
# Runs `cargo build --release --locked -p deltaserve` (CARGO_TARGET_DIR respected; default target/),
# copies the binary into OUT_DIR when one is given, and prints the binary's path (in OUT_DIR, or in
# the target directory) on stdout; cargo's progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD

TARGET_DIR="${CARGO_TARGET_DIR:-$ROOT/target}"
case "$TARGET_DIR" in /*) ;; *) TARGET_DIR="$ROOT/$TARGET_DIR" ;; esac

cargo build --release --locked -p deltaserve >&2
BIN="$TARGET_DIR/release/deltaserve"
[ -x "$BIN" ] || { echo "build-release.sh: $BIN was not built" >&2; exit 1; }

if [ -n "${1:-}" ]; then
  mkdir -p "$1"
  cp "$BIN" "$1/deltaserve"
  BIN="$(cd "$1" && pwd)/deltaserve"
fi
echo "$BIN"
