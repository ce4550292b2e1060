"""The memory planner (swaprl/plan.py, formulas in docs/plan.md): numbers users act on, and its error messages."""

import dataclasses
import json

import pytest

import swaprl.plan as sp
from swaprl.config import GRAD_POLICIES, PARAM_POLICIES, SwapConfig
from swaprl.homes import HOMES, by_fractions, totals
from swaprl.plan.formulas import parameter_elements
from swaprl.presets import get_preset

GiB = 2**30
ROLLOUT = sp.Rollout(prompts=64, completions_per_prompt=8, prompt_tokens=512, completion_tokens=1024)


def transformers_parameters(preset: str, layers: int | None = None) -> int:
    """The parameter count of the transformers model built from the preset's config, on the meta device: an
    independent reference for the planner's own count (`Preset.num_parameters`)."""
    import torch
    from transformers import AutoModelForCausalLM

    from swaprl.checkpoints import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(preset, layers=layers))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["tiny", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "qwen2.5-72b",
                                    "llama-3.1-8b", "llama-3.1-70b", "qwen3-8b", "qwen3-32b"])
def test_the_planners_parameter_count_is_the_transformers_models(preset):
    assert get_preset(preset).num_parameters() == transformers_parameters(preset)
    assert get_preset(preset).num_parameters(2) == transformers_parameters(preset, layers=2)
    assert sum(parameter_elements(get_preset(preset))) == get_preset(preset).num_parameters()


