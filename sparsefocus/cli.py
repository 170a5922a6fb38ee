"""The ``sparsefocus`` command: demo, train, report, fidelity, bench, analyze, patterns, corpus, list.

Each subcommand hands its remaining arguments to the ``main(argv)`` of the module that owns it,
imported only when used, so the core never imports ``analysis`` or ``bench``.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("sparsefocus.train.demo", "train FULL, TOPK:5, BAND:5(1), BLOC:5(1) over seeds on a small task and report"),
    "train": ("sparsefocus.train.commands", "train an experiment: sparsefocus train CONFIG [key=value ...]"),
    "report": ("sparsefocus.train.report", "write the curves and the table of a run folder: sparsefocus report RUN_DIR"),
    "fidelity": (
        "sparsefocus.train.fidelity",
        "do CHOSEN's curves stay within REFERENCE's seed spread: sparsefocus fidelity REFERENCE CHOSEN",
    ),
    "bench": (
        "sparsefocus.bench.run",
        "time patterns against the fastest SDPA backend and Flex; --model: a Decoder training step",
    ),
    "analyze": ("sparsefocus.analysis.commands", "dispersion, separation, sinks, landscape, recall of a trained run"),
    "patterns": ("sparsefocus.analysis.pictures", "draw the selection masks of patterns"),
    "corpus": ("sparsefocus.tasks.corpus", "fetch, verify and cache the Brown corpus: sparsefocus corpus fetch|status"),
    "list": ("sparsefocus.attention.catalogue", "list every registered pattern with its parameters and cost"),
}


def usage() -> str:
    lines = ["usage: sparsefocus [--version] COMMAND [args]", "", "commands:"]
    lines += [f"  {name:<9} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += ["", "sparsefocus COMMAND --help shows the options of a command (with their defaults)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if argv[0] in ("-V", "--version"):
        print(f"sparsefocus {version()}")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        print(f"sparsefocus: error: unknown command {command!r}; one of: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(COMMANDS[command][0])
        return int(module.main(rest) or 0)
    except KeyboardInterrupt:
        print(f"sparsefocus {command}: interrupted", file=sys.stderr)
        return 130


def version() -> str:
    """The installed distribution's version, else the package's own (a source checkout)."""
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed_version

    try:
        return installed_version("sparsefocus")
    except PackageNotFoundError:
        from sparsefocus import __version__

        return __version__


if __name__ == "__main__":
    sys.exit(main())
