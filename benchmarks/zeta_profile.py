"""Where ZETA's time goes: each stage of the triton path timed alone, the profiler's kernel table
for one forward+backward (B=4, H=16, Dv=64, bf16, causal), and with --tune a sweep of the
selection kernel's and the indexed kernel's tiles at the largest N.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_profile.py OUT_DIR [N ...] [--tune] [--switches]
(--switches: time the options zeta_select.FUSED_PREFIXES and SELECT_OVERRIDES['exact_stop'] off
and on, compare the gradients and the selected keys)
Writes OUT_DIR/zeta_profile.json.
"""

from __future__ import annotations

import json
import operator
import os
import sys
from functools import partial

import torch

import sparsefocus as sf
from benchmarks.zeta_bench import PATTERN, timed_ms, zeta_inputs, zeta_step
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import SENTINEL, _codes, code_bits, mean_tokens, select_keys_fused
from sparsefocus.kernels import indexed, zeta_select
from sparsefocus.kernels.indexed import indexed_attention
from sparsefocus.kernels.zeta_select import sorted_prefixes


def stages(n: int, pattern: str = PATTERN) -> dict:
    """Median ms of each stage of the forward, and of the whole forward and forward+backward."""
    spec = parse_pattern(pattern)
    q, k, v, gamma = zeta_inputs(4, 16, n)
    bits = code_bits(spec.bits, 3, spec.curves)
    codes_k = _codes(spec, k.detach().float(), bits, fused=True)
    real = torch.ones(4, n, dtype=torch.bool, device="cuda")
    size = spec.chunk_size(n)
    index = select_keys_fused(spec, q, k, True, None)
    mean_k, mean_v, present = mean_tokens(k, v, True, None, fused=True)
    attend = lambda: indexed_attention(q, k, v, index, score="cauchy", gamma=gamma, extra_key=mean_k, extra_value=mean_v, extra_mask=present)
    out = attend()
    grad = torch.ones_like(out)
    row = {
        "N": n,
        "codes_ms": timed_ms(lambda: (_codes(spec, q.detach().float(), bits, True), _codes(spec, k.detach().float(), bits, True))),
        "sorted_prefixes_ms": timed_ms(lambda: sorted_prefixes(codes_k, real, size, spec.chunks - 1, SENTINEL)),
        "select_total_ms": timed_ms(lambda: select_keys_fused(spec, q, k, True, None)),
        "mean_tokens_fwd_ms": timed_ms(lambda: mean_tokens(k, v, True, None, fused=True)),
        "mean_tokens_fwdbwd_ms": timed_ms(lambda: torch.autograd.grad([x.float().sum() for x in mean_tokens(k, v, True, None, fused=True)[:2]], (k, v))),
        "indexed_fwd_ms": timed_ms(attend),
        "indexed_bwd_ms": timed_ms(lambda: torch.autograd.grad(out, (q, k, v, gamma, mean_k, mean_v), grad, retain_graph=True)),
        "zeta_fwd_ms": timed_ms(zeta_step(q, k, v, gamma, pattern, backward=False)),
        "zeta_fwdbwd_ms": timed_ms(zeta_step(q, k, v, gamma, pattern)),
    }
    print(json.dumps(row), flush=True)
    return row


def kernel_table(n: int, pattern: str = PATTERN, top: int = 25) -> list[dict]:
    """The profiler's CUDA kernels of one forward+backward, most time first."""
    q, k, v, gamma = zeta_inputs(4, 16, n)
    step = zeta_step(q, k, v, gamma, pattern)
    step()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    events.sort(key=lambda e: -e.device_time_total)
    rows = [{"name": e.key[:120], "calls": e.count, "ms": e.device_time_total / 1e3} for e in events[:top]]
    for r in rows:
        print(f"{r['ms']:9.3f} ms {r['calls']:5d}x {r['name']}", flush=True)
    return rows


def sweep(label: str, overrides: dict, candidates: list[dict], run) -> list[dict]:
    """Time run() under each override set (kept in ``overrides`` while it runs)."""
    rows = []
    for tiles in candidates:
        overrides.clear()
        overrides.update(tiles)
        try:
            rows.append({**tiles, "ms": timed_ms(run)})
        except Exception as error:  # a tile that does not compile or fit is recorded, not fatal
            rows.append({**tiles, "error": f"{type(error).__name__}: {str(error)[:200]}"})
        print(label, rows[-1], flush=True)
    overrides.clear()
    return rows


