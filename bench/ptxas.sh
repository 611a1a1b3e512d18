#!/usr/bin/env bash
# What the GPU's assembler makes of dplc's kernels, without a GPU: builds the
# PTX of a model's kernels (`dplc build … --cluster 1xH100`, sm_90) and runs
# ptxas (from PyPI's nvidia-cuda-nvcc-cu12 wheel, installed into .cache/nvcc
# on first use; network needed then) with -v on each, printing one line per
# kernel: registers, stack frame, spill stores and loads, shared memory. A
# kernel at 255 registers with spills runs far below the hardware's rate.
#
#   bench/ptxas.sh [MODEL_FILE MODEL] …   (default: gpt2 and llama2_7b)
set -euo pipefail
cd "$(dirname "$0")/.."
VERSION="${DPLC_NVCC_VERSION:-12.8.93}"
PTXAS=".cache/nvcc/$VERSION/nvidia/cuda_nvcc/bin/ptxas"
if [[ ! -x "$PTXAS" ]]; then
    tmp="$(mktemp -d)"
    python3 -m pip download --quiet --no-deps --only-binary=:all: \
        "nvidia-cuda-nvcc-cu12==$VERSION" -d "$tmp" >&2
    mkdir -p ".cache/nvcc/$VERSION"
    (cd ".cache/nvcc/$VERSION" && unzip -o -q "$tmp"/nvidia_cuda_nvcc*.whl 'nvidia/cuda_nvcc/bin/ptxas')
    chmod +x "$PTXAS"
    rm -rf "$tmp"
fi
export DPLC_NVRTC_LIB="${DPLC_NVRTC_LIB:-$(scripts/install-nvrtc.sh)}"
cargo build --release --locked -p dplc >&2
if [[ $# -eq 0 ]]; then
    set -- models/gpt2.dpl gpt2 models/llama2.dpl llama2_7b
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
while [[ $# -ge 2 ]]; do
    file="$1" model="$2"
    shift 2
    # A plan that fits one GPU: full recomputation, on the largest catalog part.
    ./target/release/dplc build "$file" --model "$model" --cluster 1xH200 \
        --strategy recompute=full -o "$work/$model" >&2
    echo "$model (sm_90, $("$PTXAS" --version | tail -1))"
    printf '  %-48s %5s %7s %7s %7s %7s\n' kernel regs stack spill_st spill_ld smem
    for ptx in "$work/$model"/kernels/*.ptx; do
        info="$("$PTXAS" -arch=sm_90 -v "$ptx" -o /dev/null 2>&1)"
        regs="$(grep -oE 'Used [0-9]+ registers' <<<"$info" | grep -oE '[0-9]+' | head -1 || true)"
        stack="$(grep -oE '[0-9]+ bytes stack frame' <<<"$info" | grep -oE '^[0-9]+' | head -1 || true)"
        st="$(grep -oE '[0-9]+ bytes spill stores' <<<"$info" | grep -oE '^[0-9]+' | head -1 || true)"
        ld="$(grep -oE '[0-9]+ bytes spill loads' <<<"$info" | grep -oE '^[0-9]+' | head -1 || true)"
        smem="$(grep -oE '[0-9]+ bytes smem' <<<"$info" | grep -oE '^[0-9]+' | head -1 || true)"
        printf '  %-48s %5s %7s %7s %7s %7s\n' "$(basename "$ptx" .ptx)" "${regs:-?}" "${stack:-0}" "${st:-0}" "${ld:-0}" "${smem:-0}"
    done
done
