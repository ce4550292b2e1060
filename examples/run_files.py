"""The files a run leaves under --out, written so that neither a kill at any point, nor a full disk, nor a damaged
file passes for a good one: examples/grpo.py's checkpoints and the files it rewrites.

- `replace_file` and `replace_dir` write a file or a directory whole, beside its final name, and rename it there:
  a process killed at any point leaves the old one or the new one, never a cut one (a directory killed between
  its two renames waits beside its name, and the next `replace_dir` puts it back first); fsynced before the
  rename, so that a machine losing power does not leave a renamed empty file either.
- `Checkpoints`: one directory per step, written under a temporary name and renamed once every rank's files and the
  manifest are on disk. The manifest lists each file with its size and CRC-32; a resume checks them before it reads
  anything, and goes on from the newest checkpoint that is intact, saying what is wrong with each newer one.

The checkpoint layer does not know the serializer: `save(step, write)` hands `write` a directory to put this rank's
files in, and checks and lists what it returns. examples/grpo.py writes torch.distributed.checkpoint's files
(`swaprl.saving`), which a run of another number of ranks resumes: the checkpoint's directory is then one every
rank reads (a shared file system), and a resume on N ranks has rank r checksum the files of the ranks r, r + N, ...
that wrote them.

Why CRC-32 (zlib.crc32, streamed): the checksum is for damage, not for an attacker. CRC-32 detects every single
flipped bit and every burst of up to 32 bits for certain (a cryptographic hash only with high probability), and it
runs at 1.7 GB/s here against blake2b's 0.46 GB/s and sha256's 0.82 GB/s (zlib 1.2.13, one core), so checking a
large model's shards costs seconds, not minutes. The sizes, also in the manifest, name a cut-off file directly.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import logging
import os
import re
import resource
import shutil
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, NamedTuple

log = logging.getLogger(__name__)

FORMAT = 3
"""The checkpoint format: 1, grpo.py before manifests (rank files alone); 2, a manifest.json of the files' sizes and
CRC-32 and the settings that change the computation, over a torch.save file per rank (rank*.pt), resumed on the
same number of ranks only; 3, the same manifest over torch.distributed.checkpoint's files (`swaprl.saving`), resumed
on any number. This one resumes format 3 only."""
MANIFEST = "manifest.json"
STEP = re.compile(r"step-(\d{8})")
READ_BYTES = 16 * 2**20
OLD_FORMAT = (f"no {MANIFEST}: written by a grpo.py of checkpoint format 1 (before manifests), or its manifest was "
              f"lost; this one resumes format {FORMAT} only")
FORMAT_2 = (f"checkpoint format 2 (a torch.save file per rank, rank*.pt); this grpo.py resumes format {FORMAT} "
            "(torch.distributed.checkpoint's files, on any number of ranks) only")
NOT_COMPLETED = (f"no {MANIFEST}: its save never completed, or its manifest was lost; a checkpoint of format "
                 f"{FORMAT} is resumed only with its manifest")


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or resumed from; the message names the path, the cause and the fix."""


class Intact(NamedTuple):
    """A checkpoint that passed every check, and its manifest (its step, its files, the caller's `meta`)."""

    path: Path
    manifest: dict


