"""Adaptive normalisers: the scores decide how many keys survive.

``sparsemax`` and ``entmax`` replace softmax by a projection onto the simplex that puts exact
zeros on low scores (Martins & Astudillo 2016; Peters et al. 2019); ``gate`` multiplies the
softmax weights by a learned sigmoid gate g(i, j) = sigmoid(w_h * s_ij + b_h) and renormalises.
All three weigh the allowed (causal, unpadded) keys only. The reference computes every score at
once; the lean path does the same per query chunk, recomputed in the backward (O(chunk * M) memory).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor, nn

from sparsefocus.attention.common import chunked_rows, expand_kv, masked_softmax, row_slice, upcast
from sparsefocus.attention.patterns import Pattern, register, require
from sparsefocus.attention.topk import allowed_keys
from sparsefocus.kernels._ops import kernel_chosen

ENTMAX_BISECTION_STEPS = 50


RECOMPUTE_MIN_BYTES = 2**30
"""The lean path recomputes its query chunks in the backward when the call's [B, H, N, M] fp32
weights would take at least this much (1 GiB); below it they are kept, and the normaliser runs
once: the laboratory's ListOps model (250 rows of 600 keys a layer, 360 MB) paid for it twice."""
ROW_KERNEL = "auto"
"""Sparsemax and 1.5-entmax forwards of rows of at most 4096 scores (fp32, or 16-bit ones, as
autocast makes them, computed in fp32): "auto" (the Triton row kernel ``kernels.entmax_rows`` on
CUDA, one read and one write instead of a sort and some fifteen passes), "triton" (everywhere;
the CPU through Triton's interpreter, for tests) or "torch"."""


def _row_kernel(scores: Tensor, alpha: float) -> bool:
    """Whether this forward takes the Triton row kernel (``ROW_KERNEL``)."""
    if not kernel_chosen(ROW_KERNEL, scores):
        return False
    from sparsefocus.kernels.entmax_rows import fits

    return scores.dtype in (torch.float32, torch.float16, torch.bfloat16) and fits(scores.shape[-1], alpha)


def _rows(scores: Tensor, alpha: float) -> Tensor:
    """The row kernel's weights in the scores' dtype."""
    from sparsefocus.kernels.entmax_rows import entmax_rows

    return entmax_rows(scores, alpha).to(scores.dtype)


class _Sparsemax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor) -> Tensor:
        probs = _rows(scores, 2.0) if _row_kernel(scores, 2.0) else _sparsemax_forward(scores)
        ctx.save_for_backward(probs)
        return probs

    @staticmethod
    def backward(ctx, grad: Tensor):
        (probs,) = ctx.saved_tensors
        support = (probs > 0).to(grad.dtype)
        shift = (support * grad).sum(-1, keepdim=True) / support.sum(-1, keepdim=True).clamp_min(1)
        return support * (grad - shift)


class _Entmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, scores: Tensor, alpha: float) -> Tensor:
        if _row_kernel(scores, alpha):
            probs = _rows(scores, alpha)
        else:
            probs = _entmax15_forward(scores) if alpha == 1.5 else _entmax_bisect_forward(scores, alpha)
        ctx.save_for_backward(probs)
        ctx.alpha = alpha
        return probs

    @staticmethod
    def backward(ctx, grad: Tensor):
        (probs,) = ctx.saved_tensors
        weight = torch.where(probs > 0, probs.pow(2.0 - ctx.alpha), torch.zeros_like(probs))
        shift = (weight * grad).sum(-1, keepdim=True) / weight.sum(-1, keepdim=True).clamp_min(1e-30)
        return weight * (grad - shift), None


def _finite_below_support(scores: Tensor, margin: float) -> Tensor:
    """Replace -inf by (row max - margin): low enough to be outside the support for sure, and
    finite so that sorting and cumulative sums stay exact."""
    row_max = scores.max(dim=-1, keepdim=True).values.detach()
    return torch.where(torch.isinf(scores), row_max - margin, scores)


