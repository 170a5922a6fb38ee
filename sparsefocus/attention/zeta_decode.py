"""ZETA's decoding cache: one new query per step without re-sorting the keys.

A causal ZETA call over M keys lets query i search the Z-order-sorted keys before its chunk,
``[0, p)`` with p = floor(i / s) * s and s = ceil(M / chunks), plus a band of the ``local`` most
recent keys of its own chunk and the mean of keys 0..i (``zeta.select_keys``, ``Zeta._attend``).
Decoding defines the new token's output as the last row of that call over all M keys
(``decode.py``). For the last row p only grows with M, so ``ZetaCache`` keeps, besides the keys
and values, the Morton codes of the searchable keys ``[0, p)`` sorted in runs, and the sums of
all keys and values; the other M - 1 rows are never computed.

Costs of a step (S curves, W = window, K kept keys, R <= log2(M) + 1 runs):

- Keys and values live in capacity buffers [B, Hk, capacity, *] written in place at position M;
  a full buffer doubles, so copies are amortised O(1) positions per step (one step in about M
  copies all M). A step from a cache while a longer cache on the same buffers is still alive
  (a branch) copies the M positions instead of overwriting what that cache reads.
- The searchable keys are held as sorted runs whose sizes are the set bits of p, oldest and
  largest first (a binary counter). Keys entering the prefix (fewer than one per step on
  average) are added as the counter adds: the runs below the highest bit that changes merge
  with them into one run, each merge moving each of its keys once with one binary search. A
  key's run at least doubles with each merge, so a step moves amortised O(log M) codes per
  curve and kv head; the worst step, when p's top bit changes, merges all p.
- The query searches each run once (O(R log M)), gathers W candidates per run, sorts those R W
  candidates (O(R W log(R W)) per query head and curve) and takes the same window that one
  sorted array of the p codes gives; then it ranks the S W + local candidates by exact distance
  and attends over the K kept keys gathered from the cache and the running mean (O(K D)).

Beyond the buffer growth, a branch's copy and the run merges above, a step reads, copies or
upcasts nothing of size M. It launches O(R) small kernels (about ten per run). The sizes (M,
p, run sizes, capacity) are Python ints known from the shapes, so a step never reads a device
value on the host.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
from torch import Tensor

from sparsefocus.attention.common import gather_keys, indexed_attention_ref, upcast
from sparsefocus.attention.zeta import SENTINEL, Zeta, _codes, _local_band, _nearest, code_bits

MIN_CAPACITY = 16  # positions the smallest buffers hold


class KVBuffers:
    """Keys [B, Hk, capacity, D] and values [B, Hk, capacity, Dv] shared by the caches of one
    decoding line; each cache reads its first ``length`` positions.

    A position may be written while it fits and no live cache reads it, so no cache ever sees
    a write: a cache its caller dropped no longer counts (stepping again from an earlier cache
    after dropping the later ones writes in place), one still held makes the step copy. The
    check looks at each live cache of the buffers once per step.
    """

    def __init__(self, key: Tensor, value: Tensor) -> None:
        self.key, self.value = key, value
        self._readers: list[tuple[weakref.ReferenceType, int]] = []

    @classmethod
    def holding(cls, k: Tensor, v: Tensor, capacity: int) -> KVBuffers:
        """New buffers of ``capacity`` positions whose first M hold k [B, Hk, M, D], v [B, Hk, M, Dv]."""
        key = k.new_empty(*k.shape[:2], capacity, k.shape[-1])
        value = v.new_empty(*v.shape[:2], capacity, v.shape[-1])
        key[:, :, : k.shape[2]], value[:, :, : v.shape[2]] = k, v
        return cls(key, value)

    @property
    def capacity(self) -> int:
        return self.key.shape[2]

    def add_reader(self, cache: ZetaCache) -> None:
        self._readers.append((weakref.ref(cache), cache.length))

    def writable(self, position: int) -> bool:
        """Whether ``position`` fits and no live cache reads it."""
        self._readers = [(ref, length) for ref, length in self._readers if ref() is not None]
        return position < self.capacity and all(length <= position for _, length in self._readers)


@dataclass(frozen=True)
class SortedRun:
    """Keys of consecutive positions sorted by code: codes [S, B, Hk, L] ascending on each of the
    S curves (equal codes by position) and the keys' positions in that order, [S, B, Hk, L]."""

    codes: Tensor
    order: Tensor

    @property
    def size(self) -> int:
        return self.codes.shape[-1]


