#!/usr/bin/env bash
# The test suite, exactly as CI runs it: formatting, lints, then every test of
# every crate. Needs a Rust toolchain (rustup's stable; rustfmt + clippy) and,
# on the first run, python3 with pip and network access to PyPI: NVRTC is
# installed into .cache/nvrtc so codegen's zoo test compiles every kernel to PTX
# (it would otherwise skip). No GPU or CUDA driver is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

DPLC_NVRTC_LIB="$(scripts/install-nvrtc.sh)"
export DPLC_NVRTC_LIB

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
