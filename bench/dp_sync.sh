#!/usr/bin/env bash
# The data-parallel synchronisations and compressions on CPU ranks: gpt_tiny
# on 4 rank threads (dp=4, ZeRO-0, seq 64, global batch 8, the train
# section's AdamW and schedule), one run per mode. For each: the measured
# median step time after WARMUP steps and the bytes the busiest rank sent per
# step for the gradient reduction (and a server's weights), beside what the
# plan predicts for the same `4xcpu` cluster, and the mean loss of the last
# 20 steps against the all-reduce's. Writes each run's `--json` output to
# $OUT (default bench/dp_sync_runs) and draws the loss curves side by side
# with `dplc viz --runs` into $OUT/loss.html. The dedicated-server modes
# start 4 workers and N server rank threads beside them.
#
#   STEPS=200 WARMUP=10 bench/dp_sync.sh
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${STEPS:-200}
WARMUP=${WARMUP:-10}
OUT=${OUT:-bench/dp_sync_runs}
DPLC=${DPLC:-target/release/dplc}
[ "$DPLC" = target/release/dplc ] && cargo build --release -q
mkdir -p "$OUT"
echo "machine: $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
echo "load before: $(cut -d' ' -f1-3 /proc/loadavg)"
MODES="sync=allreduce sync=ps sync=ps,ps_shards=1 sync=ps,ps_ranks=dedicated sync=ps,ps_shards=1,ps_ranks=dedicated sync=async,staleness=0 sync=async,staleness=2 compress=bf16 compress=fp16 compress=powersgd:4 compress=powersgd:16 compress=topk:0.1"
files=()
for mode in $MODES; do
    name=$(echo "$mode" | tr ',=:' '_-_')
    "$DPLC" run models/tiny.dpl --model gpt_tiny --cluster 4xcpu \
        --strategy "dp=4,zero=0,$mode" --steps "$STEPS" --json > "$OUT/$name.json"
    files+=("$OUT/$name.json")
done
python3 - "$WARMUP" "${files[@]}" <<'PY'
import json, statistics, sys
warmup = int(sys.argv[1])
rows = []
for path in sys.argv[2:]:
    lines = [json.loads(l) for l in open(path) if l.strip()]
    steps = [l for l in lines if "step" in l and not l.get("summary")]
    s = next(l for l in lines if l.get("summary"))
    gb = 8
    t = statistics.median(gb / st["samples_per_s"] for st in steps[warmup:])
    last = sum(s["losses"][-20:]) / 20
    rows.append((s["sync"], s["compress"], t, s["predicted_step_time_s"], s["dp_bytes_sent_per_step"], s["predicted_dp_bytes_per_step"], last))
base = rows[0][6]
print("| mode | measured step | predicted step | bytes sent/step (busiest rank) | predicted | mean loss, last 20 steps | vs all-reduce |")
print("|---|---:|---:|---:|---:|---:|---:|")
for sync, comp, t, pt, b, pb, last in rows:
    mode = sync if comp == "none" else f"{sync},compress={comp}"
    print(f"| `{mode}` | {t*1e3:.1f} ms | {pt*1e3:.2f} ms | {b:,.0f} | {pb:,.0f} | {last:.4f} | {100*(last/base-1):+.2f}% |")
PY
"$DPLC" viz --runs "${files[@]}" -o "$OUT/loss.html"
echo "loss curves: $OUT/loss.html"