# Small configs of every architecture the planner reads, with the fields that change the count set both ways.
ARCHITECTURE_CONFIGS = {
    "llama, biased": {"model_type": "llama", "attention_bias": True, "mlp_bias": True},
    "mistral": {"model_type": "mistral", "head_dim": 48},
    "qwen3": {"model_type": "qwen3", "head_dim": 48},
    "gemma2": {"model_type": "gemma2", "head_dim": 48},
    "gemma3": {"model_type": "gemma3_text", "head_dim": 48},
    "phi3": {"model_type": "phi3", "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 1},
}


@pytest.mark.parametrize("name", list(ARCHITECTURE_CONFIGS))
def test_a_config_json_of_each_architecture_is_counted_as_transformers_builds_it(name, tmp_path):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = {"hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 3, "num_attention_heads": 8,
              "num_key_value_heads": 2, "vocab_size": 1000, **ARCHITECTURE_CONFIGS[name]}
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    planned = sp.load_model(tmp_path)
    assert planned.num_parameters() == sum(p.numel() for p in model.parameters()), name
    # the split homes parameters in the optimizer's order: the planner's list of them is transformers' own
    assert parameter_elements(planned) == [p.numel() for p in model.parameters()], name
    assert sp.main([str(tmp_path), "--cluster", "1xH100", "--prompts", "4", "--prompt-tokens", "32",
                    "--completion-tokens", "32", "--json"]) == 0


def test_the_commands_a_new_user_types_answer(tmp_path, capsys):
    assert sp.main(["qwen2.5-72b", "--cluster", "8xH200"]) == 0  # --tp auto finds a size that fits
    out = capsys.readouterr().out
    assert out.startswith("verdict   fits") and "\ntp        auto: tp=" in out
    assert sp.main(["llama-3.1-70b", "--cluster", "8xH100", "--json"]) in (0, 1)
    data = json.loads(capsys.readouterr().out)
    assert data["model"] == "llama-3.1-70b" and data["verdict"] and data["inputs"]["tp_auto"]["chosen"] in (1, 2, 4, 8)
    assert sp.main(["qwen2.5-7b", "--cluster", "2xH100"]) == 0
    assert "cluster   1 x 2 GPUs of 79.18 GiB, host 256.00 GiB per node" in capsys.readouterr().out
    qwen3 = tmp_path / "qwen3"
    qwen3.mkdir()
    (qwen3 / "config.json").write_text(json.dumps(get_preset("qwen3-8b").config))
    assert sp.main([str(qwen3), "--cluster", "1xH100", "--prompts", "8"]) == 0
    assert sp.main(["meta-llama/Llama-3.1-8B-Instruct", "--cluster", "1xH200", "--prompts", "8"]) == 0
    assert sp.main(["someone/unknown-model"]) == 2
    assert "reads no hub" in capsys.readouterr().err


def test_tp_auto_picks_the_size_with_the_lowest_predicted_step_cost():
    """`--tp auto` plans every size and keeps the fitting one whose step costs least by §Cost: the rollout's decode
    (each step reads one rank's weights and its sequences' KV cache at the GPU's memory bandwidth), the PCIe copies
    and the weight sync. For 72B on 8xH200 every size from 2 fits; TP 8 reads the least weights per rank, and its
    smaller engine weights leave the most room for states on the device."""
    for precision in ("bf16", "fp32-params"):  # the command's default precision is fp32-params here
        auto = sp.plan("qwen2.5-72b", cluster="8xH200", rollout=ROLLOUT, precision=precision)
        sizes = {tp: sp.plan("qwen2.5-72b", cluster="8xH200", tp=tp, rollout=ROLLOUT, precision=precision)
                 for tp in (1, 2, 4, 8)}
        fitting = {tp: p for tp, p in sizes.items() if p.ok}
        assert set(fitting) == {2, 4, 8} and fitting[4].waves == fitting[8].waves == 1, precision
        for tp, p in fitting.items():  # the cost recomputed from what each plan reports
            weights, bandwidth = p.gpu["generate"]["engine_weights"], 4.8e12  # the H200 datasheet's
            kv_read = p.sequences_per_engine * p.kv_bytes_per_token * (512 + 1024 / 2)
            assert p.step_cost["decode_s"] == pytest.approx(1024 * (p.waves * weights + kv_read) / bandwidth)
            assert p.step_cost["copies_s"] == p.copy_seconds and p.step_cost["sync_s"] == 2 * weights / bandwidth
            assert p.step_cost["total_s"] == pytest.approx(sum(v for k, v in p.step_cost.items() if k != "total_s"))
        cheapest = min(fitting, key=lambda tp: fitting[tp].step_cost["total_s"])
        assert auto.inputs["tp_auto"]["chosen"] == auto.inputs["tp"] == cheapest == 8, precision
        assert auto.step_cost == fitting[8].step_cost and auto.settings == fitting[8].settings
        why = auto.inputs["tp_auto"]["why"]
        assert why.startswith("tp=8: of the sizes that fit, the lowest predicted step cost")
        assert all(term in why for term in ("rollout decode", "PCIe copies", "weight sync"))
        assert (f"tp=4 fits, {fitting[4].kv_cache_bytes / GiB:.1f} GiB of KV per GPU, one wave, "
                f"{fitting[4].step_cost['total_s']:.2f} s") in auto.table()
        assert "\ncost      " in auto.table() and sizes[1].step_cost is None


def test_precision_auto_keeps_the_precise_mode_that_fits_with_the_lowest_predicted_step_cost(capsys):
    """RL fine-tuning at lr ~1e-6 needs fp32 weights: by default the planner compares fp32 masters beside bf16
    parameters (`master-weights`, the masters homed with their states) and fp32 FSDP2 shards under bf16 compute
    (`fp32-params`), and keeps the cheaper that fits; bf16 parameters updated in place only when asked."""
    auto = sp.plan("qwen2.5-72b", cluster="8xH200", rollout=ROLLOUT)
    modes = {m: sp.plan("qwen2.5-72b", cluster="8xH200", rollout=ROLLOUT, precision=m)
             for m in ("master-weights", "fp32-params")}
    assert all(p.ok for p in modes.values())
    cheapest = min(modes, key=lambda m: modes[m].step_cost["total_s"])
    assert auto.precision == auto.inputs["precision"] == auto.inputs["precision_auto"]["chosen"] == cheapest
    assert cheapest == "fp32-params" and auto.step_cost == modes[cheapest].step_cost
    # the same decode at TP 8 in one wave; the masters' 12 bytes per parameter with the states swap and stream more
    assert modes["fp32-params"].step_cost["decode_s"] == modes["master-weights"].step_cost["decode_s"]
    assert modes["fp32-params"].copy_seconds < modes["master-weights"].copy_seconds
    why = auto.inputs["precision_auto"]["why"]
    assert why.startswith("fp32-params (fp32 parameter shards and float32 gradients, bfloat16 compute): of the "
                          "precise modes that fit, the lowest predicted step cost")
    assert "mostly in the PCIe copies" in why
    assert auto.inputs["param_dtype"] == "float32" and not auto.inputs["master_weights"]
    assert "master_weights" not in auto.swap_config()
    assert modes["master-weights"].swap_config()["master_weights"] is True
    # the command line says it first, under the verdict, with what each mode gave
    assert sp.main(["qwen2.5-72b", "--cluster", "8xH200"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith(f"precision auto: {why}; fp32-params fits at tp=8")
    assert "master-weights fits at tp=8" in lines[1] and "fp32 parameters (--param-dtype" not in "\n".join(lines)
    assert "params float32, grads float32, adamw states float32" in "\n".join(lines)
    assert sp.Plan.from_json(auto.to_json()) == auto
    # the explicit flags pin the mode they name; bf16 only when asked, and its table says what it loses
    assert sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, master_weights=True).precision \
        == "master-weights"
    assert sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, param_dtype="float32").precision \
        == "fp32-params"
    bf16 = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, param_dtype="bfloat16")
    assert bf16.precision == "bf16" and "precision_auto" not in bf16.inputs
    assert "precision bf16 (as asked): bfloat16 parameters updated in place, no fp32 copy; updates below" in bf16.table()
    assert bf16.full_precision.startswith("param_dtype=float32")  # what the same step needs with fp32 parameters
    assert sp.main(["qwen2.5-72b", "--cluster", "8xH200", "--tp", "4", "--precision", "bf16", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["precision"] == "bf16"


def test_72b_on_8xh200_tp4_fits_with_fp32_masters_and_16_gib_of_kv_cache(capsys):
    """`swaprl plan qwen2.5-72b --cluster 8xH200 --tp 4 --master-weights` said "nothing fits ... host needs 812.56
    of 456.00 GiB pinned per node" while the masters were kept in host memory only: homed with their states, the
    device keeps what the host cannot hold, and the KV cache keeps more than 16 GiB per GPU."""
    assert sp.main(["qwen2.5-72b", "--cluster", "8xH200", "--tp", "4", "--master-weights", "--json"]) == 0
    p = sp.Plan.from_json(capsys.readouterr().out)
    homes = assert_split_fits(p)
    assert p.precision == "master-weights" and p.kv_cache_bytes >= 16 * GiB and p.waves == 1
    assert all(homes.values()) and p.swap_config()["master_weights"] is True


def test_the_docs_quote_what_the_default_command_prints():
    """docs/plan.md's figures for `swaprl plan qwen2.5-72b --cluster 8xH200` are the ones it prints."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "plan.md").read_text()
    p = sp.plan("qwen2.5-72b", cluster="8xH200", rollout=ROLLOUT)
    assert p.precision == "fp32-params" and p.inputs["tp"] == 8
    intro = doc[doc.index("With the defaults (`--precision auto`"):doc.index("The exit status")]
    assert f"keeps {p.settings.optimizer_states['device']:.0%}" in intro and "vLLM at TP 8" in intro
    assert f"{p.kv_cache_bytes / GiB:.2f} GiB of KV cache per GPU" in intro
    assert f"{p.moved_bytes / GiB:.2f} GiB over PCIe" in intro
    costs = {tp: sp.plan("qwen2.5-72b", cluster="8xH200", rollout=ROLLOUT, tp=tp).step_cost["total_s"]
             for tp in (2, 4, 8)}
    assert f"The predicted costs are {costs[2]:.2f}, {costs[4]:.2f} and {costs[8]:.2f} s." in doc


@pytest.mark.parametrize("kwargs, message", [
    ({"precision": "fp64"}, "precision='fp64'; use one of auto, master-weights, fp32-params, bf16"),
    ({"precision": "bf16", "master_weights": True}, "precision='bf16' but master_weights=True asks for"),
    ({"precision": "fp32-params", "param_dtype": "bf16"}, "param_dtype='bfloat16' asks for 'bf16'; drop one"),
    ({"precision": "master-weights", "param_dtype": "float32"}, "asks for 'fp32-params'"),
])
def test_a_precision_the_other_flags_contradict_names_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=None) as info:
        sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, **kwargs)
    assert message in str(info.value)


@pytest.mark.parametrize("config, message", [
    ([1, 2], "holds a list"),
    ({"model_type": "llama", "hidden_size": "4096"}, "hidden_size='4096'"),
    ({"model_type": "llama", "num_hidden_layers": 0}, "num_hidden_layers=0"),
    ({"model_type": "mixtral", "num_local_experts": 8}, "mixture-of-experts"),
    ({"model_type": "llava", "text_config": {}}, "multimodal"),
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not a dense decoder the planner knows"),
])
def test_a_config_json_the_planner_cannot_read_is_refused_naming_why(tmp_path, capsys, config, message):
    base = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
            "vocab_size": 100}
    body = {**base, **config} if isinstance(config, dict) and "text_config" not in config else config
    (tmp_path / "config.json").write_text(json.dumps(body))
    assert sp.main([str(tmp_path), "--cluster", "1xH100"]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["llama3-8b"], "did you mean llama-3-8b?"),
    (["qwen2.5-7b", "--micro-batch-tokens", "100"], "less than one sequence"),
    (["qwen2.5-7b", "--cluster", "8xH100", "--shard-degree", "3"], "shard_degree=3 must divide"),  # not a TP error
    (["qwen2.5-7b", "--host-memory-gib", "inf"], "--host-memory-gib inf"),
])
def test_bad_command_lines_name_the_fix(capsys, args, message):
    assert sp.main(args) == 2
    err = capsys.readouterr().err
    assert message in err and "tensor-parallel size" not in err


def test_the_command_line_ends_quietly_on_a_closed_pipe_and_says_its_version():
    import subprocess
    import sys

    from swaprl import __version__

    head = subprocess.run(f"{sys.executable} -m swaprl plan qwen2.5-72b --cluster 8xH200 --json | head -1",
                          shell=True, capture_output=True, text=True, timeout=120)
    assert head.stdout.strip() == "{" and "Traceback" not in head.stderr and "BrokenPipe" not in head.stderr
    version = subprocess.run([sys.executable, "-m", "swaprl", "--version"], capture_output=True, text=True, timeout=60)
    assert version.returncode == 0 and version.stdout.strip() == f"swaprl {__version__}"


@pytest.mark.parametrize("name, gpus, nodes, host_gib", [("2xH100", 2, 1, 256), ("16xH200", 8, 2, 1024),
                                                         ("8xA100", 8, 1, 1024), ("1xL40S", 1, 1, 128)])
def test_any_count_of_a_known_gpu_is_a_cluster(name, gpus, nodes, host_gib):
    c = sp.get_cluster(name)
    assert (c.gpus_per_node, c.nodes, c.host_memory_bytes) == (gpus, nodes, host_gib * GiB)


def test_the_named_clusters_keep_the_host_memory_of_the_machines_measured():
    assert sp.CLUSTERS["8xH100"].host_memory_bytes == 1024 * GiB
    assert sp.CLUSTERS["8xH200"].host_memory_bytes == 560 * GiB


def close(actual: float, expected: float, rel: float = 0.01) -> bool:
    return abs(actual - expected) <= rel * abs(expected)


def state_sizes(p: sp.Plan) -> list[int]:
    """Each parameter's states on one GPU, for a plan whose shard degree divides every parameter (as FSDP2 shards
    72B's over 8 ranks): its elements' share times the bytes per parameter of its states."""
    per = {"adamw": 2, "adam": 2, "sgd": 1, "lion": 1}[p.inputs["optimizer"]] * (
        4 if p.inputs["optimizer_dtype"] == "float32" else 2) + 4 * p.inputs["master_weights"]
    elements = parameter_elements(dataclasses.replace(get_preset(p.model), num_hidden_layers=p.layers))
    shard = p.inputs["shard_degree"]
    assert all(n % shard == 0 for n in elements)
    return [n // shard * per for n in elements]


def assert_split_fits(p: sp.Plan, *, chosen: bool = True) -> dict[str, int]:
    """The three checks of the split, recomputed from the numbers the plan reports; the homes' bytes. A split the
    planner chose (`chosen`) gives each home exactly its fraction of the states; a pinned one whole parameters, each
    in the home its middle byte falls in, so that each home ends within half the largest parameter of its fraction."""
    homes, split = p.state_bytes, p.settings.optimizer_states
    states, gpn = sum(homes.values()), p.inputs["cluster"]["gpus_per_node"]
    assert set(homes) == set(split) == {"device", "swap", "host"} and abs(sum(split.values()) - 1) < 1e-9
    assert all(b >= 0 for b in homes.values())
    tolerance = 1 if chosen else max(state_sizes(p)) / 2
    edge, held = 0.0, 0
    for h in HOMES:
        edge, held = edge + split[h] * states, held + homes[h]
        assert abs(held - edge) <= tolerance, (h, held, edge)
    # generate: the device home stays on the GPU next to a KV cache of one whole sequence at least
    r = p.inputs["rollout"]
    assert p.gpu["generate"]["optimizer"] == homes["device"]
    assert p.total("generate") == p.gpu_budget_bytes["generate"]  # the engine sizes its KV cache to the rest
    assert p.kv_cache_bytes >= p.kv_bytes_per_token * -(-(r["prompt_tokens"] + r["completion_tokens"]) // 16) * 16
    # train: the device and swap homes resident, the host home through its staging chunks only
    staged = p.gpu["train"]["optimizer"] - homes["device"] - homes["swap"]
    if homes["host"] == 0:
        assert staged == 0
    else:  # all of it when one chunk holds it, else two chunks of 1 GiB or more, less than the host home
        assert staged == homes["host"] or (staged % 2 == 0 and 2**30 <= staged // 2 and staged < homes["host"])
    assert p.total("train") <= p.gpu_budget_bytes["train"]
    # host: every GPU of the node pins its swap and host homes, in one buffer kept over both phases
    assert p.host["generate"]["optimizer"] == gpn * (homes["swap"] + homes["host"])
    assert p.host["train"]["optimizer"] == gpn * homes["host"]
    assert p.host_pinned_bytes == sum(max(p.host["train"][c], p.host["generate"][c]) for c in sp.HOST_CATEGORIES)
    assert p.host_pinned_bytes <= p.host_budget_bytes
    assert all(p.fits.values()) and p.ok
    # copies: swapped and streamed bytes cross twice per step, device bytes never; the streamed ones both ways at once
    assert p.moved_bytes >= 2 * (homes["swap"] + homes["host"])
    assert p.copy_seconds == pytest.approx((p.moved_bytes - homes["host"]) / p.inputs["cluster"]["copy_bytes_per_s"])
    return homes


def test_72b_on_8xh200_fits_with_bf16_optimizer_states():
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", optimizer_dtype="bfloat16", rollout=ROLLOUT)
    n = 72.7e9
    assert p.ok and all(p.fits.values())
    assert close(p.parameters, n, 0.001)
    train, gen = p.gpu["train"], p.gpu["generate"]
    assert set(train) == set(gen) == set(sp.CATEGORIES)
    assert close(train["params"], n * 2 / 8)
    assert close(train["grads"], n * 2 / 8)
    assert close(train["optimizer"], n * 2 * 2 / 8)  # exp_avg + exp_avg_sq in bf16
    assert close(gen["engine_weights"], n * 2 / 4)  # TP 4
    # every state stays on the device: beside them the KV cache still holds a full wave of the rollout
    assert gen["optimizer"] == train["optimizer"] and train["engine_weights"] == train["kv_cache"] == 0
    assert train["unattributed"] == gen["unattributed"] == 0
    # train stays within the 92% cap; in generate the KV cache fills the GPU up to the engine's reserve, as a
    # VLLMEngine sizing itself does (3% of an H200 is more than 2 GiB)
    gpu = sp.CLUSTERS["8xH200"].gpu_memory_bytes
    assert sum(train.values()) <= p.gpu_budget_bytes["train"] == int(gpu * 0.92)
    assert sum(gen.values()) == p.gpu_budget_bytes["generate"] == gpu - int(0.03 * gpu)
    # K and V, 80 layers, 8 KV heads / TP 4, head dim 128, bf16
    assert p.kv_bytes_per_token == 2 * 80 * 2 * 128 * 2
    wave = 256 * p.kv_bytes_per_token * 1536  # the engine's 256 sequences at once, each at full length
    assert p.kv_cache_bytes >= 1.25 * wave
    assert p.concurrent_sequences == p.kv_cache_bytes // (p.kv_bytes_per_token * 1536)
    assert p.sequences_per_engine == 512 // 2 and p.waves == 1
    # nothing is pinned on the node, nothing crosses PCIe
    assert p.host["generate"]["optimizer"] == 0 == p.host_pinned_bytes
    assert p.settings == sp.Settings(grads="free", params="keep", sleep_level=2, activation_checkpointing=True,
                                     optimizer_states={"device": 1.0, "swap": 0.0, "host": 0.0})
    assert p.swap_config() == {"optimizer_states": {"device": 1.0, "swap": 0.0, "host": 0.0}, "grads": "free",
                               "params": "keep", "sleep_level": 2}
    assert assert_split_fits(p) == {"device": train["optimizer"], "swap": 0, "host": 0}
    assert p.moved_bytes == 0 and p.copy_seconds == 0
    # swapping every state would give the engine a KV cache twice as large, for the same one wave, at the cost of
    # the states' copies out and back at every step
    swapped = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", optimizer_dtype="bfloat16",
                      rollout=ROLLOUT, settings={"optimizer_states": "swap"})
    assert swapped.ok and swapped.waves == p.waves == 1 and swapped.kv_cache_bytes > 1.7 * p.kv_cache_bytes
    assert swapped.moved_bytes == 2 * train["optimizer"]
    assert p.verdict.startswith("fits") and "checkpointing=on" in p.verdict
    # the search: the candidates that stream nothing first, each group from the least moving up, in units of the
    # largest parameter's states out and back (the embedding's shard: where a home's edge falls moves no more);
    # checkpointing off leaves too little of train for all the states, so those candidates stream and come last
    assert len(p.candidates) == 24 and p.candidates[0].settings == p.settings
    streams = [c.settings.optimizer_states["host"] > 0 for c in p.candidates]
    assert streams == sorted(streams) and not streams[0]
    grain = 2 * 152064 * 8192 * 4 // 8
    for group in (False, True):
        moved = [round(c.moved_bytes / grain) for c, s in zip(p.candidates, streams) if s == group]
        assert moved == sorted(moved)
    assert all(c.settings.optimizer_states["host"] > 0 for c in p.candidates if not c.settings.activation_checkpointing)


def test_72b_with_fp32_states_fits_one_8xh200_node_keeping_on_the_device_what_a_full_wave_leaves():
    """8 bytes of AdamW states per parameter are 542 GiB on the node, over its 456 GiB budget for pinned memory: each
    GPU keeps on the device what the host cannot hold and, more than that here, what generate holds beside a full
    wave of the rollout's KV cache, and swaps the rest."""
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT)
    homes = assert_split_fits(p)
    states = sum(homes.values())
    assert close(states, 72.7e9 * 8 / 8)
    assert p.host_budget_bytes == 560 * GiB - (56 * GiB + 8 * 6 * GiB)  # the margin: 10% + 6 GiB per GPU
    assert close(8 * states - p.host_budget_bytes, 85.7 * GiB)  # what the node cannot pin
    # the host alone would keep 17% on the device; beside a full wave of the rollout's KV cache and a quarter more,
    # generate holds the states of the parameters in order up to the first that does not fit: 63% of the bytes
    sizes = state_sizes(p)
    room = p.kv_cache_bytes + homes["device"] - 1.25 * 256 * p.kv_bytes_per_token * 1536
    kept = next(k for k in range(len(sizes)) if sum(sizes[:k + 1]) > room)
    assert homes == {"device": sum(sizes[:kept]), "swap": sum(sizes[kept:]), "host": 0}
    assert 0.17 < homes["device"] / states < 0.63 < (homes["device"] + sizes[kept]) / states
    assert homes["host"] == 0 and p.host_pinned_bytes < 0.5 * p.host_budget_bytes
    split = {h: n / states for h, n in homes.items()}
    assert p.settings.optimizer_states == split
    config = p.swap_config()
    assert config["optimizer_states"] == split and SwapConfig(**config).state_split() == split
    # the KV cache gives up the device share, and still holds the rollout in one wave, with a quarter to spare
    bf16 = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT,
                   settings={"optimizer_states": "swap"}, optimizer_dtype="bfloat16")
    assert p.kv_cache_bytes == bf16.kv_cache_bytes - homes["device"] and p.waves == 1
    assert p.kv_cache_bytes >= 1.25 * 256 * p.kv_bytes_per_token * 1536
    assert p.moved_bytes == 2 * homes["swap"]
    # it says so: the split, the KV cache and the bytes per step
    assert p.verdict.startswith("fits with optimizer states split")
    assert f"device={split['device']!r},swap={split['swap']!r};" in p.verdict
    assert f"{p.kv_cache_bytes / GiB:.2f} GiB of KV cache per GPU" in p.verdict
    assert f"{p.moved_bytes / GiB:.2f} GiB per GPU over PCIe per step" in p.verdict
    table = p.table()
    assert "states    per GPU device 42.62 GiB (0.63), swap 25.09 GiB (0.37), host 0.00 GiB (0.00)" in table
    assert "fewer than the model's context" not in table  # 500k tokens: any max_model_len fits
    assert f"copies    {p.moved_bytes / GiB:.2f} GiB per GPU per step" in table and "DOES NOT FIT" not in table
    assert sp.Plan.from_json(p.to_json()) == p


