"""swaprl.vmm: the pausable device memory pool (kernels/vmm_pool.cpp), for real on the GPU machine.

On a CPU machine: the source builds where a compiler and cuda.h are present and exports its entry points, and
without a GPU the pool says why it cannot be used (and the engine refuses `release_other=True`). On the GPU: memory
is released and comes back at the same addresses with the allocated bytes; freed blocks are not copied; a CUDA graph
captured into a pool replays right after 200 pauses with no growth in device memory; a resume that does not fit
fails, keeps the pool paused and loses nothing; and a colocated vLLM engine with CUDA graphs keeps almost nothing
on the device while it sleeps, generating the same tokens as without the pool.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from swaprl import vmm

MiB = 2**20
BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
gpu = pytest.mark.gpu


def _free() -> int:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0]


def test_the_source_builds_and_exports_every_entry_point(tmp_path):
    if vmm.cuda_include_dir() is None or shutil.which("g++") is None or shutil.which("nm") is None:
        pytest.skip("needs g++, nm and cuda.h (CUDA_HOME, /usr/local/cuda or Triton's copy)")
    lib = vmm.build(tmp_path)
    assert lib.parent == tmp_path / "kernels" and lib.exists()
    assert vmm.build(tmp_path) == lib  # cached by the source's hash
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    names = {line.split()[-1] for line in symbols.splitlines()}
    wanted = {f"swaprl_vmm_{fn}_{k}" for fn in ("malloc", "free") for k in range(8)}
    wanted |= {"swaprl_vmm_pause", "swaprl_vmm_resume", "swaprl_vmm_stat", "swaprl_vmm_error", "swaprl_vmm_slots",
               "swaprl_vmm_lend", "swaprl_vmm_unlend", "swaprl_vmm_lent_stat", "swaprl_vmm_page_bytes"}
    assert wanted <= names, wanted - names


def test_a_build_without_the_header_names_the_fix(tmp_path, monkeypatch):
    monkeypatch.setattr(vmm, "cuda_include_dir", lambda: None)
    with pytest.raises(RuntimeError, match="cuda.h not found .* CUDA_HOME"):
        vmm.build(tmp_path, force=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_without_a_gpu_the_pool_is_unavailable_and_says_why():
    assert not vmm.available()
    assert "no CUDA device" in vmm.unavailable()
    with pytest.raises(RuntimeError, match="no CUDA device"):
        vmm.PausablePool("x")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.vllm
def test_engine_refuses_release_other_without_a_gpu(tiny_checkpoint):
    from swaprl.engines.vllm import VLLMEngine

    with pytest.raises(RuntimeError, match="release_other=True needs a CUDA GPU"):
        VLLMEngine(tiny_checkpoint, release_other=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
@pytest.mark.vllm
def test_by_default_the_engine_releases_its_graphs_and_buffers_only_where_it_can(tiny_checkpoint):
    from swaprl.engines.vllm import pools_unavailable

    assert "no CUDA GPU" in pools_unavailable()
    assert "built elsewhere" in pools_unavailable(built=False)  # TRL's engine: allocated before swaprl saw it
    # past the GPU check, the library decides (here it cannot load: no CUDA device), then vLLM
    why = vmm.unavailable()
    assert why is not None and pools_unavailable(cuda=True) == why


@pytest.mark.vllm
def test_the_profile_run_is_patchable_only_where_vllm_has_one(monkeypatch):
    from swaprl.compat import vllm as vllm_compat

    assert vllm_compat.startup_runs_unpatchable() is None  # the installed vLLM has GPUModelRunner.profile_run
    monkeypatch.setattr(vllm_compat, "STARTUP_RUNS", {("vllm.no_such_module", "GPUModelRunner"): "profile_run",
                                                      ("vllm.v1.worker.gpu_worker", ""): "warmup_kernels"})
    assert "found no GPUModelRunner.profile_run" in vllm_compat.startup_runs_unpatchable()


@pytest.mark.gpu
@pytest.mark.vllm
def test_the_default_engine_has_its_pools_where_they_can_be_used(vllm_engine):
    from swaprl.engines.vllm import pools_unavailable

    why = pools_unavailable()
    assert (vllm_engine.other is not None) == (why is None), why
    assert why is None, f"the GPU machine should have the pools: {why}"


@pytest.mark.gpu
@pytest.mark.vllm
def test_an_engine_that_cannot_start_gives_its_pools_back(tiny_checkpoint):
    from swaprl.engines.vllm import EngineWakeError, VLLMEngine

    for _ in range(3):  # 3 pools each: without them back, the third would find no slot
        with pytest.raises(EngineWakeError):
            VLLMEngine(tiny_checkpoint, enforce_eager=True, reserve_bytes=torch.cuda.mem_get_info()[1])
    vmm.PausablePool("after").close()


def test_bad_keep_is_refused():
    with pytest.raises(ValueError, match="keep='all'; use one of allocated, nothing"):
        vmm.PausablePool("x", keep="all")


def test_the_wheel_lists_every_package():
    """pyproject.toml lists the packages by hand (the native source ships as swaprl._kernels): a new subpackage
    must be added there or a wheel would leave it out."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    root = Path(__file__).resolve().parent.parent
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(root).parts) for p in (root / "swaprl").rglob("__init__.py")}
    assert found | {"swaprl._kernels"} == listed


