"""Random-weight checkpoints of real architectures, with a tokenizer, written without any model hub.

No hub is reachable where swaprl's examples, tests and benchmarks run, yet memory and speed only mean something on
the real shapes. `write_random_checkpoint` writes a Hugging Face directory (`config.json`, sharded safetensors with
an index, tokenizer files) that transformers and vLLM load like any downloaded model:

    python -m swaprl.checkpoints qwen2.5-1.5b /tmp/qwen1.5b [--layers 4] [--device cuda]

Tensors are generated one at a time and flushed into shards of `shard_bytes`, so a 72B checkpoint needs one shard
of memory, not 145 GB. The tokenizer is byte-level (256 byte tokens plus the Qwen chat special tokens, so every text
round-trips) and, like Qwen2.5's own, it names every id up to 151,665: the rest are filler tokens of two to four
ASCII letters and digits that encoding never produces. A random-weight model samples ids from its whole
vocabulary, and an id the tokenizer does not know costs a detokenizer ~30 us against ~1 us: a tokenizer of 259
entries would make every generation that detokenizes (TRL's, vLLM's default) CPU-bound and unrealistically slow.

`checkpoint_dir_of(model)` finds the local checkpoint directory a loaded model came from (what vLLM starts from).
"""

from __future__ import annotations

import argparse
import glob
import itertools
import json
import logging
import os
import shutil
import string
from pathlib import Path

import psutil
import torch

from ._extras import needs
from .presets import get_preset

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_TOKENIZER_SIZE = 151665  # Qwen2.5's tokenizer: 151,643 regular tokens and 22 special ones; model rows beyond pad
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
_SHARD_BYTES = 4 * 2**30


def write_tokenizer(path: str | os.PathLike, size: int = QWEN_TOKENIZER_SIZE) -> dict[str, int]:
    """Write a byte-level BPE tokenizer of `size` ids to `path`; returns the special tokens' ids.

    Ids 0-255 are the bytes, 256-258 the special tokens; the rest are filler tokens that only decoding meets.
    """
    with needs("hf"):
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

    byte_chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    if size < len(byte_chars) + len(SPECIAL_TOKENS):
        raise ValueError(f"a tokenizer of size {size} cannot hold the 256 bytes and {len(SPECIAL_TOKENS)} special "
                         "tokens: give the model a vocabulary of at least 259")
    # The order of `hf_config`'s default ids: <|im_end|> 256 (eos), <|endoftext|> 257 (bos, pad), <|im_start|> 258.
    tokens = [*byte_chars, "<|im_end|>", "<|endoftext|>", "<|im_start|>"]
    tokens += _filler_tokens(size - len(tokens))
    vocab = {token: i for i, token in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.add_special_tokens({"additional_special_tokens": list(SPECIAL_TOKENS)})
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))
    return {t: fast.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}


def _filler_tokens(n: int) -> list[str]:
    """`n` distinct strings of 2-4 ASCII letters and digits (all valid UTF-8, as most real tokens are)."""
    chars = string.ascii_letters + string.digits
    out: list[str] = []
    for length in (2, 3, 4):
        for combo in itertools.product(chars, repeat=length):
            if len(out) >= n:
                return out
            out.append("".join(combo))
    return out


