"""The Semantic Focus paper's bound check: do the measured statistics favour heavy hitters?

With delta_s the full-attention dispersion (FULL model, all keys), delta_h the heavy-hitter
dispersion (TOPK model, its kept keys), Delta the heavy-hitter separation and beta the sink ratio
(sink count / k), c1 = delta_h / delta_s and c2 = Delta / delta_s, the paper's code
(``bounds-lhs.py``, its eqs. (304) and (305)) evaluates

- W-form: c1 + (1/delta_s) log(2 (1 + 1/(delta_s c2)))                          < 1
- X-form: c1 + (1/delta_s) log(delta_s (1 + beta)(1 + 1/(delta_s c2)) + beta)
                                                        < 1 + (1/delta_s) log(delta_s + 1)

(the X-form assumes 2 Gamma Xi^2 = delta_s). A condition that holds means the measured numbers
fall on the side where heavy-hitter attention is favoured. Each is checked per percentile column
(p75/p90/p95/max of dispersion and sinks against p25/p10/p5/min of separation); every input is
floored at 1e-9 as in the paper's code.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FLOOR = 1e-9
COLUMNS = ("p75", "p90", "p95", "p100")
SEPARATION_COLUMNS = ("p25", "p10", "p5", "p0")


@dataclass(frozen=True)
class BoundInputs:
    """One percentile column: dispersions, separation and sink ratio (sink count / k)."""

    full_dispersion: float
    heavy_dispersion: float
    separation: float
    sink_ratio: float

    def floored(self) -> BoundInputs:
        return BoundInputs(
            *(max(value, FLOOR) for value in (self.full_dispersion, self.heavy_dispersion, self.separation, self.sink_ratio))
        )


def w_form_lhs(inputs: BoundInputs) -> float:
    """Left side of the W-form condition (holds when < 1)."""
    x = inputs.floored()
    c1 = x.heavy_dispersion / x.full_dispersion
    return c1 + math.log(2.0 * (1.0 + 1.0 / x.separation)) / x.full_dispersion


def x_form_sides(inputs: BoundInputs) -> tuple[float, float]:
    """(left, right) sides of the X-form condition (holds when left < right)."""
    x = inputs.floored()
    c1 = x.heavy_dispersion / x.full_dispersion
    inner = x.full_dispersion * (1.0 + x.sink_ratio) * (1.0 + 1.0 / x.separation) + x.sink_ratio
    left = c1 + math.log(inner) / x.full_dispersion
    right = 1.0 + math.log(x.full_dispersion + 1.0) / x.full_dispersion
    return left, right


def check_column(inputs: BoundInputs) -> dict[str, float | bool]:
    """Both conditions for one column. ``x_lhs`` is the code's single number (left - right + 1 < 1)."""
    w_lhs = w_form_lhs(inputs)
    x_left, x_right = x_form_sides(inputs)
    return {
        "w_lhs": w_lhs,
        "w_holds": w_lhs < 1.0,
        "x_left": x_left,
        "x_right": x_right,
        "x_lhs": x_left - x_right + 1.0,
        "x_holds": x_left < x_right,
    }


def columns_from_table(row: dict[str, list[float]], sinks_per_query: float = 5.0) -> list[BoundInputs]:
    """Paper-table row ``{"full_dispersion": [4], "heavy_dispersion": [4], "separation": [4],
    "sinks": [4]}`` (sinks as counts beta) -> four BoundInputs, sink ratio = beta / sinks_per_query."""
    for name in ("full_dispersion", "heavy_dispersion", "separation", "sinks"):
        if len(row.get(name, ())) != 4:
            raise ValueError(f"bound table row needs 4 values for {name!r}, got {row.get(name)}")
    return [
        BoundInputs(
            row["full_dispersion"][i], row["heavy_dispersion"][i], row["separation"][i], row["sinks"][i] / sinks_per_query
        )
        for i in range(4)
    ]


