"""What every ``sparsefocus`` subcommand shares: help that shows defaults, one-line errors on stderr."""

from __future__ import annotations

import argparse
import sys


class HelpFormatter(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """Keeps the description's and epilog's line breaks and appends ``(default: ...)`` to options
    that have a default value (not to flags or to options that are off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        if action.default in (None, False, argparse.SUPPRESS) or not action.option_strings:
            return action.help or ""
        return super()._get_help_string(action) or ""


def fail(prog: str, message: object, code: int = 2, kind: str = "error") -> int:
    """Print ``prog: error: message`` to stderr; returns the exit code. ``kind`` replaces "error"
    (e.g. "stopped" for Ctrl-C, which is not an error)."""
    print(f"{prog}: {kind}: {message}", file=sys.stderr)
    return code
