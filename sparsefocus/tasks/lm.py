"""Real-text tasks: causal language modelling on contiguous blocks, and the Semantic Focus PTB setting
(classify the next token from a fixed window), over Brown, PTB, WikiText or a folder of text.

| task | kind | example | targets |
|---|---|---|---|
| ``lm`` | ``next_token`` | ``block_size`` tokens of the split's stream (``<eos>`` after each line) | the next token at every position |
| ``lm_window`` | ``classify`` | ``window`` consecutive tokens inside one line, stride 1 (spartan ``ptb.py``) | the token after the window |

Perplexity is ``exp`` of the mean next-token cross-entropy in nats (``perplexity(mean_nll)``): for ``lm``
every position of every block is scored and blocks have equal length, so the held-out loss the training
loop reports is already the per-token mean. Blocks do not overlap, so early positions see little context;
perplexities are higher than sliding-window evaluations. The data depend on ``split_seed`` only, never on
the training seed, so every seed and mechanism sees the same held-out tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from sparsefocus.tasks.base import TaskConfig, TaskData, register_task
from sparsefocus.tasks.corpus import SPLITS
from sparsefocus.tasks.text_loaders import CORPORA, TextSplits, load_text
from sparsefocus.tasks.tokenize import TOKENIZERS, Encoded, Tokenizer, build_tokenizer, encode_split

PERPLEXITY_RULE = "perplexity = exp(mean next-token cross-entropy in nats) on the held-out split"


def perplexity(mean_nll: float) -> float:
    """Per-token perplexity from a mean negative log-likelihood in nats; ``inf`` when it overflows."""
    try:
        return math.exp(mean_nll)
    except OverflowError:
        return math.inf


def mean_token_nll(logits: Tensor, targets: Tensor, ignore_index: int = -100) -> Tensor:
    """Mean cross-entropy over scored targets. logits [..., V], targets [...] long (``ignore_index`` = unscored)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=ignore_index)


@dataclass
class TextTask(TaskConfig):
    """Fields shared by the real-text tasks.

    Args:
        corpus: "brown" (the setup step's cache), "ptb", "wikitext2", "wikitext103" or "folder". Default: "brown".
        path: folder holding the corpus files (every corpus but brown). Default: "".
        raw: WikiText only: read ``wiki.*.raw`` instead of ``wiki.*.tokens``. Default: False.
        tokenizer: "unigram", "bpe" (SentencePiece) or "word" (lowercase, numbers -> N). Default: "unigram".
        vocab_size: every id counted, ``<unk>`` and ``<eos>`` included. Default: 4096.
        split_seed: seeds the document split (brown, folder) and the capped subsets. Default: 0.
        max_train, max_valid, max_test: keep at most this many examples (a seeded subset); 0 keeps all.
            Default: 0.
    """

    kind: ClassVar[str] = "next_token"

    corpus: str = "brown"
    path: str = ""
    raw: bool = False
    tokenizer: str = "unigram"
    vocab_size: int = 4096
    split_seed: int = 0
    max_train: int = 0
    max_valid: int = 0
    max_test: int = 0

    def validate(self) -> None:
        if self.corpus not in CORPORA:
            raise ValueError(f"{self.name}: unknown corpus {self.corpus!r}; valid: {', '.join(CORPORA)}")
        if self.tokenizer not in TOKENIZERS:
            raise ValueError(f"{self.name}: unknown tokenizer {self.tokenizer!r}; valid: {', '.join(TOKENIZERS)}")
        if self.corpus != "brown" and not self.path:
            raise ValueError(f"{self.name}: corpus {self.corpus!r} needs path (the folder holding its files)")
        if self.raw and not self.corpus.startswith("wikitext"):
            raise ValueError(f"{self.name}: raw applies to wikitext2/wikitext103 only, not {self.corpus!r}")
        if self.vocab_size < 3:
            raise ValueError(f"{self.name}: vocab_size must be >= 3, got {self.vocab_size}")
        for field in ("max_train", "max_valid", "max_test"):
            if getattr(self, field) < 0:
                raise ValueError(f"{self.name}: {field} must be >= 0 (0 keeps all), got {getattr(self, field)}")

    def encoded(self) -> tuple[TextSplits, Tokenizer, dict[str, Encoded]]:
        """Load the corpus, train or load the tokenizer, and encode the three splits (all cached)."""
        splits = load_text(self.corpus, self.path, raw=self.raw, split_seed=self.split_seed)
        tokenizer = build_tokenizer(splits, self.tokenizer, self.vocab_size)
        return splits, tokenizer, {name: encode_split(tokenizer, splits, name) for name in SPLITS}

    def cap(self, split: str) -> int:
        return {"train": self.max_train, "valid": self.max_valid, "test": self.max_test}[split]

    def subset(self, split: str, count: int) -> np.ndarray:
        """Sorted indices of the kept examples of ``split``: all, or a ``split_seed``-seeded sample of the cap."""
        cap = self.cap(split)
        if cap == 0 or cap >= count:
            return np.arange(count)
        rng = np.random.default_rng([self.split_seed, SPLITS.index(split)])
        return np.sort(rng.choice(count, size=cap, replace=False))

    def base_info(self, splits: TextSplits, tokenizer: Tokenizer, encoded: dict[str, Encoded]) -> dict[str, Any]:
        return {
            "corpus": splits.name,
            "tokenizer": f"{tokenizer.kind}:{tokenizer.vocab_size}",
            "tokenizer_file": str(getattr(tokenizer, "path", "")),
            "eos_id": tokenizer.eos_id,
            "tokens": {name: int(e.ids.size) for name, e in encoded.items()},
            "lines": {name: int(e.offsets.size - 1) for name, e in encoded.items()},
            "metric": PERPLEXITY_RULE,
        }


