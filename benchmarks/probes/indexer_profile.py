"""Kernel times of one DSA indexer top-k call (exact and sampled) at 64K, B=4, h=4, d=64, kk=2048, causal."""

from __future__ import annotations

import sys

import torch
from torch.profiler import ProfilerActivity, profile

import sparsefocus.kernels.indexer_topk as it


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 65536
    torch.manual_seed(0)
    iq = torch.randn(4, 4, n, 64, device="cuda")
    ik = torch.randn(4, n, 64, device="cuda")
    w = torch.randn(4, n, 4, device="cuda")
    for sampled in (False, True):
        it.SAMPLED = sampled
        it.indexer_topk(iq, ik, w, 2048, causal=True)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            it.indexer_topk(iq, ik, w, 2048, causal=True)
            torch.cuda.synchronize()
        print("SAMPLED", sampled)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=60))


if __name__ == "__main__":
    main()