@dataclass(frozen=True, eq=False)
class ZetaCache:
    """A ZETA layer's KV cache after M positions; it reads as ``(k, v)`` like a plain cache.

    buffers: the capacity buffers (``KVBuffers``), shared with the caches before and after this
    one; length: M; runs: the searchable keys 0..P-1 as sorted runs, one per set bit of P,
    largest (oldest) first, the run of size 2**j covering the positions its place in P's
    binary expansion gives; key_sum [B, Hk, 1, D], value_sum [B, Hk, 1, Dv]: sums over all M
    positions in the compute dtype (fp32, or fp64 for fp64 inputs).

    ``k`` and ``v`` are views of the buffers' first M positions. A step returns a cache that may
    share the buffers with the one passed in (as HF's static caches share theirs) but, unlike
    those, never writes a position that a live cache reads: a cache, and its views while it is
    alive, keep their values. Clone a view to keep it after its cache is dropped.
    """

    buffers: KVBuffers
    length: int
    runs: tuple[SortedRun, ...]
    key_sum: Tensor
    value_sum: Tensor

    def __post_init__(self) -> None:
        self.buffers.add_reader(self)

    @property
    def k(self) -> Tensor:
        """[B, Hk, M, D], a view of the key buffer."""
        return self.buffers.key[:, :, : self.length]

    @property
    def v(self) -> Tensor:
        """[B, Hk, M, Dv], a view of the value buffer."""
        return self.buffers.value[:, :, : self.length]

    def __getitem__(self, index: int) -> Tensor:
        return (self.k, self.v)[index]

    def __len__(self) -> int:
        return 2

    @property
    def capacity(self) -> int:
        """Positions the buffers hold before the next growth."""
        return self.buffers.capacity

    @property
    def prefix(self) -> int:
        """P: how many leading keys the sorted runs hold."""
        return sum(run.size for run in self.runs)

    @property
    def sorted_codes(self) -> Tensor:
        """[S, B, Hk, P] the codes of keys 0..P-1 in ascending order, equal codes by position (the
        runs merged: O(P log P), for inspection; [0, B, Hk, 0] when P = 0)."""
        return self._merged()[0]

    @property
    def order(self) -> Tensor:
        """[S, B, Hk, P] the positions of ``sorted_codes``."""
        return self._merged()[1]

    def _merged(self) -> tuple[Tensor, Tensor]:
        if not self.runs:
            empty = self.key_sum.new_empty((0, *self.key_sum.shape[:2], 0), dtype=torch.long)
            return empty, empty
        # the runs lie in position order, so a stable sort keeps equal codes by position
        codes = torch.cat([run.codes for run in self.runs], dim=-1)
        sorted_codes, slot = torch.sort(codes, dim=-1, stable=True)
        return sorted_codes, torch.cat([run.order for run in self.runs], dim=-1).gather(-1, slot)


