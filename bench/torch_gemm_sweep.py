#!/usr/bin/env python3
"""Sustained GEMM rates by shape on this GPU, for the cost model's GEMM rate.

dplc prices every aligned GEMM of a device at one sustained rate (the
catalog's `matmul_efficiency`, Bekman's MSMF: the best shape, the GPU soaked
at its power limit) less wave quantization. Megatron-Core's weak-scaling
table (bench/RESULTS.md) reads the small models fast, as a rate that falls
with the GEMM's size would explain. This measures that fall instead of
fitting it: the three GEMMs of each linear layer of transformer training
(forward, input gradient, weight gradient) at hidden sizes 2,048-16,384,
FFN 4h and Llama's 3.5h, tensor-parallel splits 1, 2, 4 and 8, 8,192 tokens
a micro-batch; bf16 through cuBLAS (`torch.matmul`), and FP8 (e4m3, per
tensor scales, `torch._scaled_mm`) where the GPU has it.

The GPU is first soaked (a large GEMM in a loop for --soak seconds) so that
every shape runs at the settled clock a training step runs at; each shape is
then timed by CUDA events over enough calls to fill --min-ms.

Prints one line a GEMM, `gemm DTYPE M N K MS TFLOPS`, and a summary,
`gemm_summary DTYPE ...`; --csv also writes them as CSV.
"""

import argparse
import csv
import statistics
import sys
import time

import torch


def shapes(tokens):
    """(role, M, N, K) of the linears' forward, input and weight gradients."""
    out = []
    for h, ffn in [(2048, 8192), (4096, 14336), (4096, 16384), (6144, 24576),
                   (8192, 28672), (12288, 49152), (16384, 65536)]:
        for tp in (1, 2, 4, 8):
            for name, k_in, n_out in [
                ("qkv", h, 3 * h // tp),
                ("proj", h // tp, h),
                ("fc1", h, ffn // tp),
                ("fc2", ffn // tp, h),
            ]:
                tag = f"h{h}_ffn{ffn}_tp{tp}_{name}"
                out.append((tag + "_fwd", tokens, n_out, k_in))
                out.append((tag + "_dgrad", tokens, k_in, n_out))
                out.append((tag + "_wgrad", k_in, n_out, tokens))
    # The same GEMM can recur (fc1's and fc2's gradients); time each once.
    seen, unique = set(), []
    for role, m, n, k in out:
        if (m, n, k) not in seen:
            seen.add((m, n, k))
            unique.append((role, m, n, k))
    return unique


def operands(dtype, m, n, k):
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    if dtype == "bf16":
        bt = b.t()
        return lambda: torch.matmul(a, bt)
    fp8 = torch.float8_e4m3fn
    a8 = a.to(fp8)
    b8 = b.to(fp8).t()  # column-major, as _scaled_mm wants its second operand
    one = torch.ones((), device="cuda")
    return lambda: torch._scaled_mm(a8, b8, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)


def time_ms(call, min_ms):
    call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    call()
    end.record()
    torch.cuda.synchronize()
    once = max(start.elapsed_time(end), 1e-3)
    reps = max(3, int(min_ms / once))
    start.record()
    for _ in range(reps):
        call()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def fp8_available():
    if not hasattr(torch, "_scaled_mm") or not hasattr(torch, "float8_e4m3fn"):
        return False
    major, _ = torch.cuda.get_device_capability()
    if major < 9:
        return False
    try:
        operands("fp8", 64, 64, 64)()
        return True
    except Exception:  # noqa: BLE001 - any refusal means no FP8 GEMMs here
        return False


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--soak", type=float, default=10.0, help="seconds of a large GEMM first")
    p.add_argument("--min-ms", type=float, default=30.0, help="time each shape over at least this")
    p.add_argument("--dtypes", default="bf16,fp8")
    p.add_argument("--csv", default=None)
    args = p.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device", file=sys.stderr)
        return 1
    torch.backends.cuda.matmul.allow_tf32 = False
    print(f"device {torch.cuda.get_device_name()} torch {torch.__version__}", flush=True)
    dtypes = [d for d in args.dtypes.split(",") if d]
    if "fp8" in dtypes and not fp8_available():
        print("fp8: torch._scaled_mm unavailable on this GPU or build; bf16 only", flush=True)
        dtypes.remove("fp8")
    soak = operands("bf16", 8192, 8192, 8192)
    until = time.time() + args.soak
    while time.time() < until:
        for _ in range(50):
            soak()
        torch.cuda.synchronize()
    rows = []
    for dtype in dtypes:
        peak_call = operands(dtype, 8192, 8192, 8192)
        peak_ms = time_ms(peak_call, args.min_ms)
        peak = 2 * 8192**3 / peak_ms / 1e9
        print(f"gemm {dtype} 8192 8192 8192 {peak_ms:.4f} {peak:.1f} square", flush=True)
        rates = []
        for role, m, n, k in shapes(args.tokens):
            call = operands(dtype, m, n, k)
            ms = time_ms(call, args.min_ms)
            tflops = 2 * m * n * k / ms / 1e9
            rates.append(tflops)
            rows.append((dtype, role, m, n, k, ms, tflops))
            print(f"gemm {dtype} {m} {n} {k} {ms:.4f} {tflops:.1f} {role}", flush=True)
            del call
        print(
            f"gemm_summary {dtype}: {len(rates)} shapes, min {min(rates):.1f} median "
            f"{statistics.median(rates):.1f} max {max(rates):.1f} TFLOP/s; 8192^3 {peak:.1f}",
            flush=True,
        )
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["dtype", "role", "m", "n", "k", "ms", "tflops"])
            w.writerows(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
