"""LRA ListOps, seeded, with its two presets and two tokenisations.

The distribution is exactly that of LRA's ``lra_benchmarks/data/listops.py`` (``generate_tree``:
below ``max_depth`` a node is a leaf digit with probability 0.75, else an operator from
[MIN [MAX [MED [SM over 2..max_args children one level deeper; length = operators + closers +
digits), kept only when ``min_length < length < max_length``. LRA draws trees and throws away
the ~92% (``lra``) or ~99% (``semantic_focus``) outside the window; we instead compute the exact
length distribution of every subtree by convolution (``LengthTables``) and sample a tree
*conditioned* on its length: same distribution, no rejection, 5000 trees of length 500-600 in
seconds. Labels: MIN, MAX, MED = int(median) (even count: mean of the middle two, truncated),
SM = sum mod 10.

Tokenisations (both delete LRA's parentheses, so the token count equals the generator length):

- ``lra``: LRA's fixed input pipeline: ``]`` written ``X``; ids <pad>=0, 15 symbols, <oov>=16
  (never used); padded to ``max_length`` (17 ids). The order of the 15 symbol ids is ours.
- ``spartan`` (the Semantic Focus code): ``]`` kept; [PAD]=0 and 15 symbols (16 ids); padded to
  the longest sequence drawn, rounded up to ``pad_multiple``. spartan orders ids by frequency in
  its data; ours are fixed.
"""

from __future__ import annotations

import random
import statistics
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Sequence

import numpy as np

from sparsefocus.tasks.base import TaskConfig, TaskData, register_task
from sparsefocus.tasks.splits import (
    draw_distinct,
    require_choice,
    require_int,
    require_sizes,
    resolve_preset,
    split_task_data,
)

OPERATORS = ("[MIN", "[MAX", "[MED", "[SM")
CLOSE = "]"
LEAF_PROBABILITY = 0.75  # LRA's VALUE_P = 0.25 is the probability of an operator node
SCAN_STEPS = 32  # child lengths scanned in Python before switching to numpy

_DIGITS = tuple(str(digit) for digit in range(10))
_SYMBOLS = list(_DIGITS) + list(OPERATORS)
TOKENIZATIONS: dict[str, list[str]] = {
    "lra": ["<pad>"] + _SYMBOLS + ["X", "<oov>"],
    "spartan": ["[PAD]"] + _SYMBOLS + [CLOSE],
}
_CLOSE_TOKEN = {"lra": "X", "spartan": CLOSE}

PRESETS: dict[str, dict[str, Any]] = {
    "lra": dict(
        max_depth=10,
        max_args=10,
        min_length=500,
        max_length=2000,
        num_train=96000,
        num_valid=2000,
        num_test=2000,
        tokenization="lra",
    ),
    "semantic_focus": dict(
        max_depth=10,
        max_args=10,
        min_length=500,
        max_length=600,
        num_train=5000,
        num_valid=2000,
        num_test=0,
        tokenization="spartan",
    ),
}


class LengthTables:
    """Exact length distributions of LRA's tree sampler, truncated below ``max_length``.

    ``subtree[d][n]``: probability that a subtree grown at depth d (root = 1) has n tokens.
    ``sums[d][k][n]``: probability that k independent subtrees at depth d have n tokens in total.
    Arrays are float64 of shape [max_length]; ``*_list`` are the same as Python lists for fast scans.
    """

    def __init__(self, max_depth: int, max_args: int, max_length: int) -> None:
        self.max_depth = max_depth
        self.max_args = max_args
        self.subtree: dict[int, np.ndarray] = {max_depth: _unit(1, max_length)}
        self.sums: dict[int, list[np.ndarray]] = {}
        for depth in range(max_depth - 1, 0, -1):
            self.sums[depth + 1] = _convolution_powers(self.subtree[depth + 1], max_args)
            children = sum(self.sums[depth + 1][2:]) / (max_args - 1)  # uniform over 2..max_args children
            operator = np.zeros(max_length)
            operator[2:] = children[:-2]  # an operator node adds its operator and its closer
            self.subtree[depth] = LEAF_PROBABILITY * _unit(1, max_length) + (1 - LEAF_PROBABILITY) * operator
        self.subtree_list = {depth: table.tolist() for depth, table in self.subtree.items()}
        self.sums_list = {depth: [table.tolist() for table in tables] for depth, tables in self.sums.items()}