def _sparsemax_forward(scores: Tensor) -> Tensor:
    """Exact sparsemax over the last dim by sorting; -inf entries get 0 (tau >= max - 1)."""
    z = _finite_below_support(scores, 2.0)
    z_sorted = z.sort(dim=-1, descending=True).values
    rank = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    cumulative = z_sorted.cumsum(-1)
    in_support = 1 + rank * z_sorted > cumulative
    support_size = in_support.sum(-1, keepdim=True)
    tau = (cumulative.gather(-1, support_size - 1) - 1) / support_size.to(z.dtype)
    return (z - tau).clamp_min(0)


def _entmax15_forward(scores: Tensor) -> Tensor:
    """1.5-entmax over the last dim, exact by sorting (Peters et al. 2019, Algorithm 2):
    p = [z/2 - tau]_+^2. Along the scores sorted in descending order, the threshold of the k
    largest is tau_k = mean_k - sqrt((1 - k * var_k) / k) (mean and variance of the k largest
    halves); the support is the k with tau_k <= the k-th largest. -inf entries get 0: outside the
    support, tau >= max - 1. About a dozen tensor ops instead of the bisection's 50 rounds."""
    z = _finite_below_support(scores, 3.0) / 2  # margin 3 in the scores is 1.5 > 1 in the halves
    z = z - z.max(dim=-1, keepdim=True).values
    z_sorted = z.sort(dim=-1, descending=True).values
    rank = torch.arange(1, z.shape[-1] + 1, device=z.device, dtype=z.dtype)
    mean = z_sorted.cumsum(-1) / rank
    mean_square = z_sorted.square().cumsum(-1) / rank
    spread = (1 - rank * (mean_square - mean.square())) / rank
    tau = mean - spread.clamp_min(0).sqrt()
    support_size = (tau <= z_sorted).sum(-1, keepdim=True)
    return (z - tau.gather(-1, support_size - 1)).clamp_min(0).square()


def _entmax_bisect_forward(scores: Tensor, alpha: float) -> Tensor:
    """alpha-entmax over the last dim: p = [(alpha-1) z - tau]_+^(1/(alpha-1)), tau by bisection."""
    z = (alpha - 1.0) * _finite_below_support(scores, 1.0 / (alpha - 1.0) + 1.0)
    top = z.max(dim=-1, keepdim=True).values
    low, high = top - 1.0, top - (1.0 / z.shape[-1]) ** (alpha - 1.0)
    exponent = 1.0 / (alpha - 1.0)
    for _ in range(ENTMAX_BISECTION_STEPS):
        tau = (low + high) / 2
        mass = (z - tau).clamp_min(0).pow(exponent).sum(-1, keepdim=True)
        low = torch.where(mass >= 1, tau, low)
        high = torch.where(mass >= 1, high, tau)
    probs = (z - (low + high) / 2).clamp_min(0).pow(exponent)
    return probs / probs.sum(-1, keepdim=True)


def sparsemax(scores: Tensor, dim: int = -1) -> Tensor:
    """Sparsemax of ``scores`` along ``dim`` (exact, sort-based); -inf entries get exactly 0."""
    return _Sparsemax.apply(scores.transpose(dim, -1)).transpose(dim, -1)


def entmax(scores: Tensor, alpha: float = 1.5, dim: int = -1) -> Tensor:
    """alpha-entmax of ``scores`` along ``dim`` (1 < alpha <= 2; 2 = sparsemax): exact by sorting
    at alpha = 1.5, by bisection otherwise."""
    return _Entmax.apply(scores.transpose(dim, -1), alpha).transpose(dim, -1)


