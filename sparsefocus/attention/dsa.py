"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2): a lightning indexer picks k keys per query.

Indexer: ``heads`` small heads of width ``dim`` read the layer's input x. For query t and key s,

    I(t, s) = sum_h w_{t,h} * ReLU(q^I_{t,h} . k^I_s),    q^I = x W_q,  k^I = x W_k,  w = x W_w,

with one indexer key per token shared by every head. Each query keeps its ``k`` best keys by I
(causal: among s <= t; padded keys never), shared by all query heads, and ordinary softmax
attention runs over them. Without indexer weights the main queries serve as indexer heads and the
mean key over kv heads as indexer key (w = 1 / Hq).

Training (V3.2's sparse stage): the indexer learns from a KL loss towards the main attention's
distribution on the selected keys (summed over query heads, L1-normalised, detached), weighted by
``kl`` and written to ``params[AUX_KEY]["dsa_indexer_kl"]``; the indexer reads a detached x, so the
loss trains the indexer only. The indexer never holds an N x N tensor: scores are computed in
row chunks and only the top-k lists are kept.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar, cast

import torch
from torch import Tensor, nn

from sparsefocus.attention.common import (
    dense_masked_attention,
    expand_kv,
    gather_keys,
    grouped_linear,
    indexed_attention_ref,
    mask_from_indices,
    row_slice,
    upcast,
)
from sparsefocus.attention.patterns import (
    AUX_KEY,
    HIDDEN_KEY,
    RUNS_KEY,
    Pattern,
    register,
    require,
)
from sparsefocus.kernels._ops import kernel_chosen, top_positions

SCORE_ELEMENTS = 2**27  # largest [B, heads, rows, N] chunk of indexer scores
KL_ELEMENTS = 2**26  # largest [B, Hk, rows, k, D] chunk of the KL loss (the gathered keys)
WEIGHTS = ("dsa_wq", "dsa_wk", "dsa_ww")
EXPANDED_INDEX_BYTES = 2**30  # largest per-head copy of the shared key lists one kernel call gets
KL_KERNEL = "auto"
"""The indexer's KL loss: "auto" (the fused Triton kernel ``kernels.indexer_kl`` on CUDA, the chunked
PyTorch computation elsewhere), "triton" (the kernel everywhere; the CPU through Triton's
interpreter, for tests) or "torch"."""
GROUP_KERNEL_MIN_HEADS = 4
"""Query heads per kv head from which the Triton path attends with ``group_indexed`` (a kv group's
heads as the rows of one tensor-core tile, each listed key gathered once for the group) instead
of the per-head gather kernel. The crossover is estimated (a tile of 16 rows holding G heads uses
G/16 of the tensor cores, which outrun the gather kernel's CUDA-core products about 15 to 1), not
timed yet."""


@register
@dataclass(frozen=True)
class DSA(Pattern):
    """``dsa:k=2048,heads=4,dim=64,kl=1.0,kl_every=1``: top-k keys per query by a lightning indexer;
    the KL loss (weight ``kl``) is taken over every ``kl_every``-th query row (positions 0, e, 2e...)."""

    k: int = 2048
    heads: int = 4
    dim: int = 64
    kl: float = 1.0
    kl_every: int = 1
    name: ClassVar[str] = "dsa"
    positional: ClassVar[tuple[str, ...]] = ("k",)
    field_aliases: ClassVar[dict[str, str]] = {"topk": "k", "index_heads": "heads", "index_dim": "dim"}
    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "heavy hitters"
    needs_square: ClassVar[bool] = False
    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")
    needs_hidden: ClassVar[bool] = True
    expands_kv: ClassVar[bool] = False
    has_aux_loss: ClassVar[bool] = True
    run_params: ClassVar[bool] = True
    examples: ClassVar[tuple[str, ...]] = ("dsa:k=5,heads=2,dim=4",)
    cost: ClassVar[tuple[str, str]] = ("O(N M heads dim) indexer + O(N k D) attend", "O(N k) lists")

    def validate(self) -> None:
        require(
            self.k >= 1 and self.heads >= 1 and self.dim >= 1,
            f"dsa: k, heads, dim must be >= 1, got {self.k}, {self.heads}, {self.dim}",
        )
        require(self.kl >= 0, f"dsa: kl must be >= 0, got {self.kl}")
        require(self.kl_every >= 1, f"dsa: kl_every must be >= 1, got {self.kl_every}")

    def make_layer_parameters(self, dim: int, num_heads: int, kv_heads: int, qk_dim: int, v_dim: int) -> dict[str, nn.Parameter]:
        """Indexer weights ``dsa_wq`` [dim, heads * idim], ``dsa_wk`` [dim, idim], ``dsa_ww`` [dim, heads]."""
        scale = dim**-0.5
        return {
            "dsa_wq": nn.Parameter(torch.randn(dim, self.heads * self.dim) * scale),
            "dsa_wk": nn.Parameter(torch.randn(dim, self.dim) * scale),
            "dsa_ww": nn.Parameter(torch.randn(dim, self.heads) * scale),
        }

    @property
    def folds_params(self) -> bool:
        """The indexer's weights may come per batch row or per run ([G, dim, h d], ``grouped_linear``);
        the KL loss is summed over params[RUNS_KEY] slices (``run_means``)."""
        return True

    def indexer(self, q: Tensor, k: Tensor, params: dict | None) -> tuple[Tensor, Tensor, Tensor]:
        """(indexer queries [B, h, N, d], keys [B, M, d], head weights [B, N, h]), fp32."""
        if params is None or any(name not in params for name in WEIGHTS):
            iq, ik = upcast(q.detach()), upcast(k.detach()).mean(1)
            return iq, ik, iq.new_full((q.shape[0], q.shape[2], q.shape[1]), 1.0 / q.shape[1])
        hidden = params.get(HIDDEN_KEY)
        if hidden is None:
            raise ValueError(f"dsa's indexer needs the layer's input x as params[{HIDDEN_KEY!r}] [B, N, dim]")
        if hidden.shape[1] != k.shape[2]:
            raise ValueError(
                f"dsa's indexer needs x for every key position: params[{HIDDEN_KEY!r}] has {hidden.shape[1]} "
                f"rows for {k.shape[2]} keys (while decoding, pass the inputs of the cached positions too)"
            )
        x = upcast(hidden.detach())  # the indexer's loss must not train the main model
        batch, n, _ = x.shape
        wq, wk, ww = (params[name].float() for name in WEIGHTS)  # [dim, out], or per row or run [G, dim, out]
        iq = grouped_linear(x, wq).view(batch, n, self.heads, self.dim).transpose(1, 2)  # [B, h, N, d]
        return iq, grouped_linear(x, wk), grouped_linear(x, ww)

    def select(
        self, iq: Tensor, ik: Tensor, w: Tensor, causal: bool, key_padding_mask: Tensor | None, fused: bool = False
    ) -> Tensor:
        """[B, 1, N, min(k, M)] int32 top-k key lists by indexer score, ties to the smaller position
        (so a row's list never depends on how many later positions the call holds), -1 where
        fewer keys are allowed. ``fused``: the Triton radix selection (``kernels.indexer_topk``,
        the same keys in position order) instead of row chunks of scores and ``top_positions``
        (best first)."""
        if fused and ik.shape[1] > 0:
            from sparsefocus.kernels.indexer_topk import indexer_topk

            kk = min(self.k, ik.shape[1])
            return indexer_topk(iq, ik, w, kk, causal=causal, key_padding_mask=key_padding_mask)[:, None]
        with torch.no_grad():
            batch, heads, n, _ = iq.shape
            chunk = max(1, SCORE_ELEMENTS // max(1, batch * heads * ik.shape[1]))
            lists = []
            for start in range(0, n, chunk):
                rows = row_slice(n, start, start + chunk)
                scores = index_scores(iq[:, :, rows], ik, w[:, rows])  # [B, R, M]
                allowed = allowed_keys(rows, ik.shape[1], causal, key_padding_mask, iq.device)
                lists.append(top_positions(scores, self.k, allowed))  # ReLU scores tie often: ties to earlier keys
            return torch.cat(lists, dim=1)[:, None].to(torch.int32)

    def _lists(self, q, k, causal, key_padding_mask, params, fused=False) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor]]:
        tensors = self.indexer(q, k, params)
        return self.select(*tensors, causal, key_padding_mask, fused), tensors

    def _wants_loss(self, params: dict | None) -> bool:
        return self.kl > 0 and params is not None and AUX_KEY in params and all(name in params for name in WEIGHTS)

    def reference(self, q, k, v, *, causal, scale, key_padding_mask, params):
        """Dense masked attention over the selected keys; the KL loss from dense [B, N, M] tensors."""
        index, tensors = self._lists(q, k, causal, key_padding_mask, params)
        mask = mask_from_indices(index, k.shape[2])  # [B, 1, N, M]
        q_heads = q.shape[1]
        out = dense_masked_attention(q, expand_kv(k, q_heads), expand_kv(v, q_heads), mask, scale)
        if self._wants_loss(params):
            kl = dense_indexer_kl(q, k, mask[:, 0], tensors, scale, self.kl_every, runs_of(params, q.shape[0]))
            params[AUX_KEY]["dsa_indexer_kl"] = self.kl * kl
        return out

    def lean(self, q, k, v, *, causal, scale, key_padding_mask, params):
        index, tensors = self._lists(q, k, causal, key_padding_mask, params)
        self._store_loss(q, k, index, tensors, scale, params)
        return indexed_attention_ref(q, k, v, index.expand(q.shape[0], q.shape[1], -1, -1), scale=scale)

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        index, tensors = self._lists(q, k, causal, key_padding_mask, params, fused=True)
        self._store_loss(q, k, index, tensors, scale, params)
        if q.shape[1] // k.shape[1] >= GROUP_KERNEL_MIN_HEADS:
            from sparsefocus.kernels.group_indexed import group_indexed_attention

            return group_indexed_attention(q, k, v, index, scale=scale)[0]
        return indexed_per_group(q, k, v, index, scale)

    def _store_loss(self, q, k, index, tensors, scale, params) -> None:
        if self._wants_loss(params):
            kl = chunked_indexer_kl(q, k, index, tensors, scale, self.kl_every, runs_of(params, q.shape[0]))
            params[AUX_KEY]["dsa_indexer_kl"] = self.kl * kl

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        index, _ = self._lists(q, k, causal, key_padding_mask, params)
        return mask_from_indices(index[:, :, rows], k.shape[2])


