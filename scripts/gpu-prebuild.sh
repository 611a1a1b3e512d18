#!/usr/bin/env bash
# Builds what scripts/gpu-check.sh runs, for a GPU machine without a Rust
# toolchain: the release `dplc` and the runtime's GPU test binary, stripped,
# into .gpu-bin/ (ignored by git; carry it to the GPU machine). gpu-check.sh
# uses .gpu-bin/ when the machine has no cargo.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --locked -p dplc >&2
TEST_BIN="$(cargo test --release --locked -p dplc-runtime --test gpu --no-run --message-format=json 2>/dev/null \
    | python3 -c 'import json,sys
for l in sys.stdin:
    m = json.loads(l)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "gpu":
        print(m["executable"])' | tail -1)"
[[ -x "$TEST_BIN" ]] || { echo "error: no GPU test binary was built" >&2; exit 1; }
rm -rf .gpu-bin
mkdir -p .gpu-bin
cp target/release/dplc .gpu-bin/dplc
cp "$TEST_BIN" .gpu-bin/gpu-tests
strip .gpu-bin/dplc .gpu-bin/gpu-tests
git rev-parse --short HEAD > .gpu-bin/COMMIT
git diff --quiet HEAD || echo "+uncommitted" >> .gpu-bin/COMMIT
du -sh .gpu-bin/* >&2
