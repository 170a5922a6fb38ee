"""ZETA (Zeng et al., ICLR 2025): top-k attention found through Z-order (Morton) codes, scored
by an adaptive Cauchy kernel with a trainable width gamma.

Per head, queries and keys live in a few dimensions (d_K = 3 by default; ``SparseAttention``
projects to ``dk`` through ``qk_dim``). Each vector is squashed to [0, 1] by a sigmoid (elementwise,
so no statistic over other positions is taken), quantised to ``bits`` bits per dimension and
turned into one 64-bit Morton code. Keys are sorted by code; each query looks up its insertion
point with a binary search and takes the ``window`` keys around it as candidates. With several
``curves`` the same is done on copies of the space shifted by j/curves along the diagonal and
the candidates are united. The candidates are re-ranked by exact squared distance and the ``k``
nearest kept. A mean token (mean key and mean value of every allowed key, a cumulative mean when
causal) joins every query's list, so that gradients reach every key and value. Weights are
``1 / (||q - k||^2 + gamma^2)`` normalised over the list and the mean token; ``scale`` is unused.
With ``sink=1`` every list also holds a learned key per head with value zero (an attention sink):
it only adds its weight to the normaliser, so a query can put weight on "nothing".

Causality is chunked: the positions are cut into ``chunks`` equal chunks; a query in chunk m
searches the sorted codes of all keys in chunks < m (one sort per chunk boundary, so no future
key can move its window) plus, densely, its ``local`` most recent keys inside its own chunk.
Non-causal attention searches all keys with one sort and ignores ``chunks`` and ``local``.
The decisions and their reasons are in docs/readme/zeta.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar, Iterator

import torch
from torch import Tensor

from sparsefocus.attention.common import expand_kv, gamma_squared, indexed_attention_ref, sink_rows, upcast
from sparsefocus.attention.patterns import Pattern, parse_pattern, register, require

CODE_BITS = 62  # Morton codes stay below 2**62 so that SENTINEL sorts after every real code
SENTINEL = 1 << CODE_BITS
# Smallest Cauchy width: a key at distance 0 weighs 1 / GAMMA_MIN^2 = 1e6, not inf. Trained widths
# collapse: on MQAR one model's four gammas all ended below 2e-10, one at 1e-40, whose square is 0 in fp32.
GAMMA_MIN = 1e-3
SINK_INIT = 1.0  # sink keys start at (1, ..., 1): far from q, k near 0 at init, so nearly weightless
ROW_BUDGET = 1 << 24  # candidate entries materialised at once by the lean selection
FUSED_MEAN = True  # triton, causal, N = M: the mean token inside the indexed kernel's function (False: benchmarks' A/B)

# Bit-spreading steps for 3-D codes (libmorton-style): x = (x | x << shift) & mask.
_SPREAD3 = (
    (32, 0x1F00000000FFFF),
    (16, 0x1F0000FF0000FF),
    (8, 0x100F00F00F00F00F),
    (4, 0x10C30C30C30C30C3),
    (2, 0x1249249249249249),
)


def spread_bits_3d(x: Tensor) -> Tensor:
    """Insert two zero bits after each of the low 21 bits of ``x`` (int64): b20..b0 -> b20 0 0 ... b0."""
    x = x & 0x1FFFFF
    for shift, mask in _SPREAD3:
        x = (x | (x << shift)) & mask
    return x


def morton_codes(grid: Tensor, bits: int) -> Tensor:
    """Interleave the bits of integer coordinates, most significant bit first.

    Args:
        grid: [..., D] int64 coordinates in [0, 2**bits), D * bits <= 62.
        bits: bits per coordinate.
    Returns:
        [...] int64 codes; bit b of coordinate d lands at position b * D + (D - 1 - d), so
        coordinate 0 holds the most significant bit of every group.
    """
    dims = grid.shape[-1]
    if dims == 3 and bits <= 21:
        return (spread_bits_3d(grid[..., 0]) << 2) | (spread_bits_3d(grid[..., 1]) << 1) | spread_bits_3d(grid[..., 2])
    code = torch.zeros(grid.shape[:-1], dtype=torch.int64, device=grid.device)
    for bit in range(bits):
        for dim in range(dims):
            code |= ((grid[..., dim] >> bit) & 1) << (bit * dims + dims - 1 - dim)
    return code


def squash(x: Tensor) -> Tensor:
    """Map coordinates to (0, 1) elementwise with a sigmoid: causal-safe, same map at decode."""
    return torch.sigmoid(upcast(x))


def curve_codes(
    x: Tensor, bits: int, curve: int, curves: int, fused: bool = False, tag_rows: tuple[int, int] | None = None
) -> Tensor:
    """Morton codes of x [..., D] on curve ``curve`` of ``curves`` -> [...] int64.

    One curve: grid = floor(sigmoid(x) * 2**bits). Several: the squashed point is shifted by
    curve / p along the diagonal inside [0, 2)^D, p the smallest odd number >= curves (shifted
    quadtrees, Chan 1998; a dyadic shift such as 1/2 would keep every cell boundary and give the
    same order), and quantised with bits + 1 bits, so curve 0 equals the single curve.
    ``fused`` shifts, quantises and interleaves in one Triton kernel (same fp32 operations);
    ``tag_rows`` (fused only) puts row numbers above the codes (``morton_codes_triton``).
    """
    unit = squash(x)
    levels = 1 << bits
    extra = shift_bits(curves)
    shift = curve / (curves | 1)
    top = (levels << extra) - 1
    if fused:
        from sparsefocus.kernels.morton import morton_codes_triton

        return morton_codes_triton(unit, bits + extra, shift, levels, top, tag_rows)
    grid = torch.floor((unit + shift) * levels).long().clamp(0, top)
    return morton_codes(grid, bits + extra)


def shift_bits(curves: int) -> int:
    """Bits per coordinate the shifted curves add above ``bits`` (their points reach [0, 2))."""
    return 0 if curves == 1 else 1


def code_width(bits: int, dims: int, curves: int) -> int:
    """Bits of one Morton code: dims * (bits + ``shift_bits``), with ``bits`` from ``code_bits``."""
    return dims * (bits + shift_bits(curves))


def code_bits(bits: int, dims: int, curves: int) -> int:
    """Bits per coordinate actually used: ``bits``, reduced so that the code fits in 62 bits."""
    extra = shift_bits(curves)
    usable = CODE_BITS // dims - extra
    if usable < 1:
        raise ValueError(
            f"zeta: q/k width {dims} is too wide for a 62-bit Morton code; project q and k to a few "
            f"dimensions (the pattern's dk, {'at most 30' if extra else 'at most 62'})"
        )
    return min(bits, usable)


MEAN_BUDGET = 1 << 25  # at most this many fp32 elements in one block of the chunked cumulative mean
MEAN_SMALL = 1 << 22  # ... and at most 1/MEAN_PARTS of x once x has more elements than this
MEAN_PARTS = 16


def mean_tokens(
    k: Tensor, v: Tensor, causal: bool, key_padding_mask: Tensor | None, fused: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """Mean key, mean value and whether any key was averaged, per query slot.

    Args:
        k: [B, H, M, D]; v: [B, H, M, Dv]; key_padding_mask: [B, M] bool (True = real).
        fused: take the causal cumulative mean from the Triton scan (``CausalMeanScan``, the
            fast twin of ``CausalMean``) instead of torch.
    Returns:
        mean_k [B, H, T, D], mean_v [B, H, T, Dv] in the inputs' dtypes (sums in fp32) and
        present [B, 1, T] bool, with T = M (causal: mean of the real keys 0..i) or T = 1 (all
        real keys). The causal mean runs over row blocks with a carried sum, so no fp32 copy
        of v is ever held whole, in the forward or the backward.
    """
    real = torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device) if key_padding_mask is None else key_padding_mask
    if causal:
        count = real.to(upcast(k).dtype).cumsum(-1)  # [B, M]
        scan = CausalMean
        if fused:
            from sparsefocus.kernels.scan import CausalMeanScan as scan
        return scan.apply(k, real, count), scan.apply(v, real, count), (count > 0)[:, None, :]
    weight = real[:, None, :, None].to(upcast(k).dtype)  # [B, 1, M, 1]
    count = weight.sum(2, keepdim=True)  # [B, 1, 1, 1]
    means = [((upcast(x) * weight).sum(2, keepdim=True) / count.clamp_min(1.0)).to(x.dtype) for x in (k, v)]
    return means[0], means[1], count[..., 0] > 0


class CausalMean(torch.autograd.Function):
    """mean[i] = sum_{j <= i, real} x[j] / count[i] along dim 2 of x [B, H, M, X], in row blocks.

    Forward and backward (a reversed cumulative sum) carry an fp32 running sum from block to
    block, so the temporaries are one block, not a copy of x."""

    @staticmethod
    def forward(ctx, x: Tensor, real: Tensor, count: Tensor) -> Tensor:
        out = torch.empty_like(x)
        carry = torch.zeros(*x.shape[:2], 1, x.shape[3], dtype=upcast(x).dtype, device=x.device)
        for rows in _mean_blocks(x):
            total = row_cumsum(upcast(x[:, :, rows]) * real[:, None, rows, None]) + carry
            out[:, :, rows] = total / count[:, None, rows, None].clamp_min(1.0)
            carry = total[:, :, -1:]
        ctx.save_for_backward(real, count)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor):
        real, count = ctx.saved_tensors
        dx = torch.empty_like(grad)
        carry = torch.zeros(*grad.shape[:2], 1, grad.shape[3], dtype=upcast(grad).dtype, device=grad.device)
        for rows in reversed(list(_mean_blocks(grad))):
            share = upcast(grad[:, :, rows]) / count[:, None, rows, None].clamp_min(1.0)
            total = row_cumsum(share.flip(2)).flip(2) + carry  # sum over i >= j of grad_i / count_i
            dx[:, :, rows] = total * real[:, None, rows, None]
            carry = total[:, :, :1]
        return dx, None, None


def row_cumsum(x: Tensor, part: int = 64) -> Tensor:
    """Inclusive cumulative sum along dim 2 of x [B, H, R, X], in two levels (within parts of
    ``part`` rows, then over the parts' totals). Same sums as ``x.cumsum(2)``, but torch's CUDA
    scan along a non-last dim runs one thread per (B, H, X) column sequentially over R rows, which
    at B*H*X = 4096 columns and R = 64K took tens of ms (the H200 run at 43058cc); here the
    sequential runs are at most ``part`` and R / part long."""
    batch, heads, rows, width = x.shape
    pad = (-rows) % part
    padded = torch.nn.functional.pad(x, (0, 0, 0, pad)) if pad else x
    parts = padded.reshape(batch, heads, (rows + pad) // part, part, width).cumsum(3)  # [B, H, R/part, part, X]
    totals = parts[:, :, :, -1]  # [B, H, R/part, X]
    before = torch.nn.functional.pad(totals[:, :, :-1], (0, 0, 1, 0)).cumsum(2)  # sums of all earlier parts, never a later one
    return (parts + before[:, :, :, None]).reshape(batch, heads, rows + pad, width)[:, :, :rows]


def _mean_blocks(x: Tensor) -> list[slice]:
    """Row blocks of x [B, H, M, X]: the fp32 temporaries of a block stay a small part of x
    (the H200 run at 43058cc, with blocks of up to 2**25 elements, held a whole fp32 copy of v at
    4K-16K and peaked 22% above SDPA there)."""
    row = max(1, x.shape[0] * x.shape[1] * x.shape[3])
    elements = min(MEAN_BUDGET, max(MEAN_SMALL, row * x.shape[2] // MEAN_PARTS))
    step = max(1, elements // row)
    return [slice(start, min(start + step, x.shape[2])) for start in range(0, x.shape[2], step)]


@register
@dataclass(frozen=True)
class Zeta(Pattern):
    """``zeta:k=32,dk=3``: Z-order top-k attention with Cauchy weights and a mean token.

    Parameters: k kept keys per query (32); dk q/k width a layer projects to (3); bits per
    dimension of the Morton code (12); chunks for causality (8); window candidates per sorted
    search (64); local recent keys of the own chunk, causal only (32); curves shifted Z-curves
    whose candidates are united (1); gamma the default Cauchy width (1.0, trainable in a layer);
    sink 1 adds a learned zero-value key per head to every list (0: none).
    """

    k: int = 32
    dk: int = 3
    bits: int = 12
    chunks: int = 8
    window: int = 64
    local: int = 32
    curves: int = 1
    gamma: float = 1.0
    sink: int = 0
    examples: ClassVar[tuple[str, ...]] = (
        "zeta:k=4,window=6,chunks=3,local=3",
        "zeta:k=3,window=4,curves=3,chunks=2,local=0",
        "zeta:k=3,window=4,chunks=3,local=2,sink=1",
    )
    name: ClassVar[str] = "zeta"
    positional: ClassVar[tuple[str, ...]] = ("k",)
    field_aliases: ClassVar[dict[str, str]] = {"d_k": "dk", "w": "window"}
    input_dependent: ClassVar[bool] = True
    score: ClassVar[str] = "cauchy"
    normaliser: ClassVar[str] = "Cauchy weights with a mean token"
    family: ClassVar[str] = "heavy hitters"
    cost: ClassVar[tuple[str, str]] = ("O(N log N + N (curves*window + local) D_K + N k Dv)", "O(N k)")
    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")
    needs_square: ClassVar[bool] = False

    def validate(self) -> None:
        for name in ("k", "dk", "bits", "chunks", "window", "curves"):
            require(getattr(self, name) >= 1, f"zeta: {name} must be >= 1, got {getattr(self, name)}")
        require(self.bits <= 20, f"zeta: bits must be <= 20 (codes are 64-bit), got {self.bits}")
        require(self.local >= 0, f"zeta: local must be >= 0, got {self.local}")
        require(self.sink in (0, 1), f"zeta: sink must be 0 or 1, got {self.sink}")
        require(
            self.gamma >= GAMMA_MIN and math.isfinite(self.gamma),
            f"zeta: gamma must be finite and >= {GAMMA_MIN}, got {self.gamma}",
        )
        code_bits(self.bits, self.dk, self.curves)

    def qk_dim(self, head_dim: int) -> int:
        return self.dk

    def make_parameters(self, num_heads: int) -> dict[str, torch.nn.Parameter]:
        """One trainable Cauchy width per head, initialised to ``gamma``; with ``sink``, one sink
        key per head [H, dk], initialised to ``SINK_INIT`` in every coordinate."""
        params = {"gamma": torch.nn.Parameter(torch.full((num_heads,), float(self.gamma)))}
        if self.sink:
            params["sink_key"] = torch.nn.Parameter(torch.full((num_heads, self.dk), SINK_INIT))
        return params

    @property
    def folds_params(self) -> bool:
        """The widths [B, Hq] and sink keys [B, Hq, D] may come per batch row: the kernels and
        both references read them by (row, head)."""
        return True

    def sink_of(self, params: dict | None, heads: int, width: int, device: torch.device) -> Tensor | None:
        """The sink keys [H, D] or per batch row [B, H, D] (trained, or ``SINK_INIT`` everywhere), or
        None without ``sink``."""
        if not self.sink:
            return None
        if params is not None and params.get("sink_key") is not None:
            return params["sink_key"]
        return torch.full((heads, width), SINK_INIT, device=device)

    def gamma_of(self, params: dict | None) -> Tensor | float:
        """The Cauchy width: the pattern's ``gamma``, or the trained one with its magnitude
        floored at ``GAMMA_MIN`` (training drives it to 0, where gamma^2 underflows)."""
        if params is None or params.get("gamma") is None:
            return self.gamma
        return params["gamma"].abs().clamp_min(GAMMA_MIN)

    def blocks(self, n_queries: int, n_keys: int, causal: bool) -> Iterator[tuple[slice, int]]:
        """(query rows, number of leading keys they may search): one block per causal chunk."""
        if not causal:
            yield slice(0, n_queries), n_keys
            return
        size = self.chunk_size(n_queries)
        for start in range(0, n_queries, size):
            yield slice(start, min(start + size, n_queries)), start

    def chunk_size(self, n: int) -> int:
        return max(1, math.ceil(n / self.chunks))

    def key_indices(self, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None, params=None) -> Tensor:
        """[B, Hq, N, K] selected key positions (-1 unused), K = min(k, candidates per query)."""
        return select_keys(self, q, k, causal, key_padding_mask)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        return dense_selection(self, q, k, causal, key_padding_mask)[:, :, rows]

    def reference(self, q, k, v, *, causal, scale, key_padding_mask, params):
        mask = self.full_mask(q, k, causal, key_padding_mask, params)
        sink = self.sink_of(params, q.shape[1], q.shape[-1], q.device)
        return dense_cauchy_attention(q, k, v, mask, causal, key_padding_mask, self.gamma_of(params), sink)

    def lean(self, q, k, v, *, causal, scale, key_padding_mask, params):
        index = select_keys(self, q, k, causal, key_padding_mask)
        return self._attend(q, k, v, index, causal, key_padding_mask, params, indexed_attention_ref, fused=False)

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from sparsefocus.kernels.indexed import indexed_attention, indexed_attention_causal_mean

        index = select_keys_fused(self, q, k, causal, key_padding_mask)
        if (
            FUSED_MEAN and causal and q.shape[2] == k.shape[2] and index.shape[-1] > 0
        ):  # the mean token fused into the kernel's extra slot
            return indexed_attention_causal_mean(
                q,
                k,
                v,
                index,
                score="cauchy",
                gamma=self.gamma_of(params),
                key_padding_mask=key_padding_mask,
                sink_key=self.sink_of(params, q.shape[1], q.shape[-1], q.device),
            )
        return self._attend(q, k, v, index, causal, key_padding_mask, params, indexed_attention, fused=True)

    def start_cache(self, k: Tensor, v: Tensor):
        """The decoding cache after a causal call over k, v (``zeta_decode.ZetaCache``)."""
        from sparsefocus.attention.zeta_decode import start_cache

        return start_cache(self, k, v)

    def decode_step(self, q: Tensor, k_new: Tensor, v_new: Tensor, cache, params=None):
        """(output, cache) of one new position from a ``ZetaCache``, without re-sorting the keys
        (``zeta_decode.decode_step``)."""
        from sparsefocus.attention.zeta_decode import decode_step

        return decode_step(self, q, k_new, v_new, cache, params)

    def _attend(self, q, k, v, index, causal, key_padding_mask, params, kernel, fused: bool) -> Tensor:
        """Selected keys (index [B, Hq, N, K]) plus the mean token through an indexed Cauchy kernel.

        The mean token is the kernel's extra slot: per query its own mean key and value
        ([B, Hk, N, *], or one row expanded when not causal), so v is not extended and the
        gradients flow through the cumulative mean to every key and value.
        """
        mean_k, mean_v, present = mean_tokens(k, v, causal, key_padding_mask, fused)
        n_queries = q.shape[2]
        if causal:
            mean_k, mean_v, present = mean_k[:, :, :n_queries], mean_v[:, :, :n_queries], present[:, :, :n_queries]
        else:
            mean_k, mean_v = mean_k.expand(-1, -1, n_queries, -1), mean_v.expand(-1, -1, n_queries, -1)
            present = present.expand(-1, -1, n_queries)
        sink = self.sink_of(params, q.shape[1], q.shape[-1], q.device)  # [Hq, D] or None: a zero-value key in every list
        return kernel(
            q,
            k,
            v,
            index,
            score="cauchy",
            gamma=self.gamma_of(params),
            extra_key=mean_k,
            extra_value=mean_v,
            extra_mask=present,
            sink_key=sink,
        )


def squared_distances(q: Tensor, k: Tensor) -> Tensor:
    """||q_i - k_j||^2 from explicit differences: q [B, H, N, D], k [B, H, M, D] -> [B, H, N, M].

    Differentiable at zero distance (unlike cdist) and rounded as the gathered paths round."""
    return (q[..., :, None, :] - k[..., None, :, :]).pow(2).sum(-1)


def _codes(spec: Zeta, x: Tensor, bits: int, fused: bool = False, tagged: bool = False) -> Tensor:
    """[S, ...] Morton codes of x [B, H, M, D] on each of the spec's curves (one curve: a view, no
    copy); ``tagged`` (fused only): each (curve, b, h) row's number above its codes."""
    rows = x.shape[0] * x.shape[1]
    tag = lambda curve: (x.shape[2], curve * rows) if tagged else None
    if spec.curves == 1:
        return curve_codes(x, bits, 0, 1, fused, tag(0))[None]
    return torch.stack([curve_codes(x, bits, curve, spec.curves, fused, tag(curve)) for curve in range(spec.curves)])


