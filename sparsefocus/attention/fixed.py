"""Input-agnostic patterns: which keys a query keeps depends only on positions.

Each pattern lists its keys per query (``key_indices``, for the gather path and the Triton
kernel) and states the same rule as a FlexAttention ``mask_mod`` (for the ``flex`` path). The
dense reference is built from ``mask_mod`` evaluated on every pair, so the two statements are
checked against each other by the tests.

Here: BAND, BLOC, global tokens, the Sparse Transformer's strided and fixed patterns, a dilated
window, seeded random keys, BigBird (window + global + random) and Longformer (window + global).

Global tokens sit at the start of the sequence by default (``globals_at="start"``: positions
0..g-1, and windows and blocks run over every position). ``globals_at="end"`` is the Semantic
Focus code's layout: the g global tokens are the LAST g positions and BAND's windows and BLOC's
blocks run over the N - g regular positions only (``band:k=5,g=1,globals_at=end``; non-causal).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, ClassVar

import torch
from torch import Tensor

from sparsefocus.attention.common import (
    apply_key_padding,
    dense_masked_attention,
    expand_kv,
    mask_from_indices,
    row_slice,
)
from sparsefocus.attention.patterns import PATTERNS, IndexedPattern, register, require

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


@lru_cache(maxsize=1)
def _compiled_flex_attention():
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention, dynamic=False)


def flex_attention_fn(device: torch.device):
    """FlexAttention: compiled on CUDA, eager (unfused, for tests) elsewhere."""
    from torch.nn.attention.flex_attention import flex_attention

    return _compiled_flex_attention() if device.type == "cuda" else flex_attention


def with_causal_and_padding(mask_mod: MaskMod, causal: bool, key_padding_mask: Tensor | None) -> MaskMod:
    """AND a causal rule and a [B, M] key padding mask into a mask_mod."""

    def combined(b, h, q_idx, kv_idx):
        keep = mask_mod(b, h, q_idx, kv_idx)
        if causal:
            keep = keep & (kv_idx <= q_idx)
        if key_padding_mask is not None:
            keep = keep & key_padding_mask[b, kv_idx]
        return keep

    return combined


GLOBAL_PLACES = ("start", "end")


def with_global_tokens(mask_mod: MaskMod, num_global: int, globals_at: str = "start", n_tokens: int = 0) -> MaskMod:
    """OR in g global tokens: their rows and columns are all kept. They are positions 0..g-1
    (``globals_at="start"``) or the last g of ``n_tokens`` positions (``"end"``)."""
    if num_global == 0:
        return mask_mod
    if globals_at == "end":
        first = n_tokens - num_global

        def appended(b, h, q_idx, kv_idx):
            return mask_mod(b, h, q_idx, kv_idx) | (q_idx >= first) | (kv_idx >= first)

        return appended

    def combined(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_idx, kv_idx) | (q_idx < num_global) | (kv_idx < num_global)

    return combined


def append_global_columns(index: Tensor, num_global: int, globals_at: str = "start", n_keys: int = 0) -> Tensor:
    """Add the g global key columns (0..g-1, or the last g of ``n_keys`` when ``globals_at="end"``)
    to every row of [1, 1, N, K] lists, dropping repeats -> [1, 1, N, K+g]."""
    if num_global == 0:
        return index
    n_queries = index.shape[-2]
    first = n_keys - num_global if globals_at == "end" else 0
    globals_ = torch.arange(first, first + num_global, device=index.device).expand(1, 1, n_queries, num_global)
    repeats = index >= first if globals_at == "end" else index < num_global
    local = torch.where(repeats, torch.full_like(index, -1), index)
    return torch.cat([local, globals_.to(index.dtype)], dim=-1)


def _with_unused_rows(index: Tensor, count: int) -> Tensor:
    """[1, 1, N, K] key lists -> [1, 1, N + count, K], the new last rows all -1 (unused)."""
    unused = torch.full((*index.shape[:-2], count, index.shape[-1]), -1, dtype=index.dtype, device=index.device)
    return torch.cat([index, unused], dim=-2)


@dataclass(frozen=True)
class FixedPattern(IndexedPattern):
    """Base of position-only patterns: key lists, a mask_mod and a FlexAttention path."""

    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton", "flex")
    family: ClassVar[str] = "input-agnostic"

    def mask_mod(self, n_queries: int, n_keys: int, causal: bool) -> MaskMod:
        """FlexAttention-style rule ``(b, h, q_idx, kv_idx) -> bool``, global tokens included.

        ``causal`` is passed because some rules change shape under causality (BAND keeps the k
        most recent keys); the j <= i cut itself is added by the caller."""
        raise NotImplementedError(f"{type(self).__name__} must define mask_mod")

    def position_indices(self, n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
        """[1, 1, N, K] key lists without global tokens; -1 = unused."""
        raise NotImplementedError(f"{type(self).__name__} must define position_indices")

    def device_mask_mod(self, n_queries: int, n_keys: int, causal: bool, device: torch.device) -> MaskMod:
        """``mask_mod`` whose captured tensors (if any) live on ``device``. Default: ``mask_mod``."""
        return self.mask_mod(n_queries, n_keys, causal)

    @property
    def globals_last(self) -> bool:
        """True when the global tokens are the last g positions (the Semantic Focus code's layout)."""
        return getattr(self, "globals_at", "start") == "end"

    def regular_count(self, n: int) -> int:
        """Positions that windows and blocks run over: all n, or n - g when the globals come last."""
        return n - min(self.num_global_tokens, n) if self.globals_last else n

    def check_globals_at(self) -> None:
        """``validate`` helper for the patterns with a ``globals_at`` field."""
        place = getattr(self, "globals_at", "start")
        require(place in GLOBAL_PLACES, f"{self.name}: globals_at must be one of {', '.join(GLOBAL_PLACES)}, got {place!r}")

    def check_sizes(self, n_queries: int, n_keys: int, causal: bool) -> None:
        super().check_sizes(n_queries, n_keys, causal)
        if self.globals_last and self.num_global_tokens and causal:
            raise ValueError(
                f"pattern {self}: global tokens at the end attend to every position, so globals_at=end cannot be causal"
            )

    def key_indices(self, q, k, causal, key_padding_mask, params):
        n_queries, n_keys = q.shape[-2], k.shape[-2]
        num_global = min(self.num_global_tokens, n_keys)
        if self.globals_last and num_global:
            regular = self.position_indices(n_queries - num_global, n_keys - num_global, causal, q.device)
            index = _with_unused_rows(regular, num_global)  # the global rows are computed densely
            return append_global_columns(index, num_global, "end", n_keys)
        index = self.position_indices(n_queries, n_keys, causal, q.device)
        index = append_global_columns(index, num_global)
        if causal:
            query_pos = torch.arange(n_queries, device=q.device)[:, None]
            index = torch.where(index > query_pos, torch.full_like(index, -1), index)
        return index

    def _global_rows_dense(self, q, k, v, out, causal, scale, key_padding_mask):
        """With the globals last, their g query rows (the last g) attend to every key."""
        if not self.globals_last:
            return super()._global_rows_dense(q, k, v, out, causal, scale, key_padding_mask)
        n_queries = q.shape[-2]
        num_global = min(self.num_global_tokens, n_queries)
        if num_global == 0:
            return out
        rows = row_slice(n_queries, n_queries - num_global)
        mask = apply_key_padding(torch.ones(1, 1, num_global, k.shape[-2], dtype=torch.bool, device=q.device), key_padding_mask)
        head = dense_masked_attention(q[:, :, rows], expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]), mask, scale)
        return torch.cat([out[:, :, : rows.start], head.to(out.dtype)], dim=2)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        rule = self.device_mask_mod(q.shape[-2], k.shape[-2], causal, q.device)
        rule = with_causal_and_padding(rule, causal, None)
        query_pos = torch.arange(rows.start, rows.stop, device=q.device)[:, None]
        key_pos = torch.arange(k.shape[-2], device=q.device)[None, :]
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        return rule(zero, zero, query_pos, key_pos)[None, None]

    def flex(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from torch.nn.attention.flex_attention import create_block_mask

        n_queries, n_keys = q.shape[-2], k.shape[-2]
        rule = self.device_mask_mod(n_queries, n_keys, causal, q.device)
        rule = with_causal_and_padding(rule, causal, key_padding_mask)
        batch = None if key_padding_mask is None else q.shape[0]
        block_mask = create_block_mask(rule, batch, None, n_queries, n_keys, device=q.device)
        attend = flex_attention_fn(q.device)
        return attend(q, k, v, block_mask=block_mask, scale=scale)


@register
@dataclass(frozen=True)
class Band(FixedPattern):
    """``BAND:k(g)``: exactly k keys per query, floor((k-1)/2) to the left and the rest to the right,
    the window shifted at the edges so every row keeps k keys; causal: the k most recent keys
    including itself. g global tokens are added: the first g positions (``globals_at="start"``,
    windows over every position), or the last g with the windows over the N - g regular positions
    (``globals_at="end"``, the Semantic Focus code)."""

    k: int
    g: int = 0
    globals_at: str = "start"
    examples: ClassVar[tuple[str, ...]] = ("BAND:5(1)", "band:k=4", "BAND:1")
    name: ClassVar[str] = "band"
    aliases: ClassVar[tuple[str, ...]] = ("windowed", "sliding_window")
    positional: ClassVar[tuple[str, ...]] = ("k", "g")
    cost: ClassVar[tuple[str, str]] = ("O(N (k+g) D)", "O(N (k+g))")

    def validate(self) -> None:
        require(self.k >= 1, f"band: k must be >= 1, got {self.k}")
        require(self.g >= 0, f"band: g must be >= 0, got {self.g}")
        self.check_globals_at()

    def _left(self) -> int:
        return (self.k - 1) // 2

    def mask_mod(self, n_queries, n_keys, causal):
        regular = self.regular_count(n_keys)
        width, left = min(self.k, regular), self._left()

        def band(b, h, q_idx, kv_idx):
            start = torch.clamp(q_idx - left, 0, regular - width)
            return (kv_idx >= start) & (kv_idx < start + width)

        def recent(b, h, q_idx, kv_idx):
            return (q_idx - kv_idx < self.k) & (kv_idx <= q_idx)

        return with_global_tokens(recent if causal else band, self.g, self.globals_at, n_keys)

    def position_indices(self, n_queries, n_keys, causal, device):
        query_pos = torch.arange(n_queries, device=device)[:, None]
        width = min(self.k, n_keys)
        if causal:
            index = query_pos - self.k + 1 + torch.arange(self.k, device=device)[None, :]
            return torch.where(index < 0, torch.full_like(index, -1), index)[None, None]
        start = torch.clamp(query_pos - self._left(), 0, n_keys - width)
        return (start + torch.arange(width, device=device)[None, :])[None, None]

    def recent_keys(self) -> int | None:
        """Causal: the k most recent keys, unless global tokens (the first positions) are kept too."""
        return None if self.g else self.k

    def packed_runs(self, local, length, causal):
        """``position_indices``' run within each document, without global tokens."""
        if self.g:
            return None
        if causal:  # the k most recent keys, cut at the document's start
            first = (local - self.k + 1).clamp_min(0)
            return first, local - first + 1
        width = length.clamp_max(self.k)
        return torch.minimum((local - self._left()).clamp_min(0), length - width), width

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        """Without global tokens or padding every row is one contiguous run of keys, so the
        tensor-core run kernel replaces the per-row gathers of the indexed kernel."""
        if self.g or key_padding_mask is not None:
            return super().triton(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params)
        from sparsefocus.kernels.runs import run_attention

        if causal:  # the k most recent keys from i - k + 1; the kernel clips the run at 0 and at the query
            return run_attention(q, k, v, 1 - self.k, self.k, scale=scale, causal=True)
        query_pos = torch.arange(q.shape[-2], device=q.device)
        width = min(self.k, k.shape[-2])
        start = torch.clamp(query_pos - self._left(), 0, k.shape[-2] - width)  # [N], as position_indices
        return run_attention(q, k, v, start[None, None], width, scale=scale)

    def label(self) -> str:
        return f"BAND:{self.k}({self.g})" if self.g else f"BAND:{self.k}"


@register
@dataclass(frozen=True)
class Bloc(FixedPattern):
    """``BLOC:k(g)``: non-overlapping diagonal blocks of size k (the last may be shorter); a query
    keeps the keys of its own block (causal: those up to itself) plus g global tokens: the first g
    positions (``globals_at="start"``, blocks over every position) or the last g with the blocks
    over the N - g regular positions (``globals_at="end"``, the Semantic Focus code)."""

    k: int
    g: int = 0
    globals_at: str = "start"
    examples: ClassVar[tuple[str, ...]] = ("BLOC:9(3)", "bloc:k=4")
    name: ClassVar[str] = "bloc"
    aliases: ClassVar[tuple[str, ...]] = ("blklocal", "block_local")
    positional: ClassVar[tuple[str, ...]] = ("k", "g")
    cost: ClassVar[tuple[str, str]] = ("O(N (k+g) D)", "O(N (k+g))")

    def validate(self) -> None:
        require(self.k >= 1, f"bloc: k must be >= 1, got {self.k}")
        require(self.g >= 0, f"bloc: g must be >= 0, got {self.g}")
        self.check_globals_at()

    def mask_mod(self, n_queries, n_keys, causal):
        regular = self.regular_count(n_keys)

        def block(b, h, q_idx, kv_idx):
            return ((q_idx // self.k) == (kv_idx // self.k)) & (kv_idx < regular)

        return with_global_tokens(block, self.g, self.globals_at, n_keys)

    def position_indices(self, n_queries, n_keys, causal, device):
        query_pos = torch.arange(n_queries, device=device)[:, None]
        index = (query_pos // self.k) * self.k + torch.arange(self.k, device=device)[None, :]
        return torch.where(index >= n_keys, torch.full_like(index, -1), index)[None, None]

    def packed_runs(self, local, length, causal):
        """The query's block within its document (the last one may be shorter), without global
        tokens; causality is cut by the kernel."""
        if self.g:
            return None
        first = (local // self.k) * self.k
        return first, (length - first).clamp_max(self.k)

    def label(self) -> str:
        return f"BLOC:{self.k}({self.g})" if self.g else f"BLOC:{self.k}"


@register
@dataclass(frozen=True)
class GlobalTokens(FixedPattern):
    """``global:g=G``: the first g positions (the last g with ``globals_at="end"``) attend to every
    position and every position attends to them; nothing else is kept. Combine with a local
    pattern through BAND/BLOC's g."""

    g: int
    globals_at: str = "start"
    examples: ClassVar[tuple[str, ...]] = ("global:g=2",)
    name: ClassVar[str] = "global"
    positional: ClassVar[tuple[str, ...]] = ("g",)
    cost: ClassVar[tuple[str, str]] = ("O(N g D)", "O(N g)")

    def validate(self) -> None:
        require(self.g >= 1, f"global: g must be >= 1, got {self.g}")
        self.check_globals_at()

    def mask_mod(self, n_queries, n_keys, causal):
        def nothing(b, h, q_idx, kv_idx):
            return q_idx < 0

        return with_global_tokens(nothing, self.g, self.globals_at, n_keys)

    def position_indices(self, n_queries, n_keys, causal, device):
        return torch.full((1, 1, n_queries, 1), -1, dtype=torch.long, device=device)


def _invalid_to_unused(index: Tensor, valid: Tensor) -> Tensor:
    """Replace the entries of ``index`` where ``valid`` is False by -1."""
    return torch.where(valid, index, torch.full_like(index, -1))


@register
@dataclass(frozen=True)
class Strided(FixedPattern):
    """``strided:stride=s`` (Child et al. 2019, "strided"): query i keeps key j if |i - j| < s or
    (i - j) mod s == 0, i.e. a local window of 2s-1 keys plus every s-th key in i's residue class.
    Causal: the lower-triangular version (the s most recent keys plus every s-th earlier one).
    With s ~ sqrt(N) every row keeps O(sqrt(N)) keys, so the default ``stride=0`` (bare
    ``strided``) means s = ceil(sqrt(M)) for M keys, Child et al.'s choice."""

    stride: int = 0
    examples: ClassVar[tuple[str, ...]] = ("strided:4", "strided:stride=7", "strided")
    name: ClassVar[str] = "strided"
    aliases: ClassVar[tuple[str, ...]] = ("sparse_strided",)
    positional: ClassVar[tuple[str, ...]] = ("stride",)
    field_aliases: ClassVar[dict[str, str]] = {"s": "stride"}
    cost: ClassVar[tuple[str, str]] = ("O(N (s + N/s) D)", "O(N (s + N/s))")

    def validate(self) -> None:
        require(self.stride >= 0, f"strided: stride must be >= 1 (or 0 = ceil(sqrt(N))), got {self.stride}")

    def stride_for(self, n_keys: int) -> int:
        """The stride used with ``n_keys`` keys: ``stride``, or ceil(sqrt(n_keys)) when it is 0."""
        return self.stride or max(1, math.isqrt(max(n_keys - 1, 0)) + 1)

    def mask_mod(self, n_queries, n_keys, causal):
        stride = self.stride_for(n_keys)

        def strided(b, h, q_idx, kv_idx):
            diff = q_idx - kv_idx
            return (diff % stride == 0) | (torch.abs(diff) < stride)

        return strided

    def position_indices(self, n_queries, n_keys, causal, device):
        stride = self.stride_for(n_keys)
        query_pos = torch.arange(n_queries, device=device)[:, None]
        steps = torch.arange(-(-n_keys // stride), device=device)[None, :]
        if causal:
            local = query_pos - torch.arange(stride, device=device)[None, :]
            far = query_pos - stride * (steps + 1)
            index = torch.cat([local, far], dim=-1)  # [N, s + ceil(M/s)]
            return _invalid_to_unused(index, index >= 0)[None, None]
        local = query_pos + torch.arange(-(stride - 1), stride, device=device)[None, :]
        local = _invalid_to_unused(local, (local >= 0) & (local < n_keys))
        # Same residue class as i; the only member with |i - j| < s is i itself, already in local.
        far = query_pos % stride + stride * steps
        far = _invalid_to_unused(far, (far < n_keys) & (far != query_pos))
        return torch.cat([local, far], dim=-1)[None, None]  # [1, 1, N, 2s-1 + ceil(M/s)]


@register
@dataclass(frozen=True)
class FixedSummary(FixedPattern):
    """``fixed:block=l,c=c`` (Child et al. 2019, "fixed"): query i keeps the keys of its own block
    of length l (blocks [0, l), [l, 2l), ...) plus the "summary" columns, the last c positions of
    every block (j mod l >= l - c; a shorter final block has those of them that exist).
    Causal: only j <= i of the same set."""

    block: int
    c: int = 1
    examples: ClassVar[tuple[str, ...]] = ("fixed:block=8,c=2", "fixed:4,1")
    name: ClassVar[str] = "fixed"
    aliases: ClassVar[tuple[str, ...]] = ("sparse_fixed",)
    positional: ClassVar[tuple[str, ...]] = ("block", "c")
    field_aliases: ClassVar[dict[str, str]] = {"l": "block", "summary": "c"}
    cost: ClassVar[tuple[str, str]] = ("O(N (l + c N/l) D)", "O(N (l + c N/l))")

    def validate(self) -> None:
        require(self.block >= 1, f"fixed: block must be >= 1, got {self.block}")
        require(1 <= self.c <= self.block, f"fixed: c must be in [1, block={self.block}], got {self.c}")

    def mask_mod(self, n_queries, n_keys, causal):
        block, first_summary = self.block, self.block - self.c

        def fixed(b, h, q_idx, kv_idx):
            return (q_idx // block == kv_idx // block) | (kv_idx % block >= first_summary)

        return fixed

    def position_indices(self, n_queries, n_keys, causal, device):
        query_block = torch.arange(n_queries, device=device)[:, None] // self.block  # [N, 1]
        own = query_block * self.block + torch.arange(self.block, device=device)[None, :]
        own = _invalid_to_unused(own, own < n_keys)
        blocks = torch.arange(-(-n_keys // self.block), device=device)[:, None]
        summary = (blocks * self.block + self.block - self.c + torch.arange(self.c, device=device)).reshape(1, -1)
        # Summary columns of i's own block are already listed in ``own``.
        summary = _invalid_to_unused(summary, (summary < n_keys) & (summary // self.block != query_block))
        return torch.cat([own, summary], dim=-1)[None, None]  # [1, 1, N, l + c ceil(M/l)]


@register
@dataclass(frozen=True)
class Dilated(FixedPattern):
    """``dilated:k=K,dilation=d``: k keys at offsets that are multiples of d, floor((k-1)/2) steps
    to the left of i and the rest to the right; like BAND the window is shifted at the edges
    (staying on i's residue class mod d) so every row keeps k keys when the class has k members.
    Causal: the k most recent keys at stride d (i, i-d, ..., i-(k-1)d). d=1 is BAND."""

    k: int
    dilation: int = 2
    examples: ClassVar[tuple[str, ...]] = ("dilated:k=5,dilation=2", "dilated:4,3")
    name: ClassVar[str] = "dilated"
    aliases: ClassVar[tuple[str, ...]] = ("dilated_window",)
    positional: ClassVar[tuple[str, ...]] = ("k", "dilation")
    field_aliases: ClassVar[dict[str, str]] = {"d": "dilation"}
    cost: ClassVar[tuple[str, str]] = ("O(N k D)", "O(N k)")

    def validate(self) -> None:
        require(self.k >= 1, f"dilated: k must be >= 1, got {self.k}")
        require(self.dilation >= 1, f"dilated: dilation must be >= 1, got {self.dilation}")

    def _window(self, q_idx: Tensor, n_keys: int) -> tuple[Tensor, Tensor]:
        """First step u0 and width of the non-causal window of query q_idx, in units of d."""
        lowest = -(q_idx // self.dilation)
        highest = (n_keys - 1 - q_idx) // self.dilation
        width = torch.clamp(highest - lowest + 1, max=self.k)
        first = torch.maximum(lowest, torch.clamp(highest - width + 1, max=-((self.k - 1) // 2)))
        return first, width

    def mask_mod(self, n_queries, n_keys, causal):
        dilation, k = self.dilation, self.k

        def recent(b, h, q_idx, kv_idx):
            diff = q_idx - kv_idx
            return (diff % dilation == 0) & (diff < k * dilation)

        def centred(b, h, q_idx, kv_idx):
            diff = kv_idx - q_idx
            first, width = self._window(q_idx, n_keys)
            step = diff // dilation
            return (diff % dilation == 0) & (step >= first) & (step < first + width)

        return recent if causal else centred

    def position_indices(self, n_queries, n_keys, causal, device):
        query_pos = torch.arange(n_queries, device=device)[:, None]
        slots = torch.arange(self.k, device=device)[None, :]
        if causal:
            index = query_pos - self.dilation * slots
            return _invalid_to_unused(index, index >= 0)[None, None]
        first, width = self._window(query_pos, n_keys)
        index = query_pos + self.dilation * (first + slots)  # [N, k]
        return _invalid_to_unused(index, slots < width)[None, None]


def sample_distinct(counts: Tensor, k: int, generator: torch.Generator) -> Tensor:
    """Per row r, k distinct ranks drawn uniformly from [0, counts[r]) (all of them if fewer).

    Floyd's algorithm, vectorised over rows: O(R k^2) time and O(R k) memory, no R x M tensor.
    counts: [R] int64 on the CPU. Returns [R, k] int64, -1 for unused slots.
    """
    n_rows = counts.shape[0]
    chosen = torch.full((n_rows, k), -1, dtype=torch.long)
    for step in range(k):
        top = counts - k + step  # Floyd's j: draw t in [0, j]; take j itself if t was taken
        uniform = torch.rand(n_rows, generator=generator, dtype=torch.float64)
        draw = torch.minimum((uniform * (top + 1).clamp_min(0)).long(), top)
        taken = (chosen == draw[:, None]).any(dim=-1)
        pick = torch.where(taken, top, draw)
        chosen[:, step] = torch.where(top >= 0, pick, torch.full_like(pick, -1))
    return chosen


PatternKey = tuple  # (class name, ((field, value), ...)): a pattern as plain constants


def pattern_key(pattern: "FixedPattern") -> PatternKey:
    """The pattern as a tuple of plain values, which torch.compile can hold as a constant (a frozen
    dataclass instance cannot be rebuilt inside a graph by every torch version)."""
    return type(pattern).__name__, tuple((field.name, getattr(pattern, field.name)) for field in dataclasses.fields(pattern))


@lru_cache(maxsize=8)
def _cached_random_keys(key: PatternKey, n_queries: int, n_keys: int, causal: bool) -> Tensor:
    classes = {cls.__name__: cls for cls in PATTERNS.values()}
    pattern = classes[key[0]](**dict(key[1]))
    return pattern.draw_random_keys(n_queries, n_keys, causal)


@lru_cache(maxsize=8)
def _random_keys_on(key: PatternKey, n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
    return _cached_random_keys(key, n_queries, n_keys, causal).to(device)


@torch.compiler.assume_constant_result
def _constant_random_keys(key: PatternKey, n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
    return _random_keys_on(key, n_queries, n_keys, causal, device)


def random_keys_on(pattern: "FixedPattern", n_queries: int, n_keys: int, causal: bool, device: torch.device) -> Tensor:
    """The cached draw on ``device`` (read-only): copied there once, so later calls make no
    host-to-device copy (CUDA graphs can capture them) and torch.compile holds it as a constant."""
    return _constant_random_keys(pattern_key(pattern), n_queries, n_keys, causal, device)


def _table_mask_mod(table: Tensor) -> MaskMod:
    """mask_mod reading a precomputed [N, M] bool table."""

    def lookup(b, h, q_idx, kv_idx):
        return table[q_idx, kv_idx]

    return lookup


@register
@dataclass(frozen=True)
class RandomKeys(FixedPattern):
    """``random:k=K,seed=S``: every query keeps k keys drawn uniformly without replacement from
    its allowed keys (causal: j <= i); rows with fewer than k allowed keys keep them all. The draw
    depends only on (seed, N, M, causal): the same keys for every batch element and every head
    (use different seeds for different layers), never on q/k values."""

    k: int
    seed: int = 0
    examples: ClassVar[tuple[str, ...]] = ("random:k=4", "random:6,seed=3")
    name: ClassVar[str] = "random"
    positional: ClassVar[tuple[str, ...]] = ("k", "seed")
    cost: ClassVar[tuple[str, str]] = ("O(N k D)", "O(N k) (flex/reference: an N x M bool table)")

    def validate(self) -> None:
        require(self.k >= 1, f"random: k must be >= 1, got {self.k}")

    def draw_random_keys(self, n_queries: int, n_keys: int, causal: bool) -> Tensor:
        """[N, k] CPU key lists, -1 unused (the draw behind both the lists and the mask)."""
        counts = torch.full((n_queries,), n_keys, dtype=torch.long)
        if causal:
            counts = torch.clamp(torch.arange(1, n_queries + 1), max=n_keys)
        return sample_distinct(counts, self.k, torch.Generator().manual_seed(self.seed))

    def device_mask_mod(self, n_queries, n_keys, causal, device):
        keys = random_keys_on(self, n_queries, n_keys, causal, device)
        return _table_mask_mod(mask_from_indices(keys, n_keys))  # [N, M] table

    def mask_mod(self, n_queries, n_keys, causal):
        return self.device_mask_mod(n_queries, n_keys, causal, torch.device("cpu"))

    def position_indices(self, n_queries, n_keys, causal, device):
        # A copy, so that no caller can modify the cached draw in place.
        return random_keys_on(self, n_queries, n_keys, causal, device).clone()[None, None]


@register
@dataclass(frozen=True)
class Longformer(FixedPattern):
    """``longformer:window=w,g=G`` (Beltagy et al. 2020): a sliding window of w keys (BAND:w, so
    causal keeps the w most recent) plus g global tokens, the first g positions (Longformer lets
    the task pick them, e.g. [CLS]; put them first) or the last g with ``globals_at="end"``."""

    window: int
    g: int = 1
    globals_at: str = "start"
    examples: ClassVar[tuple[str, ...]] = ("longformer:window=4,g=1", "longformer:7,2")
    name: ClassVar[str] = "longformer"
    positional: ClassVar[tuple[str, ...]] = ("window", "g")
    field_aliases: ClassVar[dict[str, str]] = {"w": "window"}
    cost: ClassVar[tuple[str, str]] = ("O(N (w+g) D)", "O(N (w+g))")

    def validate(self) -> None:
        require(self.window >= 1, f"longformer: window must be >= 1, got {self.window}")
        require(self.g >= 0, f"longformer: g must be >= 0, got {self.g}")
        self.check_globals_at()

    def mask_mod(self, n_queries, n_keys, causal):
        return Band(self.window, self.g, self.globals_at).mask_mod(n_queries, n_keys, causal)

    def position_indices(self, n_queries, n_keys, causal, device):
        return Band(self.window).position_indices(n_queries, n_keys, causal, device)


@register
@dataclass(frozen=True)
class BigBird(FixedPattern):
    """``bigbird:window=w,g=G,r=R,seed=S`` (Zaheer et al. 2020, token level): a sliding window of
    w keys (BAND:w), g global tokens (the first g positions) and r random keys per query drawn
    without replacement from the allowed keys outside the window and the global tokens, so a row
    keeps r more keys than window + globals (w+g+r when the window is clear of the globals) when
    it has that many. Random keys are seeded and shared by every
    batch element and head, as in RANDOM; causal draws only among j <= i.
    Defaults (bare ``bigbird``): window=3, g=2, r=3, BigBird-ITC's block counts (3 sliding, 2
    global, 3 random blocks) at a block size of one token."""

    window: int = 3
    g: int = 2
    r: int = 3
    seed: int = 0
    examples: ClassVar[tuple[str, ...]] = ("bigbird:window=3,g=2,r=2", "bigbird:5,0,3,seed=1", "bigbird")
    name: ClassVar[str] = "bigbird"
    positional: ClassVar[tuple[str, ...]] = ("window", "g", "r")
    field_aliases: ClassVar[dict[str, str]] = {"w": "window"}
    cost: ClassVar[tuple[str, str]] = ("O(N (w+g+r) D)", "O(N (w+g+r)) (flex/reference: an N x M bool table)")

    def validate(self) -> None:
        require(self.window >= 1, f"bigbird: window must be >= 1, got {self.window}")
        require(self.g >= 0, f"bigbird: g must be >= 0, got {self.g}")
        require(self.r >= 0, f"bigbird: r must be >= 0, got {self.r}")

    def _window_bounds(self, n_queries: int, n_keys: int, causal: bool) -> tuple[Tensor, Tensor, Tensor]:
        """Per query: window [start, stop) and the end of its allowed keys, each [N] int64 (CPU)."""
        query_pos = torch.arange(n_queries)
        if causal:
            return torch.clamp(query_pos - self.window + 1, min=0), query_pos + 1, query_pos + 1
        width = min(self.window, n_keys)
        start = torch.clamp(query_pos - (self.window - 1) // 2, 0, n_keys - width)
        return start, start + width, torch.full_like(query_pos, n_keys)

    def draw_random_keys(self, n_queries: int, n_keys: int, causal: bool) -> Tensor:
        """[N, r] CPU random key lists outside window and globals, -1 unused."""
        start, stop, limit = self._window_bounds(n_queries, n_keys, causal)
        num_global = min(self.g, n_keys)
        # Free keys are [g, start') and [stop', limit) with the window clipped to start at >= g.
        start = torch.clamp(start, min=num_global)
        stop = torch.maximum(stop, start)
        before = start - num_global
        counts = torch.clamp(before + limit - stop, min=0)
        rank = sample_distinct(counts, self.r, torch.Generator().manual_seed(self.seed))
        keys = torch.where(rank < before[:, None], num_global + rank, stop[:, None] + rank - before[:, None])
        return _invalid_to_unused(keys, rank >= 0)

    def device_mask_mod(self, n_queries, n_keys, causal, device):
        local = Band(self.window, self.g).mask_mod(n_queries, n_keys, causal)
        keys = random_keys_on(self, n_queries, n_keys, causal, device)
        table = mask_from_indices(keys, n_keys)  # [N, M]

        def bigbird(b, h, q_idx, kv_idx):
            return local(b, h, q_idx, kv_idx) | table[q_idx, kv_idx]

        return bigbird

    def mask_mod(self, n_queries, n_keys, causal):
        return self.device_mask_mod(n_queries, n_keys, causal, torch.device("cpu"))

    def position_indices(self, n_queries, n_keys, causal, device):
        window = Band(self.window).position_indices(n_queries, n_keys, causal, device)
        random_keys = random_keys_on(self, n_queries, n_keys, causal, device).clone()[None, None]
        return torch.cat([window, random_keys], dim=-1)  # [1, 1, N, w + r]
