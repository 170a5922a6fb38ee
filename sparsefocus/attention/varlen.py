"""Packed batches: several documents concatenated along the sequence, cut by ``cu_seqlens``.

``cu_seqlens`` [D + 1] holds the cumulative document lengths (0, len_0, len_0 + len_1, ..., T), as
FlashAttention's varlen functions take them. Every document is attended alone: no query sees
a key of another document, and no statistic of a mechanism (TOPK's choice, BAND's window edges,
ZETA's key sort and causal mean) reads another document. Two ways:

* one call for the whole batch (``packed_run_attention``): when each query's keys are one run of
  its own document (FULL, BAND and BLOC without global tokens, ``Pattern.packed_runs``) on the
  Triton path, the run kernel attends every position over its run at once. The positions'
  documents are found on the device (a search in ``cu_seqlens``) and the cut points are checked
  there (``torch._assert_async``), so nothing is read on the host;
* one call per document (``packed_attention``): any other pattern or path; the cut points are
  read on the host (one device-to-host copy per call on CUDA).
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import TYPE_CHECKING, cast

import torch
from torch import Tensor

if TYPE_CHECKING:
    from sparsefocus.attention.patterns import Pattern


def check_cu_seqlens(cu_seqlens: Tensor, q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> list[int]:
    """Validate a packed call and return the cut points as Python ints.

    Raises:
        ValueError: batch other than 1, q and k of different lengths, padding, or cut points
            that do not rise from 0 to T.
    """
    check_packed_shapes(cu_seqlens, q, k, key_padding_mask)
    cuts = [int(c) for c in cu_seqlens.tolist()]
    rising = all(b > a for a, b in itertools.pairwise(cuts))
    if len(cuts) < 2 or cuts[0] != 0 or cuts[-1] != q.shape[2] or not rising:
        raise ValueError(f"cu_seqlens must rise strictly from 0 to the packed length {q.shape[2]}, got {cuts}")
    return cuts


def check_packed_shapes(cu_seqlens: Tensor, q: Tensor, k: Tensor, key_padding_mask: Tensor | None) -> None:
    """The checks of a packed call that read no tensor values (ValueError naming the problem)."""
    if q.shape[0] != 1:
        raise ValueError(f"cu_seqlens needs a packed batch of size 1 ([1, H, T, D]), got batch {q.shape[0]}")
    if q.shape[2] != k.shape[2]:
        raise ValueError(f"cu_seqlens needs as many queries as keys, got {q.shape[2]} and {k.shape[2]}")
    if key_padding_mask is not None:
        raise ValueError("cu_seqlens and key_padding_mask are exclusive: a packed batch has no padding")
    if not isinstance(cu_seqlens, Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError("cu_seqlens must be a 1-D int32/int64 tensor of cumulative document lengths")
    if cu_seqlens.numel() < 2:
        raise ValueError(
            f"cu_seqlens must rise strictly from 0 to the packed length {q.shape[2]}, got {cu_seqlens.numel()} cut point(s)"
        )


def document_bounds(cu_seqlens: Tensor, total: int) -> tuple[Tensor, Tensor]:
    """Per position 0..T-1 of a packed batch: (first position of its document, the document's
    length), both long [T], computed on the device; the cut points are checked there too (an
    asynchronous assert: a bad ``cu_seqlens`` fails at the next synchronisation on CUDA)."""
    cuts = cu_seqlens.long()
    rising = (cuts[1:] > cuts[:-1]).all() & (cuts[0] == 0) & (cuts[-1] == total)
    torch._assert_async(rising, f"cu_seqlens must rise strictly from 0 to the packed length {total}")
    positions = torch.arange(total, device=cuts.device)
    # the count of cut points at or before a position, less one; searching a slice of cuts
    # (cuts[1:]) failed to lower in Inductor on CUDA with torch 2.11 (SliceView)
    document = (torch.searchsorted(cuts, positions, right=True) - 1).clamp(0, cuts.numel() - 2)  # [T]
    start = cuts[document]
    return start, cuts[document + 1] - start


def packed_run_attention(
    spec: Pattern,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    *,
    causal: bool,
    scale: float,
    return_lse: bool,
) -> Tensor | tuple[Tensor, Tensor]:
    """The whole packed batch in one run-kernel call: ``spec.packed_runs`` gives each position's
    document-local run (first, count) of keys (not None: the caller checked), shifted here to
    packed positions. q: [1, Hq, T, D]; k: [1, Hk, T, D]; v: [1, Hk, T, Dv] -> out [1, Hq, T, Dv] (and lse
    [1, Hq, T] with ``return_lse``). No host read."""
    from sparsefocus.kernels.runs import run_attention

    start, length = document_bounds(cu_seqlens.to(q.device), q.shape[2])
    runs = spec.packed_runs(torch.arange(q.shape[2], device=q.device) - start, length, causal)
    assert runs is not None, f"{spec} has no packed runs"
    first, count = runs  # document-local
    # causal compares packed positions, which keep the order within a document
    return run_attention(
        q, k, v, (start + first)[None, None], count[None, None], scale=scale, causal=causal, return_lse=return_lse
    )


def packed_attention(
    attend: Callable[[Tensor, Tensor, Tensor], Tensor | tuple[Tensor, Tensor]],
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cuts: list[int],
) -> Tensor | tuple[Tensor, Tensor]:
    """Run ``attend(q_doc, k_doc, v_doc)`` on each document and concatenate along the sequence.

    q: [1, Hq, T, D]; k: [1, Hk, T, D]; v: [1, Hk, T, Dv]. ``attend`` returns out [1, Hq, L, Dv]
    or (out, lse [1, Hq, L]); so does this, over T.
    """
    parts = [attend(q[:, :, a:b], k[:, :, a:b], v[:, :, a:b]) for a, b in itertools.pairwise(cuts)]
    # One attend, one kind of result: every part is a tuple when the first is.
    if isinstance(parts[0], tuple):
        pairs = cast(list[tuple[Tensor, Tensor]], parts)
        return torch.cat([p[0] for p in pairs], dim=2), torch.cat([p[1] for p in pairs], dim=2)
    return torch.cat(cast(list[Tensor], parts), dim=2)
