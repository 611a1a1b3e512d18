#!/usr/bin/env bash
# The GPU check of the CUDA backend, for a machine with an NVIDIA GPU:
#   1. builds the runtime's tests (release);
#   2. runs the GPU tests: every generated kernel (forward, backward, column
#      sums, AdamW) against the CPU interpreter on random inputs (f32 within
#      1e-5, bf16 within 1e-2, norm-wise relative), cuBLAS against a CPU matmul,
#      the allocator, NCCL on one rank; on the schedule executor every split
#      on one GPU against the host backend and, with two GPUs, device-resident
#      state summed by NCCL (dp2 at ZeRO 0-3, pp2);
#   3. benchmarks each fused kernel of a GPT-2-small layer (bf16, batch 8,
#      seq 1024) against a measured device-to-device copy (target >= 85%);
#   4. trains gpt_tiny (20 steps) and gpt2 (5 steps) on GPU 0 with
#      `dplc run --cluster 1xH100 --json`: tokens/s, the loss, and the
#      allocator's measured peak against the plan's predicted peak memory;
#   5. with --torch, times PyTorch eager and torch.compile on a GPT-2-small
#      layer forward+backward, and on the whole gpt2 training step of (4) with
#      the same micro-batch, micro-batch count and sequence
#      (bench/torch_gpt2_step.py), and states dplc's tokens/s against both;
#   6. appends the results, with date, device and command, to bench/RESULTS.md
#      and copies the raw logs to $OUT when that is set.
#
# NVRTC, cuBLAS and NCCL are found as installed (DPLC_NVRTC_LIB, the CUDA
# toolkit, or the nvidia-* wheels PyTorch brings); the machine needs no network.
#
# Status: written without access to a GPU; it has not been run on one yet.
# The training step (4) is the fused executor, tested on the CPU through its
# host backend (tests/fused_matrix.rs), never yet on a GPU.
set -euo pipefail
cd "$(dirname "$0")/.."

TORCH=0
for a in "$@"; do
    case "$a" in
        --torch) TORCH=1 ;;
        *) echo "usage: $0 [--torch]" >&2; exit 2 ;;
    esac
done

LOG_DIR="${OUT:-target/gpu-check}"
mkdir -p "$LOG_DIR"

# Libraries the pip wheels of PyTorch carry (cudarc opens them by soname).
if command -v python3 >/dev/null; then
    WHEEL_LIBS="$(python3 - <<'PY' 2>/dev/null || true
import importlib.util, os
dirs = []
for mod in ("nvidia.cuda_nvrtc", "nvidia.cublas", "nvidia.nccl", "nvidia.cuda_runtime"):
    try:
        spec = importlib.util.find_spec(mod)
    except ModuleNotFoundError:
        spec = None
    if spec and spec.submodule_search_locations:
        d = os.path.join(list(spec.submodule_search_locations)[0], "lib")
        if os.path.isdir(d):
            dirs.append(d)
print(":".join(dirs))
PY
)"
    if [[ -n "$WHEEL_LIBS" ]]; then
        export LD_LIBRARY_PATH="${WHEEL_LIBS}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    fi
fi
if [[ -z "${DPLC_NVRTC_LIB:-}" ]]; then
    for d in ${LD_LIBRARY_PATH//:/ } /usr/local/cuda/lib64 /usr/lib/x86_64-linux-gnu; do
        if [[ -f "$d/libnvrtc.so.12" ]]; then
            export DPLC_NVRTC_LIB="$d/libnvrtc.so.12"
            break
        fi
    done
fi
if [[ -z "${DPLC_NVRTC_LIB:-}" ]]; then
    DPLC_NVRTC_LIB="$(scripts/install-nvrtc.sh)"
    export DPLC_NVRTC_LIB
fi
echo "NVRTC: $DPLC_NVRTC_LIB" >&2

DEVICE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo unknown)"
DATE="$(date -u +%Y-%m-%dT%H:%MZ)"
COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"

cargo build --release -p dplc-runtime --tests

echo "== GPU tests" >&2
cargo test --release -p dplc-runtime --test gpu -- --test-threads=1 --nocapture 2>&1 | tee "$LOG_DIR/gpu-tests.log"

echo "== kernel bandwidth" >&2
cargo test --release -p dplc-runtime --test gpu bench_kernel_bandwidth -- --ignored --nocapture 2>&1 \
    | tee "$LOG_DIR/bandwidth.log"

echo "== training steps" >&2
cargo build --release
TRAIN_LINES=""
for spec in "models/tiny.dpl --model gpt_tiny --steps 20" "models/gpt2.dpl --model gpt2 --steps 5"; do
    name="$(echo "$spec" | tr ' /.' '___')"
    # shellcheck disable=SC2086
    if ./target/release/dplc run $spec --cluster 1xH100 --json > "$LOG_DIR/$name.jsonl" 2> "$LOG_DIR/$name.err"; then
        TRAIN_LINES+="$(python3 - "$LOG_DIR/$name.jsonl" "$spec" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = [l for l in lines if l.get("summary")][-1]