def hf_config(preset: str, *, layers: int | None = None, dtype: torch.dtype = torch.bfloat16,
              bos_token_id: int = 257, eos_token_id: int = 256):
    """A transformers config of `preset`, of its own architecture (default special ids: those of
    `write_tokenizer`)."""
    with needs("hf"):
        from transformers import AutoConfig

    cfg = get_preset(preset).config_dict(layers=layers, bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    model_type = cfg.pop("model_type", "qwen2")
    return AutoConfig.for_model(model_type, **cfg, dtype=dtype)


def random_model(preset: str, *, layers: int | None = None, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cuda") -> torch.nn.Module:
    """A randomly initialised `Qwen2ForCausalLM` of `preset`, built directly on `device` (no checkpoint)."""
    with needs("hf"):
        from transformers import AutoModelForCausalLM

    with torch.device(device):
        return AutoModelForCausalLM.from_config(hf_config(preset, layers=layers, dtype=dtype), dtype=dtype)


def _meta_state_shapes(config) -> list[tuple[str, torch.Size]]:
    """Names and shapes of every tensor a checkpoint of `config` holds, without allocating any of them."""
    with needs("hf"):
        from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    seen: set[int] = set()
    out = []
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in seen:  # tied lm_head: stored once, as transformers does
            continue
        seen.add(id(tensor))
        out.append((name, tensor.shape))
    return out


def _init_tensor(name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device,
                 generator: torch.Generator, std: float) -> torch.Tensor:
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=device)
    out = torch.empty(shape, dtype=torch.float32, device=device)
    out.normal_(0.0, std, generator=generator)
    return out.to(dtype)


def write_random_checkpoint(preset: str, path: str | os.PathLike, *, layers: int | None = None,
                            dtype: torch.dtype = torch.bfloat16, seed: int = 0, device: str | None = None,
                            shard_bytes: int = _SHARD_BYTES) -> Path:
    """Write a random-weight checkpoint of `preset` (e.g. "qwen2.5-1.5b", "tiny") to `path` and return it.

    `layers` cuts the depth while keeping each layer's real shapes. `device` is where the random numbers are drawn
    ("cuda" is much faster for large models; default: cuda when available). An existing complete checkpoint at
    `path` with the same settings is reused; one with other settings is replaced. The checkpoint is written in a
    directory beside `path` and renamed into place, so that a run stopped midway, or another run writing the same
    `path` at once, never leaves a partial checkpoint where a reader looks.
    """
    spec = get_preset(preset)
    if layers is not None and not 1 <= layers <= spec.num_hidden_layers:
        raise ValueError(f"layers={layers} is outside 1..{spec.num_hidden_layers} for {spec.name}")
    path = Path(path)
    tokenizer_size = min(QWEN_TOKENIZER_SIZE, spec.vocab_size)
    stamp = {"preset": spec.name, "layers": layers, "dtype": str(dtype), "seed": seed, "tokenizer": tokenizer_size}
    if _stamp_of(path) == stamp:
        logger.info("reusing random checkpoint at %s", path)
        return path
    if path.exists() and _stamp_of(path) is None and any(path.iterdir()):
        raise FileExistsError(f"{path} holds files that are not a complete random checkpoint of swaprl's; "
                              "remove them, or give a new or empty directory")
    _remove_stopped_writes(path)
    final_path, path = path, path.parent / f".{path.name}.writing-{os.getpid()}"
    path.mkdir(parents=True)
    try:
        _write_random(spec, path, layers=layers, dtype=dtype, seed=seed, device=device, shard_bytes=shard_bytes,
                      tokenizer_size=tokenizer_size, stamp=stamp)
        return _move_into_place(path, final_path, stamp)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _remove_stopped_writes(path: Path) -> None:
    """Remove what writes of `path` by processes no longer running left beside it (a write or a replacement stopped
    midway)."""
    name = glob.escape(path.name)
    for left in [*path.parent.glob(f".{name}.writing-*"), *path.parent.glob(f".{name}.old-*")]:
        pid = left.name.rpartition("-")[2]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            shutil.rmtree(left, ignore_errors=True)


def _stamp_of(path: Path) -> dict | None:
    """The settings a complete random checkpoint at `path` was written with; None where there is none."""
    try:
        return json.loads((path / "swaprl_random.json").read_text())
    except (OSError, ValueError):
        return None


def _move_into_place(written: Path, path: Path, stamp: dict) -> Path:
    """Rename the checkpoint written at `written` to `path`: an empty `path` is replaced, one of other settings is
    moved aside and removed once the new one stands, and one another run has just completed with the same settings
    is kept (this run's copy is then dropped)."""
    old = path.parent / f".{path.name}.old-{os.getpid()}"
    if path.exists() and _stamp_of(path) is not None and _stamp_of(path) != stamp:
        path.rename(old)
    try:
        written.rename(path)  # replaces an empty directory, refuses a full one
    except OSError:
        if _stamp_of(path) != stamp:
            raise
        logger.info("another run wrote the same random checkpoint at %s first; reusing it", path)
    shutil.rmtree(old, ignore_errors=True)
    return path


def _write_random(spec, path: Path, *, layers, dtype, seed, device, shard_bytes, tokenizer_size, stamp) -> None:
    with needs("hf"):
        from safetensors.torch import save_file

    ids = write_tokenizer(path, tokenizer_size)
    config = hf_config(spec.name, layers=layers, dtype=dtype, bos_token_id=ids["<|endoftext|>"],
                       eos_token_id=ids["<|im_end|>"])
    config.save_pretrained(str(path))
    (path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": config.bos_token_id, "eos_token_id": config.eos_token_id, "do_sample": True}))

    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gen = torch.Generator(device=dev).manual_seed(seed)
    shapes = _meta_state_shapes(config)
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled = 0
    weight_map: dict[str, int] = {}
    total = 0

    def flush() -> None:
        index = len(shards)
        save_file({k: v.cpu().contiguous() for k, v in shards[-1].items()},
                  str(path / f"model-{index:05d}.safetensors"), metadata={"format": "pt"})
        shards[-1] = {}
        shards.append({})

    for name, shape in shapes:
        t = _init_tensor(name, shape, dtype, dev, gen, std=0.02)
        nbytes = t.numel() * t.element_size()
        if filled and filled + nbytes > shard_bytes:
            flush()
            filled = 0
        shards[-1][name] = t
        weight_map[name] = len(shards)
        filled += nbytes
        total += nbytes
    flush()
    n = len(shards) - 1
    names = {i: f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)}
    for i, final in names.items():
        os.replace(path / f"model-{i:05d}.safetensors", path / final)
    index = {"metadata": {"total_size": total}, "weight_map": {k: names[v] for k, v in weight_map.items()}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    (path / "swaprl_random.json").write_text(json.dumps(stamp))  # last: it marks the checkpoint complete
    logger.info("wrote random %s checkpoint (%.2f GiB, %d shards)", spec.name, total / 2**30, n)


def checkpoint_dir_of(model: torch.nn.Module) -> Path | None:
    """The local checkpoint directory `model` was loaded from: `model.config._name_or_path` when it names a directory
    holding a config.json; None otherwise (a model built from a config, or loaded by hub name)."""
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    path = Path(str(name))
    return path if name and (path / "config.json").exists() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m swaprl.checkpoints", description=__doc__.splitlines()[0])
    parser.add_argument("preset", help="tiny, qwen2.5-0.5b ... qwen2.5-72b")
    parser.add_argument("path")
    parser.add_argument("--layers", type=int, default=None, help="cut the depth to this many layers")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--device", default=None)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    write_random_checkpoint(args.preset, args.path, layers=args.layers, dtype=getattr(torch, args.dtype),
                            seed=args.seed, device=args.device)


if __name__ == "__main__":
    main()
