"""The pieces both models share: embeddings with global/CLS prefix tokens, pre-LN blocks, the MLP,
and the Semantic Focus code's attention (``PaperAttention``) used when ``paper_mode`` is on."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from sparsefocus.attention import selection_mask
from sparsefocus.attention.common import expand_kv
from sparsefocus.attention.patterns import Pattern
from sparsefocus.layers import SparseAttention
from sparsefocus.models.config import ModelConfig

ACTIVATION_MODULES = {"relu": nn.ReLU, "gelu": nn.GELU, "mish": nn.Mish}
PAPER_FILL = -1e15


def is_softmax_over_kept_keys(pattern: Pattern) -> bool:
    """True when the pattern's definition is a softmax over its selection mask (so the paper's dense
    masked softmax computes the same function)."""
    return type(pattern).reference is Pattern.reference


class PaperAttention(SparseAttention):
    """The Semantic Focus code's attention: dense scores, unselected entries filled with -1e15, a
    full-row softmax, then ``F.dropout(weights, p)`` that stays active in eval mode (the original
    never passes ``training``). Same projections and parameters as ``SparseAttention``.

    Shapes: x [B, N, dim], key_padding_mask [B, N] bool or None -> [B, N, dim].
    """

    def __init__(self, dim: int, heads: int, pattern: "str | Pattern", *, attention_dropout: float, **kwargs) -> None:
        super().__init__(dim, heads, pattern, **kwargs)
        if not is_softmax_over_kept_keys(self.pattern):
            raise ValueError(f"paper_mode needs a softmax-over-kept-keys pattern, {self.pattern.label()} is not one")
        self.attention_dropout = attention_dropout

    def forward(
        self,
        x: Tensor,
        key_padding_mask: Tensor | None = None,
        past_kv: tuple[Tensor, Tensor] | None = None,
        use_cache: bool = False,
    ) -> Tensor:
        """SparseAttention's signature; the paper's attention has no KV cache (past_kv, use_cache)."""
        if past_kv is not None or use_cache:
            raise ValueError("PaperAttention (paper_mode) has no KV cache: past_kv and use_cache are not supported")
        q, k, v = self.project(x)
        params = dict(self.mechanism) or None
        keep = selection_mask(self.pattern, q, k, causal=self.causal, key_padding_mask=key_padding_mask, params=params)
        k, v = expand_kv(k, self.heads), expand_kv(v, self.heads)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.qk_dim)  # [B, H, N, N]
        weights = scores.masked_fill(~keep, PAPER_FILL).softmax(dim=-1)
        weights = F.dropout(weights, self.attention_dropout, training=True)
        out = torch.matmul(weights, v)  # [B, H, N, Dh]
        out = out.transpose(1, 2).reshape(x.shape[0], x.shape[1], self.heads * self.head_dim)  # [B, N, H*Dh]
        return self.out_proj(out)


class MLP(nn.Module):
    """Linear(d -> d_mlp) -> activation -> Linear(d_mlp -> d); the paper's code puts a dropout
    *before* the activation, which ``paper_mode`` reproduces."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.up = nn.Linear(config.dim, config.mlp_dim)
        self.inner_dropout = nn.Dropout(config.dropout if config.paper_mode else 0.0)
        self.activation = ACTIVATION_MODULES[config.activation]()
        self.down = nn.Linear(config.mlp_dim, config.dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(self.activation(self.inner_dropout(self.up(x))))


class Block(nn.Module):
    """Pre-LN block: x += Drop(Attn(LN(x))); x += Drop(MLP(LN(x))).

    In ``paper_mode`` the LayerNorms have no affine parameters and the first block's attention
    LayerNorm has eps=0, as in the paper's code.
    """

    def __init__(self, config: ModelConfig, pattern: Pattern, *, causal: bool, first: bool) -> None:
        super().__init__()
        affine = not config.paper_mode
        attn_eps = 0.0 if (config.paper_mode and first) else 1e-5
        self.attn_norm = nn.LayerNorm(config.dim, eps=attn_eps, elementwise_affine=affine)
        self.mlp_norm = nn.LayerNorm(config.dim, elementwise_affine=affine)
        common = dict(causal=causal, head_dim=config.resolved_head_dim(), impl=config.impl)
        if config.paper_mode:
            self.attn = PaperAttention(config.dim, config.heads, pattern, attention_dropout=config.dropout, **common)
        else:
            self.attn = SparseAttention(config.dim, config.heads, pattern, **common)
        self.mlp = MLP(config)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: Tensor, key_padding_mask: Tensor | None = None) -> Tensor:
        x = x + self.dropout(self.attn(self.attn_norm(x), key_padding_mask))
        return x + self.dropout(self.mlp(self.mlp_norm(x)))


