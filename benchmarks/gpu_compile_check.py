"""GPU check of every pattern with a Triton path under torch.compile and CUDA graphs.

For each pattern (one spec per registered class whose impls include "triton"), at B=2, H=8,
N=4096, D=64, bf16, causal:

(a) accuracy: the eager Triton output and gradients (dq, dk, dv and the mechanism's parameters)
    against the fp32 reference on the same bf16-rounded inputs, within FlashAttention's rule:
    error <= 2 x the error of PyTorch computing the same attention in bf16 (the selection in
    fp32, the weighting in bf16) against that reference, plus a small floor;
(b) ``torch.compile(SparseAttention, fullgraph=True)`` equals eager (output and gradients);
(c) one forward+backward captured in a ``torch.cuda.CUDAGraph`` (warm-up on a side stream)
    replays on new inputs and equals eager;
(d) CUDA kernel launches per forward+backward (torch.profiler), eager and compiled;
(e) ``torch._dynamo.explain`` graph breaks;
(f) the eager forward+backward under ``torch.cuda.set_sync_debug_mode("error")`` (no host sync);
then times eager, compiled and graph replay (median of a few runs; correctness comes first).

Usage:  python benchmarks/gpu_compile_check.py [--out DIR] [--patterns topk zeta ...] [--n 4096]
            [--constant sparsefocus.MODULE.NAME=VALUE ...]  (an implementation choice to check, as in bench)
Writes DIR/gpu_compile_check.json (DIR defaults to $OUT, else benchmarks/results) and prints
a table last. Each case is isolated (one failure is recorded, the rest still run).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import time
import traceback
from pathlib import Path

import torch

if "--device" in sys.argv and "cpu" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

from sparsefocus.attention import PATTERNS, parse_pattern, sparse_attention
from sparsefocus.bench.run import BenchError, add_constant_argument, constants_set
from sparsefocus.attention import common as attention_common
from sparsefocus.attention import zeta as zeta_module
from sparsefocus.layers.attention import SparseAttention

DEVICE, DTYPE = "cuda", torch.bfloat16
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
GPU_SPECS = {  # sizes for N = 4096 (the registry's examples are tiny); others use their first example
    "band": "BAND:64",
    "bloc": "BLOC:64",
    "global": "global:g=16",
    "strided": "strided:64",
    "fixed": "fixed:block=64,c=4",
    "dilated": "dilated:k=64,dilation=2",
    "random": "random:k=32",
    "longformer": "longformer:window=64,g=2",
    "bigbird": "bigbird:window=64,g=2,r=16",
    "window2d": "window2d:64,64,5",
    "axial": "axial:64,64",
    "topk": "TOPK:32",
    "botk": "BOTK:32",
    "block_topk": "block_topk:block=64,top=4",
    "lsh": "lsh:buckets=16,chunk=64,rounds=2",
    "routing": "routing:clusters=8,window=128",
    "zeta": "zeta",
}


def default_spec(name: str) -> str:
    """The spec checked for registry name ``name``: ``GPU_SPECS``, else the registry's first example."""
    return GPU_SPECS.get(name, PATTERNS[name].examples[0])


def triton_specs(names: list[str] | None) -> list[str]:
    """The spec of each pattern with a Triton path (``default_spec``);
    ``names`` picks registry names ("band"), and a full spec ("BAND:128") is checked as given.

    Raises:
        SystemExit: a name that is no pattern, or whose pattern has no Triton path."""
    with_triton = {name for name, cls in PATTERNS.items() if "triton" in cls.impls}
    if not names:
        return [default_spec(name) for name in sorted(with_triton)]
    specs = []
    for text in names:
        try:
            name = text if text in PATTERNS else parse_pattern(text).name
        except ValueError as error:
            raise SystemExit(f"--patterns: {text!r} is not a pattern ({error})") from None
        if name not in with_triton:
            raise SystemExit(f"--patterns: {text!r} has no Triton path (those with one: {', '.join(sorted(with_triton))})")
        specs.append(default_spec(name) if text == name else text)
    return specs


