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
    read -r world tp pp chunks < <("$PY" - "$OUT/$name.ron" <<'PYEOF'
import json, re, sys
t = open(sys.argv[1]).read()
g = lambda k: int(re.search(rf"\b{k}: (\d+)", t).group(1))
# The plan's layers per chunk in pipeline order (chunk c of stage s is
# c·pp + s), as dplc_ir::virtual_stage_layers cuts each stage's layers:
# as equal as they go, the first stage's short chunks first.
stages = [int(n) for n in re.findall(r"stage: \d+,\s*first_layer: \d+,\s*layers: (\d+)", t)]
v = g("virtual_stages")
even = lambda n, k: [n // k + (i < n % k) for i in range(k)]
runs = [even(n, v)[::-1] if s == 0 else even(n, v) for s, n in enumerate(stages)]
chunks = [runs[k % len(stages)][k // len(stages)] for k in range(v * len(stages))]
print(g("nodes") * g("devices_per_node"), g("tp"), g("pp"), json.dumps(chunks, separators=(",", ":")))
PYEOF
)
    for engine in megatron torchtitan deepspeed; do
        ext=$([ "$engine" = megatron ] && echo sh || { [ "$engine" = torchtitan ] && echo toml || echo json; })
        if "$DPLC" export "$OUT/$name.ron" --to "$engine" --closest -o "$OUT/$name.$ext" 2> "$OUT/$name.$engine.err"; then
            # The closest plan the engine runs is not the compiled one: its
            # chunks are not this plan's.
            closest=$(grep -q "exporting the closest plan" "$OUT/$name.$engine.err" && echo true || echo false)
            printf '{"name":"%s","engine":"%s","path":"%s","params":%s,"world":%s,"tp":%s,"pp":%s,"chunks":%s,"closest":%s}\n' \
                "$name" "$engine" "$OUT/$name.$ext" "$params" "$world" "$tp" "$pp" "$chunks" "$closest" >> "$OUT/manifest.jsonl"
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
llama405b_interleaved|models/llama3.dpl|llama3_405b|128x8xH100|--seq 8192 --global-batch 512 --strategy tp=8,pp=8,cp=2,dp=8,mb=1,schedule=interleaved,v=8,zero=1,sp=on,fp8=on,fp8_gather=on,fp8_bf16_ends=1,recompute=none,offload=none
llama405b_fsdp_pp|models/llama3.dpl|llama3_405b|128x8xH100|--seq 8192 --global-batch 512 --strategy tp=8,pp=8,cp=2,dp=8,mb=1,schedule=interleaved,v=8,zero=3,shards=per_param,grad_accum=separate,sp=on,tp_overlap=ring,fp8=on,fp8_gather=on,fp8_bf16_ends=1,recompute=none,offload=none
LIST
"$PY" bench/validate_exports.py "$OUT/manifest.jsonl"
