"""PyTorch's peer for runtime/tests/gpu.rs::bench_attention (scripts/gpu-check.sh
--torch): causal scaled_dot_product_attention on the flash backend, bf16, at
the same shapes (GPT-2 small: batch 8, 12 heads of 64, seq 1024, without
dropout and with GPT-2's 0.1, and a gpt2 step's 32 sequences with dropout;
Llama 2 7B: batch 2, 32 heads of 128, seq 4096),
random operands. Prints one `sdpa` line
per shape: the forward, and the backward as (forward+backward) - forward,
median of 30 after warm-up, timed with CUDA events, with TFLOP/s in
FlashAttention's convention (forward 2*b*h*s^2*d for causal, backward 2.5x)."""
import statistics

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

SHAPES = [
    ("gpt2", 8, 12, 64, 1024, 0.0),
    ("llama2_7b", 2, 32, 128, 4096, 0.0),
    ("gpt2_dropout", 8, 12, 64, 1024, 0.1),
    ("gpt2_step", 32, 12, 64, 1024, 0.1),
]


def median_ms(fn, reps=30, warmup=5):
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main():
    torch.manual_seed(0)
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}")
    for name, b, h, d, s, p in SHAPES:
        q, k, v = (
            torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(3)
        )
        grad = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16)
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            fwd = median_ms(lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p))

            def step():
                out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
                out.backward(grad)

            both = median_ms(step)
        bwd = both - fwd
        flops = 2.0 * b * h * s * s * d
        print(
            f"sdpa {name} b{b} h{h} d{d} s{s}: fwd {fwd:.3f} ms ({flops / fwd / 1e9:.0f} TFLOP/s), "
            f"bwd {bwd:.3f} ms ({2.5 * flops / bwd / 1e9:.0f} TFLOP/s), fwd+bwd {both:.3f} ms"
        )


if __name__ == "__main__":
    main()