def test_72b_with_fp32_states_all_swapped_overflows_one_8xh200_host_and_says_what_helps():
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT,
                settings={"optimizer_states": "swap"})
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


def test_1_5b_on_one_h100_fits_with_its_states_on_the_device_and_most_of_the_gpu_for_kv():
    p = sp.plan("qwen2.5-1.5b", cluster="1xH100", precision="bf16", rollout=ROLLOUT)
    assert p.ok
    gpu = sp.CLUSTERS["1xH100"].gpu_memory_bytes
    assert p.kv_cache_bytes > 0.6 * gpu
    assert p.waves == 1 and p.concurrent_sequences >= 512
    # one GPU: nothing sharded, no FSDP buffers; the states stay on the device beside a full wave of KV cache
    assert close(p.gpu["train"]["params"], transformers_parameters("qwen2.5-1.5b") * 2, 1e-9)
    assert p.gpu["generate"]["optimizer"] == p.gpu["train"]["optimizer"] > 0 and p.host_pinned_bytes == 0


def test_generate_matches_a_measured_self_sized_vllm_engine():
    # benchmarks/results/grpo_vllm_qwen2.5-1.5b_h100 (H100, vLLM 0.26, engine built by VLLMEngine with its default
    # sizing): NVML showed 82,876,104,704 B used while generating, 480 MiB of it the driver's own, and vLLM
    # allocated a 70,150,520,832 B KV cache
    p = sp.plan("qwen2.5-1.5b", cluster="1xH100", param_dtype="float32", optimizer_dtype="float32",
                compute_dtype="float32", micro_batch_tokens=4608,
                settings={"activation_checkpointing": True, "optimizer_states": "swap"},  # as that run did
                rollout=sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=64, completion_tokens=512))
    gpu = sp.CLUSTERS["1xH100"].gpu_memory_bytes
    assert p.gpu_budget_bytes["generate"] == gpu - int(0.03 * gpu)
    assert close(p.total("generate"), 82_876_104_704 - 480 * 2**20)
    assert close(p.kv_cache_bytes, 70_150_520_832)
    # a smaller reserve leaves the KV cache what it gives up
    swap = {"optimizer_states": "swap"}
    p2 = sp.plan("qwen2.5-1.5b", cluster="1xH100", engine_reserve_bytes=2 * GiB, rollout=ROLLOUT, settings=swap)
    p3 = sp.plan("qwen2.5-1.5b", cluster="1xH100", rollout=ROLLOUT, settings=swap)
    assert p2.kv_cache_bytes - p3.kv_cache_bytes == int(0.03 * gpu) - 2 * GiB
    assert p2.inputs["engine_reserve_bytes"] == 2 * GiB