def searchable_prefix(spec: Zeta, n_keys: int) -> int:
    """p of the last query of a causal call over ``n_keys`` keys: the start of its chunk."""
    size = spec.chunk_size(n_keys)
    return ((n_keys - 1) // size) * size


def start_cache(spec: Zeta, k: Tensor, v: Tensor, capacity: int | None = None) -> ZetaCache:
    """The cache after a causal call over k [B, Hk, M, D], v [B, Hk, M, Dv] (a prefill).

    k and v are copied into buffers of ``capacity`` positions (at least M). Default: the
    smallest power of two above M, and at least ``MIN_CAPACITY``."""
    length = k.shape[2]
    capacity = max(MIN_CAPACITY, 1 << length.bit_length()) if capacity is None else capacity
    if capacity < length:
        raise ValueError(f"zeta start_cache: capacity {capacity} is below the {length} positions given")
    k32 = upcast(k)
    prefix = searchable_prefix(spec, length) if length else 0
    codes = _codes(spec, k32[:, :, :prefix], code_bits(spec.bits, k.shape[-1], spec.curves))  # [S, B, Hk, P]
    key_sum, value_sum = k32.sum(2, keepdim=True), upcast(v).sum(2, keepdim=True)
    return ZetaCache(KVBuffers.holding(k, v, capacity), length, _block_runs(codes, 0), key_sum, value_sum)


def _sorted_run(codes: Tensor, first: int) -> SortedRun:
    """The run of the keys first..first+n-1 from their codes [S, B, Hk, n]."""
    sorted_codes, rank = torch.sort(codes.contiguous(), dim=-1, stable=True)
    return SortedRun(sorted_codes.contiguous(), (rank + first).contiguous())


def _block_runs(codes: Tensor, first: int) -> tuple[SortedRun, ...]:
    """The runs of the keys first..first+n-1 (codes [S, B, Hk, n], first a multiple of a power of
    two above n): one per set bit of n, largest first, each sorted on its own."""
    runs, start = [], 0
    for bit in reversed(range(codes.shape[-1].bit_length())):
        size = 1 << bit
        if codes.shape[-1] & size:
            runs.append(_sorted_run(codes[..., start : start + size], first + start))
            start += size
    return tuple(runs)


def _merge(older: SortedRun, newer: SortedRun) -> SortedRun:
    """One run from two, ``older`` holding the smaller positions, so that among equal codes its
    keys come first: each key's slot is its rank in its run plus the keys of the other run
    before it (one binary search per key, no sort)."""
    old_slot = torch.arange(older.size, device=older.codes.device) + torch.searchsorted(newer.codes, older.codes)
    new_slot = torch.arange(newer.size, device=newer.codes.device) + torch.searchsorted(older.codes, newer.codes, right=True)
    codes = older.codes.new_empty(*older.codes.shape[:-1], older.size + newer.size)  # [S, B, Hk, L_old + L_new]
    order = older.order.new_empty(codes.shape)
    codes.scatter_(-1, old_slot, older.codes).scatter_(-1, new_slot, newer.codes)
    order.scatter_(-1, old_slot, older.order).scatter_(-1, new_slot, newer.order)
    return SortedRun(codes, order)


def _runs_after(runs: tuple[SortedRun, ...], codes: Tensor, first: int, prefix: int) -> tuple[SortedRun, ...]:
    """The runs of keys 0..prefix-1 from those of keys 0..first-1 and the codes [S, B, Hk, n] of
    keys first..prefix-1, as a binary counter adds n: let 2**j be the highest bit where first and
    prefix differ; the runs above it stay, those below it and the new keys up to the next
    multiple of 2**j merge into one run of 2**j keys, and the remaining new keys form the runs
    of prefix's bits below j. Old runs are never written (an earlier cache still reads them)."""
    top = (first ^ prefix).bit_length() - 1
    kept = tuple(run for run in runs if run.size > 1 << top)
    end = (prefix >> top) << top  # where the merged run of 2**top keys ends
    merged = _sorted_run(codes[..., : end - first], first)
    for run in reversed(runs[len(kept) :]):  # youngest (smallest) first: the merged run grows geometrically
        merged = _merge(run, merged)
    return (*kept, merged, *_block_runs(codes[..., end - first :], end))


def decode_step(
    spec: Zeta,
    q: Tensor,
    k_new: Tensor,
    v_new: Tensor,
    cache: ZetaCache,
    params: dict | None = None,
    *,
    kernel: str = "auto",
) -> tuple[Tensor, ZetaCache]:
    """The output [B, Hq, 1, Dv] of the query q [B, Hq, 1, D] at position M - 1 for the new key
    and value k_new [B, Hk, 1, D], v_new [B, Hk, 1, Dv], and the updated cache.

    Equals ``sparse_attention(q, k, v, spec, causal=True)[:, :, -1:]`` over all M keys (the
    lean path's selection, then Cauchy attention over the chosen keys and the mean). No key
    padding. ``kernel``: "reference" (``indexed_attention_ref``), "triton" (the fused indexed
    kernel) or "auto" (triton on CUDA). Default: "auto". The returned cache may share buffers
    with ``cache``, which keeps reading its own M - 1 positions (``ZetaCache``)."""
    _check_step(q, k_new, v_new, cache, kernel)
    triton = kernel == "triton" or (kernel == "auto" and q.is_cuda)  # fused kernels: codes, attention
    n_keys = cache.length + 1
    buffers = _appended(cache.buffers, cache.length, k_new, v_new)
    k, v = buffers.key[:, :, :n_keys], buffers.value[:, :, :n_keys]  # [B, Hk, M, *] views
    bits = code_bits(spec.bits, q.shape[-1], spec.curves)
    prefix, runs = searchable_prefix(spec, n_keys), cache.runs
    if prefix > cache.prefix:
        entering = _codes(spec, upcast(k[:, :, cache.prefix : prefix]), bits, fused=triton)  # [S, B, Hk, n]
        runs = _runs_after(runs, entering, cache.prefix, prefix)
    key_sum, value_sum = cache.key_sum + upcast(k_new), cache.value_sum + upcast(v_new)
    index = _selection(spec, q, k, runs, prefix, bits, triton)  # [B, Hq, 1, K]
    mean_k, mean_v = (key_sum / n_keys).to(k.dtype), (value_sum / n_keys).to(v.dtype)  # [B, Hk, 1, *]
    keys, values, slots = _gathered(k, v, index)
    present = torch.ones(q.shape[0], 1, 1, dtype=torch.bool, device=q.device)
    attend = indexed_attention_ref
    if triton:
        from sparsefocus.kernels.indexed import indexed_attention as attend  # type: ignore[assignment]
    out = attend(
        q,
        keys,
        values,
        slots,
        score="cauchy",
        gamma=spec.gamma_of(params),
        extra_key=mean_k,
        extra_value=mean_v,
        extra_mask=present,
        sink_key=spec.sink_of(params, q.shape[1], q.shape[-1], q.device),
    )
    return out, ZetaCache(buffers, n_keys, runs, key_sum, value_sum)


def _check_step(q: Tensor, k_new: Tensor, v_new: Tensor, cache: ZetaCache, kernel: str) -> None:
    if kernel not in ("auto", "reference", "triton"):
        raise ValueError(f"zeta decode_step: kernel must be auto, reference or triton, got {kernel!r}")
    if q.shape[2] != 1 or k_new.shape[2] != 1:
        raise ValueError(f"zeta decode_step takes one new position, got {q.shape[2]} queries and {k_new.shape[2]} keys")
    key, value = cache.buffers.key, cache.buffers.value
    for name, new, buffer in (("k_new", k_new, key), ("v_new", v_new, value)):
        want = (*buffer.shape[:2], 1, buffer.shape[-1])
        if tuple(new.shape) != want:  # the in-place write would broadcast a mismatch silently
            raise ValueError(f"zeta decode_step: {name} must be {list(want)} like the cache, got {list(new.shape)}")


def _appended(buffers: KVBuffers, length: int, k_new: Tensor, v_new: Tensor) -> KVBuffers:
    """Buffers holding the ``length`` positions of ``buffers`` and then k_new, v_new: the same
    buffers, written in place, when position ``length`` is free (``KVBuffers.writable``), else
    new ones with the positions copied, of twice the capacity when full."""
    if not buffers.writable(length):
        capacity = buffers.capacity if length < buffers.capacity else max(2 * buffers.capacity, MIN_CAPACITY)
        buffers = KVBuffers.holding(buffers.key[:, :, :length], buffers.value[:, :, :length], capacity)
    buffers.key[:, :, length : length + 1] = k_new
    buffers.value[:, :, length : length + 1] = v_new
    return buffers


def _selection(spec: Zeta, q: Tensor, k: Tensor, runs: tuple[SortedRun, ...], prefix: int, bits: int, fused: bool) -> Tensor:
    """``select_keys``' row for the last query: window candidates of each curve around the
    query's code among the first ``prefix`` keys, the local band, the nearest ``width``.
    ``fused``: the query's codes from the Morton kernel (the same fp32 operations, one launch)."""
    batch, heads = q.shape[0], q.shape[1]
    curves, kv_heads = spec.curves, k.shape[1]
    q32 = upcast(q)
    codes_q = _codes(spec, q32, bits, fused=fused)  # [S, B, Hq, 1]
    codes_q = codes_q.reshape(curves, batch, kv_heads, heads // kv_heads)  # [S, B, Hk, G]: a kv head's queries
    windows = _run_windows(runs, codes_q, prefix, spec.window)  # [S, B, Hk, G, W]
    candidates = windows.permute(1, 2, 3, 0, 4).reshape(batch, heads, 1, curves * spec.window)
    n_keys = k.shape[2]
    if spec.local > 0:
        real = torch.ones((), dtype=torch.bool, device=q.device).expand(batch, 1, n_keys)  # no key padding: a view, not M bools
        band = _local_band(slice(n_keys - 1, n_keys), prefix, spec.local, real, heads)  # [B, Hq, 1, local]
        candidates = torch.cat([candidates, band], dim=-1)
    width = min(spec.k, spec.curves * spec.window + spec.local)
    return _nearest(q32, k, candidates, width, dedup=spec.curves > 1)  # gathers the candidates of the kv heads only


def _run_windows(runs: tuple[SortedRun, ...], codes_q: Tensor, prefix: int, window: int) -> Tensor:
    """``zeta._window_candidates`` over the one sorted array of the runs' ``prefix`` keys, from
    the runs: codes_q [S, B, Hk, G] -> [S, B, Hk, G, W] key positions, -1 past the prefix.

    The window holds the ranks [start, start + W) with start = clamp(insert - W // 2, 0,
    max(prefix - W, 0)) and insert the number of codes below the query's: its ``before`` =
    insert - start <= W keys below the query's code are the largest of those in the runs and
    the rest the smallest of those not below. So W slots of each run starting ``before`` below
    the query's insertion point in that run hold them all; sorted by (code, position), they
    put rank r at ``r - insert`` places after the last candidate below the query's code."""
    if not runs:
        return torch.full((*codes_q.shape, window), -1, dtype=torch.long, device=codes_q.device)
    codes_q = codes_q.contiguous()
    inserts = [torch.searchsorted(run.codes, codes_q) for run in runs]  # [S, B, Hk, G] codes below the query's, per run
    insert = sum(inserts[1:], inserts[0])
    start = (insert - window // 2).clamp(0, max(prefix - window, 0))
    codes, order = _run_candidates(runs, inserts, insert - start, window)  # [S, B, Hk, G, R*W]
    ranked, by_rank = torch.sort(codes, dim=-1, stable=True)  # runs in position order: ties stay by position
    below = (ranked < codes_q[..., None]).sum(-1, keepdim=True)  # [S, B, Hk, G, 1] candidates below the query's code
    offsets = torch.arange(window, device=codes_q.device)
    slot = (below - (insert - start)[..., None] + offsets).clamp(0, codes.shape[-1] - 1)  # [S, B, Hk, G, W]
    picked = order.gather(-1, by_rank.gather(-1, slot))
    return torch.where(start[..., None] + offsets < prefix, picked, torch.full_like(picked, -1))


def _run_candidates(runs: tuple[SortedRun, ...], inserts: list[Tensor], before: Tensor, window: int) -> tuple[Tensor, Tensor]:
    """Codes and positions [S, B, Hk, G, R * W] of the W slots of each run from its insertion
    point [S, B, Hk, G] minus ``before``; slots outside a run get code SENTINEL (above every
    code, so they sort last and are never taken)."""
    offsets = torch.arange(window, device=before.device)
    codes, order = [], []
    for run, at in zip(runs, inserts):
        slots = (at - before)[..., None] + offsets  # [S, B, Hk, G, W]
        inside = (slots >= 0) & (slots < run.size)
        safe = slots.clamp(0, run.size - 1).flatten(-2)  # [S, B, Hk, G*W]
        codes.append(run.codes.gather(-1, safe).view(slots.shape).masked_fill(~inside, SENTINEL))
        order.append(run.order.gather(-1, safe).view(slots.shape))
    return torch.cat(codes, dim=-1), torch.cat(order, dim=-1)


def _gathered(k: Tensor, v: Tensor, index: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """The kept keys [B, Hk, G*K, D] and values [B, Hk, G*K, Dv] of index [B, Hq, 1, K] (-1 unused)
    and the index [B, Hq, 1, K] into them, query head h reading kv head h // G as before: the
    attention then reads K rows per query head, where the kernels would make the M-row cache
    contiguous and the reference upcast it whole."""
    batch, heads, _, width = index.shape
    group = heads // k.shape[1]
    safe = index.clamp_min(0)
    rows = (batch, k.shape[1], group * width)  # gather_keys' [B, Hq, 1, K, *] read as kv-head rows
    keys, values = gather_keys(k, safe).reshape(*rows, k.shape[-1]), gather_keys(v, safe).reshape(*rows, v.shape[-1])
    local = torch.arange(heads * width, device=index.device).view(1, heads, 1, width) % (group * width)  # g * K + j
    return keys, values, torch.where(index >= 0, local, torch.full_like(local, -1))
