"""``ModelConfig``: the typed shape of an encoder or decoder, shared by both models and the trainer."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from sparsefocus.attention import parse_pattern
from sparsefocus.attention.patterns import Pattern

ACTIVATIONS = ("relu", "gelu", "mish")
POSITIONS = ("sinusoidal", "learned")
POOLINGS = ("mean", "cls")
GLOBAL_TOKEN_PLACES = ("prepend", "append_paper")


@dataclass
class ModelConfig:
    """Architecture of a transformer encoder (classification) or causal decoder (next token).

    Args:
        blocks: number of transformer blocks. Default: 2.
        heads: attention heads per block. Default: 1.
        dim: model width d. Default: 64.
        mlp_dim: hidden width of the MLP. Default: 64.
        activation: "relu", "gelu" or "mish". Default: "relu".
        dropout: dropout on embeddings, attention output, MLP and residuals. Default: 0.01.
        positions: "sinusoidal" or "learned". Default: "sinusoidal".
        pooling: "mean" or "cls" (encoder only). Default: "mean".
        head_dim: width of each head; None = dim // heads (paper_mode forces dim). Default: None.
        impl: attention implementation passed to ``sparse_attention``. Default: "auto".
        paper_mode: reproduce the Semantic Focus code's quirks (see ``docs/readme/laboratory.md``).
            Default: False.
        tie_embeddings: the decoder's output head reuses the token embedding matrix (GPT-2,
            Zoology); ignored by the encoder. Recall tasks with large vocabularies (MQAR, V=8192)
            need it: an untied head must learn each of the V/2 value rows separately. Default: False.
        init_std: > 0 draws every Linear and Embedding weight from N(0, init_std) and zeroes the
            biases (GPT-2, Zoology: 0.02; needed with tied embeddings, whose torch default N(0, 1)
            would give logits of size sqrt(dim)); 0 keeps torch's default init. Default: 0.
        global_tokens: where the encoder puts a pattern's g global tokens. "prepend": before the
            sequence, and BAND/BLOC windows and blocks run over every position; "append_paper":
            after the (padded) sequence, windows and blocks over the regular tokens only (the
            Semantic Focus code; BAND, BLOC, global and longformer patterns; no CLS token).
            Default: "prepend".
        pad_to_multiple_of_k: the encoder right-pads every input with the pad id to a multiple of
            its mechanism's k (any pattern with a field ``k``: TOPK, BAND, BLOC...), before any
            global token, as the Semantic Focus code does (L=40 becomes 45 for k=9; in paper_mode
            those PAD tokens are attended and pooled). Default: False.
    """

    blocks: int = 2
    heads: int = 1
    dim: int = 64
    mlp_dim: int = 64
    activation: str = "relu"
    dropout: float = 0.01
    positions: str = "sinusoidal"
    pooling: str = "mean"
    head_dim: int | None = None
    impl: str = "auto"
    paper_mode: bool = False
    tie_embeddings: bool = False
    init_std: float = 0.0
    global_tokens: str = "prepend"
    pad_to_multiple_of_k: bool = False

    def validate(self) -> None:
        """Raise ValueError naming the first bad field."""
        for name in ("blocks", "heads", "dim", "mlp_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"model.activation must be one of {', '.join(ACTIVATIONS)}, got {self.activation!r}")
        if self.positions not in POSITIONS:
            raise ValueError(f"model.positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        if self.pooling not in POOLINGS:
            raise ValueError(f"model.pooling must be one of {', '.join(POOLINGS)}, got {self.pooling!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"model.dropout must be in [0, 1), got {self.dropout}")
        if self.head_dim is None and not self.paper_mode and self.dim % self.heads:
            raise ValueError(f"model.heads ({self.heads}) must divide model.dim ({self.dim}) unless model.head_dim is set")
        if not self.init_std >= 0:
            raise ValueError(f"model.init_std must be >= 0, got {self.init_std}")
        if self.head_dim is not None and self.head_dim < 1:
            raise ValueError(f"model.head_dim must be >= 1, got {self.head_dim}")
        if self.global_tokens not in GLOBAL_TOKEN_PLACES:
            raise ValueError(f"model.global_tokens must be one of {', '.join(GLOBAL_TOKEN_PLACES)}, got {self.global_tokens!r}")

    def resolved_head_dim(self) -> int:
        """Per-head width: the paper's code gives every head the full width d."""
        if self.paper_mode:
            return self.dim
        return self.head_dim if self.head_dim is not None else self.dim // self.heads


def block_patterns(mechanism: "str | Pattern | list | tuple", blocks: int) -> list[Pattern]:
    """One parsed pattern per block from a single spec or a per-block list of ``blocks`` specs."""
    if isinstance(mechanism, (list, tuple)):
        if len(mechanism) != blocks:
            raise ValueError(f"a per-block mechanism list needs {blocks} patterns (model.blocks), got {len(mechanism)}")
        return [parse_pattern(spec) for spec in mechanism]
    return [parse_pattern(mechanism)] * blocks


def place_global_tokens(patterns: list[Pattern], global_tokens: str) -> list[Pattern]:
    """The patterns with their global tokens where ``model.global_tokens`` puts them: unchanged for
    "prepend"; for "append_paper" each pattern with g > 0 gets ``globals_at="end"`` (its windows or
    blocks then run over the regular tokens only). ValueError naming the pattern that cannot."""
    with_globals = [p for p in patterns if p.num_global_tokens]
    if global_tokens == "prepend":
        for pattern in with_globals:
            if getattr(pattern, "globals_at", "start") != "start":
                raise ValueError(
                    f"{pattern} puts its global tokens at the end but model.global_tokens is 'prepend'; "
                    f"set model.global_tokens=append_paper"
                )
        return patterns
    if len({p.num_global_tokens for p in patterns}) > 1:
        counts = ", ".join(str(p.num_global_tokens) for p in patterns)
        raise ValueError(f"model.global_tokens=append_paper needs the same number of global tokens in every block, got {counts}")
    for pattern in with_globals:
        if not hasattr(pattern, "globals_at"):
            raise ValueError(
                f"model.global_tokens=append_paper: {pattern.label()} cannot put its global tokens at the end "
                f"(BAND, BLOC, global and longformer can)"
            )
    # Every pattern with globals has the field (hasattr above), which mypy cannot see on Pattern.
    return [dataclasses.replace(p, globals_at="end") if p.num_global_tokens else p for p in patterns]  # type: ignore[call-arg]


def padding_multiple(patterns: list[Pattern]) -> int:
    """The length the Semantic Focus code pads to a multiple of: the patterns' k (the least common
    multiple if blocks differ); 1 when no pattern has a field ``k`` (FULL)."""
    ks = [k for k in (getattr(p, "k", None) for p in patterns) if isinstance(k, int) and k >= 1]
    return math.lcm(*ks) if ks else 1


def padded_length(length: int, multiple: int) -> int:
    """``length`` rounded up to a multiple of ``multiple`` (40 -> 45 for 9)."""
    return -(-length // multiple) * multiple


def mechanism_label(mechanism: "str | Pattern | list | tuple") -> str:
    """Short label: ``TOPK:5``; a per-block list joins its labels with '+' (``FULL+TOPK:5``)."""
    if isinstance(mechanism, (list, tuple)):
        return "+".join(parse_pattern(spec).label() for spec in mechanism)
    return parse_pattern(mechanism).label()