def indexed_per_group(q: Tensor, k: Tensor, v: Tensor, index: Tensor, scale: float) -> Tensor:
    """The indexed kernel over lists shared by every head: q [B, Hq, N, D], k, v [B, Hk, N, *],
    index [B, 1, N, K] int32 -> [B, Hq, N, Dv].

    The kernel reads one list per query head, so the shared lists are expanded (and copied) to
    [B, Hq, N, K]: 34 GB of int32 at B=4, Hq=16, N=64K, K=2048. Above ``EXPANDED_INDEX_BYTES`` the
    kv groups run one call each, with the lists expanded over one group's query heads only."""
    from sparsefocus.kernels.indexed import indexed_attention

    batch, q_heads = q.shape[:2]
    kv_heads = k.shape[1]
    if batch * q_heads * index.shape[2] * index.shape[3] * 4 <= EXPANDED_INDEX_BYTES or kv_heads == 1:
        return cast(Tensor, indexed_attention(q, k, v, index.expand(batch, q_heads, -1, -1), scale=scale))
    group = q_heads // kv_heads
    parts = [
        cast(
            Tensor,
            indexed_attention(
                q[:, g * group : (g + 1) * group],
                k[:, g : g + 1],
                v[:, g : g + 1],
                index.expand(batch, group, -1, -1),
                scale=scale,
            ),
        )
        for g in range(kv_heads)
    ]
    return torch.cat(parts, dim=1)  # [B, Hq, N, Dv]


