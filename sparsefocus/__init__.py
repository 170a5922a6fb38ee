"""sparsefocus: the PyTorch library and laboratory for sparse attention.

On a machine without CUDA, Triton runs kernels only in its interpreter, which it picks by
TRITON_INTERPRET=1 when it is first imported (torch._dynamo imports it too). So when sparsefocus is
imported before triton on such a machine, it switches the interpreter on here, first; if triton was
imported before without it, ``impl="triton"`` on a CPU tensor raises one line saying how to fix it.
"""

import os
import sys

import torch

if "triton" not in sys.modules and "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from sparsefocus.attention import (  # noqa: E402  (after the interpreter switch)
    PATTERNS,
    Pattern,
    indexed_attention_ref,
    list_patterns,
    parse_pattern,
    selection_mask,
    sparse_attention,
)
from sparsefocus.layers import MoEFeedForward, SparseAttention  # noqa: E402

__version__ = "0.1.0"

__all__ = [
    "MoEFeedForward",
    "PATTERNS",
    "Pattern",
    "indexed_attention_ref",
    "list_patterns",
    "parse_pattern",
    "selection_mask",
    "SparseAttention",
    "sparse_attention",
]
