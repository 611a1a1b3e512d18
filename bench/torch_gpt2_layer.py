"""PyTorch baseline for scripts/gpu-check.sh --torch: one GPT-2-small layer
(pre-LN attention + GELU-tanh MLP, d 768, 12 heads), forward + backward, bf16,
batch 8, seq 1024, in eager mode and under torch.compile. Prints
`eager <ms>` and `compile <ms>` lines (median of 50 after warm-up)."""
import statistics
import torch

from torch_gpt2_step import Block

B, S, D, H = 8, 1024, 768, 12


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
    layer = Block(D, H, dropout=0.0).cuda().to(torch.bfloat16)
    x = torch.randn(B, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    print(f"eager {bench(layer, x):.3f} ms")
    print(f"compile {bench(torch.compile(layer), x):.3f} ms")


if __name__ == "__main__":
    main()
