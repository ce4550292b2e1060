"""The DeepSpeed internals swaprl reads, in one place, behind a version gate.

Under DeepSpeed's ZeRO, what swaprl moves for 'generate' is not the model's parameters and their optimizer's states
but the flat fp32 partitions ZeRO's torch optimizer steps and their states (`partitions`, declared to the runtime as
`swaprl.partitions.FlatPartitions`). ZeRO-3 keeps each parameter in partitions over the ranks, which the weight sync
gathers a bucket at a time (`gathered`) and the weight check fingerprints where they lie (`local_part`). ZeRO-1/2
keep views of the flat partitions that the moves would leave behind (`views_follow`). None of this is DeepSpeed's
documented surface: each function names the private attributes it reads and why; all were checked against
DeepSpeed 0.19.8 (`SUPPORTED`), with its CPU accelerator on gloo ranks.

Importing this module does not import DeepSpeed: the ZeRO-3 tests on a parameter read its attributes only.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterable, Iterator
from contextlib import AbstractContextManager

import torch

from .. import interrupts
from ..errors import PhaseError
from ..partitions import FlatPartitions
from ..residency import savable
from . import in_range

SUPPORTED = ">=0.19.8,<0.20"
"""DeepSpeed versions swaprl knows (PEP 440 specifier)."""


def check_version(version: str | None = None) -> None:
    """Raise if `version` (default: the installed DeepSpeed's) is outside `SUPPORTED`."""
    if version is None:
        import deepspeed

        version = deepspeed.__version__
    if not in_range(version, SUPPORTED):
        raise RuntimeError(
            f"swaprl supports deepspeed{SUPPORTED}, found deepspeed {version}. It moves the flat partitions of "
            "DeepSpeed's ZeRO optimizer and reads ZeRO-3's partitioned parameters through DeepSpeed internals that "
            "change between releases, so other versions are refused rather than silently mis-moved. Install a "
            f"supported one: pip install 'deepspeed{SUPPORTED}'.")


# ---------------------------------------------------------------- ZeRO-3's partitioned parameters
def is_partitioned(p: torch.Tensor) -> bool:
    """A ZeRO-3 parameter: DeepSpeed gives it a `ds_id` (what its own `is_zero_param` tests) and keeps this rank's
    elements in `ds_tensor`, leaving `p.data` empty except while it is gathered."""
    return hasattr(p, "ds_id") and hasattr(p, "ds_tensor")


def full_shape(p: torch.Tensor) -> tuple[int, ...]:
    """The parameter's own shape: ZeRO-3 keeps it in `ds_shape` (its `.shape` is the empty placeholder's)."""
    return tuple(p.ds_shape) if is_partitioned(p) else tuple(p.shape)


def full_numel(p: torch.Tensor) -> int:
    return int(p.ds_numel) if is_partitioned(p) else p.numel()


def gathered(params: Iterable[torch.Tensor]) -> AbstractContextManager:
    """Inside: the ZeRO-3 parameters among `params` whole on every rank, gathered in one collective (every rank of
    their group must pass the same ones), partitioned again on the way out; other tensors as they are.

    `deepspeed.zero.GatheredParameters` with no modifier rank: nothing is written, so nothing is broadcast back. Those
    DeepSpeed holds gathered already (ZeRO-3's persistent small parameters, `ds_status` AVAILABLE, which it keeps
    whole between steps) are read as they are: gathering them would partition them on the way out."""
    todo = [p for p in params if is_partitioned(p) and not _available(p)]
    if not todo:
        return contextlib.nullcontext()
    from deepspeed.runtime.zero import GatheredParameters

    return GatheredParameters(todo)


def _available(p: torch.Tensor) -> bool:
    from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus

    return p.ds_status == ZeroParamStatus.AVAILABLE


def local_part(p: torch.Tensor):
    """This rank's elements of a ZeRO-3 parameter and the process group over whose ranks the parts make it whole.

    Rank r's partition `ds_tensor` holds elements [r*n, (r+1)*n) of the flattened parameter, n its `ds_numel`; the
    partitions of the last ranks run past the parameter's end, and ZeRO-3 leaves that tail uninitialised
    (`Init._partition_param` copies only the elements that exist), so it is cut off here. The group is
    `ds_process_group`, the one ZeRO-3 partitions the parameter over."""
    import torch.distributed as dist

    part, group = p.ds_tensor, p.ds_process_group
    size = int(part.ds_numel)
    valid = max(0, min(size, int(p.ds_numel) - dist.get_rank(group=group) * size))
    return part.detach().reshape(-1).narrow(0, 0, valid), group


def forget_trace(model: torch.nn.Module) -> None:
    """After a forward of a ZeRO-3 model that is no training step (the mismatch probe's scoring): invalidate the
    order of modules ZeRO-3 recorded, so that the next training forward records its own.

    ZeRO-3 records the modules of the first forward after its trace was invalidated and from then on prefetches
    parameters in that order (`PartitionedParameterCoordinator`, reached through each parameter's `_z3_optimizer`,
    set by `_link_all_hp_params`). A scoring forward calls the `lm_head` module; TRL's training forward does not
    (its fused head reads `lm_head.weight` inside a `GatheredParameters` of its own), so with the scoring forward's
    trace the training forward prefetched an untied `lm_head` and released it while autograd held it: its backward
    failed with "The size of tensor a (0) must match the size of tensor b (3584)" (Qwen2.5-7B). A model that is not
    under ZeRO-3 is left alone."""
    first = next(model.parameters(), None)
    zero = getattr(first, "_z3_optimizer", None) if first is not None and is_partitioned(first) else None
    if zero is None:
        return
    coordinator = zero.parameter_offload.get_param_coordinator()
    if not coordinator.is_invalid_trace():  # invalidating an invalid trace raises
        coordinator._invalidate_trace()


# ---------------------------------------------------------------- ZeRO's optimizers
def zero_optimizer(engine):
    """The ZeRO optimizer of a `DeepSpeedEngine` (`engine.optimizer`), refused naming the fix when it is not one of
    the two swaprl knows: stage 1/2's `DeepSpeedZeroOptimizer` and stage 3's `DeepSpeedZeroOptimizer_Stage3`."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    zero = getattr(engine, "optimizer", None)
    if not isinstance(zero, DeepSpeedZeroOptimizer | DeepSpeedZeroOptimizer_Stage3):
        raise TypeError(f"DeepSpeed's engine holds a {type(zero).__name__}, not a ZeRO optimizer of stage 1, 2 or 3: "
                        "swaprl moves ZeRO's flat partitions only. Use zero_optimization.stage 2 or 3")
    if not isinstance(zero.optimizer, torch.optim.Optimizer):
        raise TypeError(f"DeepSpeed's ZeRO optimizer steps a {type(zero.optimizer).__name__}, not a torch optimizer, "
                        "whose states swaprl cannot find; use a torch or DeepSpeed optimizer (AdamW)")
    return zero


def stage(zero) -> int:
    """3, or 2 / 1 for stage 1/2's optimizer (`partition_gradients` is what stage 2 adds)."""
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3

    if isinstance(zero, DeepSpeedZeroOptimizer_Stage3):
        return 3
    return 2 if zero.partition_gradients else 1


def partitions(zero) -> FlatPartitions:
    """What ZeRO's torch optimizer (`zero.optimizer`) steps, declared for the runtime.

    Stage 1/2: one fp32 partition per group, `single_partition_of_fp32_groups`, always a copy of the bf16/fp32
    model's flat group (`DeepSpeedZeroOptimizer.__init__` clones it), listed in the optimizer's groups. Stage 3:
    one per sub-group, `fp32_partitioned_groups_flat`, listed in the groups only inside `_optimizer_step`; it would
    be the model's own partition, not a copy, where the model trains in fp32 on the same device
    (`_create_fp32_partitions` appends `fp16_partitioned_groups_flat[i]` itself), so which are copies is read from
    their storage (in 0.19.8 that branch compares a tensor's `torch.device` with a device name, a string, which is
    never equal: fp32 partitions are copies there too). With the optimizer offloaded
    (`offload_optimizer`) ZeRO keeps them and their states in host memory itself: stage 1/2's `cpu_offload`,
    stage 3's `subgroup_to_device[i] == "cpu"`.

    Stage 3 without that offload may be streamed (see `_stream_step`): each sub-group's fp32 partition is cast into
    its bf16 one, `fp16_partitioned_groups_flat[i]`, in the group `sub_group_to_group_id[i]`. Stage 1/2 may not:
    its `_hp_mapping` views of the partitions would hold the device memory a host home leaves."""
    n = stage(zero)
    streamed: dict = {}
    if n == 3:
        flats = list(zero.fp32_partitioned_groups_flat)
        models = list(zero.fp16_partitioned_groups_flat)
        copies = [not _same_storage(f, m) for f, m in zip(flats, models)]
        on_host = getattr(zero, "subgroup_to_device", {}) if zero.offload_optimizer else {}
        kept = [on_host.get(i) == "cpu" for i in range(len(flats))]
        if not zero.offload_optimizer and all(m is not None for m in models):  # None: swapped to NVMe
            streamed = {"groups": tuple(zero.sub_group_to_group_id[i] for i in range(len(flats))),
                        "models": tuple(m if c else None for m, c in zip(models, copies)),
                        "prepare_streaming": lambda at_home, written: _stream_step(zero, at_home, written)}
    else:
        flats = list(zero.single_partition_of_fp32_groups)
        copies = [True] * len(flats)
        kept = [bool(zero.cpu_offload)] * len(flats)
    return FlatPartitions(owner=f"DeepSpeed ZeRO-{n}", tensors=tuple(flats),
                          copies=frozenset(id(f) for f, c in zip(flats, copies) if c),
                          kept=frozenset(id(f) for f, k in zip(flats, kept) if k), **streamed)


def _stream_step(zero, at_home, written) -> Callable[[], None]:
    """Let stage 3's step run over fp32 partitions whose data is at its host home (`at_home(t)`), for the streamed
    step (`swaprl.streaming`) to update, and leave out its copy into the bf16 partition where the streamed step made
    it (`written(t)`); returns what undoes it. Two of its per-sub-group methods are wrapped on the instance:

    - `_prepare_sub_group(i)` gives the partition its fp32 gradient (`_prepare_fp32_grad_for_sub_group`: `.grad =`
      a device tensor), which torch refuses for a tensor whose data is in host memory. For that call the partition's
      data is a placeholder on the device of its shape (one element, expanded: no memory), and its home again after;
      the gradient stays, and `unscale_and_clip_grads` scales it where it is.
    - `_reassign_or_swap_out_partitioned_parameters(i)` copies the updated fp32 partition into the bf16 one. The
      streamed step cast it on the device already (a partition at home a piece at a time, one on the device whole),
      and from host memory torch would cast on the CPU: for a partition at home, or one it wrote, only the
      unflattening into the parameters' `ds_tensor`s runs.

    And `state_dict()` (what `engine.save_checkpoint` saves) gives the fp32 partitions it lists (`fp32_flat_groups`)
    storages of their own over their bytes (`residency.savable`): at home they view one host buffer, which
    `torch.save` would write whole beside them.
    """
    prepare, reassign = zero._prepare_sub_group, zero._reassign_or_swap_out_partitioned_parameters
    plain_state_dict = zero.state_dict

    def prepare_sub_group(sub_group_id, timer_names):
        fp32 = zero.fp32_partitioned_groups_flat[sub_group_id]
        if not at_home(fp32):
            return prepare(sub_group_id, timer_names)
        home = fp32.data
        fp32.data = torch.empty(1, dtype=fp32.dtype, device=zero.device).expand(fp32.shape)
        try:
            return prepare(sub_group_id, timer_names)
        finally:
            fp32.data = home

    def reassign_or_swap_out(sub_group_id):
        fp32 = zero.fp32_partitioned_groups_flat[sub_group_id]
        if written(fp32) or at_home(fp32):  # asked first, so that it forgets; a partition in pieces is at home
            return zero._unflatten_partitioned_parameters(sub_group_id)
        return reassign(sub_group_id)

    def state_dict():
        from deepspeed.checkpoint.constants import FP32_FLAT_GROUPS

        out = plain_state_dict()
        if FP32_FLAT_GROUPS in out:
            out[FP32_FLAT_GROUPS] = savable(list(out[FP32_FLAT_GROUPS]))
        return out

    ours = {"_prepare_sub_group": prepare_sub_group,
            "_reassign_or_swap_out_partitioned_parameters": reassign_or_swap_out, "state_dict": state_dict}
    before = {name: vars(zero).get(name) for name in ours}  # an instance attribute of someone else's, if any
    for name, fn in ours.items():
        setattr(zero, name, fn)

    def undo() -> None:
        for name, fn in ours.items():
            if vars(zero).get(name) is not fn:
                continue  # replaced since: whoever did keeps it
            if before[name] is None:
                delattr(zero, name)
            else:
                setattr(zero, name, before[name])

    return undo


def _same_storage(a: torch.Tensor, b: torch.Tensor | None) -> bool:
    return b is not None and (a is b or a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def releasable_gradients(zero) -> torch.Tensor | None:
    """ZeRO-3's flat buffer of this rank's gradient partitions (`grad_partitions_flat_buffer`: the model's size
    over the ranks, in the gradient accumulation dtype, on the device) where nothing in it will be read again: ZeRO
    is between optimizer steps, no backward has run since its `zero_grad` (`micro_step_id` 0, its
    `_epilogue_ran_this_backward` unset), so the next backward copies every gradient it reduces into the buffer
    rather than adding to it (`partition_grads`). None where it holds gradients still to be stepped, where it is not
    on ZeRO's device (ZeRO keeps it in host memory itself under `offload_optimizer`; a user's
    `offload_states(include=[lp_grads])` moves it there), or under stages 1/2."""
    if stage(zero) != 3 or zero.offload_optimizer:
        return None
    buffer = getattr(zero, "grad_partitions_flat_buffer", None)
    if buffer is None or buffer.device != torch.device(zero.device):
        return None
    if zero.micro_step_id != 0 or getattr(zero, "_epilogue_ran_this_backward", False):
        return None
    return buffer


def gradients_released(zero, *, keep: bool = False) -> AbstractContextManager[None]:
    """Run the block (a `generate` phase, or the attach that wakes the engine) without ZeRO-3's buffer of gradient
    partitions on the device, where its contents are dead (`releasable_gradients`); `keep` (SwapConfig.grads="keep")
    leaves it. Its storage is freed (`resize_(0)`) and made again, zeroed, at the block's end (`_make_again`): ZeRO's
    per-parameter views of it (`__param_id_to_grad_partition`, `averaged_gradients`) share that storage and see the
    new memory. A gradient no backward of the next window writes (a parameter that takes no part in it) is then
    zero, not the last window's, which ZeRO would otherwise step again."""
    buffer = None if keep or zero is None else releasable_gradients(zero)
    return contextlib.nullcontext() if buffer is None else _Released(zero, buffer)


class _Released:
    """`gradients_released` of a buffer it frees. A class, not a generator, so that its exit is one protected call:
    a Ctrl-C once the block is done waits for the buffer to be made again."""

    def __init__(self, zero, buffer: torch.Tensor) -> None:
        unmade = _unmade.get(zero)  # released already: a block before this one could not make it again
        self.zero, self.buffer = zero, buffer
        self.size = unmade.size if unmade is not None else buffer.untyped_storage().nbytes()

    def __enter__(self) -> None:
        try:
            with interrupts.held("releasing ZeRO-3's gradient buffer"):
                self.buffer.untyped_storage().resize_(0)
        except BaseException as exc:  # a Ctrl-C held to the section's end: no block runs, and no exit
            _make_again(self.zero, self.buffer, self.size, failed=exc)
            raise

    @interrupts.protected
    def __exit__(self, exc_type, exc, tb) -> bool:
        _make_again(self.zero, self.buffer, self.size, failed=exc)
        return False


class _Unmade:
    """A released gradient buffer the device had no room to make again: its size, and the guard on ZeRO's module."""

    def __init__(self, size: int, guard) -> None:
        self.size, self.guard = size, guard


_unmade: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # ZeRO optimizer -> _Unmade


def _make_again(zero, buffer: torch.Tensor, size: int, *, failed: BaseException | None = None) -> None:
    """Give the released buffer its `size` bytes again, zeroed (a buffer whole already is left as it is: it may
    hold a window's gradients). Where the device has no room (a switch that failed with the engine still awake,
    another process on the GPU), the buffer stays released behind a guard that makes it again before ZeRO's module
    runs its next forward with gradients, since a backward would write into the empty storage; the failure is then
    the error, or, where the block `failed` already, a note on that error (the first cause stays the one raised).
    Under several ranks each decides alone: a rank that refuses leaves the others waiting in their next collective
    until its timeout."""
    with interrupts.held("making ZeRO-3's gradient buffer again"):
        storage = buffer.untyped_storage()
        if storage.nbytes() != size:
            try:
                storage.resize_(size)
            except RuntimeError as exc:
                if not _no_room(exc):
                    raise
                _guard(zero, buffer, size)
                why = (f"swaprl could not make DeepSpeed ZeRO-3's gradient buffer ({size / 2**30:.2f} GiB on "
                       f"{buffer.device}) again after releasing it for generation "
                       f"({str(exc).splitlines()[0].rstrip('.')}). It stays released, and the next forward with "
                       "gradients tries again (and refuses while there is no room). Free that device memory (a vLLM "
                       "engine still awake after a failed switch, another process on the GPU), or keep the buffer "
                       "through generation: SwapConfig(grads='keep').")
                if failed is None:
                    raise PhaseError(why) from exc
                failed.add_note(why)
                return
            buffer.zero_()
        unmade = _unmade.pop(zero, None)
        if unmade is not None:
            unmade.guard.remove()


def _no_room(exc: RuntimeError) -> bool:
    """The allocator's out-of-memory error: torch.OutOfMemoryError on a GPU, a plain RuntimeError on the CPU."""
    return isinstance(exc, torch.OutOfMemoryError) or "can't allocate memory" in str(exc)


def _guard(zero, buffer: torch.Tensor, size: int) -> None:
    """Make the buffer again before ZeRO's module runs a forward with gradients (registered and recorded in the
    caller's held section: a guard nothing records would never be removed)."""
    if zero in _unmade:
        return
    owner = weakref.ref(zero)  # the hook lives on the module: it must not keep a discarded optimizer alive

    def before_forward(module, args) -> None:
        zero = owner()
        if zero is not None and torch.is_grad_enabled():  # a forward without gradients writes none into it
            _make_again(zero, buffer, size)

    _unmade[zero] = _Unmade(size, zero.module.register_forward_pre_hook(before_forward, prepend=True))


def has_views(zero) -> bool:
    """Whether ZeRO keeps views of the tensors swaprl moves: stage 1/2 on the device (see `views_follow`)."""
    return stage(zero) != 3 and not zero.cpu_offload


@contextlib.contextmanager
def views_follow(zero, block: AbstractContextManager) -> Iterator[None]:
    """Run `block` (the runtime's `phase("generate")`, which moves the fp32 partitions and their states to host
    memory and back) with stage 1/2's views of those tensors following them.

    For its `safe_get_full_fp32_param` and `safe_get_full_optimizer_state`, stage 1/2 gives each bf16 parameter
    `_hp_mapping`, whose `hp_fragment` and `optim_fragment` are views (`narrow`) of the fp32 partition and of its
    optimizer states (`link_hp_params`, `lazy_init_hp_params_optimizer_state`). swaprl moves a tensor by
    re-pointing its `.data`; a view keeps the storage it was made from. Left alone they would hold the device
    memory the move frees, and read values the step no longer writes. So they are dropped before the move out
    (DeepSpeed's own `offload_states` drops them too, `_clear_hp_buffer_references`) and made again after each
    move, where the tensors are then, with DeepSpeed's own `_link_all_hp_params` and
    `_lazy_init_hp_params_optimizer_state` (what its `reload_states` calls)."""
    if not has_views(zero):
        with block:
            yield
        return
    _unlink(zero)
    try:
        with block:
            _relink(zero)  # on the host copies while generating
            yield
    finally:
        _relink(zero)  # on the device copies again (or still: a switch that failed was undone)


def _unlink(zero) -> None:
    for group in zero.bit16_groups:
        for p in group:
            p._hp_mapping = None


def _relink(zero) -> None:
    zero._link_all_hp_params()
    # Linked lazily after the first step (which makes the states); before it there is nothing to view.
    zero._hp_optimizer_states_linked = False
    if all(zero.optimizer.state.get(f) for f in zero.single_partition_of_fp32_groups):
        zero._lazy_init_hp_params_optimizer_state()