def _unit(index: int, size: int) -> np.ndarray:
    out = np.zeros(size)
    out[index] = 1.0
    return out


def _convolution_powers(distribution: np.ndarray, max_power: int) -> list[np.ndarray]:
    """[delta_0, p, p*p, ..., p^{*max_power}], each truncated to len(p)."""
    size = distribution.shape[0]
    powers = [_unit(0, size)]
    for _ in range(max_power):
        powers.append(np.convolve(powers[-1], distribution)[:size])
    return powers


@lru_cache(maxsize=8)
def length_tables(max_depth: int, max_args: int, max_length: int) -> LengthTables:
    return LengthTables(max_depth, max_args, max_length)


class TreeSampler:
    """Samples LRA ListOps trees of a given length as token lists, returning their values."""

    def __init__(self, tables: LengthTables, rnd: random.Random) -> None:
        self.tables = tables
        self.rnd = rnd

    def tree(self, depth: int, length: int, out: list[str]) -> int:
        """Append the tokens of a subtree at ``depth`` with exactly ``length`` tokens; return its value."""
        random_unit = self.rnd.random
        if length == 1:
            digit = int(random_unit() * 10)
            out.append(_DIGITS[digit])
            return digit
        num_children = self._num_children(depth, length)
        operator = OPERATORS[int(random_unit() * len(OPERATORS))]
        out.append(operator)
        values, rest = [], length - 2
        for after in range(num_children - 1, -1, -1):
            child_length = self._child_length(depth + 1, rest, after) if after else rest
            if child_length == 1:  # inlined leaf: most nodes are digits
                digit = int(random_unit() * 10)
                out.append(_DIGITS[digit])
                values.append(digit)
            else:
                values.append(self.tree(depth + 1, child_length, out))
            rest -= child_length
        out.append(CLOSE)
        return apply_operator(operator, values)

    def _num_children(self, depth: int, length: int) -> int:
        sums = self.tables.sums_list[depth + 1]
        weights = [sums[count][length - 2] for count in range(2, self.tables.max_args + 1)]
        return 2 + _pick(weights, self.rnd.random() * sum(weights))

    def _child_length(self, depth: int, rest: int, after: int) -> int:
        """Length m of the next child, given ``rest`` tokens for it and ``after`` >= 1 children still to come.

        P(m) is proportional to subtree[m] * sums[after][rest - m], whose total is sums[after + 1][rest].
        A Python scan over small m stops early (most children are single digits); past SCAN_STEPS the
        rest of the range is done in one numpy pass.
        """
        subtree, others = self.tables.subtree_list[depth], self.tables.sums_list[depth][after]
        target = self.rnd.random() * self.tables.sums_list[depth][after + 1][rest]
        largest = rest - after
        total, last_positive = 0.0, 1
        for size in range(1, min(largest, SCAN_STEPS) + 1):
            weight = subtree[size] * others[rest - size]
            if weight > 0:
                total += weight
                last_positive = size
                if total > target:
                    return size
        if largest <= SCAN_STEPS:
            return last_positive  # only reached through rounding
        return self._tail_length(depth, rest, after, total, target) or last_positive

    def _tail_length(self, depth: int, rest: int, after: int, total: float, target: float) -> int:
        """The m in SCAN_STEPS+1 .. rest-after where the running weight first exceeds ``target``; 0 if none."""
        largest = rest - after
        subtree = self.tables.subtree[depth][SCAN_STEPS + 1 : largest + 1]
        others = self.tables.sums[depth][after][after : rest - SCAN_STEPS][::-1]  # sums[rest - m] in the same order
        tail = subtree * others
        index = int(np.searchsorted(total + np.cumsum(tail), target, side="right"))
        if index < len(tail):
            return SCAN_STEPS + 1 + index
        positive = np.flatnonzero(tail > 0)  # rounding: fall back to the largest possible m
        return SCAN_STEPS + 1 + int(positive[-1]) if len(positive) else 0


