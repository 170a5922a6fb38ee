"""Pieces shared by the kernels' ``torch.library`` ops (namespace ``sparsefocus``).

Every Triton launcher in this package is a ``torch.library.custom_op``: ``torch.compile`` sees one
opaque call with a fake (shape-only) implementation instead of tracing into the Triton launch,
and autograd goes through ``register_autograd``. Custom ops return no ``None``, so an output
that a call does not produce (the extra slot's gradients without an extra slot, ...) is a [0]
stand-in that the public function drops; which outputs are real follows from the arguments alone
(``extra_key is None``, ...), never from data. The launchers on BAND's, ZETA's and TOPK's paths
also have ``triton_op`` twins, which a compiled graph launches without a Python call
(``TRITON_OPS``).
"""

from __future__ import annotations

import math
from typing import Callable

import torch
from torch import Tensor

NAMESPACE = "sparsefocus"
LN2 = math.log(2.0)
ROW_TOPK = "auto"
"""``top_positions`` on short rows: "auto" (the Triton kernel ``row_topk`` on CUDA), "triton" (the
kernel everywhere; the CPU through Triton's interpreter, for tests) or "torch" (``torch.topk``)."""
TRITON_OPS = "off"
"""Which op a kernel with a ``triton_op`` twin calls (those of BAND's, ZETA's and TOPK's paths:
runs, morton, scan, zeta_select, indexed, topk_select): "off" (the
``custom_op``, default), "auto" (the ``triton_op`` twin on CUDA) or "on" (the twin everywhere; on
the CPU only eagerly, for tests). Compiled, a ``custom_op`` stays one opaque call that runs our
Python launcher and Triton's at every step, where Inductor traces a ``triton_op``'s body and
launches its kernels from its own wrapper; the twins run the same kernels on the same arguments.
Off until the twins are timed and checked on a GPU."""


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


def kernel_chosen(choice: str, like: Tensor) -> bool:
    """Whether an implementation switch ("auto": the Triton kernel on CUDA, "triton": everywhere,
    the CPU through Triton's interpreter, "torch": never) picks the kernel for a tensor like ``like``."""
    return choice == "triton" or (choice == "auto" and like.is_cuda)


def top_positions(scores: Tensor, count: int, allowed: Tensor) -> Tensor:
    """Positions [..., min(count, M)] int64 of the largest scores [..., M] among ``allowed``
    (broadcastable bool), best first, ties to the smaller position; -1 past a row's allowed keys.

    ``torch.topk`` alone breaks ties by the row's length, so a row's choice among equal scores
    (common for ReLU scores or repeated tokens) could depend on how many future positions a
    call holds. Here each fp32 score and its position form one int64 key (the float's order in
    the high half, minus the position in the low half), so the choice is that of the row alone.
    On CUDA, rows of at most 1024 keys choosing at most 16 take a Triton kernel with the same
    result (``row_topk``; ``ROW_TOPK``): ``torch.topk`` is slow on many short rows.
    """
    n_keys = scores.shape[-1]
    if kernel_chosen(ROW_TOPK, scores):
        from sparsefocus.kernels import row_topk  # here: row_topk imports modules that import this one

        if row_topk.fits(n_keys, count):
            return row_topk.row_top_positions(scores, count, allowed)
    ordered = ordered_bits(scores).long()
    position = torch.arange(n_keys, device=scores.device)
    lowest = torch.iinfo(torch.int64).min
    packed = (ordered * (1 << 32) + (0x7FFFFFFF - position)).masked_fill(~allowed, lowest)
    return unpacked_positions(packed.topk(min(count, n_keys), dim=-1).values)


def ordered_bits(scores: Tensor) -> Tensor:
    """int32 keys in the order of the fp32 scores (a negative float's magnitude bits flipped; -0.0
    ties with 0.0), as the selection kernels' ``_ordered_bits``."""
    bits = (scores.float() + 0.0).contiguous().view(torch.int32)  # + 0.0: -0.0 ties with 0.0
    return torch.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)


def unpacked_positions(packed: Tensor) -> Tensor:
    """The positions of packed (score, position) int64 keys (``top_positions``, the selection
    kernels' ``_pack``): the low half holds 0x7FFFFFFF - position; the lowest int64 (no key) -> -1."""
    return torch.where(packed == torch.iinfo(torch.int64).min, -1, 0x7FFFFFFF - (packed & 0xFFFFFFFF))


def triton_op_chosen(like: Tensor) -> bool:
    """Whether ``TRITON_OPS`` picks a family's ``triton_op`` twin for a tensor like ``like``.

    Raises:
        ValueError: ``TRITON_OPS`` is not "off", "auto" or "on"."""
    if TRITON_OPS not in ("off", "auto", "on"):
        raise ValueError(f"TRITON_OPS must be 'off', 'auto' or 'on', got {TRITON_OPS!r}")
    return TRITON_OPS == "on" or (TRITON_OPS == "auto" and like.is_cuda)


def traced_setup(setup: Callable, traced: bool) -> Callable:
    """An autograd ``setup_context`` that runs ``setup`` and records in ``ctx.traced`` whether the
    backward calls the ``triton_op`` twins (``traced``: the forward was a twin) or the ops."""

    def wrapped(ctx, inputs, output) -> None:
        setup(ctx, inputs, output)
        ctx.traced = traced

    return wrapped
