"""The batched laboratory on one GPU: correctness, throughput, precision fidelity, then the study.

Each call does what fits in ``--budget`` seconds and remembers what it finished in
``<out>/gpu_lab.json``; calling again with the same ``--out`` folder continues.

1. check: on CUDA the fast batched FULL and TOPK:5 models (dropout 0) against the exact ones
   (each op per run, as ``train_run``) on a small ListOps batch, fp32: logits and gradients.
2. throughput: the ListOps model (10 blocks, d=64, lengths 500-600, batch 25) with 10 seeds
   folded, FULL and TOPK:5, fp32 and the chosen precision: ms per training step, seconds of one
   whole-set evaluation (5000 + 2000 per seed), their sum per epoch, compile seconds, peak memory,
   and the heaviest kernels of one profiled step and one evaluation chunk.
3. fidelity: FULL and TOPK:5, 3 seeds, ``--fidelity-epochs`` epochs at fp32 and at the chosen
   precision (run folders ``fidelity-fp32`` / ``fidelity-<precision>``), per-epoch differences
   of train loss and held-out accuracy next to the spread between seeds.
4. study: the Figure-1a ListOps study (FULL, TOPK:5, BAND:5, BAND:5(1), BLOC:5, BLOC:5(1); 10
   seeds; 200 epochs; ReLU) advanced with the budget driver under ``<out>/listops_fig1a``.

Usage (one H200, about 9 minutes a call):
    python benchmarks/gpu_lab.py --out OUT [--budget 540] [--precision high] [--autocast none]
    python benchmarks/gpu_lab.py --out OUT --summarise --precision high --autocast bf16 --fidelity-epochs 8  # no GPU
Writes ``<out>/gpu_lab.json`` and prints a table. Extra ``--set key=value`` overrides go to
every ListOps config (e.g. ``--set model.global_tokens=append_paper``). ``--constant
MODULE.NAME=VALUE`` sets a module constant of the package before anything runs, to time the
step with another implementation choice (e.g. ``--constant
sparsefocus.kernels.indexed.SHORT_KEY_GRADS_MAX_KEYS=2048``; ``train.fast_attention=lists`` sets
its two switches of ``sparsefocus.train.batched`` itself, over such constants); the overrides and
constants are recorded beside the timings. ``--throughput-form masks --throughput-form lists``
times each mechanism with both ``train.fast_attention`` forms in one process; ``--throughput-config
EXPERIMENT.yaml`` times the model and data of another experiment (say the even-pairs open question)
and ``--throughput-mechanism`` takes any pattern spec. ``--only-throughput``
times and stops (no check, fidelity or study; exit status 1 when the budget left no time to time
or a case failed). A case that fails is recorded with its error, and the others are still timed.
Each case is written to ``gpu_lab.json`` as soon as it is timed, so a call stopped by its time
limit keeps the cases it finished; the same command again times only the cases not yet timed
(or those that failed), and a call with another ``--throughput-config``, ``--set``,
``--constant``, ``--compile``, ``--topk-select`` or ``--steps`` starts the throughput record afresh.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sparsefocus.attention import parse_pattern
from sparsefocus.bench.profiling import count_kernels, device_ms, profile_events, top_kernels
from sparsefocus.bench.run import BenchError, parse_constant
from sparsefocus.train.batched import fast_attention
from sparsefocus.train.checkpoint import write_text_atomic
from sparsefocus.train.config import FAST_ATTENTIONS, PAPER_SEEDS, load_config
from sparsefocus.train.driver import Budget, GroupTrainer, build_datas
from sparsefocus.train.experiment import plan, progress_line, run_experiment
from sparsefocus.train.loop import matmul_precision

ROOT = Path(__file__).resolve().parents[1]
FIG1A = ["FULL", "TOPK:5", "BAND:5", "BAND:5(1)", "BLOC:5", "BLOC:5(1)"]
LISTOPS = ROOT / "experiments" / "listops.yaml"
FP32 = ("highest", "none")
DEVICE = "cuda"
TOPK_SELECT = "torch"


def set_constant(assignment: str) -> tuple[str, object]:
    """Apply ``MODULE.NAME=VALUE`` to a sparsefocus module constant that exists (for the whole
    process). Returns (the dotted name, the value). ValueError otherwise."""
    try:
        module, name, value = parse_constant(assignment)
    except BenchError as error:
        raise ValueError(str(error)) from None
    setattr(module, name, value)
    return f"{module.__name__}.{name}", value


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def experiment_config(
    out: Path,
    name: str,
    mechanisms: list[str],
    seeds: list[int],
    precision: tuple[str, str],
    extra: list[str],
    *more: str,
    path: Path = LISTOPS,
):
    """The experiment at ``path`` (default: the paper's ListOps), batched fast mode on CUDA, with
    the given precision."""
    overrides = [
        f"out_dir={out}",
        f"name={name}",
        f"mechanisms={json.dumps(mechanisms)}",
        f"seeds={seeds}",
        "settings={}",
        f"train.device={DEVICE}",
        "train.batched=true",
        "train.batched_mode=fast",
        "train.task_cache=true",
        f"train.matmul_precision={precision[0]}",
        f"train.autocast={precision[1]}",
        f"train.topk_select={TOPK_SELECT}",
        *extra,
        *more,
    ]
    return load_config(path, overrides)


def label(precision: tuple[str, str]) -> str:
    return "fp32" if precision == FP32 else (precision[1] if precision[1] != "none" else f"tf32-{precision[0]}")


def trainer_for(config, mechanism: str, seeds: list[int]) -> GroupTrainer:
    from sparsefocus.train.loop import RunSpec

    specs = [RunSpec(Path(config.out_dir) / "unused", config, "default", mechanism, seed) for seed in seeds]
    datas = build_datas(config, seeds, torch.device(DEVICE))
    return GroupTrainer(specs, datas, torch.device(DEVICE))


def check(out: Path, extra: list[str]) -> dict:
    """Fast (in the chosen ``train.fast_attention``) against exact folded models on CUDA (fp32,
    dropout 0): logits and gradients."""
    results = {}
    for mechanism in ("FULL", "TOPK:5", "BAND:5(1)"):
        grads = {}
        for mode in ("exact", "fast"):
            config = experiment_config(
                out,
                "check",
                [mechanism],
                PAPER_SEEDS[:2],
                FP32,
                extra,
                "model.dropout=0.0",
                f"train.batched_mode={mode}",
                "train.compile=eager",
                *(["train.fast_attention=masks"] if mode == "exact" else []),  # the exact path has one form
            )
            with matmul_precision("highest"), fast_attention(config.train.fast_attention):
                trainer = trainer_for(config, mechanism, PAPER_SEEDS[:2])
                inputs, targets = trainer.rows(
                    trainer.train_inputs, trainer.train_targets, torch.arange(8, device=DEVICE).expand(2, -1)
                )
                loss, _, _ = trainer.forward(inputs, targets)
                loss.backward()
                grads[mode] = (loss.detach(), {n: p.grad.clone() for n, p in trainer.model.named_parameters()})
        # relative to the whole gradient's norm: some gradients are zero in exact arithmetic (k_proj.bias)
        total = torch.sqrt(sum(g.norm() ** 2 for g in grads["exact"][1].values()))
        worst = max(((grads["fast"][1][n] - g).norm() / total).item() for n, g in grads["exact"][1].items())
        results[mechanism] = {
            "loss_exact": grads["exact"][0].item(),
            "loss_fast": grads["fast"][0].item(),
            "worst_grad_rel_err": worst,
        }
    results["step_graph"] = check_step_graph(out, extra)
    return results


def train_step(trainer: GroupTrainer, index: torch.Tensor, params: list) -> None:
    """One fast training step on the rows ``index`` [R, B]: the recorded graph's replay when the
    trainer has one, else forward, backward, per-run clipping and the optimiser."""
    from sparsefocus.train.batched import clip_per_run_

    if trainer.step_graph is not None:
        trainer.step_graph.step(index, trainer.optimizer.param_groups[0]["lr"])
        return
    loss, _, _ = trainer.forward(*trainer.rows(trainer.train_inputs, trainer.train_targets, index))
    trainer.optimizer.zero_grad(set_to_none=True)
    loss.backward()
    clip_per_run_(params, trainer.config.optim.grad_clip, exact=False)
    trainer.optimizer.step()


def check_step_graph(out: Path, extra: list[str], steps: int = 5) -> dict:
    """``train.compile=step-graph`` against the compiled step without a graph (FULL, fp32, dropout
    0): per-run parameters after ``steps`` full-batch steps (2 warm-up, the capture, replays); and,
    with dropout, that replays of one batch draw new masks (their losses differ)."""

    finals = {}
    for mode in ("default", "step-graph"):
        config = experiment_config(
            out, "check", ["FULL"], PAPER_SEEDS[:2], FP32, [*extra, f"train.compile={mode}"], "model.dropout=0.0"
        )
        with matmul_precision("highest"), fast_attention(config.train.fast_attention):
            trainer = trainer_for(config, "FULL", PAPER_SEEDS[:2])
            batch = trainer.train_cfg.batch_size
            order = torch.arange(steps * batch, device=DEVICE).view(steps, 1, batch).expand(steps, 2, batch)
            params = list(trainer.model.parameters())
            trainer.model.train()
            for i in range(steps):
                train_step(trainer, order[i], params)
            synchronize()
            finals[mode] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    worst = max(
        ((finals["step-graph"][n] - w).abs().max() / w.abs().max().clamp(min=1e-12)).item() for n, w in finals["default"].items()
    )
    config = experiment_config(out, "check", ["FULL"], PAPER_SEEDS[:2], FP32, [*extra, "train.compile=step-graph"])
    trainer = trainer_for(config, "FULL", PAPER_SEEDS[:2])
    trainer.model.train()
    index = torch.arange(2 * 25, device=DEVICE).view(2, 25)
    losses = []
    for _ in range(5):  # lr 0: the weights stay, only the dropout masks change
        trainer.step_graph.step(index, 0.0)
        losses.append(trainer.step_graph.take_sums()[0].sum().item())
    return {"steps": steps, "worst_param_rel_err": worst, "dropout_replay_losses": losses}


def throughput(
    out: Path,
    precisions: list[tuple[str, str]],
    extra: list[str],
    steps: int,
    compile_mode: str,
    mechanisms: tuple[str, ...],
    forms: tuple[str, ...] = (),
    path: Path = LISTOPS,
    done: dict | None = None,
    on_case: Callable[[dict], None] | None = None,
    top: int = 12,
) -> dict:
    """ms per training step and seconds per whole evaluation, 10 seeds folded, per mechanism and,
    with ``forms``, per ``train.fast_attention`` (cases "MECHANISM/PRECISION/FORM", timed one
    after the other in this process), on the model and data of the experiment at ``path``.
    Cases timed without error in ``done`` (an earlier call's) are kept, not timed again;
    ``on_case(results)`` runs after each case, so a call cut short keeps what it measured."""
    results = dict(done or {})
    for precision in precisions:
        for mechanism in mechanisms:
            for form in forms or ("",):
                case = "/".join(filter(None, (mechanism, label(precision), form)))
                if "error" not in results.get(case, {"error": "not timed"}):
                    continue
                more = [f"train.compile={compile_mode}", *([f"train.fast_attention={form}"] if form else [])]
                config = experiment_config(out, path.stem, [mechanism], PAPER_SEEDS, precision, extra, *more, path=path)
                results[case] = _time_case(config, mechanism, precision, steps, top)
                if DEVICE == "cuda":
                    torch.cuda.empty_cache()
                print(f"throughput {case}: {results[case]}", flush=True)
                if on_case is not None:
                    on_case(results)
    return results


def _time_case(config, mechanism: str, precision: tuple[str, str], steps: int, top: int = 12) -> dict:
    """One throughput case, or ``{"error": ...}`` when it fails (its traceback printed), so that
    the cases timed before and after it are kept."""
    try:
        with matmul_precision(precision[0]), fast_attention(config.train.fast_attention):
            if DEVICE == "cuda":
                torch.cuda.reset_peak_memory_stats()
            return _time_trainer(trainer_for(config, mechanism, PAPER_SEEDS), steps, top)
    except Exception as error:  # any failure of one case is recorded, not fatal
        traceback.print_exc()
        return {"error": f"{type(error).__name__}: {error}"[:2000]}


def _time_trainer(trainer: GroupTrainer, steps: int, top: int = 12) -> dict:
    params = list(trainer.model.parameters())
    batch = trainer.train_cfg.batch_size
    order = torch.stack([torch.randperm(trainer.train_inputs.shape[1], device=DEVICE) for _ in range(trainer.runs)])

    def step(i: int) -> None:
        train_step(trainer, order[:, i * batch : (i + 1) * batch], params)

    def uncaptured_step() -> None:
        if trainer.step_graph is None:
            step(0)
        else:
            trainer.step_graph.run_uncaptured(order[:, :batch], trainer.optimizer.param_groups[0]["lr"])

    trainer.model.train()
    device = torch.device(DEVICE)
    began = time.perf_counter()
    step(0)  # compiles the step
    synchronize()
    # profiled before the step graph is captured: a profile after replays also lists their kernels
    step_events = profile_events(uncaptured_step, device)
    for i in (1, 2):
        step(i)
    synchronize()
    compile_s = time.perf_counter() - began
    began = time.perf_counter()
    for i in range(steps):
        step(3 + i)
    synchronize()
    step_ms = 1000 * (time.perf_counter() - began) / steps
    trainer.evaluate(trainer.valid_inputs[:, :500], trainer.valid_targets[:, :500])  # compile the eval graph
    synchronize()
    began = time.perf_counter()
    trainer.evaluate(trainer.train_inputs, trainer.train_targets)
    trainer.evaluate(trainer.valid_inputs, trainer.valid_targets)
    synchronize()
    eval_s = time.perf_counter() - began
    epoch_s = trainer.steps_per_epoch * step_ms / 1000 + eval_s
    chunk = trainer.train_cfg.eval_batch_size
    profiles = {
        "step": step_events,
        "eval_chunk": profile_events(
            lambda: trainer.evaluate(trainer.valid_inputs[:, :chunk], trainer.valid_targets[:, :chunk]), device
        ),
    }
    return {
        "step_ms": round(step_ms, 3),
        "eval_s": round(eval_s, 3),
        "epoch_s": round(epoch_s, 3),
        "study_epochs": trainer.train_cfg.epochs,
        "study_min": round(trainer.train_cfg.epochs * epoch_s / 60, 2),
        "compile_s": round(compile_s, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEVICE == "cuda" else 0.0,
        **{
            f"{name}_profile": {
                "device_ms": device_ms(events, device),
                "kernels": count_kernels(events),
                "top_kernels": top_kernels(events, device, top),
            }
            for name, events in profiles.items()
        },
    }


def fidelity(out: Path, precisions: list[tuple[str, str]], extra: list[str], epochs: int, budget: Budget) -> dict:
    """FULL and TOPK:5 curves, 3 seeds, at fp32 and the chosen precision (``precisions``: the
    reference first); the largest per-epoch differences next to the spread between seeds."""
    for config in fidelity_configs(out, precisions, extra, epochs):
        run_experiment(config, quiet=True, budget=budget)
    return summarise_fidelity(out, precisions, extra, epochs)


def fidelity_configs(out: Path, precisions: list[tuple[str, str]], extra: list[str], epochs: int) -> list:
    return [
        experiment_config(out, f"fidelity-{label(p)}", ["FULL", "TOPK:5"], PAPER_SEEDS[:3], p, extra, f"train.epochs={epochs}")
        for p in precisions
    ]


def summarise_fidelity(out: Path, precisions: list[tuple[str, str]], extra: list[str], epochs: int) -> dict:
    """The comparison of the fidelity runs' logged curves (no training); unfinished runs give
    {"finished": False}."""
    curves = {}
    for precision, config in zip(precisions, fidelity_configs(out, precisions, extra, epochs)):
        for spec in plan(config, [("default", config)]):
            path = spec.run_dir / "metrics.jsonl"
            lines = [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []
            curves[(label(precision), spec.label, spec.seed)] = lines[:epochs]
    if any(len(lines) < epochs for lines in curves.values()):
        return {"finished": False}
    summary = compare_curves(curves, label(precisions[0]), label(precisions[-1]), epochs)
    plot_fidelity(curves, label(precisions[0]), label(precisions[-1]), out / "fidelity.png")
    return summary


def plot_fidelity(curves: dict, reference: str, chosen: str, path: Path) -> None:
    """Every seed's train loss and held-out accuracy per epoch, reference solid, chosen dashed."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, 2, figsize=(10, 7), sharex=True)
    for col, mechanism in enumerate(("FULL", "TOPK:5")):
        for row, key in enumerate(("train_loss", "valid_acc")):
            ax = axes[row][col]
            for i, seed in enumerate(PAPER_SEEDS[:3]):
                for name, style in ((reference, "-"), (chosen, "--")):
                    ys = [line[key] for line in curves[(name, mechanism, seed)]]
                    ax.plot(range(1, len(ys) + 1), ys, style, color=f"C{i}", label=f"{name} seed {seed}")
            ax.set_title(f"{mechanism} {key}")
            ax.set_xlabel("epoch")
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"ListOps, 3 seeds: {reference} (solid) and {chosen} (dashed)")
    fig.tight_layout()
    tmp = path.with_suffix(".tmp.png")
    fig.savefig(tmp, dpi=100)
    plt.close(fig)
    tmp.replace(path)


def compare_curves(curves: dict, reference: str, chosen: str, epochs: int) -> dict:
    """Per mechanism and metric: the largest |chosen - reference| over epochs and seeds, the mean
    seed standard deviation of the reference, and both median curves. ``curves``: (precision
    label, mechanism, seed) -> per-epoch metric dicts."""
    if reference == chosen:
        raise ValueError(f"the fidelity check compares two precisions, got {reference} twice")
    summary: dict = {"finished": True, "reference": reference, "chosen": chosen}
    for mechanism in ("FULL", "TOPK:5"):
        for key in ("train_loss", "valid_acc"):
            gaps, spreads = [], []
            for epoch in range(epochs):
                a = [curves[(reference, mechanism, s)][epoch][key] for s in PAPER_SEEDS[:3]]
                b = [curves[(chosen, mechanism, s)][epoch][key] for s in PAPER_SEEDS[:3]]
                gaps.append(max(abs(x - y) for x, y in zip(a, b)))
                spreads.append(statistics.pstdev(a))
            summary[f"{mechanism}/{key}"] = {"max_gap": round(max(gaps), 5), "seed_std_mean": round(statistics.mean(spreads), 5)}
            for name in (reference, chosen):
                summary[f"{mechanism}/{key}/{name}"] = [
                    round(statistics.median(curves[(name, mechanism, s)][e][key] for s in PAPER_SEEDS[:3]), 4)
                    for e in range(epochs)
                ]
    return summary


def study(out: Path, precision: tuple[str, str], extra: list[str], budget: Budget) -> dict:
    config = experiment_config(out, "listops_fig1a", FIG1A, PAPER_SEEDS, precision, extra)
    began = time.perf_counter()
    run_experiment(config, quiet=True, budget=budget)
    line, complete = progress_line(config)
    return {"summary": line, "complete": complete, "seconds_this_call": round(time.perf_counter() - began, 1)}


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.environ.get("OUT", "gpu_lab_out"), help="results and run folders (default: $OUT)")
    parser.add_argument("--budget", type=float, default=540.0, help="seconds this call may use (default 540)")
    parser.add_argument("--margin", type=float, default=90.0, help="seconds kept free for a compile at a group start")
    parser.add_argument("--precision", default="high", choices=("highest", "high", "medium"), help="chosen matmul precision")
    parser.add_argument("--autocast", default="none", choices=("none", "bf16"), help="chosen autocast")
    parser.add_argument(
        "--compile",
        default="default",
        choices=("eager", "default", "reduce-overhead", "step-graph", "eager-graph"),
        help="train.compile",
    )
    parser.add_argument("--no-reference", action="store_true", help="time only the chosen precision, not fp32 too")
    parser.add_argument("--topk-select", default="torch", choices=("torch", "triton"), help="train.topk_select")
    parser.add_argument("--steps", type=int, default=30, help="timed training steps per throughput case")
    parser.add_argument(
        "--throughput-mechanism",
        action="append",
        help="a mechanism to time (repeatable; any pattern spec; default: FULL and TOPK:5)",
    )
    parser.add_argument(
        "--throughput-config",
        type=Path,
        default=LISTOPS,
        help="the experiment whose model and data the throughput stage times (default: experiments/listops.yaml)",
    )
    parser.add_argument(
        "--throughput-form",
        action="append",
        default=[],
        choices=FAST_ATTENTIONS,
        help="time each mechanism with this train.fast_attention too (repeatable; default: as configured)",
    )
    parser.add_argument("--fidelity-epochs", type=int, default=5)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a smoke test of this script")
    parser.add_argument("--min-stage", type=float, default=240.0, help="seconds left needed to start the throughput stage")
    parser.add_argument("--no-study", action="store_true", help="stop after the fidelity stage")
    parser.add_argument(
        "--summarise",
        action="store_true",
        help="only recompute the fidelity comparison and fidelity.png from the run folders under --out (no GPU)",
    )
    parser.add_argument("--redo", action="append", default=[], help="stage to run again: check, throughput, fidelity")
    parser.add_argument(
        "--set", action="append", default=[], dest="extra", metavar="KEY=VALUE", help="override for every ListOps config"
    )
    parser.add_argument(
        "--constant", action="append", default=[], metavar="MODULE.NAME=VALUE", help="a sparsefocus module constant to set"
    )
    parser.add_argument("--only-throughput", action="store_true", help="time the step and stop: no check, fidelity or study")
    parser.add_argument(
        "--top-kernels", type=int, default=12, help="heaviest kernels listed per profiled step and evaluation chunk (default 12)"
    )
    args = parser.parse_args()
    for mechanism in args.throughput_mechanism or ():
        try:
            parse_pattern(mechanism)
        except ValueError as error:
            parser.error(f"--throughput-mechanism {mechanism!r}: {error}")
    return args


