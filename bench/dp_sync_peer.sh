#!/usr/bin/env bash
# What each gradient compression costs in loss, in dplc and in PyTorch on the
# same data: gpt_tiny on 4 CPU ranks (dplc's rank threads with
# `--data FILE.u16`; PyTorch's DDP over gloo with its own communication
# hooks, bench/torch_dp_sync.py), the train section's AdamW and schedule,
# 200 steps, at the train section's size (seq 64, global batch 8) and at the
# quarter size tests/dp_sync.rs trains (seq 32, global batch 4). For each
# mode: the mean loss of the last 20 steps, its gap to the same tool's
# all-reduce, and the ratio of dplc's gap to PyTorch's. Sets up bench/.venv
# (bench/setup-torch.sh) on first use.
#
#   bench/dp_sync_peer.sh            # MODES="bf16 powersgd:4 …" to choose
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-200}
OUT=${OUT:-bench/dp_sync_runs/peer}
DPLC=${DPLC:-target/release/dplc}
MODES=${MODES:-"bf16 fp16 powersgd:4 powersgd:8 powersgd:16 topk:0.1 topk:0.2"}
[ "$DPLC" = target/release/dplc ] && cargo build --release -q
bench/setup-torch.sh >/dev/null
PY=bench/.venv/bin/python
mkdir -p "$OUT"
TOKENS="$OUT/markov.u16"
[ -f "$TOKENS" ] || "$PY" bench/torch_dp_sync.py --tokens "$TOKENS" --write-tokens 131072
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs); $("$PY" -c 'import torch; print("torch", torch.__version__)')"
last20() { python3 -c 'import json,sys
ls=[json.loads(l) for l in sys.stdin if l.strip()]
s=[l for l in ls if l.get("summary") or "last20" in l][-1]
print(s.get("last20", sum(s["losses"][-20:])/20))'; }
for size in "64 8" "32 4"; do
    set -- $size
    seq=$1 batch=$2
    echo
    echo "seq $seq, global batch $batch, $STEPS steps"
    echo "| mode | dplc | vs all-reduce | PyTorch | vs all-reduce | gap ratio |"
    echo "|---|---:|---:|---:|---:|---:|"
    base_d="" base_t=""
    for mode in none $MODES; do
        d=$("$DPLC" run models/tiny.dpl --model gpt_tiny --cluster 4xcpu \
            --strategy "dp=4,zero=0,compress=$mode" --steps "$STEPS" --seq "$seq" \
            --global-batch "$batch" --data "$TOKENS" --json | last20)
        t=$("$PY" bench/torch_dp_sync.py --tokens "$TOKENS" --mode "$mode" --steps "$STEPS" \
            --seq "$seq" --global-batch "$batch" 2>/dev/null | last20)
        [ -z "$base_d" ] && base_d=$d base_t=$t
        python3 -c "
d, t, bd, bt = $d, $t, $base_d, $base_t
gd, gt = d / bd - 1, t / bt - 1
ratio = f'{gd / gt:.2f}' if abs(gt) > 1e-3 else '—'
print(f'| \`$mode\` | {d:.4f} | {100*gd:+.2f}% | {t:.4f} | {100*gt:+.2f}% | {ratio} |')"
    done
done
