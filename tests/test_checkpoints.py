"""The random checkpoints: their tokenizer (byte-level encoding that round-trips, a name for every id a model
samples), and their write, which never leaves a partial checkpoint where a reader looks."""

import json
import os
import subprocess
import sys

import pytest
import torch

from swaprl import checkpoints
from swaprl.checkpoints import QWEN_TOKENIZER_SIZE, hf_config, write_random_checkpoint, write_tokenizer


def test_tokenizer_names_every_id_and_keeps_the_special_ids(tmp_path):
    from transformers import AutoTokenizer

    ids = write_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tok) == QWEN_TOKENIZER_SIZE
    # A random-weight model samples from its whole vocabulary: an unnamed id would make detokenizing it slow.
    tokens = tok.convert_ids_to_tokens(list(range(QWEN_TOKENIZER_SIZE)))
    assert None not in tokens and len(set(tokens)) == QWEN_TOKENIZER_SIZE
    config = hf_config("tiny")
    assert ids["<|im_end|>"] == config.eos_token_id == tok.eos_token_id
    assert ids["<|endoftext|>"] == config.bos_token_id == tok.pad_token_id
    text = "hello <|im_start|>wörld<|im_end|>"
    encoded = tok.encode(text)
    assert tok.decode(encoded) == text
    assert max(encoded) <= 258  # fillers are never produced by encoding: prompts stay one token per byte
    assert tok.decode([259, 260]) == "aaab"


def test_tokenizer_fits_a_small_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    write_tokenizer(tmp_path, 512)
    assert len(AutoTokenizer.from_pretrained(tmp_path)) == 512


def _loads(path, layers):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    assert model.config.num_hidden_layers == layers
    return model


def _beside(path):
    return sorted(p.name for p in path.parent.iterdir() if p.name != path.name)


def test_a_checkpoint_of_other_settings_is_replaced_whole_and_one_of_the_same_reused(tmp_path):
    path = tmp_path / "m"
    write_random_checkpoint("tiny", path, layers=1)
    write_random_checkpoint("tiny", path, layers=2)
    assert json.loads((path / "swaprl_random.json").read_text())["layers"] == 2
    _loads(path, 2)
    stamp = (path / "swaprl_random.json").stat().st_mtime_ns
    write_random_checkpoint("tiny", path, layers=2)
    assert (path / "swaprl_random.json").stat().st_mtime_ns == stamp
    assert _beside(path) == []


def test_a_write_stopped_midway_leaves_the_checkpoint_that_was_there(tmp_path, monkeypatch):
    path = tmp_path / "m"
    write_random_checkpoint("tiny", path, layers=1)
    before = {p.name: p.read_bytes() for p in path.iterdir()}
    drawn = []

    def stopped(*args, **kwargs):  # a Ctrl-C after the first tensors are drawn
        drawn.append(args[0])
        if len(drawn) == 3:
            raise KeyboardInterrupt
        return init(*args, **kwargs)

    init = checkpoints._init_tensor
    monkeypatch.setattr(checkpoints, "_init_tensor", stopped)
    with pytest.raises(KeyboardInterrupt):
        write_random_checkpoint("tiny", path, layers=2)
    assert {p.name: p.read_bytes() for p in path.iterdir()} == before
    assert _beside(path) == []
    drawn.clear()
    with pytest.raises(KeyboardInterrupt):
        write_random_checkpoint("tiny", tmp_path / "new", layers=2)
    assert not (tmp_path / "new").exists() and _beside(path) == []


def test_what_a_stopped_process_left_beside_is_removed_and_a_running_ones_kept(tmp_path):
    path = tmp_path / "m"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()
    running = tmp_path / f".m.writing-{os.getppid()}"  # a process still running
    for left in (tmp_path / f".m.writing-{gone}", tmp_path / f".m.old-{gone}", running):
        left.mkdir()
        (left / "model-00001.safetensors").write_bytes(b"partial")
    write_random_checkpoint("tiny", path, layers=1)
    assert _beside(path) == [running.name]


def test_a_directory_of_other_files_is_refused_and_left_as_it_was(tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a complete random checkpoint of swaprl's; remove them, or give "
                                              "a new or empty directory"):
        write_random_checkpoint("tiny", tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == ["notes.txt"]
    empty = tmp_path / "empty"
    empty.mkdir()
    assert write_random_checkpoint("tiny", empty, layers=1) == empty
    _loads(empty, 1)


def test_runs_writing_the_same_checkpoint_at_once_both_get_it_whole(tmp_path):
    path = tmp_path / "m"
    code = ("import sys, torch; from swaprl.checkpoints import write_random_checkpoint; "
            "write_random_checkpoint('tiny', sys.argv[1], layers=2, dtype=torch.float32)")
    runs = [subprocess.Popen([sys.executable, "-c", code, str(path)], stderr=subprocess.PIPE, text=True)
            for _ in range(2)]
    for run in runs:
        assert run.wait(timeout=300) == 0, run.stderr.read()
    model = _loads(path, 2)
    again = write_random_checkpoint("tiny", tmp_path / "again", layers=2, dtype=torch.float32)
    for (name, a), (_, b) in zip(model.state_dict().items(), _loads(again, 2).state_dict().items()):
        assert torch.equal(a, b), name
    assert _beside(path) == ["again"]
