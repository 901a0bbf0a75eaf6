"""Achieved matmul throughput of one device: bf16 on GPU, fp32 on CPU (a smoke test only)."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True)
class GemmResult:
    device: str
    dtype: str
    m: int
    n: int
    k: int
    seconds: float
    tflops: float


def gemm_tflops(m: int, n: int, k: int, seconds: float) -> float:
    """2*m*n*k multiply-adds per matmul, in TFLOP/s."""
    if seconds <= 0:
        raise ValueError(f"time must be positive, got {seconds}")
    return 2.0 * m * n * k / seconds / 1e12


def fraction_of_peak(tflops: float, peak_tflops: float | None) -> float | None:
    return None if not peak_tflops else tflops / peak_tflops


def measure_gemm(device: Any, size: int | None = None, iters: int | None = None,
                 warmup: int = 2) -> GemmResult:
    """Square GEMM; 8192 bf16 on GPU keeps the tensor cores busy, 512 fp32 on CPU is enough
    to prove the math path works without hogging shared cores."""
    import torch

    on_gpu = device.type == "cuda"
    size = size or (8192 if on_gpu else 512)
    iters = iters or (50 if on_gpu else 5)
    dtype = torch.bfloat16 if on_gpu else torch.float32
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    for _ in range(warmup):  # cuBLAS heuristics and clocks ramp up on the first calls
        torch.mm(a, b)
    if on_gpu:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(iters):
        torch.mm(a, b)
    if on_gpu:
        torch.cuda.synchronize(device)  # kernels are async: time only after they finish
    seconds = (time.perf_counter() - start) / iters
    return GemmResult(str(device), str(dtype).removeprefix("torch."), size, size, size,
                      seconds, gemm_tflops(size, size, size, seconds))
