#!/usr/bin/env bash
# The GPU check of the CUDA backend, for a machine with an NVIDIA GPU:
#   1. the GPU tests (runtime/tests/gpu.rs): every generated kernel (forward,
#      backward, column sums, AdamW) and every fused-attention pass against the
#      CPU interpreter on random inputs (f32 within 1e-5, bf16 within 1e-2,
#      norm-wise relative), cuBLAS against a CPU matmul, the allocator, NCCL
#      on one rank; on the schedule executor every split on one GPU against
#      the host backend (serial, dp2 ZeRO-3, tp2 with sequence parallelism,
#      pp2 1F1B) and, with two GPUs, device-resident state summed by NCCL;
#   2. each fused kernel of a GPT-2-small layer (bf16, batch 32, seq 1024:
#      the gpt2 step's micro-batch) against a measured device-to-device copy
#      (target >= 85%), and against a copy of its own bytes;
#   3. fused attention forward and backward (bf16, causal) at GPT-2-small's
#      and Llama 2 7B's shapes; with --torch, PyTorch's flash SDPA at the same
#      shapes (bench/torch_attention.py) and the ratio (target >= 0.8x);
#   4. trains gpt_tiny, gpt2 (with its dropout and without: what the draws
#      cost a step) and a Llama-shaped model (bench/llama_gpu.dpl) on GPU 0
#      with `dplc run --cluster 1xPART --json` (PART the catalog's name for
#      this GPU: H200, H100, …, so that the predictions are this device's),
#      gpt2 again with the attention tunings part 3 measured faster
#      (DPLC_ATTENTION_TUNING), and gpt2 split tp=2 and pp=2
#      over two ranks sharing GPU 0 (`--cluster 2xPART --gpus 1`) beside
#      the same step unsplit: losses, tokens/s, the measured step against
#      the plan's predicted step, the allocator's measured peak
#      against the plan's predicted peak memory;
#      and profiles a gpt2 step (DPLC_PROFILE=1: every call waited for and
#      timed, one row per kernel, matmul shape and memory operation), and
#      the tp=2 step of two ranks sharing the GPU;
#   4c. with the `ncu` part (where Nsight Compute reads the counters: the
#      Firecracker machines), the fused attention's passes at Llama 2 7B's
#      shape and the gpt2 step's, and the embedding's backward, profiled
#      (bench/ncu_summary.py: one line per kernel of what bounds it);
#   5. with --torch, PyTorch eager and torch.compile on a GPT-2-small layer
#      forward+backward, and on the whole gpt2 training step of (4) with the
#      same micro-batch, micro-batch count and sequence
#      (bench/torch_gpt2_step.py), and dplc's tokens/s against both; eager
#      again without dropout, beside dplc's dropout-free run;
#      and (torch-gemm) cuBLAS's sustained GEMM rate by shape, bf16 and FP8,
#      over the training GEMMs of linears of hidden 2,048-16,384 at tp 1-8
#      (bench/torch_gemm_sweep.py: what a shape-dependent GEMM rate in the
#      cost model would be read from);
#   6. writes the results, with date, device and command, to
#      $LOG_DIR/gpu-check.md and appends them to bench/RESULTS.md; the raw logs
#      go to $LOG_DIR (target/gpu-check, or $OUT when that is set, as one
#      logs.tar.gz).
#
# Every part runs under its own time limit and a failing part does not stop
# the others; the script exits non-zero when any part failed.
#
# Binaries: built with cargo where the machine has it (unless
# DPLC_GPU_PREBUILT is set); else the ones scripts/gpu-prebuild.sh left in
# .gpu-bin/ (build them on a machine with a toolchain and carry the folder).
#
# Libraries: NVRTC, cuBLAS and NCCL as installed (the CUDA toolkit, or the
# nvidia-* wheels PyTorch brings), CUDA 12 or 13: cudarc opens them by the
# CUDA 12 sonames, so the script links the ones it finds under those names in
# a folder it puts first on LD_LIBRARY_PATH (the calls dplc makes are the same
# in both). The machine needs no network.
set -uo pipefail
cd "$(dirname "$0")/.."