def sinusoidal_positions(length: int, dim: int, device: torch.device) -> Tensor:
    """[length, dim] sin/cos positional table of Vaswani et al. (odd dim: last cosine column dropped)."""
    position = torch.arange(length, device=device, dtype=torch.float32)[:, None]
    frequency = torch.exp(torch.arange(0, dim, 2, device=device, dtype=torch.float32) * (-math.log(10000.0) / dim))
    table = torch.zeros(length, dim, device=device)
    table[:, 0::2] = torch.sin(position * frequency)
    table[:, 1::2] = torch.cos(position * frequency)[:, : dim // 2]
    return table


class Embedding(nn.Module):
    """Token embedding with ``num_prefix`` learned prefix tokens (global tokens, then CLS),
    ``num_suffix`` learned suffix tokens (global tokens appended, as the Semantic Focus code) and
    positions over the whole row.

    Shapes: idx [B, L] long -> [B, num_prefix + L + num_suffix, dim]. The paper's code multiplies
    the token embedding by sqrt(d); ``paper_mode`` does too and initialises it U(-0.1, 0.1).
    """

    def __init__(self, config: ModelConfig, vocab_size: int, max_len: int, num_prefix: int, num_suffix: int = 0) -> None:
        super().__init__()
        self.dim, self.num_prefix, self.kind = config.dim, num_prefix, config.positions
        self.tokens = nn.Embedding(vocab_size, config.dim)
        self.prefix = nn.Embedding(num_prefix, config.dim) if num_prefix else None
        self.suffix = nn.Embedding(num_suffix, config.dim) if num_suffix else None
        total = num_prefix + max_len + num_suffix
        self.learned_positions = nn.Embedding(total, config.dim) if self.kind == "learned" else None
        self.scale = math.sqrt(config.dim) if config.paper_mode else 1.0
        self.dropout = nn.Dropout(config.dropout)
        if config.paper_mode:
            for table in (self.tokens, self.prefix, self.suffix):
                if table is not None:
                    nn.init.uniform_(table.weight, -0.1, 0.1)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tokens(idx)  # [B, L, dim]
        if self.prefix is not None:
            prefix = self.prefix.weight.expand(idx.shape[0], -1, -1)  # [B, P, dim]
            x = torch.cat([prefix, x], dim=1)  # [B, P+L, dim]
        if self.suffix is not None:
            suffix = self.suffix.weight.expand(idx.shape[0], -1, -1)  # [B, S, dim]
            x = torch.cat([x, suffix], dim=1)  # [B, P+L+S, dim]
        x = x * self.scale
        length = x.shape[1]
        if self.learned_positions is not None:
            x = x + self.learned_positions.weight[:length]
        else:
            x = x + sinusoidal_positions(length, self.dim, x.device)
        return self.dropout(x)


def init_weights(model: nn.Module, std: float) -> None:
    """Every Linear and Embedding weight ~ N(0, std), Linear biases zero (GPT-2's init); other
    parameters (LayerNorms, a pattern's own parameters such as ZETA's gamma) are left alone."""
    for module in model.modules():
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=std)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)


def padding_mask(idx: Tensor, pad_id: int | None, num_prefix: int, num_suffix: int = 0) -> Tensor | None:
    """[B, P+L+S] bool, True = real token (prefix and suffix tokens are real), or None without
    ``pad_id`` (and, on the CPU outside torch.compile, when nothing is padded)."""
    if pad_id is None:
        return None
    real = idx != pad_id  # [B, L]
    # the shortcut reads a tensor on the host: CPU eager only (on a GPU it would synchronise every
    # step, and torch.compile would break the graph); a mask of all True gives the same result
    if idx.device.type == "cpu" and not torch.compiler.is_compiling() and bool(real.all()):
        return None
    prefix = torch.ones(idx.shape[0], num_prefix, dtype=torch.bool, device=idx.device)
    suffix = torch.ones(idx.shape[0], num_suffix, dtype=torch.bool, device=idx.device)
    return torch.cat([prefix, real, suffix], dim=1)
