"""The batched loop against the single-run loop: R seeds folded into one model give each seed's
``train_run`` result (exact mode: with dropout, parameters bit for bit; fast mode: without
dropout, to fp32 rounding), resume after an interruption, and keep the run-folder layout."""

import json
from pathlib import Path

import pytest
import torch
from torch import nn

from sparsefocus.attention import parse_pattern, selection_mask
from sparsefocus.layers import SparseAttention
from sparsefocus.models import Encoder, ModelConfig
from sparsefocus.train import batched
from sparsefocus.train.batched import (
    RunRandomness,
    default_generator,
    fold_models,
    fused_paper_attention,
    load_run_states,
    run_state,
)
from sparsefocus.train import driver
from sparsefocus.train.checkpoint import load_checkpoint
from sparsefocus.train.config import load_config
from sparsefocus.train.driver import Budget
from sparsefocus.train.experiment import run_experiment
from sparsefocus.train.loop import build_data, build_model
from sparsefocus.train.report import write_report

SEEDS = [1, 2, 3]
TINY = [
    "task={name: parity, length: 10, num_train: 40, num_valid: 20}",
    "model.blocks=2",
    "model.dim=8",
    "model.mlp_dim=8",
    "model.paper_mode=true",
    "optim.lr=0.5",
    "optim.decay=0.9",
    "train.epochs=3",
    "train.batch_size=15",  # 40 = 15 + 15 + 10: a short last batch
    "train.eval_batch_size=15",
    "train.threads=1",
    f"seeds={SEEDS}",
]
METRICS = ("train_loss", "train_acc", "valid_loss", "valid_acc", "lr")


def config(out: Path, *overrides: str):
    return load_config(None, [f"out_dir={out}", "name=exp", *TINY, *overrides])


def metrics_of(root: Path) -> dict[str, list[dict]]:
    return {
        str(path.parent.relative_to(root)): [json.loads(line) for line in path.read_text().splitlines()]
        for path in sorted(root.glob("*/*/seed-*/metrics.jsonl"))
    }


def params_of(root: Path) -> dict[str, dict[str, torch.Tensor]]:
    return {str(p.parent.relative_to(root)): load_checkpoint(p)["model"] for p in sorted(root.glob("*/*/seed-*/checkpoint.pt"))}


def assert_same_metrics(expected: dict, actual: dict, rtol: float, acc_steps: dict[str, float] | None = None) -> None:
    """Every run's metrics agree to ``rtol``; an accuracy named in ``acc_steps`` may instead move by
    at most its step (one example of its set: an argmax near a tie flips with summation order)."""
    assert expected.keys() == actual.keys() and expected
    for run, lines in expected.items():
        assert len(lines) == len(actual[run]), run
        for want, got in zip(lines, actual[run]):
            assert want["epoch"] == got["epoch"]
            for key in METRICS:
                tol = max(rtol, (acc_steps or {}).get(key, 0.0) * (1 + 1e-6))
                assert got[key] == pytest.approx(want[key], rel=rtol, abs=tol), (run, want["epoch"], key)


def assert_same_params(expected: dict, actual: dict, atol: float) -> None:
    assert expected.keys() == actual.keys()
    for run, state in expected.items():
        assert list(state) == list(actual[run]), run
        for name, tensor in state.items():
            torch.testing.assert_close(actual[run][name], tensor, rtol=0, atol=atol, msg=f"{run} {name}")


@pytest.fixture
def list_calls(monkeypatch) -> list:
    """One entry per call of the fast path's attention over key lists."""
    from sparsefocus.train import batched

    calls: list = []
    original = batched.gathered_attention
    monkeypatch.setattr(batched, "gathered_attention", lambda *a: calls.append(1) or original(*a))
    return calls


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    """The single-run loop's results for TOPK:3 with dropout 0.1 and FULL, BAND:3(1), TOPK:3 without."""
    out = tmp_path_factory.mktemp("single")
    run_experiment(config(out / "dropout", "model.dropout=0.1", "mechanisms=[TOPK:3]"), quiet=True)
    run_experiment(config(out / "plain", "model.dropout=0.0", "mechanisms=[FULL,BAND:3(1),TOPK:3]"), quiet=True)
    return out


def test_exact_batched_seeds_equal_single_runs_with_dropout(single, tmp_path):
    root = run_experiment(config(tmp_path, "model.dropout=0.1", "mechanisms=[TOPK:3]", "train.batched=true"), quiet=True)
    assert_same_metrics(metrics_of(single / "dropout" / "exp"), metrics_of(root), rtol=1e-6)
    assert_same_params(params_of(single / "dropout" / "exp"), params_of(root), atol=0.0)


@pytest.mark.parametrize("attention", ["masks", "lists", "fixed-lists"])
def test_fast_batched_seeds_equal_single_runs_without_dropout(single, tmp_path, attention):
    overrides = ["model.dropout=0.0", "mechanisms=[FULL,BAND:3(1),TOPK:3]", "train.batched=true", "train.batched_mode=fast"]
    root = run_experiment(config(tmp_path, *overrides, f"train.fast_attention={attention}"), quiet=True)
    assert_same_metrics(metrics_of(single / "plain" / "exp"), metrics_of(root), rtol=1e-5)
    assert_same_params(params_of(single / "plain" / "exp"), params_of(root), atol=1e-5)


PAPER_LAYOUT = ["model.global_tokens=append_paper", "model.pad_to_multiple_of_k=true"]