ARGS="$*"
TORCH=0
PARTS="tests,bandwidth,attention,train,profile,ncu,torch-layer,torch-step,torch-gemm"
while [[ $# -gt 0 ]]; do
    case "$1" in
        --torch) TORCH=1 ;;
        --parts) PARTS="${2:?--parts takes a comma-separated list}"; shift ;;
        *) echo "usage: $0 [--torch] [--parts tests,bandwidth,attention,train,profile,ncu,torch-layer,torch-step,torch-gemm]" >&2; exit 2 ;;
    esac
    shift
done
# Whether part $1 was asked for.
wanted() { [[ ",$PARTS," == *",$1,"* ]]; }

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: no NVIDIA GPU here (nvidia-smi -L fails); the GPU tests skip without one: cargo test -p dplc-runtime --test gpu" >&2
    exit 1
fi

LOG_DIR="target/gpu-check"
rm -rf "$LOG_DIR"
mkdir -p "$LOG_DIR"
FAILED=()
# Run one part under a time limit; a failure is recorded, not fatal.
part() {
    local name="$1" limit="$2"
    shift 2
    echo "== $name" >&2
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@"
    local rc=$?
    echo "== $name: exit $rc after $((SECONDS - t0)) s" >&2
    if [[ $rc != 0 ]]; then
        FAILED+=("$name (exit $rc)")
    fi
    # The logs so far, in case the machine is taken back before the end.
    finish
    return 0
}
finish() {
    if [[ -n "${OUT:-}" ]]; then
        tar czf "$OUT/logs.tar.gz" -C "$LOG_DIR" . 2>/dev/null
        [[ -f "$LOG_DIR/gpu-check.md" ]] && cp "$LOG_DIR/gpu-check.md" "$OUT/"
    fi
}
trap finish EXIT

# --- the libraries, under the sonames cudarc opens
CULIBS="$PWD/$LOG_DIR/culibs"
export DPLC_PTX_CACHE="$PWD/$LOG_DIR/ptx"
# shellcheck source=scripts/cuda-env.sh
source scripts/cuda-env.sh
DEVICE="$(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | head -1 || echo unknown)"
# The catalog part the runs' plans are priced for: the GPU this is, so the
# predicted step and memory describe this device (H100 where unknown).
case "$DEVICE" in
    *GH200*) PART=GH200 ;;
    *H200*) PART=H200 ;;
    *B200*) PART=B200 ;;
    *A100*) PART=A100 ;;
    *) PART=H100 ;;
esac
DATE="$(date -u +%Y-%m-%dT%H:%MZ)"
if [[ -n "${DPLC_GPU_PREBUILT:-}" && -f .gpu-bin/COMMIT ]]; then
    COMMIT="$(cat .gpu-bin/COMMIT)"
else
    COMMIT="$(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
fi
{
    echo "device: $DEVICE"
    nvidia-smi 2>&1 | head -15
    python3 -c 'import torch; print("torch", torch.__version__, torch.version.cuda)' 2>&1
    echo "LD_LIBRARY_PATH=$LD_LIBRARY_PATH"
    ls -l "$CULIBS"
} > "$LOG_DIR/env.log" 2>&1

# --- the binaries
if [[ -z "${DPLC_GPU_PREBUILT:-}" ]] && command -v cargo >/dev/null; then
    scripts/gpu-prebuild.sh || exit 1
fi
BIN="$PWD/.gpu-bin"
if [[ ! -x "$BIN/dplc" || ! -x "$BIN/gpu-tests" ]]; then
    echo "error: no cargo here and no .gpu-bin/: run scripts/gpu-prebuild.sh on a machine with a Rust toolchain and carry .gpu-bin" >&2
    exit 1
fi
DPLC="$BIN/dplc"
TESTS="$BIN/gpu-tests"

# --- 1. correctness
wanted tests && part "GPU tests" 240 bash -c "'$TESTS' --test-threads=1 --nocapture > '$LOG_DIR/gpu-tests.log' 2>&1"

