"""The fused entmax attention kernel against its twin ``entmax_attention_ref``: outputs and the
gradients of q, k and v for 1.5-entmax and sparsemax at odd sizes (GQA, Dv != D, N != M, causal
decoding rows, padded keys, rows with no key, several key tiles), the twin's exact zeros in the
weights, fp16 within twice PyTorch's own error, the ops' opcheck, compiled equal to eager,
``sparse_attention(..., impl="triton")`` taking it or falling back to the lean path, and one-line
errors. On CPU the kernel runs in Triton's interpreter (tests/conftest.py)."""

import pytest
import torch

import sparsefocus as sf
from sparsefocus.attention.adaptive import entmax_attention_ref
from sparsefocus.kernels import entmax_attention as entmax_kernel
from sparsefocus.kernels.entmax_attention import MAX_KEYS, entmax_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALPHAS = [1.5, 2.0]


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-12)).item()


def make_case(batch: int, q_heads: int, kv_heads: int, n: int, m: int, dim: int, dim_v: int):
    """q [B, Hq, N, D], k [B, Hk, M, D], v [B, Hk, M, Dv], fp32."""
    q = torch.randn(batch, q_heads, n, dim, device=DEVICE)
    k = torch.randn(batch, kv_heads, m, dim, device=DEVICE)
    v = torch.randn(batch, kv_heads, m, dim_v, device=DEVICE)
    return q, k, v


def padding_mask(batch: int, m: int) -> torch.Tensor:
    """[B, M] bool, True = real key: batch row 0 has no real key, row 1 every third key masked
    (key 0 among them, so its causal query 0 has none), the others all real."""
    mask = torch.ones(batch, m, dtype=torch.bool, device=DEVICE)
    mask[0] = False
    mask[1, ::3] = False
    return mask


def allowed_keys(n: int, m: int, causal: bool, key_padding_mask: torch.Tensor | None) -> torch.Tensor:
    """[B or 1, 1, N, M] bool: key j allowed for query i (causal: j <= i + M - N; padding)."""
    rows = torch.arange(n, device=DEVICE)[:, None]
    cols = torch.arange(m, device=DEVICE)[None, :]
    allowed = (cols <= rows + m - n) if causal else torch.ones(n, m, dtype=torch.bool, device=DEVICE)
    allowed = allowed[None, None]
    return allowed if key_padding_mask is None else allowed & key_padding_mask[:, None, None, :]


@pytest.fixture
def kernel_calls(monkeypatch):
    """The alphas of the calls that reach the kernel through its module (as the registry calls it)."""
    calls = []

    def spy(q, k, v, alpha, *args, **kwargs):
        calls.append(alpha)
        return entmax_attention(q, k, v, alpha, *args, **kwargs)

    monkeypatch.setattr(entmax_kernel, "entmax_attention", spy)
    return calls


def run(fn, q, k, v, grad, dtype=None, **kwargs):
    """fn's output and the gradients of q, k and v (each cast to dtype first)."""
    q, k, v = ((x if dtype is None else x.to(dtype)).detach().requires_grad_(True) for x in (q, k, v))
    out = fn(q, k, v, **kwargs)
    out.backward(grad.to(out.dtype))
    return out.detach(), q.grad, k.grad, v.grad


CASES = [
    pytest.param(2, 3, 3, 37, 37, 16, 24, False, False, id="odd"),
    pytest.param(1, 4, 2, 29, 29, 32, 32, False, False, id="gqa"),
    pytest.param(2, 2, 1, 17, 45, 8, 8, False, False, id="wide"),
    pytest.param(2, 2, 2, 31, 31, 16, 16, True, False, id="causal"),
    pytest.param(2, 4, 2, 5, 33, 16, 8, True, False, id="decoding"),
    pytest.param(2, 2, 2, 19, 23, 16, 16, False, True, id="padded"),
    pytest.param(3, 2, 1, 13, 13, 8, 8, True, True, id="padded_causal"),
    pytest.param(1, 2, 1, 24, 150, 64, 40, True, False, id="key_tiles"),
    pytest.param(1, 2, 2, 40, 25, 16, 8, True, False, id="more_queries_causal"),
]