@pytest.mark.parametrize("attention", ["masks", "fixed-lists"])
def test_fast_batched_training_in_the_paper_layout_equals_single_runs(tmp_path, attention, list_calls):
    """Global tokens appended after the padding, windows and blocks over the regular tokens: the
    folded fast path (the form the ListOps study trains with) gives each seed's single run."""
    overrides = ["model.dropout=0.0", "mechanisms=[BAND:3(1),BLOC:4(1)]", *PAPER_LAYOUT]
    single_root = run_experiment(config(tmp_path / "single", *overrides), quiet=True)
    fast = [*overrides, "train.batched=true", "train.batched_mode=fast", f"train.fast_attention={attention}"]
    root = run_experiment(config(tmp_path / "fast", *fast), quiet=True)
    assert_same_metrics(metrics_of(single_root), metrics_of(root), rtol=1e-5)
    assert_same_params(params_of(single_root), params_of(root), atol=1e-5)
    assert bool(list_calls) == (attention == "fixed-lists"), "the key lists were used by the wrong form"


def test_fast_attention_lists_sets_the_switches_while_training_only(tmp_path):
    from sparsefocus.kernels import indexed
    from sparsefocus.train import batched

    before = batched.MASKED_SELECTION_MAX_KEYS, batched.FIXED_LIST_MAX_SLOTS, indexed.KEY_GRADS
    with batched.fast_attention("lists"):
        assert (batched.MASKED_SELECTION_MAX_KEYS, batched.FIXED_LIST_MAX_SLOTS, indexed.KEY_GRADS) == (0, 64, before[2])
    with batched.fast_attention("fixed-lists"):
        assert (batched.MASKED_SELECTION_MAX_KEYS, batched.FIXED_LIST_MAX_SLOTS, indexed.KEY_GRADS) == (before[0], 64, before[2])
    with batched.fast_attention("masks"):
        assert (batched.MASKED_SELECTION_MAX_KEYS, batched.FIXED_LIST_MAX_SLOTS, indexed.KEY_GRADS) == before
    assert (batched.MASKED_SELECTION_MAX_KEYS, batched.FIXED_LIST_MAX_SLOTS, indexed.KEY_GRADS) == before
    with pytest.raises(ValueError, match="'masks', 'lists', 'fixed-lists'"):
        batched.fast_attention("list").__enter__()
    with pytest.raises(ValueError, match="train.fast_attention is read by the batched fast path only"):
        config(tmp_path, "train.fast_attention=lists")
    with pytest.raises(ValueError, match="train.fast_attention is read by the batched fast path only"):
        config(tmp_path, "train.batched=true", "train.fast_attention=lists")  # exact mode
    with pytest.raises(ValueError, match="train.fast_attention"):
        config(tmp_path, "train.batched=true", "train.batched_mode=fast", "train.fast_attention=sdpa")


def test_gathered_attention_in_fp16_with_unused_slots():
    """The torch form in fp16: unused slots and a row without keys (no overflowing fill)."""
    from sparsefocus.train import batched

    q, k, v = (torch.randn(2, 1, 9, 8).half() for _ in range(3))
    index = torch.randint(-1, 9, (2, 1, 9, 4))
    index[1, 0, 3] = -1
    out = batched.gathered_attention(q, k, v, index, 0.35, 0.0)
    want = batched.gathered_attention(q.float(), k.float(), v.float(), index, 0.35, 0.0)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)
    assert (out[1, 0, 3] == 0).all()


class EpochBudget(Budget):
    """A budget that allows a fixed number of epoch starts (an interruption at a known place)."""

    def __init__(self, epochs: int) -> None:
        super().__init__(1e9)
        self.left = epochs

    def allows(self, estimate=None) -> bool:
        self.left -= 1
        return self.left >= 0


def test_interrupted_batched_run_resumes_to_the_single_runs_result(single, tmp_path):
    cfg = config(tmp_path, "model.dropout=0.1", "mechanisms=[TOPK:3]", "train.batched=true")
    root = run_experiment(cfg, quiet=True, budget=EpochBudget(2))  # group start + epoch 1
    first = metrics_of(root)
    assert {len(lines) for lines in first.values()} == {1}
    assert all(not load_checkpoint(p)["finished"] for p in root.glob("*/*/seed-*/checkpoint.pt"))
    run_experiment(cfg, quiet=True)
    assert_same_metrics(metrics_of(single / "dropout" / "exp"), metrics_of(root), rtol=1e-6)
    assert_same_params(params_of(single / "dropout" / "exp"), params_of(root), atol=0.0)


def test_batched_output_keeps_the_run_folders_and_the_report(single, tmp_path):
    root = run_experiment(config(tmp_path, "model.dropout=0.1", "mechanisms=[TOPK:3]", "train.batched=true"), quiet=True)
    want = sorted(p.relative_to(single / "dropout" / "exp") for p in (single / "dropout" / "exp").rglob("*") if p.is_file())
    got = sorted(p.relative_to(root) for p in root.rglob("*") if p.is_file())
    assert got == want
    report, _ = write_report(root)
    assert "TOPK:3" in report.read_text()


def _models(mechanism: str, dropout: float, seeds=SEEDS):
    cfg = config(Path("unused"), f"model.dropout={dropout}", f"mechanisms=[{mechanism}]")
    data = build_data(cfg, seeds[0], torch.device("cpu"))
    models, states = [], []
    for seed in seeds:
        torch.manual_seed(seed)
        models.append(build_model(cfg.model, mechanism, data))
        states.append(torch.get_rng_state())
    return models, states, data


def test_folded_state_has_the_single_models_keys_and_slices():
    models, _, _ = _models("BAND:3(1)", 0.0)
    folded = fold_models(models, mode="fast")
    assert list(folded.state_dict()) == list(models[1].state_dict())
    for name, tensor in run_state(folded, 1).items():
        assert torch.equal(tensor, models[1].state_dict()[name]), name
    load_run_states(folded, [m.state_dict() for m in reversed(models)])
    assert torch.equal(run_state(folded, 0)["classifier.weight"], models[2].classifier.weight)


