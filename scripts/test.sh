#!/usr/bin/env bash
# The test suite, exactly as CI runs it: formatting, lints, then every test of
# every crate. Needs a Rust toolchain (rustup's stable; rustfmt + clippy); the
# scripts it calls install the rest: Debian's chromium (for the HTML rendering
# test) and, on the first run, NVRTC from PyPI into .cache/nvrtc (python3 with
# pip and network access), so codegen's zoo test compiles every kernel to PTX,
# and Debian's Open MPI with libclang (apt, as root or with sudo), so the `mpi`
# feature builds and tests/mpi_launch.rs runs CPU ranks as processes under
# mpirun, with a C++ compiler, so codegen/tests/host_cuda.rs runs the
# generated CUDA C on the CPU. No GPU or CUDA driver is needed.
set -euo pipefail
cd "$(dirname "$0")/.."

# Headless Chromium renders `dplc viz --format html` in tests/plan_cli.rs.
scripts/install-chromium.sh >/dev/null
DPLC_NVRTC_LIB="$(scripts/install-nvrtc.sh)"
export DPLC_NVRTC_LIB
# Open MPI for `dplc launch` under mpirun; libclang for the mpi crate's bindgen.
scripts/install-mpi.sh >/dev/null

cargo fmt --all -- --check
cargo clippy --workspace --all-targets --locked --features dplc/mpi -- -D warnings
cargo test --workspace --locked --features dplc/mpi
