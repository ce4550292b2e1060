"""Checkpoints of a training run that any number of ranks resumes, and the trained model as a transformers
checkpoint. (Not `swaprl.checkpoints`, which writes random-weight checkpoints of the presets for the examples,
tests and benchmarks.)

    from swaprl import saving
    files = saving.save(directory, model, optimizer, extra={"step": step})   # every rank; returns its files
    loaded = saving.load(directory, model, optimizer)                        # every rank, after swaprl.attach
    step = loaded.extra["step"]
    saving.export_hf(out, model, optimizer, tokenizer_from=checkpoint)       # every rank; rank 0 writes

`save` and `load` go through torch.distributed.checkpoint (DCP): each rank writes the rows of its own shards, and a
load on any number of ranks reads the rows each of its ranks holds (FSDP2's DTensor shards, or whole tensors on a
process of its own), so a run saved on two ranks resumes on one, and the other way round. The directory holds
DCP's files, `.metadata` and each saving rank's `__R_K.distcp`, under these names:

- `model.NAME`: `model.state_dict()`.
- `optimizer.state.NAME.KEY`: each optimizer state, named by its model parameter. torch's own
  `get_optimizer_state_dict` names states through the model's parameters, which the fp32 masters
  (`SwapConfig(master_weights=True)`) replace in the optimizer: here a master's states take the name of the model
  parameter it updates (`MasterWeights.model_param`).
- `masters.NAME`: the fp32 masters, by the same names.
- `swaprl`: rank 0's record: the format, the number of ranks that saved, the optimizer's param groups (their
  parameters by name), its states that are not tensors, and the caller's `extra`.
- `rankR`: rank R's own: torch's random streams (the CPU's, and the current CUDA device's) and `rank_extra`.

Where a load puts each state: DCP reads this rank's rows of every state into new tensors in host memory, and the
optimizer's own `load_state_dict` takes them from there, through swaprl's hooks (`swaprl.optimizer_hooks`): the
states whose home is "host" move into the runtime's page-locked buffer without visiting the device
(`swaprl.streaming`), torch copies the others to their parameter's device, and the masters take the saved values
and the model their casts (`swaprl.master`). The model's tensors are loaded in place.

A run that resumes on more ranks than saved has ranks without a record of their own: their random streams stay as
they are and `Loaded.rank_extra` is None (each says so in a warning). The directory must be one that every rank
reads (a shared file system): a rank reads the rows of its shards wherever they were written.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import logging
import os
import shutil
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.filesystem import FileSystem

from . import distributed, interrupts
from ._extras import needs
from .checkpoints import checkpoint_dir_of
from .compat.torch import local_tensor
from .master import KEY as MASTERS_KEY
from .optimizer_hooks import masters_of
from .state_homes import parameters

logger = logging.getLogger(__name__)

FORMAT = 1
"""The layout of what `save` writes, recorded in the checkpoint; `load` refuses another."""
METADATA = ".metadata"  # DCP's index of a checkpoint, written by the coordinating rank (its FileSystemReader's name)
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "added_tokens", "vocab", "merges", "chat_template", "spiece")
"""The start of the names of the tokenizer files `export_hf` copies from the model's checkpoint directory."""


@dataclass(frozen=True, slots=True)
class Loaded:
    """What `load` gives back besides the model and the optimizer it filled."""

    extra: dict
    """`save`'s `extra`, as rank 0 saved it."""
    rank_extra: dict | None
    """`save`'s `rank_extra` of this rank; None when this rank was not one of those that saved."""
    world: int
    """The number of ranks that saved."""


