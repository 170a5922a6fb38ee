"""Look inside a model's attention layers: forward hooks on every ``SparseAttention``.

Each hook recomputes the layer's queries and keys from its input with ``module.project`` and
hands them to a callback as an ``AttentionCall``, from which the analysis takes scores, the
selection mask and the keys a query was allowed to pick.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from sparsefocus.attention import selection_mask
from sparsefocus.attention.common import expand_kv
from sparsefocus.layers import SparseAttention


@dataclass
class AttentionCall:
    """One forward call of one attention layer.

    q: [B, H, N, Dqk]; k: [B, H, M, Dqk] (GQA already expanded); key_padding_mask: [B, M] bool or
    None; x: the layer's input [B, N, dim] (mechanisms that read it, such as DSA's indexer).
    """

    layer: str
    module: SparseAttention
    q: Tensor
    k: Tensor
    key_padding_mask: Tensor | None
    x: Tensor | None = None
    _kept: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def params(self) -> dict | None:
        """The ``params`` the layer passed: its mechanism's parameters, plus x where it reads it."""
        if self.x is not None:
            return self.module.mechanism_params(self.x)
        return dict(self.module.mechanism) or None

    def scores(self) -> Tensor:
        """Scaled dot products <q, k> / sqrt(Dqk) in fp32: [B, H, N, M] (the layer's own scale)."""
        return torch.matmul(self.q.float(), self.k.float().transpose(-1, -2)) * self.q.shape[-1] ** -0.5

    def kept(self) -> Tensor:
        """[B, H, N, M] bool: the pairs the layer's pattern keeps (computed once per call: the
        statistics and the recall both read it, and for TOPK it is an exact selection)."""
        if self._kept is None:
            self._kept = selection_mask(
                self.module.pattern,
                self.q,
                self.k,
                causal=self.module.causal,
                key_padding_mask=self.key_padding_mask,
                params=self.params,
            )
        return self._kept

    def allowed(self) -> Tensor:
        """[B or 1, 1, N, M] bool: the keys any mechanism could pick (causal cut and padding)."""
        n_queries, n_keys = self.q.shape[-2], self.k.shape[-2]
        allowed = torch.ones(1, 1, n_queries, n_keys, dtype=torch.bool, device=self.q.device)
        if self.module.causal:
            allowed = allowed & torch.ones(n_queries, n_keys, dtype=torch.bool, device=self.q.device).tril()
        if self.key_padding_mask is not None:
            allowed = allowed & self.key_padding_mask[:, None, None, :]
        return allowed


def attention_layers(model: nn.Module) -> list[tuple[str, SparseAttention]]:
    """Every ``SparseAttention`` (subclasses included) of ``model`` with its qualified name, in order."""
    return [(name, module) for name, module in model.named_modules() if isinstance(module, SparseAttention)]


def _hook(name: str, callback: Callable[[AttentionCall], None]):
    def hook(module: SparseAttention, args: tuple, kwargs: dict, output: Tensor) -> None:
        x = args[0] if args else kwargs["x"]
        padding = args[1] if len(args) > 1 else kwargs.get("key_padding_mask")
        with torch.no_grad():
            q, k, _ = module.project(x)
        callback(AttentionCall(name, module, q, expand_kv(k, q.shape[1]), padding, x))

    return hook


@contextlib.contextmanager
def capture_attention(model: nn.Module, callback: Callable[[AttentionCall], None]) -> Iterator[list[str]]:
    """While inside, every attention layer's forward also calls ``callback(AttentionCall)``.

    Yields the layer names. Raises ValueError if the model has no ``SparseAttention`` layer.
    """
    layers = attention_layers(model)
    if not layers:
        raise ValueError(f"{type(model).__name__} has no SparseAttention layer to analyse")
    handles = [module.register_forward_hook(_hook(name, callback), with_kwargs=True) for name, module in layers]
    try:
        yield [name for name, _ in layers]
    finally:
        for handle in handles:
            handle.remove()
