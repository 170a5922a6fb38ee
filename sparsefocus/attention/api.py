"""The one functional API: ``sparse_attention`` and ``selection_mask``, in SDPA's layout."""

from __future__ import annotations

import importlib.util
import itertools
import os
import sys
from typing import Any, Literal, overload

import torch
from torch import Tensor

from sparsefocus.attention.common import DEFAULT_ROW_CHUNK, expand_kv
from sparsefocus.attention.decode import (
    check_alignment,
    decode_attention,
    padded_queries,
)
from sparsefocus.attention.lse import attention_lse, check_lse_support, triton_with_lse
from sparsefocus.attention.patterns import Pattern, parse_pattern
from sparsefocus.attention.varlen import check_cu_seqlens, check_packed_shapes, packed_attention, packed_run_attention

IMPLS = ("auto", "reference", "lean", "triton", "flex")


def _check_tensor(name: str, x: Tensor) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"{name} must have rank 4 [B, H, N, D], got shape {tuple(x.shape)}")
    if not x.is_floating_point():
        raise ValueError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")


def check_inputs(q: Tensor, k: Tensor, v: Tensor, key_padding_mask: Tensor | None) -> None:
    """Validate q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv] and a [B, M] bool padding mask."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, x)
    if not (q.shape[0] == k.shape[0] == v.shape[0]):
        raise ValueError(f"batch sizes differ: q {q.shape[0]}, k {k.shape[0]}, v {v.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k head dims differ: {q.shape[-1]} vs {k.shape[-1]}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} differ in heads or length")
    if q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"GQA needs q heads ({q.shape[1]}) divisible by k/v heads ({k.shape[1]})")
    if q.device != k.device or q.device != v.device:
        raise ValueError(f"q, k, v are on different devices: {q.device}, {k.device}, {v.device}")
    if key_padding_mask is None:
        return
    expected = (q.shape[0], k.shape[2])
    if key_padding_mask.dtype != torch.bool or tuple(key_padding_mask.shape) != expected:
        raise ValueError(
            f"key_padding_mask must be a bool tensor of shape [B, M] = {list(expected)} "
            f"(True = real key), got {key_padding_mask.dtype} {list(key_padding_mask.shape)}"
        )


def resolve_impl(pattern: Pattern, impl: str, q: Tensor, decoding: bool = False, lse: bool = False) -> str:
    """Pick the implementation: "auto" -> Triton on CUDA where the pattern has one, else lean;
    "auto" while decoding (causal, N < M) -> lean, which computes only the N query rows, unless
    the pattern's Triton path computes only those rows too (``triton_decodes``: TOPK) and no LSE
    is asked for (the Triton LSE of a decoding call replays the square)."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        has_triton = q.is_cuda and "triton" in pattern.impls
        rows_only = not decoding or (not lse and pattern.triton_decodes())
        return "triton" if has_triton and rows_only else "lean"
    if impl not in pattern.impls:
        raise ValueError(f"pattern {pattern.name} has no {impl!r} implementation; it has: {', '.join(pattern.impls)}")
    if impl == "triton" and not q.is_cuda:
        use_triton_interpreter()
    return impl


def use_triton_interpreter() -> None:
    """Make impl="triton" on a CPU tensor run in Triton's interpreter, or say in one line why it cannot.

    The interpreter is chosen by TRITON_INTERPRET=1 when the kernels are defined, so it is set here
    when triton is not imported yet and there is no CUDA device (where it would slow the GPU
    kernels down too); once triton is imported without it, only a restart helps.
    """
    if os.environ.get("TRITON_INTERPRET") == "1":
        return
    if importlib.util.find_spec("triton") is None:
        raise RuntimeError('impl="triton" needs the triton package (pip install triton); use impl="lean" on a CPU')
    if "triton" in sys.modules or torch.cuda.is_available():  # with CUDA, the GPU kernels must stay compiled
        raise RuntimeError(
            'impl="triton" on a CPU tensor runs in Triton\'s interpreter, which needs TRITON_INTERPRET=1 set before '
            'triton is imported (e.g. TRITON_INTERPRET=1 python script.py); or use impl="lean"'
        )
    os.environ["TRITON_INTERPRET"] = "1"


# The return type follows return_lse: out alone, or (out, lse).
@overload
def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: str | Pattern,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    key_padding_mask: Tensor | None = ...,
    impl: str = ...,
    params: dict[str, Tensor] | None = ...,
    return_lse: Literal[False] = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor: ...


