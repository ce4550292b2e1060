"""Junk input to `swaprl plan` and `swaprl report`: refused with one line naming the field and the fix, or, for a
profile's records, skipped with a warning naming the file and line, never a traceback."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest

import swaprl.plan as sp
from swaprl.cli import main as swaprl_main
from swaprl.presets import Preset

from .test_report import synthetic_profile

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


@pytest.mark.parametrize("name, value", [("engine_reserve_bytes", math.inf), ("host_margin_bytes", math.nan)])
def test_a_byte_count_that_is_not_finite_is_refused_naming_it(name, value):
    rollout = sp.Rollout(prompts=4, completions_per_prompt=2, prompt_tokens=16, completion_tokens=16)
    with pytest.raises(ValueError, match=f"{name}"):
        sp.plan("tiny", cluster="1xH100", rollout=rollout, **{name: value})


# ---------------------------------------------------------------------------------------------------- report
def rewrite(path: Path, changes: dict[int, object]) -> None:
    """Replace lines of `path` (1-based numbers) by the JSON of the given values (a str: the text itself)."""
    lines = path.read_text().splitlines()
    for number, value in changes.items():
        lines[number - 1] = value if isinstance(value, str) else json.dumps(value)
    path.write_text("\n".join(lines) + "\n")


def line_of(path: Path, kind: str, nth: int = 0) -> tuple[int, dict]:
    found = [(i + 1, rec) for i, rec in enumerate(map(json.loads, path.read_text().splitlines()))
             if rec.get("type") == kind]
    return found[nth]


def report_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "swaprl.profile.report"
            and r.levelno == logging.WARNING]


@pytest.mark.parametrize("status, what", [(None, '"status" is null'), ([1, 2], '"status" is [1, 2]')])
def test_a_phase_record_whose_status_is_not_an_object_is_skipped_with_a_warning(tmp_path, capsys, caplog, status,
                                                                                 what):
    path = synthetic_profile(tmp_path / "run.jsonl")
    number, rec = line_of(path, "phase", -1)  # the last boundary: the one the host-buffer table reads
    rewrite(path, {number: rec | {"status": status}})
    assert swaprl_main(["report", str(path), "-o", str(tmp_path / "rep")]) == 0
    (warning,) = report_warnings(caplog)
    assert f"run.jsonl line {number}" in warning and what in warning and "expected an object" in warning
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "| rank 0 | train->generate | offload optimizer | 4 |" in md  # the rest of the run is reported
    assert "1 malformed record" in md and f"line {number}" in md


def test_every_kind_of_malformed_record_is_skipped_and_the_rest_reported(tmp_path, caplog):
    from swaprl.profile.report import load_run, write_report

    path = synthetic_profile(tmp_path / "run.jsonl")
    step_line, step = line_of(path, "step", 0)
    sample_line, sample = line_of(path, "sample", 3)
    phase_line, phase = line_of(path, "phase", 2)
    end_line, _ = line_of(path, "end")
    buffers = phase["status"]["host_buffers"] | {"buffers": [{"name": "optimizer", "bytes": "16 GiB"}]}
    later_phase_line, later_phase = line_of(path, "phase", -1)
    bad = {step_line: {k: v for k, v in step.items() if k != "seconds"},
           sample_line: sample | {"t": "later"},
           phase_line: phase | {"attribution": {"total": 1}},
           later_phase_line: later_phase | {"status": later_phase["status"] | {"host_buffers": buffers}},
           step_line + 1: [1, 2, 3],
           step_line + 2: {"type": "step", "t": True, "transition": "x", "step": "y", "bytes": 0, "seconds": 0},
           sample_line + 1: {"type": "rollout"},
           end_line: '{"type": "end", "t": 1700000100.0, "reas'}
    rewrite(path, bad)
    path.write_text(path.read_text().rstrip("\n"))  # the crash left the end record half written
    run = load_run(path)
    warnings = report_warnings(caplog)
    assert len(warnings) == len(bad)
    for number, text in ((step_line, 'lacks "seconds"'), (sample_line, '"t" is "later", expected a number'),
                         (phase_line, '"attribution" lacks "source"'),
                         (later_phase_line, '"status.host_buffers.buffers[0].bytes" is "16 GiB"'),
                         (step_line + 1, "is [1, 2, 3], expected an object"),
                         (step_line + 2, '"t" is true, expected a number'),
                         (sample_line + 1, "unknown record type \"rollout\""),
                         (end_line, "cut off")):
        assert any(w.startswith(f"run.jsonl line {number}: ") and text in w for w in warnings), (number, warnings)
    assert any("the last line is cut off" in w for w in run.warnings)
    write_report([run], tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert f"{len(bad) - 1} malformed record(s) skipped" in md  # the cut-off end has a warning of its own
    assert "| rank 0 | train->generate | offload optimizer |" in md


@pytest.mark.parametrize("kind, field, value, expected", [
    ("phase", "bytes", -10**12, '"bytes" is -1000000000000, expected an integer of bytes, 0 or more'),
    ("phase", "seconds", -1.0, '"seconds" is -1.0, expected a number of seconds, 0 or more'),
    ("step", "seconds", -0.5, '"seconds" is -0.5, expected a number of seconds, 0 or more'),
    ("step", "bytes", -4096, '"bytes" is -4096, expected an integer of bytes, 0 or more')])
def test_a_negative_size_or_duration_is_skipped_not_reported(tmp_path, caplog, kind, field, value, expected):
    """No recorder writes a negative size or duration: such a record is junk, skipped and named, never a table row
    of -931 GiB moved in -1 s. The attribution's categories may be negative ("unattributed" when the others
    overcount), and stay accepted."""
    from swaprl.profile.report import load_run, write_report

    path = synthetic_profile(tmp_path / "run.jsonl")
    number, rec = line_of(path, kind, 1)
    rewrite(path, {number: rec | {field: value}})
    run = load_run(path)
    (warning,) = report_warnings(caplog)
    assert warning.startswith(f"run.jsonl line {number}: ") and expected in warning, warning
    write_report([run], tmp_path / "rep")
    assert "-931" not in (tmp_path / "rep" / "report.md").read_text()
    caplog.clear()
    number, rec = line_of(path, "phase", 0)
    categories = rec["attribution"]["categories"] | {"unattributed": -2**20}
    rewrite(path, {number: rec | {"attribution": rec["attribution"] | {"categories": categories}}})
    load_run(path)
    assert not [w for w in report_warnings(caplog) if f"line {number}:" in w]

def test_a_profile_with_no_usable_record_is_refused(tmp_path, capsys, caplog):
    path = synthetic_profile(tmp_path / "run.jsonl")
    header, *body = path.read_text().splitlines()
    path.write_text("\n".join([header, *(json.dumps({"type": "phase", "t": 1.0, "status": None}) for _ in body)])
                    + "\n")
    assert swaprl_main(["report", str(path), "-o", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "none of its" in err and "usable" in err and str(path) in err
    assert not (tmp_path / "rep").exists()



@pytest.mark.parametrize("text", ['{"type": "sample", "t": ' + "9" * 5000 + "}", "[" * 100_000 + "]" * 100_000],
                         ids=["too many digits", "too deep"])
def test_a_line_python_cannot_parse_is_skipped_and_such_a_header_refused(tmp_path, capsys, caplog, text):
    path = synthetic_profile(tmp_path / "run.jsonl")
    good = path.read_text()
    rewrite(path, {3: text})
    assert swaprl_main(["report", str(path), "-o", str(tmp_path / "rep")]) == 0
    assert any(w.startswith("run.jsonl line 3: not JSON") for w in report_warnings(caplog))
    path.write_text(text + "\n" + good.split("\n", 1)[1])
    assert swaprl_main(["report", str(path), "-o", str(tmp_path / "rep2")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and "its first line is not JSON" in err

@pytest.mark.parametrize("field, value", [("t0", "now"), ("copy_bandwidth", [25.0]), ("device_total", "80 GiB"),
                                          ("rank", None)])
def test_a_header_with_a_field_of_the_wrong_type_is_refused_naming_it(tmp_path, capsys, field, value):
    path = synthetic_profile(tmp_path / "run.jsonl")
    header = json.loads(path.read_text().splitlines()[0])
    rewrite(path, {1: header | {field: value}})
    assert swaprl_main(["report", str(path), "-o", str(tmp_path / "rep")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f'"{field}"' in err and "header" in err and str(path) in err


def test_every_profile_the_results_keep_passes_the_checks(caplog):
    """The checks leave out nothing swaprl's recorder wrote: the profiles of the committed GPU runs read whole."""
    from swaprl.profile.report import load_run

    root = Path(__file__).parent.parent / "benchmarks" / "results"
    profiles = sorted([*root.rglob("*profile*.jsonl"), *root.rglob("*profile*.jsonl.gz")])
    assert len(profiles) >= 10
    for path in profiles:
        run = load_run(path)
        assert not any("malformed" in w for w in run.warnings), (path, run.warnings)
    assert not report_warnings(caplog)
