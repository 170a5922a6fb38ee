"""Pieces shared by the kernels' ``torch.library`` ops (namespace ``sparsefocus``).

Every Triton launcher in this package is a ``torch.library.custom_op``: ``torch.compile`` sees one
opaque call with a fake (shape-only) implementation instead of tracing into the Triton launch,
and autograd goes through ``register_autograd``. Custom ops return no ``None``, so an output
that a call does not produce (the extra slot's gradients without an extra slot, ...) is a [0]
stand-in that the public function drops; which outputs are real follows from the arguments alone
(``extra_key is None``, ...), never from data.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

NAMESPACE = "sparsefocus"
LN2 = math.log(2.0)


def op_name(name: str) -> str:
    """``sparsefocus::name``, the qualified name of an op of this package."""
    return f"{NAMESPACE}::{name}"


def absent(like: Tensor) -> Tensor:
    """The [0] stand-in for an output that this call does not produce (fresh, so it aliases nothing)."""
    return like.new_empty(0)


def lse_from_log2(stat: Tensor) -> Tensor:
    """Natural log-sum-exp [B, H, N] fp32 from the kernels' base-2 one (+inf marks a row with no
    key, so that its backward weights are exp2(s - inf) = 0): -inf there, stat * ln 2 elsewhere."""
    return torch.where(torch.isposinf(stat), float("-inf"), stat * LN2)


def lse_from_weight_sum(total: Tensor) -> Tensor:
    """Cauchy rows: log of the sum of the weights (0 for a row with no key: -inf). A Cauchy weight
    is exp(log w), so this is the log-sum-exp of the scores log w and merges like a softmax's."""
    return total.log()
