"""Simple associative recall: key-value pairs, a separator, a query key; classify the queried value.

In the spirit of HazyResearch/safari's AR synthetic (``k v`` pairs, then ``=> k``, target v) and
Zoology's single-query ``base_ar``, as a classification task. A sequence is
``k1 v1 ... kD vD SEP q`` (length 2D + 2): keys distinct within a sequence, values drawn
independently (they may repeat), q one of the D keys uniformly. Ids: keys 0..K-1, values
K..K+V-1, SEP = K+V. The class is the queried value's index in 0..V-1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from sparsefocus.tasks.base import TaskConfig, TaskData, register_task
from sparsefocus.tasks.mqar import distinct_integers
from sparsefocus.tasks.splits import distinct_splits, require_int, require_sizes


@register_task
@dataclass
class AssocRecallConfig(TaskConfig):
    """num_pairs D key-value pairs over ``num_keys`` keys and ``num_values`` values; length 2D + 2."""

    name: ClassVar[str] = "assoc_recall"
    kind: ClassVar[str] = "classify"

    num_pairs: int = 8
    num_keys: int = 16
    num_values: int = 16
    num_train: int = 5000
    num_valid: int = 2000
    num_test: int = 0

    def validate(self) -> None:
        require_int(self.name, "num_pairs", self.num_pairs, 1)
        require_int(self.name, "num_keys", self.num_keys, self.num_pairs)
        require_int(self.name, "num_values", self.num_values, 2)
        require_sizes(self.name, self.num_train, self.num_valid, self.num_test)

    def tokens(self) -> list[str]:
        return [f"k{index}" for index in range(self.num_keys)] + [f"v{index}" for index in range(self.num_values)] + ["=>"]

    def sample(self, rng: np.random.Generator, count: int) -> tuple[np.ndarray, np.ndarray]:
        """inputs [count, 2D + 2], labels [count] (value index of the queried key)."""
        keys = distinct_integers(rng, count, self.num_pairs, 0, self.num_keys)
        values = rng.integers(0, self.num_values, size=(count, self.num_pairs))
        asked = rng.integers(0, self.num_pairs, size=count)
        rows = np.arange(count)
        inputs = np.empty((count, 2 * self.num_pairs + 2), dtype=np.int64)
        inputs[:, 0:-2:2] = keys
        inputs[:, 1:-2:2] = self.num_keys + values
        inputs[:, -2] = self.num_keys + self.num_values
        inputs[:, -1] = keys[rows, asked]
        return inputs, values[rows, asked]

    def build(self, seed: int) -> TaskData:
        """Distinct sequences from one stream seeded by ``seed``; train, held-out, test in that order."""
        self.validate()
        rng = np.random.default_rng(self.seed_for_data(seed))
        sizes = (self.num_train, self.num_valid, self.num_test)
        tokens = self.tokens()
        return distinct_splits(
            self.name,
            self.kind,
            lambda count: self.sample(rng, count),
            sizes,
            vocab_size=len(tokens),
            num_classes=self.num_values,
            pad_id=None,
            info={"tokens": tokens, "separator_id": len(tokens) - 1},
        )
