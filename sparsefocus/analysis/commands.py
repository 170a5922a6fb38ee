"""``sparsefocus analyze RUN_DIR``: the Semantic Focus statistics of trained runs.

For every mechanism of a run (or experiment) folder it loads the trained model, feeds it batches
of its training data with hooks on every attention layer, and writes to ``RUN_DIR/analysis/``
(or ``--out``) a Markdown and a JSON report: dispersion, separation and sink percentiles pooled
and per layer (the paper's table: the FULL model's dispersion over all keys beside each sparse
model's dispersion over its kept keys), the paper's bound check, top-k recall, and with
``--landscape`` the loss landscapes and Lipschitz estimates as PNGs. With ``--summary`` (the
``summary.json`` of ``sparsefocus report --reach ACC`` on the same experiment) it also plots each
mechanism's learning speed against its kept/all dispersion (``speed_dispersion.md`` / ``.png``).
With ``--update`` it keeps the entries of an earlier ``analysis.json`` in the output folder whose
checkpoints (SHA-256 of each analysed ``checkpoint.pt``) and options are unchanged, and analyses
only the other mechanisms: a study continued or extended by a few mechanisms is not analysed whole
again.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from sparsefocus.analysis.bounds import (
    check_columns,
    columns_from_summaries,
    format_bound_report,
    keeps_top_scores,
    paper_bound_report,
)
from sparsefocus.analysis.hooks import AttentionCall, capture_attention
from sparsefocus.analysis.landscape import (
    LIPSCHITZ_WINDOWS,
    Landscape,
    lipschitz_profile,
    loss_grid,
    plot_landscapes,
    plot_lipschitz,
)
from sparsefocus.analysis.recall import RecallStatistics
from sparsefocus.analysis.runs import LoadedRun, find_runs, group_runs, load_run, read_record
from sparsefocus.analysis.speed_dispersion import check_summary, write_speed_dispersion
from sparsefocus.analysis.statistics import ScoreStatistics
from sparsefocus.clitools import HelpFormatter, fail
from sparsefocus.train.checkpoint import write_text_atomic


PAPER_ANALYSIS_SEED = 140439608  # the seed of the paper's statistics and landscape checkpoints


@dataclass
class AnalyzeOptions:
    """How much data to feed and what to compute. Defaults follow the paper: 10 batches of 100.

    seed: the run analysed per mechanism (unless ``all_seeds``): None = the smallest seed of the
        group (the default), or a seed, e.g. ``PAPER_ANALYSIS_SEED`` (the paper's 140439608).
    lipschitz_window: "centred" (closed [-r, r], the default) or "paper" (``lgrads.py``'s
        half-open window shifted by one grid step); see ``sparsefocus.analysis.landscape``.
    device: where the models run ("cpu", the default, or e.g. "cuda"; on CUDA a run keeps the
        attention implementation it was trained with).
    update: keep the mechanisms of the output folder's earlier ``analysis.json`` whose analysed
        checkpoints and options (other than ``device`` and ``update``) are unchanged; not with
        ``landscape``.
    """

    batches: int = 10
    batch_size: int = 100
    all_seeds: bool = False
    landscape: bool = False
    grid: int = 11
    radius: float = 1.0
    landscape_samples: int = 500
    direction_seed: int = 11111
    seed: int | None = None
    lipschitz_window: str = "centred"
    device: str = "cpu"
    update: bool = False


REUSE_IGNORES = ("device", "update")
"""Options that do not change an analysis' numbers, so an earlier entry made with others is kept."""


def pattern_k(call: AttentionCall) -> int | None:
    """The k of the layer's pattern (sink ratio beta / k), None when it has none."""
    k = getattr(call.module.pattern, "k", None)
    return k if isinstance(k, int) and k >= 1 else None


def collect(run: LoadedRun, options: AnalyzeOptions, stats: ScoreStatistics, recall: RecallStatistics | None) -> int:
    """Feed up to batches x batch_size training examples through the model, adding every layer's
    statistics; returns the number of examples used."""

    def on_call(call: AttentionCall) -> None:
        stats.add(call.layer, call.scores(), call.kept(), call.allowed(), pattern_k(call))
        if recall is not None and call.module.pattern.family != "full":
            recall(call)

    inputs = run.data.train_inputs[: options.batches * options.batch_size].to(options.device)
    run.model.eval()
    torch.manual_seed(0)  # paper-mode attention dropout stays on in eval: the same draws every time
    starts = tqdm(range(0, inputs.shape[0], options.batch_size), desc=f"{run.label} seed {run.seed}", unit="batch", leave=False)
    with torch.no_grad(), capture_attention(run.model, on_call):
        for start in starts:
            run.model(inputs[start : start + options.batch_size])
    return int(inputs.shape[0])


def landscape_of(run: LoadedRun, options: AnalyzeOptions) -> Landscape:
    """Cross-entropy on the first ``landscape_samples`` training examples around the trained weights."""
    from sparsefocus.train.loop import evaluate

    inputs = run.data.train_inputs[: options.landscape_samples].to(options.device)
    targets = run.data.train_targets[: options.landscape_samples].to(options.device)

    def loss_fn(model: torch.nn.Module) -> float:
        torch.manual_seed(0)  # paper-mode attention dropout stays on in eval: fix it per point
        return evaluate(model, inputs, targets, options.batch_size)[0]

    return loss_grid(run.model, loss_fn, steps=options.grid, radius=options.radius, seed=options.direction_seed, progress=True)


def chosen_runs(paths: list[Path], options: AnalyzeOptions) -> list[Path]:
    """The run folders of one group to analyse: all (``all_seeds``), the one of ``options.seed``,
    or the smallest seed's (``paths`` are sorted by seed). ValueError naming the seeds there are."""
    if options.all_seeds:
        return paths
    if options.seed is None:
        return paths[:1]
    seeds = [int(read_record(path)["seed"]) for path in paths]
    if options.seed not in seeds:
        label = read_record(paths[0]).get("label", paths[0].name)
        raise ValueError(f"seed {options.seed} has no run of {label}; its seeds: {', '.join(map(str, seeds))}")
    return [paths[seeds.index(options.seed)]]


def analyze_group(
    paths: list[Path], options: AnalyzeOptions, prints: dict[str, str] | None = None
) -> tuple[dict[str, Any], Landscape | None]:
    """Statistics of one mechanism (one seed, or all seeds pooled) and its landscape (the first run
    analysed); ``prints``: the chosen runs' ``checkpoint_prints`` when the caller has them."""
    stats, recall = ScoreStatistics(), RecallStatistics()
    used, seeds, landscape, first = 0, [], None, None
    chosen = chosen_runs(paths, options)
    for path in chosen:
        run = load_run(path, options.device)
        first = first or run
        used += collect(run, options, stats, recall)
        seeds.append(run.seed)
        if options.landscape and landscape is None:
            landscape = landscape_of(run, options)
    result = {
        "label": first.label,
        "task": first.data.name,
        "seeds": seeds,
        "run_dirs": [str(p) for p in chosen],
        "samples_per_seed": used // max(len(seeds), 1),
        "statistics": stats.summary(),
        "recall": recall.summary() if recall.values else None,
        "checkpoints": checkpoint_prints(chosen) if prints is None else prints,
    }
    return result, landscape


def checkpoint_prints(run_dirs: list[Path]) -> dict[str, str]:
    """{run folder: SHA-256 of its checkpoint.pt}: what ``--update`` compares to reuse an entry."""
    prints = {}
    for run_dir in run_dirs:
        digest = hashlib.sha256()
        with open(run_dir / "checkpoint.pt", "rb") as handle:
            for block in iter(lambda: handle.read(1 << 20), b""):
                digest.update(block)
        prints[str(run_dir)] = digest.hexdigest()
    return prints


def earlier_entries(out_dir: Path, options: AnalyzeOptions) -> dict[str, dict[str, Any]]:
    """{setting: {label: entry}} of ``out_dir/analysis.json`` when it was made with the same
    options (``REUSE_IGNORES`` aside); empty when there is none or the options differ."""
    path = out_dir / "analysis.json"
    if not path.exists():
        return {}
    try:
        report = json.loads(path.read_text())
        stored = {key: value for key, value in report["options"].items() if key not in REUSE_IGNORES}
        settings = report["settings"]
    except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as error:
        raise ValueError(f"{path} is not an analysis report ({error}); remove it or drop --update") from None
    current = {key: value for key, value in vars(options).items() if key not in REUSE_IGNORES}
    if stored != current:
        print(f"--update: {path} was made with other options; analysing every mechanism", file=sys.stderr)
        return {}
    return {setting: section.get("mechanisms", {}) for setting, section in settings.items()}


def bound_checks(mechanisms: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bound check of every sparse mechanism against the FULL model's all-key dispersion
    (against its own all-key dispersion when the run has no FULL model). Columns where the
    mechanism's unfloored separation is < 0 are marked ``applies: False``."""
    full = mechanisms.get("FULL")
    out = {}
    for label, result in mechanisms.items():
        if label == "FULL":
            continue
        reference = full["statistics"] if full else result["statistics"]
        try:
            checks = check_columns(columns_from_summaries(reference, result["statistics"]))
        except ValueError as error:
            out[label] = {"error": str(error)}
            continue
        for check, applies in zip(checks, keeps_top_scores(result["statistics"])):
            check["applies"] = applies
        out[label] = {"full_dispersion_from": "FULL" if full else label, "columns": checks}
    return out


def fmt(value: float) -> str:
    """3 significant digits; tiny numbers in scientific notation."""
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "–"
    if value != 0 and abs(value) < 1e-3:
        return f"{value:.0e}"
    return f"{value:.3g}"


def cell(percentiles: dict[str, float]) -> str:
    return "/".join(fmt(v) for v in percentiles.values())


def paper_table(mechanisms: dict[str, dict[str, Any]]) -> list[str]:
    """The paper's table layout: one row per sparse mechanism against the FULL model."""
    full = mechanisms.get("FULL")
    lines = [
        (
            "| mechanism | δ_s: FULL, all keys (p75/p90/p95/max) | δ_h: kept keys (p75/p90/p95/max) "
            "| Δ separation (p25/p10/p5/min) | β sinks (p75/p90/p95/max) | β/k |"
        ),
        "|---|---|---|---|---|---|",
    ]
    for label, result in mechanisms.items():
        if label == "FULL":
            continue
        pooled = result["statistics"]["pooled"]
        full_cell = cell(full["statistics"]["pooled"]["full_dispersion"]) if full else "no FULL run"
        lines.append(
            f"| {label} | {full_cell} | {cell(pooled['dispersion'])} | {cell(pooled['separation'])} "
            f"| {cell(pooled['sinks'])} | {cell(pooled['sink_ratio'])} |"
        )
    return lines


def recall_cell(result: dict[str, Any]) -> str:
    recall = result["recall"]
    if not recall or not recall["pooled"]:
        return "–"
    ks = sorted(set(recall["k"].values()))
    return f"{fmt(recall['pooled']['mean'])} / {fmt(recall['pooled']['p5'])} (k={','.join(map(str, ks))})"


def mechanism_table(mechanisms: dict[str, dict[str, Any]]) -> list[str]:
    """Every mechanism's own statistics, including its dispersion over all keys and its recall."""
    lines = [
        (
            "| mechanism | seeds | δ all keys (p75/p90/p95/max) | δ kept keys | Δ unfloored (p25/p10/p5/min) | β | β/k "
            "| top-k recall mean / p5 |"
        ),
        "|---|---|---|---|---|---|---|---|",
    ]
    for label, result in mechanisms.items():
        pooled = result["statistics"]["pooled"]
        lines.append(
            f"| {label} | {','.join(map(str, result['seeds']))} | {cell(pooled['full_dispersion'])} "
            f"| {cell(pooled['dispersion'])} | {cell(pooled['separation_raw'])} | {cell(pooled['sinks'])} "
            f"| {cell(pooled['sink_ratio'])} | {recall_cell(result)} |"
        )
    return lines


def layer_table(mechanisms: dict[str, dict[str, Any]]) -> list[str]:
    lines = [
        "| mechanism | layer | δ all keys | δ kept keys | Δ unfloored | β | recall mean |",
        "|---|---|---|---|---|---|---|",
    ]
    for label, result in mechanisms.items():
        recall = (result["recall"] or {}).get("per_layer", {})
        for layer, stats in result["statistics"]["per_layer"].items():
            mean = fmt(recall[layer]["mean"]) if layer in recall else "–"
            lines.append(
                f"| {label} | {layer} | {cell(stats['full_dispersion'])} | {cell(stats['dispersion'])} "
                f"| {cell(stats['separation_raw'])} | {cell(stats['sinks'])} | {mean} |"
            )
    return lines


def bound_lines(checks: dict[str, Any]) -> list[str]:
    lines = ["```text"]
    for label, check in checks.items():
        if "error" in check:
            lines.append(f"{label}: not checked ({check['error']})")
        else:
            lines.append(format_bound_report(f"{label} (δ_s from {check['full_dispersion_from']})", check["columns"]))
    return lines + ["```"]


def describe_protocol(result: dict[str, Any], options: dict[str, Any]) -> str:
    return (
        f"Scores s = <q, k>/sqrt(d) of every attention layer on the first {result['samples_per_seed']} "
        f"training examples ({options['batches']} batches of {options['batch_size']}), pooled over layers, "
        f"heads, queries and examples; separation percentiles floored at 1e-9; β = queries keeping a key, "
        f"k = the pattern's k (else the mean number of kept keys)."
    )


def markdown_report(report: dict[str, Any]) -> str:
    """The whole report as Markdown."""
    options = report["options"]
    lines = [f"# Analysis of `{report['run_dir']}`", ""]
    for setting, section in report["settings"].items():
        mechanisms = section["mechanisms"]
        any_result = next(iter(mechanisms.values()))
        lines += [
            f"## Task `{any_result['task']}`" + ("" if setting == "default" else f", setting `{setting}`"),
            "",
            describe_protocol(any_result, options),
            "",
            "### The paper's table",
            "",
            *paper_table(mechanisms),
            "",
            "### Every mechanism",
            "",
            *mechanism_table(mechanisms),
            "",
            "### Bound check (W-form and X-form, per percentile column)",
            "",
            *bound_lines(section["bounds"]),
            "",
            "### Per layer",
            "",
            *layer_table(mechanisms),
            "",
        ]
        lines += [f"![{name}]({name})" for name in section.get("figures", [])]
    return "\n".join(lines).rstrip() + "\n"


def landscape_figures(
    setting: str, landscapes: dict[str, Landscape], out_dir: Path, window: str = "centred"
) -> tuple[list[str], dict]:
    """Contour and Lipschitz PNGs of one setting; returns the file names and the JSON data."""
    suffix = "" if setting == "default" else "-" + "".join(c if c.isalnum() else "_" for c in setting)
    contour, lipschitz = f"landscape{suffix}.png", f"lipschitz{suffix}.png"
    profiles = {label: lipschitz_profile(land, window=window) for label, land in landscapes.items()}
    plot_landscapes(landscapes, str(out_dir / contour))
    plot_lipschitz(profiles, str(out_dir / lipschitz))
    data = {
        label: {"alphas": land.alphas.tolist(), "loss": land.loss.tolist(), "lipschitz": profiles[label]}
        for label, land in landscapes.items()
    }
    return [contour, lipschitz], data


def analyze(run_dir: str | Path, options: AnalyzeOptions, out_dir: str | Path | None = None) -> dict[str, Any]:
    """Analyse every mechanism of a run or experiment folder; write analysis.md / analysis.json
    (and landscape PNGs) to ``out_dir`` (default RUN_DIR/analysis). Returns the JSON report."""
    run_dir = Path(run_dir)
    out_dir = run_dir / "analysis" if out_dir is None else Path(out_dir)
    settings: dict[str, Any] = {}
    landscapes: dict[str, dict[str, Landscape]] = {}
    earlier = earlier_entries(out_dir, options) if options.update else {}
    for (setting, label), paths in group_runs(find_runs(run_dir)).items():
        entry = earlier.get(setting, {}).get(label)
        prints = None if entry is None else checkpoint_prints(chosen_runs(paths, options))
        if entry is not None and entry.get("checkpoints") == prints:
            print(f"--update: {label} ({setting}) unchanged, kept from the earlier analysis", file=sys.stderr)
            settings.setdefault(setting, {"mechanisms": {}})["mechanisms"][label] = entry
            continue
        result, landscape = analyze_group(paths, options, prints)
        settings.setdefault(setting, {"mechanisms": {}})["mechanisms"][label] = result
        if landscape is not None:
            landscapes.setdefault(setting, {})[label] = landscape
    for setting, section in settings.items():
        section["mechanisms"] = dict(sorted(section["mechanisms"].items(), key=lambda item: item[0] != "FULL"))
        section["bounds"] = bound_checks(section["mechanisms"])
        if setting in landscapes:
            ordered = {label: landscapes[setting][label] for label in section["mechanisms"] if label in landscapes[setting]}
            section["figures"], section["landscape"] = landscape_figures(setting, ordered, out_dir, options.lipschitz_window)
    report = {"run_dir": str(run_dir), "options": vars(options), "settings": settings}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "analysis.json", json.dumps(report, indent=1, default=float))
    write_text_atomic(out_dir / "analysis.md", markdown_report(report))
    return report


LANDSCAPE_OPTIONS = {"grid": 11, "radius": 1.0, "landscape_samples": 500}


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="sparsefocus analyze",
        description=(
            "Dispersion, separation, sinks, bound check, top-k recall and (with --landscape) loss\n"
            "landscapes of trained runs; writes analysis.md and analysis.json."
        ),
        epilog="example: sparsefocus analyze runs/demo --landscape --grid 21",
        formatter_class=HelpFormatter,
    )
    parser.add_argument("run_dir", nargs="?", help="a run folder or an experiment folder holding run folders")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/analysis)")
    parser.add_argument("--batches", type=int, default=10, help="training batches fed to each model")
    parser.add_argument("--batch-size", type=int, default=100, help="examples per batch")
    parser.add_argument("--all-seeds", action="store_true", help="pool every seed (default: one seed, see --seed)")
    parser.add_argument(
        "--seed",
        default="smallest",
        help=f"the seed analysed per mechanism: 'smallest' (default), 'paper' ({PAPER_ANALYSIS_SEED}) or a number",
    )
    parser.add_argument(
        "--lipschitz-window",
        choices=LIPSCHITZ_WINDOWS,
        default="centred",
        help="'centred' (closed [-r, r], default) or 'paper' (lgrads.py's half-open window, shifted by one step)",
    )
    parser.add_argument("--landscape", action="store_true", help="also compute loss landscapes and Lipschitz estimates")
    parser.add_argument("--grid", type=int, help="landscape points per axis, with --landscape (default: 11; the paper: 200)")
    parser.add_argument("--radius", type=float, help="landscape half-width, with --landscape (default: 1.0)")
    parser.add_argument("--landscape-samples", type=int, help="training examples per loss, with --landscape (default: 500)")
    parser.add_argument(
        "--summary",
        type=Path,
        help="a report's summary.json written with --reach: also plot each mechanism's learning speed against its dispersion",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where the models run: 'cpu' (default) or 'cuda'; on CUDA runs keep their trained attention implementation",
    )
    parser.add_argument(
        "--update",
        action="store_true",
        help="keep the mechanisms of the output folder's analysis.json whose checkpoints and options are unchanged",
    )
    parser.add_argument("--paper-bounds", action="store_true", help="print the bound check on the paper's own table and exit")
    args = parser.parse_args(argv)
    check_device(args.device, parser)
    if args.update and args.landscape:
        parser.error("--update does not work with --landscape: the landscape figures are drawn from every mechanism at once")
    if not args.paper_bounds and args.run_dir is None:
        parser.error("give RUN_DIR (or --paper-bounds)")
    for name, default in LANDSCAPE_OPTIONS.items():
        if getattr(args, name) is not None and not args.landscape:
            parser.error(f"--{name.replace('_', '-')} only applies with --landscape")
        if getattr(args, name) is None:
            setattr(args, name, default)
    for name in ("batches", "batch_size", "grid", "landscape_samples"):
        if getattr(args, name) < 1 or (name == "grid" and args.grid < 2):
            parser.error(f"--{name.replace('_', '-')} is too small: {getattr(args, name)}")
    args.seed = parse_seed(args.seed, parser)
    if args.radius <= 0:
        parser.error(f"--radius must be > 0, got {args.radius}")
    return args


