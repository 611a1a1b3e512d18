#!/usr/bin/env bash
# The CPU reference runtime against itself and against PyTorch, in one run:
#
#   scaling  dplc run gpt_tiny on 2 rank threads (dp=2, micro-batch 4 each)
#            over 1 rank (micro-batch 8), same global batch 8 and seq 64;
#   vs torch dplc on 1 rank over PyTorch eager with torch.set_num_threads(1),
#            the same model, step, AdamW and clipping (bench/torch_gpt2_step.py).
#
# Every figure is tokens per second of the median step after WARMUP steps;
# the three runs alternate REPEATS times. The ratios are the medians of the
# ratios within each repeat (runs seconds apart see similar load), beside the
# ratios of the medians. Run it
# from anywhere in a clone: it builds the release binary and makes the torch
# venv (bench/setup-torch.sh) itself. Other work on the machine skews both
# ratios, so it prints the load average before it starts.
#
#   STEPS=60 WARMUP=10 REPEATS=3 bench/cpu_ranks.sh
#
# BOOST=1 (as root, Linux) runs the measurements in their own scheduler
# autogroup at nice -10, so that compile jobs in other sessions take less of
# the two cores from them; say so when you quote numbers taken that way.
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-60}
WARMUP=${WARMUP:-10}
REPEATS=${REPEATS:-3}

cargo build --release -q
bench/setup-torch.sh
PY=bench/.venv/bin/python
DPLC=target/release/dplc

if [ "${BOOST:-0}" = 1 ] && [ -z "${CPU_RANKS_BOOSTED:-}" ]; then
    # A new session is a new autogroup; its nice weighs it against the others.
    exec env CPU_RANKS_BOOSTED=1 setsid bash -c 'echo -10 > /proc/self/autogroup && exec "$0"' "$0"
fi

echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)${CPU_RANKS_BOOSTED:+ (BOOST=1: autogroup nice -10)}"

# Median step's tokens/s of a `dplc run --json`, steps after the warm-up.
dplc_tps() {
    "$DPLC" run models/tiny.dpl --model gpt_tiny --global-batch 8 --seq 64 \
        --steps "$STEPS" --json "$@" | "$PY" -c '
import json, statistics, sys
warmup = int(sys.argv[1])
steps = [json.loads(l) for l in sys.stdin if l.startswith("{")]
tps = [s["tokens_per_s"] for s in steps if "summary" not in s]
print(f"{statistics.median(tps[warmup:]):.0f}")' "$WARMUP"
}

torch_tps() {
    "$PY" bench/torch_gpt2_step.py --device cpu --threads 1 --modes eager \
        --vocab 256 --d 64 --heads 4 --layers 2 --seq 64 --micro-batch 8 --micro-batches 1 \
        --precision fp32 --dropout 0 --lr 1e-3 --weight-decay 0.01 \
        --warmup "$WARMUP" --steps "$((STEPS - WARMUP))" | awk '/^eager_step/ {print $2}'
}

one=() two=() torch=()
for r in $(seq "$REPEATS"); do
    one+=("$(dplc_tps --cluster 1xcpu --strategy dp=1,mb=8)")
    two+=("$(dplc_tps --cluster 2xcpu --strategy dp=2,mb=4)")
    torch+=("$(torch_tps)")
    echo "run $r: dplc 1 rank ${one[-1]} tok/s, 2 ranks ${two[-1]} tok/s, torch (1 thread) ${torch[-1]} tok/s"
done

"$PY" - "${one[*]}" "${two[*]}" "${torch[*]}" <<'EOF'
import statistics, sys
one, two, torch = ([float(v) for v in a.split()] for a in sys.argv[1:4])
med = statistics.median
print(f"median: dplc 1 rank {med(one):.0f} tok/s, 2 ranks {med(two):.0f} tok/s, "
      f"torch 1 thread {med(torch):.0f} tok/s")
scaling = med([b / a for a, b in zip(one, two)])
vs_torch = med([a / t for a, t in zip(one, torch)])
print(f"scaling 2 ranks / 1 rank: {scaling:.2f}x per repeat, {med(two) / med(one):.2f}x of medians "
      "(target >= 1.6x)")
print(f"dplc 1 rank / torch 1 thread: {vs_torch:.2f}x per repeat, {med(one) / med(torch):.2f}x of "
      "medians (target >= 0.5x)")
EOF
echo "load after: $(cut -d' ' -f1-3 /proc/loadavg)"
