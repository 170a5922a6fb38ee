"""``Encoder``: a transformer encoder for sequence classification over any attention pattern.

Read top to bottom: pad to a multiple of k (``pad_to_multiple_of_k``), embed (with g global
tokens prepended or, with ``global_tokens="append_paper"``, appended, and an optional CLS token
prepended), run the blocks, pool, classify. ``ModelConfig.paper_mode`` reproduces the Semantic
Focus code; with ``global_tokens="append_paper"`` and ``pad_to_multiple_of_k`` its layout too.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from sparsefocus.attention.patterns import Pattern
from sparsefocus.models.blocks import Block, Embedding, init_weights, padding_mask
from sparsefocus.models.config import (
    ModelConfig,
    block_patterns,
    padded_length,
    padding_multiple,
    place_global_tokens,
)


class Encoder(nn.Module):
    """Bidirectional transformer classifier.

    Args:
        config: the architecture (``ModelConfig``).
        mechanism: one pattern spec for every block, or a list with one spec per block.
        vocab_size: number of token ids. num_classes: number of output classes.
        max_len: longest input length L (learned positions need it).
        pad_id: the padding token id, or None. Clean mode masks padded keys and pools over real
            tokens only; ``paper_mode`` attends to and pools over everything, as the paper's code.
            ``pad_to_multiple_of_k`` needs it.
    Shapes:
        idx [B, L] long -> logits [B, num_classes]. Inside, the row is
        [globals (prepend) | CLS | L tokens | PAD to a multiple of k | globals (append_paper)].
    """

    def __init__(
        self,
        config: ModelConfig,
        mechanism: "str | Pattern | list",
        *,
        vocab_size: int,
        num_classes: int,
        max_len: int,
        pad_id: int | None = None,
    ) -> None:
        super().__init__()
        config.validate()
        self.config, self.pad_id = config, pad_id
        self.patterns = place_global_tokens(block_patterns(mechanism, config.blocks), config.global_tokens)
        self.num_global_tokens = max(p.num_global_tokens for p in self.patterns)
        self.use_cls = config.pooling == "cls"
        appended = config.global_tokens == "append_paper" and self.num_global_tokens > 0
        if appended and self.use_cls:
            raise ValueError(
                "model.global_tokens=append_paper has no CLS token (nor has the paper's code): use model.pooling=mean"
            )
        self.num_suffix = self.num_global_tokens if appended else 0
        self.num_prefix = self.num_global_tokens - self.num_suffix + int(self.use_cls)
        self.pad_multiple = padding_multiple(self.patterns) if config.pad_to_multiple_of_k else 1
        if self.pad_multiple > 1 and pad_id is None:
            raise ValueError("model.pad_to_multiple_of_k needs a pad id, and this task has none")
        max_len = padded_length(max_len, self.pad_multiple)
        self.embedding = Embedding(config, vocab_size, max_len, self.num_prefix, self.num_suffix)
        self.blocks = nn.ModuleList(Block(config, pattern, causal=False, first=i == 0) for i, pattern in enumerate(self.patterns))
        self.final_norm = nn.Identity() if config.paper_mode else nn.LayerNorm(config.dim)
        self.classifier = nn.Linear(config.dim, num_classes)
        if config.paper_mode:
            nn.init.uniform_(self.classifier.weight, -0.1, 0.1)
            nn.init.zeros_(self.classifier.bias)
        if config.init_std > 0:
            init_weights(self, config.init_std)

    def forward(self, idx: Tensor) -> Tensor:
        idx = self.pad(idx)  # [B, L'], L' a multiple of k with pad_to_multiple_of_k
        mask = None if self.config.paper_mode else padding_mask(idx, self.pad_id, self.num_prefix, self.num_suffix)
        x = self.embedding(idx)  # [B, P+L'+S, dim]
        for block in self.blocks:
            x = block(x, mask)
        x = self.final_norm(x)
        return self.classifier(self.pool(x, mask))  # [B, C]

    def pad(self, idx: Tensor) -> Tensor:
        """[B, L] -> [B, L'] right-padded with the pad id to a multiple of ``pad_multiple``."""
        extra = padded_length(idx.shape[1], self.pad_multiple) - idx.shape[1]
        return F.pad(idx, (0, extra), value=self.pad_id) if extra else idx

    def pool(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """[B, P+L'+S, dim] -> [B, dim]: the CLS state, the mean over everything (paper_mode), or the
        mean over real tokens (no prefix, suffix or padding)."""
        if self.use_cls:
            return x[:, self.num_prefix - 1]
        if self.config.paper_mode:
            return x.mean(dim=1)
        stop = x.shape[1] - self.num_suffix
        tokens = x[:, self.num_prefix : stop]  # [B, L', dim]
        if mask is None:
            return tokens.mean(dim=1)
        real = mask[:, self.num_prefix : stop, None].to(x.dtype)  # [B, L', 1]
        return (tokens * real).sum(dim=1) / real.sum(dim=1).clamp(min=1.0)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
