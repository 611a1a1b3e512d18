#!/usr/bin/env python3
"""The peer of bench/dp_sync.sh: gpt_tiny trained in PyTorch with DDP on CPU
ranks (gloo), its gradients reduced by PyTorch's own communication hooks —
the all-reduce, `bf16_compress_hook`, `fp16_compress_hook` and
`powerSGD_hook` (error feedback, warm start, `start_powerSGD_iter`), and
top-k with error feedback written as a hook (PyTorch has none) — so that
what each compression costs in loss can be compared with what it costs in
dplc on the same data.

The model is dplc's `gpt_tiny` (models/tiny.dpl) as `dplc inspect --ir`
prints it: the same parameters in the same shapes (matrices stored
input × output, so PowerSGD sees the matrices dplc's does), the same
initialisation (normal 0.02 for matrices and embeddings, LayerNorm ones and
zeros, zero biases), GELU's tanh form, the tied output embedding, mean
cross-entropy. The training is the train section's: AdamW (1e-3, betas 0.9
and 0.95, eps 1e-8, weight decay 0.01 on matrices only, as dplc decays),
linear warm-up then cosine to 0.1× (dplc's `LrSchedule::factor`), global
gradient norm clipped to 1.0 after the reduction.

The data is the token file dplc trains on (`--data FILE.u16`), cut into
windows of seq + 1 tokens at positions drawn from `--seed`: the same
stream, not the same windows (dplc hashes its own positions), so each
tool's compressed run is compared with its own all-reduce run.

    python3 bench/torch_dp_sync.py --tokens T.u16 --mode powersgd:4 \\
        --steps 200 --seq 64 --global-batch 8 --world 4

prints one JSON line: the mode, the losses and the mean of the last 20.
"""
import argparse
import json
import math
import os
import sys

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(d, eps=1e-5)
        self.ln_2 = nn.LayerNorm(d, eps=1e-5)
        mat = lambda i, o: nn.Parameter(torch.randn(i, o) * 0.02)
        vec = lambda n: nn.Parameter(torch.zeros(n))
        self.q_w, self.q_b = mat(d, d), vec(d)
        self.k_w, self.k_b = mat(d, d), vec(d)
        self.v_w, self.v_b = mat(d, d), vec(d)
        self.o_w, self.o_b = mat(d, d), vec(d)
        self.fc_w, self.fc_b = mat(d, 4 * d), vec(4 * d)
        self.proj_w, self.proj_b = mat(4 * d, d), vec(d)

    def forward(self, h):
        b, s, d = h.shape
        x = self.ln_1(h)
        split = lambda t: t.view(b, s, self.heads, d // self.heads).transpose(1, 2)
        q = split(x @ self.q_w + self.q_b)
        k = split(x @ self.k_w + self.k_b)
        v = split(x @ self.v_w + self.v_b)
        scores = (q @ k.transpose(-1, -2)) / math.sqrt(d // self.heads)
        mask = torch.ones(s, s, dtype=torch.bool).triu(1)
        att = scores.masked_fill(mask, float("-inf")).softmax(-1) @ v
        h = h + att.transpose(1, 2).reshape(b, s, d) @ self.o_w + self.o_b
        x = self.ln_2(h)
        x = F.gelu(x @ self.fc_w + self.fc_b, approximate="tanh")
        return h + x @ self.proj_w + self.proj_b


class GptTiny(nn.Module):
    def __init__(self, vocab=256, ctx=64, d=64, heads=4, layers=2):
        super().__init__()
        self.wte = nn.Parameter(torch.randn(vocab, d) * 0.02)
        self.wpe = nn.Parameter(torch.randn(ctx, d) * 0.02)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d, eps=1e-5)

    def forward(self, tokens, targets):
        s = tokens.shape[1]
        h = self.wte[tokens] + self.wpe[:s]
        for blk in self.blocks:
            h = blk(h)
        logits = self.ln_f(h) @ self.wte.t()
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def lr_factor(step, warmup, total, min_ratio):
    """dplc's `LrSchedule::factor` (ir/src/config.rs)."""
    if step < warmup:
        return (step + 1) / warmup
    if step >= total:
        return min_ratio
    progress = (step - warmup) / max(total - warmup, 1)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def hook_for(mode, warmup, group):
    """The DDP communication hook (and its state) for a `compress=` value."""
    name, *rest = mode.split(":")
    if name == "none":
        return None, None
    if name == "bf16":
        return None, default_hooks.bf16_compress_hook
    if name == "fp16":
        return None, default_hooks.fp16_compress_hook
    if name == "powersgd":
        rank = int(rest[0])
        start = int(rest[1]) if len(rest) > 1 else warmup
        state = psgd.PowerSGDState(
            process_group=group,
            matrix_approximation_rank=rank,
            start_powerSGD_iter=max(start, 2),
            min_compression_rate=2,
            use_error_feedback=True,
            warm_start=True,
            random_seed=0,
        )
        return state, psgd.powerSGD_hook
    if name == "topk":
        fraction = float(rest[0])
        start = int(rest[1]) if len(rest) > 1 else warmup
        return TopK(group, fraction, start), topk_hook
    raise SystemExit(f"unknown mode {mode!r}: none, bf16, fp16, powersgd:R[:W] or topk:F[:W]")


class TopK:
    """Top-k with error feedback, as dplc's `compress=topk:F[:W]` (PyTorch
    has no hook for it; this is DGC's local accumulation without momentum
    correction): per matrix, the error added, the ⌈F·numel⌉ largest
    magnitudes all-gathered and summed, the rest kept as the error; vectors
    all-reduced whole; over the first W steps the kept fraction is
    F^((t+1)/(W+1)) (`Compression::topk_fraction_at`)."""

    def __init__(self, group, fraction, warmup):
        self.group, self.fraction, self.warmup = group, fraction, warmup
        self.error = {}
        self.calls = {}

    def fraction_at(self, step):
        if step < self.warmup:
            return self.fraction ** ((step + 1) / (self.warmup + 1))
        return self.fraction


def topk_hook(state, bucket):
    world = dist.get_world_size(state.group)
    flat = bucket.buffer()
    for p, g in zip(bucket.parameters(), bucket.gradients()):
        # The gradients are views of the bucket: writing them writes what
        # the hook returns.
        assert g.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
        step = state.calls.get(id(p), 0)
        state.calls[id(p)] = step + 1
        if p.dim() < 2:
            dist.all_reduce(g, group=state.group)
            g.div_(world)
            continue
        v = g.reshape(-1) + state.error.get(id(p), torch.zeros(g.numel()))
        k = max(1, min(g.numel(), math.ceil(g.numel() * state.fraction_at(step))))
        idx = v.abs().topk(k, sorted=False).indices
        vals = v[idx]
        err = v.clone()
        err[idx] = 0
        state.error[id(p)] = err
        idxs = [torch.empty_like(idx) for _ in range(world)]
        valss = [torch.empty_like(vals) for _ in range(world)]
        dist.all_gather(idxs, idx, group=state.group)
        dist.all_gather(valss, vals, group=state.group)
        total = torch.zeros(g.numel())
        for i, x in zip(idxs, valss):
            total.index_add_(0, i, x)
        g.copy_((total / world).view_as(g))
    fut = torch.futures.Future()
    fut.set_result(flat)
    return fut


def worker(rank, args, tokens, out):
    torch.set_num_threads(1)
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ["MASTER_PORT"] = str(args.port)
    dist.init_process_group("gloo", rank=rank, world_size=args.world)
    torch.manual_seed(args.seed)
    model = GptTiny()
    ddp = nn.parallel.DistributedDataParallel(model)
    state, hook = hook_for(args.mode, args.warmup, dist.group.WORLD)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": rest, "weight_decay": 0.0}],
        lr=1e-3, betas=(0.9, 0.95), eps=1e-8,
    )
    per_rank = args.global_batch // args.world
    positions = np.random.default_rng(args.seed).integers(
        0, len(tokens) - args.seq - 1, size=(args.steps, args.global_batch))
    losses = []
    for step in range(args.steps):
        mine = positions[step, rank * per_rank:(rank + 1) * per_rank]
        win = np.stack([tokens[p:p + args.seq + 1] for p in mine]).astype(np.int64)
        x, y = torch.from_numpy(win[:, :-1]), torch.from_numpy(win[:, 1:])
        for g in opt.param_groups:
            g["lr"] = 1e-3 * lr_factor(step, args.warmup, args.total, 0.1)
        opt.zero_grad(set_to_none=True)
        loss = ddp(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / args.world)
    if rank == 0:
        out.put(losses)
    dist.destroy_process_group()


