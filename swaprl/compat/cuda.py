"""The one CUDA driver call swaprl makes that torch does not expose: a thread's stream-capture mode.

vLLM captures its CUDA graphs with `torch.cuda.graph`, whose default capture mode is CUDA's global one: while any
thread captures in that mode, every other thread in the process is refused "potentially unsafe" calls (allocating
device or page-locked memory, page-locking memory, loading a module) with `cudaErrorStreamCaptureUnsupported`, and
the refused call also invalidates the capture. swaprl's attach runs two threads that make such calls while the
engine may be starting: the host buffers' page-locking and the fingerprint kernel's compilation. Each sets its own
mode to relaxed first, as torch's allocators do around their `cudaMalloc` and `cudaHostAlloc` during a capture
(CUDACachingAllocator.cpp, CachingHostAllocator.cpp): none of these calls enqueues work on a stream, so none can
enter the captured graph. The mode is per thread: the capturing thread and every other are left as they are.
"""

from __future__ import annotations

import ctypes
import functools
import logging

logger = logging.getLogger(__name__)

_CU_STREAM_CAPTURE_MODE_RELAXED = 2  # cuda.h: CU_STREAM_CAPTURE_MODE_{GLOBAL, THREAD_LOCAL, RELAXED} = 0, 1, 2


@functools.cache
def _driver() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError:  # no CUDA driver: nothing captures
        return None


def allow_calls_during_capture() -> bool:
    """Set the calling thread's stream-capture mode to relaxed (see the module docstring); False, with a warning
    that names the way around it, where there is no CUDA driver to ask or it refused."""
    lib = _driver()
    err = "no libcuda.so.1" if lib is None else lib.cuThreadExchangeStreamCaptureMode(
        ctypes.byref(ctypes.c_int(_CU_STREAM_CAPTURE_MODE_RELAXED)))
    if err == 0:
        return True
    logger.warning("could not relax this thread's CUDA stream-capture mode (%s): a vLLM engine that captures its "
                   "CUDA graphs while this thread runs may fail with cudaErrorStreamCaptureInvalidated. Build the "
                   "engine before attach (pass the Engine itself), or with enforce_eager=True", err)
    return False