def test_exact_fold_reproduces_each_models_logits_and_dropout_draws():
    models, states, data = _models("TOPK:3", 0.2)
    inputs = data.valid_inputs[:7]
    expected = []
    for model, state in zip(models, states):
        torch.set_rng_state(state)
        expected.append(model.train()(inputs))
    folded = fold_models(models, mode="exact", rng=RunRandomness(torch.device("cpu"), states)).train()
    got = folded(inputs.repeat(len(models), 1))  # [R*7, C], run-major
    torch.testing.assert_close(got, torch.cat(expected), rtol=0, atol=0)


def test_fast_dropout_is_unbiased_and_differs_between_runs():
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 1, 16, 4) for _ in range(3))
    q, k, v = (t.repeat(2, 1, 1, 1) for t in (q, k, v))  # runs 0 and 1 see identical inputs
    plain = fused_paper_attention(q, k, v, _full(), fixed_mask=None, key_padding_mask=None, causal=False, dropout_p=0.0)
    default_generator(torch.device("cpu")).manual_seed(1)
    draws = torch.stack(
        [
            fused_paper_attention(q, k, v, _full(), fixed_mask=None, key_padding_mask=None, causal=False, dropout_p=0.3)
            for _ in range(400)
        ]
    )
    assert not torch.equal(draws[0, :2], draws[0, 2:])  # each run gets its own mask
    spread = draws.std(dim=0) / 400**0.5
    assert ((draws.mean(dim=0) - plain).abs() <= 5 * spread + 1e-6).float().mean() > 0.99


def _full():
    return parse_pattern("FULL")


def test_fold_refuses_a_mechanism_with_trainable_parameters_in_paper_mode():
    model = Encoder(ModelConfig(blocks=1, dim=8, mlp_dim=8), "zeta:k=3", vocab_size=4, num_classes=2, max_len=16)
    fold_models([model, model], mode="fast")  # outside paper_mode they fold, per run
    from sparsefocus.models.blocks import PaperAttention

    class Stub(PaperAttention):  # the paper's attention refuses such patterns itself; a stub reaches the fold
        def __init__(self) -> None:
            SparseAttention.__init__(self, 8, 1, "zeta:k=3")
            self.attention_dropout = 0.0

    with pytest.raises(ValueError, match="cannot fold zeta.* in paper_mode"):
        fold_models([nn.Sequential(Stub()), nn.Sequential(Stub())], mode="fast")


PER_RUN = [
    "zeta:k=3,window=4,chunks=2,local=2,sink=1",
    "dsa:k=5,heads=2,dim=4",
    "nsa:block=4,top=3,cmp=4,stride=2,window=4",
    "nsa:block=4,top=3,cmp=4,stride=2,window=4,pool=mlp",
]


@pytest.mark.parametrize("mode", ["exact", "fast"])
@pytest.mark.parametrize("mechanism", PER_RUN)
def test_batched_mechanisms_with_their_own_parameters_equal_single_runs(mechanism, mode, tmp_path):
    """ZETA's widths and sink, DSA's indexer (with its auxiliary loss) and NSA's gates and
    compression fold as [R, ...] parameters; fast mode attends nsa (mean pooling) and dsa in one
    call over every run's rows, the others per run: batched training gives each seed's single-run
    metrics and parameters (dropout 0)."""
    common = ["model.dropout=0.0", "model.paper_mode=false", f"mechanisms=['{mechanism}']", "train.epochs=2"]
    single = run_experiment(config(tmp_path / "single", *common), quiet=True)
    batched = run_experiment(
        config(tmp_path / "batched", *common, "train.batched=true", f"train.batched_mode={mode}"), quiet=True
    )
    assert_same_metrics(metrics_of(single), metrics_of(batched), rtol=1e-5)
    assert_same_params(params_of(single), params_of(batched), atol=1e-5)
    names = [name for name in params_of(batched)[next(iter(params_of(batched)))] if ".mechanism." in name]
    assert names, "the mechanism's parameters are in each run's checkpoint"


@pytest.mark.parametrize("mode", ["exact", "fast"])
def test_folded_dsa_computes_its_indexer_loss_in_training_only(mode):
    """Evaluation reads the logits alone, so the folded layers skip DSA's KL there: the same
    logits, a zero auxiliary loss; in training the loss is there."""
    from sparsefocus.train.batched import RunAttention

    cfg = config(Path("unused"), "model.dropout=0.0", "model.paper_mode=false", f"mechanisms=['{PER_RUN[1]}']")
    data = build_data(cfg, 1, torch.device("cpu"))
    models = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        models.append(build_model(cfg.model, PER_RUN[1], data))
    folded = fold_models(models, mode=mode)
    inputs = data.valid_inputs[:4].repeat(len(models), 1)
    layers = [m for m in folded.modules() if isinstance(m, RunAttention)]
    trained = folded.train()(inputs)
    assert all(layer.aux_loss > 0 for layer in layers)
    with torch.no_grad():
        evaluated = folded.eval()(inputs)
    assert all(layer.aux_loss == 0 for layer in layers)
    torch.testing.assert_close(evaluated, trained.detach(), rtol=1e-6, atol=1e-6)


def _has_parameters(spec: str) -> bool:
    try:
        return bool(parse_pattern(spec).make_parameters(1))
    except Exception:  # noqa: BLE001  (an example that needs other sizes is simply not used)
        return False


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.batched_mode=quick", "train.batched_mode must be one of"),
        ("train.autocast=bf16", "train.autocast is read by the batched path only"),
        ("train.matmul_precision=low", "train.matmul_precision must be one of"),
    ],
)
def test_bad_batched_keys_fail_by_name(override, message, tmp_path):
    with pytest.raises(ValueError, match=message):
        config(tmp_path, override)


def test_batched_refuses_next_token_tasks(tmp_path):
    task = "task={name: mqar, vocab_size: 32, seq_len: 16, num_kv_pairs: 2, num_train: 16, num_valid: 8}"
    with pytest.raises(ValueError, match="classification tasks only"):
        run_experiment(config(tmp_path, task, "model.paper_mode=false", "train.batched=true"), quiet=True)


