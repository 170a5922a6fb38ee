"""Share of ZETA's kept (query, key) pairs whose key lies within a window of W keys of the whole
sorted key order, centred on the median insertion point of a tile of 64 queries taken in curve
order: what a backward summing in-window key gradients per tile (and adding the rest one pair at
a time) would keep out of the global adds. CPU, random q, k in 3 dims, default pattern."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from sparsefocus.attention import parse_pattern
from sparsefocus.attention.zeta import _codes, code_bits, select_keys

out, tile, windows = sys.argv[1], 64, (128, 256, 512)
torch.manual_seed(0)
pattern = parse_pattern("zeta")
bits = code_bits(pattern.bits, 3, pattern.curves)
result: dict = {}
for n in (4096, 16384):
    q, k = torch.randn(1, 2, n, 3), torch.randn(1, 2, n, 3)
    index = select_keys(pattern, q, k, True, None)[0]  # [H, N, K]
    codes_q, codes_k = _codes(pattern, q, bits)[0, 0], _codes(pattern, k, bits)[0, 0]  # [H, N]
    for width in windows:
        inside = total = programs = 0
        for h in range(index.shape[0]):
            key_order = torch.argsort(codes_k[h])
            rank = torch.empty_like(key_order)
            rank[key_order] = torch.arange(n)
            query_order = torch.argsort(codes_q[h])
            for start in range(0, n, tile):
                rows = query_order[start : start + tile]
                base = int(torch.searchsorted(codes_k[h][key_order], codes_q[h][rows]).median()) - width // 2
                listed = index[h][rows]
                listed = listed[listed >= 0]
                offset = rank[listed] - base
                inside += int(((offset >= 0) & (offset < width)).sum())
                total += listed.numel()
                programs += 1
        share = inside / total
        # adds per pair, relative to one per pair: the window flushed once, the rest one by one
        relative = (programs * width + (total - inside)) / total
        result[f"{n}/{width}"] = {"pairs": total, "in_window": inside, "share_in_window": share, "adds_relative": relative}
        print(n, width, round(share, 3), round(relative, 3), flush=True)
record = {
    "what": "ZETA default pattern (causal), B=1, H=2, q, k ~ N(0, 1) in 3 dims; tiles of 64 queries in curve order: share of kept pairs whose key is within W keys of the sorted key order around the tile's median insertion point, and the key-gradient adds relative to one per pair if each tile flushed its window once and added the other pairs one by one",
    "command": "python benchmarks/zeta_window_share_probe.py OUT.json",
    "device": "cpu",
    "torch": torch.__version__,
    "tile": tile,
    "results": result,
}
json.dump(record, open(out, "w"), indent=1)
fig, ax = plt.subplots(figsize=(6, 4))
for n in (4096, 16384):
    ax.plot(windows, [result[f"{n}/{w}"]["share_in_window"] for w in windows], "o-", label=f"N={n}: share of pairs in the window")
    ax.plot(windows, [result[f"{n}/{w}"]["adds_relative"] for w in windows], "s--", label=f"N={n}: adds relative to one per pair")
ax.set_xscale("log", base=2)
ax.set_xticks(windows, [str(w) for w in windows])
ax.set_xlabel("window of sorted keys per tile of 64 queries")
ax.set_ylim(0, 1)
ax.set_title("ZETA: a window of the sorted keys per curve-ordered tile", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out.replace(".json", ".png"), dpi=110)