def index_scores(iq: Tensor, ik: Tensor, w: Tensor) -> Tensor:
    """I(t, s) = sum_h w_{t,h} ReLU(iq_{t,h} . ik_s): iq [B, h, R, d], ik [B, M, d], w [B, R, h] -> [B, R, M]."""
    relu = torch.relu(torch.matmul(iq, ik[:, None].transpose(-1, -2)))  # [B, h, R, M]
    return torch.einsum("bhrm,brh->brm", relu, w)


def allowed_keys(rows: slice, n_keys: int, causal: bool, key_padding_mask: Tensor | None, device: torch.device) -> Tensor:
    """[B or 1, R, M] bool: keys a query may select (causal: s <= t; real keys only)."""
    allowed = torch.ones(1, rows.stop - rows.start, n_keys, dtype=torch.bool, device=device)
    if causal:
        allowed = allowed & (
            torch.arange(n_keys, device=device)[None, :] <= torch.arange(rows.start, rows.stop, device=device)[:, None]
        )
    if key_padding_mask is not None:
        allowed = allowed & key_padding_mask[:, None, :]
    return allowed


def kl_to_target(target: Tensor, logits: Tensor, valid: Tensor) -> tuple[Tensor, Tensor]:
    """Per batch row [B]: (sum over rows of KL(target || softmax(logits)) over the valid entries,
    number of rows with one); target, logits, valid [B, N, M]."""
    log_q = torch.log_softmax(logits.masked_fill(~valid, float("-inf")), dim=-1)
    return kl_terms(target, log_q, valid).flatten(1).sum(1), valid.any(-1).flatten(1).sum(1)


