"""Host time of a launch on CUDA: an empty Triton kernel, one of the package's kernels, the
``scaled_scan`` op, torch allocations, and whole eager forward+backward calls, plus a cProfile of
ZETA's; and the scan's one-pass form against its two-level form, the keys sorted in the filter's
kernel against torch's sort (device time from CUDA-graph replays, and ZETA's eager call with each). Usage: python benchmarks/probes/launch_overhead.py OUT_DIR"""

from __future__ import annotations

import cProfile
import io
import json
import pstats
import sys
import time
from pathlib import Path

import torch
import triton
import triton.language as tl

import sparsefocus as sf
from sparsefocus.kernels import scan, zeta_select

DEFAULT_ONE_PASS = scan.ONE_PASS_MAX_N
DEFAULT_TILE = scan.ONE_PASS_TILE
DEFAULT_SORT = zeta_select.SORT_MAX_M


@triton.jit
def _empty(X, N, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(X + i, tl.zeros([BLOCK], tl.float32), mask=i < N)


def per_call(fn, reps: int = 200) -> dict:
    """Host us per call (loop without sync) and wall us per call (synced at the end)."""
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        fn()
    host = (time.perf_counter() - start) / reps
    torch.cuda.synchronize()
    wall = (time.perf_counter() - start) / reps
    return {"host_us": round(host * 1e6, 1), "wall_us": round(wall * 1e6, 1)}


def graph_us(fn, reps: int = 50) -> float:
    """Device us per call: ``fn`` captured in a CUDA graph, replayed ``reps`` times."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) * 1e3 / reps, 2)


def scan_forms() -> dict:
    """Device us of one scan (B=4, H=16, bf16) per form, width and length, forward and reversed."""
    record = {}
    for n in (1024, 2048, 4096, 8192):
        for width in (3, 64):
            x = torch.randn(4, 16, n, width, device="cuda", dtype=torch.bfloat16)
            pre = torch.rand(4, n, device="cuda")
            for reverse in (False, True):
                for form, limit, tile in (
                    ("one-pass", 10**9, DEFAULT_TILE),
                    ("one-pass, 64-row tiles", 10**9, {"BLOCK_N": 64, "num_warps": 1}),
                    ("two-level", 0, DEFAULT_TILE),
                ):
                    scan.ONE_PASS_MAX_N, scan.ONE_PASS_TILE = limit, tile
                    key = f"n={n} width={width} reverse={reverse} {form}"
                    record[key] = graph_us(lambda: scan._launch_scan(x, pre, pre, reverse, None, x.dtype))
    scan.ONE_PASS_MAX_N, scan.ONE_PASS_TILE = DEFAULT_ONE_PASS, DEFAULT_TILE
    return record


def sort_forms() -> dict:
    """Device us of ZETA's key prefixes (B=4, Hk=16, 8 chunks, tagged codes of 36 bits): one
    launch sorting in the kernel against torch's sort and the filter kernel."""
    record = {}
    for n in (1024, 2048, 4096):
        rows = torch.arange(64, device="cuda", dtype=torch.int64).view(1, 4, 16, 1)
        codes = torch.randint(0, 2**36, (1, 4, 16, n), device="cuda") | (rows << 36)
        for form, sort_max in (("in kernel", DEFAULT_SORT), ("torch sort", 0)):
            zeta_select.SORT_MAX_M = sort_max
            key = f"n={n} {form}"
            record[key] = graph_us(lambda: zeta_select.key_prefixes(codes, None, n, n // 8, 1 << 62, 36, 36))
    zeta_select.SORT_MAX_M = DEFAULT_SORT
    return record


def attention_call(pattern: str, b: int, h: int, n: int, d: int):
    q = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(b, h, n, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def call():
        sf.sparse_attention(q, k, v, pattern, causal=True, impl="triton").sum().backward()

    return call


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    record: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    x = torch.zeros(64, device="cuda")
    record["empty_triton_kernel"] = per_call(lambda: _empty[(1,)](x, 16, BLOCK=16))
    xs = torch.randn(1, 1, 128, 64, device="cuda", dtype=torch.bfloat16)
    pre = torch.ones(1, 128, device="cuda")
    for form, tiles in (("one_pass", DEFAULT_ONE_PASS), ("two_level", 0)):
        scan.ONE_PASS_MAX_N = tiles
        record[f"scan_launch_{form}"] = per_call(lambda: scan._launch_scan(xs, pre, pre, False, None, xs.dtype))
    scan.ONE_PASS_MAX_N = DEFAULT_ONE_PASS
    record["scaled_scan_op"] = per_call(lambda: scan.scaled_scan(xs, pre, pre))
    record["torch_empty"] = per_call(lambda: torch.empty(1, 1, 128, 64, device="cuda"))
    record["torch_zeros"] = per_call(lambda: torch.zeros(1, 1, 128, 64, device="cuda"))
    record["torch_add"] = per_call(lambda: xs + xs)
    try:
        compiled = _empty[(1,)](x, 16, BLOCK=16)
        record["compiled_kernel_direct"] = per_call(lambda: compiled[(1, 1, 1)](x, 16))
    except Exception as error:  # noqa: BLE001 - the probe records what this Triton accepts
        record["compiled_kernel_direct"] = f"{type(error).__name__}: {error}"
    for pattern, d in (("zeta", 3), ("BAND:64", 64)):
        for shape in ((1, 1, 512), (4, 16, 4096)):
            record[f"{pattern} {shape}"] = per_call(attention_call(pattern, *shape, d), reps=30)
        print(json.dumps(record), flush=True)
    record["scan_forms_device_us"] = scan_forms()
    record["key_sort_device_us"] = sort_forms()
    for n in (1024, 4096):
        for tiles, sort_max in ((DEFAULT_ONE_PASS, DEFAULT_SORT), (0, DEFAULT_SORT), (DEFAULT_ONE_PASS, 0), (0, 0)):
            scan.ONE_PASS_MAX_N, zeta_select.SORT_MAX_M = tiles, sort_max
            call = attention_call("zeta", 4, 16, n, 3)
            key = f"zeta (4, 16, {n}) one-pass scans {tiles > 0}, sort in kernel {sort_max > 0}"
            record[key] = {**per_call(call, reps=30), "graph_us": graph_us(call, reps=20)}
            print(key, record[key], flush=True)
    scan.ONE_PASS_MAX_N, zeta_select.SORT_MAX_M = DEFAULT_ONE_PASS, DEFAULT_SORT
    print(json.dumps(record), flush=True)
    for pattern, d in (("zeta", 3), ("BAND:64", 64)):
        call = attention_call(pattern, 4, 16, 4096, d)
        call()
        profile = cProfile.Profile()
        profile.enable()
        for _ in range(20):
            call()
        torch.cuda.synchronize()
        profile.disable()
        for key in ("tottime", "cumulative"):
            text = io.StringIO()
            pstats.Stats(profile, stream=text).sort_stats(key).print_stats(45)
            (out / f"cprofile_{pattern.replace(':', '')}_{key}.txt").write_text(text.getvalue())
    (out / "launch_overhead.json").write_text(json.dumps(record, indent=1))
    print(json.dumps(record))


if __name__ == "__main__":
    main()
