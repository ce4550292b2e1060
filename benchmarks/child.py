"""Run one measurement of a benchmark in a process of its own.

vLLM's sleep-mode allocator allows one engine per process, and an out-of-memory error can leave CUDA unusable in
the process that hit it, so each attempt (a way, a utilization, a depth) gets a fresh interpreter: the benchmark
script itself with `--child SPEC`, where SPEC is a JSON file naming the `result` file the child writes.
"""

from __future__ import annotations

import argparse
import json
import logging
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from collections.abc import Callable
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Child:
    rc: int | str  # the exit status, or "timeout"
    seconds: float
    log: Path  # the child's stdout and stderr
    result: dict | None  # what it wrote, when it exited 0 and wrote it

    def log_lines(self) -> list[str]:
        return self.log.read_text(errors="replace").splitlines()


def run_child(script: str, spec: dict, name: str, run_dir: Path, timeout: float) -> Child:
    """Run `script --child` on `spec` (plus `result`, a path in `run_dir`); spec, result and log are `name.*`."""
    spec = {**spec, "result": str(run_dir / f"{name}.json")}
    spec_path, log_path = run_dir / f"{name}.spec.json", run_dir / f"{name}.log"
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    with open(log_path, "w") as logf:
        try:
            rc: int | str = subprocess.run([sys.executable, script, "--child", str(spec_path)], stdout=logf,
                                           stderr=subprocess.STDOUT, timeout=timeout, check=False).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - t0
    result_path = Path(spec["result"])
    result = json.loads(result_path.read_text()) if rc == 0 and result_path.exists() else None
    return Child(rc, seconds, log_path, result)


def result_or_say_why(script: str, spec: dict, name: str, run_dir: Path, timeout: float) -> dict | None:
    """`run_child`'s result, or None after printing why there is none (the exit status, the log's last lines)."""
    child = run_child(script, spec, name, run_dir, timeout)
    if child.result is None:
        print(f"{name}: failed ({child.rc}); last lines of {child.log}:\n" + "\n".join(child.log_lines()[-30:]))
    return child.result


def start_runs(parser: argparse.ArgumentParser, argv: list[str] | None, run_one: Callable[[str], None], *,
               timeout: float) -> tuple[argparse.Namespace, Path] | None:
    """`start` for a benchmark that runs its measurements in children, with the arguments all of those take: where
    checkpoints are written (--workdir), where results go (--out, default a new temporary directory, created here),
    each child's time limit. Returns (args, the results directory), or None in a child."""
    parser.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"))
    parser.add_argument("--out", default=None, help="directory for the results")
    parser.add_argument("--timeout", type=float, default=timeout)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = start(parser, argv, run_one)
    if args is None:
        return None
    out = Path(args.out or tempfile.mkdtemp())
    out.mkdir(parents=True, exist_ok=True)
    return args, out


def start(parser: argparse.ArgumentParser, argv: list[str] | None,
          run_one: Callable[[str], None]) -> argparse.Namespace | None:
    """Parse the benchmark's command line. In a child (`--child SPEC`) run its one measurement and return None."""
    args = parser.parse_args(argv)
    if args.child:
        run_one(args.child)
        return None
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    return args