def runs_of(params: dict, batch: int) -> int:
    """params[RUNS_KEY] (folded runs; 1 without), checked to split ``batch`` evenly."""
    runs = int(params.get(RUNS_KEY, 1))
    if runs < 1 or batch % runs:
        raise ValueError(f"dsa: params[{RUNS_KEY!r}] = {runs} does not split a batch of {batch} into equal runs")
    return runs


def run_means(total: Tensor, rows: Tensor, runs: int) -> tuple[Tensor, Tensor]:
    """(the sum over ``runs`` equal slices of the batch of each slice's total / rows, and each batch
    row's factor 1 / rows of its slice [B]) from per-batch-row sums total, rows [B]. One run: the
    mean over every row with a key, as one model computes it."""
    count = rows.view(runs, -1).sum(1).clamp_min(1)  # [R]
    loss = (total.view(runs, -1).sum(1) / count).sum()
    return loss, (1.0 / count).repeat_interleave(total.shape[0] // runs)


def kl_terms(target: Tensor, log_q: Tensor, valid: Tensor) -> Tensor:
    """Per entry target * (log target - log_q) where the entry is valid and the target positive, else 0."""
    return torch.where(valid & (target > 0), target * (torch.log(target.clamp_min(1e-30)) - log_q), torch.zeros_like(target))


def dense_indexer_kl(
    q: Tensor,
    k: Tensor,
    selected: Tensor,
    tensors: tuple[Tensor, Tensor, Tensor],
    scale: float,
    every: int = 1,
    runs: int = 1,
) -> Tensor:
    """The indexer's KL loss, defined densely: selected [B, N, M] bool, the main distribution
    softmax(scale q k) over the selected keys averaged over the query heads (detached); the mean
    over the query rows 0, every, 2 every... that keep a key (summed over ``runs`` equal slices
    of the batch, each its own mean: see ``run_means``)."""
    iq, ik, w = tensors
    q, selected, iq, w = q[:, :, ::every], selected[:, ::every], iq[:, :, ::every], w[:, ::every]
    with torch.no_grad():
        scores = torch.matmul(upcast(q), upcast(expand_kv(k, q.shape[1])).transpose(-1, -2)) * scale  # [B, Hq, N, M]
        has_key = selected.any(-1, keepdim=True)[:, None]
        probs = torch.softmax(scores.masked_fill(~selected[:, None], float("-inf")).masked_fill(~has_key, 0.0), dim=-1)
        target = (probs * has_key).mean(1)  # [B, N, M]
    total, rows = kl_to_target(target, index_scores(iq, ik, w), selected)
    return run_means(total, rows, runs)[0]


def chunked_indexer_kl(
    q: Tensor,
    k: Tensor,
    index: Tensor,
    tensors: tuple[Tensor, Tensor, Tensor],
    scale: float,
    every: int = 1,
    runs: int = 1,
) -> Tensor:
    """The same loss from the key lists ([B, 1, N, K]) in row chunks (``IndexerKL``: the loss and
    its gradients in one pass, so nothing is recomputed in backward)."""
    iq, ik, w = tensors
    q, index, iq, w = q[:, :, ::every], index[:, :, ::every], iq[:, :, ::every], w[:, ::every]
    chunk = max(1, KL_ELEMENTS // max(1, q.shape[0] * k.shape[1] * index.shape[-1] * q.shape[-1]))
    needed = torch.is_grad_enabled() and any(t.requires_grad for t in (iq, ik, w))  # evaluation skips the gradients
    return cast(Tensor, IndexerKL.apply(iq, ik, w, q.detach(), k.detach(), index, scale, chunk, needed, runs))


class IndexerKL(torch.autograd.Function):
    """The indexer's KL loss (mean over rows with a key of KL(target || softmax(logits)) over the
    listed keys; with ``runs`` > 1, the sum of each batch slice's mean) with its gradients in iq [B, h, N, d], ik [B, M, d] and w [B, N, h], computed
    together chunk by chunk in the forward: the target (the main attention's distribution, no
    gradient) is the costly part, and autograd through checkpointed chunks computed it twice.

    With t the target and p = softmax(logits) over a row's listed keys, d KL / d logits =
    p * sum(t) - t; logits = sum_h w_h ReLU(iq_h . ik_j) is differentiated by hand from there."""

    @staticmethod
    def forward(ctx, iq, ik, w, q, k, index, scale: float, chunk: int, needed: bool, runs: int):  # type: ignore[override]
        with torch.no_grad():
            if fused_kl(q, iq):
                from sparsefocus.kernels.indexer_kl import indexer_kl

                kl, has, *fused = indexer_kl(q, k, index[:, 0], iq, ik, w, scale, needed)
                total, rows, grads = kl.sum(1), has.sum(1), (tuple(fused) if needed else None)
            else:
                total, rows, grads = _chunked_kl(iq, ik, w, q, k, index, scale, chunk, needed)
            loss, factor = run_means(total, rows, runs)
            ctx.save_for_backward(*(() if grads is None else (g * factor.view(-1, *[1] * (g.dim() - 1)) for g in grads)))
        return loss

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        d_iq, d_ik, d_w = ctx.saved_tensors
        return grad * d_iq, grad * d_ik, grad * d_w, None, None, None, None, None, None, None


def fused_kl(q: Tensor, iq: Tensor) -> bool:
    """Whether the KL loss takes the Triton kernel (``KL_KERNEL``; "auto" only where a row's tiles
    fit a program, see ``indexer_kl.slots_per_tile``)."""
    if KL_KERNEL == "triton":
        return True  # tests: wherever the tiles go
    if not kernel_chosen(KL_KERNEL, q):
        return False
    from sparsefocus.kernels.indexer_kl import slots_per_tile

    return slots_per_tile(q.shape[1], q.shape[3], iq.shape[1], iq.shape[3]) is not None


def _chunked_kl(iq, ik, w, q, k, index, scale: float, chunk: int, needed: bool):
    """(KL sums [B], rows with a key [B], unnormalised gradients or None) chunk by chunk in PyTorch."""
    grads = (torch.zeros_like(iq), torch.zeros_like(ik), torch.zeros_like(w)) if needed else None
    total, rows = iq.new_zeros(iq.shape[0]), iq.new_zeros(iq.shape[0])  # [B] each
    for start in range(0, q.shape[2], chunk):
        part = row_slice(q.shape[2], start, start + chunk)
        chunk_total, chunk_rows = _kl_chunk(q[:, :, part], k, index[:, :, part], iq, ik, w, part, scale, grads)
        total, rows = total + chunk_total, rows + chunk_rows
    return total, rows, grads


def _kl_chunk(
    q: Tensor,
    k: Tensor,
    index: Tensor,
    iq: Tensor,
    ik: Tensor,
    w: Tensor,
    part: slice,
    scale: float,
    grads: tuple[Tensor, Tensor, Tensor] | None,
) -> tuple[Tensor, Tensor]:
    """KL sum and row count [B] of the rows ``part``: q [B, Hq, R, D], index [B, 1, R, K], iq [B, h, N, d],
    w [B, N, h]; their gradients (unnormalised) are added into ``grads`` = (d iq, d ik, d w) unless None."""
    valid = index[:, 0] >= 0  # [B, R, K]
    safe = index.clamp_min(0).long()
    batch, kv_heads = k.shape[:2]
    # gathered, then upcast: an fp32 copy of every key per chunk of rows would cost more than the rows' keys
    keys = upcast(gather_keys(k, safe.expand(-1, kv_heads, -1, -1)))  # [B, Hk, R, K, D], once per kv head
    grouped = upcast(q).view(batch, kv_heads, -1, *q.shape[2:])  # [B, Hk, G, R, D]
    scores = torch.einsum("bkgrd,bkrjd->bkgrj", grouped, keys).flatten(1, 2) * scale  # [B, Hq, R, K]
    has_key = valid.any(-1, keepdim=True)  # [B, R, 1]
    probs = torch.softmax(scores.masked_fill(~valid[:, None], float("-inf")).masked_fill(~has_key[:, None], 0.0), dim=-1)
    target = (probs * has_key[:, None]).mean(1)  # [B, R, K]
    n_rows, width = safe.shape[2:]
    flat = safe[:, 0].reshape(batch, n_rows * width)  # [B, R*K]
    picked = torch.gather(ik, 1, flat[..., None].expand(-1, -1, ik.shape[-1])).view(batch, n_rows, width, -1)  # [B, R, K, d]
    pre = torch.einsum("bhrd,brkd->bhrk", iq[:, :, part], picked)  # [B, h, R, K]
    relu = pre.clamp_min(0)
    logits = torch.einsum("bhrk,brh->brk", relu, w[:, part]).masked_fill(~valid, float("-inf"))
    log_p = torch.log_softmax(logits, dim=-1)
    total = kl_terms(target, log_p, valid).flatten(1).sum(1)  # [B]
    if grads is None:
        return total, has_key.flatten(1).sum(1)
    d_logits = torch.where(valid, log_p.exp() * target.sum(-1, keepdim=True) - target, torch.zeros_like(target))  # [B, R, K]
    d_iq, d_ik, d_w = grads
    d_w[:, part] += torch.einsum("brk,bhrk->brh", d_logits, relu)
    d_pre = torch.where(pre > 0, d_logits[:, None] * w[:, part].transpose(1, 2)[..., None], torch.zeros_like(pre))
    d_iq[:, :, part] += torch.einsum("bhrk,brkd->bhrd", d_pre, picked)
    _add_rows(d_ik, flat, torch.einsum("bhrk,bhrd->brkd", d_pre, iq[:, :, part]))  # every listed key's share
    return total, has_key.flatten(1).sum(1)


def _add_rows(target: Tensor, index: Tensor, rows: Tensor) -> None:
    """target[b, index[b, i]] += rows[b, i] for every batch b: target [B, M, d], index [B, R*K], rows [B, R, K, d]."""
    target.scatter_add_(1, index[..., None].expand(-1, -1, target.shape[-1]), rows.reshape(*index.shape, -1))
