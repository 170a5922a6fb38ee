"""Multi-query associative recall (MQAR) as in Zoology's ``zoology/data/multiquery_ar.py``.

A sequence of length L holds D key-value pairs ``k1 v1 ... kD vD`` (keys from [1, V/2), values from
[V/2, V), distinct within a sequence), then a query region of L - 2D positions in which every key
appears exactly once, at an even offset 2*gap, the gaps drawn without replacement with
P(gap = g - 1) proportional to a * g^(a - 1) (a = ``power_a``; small a favours short gaps). Targets
are next-token style: at the position of a queried key the target is its value; everywhere else
-100. The value itself is never written after the query. The remaining query-region positions
are 0, or uniform random ids if ``random_non_queries``.

Presets: Zoology's Figure 2 (``iclr24_zoology_figure2/configs.py``): V = 8192, 100k train / 3k
held-out, ``random_non_queries=False``, (L, D) = (64, 4), (128, 8), (256, 16); (512, 64) is
commented out there and offered here as ``fig2_512``. Zoology draws its test set from seed + 10
and only warns on overlap; we draw all splits from one stream and drop repeated sequences.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np

from sparsefocus.tasks.base import TaskConfig, TaskData, register_task
from sparsefocus.tasks.splits import distinct_splits, require_bool, require_int, require_sizes, resolve_preset

IGNORE = -100

_FIGURE2 = dict(vocab_size=8192, random_non_queries=False, num_train=100_000, num_valid=3_000, num_test=0)
PRESETS: dict[str, dict[str, Any]] = {
    "fig2_64": dict(_FIGURE2, seq_len=64, num_kv_pairs=4),
    "fig2_128": dict(_FIGURE2, seq_len=128, num_kv_pairs=8),
    "fig2_256": dict(_FIGURE2, seq_len=256, num_kv_pairs=16),
    "fig2_512": dict(_FIGURE2, seq_len=512, num_kv_pairs=64),
}


def distinct_integers(rng: np.random.Generator, count: int, size: int, low: int, high: int) -> np.ndarray:
    """[count, size] rows, each a uniformly random ordered choice of ``size`` distinct ints in [low, high)."""
    span = high - low
    if size * size <= 2 * span:  # a row repeats with probability < ~1 - exp(-1): redrawing is cheap
        return low + _redraw_until_distinct(rng, count, size, span)
    out = np.empty((count, size), dtype=np.int64)
    rows_per_chunk = max(1, (1 << 22) // span)  # bounds the [rows, span] random block to 32 MB
    for start in range(0, count, rows_per_chunk):
        scores = rng.random((min(rows_per_chunk, count - start), span))
        chosen = np.argpartition(scores, size - 1, axis=1)[:, :size]  # a uniform subset, in no useful order
        order = np.argsort(np.take_along_axis(scores, chosen, axis=1), axis=1)  # a uniform order
        out[start : start + len(scores)] = low + np.take_along_axis(chosen, order, axis=1)
    return out


def _redraw_until_distinct(rng: np.random.Generator, count: int, size: int, span: int) -> np.ndarray:
    """i.i.d. uniform rows, redrawing rows with a repeat: uniform over ordered distinct tuples."""
    out = rng.integers(0, span, size=(count, size))
    redo = np.arange(count)
    while True:
        ordered = np.sort(out[redo], axis=1)
        redo = redo[(ordered[:, 1:] == ordered[:, :-1]).any(axis=1)]
        if len(redo) == 0:
            return out
        out[redo] = rng.integers(0, span, size=(len(redo), size))


def query_gaps(rng: np.random.Generator, count: int, num_kv_pairs: int, space: int, power_a: float) -> np.ndarray:
    """[count, D] distinct slots in [0, space), drawn in order without replacement with p_g ∝ a g^(a-1).

    Gumbel-top-k: sorting log p + Gumbel noise gives exactly sequential sampling without replacement.
    """
    log_p = np.log(power_a) + (power_a - 1) * np.log(np.arange(1, space + 1))
    scores = log_p + rng.gumbel(size=(count, space))
    return np.argsort(-scores, axis=1)[:, :num_kv_pairs]


def mqar_examples(
    rng: np.random.Generator,
    count: int,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    power_a: float,
    random_non_queries: bool,
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` MQAR sequences: inputs [count, L] and next-token targets [count, L] (-100 unscored)."""
    context = 2 * num_kv_pairs
    keys = distinct_integers(rng, count, num_kv_pairs, 1, vocab_size // 2)
    values = distinct_integers(rng, count, num_kv_pairs, vocab_size // 2, vocab_size)
    inputs = np.zeros((count, seq_len), dtype=np.int64)
    inputs[:, 0:context:2] = keys
    inputs[:, 1:context:2] = values
    positions = context + 2 * query_gaps(rng, count, num_kv_pairs, (seq_len - context) // 2, power_a)  # [count, D]
    np.put_along_axis(inputs, positions, keys, axis=1)
    targets = np.full((count, seq_len), IGNORE, dtype=np.int64)
    np.put_along_axis(targets, positions, values, axis=1)
    if random_non_queries:
        filler = inputs == 0
        inputs[filler] = rng.integers(0, vocab_size, size=int(filler.sum()))
    return inputs, targets


@register_task
@dataclass
class MQARConfig(TaskConfig):
    """Zoology's MQAR. Fields left as None take the value of ``preset`` (default ``fig2_64``)."""

    name: ClassVar[str] = "mqar"
    kind: ClassVar[str] = "next_token"

    preset: str = "fig2_64"
    vocab_size: int | None = None
    seq_len: int | None = None
    num_kv_pairs: int | None = None
    power_a: float = 0.01
    random_non_queries: bool | None = None
    num_train: int | None = None
    num_valid: int | None = None
    num_test: int | None = None

    def resolved(self) -> dict[str, Any]:
        """The preset's values overridden by every field that is not None."""
        return resolve_preset(self.name, self, PRESETS)

    def validate(self) -> None:
        config = self.resolved()
        require_int(self.name, "num_kv_pairs", config["num_kv_pairs"], 1)
        require_int(self.name, "seq_len", config["seq_len"], 4 * config["num_kv_pairs"])
        if config["seq_len"] % 2:
            raise ValueError(f"{self.name}: seq_len must be even (queries sit at even offsets), got {config['seq_len']}")
        require_int(self.name, "vocab_size", config["vocab_size"], config["seq_len"] + 1)  # Zoology: V > L
        if isinstance(self.power_a, bool) or not isinstance(self.power_a, (int, float)) or not self.power_a > 0:
            raise ValueError(f"{self.name}: power_a must be a number > 0, got {self.power_a!r}")
        require_bool(self.name, "random_non_queries", config["random_non_queries"])
        require_sizes(self.name, config["num_train"], config["num_valid"], config["num_test"])

    def build(self, seed: int) -> TaskData:
        """Distinct sequences from one stream seeded by ``seed``; train, held-out, test in that order."""
        self.validate()
        config = self.resolved()
        rng = np.random.default_rng(self.seed_for_data(seed))
        sizes = (config["num_train"], config["num_valid"], config["num_test"])
        fields = ("vocab_size", "seq_len", "num_kv_pairs", "power_a", "random_non_queries")

        def sample(count: int) -> tuple[np.ndarray, np.ndarray]:
            return mqar_examples(rng, count, *(config[field] for field in fields))

        return distinct_splits(
            self.name,
            self.kind,
            sample,
            sizes,
            vocab_size=config["vocab_size"],
            num_classes=config["vocab_size"],
            pad_id=None,
            info={"preset": self.preset, "config": config, "ignore_index": IGNORE, "source": "zoology"},
        )