# --- 2. bandwidth
wanted bandwidth && part "kernel bandwidth" 180 bash -c "'$TESTS' bench_kernel_bandwidth --ignored --nocapture > '$LOG_DIR/bandwidth.log' 2>&1"

# --- 3. attention
wanted attention && part "fused attention" 150 bash -c "'$TESTS' bench_attention --ignored --nocapture > '$LOG_DIR/attention.log' 2>&1"
if [[ "$TORCH" == 1 ]] && wanted attention; then
    part "torch attention" 90 bash -c "PYTHONUNBUFFERED=1 python3 bench/torch_attention.py > '$LOG_DIR/torch-attention.log' 2>&1"
fi

# --- 4. training
# gpt2 without dropout, beside the run with it: what the draws cost a step.
sed 's/dropout = 0\.1)/dropout = 0.0)/' models/gpt2.dpl > "$LOG_DIR/gpt2_nodrop.dpl"
RUNS=(
    "tiny|models/tiny.dpl --model gpt_tiny --steps 20"
    "gpt2|models/gpt2.dpl --model gpt2 --global-batch 32 --steps 4"
    "gpt2_nodrop|$LOG_DIR/gpt2_nodrop.dpl --model gpt2 --global-batch 32 --steps 4"
    "llama|bench/llama_gpu.dpl --model llama_gpu --steps 3"
    # Five steps at 8 sequences (each ~35-60 ms): the median of the four
    # after the first is not the last, which in two-rank runs on one GPU
    # read ~110 ms slower in three of four runs (ninth H200 session).
    "gpt2_serial|models/gpt2.dpl --model gpt2 --global-batch 8 --steps 5"
    "gpt2_tp2|models/gpt2.dpl --model gpt2 --global-batch 8 --steps 5 --cluster 2x$PART --gpus 1 --strategy tp=2"
    "gpt2_pp2|models/gpt2.dpl --model gpt2 --global-batch 8 --steps 5 --cluster 2x$PART --gpus 1 --strategy pp=2"
)
# gpt2 again with the attention's tunings the benchmark measured faster at
# the step's shape (bench/gpu_targets.py --faster-tuning), where any was.
TUNING="$(python3 bench/gpu_targets.py --faster-tuning "$LOG_DIR" gpt2_step 2>/dev/null || true)"
[[ -n "$TUNING" ]] && RUNS+=("gpt2_tuned|models/gpt2.dpl --model gpt2 --global-batch 32 --steps 4")
wanted train || RUNS=()
for r in "${RUNS[@]}"; do
    name="${r%%|*}"
    spec="${r#*|}"
    [[ "$spec" == *--cluster* ]] || spec+=" --cluster 1x$PART"
    env=""
    [[ "$name" == gpt2_tuned ]] && env="DPLC_ATTENTION_TUNING=$TUNING"
    echo "${env:+$env }$spec" > "$LOG_DIR/$name.cmd"
    # shellcheck disable=SC2086
    part "train $name" 120 bash -c "$env '$DPLC' run $spec --json > '$LOG_DIR/$name.jsonl' 2> '$LOG_DIR/$name.err'"
