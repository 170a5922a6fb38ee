"""``Decoder``: a causal transformer for next-token tasks over any attention pattern.

Same blocks as the encoder with ``causal=True``; g learned global tokens are prepended when the
pattern asks for them (they sit in every query's past, so causality holds) and their outputs
are dropped before the language-model head.
"""

from __future__ import annotations

from torch import Tensor, nn

from sparsefocus.attention.patterns import Pattern
from sparsefocus.models.blocks import Block, Embedding, init_weights, padding_mask
from sparsefocus.models.config import ModelConfig, block_patterns


class Decoder(nn.Module):
    """Causal language model.

    Args:
        config: the architecture (``ModelConfig``; ``pooling`` is ignored).
        mechanism: one pattern spec for every block, or a list with one spec per block.
        vocab_size: number of token ids (also the output size).
        max_len: longest input length L (learned positions need it).
        pad_id: padding token id or None; clean mode masks padded keys.
    Shapes:
        idx [B, L] long -> logits [B, L, vocab_size].
    """

    def __init__(
        self,
        config: ModelConfig,
        mechanism: "str | Pattern | list",
        *,
        vocab_size: int,
        max_len: int,
        pad_id: int | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        if config.global_tokens != "prepend" or config.pad_to_multiple_of_k:
            raise ValueError(
                "model.global_tokens=append_paper and model.pad_to_multiple_of_k are for the (non-causal) encoder only"
            )
        self.config, self.pad_id = config, pad_id
        self.patterns = block_patterns(mechanism, config.blocks)
        self.num_prefix = max(p.num_global_tokens for p in self.patterns)
        self.embedding = Embedding(config, vocab_size, max_len, self.num_prefix)
        self.blocks = nn.ModuleList(Block(config, pattern, causal=True, first=i == 0) for i, pattern in enumerate(self.patterns))
        self.final_norm = nn.Identity() if config.paper_mode else nn.LayerNorm(config.dim)
        self.head = nn.Linear(config.dim, vocab_size)
        if config.init_std > 0:
            init_weights(self, config.init_std)
        if config.tie_embeddings:
            self.head.weight = self.embedding.tokens.weight  # [V, dim], one matrix in and out

    def forward(self, idx: Tensor, scored: Tensor | None = None) -> Tensor:
        """idx [B, L] -> logits [B, L, V]; with ``scored`` [B, L] bool, logits [S, V] of the S
        positions where it is True only (sparse-target tasks such as MQAR: the V-way head over
        every position would dominate the cost)."""
        mask = None if self.config.paper_mode else padding_mask(idx, self.pad_id, self.num_prefix)  # [B, P+L]
        x = self.embedding(idx)  # [B, P+L, dim]
        for block in self.blocks:
            x = block(x, mask)
        x = x[:, self.num_prefix :]  # [B, L, dim]
        if scored is not None:
            x = x[scored]  # [S, dim]
        return self.head(self.final_norm(x))  # [B, L, V] or [S, V]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
