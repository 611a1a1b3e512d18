#!/usr/bin/env bash
# Check `dplc export` with the engines' own code: Megatron-Core 0.12.0,
# torchtitan 0.2.0 and DeepSpeed 0.16.9 from PyPI (CPU only, no GPU needed)
# read every export of the zoo plans below; Megatron's and torchtitan's
# models are built on the meta device and their parameters counted against
# dplc's. Usage: bench/validate_exports.sh  (prints one line per export).
set -euo pipefail
cd "$(dirname "$0")/.."
bash bench/setup-torch.sh
PY=bench/.venv/bin/python
"$PY" -c 'import torchtitan, deepspeed, megatron.core' 2>/dev/null ||
    bench/.venv/bin/pip install -q "torchtitan==0.2.0" "deepspeed==0.16.9" "megatron-core==0.12.0"
cargo build -q
DPLC=target/debug/dplc
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT
: > "$OUT/manifest.jsonl"
# name | file | model | cluster | extra compile flags
while IFS='|' read -r name file model cluster extra; do
    # shellcheck disable=SC2086
    "$DPLC" compile "$file" --model "$model" --cluster "$cluster" $extra -o "$OUT/$name.ron" > /dev/null
    params=$("$DPLC" inspect "$file" --model "$model" --json | "$PY" -c 'import json,sys; print(json.load(sys.stdin)["params"])')
    read -r world tp pp < <("$PY" - "$OUT/$name.ron" <<'PYEOF'
import re, sys
t = open(sys.argv[1]).read()
g = lambda k: int(re.search(rf"\b{k}: (\d+)", t).group(1))
print(g("nodes") * g("devices_per_node"), g("tp"), g("pp"))
PYEOF
)
    for engine in megatron torchtitan deepspeed; do
        ext=$([ "$engine" = megatron ] && echo sh || { [ "$engine" = torchtitan ] && echo toml || echo json; })
        if "$DPLC" export "$OUT/$name.ron" --to "$engine" --closest -o "$OUT/$name.$ext" 2> "$OUT/$name.$engine.err"; then
            printf '{"name":"%s","engine":"%s","path":"%s","params":%s,"world":%s,"tp":%s,"pp":%s}\n' \
                "$name" "$engine" "$OUT/$name.$ext" "$params" "$world" "$tp" "$pp" >> "$OUT/manifest.jsonl"
        else
            printf '%-28s %-11s dplc refuses: %s\n' "$name" "$engine" \
                "$(grep -m1 -o "cannot build.*" "$OUT/$name.$engine.err" || head -c 200 "$OUT/$name.$engine.err")"
        fi
    done
done <<'LIST'
gpt2_8xa100|models/gpt2.dpl|gpt2|8xA100|
gpt2_pp4|models/gpt2.dpl|gpt2|8xA100|--strategy pp=4,dp=2
llama3_8b_8xh100|models/llama3.dpl|llama3_8b|8xH100|
llama3_70b_8x8xh100|models/llama3.dpl|llama3_70b|8x8xH100|
llama3_70b_pp|models/llama3.dpl|llama3_70b|8x8xH100|--strategy tp=8,pp=4
llama_tiny_tp2pp2|models/tiny.dpl|llama_tiny|8xH100|--strategy tp=2,pp=2,dp=2
mixtral_2x8xh100|models/mixtral.dpl|mixtral_8x7b|2x8xH100|
gpt_1t_384x8xa100|models/megatron_gpt.dpl|gpt_1t|384x8xA100|--global-batch 3072
LIST
"$PY" bench/validate_exports.py "$OUT/manifest.jsonl"
