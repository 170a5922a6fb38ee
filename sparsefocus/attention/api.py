"""The one functional API: ``sparse_attention`` and ``selection_mask``, in SDPA's layout."""

from __future__ import annotations

import importlib.util
import os
import sys

import torch
from torch import Tensor

from sparsefocus.attention.common import expand_kv
from sparsefocus.attention.patterns import Pattern, parse_pattern

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


def resolve_impl(pattern: Pattern, impl: str, q: Tensor) -> str:
    """Pick the implementation: "auto" -> Triton on CUDA where the pattern has one, else lean."""
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}; valid: {', '.join(IMPLS)}")
    if impl == "auto":
        return "triton" if q.is_cuda and "triton" in pattern.impls else "lean"
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


def sparse_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    pattern: "str | Pattern",
    *,
    causal: bool = False,
    scale: float | None = None,
    key_padding_mask: Tensor | None = None,
    impl: str = "auto",
    params: dict[str, Tensor] | None = None,
) -> Tensor:
    """Sparse attention in the layout of ``F.scaled_dot_product_attention``.

    Args:
        q: [B, Hq, N, D] queries. k: [B, Hk, M, D] keys, v: [B, Hk, M, Dv] values; Hq % Hk == 0 (GQA).
        pattern: a spec or string such as ``"TOPK:5"``, ``"BAND:5(1)"``, ``"zeta:k=32,dk=3"``.
        causal: query i only sees keys j <= i (needs N == M). Default: False.
        scale: score scale. Default: 1/sqrt(D).
        key_padding_mask: [B, M] bool, True = a real key; padded keys are never attended. Default: None.
        impl: "auto" (Triton kernel on CUDA where one exists, else "lean"), "reference" (dense
            fp32 definition), "lean" (no N x M tensor where the mechanism allows), "triton"
            (on a CPU tensor: Triton's interpreter, slow, switched on here unless triton was already
            imported without TRITON_INTERPRET=1), "flex" (FlexAttention, fixed patterns). Default: "auto".
        params: trainable mechanism parameters (ZETA's ``gamma``, a gate's ``gate_weight``...),
            as made by ``pattern.make_parameters``. Default: the pattern's fixed defaults.
    Returns:
        [B, Hq, N, Dv] in q's dtype. Rows with no allowed key are zero.
    """
    spec = parse_pattern(pattern)
    check_inputs(q, k, v, key_padding_mask)
    spec.check_sizes(q.shape[2], k.shape[2], causal)
    chosen = resolve_impl(spec, impl, q)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if chosen != "triton":
        k, v = expand_kv(k, q.shape[1]), expand_kv(v, q.shape[1])
    run = getattr(spec, chosen)
    out = run(q, k, v, causal=causal, scale=scale, key_padding_mask=key_padding_mask, params=params)
    return out.to(q.dtype)


def selection_mask(
    pattern: "str | Pattern",
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
    spec.check_sizes(q.shape[2], k.shape[2], causal)
    k = expand_kv(k, q.shape[1])
    with torch.no_grad():
        return spec.full_mask(q, k, causal, key_padding_mask, params)
