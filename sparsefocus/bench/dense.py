"""The dense baseline of a bench run: the fastest SDPA backend measured in that same run.

"dense" in every table and ratio is, per (N, mode), the minimum time over the SDPA backends
(cuDNN, FlashAttention, memory-efficient, math) that ran at that point, so a ratio never flatters
a case by comparing it with a slower backend than the GPU offers. Rows carry their backend in
``dense_backend`` (the SDPA cases of ``registry.py`` set it); a backend that failed or was
unavailable at a point does not take part there.
"""

from __future__ import annotations

from sparsefocus.bench.registry import SDPA_BACKENDS

DENSE_CASES = tuple(f"sdpa:{backend}" for backend in SDPA_BACKENDS)


def fastest_dense(rows: list[dict]) -> dict[tuple[int, str], dict]:
    """{(n, mode): {"backend", "ms"}} of the fastest ok dense row at each point.

    Args:
        rows: result rows with ``n``, ``mode``, ``status``, ``ms`` and, for dense rows,
            ``dense_backend``; other rows are ignored. Ties keep the row that comes first.
    """
    best: dict[tuple[int, str], dict] = {}
    for row in rows:
        if row.get("status") != "ok" or "dense_backend" not in row:
            continue
        key = (row["n"], row["mode"])
        if key not in best or row["ms"] < best[key]["ms"]:
            best[key] = {"backend": row["dense_backend"], "ms": row["ms"]}
    return best


def attach_dense_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``dense_ms``, ``dense_backend_used`` and ``speedup_vs_dense`` = dense_ms / ms
    (> 1: faster than dense) wherever both were measured; None elsewhere."""
    best = fastest_dense(rows)
    out = []
    for row in rows:
        dense = best.get((row["n"], row["mode"]))
        out.append(
            row
            | {
                "dense_ms": dense["ms"] if dense else None,
                "dense_backend_used": dense["backend"] if dense else None,
                "speedup_vs_dense": dense["ms"] / row["ms"] if dense is not None and row.get("status") == "ok" else None,
            }
        )
    return out


def dense_table(rows: list[dict]) -> list[dict]:
    """The fastest dense backend per point, as JSON rows {n, mode, backend, ms}, sorted."""
    best = fastest_dense(rows)
    return [{"n": n, "mode": mode} | best[(n, mode)] for n, mode in sorted(best)]