@pytest.mark.parametrize("layout", [[], PAPER_LAYOUT], ids=["prepend", "paper"])
@pytest.mark.parametrize("mechanism", ["BAND:3(1)", "BLOC:4(1)", "TOPK:3"])
def test_fast_fold_computes_each_models_logits(mechanism, layout):
    if layout and not hasattr(ModelConfig(), "global_tokens"):
        pytest.skip("this model has no global-token layouts")
    cfg = config(Path("unused"), "model.dropout=0.0", f"mechanisms=[{mechanism}]", *layout)
    data = build_data(cfg, 1, torch.device("cpu"))
    models = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        models.append(build_model(cfg.model, mechanism, data).eval())
    inputs = data.valid_inputs[:5]
    expected = torch.cat([model(inputs) for model in models])
    got = fold_models(models, mode="fast").eval()(inputs.repeat(len(models), 1))
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("layout", [[], PAPER_LAYOUT], ids=["prepend", "paper"])
@pytest.mark.parametrize("mechanism", ["BAND:3", "BLOC:4", "BAND:3(1)", "BLOC:4(1)"])
def test_fast_fold_over_fixed_key_lists_computes_each_models_logits(mechanism, layout, monkeypatch, list_calls):
    from sparsefocus.train import batched

    monkeypatch.setattr(batched, "FIXED_LIST_MAX_SLOTS", 8)
    test_fast_fold_computes_each_models_logits(mechanism, layout)
    assert list_calls, "the key lists were not used"


def test_fast_fold_with_the_norm_and_bias_kernels_equals_the_models_and_the_twins(monkeypatch):
    """The folded norms and linear biases through their Triton kernels (Triton's interpreter here):
    each model's logits, and the fold's parameter gradients equal those through the twins."""
    from sparsefocus.train import batched

    cfg = config(Path("unused"), "model.dropout=0.0", "mechanisms=[FULL]", "model.blocks=1", "model.paper_mode=false")
    data = build_data(cfg, 1, torch.device("cpu"))
    models = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        model = build_model(cfg.model, "FULL", data).eval()
        for norm in (m for m in model.modules() if isinstance(m, torch.nn.LayerNorm)):
            torch.nn.init.normal_(norm.weight)  # not the initial 1 and 0: each run's affine shows
            torch.nn.init.normal_(norm.bias)
        models.append(model)
    inputs = data.valid_inputs[:3]
    expected = torch.cat([model(inputs) for model in models])
    grads = {}
    for choice in ("torch", "triton"):
        monkeypatch.setattr(batched, "LAYER_NORM", choice)
        monkeypatch.setattr(batched, "BIAS_ADD", choice)
        fold = fold_models(models, mode="fast").eval()
        logits = fold(inputs.repeat(len(models), 1))
        torch.testing.assert_close(logits, expected, rtol=1e-5, atol=1e-6)
        logits.square().sum().backward()
        grads[choice] = {name: p.grad.clone() for name, p in fold.named_parameters() if p.grad is not None}
    assert grads["triton"].keys() == grads["torch"].keys() and any("norm" in name for name in grads["torch"])
    for name, grad in grads["triton"].items():
        torch.testing.assert_close(grad, grads["torch"][name], rtol=1e-4, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.batched_mode=fast"], "needs train.batched_mode=fast on a CUDA device"),
        (["train.batched_mode=exact"], "needs train.batched_mode=fast on a CUDA device"),
    ],
)
@pytest.mark.parametrize("mode", ["step-graph", "eager-graph"])
def test_step_graph_refuses_what_it_cannot_capture(overrides, message, mode, tmp_path):
    cfg = config(tmp_path, "train.batched=true", f"train.compile={mode}", "mechanisms=[FULL]", *overrides)
    with pytest.raises(ValueError, match=message):
        run_experiment(cfg, quiet=True)


@pytest.mark.parametrize("mode", ["step-graph", "eager-graph"])
def test_step_graph_refuses_momentum(mode, tmp_path):
    """The captured update is plain SGD; momentum or weight decay would be silently dropped."""
    from sparsefocus.train import driver

    cfg = config(tmp_path, "train.batched=true", f"train.compile={mode}", "train.batched_mode=fast", "optim.momentum=0.9")
    with pytest.raises(ValueError, match="plain SGD only"):
        driver._check_step_graph(cfg, torch.device("cuda"))
    assert not driver._check_step_graph(config(tmp_path, "train.batched=true"), torch.device("cuda"))


@pytest.mark.parametrize("mode, compiled", [("step-graph", "default"), ("eager-graph", None)])
def test_eager_graph_records_the_step_without_compiling(mode, compiled, tmp_path):
    """Both graph modes record the whole step; only step-graph compiles the forward first."""
    from sparsefocus.train import driver

    cfg = config(tmp_path, "train.batched=true", f"train.compile={mode}", "train.batched_mode=fast")
    assert driver._check_step_graph(cfg, torch.device("cuda"))
    assert driver._compile_mode(cfg.train, torch.device("cuda")) == compiled


@pytest.mark.parametrize(
    "mode, device, compiled",
    [
        ("step-graph", "cuda", "max-autotune-no-cudagraphs"),
        ("default", "cpu", "max-autotune-no-cudagraphs"),
        ("reduce-overhead", "cuda", "max-autotune"),
        ("auto", "cuda", "max-autotune-no-cudagraphs"),
        ("auto", "cpu", None),
    ],
)
def test_compile_autotune_picks_each_modes_max_autotune_form(mode, device, compiled, tmp_path):
    from sparsefocus.train import driver

    cfg = config(
        tmp_path, "train.batched=true", f"train.compile={mode}", "train.batched_mode=fast", "train.compile_autotune=true"
    )
    assert driver._compile_mode(cfg.train, torch.device(device)) == compiled


