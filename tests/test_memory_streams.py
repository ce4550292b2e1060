"""benchmarks/memory_streams.py: the free cached blocks of each stream at the default pool's peak, from a
memory-history snapshot."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
import torch

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"
GiB = 2**30
COMPUTE, GATHER = 111, 222  # two streams, as torch names them (their handles)


def snapshot() -> dict:
    """Recorded while a step ran: the gather stream maps 4 GiB, uses and frees it; then the compute stream maps 10
    GiB beside it (16 GiB with a segment the compute stream had before recording began, 1 of its 2 GiB in use), and
    the gather stream takes 2 GiB of its cache again (the peak: the most in use while the most was held); then
    all is freed. A private pool's actions (vLLM's) come between, and must not count."""
    def ev(action, stream, size, addr, pool=(0, 0)):
        frames = [{"filename": "torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py", "name": name}
                  for name in ("allocate", "foreach_all_gather")] if stream == GATHER else []
        return {"action": action, "stream": stream, "size": size, "addr": addr, "pool_id": pool, "frames": frames}
    trace = [ev("segment_map", GATHER, 4 * GiB, 0x1000), ev("alloc", GATHER, 4 * GiB, 0x1000),
             ev("free_requested", GATHER, 4 * GiB, 0x1000), ev("free_completed", GATHER, 4 * GiB, 0x1000),
             ev("segment_alloc", 333, 30 * GiB, 0x9000, pool=(1, 0)), ev("alloc", 333, 30 * GiB, 0x9000, pool=(1, 0)),
             ev("segment_map", COMPUTE, 10 * GiB, 0x5000), ev("alloc", COMPUTE, 10 * GiB, 0x5000),
             ev("alloc", GATHER, 2 * GiB, 0x1000), ev("free_completed", GATHER, 2 * GiB, 0x1000),
             ev("free_completed", COMPUTE, 10 * GiB, 0x5000), ev("segment_unmap", COMPUTE, 10 * GiB, 0x5000)]
    def block(size, state):  # the trace's sizes are the sizes asked for; a block's own is rounded up
        return {"size": size + 512, "requested_size": size, "state": state}
    segments = [  # when the snapshot was taken
        {"device": 1, "address": 0x100, "total_size": 2 * GiB, "allocated_size": GiB + 512, "stream": COMPUTE,
         "segment_pool_id": (0, 0), "blocks": [block(GiB, "active_allocated"), block(GiB - 1024, "inactive")]},
        {"device": 1, "address": 0x1000, "total_size": 4 * GiB, "allocated_size": 0, "stream": GATHER,
         "segment_pool_id": (0, 0), "blocks": [block(4 * GiB - 512, "inactive")]},
        {"device": 1, "address": 0x9000, "total_size": 30 * GiB, "allocated_size": 30 * GiB, "stream": 333,
         "segment_pool_id": (1, 0), "blocks": []}]
    # A rank's snapshot lists every GPU; the others' traces hold only the snapshot's own marks.
    return {"segments": segments, "device_traces": [[{"action": "snapshot", "stream": 0, "size": 0, "addr": 0}],
                                                    trace]}


def test_the_peak_is_split_by_stream(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import memory_streams

    path = tmp_path / "memory.step1.pickle"
    path.write_bytes(pickle.dumps(snapshot()))
    result = memory_streams.main([str(path), "--out", str(tmp_path / "streams.md")])
    assert result["peak_reserved"] == 16 * GiB and result["grew_on"] == COMPUTE
    assert result["device"] == 1  # the trace with the allocator's actions, not the first one listed
    assert result["streams"] == {
        COMPUTE: {"reserved": 12 * GiB, "allocated": 11 * GiB, "free": GiB, "mostly": None},
        GATHER: {"reserved": 4 * GiB, "allocated": 2 * GiB, "free": 2 * GiB, "mostly": "foreach_all_gather"}}
    table = (tmp_path / "streams.md").read_text()
    assert table == capsys.readouterr().out
    assert f"| {GATHER} | foreach_all_gather | 4.00 | 2.00 | 2.00 |" in table
    assert f"| {COMPUTE} (the one that grew) | no Python frame | 12.00 |" in table


def test_a_snapshot_without_actions_says_how_to_take_one(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import memory_streams

    with pytest.raises(ValueError, match="_record_memory_history.*--memory-step"):
        memory_streams.replay({"segments": [], "device_traces": [[]]})
    with pytest.raises(ValueError, match="_record_memory_history"):  # only the snapshot's own marks
        memory_streams.replay({"segments": [], "device_traces": [[{"action": "snapshot", "stream": 0, "size": 0}]]})
    with pytest.raises(SystemExit, match="no such file"):
        memory_streams.main([str(tmp_path / "missing.pickle")])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; run on the GPU machine")
def test_a_real_snapshot_shows_the_other_streams_free_blocks(tmp_path, monkeypatch):
    """On the GPU: a block freed on a side stream stays cached there while the compute stream allocates beside it."""
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import memory_streams

    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.memory._record_memory_history(max_entries=10_000, context=None)
    try:
        with torch.cuda.stream(side):
            t = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
            t.fill_(1)
            del t
        side.synchronize()
        u = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
        u.fill_(2)
        path = tmp_path / "memory.pickle"
        torch.cuda.memory._dump_snapshot(str(path))
        del u
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
        torch.cuda.empty_cache()
    result = memory_streams.main([str(path)])
    rows = result["streams"]
    assert rows[side.cuda_stream]["free"] >= 256 * 2**20, rows
    assert result["grew_on"] == torch.cuda.current_stream().cuda_stream, result