done
TRAIN_LINES="$(python3 - "$LOG_DIR" <<'PY'
import json, os, sys
d = sys.argv[1]
gib = 1 << 30
for name in ["tiny", "gpt2", "gpt2_nodrop", "gpt2_tuned", "llama", "gpt2_serial", "gpt2_tp2", "gpt2_pp2"]:
    if not os.path.exists(os.path.join(d, name + ".cmd")):
        continue
    cmd = open(os.path.join(d, name + ".cmd")).read().strip()
    try:
        lines = [json.loads(l) for l in open(os.path.join(d, name + ".jsonl")) if l.strip()]
        s = [l for l in lines if l.get("summary")][-1]
    except Exception:
        err = open(os.path.join(d, name + ".err")).read().strip().splitlines()[-3:]
        print(f"dplc run {cmd}: failed: {' / '.join(err)}")
        continue
    steps = [l for l in lines if "step" in l and not l.get("summary")]
    steady = steps[1:] or steps
    step_s = sorted(s["global_batch"] / l["samples_per_s"] for l in steady)[len(steady) // 2]
    line = (f"dplc run {cmd}: {s['steps']} steps, losses {' '.join(f'{x:.4f}' for x in s['losses'])}; "
            f"step {step_s * 1e3:.1f} ms measured (median after the first) vs {s['predicted_step_time_s'] * 1e3:.1f} ms "
            f"predicted ({step_s / s['predicted_step_time_s']:.2f}x); {s.get('tokens_per_s', 0):.0f} tokens/s overall")
    if "peak_memory_bytes" in s:
        # The allocator's peak against the plan's peak less the runtime's
        # reserve outside the allocator (the CUDA context and workspaces).
        alloc = s["predicted_allocator_peak_bytes"]
        line += (f"; allocator peak {s['peak_memory_bytes'] / gib:.3f} GiB measured vs {alloc / gib:.3f} GiB "
                 f"predicted ({s['peak_memory_bytes'] / max(alloc, 1):.3f}x; "
                 f"{s['predicted_peak_memory_bytes'] / gib:.3f} GiB with the reserve)")
    line += f"; {s.get('kernels', '?')} kernels, collectives {s.get('collectives', '?')}"
    if "host_crossings" in s:
        # Uploads and downloads over the whole run, the busiest rank's.
        line += f", {s['host_crossings']} host crossings in {s['steps']} steps"
    if s.get("gpus") and s.get("ranks", 0) > s["gpus"]:
        # The plan priced a device a rank; these ranks shared the GPU, whose
        # allocator is compared with their stages' predictions summed.
        line += (f"; the plan priced {s['ranks']} devices, {s['ranks']} ranks shared {s['gpus']} GPU"
                 " (its memory predicted as their stages' summed)")
    print(line)
PY
)"
echo "$TRAIN_LINES" >&2

# --- 4b. where a gpt2 step's time goes: every call waited for and timed
if wanted profile; then
    part "profile gpt2" 180 bash -c "DPLC_PROFILE=1 '$DPLC' run models/gpt2.dpl --model gpt2 --global-batch 32 --steps 3 --cluster 1x$PART --json --trace '$LOG_DIR/gpt2-trace.json' > '$LOG_DIR/profile.jsonl' 2> '$LOG_DIR/profile.err'"
    # Two ranks sharing the GPU: one table per rank and backend (where
    # host-staged collectives spend a tp=2 step).
    part "profile gpt2 tp2" 120 bash -c "DPLC_PROFILE=1 '$DPLC' run models/gpt2.dpl --model gpt2 --global-batch 8 --steps 2 --cluster 2x$PART --gpus 1 --strategy tp=2 --json --trace '$LOG_DIR/tp2-trace.json' > '$LOG_DIR/profile-tp2.jsonl' 2> '$LOG_DIR/profile-tp2.err'"
    # And a pp=2 step: where its hops, tied-embedding sum and waits go.
    part "profile gpt2 pp2" 120 bash -c "DPLC_PROFILE=1 '$DPLC' run models/gpt2.dpl --model gpt2 --global-batch 8 --steps 2 --cluster 2x$PART --gpus 1 --strategy pp=2 --json --trace '$LOG_DIR/pp2-trace.json' > '$LOG_DIR/profile-pp2.jsonl' 2> '$LOG_DIR/profile-pp2.err'"
fi

