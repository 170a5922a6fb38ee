"""The lightning-indexer selection against DSA's PyTorch selection, with the radix select, the
short-row select after the scores chunk and the one-launch fused short path (each test runs all
three, and the sampled path for long rows): the same key sets (tie rule included) at odd sizes,
causal and padded keys never chosen, -1 fill, ties, the chunked rows, the op's registration
(opcheck) and compilation."""

import pytest
import torch

from sparsefocus.attention.dsa import allowed_keys, index_scores
from sparsefocus.kernels import indexer_topk as indexer_topk_module
from sparsefocus.kernels._ops import ordered_bits, top_positions
from sparsefocus.kernels.indexer_topk import indexer_topk

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True, params=["fused", "short", "radix", "sampled"])
def select_kernel(request, monkeypatch):
    """Every case through the fused short path (scores merged into each row's kept entries in one
    launch), the short-row select over the scores chunk (rows in registers), both up to 64 picks
    here, the radix select, or the sampled path (a cut from every 4th key, a buffer of twice kk
    keys: at these sizes many rows overflow it or fall short and take the radix select)."""
    monkeypatch.setattr(indexer_topk_module, "SHORT_MAX_K", 64 if request.param in ("fused", "short") else 0)
    monkeypatch.setattr(indexer_topk_module, "FUSED_SHORT", request.param == "fused")
    monkeypatch.setattr(indexer_topk_module, "SAMPLED", request.param == "sampled")
    monkeypatch.setattr(indexer_topk_module, "SAMPLED_MIN_K", 1)
    monkeypatch.setattr(indexer_topk_module, "SAMPLE_STRIDE", 4)
    monkeypatch.setattr(indexer_topk_module, "SAMPLED_CAP_FACTOR", 2.0)
    return request.param


def torch_selection(iq, ik, w, kk, causal, key_padding_mask):
    """DSA's reference selection, as sets: [B, N, kk] positions in increasing order, -1 last."""
    n = iq.shape[2]
    chosen = top_positions(
        index_scores(iq, ik, w), kk, allowed_keys(slice(0, n), ik.shape[1], causal, key_padding_mask, iq.device)
    )
    chosen = torch.nn.functional.pad(chosen, (0, kk - chosen.shape[-1]), value=-1)
    ordered = torch.where(chosen < 0, torch.iinfo(torch.int64).max, chosen).sort(-1).values
    return torch.where(ordered == torch.iinfo(torch.int64).max, -1, ordered)


def inputs(batch, heads, n, m, dim):
    return (
        torch.randn(batch, heads, n, dim, device=DEVICE),
        torch.randn(batch, m, dim, device=DEVICE),
        torch.randn(batch, n, heads, device=DEVICE),
    )


@pytest.mark.parametrize(
    "batch,heads,n,m,dim,kk,causal,padded",
    [
        (2, 3, 37, 37, 8, 5, True, False),
        (1, 2, 50, 61, 16, 20, False, True),
        (2, 4, 70, 70, 8, 64, True, True),
        (1, 1, 33, 33, 5, 40, True, False),
        (1, 2, 1, 1, 4, 1, True, False),
    ],
)
def test_indexer_topk_equals_the_torch_selection(batch, heads, n, m, dim, kk, causal, padded):
    iq, ik, w = inputs(batch, heads, n, m, dim)
    key_padding_mask = torch.rand(batch, m, device=DEVICE) > 0.3 if padded else None
    got = indexer_topk(iq, ik, w, kk, causal=causal, key_padding_mask=key_padding_mask)
    assert got.shape == (batch, n, kk) and got.dtype == torch.int32
    assert torch.equal(got.long(), torch_selection(iq, ik, w, kk, causal, key_padding_mask))


def test_indexer_topk_ties_go_to_smaller_positions():
    """Non-positive indexer dots: every score is 0 (ReLU), so each row keeps its first kk keys."""
    iq = -torch.rand(1, 2, 40, 4, device=DEVICE)
    ik = torch.rand(1, 40, 4, device=DEVICE)
    w = torch.randn(1, 40, 2, device=DEVICE)  # negative weights make -0.0, which ties with 0.0
    got = indexer_topk(iq, ik, w, 6, causal=True).long()
    rows = torch.arange(40, device=DEVICE)[:, None]
    expected = torch.where(torch.arange(6, device=DEVICE) <= rows, torch.arange(6, device=DEVICE), -1)
    assert torch.equal(got[0], expected)


def test_indexer_topk_with_partial_ties_equals_the_torch_selection():
    iq, ik, w = inputs(2, 2, 45, 45, 6)
    iq[:, :, ::3] = -iq[:, :, ::3].abs()
    ik[:, ::2] = ik[:, ::2].abs()  # every third row ties many keys at 0
    got = indexer_topk(iq, ik, w.abs(), 17, causal=True)
    assert torch.equal(got.long(), torch_selection(iq, ik, w.abs(), 17, True, None))


def test_indexer_topk_row_chunks_change_nothing(monkeypatch):
    iq, ik, w = inputs(2, 2, 53, 53, 8)
    whole = indexer_topk(iq, ik, w, 9, causal=True)
    monkeypatch.setattr(indexer_topk_module, "CHUNK_ELEMENTS", 2 * 53 * 7)  # chunks of 7 rows
    assert torch.equal(indexer_topk(iq, ik, w, 9, causal=True), whole)


