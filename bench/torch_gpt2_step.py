"""PyTorch baseline for a whole GPT-2 training step, for scripts/gpu-check.sh --torch.

The model is `gpt2` of models/gpt2.dpl: learned positions, pre-LN with biases,
tanh GELU, dropout 0.1, the output projection tied to the token embedding,
cross-entropy over 50257 tokens. The step is the one `dplc run` takes: the
global batch as `--micro-batches` micro-batches of `--micro-batch` sequences
(gradients accumulated), fp32 master weights with bf16 compute (autocast),
global-norm clipping at 1.0 and AdamW (lr 6e-4, betas 0.9/0.95, eps 1e-8,
weight decay 0.1), on synthetic tokens.

Each mode (eager, then torch.compile) runs `--warmup` steps untimed and
`--steps` timed ones, and prints one line:

    eager_step   <tokens/s> tokens/s  <ms> ms/step  loss <first> -> <last>  peak <GiB> GiB

`--device cpu` with a small `--layers/--d/--vocab/--seq` checks the script on
a machine without a GPU. For the CPU reference comparison (bench/cpu_ranks.sh)
the flags match `gpt_tiny` in models/tiny.dpl instead: `--precision fp32`
(no autocast), `--dropout 0`, `--lr 1e-3 --weight-decay 0.01`, and
`--threads 1` (torch.set_num_threads) against one dplc rank."""
import argparse
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F


class Block(nn.Module):
    def __init__(self, d, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln_1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln_2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.out = nn.Linear(4 * d, d)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln_1(x)).split(d, dim=-1)
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in (q, k, v))
        p = self.dropout if self.training else 0.0
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        x = x + F.dropout(self.proj(a.transpose(1, 2).reshape(b, s, d)), p, self.training)
        h = F.gelu(self.fc(self.ln_2(x)), approximate="tanh")
        return x + F.dropout(self.out(h), p, self.training)


class Gpt2(nn.Module):
    def __init__(self, vocab, ctx, d, heads, layers, dropout):
        super().__init__()
        self.dropout = dropout
        self.wte = nn.Embedding(vocab, d)
        self.wpe = nn.Embedding(ctx, d)
        self.blocks = nn.ModuleList(Block(d, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        # GPT-2's initialisation: N(0, 0.02) weights, zero biases.
        for mod in self.modules():
            if isinstance(mod, (nn.Linear, nn.Embedding)):
                nn.init.normal_(mod.weight, std=0.02)
            if isinstance(mod, nn.Linear):
                nn.init.zeros_(mod.bias)

    def forward(self, tokens, targets):
        pos = torch.arange(tokens.shape[1], device=tokens.device)
        h = F.dropout(self.wte(tokens) + self.wpe(pos), self.dropout, self.training)
        for blk in self.blocks:
            h = blk(h)
        logits = self.ln_f(h) @ self.wte.weight.t()
        return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


def synchronize(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def run(mode, args, device):
    torch.manual_seed(0)
    model = Gpt2(args.vocab, args.seq, args.d, args.heads, args.layers, args.dropout)
    model = model.to(device).train()
    # Matrices decay, biases and norm gains do not: dplc's convention (the
    # embeddings are matrices and decay too).
    decay = [p for p in model.parameters() if p.dim() >= 2]
    rest = [p for p in model.parameters() if p.dim() < 2]
    fused = device.type == "cuda"
    opt = torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": rest, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
        fused=fused,
    )
    step_fn = model if mode == "eager" else torch.compile(model)
    m, mb = args.micro_batches, args.micro_batch
    gen = torch.Generator(device="cpu").manual_seed(1)
    batches = [
        torch.randint(0, args.vocab, (m, mb, args.seq + 1), generator=gen) for _ in range(2)
    ]
    batches = [b.to(device) for b in batches]

    def step(i):
        data = batches[i % len(batches)]
        total = 0.0
        for j in range(m):
            x, y = data[j, :, :-1], data[j, :, 1:]
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
                loss = step_fn(x, y) / m
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return float(total)

    losses = [step(i) for i in range(args.warmup)]
    synchronize(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times = []
    for i in range(args.steps):
        t0 = time.perf_counter()
        losses.append(step(args.warmup + i))  # float() waits for the step
        synchronize(device)
        times.append(time.perf_counter() - t0)
    ms = statistics.median(times) * 1e3
    tokens = m * mb * args.seq
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    print(
        f"{mode}_step {tokens / (ms / 1e3):.0f} tokens/s  {ms:.1f} ms/step  "
        f"loss {losses[0]:.4f} -> {losses[-1]:.4f}  peak {peak:.2f} GiB",
        flush=True,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--micro-batches", type=int, default=64)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--vocab", type=int, default=50257)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--heads", type=int, default=12)
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--modes", default="eager,compile")
    ap.add_argument("--precision", choices=["bf16", "fp32"], default="bf16")
    ap.add_argument("--dropout", type=float, default=0.1)
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=0, help="torch.set_num_threads (0: torch's default)")
    args = ap.parse_args()
    if args.threads > 0:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(
        f"device {name} torch {torch.__version__}: gpt2 d {args.d} × {args.layers} layers, "
        f"{args.micro_batches} × {args.micro_batch} sequences of {args.seq}, "
        f"{args.precision}, {torch.get_num_threads()} threads",
        flush=True,
    )
    for mode in args.modes.split(","):
        run(mode, args, device)


if __name__ == "__main__":
    main()