def test_accumulating_micro_batches_counts_the_head_gradient_formed_before_it_is_added():
    # 72B's shapes cut to 2 layers on one GPU, micro batches of one 768-token sequence: from the second micro batch
    # on, the lm_head's new bf16 gradient (V x h) is formed whole next to the logits, outweighing their backward
    m = get_preset("qwen2.5-72b")
    t, h, V, i = 768, m.hidden_size, m.vocab_size, m.intermediate_size
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=256, completion_tokens=512)
    p = sp.plan(m, layers=2, cluster="1xH100", precision="bf16", optimizer_dtype="bf16", rollout=rollout,
                settings={"activation_checkpointing": False})
    layer = t * 2 * (10 * h + 2 * 8 * 128 + 4 * i)
    head = t * V * (2 * 2 + 4) + V * h * 2
    assert head > t * V * (2 + 12)  # the loss's own backward
    assert p.gpu["train"]["activations"] == 2 * layer + t * 2 * 4 * h + head


def test_72b_on_8xh100_fits_one_node_by_streaming_most_states_each_rank_its_own_shard():
    """On 80 GB GPUs 72B's bf16 parameters and gradients leave train no room for a fifth of the fp32 states: FSDP2
    ranks stream the rest through the GPU, each its own shard's."""
    p = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT)
    homes = assert_split_fits(p)
    assert homes["device"] == 0 and 0 < homes["swap"] < homes["host"]
    # two staging chunks of 1 GiB: AdamW's step takes one rank's shard of the embedding's states (152064 x 8192 x
    # 8 B / 8 ranks, over 1 GiB) in pieces
    assert p.gpu["train"]["optimizer"] == homes["swap"] + 2 * GiB
    # generate runs no trainer forward (the check's probe is scored as training starts), yet 80 GB GPUs keep less KV
    # cache than the rollout's one wave needs
    assert p.gpu["generate"]["activations"] == 0 and p.waves > 1
    assert f"the rollout needs {p.waves} waves" in p.verdict
    assert p.moved_bytes == 2 * (homes["swap"] + homes["host"])
    assert p.copy_seconds == pytest.approx((2 * homes["swap"] + homes["host"]) / 36e9)
    # with every state swapped, train overflows; what helps is not to pin that
    swapped = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT, settings={"optimizer_states": "swap"})
    assert not swapped.ok and not swapped.fits["train"]
    assert swapped.suggestions == [f"would fit with no pinned settings ({p.settings.describe()})"]


def test_pinned_settings_restrict_the_search_and_level_1_pins_engine_weights_on_host():
    p = sp.plan("qwen2.5-7b", cluster="8xH100", tp=2, rollout=ROLLOUT, settings={"sleep_level": 1, "grads": "offload"})
    assert p.ok and p.settings.sleep_level == 1 and p.settings.grads == "offload"
    assert all(c.settings.sleep_level == 1 and c.settings.grads == "offload" for c in p.candidates)
    assert p.host["train"]["engine_weights"] == 8 * p.gpu["generate"]["engine_weights"]
    assert p.host["generate"]["grads"] == 8 * p.gpu["train"]["grads"]
    free = sp.plan("qwen2.5-7b", cluster="8xH100", tp=2, rollout=ROLLOUT)
    assert free.settings.sleep_level == 2 and free.host_pinned_bytes < p.host_pinned_bytes