def test_indexer_topk_never_picks_future_or_padded_keys():
    iq, ik, w = inputs(1, 2, 40, 40, 4)
    key_padding_mask = torch.ones(1, 40, dtype=torch.bool, device=DEVICE)
    key_padding_mask[0, 5:9] = False
    got = indexer_topk(iq, ik, w, 6, causal=True, key_padding_mask=key_padding_mask).long()[0]
    rows = torch.arange(40, device=DEVICE)[:, None]
    assert ((got <= rows) | (got == -1)).all()
    assert not ((got >= 5) & (got < 9)).any()
    assert got[0, 0] == 0 and (got[0, 1:] == -1).all()


def test_indexer_topk_op_passes_opcheck_and_compiles():
    iq, ik, w = inputs(1, 2, 20, 20, 4)
    key_padding_mask = torch.rand(1, 20, device=DEVICE) > 0.3
    torch.library.opcheck(torch.ops.sparsefocus.indexer_topk.default, (iq, ik, w, 3, True, key_padding_mask))
    compiled = torch.compile(lambda a, b, c: indexer_topk(a, b, c, 3, causal=True), fullgraph=True, backend="eager")
    assert torch.equal(compiled(iq, ik, w), indexer_topk(iq, ik, w, 3, causal=True))


def test_indexer_topk_refuses_bad_input():
    iq, ik, w = inputs(1, 2, 10, 10, 4)
    with pytest.raises(ValueError, match="kk must be >= 1"):
        indexer_topk(iq, ik, w, 0)
    with pytest.raises(ValueError, match="incompatible"):
        indexer_topk(iq, ik, w[:, :, :1], 3)


class TestSampledBuffers:
    """The sampled path alone, with buffers so small that most rows overflow (1.1 kk), as in the
    module's cases (2 kk), and so large that none does (8 kk), over rows long enough for the sample,
    and its buffers' contents."""

    @pytest.fixture(autouse=True)
    def select_kernel(self, monkeypatch):
        """Overrides the module's fixture: only the sampled path."""
        monkeypatch.setattr(indexer_topk_module, "SHORT_MAX_K", 0)
        monkeypatch.setattr(indexer_topk_module, "FUSED_SHORT", False)
        monkeypatch.setattr(indexer_topk_module, "SAMPLED", True)
        monkeypatch.setattr(indexer_topk_module, "SAMPLED_MIN_K", 1)
        monkeypatch.setattr(indexer_topk_module, "SAMPLE_STRIDE", 4)
        return "sampled"

    @staticmethod
    def assert_selection_equals_the_torch_selection():
        """kk=12 of rows of 301 padded keys, causal and not."""
        iq, ik, w = inputs(2, 3, 90, 301, 8)
        key_padding_mask = torch.rand(2, 301, device=DEVICE) > 0.2
        for causal in (True, False):
            got = indexer_topk(iq, ik, w, 12, causal=causal, key_padding_mask=key_padding_mask)
            assert torch.equal(got.long(), torch_selection(iq, ik, w, 12, causal, key_padding_mask))

    @pytest.mark.parametrize("cap_factor", [1.1, 2.0, 8.0])
    def test_selection_equals_the_torch_selection_whichever_rows_fall_back(self, cap_factor, monkeypatch):
        monkeypatch.setattr(indexer_topk_module, "SAMPLED_CAP_FACTOR", cap_factor)
        self.assert_selection_equals_the_torch_selection()

    def test_row_chunks_change_nothing(self, monkeypatch):
        """Chunks of 5 rows (the last one short) with their cuts and buffers beside the scores."""
        monkeypatch.setattr(indexer_topk_module, "SAMPLED_CAP_FACTOR", 1.1)  # 13 entries for kk=12
        monkeypatch.setattr(indexer_topk_module, "CHUNK_ELEMENTS", 2 * (301 + 2 * 13) * 5)
        self.assert_selection_equals_the_torch_selection()

    def test_buffers_hold_each_rows_keys_at_or_above_its_cut(self, monkeypatch):
        """The compaction itself: a row's buffer holds its allowed keys whose score is at or above
        its cut, in position order, whenever they fit; rows of both kinds (selected from the buffer,
        and from the whole row) occur here, and both give the torch selection."""
        monkeypatch.setattr(indexer_topk_module, "SAMPLED_CAP_FACTOR", 2.0)
        iq, ik, w = inputs(2, 3, 90, 301, 8)
        kk, cap, tiles = 12, 24, indexer_topk_module._tiles(iq)
        out = torch.full((2, 90, kk), -7, dtype=torch.int32, device=DEVICE)
        scores = torch.full((2, 90, 301), float("nan"), device=DEVICE)
        sample = indexer_topk_module._Sample(iq, ik, out, False, kk, cap, 90)
        sample.cut_rows(iq, w, 0, 90, True, tiles)
        indexer_topk_module._scores(iq, ik, w, scores, 0, 90, True, 1, tiles)
        indexer_topk_module._select(scores, out, out, sample, 0, 90, kk, True, False, tiles)
        assert torch.equal(out.long(), torch_selection(iq, ik, w, kk, True, None))
        positions = torch.arange(301, device=DEVICE)
        allowed = positions[None, :] <= torch.arange(90, device=DEVICE)[:, None]  # [90, 301]
        score = torch.where(allowed & (scores != 0), scores, 0.0)
        hit = allowed & (ordered_bits(score) >= sample.cut[..., None])  # [2, 90, 301]
        count = hit.sum(-1)
        from_buffer = (count <= cap) & ((count >= kk) | (sample.cut == torch.iinfo(torch.int32).min))
        assert from_buffer.any() and not from_buffer.all()
        for b, r in from_buffer.nonzero().tolist():
            n = int(count[b, r])
            assert torch.equal(sample.kept_positions[b, r, :n].long(), hit[b, r].nonzero().flatten())
            assert torch.equal(sample.kept_scores[b, r, :n], score[b, r][hit[b, r]])
