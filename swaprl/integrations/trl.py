"""Run an existing TRL `GRPOTrainer` under swaprl: its generation in `phase("generate")`, the rest in `"train"`.

    from swaprl.integrations.trl import large_pages, wrap
    with large_pages():                     # only matters under torch's larger pages (see `large_pages`)
        trainer = GRPOTrainer(model=..., reward_funcs=..., args=GRPOConfig(...), train_dataset=...)
    rt = wrap(trainer)                      # or wrap(trainer, config=swaprl.SwapConfig(...))
    trainer.train()
    rt.detach()                             # optional: puts the trainer back as it was

What changes, on this trainer instance only (TRL's classes are not touched; `rt.detach()` undoes all of it but the
optimizer's creation):

- `trainer._generate`, the one method through which GRPOTrainer 1.16 produces completions (transformers
  `generate`, vLLM colocate, the tool-call loop and a custom `rollout_func` alike), runs inside
  `rt.phase("generate")`: the optimizer states (and gradients, per `SwapConfig.grads`) leave the device for its
  duration. Everything else (reward functions, old and reference log-probabilities, loss, backward,
  `optimizer.step()`) runs in the runtime's default phase, "train", where they are back.
- The optimizer is created by `wrap`, with the trainer's own `create_optimizer()`: the same one `train()` would
  create, and `train()` reuses it (it only builds one when `trainer.optimizer` is None). The runtime needs it to
  exist; AdamW allocates its states at the first step anyway, so this costs no memory.
- `use_vllm=False`: TRL generates with the trainer's own module, so there is nothing to sync: swaprl's `HFEngine`
  semantics (only the optimizer-state swap). `use_vllm=True, vllm_mode="colocate"`: swaprl drives TRL's in-process
  `vllm.LLM` through `VLLMEngine` (asleep in "train"; woken, synced from the trainer and checked at each
  "generate": bit-exact weights, and the rollout-training mismatch measured). TRL's own weight sync becomes a no-op
  and its sleep mode is switched off on this instance, so the engine is not woken, synced or put to sleep twice.
- `trainer.log` adds swaprl's figures (`swaprl/...`: phase switches, the last sync's check and mismatch) to every
  record, so they reach whatever `report_to` the user set.

Several processes (`accelerate launch`, torchrun): every process builds its trainer and wraps it, and each rank's
runtime moves that rank's own optimizer states (all of them under DDP, its shards' under FSDP2 and DeepSpeed's ZeRO).
With vLLM colocate, TRL builds one `vllm.LLM` per rank with vLLM's external launcher, `vllm_tensor_parallel_size`
consecutive ranks sharding one engine; swaprl's `VLLMEngine` forms the same groups, each rank syncs the full tensors
(FSDP2 shards gathered one parameter at a time, ZeRO-3 partitions a bucket at a time) and the weight check sums the
engine's tensor-parallel shards and the trainer's FSDP2 shards or ZeRO-3 partitions over their ranks. Under FSDP2
(accelerate's `fsdp_version: 2`) `train()` itself shards the model and points the optimizer at the shards, and under
DeepSpeed `train()` builds the engine and its ZeRO optimizer (transformers' `deepspeed_init`), both after `wrap`:
`wrap` validates everything, registers the runtime and returns it, and attaches it to the trainer's final model and
optimizer at `train()`'s `on_train_begin`, on every rank (until then `rt.status()` and `rt.phase()` raise a
`PhaseError` saying so).

Under DeepSpeed ZeRO-2 and ZeRO-3 the runtime is bound to the model, to ZeRO's inner torch optimizer and to a
declaration of the flat fp32 partitions that optimizer steps (`swaprl.partitions`, built by
`swaprl.compat.deepspeed.partitions`): the partitions that are copies of the model's values (the fp32 masters of a
bf16 model; all of them under ZeRO-2) move with their states, as the homes place them, and under ZeRO-3 those in
host memory (the "host" home) are streamed through ZeRO's own step. ZeRO-3's `offload_optimizer` (cpu) is replaced by
those homes (`_replace_zero3_offload`): DeepSpeed builds its engine without it. What DeepSpeed keeps in host memory
itself otherwise (ZeRO-2's `offload_optimizer`, `offload_param`) swaprl leaves there. FSDP1, ZeRO stages 0 and 1,
and DeepSpeed's NVMe offload are refused (`_check_setup` and `_check_deepspeed` say why and what to use).

The hook is on private TRL names whose behaviour changes between releases: `swaprl.compat.trl` holds every change
and the version range it was checked on (`SUPPORTED_TRL`); other versions are refused rather than silently
mis-wrapped.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch

import swaprl

from .._extras import needs
from .. import interrupts
from ..attachment import Runtime
from ..compat import deepspeed as deepspeed_compat
from ..compat import trl as trl_compat
from ..compat.trl import SUPPORTED as SUPPORTED_TRL  # noqa: F401 (the range docs/trl.md names, re-exported)
from ..compat.trl import check_version as check_version
from ..config import SwapConfig
from ..engines.base import Engine
from ..errors import PhaseError
from ..undo import Undo

if TYPE_CHECKING:
    from trl import GRPOTrainer

logger = logging.getLogger(__name__)

_RUNTIME_ATTR = "_swaprl_runtime"  # set on a wrapped trainer: refuses a second wrap, found by `runtime_of`


def wrap(trainer: GRPOTrainer, *, config: SwapConfig | None = None, engine: Engine | None = None,
         lean_rollouts: bool = True) -> Runtime:
    """Attach swaprl to a constructed `trl.GRPOTrainer` and return the runtime (also `swaprl.current()`).

    `config`: what moves (default `SwapConfig()`). `engine`: leave None; swaprl builds the engine matching how the
    trainer generates. Pass one only to choose its arguments, e.g. a `VLLMEngine(llm=trainer.vllm_generation.llm,
    model="/local/checkpoint")` when the model was loaded by hub name and its files are not in the local cache.
    `lean_rollouts` (vLLM colocate only): ask vLLM for what the trainer reads and nothing else (see `_lean_rollouts`);
    False leaves TRL's sampling requests as they are.
    Call it before `trainer.train()` (or between two calls); everything is validated before anything moves. Under
    `accelerate launch` every process calls it, as every process builds its trainer. With FSDP2 and DeepSpeed the
    runtime is returned at once but takes charge of the trainer when `train()` has sharded the model and built its
    optimizer (see the module's docstring); until then `rt.status()` and `rt.phase()` raise a `PhaseError` saying
    so.
    """
    with needs("trl"):
        import trl
    check_version(getattr(trl, "__version__", "unknown"))
    from trl import GRPOTrainer

    if not isinstance(trainer, GRPOTrainer):
        raise TypeError(f"swaprl.integrations.trl.wrap() takes a trl.GRPOTrainer, not {type(trainer).__name__}; "
                        "for another training loop, call swaprl.attach(model, optimizer) and enter "
                        "swaprl.phase('generate') / swaprl.phase('train') yourself")
    if getattr(trainer, _RUNTIME_ATTR, None) is not None:
        raise PhaseError("this GRPOTrainer is already wrapped; use the Runtime the first wrap() returned (or "
                         "swaprl.integrations.trl.runtime_of(trainer)), or detach it before wrapping again")
    if config is not None and not isinstance(config, SwapConfig):
        raise TypeError(f"config must be a swaprl.SwapConfig, not {type(config).__name__}")
    config = config if config is not None else SwapConfig()
    _check_setup(trainer)
    if trainer.is_deepspeed_enabled:
        _check_deepspeed(trainer, config)
    _check_engine(trainer, engine)
    _check_nothing_attached()  # attach() would refuse too, but only after the vLLM engine was woken
    if _sharded_by_train(trainer):
        return _wrap_at_train_begin(trainer, config, engine, lean_rollouts=lean_rollouts)
    optimizer = _optimizer(trainer)
    with _engine(trainer, engine) as engine:
        rt = swaprl.attach(trainer.model, optimizer, engine, config=config)
    try:
        with interrupts.held("wrapping the GRPOTrainer"):
            _install(trainer, rt, lean_rollouts=lean_rollouts)
            _register(trainer, rt)
    except BaseException:
        rt.detach()  # nothing of the wrap stays behind: the trainer is as it was, and no runtime is attached
        raise
    logger.info("wrapped GRPOTrainer (trl %s): generation in phase 'generate' with %s", trl.__version__,
                type(engine).__name__)
    return rt


@contextlib.contextmanager
def large_pages() -> Iterator[None]:
    """Build the `GRPOTrainer` inside this when torch runs with pages larger than 20 MiB
    (`large_segment_size_mb` in `PYTORCH_CUDA_ALLOC_CONF`, docs/kernels.md):

        with large_pages():
            trainer = GRPOTrainer(...)
        rt = wrap(trainer)

    TRL builds its vLLM engine in the constructor, and vLLM 0.26 sets a 20 MiB `max_split_size_mb` while it loads
    the model, which torch refuses under larger pages ("max_split_size_mb too small"). Inside, that split is raised
    to the page size, as swaprl's own `VLLMEngine` does when it builds an engine; vLLM's worker gets its own method
    back on the way out. Without larger pages, or without vLLM, it changes nothing."""
    from ..compat import vllm as vllm_compat

    if importlib.util.find_spec("vllm") is None:
        yield
        return
    with vllm_compat.load_split_within_pages():
        yield


def runtime_of(trainer: GRPOTrainer) -> Runtime | None:
    """The runtime `wrap` attached to `trainer`, or None if it is not wrapped (or was detached)."""
    return getattr(trainer, _RUNTIME_ATTR, None)




# ---------------------------------------------------------------- validation and construction
def _check_setup(trainer) -> None:
    """Refuse set-ups the wrapper does not handle, before anything is created or moved."""
    if trainer.is_fsdp_enabled and _fsdp_version(trainer) != 2:
        raise ValueError(
            f"FSDP version {_fsdp_version(trainer)}: swaprl.integrations.trl supports FSDP2 only. FSDP1 flattens "
            "the parameters into FlatParameters and transformers builds the optimizer over them inside train(); "
            "use `fsdp_version: 2` in the accelerate config (or GRPOConfig(fsdp_config={'version': 2}), "
            "transformers' default)")
    if not trainer.use_vllm:
        return
    vg = trainer.vllm_generation
    if vg.mode != "colocate":
        raise ValueError(f"GRPOConfig(vllm_mode={vg.mode!r}): the vLLM server runs in another process, which swaprl "
                         "cannot put to sleep; use vllm_mode='colocate', or use_vllm=False")
    if torch.cuda.is_available() and not vg.enable_sleep_mode:
        raise ValueError("the vLLM engine TRL built cannot sleep: set GRPOConfig(vllm_enable_sleep_mode=True) so "
                         "swaprl can release its memory during training")
    from accelerate.utils import is_peft_model

    if is_peft_model(trainer.model):
        raise ValueError("PEFT models with use_vllm=True are not supported: swaprl's weight sync sends the "
                         "trainer's parameters by their checkpoint names and does not merge adapters. Use "
                         "use_vllm=False, or full fine-tuning")


def _check_deepspeed(trainer, config: SwapConfig) -> None:
    """Refuse the DeepSpeed configurations the wrapper does not handle, from the config accelerate's plugin holds,
    before `train()` builds anything (the runtime attaches at its `on_train_begin`)."""
    try:
        import deepspeed  # noqa: F401 (accelerate imports it for a DeepSpeed trainer; named here if it cannot)
    except ImportError as exc:
        raise ImportError(f"this GRPOTrainer runs under DeepSpeed, which does not import ({exc}); pip install "
                          f"'deepspeed{deepspeed_compat.SUPPORTED}'") from exc
    deepspeed_compat.check_version()
    ds = trainer.accelerator.state.deepspeed_plugin.hf_ds_config
    stage = ds.get_value("zero_optimization.stage", 0)
    if stage not in (2, 3):
        raise ValueError(
            f"DeepSpeed ZeRO stage {stage}: swaprl.integrations.trl supports ZeRO-2 and ZeRO-3. Stage 0 steps through "
            "DeepSpeed's own mixed-precision optimizer and stage 1 is not tested here; use `zero_stage: 2` (the "
            "optimizer states and gradients partitioned, the same states per rank as stage 1) or `zero_stage: 3` "
            "in the accelerate config (zero_optimization.stage in a DeepSpeed config)")
    if stage == 3 and ds.get_value("zero_optimization.offload_optimizer.super_offload", False):
        raise ValueError(
            "offload_optimizer.super_offload under ZeRO-3: DeepSpeed then builds SuperOffload's optimizer, which steps "
            "the partitions with an optimizer of its own on the CPU whatever the offload's device, and swaprl replaces "
            "ZeRO-3's optimizer offload with its homes. Remove super_offload (swaprl's 'host' home streams the states "
            "that do not fit through the GPU)")
    for part in ("optimizer", "param"):
        device = ds.get_value(f"zero_optimization.offload_{part}.device") or "none"
        if device == "nvme":
            raise ValueError(
                f"DeepSpeed's offload_{part} to NVMe swaps the {part} partitions through files with its own buffers, "
                f"which swaprl does not follow; use `offload_{part}_device: cpu` (DeepSpeed keeps them in host memory "
                f"and swaprl leaves them there) or `none` (swaprl moves them to host memory only while generating)")
    ratio = ds.get_value("zero_optimization.offload_optimizer.ratio", 1.0)
    if stage == 2 and (ds.get_value("zero_optimization.offload_optimizer.device") or "none") != "none" and \
            ratio != 1.0:  # ZeRO-3's offload is replaced whole (`_replace_zero3_offload`), its ratio with it
        raise ValueError(
            f"offload_optimizer.ratio={ratio} under ZeRO-2: DeepSpeed then steps the sub-groups it keeps on the device "
            "with a second optimizer of its own, whose states swaprl cannot find. Use ratio 1.0 (the default: every "
            "state in host memory, DeepSpeed's), no offload_optimizer (swaprl moves the states to host memory only "
            "while generating), or ZeRO-3, whose offload swaprl's homes replace")
    if config.master_weights:
        raise ValueError("SwapConfig(master_weights=True) under DeepSpeed: ZeRO keeps fp32 master partitions of a "
                         "bf16 model itself (mixed_precision: bf16), which swaprl moves with their states; leave "
                         "master_weights=False")
    if stage == 2 and config.optimizer_states != "auto" and config.state_split()["host"] > 0:
        raise ValueError(
            f"SwapConfig(optimizer_states={config.optimizer_states!r}) under DeepSpeed ZeRO-2: the 'host' home "
            "streams the states through the device inside optimizer.step(), and ZeRO-2 keeps views of them that a "
            "home in host memory would leave behind. Use ZeRO-3 (`zero_stage: 3`), where swaprl streams them, or "
            "have DeepSpeed keep them in host memory: `offload_optimizer_device: cpu` in the accelerate config "
            "(zero_optimization.offload_optimizer.device), with swaprl's 'swap' or 'auto'")
    if config.params == "offload":
        raise ValueError(
            "SwapConfig(params='offload') under DeepSpeed: ZeRO's model parameters are views of (ZeRO-2) or "
            "placeholders for (ZeRO-3) flat buffers DeepSpeed owns, which swaprl cannot move. Use params='keep'; to "
            "keep ZeRO-3's parameter partitions in host memory, have DeepSpeed do it: `offload_param_device: cpu`")


def _replace_zero3_offload(trainer) -> Callable[[], None] | None:
    """Under ZeRO-3 with `offload_optimizer_device: cpu`, have DeepSpeed build its engine without that offload, so
    that the one home policy places the fp32 partitions and their states (ZeRO-Offload's layout is its "host" home,
    updated on the GPU a piece at a time instead of by a CPU optimizer over fp32 gradients copied to host memory).
    Changed in the config accelerate's plugin holds, which `train()` builds the engine from; returns what puts the
    user's value back (at detach), or None where nothing was changed."""
    plugin = trainer.accelerator.state.deepspeed_plugin
    ds = plugin.hf_ds_config
    if ds.get_value("zero_optimization.stage", 0) != 3 or \
            (ds.get_value("zero_optimization.offload_optimizer.device") or "none") != "cpu":
        return None
    # accelerate's plugin holds the dict transformers' config does, or a copy of it: whichever train() reads
    configs = list({id(c): c for c in (ds.config, getattr(plugin, "deepspeed_config", ds.config))}.values())
    offloads = [c["zero_optimization"]["offload_optimizer"] for c in configs]
    before = [dict(o) for o in offloads]
    for o in offloads:
        o["device"] = "none"
    logger.info("DeepSpeed ZeRO-3's offload_optimizer (cpu) is replaced: its fp32 partitions and optimizer states "
                "are placed by swaprl's homes, those in host memory updated on the GPU")

    def restore() -> None:
        for o, b in zip(offloads, before):
            o.clear()
            o.update(b)

    return restore


def _fsdp_version(trainer) -> int:
    # transformers reads it the same way (Trainer._prepare_for_training); FSDP1 plugins may lack the field.
    return getattr(trainer.accelerator.state.fsdp_plugin, "fsdp_version", 1)


def _sharded_by_train(trainer) -> bool:
    """FSDP2 before its first train(): the model is not sharded yet, and the optimizer `train()` builds will be
    pointed at the shards (accelerate's prepare), so neither exists in its final form before `train()` starts.
    DeepSpeed, always: its engine and ZeRO optimizer are built by `train()` (transformers' deepspeed_init)."""
    from ..distributed import is_fsdp2

    return trainer.is_deepspeed_enabled or trainer.is_fsdp_enabled and not is_fsdp2(trainer.model)


def _check_nothing_attached() -> None:
    try:
        swaprl.current()
    except PhaseError:
        return
    raise PhaseError("another swaprl runtime is attached in this process; detach it (swaprl.detach()) before "
                     "wrapping this trainer")


def _optimizer(trainer) -> torch.optim.Optimizer:
    from accelerate.optimizer import AcceleratedOptimizer

    optimizer = trainer.optimizer if trainer.optimizer is not None else trainer.create_optimizer()
    # After a train() call the trainer holds accelerate's wrapper; its step() calls the torch optimizer inside.
    return optimizer.optimizer if isinstance(optimizer, AcceleratedOptimizer) else optimizer


def _check_engine(trainer, engine: Engine | None) -> None:
    """Refuse an `engine` argument that does not fit how the trainer generates (before anything is built)."""
    if engine is not None and not isinstance(engine, Engine):
        raise TypeError(f"engine must be a swaprl Engine or None, not {type(engine).__name__}")
    if not trainer.use_vllm:
        if engine is not None and not engine.shares_trainer_weights:
            raise ValueError(f"GRPOConfig(use_vllm=False): TRL generates with the trainer's own module, but "
                             f"{type(engine).__name__} holds its own weights; leave engine=None")
        return
    from ..engines.vllm import VLLMEngine

    if engine is not None and not (isinstance(engine, VLLMEngine) and engine.llm is trainer.vllm_generation.llm):
        raise ValueError("with use_vllm=True the engine must be a VLLMEngine around the trainer's own LLM: "
                         "VLLMEngine(llm=trainer.vllm_generation.llm, model=<checkpoint dir>), or engine=None")
    if engine is None:
        _checkpoint_dir(trainer.model)  # raises naming the fix when the checkpoint's files cannot be found


@contextlib.contextmanager
def _engine(trainer, engine: Engine | None) -> Iterator[Engine]:
    """The engine for the checked `engine` argument: itself, or the one matching how the trainer generates. TRL's
    vLLM engine is woken for the attach the block makes, and put back to sleep, as TRL keeps it, if the block fails:
    the trainer is TRL's own again, and what the attach released (ZeRO-3's gradient buffer) has its room back."""
    if not trainer.use_vllm:
        if engine is None:
            from ..engines.hf import HFEngine

            engine = HFEngine()
        yield engine
        return
    from ..compat import vllm as vllm_compat
    from ..engines.vllm import VLLMEngine

    llm = trainer.vllm_generation.llm
    vllm_compat.check_version()  # before the engine is touched (VLLMEngine checks again)
    # TRL puts the engine to sleep (level 2) as soon as it builds it; VLLMEngine starts from an awake engine and
    # the runtime puts it back to sleep at attach, at its own level. (TRL's own record, where vLLM cannot say.)
    sleeping = vllm_compat.is_sleeping(llm)
    asleep = sleeping if sleeping is not None else trainer.vllm_generation._llm_weights_sleeping
    woken = False
    try:
        if asleep:
            if torch.cuda.is_available():
                # vLLM maps its memory from the driver: what torch holds cached and free (DeepSpeed's build leaves
                # its casts' blocks there, and a released gradient buffer) would otherwise stay out of its reach.
                torch.cuda.empty_cache()
            llm.wake_up()
            woken = True
        if engine is None:
            # Under several processes: one engine per tensor-parallel group of TRL's (consecutive ranks), whose
            # VLLMEngine builds the same groups from the LLM's tensor-parallel size.
            engine = VLLMEngine(llm=llm, model=_checkpoint_dir(trainer.model))
        yield engine
    except BaseException as exc:
        if woken:  # a failed attach gives the engine back awake, as it was handed over
            try:
                if vllm_compat.is_sleeping(llm):  # asleep in part (a sleep undone halfway): LLM.sleep does nothing
                    vllm_compat.sleep_partly_awake(llm, 2)
                else:
                    llm.sleep(level=2)  # TRL's own level (VLLMGeneration)
            except Exception as again:
                exc.add_note(f"putting TRL's vLLM engine back to sleep failed too: {again!r}")
        elif asleep:
            exc.add_note("TRL's vLLM engine may be left awake in part: its wake-up for swaprl's attach did not end")
        raise


def _checkpoint_dir(model: torch.nn.Module) -> Path:
    """The local directory of the checkpoint TRL started vLLM from (`model.name_or_path`, or its hub cache)."""
    from ..checkpoints import checkpoint_dir_of

    local = checkpoint_dir_of(model)
    if local is not None:
        return local
    name = getattr(model, "name_or_path", "") or ""
    try:
        from huggingface_hub import snapshot_download

        path = Path(snapshot_download(name, local_files_only=True))
    except Exception as exc:  # not a hub id, or not cached: the caller names the directory
        raise ValueError(f"cannot find on disk the checkpoint TRL started vLLM from ({name!r}: {exc}); pass "
                         "engine=swaprl.engines.VLLMEngine(llm=trainer.vllm_generation.llm, "
                         "model='/path/to/checkpoint')") from exc
    if not any(path.glob("*.safetensors")):
        raise ValueError(f"the checkpoint {name!r} at {path} has no safetensors files; pass "
                         "engine=swaprl.engines.VLLMEngine(llm=trainer.vllm_generation.llm, model=<a directory "
                         "with the model's safetensors>)")
    return path


def _wrap_at_train_begin(trainer, config: SwapConfig, engine: Engine | None, *, lean_rollouts: bool) -> Runtime:
    """FSDP2 and DeepSpeed: return a runtime now and attach it when `train()` has sharded the model and built its
    optimizer.

    Under FSDP2 transformers builds the optimizer over the unsharded parameters, then accelerate's prepare shards
    the model in place (fully_shard) and points the optimizer's parameter groups at the shards; under DeepSpeed
    transformers' deepspeed_init builds the optimizer and accelerate's prepare hands model and optimizer to
    `deepspeed.initialize`, whose ZeRO optimizer flattens the parameters into partitions and points the torch
    optimizer at their fp32 copies (and loads a checkpoint being resumed). All of it happens inside `train()`, before
    its `on_train_begin` callbacks. Attaching earlier would hold the unsharded parameters (a whole model per rank)
    and an optimizer whose parameters are about to be replaced; at `on_train_begin` `trainer.model` and the
    optimizer are the final ones. Every rank runs the same callback, so every rank attaches at the same point
    (building the engine's groups and reducing the first checks are collective).
    """
    from transformers import TrainerCallback

    how = ("DeepSpeed builds its engine and ZeRO optimizer inside train()" if trainer.is_deepspeed_enabled else
           "the trainer is sharded with FSDP2, and train() shards the model and builds its optimizer")
    rt = swaprl.attach_later(config=config, until=(
        f"{how}, so wrap() attaches it when trainer.train() has done that (at train()'s on_train_begin); use it from "
        "then on, e.g. in a TrainerCallback or after train()"))

    class AttachWhenSharded(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            _attach_sharded(trainer, rt, engine, lean_rollouts=lean_rollouts)

    callback = AttachWhenSharded()
    try:
        with interrupts.held("wrapping the GRPOTrainer"):
            trainer.add_callback(callback)
            rt.on_detach(lambda: trainer.remove_callback(callback))
            if trainer.is_deepspeed_enabled and (restore := _replace_zero3_offload(trainer)) is not None:
                rt.on_detach(restore)
            _register(trainer, rt)
    except BaseException:
        rt.detach()  # a Ctrl-C held to the block's end, or a failure in it: the trainer and its config as they were
        raise
    logger.info("wrapped GRPOTrainer under %s: swaprl attaches when train() has built the model and optimizer",
                "DeepSpeed" if trainer.is_deepspeed_enabled else "FSDP2")
    return rt


def _attach_sharded(trainer, rt: Runtime, engine: Engine | None, *, lean_rollouts: bool) -> None:
    """Bind `rt` to the final model and optimizer, at the start of a `train()` (see `_wrap_at_train_begin`)."""
    try:
        zero = deepspeed_compat.zero_optimizer(trainer.model_wrapped) if trainer.is_deepspeed_enabled else None
    except BaseException:
        rt.detach()
        raise
    if rt.model is not None:
        # A later train(): accelerate's prepare finds the model sharded already and keeps it, and maps the
        # optimizer's parameters back onto the same shards, so the runtime holds what it held.
        if rt.model is trainer.model and rt.optimizer is (zero.optimizer if zero is not None else _optimizer(trainer)):
            return
        if zero is not None:
            rt.detach()  # it holds the previous engine's tensors, which DeepSpeed no longer steps
            raise PhaseError("this train() built a new DeepSpeed engine and ZeRO optimizer, not the ones swaprl "
                             "attached to, so swaprl detached. Wrap the trainer again before training on: "
                             "rt = wrap(trainer); trainer.train()")
        raise PhaseError("the GRPOTrainer's model or optimizer was replaced since swaprl attached to it: detach "
                         "(rt.detach()) and wrap the trainer again before training on")
    try:
        if zero is not None:
            # ZeRO's torch optimizer steps flat fp32 partitions, not the model's parameters: declared as such.
            optimizer, partitions = zero.optimizer, deepspeed_compat.partitions(zero)
        else:
            optimizer, partitions = _optimizer(trainer), None
        # The engine wakes (TRL keeps it asleep) and the homes are decided beside it as it will generate: without
        # ZeRO-3's gradient buffer where every generation releases it (`_every_generation_releases`).
        release = _every_generation_releases(trainer, rt)
        with deepspeed_compat.gradients_released(zero, keep=not release), _engine(trainer, engine) as built:
            rt.bind(trainer.model, optimizer, built, partitions=partitions)
        _install(trainer, rt, lean_rollouts=lean_rollouts, zero=zero)
    except BaseException:
        rt.detach()  # the trainer is TRL's own again, and train() stops with the error
        raise
    logger.info("swaprl attached to the %s GRPOTrainer: generation in phase 'generate' with %s",
                partitions.owner if zero is not None else "FSDP2-sharded", type(built).__name__)


def _every_generation_releases(trainer, rt: Runtime) -> bool:
    """Whether each of the trainer's generations starts an accumulation window, where ZeRO-3's gradient buffer is
    dead and 'generate' releases it (`swaprl.compat.deepspeed.releasable_gradients`). GRPOTrainer generates every
    `steps_per_generation * num_iterations` micro-steps (`_prepare_inputs`); where that is not a multiple of
    `gradient_accumulation_steps`, some generations come inside a window and keep the buffer, so the attach decides
    the homes beside it."""
    args = trainer.args
    every = args.steps_per_generation * args.num_iterations
    return rt.config.grads != "keep" and every % args.gradient_accumulation_steps == 0


def _register(trainer, rt: Runtime) -> None:
    """Make `rt` the trainer's runtime (`runtime_of`, and a second wrap refused) until it is detached."""
    setattr(trainer, _RUNTIME_ATTR, rt)
    rt.on_detach(lambda: vars(trainer).pop(_RUNTIME_ATTR, None))


# ---------------------------------------------------------------- the hooks
def _install(trainer, rt: Runtime, *, lean_rollouts: bool, zero=None) -> None:
    """Route the trainer's generation through `rt`; record how to undo each change, undone at `rt.detach()`.
    `zero`: DeepSpeed's ZeRO optimizer, whose views of what the phase moves follow the moves
    (`swaprl.compat.deepspeed.views_follow`)."""
    @contextlib.contextmanager
    def generating():
        if zero is None:
            with rt.phase("generate"):
                yield
            return
        # Released before the switch, so that the engine wakes into its memory; made again once training is back.
        with deepspeed_compat.gradients_released(zero, keep=rt.config.grads == "keep"), \
                deepspeed_compat.views_follow(zero, rt.phase("generate")):
            yield

    undo = Undo("wrapping the GRPOTrainer")
    with undo.on_error():
        if trainer.use_vllm:
            # First: attach put TRL's engine to sleep behind its back, and this change's undo is what tells TRL so
            # (and makes it re-sync before generating), should anything after it fail.
            undo.push(trl_compat.take_over_vllm(trainer, wake=lambda: rt.engine.wake()), "vLLM sleep, wake-up, sync")
        undo.push(trl_compat.route_generation(trainer, generating), "_generate")
        undo.push(_log_figures(trainer, rt), "log")
        if trainer.use_vllm and lean_rollouts:
            undo.push(trl_compat.lean_rollouts(trainer), "lean rollouts")

    def unwrap() -> None:
        undo.run()
        logger.info("GRPOTrainer unwrapped: TRL generates on its own again")

    rt.on_detach(unwrap)


def _log_figures(trainer, rt: Runtime) -> Callable[[], None]:
    """Add swaprl's figures to every `trainer.log(...)` record, so they reach the user's `report_to` (wandb,
    tensorboard) with TRL's own; returns the undo.

    Per record: the phase switches since the previous record (count, seconds, bytes moved) and the last sync's
    check: whether the engine's weights were the trainer's bit for bit, the sync's and the check's seconds, and the
    rollout-training mismatch on the probe.
    """
    switches = {"n": 0, "s": 0.0, "bytes": 0}

    def on_phase(event: dict) -> None:
        if event["type"] == "phase":
            switches["n"] += 1
            switches["s"] += event["seconds"]
            switches["bytes"] += event["bytes"]

    remove = rt.add_listener(on_phase)

    def with_swaprl(logs: dict) -> dict:
        if switches["n"]:
            logs = {**logs, "swaprl/switch_seconds": switches["s"], "swaprl/switches": switches["n"],
                    "swaprl/moved_gib": switches["bytes"] / 2**30}
            switches.update(n=0, s=0.0, bytes=0)
        return {**logs, **sync_metrics(rt.last_sync)}

    unpatch = trl_compat.add_to_logs(trainer, with_swaprl)

    def restore() -> None:
        remove()
        unpatch()

    return restore


def sync_metrics(report) -> dict[str, float]:
    """The last sync's check as flat numbers for a training log ({} before the first sync)."""
    if report is None:
        return {}
    out = {"swaprl/weights_exact": float(report.weights == "exact"),
           "swaprl/weights_unreadable": float(len(report.unreadable)), "swaprl/verify_seconds": report.verify_seconds}
    if report.sync_seconds is not None:
        out["swaprl/sync_seconds"] = report.sync_seconds
    if report.mismatch is not None:
        m = report.mismatch
        out.update({"swaprl/mismatch/max_abs_logp": m.max_abs, "swaprl/mismatch/mean_abs_logp": m.mean_abs,
                    "swaprl/mismatch/kl": m.kl, "swaprl/mismatch/ratio_outside": m.outside})
    return out
