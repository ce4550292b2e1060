"""examples/grpo.py's checkpoints and resumes against an adversarial user: a resume killed at any point of its start,
damaged checkpoints, resumes with other settings, saves that cannot write, runs that fail after attaching.

Real runs on the tiny preset on the CPU. The runs that are killed are forked children of tests/resume_worker.py
(torch and transformers imported once), killed with SIGKILL right after a chosen change to the files under --out.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import zlib
from pathlib import Path

import pytest

import swaprl

TESTS = Path(__file__).resolve().parent
EXAMPLES = TESTS.parent / "examples"
COMMON = ["--engine", "hf", "--warmup", "0"]
RANK0, RANK1 = "__0_0.distcp", "__1_0.distcp"  # torch.distributed.checkpoint's file of each rank's shards


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


class Worker:
    """tests/resume_worker.py: runs grpo.main() in a forked child per job."""

    def __init__(self, root: Path) -> None:
        self.root, self.jobs = root, 0
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.proc = subprocess.Popen([sys.executable, str(TESTS / "resume_worker.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=env)

    def run(self, out: Path, *argv: str, kill_after: int | None = None, fsize: int | None = None) -> dict:
        """grpo.main(argv + --out out); the result has the exit status or signal, the child's output (`log`) and
        the changes it made under `out` (`ops`, with ["phase", name] markers)."""
        self.jobs += 1
        log, ops = self.root / f"job{self.jobs}.log", self.root / f"job{self.jobs}.ops"
        job = {"argv": [*COMMON, "--checkpoint-dir", str(self.root / "ck"), "--out", str(out), *argv],
               "log": str(log), "ops": str(ops), "watch": str(out), "kill_after": kill_after, "fsize": fsize}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise RuntimeError(f"tests/resume_worker.py ended (exit status {self.proc.wait()}); its error is in the "
                               "captured stderr")
        result = json.loads(answer)
        result["log"] = log.read_text() if log.exists() else ""
        result["ops"] = [json.loads(x) for x in ops.read_text().splitlines()] if ops.exists() else []
        return result

    def ok(self, out: Path, *argv: str, **kw) -> dict:
        result = self.run(out, *argv, **kw)
        assert result["exit"] == 0, result["log"][-4000:]
        return result

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def worker(tmp_path_factory):
    w = Worker(tmp_path_factory.mktemp("worker"))
    yield w
    w.close()


@pytest.fixture(scope="module")
def runs(worker, tmp_path_factory):
    """Four steps straight through ("straight"), and the first three of them saved at step 2 ("saved": a run killed
    after its third step's line, so metrics.jsonl has a line past the checkpoint, which a resume does again)."""
    root = tmp_path_factory.mktemp("runs")
    worker.ok(root / "straight", "--steps", "4")
    worker.ok(root / "saved", "--steps", "3", "--save-steps", "2")
    worker.ok(root / "saved1", "--steps", "2", "--save-steps", "1")
    return root


def copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def lines(out: Path) -> list[str]:
    path = out / "metrics.jsonl"
    return path.read_text().splitlines() if path.exists() else []


def figures(out: Path) -> list[tuple[int, float, float]]:
    return [(r["step"], r["loss"], r["reward"]) for r in map(json.loads, lines(out))]


def files(path: Path) -> dict[str, tuple[int, int]]:
    """Every file under `path`: its size and CRC-32."""
    return {str(f.relative_to(path)): (f.stat().st_size, zlib.crc32(f.read_bytes()))
            for f in sorted(path.rglob("*")) if f.is_file()}


# ------------------------------------------------------------------------------------------- 1. killed resumes
def test_a_resume_killed_at_any_point_of_its_start_keeps_every_earlier_line_and_checkpoint(tmp_path, worker, runs):
    """A resume killed right after each change it makes to --out before its first step (each one killed resume
    going on from what the previous one left), then one that runs through: the lines of the steps before the
    checkpoint and the checkpoint itself are as they were after every kill, and the run ends as one that was never
    interrupted, bit for bit."""
    saved, resume = runs / "saved", ["--steps", "4", "--resume"]
    probe = worker.ok(copy(saved, tmp_path / "probe"), *resume)
    start = probe["ops"].index(["phase", "generate"])  # the changes of the resume's start
    assert start >= 2, probe["ops"]
    kept, checkpoint = lines(saved)[:2], files(saved / "checkpoints")
    out = copy(saved, tmp_path / "out")
    for k in range(1, start + 1):
        killed = worker.run(out, *resume, kill_after=k)
        assert killed["signal"] == signal.SIGKILL, killed["log"][-3000:]
        assert lines(out)[:2] == kept, (k, killed["ops"])
        assert files(out / "checkpoints") == checkpoint, (k, killed["ops"])
    worker.ok(out, *resume)
    assert figures(out) == figures(runs / "straight")
    assert len(set(figures(out))) == 4


def test_a_run_killed_at_any_point_of_a_save_resumes_bit_for_bit(tmp_path, worker, runs):
    """Killed right after each change of its first save (the step's line, the rank file, the manifest, the
    renames), then resumed: the earlier lines are as they were, the resume goes on from the checkpoint before or
    the new one, and the run ends as one never interrupted, bit for bit."""
    saved, resume = runs / "saved", ["--steps", "4", "--save-steps", "1", "--resume"]
    ops = worker.ok(copy(saved, tmp_path / "probe"), *resume)["ops"]
    train = ops.index(["phase", "train"])
    after = ops.index(["phase", "generate"], train)  # the first save is between these
    assert ["replace", "checkpoints/.step-00000003.tmp", "checkpoints/step-00000003"] in ops[train:after], ops
    changes = [i for i, op in enumerate(ops) if op[0] != "phase"]
    for k in [k for k, i in enumerate(changes, 1) if train < i < after]:
        out = copy(saved, tmp_path / f"out{k}")
        killed = worker.run(out, *resume, kill_after=k)
        assert killed["signal"] == signal.SIGKILL, killed["log"][-3000:]
        assert lines(out)[:2] == lines(saved)[:2], k
        worker.ok(out, *resume)
        assert json.loads((out / "metrics.json").read_text())["resumed_from"] in (2, 3), k
        assert figures(out) == figures(runs / "straight"), k


def test_a_run_killed_while_it_writes_its_summary_and_report_leaves_none_half_written(tmp_path, worker, runs):
    """Killed right after each change it makes once its last step is done (metrics.json, the report): the
    metrics.json there is whole (this run's or the previous run's), and a report directory is there whole or not
    at all."""
    saved, resume = runs / "saved", ["--steps", "3", "--resume"]
    ops = worker.ok(copy(saved, tmp_path / "probe"), *resume)["ops"]
    last = max(i for i, op in enumerate(ops) if op == ["phase", "train"])
    changes = [i for i, op in enumerate(ops) if op[0] != "phase"]  # the k-th change is ops[changes[k - 1]]
    ends = [k for k, i in enumerate(changes, 1) if i > last]
    assert len(ends) >= 2, ops
    for k in ends:
        out = copy(saved, tmp_path / f"out{k}")
        killed = worker.run(out, *resume, kill_after=k)
        assert killed["signal"] == signal.SIGKILL, killed["log"][-3000:]
        summary = json.loads((out / "metrics.json").read_text())  # whole
        assert summary["steps"], k
        for report in out.glob("report*"):  # (the one being written is .report*.tmp)
            assert {"report.md", "report.html"} <= {f.name for f in report.iterdir()}, (k, report)



def test_an_export_killed_between_its_renames_is_put_back_before_the_next_is_written(tmp_path, monkeypatch):
    """`replace_dir` moves the older directory aside, then renames the new one into its place: killed between the
    two, nothing is at the name and the older one waits beside it. The next call puts it back first, so that a
    failure of its own (a full disk) still leaves the older one there, and a call that succeeds leaves nothing
    beside."""
    import run_files

    target = tmp_path / "export"

    def fill(text):
        return lambda d: (d / "model.safetensors").write_text(text)

    run_files.replace_dir(target, fill("old"))
    real = os.replace

    def killed_at_the_second_rename(src, dst):
        if Path(src).name == ".export.tmp":
            raise KeyboardInterrupt  # what a kill there leaves on disk
        real(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_second_rename)
    with pytest.raises(KeyboardInterrupt):
        run_files.replace_dir(target, fill("new"))
    monkeypatch.setattr(os, "replace", real)
    assert not target.exists() and (tmp_path / ".export.old" / "model.safetensors").read_text() == "old"

    def full_disk(d):
        raise OSError(28, "No space left on device")

    with pytest.raises(OSError):
        run_files.replace_dir(target, full_disk)
    assert (target / "model.safetensors").read_text() == "old"
    run_files.replace_dir(target, fill("new"))
    assert (target / "model.safetensors").read_text() == "new"
    assert [p.name for p in tmp_path.iterdir()] == ["export"]


def test_an_export_that_would_replace_the_runs_own_files_is_refused_before_anything_loads(tmp_path,
                                                                                          tiny_checkpoint):
    """--export-hf DIR is replaced whole at the end (moved aside, then removed): DIR being --out, a directory
    holding it, the model's directory, or a directory of other files would lose the run's checkpoints and metrics,
    the model it trains from, or whatever was there. Each is refused naming the flag, and nothing is touched."""
    import grpo

    out, mine = tmp_path / "runs" / "o", tmp_path / "mine"
    (out / "checkpoints").mkdir(parents=True)
    (out / "metrics.jsonl").write_text('{"step": 0}\n')
    mine.mkdir()
    (mine / "notes.txt").write_text("kept")
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    common = ["--engine", "hf", "--steps", "1", "--out", str(out), "--model", str(tiny_checkpoint)]
    for export, said in ((out, f"is --out {out} or holds it"), (tmp_path / "runs", "is --out .* or holds it"),
                         (tiny_checkpoint, "is the model's directory .* or holds it"),
                         (mine, "holds files that are no model's \\(notes.txt\\)")):
        with pytest.raises(SystemExit, match=f"--export-hf {export} {said}"):
            grpo.main([*common, "--export-hf", str(export)])
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before

def test_a_metrics_line_damaged_on_disk_is_skipped_like_a_cut_one(tmp_path, caplog):
    """metrics.jsonl with bytes that are not UTF-8 (a damaged block), a cut line and a line of NULs: a resume keeps
    the intact lines of the steps before it and names the one it lacks, where it read none of the file before."""
    import grpo

    path = tmp_path / "metrics.jsonl"
    good = [json.dumps({"step": k, "loss": 0.5}) for k in range(3)]
    path.write_bytes(b"\n".join([good[0].encode(), b'{"step": 1, "loss": "\xe9\xff"}', good[2].encode(), b"\0" * 16,
                                  b'{"step": 3, "lo']))
    assert grpo.lines_before(path, 3) == [good[0], good[2]]
    assert "lacks the lines of steps [1]" in caplog.text

# ------------------------------------------------------------------------------------------- 2. damaged checkpoints
def flip_a_bit(f: Path) -> None:
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x10
    f.write_bytes(bytes(data))


DAMAGE = {
    "a flipped bit": (flip_a_bit, "checksum"),
    "truncated": (lambda f: f.write_bytes(f.read_bytes()[:-1000]), "bytes"),
    "empty": (lambda f: f.write_bytes(b""), "0 bytes"),
    "a foreign file": (lambda f: f.write_text('{"not": "a checkpoint"}'), "bytes"),
    "a missing rank file": (lambda f: f.unlink(), "missing"),
}


@pytest.mark.parametrize("damage", DAMAGE, ids=list(DAMAGE))
def test_a_damaged_newest_checkpoint_is_named_and_the_run_resumes_from_an_intact_one(tmp_path, worker, runs, damage):
    """The newest checkpoint's rank file damaged after it was written: the resume names the file and what is wrong
    with it, goes on from the checkpoint before, and trains as the run that was never damaged, bit for bit."""
    out = copy(runs / "saved1", tmp_path / "out")  # checkpoints at steps 1 and 2
    spoil, why = DAMAGE[damage]
    spoil(out / "checkpoints" / "step-00000002" / RANK0)
    resumed = worker.ok(out, "--steps", "4", "--resume")
    warning = next((x for x in resumed["log"].splitlines() if "step-00000002" in x and RANK0 in x), "")
    assert why in warning and "resuming from step-00000001" in resumed["log"], resumed["log"][-3000:]
    assert json.loads((out / "metrics.json").read_text())["resumed_from"] == 1
    assert figures(out) == figures(runs / "straight")


def test_a_resume_with_no_intact_checkpoint_says_what_is_wrong_with_each(tmp_path, worker, runs):
    out = copy(runs / "saved1", tmp_path / "out")
    flip_a_bit(out / "checkpoints" / "step-00000002" / RANK0)
    (out / "checkpoints" / "step-00000001" / RANK0).write_bytes(b"")
    before = files(out / "checkpoints")
    refused = worker.run(out, "--steps", "4", "--resume")
    assert refused["exit"] == 2, refused["log"][-3000:]
    said = refused["log"].split("SystemExit: ", 1)[-1]
    assert "no intact checkpoint" in said and f"step-00000002/{RANK0}" in said and "checksum" in said, said
    assert f"step-00000001/{RANK0}" in said and "0 bytes" in said, said
    assert files(out / "checkpoints") == before  # nothing was deleted or moved


def test_a_checkpoint_without_a_manifest_is_refused_with_its_format(tmp_path, worker, runs):
    """A checkpoint of the format before manifests (or one that lost it) is not resumed from blindly."""
    out = copy(runs / "saved1", tmp_path / "out")
    for manifest in (out / "checkpoints").glob("step-*/manifest.json"):
        manifest.unlink()
    refused = worker.run(out, "--steps", "4", "--resume")
    assert refused["exit"] == 2, refused["log"][-3000:]
    assert "no manifest.json" in refused["log"] and "format" in refused["log"], refused["log"][-3000:]


def test_a_checkpoint_of_format_2_is_refused_naming_its_format(tmp_path, worker, runs):
    """A checkpoint of torch.save files per rank (format 2, before torch.distributed.checkpoint) is named as such,
    with the way on; nothing is deleted."""
    out = copy(runs / "saved1", tmp_path / "out")
    for manifest in (out / "checkpoints").glob("step-*/manifest.json"):
        manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "format": 2}))
    before = files(out / "checkpoints")
    refused = worker.run(out, "--steps", "4", "--resume")
    assert refused["exit"] == 2, refused["log"][-3000:]
    said = refused["log"].split("SystemExit: ", 1)[-1]
    assert "checkpoint format 2 (a torch.save file per rank, rank*.pt)" in said, said
    assert "resume them with the grpo.py that wrote them" in said, said
    assert files(out / "checkpoints") == before


