"""Where the indexed backward's time goes: the same kernel on key lists of different structure.

Usage on a CUDA machine:  PYTHONPATH=. python benchmarks/zeta_bwd_probe.py OUT.json [N]
B=4, H=16, q/k width 3, Dv=64, bf16, Cauchy weights, 32 slots per query, no mean token.
Lists: "zeta" (ZETA's causal selection, the benchmark pattern), "zeta_local0" (the same without
the local band), "uniform" (32 keys drawn uniformly from 0..i: no locality, no shared keys),
"local" (i-31..i: every key shared by 32 neighbouring queries, the most contended adds),
"zeta_shuffled" (ZETA's lists given to randomly permuted query rows: same keys per list, but
neighbouring programs no longer share keys), "zeta_zsorted" (ZETA's lists with the rows in Morton
order of the queries: neighbouring programs share most keys) and "zeta_zstrided" (the same rows
in tiles of 16, the tiles interleaved so that consecutive programs lie 1/64 of the rows apart).
Forward and forward+backward times, medians.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import torch

from benchmarks.zeta_bench import PATTERN, timed_ms, zeta_inputs
from sparsefocus.attention.patterns import parse_pattern
from sparsefocus.attention.zeta import _codes, code_bits, select_keys_fused
from sparsefocus.kernels.indexed import indexed_attention

SLOTS = 32


def lists(q: torch.Tensor, k: torch.Tensor) -> dict[str, torch.Tensor]:
    """Key lists [B, H, N, 32] int32 (-1 unused) of each structure."""
    batch, heads, n, _ = q.shape
    gen = torch.Generator(device="cuda").manual_seed(1)
    rows = torch.arange(n, device="cuda")[:, None]  # [N, 1]
    uniform = (torch.rand(batch, heads, n, SLOTS, generator=gen, device="cuda") * (rows + 1)).long()  # [B, H, N, 32] in 0..i
    local = rows - torch.arange(SLOTS, device="cuda")  # [N, 32]: i, i-1, ..., i-31
    zeta = select_keys_fused(parse_pattern(PATTERN), q, k, True, None)
    no_local = select_keys_fused(parse_pattern(PATTERN.replace("local=32", "local=0")), q, k, True, None)
    shuffled = zeta[:, :, torch.randperm(n, generator=gen, device="cuda")]
    spec = parse_pattern(PATTERN)
    zorder = torch.argsort(_codes(spec, q.float(), code_bits(spec.bits, 3, 1), True)[0], dim=-1)  # [B, H, N] rows by Morton code
    tiles = n // 16
    strided = torch.arange(tiles, device="cuda").view(64, tiles // 64).t().reshape(-1)  # program p -> tile (p % 64) * T/64 + p // 64
    zstrided = zorder.view(batch, heads, tiles, 16)[:, :, strided].reshape(batch, heads, n)
    return {
        "zeta": zeta, "zeta_local0": no_local, "uniform": uniform,
        "local": torch.where(local >= 0, local, -1).expand(batch, heads, n, SLOTS), "zeta_shuffled": shuffled,
        "zeta_zsorted": zeta.gather(2, zorder[..., None].expand_as(zeta)),
        "zeta_zstrided": zeta.gather(2, zstrided[..., None].expand_as(zeta)),
    }


def main() -> None:
    path, n = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 65536
    q, k, v, gamma = zeta_inputs(4, 16, n)
    rows = []
    for name, index in lists(q.detach(), k.detach()).items():
        index = index.to(torch.int32).contiguous()

        def step(backward: bool):
            def run():
                out = indexed_attention(q, k, v, index, score="cauchy", gamma=gamma)
                if backward:
                    out.backward(torch.ones_like(out))
            return run

        fwd, both = timed_ms(step(False), 7), timed_ms(step(True), 7)
        used = (index >= 0).float().mean().item()
        rows.append({"list": name, "N": n, "slots_used": used, "fwd_ms": fwd, "fwdbwd_ms": both, "bwd_ms": both - fwd})
        print(json.dumps(rows[-1]), flush=True)
    commit = os.environ.get("SPARSEFOCUS_COMMIT") or subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
    result = {"command": "PYTHONPATH=. python benchmarks/zeta_bwd_probe.py " + " ".join(sys.argv[1:]), "commit": commit,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__, "pattern": PATTERN, "rows": rows}
    with open(path + ".tmp", "w") as handle:
        json.dump(result, handle, indent=1)
    os.replace(path + ".tmp", path)


if __name__ == "__main__":
    main()
