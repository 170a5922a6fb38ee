"""Block-sparse mechanisms on one GPU: correctness first (small sizes, against the fp32
definitions), then fwd+bwd time and peak memory of nsa (16 q heads per kv head, and GQA 1, 4, 8
on group tiles and on query tiles of 16), moba, quest and dsa beside fla-core's ``parallel_nsa``
on identical shapes and dense SDPA (the fastest of the cuDNN, flash and efficient backends), at
N = 4K, 16K, 64K.

Usage (CUDA machine, repo root):
    PYTHONPATH=. python benchmarks/gpu_block_sparse.py --out benchmarks/results
Writes gpu_block_sparse.json into --out (default $OUT) after every case, so a run cut short keeps
what it measured; draws gpu_block_sparse.png and prints a table last (``--plot-only JSON`` redraws
the PNG of a record). ``--cases`` picks cases by name. B=4, H=16, D=64, bf16, causal unless flags say otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
import traceback

import torch
import torch.nn.functional as F
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel

import sparsefocus as sf
from sparsefocus.analysis.files import save_figure
from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY
from sparsefocus.kernels.block_sparse import (
    GROUP_TILE,
    block_sparse_attention,
    block_sparse_attention_ref,
    block_sparse_mask,
)

DEVICE = "cuda"
NSA = "nsa:block=64,top=16,cmp=64,stride=64,window=0"  # fla's configuration: compression + selection
MOBA = "moba:block=64,top=15,tile=64"  # own block + 15 = 16 blocks of 64
QUEST = "quest:block=64,top=15,tile=64"
DSA = "dsa:k=2048,heads=4,dim=64,kl_every=16"  # the KL loss on every 16th query row
DEADLINE_S = 400  # no new case after this many seconds: the whole run stays under 8 minutes


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def grads_of(fn, leaves):
    leaves = [x.detach().clone().requires_grad_() for x in leaves]
    out = fn(*leaves)
    grad = torch.cos(torch.arange(out.numel(), device=out.device, dtype=torch.float32)).view(out.shape)
    return [out.float()] + [g.float() for g in torch.autograd.grad((out.float() * grad).sum(), leaves)]


def check_kernel(tile: int, group: int) -> dict:
    """bf16 kernel error vs fp32 <= 2x PyTorch's bf16 error, on the same rounded inputs."""
    torch.manual_seed(0)
    n, kv, d = 300, 2, 64
    q, k, v = (torch.randn(2, h, n, d, device=DEVICE).bfloat16().float() for h in (kv * group, kv, kv))
    heads, tiles = (kv, n) if tile == GROUP_TILE else (kv * group, -(-n // tile))
    blocks = torch.rand(2 * heads * tiles, -(-n // 64), device=DEVICE).argsort(-1)[:, :3].view(2, heads, tiles, 3).int()
    kw = {"block_size": 64, "tile": tile, "causal": True}

    def torch_low(q, k, v):
        mask = block_sparse_mask(q, k, blocks, 64, tile, True, None, 0, 1, 0)
        s = (q @ k.repeat_interleave(group, 1).transpose(-1, -2)) * d**-0.5
        has = mask.any(-1, keepdim=True)
        return (torch.softmax(s.masked_fill(~mask, float("-inf")).masked_fill(~has, 0), -1) * has) @ v.repeat_interleave(group, 1)

    truth = grads_of(lambda *x: block_sparse_attention_ref(*x, blocks, **kw)[0], (q, k, v))
    low = grads_of(torch_low, [x.bfloat16() for x in (q, k, v)])
    kern = grads_of(lambda *x: block_sparse_attention(*x, blocks, **kw)[0], [x.bfloat16() for x in (q, k, v)])
    row = {}
    for name, a, b, t in zip(["out", "dq", "dk", "dv"], kern, low, truth):
        row[name] = {"kernel": rel(a, t), "torch_bf16": rel(b, t), "ok": rel(a, t) <= 2 * rel(b, t) + 1e-4}
    return row


def check_pattern(pattern: str, group: int, kv: int = 2, n: int = 257) -> dict:
    """fp32 Triton path vs the pattern's reference, output and every gradient (q, k, v, weights)."""
    torch.manual_seed(1)
    spec = sf.parse_pattern(pattern)
    dim, d = 48, 32
    weights = spec.make_layer_parameters(dim, kv * group, kv, d, d)
    for w in weights.values():
        w.data.normal_(0, 0.2)
    x = torch.randn(2, n, dim, device=DEVICE)
    q, k, v = (torch.randn(2, h, n, d, device=DEVICE) for h in (kv * group, kv, kv))
    padding = torch.rand(2, n, device=DEVICE) > 0.1
    results = []
    for impl in ("reference", "triton"):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        params = {key: w.detach().to(DEVICE).requires_grad_() for key, w in weights.items()}
        call = {**params, HIDDEN_KEY: x, AUX_KEY: {}}
        out = sf.sparse_attention(*leaves, spec, causal=True, key_padding_mask=padding, impl=impl, params=call)
        aux = sum(call[AUX_KEY].values(), out.new_zeros(()))
        grad = torch.cos(torch.arange(out.numel(), device=DEVICE, dtype=torch.float32)).view(out.shape)
        grads = torch.autograd.grad((out * grad).sum() + aux, leaves + list(params.values()), allow_unused=True)
        results.append([out, aux] + [torch.zeros((), device=DEVICE) if g is None else g for g in grads])
    names = ["out", "aux", "dq", "dk", "dv"] + list(weights)
    errors = {name: rel(b, a) for name, a, b in zip(names, *results)}
    return errors | {"ok": all(err < 1e-4 for err in errors.values())}


def correctness() -> dict:
    report = {}
    for tile, group in ((GROUP_TILE, 16), (GROUP_TILE, 4), (64, 1), (64, 4)):
        report[f"kernel tile={tile} group={group}"] = check_kernel(tile, group)
    for pattern, group in (
        ("moba:block=32,top=3,tile=64", 2),
        ("quest:block=32,top=3,tile=32", 1),
        ("nsa:block=32,top=4,cmp=32,stride=16,window=64,pool=mlp", 4),
        ("nsa:block=64,top=3,cmp=64,stride=64,window=0", 16),
        ("nsa:block=32,top=4,cmp=32,stride=16,window=64,tile=16", 1),
        ("nsa:block=32,top=4,cmp=32,stride=16,window=64,tile=32", 4),
        ("dsa:k=40,heads=4,dim=16", 2),
    ):
        report[f"{pattern} group={group}"] = check_pattern(pattern, group, kv=1 if group == 16 else 2)
    return report


def inputs(batch: int, heads: int, kv_heads: int, n: int, d: int):
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    make = lambda h: torch.randn(batch, h, n, d, generator=gen, device=DEVICE, dtype=torch.bfloat16).requires_grad_()
    return make(heads), make(kv_heads), make(kv_heads)


def measure(fn, leaves) -> dict:
    """Median fwd+bwd ms (triton.testing.do_bench) and the peak GB allocated during one step."""
    out = fn(*leaves)
    grad = torch.randn_like(out)
    del out

    def step():
        out = fn(*leaves)
        torch.autograd.grad(out, leaves, grad)

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() / 1e9
    ms = triton.testing.do_bench(step, warmup=50, rep=200, return_mode="median")
    return {"ms": ms, "peak_gb": peak}


def sdpa_best(batch, heads, n, d) -> dict:
    leaves = inputs(batch, heads, heads, n, d)
    best = None
    for backend in (SDPBackend.CUDNN_ATTENTION, SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION):
        try:

            def fn(q, k, v, backend=backend):
                with sdpa_kernel([backend]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

            row = measure(fn, leaves) | {"backend": backend.name}
        except Exception as error:  # noqa: BLE001  (a backend that refuses the shape is skipped)
            row = {"error": repr(error)[:200], "backend": backend.name}
        if "ms" in row and (best is None or row["ms"] < best["ms"]):
            best = row
    return best or row


def fla_nsa(batch, heads, kv_heads, n, d, selection_only=False) -> dict:
    from fla.ops.nsa import parallel_nsa

    q, k, v = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in inputs(batch, heads, kv_heads, n, d))
    g = torch.ones(batch, n, heads, device=DEVICE, dtype=torch.bfloat16)
    if selection_only:
        indices = causal_block_lists(batch, kv_heads, n).transpose(1, 2).long().contiguous()  # [B, T, H, S]
        fn = lambda q, k, v: parallel_nsa(q, k, v, g_slc=g, block_indices=indices, block_counts=16, block_size=64)
    else:
        fn = lambda q, k, v: parallel_nsa(q, k, v, g_cmp=g, g_slc=g, block_counts=16, block_size=64)
    return measure(fn, [q, k, v])


def causal_block_lists(batch, kv_heads, n, top=16, block=64) -> torch.Tensor:
    """[B, Hk, N, top] random distinct past blocks per position (own block first), int32."""
    own = torch.arange(n, device=DEVICE) // block
    noise = torch.rand(batch, kv_heads, n, -(-n // block), device=DEVICE)
    noise = noise.masked_fill(torch.arange(noise.shape[-1], device=DEVICE) > own[:, None], -1.0)
    noise = noise.scatter(-1, own[None, None, :, None].expand(batch, kv_heads, n, 1), 2.0)
    values, chosen = noise.topk(min(top, noise.shape[-1]), -1)
    return torch.where(values < 0, -1, chosen).int()


def ours_selection_only(batch, heads, kv_heads, n, d) -> dict:
    blocks = causal_block_lists(batch, kv_heads, n)
    fn = lambda q, k, v: block_sparse_attention(q, k, v, blocks, block_size=64, tile=GROUP_TILE, causal=True)[0]
    return measure(fn, inputs(batch, heads, kv_heads, n, d))


def ours(pattern, batch, heads, kv_heads, n, d) -> dict:
    spec = sf.parse_pattern(pattern)
    params = None
    if spec.needs_hidden and spec.name == "dsa":
        width = heads * d
        weights = spec.make_layer_parameters(width, heads, kv_heads, d, d)
        params = {key: w.to(DEVICE) for key, w in weights.items()}
        params[HIDDEN_KEY] = torch.randn(batch, n, width, device=DEVICE, dtype=torch.bfloat16)

    def fn(q, k, v):
        call = None if params is None else {**params, AUX_KEY: {}}
        out = sf.sparse_attention(q, k, v, spec, causal=True, params=call)
        return out if call is None else out + 0 * sum(call[AUX_KEY].values())

    return measure(fn, inputs(batch, heads, kv_heads, n, d))


def cases(batch, heads, d):
    """(name, thunk(n)) of every timed case."""
    yield "sdpa", lambda n: sdpa_best(batch, heads, n, d)
    yield "fla_nsa g16", lambda n: fla_nsa(batch, heads, heads // 16, n, d)
    yield "nsa g16", lambda n: ours(NSA, batch, heads, heads // 16, n, d)
    yield "fla_nsa_selection g16", lambda n: fla_nsa(batch, heads, heads // 16, n, d, selection_only=True)
    yield "nsa_selection g16", lambda n: ours_selection_only(batch, heads, heads // 16, n, d)
    for group in (8, 4, 1):
        yield f"nsa g{group}", lambda n, group=group: ours(NSA, batch, heads, heads // group, n, d)
        # the selection on query tiles of 16 positions with per-row block masks, same shapes
        yield f"nsa tile16 g{group}", lambda n, group=group: ours(NSA + ",tile=16", batch, heads, heads // group, n, d)
    yield "moba", lambda n: ours(MOBA, batch, heads, heads, n, d)
    yield "quest", lambda n: ours(QUEST, batch, heads, heads, n, d)
    yield "dsa", lambda n: ours(DSA, batch, heads, heads, n, d)
    yield "dsa g16", lambda n: ours(DSA, batch, heads, heads // 16, n, d)  # a kv group's heads share one tensor-core tile


def write(out_dir: str, record: dict) -> None:
    path = os.path.join(out_dir, "gpu_block_sparse.json")
    with open(path + ".tmp", "w") as handle:
        json.dump(record, handle, indent=1)
    os.replace(path + ".tmp", path)


def table(record: dict) -> str:
    lengths = record["lengths"]
    lines = ["case".ljust(24) + "".join(f"{n // 1024}K ms (GB)".rjust(18) for n in lengths)]
    for name, rows in record["timing"].items():
        cells = []
        for n in lengths:
            row = rows.get(str(n), {})
            cells.append((f"{row['ms']:.2f} ({row['peak_gb']:.1f})" if "ms" in row else row.get("error", "-")[:16]).rjust(18))
        lines.append(name.ljust(24) + "".join(cells))
    return "\n".join(lines)


def plot(record: dict, path: str) -> None:
    """fwd+bwd ms against N per case (log-log), dense SDPA drawn dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for name, rows in record["timing"].items():
        points = sorted((int(n), row["ms"]) for n, row in rows.items() if "ms" in row)
        if points:
            ax.plot(*zip(*points), "k--o" if name == "sdpa" else "o-", label=name)
    ax.set(
        xscale="log",
        yscale="log",
        xlabel="N",
        ylabel="ms, fwd+bwd",
        title=f"block-sparse attention, {record['machine']}, {record['commit']}",
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path, dpi=120)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    parser.add_argument("--lengths", default="4096,16384,65536")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--cases", default="", help="comma-separated case names to time (default: every case)")
    parser.add_argument("--plot-only", metavar="JSON", help="redraw the PNG beside a recorded JSON and exit")
    args = parser.parse_args()
    if args.plot_only:
        with open(args.plot_only) as handle:
            plot(json.load(handle), args.plot_only.removesuffix(".json") + ".png")
        return
    os.makedirs(args.out, exist_ok=True)
    start = time.time()
    lengths = [int(n) for n in args.lengths.split(",")]
    chosen = set(args.cases.split(",")) if args.cases else set()
    record = {
        "machine": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": time.strftime("%Y-%m-%d"),
        "commit": os.environ.get("SPARSEFOCUS_COMMIT", ""),
        "shape": {
            "batch": args.batch,
            "heads": args.heads,
            "head_dim": args.head_dim,
            "dtype": "bf16",
            "causal": True,
            "mode": "fwd+bwd",
        },
        "patterns": {"nsa": NSA, "moba": MOBA, "quest": QUEST, "dsa": DSA},
        "lengths": lengths,
        "correctness": {},
        "timing": {},
    }
    if not args.skip_check:
        try:
            record["correctness"] = correctness()
        except Exception:  # noqa: BLE001  (recorded; the timing still runs)
            record["correctness"] = {"error": traceback.format_exc()[-2000:]}
        print(json.dumps(record["correctness"], indent=1), flush=True)
        write(args.out, record)
    for n in lengths:
        for name, thunk in cases(args.batch, args.heads, args.head_dim):
            if chosen and name not in chosen:
                continue
            rows = record["timing"].setdefault(name, {})
            if time.time() - start > DEADLINE_S:
                rows[str(n)] = {"error": "skipped: time"}
                continue
            try:
                rows[str(n)] = thunk(n)
            except Exception as error:  # noqa: BLE001  (an OOM or a refusal is recorded, the rest runs)
                rows[str(n)] = {"error": repr(error)[:300]}
            torch.cuda.empty_cache()
            print(name, n, rows[str(n)], f"{time.time() - start:.0f}s", flush=True)
            write(args.out, record)
    plot(record, os.path.join(args.out, "gpu_block_sparse.png"))
    print(table(record))


if __name__ == "__main__":
    main()
