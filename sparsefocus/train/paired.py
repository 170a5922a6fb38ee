"""Seed-paired comparisons of mechanisms trained on the same seeds: the epoch at which each seed
first reaches a held-out accuracy, and an exact signed-rank test of the per-seed differences
against the reference mechanism on the same seed.

A study trains every mechanism on the same seeds, so the fair comparison of, say, how soon a
mechanism leaves a plateau is seed by seed (each seed's own data and draws): a mechanism that
is earlier on most seeds, by more than it is later on the others, learns faster. The test is the
Wilcoxon signed-rank test with its exact null distribution (every sign pattern of the nonzero
differences equally likely), which stays exact with tied magnitudes; it needs no large sample.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np


def epochs_to_reach(curve: np.ndarray, target: float) -> int | None:
    """First epoch (1-based) at which ``curve`` is at or below ``target``; None if never."""
    hits = np.nonzero(curve <= target)[0]
    return int(hits[0]) + 1 if hits.size else None


def first_reach(accuracy: np.ndarray, threshold: float) -> list[int | None]:
    """Per seed (the rows of ``accuracy`` [seeds, epochs]) the first epoch, counted from 1, with
    accuracy >= ``threshold``; None where a seed never gets there."""
    return [epochs_to_reach(-row, -threshold) for row in accuracy]


def midranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``values`` [n], tied values sharing the mean of their ranks."""
    order = np.argsort(values, kind="stable")
    ranks = np.empty(values.size, dtype=np.float64)
    ranks[order] = np.arange(1, values.size + 1)
    for value in np.unique(values):
        tied = values == value
        ranks[tied] = ranks[tied].mean()
    return ranks


def signed_rank_p(differences: Sequence[float]) -> float | None:
    """Exact two-sided p-value of the Wilcoxon signed-rank test of ``differences`` against a
    distribution symmetric about zero; None when every difference is zero.

    Zero differences are dropped; tied magnitudes get midranks. Under the null each nonzero
    difference is as likely positive as negative, so the statistic W (the sum of the ranks of the
    positive differences) has the distribution of a sum over every sign pattern; it is counted
    exactly over the doubled (integer) ranks, and p is the share of patterns whose W lies at least
    as far from its mean as the observed one."""
    nonzero = np.asarray([d for d in differences if d != 0], dtype=np.float64)
    if nonzero.size == 0:
        return None
    doubled = np.rint(2 * midranks(np.abs(nonzero))).astype(np.int64)  # midranks are multiples of 1/2
    counts = [1] + [0] * int(doubled.sum())  # counts[s]: sign patterns with doubled W = s (exact ints)
    for rank in doubled:
        counts = [c + (counts[s - rank] if s >= rank else 0) for s, c in enumerate(counts)]
    observed = int(doubled[nonzero > 0].sum())
    centre = doubled.sum() / 2
    extreme = sum(c for s, c in enumerate(counts) if abs(s - centre) >= abs(observed - centre))
    return extreme / 2**nonzero.size


@dataclass(frozen=True)
class ReachRow:
    """One mechanism's first epochs at held-out accuracy >= ``threshold``: per seed (``epochs``,
    None where never), how many seeds get there, the median and range over those; and against the
    reference on the same seeds, how many seeds are earlier, later or the same and the exact
    signed-rank p (None for the reference itself, or without a shared seed). A seed that never
    gets there counts as one epoch after the last in the comparison."""

    threshold: float
    seeds: list[int]
    epochs: list[int | None]
    reached: int
    median: float | None
    first: int | None
    last: int | None
    earlier: int | None = None
    later: int | None = None
    same: int | None = None
    p_value: float | None = None

    @classmethod
    def of(cls, seeds: list[int], accuracy: np.ndarray, threshold: float) -> ReachRow:
        """Of held-out accuracy [seeds, epochs] (the seeds in ``seeds`` order), no comparison."""
        epochs = first_reach(accuracy, threshold)
        got = [epoch for epoch in epochs if epoch is not None]
        if not got:
            return cls(threshold, list(seeds), epochs, 0, None, None, None)
        return cls(threshold, list(seeds), epochs, len(got), float(np.median(got)), min(got), max(got))

    def against(self, reference: ReachRow, horizon: int) -> ReachRow:
        """This row compared seed by seed with ``reference``'s (``horizon``: the number of epochs, so
        that a seed that never reaches the threshold counts as epoch horizon + 1)."""
        theirs = dict(zip(reference.seeds, reference.epochs))
        shared = [(mine, theirs[seed]) for seed, mine in zip(self.seeds, self.epochs) if seed in theirs]
        if not shared:
            return self
        differences = [(horizon + 1 if a is None else a) - (horizon + 1 if b is None else b) for a, b in shared]
        return replace(
            self,
            earlier=sum(d < 0 for d in differences),
            later=sum(d > 0 for d in differences),
            same=sum(d == 0 for d in differences),
            p_value=signed_rank_p(differences),
        )

    def text(self) -> str:
        if self.median is None:
            return f"never (0/{len(self.epochs)})"
        return f"{self.median:g} [{self.first}, {self.last}] ({self.reached}/{len(self.epochs)})"
