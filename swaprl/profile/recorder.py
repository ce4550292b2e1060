"""Recording a memory profile: a sampling thread plus the runtime's step and phase events, as JSON Lines.

    attach_profiler(rt, "run.jsonl")   # or swaprl.attach(..., config=SwapConfig(profile="run.jsonl"))
    swaprl report run.jsonl -o rep/    # HTML and Markdown report with figures (swaprl.profile.report)

One file per rank (`run.rank3.jsonl` when torch.distributed runs more than one rank). Schema version 1, one JSON
object a line; every line is written whole and flushed, so a crash leaves a readable prefix:

    header  {"schema": "swaprl.profile", "version": 1, "type": "header", "rank", "world_size", "device", "host",
             "torch", "swaprl", "nvml", "device_used_source",
             "copy_bandwidth": {"h2d_GBps", "d2h_GBps", "d2d_GBps", "bytes"} | null,
             "interval_s", "engine", "config", "alloc_conf", "t0", ...}  (alloc_conf: PYTORCH_CUDA_ALLOC_CONF;
             on CUDA also "device_name", "device_total", "engine_pool": the engine's `pool_allocations()`)
    sample  {"type": "sample", "t", "host_rss", "host_buffers"[, "device_used", "torch_allocated", "torch_reserved"]}
    step    {"type": "step", "t", "transition", "step", "bytes", "seconds"[, "span_seconds"][, "issued"]}
            (span_seconds: an overlapped copy's time from the step that queued it to this one, which waited for it;
            issued: true for a step whose copies were queued and left running, e.g. an optimizer reload under the
            forward, so that "seconds" is not their duration); also each
            streamed optimizer step (SwapConfig(optimizer_states="host")): "transition": "optimizer.step", "step":
            "stream optimizer states", "bytes" both ways, and "h2d_bytes", "d2h_bytes", "chunks"
    error   {"type": "error", "t", "transition", "step", "error"}: a transition that failed and was rolled back
    sync    {"type": "sync", "t", "cycle", "weights", "checked", "differing", "stale_since", "sync_seconds",
             "sync_bytes", "verify_seconds", "mismatch": {"tokens", "max_abs", "mean_abs", "kl", "outside"} | null,
             "mismatch_seconds", "probe_engine_seconds", "bounds", "ok"}: the on-policy check after each weight sync
            (`swaprl.verify`)
    demote  {"type": "demote", "t", "short_bytes", "bytes"}: optimizer_states="auto" swapped more states after the
            engine's wake-up lacked `short_bytes` (then rolled back and retried)
    retry   {"type": "retry", "t", "transition", "how"}: the switch that just failed (the error before it) goes again,
            as `how` says
    phase   {"type": "phase", "t", "phase", "from", "cycle", "seconds", "bytes", "host_rss", "status", "attribution"
            [, "torch_private_free", "torch_peak_allocated", "torch_peak_reserved"]} (the first one, "from": null,
            is the state when recording started; torch_private_free: bytes of torch's private pools that no block
            holds; torch_peak_*: torch's peak counters over the span this record ends, from the previous record: the
            phase left and the switch out of it; the first record's span began at attach, or wherever torch's
            peaks were last reset)
    end     {"type": "end", "t", "reason": "detach" | "close" | "exit", "samples"[, "copy_bandwidth",
             "torch_peak_allocated", "torch_peak_reserved"]}
            (copy_bandwidth: measured again at the end, on CUDA, but at "exit"; "exit": the process ended with
            the runtime still attached: the normal end when host-resident optimizer states do not fit on the device
            for `detach()`, or an uncaught exception; a profile without an end record was cut short: a kill, a
            hard crash, or a run still going)

Times are epoch seconds, sizes bytes. Device figures exist only on CUDA: "device_used" is NVML's whole-device figure
(it sees vLLM's own memory pool and CUDA contexts, which torch's allocator does not), or the CUDA driver's when NVML
is missing ("device_used_source" says which). Sampling costs one NVML query, two torch counter reads and one
/proc read per interval; everything heavier runs only at phase boundaries.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import platform
import socket
import statistics
import threading
import time
from dataclasses import asdict
from pathlib import Path

import psutil
import torch

from .. import memory
from ..compat import torch as torch_compat
from .._version import __version__
from . import SCHEMA, VERSION
from .attribution import attribute

logger = logging.getLogger(__name__)

_COPY_BYTES = 256 * 2**20
_COPY_REPEATS = 5


class Profiler:
    """Writes a memory profile of `runtime` to `path` until `close()`, the runtime's `detach()` or the process's exit.

    Build it with `attach_profiler` (or `SwapConfig(profile=...)`); it is also a context manager. `path` is where the
    file
    actually goes (with the rank suffix under torch.distributed).
    """

    def __init__(self, runtime, path: str | os.PathLike, *, interval_s: float = 0.05) -> None:
        if not interval_s > 0:
            raise ValueError(f"interval_s={interval_s}; give a positive sampling interval in seconds (0.05 "
                             "samples 20 times a second)")
        self.runtime = runtime
        self.interval_s = float(interval_s)
        self.path = _rank_path(Path(path))
        self._device = runtime.device
        self._cuda = self._device.type == "cuda"
        self._nvml = self._cuda and _nvml_readable(self._device)
        self._proc = psutil.Process()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._closing = self._closed = False
        self._samples = 0
        bandwidth = _copy_bandwidth(self._device) if self._cuda else None
        status = runtime.status()  # after the bandwidth probe, which may release torch's cached blocks
        self._host_buffers = int(status["host_buffers"]["bytes"])

        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "w", encoding="utf-8")
        try:
            self._write(self._header(runtime, bandwidth))
            self._write(self._boundary({"t": time.time(), "phase": status["phase"], "from": None, "cycle": None,
                                        "seconds": 0.0, "bytes": 0, "status": status}))
        except BaseException:
            self._file.close()
            raise
        self._remove_listener = runtime.add_listener(self._on_event)
        runtime.on_detach(lambda: self.close("detach"))
        atexit.register(self._close_at_exit)
        self._thread = threading.Thread(target=self._sample_loop, name="swaprl-profiler", daemon=True)
        self._thread.start()
        logger.info("recording a memory profile to %s every %.0f ms (device figures: %s)", self.path,
                    self.interval_s * 1e3, self._source() or "none on this device")

    def close(self, reason: str = "close") -> None:
        """Stop sampling, write the end record and close the file; later calls do nothing."""
        with self._lock:
            if self._closing:
                return
            self._closing = True
        atexit.unregister(self._close_at_exit)
        self._remove_listener()
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        self._write(self._sample())
        end = {"type": "end", "t": time.time(), "reason": reason, "samples": self._samples}
        if self._cuda:
            end.update(self._peaks())
            self.runtime.peaks.forget(self)
        if self._cuda and reason != "exit":  # measured again now that nothing else copies (the report takes the best)
            end["copy_bandwidth"] = _copy_bandwidth(self._device)
        self._write(end)
        with self._lock:
            self._closed = True
            self._file.close()
        logger.info("memory profile written to %s (%d samples)", self.path, self._samples)

    def _close_at_exit(self) -> None:
        try:
            self.close("exit")
        except Exception as exc:  # the interpreter is ending: say why the profile has no end record, do not raise
            logger.warning("memory profile %s: could not write its end record at exit (%s)", self.path, exc)

    def __enter__(self) -> Profiler:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ---------------------------------------------------------------- records
    def _header(self, runtime, bandwidth: dict | None) -> dict:
        rank, world = _rank_world()
        config = {k: v for k, v in asdict(runtime.config).items() if k != "profile"}
        head = {"schema": SCHEMA, "version": VERSION, "type": "header", "rank": rank, "world_size": world,
                "pid": os.getpid(), "device": str(self._device), "host": socket.gethostname(),
                "host_total": int(psutil.virtual_memory().total), "python": platform.python_version(),
                "torch": torch.__version__, "swaprl": __version__, "nvml": self._nvml,
                "device_used_source": self._source(), "copy_bandwidth": bandwidth, "interval_s": self.interval_s,
                "engine": type(runtime.engine).__name__, "config": config,
                # an engine that wakes on torch's cached pages keeps them in torch's cache from cycle to cycle
                "engine_lends": getattr(runtime.engine, "lender", None) is not None,
                # torch's allocator settings: expandable segments change how much cached memory a peak carries
                "alloc_conf": torch_compat.alloc_conf()}
        if self._cuda:
            props = torch.cuda.get_device_properties(self._device)
            head["device_name"] = props.name
            head["device_total"] = memory.device_total_bytes(self._device)
            # what the engine's wake-ups map and its sleeps unmap: benchmarks/switch_floors.py measures their floor
            head["engine_pool"] = runtime.engine.pool_allocations()
        head["t0"] = time.time()
        return head

    def _sample(self) -> dict:
        rec = {"type": "sample", "t": time.time(), "host_rss": int(self._proc.memory_info().rss),
               "host_buffers": self._host_buffers}
        if self._cuda:
            rec["device_used"] = memory.device_used_bytes(self._device)
            lender = getattr(self.runtime.engine, "lender", None)
            rec["torch_allocated"], rec["torch_reserved"] = memory.torch_counters(
                self._device, lent=lender.lent_bytes if lender is not None else 0)
        return rec

    def _boundary(self, event: dict) -> dict:
        status = event["status"]
        self._host_buffers = int(status["host_buffers"]["bytes"])
        source = self._source() or "runtime"
        extra = {}
        if self._cuda:
            private, private_free = memory.private_pool_bytes(self._device)
            attribution = attribute(status, source=source, private_pool_bytes=private,
                                    process_used_bytes=self._process_used_bytes(),
                                    driver_reserved_bytes=memory.device_reserved_bytes(self._device))
            extra["torch_private_free"] = private_free  # the report tells these from the default pool's free blocks
            extra.update(self._peaks())
        else:
            attribution = attribute(status, source=source)
        return {"type": "phase", "t": event["t"], "phase": event["phase"], "from": event["from"],
                "cycle": event["cycle"], "seconds": event["seconds"], "bytes": event["bytes"],
                "host_rss": int(self._proc.memory_info().rss), "status": status, "attribution": attribution, **extra}

    def _on_event(self, event: dict) -> None:
        kind = event.get("type")
        if kind == "step":
            keys = ("t", "transition", "step", "bytes", "seconds", "span_seconds", "issued", "h2d_bytes", "d2h_bytes",
                    "chunks")
            self._write({"type": "step"} | {k: event[k] for k in keys if k in event})
        elif kind == "phase":
            self._write(self._boundary(event))
            self._write(self._sample())
        elif kind == "error":  # a transition that failed and was rolled back
            self._write({"type": "error"} | {k: event[k] for k in ("t", "transition", "step", "error")})
        elif kind in ("sync", "demote", "retry"):  # the check after a sync; a failed switch going again
            self._write(event)

    # ---------------------------------------------------------------- plumbing
    def _write(self, record: dict) -> None:
        line = json.dumps(record, separators=(",", ":"), default=str) + "\n"
        with self._lock:
            if self._closed:
                return
            self._file.write(line)
            self._file.flush()
            if record.get("type") == "sample":
                self._samples += 1

    def _sample_loop(self) -> None:
        while True:
            try:
                self._write(self._sample())
            except Exception:  # a profiler must never take the training run down with it
                logger.exception("memory profiler sampling failed; sampling stops, events are still recorded")
                return
            if self._stop.wait(self.interval_s):
                return

    def _peaks(self) -> dict[str, int]:
        """torch's peak counters since the last record that took them; torch's peaks start again from here (a
        script reading `torch.cuda.max_memory_allocated()` while a profile records sees the current span's)."""
        allocated, reserved = self.runtime.peaks.span(self)
        return {"torch_peak_allocated": allocated, "torch_peak_reserved": reserved}

    def _source(self) -> str | None:
        if not self._cuda:
            return None
        return "nvml" if self._nvml else "cuda_driver"

    def _process_used_bytes(self) -> int | None:
        """NVML's figure for this process alone (None without NVML, or when NVML cannot see our pid, as in some
        containers)."""
        if not self._nvml:
            return None
        try:
            nvml = memory._nvml()
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(memory._nvml_handle(self._device)):
                if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                    return int(proc.usedGpuMemory)
        except Exception as exc:
            logger.debug("NVML per-process reading failed: %s", exc)
        return None


def attach_profiler(runtime, path: str | os.PathLike, *, interval_s: float = 0.05) -> Profiler:
    """Record a memory profile of `runtime` to `path` (JSON Lines) until `detach()` or the profiler's `close()`."""
    return Profiler(runtime, path, interval_s=interval_s)


def attach_configured(runtime) -> Profiler | None:
    """The profiler `runtime.config.profile` asks for (attached now), or None when it asks for none."""
    path = runtime.config.profile
    return attach_profiler(runtime, path) if path is not None else None


def _nvml_readable(device: torch.device) -> bool:
    """NVML can read `device` (it may be installed yet fail to find the card, which `memory` then hides)."""
    if not memory.nvml_available():
        return False
    try:
        memory._nvml().nvmlDeviceGetMemoryInfo(memory._nvml_handle(device))
        return True
    except Exception as exc:
        logger.warning("NVML cannot read %s (%s); the profile's device figures come from the CUDA driver", device,
                       exc)
        return False


def _rank_world() -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _rank_path(path: Path) -> Path:
    # Only several ranks need several files: an in-process vLLM initialises a process group of one on its own.
    rank, world = _rank_world()
    if world > 1:
        return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")
    return path


def _copy_bandwidth(device: torch.device) -> dict | None:
    """Copy speeds in GB/s, the median of a few 256 MiB copies: host<->device through pinned memory each way, and
    device to device (bytes copied, each read once and written once: the floor of a weight sync)."""
    try:
        with torch.cuda.device(device):
            host = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
            dev = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)

            def median_seconds(dst: torch.Tensor, src: torch.Tensor) -> float:
                times = []
                for _ in range(_COPY_REPEATS + 1):  # the first copy is a warm-up
                    torch.cuda.synchronize(device)
                    t0 = time.perf_counter()
                    dst.copy_(src, non_blocking=True)
                    torch.cuda.synchronize(device)
                    times.append(time.perf_counter() - t0)
                return statistics.median(times[1:])

            h2d = _COPY_BYTES / median_seconds(dev, host) / 1e9
            d2h = _COPY_BYTES / median_seconds(host, dev) / 1e9
            del host
            d2d = _COPY_BYTES / median_seconds(torch.empty_like(dev), dev) / 1e9
            del dev
            torch.cuda.empty_cache()  # leave torch's reserved memory as it was: the profile must not show us
        return {"h2d_GBps": round(h2d, 2), "d2h_GBps": round(d2h, 2), "d2d_GBps": round(d2d, 2), "bytes": _COPY_BYTES}
    except Exception as exc:  # out of memory, most likely: the profile is still worth having without a ceiling
        logger.warning("could not measure host<->device copy bandwidth (%s); the report takes the run's other "
                       "measure, if any, as its ceiling", exc)
        return None
