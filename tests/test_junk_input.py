"""Junk input to `swaprl plan` and `swaprl report`: refused with one line naming the field and the fix, or, for a
profile's records, skipped with a warning naming the file and line, never a traceback."""

from __future__ import annotations

import json
import math

import pytest

import swaprl.plan as sp
from swaprl.presets import Preset

SMALL = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100}
ROLLOUT_FLAGS = ["--prompts", "4", "--prompt-tokens", "32", "--completion-tokens", "32"]


def plan_error(capsys, *args: str) -> str:
    """The one line `swaprl plan ARGS` prints when it refuses its input (it must exit 2, with no traceback)."""
    assert sp.main([*args]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith("swaprl plan: error: ")
    return err


# ---------------------------------------------------------------------------------------------------- config.json
JUNK_CONFIGS = [
    ({"num_attention_heads": 128}, ["num_attention_heads=128", "hidden_size=64", "head_dim"]),
    ({"hidden_size": int("9" * 400)}, ["hidden_size=", "400-digit", "2147483647"]),
    ({"rope_theta": [1, 2]}, ["rope_theta=[1, 2]", "positive number"]),
    ({"rope_theta": math.inf}, ["rope_theta=inf", "finite"]),
    ({"rms_norm_eps": "1e-6"}, ["rms_norm_eps='1e-6'", "number"]),
    ({"max_position_embeddings": "4096"}, ["max_position_embeddings='4096'", "JSON integer"]),
    ({"max_position_embeddings": None}, ["max_position_embeddings=None", "leave the field out"]),
    ({"tie_word_embeddings": "no"}, ["tie_word_embeddings='no'", "JSON true or false"]),
    ({"attention_bias": 0}, ["attention_bias=0", "JSON true or false"]),
    ({"mlp_bias": None}, ["mlp_bias=None", "JSON true or false"]),
    ({"num_key_value_heads": 3}, ["num_key_value_heads=3", "num_attention_heads=4", "divide"]),
    ({"num_key_value_heads": 8}, ["num_key_value_heads=8", "num_attention_heads=4"]),
    ({"hidden_size": 66}, ["hidden_size=66", "multiple of num_attention_heads=4", "head_dim"]),
    ({"head_dim": 15}, ["head_dim=15", "even"]),
    ({"model_type": ["llama"]}, ["model_type ['llama']", "llama, mistral"]),
]


@pytest.mark.parametrize("fields, expected", JUNK_CONFIGS, ids=[str(f)[:40] for f, _ in JUNK_CONFIGS])
def test_a_junk_config_json_is_refused_naming_the_file_the_field_and_the_fix(tmp_path, capsys, fields, expected):
    (tmp_path / "config.json").write_text(json.dumps({**SMALL, **fields}))
    err = plan_error(capsys, str(tmp_path), "--cluster", "1xH100", *ROLLOUT_FLAGS)
    assert str(tmp_path / "config.json") in err
    for text in expected:
        assert text in err


@pytest.mark.parametrize("text, expected", [
    ('{"hidden_size": ' + "9" * 5000 + "}", "not JSON"),  # past Python's limit on the digits of an int
    ("[" * 100_000 + "]" * 100_000, "not JSON"),  # nested past the parser's recursion limit
], ids=["too many digits", "too deep"])
def test_a_config_json_python_cannot_parse_is_refused_naming_the_file(tmp_path, capsys, text, expected):
    (tmp_path / "config.json").write_text(text)
    err = plan_error(capsys, str(tmp_path), "--cluster", "1xH100")
    assert str(tmp_path / "config.json") in err and expected in err


def test_a_preset_built_in_python_is_checked_like_a_config_json():
    good = {"name": "m", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "tie_word_embeddings": False}
    with pytest.raises(ValueError, match="tie_word_embeddings='no'"):
        Preset(**{**good, "tie_word_embeddings": "no"})
    with pytest.raises(ValueError, match="num_attention_heads=128 .*hidden_size=64"):
        Preset(**{**good, "num_attention_heads": 128})
    with pytest.raises(ValueError, match="num_hidden_layers=True"):
        Preset(**{**good, "num_hidden_layers": True})


# ---------------------------------------------------------------------------------------------------- flags
@pytest.mark.parametrize("flag, value, expected", [
    ("--gpu-memory-gib", "1e300", "at most 4096"),
    ("--gpu-memory-gib", "1e-300", "less than one byte"),
    ("--gpu-memory-gib", "0", "above 0"),
    ("--host-memory-gib", "1e300", "at most 65536"),
    ("--engine-reserve-gib", "1e300", "at most 4096"),
    ("--host-margin-gib", "1e300", "at most 65536"),
    ("--copy-gb-per-s", "1e300", "at most 10000"),
    ("--nodes", str(10**30), "at most"),
    ("--gpus-per-node", "100000", "at most 1024"),
    ("--prompts", str(10**30), "at most 2147483647"),
    ("--completion-tokens", str(10**30), "at most 2147483647"),
    ("--micro-batch-tokens", str(10**400), "at most 2147483647"),
    ("--max-num-batched-tokens", str(10**400), "at most 2147483647"),
    ("--max-num-seqs", str(10**30), "at most 2147483647"),
], ids=lambda v: v if len(v) < 40 else f"{len(v)} digits")
def test_an_absurd_flag_is_refused_naming_the_flag(capsys, flag, value, expected):
    err = plan_error(capsys, "tiny", "--cluster", "1xH100", *ROLLOUT_FLAGS, flag, value)
    assert flag in err and expected in err


def test_more_gpus_than_the_planner_plans_for_is_refused_naming_both_flags(capsys):
    err = plan_error(capsys, "tiny", "--cluster", "1xH100", *ROLLOUT_FLAGS, "--nodes", "200000",
                     "--gpus-per-node", "8")
    assert "1600000 GPUs" in err and "--nodes" in err and "--gpus-per-node" in err


def test_absurd_python_arguments_are_refused_naming_the_field():
    rollout = sp.Rollout(prompts=4, completions_per_prompt=2, prompt_tokens=16, completion_tokens=16)
    cluster = sp.Cluster(gpus_per_node=1, gpu_memory_bytes=80 * sp.GiB, host_memory_bytes=256 * sp.GiB)
    with pytest.raises(ValueError, match="Cluster.gpu_memory_bytes"):
        sp.Cluster(gpus_per_node=1, gpu_memory_bytes=10**400, host_memory_bytes=256 * sp.GiB)
    with pytest.raises(ValueError, match="Cluster.host_memory_bytes"):
        sp.Cluster(gpus_per_node=1, gpu_memory_bytes=80 * sp.GiB, host_memory_bytes=2**80)
    with pytest.raises(ValueError, match="Rollout.prompts"):
        sp.Rollout(prompts=10**30, completions_per_prompt=2, prompt_tokens=16, completion_tokens=16)
    for kwargs, message in (({"tp": True}, "tp=True"), ({"layers": True}, "layers=True"),
                            ({"shard_degree": True}, "shard_degree=True"),
                            ({"engine_max_seqs": 10**30}, "engine_max_seqs must be a positive integer"),
                            ({"cluster": sp.Cluster(gpus_per_node=8, nodes=200_000, gpu_memory_bytes=80 * sp.GiB,
                                                    host_memory_bytes=256 * sp.GiB)}, "1600000 GPUs")):
        with pytest.raises(ValueError, match=message):
            sp.plan("tiny", **{"cluster": cluster, "rollout": rollout, **kwargs})


# search.py's plan() converts these with int() before Spec sees them (OverflowError on inf, an unnamed ValueError on
# NaN); search.py is another change's, so the check waits for it: strict, this fails once it is fixed
@pytest.mark.xfail(strict=True, raises=(OverflowError, AssertionError), reason="plan() calls int() before validating")
@pytest.mark.parametrize("name, value", [("engine_reserve_bytes", math.inf), ("host_margin_bytes", math.nan)])
def test_a_byte_count_that_is_not_finite_is_refused_naming_it(name, value):
    rollout = sp.Rollout(prompts=4, completions_per_prompt=2, prompt_tokens=16, completion_tokens=16)
    with pytest.raises(ValueError, match=f"{name}"):
        sp.plan("tiny", cluster="1xH100", rollout=rollout, **{name: value})
