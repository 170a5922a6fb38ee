"""Hugging Face transformers integration: any registered pattern as an ``attn_implementation``.

    import sparsefocus.hf
    sparsefocus.hf.register("sf-topk", "TOPK", k=8)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sf-topk")

``register`` installs two functions under the name: the attention function
(``transformers.AttentionInterface``) and the mask function (``transformers.AttentionMaskInterface``).
The mask function is needed: transformers builds no mask at all for an implementation it has no
mask function for, which would silently drop the padding. Ours returns only the key padding mask,
[B, 1, 1, M] bool (True = attend), or None without padding; causality comes from the attention
module (``is_causal``), and the pattern decides which keys each query keeps. With a KV cache the
queries are the last positions of the keys (``causal=True`` with N < M in ``sparse_attention``).

Packed sequences (documents concatenated in a row, marked by ``position_ids`` that restart, or by
FlashAttention's ``cu_seq_lens_q/k``) run through ``sparse_attention(cu_seqlens=...)``: each
document is attended alone. Attention dropout (training) runs on the materialised weights, as
transformers' eager attention does. Refused with a clear error: dropout with packing or with a
non-softmax pattern, packing with padding or a cache, sliding-window or other custom masks, caches whose keys extend past the
queries (``StaticCache``), and patterns with their own q/k width (ZETA's ``dk``: HF attention modules
project q and k to the head width; use ``sparsefocus.SparseAttention`` or the library's models).
Trainable mechanism parameters (a gate's weights) are not created in HF models: the pattern's
fixed defaults are used. Needs transformers >= 4.53 (``AttentionMaskInterface``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from sparsefocus.attention import parse_pattern, selection_mask, sparse_attention
from sparsefocus.attention.patterns import Pattern

REGISTERED: dict[str, Pattern] = {}


def _transformers():
    try:
        import transformers
    except ImportError as error:
        raise ImportError("sparsefocus.hf needs transformers: pip install 'sparsefocus[hf]'") from error
    if not hasattr(transformers, "AttentionMaskInterface"):
        raise ImportError(f"sparsefocus.hf needs transformers >= 4.53 (AttentionMaskInterface), found {transformers.__version__}")
    return transformers


def build_pattern(pattern: str | Pattern, **options: Any) -> Pattern:
    """The pattern spec with ``options`` as its parameters: ``build_pattern("TOPK", k=8)`` is
    ``TOPK:8``; with a spec or a string that has parameters, options replace those fields."""
    if not options:
        return parse_pattern(pattern)
    if isinstance(pattern, Pattern) or ":" in pattern:
        spec = parse_pattern(pattern)
        names = {field.name for field in dataclasses.fields(spec)}
        unknown = sorted(set(options) - names)
        if unknown:
            raise ValueError(f"pattern {spec.name} has no parameter {unknown[0]!r}; valid parameters: {', '.join(sorted(names))}")
        return dataclasses.replace(spec, **options)
    return parse_pattern(f"{pattern}:" + ",".join(f"{key}={value}" for key, value in options.items()))


def check_hf_pattern(spec: Pattern) -> None:
    """Refuse patterns that need a q/k width other than the head width (ZETA's ``dk``)."""
    if type(spec).qk_dim is not Pattern.qk_dim:
        raise ValueError(
            f"pattern {spec.label()} scores low-dimensional q/k (width {spec.qk_dim(64)} for 64-wide heads), which needs "
            "its own q/k projection that HF attention modules do not have; use sparsefocus.SparseAttention "
            "(or the library's decoder) for it"
        )


def register(name: str, pattern: str | Pattern, *, impl: str = "auto", **options: Any) -> Pattern:
    """Register ``pattern`` under ``name`` for ``attn_implementation=name``.

    Args:
        name: the implementation name (must not be one of transformers' own).
        pattern: a pattern spec or string (``"TOPK:8"``, ``"BAND:64(4)"``, or a bare name with options).
        impl: passed to ``sparse_attention``. Default: "auto".
        options: pattern parameters, e.g. ``register("sf-band", "BAND", k=64, g=4)``.
    Returns:
        the pattern spec.
    """
    transformers = _transformers()
    spec = build_pattern(pattern, **options)
    check_hf_pattern(spec)
    builtin = {"sdpa", "eager", "flex_attention", "flash_attention_2", "flash_attention_3"}
    if name in builtin:
        raise ValueError(f"attention implementation name {name!r} is one of transformers' own; choose another")
    transformers.AttentionInterface.register(name, make_attention_function(spec, impl))
    transformers.AttentionMaskInterface.register(name, make_mask_function(name))
    REGISTERED[name] = spec
    return spec


def make_attention_function(spec: Pattern, impl: str = "auto") -> Callable[..., tuple[Tensor, None]]:
    """The function transformers calls in every attention layer:
    ``fn(module, query [B, H, S, D], key [B, Hkv, M, D], value, attention_mask, dropout, scaling,
    is_causal, **kwargs) -> (out [B, S, H, Dv], None)``."""

    def attention(
        module: torch.nn.Module,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        attention_mask: Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        is_causal: bool | None = None,
        **kwargs: Any,
    ) -> tuple[Tensor, None]:
        documents = packed_documents(attention_mask, kwargs, query.shape[0], query.shape[2])
        if dropout:
            if documents is not None:
                raise ValueError(f"sparsefocus attention ({spec.label()}) takes attention dropout on unpacked batches only")
            mask = key_padding_from_mask(attention_mask, key.shape[2])
            out = dropout_attention(spec, query, key, value, mask, _is_causal(module, is_causal), scaling, dropout)
            return out.transpose(1, 2).contiguous(), None
        if documents is not None:
            out = _packed_attention(spec, impl, query, key, value, documents, scaling, _is_causal(module, is_causal))
            return out.transpose(1, 2).contiguous(), None
        causal = _is_causal(module, is_causal)
        out = sparse_attention(
            query,
            key,
            value,
            spec,
            causal=causal,
            scale=scaling,
            key_padding_mask=key_padding_from_mask(attention_mask, key.shape[2]),
            impl=impl,
        )  # [B, H, S, Dv]
        return out.transpose(1, 2).contiguous(), None

    attention.__name__ = f"sparsefocus_{spec.name}_attention"
    return attention


def dropout_attention(
    spec: Pattern,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    key_padding_mask: Tensor | None,
    causal: bool,
    scaling: float | None,
    dropout: float,
) -> Tensor:
    """Attention with dropout on the weights, as transformers' eager attention applies it:
    softmax over the pattern's kept keys, then ``F.dropout(weights, dropout)`` on the dense
    [B, Hq, S, M] weights (the same draw as eager's for the same generator state), then the values.
    Materialises the weights, so it is for training at the lengths eager attention handles.
    Patterns whose weights are not a softmax over their kept keys (sparsemax, entmax) are refused."""
    from sparsefocus.attention.common import expand_kv, masked_softmax
    from sparsefocus.models.blocks import is_softmax_over_kept_keys

    if not is_softmax_over_kept_keys(spec):
        raise ValueError(f"sparsefocus attention ({spec.label()}) has no attention dropout: its weights are not a softmax")
    keep = selection_mask(spec, query, key, causal=causal, key_padding_mask=key_padding_mask)  # [B, Hq, S, M]
    heads = query.shape[1]
    key, value = expand_kv(key, heads), expand_kv(value, heads)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale  # [B, Hq, S, M]
    weights = masked_softmax(scores.float(), keep).to(query.dtype)  # rows keeping no key: zeros
    weights = torch.nn.functional.dropout(weights, p=dropout, training=True)
    return torch.matmul(weights, value)  # [B, Hq, S, Dv]


def document_ids(mask: Tensor) -> Tensor | None:
    """[B, S] long document index of each position when ``mask`` [B, 1, S, S] bool is packed
    documents (block diagonal, causal or not, every query seeing at least itself), else None. A
    document starts where a query cannot see the key just before it."""
    rows = mask[:, 0]  # [B, S, S]
    n = rows.shape[-1]
    sees_previous = rows.diagonal(offset=-1, dim1=-2, dim2=-1)  # [B, S-1]
    starts = torch.cat([torch.ones_like(rows[:, :, 0][:, :1]), ~sees_previous], dim=1)
    ids = starts.long().cumsum(-1) - 1  # [B, S]
    same = ids[:, :, None] == ids[:, None, :]  # [B, S, S]
    causal = same & torch.ones(n, n, dtype=torch.bool, device=mask.device).tril()
    return ids if bool(torch.equal(rows, causal) or torch.equal(rows, same)) else None


def packed_documents(attention_mask: Tensor | None, kwargs: dict, batch: int, length: int) -> Tensor | None:
    """[B, S] document ids of a packed batch, or None for an ordinary (padded) one.

    Packing arrives as the dense block-diagonal mask our mask function builds when transformers
    packs through ``position_ids``, or as FlashAttention's ``cu_seq_lens_q/k`` (equal, batch 1)."""
    cuts = kwargs.get("cu_seq_lens_q", kwargs.get("cu_seqlens_q"))
    if cuts is not None:
        other = kwargs.get("cu_seq_lens_k", kwargs.get("cu_seqlens_k"))
        if batch != 1 or (other is not None and not torch.equal(other, cuts)):
            raise ValueError("sparsefocus attention takes packed sequences as one row with cu_seq_lens_q == cu_seq_lens_k")
        lengths = (cuts[1:] - cuts[:-1]).long()
        return torch.repeat_interleave(torch.arange(lengths.shape[0], device=cuts.device), lengths)[None]
    if attention_mask is None or attention_mask.dim() != 4 or attention_mask.dtype != torch.bool:
        return None
    if attention_mask.shape[2] != length or attention_mask.shape[3] != length or length < 2:
        return None
    ids = document_ids(attention_mask)
    return ids if ids is not None and bool(ids[:, -1].gt(0).any()) else None


def _packed_attention(spec, impl, query, key, value, documents, scaling, causal) -> Tensor:
    """Each row's documents attended alone through ``sparse_attention(cu_seqlens=...)``:
    query [B, H, S, D], documents [B, S] -> [B, H, S, Dv]."""
    outs = []
    for row in range(query.shape[0]):
        counts = torch.bincount(documents[row])
        cu_seqlens = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
        part = (query[row : row + 1], key[row : row + 1], value[row : row + 1])
        outs.append(sparse_attention(*part, spec, causal=causal, scale=scaling, cu_seqlens=cu_seqlens, impl=impl))
    return torch.cat(outs)


def _is_causal(module: torch.nn.Module, is_causal: bool | None) -> bool:
    """The layer's causality: the call's ``is_causal``, else the module's, and never causal when
    the model's config says it is bidirectional."""
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    config = getattr(module, "config", None)
    return causal and bool(getattr(config, "is_causal", True))


def key_padding_from_mask(attention_mask: Tensor | None, n_keys: int) -> Tensor | None:
    """[B, M] bool key padding mask (True = real) from a transformers mask: ours ([B, 1, 1, M]
    bool) or any 4-D bool / additive float mask [B, 1, S, M], where a key is real when some query
    may attend to it."""
    if attention_mask is None:
        return None
    if attention_mask.dim() == 2:
        return attention_mask[:, -n_keys:].bool()
    if attention_mask.dim() != 4:
        raise ValueError(f"sparsefocus attention expects a 2-D or 4-D attention mask, got shape {tuple(attention_mask.shape)}")
    mask = attention_mask[:, 0, :, :n_keys]  # [B, S, M]
    if mask.dtype != torch.bool:
        mask = mask > torch.finfo(mask.dtype).min / 2
    return mask.any(dim=1)


def make_mask_function(name: str) -> Callable[..., Tensor | None]:
    """The mask function transformers calls once per forward (``AttentionMaskInterface``)."""

    def sparsefocus_mask(
        batch_size: int,
        kv_length: int,
        kv_offset: int = 0,
        mask_function: Callable | None = None,
        attention_mask: Tensor | None = None,
        **kwargs: Any,
    ) -> Tensor | None:
        _check_queries_are_last(name, kv_length, kv_offset, kwargs)
        if not _is_plain(mask_function):
            return _packed_mask(name, batch_size, kv_length, kv_offset, mask_function, attention_mask, kwargs)
        if attention_mask is None:
            return None
        padding = attention_mask.bool()
        missing = kv_offset + kv_length - padding.shape[-1]
        if missing > 0:
            padding = torch.nn.functional.pad(padding, (0, missing))
        return padding[:, None, None, kv_offset : kv_offset + kv_length]  # [B, 1, 1, M]

    return sparsefocus_mask


def _is_plain(mask_function: Callable | None) -> bool:
    """The plain causal or bidirectional mask (the pattern then decides the keys)."""
    from transformers import masking_utils

    plain = (None, masking_utils.causal_mask_function, getattr(masking_utils, "bidirectional_mask_function", None))
    return mask_function in plain


def _packed_mask(
    name: str, batch_size: int, kv_length: int, kv_offset: int, mask_function: Callable | None, attention_mask, kwargs
) -> Tensor:
    """The dense [B, 1, S, S] bool mask of packed documents (transformers packs through
    ``position_ids``); any other custom mask (a sliding window, an overlay) is refused by name."""
    assert mask_function is not None, "None is the plain mask"
    device = attention_mask.device if attention_mask is not None else kwargs.get("device")
    rows = torch.arange(batch_size, device=device)[:, None, None, None]
    positions = torch.arange(kv_offset, kv_offset + kv_length, device=device)
    try:
        dense = mask_function(rows, torch.zeros_like(rows), positions[None, None, :, None], positions[None, None, None, :])
        dense = torch.as_tensor(dense, device=device).expand(batch_size, 1, kv_length, kv_length).bool()
    except (RuntimeError, IndexError, TypeError):
        dense = None
    padded = attention_mask is not None and not bool(attention_mask.bool().all())
    if kv_offset != 0 or dense is None or padded or document_ids(dense) is None:
        raise ValueError(
            f"attention implementation {name!r} takes plain causal or bidirectional masks with padding, or packed "
            f"documents without padding or cache; the model asked for {getattr(mask_function, '__name__', mask_function)!r} "
            "(a sliding window, a custom overlay, or packing with padding or a cache): set sliding_window=None, or pad "
            "instead of packing"
        )
    return dense


def _check_queries_are_last(name: str, kv_length: int, kv_offset: int, kwargs: dict) -> None:
    """The queries must be the last positions of the keys (a DynamicCache, or no cache)."""
    q_length, q_offset = kwargs.get("q_length"), kwargs.get("q_offset", 0)
    if q_length is None and kwargs.get("cache_position") is not None:  # transformers < 5.x passes positions
        positions = kwargs["cache_position"]
        q_length, q_offset = positions.shape[0], int(positions[0])
    if q_length is None:
        return
    if isinstance(q_offset, Tensor) or q_offset + q_length != kv_offset + kv_length:
        raise ValueError(
            f"attention implementation {name!r} needs the queries to be the last {q_length} of the {kv_length} keys "
            "(a DynamicCache or no cache); a cache whose keys extend past the queries (StaticCache) is not supported"
        )
