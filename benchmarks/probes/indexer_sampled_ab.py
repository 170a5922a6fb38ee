"""DSA indexer top-k: the exact path against the sampled-cut path (SAMPLED) on one GPU, same inputs:
agreement of the selected positions and time per call, at 16K and 64K, causal, kk=2048, h=4, d=64."""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

import sparsefocus.kernels.indexer_topk as it


def main() -> None:
    out_dir = sys.argv[1]
    rows = []
    for n in (16384, 65536):
        torch.manual_seed(0)
        b, h, d, kk = 4, 4, 64, 2048
        iq = torch.randn(b, h, n, d, device="cuda")
        ik = torch.randn(b, n, d, device="cuda")
        w = torch.randn(b, n, h, device="cuda")
        res = {"n": n, "batch": b, "heads": h, "dim": d, "kk": kk}
        outs = {}
        # exact; sampled in chunks of 1,024 rows (the scores chunk's at 64K); sampled in chunks of 8,192
        for name, sampled, buffer_bytes in (("exact", False, 2**31), ("sampled_1k", True, 2**28), ("sampled_8k", True, 2**31)):
            it.SAMPLED, it.SAMPLED_BUFFER_BYTES = sampled, buffer_bytes
            fn = lambda: it.indexer_topk(iq, ik, w, kk, causal=True)  # noqa: E731
            outs[name] = fn()
            torch.cuda.synchronize()
            res[f"ms_{name}"] = triton.testing.do_bench(fn, warmup=3, rep=300)
            res[f"identical_{name}"] = bool(torch.equal(outs["exact"], outs[name]))
            print(name, res[f"ms_{name}"], res[f"identical_{name}"], flush=True)
        rows.append(res)
        print(res, flush=True)
        it.SAMPLED, it.SAMPLED_BUFFER_BYTES = False, 2**31
    with open(os.path.join(out_dir, "indexer_sampled_ab.json"), "w") as f:
        json.dump(
            {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__, "rows": rows},
            f,
            indent=1,
        )


if __name__ == "__main__":
    main()
