#!/usr/bin/env bash
# Open MPI and libclang from Debian, for the `mpi` crate (its build script runs
# bindgen over mpi.h) and for `mpirun` in tests/mpi_launch.rs, and a C++
# compiler for codegen/tests/host_cuda.rs. Idempotent: does
# nothing when both are present. Needs root (or sudo) and Debian's mirrors.
set -euo pipefail
need=()
command -v mpirun >/dev/null 2>&1 || need+=(openmpi-bin)
command -v mpicc >/dev/null 2>&1 || need+=(libopenmpi-dev)
ls /usr/lib/llvm-*/lib/libclang*.so* >/dev/null 2>&1 || need+=(libclang-dev)
command -v clang >/dev/null 2>&1 || need+=(clang)
# A C++ compiler for codegen/tests/host_cuda.rs (the generated CUDA C run on
# the CPU); without one that test skips.
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ ${#need[@]} -eq 0 ]; then
    exit 0
fi
sudo=()
[ "$(id -u)" -eq 0 ] || sudo=(sudo)
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -qq >&2
"${sudo[@]}" apt-get install -y -qq --no-install-recommends "${need[@]}" >&2