@register_task
@dataclass
class CausalLMTask(TextTask):
    """Causal language modelling on non-overlapping blocks of each split's token stream.

    Args (besides ``TextTask``'s):
        block_size: tokens per example L. Default: 128.
    Data: inputs [N, L] = stream[i*L : (i+1)*L], targets [N, L] = stream[i*L+1 : (i+1)*L+1].
    """

    name: ClassVar[str] = "lm"
    kind: ClassVar[str] = "next_token"

    block_size: int = 128

    def validate(self) -> None:
        super().validate()
        if self.block_size < 1:
            raise ValueError(f"{self.name}: block_size must be >= 1, got {self.block_size}")

    def build(self, seed: int) -> TaskData:
        """The blocks of train / valid / test. ``seed`` is unused: the data depend on ``split_seed`` only."""
        self.validate()
        splits, tokenizer, encoded = self.encoded()
        blocks = {name: self.blocks(name, encoded[name].stream(tokenizer.eos_id)) for name in SPLITS}
        info = self.base_info(splits, tokenizer, encoded)
        info["unigram_perplexity"] = unigram_perplexity(blocks["train"][1], blocks, tokenizer.vocab_size)
        return TaskData(
            name=self.name, kind="next_token",
            train_inputs=blocks["train"][0], train_targets=blocks["train"][1],
            valid_inputs=blocks["valid"][0], valid_targets=blocks["valid"][1],
            test_inputs=blocks["test"][0], test_targets=blocks["test"][1],
            vocab_size=tokenizer.vocab_size, num_classes=tokenizer.vocab_size, info=info,
        )  # fmt: skip

    def blocks(self, split: str, stream: np.ndarray) -> tuple[Tensor, Tensor]:
        """Inputs and targets [N, block_size] of one split's stream [T]; ValueError if T <= block_size."""
        count = (stream.size - 1) // self.block_size
        if count == 0:
            raise ValueError(
                f"{self.name}: block_size {self.block_size} is longer than the {split} split "
                f"({stream.size} tokens); use a smaller block_size"
            )
        keep = self.subset(split, count)
        starts = keep[:, None] * self.block_size + np.arange(self.block_size)  # [N, L]
        return torch.from_numpy(stream[starts]), torch.from_numpy(stream[starts + 1])


