"""Time and peak memory of bench workloads: CUDA events (wall clock on CPU), median after warm-up."""

from __future__ import annotations

import gc
import statistics
import time
from collections.abc import Callable

import torch
from torch import Tensor

from sparsefocus.bench.profiling import kernel_launches
from sparsefocus.bench.registry import BenchShape, Workload, parse_case

MODES = ("fwd", "fwd+bwd")
# Ceilings measured on one device, keyed by a substring of its name: bf16 dense matmul on random
# data (TFLOP/s) and a device-to-device copy, bytes read + written (TB/s). Fractions of peak are
# reported only on the device they were measured on.
CEILINGS = {"H200": {"tflops": 790.0, "tbps": 4.2}}


def ceilings_for(device_name: str) -> dict | None:
    """The measured ceilings of a device (``{"tflops", "tbps", "measured_on"}``), or None."""
    for key, values in CEILINGS.items():
        if key in device_name:
            return values | {"measured_on": key}
    return None


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
        detached = tuple(x.detach() for x in inputs)  # no autograd state at all (FlexAttention on CPU refuses it)

        def forward() -> None:
            with torch.no_grad():
                workload.forward(*detached)

        return forward
    grad_out: list[Tensor] = []

    def forward_backward() -> None:
        out = workload.forward(*inputs)
        if not grad_out:
            grad_out.append(torch.randn_like(out))
        torch.autograd.grad(out, inputs, grad_out[0])

    return forward_backward


def _elapsed_ms(run: Callable[[], None], device: torch.device) -> float:
    """Milliseconds of one call of ``run``: CUDA events around it, then a synchronisation, on
    CUDA; the wall clock elsewhere."""
    if device.type == "cuda":
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        stop.record()
        torch.cuda.synchronize()
        return start.elapsed_time(stop)
    begin = time.perf_counter()
    run()
    return 1e3 * (time.perf_counter() - begin)


def median_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of ``fn`` over ``repeats`` runs after ``warmup`` runs."""
    for _ in range(warmup):
        fn()
    return statistics.median(_elapsed_ms(fn, device) for _ in range(repeats))


def pipelined_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Mean milliseconds of ``fn`` over ``repeats`` back-to-back runs after ``warmup`` runs, with
    no synchronisation between runs, as a training loop runs its steps: while the GPU works on
    one run the host already queues the next, so a run that waits on the host costs its host
    time, one that keeps the GPU busy its device time."""
    for _ in range(warmup):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize()  # the timed runs start on an idle GPU

    def runs() -> None:
        for _ in range(repeats):
            fn()

    return _elapsed_ms(runs, device) / repeats


def graphed_ms(fn: Callable[[], None], device: torch.device, warmup: int, repeats: int) -> float:
    """Median milliseconds of one replay of a CUDA graph holding one run of ``fn``: the run's
    device time with no host work between its kernels, as ``torch.compile(mode="reduce-overhead")``
    or a hand-captured training step would run it. Raises on CPU, and wherever ``fn`` cannot be
    captured (a host synchronisation, say); ``fn`` is warmed up on a side stream first, as
    capturing autograd needs."""
    if device.type != "cuda":
        raise RuntimeError("CUDA graphs need a CUDA device")
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(max(warmup, 1)):
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return median_ms(graph.replay, device, 1, repeats)  # the graph's memory goes with it on return


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


def error_message(error: BaseException, limit: int = 300) -> str:
    """``Type: first line of the message``, cut to ``limit`` characters."""
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0] if lines else ''}"[:limit]


def failure(error: BaseException, unavailable: bool = False) -> dict:
    """The status columns of a failed measurement: oom, unavailable or error, with the message."""
    status = "oom" if is_oom(error) else "unavailable" if unavailable else "error"
    return {"status": status, "error": error_message(error)}


def release_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def measure(
    case: str,
    shape: BenchShape,
    modes: tuple[str, ...],
    warmup: int,
    repeats: int,
    ceilings: dict | None = None,
    graphs: bool = False,
) -> list[dict]:
    """One result row per mode for ``case`` at ``shape``: ms, peak MB, launches, FLOPs, bytes.

    ``ceilings`` ({"tflops", "tbps"}) adds the fractions of peak. ``graphs`` (CUDA) adds
    ``graph_ms``, one run replayed from a CUDA graph (``graphed_ms``), or ``graph_error`` where
    the run cannot be captured. Status "oom" for out of memory, "unavailable" where an SDPA
    backend refuses the shape, else "error"; the message is in "error"."""
    base = {"case": case, "n": shape.n}
    try:
        workload = parse_case(case, shape)
        inputs = make_inputs(shape)
    except Exception as error:  # noqa: BLE001 - recorded in the results, the sweep goes on
        release_memory(shape.device)
        return [base | {"mode": mode} | failure(error) for mode in modes]
    rows = [base | {"mode": mode} | _measure_mode(workload, inputs, shape, mode, warmup, repeats, ceilings) for mode in modes]
    if graphs:
        rows = [row | _graph_columns(workload, inputs, shape, row, warmup, repeats) for row in rows]
    if workload.extra is not None and all(row["status"] == "ok" for row in rows):
        with torch.no_grad():
            extra = workload.extra(*inputs)
        rows = [row | extra for row in rows]
    del workload, inputs
    release_memory(shape.device)
    return rows


def _graph_columns(workload: Workload, inputs, shape: BenchShape, row: dict, warmup: int, repeats: int) -> dict:
    """``graph_ms`` of a row that measured ok, or ``graph_error`` naming why capture failed."""
    if row["status"] != "ok":
        return {}
    try:
        return {"graph_ms": graphed_ms(step_fn(workload, inputs, row["mode"]), shape.device, warmup, repeats)}
    except Exception as error:  # noqa: BLE001 - recorded in the results, the sweep goes on
        return {"graph_error": error_message(error)}


def _measure_mode(
    workload: Workload, inputs, shape: BenchShape, mode: str, warmup: int, repeats: int, ceilings: dict | None
) -> dict:
    flops, bytes_ = workload.total(mode)
    fn = step_fn(workload, inputs, mode)
    try:
        ms = median_ms(fn, shape.device, warmup, repeats)
        peak = peak_memory_mb(fn, shape.device)
        launches = kernel_launches(fn, shape.device)
    except Exception as error:  # noqa: BLE001 - recorded in the results, the sweep goes on
        release_memory(shape.device)
        return failure(error, workload.unavailable_on_error) | workload.notes
    tflops = flops / (ms / 1e3) / 1e12
    row = {"status": "ok", "ms": ms, "peak_mb": peak, "launches": launches, "flops": flops, "bytes": bytes_, "tflops": tflops}
    if ceilings is not None:
        row["frac_peak_flops"] = tflops / ceilings["tflops"]
        row["frac_peak_bandwidth"] = bytes_ / (ms / 1e3) / 1e12 / ceilings["tbps"]
    return row | workload.notes