def max_error(got, want) -> float:
    return (got.float() - want.float()).abs().max().item()


@contextlib.contextmanager
def bf16_weighting():
    """PyTorch's own bf16 attention: the dense weighting without its fp32 upcast (the selections
    keep theirs, each module binds its own ``upcast``)."""
    identity = lambda x: x  # noqa: E731
    saved = attention_common.upcast, zeta_module.upcast
    attention_common.upcast = zeta_module.upcast = identity
    try:
        yield
    finally:
        attention_common.upcast, zeta_module.upcast = saved


def bf16_torch_attention(spec, q, k, v, causal, params):
    """The pattern's reference with the weighting in the inputs' dtype (selection in fp32 on the same inputs)."""
    if isinstance(spec, zeta_module.Zeta):
        mask = spec.full_mask(q, k, causal, None, params)  # before the patch: the selection stays fp32
        with bf16_weighting():
            gamma = spec.gamma_of(params)
            gamma = gamma.to(q.dtype) if torch.is_tensor(gamma) else gamma
            return zeta_module.dense_cauchy_attention(q, k, v, mask, causal, None, gamma)
    with bf16_weighting():
        return sparse_attention(q, k, v, spec, causal=causal, impl="reference", params=params)


def functional_grads(spec, q, k, v, causal, impl, params, grad_out):
    inputs = [x.detach().clone().requires_grad_() for x in (q, k, v)]
    plist = {name: p.detach().clone().requires_grad_() for name, p in (params or {}).items()} or None
    if impl == "bf16_torch":
        out = bf16_torch_attention(spec, *inputs, causal, plist)
    else:
        out = sparse_attention(*inputs, spec, causal=causal, impl=impl, params=plist)
    leaves = inputs + list((plist or {}).values())
    grads = torch.autograd.grad(out, leaves, grad_out.to(out.dtype))
    names = ["dq", "dk", "dv"] + [f"d{name}" for name in (plist or {})]
    return out.detach(), dict(zip(names, grads))


def check_accuracy(spec, batch, heads, n, dim, causal) -> dict:
    """(a): Triton bf16 vs the fp32 reference, against PyTorch's bf16 error on the same inputs."""
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    qk = spec.qk_dim(dim)
    q, k = (torch.randn(batch, heads, n, qk, device=DEVICE, generator=gen).to(DTYPE) for _ in range(2))
    v = torch.randn(batch, heads, n, dim, device=DEVICE, generator=gen).to(DTYPE)
    params = {name: p.detach().to(DEVICE) for name, p in spec.make_parameters(heads).items()} or None
    grad_out = torch.randn(batch, heads, n, dim, device=DEVICE, generator=gen)
    ref, ref_grads = functional_grads(spec, q.float(), k.float(), v.float(), causal, "reference", params, grad_out)
    pt, pt_grads = functional_grads(spec, q, k, v, causal, "bf16_torch", params, grad_out)
    tri, tri_grads = functional_grads(spec, q, k, v, causal, "triton", params, grad_out)
    result = {}
    for name, got, base, want in [("out", tri, pt, ref)] + [(g, tri_grads[g], pt_grads[g], ref_grads[g]) for g in ref_grads]:
        err, err_pt = max_error(got, want), max_error(base, want)
        floor = 1e-3 * max(want.float().abs().max().item(), 1e-6)
        result[name] = {"err": err, "err_torch_bf16": err_pt, "ok": err <= 2 * err_pt + floor}
    result["ok"] = all(entry["ok"] for entry in result.values() if isinstance(entry, dict))
    return result


def make_layer(spec, heads, dim, causal):
    torch.manual_seed(0)
    layer = SparseAttention(heads * dim, heads, spec, causal=causal, impl="triton").to(DEVICE, DTYPE)
    return layer


def layer_step(fn, layer, x, grad_out):
    """Output and gradients (x and every parameter) of one forward+backward, leaving .grad alone."""
    x = x.detach().clone().requires_grad_()
    out = fn(x)
    grads = torch.autograd.grad(out, [x, *layer.parameters()], grad_out, allow_unused=True)
    return [out.detach(), *grads]