def one_rank_file(d: Path) -> list[Path]:
    """A serializer for run_files.Checkpoints alone: one small file of rank 0's."""
    (d / "rank0.pt").write_bytes(b"state")
    return [d / "rank0.pt"]


@pytest.mark.parametrize("junk", [{"step": 2.0}, {"step": True}, {"meta": [1]}, {"files": [{"name": None}]},
                                  {"files": [{"name": 5}]}], ids=str)
def test_a_manifest_of_junk_types_is_named_unreadable_and_the_one_before_resumed(tmp_path, junk):
    """A manifest whose step is no integer (a resume counts from it), whose files' names are no strings, or whose
    meta is no object: the checkpoint is named unreadable and the one before resumed, never a raw TypeError or
    AttributeError out of the resume."""
    import run_files

    root = tmp_path / "checkpoints"
    checkpoints = run_files.Checkpoints(root, rank=0, world=1)

    for step in (1, 2):
        checkpoints.save(step, one_rank_file, meta={"settings": {}})
    listed = root / "step-00000002" / run_files.MANIFEST
    manifest = json.loads(listed.read_text())
    if "files" in junk:
        manifest["files"][0].update(junk["files"][0])
    else:
        manifest.update(junk)
    listed.write_text(json.dumps(manifest))
    assert "unreadable (TypeError: " in " ".join(checkpoints.problems(root / "step-00000002"))
    assert checkpoints.newest_intact().path.name == "step-00000001"