def entmax_attention_ref(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    alpha: float,
    scale: float,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
) -> Tensor:
    """The slow twin of ``kernels.entmax_attention.entmax_attention`` (same signature): every
    score at once in fp32, ``entmax`` (``sparsemax`` at alpha 2) over the allowed keys, times V.

    Args:
        q: [B, Hq, N, D]; k: [B, Hk, M, D]; v: [B, Hk, M, Dv], Hk dividing Hq.
        alpha: 1 < alpha <= 2. scale: the scores are scale * q.k.
        causal: key j allowed for query i only if j <= i + M - N. Default: False.
        key_padding_mask: [B, M] bool, True = real key. Default: every key real.
    Returns:
        [B, Hq, N, Dv] in q's dtype; 0 for a row with no allowed key.
    """
    k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    scores = torch.matmul(upcast(q), upcast(k).transpose(-1, -2)) * scale  # [B, H, N, M]
    n_queries, n_keys = q.shape[2], k.shape[2]
    # query i sits at key position i + M - N (a negative one reads no key when causal)
    allowed = allowed_keys(q, k, slice(n_keys - n_queries, n_keys), causal, key_padding_mask)
    weights = _over_allowed(scores, allowed, lambda masked, _: sparsemax(masked) if alpha == 2.0 else entmax(masked, alpha))
    return torch.matmul(weights, upcast(v)).to(q.dtype)


def _over_allowed(scores: Tensor, allowed: Tensor, normalise: Callable[[Tensor, Tensor], Tensor]) -> Tensor:
    """normalise(scores with -inf outside the allowed keys, allowed) for scores [B, H, C, M] and a
    broadcastable allowed mask; rows without an allowed key get zeros."""
    allowed = allowed.expand_as(scores)
    row_has_key = allowed.any(-1, keepdim=True)
    masked = scores.masked_fill(~allowed, float("-inf")).masked_fill(~row_has_key, 0.0)
    return normalise(masked, allowed) * row_has_key


@dataclass(frozen=True)
class _AdaptivePattern(Pattern):
    """Base: scores over the allowed keys, turned into weights by ``normalise``."""

    input_dependent: ClassVar[bool] = True
    family: ClassVar[str] = "adaptive"
    needs_square: ClassVar[bool] = False
    cost: ClassVar[tuple[str, str]] = ("O(N M D)", "O(chunk M) lean")

    def normalise(self, scores: Tensor, allowed: Tensor, params: dict | None) -> Tensor:
        """Weights [B, H, C, M] from scaled scores and the allowed mask (rows of zeros if none)."""
        raise NotImplementedError

    def _weights(self, q, k, rows, causal, scale, key_padding_mask, params) -> Tensor:
        scores = torch.matmul(upcast(q[:, :, rows]), upcast(k).transpose(-1, -2)) * scale  # [B, H, C, M]
        allowed = allowed_keys(q, k, rows, causal, key_padding_mask)
        return _over_allowed(scores, allowed, lambda masked, full: self.normalise(masked, full, params))

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        with torch.no_grad():
            weights = self._weights(q, k, rows, causal, q.shape[-1] ** -0.5, key_padding_mask, params)
            return weights > self.support_threshold

    support_threshold: ClassVar[float] = 0.0

    def reference(self, q, k, v, *, causal, scale, key_padding_mask, params):
        rows = row_slice(q.shape[-2])
        return torch.matmul(self._weights(q, k, rows, causal, scale, key_padding_mask, params), upcast(v))

    def lean(self, q, k, v, *, causal, scale, key_padding_mask, params):
        """Query chunks of ``DEFAULT_ROW_CHUNK`` rows, each recomputed in the backward (so memory
        stays O(chunk M)) when the whole call's fp32 weights would reach ``RECOMPUTE_MIN_BYTES``."""

        def one_chunk(rows: slice) -> Tensor:
            return torch.matmul(self._weights(q, k, rows, causal, scale, key_padding_mask, params), upcast(v))

        weights_bytes = 4 * q.shape[0] * q.shape[1] * q.shape[2] * k.shape[2]
        return chunked_rows(one_chunk, q.shape[-2], recompute=weights_bytes >= RECOMPUTE_MIN_BYTES)


@dataclass(frozen=True)
class _FusedAdaptive(_AdaptivePattern):
    """Sparsemax and 1.5-entmax: a Triton path through ``kernels.entmax_attention`` (rows of at
    most ``MAX_KEYS`` keys; other alphas, longer rows and float64 take the lean path)."""

    impls: ClassVar[tuple[str, ...]] = ("reference", "lean", "triton")

    @property
    def kernel_alpha(self) -> float:
        """The alpha the kernel computes: 2 (sparsemax); ``Entmax`` gives its own."""
        return 2.0

    def triton(self, q, k, v, *, causal, scale, key_padding_mask, params):
        from sparsefocus.kernels.entmax_attention import entmax_attention, fits

        if not fits(k.shape[-2], self.kernel_alpha) or q.dtype == torch.float64:
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
            return self.lean(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params)
        return entmax_attention(q, k, v, self.kernel_alpha, scale, causal, key_padding_mask)


