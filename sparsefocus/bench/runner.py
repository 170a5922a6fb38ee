"""Time and peak memory of bench workloads: CUDA events (wall clock on CPU), median after warm-up."""

from __future__ import annotations

import gc
import statistics
import time
from typing import Callable

import torch
from torch import Tensor

from sparsefocus.bench.registry import BenchShape, Workload, parse_case

MODES = ("fwd", "fwd+bwd")
PEAK_TFLOPS = 790.0  # bf16 dense matmul measured on the H200 (random data)
PEAK_TBPS = 4.2  # device-to-device copy, bytes read + written, measured on the H200


def make_inputs(shape: BenchShape, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Random q [B, H, N, D], k, v [B, Hk, N, D] that require grad."""
    generator = torch.Generator(device=shape.device).manual_seed(seed)

    def rand(heads: int) -> Tensor:
        x = torch.randn(shape.batch, heads, shape.n, shape.head_dim, generator=generator, device=shape.device)
        return x.to(shape.dtype).requires_grad_()

    return rand(shape.heads), rand(shape.kv_heads), rand(shape.kv_heads)


def step_fn(workload: Workload, inputs: tuple[Tensor, ...], mode: str) -> Callable[[], None]:
    """A closure running one forward (no autograd) or one forward + backward."""
    if mode == "fwd":

        def forward() -> None:
            with torch.no_grad():
                workload.forward(*inputs)

        return forward
    grad_out: list[Tensor] = []

    def forward_backward() -> None:
        out = workload.forward(*inputs)
        if not grad_out:
            grad_out.append(torch.randn_like(out))
        torch.autograd.grad(out, inputs, grad_out[0])

    return forward_backward


def median_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            stop.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(stop))
        else:
            begin = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - begin))
    return statistics.median(times)


def peak_memory_mb(fn: Callable[[], None], device: torch.device) -> float | None:
    """Peak allocated CUDA memory (inputs included) of one run of ``fn``; None on CPU."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated(device) / 2**20


def is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(case: str, shape: BenchShape, modes: tuple[str, ...], warmup: int, repeats: int) -> list[dict]:
    """One result row per mode for ``case`` at ``shape``: ms, peak MB, FLOPs, bytes, fractions.

    An out-of-memory error gives status "oom"; any other error "error: <message>"."""
    base = {"case": case, "n": shape.n}
    try:
        workload = parse_case(case, shape)
        inputs = make_inputs(shape)
    except Exception as error:  # noqa: BLE001 - recorded in the results, the sweep goes on
        release_memory(shape.device)
        return [base | {"mode": mode, "status": "oom" if is_oom(error) else f"error: {error}"} for mode in modes]
    rows = [base | {"mode": mode} | _measure_mode(workload, inputs, shape, mode, warmup, repeats) for mode in modes]
    if workload.extra is not None and all(row["status"] == "ok" for row in rows):
        with torch.no_grad():
            extra = workload.extra(*inputs)
        rows = [row | extra for row in rows]
    del workload, inputs
    release_memory(shape.device)
    return rows


def _measure_mode(workload: Workload, inputs, shape: BenchShape, mode: str, warmup: int, repeats: int) -> dict:
    flops, bytes_ = workload.total(mode)
    fn = step_fn(workload, inputs, mode)
    try:
        ms = median_ms(fn, shape.device, warmup, repeats)
        peak = peak_memory_mb(fn, shape.device)
    except Exception as error:  # noqa: BLE001 - recorded in the results, the sweep goes on
        release_memory(shape.device)
        return {"status": "oom" if is_oom(error) else f"error: {type(error).__name__}: {error}"[:300]}
    seconds = ms / 1e3
    return {
        "status": "ok",
        "ms": ms,
        "peak_mb": peak,
        "flops": flops,
        "bytes": bytes_,
        "tflops": flops / seconds / 1e12,
        "frac_peak_flops": flops / seconds / 1e12 / PEAK_TFLOPS,
        "frac_peak_bandwidth": bytes_ / seconds / 1e12 / PEAK_TBPS,
        **workload.notes,
    }
