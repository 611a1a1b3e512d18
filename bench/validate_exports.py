"""Check `dplc export` files with the engines' own code (bench/validate_exports.sh).

Each entry of the manifest (argv[1], JSON lines) names an export, its engine,
the model's parameter count as dplc counts it and the plan's world size. For
each it builds what the engine builds from that file, on the CPU, without
GPUs or a cluster:

- megatron: Megatron-Core's TransformerConfig from the flags (its
  __post_init__ checks the parallel sizes and their combinations), the
  layers its `get_num_layers_to_build` puts in each pipeline chunk (which
  must be the plan's), then the GPT model itself at tp = pp = 1 on the meta
  device, whose parameter count must equal dplc's (at tp = 1 Megatron pads
  no vocabulary row).
- torchtitan: torchtitan's ConfigManager parses the TOML into its JobConfig;
  ParallelDims validates the degrees against the world; the layers of each
  pipeline part it reads must be the plan's chunks; the llama3 model of
  the flavour (or of the TransformerModelArgs line the export gives) is
  built on the meta device and its parameters counted.
- deepspeed: DeepSpeedConfig reads the JSON with the plan's data-parallel
  size (its batch rule and every section's parser run).

Prints one line per export and exits non-zero if any fails.
"""

import json
import os
import re
import shlex
import sys
import traceback

import torch


def megatron_flags(path):
    text = open(path).read()
    words = shlex.split(text.split("pretrain_gpt.py", 1)[1].replace("\\\n", " "))
    flags, i = {}, 0
    while i < len(words):
        name = words[i]
        if i + 1 < len(words) and not words[i + 1].startswith("--"):
            flags[name] = words[i + 1]
            i += 2
        else:
            flags[name] = True
            i += 1
    return flags


def check_megatron(entry):
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer.transformer_config import TransformerConfig

    f = megatron_flags(entry["path"])
    num = lambda k, d=None: int(f[k]) if k in f else d
    flt = lambda k, d=None: float(f[k]) if k in f else d
    experts = num("--num-experts")
    common = dict(
        num_layers=num("--num-layers"),
        hidden_size=num("--hidden-size"),
        ffn_hidden_size=num("--ffn-hidden-size"),
        num_attention_heads=num("--num-attention-heads"),
        num_query_groups=num("--num-query-groups") if "--group-query-attention" in f else None,
        gated_linear_unit="--swiglu" in f,
        activation_func=torch.nn.functional.silu if "--swiglu" in f else torch.nn.functional.gelu,
        add_bias_linear="--disable-bias-linear" not in f,
        add_qkv_bias="--add-qkv-bias" in f,
        normalization=f["--normalization"],
        layernorm_epsilon=flt("--norm-epsilon"),
        attention_dropout=flt("--attention-dropout"),
        hidden_dropout=flt("--hidden-dropout"),
        num_moe_experts=experts,
        moe_router_topk=num("--moe-router-topk", 2),
        moe_expert_capacity_factor=flt("--moe-expert-capacity-factor"),
        moe_router_load_balancing_type=f.get("--moe-router-load-balancing-type", "aux_loss"),
        bf16="--bf16" in f,
        fp16="--fp16" in f,
        recompute_granularity=f.get("--recompute-granularity"),
        recompute_method=f.get("--recompute-method"),
        recompute_num_layers=num("--recompute-num-layers"),
    )
    pp = num("--pipeline-model-parallel-size", 1)
    vp = num("--num-virtual-stages-per-pipeline-rank")
    # The configuration as the plan runs it: Megatron validates the sizes.
    parallel = TransformerConfig(
        tensor_model_parallel_size=num("--tensor-model-parallel-size", 1),
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=vp,
        context_parallel_size=num("--context-parallel-size", 1),
        expert_model_parallel_size=num("--expert-model-parallel-size", 1),
        sequence_parallel="--sequence-parallel" in f,
        num_layers_in_first_pipeline_stage=num("--decoder-first-pipeline-num-layers"),
        num_layers_in_last_pipeline_stage=num("--decoder-last-pipeline-num-layers"),
        account_for_embedding_in_pipeline_split="--account-for-embedding-in-pipeline-split" in f,
        account_for_loss_in_pipeline_split="--account-for-loss-in-pipeline-split" in f,
        pipeline_dtype=torch.bfloat16 if pp > 1 else None,
        **common,
    )
    # The whole model on one rank, on the meta device: count its parameters.
    if not torch.distributed.is_initialized():
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)
        parallel_state.initialize_model_parallel(1, 1)
    config = TransformerConfig(use_cpu_initialization=True, **common)
    spec = get_gpt_layer_local_spec(num_experts=experts, normalization=f["--normalization"])
    vocab = int(f["--vocab-size"]) + 1  # NullTokenizer's end-of-document id
    with torch.device("meta"):
        model = GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab,
            max_sequence_length=num("--max-position-embeddings"),
            share_embeddings_and_output_weights="--untie-embeddings-and-output-weights" not in f,
            position_embedding_type=f["--position-embedding-type"],
            rotary_base=num("--rotary-base", 10000),
        )
    if pp > 1 and not entry["closest"]:
        built = megatron_chunks(parallel, pp, vp or 1)
        if built != entry["chunks"]:
            raise ValueError(f"Megatron builds chunks of {built} layers, the plan runs {entry['chunks']}")
    return sum(p.numel() for p in model.parameters())