def test_a_manifest_whose_settings_are_no_object_refuses_the_resume_naming_the_settings():
    """The manifest's checks pass (its meta is an object) but its settings are not grpo.py's record: nothing can be
    compared, so the resume is refused as one of other settings, not with an AttributeError."""
    import grpo

    args = grpo.build_parser().parse_args(["--engine", "hf", "--steps", "3"])
    grpo.resolve_precision(args)
    with pytest.raises(SystemExit, match=r"other settings \(--model '\(not used\)' -> None; .*resume with its"):
        grpo.check_resumable({"step": 2, "meta": {"settings": [1]}}, grpo.computation(args), args)

def test_under_torchrun_a_damaged_file_of_one_rank_sends_every_rank_to_the_checkpoint_before(tmp_path):
    """Two CPU ranks (FSDP2 over gloo): a flipped bit in rank 1's file of the newest checkpoint, which only rank 1
    checksums, is learned by both ranks, which resume together from the checkpoint before: step 1 done again is
    the step 1 of the first run, bit for bit."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    out = tmp_path / "o"

    def run(*extra: str) -> subprocess.CompletedProcess:
        proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                               str(EXAMPLES / "grpo.py"), *COMMON, "--out", str(out), "--checkpoint-dir",
                               str(tmp_path / "ck"), *extra], env=env, capture_output=True, text=True, timeout=300,
                              check=False)
        assert proc.returncode == 0, proc.stderr[-4000:]
        return proc

    run("--steps", "2", "--save-steps", "1")
    first = figures(out)
    flip_a_bit(out / "checkpoints" / "step-00000002" / RANK1)
    resumed = run("--steps", "3", "--resume")
    assert f"step-00000002/{RANK1}: checksum" in resumed.stderr and "resuming from step-00000001" in resumed.stderr
    assert json.loads((out / "metrics.json").read_text())["resumed_from"] == 1
    assert figures(out)[:2] == first and len(figures(out)) == 3


def test_after_resuming_past_a_damaged_checkpoint_the_next_save_sets_it_aside(tmp_path, worker, runs):
    """The damaged checkpoint is kept for a look, under a name no resume takes; the run saves that step anew."""
    out = copy(runs / "saved1", tmp_path / "out")
    flip_a_bit(out / "checkpoints" / "step-00000002" / RANK0)
    worker.ok(out, "--steps", "3", "--save-steps", "1", "--resume")
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step-00000002", "step-00000002.damaged", "step-00000003"], names
    resumed = worker.ok(out, "--steps", "4", "--resume")
    assert "step-00000002.damaged" not in resumed["log"] and "damaged" not in resumed["log"].lower()
    assert figures(out) == figures(runs / "straight")


# ------------------------------------------------------------------------------------------- 3. every run's profile
def test_every_run_keeps_its_own_profile_and_report(tmp_path, worker, runs):
    """Two resumes from the same checkpoint (the first wrote none): each has a profile and a report of its own, and
    metrics.json names the one of the run it sums up."""
    out = copy(runs / "saved", tmp_path / "out")
    first = worker.ok(out, "--steps", "3", "--resume")
    profiles = {p.name: p.read_bytes() for p in out.glob("profile*.jsonl")}
    reports = {p.name: files(p) for p in out.glob("report*")}
    named = json.loads((out / "metrics.json").read_text())["profiles"][0]
    assert named in profiles and named != "profile.jsonl", (named, sorted(profiles), first["log"][-2000:])
    worker.ok(out, "--steps", "3", "--resume")
    again = json.loads((out / "metrics.json").read_text())["profiles"][0]
    assert again not in profiles, (again, sorted(profiles))
    assert {p.name: p.read_bytes() for p in out.glob("profile*.jsonl") if p.name in profiles} == profiles
    assert {p.name: files(p) for p in out.glob("report*") if p.name in reports} == reports
    assert len(list(out.glob("report*"))) == len(reports) + 1


# ------------------------------------------------------------------------------------------- 4. settings
CHANGES = [("--prompt-tokens", "8", "16"), ("--clip", "0.3", "0.2"), ("--tis-cap", "3", "2.0"),
           ("--updates", "2", "1"), ("--micro-batch", "4", "8"), ("--max-tokens", "8", "16"), ("--lr", "1e-4", "1e-05"),
           ("--kl-coef", "0.1", "0.0"), ("--seed", "1", "0"), ("--prompts", "3", "2"), ("--completions", "3", "4"),
           ("--task", "arithmetic", "'even-tokens'"), ("--dtype", "bfloat16", "'float32'"), ("--layers", "1", "None"),
           ("--engine", "vllm", "'hf'")]


@pytest.fixture(scope="module")
def even_tokens(worker, tmp_path_factory):
    """A run of --task even-tokens (where --prompt-tokens is the prompts' length) saved at step 1."""
    out = tmp_path_factory.mktemp("even") / "o"
    worker.ok(out, "--steps", "1", "--save-steps", "1", "--task", "even-tokens")
    return out


@pytest.mark.parametrize("flag, value, saved", CHANGES, ids=[c[0] for c in CHANGES])
def test_a_resume_refuses_any_setting_that_changes_what_it_computes(tmp_path, even_tokens, flag, value, saved):
    import grpo

    out = copy(even_tokens, tmp_path / "o")
    before = files(out)
    with pytest.raises(SystemExit) as refused:
        grpo.main([*COMMON, "--task", "even-tokens", "--steps", "2", "--resume", "--out", str(out),
                   "--checkpoint-dir", str(tmp_path / "ck"), flag, value])
    said = str(refused.value)
    assert f"{flag} {saved} -> " in said and "resume with its settings" in said, said
    assert files(out) == before


def test_a_resume_refuses_to_turn_deterministic_kernels_on_or_off(tmp_path, even_tokens, monkeypatch):
    """--deterministic changes the kernels, so a resume keeps it as saved; off, it is not recorded at all (the
    checkpoints of runs from before the flag existed resume as they were)."""
    import grpo

    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what the flag sets, put back after the test
    out = copy(even_tokens, tmp_path / "o")
    assert "deterministic" not in json.loads((next((out / "checkpoints").iterdir()) / "manifest.json").read_text()
                                             )["meta"]["settings"]
    with pytest.raises(SystemExit, match=r"--deterministic '\(not used\)' -> True\); resume with its settings"):
        grpo.main([*COMMON, "--task", "even-tokens", "--steps", "2", "--resume", "--out", str(out),
                   "--checkpoint-dir", str(tmp_path / "ck"), "--deterministic"])


def test_a_resume_may_change_what_does_not_change_the_computation(tmp_path, worker, runs):
    """--steps, --save-steps, --warmup, --report-to, the checks and where the optimizer states live: the resumed
    run trains as the straight one, bit for bit."""
    out = copy(runs / "saved", tmp_path / "out")
    worker.ok(out, "--steps", "4", "--resume", "--save-steps", "1", "--warmup", "1", "--report-to", "tensorboard",
              "--no-verify", "--optimizer-states", "host", "--sleep-level", "1")
    assert figures(out) == figures(runs / "straight")


def test_every_flag_is_either_kept_by_a_resume_or_free_to_change():
    """A new flag of grpo.py must say which it is (COMPUTATION or FREE), or a resume would let it change silently."""
    import grpo

    dests = {a.dest for a in grpo.build_parser()._actions if a.dest != "help"}
    assert set(grpo.COMPUTATION).isdisjoint(grpo.FREE)
    assert dests == set(grpo.COMPUTATION) | set(grpo.FREE), dests ^ (set(grpo.COMPUTATION) | set(grpo.FREE))


# ------------------------------------------------------------------------------------------- 5. saves that fail
def test_a_save_past_the_file_size_limit_names_the_path_and_the_cause(tmp_path, worker, runs):
    """Under a file-size limit (RLIMIT_FSIZE, SIGXFSZ ignored) the checkpoint cannot be written: the error names
    the file, the limit and the fix; the half-written checkpoint is gone and the earlier ones are as they were."""
    out = copy(runs / "saved1", tmp_path / "out")
    before = files(out / "checkpoints")
    failed = worker.run(out, "--steps", "4", "--save-steps", "1", "--resume", fsize=1 << 20)
    assert failed["exit"] == 2, failed["log"][-3000:]
    said = failed["log"].split("SystemExit: ", 1)[-1]
    assert str(out / "checkpoints") in said and RANK0 in said, said
    assert "file-size limit" in said and "EFBIG" in said and "ulimit -f" in said, said
    assert files(out / "checkpoints") == before
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000001", "step-00000002"]


def test_a_save_that_fails_for_want_of_room_or_rights_says_so(tmp_path):
    """The checkpoint layer under any serializer: a writer that fails with ENOSPC or EACCES gets an error naming the
    path, the cause and the fix; its temporary directory is removed and the earlier checkpoint kept."""
    import errno

    import run_files

    root = tmp_path / "checkpoints"
    checkpoints = run_files.Checkpoints(root, rank=0, world=1)

    checkpoints.save(1, one_rank_file)
    for code, cause, fix in ((errno.ENOSPC, "disk full", "free space"), (errno.EACCES, "permission", "writable")):
        def bad(d: Path, code=code) -> list[Path]:
            (d / "rank0.pt").write_bytes(b"sta")
            raise OSError(code, os.strerror(code), str(d / "rank0.pt"))

        with pytest.raises(run_files.CheckpointError) as failed:
            checkpoints.save(2, bad)
        said = str(failed.value)
        assert str(root / ".step-00000002.tmp" / "rank0.pt") in said and cause in said and fix in said, said
        assert sorted(p.name for p in root.iterdir()) == ["step-00000001"]
    assert checkpoints.newest_intact()[0].name == "step-00000001"



def test_the_next_save_removes_what_killed_saves_left_of_any_step(tmp_path):
    """A save killed before its rename leaves its temporary directory (up to a whole checkpoint of the disk); a
    resume goes on from an earlier step, so the next save may be of another step: it removes them all."""
    import run_files

    root = tmp_path / "checkpoints"
    checkpoints = run_files.Checkpoints(root, rank=0, world=1)

    checkpoints.save(2, one_rank_file)
    for killed in (".step-00000004.tmp", ".step-00000006.tmp"):
        (root / killed).mkdir()
        (root / killed / "rank0.pt").write_bytes(b"half")
    checkpoints.save(3, one_rank_file)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000002", "step-00000003"]

# ------------------------------------------------------------------------------------------- 6. nothing left attached
def test_a_run_that_fails_after_attaching_leaves_nothing_attached(tmp_path, monkeypatch):
    """main() whose profile cannot be opened (a full disk): the error comes out, the runtime is detached, and the
    same process can run again."""
    import grpo

    def no_profile(rt, path, **kw):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(grpo, "attach_profiler", no_profile)
    with pytest.raises(OSError, match="No space left"):
        grpo.main([*COMMON, "--steps", "1", "--out", str(tmp_path / "o"), "--checkpoint-dir", str(tmp_path / "ck")])
    with pytest.raises(swaprl.PhaseError, match="no swaprl runtime is attached"):
        swaprl.current()
    monkeypatch.undo()
    grpo.main([*COMMON, "--steps", "1", "--out", str(tmp_path / "o2"), "--checkpoint-dir", str(tmp_path / "ck")])
