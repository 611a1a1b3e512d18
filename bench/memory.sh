#!/usr/bin/env bash
# The fused compute's measured memory on CPU ranks against the plan's
# prediction: the host backend counts every buffer the kernels use (state,
# activations, the backward's working set), as a GPU's allocator would, and
# `dplc run --json` reports it beside the plan's (`peak_memory_bytes`,
# `predicted_peak_memory_bytes`). One line per configuration, the busiest
# rank against the plan's first stage.
#
#   bench/memory.sh
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q
DPLC=target/release/dplc
echo "date: $(date -u +%Y-%m-%d), $(nproc) cores, $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2- | xargs)"
printf '%-14s %-26s %12s %12s %7s\n' model strategy measured predicted ratio
while read -r file model cluster strategy; do
    "$DPLC" run "models/$file" --model "$model" --cluster "$cluster" --strategy "$strategy" \
        --steps 2 --compute fused --json 2>/dev/null | tail -1 | python3 -c "
import json, sys
d = json.load(sys.stdin)
m, p = d['peak_memory_bytes'], d['predicted_peak_memory_bytes']
print('%-14s %-26s %12d %12d %6.2fx' % ('$model', '$strategy', m, p, m / p))"
done <<'CONFIGS'
tiny.dpl gpt_tiny 1xcpu dp=1
tiny.dpl llama_tiny 1xcpu dp=1
tiny.dpl moe_tiny 1xcpu dp=1
tiny.dpl gpt_tiny 1xcpu recompute=full
tiny.dpl gpt_tiny 1xcpu recompute=selective
tiny.dpl gpt_tiny 1xcpu attention=unfused
tiny.dpl gpt_tiny 2xcpu dp=2,zero=2
tiny.dpl gpt_tiny 2xcpu dp=2,zero=3
tiny.dpl gpt_tiny 2xcpu pp=2
tiny.dpl gpt_tiny 4xcpu dp=2,pp=2,zero=3
tiny.dpl gpt_tiny 2xcpu tp=2,sp=on
tiny.dpl llama_tiny 2xcpu cp=2
tiny.dpl moe_tiny 4xcpu dp=2,ep=2
t5.dpl t5_tiny 2xcpu pp=2
deepseek.dpl deepseek_tiny 2xcpu tp=2
vit.dpl vit_tiny 2xcpu dp=2
mistral.dpl mistral_tiny 1xcpu dp=1
CONFIGS