# ------------------------------------------------------------------------------------------- save
def save(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *,
         extra: dict | None = None, rank_extra: dict | None = None) -> list[Path]:
    """Write the model, the optimizer (its states, param groups and fp32 masters) and torch's random streams into
    the directory `path` (made if missing), with `extra` (rank 0's is kept) and this rank's `rank_extra`, any
    picklable objects. Every rank calls it, with the same `path`. Returns the files this rank wrote (rank 0's
    include DCP's `.metadata`), each fsynced. A failure on any rank raises on every rank: this rank's own error, or
    the first failing rank's."""
    path = Path(path)
    rank, world = distributed.world()
    # Through the optimizer's own state_dict: swaprl's hooks wait for a reload in flight, fill masters not filled
    # yet, and give the states carved out of one host buffer a storage each (so DCP writes each one's bytes only).
    packed = optimizer.state_dict()
    names = _names(model, optimizer)
    by_index = {i: p for saved, group in zip(packed["param_groups"], optimizer.param_groups)
                for i, p in zip(saved["params"], group["params"])}
    states, loose = {}, {}
    for i, state in packed["state"].items():
        name = names[id(by_index[i])]
        states[name] = {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}
        if other := {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}:
            loose[name] = other
    groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": [names[id(p)] for p in group["params"]]}
              for saved, group in zip(packed["param_groups"], optimizer.param_groups)]
    masters = masters_of(optimizer)
    content = {"model": model.state_dict(), "optimizer": {"state": states},
               # the masters themselves: a DTensor master's shard is its rows, which the state dict's plain copy
               # (`MasterWeights.save_into`) does not say
               "masters": {names[id(m)]: m for m in masters} if masters is not None else {},
               f"rank{rank}": _blob({"rng": _random_streams(), "extra": rank_extra})}
    if rank == 0:  # DCP keeps one copy of an object every rank gives; this one is rank 0's
        content["swaprl"] = _blob({"format": FORMAT, "world": world, "groups": groups, "loose": loose,
                                   "extra": extra if extra is not None else {}})
    writer = _Writer(path)
    path.mkdir(parents=True, exist_ok=True)
    # Held: a KeyboardInterrupt raised inside torch's writers can abort the process (a Python exception through
    # C++), leaving no error and no cleanup; the Ctrl-C is raised once the save is written (a second one at once).
    with torch.no_grad(), interrupts.held(f"saving a checkpoint to {path}"):
        _reraised(lambda: dcp.save(content, storage_writer=writer, no_dist=world == 1), rank)
    files = [path / name for name in writer.files]
    if rank == 0:
        if not (path / METADATA).is_file():
            raise RuntimeError(f"torch.distributed.checkpoint wrote no {METADATA} in {path}: this torch writes its "
                               "index under another name, which swaprl.saving does not list; use a torch swaprl "
                               "supports (swaprl.compat.torch.SUPPORTED)")
        files.append(path / METADATA)
    return files