@pytest.fixture
def pool():
    if not vmm.available():
        pytest.skip(vmm.unavailable())
    p = vmm.PausablePool("test")
    yield p
    p.close()


@gpu
def test_pause_releases_the_memory_and_resume_restores_it_in_place(pool):
    with pool.use():
        x = torch.arange(64 * MiB // 4, dtype=torch.float32, device="cuda")
        y = torch.full((3 * MiB,), 7, dtype=torch.uint8, device="cuda")
    expected_x, expected_y = x.clone(), y.clone()
    addresses = (x.data_ptr(), y.data_ptr())
    mapped = pool.mapped_bytes
    assert mapped >= 67 * MiB
    before = _free()
    released = pool.pause()
    assert released == mapped and pool.mapped_bytes == 0 and pool.paused
    assert _free() - before >= mapped - 2 * MiB
    assert pool.kept_bytes >= 67 * MiB  # both tensors' blocks
    pool.resume()
    assert pool.mapped_bytes == mapped and not pool.paused
    assert (x.data_ptr(), y.data_ptr()) == addresses
    assert torch.equal(x, expected_x) and torch.equal(y, expected_y)
    x += 1  # and it is ordinary device memory again
    assert x[0].item() == 1


@gpu
def test_segments_whose_addresses_touch_pause_and_resume(pool):
    """Each segment is its own reserved range, and the driver often hands out ranges side by side: allocated blocks
    at the end of one segment and the start of the next must be kept as two ranges, one per mapping."""
    with pool.use():
        parts = [torch.full((32 * MiB,), i, dtype=torch.uint8, device="cuda") for i in range(6)]
    segments = sorted((int(s["address"]), int(s["total_size"]))
                      for s in torch.cuda.memory.memory_snapshot(pool.id, include_traces=False))
    if not any(a + n == b for (a, n), (b, _) in zip(segments, segments[1:])):
        pytest.skip("the driver placed no two of this pool's segments side by side")
    pool.pause()
    pool.resume()
    assert [int(p[0]) for p in parts] == list(range(6)) and all(bool((p == i).all()) for i, p in enumerate(parts))


@gpu
def test_freed_blocks_are_not_copied(pool):
    with pool.use():
        keep = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
        drop = torch.ones(32 * MiB, dtype=torch.uint8, device="cuda")
    del drop
    pool.pause()
    assert 8 * MiB <= pool.kept_bytes < 16 * MiB, pool.kept_bytes
    pool.resume()
    assert keep.sum().item() == 8 * MiB


@gpu
def test_a_fill_byte_shows_what_a_pause_dropped_and_leaves_what_it_kept(pool, monkeypatch):
    """With SWAPRL_POOL_FILL, memory a resume maps but the pause did not keep reads as the byte (NaN for 0xff in
    fp32), so a program that reads dropped memory shows it; kept tensors come back as they were."""
    monkeypatch.setenv("SWAPRL_POOL_FILL", "0xff")
    dropped = vmm.PausablePool("test dropped", keep="nothing")
    try:
        with pool.use():
            kept = torch.arange(4 * MiB, dtype=torch.float32, device="cuda")
            freed = torch.zeros(4 * MiB, dtype=torch.float32, device="cuda")
        with dropped.use():
            lost = torch.zeros(4 * MiB, dtype=torch.float32, device="cuda")
        freed_address = freed.data_ptr()
        del freed
        for p in (pool, dropped):
            p.pause()
            p.resume()
        assert torch.equal(kept, torch.arange(4 * MiB, dtype=torch.float32, device="cuda"))
        assert bool(lost.isnan().all())
        with pool.use():
            again = torch.empty(4 * MiB, dtype=torch.float32, device="cuda")  # the freed block, not copied
        assert again.data_ptr() == freed_address and bool(again.isnan().all())
        del again, lost
    finally:
        dropped.close()


def test_a_fill_that_is_not_a_byte_names_the_fix(monkeypatch):
    monkeypatch.setenv("SWAPRL_POOL_FILL", "nan")
    with pytest.raises(ValueError, match="0-255"):
        vmm._resume_fill()
    monkeypatch.setenv("SWAPRL_POOL_FILL", "0x1ff")
    with pytest.raises(ValueError, match="unset it"):
        vmm._resume_fill()
    monkeypatch.setenv("SWAPRL_POOL_FILL", "255")
    assert vmm._resume_fill() == 255
    monkeypatch.delenv("SWAPRL_POOL_FILL")
    assert vmm._resume_fill() == -1


@gpu
def test_allocating_in_a_paused_pool_is_refused(pool):
    pool.pause()
    with pytest.raises(RuntimeError, match="paused: resume"):
        with pool.use():
            pass
    pool.resume()


@gpu
def test_a_sealed_pool_backs_only_its_live_blocks_and_keeps_them(pool):
    """Sealing releases the memory under free blocks, down to the granules that hold live ones, also inside a
    segment that holds both; the live bytes stay in place across the seal and later pauses; nothing may allocate in
    the pool any more."""
    with pool.use():
        # 1-10 MiB requests share 20 MiB segments: `kept` sits after `dropped` in one segment, `whole` has its own.
        dropped = torch.ones(8 * MiB, dtype=torch.uint8, device="cuda")
        kept = torch.arange(2 * MiB, dtype=torch.float32, device="cuda")  # 8 MiB
        whole = torch.ones(64 * MiB, dtype=torch.uint8, device="cuda")
    shared = [int(s["address"]) for s in torch.cuda.memory.memory_snapshot(pool.id, include_traces=False)
              if int(s["address"]) <= kept.data_ptr() < int(s["address"]) + int(s["total_size"])]
    assert shared == [dropped.data_ptr()], "the test's layout assumption: dropped and kept share a segment"
    del dropped, whole
    expected, address = kept.clone(), kept.data_ptr()
    mapped = pool.mapped_bytes
    before = _free()
    released = pool.seal()
    assert pool.sealed and not pool.paused
    assert pool.mapped_bytes == mapped - released
    assert 8 * MiB <= pool.mapped_bytes <= 12 * MiB, pool.mapped_bytes  # kept's granules (2 MiB each), no more
    assert _free() - before >= released - 2 * MiB
    assert kept.data_ptr() == address and torch.equal(kept, expected)
    for _ in range(3):
        backed = pool.mapped_bytes
        assert pool.pause() == backed and pool.mapped_bytes == 0 and pool.resume_bytes == backed
        pool.resume()
        assert torch.equal(kept, expected) and 8 * MiB <= pool.mapped_bytes <= 12 * MiB
    kept += 1  # ordinary device memory
    assert kept[0].item() == 1
    with pytest.raises(RuntimeError, match="sealed"):
        with pool.use():
            pass
    with pytest.raises(RuntimeError, match="sealed"):
        pool.id
    assert pool.seal() == 0  # sealing twice is a no-op


@gpu
def test_a_pool_cannot_be_sealed_while_it_receives_allocations(pool):
    with pool.use():
        with pytest.raises(RuntimeError, match=r"seal\(\) it after its use\(\) ends"):
            pool.seal()
    assert not pool.sealed


@gpu
def test_a_graph_captured_in_a_pool_replays_after_200_pauses():
    if not vmm.available():
        pytest.skip(vmm.unavailable())
    scratch = vmm.PausablePool("graph", keep="nothing")
    w = torch.randn(1024, 1024, device="cuda")
    inp = torch.randn(256, 1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # warm up outside the capture (cuBLAS picks its kernels)
            torch.relu(inp @ w) @ w
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=scratch.id):
        out = torch.relu(inp @ w) @ w
    assert scratch.mapped_bytes > 0  # the capture's intermediates and output live in the pool
    used = []
    for cycle in range(200):
        scratch.pause()
        used.append(torch.cuda.mem_get_info()[1] - _free())
        scratch.resume()
        inp.normal_()
        graph.replay()
        torch.testing.assert_close(out, torch.relu(inp @ w) @ w, msg=f"cycle {cycle}")
    growth = max(used[2:]) - used[1]
    assert growth < 16 * MiB, f"device memory grew by {growth / MiB:.1f} MiB over 200 pauses"
    del graph, out
    scratch.close()


@gpu
def test_a_resume_that_does_not_fit_keeps_the_pool_paused_and_loses_nothing(pool):
    with pool.use():
        x = torch.arange(256 * MiB // 4, dtype=torch.int32, device="cuda")
    expected = x.cpu()
    pool.pause()
    hog = torch.empty(_free() - 64 * MiB, dtype=torch.uint8, device="cuda")
    try:
        with pytest.raises(torch.OutOfMemoryError, match=r"resuming pool 'test' .*out of memory.*nothing was lost"):
            pool.resume()
        assert pool.paused and pool.mapped_bytes == 0
    finally:
        del hog
    pool.resume()
    assert torch.equal(x.cpu(), expected)


@gpu
@pytest.mark.vllm
def test_engine_with_cuda_graphs_keeps_almost_nothing_while_asleep(tmp_path, monkeypatch):
    """The tiny model's engine with CUDA graphs, in processes of their own with and without the pools: while it
    sleeps the report attributes at most 256 MiB to it, the graphs replay after every cycle (the same tokens
    each time), the tokens equal those of the engine without the pools, and every sync's check passes."""
    if not vmm.available():
        pytest.skip(vmm.unavailable())
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_engine_pool

    s = bench_engine_pool.main(["--preset", "tiny", "--cycles", "8", "--out", str(tmp_path),
                                "--workdir", str(tmp_path / "ck")])
    assert s["pool"] and s["nopool"], s
    assert s["pool"]["asleep_engine_other_MiB_max"] <= 256, s["pool"]
    assert s["nopool"]["asleep_engine_other_MiB_max"] > s["pool"]["asleep_engine_other_MiB_max"], s
    for run in ("pool", "nopool"):
        assert s[run]["tokens_same_every_cycle"] and s[run]["checks_passed"] and s[run]["checks"] >= 7, s[run]
        assert s[run]["train_growth_MiB"] < 64, s[run]
    assert s["tokens_equal_with_and_without_pool"], s


@gpu
@pytest.mark.vllm
def test_under_torchrun_with_a_bound_device_the_sleeping_engine_still_keeps_almost_nothing(tmp_path, monkeypatch):
    """A training script's process group with its device bound (`init_process_group(device_id=...)`, as
    examples/grpo.py starts it) makes torch create every new group's NCCL communicator at once; vLLM makes six while
    it starts, which held 1.5 GiB on the H100 while the engine slept (Qwen2.5-0.5B, pools on). Started lazily
    (`compat.torch.lazy_new_groups`), the engine is back under 256 MiB."""
    if not vmm.available():
        pytest.skip(vmm.unavailable())
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_engine_pool

    s = bench_engine_pool.main(["--preset", "tiny", "--cycles", "4", "--baseline-cycles", "0", "--nproc", "1",
                                "--out", str(tmp_path), "--workdir", str(tmp_path / "ck")])
    assert s["pool"], s
    assert s["pool"]["asleep_engine_other_MiB_max"] <= 256, s["pool"]
    # Not nothing either: the loaded kernels stay. A 0 is the figure clamped, the start footprint undercounted
    # because vLLM's start handed the trainer's cached blocks back to the driver (836 MiB here, once).
    assert s["pool"]["asleep_engine_other_MiB_max"] > 0, s["pool"]
    assert s["pool"]["tokens_same_every_cycle"] and s["pool"]["checks_passed"], s["pool"]


def test_the_engine_pool_bench_compares_pooled_tokens_with_every_unpooled_run(monkeypatch):
    """At 72B's size vLLM's tokens differ from one process to the next, pools or not: with --repeats the summary says
    whether each pooled run's tokens are those of some unpooled run, not only of the first."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_engine_pool

    def run(tokens):
        return {"asleep_engine_other_bytes": [MiB], "train_growth_bytes": 0, "cycles": 2, "checks": 2,
                "tokens_same_every_cycle": True, "checks_passed": True, "steps": {}, "generate": {},
                "engine": {"other_stats": {"other_kept_bytes": 0}}, "cudagraph_mode": "FULL_DECODE_ONLY",
                "tokens_first": tokens, "floor_GBps": {"h2d": 50.0}}

    runs = {"m_pool": run([[1]]), "m_pool_2": run([[2]]), "m_nopool": run([[2]]), "m_nopool_2": run([[1]])}
    s = bench_engine_pool.summarize("m", runs)
    assert not s["tokens_equal_with_and_without_pool"]  # the first pair differs
    assert s["pool_tokens_among_unpooled"] and s["token_sets"] == {"pool": [0, 1], "nopool": [1, 0]}
    runs["m_pool_3"] = run([[3]])
    s = bench_engine_pool.summarize("m", runs)
    assert not s["pool_tokens_among_unpooled"] and s["token_sets"]["pool"] == [0, 1, 2]