def test_compile_autotune_needs_a_compiling_mode(tmp_path):
    with pytest.raises(ValueError, match="train.compile_autotune needs a compiling train.compile mode, got 'eager-graph'"):
        config(tmp_path, "train.batched=true", "train.compile=eager-graph", "train.compile_autotune=true")


def test_step_graph_body_is_the_fast_step(tmp_path):
    """The step the CUDA graph records (rows, forward, backward, per-run clipping, p -= lr * g,
    running sums), run uncaptured on the CPU, equals the fast loop's step with torch.optim.SGD."""
    from sparsefocus.train.driver import GroupTrainer, StepGraph, build_datas
    from sparsefocus.train.loop import RunSpec

    cfg = config(tmp_path, "model.dropout=0.0", "mechanisms=[TOPK:3]", "train.batched=true", "train.batched_mode=fast")
    datas = build_datas(cfg, SEEDS, torch.device("cpu"))
    specs = [RunSpec(tmp_path / str(s), cfg, "default", "TOPK:3", s) for s in SEEDS]
    plain, graphed = (GroupTrainer(specs, datas, torch.device("cpu")) for _ in range(2))
    body = StepGraph(graphed)
    params = list(plain.model.parameters())
    for step in range(3):
        index = torch.arange(step * 10, step * 10 + 15).remainder(40).expand(len(SEEDS), -1)
        loss, losses, _ = plain.forward(*plain.rows(plain.train_inputs, plain.train_targets, index))
        plain.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        plain.clip(params, cfg.optim.grad_clip)
        plain.optimizer.step()
        body.index.copy_(index)
        body.neg_lr.fill_(-cfg.optim.lr)
        for p in body.params:
            p.grad = None
        body._body()
    for (name, want), got in zip(plain.model.named_parameters(), graphed.model.parameters()):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7, msg=name)
    sums, _ = body.take_sums()
    assert sums.shape == (len(SEEDS),) and bool((sums > 0).all()) and not bool(body.loss_sum.any())


CONCURRENT = ["model.dropout=0.1", "mechanisms=[FULL,BAND:3(1),TOPK:3]", "train.batched=true", "train.batched_mode=fast"]


@pytest.fixture(scope="module")
def one_at_a_time(tmp_path_factory):
    """Fast batched groups with dropout trained one after the other, two runs per folded model
    (3 mechanisms x parts of 2 and 1 seeds: 6 folded models)."""
    root = run_experiment(config(tmp_path_factory.mktemp("sequential"), *CONCURRENT, "train.batched_max_runs=2"), quiet=True)
    return metrics_of(root), params_of(root)


@pytest.mark.parametrize("width", [2, 4])
def test_concurrent_groups_give_what_each_group_gives_alone(one_at_a_time, width, tmp_path):
    """Steps of several folded models interleaved (each its own dropout stream) equal the models
    trained one after the other, bit for bit; a part starts when another finishes."""
    cfg = config(tmp_path, *CONCURRENT, "train.batched_max_runs=2", f"train.concurrent_groups={width}")
    root = run_experiment(cfg, quiet=True)
    metrics, params = one_at_a_time
    assert_same_metrics(metrics, metrics_of(root), rtol=0.0)
    assert_same_params(params, params_of(root), atol=0.0)
    timings = [json.loads(p.read_text()) for p in root.glob("*/*/seed-*/timing.json")]
    assert timings and all(t[-1]["concurrent_groups"] == width and t[-1]["to_epoch"] == 3 for t in timings)
    assert json.loads((root / "timing.json").read_text())[-1]["runs_finished"] == len(timings)


CUDA_LAB = [
    "task={name: listops, min_length: 40, max_length: 90, num_train: 100, num_valid: 50, data_seed: 7}",
    "model={blocks: 2, heads: 1, dim: 16, mlp_dim: 16, dropout: 0.01, activation: relu, pooling: mean, paper_mode: false}",
    "mechanisms=[FULL, TOPK:5]",
    "seeds=[1, 2, 3, 4, 5, 6, 7, 8, 9, 10]",  # runs 5-9 of a folded ten are where two lanes once disagreed
    "optim.lr=1.0",
    "train.epochs=2",
    "train.batch_size=25",
    "train.device=cuda",
    "train.batched=true",
    "train.batched_mode=fast",
    "train.compile=eager-graph",
    "train.autocast=bf16",
    "train.matmul_precision=high",
]
CUDA_LAB_ACC_STEPS = {"train_acc": 1 / 100, "valid_acc": 1 / 50}  # one example of CUDA_LAB's sets


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA: the lanes' streams and CUDA graphs exist only there")
@pytest.mark.parametrize(
    "dropout,streams",
    [(0.01, True), (0.0, True), (0.01, False)],  # no dropout: the generator states play no part; no streams: in turn
)
def test_concurrent_cuda_lanes_of_ten_runs_give_what_each_group_gives_alone(dropout, streams, monkeypatch, tmp_path):
    """The laboratory's CUDA set-up (ten seeds folded, key padding, steps replayed from CUDA
    graphs, bf16): two groups in lock step, each on its own stream, give every run the metrics it
    gets when its group trains alone (to bf16 run-to-run noise, far below the 4% by which a
    concurrent ListOps pair once moved five of ten runs' first-epoch loss). With both groups' step
    graphs captured on one stream (so, by PyTorch's code, sharing one cuBLAS workspace) the later
    runs moved by up to 0.06 in loss, with or without dropout, and not with the lanes in turn.
    Accuracies may differ by one example: trained alone twice, a run's held-out accuracy moved by
    one of the 50 examples too (H200), while its losses stayed within 5e-4."""
    monkeypatch.setattr(driver, "LANE_STREAMS", streams)
    lab = (*CUDA_LAB, f"model.dropout={dropout}")
    alone = run_experiment(config(tmp_path / "alone", *lab), quiet=True)
    together = run_experiment(config(tmp_path / "together", *lab, "train.concurrent_groups=2"), quiet=True)
    assert_same_metrics(metrics_of(alone), metrics_of(together), rtol=2e-3, acc_steps=CUDA_LAB_ACC_STEPS)