# --- 4c. what bounds the attention's passes and the embedding's backward:
# Nsight Compute's counters, one launch of each kernel (the benchmarks run
# each timed call once under DPLC_BENCH_PROFILED). The clocks are left as
# they are (METHOD.md), so the durations are the run's own.
if wanted ncu; then
    NCU="$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)"
    SECTIONS="--section SpeedOfLight --section LaunchStats --section Occupancy --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis"
    if [[ -z "$NCU" ]]; then
        echo "ncu: not found on PATH or under /opt/nvidia/nsight-compute" > "$LOG_DIR/ncu-attention.log"
        FAILED+=("ncu (not installed)")
    else
        # shellcheck disable=SC2086
        part "ncu attention" 150 bash -c "DPLC_BENCH_PROFILED=1 DPLC_BENCH_SHAPES=llama2_7b,gpt2_step '$NCU' --clock-control none -k 'regex:^attention_' $SECTIONS '$TESTS' bench_attention --ignored --nocapture > '$LOG_DIR/ncu-attention.log' 2>&1"
        # shellcheck disable=SC2086
        part "ncu embedding backward" 90 bash -c "DPLC_BENCH_PROFILED=1 '$NCU' --clock-control none -k 'regex:^embedding.*backward' $SECTIONS '$TESTS' bench_kernel_bandwidth --ignored --nocapture > '$LOG_DIR/ncu-bandwidth.log' 2>&1"
    fi
fi

# --- 5. PyTorch
TORCH_LINES=""
STEP_LINES=""
if [[ "$TORCH" == 1 ]] && wanted torch-layer; then
    part "torch layer" 150 bash -c "PYTHONUNBUFFERED=1 python3 bench/torch_gpt2_layer.py > '$LOG_DIR/torch.log' 2>&1"
    TORCH_LINES="$(grep -E '^(eager|compile)' "$LOG_DIR/torch.log" || true)"
