#!/usr/bin/env bash
# The test suite, exactly as CI runs it: formatting, lints, then every test of
# every crate. Needs only a Rust toolchain (rustup's stable; rustfmt + clippy).
set -euo pipefail
cd "$(dirname "$0")/.."

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
