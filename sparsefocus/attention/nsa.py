"""Native Sparse Attention (NSA, Yuan et al. 2025): three gated branches over one set of q, k, v.

* compression: keys and values are summarised over blocks of ``cmp`` positions taken every
  ``stride`` positions (mean pooling, or a learned MLP); compressed key j sits at the last
  position it summarises, j * stride + cmp - 1, and a query sees it once that position is past.
* selection: the key blocks of ``block`` positions are scored by the compressed attention
  probabilities, summed over the query heads of a GQA group and over the compressed keys that
  start inside the block; each (position, kv group) keeps the ``top`` best blocks, counting the
  ``initial`` first blocks and the ``local`` blocks ending at its own, which are always kept.
* sliding window: the last ``window`` keys.

out = g_cmp * o_cmp + g_slc * o_slc + g_swa * o_swa, the gates per (head, position) a sigmoid of
a linear map of the layer's input x (the layer owns the weights; without them every gate is
sigmoid(0) = 1/2). The selection itself has no gradient (it is discrete); the compressed branch
trains the compression. The Triton path runs all three branches on the block-sparse kernel.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from sparsefocus.attention.common import (
    apply_key_padding,
    causal_row_mask,
    dense_masked_attention,
    expand_kv,
    grouped_linear,
    row_slice,
    rows_of_groups,
    upcast,
)
from sparsefocus.attention.patterns import HIDDEN_KEY, Pattern, register, require
from sparsefocus.kernels._ops import top_positions

POOLS = ("mean", "mlp")
BRANCHES = 3  # compression, selection, sliding window
QUERY_TILE = 64  # query tile of the compressed and window branches in the kernel
KEY_TILE = 64  # compressed keys per listed block of the compressed branch; window branch block
SCORE_ELEMENTS = 2**26  # largest [B, Hq, rows, Nc] chunk of the selection scores
RECOMPUTE_MIN_BYTES = 2**25
"""The compressed and window branches are recomputed in the backward (not saved) when q holds at
least this many bytes (32 MiB: B=4, 16 heads, N=4096, D=64 in bf16); smaller calls, such as the
laboratory's 600-token one-head model, save them: recomputing costs two more kernel calls and the
checkpoint's bookkeeping a layer, to save little memory."""
SELECTION_TILES = (0, 16, 32)  # the selection branch's kernel tiles: group tiles, or query tiles with row masks


def compressed_count(n: int, cmp: int, stride: int) -> int:
    """Number of complete compression windows over n positions."""
    return 0 if n < cmp else (n - cmp) // stride + 1


def compress(
    x: Tensor, real: Tensor | None, cmp: int, stride: int, mlp: tuple[Tensor, ...] | None
) -> tuple[Tensor, Tensor | None]:
    """Summaries of x [B, Hk, N, X] over windows of cmp positions every stride -> ([B, Hk, Nc, X], real [B, Nc] or None).

    Mean pooling averages the real positions of a window. With ``mlp = (pos [cmp, X], w1
    [cmp X, X], b1 [X], w2 [X, X])`` (or each with a leading dim of groups of batch rows, as
    ``grouped_linear`` takes them) the summary is the mean plus W2 gelu(W1 flatten(x + pos)) over
    the window (padded positions zeroed), so a zero W2 starts from mean pooling."""
    n_cmp = compressed_count(x.shape[2], cmp, stride)
    if n_cmp == 0:
        return x[:, :, :0], None if real is None else real[:, :0]
    span = (n_cmp - 1) * stride + cmp
    cmp_real = None
    if real is not None:
        # Padded positions are zeroed before the windows are cut, not in them: Inductor's CPU code
        # (torch 2.13) for the backward of a product of two unfolded tensors wrote out of bounds.
        x = x * real[:, None, :, None].to(x.dtype)
    windows = x[:, :, :span].unfold(2, cmp, stride).transpose(-1, -2)  # [B, Hk, Nc, cmp, X]
    if real is None:
        mean = windows.mean(-2)
    else:
        count = real[:, None, :span].unfold(2, cmp, stride).sum(-1, keepdim=True).to(x.dtype)  # [B, 1, Nc, 1]
        mean = windows.sum(-2) / count.clamp_min(1)
        cmp_real = count[:, 0, :, 0] > 0  # [B, Nc]
    if mlp is None:
        return mean, cmp_real
    pos, w1, b1, w2 = (t.to(x.dtype) for t in mlp)
    pos = pos if pos.dim() == 2 else rows_of_groups(pos, x.shape[0])[:, None, None]  # [cmp, X] or [B, 1, 1, cmp, X]
    flat = (windows + pos).flatten(-2)  # [B, Hk, Nc, cmp * X]
    return mean + grouped_linear(F.gelu(grouped_linear(flat, w1, b1)), w2), cmp_real