fi
if [[ "$TORCH" == 1 ]] && wanted torch-step; then
    if read -r MB M SEQ DPLC_TPS < <(python3 - "$LOG_DIR/gpt2.jsonl" <<'PY' 2>/dev/null
import json, sys
lines = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
s = [l for l in lines if l.get("summary")][-1]
steps = [l for l in lines if "step" in l and not l.get("summary")]
steady = steps[1:] or steps
tps = sorted(l["tokens_per_s"] for l in steady)[len(steady) // 2]
print(s["micro_batch"], s["num_micro_batches"], s["seq"], round(tps))
PY
    ); then
        part "torch step" 200 bash -c "PYTHONUNBUFFERED=1 python3 bench/torch_gpt2_step.py --micro-batch $MB --micro-batches $M --seq $SEQ --warmup 1 --steps 3 > '$LOG_DIR/torch-step.log' 2>&1"
        STEP_LINES="$(grep -E '^(device|eager_step|compile_step)' "$LOG_DIR/torch-step.log" || true)"
        # PyTorch eager without dropout, beside dplc's gpt2_nodrop run.
        part "torch step, no dropout" 120 bash -c "PYTHONUNBUFFERED=1 python3 bench/torch_gpt2_step.py --micro-batch $MB --micro-batches $M --seq $SEQ --warmup 1 --steps 3 --modes eager --dropout 0 > '$LOG_DIR/torch-step-nodrop.log' 2>&1"
        NODROP="$(awk '$1 == "eager_step" { print $2 }' "$LOG_DIR/torch-step-nodrop.log")"
        [[ -n "$NODROP" ]] && STEP_LINES+=$'\n'"eager_step without dropout: ${NODROP} tokens/s"
        STEP_LINES+=$'\n'"dplc_step ${DPLC_TPS} tokens/s (gpt2, ${M} x ${MB} sequences of ${SEQ}, median after the first step)"
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

GEMM_LINES=""
if [[ "$TORCH" == 1 ]] && wanted torch-gemm; then
    part "torch gemm sweep" 150 bash -c "PYTHONUNBUFFERED=1 python3 bench/torch_gemm_sweep.py --csv '$LOG_DIR/gemm-sweep.csv' > '$LOG_DIR/gemm-sweep.log' 2>&1"
    GEMM_LINES="$(grep -E '^(device|gemm_summary|gemm [a-z0-9]+ 8192 8192 8192|fp8:)' "$LOG_DIR/gemm-sweep.log" || true)"
fi

{
    echo
    echo "## GPU check ($DATE, $DEVICE, commit $COMMIT)"
    echo
    echo "\`scripts/gpu-check.sh $ARGS\`"
    echo
    if [[ ${#FAILED[@]} -gt 0 ]]; then
        echo "Failed parts: ${FAILED[*]}"
        echo
    fi
    echo "Issue #20's targets (\`bench/gpu_targets.py\` on this run's logs):"
    echo
    python3 bench/gpu_targets.py "$LOG_DIR" || true
    echo
    echo "Tests:"
    echo '```'
    grep -E '^(test |test result|SKIPPED|[0-9]+ attention passes)' "$LOG_DIR/gpu-tests.log" || true
    echo '```'
    echo "Fused kernels of a GPT-2-small layer (bf16, batch 32, seq 1024) against a device-to-device copy of 256 MiB and of the kernel's bytes:"
    echo '```'
    grep -E 'GB/s' "$LOG_DIR/bandwidth.log" || true
    echo '```'
    echo "Fused attention (bf16, causal), dplc against PyTorch's flash SDPA:"
    echo '```'
    grep -E '^(attention|variant) ' "$LOG_DIR/attention.log" || true
    grep -E '^sdpa ' "$LOG_DIR/torch-attention.log" 2>/dev/null || true
    echo '```'
    if grep -q '^DPLC_PROFILE' "$LOG_DIR/profile.err" 2>/dev/null; then
        echo "Where a gpt2 step's time goes (\`DPLC_PROFILE=1 dplc run models/gpt2.dpl --global-batch 32 --steps 3\`, every call waited for; one table per backend: the compute's, then the training state's):"
        echo '```'
        grep -A 44 '^DPLC_PROFILE' "$LOG_DIR/profile.err" || true
        echo '```'
    fi
    if grep -q '^DPLC_PROFILE' "$LOG_DIR/profile-tp2.err" 2>/dev/null; then
        echo "Two ranks sharing the GPU (\`DPLC_PROFILE=1 dplc run models/gpt2.dpl --global-batch 8 --steps 2 --cluster 2x$PART --gpus 1 --strategy tp=2\`; a table per rank and backend, the 16 costliest rows each):"
        echo '```'
        grep -A 18 '^DPLC_PROFILE' "$LOG_DIR/profile-tp2.err" || true
        echo '```'
    fi
    if grep -q '^DPLC_PROFILE' "$LOG_DIR/profile-pp2.err" 2>/dev/null; then
        echo "The same with pp=2 (\`--strategy pp=2\`):"
        echo '```'
        grep -A 18 '^DPLC_PROFILE' "$LOG_DIR/profile-pp2.err" || true
        echo '```'
    fi
    if [[ -f "$LOG_DIR/ncu-attention.log" ]]; then
        echo "Nsight Compute on one launch of each kernel (\`bench/ncu_summary.py\`; the attention at Llama 2 7B's shape and the gpt2 step's — the forward twice, as launched and under \`__launch_bounds__(128)\`, and the two-pass backward beside the one-pass — then the embedding's backward; the whole reports are in the logs):"
        echo '```'
        python3 bench/ncu_summary.py "$LOG_DIR/ncu-attention.log" "$LOG_DIR/ncu-bandwidth.log" 2>&1 || tail -5 "$LOG_DIR/ncu-attention.log"
        echo '```'
    fi
    echo "Training (\`dplc run … --json\`):"
    echo '```'
    echo "$TRAIN_LINES"
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
    if [[ -n "$GEMM_LINES" ]]; then
        echo "cuBLAS's sustained GEMM rate by shape (\`bench/torch_gemm_sweep.py\`; every shape in gemm-sweep.csv):"
        echo '```'
        echo "$GEMM_LINES"
        echo '```'
    fi
} > "$LOG_DIR/gpu-check.md"
cat "$LOG_DIR/gpu-check.md" >> bench/RESULTS.md
cat "$LOG_DIR/gpu-check.md"
if [[ ${#FAILED[@]} -gt 0 ]]; then
    echo "failed: ${FAILED[*]}" >&2
    exit 1
fi