@overload
def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: str | Pattern,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    key_padding_mask: Tensor | None = ...,
    impl: str = ...,
    params: dict[str, Tensor] | None = ...,
    return_lse: Literal[True],
    cu_seqlens: Tensor | None = ...,
) -> tuple[Tensor, Tensor]: ...


@overload
def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: str | Pattern,
    *,
    causal: bool = ...,
    scale: float | None = ...,
    key_padding_mask: Tensor | None = ...,
    impl: str = ...,
    params: dict[str, Tensor] | None = ...,
    return_lse: bool = ...,
    cu_seqlens: Tensor | None = ...,
) -> Tensor | tuple[Tensor, Tensor]: ...


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: str | Pattern,
    *,
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    impl: str = "auto",
    params: dict[str, Tensor] | None = None,
    return_lse: bool = False,
    cu_seqlens: Tensor | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Sparse attention in the layout of ``F.scaled_dot_product_attention``.

    Args:
        q: [B, Hq, N, D] queries. k: [B, Hk, M, D] keys, v: [B, Hk, M, Dv]; Hq % Hk == 0 (GQA).
        pattern: a spec or string such as ``"TOPK:5"``, ``"BAND:5(1)"``, ``"zeta:k=32,dk=3"``.
        causal: query i only sees keys j <= i. With N < M the queries are the *last* N positions
            (bottom-right, as FlashAttention: query i sees j <= i + M - N), which is decoding with
            a KV cache; the result equals the last N rows of the causal call over all M positions.
            Default: False.
        scale: score scale. Default: 1/sqrt(D).
        key_padding_mask: [B, M] bool, True = a real key; padded keys are never attended. Default: None.
        impl: "auto" (Triton kernel on CUDA where one exists, else "lean"; "lean" while
            decoding), "reference" (dense fp32 definition), "lean" (no N x M tensor where the
            mechanism allows), "triton" (on a CPU tensor: Triton's interpreter, slow, switched on
            here unless triton was already imported without TRITON_INTERPRET=1), "flex"
            (FlexAttention, fixed patterns). Default: "auto".
        params: trainable mechanism parameters (ZETA's ``gamma``, a gate's ``gate_weight``...),
            as made by ``pattern.make_parameters``. Default: the pattern's fixed defaults.
        return_lse: also return the log-sum-exp of each row's scaled kept scores (softmax
            mechanisms only; see ``merge_partials`` in attention/lse.py). Default: False.
        cu_seqlens: [D + 1] int cumulative document lengths of a packed batch q, k, v
            [1, H, T, *]: each document is attended alone (attention/varlen.py). Every path;
            N == M, no key_padding_mask. FULL, BAND and BLOC without global tokens
            on the Triton path ("auto" on CUDA) run in one kernel call with no host read; the
            rest one call per document. Default: None.
    Returns:
        [B, Hq, N, Dv] in q's dtype; rows with no allowed key are zero. With ``return_lse``,
        (out, lse) with lse [B, Hq, N] fp32, natural log, -inf on rows with no key.
    """
    spec = parse_pattern(pattern)
    check_inputs(q, k, v, key_padding_mask)
    if cu_seqlens is not None:
        check_packed_shapes(cu_seqlens, q, k, key_padding_mask)  # the cut points' values: by the path in _packed
        return _packed(spec, q, k, v, cu_seqlens, causal=causal, scale=scale, impl=impl, params=params, return_lse=return_lse)
    decoding = check_alignment(spec, q.shape[2], k.shape[2], causal)
    if return_lse:
        check_lse_support(spec)
    if q.shape[0] == 0 or q.shape[2] == 0:
        return _no_queries(q, k, v, return_lse)
    chosen = resolve_impl(spec, impl, q, decoding, lse=return_lse)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if return_lse and chosen == "triton":
        return _triton_with_lse(
            spec, q, k, v, decoding, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params
        )
    kwargs: dict[str, Any] = {"scale": scale, "key_padding_mask": key_padding_mask, "params": params}
    if decoding:  # expands kv heads itself, only where a path needs it (never the whole cache for FULL or a window)
        out = decode_attention(spec, chosen, q, k, v, **kwargs)
    else:
        if chosen != "triton" and spec.expands_kv:
            k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
        out = getattr(spec, chosen)(q, k, v, causal=causal, **kwargs)
    if not return_lse:
        return out.to(q.dtype)
    k = expand_kv(k, q.shape[1]) if spec.expands_kv else k
    return out.to(q.dtype), _lse(spec, chosen, q, k, decoding, causal, **kwargs)


def _no_queries(q: Tensor, k: Tensor, v: Tensor, return_lse: bool) -> Tensor | tuple[Tensor, Tensor]:
    """An empty batch or no query rows (a data-parallel shard or an evaluation remainder without
    sequences): the empty [B, Hq, N, Dv] output through dense SDPA, which gives empty gradients,
    instead of kernels launched on empty grids."""
    out = torch.nn.functional.scaled_dot_product_attention(q, expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1]))
    if not return_lse:
        return out
    return out, q.new_empty(q.shape[:3], dtype=torch.float32)


def _packed(spec: Pattern, q: Tensor, k: Tensor, v: Tensor, cu_seqlens: Tensor, *, impl: str, **kwargs):
    """A packed batch in one run-kernel call where the pattern's rows are runs of their documents
    and the path is Triton ("auto" on CUDA too, for FULL as well), else each document through
    ``sparse_attention`` alone."""
    chosen = resolve_impl(spec, impl, q)  # FULL has no Triton path, but "auto" on CUDA packs it as runs too
    one = torch.ones(1, dtype=torch.long)  # a host probe: does the pattern give runs at all
    if (chosen == "triton" or (impl == "auto" and q.is_cuda)) and spec.packed_runs(one - 1, one, kwargs["causal"]) is not None:
        scale = q.shape[-1] ** -0.5 if kwargs["scale"] is None else float(kwargs["scale"])
        return packed_run_attention(
            spec, q, k, v, cu_seqlens, causal=kwargs["causal"], scale=scale, return_lse=kwargs["return_lse"]
        )
    cuts = check_cu_seqlens(cu_seqlens, q, k, None)  # sparse_attention checked the padding
    for a, b in itertools.pairwise(cuts):
        check_alignment(spec, b - a, b - a, kwargs["causal"])
    # every path, Triton included, runs each document as its own call (the impl resolves per call)
    return packed_attention(lambda qd, kd, vd: sparse_attention(qd, kd, vd, spec, impl=impl, **kwargs), q, k, v, cuts)


def _lse(spec: Pattern, impl: str, q: Tensor, k: Tensor, decoding: bool, causal: bool, **kwargs) -> Tensor:
    """The rows' lse [B, Hq, N] from the pattern's row_mask (k GQA-expanded); decoding reads
    the last N rows of the padded square."""
    chunk = None if impl == "reference" else DEFAULT_ROW_CHUNK
    if decoding:
        full_q = padded_queries(q, k.shape[2])
        return attention_lse(spec, full_q, k, causal=True, first_row=k.shape[2] - q.shape[2], chunk=chunk, **kwargs)
    return attention_lse(spec, q, k, causal=causal, chunk=chunk, **kwargs)


def _triton_with_lse(spec: Pattern, q: Tensor, k: Tensor, v: Tensor, decoding: bool, **kwargs) -> tuple[Tensor, Tensor]:
    if not decoding:
        out, lse = triton_with_lse(spec, q, k, v, **kwargs)
        return out.to(q.dtype), lse
    kwargs["causal"] = True
    offset = k.shape[2] - q.shape[2]
    out, lse = triton_with_lse(spec, padded_queries(q, k.shape[2]), k, v, **kwargs)
    return out[:, :, offset:].to(q.dtype), lse[:, :, offset:]


def selection_mask(
    pattern: str | Pattern,
    q: Tensor,
    k: Tensor,
    *,
    causal: bool = False,
    key_padding_mask: Tensor | None = None,
    params: dict[str, Tensor] | None = None,
) -> Tensor:
    """Boolean [B, Hq, N, M] mask of the (query, key) pairs the pattern keeps.

    For weighting mechanisms (sparsemax, entmax, gates) it is the support of the weights.
    Materialises N x M: for tests, pictures and analysis at small N.
    """
    spec = parse_pattern(pattern)
    check_inputs(q, k, k, key_padding_mask)
    decoding = check_alignment(spec, q.shape[2], k.shape[2], causal)
    k = expand_kv(k, q.shape[1]) if spec.expands_kv else k
    with torch.no_grad():
        if decoding:
            full = spec.full_mask(padded_queries(q, k.shape[2]), k, True, key_padding_mask, params)
            return full[:, :, k.shape[2] - q.shape[2] :]
        return spec.full_mask(q, k, causal, key_padding_mask, params)
