"""On a GPU: the offloaded bytes really leave the device (torch allocator and NVML) and really come back."""

from __future__ import annotations

import pytest
import torch

import swaprl
from swaprl import memory
from swaprl.compat import torch as torch_compat

pytestmark = pytest.mark.gpu
MiB = 2**20


def _trained_model(layers: int = 2):
    from swaprl.checkpoints import random_model

    torch.manual_seed(0)
    model = random_model("qwen2.5-0.5b", layers=layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    return model, opt


@pytest.fixture
def expandable_segments(monkeypatch):
    """torch's allocator with expandable segments for the test, whatever the suite runs with, then as it was."""
    set_settings = torch._C._accelerator_setAllocatorSettings
    before = "expandable_segments:True" if torch_compat.expandable_segments() else "expandable_segments:False"
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    torch.cuda.empty_cache()
    set_settings("expandable_segments:True")
    yield
    torch.cuda.empty_cache()
    set_settings(before)


def test_offloaded_bytes_leave_the_device_and_come_back(expandable_segments):
    model, opt = _trained_model()
    grad_bytes = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(grads="offload"))
    state_bytes = rt.status()["optimizer"]["bytes"]
    assert state_bytes > 1000 * MiB
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    alloc0, used0 = torch.cuda.memory_allocated(), memory.device_used_bytes(torch.device("cuda"))
    for _ in range(3):  # and again: the host buffers are reused, nothing accumulates
        with swaprl.phase("generate"):
            moved = state_bytes + grad_bytes
            # The allocator rounds blocks (2 MiB for large ones): compare to within a few MiB.
            assert abs(torch.cuda.memory_allocated() - (alloc0 - moved)) < 8 * MiB
            dropped = used0 - memory.device_used_bytes(torch.device("cuda"))
            assert abs(dropped - moved) < 64 * MiB, (dropped, moved)
            assert rt.status()["optimizer"]["location"] == "host"
        assert abs(torch.cuda.memory_allocated() - alloc0) < 8 * MiB
        assert rt.status()["optimizer"]["bytes"] == state_bytes
        # Back in one segment of their own, one cudaMalloc, even under expandable segments (the suite's setting),
        # whose pages would each be a driver allocation made and given back at every switch.
        state = next(v for st in opt.state.values() for v in st.values() if v.is_cuda and v.dim())
        segment = next(g for g in torch.cuda.memory_snapshot()
                       if g["address"] <= state.data_ptr() < g["address"] + g["total_size"])
        assert not segment["is_expandable"] and segment["total_size"] >= state_bytes, segment["total_size"]
        assert len(segment["blocks"]) == 1, segment["blocks"]  # no free tail that another tensor could take
    assert rt.status()["host_buffers"]["pinned"]


def test_reload_that_does_not_fit_leaves_the_runtime_in_generate():
    model, opt = _trained_model()
    rt = swaprl.attach(model, opt)
    state = [v.clone() for st in opt.state.values() for v in st.values() if v.is_cuda]
    filler = None
    with pytest.raises(torch.OutOfMemoryError, match=r"could not bring the (grads|optimizer) back .* GiB needed"):
        with swaprl.phase("generate"):
            free = torch.cuda.mem_get_info()[0]
            filler = torch.empty(free - 256 * MiB, dtype=torch.uint8, device="cuda")  # user code hogging memory
    assert rt.current_phase == "generate"
    assert rt.status()["optimizer"]["location"] == "host"
    del filler
    with rt.phase("train"):
        now = [v for st in opt.state.values() for v in st.values() if v.is_cuda]
        for a, b in zip(now, state):
            torch.testing.assert_close(a, b, rtol=0, atol=0)


_CAPTURE_SCRIPT = """
import logging, threading, torch
from swaprl import fingerprint
from swaprl.residency import HostBuffer

warnings = []
class Record(logging.Handler):
    def emit(self, record):
        warnings.append(record.getMessage())
logging.getLogger("swaprl").addHandler(Record(logging.WARNING))

size, device = 256 << 20, torch.device("cuda", 0)
x = torch.arange(1 << 20, dtype=torch.float32, device=device)
buf = HostBuffer("capture", pin=True)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):  # CUDA's global capture mode, as vLLM captures
    y = x * 2
    buf.prepare(size)  # page-locks in a thread of its own
    fingerprint.warm_up(device)  # compiles the kernel and runs it in a thread of its own
    for t in threading.enumerate():
        if t.name.startswith("swaprl-"):
            t.join()
    y += 1
graph.replay()
torch.cuda.synchronize()
assert torch.equal(y, x * 2 + 1), "the graph captured around the threads replays wrong"
assert buf.span(size).numel() == size and buf.locked_bytes == size, "the buffer was not page-locked"
t = torch.randn(5000, device=device).to(torch.bfloat16)
assert fingerprint.fingerprint(t) == fingerprint.fingerprint(t.cpu())
assert not warnings, warnings
print("ok")
"""


def test_attach_threads_lock_host_memory_and_compile_the_check_while_a_graph_is_captured(tmp_path):
    """With an engine built inside attach, its threads page-lock the host buffers and compile the fingerprint kernel
    while vLLM captures CUDA graphs in CUDA's global mode, which refuses other threads such calls unless they relax
    their own mode (`swaprl.compat.cuda`). In a fresh process with an empty Triton cache, so the kernel is really
    compiled and loaded during the capture."""
    import os
    import subprocess
    import sys

    torch.cuda.empty_cache()  # the child needs device memory that earlier tests of this process left cached
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run([sys.executable, "-c", _CAPTURE_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


def test_torch_counters_are_torchs_own_and_its_peaks_fold_into_every_reader():
    """One reading gives what `memory_allocated` and `memory_reserved` give, and the shared peaks keep a passing high
    for each reader."""
    device = torch.device("cuda", torch.cuda.current_device())
    keep = torch.empty(64 * MiB, dtype=torch.uint8, device=device)
    assert memory.torch_counters(device) == (torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device))
    peaks = memory.TorchPeaks(device)
    peaks.span("a"), peaks.span("b")
    passing = torch.empty(128 * MiB, dtype=torch.uint8, device=device)
    high = torch.cuda.max_memory_allocated(device)
    del passing
    assert peaks.span("a")[0] == high >= keep.numel() + 128 * MiB
    assert peaks.span("b")[0] == high  # a's span reset torch's peak; b's high is kept for b
    assert peaks.span("a")[0] < high  # a's next span starts after the passing high
    peaks.forget("a"), peaks.forget("b")
