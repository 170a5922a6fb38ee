"""Patterns are data: one frozen dataclass per mechanism, a registry and a string parser.

A pattern spec says *which* (query, key) pairs a mechanism keeps and how it weighs them; the
mechanism's file gives it a reference (the definition), a memory-lean path and, where one exists,
a Triton path. ``parse_pattern`` accepts the Semantic Focus paper's notation (``FULL``,
``TOPK:5``, ``BAND:5(1)``, ``BLOC:9(3)``) and a keyword form (``band:k=5,g=1``,
``zeta:k=32,dk=3``).
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

from sparsefocus.attention.common import (
    apply_key_padding,
    chunked_rows,
    dense_masked_attention,
    drop_padded_keys,
    expand_kv,
    indexed_attention_ref,
    mask_from_indices,
    row_slice,
)

PATTERNS: dict[str, type["Pattern"]] = {}
HIDDEN_KEY = "hidden"  # params entry: the layer's input x [B, N, dim], for patterns with needs_hidden
AUX_KEY = "aux_losses"  # params entry: a dict the mechanism fills with named auxiliary losses
RUNS_KEY = "runs"  # params entry (int): the batch holds that many runs' equal slices (folds_params)
_ALIASES: dict[str, str] = {}


def register(cls: type["Pattern"]) -> type["Pattern"]:
    """Class decorator: add a pattern class to the registry under ``cls.name`` and its aliases."""
    key = cls.name.lower()
    if key in PATTERNS or key in _ALIASES:
        raise ValueError(f"pattern name {cls.name!r} is registered twice")
    PATTERNS[key] = cls
    for alias in cls.aliases:
        _ALIASES[alias.lower()] = key
    # Read by the string parser: plain class attributes, so that torch.compile can trace a parse
    # (dataclasses.fields and typing.get_type_hints are not traceable).
    cls._field_names = tuple(f.name for f in dataclasses.fields(cls))  # type: ignore[attr-defined]
    cls._field_kinds = typing.get_type_hints(cls)  # type: ignore[attr-defined]
    return cls


@dataclass(frozen=True)
class Pattern:
    """Base spec of a sparse-attention mechanism.

    Subclasses are frozen dataclasses whose fields are the mechanism's parameters. They set the
    class variables below and implement ``row_mask`` (which keys each query keeps) and, where the
    mechanism is not "softmax over the kept keys", ``reference``.
    """

    name: ClassVar[str] = ""
    aliases: ClassVar[tuple[str, ...]] = ()
    positional: ClassVar[tuple[str, ...]] = ()
    field_aliases: ClassVar[dict[str, str]] = {}
    input_dependent: ClassVar[bool] = False
    family: ClassVar[str] = ""
    cost: ClassVar[tuple[str, str]] = ("O(N^2 D)", "O(N^2)")
    impls: ClassVar[tuple[str, ...]] = ("reference", "lean")
    needs_square: ClassVar[bool] = True
    examples: ClassVar[tuple[str, ...]] = ()
    # How a row's weights are normalised; only "softmax" has a log-sum-exp (return_lse).
    normaliser: ClassVar[str] = "softmax"
    # Causal with N < M (attention/decode.py): "rows" computes only the last N rows through
    # row_mask, "replay" runs the square call and keeps them, "none" refuses.
    decoding: ClassVar[str] = "rows"
    # Mechanisms that read the layer's input x get it as params[HIDDEN_KEY] ([B, N, dim]).
    needs_hidden: ClassVar[bool] = False
    # False: the non-Triton paths receive k, v with their own Hk heads (the mechanism handles GQA).
    expands_kv: ClassVar[bool] = True
    # True: the mechanism writes named auxiliary losses into params[AUX_KEY] (a dict the caller passes).
    has_aux_loss: ClassVar[bool] = False
    # True (with folds_params): each parameter may also come once per group of batch rows, [G, ...]
    # with G dividing B (``common.grouped_linear``), so folded runs pass theirs [R, ...] unrepeated.
    run_params: ClassVar[bool] = False

    @property
    def folds_params(self) -> bool:
        """Whether the mechanism also takes its parameters per batch row, each [B, ...] (several
        models' runs folded into one batch, each row with its run's parameters), and with
        params[RUNS_KEY] = R makes each auxiliary loss the sum of its value over the batch's R
        equal slices. Without it, folded runs call the mechanism once per run."""
        return False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check the parameters alone; raise ValueError naming the bad one."""

    def check_sizes(self, n_queries: int, n_keys: int, causal: bool) -> None:
        """Check the parameters against the sequence lengths; raise ValueError naming the problem."""
        if (self.needs_square or causal) and n_queries != n_keys:
            raise ValueError(
                f"pattern {self} with causal={causal} needs as many queries as keys, got {n_queries} queries and {n_keys} keys"
            )

    @property
    def num_global_tokens(self) -> int:
        """Number of leading positions that attend everywhere and are attended by all."""
        return int(getattr(self, "g", 0))

    def triton_decodes(self) -> bool:
        """True when ``triton_decode`` computes a decoding call's (causal, N < M) N rows in Triton;
        False (the default): the Triton path of a decoding call replays the square call."""
        return False

    def triton_decode(
        self, q: Tensor, k: Tensor, v: Tensor, *, scale: float, key_padding_mask: Tensor | None, params: dict[str, Tensor] | None
    ) -> Tensor:
        """The last N rows of the causal call over M keys, q [B, Hq, N, D], k, v [B, Hk, M, *] (not
        expanded) -> [B, Hq, N, Dv]; only where ``triton_decodes()``."""
        raise NotImplementedError(f"pattern {self.name} has no Triton decoding rows")

    def recent_keys(self) -> int | None:
        """W when a causal row reads only the W most recent positions (its own included), so that a
        KV cache needs only the last W - 1 of them; None (the default): a row may read any key."""
        return None

    def packed_runs(self, local: Tensor, length: Tensor, causal: bool) -> tuple[Tensor, Tensor] | None:
        """Each position's kept keys as one run of its own document, for packed batches on the
        run kernel (attention/varlen.py): local [T] positions within their documents, length [T]
        their documents' lengths -> (first [T], count [T]) document-local keys first..first+count-1
        (0 <= first, first + count <= length; causality is cut by the kernel). None (the default):
        the mechanism's rows are not single runs, and a packed batch runs document by document."""
        return None

    def qk_dim(self, head_dim: int) -> int:
        """Width of the per-head query/key vectors a layer should produce. Default: head_dim."""
        return head_dim

    def make_parameters(self, num_heads: int) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters the mechanism owns (e.g. ZETA's gamma, a gate). Default: none."""
        return {}

    def make_layer_parameters(
        self, dim: int, num_heads: int, kv_heads: int, qk_dim: int, v_dim: int
    ) -> dict[str, torch.nn.Parameter]:
        """Trainable parameters for a layer of this shape (a gate on x, a compression MLP...).
        Default: ``make_parameters(num_heads)``."""
        return self.make_parameters(num_heads)

    def row_mask(
        self,
        q: Tensor,
        k: Tensor,
        rows: slice,
        causal: bool,
        key_padding_mask: Tensor | None = None,
        params: dict[str, Tensor] | None = None,
    ) -> Tensor:
        """Boolean mask of kept keys for the queries ``rows``.

        Args:
            q: [B, H, N, D] queries (GQA already expanded), k: [B, H, M, D] keys.
            rows: the slice of query positions to compute.
            key_padding_mask: [B, M] bool, True = real key. Input-dependent selections must not
                pick padded keys; the caller also ANDs it in afterwards.
        Returns:
            [B or 1, H or 1, len(rows), M] bool; True = the pair is kept. Causality is applied here.
        """
        raise NotImplementedError(f"{type(self).__name__} must define row_mask")

    def full_mask(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None, params: dict | None) -> Tensor:
        """[B, H, N, M] bool mask of kept pairs (row_mask over all rows, padding applied)."""
        mask = self.row_mask(q, k, row_slice(q.shape[-2]), causal, key_padding_mask, params)
        mask = mask.expand(q.shape[0], q.shape[1], q.shape[-2], k.shape[-2])
        return apply_key_padding(mask, key_padding_mask)

    def reference(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        key_padding_mask: Tensor | None,
        params: dict[str, Tensor] | None,
    ) -> Tensor:
        """The definition: softmax over the kept keys, with an explicit dense mask, in fp32.

        q: [B, H, N, D]; k: [B, H, M, D]; v: [B, H, M, Dv] (GQA already expanded). Returns
        [B, H, N, Dv] fp32.
        """
        mask = self.full_mask(q, k, causal, key_padding_mask, params)
        return dense_masked_attention(q, k, v, mask, scale)

    def lean(
        self,
        q: Tensor,
        k: Tensor,
        v: Tensor,
        *,
        causal: bool,
        scale: float,
        key_padding_mask: Tensor | None,
        params: dict[str, Tensor] | None,
    ) -> Tensor:
        """Same result as ``reference`` without an N x M tensor: query chunks, recomputed in backward."""

        def one_chunk(rows: slice) -> Tensor:
            mask = apply_key_padding(self.row_mask(q, k, rows, causal, key_padding_mask, params), key_padding_mask)
            return dense_masked_attention(q[:, :, rows], k, v, mask, scale)

        return chunked_rows(one_chunk, q.shape[-2])

    def __str__(self) -> str:
        values = ",".join(f"{f.name}={getattr(self, f.name)}" for f in dataclasses.fields(self))
        return f"{self.name}:{values}" if values else self.name

    def label(self) -> str:
        """Short human label, in the paper's notation where it has one (``BAND:5(1)``)."""
        return str(self)


def list_patterns() -> list[str]:
    """Names of every registered pattern, sorted."""
    return sorted(PATTERNS)


def pattern_class(name: str) -> type[Pattern]:
    """Look a pattern class up by name or alias (case-insensitive)."""
    key = name.strip().lower()
    key = _ALIASES.get(key, key)
    if key not in PATTERNS:
        raise ValueError(f"unknown pattern {name!r}; valid patterns: {', '.join(list_patterns())}")
    return PATTERNS[key]


def _positional_group(item: str) -> list[str]:
    """'5(1)' -> ['5', '1'] (a value and its group count); anything else -> [item]. String
    methods rather than a regex, so that torch.compile traces it."""
    head, bracket, tail = item.partition("(")
    if not bracket or not tail.endswith(")"):
        return [item]
    head, tail = head.strip(), tail[:-1].strip()
    if not head or not tail or any(c in head + tail for c in "() \t"):
        return [item]
    return [head, tail]


def _split_values(body: str) -> list[str]:
    """Split 'a,b=c' at commas that are not inside brackets."""
    parts, depth, current = [], 0, ""
    for char in body:
        depth += char == "("
        depth -= char == ")"
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += char
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _convert(cls: type[Pattern], field_name: str, raw: str) -> Any:
    """Turn the text of one parameter into its field's type (int, float, str or bool)."""
    kind = cls._field_kinds[field_name]  # type: ignore[attr-defined]
    try:
        if kind is bool:
            if raw.lower() not in ("true", "false", "1", "0"):
                raise ValueError
            return raw.lower() in ("true", "1")
        return kind(raw)
    except (ValueError, TypeError):
        raise ValueError(f"pattern {cls.name}: parameter {field_name!r} must be {kind.__name__}, got {raw!r}") from None


def _parse_body(cls: type[Pattern], body: str) -> dict[str, Any]:
    names = cls._field_names  # type: ignore[attr-defined]
    positional = list(cls.positional)
    values: dict[str, Any] = {}
    for item in _split_values(body):
        if "=" in item:
            key, raw = (s.strip() for s in item.split("=", 1))
            key = cls.field_aliases.get(key, key)
            if key not in names:
                raise ValueError(f"pattern {cls.name} has no parameter {key!r}; valid parameters: {', '.join(names) or 'none'}")
            values[key] = _convert(cls, key, raw)
            continue
        for raw in _positional_group(item):
            if not positional:
                raise ValueError(
                    f"pattern {cls.name}: too many positional values in {body!r}; "
                    f"positional parameters: {', '.join(cls.positional) or 'none'}"
                )
            key = positional.pop(0)
            values[key] = _convert(cls, key, raw)
    return values


def parse_pattern(spec: "str | Pattern") -> Pattern:
    """Turn a string (or an existing spec) into a pattern spec.

    Accepts ``FULL``, ``TOPK:5``, ``BAND:5(1)`` (k=5, g=1), ``BLOC:9(3)``, and keyword forms
    ``topk:k=5``, ``band:k=5,g=1``, ``zeta:k=32,dk=3``. Names are case-insensitive.

    Raises:
        ValueError: unknown name (listing the valid ones) or a bad parameter (naming it).
    """
    if isinstance(spec, Pattern):
        return spec
    if not isinstance(spec, str):
        raise ValueError(f"a pattern must be a string or a Pattern, got {type(spec).__name__}")
    name, _, body = spec.partition(":")
    cls = pattern_class(name)
    values = _parse_body(cls, body)
    try:
        return cls(**values)
    except TypeError as error:
        required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING]
        raise ValueError(f"pattern {cls.name}: {error}; required parameters: {', '.join(required)}") from None


