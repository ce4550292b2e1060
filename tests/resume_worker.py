"""examples/grpo.py's main() in forked children of one process, for tests/test_resume.py:

    python tests/resume_worker.py      # then one JSON job per line on stdin, one JSON result per line on stdout

torch, transformers and swaprl are imported once, here; each job forks a child that runs `grpo.main(argv)` (its
output goes to the job's `log` file). A job may SIGKILL its child right after the child's `kill_after`-th change to
the files under `watch` (an open for writing, a rename or replace, a mkdir, a removal): a real kill at a point the
test chooses, without any hook in the example itself. Every change is recorded in the job's `ops` file as it
happens, with a marker line at each phase the loop enters, so that a first run without a kill lists the points to
kill at. A job may also set a file-size limit (`fsize`, with SIGXFSZ ignored: writes past it fail with EFBIG).

A job: {"argv": [...], "log": PATH, "ops": PATH, "watch": DIR, "kill_after": N | null, "fsize": BYTES | null}.
Its result: {"exit": status | null, "signal": N | null}.
"""

from __future__ import annotations

import builtins
import io
import json
import os
import resource
import shutil
import signal
import sys
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch is imported
EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
sys.path.insert(0, str(EXAMPLES.parent))  # the swaprl under test
sys.path.insert(0, str(EXAMPLES))

import grpo
import transformers  # noqa: F401  (imported by main(); here once, before any fork)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: F401

import swaprl.profile.report  # noqa: F401


def watch_changes(root: Path, ops: Path, kill_after: int | None) -> None:
    """Record every change the process makes under `root` to `ops` (one line each, flushed before it returns), and
    SIGKILL the process right after the `kill_after`-th."""
    log = open(ops, "a", buffering=1)  # noqa: SIM115  (open until the process ends, or is killed)
    count = [0]
    root = os.path.realpath(root)
    real_open = builtins.open

    def under(path) -> str | None:
        if isinstance(path, int):
            return None
        full = os.path.realpath(os.fsdecode(path))
        return os.path.relpath(full, root) if full == root or full.startswith(root + os.sep) else None

    def changed(kind: str, *paths) -> None:
        names = [under(p) for p in paths]
        if all(n is None for n in names):
            return
        count[0] += 1
        log.write(json.dumps([kind, *names]) + "\n")
        if kill_after is not None and count[0] >= kill_after:
            log.close()
            os.kill(os.getpid(), signal.SIGKILL)

    def wrap(fn, kind: str, arity: int = 1):
        def changing(*args, **kwargs):
            result = fn(*args, **kwargs)
            changed(kind, *args[:arity])
            return result
        return changing

    def open_(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        if any(c in mode for c in "wax+"):
            changed(f"open-{mode}", file)
        return f

    builtins.open = io.open = open_
    os.replace = wrap(os.replace, "replace", 2)
    os.rename = wrap(os.rename, "rename", 2)
    os.mkdir = wrap(os.mkdir, "mkdir")
    os.rmdir = wrap(os.rmdir, "rmdir")
    os.unlink = os.remove = wrap(os.unlink, "unlink")
    shutil.rmtree = wrap(shutil.rmtree, "rmtree")
    entered = grpo.entered

    def marked(name, calls):  # the loop's phases, as markers between the changes
        log.write(json.dumps(["phase", name]) + "\n")
        return entered(name, calls)

    grpo.entered = marked


def run(job: dict) -> dict:
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            sys.stdout = io.TextIOWrapper(os.fdopen(1, "wb", closefd=False), line_buffering=True)
            sys.stderr = io.TextIOWrapper(os.fdopen(2, "wb", closefd=False), line_buffering=True)
            if job.get("fsize") is not None:
                signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
                resource.setrlimit(resource.RLIMIT_FSIZE, (job["fsize"], resource.RLIM_INFINITY))
            watch_changes(Path(job["watch"]), Path(job["ops"]), job.get("kill_after"))
            try:
                grpo.main(job["argv"])
                code = 0
            except SystemExit as exc:
                print(f"SystemExit: {exc}", file=sys.stderr)
                code = 2
            except BaseException:  # noqa: BLE001  (told to the test through the exit status and the log)
                import traceback

                traceback.print_exc()
                code = 3
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return {"exit": os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else None,
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None}


if __name__ == "__main__":
    for line in sys.stdin:
        if line.strip():
            print(json.dumps(run(json.loads(line))), flush=True)
