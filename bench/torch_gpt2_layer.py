"""PyTorch baseline for scripts/gpu-check.sh --torch: one GPT-2-small layer
(pre-LN attention + GELU-tanh MLP, d 768, 12 heads), forward + backward, bf16,
batch 8, seq 1024, in eager mode and under torch.compile. Prints
`eager <ms>` and `compile <ms>` lines (median of 50 after warm-up)."""
import statistics
import torch
import torch.nn as nn
import torch.nn.functional as F

B, S, D, H = 8, 1024, 768, 12


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln1 = nn.LayerNorm(D)
        self.qkv = nn.Linear(D, 3 * D)
        self.proj = nn.Linear(D, D)
        self.ln2 = nn.LayerNorm(D)
        self.fc = nn.Linear(D, 4 * D)
        self.out = nn.Linear(4 * D, D)

    def forward(self, x):
        q, k, v = self.qkv(self.ln1(x)).split(D, dim=-1)
        shape = (B, S, H, D // H)
        q, k, v = (t.view(shape).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(B, S, D))
        return x + self.out(F.gelu(self.fc(self.ln2(x)), approximate="tanh"))


def bench(fn, x):
    times = []
    for i in range(60):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(x).float().sum().backward()
        end.record()
        torch.cuda.synchronize()
        if i >= 10:
            times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    layer = Layer().cuda().to(torch.bfloat16)
    x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"eager {bench(layer, x):.3f} ms")
    print(f"compile {bench(torch.compile(layer), x):.3f} ms")


if __name__ == "__main__":
    main()