@register_task
@dataclass
class WindowNextTokenTask(TextTask):
    """The Semantic Focus PTB setting: classify the token that follows a window of ``window`` tokens.

    Windows slide with stride 1 inside each line (sentence) and never cross lines; a line of n tokens
    gives n - window examples (none if n <= window). No ``<eos>``: as in spartan ``ptb.py``.

    Args (besides ``TextTask``'s):
        window: tokens per example L; 0 = the mean training-line length in tokens, truncated (the paper's
            rule: about 29 for Brown with unigram 4096). Default: 0.
    """

    name: ClassVar[str] = "lm_window"
    kind: ClassVar[str] = "classify"

    window: int = 0

    def validate(self) -> None:
        super().validate()
        if self.window < 0:
            raise ValueError(f"{self.name}: window must be >= 0 (0 = mean training line length), got {self.window}")

    def build(self, seed: int) -> TaskData:
        """Windows and next-token labels of train / valid / test. ``seed`` is unused (see the module doc)."""
        self.validate()
        splits, tokenizer, encoded = self.encoded()
        window = self.window or max(int(encoded["train"].line_lengths.mean()), 1)
        examples = {name: self.windows(name, encoded[name], window) for name in SPLITS}
        info = self.base_info(splits, tokenizer, encoded) | {"window": window}
        info["unigram_perplexity"] = unigram_perplexity(examples["train"][1], examples, tokenizer.vocab_size)
        return TaskData(
            name=self.name, kind="classify",
            train_inputs=examples["train"][0], train_targets=examples["train"][1],
            valid_inputs=examples["valid"][0], valid_targets=examples["valid"][1],
            test_inputs=examples["test"][0], test_targets=examples["test"][1],
            vocab_size=tokenizer.vocab_size, num_classes=tokenizer.vocab_size, info=info,
        )  # fmt: skip

    def windows(self, split: str, encoded: Encoded, window: int) -> tuple[Tensor, Tensor]:
        """Inputs [N, window] and labels [N] of one split; ValueError if no line is longer than ``window``."""
        starts = window_starts(encoded, window)
        if starts.size == 0:
            longest = int(encoded.line_lengths.max())
            raise ValueError(
                f"{self.name}: window {window} is not shorter than any line of the {split} split "
                f"(longest {longest} tokens); use a smaller window"
            )
        starts = starts[self.subset(split, starts.size)]
        ids = encoded.ids.astype(np.int64)
        inputs = ids[starts[:, None] + np.arange(window)]  # [N, window]
        return torch.from_numpy(inputs), torch.from_numpy(ids[starts + window])


def window_starts(encoded: Encoded, window: int) -> np.ndarray:
    """Start offsets of every stride-1 window of ``window`` tokens (plus one target) inside a line: [N] int64."""
    counts = np.maximum(encoded.line_lengths - window, 0)  # windows per line
    line_starts = np.repeat(encoded.offsets[:-1], counts)
    first_of_line = np.repeat(np.cumsum(counts) - counts, counts)
    return line_starts + np.arange(int(counts.sum())) - first_of_line


def unigram_perplexity(train_targets: Tensor, examples: dict[str, tuple[Tensor, Tensor]], vocab_size: int) -> dict[str, float]:
    """Perplexity of an add-one unigram model of the training targets on each held-out split's targets:
    the number a trained model has to beat."""
    counts = np.bincount(train_targets[train_targets >= 0].numpy(), minlength=vocab_size) + 1
    log_prob = np.log(counts / counts.sum())
    out = {}
    for name in ("valid", "test"):
        targets = examples[name][1]
        scored = targets[targets >= 0].numpy()
        out[name] = perplexity(float(-log_prob[scored].mean()))
    return out