def tune(n: int, pattern: str = PATTERN) -> dict:
    """Selection-kernel variants and indexed-kernel tiles on the ZETA shape at length n."""
    spec = parse_pattern(pattern)
    q, k, v, gamma = zeta_inputs(4, 16, n)
    index = select_keys_fused(spec, q, k, True, None)
    mean_k, mean_v, present = (x.detach() for x in mean_tokens(k, v, True, None, fused=True))
    attend = lambda: indexed_attention(q, k, v, index, score="cauchy", gamma=gamma, extra_key=mean_k, extra_value=mean_v, extra_mask=present)
    out = attend()
    grad = torch.ones_like(out)
    # one curve's cut (distinct): smaller row tiles stop their early-exit loop sooner
    select = [dict(distinct=True, BLOCK_M=m, num_warps=w) for m, w in ((4, 1), (1, 1), (2, 1), (4, 2), (8, 1), (8, 2), (16, 2), (16, 4))]
    fwd = [dict(BLOCK_M=m, BLOCK_K=kk, num_warps=w) for m, kk, w in ((16, 16, 2), (16, 32, 2), (8, 32, 1), (8, 16, 1), (32, 16, 4), (16, 8, 2), (32, 8, 4))]
    bwd = [dict(BLOCK_M=m, BLOCK_K=kk, num_warps=w) for m, kk, w in ((16, 1, 2), (16, 2, 2), (32, 1, 4), (32, 1, 2), (8, 1, 1), (16, 1, 1), (8, 2, 1), (32, 2, 4))]
    indexed.TILE_OVERRIDES["fwd"], indexed.TILE_OVERRIDES["bwd"] = {}, {}
    return {
        "N": n,
        "select": sweep("select", zeta_select.SELECT_OVERRIDES, select, lambda: select_keys_fused(spec, q, k, True, None)),
        "indexed_fwd": sweep("fwd", indexed.TILE_OVERRIDES["fwd"], fwd, attend),
        "indexed_bwd": sweep("bwd", indexed.TILE_OVERRIDES["bwd"], bwd, lambda: torch.autograd.grad(out, (q, k, v, gamma), grad, retain_graph=True)),
    }


def switch_ab(lengths: list[int], name: str, flip, original: bool, pattern: str = PATTERN) -> list[dict]:
    """fwd+bwd and selection time with an option off and on (``flip(flag)`` sets it; e.g.
    zeta_select.FUSED_PREFIXES), the relative difference of the gradients and whether the
    selected keys are identical, at each length."""
    rows = []
    for n in lengths:
        q, k, v, gamma = zeta_inputs(4, 16, n)
        row, grads = {"switch": name, "N": n}, {}
        chosen = {}
        for flag in (False, True):
            flip(flag)
            row[f"{flag}_fwdbwd_ms"] = timed_ms(zeta_step(q, k, v, gamma, pattern))
            row[f"{flag}_select_ms"] = timed_ms(lambda: select_keys_fused(parse_pattern(pattern), q, k, True, None))
            chosen[flag] = select_keys_fused(parse_pattern(pattern), q, k, True, None)
            for x in (q, k, v, gamma):
                x.grad = None
            sparse_attention_for(q, k, v, gamma, pattern).float().pow(2).sum().backward()
            grads[flag] = [x.grad.float().clone() for x in (q, k, v, gamma)]
        flip(original)
        row["same_keys"] = bool(torch.equal(chosen[False], chosen[True]))
        for label, plain, switched in zip(("dq", "dk", "dv", "dgamma"), grads[False], grads[True]):
            row[f"rel_diff_{label}"] = ((switched - plain).norm() / plain.norm().clamp_min(1e-30)).item()
        print("switch", json.dumps(row), flush=True)
        rows.append(row)
    return rows


def sparse_attention_for(q, k, v, gamma, pattern):
    return sf.sparse_attention(q, k, v, pattern, causal=True, impl="triton", params={"gamma": gamma})


def main(argv: list[str]) -> None:
    out = argv[0]
    lengths = [int(x) for x in argv[1:] if not x.startswith("--")] or [8192, 65536]
    result = {"device": torch.cuda.get_device_name(), "commit": os.environ.get("SPARSEFOCUS_COMMIT", "unknown"), "pattern": PATTERN}
    result["stages"] = [stages(n) for n in lengths]
    result["kernels"] = {str(n): kernel_table(n) for n in lengths}
    if "--tune" in argv:
        result["tune"] = tune(max(lengths))
    if "--switches" in argv:
        result["switches"] = switch_ab(lengths, "FUSED_PREFIXES", partial(setattr, zeta_select, "FUSED_PREFIXES"), True) + switch_ab(
            lengths, "exact_stop", partial(operator.setitem, zeta_select.SELECT_OVERRIDES, "exact_stop"), True
        )
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "zeta_profile.json.tmp"), "w") as handle:
        json.dump(result, handle, indent=1)
    os.replace(os.path.join(out, "zeta_profile.json.tmp"), os.path.join(out, "zeta_profile.json"))


if __name__ == "__main__":
    main(sys.argv[1:])
