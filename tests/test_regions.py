"""The trainer's pausable regions (`Runtime.pausable`, swaprl.regions): memory released in generate and mapped again
at the same addresses for training.

On a CPU machine: asking for one says why it cannot be had. On the GPU: a training step captured in a CUDA graph
whose pool is a region replays bit for bit the same losses and weights across phase switches as the same graph
without any switch, with the region's memory released while generating; a tensor allocated in a region keeps its
bytes across switches; the profile's attribution counts what a region holds as activations.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import swaprl
from swaprl import vmm
from swaprl.profile.attribution import attribute

gpu = pytest.mark.gpu
MiB = 2**20


def _model(path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without a GPU")
def test_a_region_on_a_cpu_trainer_is_refused_with_the_reason(tiny_checkpoint):
    model = _model(tiny_checkpoint)
    rt = swaprl.attach(model, torch.optim.AdamW(model.parameters()), engine="hf")
    try:
        with pytest.raises(RuntimeError,
                           match=r"needs swaprl's pausable pool on a CUDA device \(the trainer is on cpu"):
            rt.pausable("graph", keep="nothing")
        assert "regions" not in rt.status()
    finally:
        swaprl.detach()


def test_attribution_counts_a_region_as_activations_and_keeps_the_sum():
    status = {"params": {"bytes": 100}, "grads": {"bytes": 0}, "optimizer": {"bytes": 0},
              "engine": {"bytes": 0}, "regions": {"graph": {"bytes": 40, "reserved_bytes": 60, "paused": False}},
              "device_memory": {"used": 1000, "torch_reserved": 260}}
    # torch reserves 260: 200 in its default pool, 60 in the region's private pool (40 of them backed now)
    out = attribute(status, private_pool_bytes=60, process_used_bytes=700)
    cats = out["categories"]
    assert cats["activations"] == 200 - 100 + 40
    assert cats["cuda_context"] == 700 - 200 - 40
    assert sum(cats.values()) == 1000


def _captured_training(path, switch: bool, steps: int = 4):
    """Losses and final weights of `steps` steps whose forward and backward replay one CUDA graph and whose AdamW
    step runs eagerly; with `switch`, the graph's pool is a region and each step is followed by a generate phase."""
    model = _model(path).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    x = torch.randint(1, 500, (2, 32), device="cuda", generator=torch.Generator("cuda").manual_seed(1))
    rt = region = None
    if switch:
        rt = swaprl.attach(model, opt, engine="hf", config=swaprl.SwapConfig(grads="keep"))
        region = rt.pausable("train graph", keep="nothing")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up before capture, as torch.cuda.graph asks; it also allocates the grads
        for _ in range(2):
            model(input_ids=x, labels=x).loss.backward()
    torch.cuda.current_stream().wait_stream(side)
    opt.zero_grad(set_to_none=False)  # the captured backward accumulates into these grads, which stay in place
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=region.id if region is not None else None):
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
    losses, released = [], []
    for _ in range(steps):
        opt.zero_grad(set_to_none=False)
        graph.replay()
        opt.step()
        losses.append(loss.item())
        if switch:
            mapped = region.mapped_bytes
            with swaprl.phase("generate"):
                released.append((mapped, region.mapped_bytes, rt.status()["regions"]["train graph"]["paused"]))
                rt.engine.generate([[1, 2, 3]], swaprl.Sampling(max_tokens=4, temperature=0.0))
    weights = [p.detach().clone() for p in model.parameters()]
    if switch:
        swaprl.detach()
        region.close()
    return losses, weights, released


@gpu
def test_a_captured_training_step_replays_the_same_across_phase_switches(tiny_checkpoint):
    if not vmm.available():
        pytest.skip(vmm.unavailable())
    plain_losses, plain_weights, _ = _captured_training(tiny_checkpoint, switch=False)
    losses, weights, released = _captured_training(tiny_checkpoint, switch=True)
    assert losses == plain_losses
    assert all(torch.equal(a, b) for a, b in zip(weights, plain_weights))
    assert len(set(losses)) == len(losses)  # the weights moved: the replays did train
    for mapped, in_generate, paused in released:
        assert mapped > 0 and in_generate == 0 and paused


@gpu
def test_a_tensor_in_a_region_keeps_its_bytes_and_address_across_switches(tiny_checkpoint):
    if not vmm.available():
        pytest.skip(vmm.unavailable())
    model = _model(tiny_checkpoint).cuda()
    rt = swaprl.attach(model, torch.optim.AdamW(model.parameters()), engine="hf")
    try:
        region = rt.pausable("buffers")  # keep="allocated"
        with pytest.raises(ValueError, match="named 'buffers' exists already"):
            rt.pausable("buffers")
        with region.use():
            buf = torch.arange(16 * MiB // 4, dtype=torch.float32, device="cuda")
        expected, address = buf.clone(), buf.data_ptr()
        for _ in range(3):
            torch.cuda.synchronize()
            free_train = torch.cuda.mem_get_info()[0]
            with swaprl.phase("generate"):
                torch.cuda.synchronize()
                assert region.paused and torch.cuda.mem_get_info()[0] - free_train >= 16 * MiB - 2 * MiB
            assert not region.paused and buf.data_ptr() == address and torch.equal(buf, expected)
        del buf
    finally:
        swaprl.detach()
    region.close()


def test_the_benchmark_summary_compares_losses_and_generate_memory(monkeypatch):
    """benchmarks/bench_regions.py's summary, on runs shaped as its children write them."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_regions

    def run(losses, generate_gib, step_s):
        return {"losses": losses, "step_s": {"median": step_s, "first": 2 * step_s},
                "device_used_generate_bytes": [generate_gib * 2**30] * 3, "device_used_train_bytes": [30 * 2**30] * 3,
                "switch_steps": {"pause regions": {"median_s": 0.01}, "offload optimizer": {"median_s": 0.1}}}

    s = bench_regions.summarize({"eager": run([3.0, 2.5], 9, 0.15), "graph": run([3.0, 2.0], 19, 0.1),
                                 "region": run([3.0, 2.1], 9.5, 0.1)})
    assert s["generate_GiB_released_by_region"] == pytest.approx(9.5)
    assert s["graph_step_speedup_over_eager"] == pytest.approx(1.5)
    assert not s["graph_and_region_losses_equal"] and s["graph_and_region_first_differing_step"] == 1
    assert s["region"]["switch_steps"] == {"pause regions": 0.01}
    assert bench_regions.summarize({"graph": None, "region": None}) == {"graph": None, "region": None}
