"""The memory planner (swaprl/plan.py, formulas in docs/plan.md): numbers users act on, and its error messages."""

import dataclasses
import json

import pytest

import swaprl.plan as sp
from swaprl.config import GRAD_POLICIES, PARAM_POLICIES, SwapConfig
from swaprl.presets import get_preset

GiB = 2**30
ROLLOUT = sp.Rollout(prompts=64, completions_per_prompt=8, prompt_tokens=512, completion_tokens=1024)


def close(actual: float, expected: float, rel: float = 0.01) -> bool:
    return abs(actual - expected) <= rel * abs(expected)


def test_72b_on_8xh200_fits_with_bf16_optimizer_states():
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, optimizer_dtype="bfloat16", rollout=ROLLOUT)
    n = 72.7e9
    assert p.ok and all(p.fits.values())
    assert close(p.parameters, n, 0.001)
    train, gen = p.gpu["train"], p.gpu["generate"]
    assert set(train) == set(gen) == set(sp.CATEGORIES)
    assert close(train["params"], n * 2 / 8)
    assert close(train["grads"], n * 2 / 8)
    assert close(train["optimizer"], n * 2 * 2 / 8)  # exp_avg + exp_avg_sq in bf16
    assert close(gen["engine_weights"], n * 2 / 4)  # TP 4
    assert gen["optimizer"] == 0 and train["engine_weights"] == train["kv_cache"] == 0
    assert train["unattributed"] == gen["unattributed"] == 0
    # train stays within the 92% cap; in generate the KV cache fills the GPU up to the engine's reserve, as a
    # VLLMEngine sizing itself does (3% of an H200 is more than 2 GiB)
    gpu = sp.CLUSTERS["8xH200"].gpu_memory_bytes
    assert sum(train.values()) <= p.gpu_budget_bytes["train"] == int(gpu * 0.92)
    assert sum(gen.values()) == p.gpu_budget_bytes["generate"] == gpu - int(0.03 * gpu)
    assert 40 * GiB < p.kv_cache_bytes < 100 * GiB
    # K and V, 80 layers, 8 KV heads / TP 4, head dim 128, bf16
    assert p.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2
    assert p.concurrent_sequences == p.kv_cache_bytes // (p.kv_bytes_per_token * 1536)
    assert p.sequences_per_engine == 512 // 2 and p.waves == 1
    # the optimizer states of the 8 GPUs are pinned on the node in generate
    assert p.host["generate"]["optimizer"] == 8 * train["optimizer"] == p.host_pinned_bytes
    assert p.settings == sp.Settings(grads="free", params="keep", sleep_level=2, activation_checkpointing=True)
    assert p.verdict.startswith("fits") and "checkpointing=on" in p.verdict
    # the search went from the least moving candidate up to the chosen one
    moved = [c.moved_bytes for c in p.candidates]
    assert moved == sorted(moved) and len(p.candidates) == 24
    assert not p.candidates[0].settings.activation_checkpointing and not all(p.candidates[0].fits.values())


def test_72b_with_fp32_states_overflows_one_8xh200_host_and_says_what_helps():
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT)
    assert not p.ok and p.settings is None
    assert p.fits == {"train": True, "generate": True, "host": False}
    assert close(p.host_pinned_bytes, 72.7e9 * 8)  # two fp32 states per parameter, all on one node
    assert "host needs" in p.verdict and "over by" in p.verdict
    assert any("optimizer_dtype='bfloat16'" in s for s in p.suggestions)
    assert any("nodes=2" in s for s in p.suggestions)
    assert "DOES NOT FIT" in p.table()


def test_72b_on_one_h100_does_not_fit_and_says_why():
    p = sp.plan("qwen2.5-72b", cluster="1xH100", rollout=ROLLOUT)
    assert not p.ok
    assert not p.fits["train"] and not p.fits["generate"] and not p.fits["host"]
    assert "train needs" in p.verdict and "generate needs" in p.verdict and "host needs" in p.verdict
    assert p.concurrent_sequences == 0 and p.waves is None and p.kv_cache_bytes == 0
    assert p.suggestions  # even if only "use a bigger cluster"
    table = p.table()
    assert "none fits" in table and "NO" in table