# ------------------------------------------------------------------------------------------- whole-file writes
def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable (the directory's own entry)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: Path, data: str | bytes) -> None:
    """Write `path` whole: into `.NAME.tmp` beside it, fsynced, then renamed over it."""
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data.encode() if isinstance(data, str) else data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def replace_dir(path: Path, fill: Callable[[Path], object]) -> None:
    """Fill a directory in `.NAME.tmp` beside `path` with `fill(dir)`, then rename it to `path` (an older one of that
    name is moved aside first and removed after). A run killed between the two renames left the older one aside,
    with nothing at `path`: it is put back first, so that this call failing in turn still leaves it there."""
    tmp, old = path.with_name(f".{path.name}.tmp"), path.with_name(f".{path.name}.old")
    if old.exists() and not path.exists():
        os.replace(old, path)
    for stale in (tmp, old):  # a run killed while it wrote, or after the second rename
        if stale.exists():
            shutil.rmtree(stale)
    tmp.mkdir()
    fill(tmp)
    if path.exists():
        os.replace(path, old)
    os.replace(tmp, path)
    fsync_dir(path.parent)
    if old.exists():
        shutil.rmtree(old)


def append_line(path: Path, line: str) -> None:
    """One line at the end of `path` (a kill can cut only this line, the last; a reader skips it)."""
    with open(path, "a", encoding="utf-8") as f:
        f.write(line + "\n")


def fsync_file(path: Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def write_with(path: Path, save: Callable[[BinaryIO], object]) -> Path:
    """`save(file)` into `path` opened here, for serializers that take a file object (torch.save): its writes then
    go through Python and fail with the OSError's errno (torch's own file writer says only "unexpected pos")."""
    try:
        with open(path, "wb") as f:
            save(f)
            f.flush()
    except Exception as exc:
        cause = _os_error(exc)
        if cause is not None and cause.errno is not None:
            raise OSError(cause.errno, cause.strerror, str(path)) from exc
        raise
    return path


# ------------------------------------------------------------------------------------------- checkpoints
def crc32(path: Path) -> int:
    value = 0
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            value = zlib.crc32(chunk, value)
    return value


class Checkpoints:
    """Checkpoints under `root`, one directory per step (`step-00000004/`: files from each of `world` ranks and a
    manifest), the newest `keep` kept. Every rank makes the same calls; under torch.distributed they agree through
    collectives (all_gather_object), so a failure on one rank is raised on all, with its message."""

    def __init__(self, root: Path, *, rank: int = 0, world: int = 1, keep: int = 2) -> None:
        self.root, self.rank, self.world, self.keep = Path(root), rank, world, keep
        self._damaged: list[Path] = []  # newer than the one resumed from: set aside by the first save

    def steps(self) -> list[Path]:
        """Every checkpoint directory, the oldest first (intact or not: `newest_intact` checks)."""
        if not self.root.is_dir():
            return []
        return sorted(p for p in self.root.iterdir() if STEP.fullmatch(p.name) and p.is_dir())

    def newest(self) -> Path | None:
        found = self.steps()
        return found[-1] if found else None

    def problems(self, path: Path) -> list[str]:
        """What is wrong with the checkpoint at `path`, as far as this rank checks it (every file's presence and
        size, the checksums of the files it is given: those of the ranks that wrote them, rank r of N checking
        the files of ranks r, r + N, ...); [] when intact."""
        listed = path / MANIFEST
        if not listed.is_file():
            if any(path.glob("rank*.pt")):
                return [f"{path}: {OLD_FORMAT}"]
            if any(path.glob("*.distcp")):
                return [f"{path}: {NOT_COMPLETED}"]
            return [f"{path}: no {MANIFEST} (a checkpoint never completed, or not one)"]
        try:
            manifest = json.loads(listed.read_text())
            version, step = manifest["format"], manifest["step"]
            files = [(e["name"], int(e["rank"]), int(e["bytes"]), int(e["crc32"], 16)) for e in manifest["files"]]
            if type(step) is not int or not isinstance(manifest.get("meta", {}), dict) or \
                    not all(isinstance(name, str) for name, *_ in files):  # (a resume counts from the step)
                raise TypeError("its step is not an integer, a file's name not a string, or its meta not an object")
        except (OSError, ValueError, KeyError, TypeError) as exc:
            return [f"{listed}: unreadable ({type(exc).__name__}: {exc})"]
        if version == 2:
            return [f"{path}: {FORMAT_2}"]
        if version != FORMAT:
            return [f"{path}: checkpoint format {version}; this grpo.py resumes format {FORMAT}"]
        if step != int(STEP.fullmatch(path.name).group(1)):
            return [f"{listed}: the manifest is of step {step}, not of its directory's"]
        found = []
        for name, rank, size, checksum in files:
            f = path / name
            if not f.is_file():
                found.append(f"{f}: missing (the manifest lists it, {size} bytes from rank {rank})")
            elif (actual := f.stat().st_size) != size:
                found.append(f"{f}: {actual} bytes, the manifest says {size} (cut short, or another file put in "
                             "its place)")
            elif rank % self.world == self.rank and (value := crc32(f)) != checksum:
                found.append(f"{f}: checksum crc32 {value:08x}, the manifest says {checksum:08x} (changed since "
                             "it was written: a flipped bit, or another file of the same size put in its place)")
        return found

    def newest_intact(self) -> Intact:
        """The newest checkpoint every rank finds intact, with its manifest; each newer one is named in a warning
        with what is wrong with it (and set aside by the next save). Raises CheckpointError when none is."""
        seen = []
        for path in reversed(self.steps()):
            found = self._gathered(self.problems(path))
            if not found:
                if seen and self.rank == 0:
                    log.warning("--resume: resuming from %s, the newest intact checkpoint", path.name)
                self._damaged = [p for p, _ in seen]
                return Intact(path, json.loads((path / MANIFEST).read_text()))
            if self.rank == 0:
                log.warning("--resume: checkpoint %s is damaged, skipped (the next save sets it aside as %s.damaged): "
                            "%s", path.name, path.name, "; ".join(found))
            seen.append((path, found))
        if not seen:
            raise CheckpointError(f"--resume: no complete checkpoint under {self.root}; run with --save-steps N "
                                  "first, or drop --resume to start over")
        problems = [p for _, found in seen for p in found]
        fix = ("resume them with the grpo.py that wrote them" if all(p.endswith((OLD_FORMAT, FORMAT_2))
                                                                        for p in problems)
               else "put the damaged files back from a copy")
        raise CheckpointError(f"--resume: no intact checkpoint under {self.root}: {'; '.join(problems)}. To go on, "
                              f"{fix}, or start a new run with another --out (nothing was deleted)")

    def save(self, step: int, write: Callable[[Path], list[Path]], *, meta: dict | None = None) -> Path:
        """Checkpoint `step`: `write(dir)` puts this rank's files in a temporary directory and returns them; once
        every rank's are on disk, rank 0 writes the manifest, renames the directory to `step-NNNNNNNN` and removes
        the oldest beyond `keep`. A failure on any rank removes the temporary directory, leaves the earlier
        checkpoints as they were, and raises CheckpointError naming the file, the cause and the fix."""
        final, tmp = self.root / f"step-{step:08d}", self.root / f".step-{step:08d}.tmp"

        def prepare() -> None:
            # Saves killed before their rename, of this step or any other (a resume goes on from an earlier one):
            # each holds up to a whole checkpoint's bytes of the disk, and none is resumed from.
            for killed in self.root.glob(".step-*.tmp") if self.root.is_dir() else []:
                shutil.rmtree(killed)
                if killed != tmp:
                    log.info("removed %s, left by a save that did not finish", killed.name)
            tmp.mkdir(parents=True)

        def files() -> list[dict]:
            listed = []
            for f in write(tmp):
                with open(f, "rb") as fd:  # on disk before the manifest says it is
                    os.fsync(fd.fileno())
                listed.append({"name": str(Path(f).relative_to(tmp)), "rank": self.rank,
                               "bytes": Path(f).stat().st_size, "crc32": f"{crc32(Path(f)):08x}"})
            return listed

        def commit(listed: list[dict]) -> None:
            manifest = {"format": FORMAT, "step": step, "world": self.world, "checksum": "crc32",
                        "written": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                        "files": listed, "meta": meta or {}}
            replace_file(tmp / MANIFEST, json.dumps(manifest, indent=1, default=str))
            for damaged in [*self._damaged, final]:  # kept for a look, under a name none resumes
                if damaged.exists():
                    aside = next(a for k in range(1, 1000) if not (a := damaged.with_name(
                        f"{damaged.name}.damaged{f'.{k}' if k > 1 else ''}")).exists())
                    os.replace(damaged, aside)
                    log.warning("checkpoint %s was damaged: set aside as %s", damaged.name, aside.name)
            self._damaged = []
            os.replace(tmp, final)
            fsync_dir(self.root)

        self._each(step, tmp, prepare if self.rank == 0 else None)
        listed = [e for part in self._all(self._each(step, tmp, files)) for e in part]
        self._each(step, tmp, (lambda: commit(listed)) if self.rank == 0 else None)
        if self.rank == 0:
            for old in self.steps()[:-self.keep]:
                try:
                    shutil.rmtree(old)
                except OSError as exc:  # the new checkpoint is complete: an old one left is no reason to stop
                    log.warning("could not remove the old checkpoint %s (%s); remove it by hand", old, exc)
            log.info("checkpoint %s written", final)
        return final

    def _each(self, step: int, tmp: Path, fn: Callable[[], object] | None) -> object:
        """`fn()` on this rank, then every rank learns whether any failed; a failure removes `tmp`, and raises on
        every rank the message of each rank that failed."""
        result, failed = None, None
        if fn is not None:
            try:
                result = fn()
            except Exception as exc:  # noqa: BLE001  (whatever the writer raises: every rank must hear of it)
                failed = describe_failure(exc, tmp)
        # (one message once: a failure inside torch.distributed.checkpoint is raised on every rank)
        errors = list(dict.fromkeys(e for e in self._all(failed) if e is not None))
        if errors:
            removed = "was removed"
            if self.rank == 0:
                try:
                    if tmp.exists():
                        shutil.rmtree(tmp)
                except OSError as exc:
                    removed = f"could not be removed ({exc}): remove it by hand"
            earlier = ", ".join(p.name for p in self.steps()) or "none"
            raise CheckpointError(f"checkpoint of step {step}: {'; '.join(errors)}. The partial checkpoint {tmp} "
                                  f"{removed}; the earlier ones ({earlier}) are as they were")
        return result

    def _all(self, value) -> list:
        """`value` of every rank, in rank order."""
        if self.world == 1:
            return [value]
        import torch.distributed as dist

        out = [None] * self.world
        dist.all_gather_object(out, value)
        return out

    def _gathered(self, problems: list[str]) -> list[str]:
        return list(dict.fromkeys(p for part in self._all(problems) for p in part))


def _os_error(exc: BaseException) -> OSError | None:
    """The first OSError with an errno in `exc`'s chain (causes and contexts)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno is not None:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def describe_failure(exc: BaseException, where: Path) -> str:
    """"cannot write PATH: CAUSE; FIX" for a write under `where` that raised `exc`: the cause from the errno in
    its chain, or, for a writer that reports none, from what the file system and the limits say."""
    os_error = _os_error(exc)
    path = Path(os_error.filename) if os_error is not None and os_error.filename else where
    code = os_error.errno if os_error is not None else _likely_errno(where)
    directory = path.parent if path != where else where.parent
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    writable = f"make {directory} writable for this user, or give another --out"
    file_size = (f"this process's RLIMIT_FSIZE, `ulimit -f`, is {limit} bytes" if limit != resource.RLIM_INFINITY
                 else "the file system's largest file")
    larger = ("raise the limit (ulimit -f unlimited) before the run, or give an --out on a file system that takes "
              "larger files")
    causes = {
        errno.ENOSPC: ("disk full (ENOSPC)", f"free space on the file system of {directory}, or give another --out"),
        errno.EDQUOT: ("the disk quota is used up (EDQUOT)", "free space within the quota, or give another --out"),
        errno.EFBIG: (f"the file-size limit (EFBIG: {file_size})", larger),
        errno.EACCES: ("permission denied (EACCES)", writable),
        errno.EPERM: ("operation not permitted (EPERM)", writable),
        errno.EROFS: ("the file system is read-only (EROFS)", "give an --out on a writable file system"),
    }
    if code in causes:
        cause, fix = causes[code]
        return f"cannot write {path}: {cause}; {fix}"
    detail = f"{os.strerror(code)} ({errno.errorcode.get(code, code)})" if code else f"{type(exc).__name__}: {exc}"
    return f"cannot write {path}: {detail}; check that the file system of {directory} has room and takes writes"


def _likely_errno(where: Path) -> int | None:
    """For a writer whose error has no errno: what the process's limits and the file system say."""
    with contextlib.suppress(OSError):
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        if limit != resource.RLIM_INFINITY and where.exists() and any(
                f.stat().st_size >= limit for f in where.rglob("*") if f.is_file()):
            return errno.EFBIG
        if shutil.disk_usage(where if where.exists() else where.parent).free < READ_BYTES:
            return errno.ENOSPC
        if not os.access(where if where.exists() else where.parent, os.W_OK):
            return errno.EACCES
    return None