def test_the_cuda_lab_settings_are_a_valid_experiment(tmp_path):
    """The CUDA test's settings load (checked on every machine, so that a typo cannot hide behind its skip)."""
    cfg = config(tmp_path, *CUDA_LAB, "train.concurrent_groups=2")
    assert cfg.train.concurrent_groups == 2 and len(cfg.seeds) == 10 and cfg.train.compile == "eager-graph"
    sizes = {"train_acc": cfg.task["num_train"], "valid_acc": cfg.task["num_valid"]}
    assert {key: round(1 / step) for key, step in CUDA_LAB_ACC_STEPS.items()} == sizes


def test_interrupted_concurrent_groups_resume_to_the_uninterrupted_result(one_at_a_time, tmp_path):
    cfg = config(tmp_path, *CONCURRENT, "train.batched_max_runs=2", "train.concurrent_groups=3")
    root = run_experiment(cfg, quiet=True, budget=EpochBudget(2))  # epochs 1 and 2 of the first 3 parts
    done = {run: len(lines) for run, lines in metrics_of(root).items()}
    assert done == {
        f"default/{m}/seed-{s}": 2 for m, s in [("FULL", 1), ("FULL", 2), ("FULL", 3), ("BAND-3-1", 1), ("BAND-3-1", 2)]
    }
    assert all(not load_checkpoint(p)["finished"] for p in root.glob("*/*/seed-*/checkpoint.pt"))
    assert json.loads((root / "timing.json").read_text())[-1]["runs_finished"] == 0
    run_experiment(cfg, quiet=True)
    assert json.loads((root / "timing.json").read_text())[-1]["runs_finished"] == len(metrics_of(root))
    metrics, params = one_at_a_time
    assert_same_metrics(metrics, metrics_of(root), rtol=0.0)
    assert_same_params(params, params_of(root), atol=0.0)


@pytest.mark.parametrize("where", ["make", "step"])
def test_a_failing_concurrent_group_stops_alone(one_at_a_time, where, monkeypatch, tmp_path):
    """A group that raises (while its model is built, or in its second epoch) drops out; the other
    groups train to the end with their usual results, and the error names the failed parts."""
    made, steps = driver.PartRun.__init__, driver.PartRun.steps

    def failing_init(self, specs, *args, **kwargs):
        if where == "make" and specs[0].label == "TOPK:3":
            raise RuntimeError("cannot build\nsecond line")
        made(self, specs, *args, **kwargs)

    def failing_steps(self):
        if where == "step" and self.specs[0].label == "TOPK:3" and self.epoch == 1:
            raise RuntimeError("cannot step")
        return (yield from steps(self))

    monkeypatch.setattr(driver.PartRun, "__init__", failing_init)
    monkeypatch.setattr(driver.PartRun, "steps", failing_steps)
    cfg = config(tmp_path, *CONCURRENT, "train.batched_max_runs=2", "train.concurrent_groups=2")
    message = "cannot build" if where == "make" else "cannot step"
    with pytest.raises(driver.PartsFailed, match=f"TOPK:3 \\(2 runs\\): RuntimeError: {message}; TOPK:3 \\(1 runs\\)"):
        run_experiment(cfg, quiet=True)
    metrics, _ = one_at_a_time
    got = metrics_of(Path(cfg.out_dir) / "exp")
    others = {run: lines for run, lines in metrics.items() if "TOPK" not in run}
    assert_same_metrics(others, {run: got[run] for run in others}, rtol=0.0)
    topk = {run: len(lines) for run, lines in got.items() if "TOPK" in run}
    assert topk == ({} if where == "make" else {f"default/TOPK-3/seed-{s}": 1 for s in SEEDS})


def test_concurrent_groups_need_the_batched_path(tmp_path):
    with pytest.raises(ValueError, match="train.concurrent_groups is read by the batched path only"):
        config(tmp_path, "train.concurrent_groups=2")
    with pytest.raises(ValueError, match="train.concurrent_groups must be"):
        config(tmp_path, "train.batched=true", "train.concurrent_groups=0")


def test_concurrent_groups_refuse_the_shared_cuda_graph_trees(tmp_path):
    with pytest.raises(ValueError, match="cannot take train.compile=reduce-overhead"):
        config(tmp_path, "train.batched=true", "train.concurrent_groups=2", "train.compile=reduce-overhead")


