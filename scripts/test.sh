#!/usr/bin/env bash
# The test suite, exactly as CI runs it: formatting, lints, then every test of
# every crate. Needs a Rust toolchain (rustup's stable; rustfmt + clippy); the
# scripts it calls install the rest (Debian's chromium).
set -euo pipefail
cd "$(dirname "$0")/.."

# Headless Chromium renders `dplc viz --format html` in tests/plan_cli.rs.
scripts/install-chromium.sh >/dev/null

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked -- -D warnings
cargo test --workspace --locked
