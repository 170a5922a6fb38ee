"""How many distinct keys a tile of queries lists in ZETA's default selection, with the queries
taken in position order or in curve (Morton code) order: the factor by which pre-reducing each
tile's key gradients would cut the backward's global adds. CPU, random q, k in 3 dims."""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch

from sparsefocus.attention import parse_pattern
from sparsefocus.attention.zeta import _codes, code_bits, select_keys

out = sys.argv[1]
torch.manual_seed(0)
pattern = parse_pattern("zeta")
tiles = (16, 32, 64, 128)
result: dict = {}
for n in (4096, 16384):
    q, k = torch.randn(1, 2, n, 3), torch.randn(1, 2, n, 3)
    index = select_keys(pattern, q, k, True, None)[0]  # [H, N, K]
    codes = _codes(pattern, q, code_bits(pattern.bits, 3, pattern.curves))[0, 0]  # [H, N]
    for order in ("position", "curve"):
        for tile in tiles:
            pairs = distinct = 0
            for h in range(index.shape[0]):
                perm = torch.arange(n) if order == "position" else torch.argsort(codes[h])
                for start in range(0, n, tile):
                    listed = index[h][perm[start : start + tile]]
                    listed = listed[listed >= 0]
                    pairs += listed.numel()
                    distinct += listed.unique().numel()
            result[f"{n}/{order}/{tile}"] = {"pairs": pairs, "distinct_keys": distinct, "pairs_per_key": pairs / distinct}
            print(n, order, tile, round(pairs / distinct, 2), flush=True)
record = {
    "what": "ZETA default pattern (k=32, window=64, local=32, chunks=8, causal), B=1, H=2, q and k ~ N(0, 1) in 3 dims: (query, slot) pairs per distinct key within tiles of consecutive queries, queries in position order or sorted by their Morton code",
    "command": "python benchmarks/zeta_key_sharing_probe.py OUT.json",
    "device": "cpu",
    "torch": torch.__version__,
    "results": result,
}
json.dump(record, open(out, "w"), indent=1)
fig, ax = plt.subplots(figsize=(6, 4))
for n in (4096, 16384):
    for order, style in (("position", "--"), ("curve", "-")):
        ax.plot(tiles, [result[f"{n}/{order}/{t}"]["pairs_per_key"] for t in tiles], style, marker="o", label=f"N={n}, {order} order")
ax.set_xscale("log", base=2)
ax.set_xticks(tiles, [str(t) for t in tiles])
ax.set_xlabel("queries per tile")
ax.set_ylabel("(query, slot) pairs per distinct key")
ax.set_title("ZETA's selections: keys shared within a tile of queries", fontsize=10)
ax.legend(fontsize=8)
fig.tight_layout()
fig.savefig(out.replace(".json", ".png"), dpi=110)