def _pick(weights: Sequence[float], target: float) -> int:
    """The first index whose running sum exceeds ``target`` (the last positive one if rounding says none)."""
    total = 0.0
    last_positive = 0
    for index, weight in enumerate(weights):
        if weight > 0:
            last_positive = index
            total += weight
            if total > target:
                return index
    return last_positive


def apply_operator(operator: str, values: list[int]) -> int:
    """The generator's evaluation, as LRA writes it (median via the statistics module)."""
    if operator == "[MIN":
        return min(values)
    if operator == "[MAX":
        return max(values)
    if operator == "[MED":
        return int(statistics.median(values))
    return sum(values) % 10


def evaluate_tokens(tokens: Sequence[str]) -> int:
    """Independent check of a label: a stack machine over the tokens (pad tokens ignored).

    Accepts either closer (``]`` or ``X``). Each operator opens a frame collecting integer
    arguments; a closer reduces the frame with integer arithmetic only and hands the result to the
    frame below. ValueError on a malformed sequence.
    """
    frames: list[tuple[str, list[int]]] = []
    result: list[int] = []
    for token in tokens:
        if token in OPERATORS:
            frames.append((token, []))
        elif token in (CLOSE, "X"):
            if not frames:
                raise ValueError("closer without an open operator")
            operator, args = frames.pop()
            (frames[-1][1] if frames else result).append(_reduce(operator, args))
        elif token.isdigit():
            (frames[-1][1] if frames else result).append(int(token))
    if frames or len(result) != 1:
        raise ValueError("malformed ListOps sequence")
    return result[0]


def _reduce(operator: str, args: list[int]) -> int:
    ordered = sorted(args)
    if operator == "[MIN":
        return ordered[0]
    if operator == "[MAX":
        return ordered[-1]
    if operator == "[MED":
        middle = len(ordered) // 2
        return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) // 2
    total = 0
    for value in args:
        total = (total + value) % 10
    return total


def decode(ids: Sequence[int], tokenization: str) -> list[str]:
    """Token strings of a row of ids (pad included)."""
    vocabulary = TOKENIZATIONS[tokenization]
    return [vocabulary[int(index)] for index in ids]