@pytest.mark.parametrize("alpha", ALPHAS)
@pytest.mark.parametrize("batch,q_heads,kv_heads,n,m,dim,dim_v,causal,padded", CASES)
def test_matches_twin_fp32(alpha, batch, q_heads, kv_heads, n, m, dim, dim_v, causal, padded):
    """Rows with no allowed key (padded: batch row 0; padded_causal: also query 0 of batch row 1;
    more_queries_causal: the first N - M queries) give exactly 0 and their queries exactly zero gradients; keys no query may read get zero dk, dv."""
    q, k, v = make_case(batch, q_heads, kv_heads, n, m, dim, dim_v)
    key_padding_mask = padding_mask(batch, m) if padded else None
    grad = torch.randn(batch, q_heads, n, dim_v, device=DEVICE)
    kwargs = dict(alpha=alpha, scale=dim**-0.5, causal=causal, key_padding_mask=key_padding_mask)
    got = run(entmax_attention, q, k, v, grad, **kwargs)
    want = run(entmax_attention_ref, q, k, v, grad, **kwargs)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert a.shape == b.shape and a.dtype == b.dtype == torch.float32, name
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(a, b) < 1e-4, f"{name}: relative error {rel_err(a, b):.2e}"
    allowed = allowed_keys(n, m, causal, key_padding_mask)
    empty_rows = (~allowed.any(-1)).expand(batch, q_heads, n)  # [B, Hq, N]
    unread_keys = (~allowed.any(-2)).expand(batch, kv_heads, m)  # [B, Hk, M]
    assert empty_rows.any() == (padded or (causal and n > m)) and unread_keys.any() == padded
    out, dq, dk, dv = got
    assert not out[empty_rows].any() and not dq[empty_rows].any()
    assert not dk[unread_keys].any() and not dv[unread_keys].any()


@pytest.mark.parametrize("alpha", ALPHAS)
def test_rows_of_max_keys_whose_threshold_is_far_from_the_start(alpha):
    """MAX_KEYS keys with scores -c (j / M)^0.3 (shuffled), c from 0.5 to 30: most scores crowd
    near the top, so the threshold search started at max - 1 crosses hundreds of keys; one cut
    to four steps or fewer is off by 1e-3 to 1 here."""
    q = torch.zeros(1, 1, 4, 8, device=DEVICE)
    q[0, 0, :, 0] = torch.tensor([0.5, 1.0, 4.0, 30.0])
    k = torch.randn(1, 1, MAX_KEYS, 8, device=DEVICE)
    k[0, 0, :, 0] = -((torch.arange(MAX_KEYS, device=DEVICE) / MAX_KEYS) ** 0.3)
    k = k[:, :, torch.randperm(MAX_KEYS, device=DEVICE)]
    v = torch.randn(1, 1, MAX_KEYS, 8, device=DEVICE)
    grad = torch.randn(1, 1, 4, 8, device=DEVICE)
    got = run(entmax_attention, q, k, v, grad, alpha=alpha, scale=1.0)
    want = run(entmax_attention_ref, q, k, v, grad, alpha=alpha, scale=1.0)
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(a, b) < 1e-4, f"{name}: relative error {rel_err(a, b):.2e}"


@pytest.mark.parametrize("alpha", ALPHAS)
def test_weights_have_the_twins_exact_zeros(alpha):
    """Scores four times the usual scale (1 = 4 / sqrt(16)): v = the identity makes the output the
    weights [B, H, N, M]. The twin's are mostly exact zeros with some rows keeping several keys;
    the kernel's equal them, are exactly 0 at the same keys and sum to 1."""
    q, k, _ = make_case(1, 2, 2, 23, 23, 16, 16)
    identity = torch.eye(23, device=DEVICE).expand(1, 2, 23, 23).contiguous()
    got = entmax_attention(q, k, identity, alpha, 1.0)
    want = entmax_attention_ref(q, k, identity, alpha, 1.0)
    assert (want == 0).float().mean() > 0.5 and ((want > 0).sum(-1) > 1).any()
    assert torch.equal(got == 0, want == 0)
    assert rel_err(got, want) < 1e-4
    torch.testing.assert_close(got.sum(-1), torch.ones(1, 2, 23, device=DEVICE))