def require(condition: bool, message: str) -> None:
    """Raise ValueError(message) unless condition holds. For parameter validation."""
    if not condition:
        raise ValueError(message)


@dataclass(frozen=True)
class IndexedPattern(Pattern):
    """A mechanism that can list, for every query, the keys it keeps.

    Subclasses implement ``key_indices``. The memory-lean path gathers the listed keys
    (O(N K) memory) and the Triton path feeds the same lists to the indexed-attention kernel.
    The first ``num_global_tokens`` query rows attend to every allowed key and are computed
    densely (they are only g rows).
    """

    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")
    score: ClassVar[str] = "dot"

    def key_indices(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None, params: dict | None) -> Tensor:
        """[B or 1, H or 1, N, K] int key positions per query, -1 for unused slots.

        q: [B, Hq, N, D]; k: [B, Hk, M, D]. Causality and padding must already be applied, except
        that ``drop_padded_keys`` is applied again by the caller.
        """
        raise NotImplementedError(f"{type(self).__name__} must define key_indices")

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        index = self.key_indices(q, k, causal, key_padding_mask, params)
        mask = mask_from_indices(index[:, :, rows], k.shape[-2])
        return self._with_global_rows(mask, rows, k.shape[-2], causal)

    def _with_global_rows(self, mask: Tensor, rows: slice, n_keys: int, causal: bool) -> Tensor:
        """Give the first g query rows every (causally allowed) key."""
        g = self.num_global_tokens
        if g == 0:
            return mask
        query_pos = torch.arange(rows.start, rows.stop, device=mask.device)[:, None]
        key_pos = torch.arange(n_keys, device=mask.device)[None, :]
        global_rows = (query_pos < g) & ((key_pos <= query_pos) if causal else True)
        return mask | global_rows

    def indices(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None, params: dict | None) -> Tensor:
        """Key lists broadcast to [B, Hq, N, K], padding dropped, as int32."""
        index = self.key_indices(q, k, causal, key_padding_mask, params)
        index = index.expand(q.shape[0], q.shape[1], q.shape[2], index.shape[-1])
        return drop_padded_keys(index, key_padding_mask).to(torch.int32)

    def _attend(self, q, k, v, index, scale, params, kernel) -> Tensor:
        gamma = None if params is None else params.get("gamma")
        return kernel(q, k, v, index, scale=scale, score=self.score, gamma=gamma)

    def _global_rows_dense(self, q, k, v, out, causal, scale, key_padding_mask) -> Tensor:
        g = min(self.num_global_tokens, q.shape[-2])
        if g == 0:
            return out
        rows = row_slice(q.shape[-2], 0, g)
        mask = torch.ones(g, k.shape[-2], dtype=torch.bool, device=q.device)
        if causal:
            mask = torch.arange(k.shape[-2], device=q.device)[None, :] <= torch.arange(g, device=q.device)[:, None]
        mask = apply_key_padding(mask[None, None], key_padding_mask)
        head = dense_masked_attention(q[:, :, rows], expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), mask, scale)
        return torch.cat([head.to(out.dtype), out[:, :, g:]], dim=2)

    def lean(self, q, k, v, *, causal, scale, key_padding_mask, params):
        index = self.indices(q, k, causal, key_padding_mask, params)
        out = self._attend(q, k, v, index, scale, params, indexed_attention_ref)
        return self._global_rows_dense(q, k, v, out, causal, scale, key_padding_mask)

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from sparsefocus.kernels.indexed import indexed_attention

        index = self.indices(q, k, causal, key_padding_mask, params)
        out = self._attend(q, k, v, index, scale, params, indexed_attention)
        return self._global_rows_dense(q, k, v, out, causal, scale, key_padding_mask)