steps = [l for l in lines if "step" in l and not l.get("summary")]
steady = steps[1:] or steps
tps = sum(l["tokens_per_s"] for l in steady) / len(steady)
gib = 1 << 30
m = s.get("predicted_memory") or {}
tensors = s["predicted_peak_memory_bytes"] - m.get("buffers", 0)
print(f"{sys.argv[2]}: {s['steps']} steps, loss {s['first_loss']:.4f} -> {s['final_loss']:.4f}, "
      f"{tps:.0f} tokens/s after the first step, peak {s['peak_memory_bytes']/gib:.2f} GiB measured "
      f"vs {s['predicted_peak_memory_bytes']/gib:.2f} GiB predicted ({tensors/gib:.2f} GiB without "
      f"the plan's buffers: the CUDA context's reserve, gather buffers, the loss gradient; activations "
      f"{m.get('activations', 0)/gib:.2f}), {s['kernels']} kernels")
PY
)"$'\n'
    else
        TRAIN_LINES+="$spec: failed: $(tail -3 "$LOG_DIR/$name.err" | tr '\n' ' ')"$'\n'
    fi
done
echo "$TRAIN_LINES" >&2

TORCH_LINES=""
STEP_LINES=""
if [[ "$TORCH" == 1 ]]; then
    echo "== PyTorch baseline" >&2
    python3 bench/torch_gpt2_layer.py 2>&1 | tee "$LOG_DIR/torch.log"
    TORCH_LINES="$(grep -E '^(eager|compile)' "$LOG_DIR/torch.log" || true)"
    GPT2_RUN="$LOG_DIR/models_gpt2_dpl_--model_gpt2_--steps_5.jsonl"
    if [[ -s "$GPT2_RUN" ]]; then
        # The same step dplc took: its micro-batch, count and sequence.
        read -r MB M SEQ DPLC_TPS < <(python3 - "$GPT2_RUN" <<'PY'
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = [l for l in lines if l.get("summary")][-1]
steps = [l for l in lines if "step" in l and not l.get("summary")]
steady = steps[1:] or steps
tps = sum(l["tokens_per_s"] for l in steady) / len(steady)
print(s["micro_batch"], s["num_micro_batches"], s["seq"], round(tps))
PY
)
        python3 bench/torch_gpt2_step.py --micro-batch "$MB" --micro-batches "$M" --seq "$SEQ" 2>&1 \
            | tee "$LOG_DIR/torch-step.log"
        STEP_LINES="$(grep -E '^(device|eager_step|compile_step)' "$LOG_DIR/torch-step.log" || true)"
        STEP_LINES+=$'\n'"dplc_step ${DPLC_TPS} tokens/s (gpt2, ${M} x ${MB} sequences of ${SEQ}, from step 4)"
        for mode in eager compile; do
            theirs="$(awk -v m="${mode}_step" '$1 == m { print $2 }' "$LOG_DIR/torch-step.log")"
            if [[ -n "$theirs" ]]; then
                STEP_LINES+=$'\n'"dplc / torch ${mode}: $(python3 -c "print(f'{${DPLC_TPS} / ${theirs}:.2f}')")x"
            fi
        done
    else
        STEP_LINES="the gpt2 run of step 4 failed; no step comparison"
    fi
fi

{
    echo
    echo "## GPU check ($DATE, $DEVICE, commit $COMMIT)"
    echo
    echo "\`scripts/gpu-check.sh $*\`"
    echo
    echo "Tests:"
    echo '```'
    grep -E '^(test |test result|SKIPPED)' "$LOG_DIR/gpu-tests.log" || true
    echo '```'
    echo "Fused kernels of a GPT-2-small layer (bf16, batch 8, seq 1024) against a device-to-device copy:"
    echo '```'
    grep -E 'GB/s' "$LOG_DIR/bandwidth.log" || true
    echo '```'
    echo "Training on GPU 0 (\`dplc run … --cluster 1xH100 --json\`):"
    echo '```'
    echo -n "$TRAIN_LINES"
    echo '```'
    if [[ -n "$TORCH_LINES" ]]; then
        echo "PyTorch on the same GPU (GPT-2-small layer forward+backward, bf16, batch 8, seq 1024):"
        echo '```'
        echo "$TORCH_LINES"
        echo '```'
    fi
    if [[ -n "$STEP_LINES" ]]; then
        echo "A whole gpt2 training step, PyTorch (bf16 autocast, fp32 master weights, AdamW, clipping) against dplc:"
        echo '```'
        echo "$STEP_LINES"
        echo '```'
    fi
} >> bench/RESULTS.md
cp bench/RESULTS.md "$LOG_DIR/RESULTS.md"
echo "results appended to bench/RESULTS.md" >&2