def test_1_5b_on_one_h100_fits_with_most_of_the_gpu_for_kv():
    p = sp.plan("qwen2.5-1.5b", cluster="1xH100", rollout=ROLLOUT)
    assert p.ok
    gpu = sp.CLUSTERS["1xH100"].gpu_memory_bytes
    assert p.kv_cache_bytes > 0.7 * gpu
    assert p.waves == 1 and p.concurrent_sequences >= 512
    # one GPU: nothing sharded, no FSDP buffers, optimizer states offloaded to host
    assert close(p.gpu["train"]["params"], get_preset("1.5b").num_parameters() * 2, 1e-9)
    assert p.host["generate"]["optimizer"] == p.gpu["train"]["optimizer"]


def test_generate_matches_a_measured_self_sized_vllm_engine():
    # benchmarks/results/grpo_vllm_qwen2.5-1.5b_h100 (H100, vLLM 0.26, engine built by VLLMEngine with its default
    # sizing): NVML showed 82,876,104,704 B used while generating, 480 MiB of it the driver's own, and vLLM
    # allocated a 70,150,520,832 B KV cache
    p = sp.plan("qwen2.5-1.5b", cluster="1xH100", param_dtype="float32", optimizer_dtype="float32",
                compute_dtype="float32", micro_batch_tokens=4608, settings={"activation_checkpointing": True},
                rollout=sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=64, completion_tokens=512))
    gpu = sp.CLUSTERS["1xH100"].gpu_memory_bytes
    assert p.gpu_budget_bytes["generate"] == gpu - int(0.03 * gpu)
    assert close(p.total("generate"), 82_876_104_704 - 480 * 2**20)
    assert close(p.kv_cache_bytes, 70_150_520_832)
    # a smaller reserve leaves the KV cache what it gives up
    p2 = sp.plan("qwen2.5-1.5b", cluster="1xH100", engine_reserve_bytes=2 * GiB, rollout=ROLLOUT)
    p3 = sp.plan("qwen2.5-1.5b", cluster="1xH100", rollout=ROLLOUT)
    assert p2.kv_cache_bytes - p3.kv_cache_bytes == int(0.03 * gpu) - 2 * GiB
    assert p2.inputs["engine_reserve_bytes"] == 2 * GiB


def test_accumulating_micro_batches_counts_the_head_gradient_formed_before_it_is_added():
    # 72B's shapes cut to 2 layers on one GPU, micro batches of one 768-token sequence: from the second micro batch
    # on, the lm_head's new bf16 gradient (V x h) is formed whole next to the logits, outweighing their backward
    m = get_preset("qwen2.5-72b")
    t, h, V, i = 768, m.hidden_size, m.vocab_size, m.intermediate_size
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=256, completion_tokens=512)
    p = sp.plan(m, layers=2, cluster="1xH100", optimizer_dtype="bf16", rollout=rollout,
                settings={"activation_checkpointing": False})
    layer = t * 2 * (10 * h + 2 * 8 * 128 + 4 * i)
    head = t * V * (2 * 2 + 4) + V * h * 2
    assert head > t * V * (2 + 12)  # the loss's own backward
    assert p.gpu["train"]["activations"] == 2 * layer + t * 2 * 4 * h + head


def test_72b_on_8xh100_needs_more_than_one_node():
    p = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT)
    assert not p.ok and not p.fits["train"]
    assert any("nodes=2" in s for s in p.suggestions)


def test_pinned_settings_restrict_the_search_and_level_1_pins_engine_weights_on_host():
    p = sp.plan("qwen2.5-7b", cluster="8xH100", tp=2, rollout=ROLLOUT, settings={"sleep_level": 1, "grads": "offload"})
    assert p.ok and p.settings.sleep_level == 1 and p.settings.grads == "offload"
    assert all(c.settings.sleep_level == 1 and c.settings.grads == "offload" for c in p.candidates)
    assert p.host["train"]["engine_weights"] == 8 * p.gpu["generate"]["engine_weights"]
    assert p.host["generate"]["grads"] == 8 * p.gpu["train"]["grads"]
    free = sp.plan("qwen2.5-7b", cluster="8xH100", tp=2, rollout=ROLLOUT)
    assert free.settings.sleep_level == 2 and free.host_pinned_bytes < p.host_pinned_bytes


