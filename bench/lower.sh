#!/usr/bin/env bash
# Wall time of `dplc inspect` (parse std + file, lower, analyse, print JSON)
# for the largest zoo models, averaged over N runs of the release binary.
set -euo pipefail
cd "$(dirname "$0")/.."
N=${N:-100}
cargo build --release -q
for spec in llama3.dpl:llama3_405b megatron_gpt.dpl:gpt_1t mixtral.dpl:mixtral_8x7b; do
    file=${spec%%:*} model=${spec##*:}
    start=$(date +%s%N)
    for _ in $(seq "$N"); do
        ./target/release/dplc inspect "models/$file" --model "$model" --json >/dev/null
    done
    end=$(date +%s%N)
    rss=$( { /usr/bin/time -f %M ./target/release/dplc inspect "models/$file" --model "$model" --json >/dev/null; } 2>&1 )
    printf '%-14s %6.2f ms per run (N=%d), max RSS %s KiB\n' "$model" \
        "$(echo "($end - $start) / $N / 1000000" | bc -l)" "$N" "$rss"
done