def columns_from_summaries(full: dict, sparse: dict) -> list[BoundInputs]:
    """Pooled summaries of ``ScoreStatistics`` (FULL model, sparse model) -> four BoundInputs."""
    full_disp = full["pooled"]["full_dispersion"]
    pooled = sparse["pooled"]
    return [
        BoundInputs(full_disp[c], pooled["dispersion"][c], pooled["separation"][s], pooled["sink_ratio"][c])
        for c, s in zip(COLUMNS, SEPARATION_COLUMNS)
    ]


def keeps_top_scores(sparse: dict) -> list[bool]:
    """Per column, whether the sparse model's unfloored separation percentile is >= 0 (ties give
    0): the bound reasons about keeping the top scores, which a model whose dropped keys outscore
    its kept ones (input-agnostic patterns) does not do. Summaries without raw values pass."""
    raw = sparse["pooled"].get("separation_raw")
    return [True] * len(COLUMNS) if raw is None else [raw[c] >= 0 for c in SEPARATION_COLUMNS]


def check_columns(columns: list[BoundInputs]) -> list[dict[str, float | bool]]:
    """``check_column`` on each column; NaN inputs (a statistic that was undefined) raise ValueError."""
    for column in columns:
        if any(math.isnan(v) for v in vars(column).values()):
            raise ValueError(f"bound check needs finite statistics, got {column}")
    return [check_column(column) for column in columns]


def format_bound_report(name: str, results: list[dict[str, float | bool]]) -> str:
    """Lines saying, per column, the left sides and on which side of each condition the task falls."""
    lines = [f"{name}:"]
    for label, result in zip(("p75", "p90", "p95", "max"), results):
        if not result.get("applies", True):
            lines.append(f"  {label:<4} not applicable: separation < 0 (dropped keys outscore kept ones)")
            continue
        w_side = "holds (favours heavy hitters)" if result["w_holds"] else "fails"
        x_side = "holds (favours heavy hitters)" if result["x_holds"] else "fails"
        lines.append(
            f"  {label:<4} W-form LHS {result['w_lhs']:.3f} < 1: {w_side}; "
            f"X-form {result['x_left']:.3f} < {result['x_right']:.3f}: {x_side}"
        )
    return "\n".join(lines)


PAPER_TABLE: dict[str, dict[str, list[float]]] = {
    "ListOps": {
        "full_dispersion": [8.61, 18.5, 29.4, 87.8],
        "heavy_dispersion": [3.51, 6.74, 9.67, 28.2],
        "separation": [0.016, 0.005, 0.002, 1e-9],
        "sinks": [1, 3, 15, 598],
    },
    "Parity": {
        "full_dispersion": [8.30, 10.1, 11.2, 19.4],
        "heavy_dispersion": [2.31, 3.13, 3.78, 9.16],
        "separation": [0.062, 0.022, 0.011, 1e-6],
        "sinks": [8, 13, 16, 33],
    },
    "Even pairs": {
        "full_dispersion": [2.03, 4.73, 9.44, 14.6],
        "heavy_dispersion": [1.03, 2.84, 5.50, 8.25],
        "separation": [0.009, 0.003, 0.002, 3e-8],
        "sinks": [6, 17, 26, 40],
    },
    "Missing dup": {
        "full_dispersion": [4.63, 9.25, 17.1, 23.9],
        "heavy_dispersion": [2.36, 4.25, 4.88, 10.5],
        "separation": [0.018, 0.006, 0.003, 1e-7],
        "sinks": [7, 15, 21, 40],
    },
}
"""The values the paper's ``bounds-lhs.py`` hard-codes as its results (TOPK:5 against FULL)."""


def paper_bound_report() -> str:
    """The bound check on the paper's own table, one block per task."""
    return "\n".join(format_bound_report(task, check_columns(columns_from_table(row))) for task, row in PAPER_TABLE.items())