def test_14b_on_one_h100_fits_only_with_most_optimizer_states_in_host_memory():
    """bf16 Qwen2.5-14B with AdamW: parameters, gradients and states (29.5 + 29.5 + 59 GB) overflow an 80 GB GPU in
    train whatever is swapped; the states train has no room for stay in host memory for good, and train holds two
    staging chunks instead."""
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=256, completion_tokens=512)
    p = sp.plan("qwen2.5-14b", cluster="1xH100", precision="bf16", optimizer_dtype="bfloat16", rollout=rollout)
    homes = assert_split_fits(p)
    m = get_preset("qwen2.5-14b")
    states = m.num_parameters() * 2 * 2
    # of what train holds, generate keeps beside a full wave of KV cache about half, and swaps the rest
    assert sum(homes.values()) == states and 0 < homes["device"] and 0 < homes["swap"] < 0.2 * states
    assert p.settings.optimizer_states["host"] >= 0.8 and p.waves == 1
    train = p.gpu["train"]
    # two staging chunks of 1 GiB: the embedding's states (152064 x 5120 x 2 states x 2 bytes) go in pieces
    assert train["optimizer"] == homes["device"] + homes["swap"] + 2 * GiB
    # the swapped share takes what train has left beside them, to the percent
    assert p.gpu_budget_bytes["train"] - p.total("train") < 0.01 * states + m.vocab_size * m.hidden_size * 2
    assert p.host["train"]["optimizer"] == homes["host"]
    assert p.host["generate"]["optimizer"] == states - homes["device"] == p.host_pinned_bytes
    # no candidate fits without streaming, and every one moves the states off the device out and back once per step
    assert len(p.candidates) == 24 and all(c.settings.optimizer_states["host"] > 0 for c in p.candidates)
    assert p.candidates[0].moved_bytes == p.moved_bytes == 2 * (states - homes["device"])
    assert "fits with optimizer states split" in p.verdict and "optimizer_states=device=0." in p.table()
    assert sp.Plan.from_json(p.to_json()) == p
    # all of them streamed, pinned: as before the split, two staging chunks on the GPU
    host = sp.plan("qwen2.5-14b", cluster="1xH100", precision="bf16", optimizer_dtype="bfloat16", rollout=rollout,
                   settings={"optimizer_states": "host"})
    assert host.ok and host.swap_config()["optimizer_states"] == "host"
    assert host.gpu["train"]["optimizer"] == 2 * GiB
    assert host.host["train"]["optimizer"] == states and "fits with optimizer states in host memory" in host.verdict
    assert "optimizer_states=host" in host.table()


def test_fsdp_trainers_may_stream_their_states_and_bad_homes_name_the_fix():
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT, optimizer_dtype="bfloat16",
                settings={"optimizer_states": "host"})
    assert p.ok and p.inputs["shard_degree"] == 8
    assert all(c.settings.optimizer_states == {"device": 0.0, "swap": 0.0, "host": 1.0} for c in p.candidates)
    # each staging chunk holds 1 GiB: more than one rank's shard of the embedding's states (152064 x 8192 x 4 B / 8)
    assert p.gpu["train"]["optimizer"] == 2 * GiB
    fp32 = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, precision="bf16", rollout=ROLLOUT,
                   settings={"optimizer_states": "host"})
    assert fp32.gpu["train"]["optimizer"] == 2 * GiB  # the shard's states, over 1 GiB, go in pieces
    # an optimizer the streamed step cannot slice (Lion) holds the largest parameter's states in each chunk
    lion = sp.plan("qwen2.5-14b", cluster="1xH100", precision="bf16", rollout=ROLLOUT, optimizer="lion",
                   settings={"optimizer_states": "host"})
    m = get_preset("qwen2.5-14b")
    assert lion.gpu["train"]["optimizer"] == 2 * m.vocab_size * m.hidden_size * 4  # one fp32 state, over 1 GiB
    with pytest.raises(ValueError, match="optimizer_states='gpu'"):
        sp.plan("qwen2.5-7b", cluster="1xH100", rollout=ROLLOUT, settings={"optimizer_states": "gpu"})


def test_a_pinned_split_is_planned_as_given():
    split = {"device": 0.25, "swap": 0.5, "host": 0.25}
    p = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT,
                settings={"optimizer_states": split})
    homes = assert_split_fits(p, chosen=False)
    assert p.settings.optimizer_states == split and p.swap_config()["optimizer_states"] == split
    assert all(c.settings.optimizer_states == split for c in p.candidates)
    assert p.inputs["pinned_settings"] == {"optimizer_states": split}
    # the bytes the runtime puts in each home: whole parameters, each where its middle byte falls
    sizes = state_sizes(p)
    assert homes == totals(sizes, by_fractions(sizes, split))
    assert "optimizer_states=device=0.25,swap=0.5,host=0.25" in p.verdict


def test_less_host_memory_keeps_more_states_on_the_device_until_none_fits(capsys):
    def planned(host_gib: int, *extra: str) -> tuple[int, dict]:
        rc = sp.main(["qwen2.5-72b", "--cluster", "8xH200", "--tp", "4", "--host-memory-gib", str(host_gib),
                      *(extra or ("--precision", "bf16")), "--json"])
        return rc, json.loads(capsys.readouterr().out)

    shares, kv = [], []
    for host in (560, 200, 100):  # 560: a full wave of KV cache sets the device share; less host memory raises it
        rc, data = planned(host)
        p = sp.Plan.from_dict(data)
        assert rc == 0 and p.inputs["cluster"]["host_memory_bytes"] == host * GiB
        assert_split_fits(p)
        shares.append(p.settings.optimizer_states["device"])
        kv.append(p.kv_cache_bytes)
    assert shares[0] < shares[1] < shares[2] < 1.0 and kv[0] > kv[1] > kv[2]
    assert p.waves > 1 and f"the rollout needs {p.waves} waves" in p.verdict
    # with bf16 parameters generate holds every state beside the engine: with too little host memory to pin any,
    # they all stay on the device, at the cost of KV cache, and nothing crosses PCIe
    rc, data = planned(20)
    p = sp.Plan.from_dict(data)
    assert rc == 0 and p.settings.optimizer_states == {"device": 1.0, "swap": 0.0, "host": 0.0}
    assert p.moved_bytes == 0 and p.kv_cache_bytes < kv[2]
    # fp32 master weights leave train too little room for the share 200 GiB of host memory would need on the device
    rc, data = planned(200, "--param-dtype", "float32")
    p = sp.Plan.from_dict(data)
    assert rc == 1 and p.fits == {"train": True, "generate": True, "host": False}
    assert p.verdict.startswith("nothing fits") and "host needs" in p.verdict and "train needs" not in p.verdict
    assert p.host_budget_bytes == 200 * GiB - (20 * GiB + 48 * GiB)


def test_fp32_master_weights_are_planned_16_bytes_per_parameter():
    """FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16) over fp32 shards: fp32 parameters, gradients and AdamW
    states, 16 bytes per parameter sharded; bf16 unsharded parameters in forward and backward."""
    n = transformers_parameters("qwen2.5-72b")
    fp32 = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, param_dtype="float32")
    homes = assert_split_fits(fp32)
    train = fp32.gpu["train"]
    assert fp32.inputs["grad_dtype"] == "float32" and fp32.inputs["compute_dtype"] == "bfloat16"
    assert train["params"] + train["grads"] + sum(homes.values()) == -(-n * 4 // 8) * 2 + n * 8 // 8
    assert homes["device"] > 0 and homes["swap"] > 0 and homes["host"] > 0  # all three homes at once
    # FSDP's unsharded parameters are in the compute dtype whatever the shards' dtype; only the unsharded gradients
    # (one layer's and the root's) grow with the fp32 gradients
    m = get_preset("qwen2.5-72b")
    h, kv_dim = m.hidden_size, m.num_key_value_heads * m.head_dim
    layer = 2 * h * h + h + 2 * (h * kv_dim + kv_dim) + 3 * h * m.intermediate_size + 2 * h
    root = 2 * m.vocab_size * h + h
    bf16 = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT)
    assert train["activations"] - bf16.gpu["train"]["activations"] == (layer + root) * (4 - 2)
    # the default plan (bf16 parameters, fp32 states) says what fits with fp32 parameters: this plan
    assert bf16.full_precision.startswith("param_dtype=float32 (16 B per parameter with the states")
    assert fp32.settings.describe() in bf16.full_precision and "fits with" in bf16.full_precision
    assert f"{fp32.kv_cache_bytes / GiB:.2f} GiB of KV cache" in bf16.full_precision
    assert f"fp32 parameters (--param-dtype float32): {bf16.full_precision}" in bf16.table()
    assert fp32.full_precision is None
    # a separate fp32 master copy of bf16 parameters is 16 bytes per parameter too, 12 of them with the states:
    # 812 GiB per node, more than the 8xH200 preset's 560 can pin. Each master lives with its parameter's states,
    # where the policy homes them: on the device what the host cannot hold, to the end of the parameter that
    # reaches it, then swapped what train holds beside two staging chunks, the rest streamed
    master = sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, master_weights=True)
    homes = assert_split_fits(master)
    states = sum(homes.values())
    assert close(states, n * 12 / 8, 1e-6) and 8 * states > 1.7 * master.host_budget_bytes
    sizes = state_sizes(master)
    kept = next(k for k in range(len(sizes)) if sum(sizes[:k]) >= states - master.host_budget_bytes // 8)
    assert homes["device"] == sum(sizes[:kept]) and homes["swap"] > 0 and homes["host"] > 0
    assert master.kv_cache_bytes >= 16 * GiB and master.waves == 1 and master.full_precision is None
    assert master.gpu["train"]["optimizer"] == homes["device"] + homes["swap"] + 2 * GiB


def test_72b_with_fp32_master_weights_fits_8xh100_with_most_masters_in_host_memory():
    """The mission's target with what RL fine-tuning needs: bf16 parameters and gradients on the GPUs, the fp32
    masters with their AdamW states swapped where train has room beside two staging chunks and the rest in the
    8xH100 preset's 1024 GiB of host memory, at least 16 GiB of KV cache per GPU; the SwapConfig it gives is what
    the runtime runs."""
    p = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT, master_weights=True)
    homes = assert_split_fits(p)
    assert p.ok and p.kv_cache_bytes >= 16 * GiB
    assert homes["device"] == 0 and 0 < homes["swap"] < homes["host"]  # 80 GB: generate has no room beside KV
    assert p.swap_config() == {"optimizer_states": p.settings.optimizer_states, "grads": p.settings.grads,
                               "params": "keep", "sleep_level": p.settings.sleep_level, "master_weights": True}
    assert SwapConfig(**p.swap_config()).master_weights
    # a split pinned with masters is planned as given: they live with their states in any home
    pinned = sp.plan("qwen2.5-72b", cluster="8xH100", tp=4, rollout=ROLLOUT, master_weights=True,
                     settings={"optimizer_states": {"device": 0.1, "swap": 0.0, "host": 0.9}})
    assert pinned.shown.optimizer_states == {"device": 0.1, "swap": 0.0, "host": 0.9}


