"""Mechanisms that fold their parameters (``Pattern.folds_params``: NSA's gates and compression
MLP, DSA's indexer, ZETA's widths and sink keys):
one call over the rows of R runs, each row with its run's parameters and params[RUNS_KEY] = R,
gives the R separate calls' outputs, the sum of their auxiliary losses and every gradient, with
key padding that differs between runs (so the runs' KL means have different row counts)."""

import pytest
import torch
from block_sparse_checks import impl_device

import sparsefocus as sf
from sparsefocus.attention.common import grouped_linear, rows_of_groups
from sparsefocus.attention.patterns import AUX_KEY, HIDDEN_KEY, RUNS_KEY
from sparsefocus.kernels import indexed

RUNS, BATCH, N, DIM, HEADS, KV_HEADS, HEAD_DIM = 3, 2, 19, 12, 4, 2, 8
FOLDING = [
    "nsa:block=4,top=3,cmp=4,stride=2,window=4",
    "nsa:block=4,top=3,cmp=4,stride=2,window=4,pool=mlp",
    "dsa:k=5,heads=2,dim=4",
    "zeta:k=3,window=4,chunks=2,local=2,sink=1",
    "zeta:k=3,window=4,chunks=2,local=2,sink=1,dk=8",
]


def call(spec, impl, q, k, v, x, padding, params, runs=None):
    """(out, auxiliary loss) of one ``sparse_attention`` call; ``runs`` sets params[RUNS_KEY]."""
    extra = {HIDDEN_KEY: x, AUX_KEY: {}, **({} if runs is None else {RUNS_KEY: runs})}
    args = {**params, **extra}
    out = sf.sparse_attention(q, k, v, spec, causal=True, key_padding_mask=padding, impl=impl, params=args)
    return out, sum(args[AUX_KEY].values(), out.new_zeros(()))


CASES = [(mechanism, impl, "atomic", "rows") for mechanism in FOLDING for impl in ("reference", "lean", "triton")]
CASES += [(FOLDING[3], "triton", "inverse", "rows"), (FOLDING[3], "triton", "short", "rows")]  # ZETA's other key-gradient sums
# NSA and DSA also take each parameter once per run ([R, ...], run_params), as the batched trainer passes them
CASES += [(mechanism, impl, "atomic", "runs") for mechanism in FOLDING[:3] for impl in ("reference", "lean", "triton")]


@pytest.mark.parametrize("mechanism, impl, key_grads, layout", CASES)
def test_one_call_over_folded_runs_equals_the_runs_one_by_one(mechanism, impl, key_grads, layout, monkeypatch):
    monkeypatch.setattr(indexed, "KEY_GRADS", key_grads)
    spec = sf.parse_pattern(mechanism)
    assert spec.folds_params
    assert spec.run_params == (mechanism in FOLDING[:3])
    device = impl_device(impl)
    torch.manual_seed(0)
    width = spec.qk_dim(HEAD_DIM)  # ZETA's q and k are dk wide
    runs = [spec.make_layer_parameters(DIM, HEADS, KV_HEADS, width, HEAD_DIM) for _ in range(RUNS)]
    stacked = {name: torch.stack([torch.randn_like(r[name]) * 0.3 + r[name] for r in runs]).to(device) for name in runs[0]}
    rows = RUNS * BATCH
    x = torch.randn(rows, N, DIM, device=device)
    q = torch.randn(rows, HEADS, N, width, device=device)
    k = torch.randn(rows, KV_HEADS, N, width, device=device)
    v = torch.randn(rows, KV_HEADS, N, HEAD_DIM, device=device)
    padding = torch.rand(rows, N, device=device) > 0.3
    padding[:, 0] = True
    weight = torch.cos(torch.arange(rows * HEADS * N * HEAD_DIM, dtype=torch.float32, device=device)).view(
        rows, HEADS, N, HEAD_DIM
    )

    def loss_and_grads(folded: bool):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        params = {name: value.clone().requires_grad_() for name, value in stacked.items()}
        if folded:
            per_row = {
                name: p[:, None].expand(RUNS, BATCH, *p.shape[1:]).reshape(rows, *p.shape[1:]) for name, p in params.items()
            }
            out, aux = call(spec, impl, *leaves, x, padding, per_row if layout == "rows" else params, runs=RUNS)
        else:
            parts = [
                call(
                    spec,
                    impl,
                    *(t[r * BATCH : (r + 1) * BATCH] for t in (*leaves, x, padding)),
                    {n: p[r] for n, p in params.items()},
                )
                for r in range(RUNS)
            ]
            out, aux = torch.cat([o for o, _ in parts]), sum(a for _, a in parts)
        grads = torch.autograd.grad((out * weight).sum() + aux, leaves + list(params.values()), allow_unused=True)
        return [out, aux, *(torch.zeros(()) if g is None else g for g in grads)]

    want, got = loss_and_grads(folded=False), loss_and_grads(folded=True)
    if spec.has_aux_loss:
        assert want[1] > 0
    for name, a, b in zip(["out", "aux", "dq", "dk", "dv", *stacked], want, got, strict=True):
        torch.testing.assert_close(b, a, atol=2e-5, rtol=1e-4, msg=name)


def test_runs_that_do_not_split_the_batch_fail_by_name():
    spec = sf.parse_pattern(FOLDING[2])
    params = spec.make_layer_parameters(DIM, HEADS, KV_HEADS, HEAD_DIM, HEAD_DIM)
    q = torch.randn(5, HEADS, N, HEAD_DIM)
    k = torch.randn(5, KV_HEADS, N, HEAD_DIM)
    with pytest.raises(ValueError, match="does not split a batch of 5 into equal runs"):
        call(spec, "lean", q, k, k, torch.randn(5, N, DIM), None, params, runs=2)


@pytest.mark.parametrize("groups", [1, 2, 6])
def test_grouped_linear_gives_each_group_of_rows_its_weight(groups):
    torch.manual_seed(1)
    x = torch.randn(6, 3, 5, 7, dtype=torch.float64)
    weight, bias = torch.randn(groups, 7, 4, dtype=torch.float64), torch.randn(groups, 4, dtype=torch.float64)
    rows = 6 // groups
    want = torch.stack([x[b] @ weight[b // rows] + bias[b // rows] for b in range(6)])
    torch.testing.assert_close(grouped_linear(x, weight, bias), want)
    torch.testing.assert_close(grouped_linear(x, weight), torch.stack([x[b] @ weight[b // rows] for b in range(6)]))
    torch.testing.assert_close(rows_of_groups(bias, 6), torch.stack([bias[b // rows] for b in range(6)]))


def test_grouped_linear_shares_a_two_dim_weight_and_refuses_groups_that_do_not_split_the_batch():
    x, weight = torch.randn(4, 3, 5), torch.randn(5, 2)
    torch.testing.assert_close(grouped_linear(x, weight), x @ weight)
    with pytest.raises(ValueError, match="G dividing the batch"):
        grouped_linear(x, torch.randn(3, 5, 2))
    with pytest.raises(ValueError, match="do not split a batch of 4"):
        rows_of_groups(torch.randn(3, 2), 4)