def select_keys(spec: Zeta, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """The memory-lean selection: sort, binary search, window, local band, exact re-ranking.

    q: [B, Hq, N, D]; k: [B, Hk, M, D]. Returns [B, Hq, N, K] int64, -1 for unused slots,
    K = min(k, curves * window + local). Memory O(N K) plus bounded row blocks. No gradient.
    """
    with torch.no_grad():
        q32, k32 = upcast(q), expand_kv(upcast(k), q.shape[1])  # [B, H, N, D], [B, H, M, D]
        bits = code_bits(spec.bits, q.shape[-1], spec.curves)
        codes_q, codes_k = _codes(spec, q32, bits), _codes(spec, k32, bits)  # [S, B, H, N], [S, B, H, M]
        real = _real_keys(k, key_padding_mask)  # [B, 1, M]
        width = min(spec.k, spec.curves * spec.window + (spec.local if causal else 0))
        out = torch.full((*q.shape[:3], width), -1, dtype=torch.long, device=q.device)
        for rows, prefix in spec.blocks(q.shape[2], k.shape[2], causal):
            sorted_codes, order, n_valid = _sorted_prefix(codes_k, real, prefix)
            step = max(1, ROW_BUDGET // max(1, q.shape[0] * q.shape[1] * (spec.curves * spec.window + spec.local)))
            for start in range(rows.start, rows.stop, step):
                sub = slice(start, min(start + step, rows.stop))
                candidates = _window_candidates(sorted_codes, order, n_valid, codes_q[..., sub], spec.window)
                if causal and spec.local > 0:
                    candidates = torch.cat([candidates, _local_band(sub, prefix, spec.local, real, q.shape[1])], dim=-1)
                out[:, :, sub] = _nearest(q32[:, :, sub], k32, candidates, width, dedup=spec.curves > 1)
        return out


def select_keys_fused(spec: Zeta, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """``select_keys`` through the fused Triton kernel (``sparsefocus/kernels/zeta_select.py``):
    the same keys (ties to the smaller position), [B, Hq, N, K] int32, -1 for unused slots."""
    from sparsefocus.kernels.zeta_select import key_prefixes, zeta_select

    with torch.no_grad():
        bits = code_bits(spec.bits, q.shape[-1], spec.curves)
        chunk = spec.chunk_size(q.shape[2]) if causal else None
        # the keys' codes and sort first: the GPU sorts while the CPU issues the queries' codes
        width = code_width(bits, q.shape[-1], spec.curves)
        rows = spec.curves * k.shape[0] * k.shape[1]
        tagged = (
            key_padding_mask is None and width + (rows - 1).bit_length() <= CODE_BITS
        )  # one flat sort (no sentinels to keep last)
        codes_k = _codes(spec, upcast(k), bits, True, tagged)  # [S, B, Hk, M]
        prefixes = key_prefixes(codes_k, key_padding_mask, q.shape[2], chunk, SENTINEL, width if tagged else None, width)
        codes_q = _codes(spec, upcast(q), bits, True)  # [S, B, Hq, N]
        local = spec.local if causal else 0
        return zeta_select(
            q,
            k,
            codes_q,
            prefixes,
            key_padding_mask,
            width=min(spec.k, spec.curves * spec.window + local),
            window=spec.window,
            local=local,
            chunk=chunk,
        )


def _real_keys(k: Tensor, key_padding_mask: Tensor | None) -> Tensor:
    if key_padding_mask is None:
        return torch.ones(k.shape[0], 1, k.shape[2], dtype=torch.bool, device=k.device)
    return key_padding_mask[:, None, :]


def _sorted_prefix(codes_k: Tensor, real: Tensor, prefix: int) -> tuple[Tensor, Tensor, Tensor]:
    """Sort the codes of the first ``prefix`` keys, padded keys last (as SENTINEL).

    Returns sorted codes [S, B, H, P], positions in that order [S, B, H, P] and the number of
    real keys among them [B, 1] (the searchable length). Stable: equal codes keep position order.
    """
    codes = codes_k[..., :prefix].masked_fill(~real[None, ..., :prefix], SENTINEL)
    sorted_codes, order = torch.sort(codes, dim=-1, stable=True)
    return sorted_codes, order, real[..., :prefix].sum(-1)


def _window_candidates(sorted_codes: Tensor, order: Tensor, n_valid: Tensor, codes_q: Tensor, window: int) -> Tensor:
    """The ``window`` sorted keys around each query's insertion point, shifted at the ends.

    sorted_codes, order: [S, B, H, P]; n_valid: [B, 1]; codes_q: [S, B, H, R].
    Returns [B, H, R, S * window] key positions, -1 where the searchable list is shorter.
    """
    curves, batch, heads, rows = codes_q.shape
    if sorted_codes.shape[-1] == 0:
        return torch.full((batch, heads, rows, curves * window), -1, dtype=torch.long, device=codes_q.device)
    insert = torch.searchsorted(sorted_codes, codes_q.contiguous())  # [S, B, H, R]
    limit = n_valid[None, :, :, None]  # [1, B, 1, 1]
    start = torch.minimum((insert - window // 2).clamp_min(0), (limit - window).clamp_min(0))
    slots = start[..., None] + torch.arange(window, device=codes_q.device)  # [S, B, H, R, W]
    picked = torch.gather(order, -1, slots.clamp_max(order.shape[-1] - 1).flatten(-2)).view(slots.shape)
    picked = torch.where(slots < limit[..., None], picked, torch.full_like(picked, -1))
    return picked.permute(1, 2, 3, 0, 4).reshape(batch, heads, rows, curves * window)


def _local_band(rows: slice, chunk_start: int, local: int, real: Tensor, heads: int) -> Tensor:
    """[B, H, R, local] the most recent real keys i, i-1, ... inside the own chunk, -1 elsewhere."""
    position = torch.arange(rows.start, rows.stop, device=real.device)[:, None] - torch.arange(local, device=real.device)
    inside = position >= chunk_start  # [R, local]
    safe = position.clamp_min(0)
    is_real = real[:, 0][:, safe]  # [B, R, local]
    keep = inside[None] & is_real
    band = torch.where(keep, safe[None], torch.full_like(safe[None], -1))  # [B, R, local]
    return band[:, None].expand(-1, heads, -1, -1)


def _nearest(q: Tensor, k: Tensor, candidates: Tensor, width: int, dedup: bool) -> Tensor:
    """Keep the ``width`` candidates nearest to each query (with ``dedup``, repeats counted once;
    only several curves can propose a key twice); equal distances go to the smaller position.

    q: [B, H, R, D]; k: [B, Hk, M, D] with H % Hk == 0 (query head h reads key head h // (H // Hk),
    so keys need not be expanded, nor upcast beyond the candidates: the distances are in q's
    dtype); candidates: [B, H, R, C] (-1 unused) -> [B, H, R, width].
    """
    candidates, _ = candidates.sort(dim=-1)  # by position: the stable sort below then breaks ties by it
    if dedup:
        repeated = torch.zeros_like(candidates, dtype=torch.bool)
        repeated[..., 1:] = candidates[..., 1:] == candidates[..., :-1]
        candidates = torch.where(repeated, torch.full_like(candidates, -1), candidates)
    batch, heads, rows, count = candidates.shape
    per_kv = heads // k.shape[1] * rows * count  # explicit, not -1: an empty batch has no size to infer
    flat = candidates.clamp_min(0).reshape(batch, k.shape[1], per_kv, 1)  # [B, Hk, G*R*C, 1]: a kv head's query heads
    keys = torch.gather(k, 2, flat.expand(-1, -1, -1, k.shape[-1])).view(batch, heads, rows, count, k.shape[-1]).to(q.dtype)
    distance = (q[..., None, :] - keys).pow(2).sum(-1)  # [B, H, R, C]
    distance = distance.masked_fill(candidates < 0, float("inf"))
    if count < width:
        distance = torch.nn.functional.pad(distance, (0, width - count), value=float("inf"))
        candidates = torch.nn.functional.pad(candidates, (0, width - count), value=-1)
    best, slot = (x[..., :width] for x in distance.sort(dim=-1, stable=True))  # [B, H, R, width]
    chosen = torch.gather(candidates, -1, slot)
    return torch.where(torch.isinf(best), torch.full_like(chosen, -1), chosen)


def dense_selection(spec: Zeta, q: Tensor, k: Tensor, causal: bool, key_padding_mask: Tensor | None) -> Tensor:
    """The definition of ZETA's selection as dense [B, H, N, M] masks (small N only: O(N M^2)).

    Key j is a candidate of query i when, on some curve, its rank among the keys i may search
    (by code, then position) lies in the window of ``window`` ranks starting at
    clamp(p - window // 2, 0, max(n - window, 0)), p being the number of searchable keys whose
    code is below the query's and n the number of searchable keys; or when causal and j is one
    of the ``local`` positions i, i-1, ... of i's own chunk. The k nearest candidates are kept;
    among equal distances at the cut, the smaller positions.
    """
    with torch.no_grad():
        q32, k32 = upcast(q), expand_kv(upcast(k), q.shape[1])
        bits = code_bits(spec.bits, q.shape[-1], spec.curves)
        searchable, own_chunk = _dense_reach(spec, q.shape[2], k.shape[2], causal, _real_keys(k, key_padding_mask))
        candidate = torch.zeros(*q.shape[:3], k.shape[2], dtype=torch.bool, device=q.device)
        for code_q, code_k in zip(_codes(spec, q32, bits), _codes(spec, k32, bits)):
            candidate |= _dense_window(code_q, code_k, searchable, spec.window)
        if causal:
            query_pos = torch.arange(q.shape[2], device=q.device)[:, None]
            key_pos = torch.arange(k.shape[2], device=q.device)[None, :]
            candidate |= own_chunk & (key_pos <= query_pos) & (key_pos > query_pos - spec.local)
        distance = squared_distances(q32, k32).masked_fill(~candidate, float("inf"))  # [B, H, N, M]
        width = min(spec.k, k.shape[2])
        best, index = (x[..., :width] for x in distance.sort(dim=-1, stable=True))  # ties: smaller position
        keep = torch.zeros_like(candidate)
        keep.scatter_(-1, index, ~torch.isinf(best))
        return keep


def _dense_reach(spec: Zeta, n_queries: int, n_keys: int, causal: bool, real: Tensor) -> tuple[Tensor, Tensor]:
    """searchable [B, 1, N, M]: keys in earlier chunks (all keys if not causal), real only;
    own_chunk [B, 1, N, M]: real keys in the query's own chunk."""
    query_pos = torch.arange(n_queries, device=real.device)[:, None]
    key_pos = torch.arange(n_keys, device=real.device)[None, :]
    if causal:
        size = spec.chunk_size(n_queries)
        earlier = key_pos < (query_pos // size) * size
        same = (key_pos // size) == (query_pos // size)
    else:
        earlier = torch.ones(n_queries, n_keys, dtype=torch.bool, device=real.device)
        same = torch.zeros_like(earlier)
    return earlier & real[:, :, None, :], same & real[:, :, None, :]


def _dense_window(code_q: Tensor, code_k: Tensor, searchable: Tensor, window: int) -> Tensor:
    """[B, H, N, M] keys whose rank among the searchable keys falls in the query's window."""
    position = torch.arange(code_k.shape[-1], device=code_k.device)
    precedes = (code_k[..., :, None] < code_k[..., None, :]) | (
        (code_k[..., :, None] == code_k[..., None, :]) & (position[:, None] < position[None, :])
    )  # [B, H, M(j'), M(j)]: key j' sorts before key j
    rank = searchable.float() @ precedes.float()  # [B, H, N, M]: searchable keys sorting before j
    below = (searchable & (code_k[..., None, :] < code_q[..., :, None])).sum(-1, keepdim=True)  # [B, H, N, 1]
    count = searchable.sum(-1, keepdim=True)
    start = torch.minimum((below - window // 2).clamp_min(0), (count - window).clamp_min(0))
    return searchable & (rank >= start) & (rank < start + window)


def dense_cauchy_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Tensor,
    causal: bool,
    key_padding_mask: Tensor | None,
    gamma: Tensor | float,
    sink: Tensor | None = None,
) -> Tensor:
    """The definition of ZETA's weighting, dense, in fp32 (fp64 kept).

    o_i = (sum_{j in S_i} c_ij v_j + c_i* vbar_i) / (sum_{j in S_i} c_ij + c_i*), with
    c_ij = 1 / (||q_i - k_j||^2 + gamma^2), S_i the selected keys (mask [B, H, N, M]),
    kbar_i, vbar_i the mean of the real keys/values q_i may see (0..i when causal, all when not)
    and c_i* = 1 / (||q_i - kbar_i||^2 + gamma^2), or 0 when q_i may see no key (the row is then 0).
    With ``sink`` [H, D], c_is = 1 / (||q_i - sink||^2 + gamma^2) joins the denominator only (its
    value is 0). q: [B, H, N, D]; k: [B, H, M, D]; v: [B, H, M, Dv]; gamma: scalar, [H] or per
    batch row [B, H]; sink [H, D] or [B, H, D].
    Returns [B, H, N, Dv].
    """
    q, k, v = upcast(q), upcast(k), upcast(v)
    real = _real_keys(k, key_padding_mask)[:, :, None, :]  # [B, 1, 1, M]
    visible = real.expand(-1, -1, q.shape[2], -1)
    if causal:
        visible = visible & torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    count = visible.sum(-1, keepdim=True)  # [B, 1, N, 1]
    averaging = visible.to(q.dtype) / count.clamp_min(1)
    mean_k, mean_v = averaging @ k, averaging @ v  # [B, H, N, D], [B, H, N, Dv]
    gamma_sq = gamma_squared(gamma, q)
    weight = mask.to(q.dtype) / (squared_distances(q, k) + gamma_sq)  # [B, H, N, M]
    mean_weight = (count > 0).to(q.dtype) / ((q - mean_k).pow(2).sum(-1, keepdim=True) + gamma_sq)  # [B, H, N, 1]
    total = weight.sum(-1, keepdim=True) + mean_weight
    if sink is not None:
        total = total + 1 / ((q - sink_rows(upcast(sink))).pow(2).sum(-1, keepdim=True) + gamma_sq)
    total = torch.where(total > 0, total, torch.ones_like(total))
    return (weight @ v + mean_weight * mean_v) / total


def candidate_recall(
    q: Tensor,
    k: Tensor,
    pattern: "str | Zeta" = "zeta",
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    row_chunk: int | None = None,
) -> Tensor:
    """Fraction of each query's exact top-k keys (smallest ||q - k||^2 among all keys it may see:
    every real key, or every real key j <= i when causal) that ZETA's selection finds.

    The selection keeps the k nearest of its candidates, so this is also the recall of the
    candidate set. q: [B, Hq, N, D]; k: [B, Hk, M, D]. Returns [B, Hq, N] float32, NaN on rows
    that may see no key. Memory O(row_chunk * M D), row_chunk chosen to keep it near 2**24 by default.
    """
    spec = parse_pattern(pattern)
    if not isinstance(spec, Zeta):
        raise ValueError(f"candidate_recall needs a zeta pattern, got {spec}")
    with torch.no_grad():
        found = select_keys(spec, q, k, causal, key_padding_mask)  # [B, H, N, K]
        k32 = expand_kv(upcast(k), q.shape[1])
        real = _real_keys(k, key_padding_mask)[:, :, None, :]
        recall = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device)
        row_chunk = row_chunk or max(1, ROW_BUDGET // (q.shape[0] * q.shape[1] * k.shape[2] * q.shape[3]))
        for start in range(0, q.shape[2], row_chunk):
            rows = slice(start, min(start + row_chunk, q.shape[2]))
            distance = squared_distances(upcast(q[:, :, rows]), k32)  # [B, H, R, M]
            allowed = real.expand(-1, -1, rows.stop - rows.start, -1)
            if causal:
                key_pos = torch.arange(k.shape[2], device=q.device)
                allowed = allowed & (key_pos[None, :] <= torch.arange(rows.start, rows.stop, device=q.device)[:, None])
            best, exact = distance.masked_fill(~allowed, float("inf")).topk(min(spec.k, k.shape[2]), dim=-1, largest=False)
            exact = torch.where(torch.isinf(best), torch.full_like(exact, -2), exact)
            hit = (exact[..., :, None] == found[:, :, rows, None, :]).any(-1)  # [B, H, R, k]
            size = (exact >= 0).sum(-1)
            recall[:, :, rows] = hit.sum(-1).float() / size.clamp_min(1) + torch.where(size > 0, 0.0, float("nan"))
        return recall
