"""A run killed and resumed against the same run never interrupted: does it go on bit for bit, and what does it cost?

    python benchmarks/bench_resume.py --out out/resume_72b_1l --kill-after 3 -- \
        python examples/qwen72b.py --layers 1 --host-memory-gib 70 --bf16-only --save-steps 2 --steps 4
    python benchmarks/bench_resume.py --out /tmp/resume --kill-after 3 -- \
        python examples/grpo.py --preset tiny --engine hf --warmup 0 --save-steps 2 --steps 4    # CPU

The command after `--` is a run of examples/grpo.py or examples/qwen72b.py with `--save-steps` (this script adds
`--out`, and `--resume` to the resume). It runs three times, one after the other, each in its own process group:

1. straight: the whole run, never interrupted. Its checkpoints are removed when it ends (the disk then holds one
   run's checkpoints at a time);
2. killed: the same run, killed with SIGKILL (every process of its group, the engine's too) as soon as metrics.jsonl
   holds `--kill-after` steps, a step past the last checkpoint when `--kill-after` is not a multiple of
   `--save-steps`;
3. resumed: the killed run's --out with `--resume`, to the end.

The killed run's lines must equal the straight run's (the run is reproducible at all: if not, nothing below can be
compared, and the script says so); the resumed run's lines, the steps it did again included, must equal the straight
run's, every figure but the timings, and the resume must have gone on from a checkpoint before the kill. Writes
OUT/resume.json and the three runs' logs and metrics beside the runs' own directories (their profiles and reports);
exits 1 when a line differs. Each run's seconds from its start to its first metrics line are given with the others,
to show what a resume costs beyond the steps themselves (the engine's start is in each of them).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

TIMINGS = ("step_s", "switch_s")  # wall-clock figures: the only ones a resumed step may give differently


def metrics(out: Path) -> list[dict]:
    """metrics.jsonl's whole lines (a line being written when a run was killed is not one)."""
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text(errors="replace").splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return rows


def differing(row: dict, ref: dict | None) -> list[str]:
    """The figures of `row` but the timings that `ref` gives differently (all of them without a `ref`), compared as
    text: equal text is equal bits (a NaN loss equals a NaN loss)."""
    keys = ({*row, *(ref or {})}) - set(TIMINGS)
    return sorted(k for k in keys if ref is None or json.dumps(row.get(k)) != json.dumps(ref.get(k)))