@register_task
@dataclass
class ListOpsConfig(TaskConfig):
    """LRA ListOps. Fields left as None take the value of ``preset``.

    preset: "semantic_focus" (lengths in (500, 600), 5000/2000/0, spartan tokens; the default) or
    "lra" (lengths in (500, 2000), 96000/2000/2000, LRA tokens). Lengths are strict bounds on the token
    count. seq_len: padded width (None: ``max_length`` for lra tokens, the longest drawn sequence
    rounded up to ``pad_multiple`` for spartan tokens).
    """

    name: ClassVar[str] = "listops"
    kind: ClassVar[str] = "classify"

    preset: str = "semantic_focus"
    tokenization: str | None = None
    max_depth: int | None = None
    max_args: int | None = None
    min_length: int | None = None
    max_length: int | None = None
    num_train: int | None = None
    num_valid: int | None = None
    num_test: int | None = None
    seq_len: int | None = None
    pad_multiple: int = 1

    def resolved(self) -> dict[str, Any]:
        """The preset's values overridden by every field that is not None."""
        return resolve_preset(self.name, self, PRESETS)

    def validate(self) -> None:
        config = self.resolved()
        require_choice(self.name, "tokenization", config["tokenization"], list(TOKENIZATIONS))
        require_int(self.name, "max_depth", config["max_depth"], 1)
        require_int(self.name, "max_args", config["max_args"], 2)
        require_int(self.name, "min_length", config["min_length"], 0)
        require_int(self.name, "max_length", config["max_length"], config["min_length"] + 2)
        require_sizes(self.name, config["num_train"], config["num_valid"], config["num_test"])
        require_int(self.name, "pad_multiple", config["pad_multiple"], 1)
        if self.seq_len is not None:
            require_int(self.name, "seq_len", self.seq_len, config["max_length"] - 1)

    def build(self, seed: int) -> TaskData:
        """Distinct trees drawn from one stream seeded by ``seed``; train, held-out, test in that order."""
        self.validate()
        config = self.resolved()
        tables = length_tables(config["max_depth"], config["max_args"], config["max_length"])
        window = self._length_window(tables, config)
        rnd = random.Random(self.seed_for_data(seed))
        sizes = (config["num_train"], config["num_valid"], config["num_test"])
        vocabulary = TOKENIZATIONS[config["tokenization"]]
        encoder = {token: index for index, token in enumerate(vocabulary)}
        encoder[CLOSE] = encoder[_CLOSE_TOKEN[config["tokenization"]]]

        def sample(count: int) -> tuple[np.ndarray, np.ndarray]:
            return _sample_rows(TreeSampler(tables, rnd), window, count, encoder, config["max_length"] - 1)

        inputs, labels = draw_distinct(self.name, sample, sum(sizes))
        inputs = _fit_columns(inputs, self._width(inputs, config))
        info = {"preset": self.preset, "tokenization": config["tokenization"], "tokens": vocabulary, "config": config}
        return split_task_data(
            self.name,
            self.kind,
            inputs,
            labels,
            sizes,
            vocab_size=len(vocabulary),
            num_classes=10,
            pad_id=0,
            info=info,
        )

    def _length_window(self, tables: LengthTables, config: dict[str, Any]) -> tuple[np.ndarray, np.ndarray]:
        """Allowed root lengths (min_length, max_length) and their cumulative probabilities."""
        lengths = np.arange(config["min_length"] + 1, config["max_length"])
        cumulative = np.cumsum(tables.subtree[1][lengths])
        if cumulative[-1] <= 0:
            raise ValueError(
                f"{self.name}: no tree with max_depth={config['max_depth']}, max_args={config['max_args']} has a "
                f"length strictly between min_length={config['min_length']} and max_length={config['max_length']}"
            )
        return lengths, cumulative

    def _width(self, inputs: np.ndarray, config: dict[str, Any]) -> int:
        """Padded sequence width (see the class docstring)."""
        if self.seq_len is not None:
            return self.seq_len
        if config["tokenization"] == "lra":
            return config["max_length"]
        longest = int((inputs != 0).sum(axis=1).max())
        multiple = config["pad_multiple"]
        return -(-longest // multiple) * multiple


def _sample_rows(
    sampler: TreeSampler, window: tuple[np.ndarray, np.ndarray], count: int, encoder: dict[str, int], width: int
) -> tuple[np.ndarray, np.ndarray]:
    """``count`` trees as id rows [count, width] padded with 0, and their labels [count]."""
    lengths, cumulative = window
    inputs = np.zeros((count, width), dtype=np.int64)
    labels = np.zeros(count, dtype=np.int64)
    for row in range(count):
        index = int(np.searchsorted(cumulative, sampler.rnd.random() * cumulative[-1], side="right"))
        tokens: list[str] = []
        labels[row] = sampler.tree(1, int(lengths[min(index, len(lengths) - 1)]), tokens)
        inputs[row, : len(tokens)] = [encoder[token] for token in tokens]
    return inputs, labels


def _fit_columns(inputs: np.ndarray, width: int) -> np.ndarray:
    """Id rows cut or right-padded with 0 to ``width`` columns (only pad columns are ever cut)."""
    if inputs.shape[1] >= width:
        return inputs[:, :width]
    return np.pad(inputs, ((0, 0), (0, width - inputs.shape[1])))