@pytest.mark.parametrize("pattern", ["TOPK:4", "BOTK:4"])
def test_fast_selection_by_mask_equals_the_gathered_keys(pattern, monkeypatch):
    """Fast-mode TOPK/BOTK through SDPA with a boolean mask of the chosen keys gives the outputs
    and gradients of the gathered-keys form (used above MASKED_SELECTION_MAX_KEYS keys)."""
    from sparsefocus.attention import parse_pattern
    from sparsefocus.train import batched

    q, k, v = (torch.randn(3, 2, 23, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(3, 2, 23, 8, dtype=torch.float64)
    results = []
    for limit in (4096, 0):
        monkeypatch.setattr(batched, "MASKED_SELECTION_MAX_KEYS", limit)
        out = fused_paper_attention(
            q, k, v, parse_pattern(pattern), fixed_mask=None, key_padding_mask=None, causal=False, dropout_p=0.0
        )
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for name, masked, gathered in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(masked, gathered, rtol=1e-10, atol=1e-12, msg=name)


@pytest.mark.parametrize("exact", [True, False])
def test_clip_per_run_scales_each_run_by_its_own_norm(exact):
    """Run r's gradients (the slices [r] of every parameter) are clipped as ``clip_grad_norm_``
    clips one model's: by min(1, max_norm / (||g_r|| + 1e-6)), other runs untouched."""
    from sparsefocus.train.batched import clip_per_run_

    params = [
        torch.nn.Parameter(torch.zeros(3, 4, 5)),
        torch.nn.Parameter(torch.zeros(3, 7)),
        torch.nn.Parameter(torch.zeros(3, 2)),
    ]
    for p, scale in zip(params, (1.0, 0.1, 3.0)):
        p.grad = torch.randn_like(p) * scale
    params[2].grad = None  # a parameter without a gradient is skipped
    params[0].grad[1] *= 1e-3  # run 1 is under the threshold
    singles = [[p.grad[r].clone() for p in params[:2]] for r in range(3)]
    norms = clip_per_run_(params, 0.5, exact=exact)
    for r in range(3):
        expected = torch.nn.utils.get_total_norm(singles[r])
        torch.testing.assert_close(norms[r], expected)
        coef = min(1.0, 0.5 / (expected.item() + 1e-6))
        for p, g in zip(params[:2], singles[r]):
            torch.testing.assert_close(p.grad[r], g * coef)


@pytest.mark.parametrize("dropout_p", [0.0, 0.3])
def test_gathered_attention_kernel_equals_torch_with_the_same_dropout_draw(dropout_p, monkeypatch):
    """The gathered-keys attention on the indexed Triton kernel (slot weights for the dropout)
    gives the torch form's outputs and gradients when both draw from the same generator state,
    with unused slots (-1) and a row without keys (output 0)."""
    from sparsefocus.train import batched

    q, k, v = (torch.randn(3, 2, 21, 8, requires_grad=True) for _ in range(3))
    index = torch.randint(-1, 21, (3, 2, 21, 5))
    index[0, 1, 4] = -1
    grad = torch.randn(3, 2, 21, 8)
    results = []
    for impl in ("torch", "triton"):
        monkeypatch.setattr(batched, "GATHER_IMPL", impl)
        torch.manual_seed(7)
        out = batched.gathered_attention(q, k, v, index, 0.35, dropout_p)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)
    assert (results[0][0][0, 1, 4] == 0).all() and torch.isfinite(results[0][1]).all()
    if dropout_p:
        torch.manual_seed(7)
        assert not torch.allclose(results[0][0], batched.gathered_attention(q, k, v, index, 0.35, 0.0))


@pytest.mark.parametrize(
    "pattern", ["BAND:3", "BLOC:4", "BAND:5", "BAND:3(1)", "bloc:k=4,g=2,globals_at=end", "band:k=5,g=1,globals_at=end"]
)
def test_fixed_patterns_over_their_key_lists_equal_the_masked_form(pattern, monkeypatch):
    """With FIXED_LIST_MAX_SLOTS set, fast mode attends BAND and BLOC over their key lists (unused
    slots at the edges included; global rows, first or last, over every key): the outputs and
    gradients of SDPA with the pattern's mask. Lists longer than the limit keep the mask."""
    from sparsefocus.attention import parse_pattern
    from sparsefocus.train import batched

    q, k, v = (torch.randn(3, 2, 22, 8, dtype=torch.float64, requires_grad=True) for _ in range(3))
    grad = torch.randn(3, 2, 22, 8, dtype=torch.float64)
    spec = parse_pattern(pattern)
    results = []
    for limit in (0, 16):
        monkeypatch.setattr(batched, "FIXED_LIST_MAX_SLOTS", limit)
        index = batched.fixed_key_lists(spec, q, k, causal=False)
        assert (index is None) == (limit == 0)
        fixed = selection_mask(spec, q[:1, :1], k[:1, :1]) if index is None else None
        out = fused_paper_attention(
            q, k, v, spec, fixed_mask=fixed, key_padding_mask=None, causal=False, dropout_p=0.0, fixed_index=index
        )
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for name, masked, listed in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(masked, listed, rtol=1e-10, atol=1e-12, msg=name)
    monkeypatch.setattr(batched, "FIXED_LIST_MAX_SLOTS", 2)
    assert batched.fixed_key_lists(spec, q, k, causal=False) is None


@pytest.mark.parametrize("pattern", ["BAND:5", "band:k=5,g=1,globals_at=end", "bloc:k=4,g=2,globals_at=end"])
def test_key_lists_op_passes_opcheck_and_compiles_like_eager(pattern, monkeypatch):
    """The key lists are the op ``sparsefocus::pattern_key_lists``: its lists are the pattern's
    own, it passes opcheck, and the compiled listed attention (global rows last included) gives
    eager's outputs and gradients."""
    from sparsefocus.attention import parse_pattern
    from sparsefocus.train import batched

    spec = parse_pattern(pattern)
    q, k, v = (torch.randn(2, 1, 23, 8, requires_grad=True) for _ in range(3))
    lists = torch.ops.sparsefocus.pattern_key_lists(str(spec), 23, 23, False, q)
    torch.testing.assert_close(lists, spec.indices(q[:1], k[:1], False, None, None).long(), rtol=0, atol=0)
    torch.library.opcheck(torch.ops.sparsefocus.pattern_key_lists.default, (str(spec), 23, 23, False, q.detach()))
    monkeypatch.setattr(batched, "FIXED_LIST_MAX_SLOTS", 16)

    def attend(q, k, v):
        index = batched.fixed_key_lists(spec, q, k, causal=False)
        return batched.listed_attention(q, k, v, spec, index, 0.35, 0.0)

    grad = torch.randn(2, 1, 23, 8)
    results = []
    for function in (attend, torch.compile(attend, fullgraph=True, dynamic=False)):
        out = function(q, k, v)
        results.append([out, *torch.autograd.grad(out, (q, k, v), grad)])
    for name, eager, compiled in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6, msg=name)