def test_14b_on_one_h100_fits_only_with_the_optimizer_states_in_host_memory():
    """bf16 Qwen2.5-14B with AdamW: parameters, gradients and states (29.5 + 29.5 + 59 GB) overflow an 80 GB GPU in
    train whatever is swapped; with the states in host memory for good, train holds two staging chunks instead."""
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=256, completion_tokens=512)
    p = sp.plan("qwen2.5-14b", cluster="1xH100", optimizer_dtype="bfloat16", rollout=rollout)
    assert p.ok and p.settings.optimizer_states == "host"
    m = get_preset("qwen2.5-14b")
    states = m.num_parameters() * 2 * 2
    train = p.gpu["train"]
    # each staging chunk holds the largest parameter's states: the embedding, 152064 x 5120 x 2 states x 2 bytes
    assert train["optimizer"] == 2 * m.vocab_size * m.hidden_size * 4
    assert p.host["train"]["optimizer"] == p.host["generate"]["optimizer"] == states == p.host_pinned_bytes
    swapped = [c for c in p.candidates if c.settings.optimizer_states == "swap"]
    streamed = [c for c in p.candidates if c.settings.optimizer_states == "host"]
    assert len(swapped) == 24 and not any(all(c.fits.values()) for c in swapped)  # tried first, all overflow train
    assert p.candidates[:24] == swapped and len(streamed) == 24
    assert next(c for c in streamed if all(c.fits.values())).settings == p.settings
    assert streamed[0].moved_bytes == swapped[0].moved_bytes == 2 * states  # the same traffic as swapping
    assert "fits with optimizer states in host memory" in p.verdict and "optimizer_states=host" in p.table()
    assert sp.Plan.from_json(p.to_json()) == p


def test_host_resident_optimizer_states_are_not_planned_under_fsdp():
    p = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT)
    assert all(c.settings.optimizer_states == "swap" for c in p.candidates)
    with pytest.raises(ValueError, match=r"optimizer_states'\]='host' with shard_degree=8.*shard_degree=1"):
        sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT, settings={"optimizer_states": "host"})
    with pytest.raises(ValueError, match="optimizer_states='gpu'"):
        sp.plan("qwen2.5-7b", cluster="1xH100", rollout=ROLLOUT, settings={"optimizer_states": "gpu"})


def test_every_searched_setting_is_a_swapconfig_and_the_search_covers_its_values():
    p = sp.plan("qwen2.5-1.5b", cluster="1xH100", rollout=ROLLOUT)
    for c in p.candidates:
        st = c.settings
        SwapConfig(optimizer_states=st.optimizer_states, grads=st.grads, params=st.params, sleep_level=st.sleep_level)
    assert {c.settings.grads for c in p.candidates} == set(GRAD_POLICIES)
    assert {c.settings.params for c in p.candidates} == set(PARAM_POLICIES)


def test_kv_heads_are_replicated_when_tp_exceeds_them():
    # qwen2.5-1.5b: 2 KV heads; with TP 4 each rank still holds one
    p = sp.plan("qwen2.5-1.5b", cluster="8xH100", tp=4, rollout=ROLLOUT)
    assert p.kv_bytes_per_token == 2 * 28 * 1 * 128 * 2
    fp8 = sp.plan("qwen2.5-1.5b", cluster="8xH100", tp=4, kv_dtype="fp8", rollout=ROLLOUT)
    assert fp8.kv_bytes_per_token * 2 == p.kv_bytes_per_token


def test_reduced_depth_counts_only_the_kept_layers():
    p = sp.plan("qwen2.5-72b", cluster="1xH100", layers=2, rollout=ROLLOUT)
    assert p.layers == 2 and p.parameters == get_preset("72b").num_parameters(2)


def test_a_local_config_json_plans_like_its_preset(tmp_path):
    preset = get_preset("qwen2.5-72b")
    ckpt = tmp_path / "qwen72"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(preset.config_dict(bos_token_id=0, eos_token_id=1)))
    kwargs = {"cluster": "8xH200", "tp": 8, "optimizer_dtype": "bf16", "rollout": ROLLOUT}
    expected = sp.plan("qwen2.5-72b", **kwargs).to_dict()
    for source in (ckpt, ckpt / "config.json", str(ckpt)):
        got = sp.plan(source, **kwargs).to_dict()
        assert got.pop("model") == "qwen72"
        assert got == {k: v for k, v in expected.items() if k != "model"}