def test_a_share_of_a_node_uses_all_three_homes_and_every_candidate_is_a_swapconfig():
    """20 of 72B's layers on two GPUs of a node with 70 GiB of host memory each (`--gpus-per-node 2
    --host-memory-gib 140 --layers 20 --tp 1`): the host holds too little, and train too little beside the
    un-checkpointed activations: some states on the device, some swapped, the rest streamed."""
    cluster = dataclasses.replace(sp.get_cluster("8xH200"), gpus_per_node=2, host_memory_bytes=140 * GiB)
    p = sp.plan("qwen2.5-72b", cluster=cluster, layers=20, precision="bf16", rollout=ROLLOUT)
    homes = assert_split_fits(p)
    assert all(homes.values()) and not p.settings.activation_checkpointing
    assert p.host_budget_bytes == 140 * GiB - (14 * GiB + 2 * 6 * GiB)
    for c in p.candidates:
        config = SwapConfig(**c.settings.swap_config())
        assert config.state_split() == c.settings.optimizer_states


def test_the_printed_split_gives_the_runtime_the_homes_the_planner_chose():
    """The planner decides whole parameters' homes (`homes.decide`) and prints their fractions; the runtime reads
    them back (`parse_optimizer_states`, `SwapConfig`) and homes each rank's FSDP2 shards by the middle-byte rule
    (`homes.by_fractions` on the parameters' bytes): the same parameters land in the same homes, to the byte."""
    import torch
    from transformers import AutoModelForCausalLM

    from swaprl.checkpoints import hf_config
    from swaprl.config import format_optimizer_states, parse_optimizer_states

    share = dataclasses.replace(sp.get_cluster("8xH200"), gpus_per_node=2, host_memory_bytes=140 * GiB)
    plans = [sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT),
             sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="master-weights", rollout=ROLLOUT),
             sp.plan("qwen2.5-72b", cluster=share, layers=20, precision="bf16", rollout=ROLLOUT)]
    for p in plans:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config("qwen2.5-72b", layers=p.layers), dtype=torch.bfloat16)
        shard = p.inputs["shard_degree"]
        # rank 0's shard of each parameter, as FSDP2 cuts them: dim 0 in `shard` chunks
        local = [-(-q.shape[0] // shard) * q[0].numel() * q.element_size() for q in model.parameters()]
        printed = format_optimizer_states(p.swap_config()["optimizer_states"])
        assert f"optimizer_states={printed}" in p.settings.describe() and printed in p.settings.label()
        split = SwapConfig(optimizer_states=parse_optimizer_states(printed)).state_split()
        # every digit of the fractions comes back: an edge after a small parameter (a norm, a bias) would move it
        # into the next home were the fraction rounded by more than half of it
        assert split == p.settings.optimizer_states
        runtime = by_fractions(local, split)
        # the homes are runs in order: the same bytes in each are the same parameters
        assert totals(state_sizes(p), runtime) == p.state_bytes, p.inputs["cluster"]["gpus_per_node"]
    assert all(plans[1].state_bytes.values()) and all(plans[2].state_bytes.values())  # three homes, two edges


def test_small_models_keep_their_states_on_the_device_unless_the_rollout_needs_the_room():
    """Beside a full wave of the rollout's KV cache (and a quarter more) generate holds all or most of a small
    model's states: they stay on the device and cross PCIe no more. A rollout whose wave takes the GPU swaps them
    all, as every such model planned before."""
    long = sp.Rollout(prompts=512, completions_per_prompt=8, prompt_tokens=1024, completion_tokens=8192)
    for model, cluster, tp in (("qwen2.5-0.5b", "1xH100", 1), ("qwen2.5-1.5b", "1xH100", 1),
                               ("qwen2.5-3b", "1xH100", 1), ("qwen2.5-7b", "1xH200", 1),
                               ("qwen2.5-7b", "8xH100", 2), ("qwen2.5-32b", "8xH200", 4)):
        p = sp.plan(model, cluster=cluster, tp=tp, precision="bf16", rollout=ROLLOUT)
        homes = assert_split_fits(p)
        assert homes["host"] == 0 and homes["device"] > 3 * homes["swap"], (model, cluster, p.settings)
        wave = min(p.sequences_per_engine, p.inputs["engine_max_seqs"]) * p.kv_bytes_per_token * 1536
        assert p.waves == 1 and p.kv_cache_bytes >= 1.25 * wave, (model, cluster)
        assert p.moved_bytes == 2 * homes["swap"]
        p = sp.plan(model, cluster=cluster, tp=tp, precision="bf16", rollout=long)
        homes = assert_split_fits(p)
        assert p.swap_config()["optimizer_states"] == "swap", (model, cluster, p.settings)
        assert homes["device"] == homes["host"] == 0 and p.gpu["generate"]["optimizer"] == 0, model
        assert "optimizer_states" not in p.settings.describe() and p.verdict.startswith("fits with optimizer offload")


def test_a_kv_cache_shorter_than_the_models_context_says_which_max_model_len_the_engine_can_take():
    """A KV cache sized to a short rollout may not hold one sequence of the model's whole context, which vLLM's
    default max_model_len asks for: the table says so, with the tokens it holds."""
    p = sp.plan("qwen2.5-32b", cluster="8xH100", tp=2,
                rollout=sp.Rollout(prompts=16, completions_per_prompt=8, prompt_tokens=128, completion_tokens=512))
    held = p.kv_cache_bytes // p.kv_bytes_per_token
    assert p.ok and p.waves == 1 and 640 < held < get_preset("qwen2.5-32b").max_position_embeddings
    assert f"it holds {held} tokens, fewer than the model's context: start the engine with max_model_len" in p.table()
    assert sp.Plan.from_json(p.to_json()).table() == p.table()


def test_every_searched_setting_is_a_swapconfig_and_the_search_covers_its_values():
    p = sp.plan("qwen2.5-1.5b", cluster="1xH100", rollout=ROLLOUT)
    for c in p.candidates:
        config = SwapConfig(**c.settings.swap_config())
        assert config.state_split() == c.settings.optimizer_states and config.grads == c.settings.grads
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
    assert p.layers == 2 and p.parameters == transformers_parameters("qwen2.5-72b", layers=2)


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
    ({"cluster": "4xV100"}, "unknown cluster '4xV100'"),
    ({"settings": {"sleep": 1}}, "unknown settings ['sleep']"),
    ({"settings": {"grads": "drop"}}, "grads='drop'; use one of free, keep, offload"),
    ({"settings": {"optimizer": "keep"}}, "can only be 'offload'"),
    ({"settings": {"optimizer_states": {"device": 0.5, "swap": 0.6}}}, "sums to 1.1"),
    ({"settings": {"optimizer_states": {"device": 1.5, "swap": -0.5}}}, "give a fraction in [0, 1]"),
    ({"settings": {"optimizer_states": {"gpu": 1.0}}}, "unknown home(s) ['gpu']"),
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
    with pytest.raises(ValueError, match="Cluster.copy_bytes_per_s must be a positive number"):
        sp.Cluster(gpus_per_node=8, gpu_memory_bytes=1, host_memory_bytes=1, copy_bytes_per_s=0)


def test_cli_prints_a_table_or_json_and_returns_the_verdict(capsys):
    assert sp.main(["qwen2.5-1.5b", "--cluster", "1xH100", "--prompts", "8"]) == 0
    out = capsys.readouterr().out
    assert "per GPU (GiB)" in out and "kv_cache" in out and "verdict   fits" in out
    assert sp.main(["72b", "--cluster", "8xH200", "--tp", "4", "--optimizer-states", "swap", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["settings"] is None and data["fits"]["host"] is False
    assert sp.main(["72b", "--cluster", "8xH200", "--tp", "4", "--optimizer-states", "device=0.3,host=0.7",
                    "--copy-gb-per-s", "20", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["optimizer_states"] == {"device": 0.3, "swap": 0.0, "host": 0.7}
    assert data["inputs"]["cluster"]["copy_bytes_per_s"] == 20e9
    assert data["copy_seconds"] == pytest.approx(data["state_bytes"]["host"] / 20e9)
    for bad, message in (("device=0.5,swap=0.6", "sums to 1.1"), ("device=half", "give 'swap', 'host' or a split"),
                         ("gpu=1", "unknown home(s) ['gpu']")):
        assert sp.main(["72b", "--tp", "4", "--optimizer-states", bad]) == 2
        assert message in capsys.readouterr().err
    assert sp.main(["72b", "--cluster", "8xH200", "--tp", "4", "--optimizer-dtype", "bf16", "--sleep-level", "1",
                    "--nodes", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["settings"]["sleep_level"] == 1 and data["inputs"]["shard_degree"] == 16
    assert sp.main(["72b", "--tp", "3"]) == 2
    assert "error: tp=3 must divide gpus_per_node=8" in capsys.readouterr().err


def test_release_other_counts_only_what_the_pools_cannot_release():
    kept = sp.plan("qwen2.5-7b", cluster="1xH100", rollout=ROLLOUT, settings={"grads": "free"})
    pooled = sp.plan("qwen2.5-7b", cluster="1xH100", rollout=ROLLOUT, settings={"grads": "free"}, release_other=True)
    assert pooled.inputs["release_other"] and not kept.inputs["release_other"]
    kept_train, pooled_train = kept.gpu["train"]["engine_other"], pooled.gpu["train"]["engine_other"]
    assert pooled_train == 240 * 2**20 and kept_train - pooled_train > 1024 * 2**20


def test_an_embedding_and_lm_head_of_their_own_shrink_fsdps_working_set_and_bad_units_name_the_choices():
    """--fsdp-units split (swaprl.distributed.shard_causal_lm): the unit being worked on and the prefetched next one,
    with the first one's gradients and the reduce-scatter input of the unit before it, in place of two layers and
    the whole root with its gradients; a tied embedding stays in the root, so split plans it as root."""
    m = get_preset("qwen2.5-72b")
    h, kv_dim = m.hidden_size, m.num_key_value_heads * m.head_dim
    layer = 2 * h * h + h + 2 * (h * kv_dim + kv_dim) + 3 * h * m.intermediate_size + 2 * h
    root, end = 2 * m.vocab_size * h + h, m.vocab_size * h
    units = ("root", "split")
    plans = {u: sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, precision="bf16", rollout=ROLLOUT, fsdp_units=u)
             for u in units}
    saved = plans["root"].gpu["train"]["activations"] - plans["split"].gpu["train"]["activations"]
    # 72B's V * h is under two layers: the last layer's window, with the lm_head's reduce-scatter input, is the peak
    assert end < 2 * layer
    assert saved == ((2 * layer + root) * 2 + (layer + root) * 2) - (2 * layer * 2 + (layer + end) * 2) > 6 * GiB
    assert plans["split"].inputs["fsdp_units"] == "split" and "(split units)" in plans["split"].table()
    tied = {u: sp.plan("qwen2.5-1.5b", cluster="8xH100", tp=1, rollout=ROLLOUT, fsdp_units=u) for u in units}
    assert tied["root"].gpu["train"]["activations"] == tied["split"].gpu["train"]["activations"]
    one_gpu = {u: sp.plan("qwen2.5-7b", cluster="1xH100", rollout=ROLLOUT, fsdp_units=u) for u in units}
    assert one_gpu["root"].gpu["train"]["activations"] == one_gpu["split"].gpu["train"]["activations"]  # no FSDP
    with pytest.raises(ValueError, match="fsdp_units='layers'.*'root'.*'split'.*shard_causal_lm"):
        sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, fsdp_units="layers")


def test_split_units_count_the_reduce_scatter_input_fsdp2_keeps_from_the_unit_before():
    """FSDP2 keeps a unit's reduce-scatter input until the next unit's post-backward, so the last layer's backward
    holds the lm_head's beside two layers and a layer's gradients, and the first layer's holds the prefetched
    embedding beside the next layer's: with 72B's shapes either outweighs the lm_head's own window, whatever the
    gradients' dtype."""
    from swaprl.plan.formulas import unit_params

    m = get_preset("qwen2.5-72b")
    layer, root = unit_params(m)
    end = m.vocab_size * m.hidden_size
    for grad_dtype, b_g in (("bfloat16", 2), ("float32", 4)):
        plans = {u: sp.plan("qwen2.5-72b", cluster="8xH200", tp=4, rollout=ROLLOUT, fsdp_units=u,
                            grad_dtype=grad_dtype, settings={"activation_checkpointing": True})
                 for u in ("root", "split")}
        in_root = (2 * layer + root) * 2 + (layer + root) * b_g
        split = plans["split"].gpu["train"]["activations"] - plans["root"].gpu["train"]["activations"] + in_root
        windows = [(end + layer) * 2 + end * b_g,  # lm_head, the last layer prefetched
                   2 * layer * 2 + (layer + end) * b_g,  # the last layer: the lm_head's reduce-scatter input
                   2 * layer * 2 + 2 * layer * b_g,  # a middle layer
                   (layer + end) * 2 + 2 * layer * b_g,  # the first layer, the embedding prefetched
                   end * 2 + (end + layer) * b_g]  # the embedding
        assert split == max(windows) > (layer + end) * 2 + end * b_g, grad_dtype


# ---------------------------------------------------------------- DeepSpeed ZeRO-3
def zero3_plan(preset: str, layout: str = "zero3", **kw) -> sp.Plan:
    """The planner asked for the measured ZeRO-3 runs' step (benchmarks/results/trl_zero3_h200): one H200 with the
    machine's 125 GiB of host memory, 8 x 8 completions of 1024 tokens after 64-token prompts, micro batches of 8."""
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=64, completion_tokens=1024)
    return sp.plan(preset, cluster=dataclasses.replace(sp.get_cluster("1xH200"), host_memory_bytes=125 * GiB),
                   rollout=rollout, micro_batch_tokens=8 * rollout.sequence_tokens, layout=layout, **kw)


def test_zero3s_homes_at_7b_are_those_the_measured_run_found():
    """Qwen2.5-7B under ZeRO-3 on one H200 (b7_zero3): the homes "auto" gave its sub-groups on the GPU, bytes of
    the fp32 partitions and AdamW states on the device and in host memory, are the planner's (within 1%: the same
    sub-groups in each home)."""
    from pathlib import Path

    measured = json.loads((Path(__file__).parents[1] / "benchmarks/results/trl_zero3_h200/b7_zero3.json").read_text())
    homes = measured["ways"]["b"]["extra"]["optimizer_homes"]
    p = zero3_plan("qwen2.5-7b", precision="master-weights")
    assert p.ok and p.inputs["layout"] == "zero3"
    total = sum(homes.values())
    assert homes["host"] > 0 and total == pytest.approx(sum(p.state_bytes.values()), rel=1e-3)
    for home in ("device", "swap", "host"):  # a sub-group (12 GB) off would be 13% of them
        assert abs(p.state_bytes[home] - homes[home]) < 0.01 * total, (home, p.state_bytes, homes)


def test_zero3s_sub_groups_are_deepspeeds_over_transformers_two_parameter_groups(monkeypatch):
    """DeepSpeed's rule (`_create_fp16_sub_groups`) applied to the transformers model's own parameters in
    transformers' two groups (decayed, then biases and norms), each parameter's partition over two ranks: the
    planner's sub-groups, element for element."""
    import torch
    from transformers import AutoModelForCausalLM

    from swaprl.checkpoints import hf_config
    from swaprl.plan import formulas

    size = 3 * 10**7  # smaller than DeepSpeed's default, so that qwen2.5-0.5b has several
    monkeypatch.setattr(formulas, "ZERO3_SUB_GROUP_ELEMENTS", size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config("qwen2.5-0.5b"))
    named = [(n, p) for n, p in model.named_parameters()]
    groups = [[p for n, p in named if not ("bias" in n or "norm" in n)], [p for n, p in named if "bias" in n or "norm" in n]]
    expected = []
    for group in groups:
        held = 0
        for i, p in enumerate(group):
            held += -(-p.numel() // 2)
            if held >= size or i == len(group) - 1:
                expected.append(held)
                held = 0
    spec = zero3_plan("qwen2.5-0.5b", precision="master-weights")  # validates the inputs
    s = sp.search.Spec(**{**_spec_fields(spec), "cluster": sp.get_cluster("2xH200"), "shard_degree": 2})
    assert formulas.zero3_sub_groups(s) == expected and len(expected) > 3


def _spec_fields(p: sp.Plan) -> dict:
    """The Spec a plan was built from, again (its inputs, the model as a preset)."""
    i = p.inputs
    names = [f.name for f in dataclasses.fields(sp.search.Spec)]
    fields = {k: i[k] for k in names if k in i}
    return {**fields, "model": get_preset(p.model), "cluster": sp.Cluster(**i["cluster"]),
            "rollout": sp.Rollout(**i["rollout"]), "pinned": ()}


def test_under_zero3_the_gradients_are_released_for_generate_and_the_partitions_stay():
    """Released but for its reduce bucket, which ZeRO-3 makes once (DeepSpeed's default 5e8 elements, in bf16)."""
    p = zero3_plan("qwen2.5-7b")
    assert p.settings.grads in ("free", "keep") and p.settings.params == "keep"
    if p.settings.grads == "free":
        assert p.gpu["generate"]["grads"] == 5 * 10**8 * 2 and p.gpu["train"]["grads"] > 0
    assert p.gpu["generate"]["params"] == p.gpu["train"]["params"] > 0
    assert all(c.settings.grads != "offload" and c.settings.params == "keep" for c in p.candidates)


@pytest.mark.parametrize("kw, match", [
    ({"precision": "bf16"}, "precision='master-weights'"),
    ({"settings": {"grads": "offload"}}, "pin grads='free' or 'keep'"),
    ({"settings": {"params": "offload"}}, "params='keep'"),
    ({"fsdp_units": "split"}, "leave it out with layout='zero3'"),
])
def test_zero3_inputs_it_cannot_follow_are_refused_naming_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        zero3_plan("qwen2.5-7b", **kw)


def test_zero3_over_part_of_the_gpus_is_refused_naming_the_fix():
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=64, completion_tokens=1024)
    with pytest.raises(ValueError, match="leave shard_degree out"):
        sp.plan("qwen2.5-7b", cluster="2xH200", rollout=rollout, layout="zero3", shard_degree=1)
    with pytest.raises(ValueError, match="'fsdp2' .*'zero2' or 'zero3'"):
        sp.plan("qwen2.5-7b", cluster="2xH200", rollout=rollout, layout="zero1")


# ---------------------------------------------------------------- DeepSpeed ZeRO-2
def test_zero2_keeps_the_parameters_whole_and_partitions_gradients_partitions_and_states():
    """Over 8 GPUs: the bf16 parameters whole on each; the gradients in two partitions of an eighth (the sum so far
    and the next backward's) and none between steps, or one kept for a generation inside an accumulation window;
    the fp32 partitions with their AdamW states an eighth, in two units (transformers' two parameter groups)."""
    rollout = sp.Rollout(prompts=8, completions_per_prompt=8, prompt_tokens=64, completion_tokens=1024)
    p = sp.plan("qwen2.5-7b", cluster="8xH200", rollout=rollout, layout="zero2", precision="master-weights")
    n = p.parameters
    assert p.ok and p.inputs["layout"] == "zero2" and p.inputs["shard_degree"] == 8
    assert p.gpu["train"]["params"] == p.gpu["generate"]["params"] == 2 * n
    assert p.gpu["train"]["grads"] == 2 * -(-2 * n // 8) and p.gpu["generate"]["grads"] == 0
    kept = sp.plan("qwen2.5-7b", cluster="8xH200", rollout=rollout, layout="zero2", precision="master-weights",
                   settings={"grads": "keep"})
    assert kept.gpu["generate"]["grads"] == -(-2 * n // 8)
    assert sum(p.state_bytes.values()) == pytest.approx(12 * n / 8, rel=1e-6)
    assert p.state_bytes["host"] == 0
    assert all(c.settings.grads == "free" and c.settings.params == "keep" for c in p.candidates)
    from swaprl.plan import formulas

    s = sp.search.Spec(**_spec_fields(p))
    decay, no_decay = formulas.zero2_partitions(s)
    assert decay > 1000 * no_decay > 0 and decay + no_decay == pytest.approx(n / 8, abs=2)


def test_zero2_never_homes_states_in_host_memory_and_says_what_does_not_fit():
    """Its step cannot stream: on one H200 at 7B the states that would stream under ZeRO-3 overflow train instead,
    and the verdict says by how much."""
    z2, z3 = zero3_plan("qwen2.5-7b", layout="zero2"), zero3_plan("qwen2.5-7b")
    assert z3.ok and z3.state_bytes["host"] > 0
    assert not z2.ok and "train needs" in z2.verdict
    assert all(c.settings.optimizer_states.get("host", 0) == 0 for c in z2.candidates)
    small = zero3_plan("qwen2.5-1.5b", layout="zero2")
    assert small.ok and small.state_bytes["host"] == 0


@pytest.mark.parametrize("kw, match", [
    ({"precision": "bf16"}, "precision='master-weights'"),
    ({"settings": {"grads": "offload"}}, "no gradients between optimizer steps.*pin grads='free', or 'keep'"),
    ({"settings": {"optimizer_states": "host"}}, "cannot have the 'host' home.*Pin 'swap'.*layout='zero3'"),
    ({"settings": {"optimizer_states": {"device": 0.5, "host": 0.5}}}, "cannot have the 'host' home"),
    ({"settings": {"params": "offload"}}, "whole on every GPU.*params='keep'"),
    ({"fsdp_units": "split"}, "leave it out with layout='zero2'"),
])
def test_zero2_inputs_it_cannot_follow_are_refused_naming_the_fix(kw, match):
    with pytest.raises(ValueError, match=match):
        zero3_plan("qwen2.5-7b", layout="zero2", **{k: v for k, v in kw.items()})


def test_swaprl_plan_takes_the_zero3_layout(capsys):
    from swaprl.plan.cli import main

    code = main(["qwen2.5-7b", "--cluster", "1xH200", "--host-memory-gib", "125", "--layout", "zero3",
                 "--prompts", "8", "--prompt-tokens", "64", "--micro-batch-tokens", "8704"])
    out = capsys.readouterr().out
    assert code == 0 and "DeepSpeed ZeRO-3 over 1 GPUs" in out and "grads=free" in out
    code = main(["qwen2.5-1.5b", "--cluster", "1xH200", "--host-memory-gib", "125", "--layout", "zero2",
                 "--prompts", "8", "--prompt-tokens", "64", "--micro-batch-tokens", "8704"])
    out = capsys.readouterr().out
    assert code == 0 and "DeepSpeed ZeRO-2 over 1 GPUs" in out and "host 0.00 GiB" in out
