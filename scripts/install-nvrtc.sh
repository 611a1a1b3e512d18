#!/usr/bin/env bash
# Installs NVRTC (the CUDA runtime compiler; no GPU or driver needed) from the
# PyPI wheel nvidia-cuda-nvrtc-cu12 into .cache/nvrtc, so codegen's tests can
# compile every generated kernel to PTX. Idempotent: a second run only checks
# that the library is there.
#
# Prints the library's path on stdout as the last line. Tests and `dplc` find it
# through DPLC_NVRTC_LIB (the full path of libnvrtc.so.12):
#
#     export DPLC_NVRTC_LIB="$(scripts/install-nvrtc.sh)"
#
# Needs python3 with pip and network access to PyPI on the first run.
set -euo pipefail
cd "$(dirname "$0")/.."

# The wheel matches the cudarc feature `cuda-12080` of codegen/Cargo.toml.
VERSION="${DPLC_NVRTC_VERSION:-12.8.93}"
DEST=".cache/nvrtc/${VERSION}"
LIB="$PWD/$DEST/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"

if [[ ! -f "$LIB" ]]; then
    echo "installing nvidia-cuda-nvrtc-cu12==${VERSION} into ${DEST}" >&2
    tmp="${DEST}.partial"
    rm -rf "$tmp"
    mkdir -p "$tmp"
    python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps \
        --only-binary=:all: --target "$tmp" "nvidia-cuda-nvrtc-cu12==${VERSION}" >&2
    if [[ ! -f "$tmp/nvidia/cuda_nvrtc/lib/libnvrtc.so.12" ]]; then
        echo "error: the wheel holds no nvidia/cuda_nvrtc/lib/libnvrtc.so.12" >&2
        exit 1
    fi
    rm -rf "$DEST"
    mv "$tmp" "$DEST"
fi

echo "$LIB"