@pytest.mark.parametrize("alpha", ALPHAS)
def test_fp16_within_twice_torch_error(alpha):
    """FlashAttention's rule: on the same fp16-rounded q, k, v and upstream gradient, the kernel's
    error against the twin in fp64 is at most twice the twin's in fp16 (+ eps), for the output and
    every gradient."""
    q, k, v = (x.half().float() for x in make_case(2, 4, 2, 33, 40, 32, 24))
    key_padding_mask = padding_mask(2, 40)
    key_padding_mask[0, :20] = True  # batch row 0 gets real keys here
    grad = torch.randn(2, 4, 33, 24, device=DEVICE).half().float()
    kwargs = dict(alpha=alpha, scale=32**-0.5, causal=True, key_padding_mask=key_padding_mask)
    truth = run(entmax_attention_ref, q, k, v, grad, torch.float64, **kwargs)
    torch_low = run(entmax_attention_ref, q, k, v, grad, torch.float16, **kwargs)
    kernel = run(entmax_attention, q, k, v, grad, torch.float16, **kwargs)
    for name, a, b, t in zip(["out", "dq", "dk", "dv"], kernel, torch_low, truth):
        assert a.dtype == b.dtype == torch.float16, name
        assert torch.isfinite(a).all(), f"{name} has NaN/inf (unwritten output?)"
        assert rel_err(a, t) <= 2 * rel_err(b, t) + 1e-4, f"{name}: {rel_err(a, t):.2e} vs torch {rel_err(b, t):.2e}"


@pytest.mark.parametrize("alpha", ALPHAS)
def test_opcheck_and_compiled_equals_eager(alpha):
    q, k, v = make_case(2, 2, 1, 7, 9, 8, 8)
    key_mask = padding_mask(2, 9)
    for with_vbar in (True, False):
        torch.library.opcheck(entmax_kernel.entmax_attention_op, (q, k, v, key_mask, alpha, 0.4, True, with_vbar))
    out, tau, vbar = entmax_kernel.entmax_attention_op(q, k, v, key_mask, alpha, 0.4, True, True)
    args = (torch.randn_like(out), q, k, v, key_mask, tau, vbar, alpha, 0.4, True)
    torch.library.opcheck(entmax_kernel.entmax_attention_bwd, args)
    grad = torch.randn_like(out)
    kwargs = dict(alpha=alpha, scale=0.4, causal=True, key_padding_mask=key_mask)
    compiled = torch.compile(entmax_attention, fullgraph=True)
    for name, a, b in zip(
        ["out", "dq", "dk", "dv"], run(compiled, q, k, v, grad, **kwargs), run(entmax_attention, q, k, v, grad, **kwargs)
    ):
        assert torch.allclose(a, b, rtol=1e-6, atol=1e-6), name


@pytest.mark.parametrize("alpha", ALPHAS)
def test_forward_forms_and_calls_without_gradients_agree(alpha, monkeypatch):
    """The forward in one launch (thresholds and outputs per 16 rows) equals the split one
    (thresholds, then outputs per 64 rows), and a call without gradients (no vbar) gives the same
    output as one with them."""
    q, k, v = make_case(2, 2, 1, 70, 70, 16, 8)
    key_mask = padding_mask(2, 70)
    kwargs = dict(alpha=alpha, scale=0.5, causal=True, key_padding_mask=key_mask)
    outs = []
    for split in (True, False):
        monkeypatch.setattr(entmax_kernel, "SPLIT_FORWARD", split)
        with torch.no_grad():
            outs.append(entmax_attention(q, k, v, **kwargs))
        outs.append(entmax_attention(q.requires_grad_(True), k, v, **kwargs).detach())
        q = q.detach()
    want = entmax_attention_ref(q, k, v, **kwargs)
    for out in outs:
        assert torch.isfinite(out).all() and rel_err(out, want) < 1e-5
    assert torch.allclose(outs[0], outs[2], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "pattern,kernel_alpha", [("entmax", 1.5), ("entmax:alpha=2", 2.0), ("sparsemax", 2.0), ("entmax:alpha=1.25", None)]
)
def test_triton_impl_matches_reference(pattern, kernel_alpha, kernel_calls):
    """The registry's impl="triton" gives impl="reference"'s outputs and gradients: the kernel for
    alpha 1.5 and 2, the lean path for alpha 1.25 (the kernel refuses it)."""
    q, k, v = make_case(2, 4, 2, 21, 21, 8, 6)
    grad = torch.randn(2, 4, 21, 6, device=DEVICE)
    kwargs = dict(pattern=pattern, causal=True, key_padding_mask=padding_mask(2, 21))
    got = run(sf.sparse_attention, q, k, v, grad, impl="triton", **kwargs)
    want = run(sf.sparse_attention, q, k, v, grad, impl="reference", **kwargs)
    assert kernel_calls == ([] if kernel_alpha is None else [kernel_alpha])
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert torch.isfinite(a).all(), f"{pattern} {name} has NaN/inf"
        assert rel_err(a, b) < 1e-4, f"{pattern} {name}: relative error {rel_err(a, b):.2e}"