def compare(a: list, b: list) -> dict:
    diffs = [max_error(x, y) for x, y in zip(a, b) if x is not None and y is not None]
    scale = max(max(y.float().abs().max().item() for y in b if y is not None), 1e-6)
    worst = max(diffs)
    return {"max_abs_diff": worst, "max_abs": scale, "ok": worst <= 2e-2 * scale}


def count_kernels(fn) -> dict:
    """Kernels one call of ``fn`` launches, after one untimed call (a compiled module's first
    backward compiles and benchmarks its kernels, which the profiler would count too)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    kernels = [name for name in names if not name.startswith(("Memcpy", "Memset"))]
    return {"kernels": len(kernels), "all_device_events": len(names)}


def time_ms(fn, repeats: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        stop.synchronize()
        times.append(start.elapsed_time(stop))
    return sorted(times)[len(times) // 2]


def capture_graph(layer, x_shape, grad_out):
    """(c): warm up on a side stream, capture forward+backward, return (graph, static x, out)."""
    static_x = torch.randn(x_shape, device="cuda", dtype=DTYPE, requires_grad=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            layer.zero_grad(set_to_none=True)
            static_x.grad = None
            layer(static_x).backward(grad_out)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    layer.zero_grad(set_to_none=True)
    static_x.grad = None
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
        static_out.backward(grad_out)
    return graph, static_x, static_out


def check_layer(spec, batch, heads, n, dim, causal, result: dict) -> None:
    layer = make_layer(spec, heads, dim, causal)
    x = torch.randn(batch, n, heads * dim, device=DEVICE, dtype=DTYPE)
    grad_out = torch.randn_like(x)
    eager = layer_step(layer, layer, x, grad_out)  # also the warm-up (kernel JIT, cached constants)
    on_gpu = DEVICE == "cuda"  # graphs, the profiler's kernels, sync checks and timings need CUDA
    step = lambda fn: lambda: fn(x).backward(grad_out)  # noqa: E731

    def record(key, fn):
        try:
            result[key] = fn()
        except Exception as error:  # one failing check must not hide the others
            result[key] = {"ok": False, "error": f"{type(error).__name__}: {str(error)[:400]}"}

    def sync_free():
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            layer_step(layer, layer, x, grad_out)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        return {"ok": True}

    if on_gpu:
        record("host_sync_free", sync_free)
    compiled = torch.compile(layer, fullgraph=True)

    def compiled_equals_eager():
        start = time.perf_counter()
        got = layer_step(compiled, layer, x, grad_out)
        return compare(got, eager) | {"compile_s": time.perf_counter() - start}

    record("compile", compiled_equals_eager)

    def graph_replay():
        graph, static_x, static_out = capture_graph(layer, x.shape, grad_out)
        with torch.no_grad():
            static_x.copy_(x)
        graph.replay()
        torch.cuda.synchronize()
        got = [static_out, static_x.grad, *[p.grad for p in layer.parameters()]]
        timing = time_ms(graph.replay)
        layer.zero_grad(set_to_none=True)
        return compare(got, eager) | {"replay_ms": timing}

    if on_gpu:
        record("cuda_graph", graph_replay)
        record("launches_eager", lambda: count_kernels(step(layer)))
        record("launches_compiled", lambda: count_kernels(step(compiled)))

    def explain():
        torch._dynamo.reset()
        explanation = torch._dynamo.explain(layer)(x)
        return {
            "graph_breaks": explanation.graph_break_count,
            "graphs": explanation.graph_count,
            "ok": explanation.graph_break_count == 0,
            "reasons": [str(r.reason)[:200] for r in explanation.break_reasons],
        }

    def timings():
        out = {"eager_ms": time_ms(step(layer))}
        out["compiled_ms"] = time_ms(step(compiled))
        layer.zero_grad(set_to_none=True)
        return out

    if on_gpu:
        record("timing", timings)
    record("explain", explain)  # last: it resets dynamo's caches


def run_case(spec_text: str, args) -> dict:
    spec = parse_pattern(spec_text)
    result: dict = {"pattern": spec_text}
    try:
        result["accuracy"] = check_accuracy(spec, args.batch, args.heads, args.n, args.dim, True)
    except Exception as error:
        result["accuracy"] = {
            "ok": False,
            "error": f"{type(error).__name__}: {str(error)[:400]}",
            "trace": traceback.format_exc()[-1500:],
        }
    try:
        check_layer(spec, args.batch, args.heads, args.n, args.dim, True, result)
    except Exception as error:
        result["layer_error"] = f"{type(error).__name__}: {str(error)[:400]}"
    if DEVICE == "cuda":
        torch.cuda.empty_cache()
    return result


def status(entry) -> str:
    if not isinstance(entry, dict):
        return "-"
    return "ok" if entry.get("ok", True) and "error" not in entry else "FAIL"


def table(results: list[dict]) -> str:
    head = f"{'pattern':34s} {'acc':4s} {'cmp':4s} {'graph':5s} {'sync':4s} {'breaks':6s} {'launch e/c':10s} {'eager':>7s} {'comp':>7s} {'replay':>7s}"
    lines = [head]
    for r in results:
        launches = f"{r.get('launches_eager', {}).get('kernels', '-')}/{r.get('launches_compiled', {}).get('kernels', '-')}"
        timing = r.get("timing", {})
        fmt = lambda v: f"{v:7.2f}" if isinstance(v, float) else f"{'-':>7s}"  # noqa: E731
        lines.append(
            f"{r['pattern']:34s} {status(r.get('accuracy')):4s} {status(r.get('compile')):4s} {status(r.get('cuda_graph')):5s} "
            f"{status(r.get('host_sync_free')):4s} {str(r.get('explain', {}).get('graph_breaks', '-')):6s} {launches:10s} "
            f"{fmt(timing.get('eager_ms'))} {fmt(timing.get('compiled_ms'))} {fmt(r.get('cuda_graph', {}).get('replay_ms'))}"
        )
    return "\n".join(lines)


def write_json_atomic(path: Path, payload: dict) -> None:
    temporary = path.with_suffix(".json.tmp")
    temporary.write_text(json.dumps(payload, indent=1, default=str))
    os.replace(temporary, path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "benchmarks/results"))
    parser.add_argument("--patterns", nargs="*", help="registry names or specs (default: every pattern with a Triton path)")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--n", type=int, default=4096)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument(
        "--device", default="cuda", help="cpu: a smoke run of (a), (b), (e) in Triton's interpreter (fp16, tiny N)"
    )
    add_constant_argument(parser)
    args = parser.parse_args()
    try:
        with constants_set(args.constant) as constants:
            check(args, constants)
    except BenchError as error:
        raise SystemExit(str(error)) from None


def check(args: argparse.Namespace, constants: dict[str, object]) -> None:
    """Run every pattern's checks with the constants set, writing the JSON after each."""
    global DEVICE, DTYPE
    DEVICE, DTYPE = args.device, DTYPES[args.dtype]
    if DEVICE == "cuda" and not torch.cuda.is_available():
        raise SystemExit("gpu_compile_check needs a CUDA device (or --device cpu for a smoke run)")
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    torch._dynamo.config.cache_size_limit = 64  # one module per pattern: each compiles once
    meta = {
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name() if DEVICE == "cuda" else DEVICE,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "shape": [args.batch, args.heads, args.n, args.dim],
        "dtype": args.dtype,
        "causal": True,
        "constants": constants,
    }
    try:
        import triton

        meta["triton"] = triton.__version__
    except ImportError:
        pass
    results = []
    for spec_text in triton_specs(args.patterns):
        start = time.perf_counter()
        results.append(run_case(spec_text, args) | {"seconds": time.perf_counter() - start})
        write_json_atomic(out_dir / "gpu_compile_check.json", {"meta": meta, "results": results})
        print(f"{spec_text}: {results[-1]['seconds']:.1f} s", flush=True)
    print(table(results))


if __name__ == "__main__":
    main()