def check_device(name: str, parser: argparse.ArgumentParser) -> None:
    """``--device``: a CPU or CUDA torch device that exists here, else a one-line parser error."""
    try:
        device = torch.device(name)
    except RuntimeError:
        parser.error(f"--device must be 'cpu' or 'cuda', got {name!r}")
    if device.type not in ("cpu", "cuda"):
        parser.error(f"--device must be 'cpu' or 'cuda', got {name!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        parser.error(f"--device {name}: CUDA is not available here; use --device cpu")


def parse_seed(text: str, parser: argparse.ArgumentParser) -> int | None:
    """``--seed``: 'smallest' -> None, 'paper' -> the paper's seed, else an integer."""
    if text == "smallest":
        return None
    if text == "paper":
        return PAPER_ANALYSIS_SEED
    try:
        return int(text)
    except ValueError:
        parser.error(f"--seed must be 'smallest', 'paper' or an integer, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    """``sparsefocus analyze``: see the module docstring."""
    args = parse_args([] if argv is None else argv)
    if args.paper_bounds:
        print(paper_bound_report())
        return 0
    options = AnalyzeOptions(
        batches=args.batches,
        batch_size=args.batch_size,
        all_seeds=args.all_seeds,
        landscape=args.landscape,
        grid=args.grid,
        radius=args.radius,
        landscape_samples=args.landscape_samples,
        seed=args.seed,
        lipschitz_window=args.lipschitz_window,
        device=args.device,
        update=args.update,
    )
    out_dir = Path(args.out) if args.out else Path(args.run_dir) / "analysis"
    try:
        summary = None if args.summary is None else json.loads(args.summary.read_text())
        if summary is not None:
            check_summary(summary)
        report = analyze(args.run_dir, options, args.out)
        speed = [] if summary is None else speed_files(summary, report, out_dir)
    except (ValueError, OSError, json.JSONDecodeError) as error:
        return fail("sparsefocus analyze", error)
    print((out_dir / "analysis.md").read_text())
    print(f"wrote {out_dir / 'analysis.md'} and {out_dir / 'analysis.json'}")
    for path in speed:
        print(f"wrote {path}")
    return 0


def speed_files(summary: dict[str, Any], report: dict[str, Any], out_dir: Path) -> list[Path]:
    """``speed_dispersion`` files for every setting both the report's summary and the analysis hold."""
    settings = [name for name in report["settings"] if name in summary.get("settings", {})]
    if not settings:
        raise ValueError("the summary and the analysis share no setting: give the summary.json of the analysed experiment")
    return [path for setting in settings for path in write_speed_dispersion(summary, report, out_dir, setting)]
