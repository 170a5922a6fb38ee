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


def fastest_dense(rows: list[dict], timing: str = "ms") -> dict[tuple[int, str], dict]:
    """{(n, mode): {"backend", "ms"}} of the fastest ok dense row at each point.

    Args:
        rows: result rows with ``n``, ``mode``, ``status``, ``ms`` and, for dense rows,
            ``dense_backend``; other rows are ignored. Ties keep the row that comes first.
        timing: the column compared, ``ms`` (default) or ``graph_ms`` (replayed from CUDA
            graphs; rows without it are ignored). The result's ``ms`` is that column.
    """
    best: dict[tuple[int, str], dict] = {}
    for row in rows:
        if row.get("status") != "ok" or "dense_backend" not in row or row.get(timing) is None:
            continue
        key = (row["n"], row["mode"])
        if key not in best or row[timing] < best[key]["ms"]:
            best[key] = {"backend": row["dense_backend"], "ms": row[timing]}
    return best


def attach_dense_ratios(rows: list[dict]) -> list[dict]:
    """Rows with ``dense_ms``, ``dense_backend_used`` and ``speedup_vs_dense`` = dense_ms / ms
    (> 1: faster than dense) wherever both were measured; None elsewhere. Rows timed from CUDA
    graphs too (``graph_ms``) also get ``graph_dense_ms``, ``graph_dense_backend_used`` and
    ``graph_speedup_vs_dense``: the same rule within the graph timings, whose fastest backend
    may differ."""
    best = fastest_dense(rows)
    graphed = fastest_dense(rows, "graph_ms")
    out = []
    for row in rows:
        row = row | _ratio(row, best.get((row["n"], row["mode"])), "ms", "")
        if "graph_ms" in row or "graph_error" in row:
            row = row | _ratio(row, graphed.get((row["n"], row["mode"])), "graph_ms", "graph_")
        out.append(row)
    return out


def _ratio(row: dict, dense: dict | None, timing: str, prefix: str) -> dict:
    measured = row.get("status") == "ok" and row.get(timing) is not None
    return {
        f"{prefix}dense_ms": dense["ms"] if dense else None,
        f"{prefix}dense_backend_used": dense["backend"] if dense else None,
        f"{prefix}speedup_vs_dense": dense["ms"] / row[timing] if dense is not None and measured else None,
    }


def dense_table(rows: list[dict], timing: str = "ms") -> list[dict]:
    """The fastest dense backend per point, as JSON rows {n, mode, backend, ms}, sorted;
    ``timing`` as in ``fastest_dense``."""
    best = fastest_dense(rows, timing)
    return [{"n": n, "mode": mode} | best[(n, mode)] for n, mode in sorted(best)]
