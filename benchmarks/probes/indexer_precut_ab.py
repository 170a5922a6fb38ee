"""DSA indexer top-k on one GPU: the exact radix select against the sampled pre-cut (SAMPLED: each
row's keys at or above a sampled cut compacted into a buffer, the radix select over the buffer),
same inputs, positions compared; B=4, h=4, d=64, kk=2048, causal; a few settings of the path.
Writes indexer_precut_ab.json to the folder given, after every measurement."""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

import sparsefocus.kernels.indexer_topk as it

DEFAULTS = dict(SAMPLED=False, SAMPLE_FACTOR=1.35, SAMPLED_CAP_FACTOR=4.0, SAMPLE_STRIDE=16)
VARIANTS = {
    "exact": {},
    "sampled": dict(SAMPLED=True),
    "sampled_sel2048w8": dict(SAMPLED=True, TILES=dict(SELECT_BLOCK=2048, select_warps=8)),
    "sampled_sel512w4": dict(SAMPLED=True, TILES=dict(SELECT_BLOCK=512, select_warps=4)),
    "sampled_sel512w2": dict(SAMPLED=True, TILES=dict(SELECT_BLOCK=512, select_warps=2)),
    "sampled_sel256w2": dict(SAMPLED=True, TILES=dict(SELECT_BLOCK=256, select_warps=2)),
    "sampled_sel256w1": dict(SAMPLED=True, TILES=dict(SELECT_BLOCK=256, select_warps=1)),
    "exact_sel512w4": dict(TILES=dict(SELECT_BLOCK=512, select_warps=4)),
    "exact_sel512w2": dict(TILES=dict(SELECT_BLOCK=512, select_warps=2)),
    "sampled_cap3": dict(SAMPLED=True, SAMPLED_CAP_FACTOR=3.0),
    "sampled_cap2_factor1.2": dict(SAMPLED=True, SAMPLED_CAP_FACTOR=2.0, SAMPLE_FACTOR=1.2),
    "sampled_stride32": dict(SAMPLED=True, SAMPLE_STRIDE=32),
    "sampled_stride8": dict(SAMPLED=True, SAMPLE_STRIDE=8),
}


def _set(settings: dict) -> None:
    for name, value in (DEFAULTS | settings).items():
        if name != "TILES":
            setattr(it, name, value)
    it.TILE_OVERRIDES.clear()
    it.TILE_OVERRIDES.update(settings.get("TILES", {}))


def _record(path: str, res: dict) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(res, f, indent=1)
    os.replace(path + ".tmp", path)


def main() -> None:
    out_dir, lengths = sys.argv[1], [int(x) for x in sys.argv[2:]] or [16384, 65536]
    path = os.path.join(out_dir, "indexer_precut_ab.json")
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    start = time.time()
    for n in lengths:
        torch.manual_seed(0)
        b, h, d, kk = 4, 4, 64, 2048
        iq, ik, w = (
            torch.randn(b, h, n, d, device="cuda"),
            torch.randn(b, n, d, device="cuda"),
            torch.randn(b, n, h, device="cuda"),
        )
        reference = None
        for name, settings in VARIANTS.items():
            _set(settings)
            fn = lambda: it.indexer_topk(iq, ik, w, kk, causal=True)  # noqa: E731
            got = fn()
            torch.cuda.synchronize()
            reference = got if reference is None else reference
            res[f"n{n}_{name}_identical"] = bool(torch.equal(reference, got))
            res[f"n{n}_{name}_ms"] = triton.testing.do_bench(fn, warmup=2, rep=600)
            print(
                f"n{n}_{name}", res[f"n{n}_{name}_ms"], res[f"n{n}_{name}_identical"], f"{time.time() - start:.0f}s", flush=True
            )
            _record(path, res)
        del iq, ik, w, reference
        torch.cuda.empty_cache()
    _set({})


if __name__ == "__main__":
    main()