def test_fast_selection_without_gradients_attends_through_the_gathered_keys(monkeypatch):
    """Evaluation (no gradients) attends over the chosen keys only; at dropout 0 that is the
    masked form's output."""
    from sparsefocus.attention import parse_pattern
    from sparsefocus.train import batched

    q, k, v = (torch.randn(2, 1, 30, 8) for _ in range(3))
    calls = []
    original = batched.gathered_attention
    monkeypatch.setattr(batched, "gathered_attention", lambda *a: calls.append(1) or original(*a))
    kw = dict(fixed_mask=None, key_padding_mask=None, causal=False, dropout_p=0.0)
    with torch.no_grad():
        evaluated = fused_paper_attention(q, k, v, parse_pattern("TOPK:5"), **kw)
    assert calls == [1]
    trained = fused_paper_attention(q, k, v, parse_pattern("TOPK:5"), **kw)
    assert calls == [1]
    torch.testing.assert_close(evaluated, trained, rtol=1e-5, atol=1e-6)


def test_fast_selection_compiles_in_both_grad_modes():
    """The masked (training) and gathered (evaluation) branches of fast-mode TOPK compile with
    fullgraph and give eager's outputs (grad mode is part of the compiled graph's guards)."""
    from sparsefocus.attention import parse_pattern

    q, k, v = (torch.randn(2, 1, 30, 8) for _ in range(3))
    kw = dict(fixed_mask=None, key_padding_mask=None, causal=False, dropout_p=0.0)

    def attend(q, k, v):
        return fused_paper_attention(q, k, v, parse_pattern("TOPK:5"), **kw)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            torch.testing.assert_close(compiled(q, k, v), attend(q, k, v), rtol=1e-5, atol=1e-6)


def test_fixed_key_lists_compile_with_fullgraph(monkeypatch):
    """The key lists of an input-agnostic pattern are built inside the compiled graph and give
    eager's outputs."""
    from sparsefocus.attention import parse_pattern
    from sparsefocus.train import batched

    monkeypatch.setattr(batched, "FIXED_LIST_MAX_SLOTS", 8)
    spec = parse_pattern("BAND:3")
    q, k, v = (torch.randn(2, 1, 30, 8) for _ in range(3))

    def attend(q, k, v):
        index = batched.fixed_key_lists(spec, q, k, causal=False)
        kw = dict(fixed_mask=None, key_padding_mask=None, causal=False, dropout_p=0.0, fixed_index=index)
        return fused_paper_attention(q, k, v, spec, **kw)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v), attend(q, k, v), rtol=1e-5, atol=1e-6)


def test_gathered_attention_of_an_empty_batch_is_empty():
    from sparsefocus.train import batched

    q, k, v = torch.randn(0, 2, 7, 8), torch.randn(0, 2, 9, 8), torch.randn(0, 2, 9, 5)
    out = batched.gathered_attention(q, k, v, torch.zeros(0, 2, 7, 3, dtype=torch.long), 0.3, 0.1)
    assert out.shape == (0, 2, 7, 5)


def test_gathered_attention_on_the_kernel_compiles_with_fullgraph(monkeypatch):
    """The kernel form (with its per-call key-gradient mode) inside a compiled graph: eager's
    outputs and gradients."""
    from sparsefocus.train import batched

    monkeypatch.setattr(batched, "GATHER_IMPL", "triton")
    q, k, v = (torch.randn(2, 1, 30, 16, requires_grad=True) for _ in range(3))
    index = torch.randint(-1, 30, (2, 1, 30, 4))

    def attend(q, k, v):
        return batched.gathered_attention(q, k, v, index, 0.25, 0.0)

    compiled = torch.compile(attend, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (compiled, attend):
        out = fn(q, k, v)
        results.append([out, *torch.autograd.grad(out.sum(), (q, k, v))])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    "mechanism",
    [
        "nsa:block=4,top=3,cmp=4,stride=2,window=4",
        "dsa:k=5,heads=2,dim=4",
        "nsa:block=4,top=3,cmp=4,stride=2,window=4,pool=mlp",
        "zeta:k=3,window=4,chunks=2,local=2,sink=1",
    ],
)
def test_folded_mechanisms_with_parameters_attend_once_per_block_and_compile_like_eager(mechanism, monkeypatch):
    """Fast mode attends every run of a mechanism with parameters in one call per block (their
    parameters fold), so the step graph does not grow with the runs; the compiled folded model
    (fullgraph) gives the eager outputs, auxiliary loss and gradients."""
    assert parse_pattern(mechanism).folds_params
    cfg = config(Path("unused"), "model.dropout=0.0", "model.paper_mode=false", f"mechanisms=['{mechanism}']")
    data = build_data(cfg, 1, torch.device("cpu"))
    models = []
    for seed in SEEDS:
        torch.manual_seed(seed)
        models.append(build_model(cfg.model, mechanism, data))
    folded = fold_models(models, mode="fast")
    inputs = data.train_inputs[:4].repeat(len(models), 1)
    calls = []
    attend = batched.sparse_attention

    def counted(*args, **kwargs):
        calls.append(args[0].shape[0])
        return attend(*args, **kwargs)

    def step(model):
        logits = model(inputs)
        aux = sum(m.aux_loss for m in model.modules() if isinstance(m, batched.RunAttention))
        grads = torch.autograd.grad(logits.square().sum() + aux, list(model.parameters()), allow_unused=True)
        return logits, aux, grads

    monkeypatch.setattr(batched, "sparse_attention", counted)
    want = step(folded)
    assert calls == [inputs.shape[0]] * cfg.model.blocks, "one call per block over every run's rows"
    monkeypatch.setattr(batched, "sparse_attention", attend)
    torch._dynamo.reset()
    got = step(torch.compile(folded, backend="aot_eager", fullgraph=True))
    torch.testing.assert_close(got[0], want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=1e-5, atol=1e-6)
    for g, w in zip(got[2], want[2], strict=True):
        assert (g is None) == (w is None)
        if g is not None:
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