def write_tokens(path, n, seed):
    """A first-order Markov chain over 256 tokens, each with four likely
    successors (60/25/10/5 %): the kind of stream dplc's synthetic corpus
    is (`Corpus::synthetic`), written as little-endian u16 for both tools."""
    rng = np.random.default_rng(seed)
    succ = rng.integers(0, 256, size=(256, 4))
    choice = rng.choice(4, size=n, p=[0.60, 0.25, 0.10, 0.05])
    tokens = np.empty(n, dtype="<u2")
    cur = 0
    for i in range(n):
        tokens[i] = cur
        cur = succ[cur, choice[i]]
    tokens.tofile(path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", required=True, help="little-endian u16 token file")
    ap.add_argument("--write-tokens", type=int, metavar="N",
                    help="write N tokens of a Markov chain to --tokens and exit")
    ap.add_argument("--mode", default="none", help="none, bf16, fp16, powersgd:R[:W] or topk:F[:W]")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--global-batch", type=int, default=8)
    ap.add_argument("--world", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=10, help="the schedule's warm-up steps")
    ap.add_argument("--total", type=int, default=200, help="the schedule's total steps")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=29517)
    args = ap.parse_args()
    if args.write_tokens:
        write_tokens(args.tokens, args.write_tokens, args.seed)
        return
    if args.global_batch % args.world:
        sys.exit(f"--global-batch {args.global_batch} does not split over {args.world} ranks")
    tokens = np.fromfile(args.tokens, dtype="<u2")
    if len(tokens) <= args.seq + 1:
        sys.exit(f"{args.tokens}: {len(tokens)} tokens, a sample needs {args.seq + 1}")
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    mp.spawn(worker, args=(args, tokens, out), nprocs=args.world, join=True)
    losses = out.get()
    print(json.dumps({
        "peer": f"torch {torch.__version__}",
        "mode": args.mode,
        "losses": losses,
        "last20": sum(losses[-20:]) / min(20, len(losses)),
    }))


if __name__ == "__main__":
    main()