def megatron_chunks(config, pp, vp):
    """The layers Megatron-Core builds in each model chunk, in pipeline order
    (chunk c of stage s is c·pp + s), from its own `get_num_layers_to_build`
    at each pipeline and virtual rank."""
    from megatron.core import parallel_state as ps
    from megatron.core.transformer.transformer_block import get_num_layers_to_build

    chunks = []
    ps.set_pipeline_model_parallel_world_size(pp)
    ps.set_virtual_pipeline_model_parallel_world_size(vp if vp > 1 else None)
    try:
        for c in range(vp):
            for s in range(pp):
                ps.set_pipeline_model_parallel_rank(s)
                if vp > 1:
                    ps.set_virtual_pipeline_model_parallel_rank(c)
                chunks.append(get_num_layers_to_build(config))
    finally:
        ps.set_pipeline_model_parallel_world_size(1)
        ps.set_pipeline_model_parallel_rank(0)
        ps.set_virtual_pipeline_model_parallel_world_size(None)
        ps.set_virtual_pipeline_model_parallel_rank(None)
    return chunks


def check_torchtitan(entry):
    from torchtitan.config import ConfigManager
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import Transformer, TransformerModelArgs, llama3_args

    job = ConfigManager().parse_args(["--job.config_file", entry["path"]])
    p = job.parallelism
    ParallelDims(
        dp_replicate=p.data_parallel_replicate_degree,
        dp_shard=p.data_parallel_shard_degree,
        cp=p.context_parallel_degree,
        tp=p.tensor_parallel_degree,
        pp=p.pipeline_parallel_degree,
        ep=p.expert_parallel_degree,
        etp=p.expert_tensor_parallel_degree,
        world_size=entry["world"],
    )
    parts = p.module_fqns_per_model_part
    if p.pipeline_parallel_degree > 1 and parts and not entry["closest"]:
        # torchtitan builds each pipeline part from these module names, in
        # its part order (chunk c of stage s is part c·pp + s): its layers
        # must be the plan's chunks.
        built = [sum(1 for m in part if m.startswith("layers.")) for part in parts]
        if built != entry["chunks"]:
            raise ValueError(f"torchtitan builds parts of {built} layers, the plan runs {entry['chunks']}")
    args = llama3_args.get(job.model.flavor)
    if args is None:
        line = re.search(r"TransformerModelArgs\(.*\)", open(entry["path"]).read()).group(0)
        args = eval(line, {"TransformerModelArgs": TransformerModelArgs})
    with torch.device("meta"):
        model = Transformer(args)
    return sum(p.numel() for p in model.parameters())


class _Mpu:
    def __init__(self, dp):
        self.dp = dp

    def get_data_parallel_world_size(self):
        return self.dp


def check_deepspeed(entry):
    import deepspeed.runtime.config as ds_config
    from deepspeed.runtime.config import DeepSpeedConfig

    # DeepSpeedConfig asks deepspeed.comm for this rank; its CPU backend would
    # compile a shared-memory extension first, so answer for it.
    ds_config.dist.get_rank = lambda *a, **k: 0
    dp = entry["world"] // (entry["tp"] * entry["pp"])
    DeepSpeedConfig(entry["path"], mpu=_Mpu(dp))
    return None


def main():
    os.environ.setdefault("MASTER_ADDR", "localhost")
    os.environ.setdefault("MASTER_PORT", "29511")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    failed = 0
    for line in open(sys.argv[1]):
        entry = json.loads(line)
        check = {"megatron": check_megatron, "torchtitan": check_torchtitan, "deepspeed": check_deepspeed}
        try:
            count = check[entry["engine"]](entry)
            if count is None:
                verdict = "config accepted"
            elif count == entry["params"]:
                verdict = f"config accepted; model built: {count:,} parameters = dplc's"
            else:
                failed += 1
                verdict = f"MISMATCH: model built with {count:,} parameters, dplc counts {entry['params']:,}"
        except Exception as e:
            failed += 1
            verdict = f"FAILED: {type(e).__name__}: {e}"
            traceback.print_exc(file=sys.stderr)
        print(f"{entry['name']:<28} {entry['engine']:<11} {verdict}", flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