def main() -> int:
    global DEVICE, TOPK_SELECT
    args = parse_args()
    DEVICE, TOPK_SELECT = args.device, args.topk_select
    if args.summarise:
        return summarise_only(args)
    try:
        constants = dict(set_constant(assignment) for assignment in args.constant)
    except ValueError as error:
        print(f"gpu_lab: error: {error}", file=sys.stderr)
        return 2
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_lab needs CUDA (--device cpu with small --set sizes is a smoke test only)")
        return 2
    started = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    state_path = out / "gpu_lab.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    for stage in args.redo:
        state.pop(stage, None)
    chosen = (args.precision, args.autocast)
    timed = [FP32] if chosen == FP32 else ([chosen] if args.no_reference else [FP32, chosen])
    compared = [FP32, chosen]  # the fidelity stage always has its fp32 reference
    extra = [f"train.compile={args.compile}", *args.extra]
    state["device"] = torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu"
    state["torch"] = torch.__version__
    state["chosen"] = {"matmul_precision": chosen[0], "autocast": chosen[1], "compile": args.compile, "topk_select": TOPK_SELECT}

    def save() -> None:
        write_text_atomic(state_path, json.dumps(state, indent=1))

    def left() -> float:
        return args.budget - (time.time() - started)

    if "check" not in state and not args.only_throughput:
        state["check"] = check(out, extra)
        save()
    settings = {  # what the timings ran with; another value of any of them times every case again
        "config": str(args.throughput_config),
        "set": args.extra,
        "constants": constants,
        "compile": args.compile,
        "topk_select": TOPK_SELECT,
        "steps": args.steps,
    }
    if state.get("throughput_settings", settings) != settings:
        state.pop("throughput", None)  # an earlier call's cases timed something else
    if left() > args.min_stage:

        def keep(results: dict) -> None:
            state["throughput"], state["throughput_settings"] = results, settings
            save()

        throughput(  # each timed case is kept by ``keep`` as it finishes
            out,
            timed,
            extra,
            args.steps,
            args.compile,
            tuple(args.throughput_mechanism or FIG1A[:2]),
            tuple(args.throughput_form),
            args.throughput_config,
            done=state.get("throughput"),
            on_case=keep,
            top=args.top_kernels,
        )
    elif "throughput" not in state:
        print(f"throughput not started: {left():.0f} s of the budget left, --min-stage needs {args.min_stage:.0f}", flush=True)
    if args.only_throughput:
        print_table(state)
        timed_all = "throughput" in state and not any("error" in row for row in state["throughput"].values())
        return 0 if timed_all else 1
    fidelity_due = chosen != FP32 and not state.get("fidelity", {}).get("finished")
    if fidelity_due and left() > args.margin + 120:
        state["fidelity"] = fidelity(out, compared, extra, args.fidelity_epochs, Budget(left() - args.margin))
        save()
    if not args.no_study and left() > args.margin + 60:
        state["study"] = study(out, chosen, extra, Budget(left() - args.margin))
        save()
    print_table(state)
    return 0