def test_triton_impl_falls_back_to_lean_past_max_keys(monkeypatch, kernel_calls):
    """With MAX_KEYS at 16 the kernel refuses 40 keys, and impl="triton" still gives the reference's result."""
    monkeypatch.setattr(entmax_kernel, "MAX_KEYS", 16)
    q, k, v = make_case(1, 2, 1, 9, 40, 8, 8)
    with pytest.raises(ValueError, match="entmax_attention"):
        entmax_attention(q, k, v, 1.5, 8**-0.5)
    grad = torch.randn(1, 2, 9, 8, device=DEVICE)
    got = run(sf.sparse_attention, q, k, v, grad, pattern="entmax", impl="triton")
    want = run(sf.sparse_attention, q, k, v, grad, pattern="entmax", impl="reference")
    assert kernel_calls == []
    for name, a, b in zip(["out", "dq", "dk", "dv"], got, want):
        assert rel_err(a, b) < 1e-5, f"{name}: relative error {rel_err(a, b):.2e}"


def test_fits_names_the_kernels_limits():
    assert entmax_kernel.fits(MAX_KEYS, 1.5) and entmax_kernel.fits(1, 2.0)
    assert not entmax_kernel.fits(MAX_KEYS + 1, 1.5) and not entmax_kernel.fits(0, 2.0)
    assert not entmax_kernel.fits(10, 1.25)


def test_bad_inputs_get_one_line_errors():
    q, k, v = make_case(2, 4, 2, 5, 6, 8, 8)
    with pytest.raises(ValueError, match="entmax_attention"):
        entmax_attention(q, k, v, 1.25, 1.0)
    with pytest.raises(ValueError, match="entmax_attention"):
        entmax_attention(q, k[:, :, :5], v, 1.5, 1.0)  # 5 keys, 6 values
    with pytest.raises(ValueError, match="entmax_attention"):
        entmax_attention(q[:, :3], k, v, 1.5, 1.0)  # 3 query heads over 2 kv heads
    with pytest.raises(ValueError, match="entmax_attention"):
        entmax_attention(q, k, v, 1.5, 1.0, key_padding_mask=torch.ones(2, 7, dtype=torch.bool, device=DEVICE))
    with pytest.raises(ValueError, match="entmax_attention: q, k, v must share"):
        entmax_attention(q, k.half(), v, 1.5, 1.0)
    with pytest.raises(ValueError, match="entmax_attention: q, k, v must share"):
        entmax_attention(q.double(), k.double(), v.double(), 1.5, 1.0)
    long_k, long_v = (torch.randn(1, 1, MAX_KEYS + 1, 4, device=DEVICE) for _ in range(2))
    with pytest.raises(ValueError, match="entmax_attention"):
        entmax_attention(torch.randn(1, 1, 3, 4, device=DEVICE), long_k, long_v, 1.5, 1.0)


@pytest.mark.parametrize("n_keys", [1, 16, 17, 33, 150, 601, 700, 900, 1024, 1025, MAX_KEYS])
def test_row_blocks_cover_the_row_in_powers_of_two(n_keys):
    """The forward's row is one power of two, or two when they hold fewer columns or one would be
    wider than MAX_PART_KEYS; they cover it."""
    block_a, block_b = entmax_kernel.row_blocks(n_keys)
    whole = max(16, 1 << (n_keys - 1).bit_length())
    assert block_a + block_b >= n_keys and block_a + block_b <= whole
    assert max(block_a, block_b) <= entmax_kernel.MAX_PART_KEYS
    assert block_a & (block_a - 1) == 0 and block_a >= 16
    assert block_b == 0 or (block_b & (block_b - 1) == 0 and block_b >= 16)
