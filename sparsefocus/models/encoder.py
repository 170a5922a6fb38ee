"""``Encoder``: a transformer encoder for sequence classification over any attention pattern.

Read top to bottom: embed (with g global tokens and an optional CLS token prepended), run the
blocks, pool, classify. ``ModelConfig.paper_mode`` reproduces the Semantic Focus code.
"""

from __future__ import annotations

from torch import Tensor, nn

from sparsefocus.attention.patterns import Pattern
from sparsefocus.models.blocks import Block, Embedding, init_weights, padding_mask
from sparsefocus.models.config import ModelConfig, block_patterns


class Encoder(nn.Module):
    """Bidirectional transformer classifier.

    Args:
        config: the architecture (``ModelConfig``).
        mechanism: one pattern spec for every block, or a list with one spec per block.
        vocab_size: number of token ids. num_classes: number of output classes.
        max_len: longest input length L (learned positions need it).
        pad_id: the padding token id, or None. Clean mode masks padded keys and pools over real
            tokens only; ``paper_mode`` attends to and pools over everything, as the paper's code.
    Shapes:
        idx [B, L] long -> logits [B, num_classes].
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
        self.patterns = block_patterns(mechanism, config.blocks)
        self.num_global_tokens = max(p.num_global_tokens for p in self.patterns)
        self.use_cls = config.pooling == "cls"
        self.num_prefix = self.num_global_tokens + int(self.use_cls)
        self.embedding = Embedding(config, vocab_size, max_len, self.num_prefix)
        self.blocks = nn.ModuleList(
            Block(config, pattern, causal=False, first=i == 0) for i, pattern in enumerate(self.patterns)
        )
        self.final_norm = nn.Identity() if config.paper_mode else nn.LayerNorm(config.dim)
        self.classifier = nn.Linear(config.dim, num_classes)
        if config.paper_mode:
            nn.init.uniform_(self.classifier.weight, -0.1, 0.1)
            nn.init.zeros_(self.classifier.bias)
        if config.init_std > 0:
            init_weights(self, config.init_std)

    def forward(self, idx: Tensor) -> Tensor:
        mask = None if self.config.paper_mode else padding_mask(idx, self.pad_id, self.num_prefix)  # [B, P+L]
        x = self.embedding(idx)  # [B, P+L, dim]
        for block in self.blocks:
            x = block(x, mask)
        x = self.final_norm(x)
        return self.classifier(self.pool(x, mask))  # [B, C]

    def pool(self, x: Tensor, mask: Tensor | None) -> Tensor:
        """[B, P+L, dim] -> [B, dim]: the CLS state, the mean over everything (paper_mode), or the
        mean over real, non-prefix tokens."""
        if self.use_cls:
            return x[:, self.num_global_tokens]
        if self.config.paper_mode:
            return x.mean(dim=1)
        tokens = x[:, self.num_prefix :]  # [B, L, dim]
        if mask is None:
            return tokens.mean(dim=1)
        real = mask[:, self.num_prefix :, None].to(x.dtype)  # [B, L, 1]
        return (tokens * real).sum(dim=1) / real.sum(dim=1).clamp(min=1.0)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())