def _names(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[int, str]:
    """id(each optimizer parameter) -> the model parameter's name: a master's is its model parameter's."""
    masters = masters_of(optimizer)
    named = {id(p): n for n, p in model.named_parameters()}
    out, strangers = {}, []
    for p in parameters(optimizer):
        q = masters.model_param(p) if masters is not None and masters.is_master(p) else p
        if id(q) in named:
            out[id(p)] = named[id(q)]
        else:
            strangers.append(tuple(p.shape))
    if strangers:
        raise ValueError(f"{len(strangers)} parameter(s) of the optimizer (shapes {strangers[:4]}) are not "
                         "parameters of the model, so they have no name to be saved and loaded under; build the "
                         "optimizer over model.parameters() (the same objects)")
    return out


class _Files(FileSystem):
    """DCP's local files, whose write errors name the file: the OSError of a write (a full disk, a file-size limit)
    has none, and reaches here inside torch.save's RuntimeError."""

    @contextlib.contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        try:
            with super().create_stream(path, mode) as stream:
                yield stream
        except Exception as exc:
            cause: BaseException | None = exc
            seen = set()
            while cause is not None and id(cause) not in seen and not (isinstance(cause, OSError) and cause.errno):
                seen.add(id(cause))
                cause = cause.__cause__ or cause.__context__
            cause = cause if isinstance(cause, OSError) else None
            if cause is not None and cause.filename is None:
                raise OSError(cause.errno, cause.strerror, str(path)) from exc
            raise


class _Writer(FileSystemWriter):
    """DCP's file writer (each file fsynced), noting the files this rank wrote, for the caller's manifest."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, sync_files=True)
        self.fs = _Files()
        self.files: list[str] = []

    def write_data(self, plan, planner):
        future = super().write_data(plan, planner)
        self.files = sorted({r.storage_data.relative_path for r in future.wait()})  # written when it returns
        return future


# ------------------------------------------------------------------------------------------- load
def load(path: str | os.PathLike, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> Loaded:
    """Load what `save` wrote into `model` and `optimizer`, on any number of ranks (each its own rows), and put
    back this rank's random streams where it saved some. Every rank calls it, after `swaprl.attach` (the masters
    and the homes of the states exist then), with nothing else in flight. Everything is checked against the
    checkpoint's index before anything is loaded: a parameter missing on either side, another shape or other param
    groups raise ValueError naming them, and change nothing."""
    path = Path(path)
    rank, world = distributed.world()
    if not (path / METADATA).is_file():
        raise ValueError(f"{path} has no {METADATA}: not a checkpoint of swaprl.saving.save (a torch.distributed."
                         "checkpoint), or one whose save never completed")
    try:
        index = FileSystemReader(path).read_metadata()
    except Exception as exc:  # a pickle cut short or overwritten: UnpicklingError, EOFError, and whatever it decodes to
        raise ValueError(f"{path / METADATA} cannot be read ({type(exc).__name__}: {exc}): it is damaged (cut "
                         "short, or overwritten), or written by a newer torch than this one (torch 2.15's index "
                         f"does not load in earlier releases; this is torch {torch.__version__}); load a checkpoint "
                         "whose files are intact, or load it with the torch that wrote it") from exc
    saved = index.state_dict_metadata
    if "swaprl" not in saved:
        raise ValueError(f"{path} is a torch.distributed.checkpoint without swaprl.saving's record: written by "
                         "another program, whose layout this load does not know; load it with "
                         "torch.distributed.checkpoint.load")
    head = {"swaprl": None}
    if f"rank{rank}" in saved:
        head[f"rank{rank}"] = None
    _reraised(lambda: dcp.load(head, storage_reader=FileSystemReader(path), no_dist=world == 1), rank)
    record = _unblob(head["swaprl"])
    if record.get("format") != FORMAT:
        raise ValueError(f"{path} is of swaprl.saving format {record.get('format')!r}; this swaprl loads format "
                         f"{FORMAT}: load it with the swaprl that wrote it")
    mine = _unblob(head[f"rank{rank}"]) if f"rank{rank}" in head else None

    paths = {key: tuple(p) for key, p in (index.planner_data or {}).items()}
    state_index: dict[str, dict[str, object]] = {}
    master_index: dict[str, object] = {}
    model_index: dict[str, object] = {}
    for key, where in paths.items():
        if where[:2] == ("optimizer", "state") and len(where) == 4:
            state_index.setdefault(where[2], {})[where[3]] = saved[key]
        elif where[0] == "masters" and len(where) == 2:
            master_index[where[1]] = saved[key]
        elif where[0] == "model" and len(where) == 2:
            model_index[where[1]] = saved[key]

    weights = model.state_dict()
    names = _names(model, optimizer)
    params = parameters(optimizer)
    by_name = {names[id(p)]: p for p in params}
    masters = masters_of(optimizer)
    _check(path, weights, model_index, by_name, state_index, record["groups"], optimizer, names,
           masters, master_index)

    def like(p: torch.Tensor, meta) -> torch.Tensor:
        """A new host tensor for this rank's rows of the saved tensor `meta` of `p`'s states: a shard like `p`'s
        where the saved tensor has `p`'s shape, else whole (a scalar such as Adam's step)."""
        dtype = meta.properties.dtype
        if tuple(meta.size) == tuple(p.shape):
            return torch.empty_like(p.detach() if local_tensor(p) is p else p, dtype=dtype, device="cpu",
                                    requires_grad=False)
        return torch.empty(tuple(meta.size), dtype=dtype)

    states = {name: {k: like(by_name[name], meta) for k, meta in keys.items()} for name, keys in state_index.items()}
    master_values = ({names[id(m)]: like(m, master_index[names[id(m)]]) for m in masters
                      if names[id(m)] in master_index} if masters is not None else {})
    with torch.no_grad():
        _reraised(lambda: dcp.load({"model": weights, "optimizer": {"state": states}, "masters": master_values},
                                   storage_reader=FileSystemReader(path), no_dist=world == 1), rank)

    # The optimizer's own load, by index, as its state_dict() would have given it
    number = {id(p): i for i, p in enumerate(params)}
    groups = []
    for group in optimizer.param_groups:
        hyper = next(g for g in record["groups"] if set(g["params"]) == {names[id(p)] for p in group["params"]})
        groups.append({**{k: v for k, v in hyper.items() if k != "params"},
                       "params": [number[id(p)] for p in group["params"]]})
    packed = {"state": {number[id(by_name[name])]: {**states.get(name, {}), **record["loose"].get(name, {})}
                        for name in {**states, **record["loose"]}},
              "param_groups": groups}
    if masters is not None and master_values:
        packed[MASTERS_KEY] = {number[id(m)]: local_tensor(master_values[names[id(m)]]) for m in masters}
    optimizer.load_state_dict(packed)
    if mine is not None:
        _set_random_streams(mine["rng"])
    else:
        logger.warning("rank %d was not one of the %d rank(s) that saved %s: its random streams stay as they are "
                       "and it has no rank_extra", rank, record["world"], path)
    return Loaded(extra=record["extra"], rank_extra=mine["extra"] if mine is not None else None,
                  world=record["world"])


def _check(path: Path, weights: dict, model_index: dict, by_name: dict, state_index: dict, groups: list[dict],
           optimizer: torch.optim.Optimizer, names: dict[int, str], masters, master_index: dict) -> None:
    """Refuse, before anything is loaded, a checkpoint of other parameters, shapes or param groups."""
    problems = []

    def differ(what: str, here: Iterable[str], there: Iterable[str]) -> None:
        here, there = set(here), set(there)
        if only := sorted(here - there):
            problems.append(f"{what} {only[:4]} {'is' if len(only) == 1 else 'are'} not in the checkpoint")
        if only := sorted(there - here):
            problems.append(f"the checkpoint's {what} {only[:4]} {'is' if len(only) == 1 else 'are'} not here")

    differ("model tensor(s)", weights, model_index)
    problems += [f"model tensor {n}: shape {tuple(t.shape)} here, {tuple(model_index[n].size)} in the checkpoint"
                 for n, t in weights.items() if n in model_index and tuple(t.shape) != tuple(model_index[n].size)]
    differ("optimizer parameter(s) with states", [], set(state_index) - set(by_name))
    for name, keys in state_index.items():
        p = by_name.get(name)
        problems += [f"optimizer state {name}.{k}: shape {tuple(meta.size)} in the checkpoint, the parameter's is "
                     f"{tuple(p.shape)}" for k, meta in keys.items()
                     if p is not None and len(meta.size) and tuple(meta.size) != tuple(p.shape)]
    here = sorted(sorted(names[id(p)] for p in g["params"]) for g in optimizer.param_groups)
    if here != sorted(sorted(g["params"]) for g in groups):
        problems.append(f"the optimizer has {len(here)} param group(s) of {[len(g) for g in here]} parameters, the "
                        f"checkpoint {len(groups)} of {[len(g['params']) for g in groups]} (or of other names)")
    if master_index and masters is None:
        problems.append("the checkpoint has fp32 master weights and this optimizer has none: attach with "
                        "SwapConfig(master_weights=True) before loading, as the run that saved did")
    elif masters is not None:
        mine = {names[id(m)]: m for m in masters}
        if master_index:
            differ("fp32 master(s)", mine, master_index)
            problems += [f"fp32 master {n}: shape {tuple(m.shape)} here, {tuple(master_index[n].size)} in the "
                         "checkpoint" for n, m in mine.items()
                         if n in master_index and tuple(m.shape) != tuple(master_index[n].size)]
        else:
            logger.warning("%s has no fp32 master weights: the masters are set from the model's parameters as "
                           "loaded", path)
    if problems:
        raise ValueError(f"{path} does not fit this model and optimizer: {'; '.join(problems)}; load it into the "
                         "model and optimizer it was saved from (the same architecture, parameters and param "
                         "groups); nothing was loaded")


# ------------------------------------------------------------------------------------------- export
def export_hf(path: str | os.PathLike | None, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
              *, tokenizer_from: str | os.PathLike | None = None, dtype: torch.dtype | None = None,
              shard_bytes: int = 4 * 2**30) -> Path | None:
    """Write `model` as a transformers checkpoint into the directory `path` (made if missing): config.json,
    safetensors shards (with an index when there are several), generation_config.json and the tokenizer files of
    `tokenizer_from` (default: the directory the model was loaded from, `swaprl.checkpoints.checkpoint_dir_of`).
    `AutoModelForCausalLM.from_pretrained` and vLLM load it.

    Each tensor is written in `dtype` (default: its parameter's own), cast from its fp32 master where
    `optimizer` has one (`SwapConfig(master_weights=True)`), under its `state_dict()` name; tied weights once, as
    transformers writes them. Every rank calls it: FSDP2's shards are gathered one tensor at a time, and only rank 0
    holds them, a shard of the checkpoint at a time, and writes (the other ranks may pass `path=None`). Returns the
    directory on rank 0, None on the others. It writes in place: for a directory replaced whole, write into a
    temporary one and rename it."""
    with needs("hf"):
        from safetensors.torch import save_file

    rank, _ = distributed.world()
    source = Path(tokenizer_from) if tokenizer_from is not None else checkpoint_dir_of(model)
    out = Path(path) if rank == 0 else None
    if rank == 0:
        if out is None:
            raise ValueError("export_hf on rank 0 needs a path to write to")
        out.mkdir(parents=True, exist_ok=True)
    masters = masters_of(optimizer) if optimizer is not None else None
    master_of = {id(masters.model_param(m)): m for m in masters} if masters is not None else {}
    shards: list[dict[str, torch.Tensor]] = [{}]
    filled, total, dtypes = 0, 0, {}
    seen: set[int] = set()
    with torch.no_grad():
        for name, t in model.state_dict(keep_vars=True).items():
            if id(t) in seen:  # a tied weight: once, under its first name
                continue
            seen.add(id(t))
            want = dtype or t.dtype
            value = _gathered(master_of.get(id(t)), t, want)
            if rank != 0:
                continue
            size = value.numel() * value.element_size()
            if filled and filled + size > shard_bytes:
                shards.append({})
                filled = 0
            shards[-1][name] = value
            filled += size
            total += size
            if value.is_floating_point():
                dtypes[value.dtype] = dtypes.get(value.dtype, 0) + size
    if rank != 0:
        return None
    n = len(shards)
    files = ["model.safetensors"] if n == 1 else [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    for shard, file in zip(shards, files):
        save_file({k: v.contiguous() for k, v in shard.items()}, str(out / file), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": total},
                 "weight_map": {k: file for shard, file in zip(shards, files) for k in shard}}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    config = copy.deepcopy(model.config)
    config.dtype = max(dtypes, key=dtypes.get) if dtypes else (dtype or torch.float32)
    config.use_cache = True  # for generation: a training loop turns the cache off (it is of no use there)
    if not getattr(config, "architectures", None):
        config.architectures = [_unsharded_class(model).__name__]
    config.save_pretrained(str(out))
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(str(out))
    copied = _copy_tokenizer(source, out)
    logger.info("exported %s (%.2f GiB, %d safetensors file(s), tokenizer files %s) to %s",
                type(config).__name__, total / 2**30, n, copied or "none", out)
    return out


def _gathered(master: torch.Tensor | None, t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`t` whole in `dtype`, in host memory (on rank 0; the other ranks' value is of no use), cast from `master`
    when given. A shard is gathered on its parameter's device: a master's rows in host memory are cast there and
    moved to that device first (the collective runs where the mesh does)."""
    from torch.distributed.tensor import DTensor

    source = master if master is not None else t
    if not isinstance(t, DTensor):
        return source.detach().to(device="cpu", dtype=dtype, copy=True)
    rows = local_tensor(source).detach().to(dtype=dtype).to(local_tensor(t).device)
    whole = DTensor.from_local(rows, t.device_mesh, t.placements, shape=t.shape, stride=t.stride(),
                               run_check=False).full_tensor()
    return whole.to("cpu", copy=True)


def _unsharded_class(model: torch.nn.Module) -> type:
    """The model's own class: FSDP2's `fully_shard` gives a module a class of its own, FSDP<name>, over it."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return type(model)
    return next(c for c in type(model).__mro__ if not issubclass(c, FSDPModule))


def _copy_tokenizer(source: Path | None, out: Path) -> list[str]:
    if source is None:
        logger.warning("export_hf: the model's checkpoint directory is not known, so %s has no tokenizer files; "
                       "pass tokenizer_from=<the directory the model was loaded from>", out)
        return []
    copied = []
    for f in sorted(Path(source).iterdir()):
        if f.is_file() and (f.name.startswith(TOKENIZER_FILES) or f.suffix == ".tiktoken"):
            shutil.copyfile(f, out / f.name)
            copied.append(f.name)
    return copied


# ------------------------------------------------------------------------------------------- helpers
def _blob(value: object) -> bytes:
    """`value` as one object of the checkpoint: DCP would walk a dict into entries of its own."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    return buffer.getvalue()


def _unblob(data: bytes) -> dict:
    return torch.load(io.BytesIO(data), weights_only=False)  # the run's own objects (DCP reads its own so too)


def _random_streams() -> dict:
    out = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state()
    return out


def _set_random_streams(streams: dict) -> None:
    torch.set_rng_state(streams["torch"])
    if "cuda" in streams and torch.cuda.is_available():
        torch.cuda.set_rng_state(streams["cuda"])


def _reraised(fn: Callable[[], object], rank: int) -> object:
    """`fn()`, a DCP call: DCP gathers every rank's failure into a CheckpointException, a BaseException that an
    `except Exception` would let through; this raises the failure itself (this rank's, else the first rank's), with
    its errno and file name where it has them. A failure caused by an interrupt (a Ctrl-C, or what a signal's
    handler raised: not an `Exception`) raises the interrupt: inside torch.save's zip writer it comes out as that
    writer's RuntimeError ("unexpected pos"), which would pass a Ctrl-C off as a write error. Without a process
    group DCP warns that it assumes one process, at every call: that is what is meant here."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
            return fn()
    except CheckpointException as exc:
        failures = exc.failures
        first = failures.get(rank) or failures[min(failures)]
        error = first[0] if isinstance(first, tuple) else first
        cause, seen = error, set()
        while isinstance(cause, Exception) and id(cause) not in seen:
            seen.add(id(cause))
            cause = cause.__cause__ or cause.__context__
        raise (cause if cause is not None and not isinstance(cause, Exception) else error) from None
