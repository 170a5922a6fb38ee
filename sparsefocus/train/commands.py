"""``sparsefocus train CONFIG [key=value ...] [--budget SECONDS]``: check the config, train every
unfinished run (or as much as fits in the budget), report when everything is finished."""

from __future__ import annotations

import argparse

from sparsefocus.clitools import HelpFormatter, fail
from sparsefocus.train.checkpoint import CheckpointError
from sparsefocus.train.config import load_config, to_yaml
from sparsefocus.train.driver import Budget
from sparsefocus.train.experiment import TrainingInterrupted, check_experiment, plan, progress_line, run_experiment
from sparsefocus.train.report import write_report
from sparsefocus.train.workers import RunLocked

PROG = "sparsefocus train"
EPILOG = """examples:
  sparsefocus train experiments/nnch_parity.yaml
  sparsefocus train experiments/listops.yaml train.epochs=20 'mechanisms=[FULL,TOPK:5]' seeds=[1,2,3]
  sparsefocus train experiments/nnch_even_pairs.yaml model.blocks=2 train.jobs=2 --dry-run
  sparsefocus train experiments/listops.yaml train.num_gpus=1 --ray          (a local Ray)
  sparsefocus train experiments/listops.yaml --ray=auto                      (a running cluster)
  sparsefocus train experiments/listops.yaml train.device=cuda train.batched=true train.batched_mode=fast --budget 540
Values are read as YAML; quote arguments with brackets or parentheses for your shell.
Ctrl-C stops every run at once; the same command resumes from the last checkpoints."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Train mechanisms x seeds x settings of an experiment config (resumes where it stopped).",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    parser.add_argument("config", help="YAML experiment config (see experiments/), or 'defaults' for none")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.blocks=4")
    parser.add_argument("--dry-run", action="store_true", help="check the config, print it and the runs, train nothing")
    parser.add_argument("--no-report", action="store_true", help="do not write report.md and the curves at the end")
    parser.add_argument(
        "--ray",
        nargs="?",
        const="",
        default=None,
        metavar="ADDRESS",
        help="train the runs as Ray tasks (train.num_cpus/num_gpus each), on a local Ray or the cluster at ADDRESS",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop at the first epoch boundary where the next epoch would not fit in SECONDS; run again to continue",
    )
    args = parser.parse_intermixed_args(argv)
    if args.ray and "=" in args.ray and "://" not in args.ray:  # an override that followed a bare --ray
        args.overrides.append(args.ray)
        args.ray = ""
    if args.ray is not None and args.budget is not None:
        parser.error("--budget applies to local training; it cannot be combined with --ray")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        config = load_config(None if args.config == "defaults" else args.config, args.overrides)
        if args.dry_run:
            specs = plan(config, check_experiment(config))
            print(to_yaml(config))
            print(f"{len(specs)} runs:")
            for spec in specs:
                print(f"  {spec.run_dir}")
            return 0
        if args.ray is not None:
            from sparsefocus.train.ray_runner import run_experiment_ray

            root = run_experiment_ray(config, args.ray)
        else:
            budget = Budget(args.budget) if args.budget is not None else None
            root = run_experiment(config, budget=budget)
        summary, complete = progress_line(config)
    except TrainingInterrupted as stop:
        return fail(PROG, stop, 130, kind="stopped")
    except KeyboardInterrupt:
        return fail(PROG, "interrupted before training started", 130, kind="stopped")
    except (ValueError, CheckpointError, RunLocked) as error:
        return fail(PROG, error)
    except OSError as error:
        return fail(PROG, f"{error.strerror}: {error.filename}" if error.filename else error)
    print(f"runs: {root}")
    print(summary)
    if not args.no_report and complete:
        report, pictures = write_report(root)
        print(f"report: {report}")
        for picture in pictures:
            print(f"curves: {picture}")
    return 0