def test_a_written_checkpoint_plans_like_its_preset(tmp_path):
    pytest.importorskip("transformers")
    from swaprl.checkpoints import write_random_checkpoint

    path = write_random_checkpoint("tiny", tmp_path / "tiny")
    rollout = sp.Rollout(prompts=4, completions_per_prompt=2, prompt_tokens=16, completion_tokens=16)
    got, expected = (sp.plan(m, cluster="1xH100", rollout=rollout).to_dict() for m in (path, "tiny"))
    assert got.pop("model") == "tiny" and expected.pop("model") == "tiny"
    assert got == expected


def test_json_round_trip():
    for p in (sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, optimizer_dtype="bfloat16", rollout=ROLLOUT),
              sp.plan("qwen2.5-72b", cluster="1xH100", rollout=ROLLOUT)):
        text = p.to_json()
        data = json.loads(text)
        assert set(data["gpu"]) == {"train", "generate"} and data["kv_cache_bytes"] == p.kv_cache_bytes
        assert sp.Plan.from_json(text) == p


def _kv3_preset():
    return dataclasses.replace(get_preset("qwen2.5-7b"), name="kv3", num_attention_heads=12, num_key_value_heads=3,
                               hidden_size=12 * 128)


@pytest.mark.parametrize("kwargs, message", [
    ({"shard_degree": 3}, "must divide the 8 GPUs"),
    ({"tp": 16}, "must divide gpus_per_node=8"),
    ({"tp": 3}, "must divide gpus_per_node=8"),
    ({"model": "qwen2.5-7b", "tp": 8}, "does not divide qwen2.5-7b's 28 attention heads; use tp in [1, 2, 4]"),
    ({"model": _kv3_preset(), "tp": 2}, "KV heads divisible by tp"),
    ({"param_dtype": "fp12"}, "unknown dtype 'fp12'"),
    ({"optimizer": "adagrad"}, "unknown optimizer 'adagrad'"),
    ({"param_dtype": "float32", "master_weights": True}, "drop master_weights"),
    ({"model": "qwen9"}, "unknown model preset"),
    ({"model": "/nonexistent/dir"}, "no config.json at /nonexistent/dir"),
    ({"layers": 100}, "outside 1..80"),
    ({"gpu_utilization_cap": 1.5}, "must lie in (0, 1]"),
    ({"engine_reserve_bytes": -1}, "engine_reserve_bytes=-1 must lie in [0, gpu_memory_bytes="),
    ({"cluster": "4xA100"}, "unknown cluster '4xA100'"),
    ({"settings": {"sleep": 1}}, "unknown settings ['sleep']"),
    ({"settings": {"grads": "drop"}}, "grads='drop'; use one of free, keep, offload"),
    ({"settings": {"optimizer": "keep"}}, "can only be 'offload'"),
    ({"rollout": sp.Rollout(prompts=1, completions_per_prompt=1, prompt_tokens=32768, completion_tokens=1)},
     "exceeds qwen2.5-72b's max_position_embeddings=32768"),
])
def test_bad_inputs_name_the_fix(kwargs, message):
    args = {"model": "qwen2.5-72b", "cluster": "8xH200", "rollout": ROLLOUT, **kwargs}
    model = args.pop("model")
    with pytest.raises(ValueError) as info:
        sp.plan(model, **args)
    assert message in str(info.value)


def test_bad_dataclass_fields_raise():
    with pytest.raises(ValueError, match="Rollout.prompts must be a positive integer"):
        sp.Rollout(prompts=0, completions_per_prompt=8, prompt_tokens=1, completion_tokens=1)
    with pytest.raises(ValueError, match="Cluster.gpus_per_node"):
        sp.Cluster(gpus_per_node=0, gpu_memory_bytes=1, host_memory_bytes=1)


def test_cli_prints_a_table_or_json_and_returns_the_verdict(capsys):
    assert sp.main(["qwen2.5-1.5b", "--cluster", "1xH100", "--prompts", "8"]) == 0
    out = capsys.readouterr().out
    assert "per GPU (GiB)" in out and "kv_cache" in out and "verdict   fits" in out
    assert sp.main(["72b", "--cluster", "8xH200", "--tp", "4", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["settings"] is None and data["fits"]["host"] is False
    assert sp.main(["72b", "--cluster", "8xH200", "--tp", "4", "--optimizer-dtype", "bf16", "--sleep-level", "1",
                    "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["sleep_level"] == 1 and data["inputs"]["shard_degree"] == 16
    assert sp.main(["72b", "--tp", "3"]) == 2
    assert "error: tp=3 must divide gpus_per_node=8" in capsys.readouterr().err