@register
@dataclass(frozen=True)
class Sparsemax(_FusedAdaptive):
    """``sparsemax``: weights = sparsemax(scale * q.k) over the allowed keys; exact zeros below a
    data-dependent threshold, so each query keeps a variable number of keys."""

    normaliser: ClassVar[str] = "sparsemax"
    name: ClassVar[str] = "sparsemax"
    examples: ClassVar[tuple[str, ...]] = ("sparsemax",)

    def normalise(self, scores, allowed, params):
        return sparsemax(scores)


@register
@dataclass(frozen=True)
class Entmax(_FusedAdaptive):
    """``entmax:alpha=A``: alpha-entmax (1 < alpha <= 2) of scale * q.k over the allowed keys;
    alpha -> 1 approaches softmax, alpha = 2 is sparsemax. Default alpha 1.5."""

    alpha: float = 1.5
    normaliser: ClassVar[str] = "alpha-entmax"
    name: ClassVar[str] = "entmax"
    positional: ClassVar[tuple[str, ...]] = ("alpha",)
    examples: ClassVar[tuple[str, ...]] = ("entmax:alpha=1.5", "entmax:1.25")

    def validate(self) -> None:
        require(1.0 < self.alpha <= 2.0, f"entmax: alpha must be in (1, 2], got {self.alpha}")

    @property
    def kernel_alpha(self) -> float:
        return float(self.alpha)

    def normalise(self, scores, allowed, params):
        return entmax(scores, self.alpha)


@register
@dataclass(frozen=True)
class Gate(_AdaptivePattern):
    """``gate``: softmax weights times a learned sigmoid gate, renormalised:
    p_ij ∝ sigmoid(w_h s_ij + b_h) exp(s_ij) over allowed keys, with per-head trainable w_h, b_h
    (params ``gate_weight`` and ``gate_bias``, made by ``make_parameters``). The selection mask
    reports the pairs whose gate is above 1/2."""

    weight: float = 1.0
    bias: float = 0.0
    normaliser: ClassVar[str] = "a sigmoid-gated softmax"
    name: ClassVar[str] = "gate"
    aliases: ClassVar[tuple[str, ...]] = ("sigmoid_gate",)
    examples: ClassVar[tuple[str, ...]] = ("gate", "gate:weight=2.0,bias=-1.0")

    def make_parameters(self, num_heads: int) -> dict[str, nn.Parameter]:
        return {
            "gate_weight": nn.Parameter(torch.full((num_heads,), float(self.weight))),
            "gate_bias": nn.Parameter(torch.full((num_heads,), float(self.bias))),
        }

    def _gate_logits(self, scores: Tensor, params: dict | None) -> Tensor:
        if params is None or "gate_weight" not in params:
            return self.weight * scores + self.bias
        weight = params["gate_weight"].to(scores.dtype).reshape(1, -1, 1, 1)
        bias = params["gate_bias"].to(scores.dtype).reshape(1, -1, 1, 1)
        return weight * scores + bias

    def normalise(self, scores, allowed, params):
        finite = scores.masked_fill(~allowed, 0.0)
        log_gate = nn.functional.logsigmoid(self._gate_logits(finite, params))
        return masked_softmax(finite + log_gate, allowed)

    def row_mask(self, q, k, rows, causal, key_padding_mask=None, params=None):
        with torch.no_grad():
            scores = torch.matmul(upcast(q[:, :, rows]), upcast(k).transpose(-1, -2)) * q.shape[-1] ** -0.5
            allowed = allowed_keys(q, k, rows, causal, key_padding_mask)
            return (self._gate_logits(scores, params) > 0) & allowed
