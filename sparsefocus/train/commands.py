"""``sparsefocus train CONFIG [key=value ...]``: check the config, train every unfinished run, report."""

from __future__ import annotations

import argparse

from sparsefocus.clitools import HelpFormatter, fail
from sparsefocus.train.checkpoint import CheckpointError
from sparsefocus.train.config import load_config, to_yaml
from sparsefocus.train.experiment import TrainingInterrupted, check_experiment, plan, run_experiment
from sparsefocus.train.report import write_report
from sparsefocus.train.workers import RunLocked

PROG = "sparsefocus train"
EPILOG = """examples:
  sparsefocus train experiments/nnch_parity.yaml
  sparsefocus train experiments/listops.yaml train.epochs=20 'mechanisms=[FULL,TOPK:5]' seeds=[1,2,3]
  sparsefocus train experiments/nnch_even_pairs.yaml model.blocks=2 train.jobs=2 --dry-run
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
    return parser.parse_intermixed_args(argv)


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
        root = run_experiment(config)
    except TrainingInterrupted as stop:
        return fail(PROG, stop, 130, kind="stopped")
    except KeyboardInterrupt:
        return fail(PROG, "interrupted before training started", 130, kind="stopped")
    except (ValueError, CheckpointError, RunLocked) as error:
        return fail(PROG, error)
    except OSError as error:
        return fail(PROG, f"{error.strerror}: {error.filename}" if error.filename else error)
    print(f"runs: {root}")
    if not args.no_report:
        report, pictures = write_report(root)
        print(f"report: {report}")
        for picture in pictures:
            print(f"curves: {picture}")
    return 0