def group_probabilities(q, ck, lse, cmp_real, rows, cmp, stride, causal, scale) -> Tensor:
    """[B, Hk, R, Nc] compressed attention probabilities of the rows summed over each GQA group
    (the slow twin of ``kernels.block_sparse.compressed_importance``): q [B, Hq, R, D], lse [B, Hq, R]."""
    batch, q_heads, n_rows, dim = q.shape
    kv_heads, n_cmp = ck.shape[1], ck.shape[2]
    grouped = upcast(q).reshape(batch, kv_heads, q_heads // kv_heads, n_rows, dim)
    scores = torch.matmul(grouped, upcast(ck)[:, :, None].transpose(-1, -2)) * scale  # [B, Hk, G, R, Nc]
    lse = lse.reshape(batch, kv_heads, q_heads // kv_heads, n_rows, 1)
    visible = compressed_visible(rows, n_cmp, cmp, stride, causal, q.device)  # [R, Nc]
    if cmp_real is not None:
        visible = visible & cmp_real[:, None, None, None, :]
    return torch.where(visible & torch.isfinite(lse), torch.exp(scores - lse), torch.zeros_like(scores)).sum(2)


def compressed_visible(rows: slice, n_cmp: int, cmp: int, stride: int, causal: bool, device: torch.device) -> Tensor:
    """[R, Nc] bool: query i sees compressed key j iff j * stride + cmp - 1 <= i (always, not causal)."""
    if not causal:
        return torch.ones(rows.stop - rows.start, n_cmp, dtype=torch.bool, device=device)
    ends = torch.arange(n_cmp, device=device) * stride + cmp - 1
    return ends[None, :] <= torch.arange(rows.start, rows.stop, device=device)[:, None]


@register
@dataclass(frozen=True)
class NSA(Pattern):
    """``nsa:block=64,top=16,cmp=32,stride=16,window=512,pool=mean|mlp,initial=1,local=2,tile=0``.

    ``block`` selection block length, ``top`` selected blocks per (position, kv group) counting the
    forced ones (``top == initial + local`` leaves nothing to choose by score except where the
    forced blocks coincide, near the start), ``cmp``/``stride`` compression window and step (both
    divide ``block``; stride divides cmp), ``window`` sliding-window length (0: no window branch),
    ``pool`` compression.
    ``tile`` only changes how the Triton path runs the selection branch, not what it computes:
    0 = a kernel tile per (position, kv group), the group's query heads as its rows (NSA's own
    layout, padded to 16 rows when the group is smaller); 16 or 32 = a tile of that many
    consecutive positions of one query head over the union of their selected blocks, each row
    masked to its own (no padding rows, for groups below 16).
    """

    block: int = 64
    top: int = 16
    cmp: int = 32
    stride: int = 16
    window: int = 512
    pool: str = "mean"
    initial: int = 1
    local: int = 2
    tile: int = 0
    name: ClassVar[str] = "nsa"
    positional: ClassVar[tuple[str, ...]] = ("block", "top")
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")
    needs_hidden: ClassVar[bool] = True
    expands_kv: ClassVar[bool] = False
    run_params: ClassVar[bool] = True
    examples: ClassVar[tuple[str, ...]] = (
        "nsa:block=8,top=3,cmp=4,stride=2,window=6",
        "nsa:block=8,top=2,cmp=8,stride=8,window=0,local=1",
    )
    cost: ClassVar[tuple[str, str]] = ("O(N (N/stride + top block + window) D)", "O(N top) lists")

    def validate(self) -> None:
        for field in ("block", "top", "cmp", "stride"):
            require(getattr(self, field) >= 1, f"nsa: {field} must be >= 1, got {getattr(self, field)}")
        require(
            self.cmp % self.stride == 0 and self.block % self.stride == 0,
            f"nsa: stride ({self.stride}) must divide cmp ({self.cmp}) and block ({self.block})",
        )
        require(self.pool in POOLS, f"nsa: pool must be one of {', '.join(POOLS)}, got {self.pool!r}")
        require(
            self.window >= 0 and self.initial >= 0 and self.local >= 1,
            f"nsa: window, initial must be >= 0 and local >= 1, got {self.window}, {self.initial}, {self.local}",
        )
        require(self.tile in SELECTION_TILES, f"nsa: tile must be one of {SELECTION_TILES}, got {self.tile}")
        require(
            self.top >= self.initial + self.local,
            f"nsa: top ({self.top}) must count the initial ({self.initial}) and local ({self.local}) blocks",
        )

    def make_layer_parameters(self, dim: int, num_heads: int, kv_heads: int, qk_dim: int, v_dim: int) -> dict[str, nn.Parameter]:
        """Gates ``nsa_gate_weight`` [dim, 3 Hq] and ``nsa_gate_bias`` [3 Hq] (zero: every gate 1/2);
        with pool=mlp the compression MLPs ``nsa_{k,v}_{pos,w1,b1,w2}`` (W2 zero: mean pooling at start)."""
        params = {
            "nsa_gate_weight": nn.Parameter(torch.zeros(dim, BRANCHES * num_heads)),
            "nsa_gate_bias": nn.Parameter(torch.zeros(BRANCHES * num_heads)),
        }
        if self.pool == "mlp":
            for name, width in (("k", qk_dim), ("v", v_dim)):
                params[f"nsa_{name}_pos"] = nn.Parameter(torch.randn(self.cmp, width) * 0.02)
                params[f"nsa_{name}_w1"] = nn.Parameter(torch.randn(self.cmp * width, width) / math.sqrt(self.cmp * width))
                params[f"nsa_{name}_b1"] = nn.Parameter(torch.zeros(width))
                params[f"nsa_{name}_w2"] = nn.Parameter(torch.zeros(width, width))
        return params

    @property
    def folds_params(self) -> bool:
        """The gates and the compression MLP take per-row or per-run weights (``grouped_linear``)."""
        return True

    def _mlp(self, params: dict | None, name: str) -> tuple[Tensor, ...] | None:
        if self.pool == "mean":
            return None
        keys = [f"nsa_{name}_{part}" for part in ("pos", "w1", "b1", "w2")]
        if params is None or any(key not in params for key in keys):
            raise ValueError(f"nsa with pool=mlp needs params {', '.join(keys)} (make them with make_layer_parameters)")
        return tuple(params[key] for key in keys)

    def compressed(
        self, k: Tensor, v: Tensor, key_padding_mask: Tensor | None, params: dict | None
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """(compressed keys [B, Hk, Nc, D], values [B, Hk, Nc, Dv], real [B, Nc] or None)."""
        ck, real = compress(k, key_padding_mask, self.cmp, self.stride, self._mlp(params, "k"))
        cv, _ = compress(v, key_padding_mask, self.cmp, self.stride, self._mlp(params, "v"))
        return ck, cv, real

    def gates(self, q: Tensor, params: dict | None) -> Tensor:
        """[B, Hq, N, 3] branch gates: sigmoid(x W + b) from the layer's input, or 1/2 without weights."""
        if params is None or "nsa_gate_weight" not in params:
            return torch.full((1, 1, 1, BRANCHES), 0.5, device=q.device, dtype=torch.float32)
        hidden = params.get(HIDDEN_KEY)
        if hidden is None:
            raise ValueError(f"nsa gates need the layer's input x as params[{HIDDEN_KEY!r}] [B, N, dim]")
        weight, bias = (params[name].to(hidden.dtype) for name in ("nsa_gate_weight", "nsa_gate_bias"))
        logits = grouped_linear(hidden, weight, bias)
        gates = torch.sigmoid(logits.float()).view(*hidden.shape[:2], BRANCHES, q.shape[1])  # [B, N, 3, Hq]
        return gates.permute(0, 3, 1, 2)  # [B, Hq, N, 3]

    def selected_blocks(
        self, q: Tensor, ck: Tensor, lse: Tensor, cmp_real: Tensor | None, causal: bool, scale: float, fused: bool = False
    ) -> Tensor:
        """[B, Hk, N, top] int32 selected block ids per (position, kv group); -1 unused. No gradient.

        Block b's importance for query i is sum over the group's heads h and the compressed keys j
        starting in b of exp(scale q_h . c_j - lse_h(i)), the compressed attention probability.
        ``fused``: the group sums come from the Triton kernel ``compressed_importance``."""
        with torch.no_grad():
            batch, q_heads, n, _ = q.shape
            n_cmp = ck.shape[2]
            n_blocks = -(-n // self.block)
            chunk = max(1, SCORE_ELEMENTS // max(1, batch * q_heads * max(n_cmp, 1)))
            parts = []
            for start in range(0, n, chunk):
                rows = row_slice(n, start, start + chunk)
                importance = self._importance(q, ck, lse, cmp_real, rows, causal, scale, n_blocks, fused)
                parts.append(self._top_blocks(importance, rows, causal, n_blocks))
            return torch.cat(parts, dim=2).to(torch.int32)  # [B, Hk, N, top]

    def _importance(self, q, ck, lse, cmp_real, rows, causal, scale, n_blocks, fused) -> Tensor:
        """[B, Hk, R, nb] summed compressed probabilities of each selection block for the rows."""
        batch = q.shape[0]
        kv_heads, n_cmp, n_rows = ck.shape[1], ck.shape[2], rows.stop - rows.start
        per_block = self.block // self.stride
        if n_cmp == 0:
            return q.new_zeros(batch, kv_heads, n_rows, n_blocks, dtype=torch.float32)
        if fused:
            from sparsefocus.kernels.block_sparse import compressed_importance

            probs = compressed_importance(
                q, ck, lse, cmp_real, rows, scale=scale, stride=self.stride, cmp=self.cmp, causal=causal
            )
        else:
            probs = group_probabilities(q[:, :, rows], ck, lse[:, :, rows], cmp_real, rows, self.cmp, self.stride, causal, scale)
        probs = F.pad(probs, (0, n_blocks * per_block - n_cmp))  # [B, Hk, R, nb * per_block]
        return probs.view(batch, kv_heads, n_rows, n_blocks, per_block).sum(-1)

    def _top_blocks(self, importance: Tensor, rows: slice, causal: bool, n_blocks: int) -> Tensor:
        """[B, Hk, R, top] ids of the forced blocks and then the best others; -1 where none is left."""
        own = (torch.arange(rows.start, rows.stop, device=importance.device) // self.block)[:, None]  # [R, 1]
        block_id = torch.arange(n_blocks, device=importance.device)[None, :]
        forced = (block_id < self.initial) | ((block_id <= own) & (block_id > own - self.local))
        allowed = block_id <= own if causal else torch.ones_like(forced)
        scores = importance.masked_fill(forced & allowed, float("inf"))
        chosen = top_positions(scores, self.top, allowed)  # ties (the forced blocks among them) to earlier blocks
        return F.pad(chosen, (0, self.top - chosen.shape[-1]), value=-1)

    def _window_mask(self, rows: slice, n_keys: int, causal: bool, device: torch.device) -> Tensor:
        """[R, M] bool: the sliding window, keys within ``window`` positions (before, when causal)."""
        query_pos = torch.arange(rows.start, rows.stop, device=device)[:, None]
        key_pos = torch.arange(n_keys, device=device)[None, :]
        near = (key_pos > query_pos - self.window) & (key_pos < query_pos + self.window)
        return near & (key_pos <= query_pos) if causal else near

    def _selection_mask(self, blocks: Tensor, group: int, n_keys: int, causal: bool, rows: slice) -> Tensor:
        """[B, Hq, R, M] bool keys of the selected blocks (causal cut), from [B, Hk, R, top] lists."""
        n_blocks = -(-n_keys // self.block)
        slot = torch.where(blocks >= 0, blocks.long(), torch.full_like(blocks.long(), n_blocks))
        kept = torch.zeros(*blocks.shape[:-1], n_blocks + 1, dtype=torch.bool, device=blocks.device).scatter(-1, slot, True)
        mask = kept[..., torch.arange(n_keys, device=blocks.device) // self.block].repeat_interleave(group, dim=1)
        return mask & causal_row_mask(rows, n_keys, blocks.device) if causal else mask

    def branches(self, q, k, v, *, causal, scale, key_padding_mask, params) -> tuple[Tensor, Tensor, Tensor]:
        """The three branch outputs [B, Hq, N, Dv] fp32 by dense masked attention (the definition)."""
        group, rows = q.shape[1] // k.shape[1], row_slice(q.shape[2])
        ck, cv, cmp_real = self.compressed(k, v, key_padding_mask, params)
        visible = compressed_visible(rows, ck.shape[2], self.cmp, self.stride, causal, q.device)[None, None]
        visible = apply_key_padding(visible, cmp_real)
        scores = torch.matmul(upcast(q), upcast(expand_kv(ck, q.shape[1])).transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)  # [B, Hq, N]
        o_cmp = dense_masked_attention(q, expand_kv(ck, q.shape[1]), expand_kv(cv, q.shape[1]), visible, scale)
        blocks = self.selected_blocks(q.detach(), ck.detach(), lse.detach(), cmp_real, causal, scale)
        k_full, v_full = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        selected = apply_key_padding(self._selection_mask(blocks, group, k.shape[2], causal, rows), key_padding_mask)
        o_slc = dense_masked_attention(q, k_full, v_full, selected, scale)
        if self.window == 0:
            return o_cmp, o_slc, torch.zeros_like(o_slc)
        window = apply_key_padding(self._window_mask(rows, k.shape[2], causal, q.device)[None, None], key_padding_mask)
        return o_cmp, o_slc, dense_masked_attention(q, k_full, v_full, window, scale)

    def reference(self, q, k, v, *, causal, scale, key_padding_mask, params):
        gates = self.gates(q, params)
        outs = self.branches(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params)
        return sum(gates[..., i, None] * out for i, out in enumerate(outs))

    def lean(self, q, k, v, *, causal, scale, key_padding_mask, params):
        """The reference: it holds [B, Hq, N, M] masks, so it is for small N (use ``triton`` at length)."""
        return self.reference(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        """The token keys a query reads directly: its selected blocks and its window (the
        compressed branch reads every visible key through the summaries)."""
        scale = q.shape[-1] ** -0.5
        ck, cmp_real = compress(k, key_padding_mask, self.cmp, self.stride, self._mlp(params, "k"))
        all_rows = row_slice(q.shape[2])
        visible = apply_key_padding(
            compressed_visible(all_rows, ck.shape[2], self.cmp, self.stride, causal, q.device)[None, None], cmp_real
        )
        scores = torch.matmul(upcast(q), upcast(expand_kv(ck, q.shape[1])).transpose(-1, -2)) * scale
        lse = torch.logsumexp(scores.masked_fill(~visible, float("-inf")), dim=-1)
        blocks = self.selected_blocks(q, ck, lse, cmp_real, causal, scale)[:, :, rows]
        mask = self._selection_mask(blocks, q.shape[1] // k.shape[1], k.shape[2], causal, rows)
        if self.window:
            mask = mask | self._window_mask(rows, k.shape[2], causal, q.device)
        return mask

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        """The three branches on the block-sparse kernel. Under autograd, for q of at least
        ``RECOMPUTE_MIN_BYTES``, the compressed and window branches run inside ``checkpoint``: their
        outputs are recomputed in the backward instead of kept, so the layer saves q and the
        selection output like dense attention saves q and its output (the two recomputed branches
        read N/stride and ``window`` keys a row, far fewer than the selection's top * block)."""
        from sparsefocus.kernels.block_sparse import GROUP_TILE, block_sparse_attention

        gates = self.gates(q, params)
        ck, cv, cmp_real = self.compressed(k, v, key_padding_mask, params)
        gates = gates.to(q.dtype)  # combined in the inputs' dtype: fp32 copies of three outputs would double the memory

        def gated_compressed(q: Tensor, ck: Tensor, cv: Tensor, gate: Tensor) -> tuple[Tensor, Tensor]:
            o_cmp, lse = self._compressed_branch(q, ck, cv, cmp_real, causal, scale)
            return gate[..., None] * o_cmp, lse

        cmp_part, lse = _recomputed(gated_compressed, q, ck, cv, gates[..., 0])
        blocks = self.selected_blocks(q.detach(), ck.detach(), lse.detach(), cmp_real, causal, scale, fused=True)
        row_bits = None
        if self.tile:
            blocks, row_bits = tile_union(blocks, self.tile, -(-k.shape[2] // self.block), q.shape[1] // k.shape[1])
        o_slc, _ = block_sparse_attention(
            q,
            k,
            v,
            blocks,
            block_size=self.block,
            tile=self.tile or GROUP_TILE,
            causal=causal,
            scale=scale,
            key_padding_mask=key_padding_mask,
            row_bits=row_bits,
        )
        out = cmp_part + gates[..., 1, None] * o_slc
        if self.window:

            def gated_window(q: Tensor, k: Tensor, v: Tensor, gate: Tensor) -> Tensor:
                lists = window_lists(q.shape[0], q.shape[1], q.shape[2], k.shape[2], self.window, causal, q.device)
                o_swa, _ = block_sparse_attention(
                    q,
                    k,
                    v,
                    lists,
                    block_size=KEY_TILE,
                    tile=QUERY_TILE,
                    causal=causal,
                    scale=scale,
                    key_padding_mask=key_padding_mask,
                    window=self.window,
                )
                return gate[..., None] * o_swa

            out = out + _recomputed(gated_window, q, k, v, gates[..., 2])
        return out

    def _compressed_branch(self, q, ck, cv, cmp_real, causal, scale) -> tuple[Tensor, Tensor]:
        """(o_cmp [B, Hq, N, Dv], lse [B, Hq, N]) over the compressed keys, on the block kernel."""
        from sparsefocus.kernels.block_sparse import block_sparse_attention

        if ck.shape[2] == 0:
            shape = (*q.shape[:3], cv.shape[-1])
            return q.new_zeros(shape), torch.full(q.shape[:3], float("-inf"), device=q.device)
        lists = compressed_lists(q.shape[0], q.shape[1], q.shape[2], ck.shape[2], self.cmp, self.stride, causal, q.device)
        return block_sparse_attention(
            q,
            ck,
            cv,
            lists,
            block_size=KEY_TILE,
            tile=QUERY_TILE,
            causal=causal,
            scale=scale,
            key_padding_mask=cmp_real,
            key_stride=self.stride,
            key_offset=self.cmp - 1,
        )


def tile_union(blocks: Tensor, tile: int, n_blocks: int, group: int) -> tuple[Tensor, Tensor]:
    """The selection as query tiles: (lists [B, Hq, T, tile * top] int32, the union of the blocks
    of a tile's ``tile`` consecutive positions in ascending order, then -1; row_bits int32 of the
    same shape, bit r set where row r of the tile selected that block), T = ceil(N / tile), from
    ``blocks`` [B, Hk, N, top] (-1 unused), shared by the ``group`` query heads of a kv head.
    Fixed shapes and no host sync: a sort, run starts and two scatters per tile."""
    batch, kv_heads, n, top = blocks.shape
    tiles = -(-n // tile)
    padded = F.pad(blocks, (0, 0, 0, tiles * tile - n), value=-1)
    entries = padded.reshape(batch, kv_heads, tiles, tile * top).long()  # entry e: row e // top
    keyed = torch.where(entries >= 0, entries, torch.full_like(entries, n_blocks))
    ordered, order = torch.sort(keyed, dim=-1)
    starts = torch.ones_like(ordered, dtype=torch.bool)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    run = starts.long().cumsum(-1) - 1  # [B, Hk, T, L] the entry's slot in the union
    lists = torch.full_like(ordered, -1).scatter(-1, run, ordered)
    lists = torch.where(lists >= n_blocks, torch.full_like(lists, -1), lists)  # the unused entries' run
    bits = torch.zeros_like(ordered).scatter_add(-1, run, torch.ones_like(order) << (order // top))  # distinct rows: sum = or
    bits = torch.where(bits >= 2**31, bits - 2**32, bits)  # row 31 in int32's sign bit
    lists, bits = (x.to(torch.int32).repeat_interleave(group, dim=1).contiguous() for x in (lists, bits))  # [B, Hq, T, L]
    return lists, bits


def compressed_lists(
    batch: int, heads: int, n: int, n_cmp: int, cmp: int, stride: int, causal: bool, device: torch.device
) -> Tensor:
    """[B, Hq, T, S] lists of compressed-key blocks (KEY_TILE keys each) that a query tile may see."""
    tiles, slots = -(-n // QUERY_TILE), -(-n_cmp // KEY_TILE)
    block_id = torch.arange(slots, device=device)[None, :]
    last_query = (torch.arange(tiles, device=device) * QUERY_TILE + QUERY_TILE - 1).clamp_max(n - 1)[:, None]
    first_end = block_id * KEY_TILE * stride + cmp - 1  # position of each block's first compressed key
    lists = torch.where((first_end <= last_query) | (not causal), block_id, torch.full_like(block_id, -1))
    return lists.to(torch.int32).expand(batch, heads, tiles, slots)


def window_lists(batch: int, heads: int, n: int, n_keys: int, window: int, causal: bool, device: torch.device) -> Tensor:
    """[B, Hq, T, S] lists of KEY_TILE-key blocks that meet the window of some query of a tile."""
    tiles = -(-n // QUERY_TILE)
    first = torch.arange(tiles, device=device) * QUERY_TILE
    low = (first - window + 1).clamp_min(0) // KEY_TILE
    high_pos = first + QUERY_TILE - 1 + (0 if causal else window - 1)
    high = high_pos.clamp_max(n_keys - 1) // KEY_TILE
    slots = -(-(window + QUERY_TILE - 1 + (0 if causal else window - 1)) // KEY_TILE) + 1
    ids = low[:, None] + torch.arange(slots, device=device)[None, :]
    lists = torch.where(ids <= high[:, None], ids, torch.full_like(ids, -1))
    return lists.to(torch.int32).expand(batch, heads, tiles, slots)


def _recomputed(fn, *args):
    """``fn(*args)`` for a branch whose output is shaped like the first argument (q); under
    autograd through ``checkpoint`` (its activations recomputed in the backward, not saved) when
    that output holds at least ``RECOMPUTE_MIN_BYTES``."""
    grads = torch.is_grad_enabled() and any(isinstance(x, Tensor) and x.requires_grad for x in args)
    query = args[0]
    if grads and query.numel() * query.element_size() >= RECOMPUTE_MIN_BYTES:
        return checkpoint(fn, *args, use_reentrant=False)
    return fn(*args)
