"""The `swaprl` command line: `swaprl report RUN.jsonl -o DIR`, `swaprl plan ...`, `swaprl --version`.

    python -m swaprl report run.jsonl -o report/
    python -m swaprl plan --help

Each subcommand lives in its own module with `add_arguments(parser)` and `run(args) -> int`; only the module of
the subcommand being run is imported, so `swaprl report` never imports the planner and `swaprl -h` imports neither.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

from ._version import __version__

_COMMANDS = {
    "report": ("swaprl.profile.report", "HTML and Markdown report from memory profiles (JSON Lines, one per rank)"),
    "plan": ("swaprl.plan", "does an online-RL step fit a cluster, and under which swap settings"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="swaprl", description="swaprl command line tools")
    parser.add_argument("--version", action="version", version=f"swaprl {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module, help_text) in _COMMANDS.items():
        cmd = sub.add_parser(name, help=help_text, description=help_text)
        if argv[:1] == [name]:
            mod = importlib.import_module(module)
            mod.add_arguments(cmd)
            cmd.set_defaults(run=mod.run)
    args = parser.parse_args(argv)
    return quiet_on_closed_pipe(lambda: args.run(args))


def quiet_on_closed_pipe(run) -> int:
    """`run()`, ending quietly when the reader closes stdout early (`swaprl plan ... --json | head`) instead of with a
    BrokenPipeError traceback; the rest of the output goes nowhere, as for any Unix tool."""
    try:
        rc = run()
        sys.stdout.flush()
        return rc
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # the flush at exit fails no more
        return 0


if __name__ == "__main__":
    sys.exit(main())
