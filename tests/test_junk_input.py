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