def run(cmd: list[str], out: Path, log: Path, *, kill_after: int | None = None) -> dict:
    """`cmd --out out` in a new process group, output to `log`; with `kill_after`, SIGKILL to the whole group once
    metrics.jsonl holds that many lines. Returns the exit status (or the signal), the wall seconds and the seconds
    to the first metrics line."""
    start, had = time.perf_counter(), len(metrics(out))
    first = None
    with open(log, "w") as f:
        proc = subprocess.Popen([*cmd, "--out", str(out)], stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        killed = False
        try:
            while proc.poll() is None:
                n = len(metrics(out))
                if n > had and first is None:
                    first = time.perf_counter() - start
                if kill_after is not None and n >= kill_after:
                    os.killpg(proc.pid, signal.SIGKILL)
                    killed = True
                    break
                time.sleep(0.02)  # a step of the CPU's tiny model takes a few tenths of a second
        except BaseException:  # a Ctrl-C here does not reach the run's own session: its engine would hold the GPU
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()  # reaped first: a zombie still counts as a member of its group
            gone(proc.pid)
            raise
        proc.wait()
    if killed:
        gone(proc.pid)
    elif first is None and len(metrics(out)) > had:
        first = time.perf_counter() - start
    return {"returncode": proc.returncode, "killed": killed, "wall_s": time.perf_counter() - start,
            "first_line_s": first, "lines": len(metrics(out))}


def gone(pgid: int, timeout: float = 120.0) -> None:
    """Wait until no process of group `pgid` is left (the engine's processes hold device memory until they exit)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            os.killpg(pgid, 0)
        except ProcessLookupError:
            return
        os.killpg(pgid, signal.SIGKILL)
        time.sleep(0.5)
    raise SystemExit(f"processes of group {pgid} still alive {timeout:.0f} s after SIGKILL: kill them, then run again")


def compare(rows: list[dict], reference: list[dict]) -> list[dict]:
    """One entry per step of `rows`: its figures next to the reference's, equal or not."""
    by_step = {r["step"]: r for r in reference}
    out = []
    for r in rows:
        ref = by_step.get(r["step"])
        differs = differing(r, ref)
        out.append({"step": r["step"], "equal": ref is not None and not differs, "differs": differs,
                    "loss": r.get("loss"), "reference_loss": ref and ref.get("loss"),
                    "reward": r.get("reward"), "reference_reward": ref and ref.get("reward")})
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        raise SystemExit("give the run after `--`, e.g. bench_resume.py --out DIR --kill-after 3 -- "
                         "python examples/grpo.py --preset tiny --engine hf --save-steps 2 --steps 4")
    split = argv.index("--")
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the three runs' directories, their logs and resume.json")
    ap.add_argument("--kill-after", type=int, required=True, metavar="N", help="kill the second run after step N")
    args = ap.parse_args(argv[:split])
    cmd = argv[split + 1:]
    if "--save-steps" not in cmd or "--out" in cmd or "--resume" in cmd:
        raise SystemExit("the run after `--` needs --save-steps and neither --out nor --resume (this script gives "
                         "each run its --out, and --resume to the resume)")
    out = Path(args.out)
    if out.exists() and any(out.iterdir()):
        raise SystemExit(f"{out} is not empty: give a new --out, or remove that directory")
    out.mkdir(parents=True, exist_ok=True)
    straight, resumed = out / "straight", out / "resumed"

    runs = {"straight": run(cmd, straight, out / "straight.log")}
    reference = metrics(straight)
    shutil.rmtree(straight / "checkpoints", ignore_errors=True)
    if runs["straight"]["returncode"] != 0 or not reference:
        raise SystemExit(f"the straight run failed (exit {runs['straight']['returncode']}): see {out / 'straight.log'}")
    if args.kill_after >= len(reference):
        raise SystemExit(f"--kill-after {args.kill_after} is not before the run's last step ({len(reference)}): "
                         "give a smaller one")
    runs["killed"] = run(cmd, resumed, out / "killed.log", kill_after=args.kill_after)
    if not runs["killed"]["killed"]:
        raise SystemExit(f"the second run ended before step {args.kill_after} (exit {runs['killed']['returncode']}):"
                         f" see {out / 'killed.log'}")
    before = metrics(resumed)
    if len(before) != args.kill_after:
        raise SystemExit(f"the second run had written {len(before)} steps, not {args.kill_after}, when it was killed: "
                         "its steps are too short to stop after a chosen one; give a longer run")
    runs["resumed"] = run([*cmd, "--resume"], resumed, out / "resumed.log")
    if runs["resumed"]["returncode"] != 0:
        raise SystemExit(f"the resume failed (exit {runs['resumed']['returncode']}): see {out / 'resumed.log'}")
    summary = json.loads((resumed / "metrics.json").read_text())
    after = metrics(resumed)
    resumed_from = summary.get("resumed_from")

    reproducible = compare(before, reference)
    continued = compare(after, reference)
    result = {"benchmark": "resume", "command": cmd, "kill_after": args.kill_after,
              "resumed_from": resumed_from, "runs": runs,
              "reproducible": all(r["equal"] for r in reproducible),
              # a run that started again from nothing would match a reproducible straight run too
              "bit_for_bit": (isinstance(resumed_from, int) and 0 < resumed_from <= args.kill_after and
                              all(r["equal"] for r in continued) and
                              [r["step"] for r in after] == [r["step"] for r in reference]),
              "killed_run": reproducible, "resumed_run": continued}
    (out / "resume.json").write_text(json.dumps(result, indent=1))
    for name, path in (("straight", straight), ("resumed", resumed)):
        if (path / "metrics.jsonl").is_file():
            shutil.copy(path / "metrics.jsonl", out / f"{name}_metrics.jsonl")
    shutil.rmtree(resumed / "checkpoints", ignore_errors=True)

    print(f"{'step':>5} {'straight loss':>16} {'resumed loss':>16} {'straight reward':>16} {'resumed reward':>16}  "
          "equal")
    for r in continued:
        print(f"{r['step']:>5} {r['reference_loss']!s:>16} {r['loss']!s:>16} {r['reference_reward']!s:>16} "
              f"{r['reward']!s:>16}  {r['equal']}")
    for name, r in runs.items():
        print(f"{name}: {r['wall_s']:.1f} s, first line after {r['first_line_s'] or float('nan'):.1f} s, "
              f"{r['lines']} lines")
    if not result["reproducible"]:
        first = next(r for r in reproducible if not r["equal"])
        print(f"the killed run's steps differ from the straight run's, from step {first['step']} on (there: "
              f"{', '.join(first['differs'])}): the run itself is not reproducible, so a resume cannot be compared bit "
              "for bit (see resume.json)")
    print(json.dumps({k: result[k] for k in ("benchmark", "kill_after", "resumed_from", "reproducible",
                                              "bit_for_bit")}))
    return 0 if result["reproducible"] and result["bit_for_bit"] else 1


if __name__ == "__main__":
    sys.exit(main())
