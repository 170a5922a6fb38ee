"""Mixture-of-Experts feed-forward layer with top-k token-to-expert routing.

Router: G(x) = softmax((W_g x + b_g) / temperature) over E experts; each token is sent to its
top-k experts and y = sum_i G(x)_i E_i(x) over those (optionally renormalised over the k). A
load-balancing loss keeps experts busy: ``"cv2"`` is lambda * CV(expert importance)^2 +
lambda * CV(expert load)^2 (Shazeer et al. 2017, as in the tutorial seed), ``"switch"`` is
E * sum_e f_e P_e (Switch Transformer), f_e the fraction of routed slots that go to expert e and
P_e its mean router probability.

``forward`` dispatches tokens to experts (each expert runs on its own tokens only);
``forward_reference`` runs every expert on every token and masks: the slow twin.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

ACTIVATIONS = {"relu": nn.ReLU, "gelu": nn.GELU, "mish": nn.Mish}
BALANCE_LOSSES = ("cv2", "switch")


def coefficient_of_variation_sq(x: Tensor) -> Tensor:
    """CV(x)^2 = var(x) / mean(x)^2 over a 1-D tensor (0 when there is a single entry)."""
    if x.numel() <= 1:
        return x.new_zeros(())
    return x.float().var() / (x.float().mean() ** 2 + 1e-10)


class MoEFeedForward(nn.Module):
    """Top-k routed mixture of two-layer MLP experts.

    Args:
        dim: model width. hidden: expert MLP width. num_experts: E. top_k: experts per token.
        activation: "relu", "gelu" or "mish". Default: "gelu".
        temperature: router softmax temperature. Default: 1.0.
        renormalize: divide the k gate values by their sum. Default: False (the tutorial's form).
        balance_loss: "cv2" or "switch". Default: "switch".
        balance_weight: lambda, the loss's weight. Default: 0.01.
    Shapes:
        x: [B, N, dim] -> [B, N, dim]. After each forward ``self.aux_loss`` holds the scalar
        load-balancing loss (add it to the training loss) and ``self.last_load`` the [E] token counts.
    """

    def __init__(
        self,
        dim: int,
        hidden: int,
        num_experts: int,
        top_k: int = 2,
        *,
        activation: str = "gelu",
        temperature: float = 1.0,
        renormalize: bool = False,
        balance_loss: str = "switch",
        balance_weight: float = 0.01,
    ) -> None:
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, num_experts={num_experts}], got {top_k}")
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; valid: {', '.join(ACTIVATIONS)}")
        if balance_loss not in BALANCE_LOSSES:
            raise ValueError(f"unknown balance_loss {balance_loss!r}; valid: {', '.join(BALANCE_LOSSES)}")
        if temperature <= 0:
            raise ValueError(f"temperature must be > 0, got {temperature}")
        self.num_experts, self.top_k, self.temperature = num_experts, top_k, temperature
        self.renormalize, self.balance_loss, self.balance_weight = renormalize, balance_loss, balance_weight
        self.router = nn.Linear(dim, num_experts)
        self.experts = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, hidden), ACTIVATIONS[activation](), nn.Linear(hidden, dim)) for _ in range(num_experts)
        )
        self.aux_loss: Tensor = torch.zeros(())
        self.last_load: Tensor = torch.zeros(num_experts)

    def route(self, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """tokens [T, dim] -> router probs [T, E], chosen experts [T, k], their gates [T, k]."""
        probs = torch.softmax(self.router(tokens) / self.temperature, dim=-1)  # [T, E]
        gates, experts = probs.topk(self.top_k, dim=-1)  # [T, k]
        if self.renormalize:
            gates = gates / gates.sum(-1, keepdim=True)
        return probs, experts, gates

    def _balance(self, probs: Tensor, experts: Tensor) -> Tensor:
        load = torch.bincount(experts.reshape(-1), minlength=self.num_experts).to(probs.dtype)  # [E]
        self.last_load = load.detach()
        if self.balance_loss == "switch":
            fraction = load / load.sum()
            loss = self.num_experts * (fraction * probs.mean(0)).sum()
        else:
            loss = coefficient_of_variation_sq(probs.sum(0)) + coefficient_of_variation_sq(load)
        return self.balance_weight * loss

    def forward(self, x: Tensor) -> Tensor:
        tokens = x.reshape(-1, x.shape[-1])  # [T, dim]
        probs, experts, gates = self.route(tokens)
        out = torch.zeros_like(tokens)
        for expert_id, expert in enumerate(self.experts):
            token_ids, slot = (experts == expert_id).nonzero(as_tuple=True)  # routed (token, slot) pairs
            if token_ids.numel() == 0:
                continue
            weighted = expert(tokens[token_ids]) * gates[token_ids, slot, None]  # [t, dim]
            out = out.index_add(0, token_ids, weighted)
        self.aux_loss = self._balance(probs, experts)
        return out.reshape(x.shape)

    def forward_reference(self, x: Tensor) -> Tensor:
        """Every expert on every token, weighted by a dense [T, E] gate matrix (zeros off the top-k)."""
        tokens = x.reshape(-1, x.shape[-1])  # [T, dim]
        probs, experts, gates = self.route(tokens)
        dense_gates = torch.zeros_like(probs).scatter(1, experts, gates)  # [T, E]
        outputs = torch.stack([expert(tokens) for expert in self.experts], dim=1)  # [T, E, dim]
        self.aux_loss = self._balance(probs, experts)
        return (dense_gates[..., None] * outputs).sum(1).reshape(x.shape)