def summarise_only(args: argparse.Namespace) -> int:
    """--summarise: the fidelity stage's comparison from finished run folders, into gpu_lab.json."""
    out = Path(args.out)
    state_path = out / "gpu_lab.json"
    state = json.loads(state_path.read_text()) if state_path.exists() else {}
    extra = [f"train.compile={args.compile}", *args.extra]
    state["fidelity"] = summarise_fidelity(out, [FP32, (args.precision, args.autocast)], extra, args.fidelity_epochs)
    write_text_atomic(state_path, json.dumps(state, indent=1))
    print_table(state)
    return 0


def print_table(state: dict) -> None:
    print(f"\n{state['device']}, torch {state['torch']}, chosen {state['chosen']}")
    for mechanism, row in state.get("check", {}).items():
        if mechanism == "step_graph":
            print(
                f"check step-graph vs compiled step, {row['steps']} steps: worst param rel err {row['worst_param_rel_err']:.2e}"
            )
            continue
        print(
            f"check {mechanism:7s} fast vs exact: loss {row['loss_fast']:.6f} vs {row['loss_exact']:.6f}, worst grad rel err {row['worst_grad_rel_err']:.2e}"
        )
    if "throughput" in state:
        print(f"{'case':24s} {'step ms':>8s} {'eval s':>7s} {'epoch s':>8s} {'study min':>10s} {'compile s':>9s} {'GiB':>6s}")
        for case, row in state["throughput"].items():
            if "error" in row:
                print(f"{case:24s} failed: {row['error'].splitlines()[0][:160]}")
                continue
            print(
                f"{case:24s} {row['step_ms']:8.2f} {row['eval_s']:7.2f} {row['epoch_s']:8.2f} {row['study_min']:10.2f} {row['compile_s']:9.1f} {row['peak_gib']:6.2f}"
            )
    fid = state.get("fidelity", {})
    if fid.get("finished"):
        for key, row in fid.items():
            if isinstance(row, dict):
                print(f"fidelity {key:22s} max gap {row['max_gap']:.4f}  (seed std {row['seed_std_mean']:.4f})")
    elif fid:
        print("fidelity: unfinished, continues next call")
    if "study" in state:
        print(f"study: {state['study']['summary']} ({state['study']['seconds_this_call']} s this call)")


if __name__ == "__main__":
    sys.exit(main())
