"""`HFEngine`: generation with the trainer's own module through transformers' `generate`.

There is no second copy of the weights, so there is nothing to sync and rollouts are on-policy by construction.
It is the default engine when vLLM is not installed, and the engine that runs on a CPU. Its KV cache lives only
for the duration of one `generate` call, so sleeping frees nothing and waking costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .. import distributed
from ..sync import trainer_weights
from ..fingerprint import WeightPrint, module_fingerprints
from .base import Engine, EngineStateError, Sampling, sequence_logprobs


class HFEngine(Engine):
    shares_trainer_weights = True

    def __init__(self, model: torch.nn.Module | None = None, *, pad_token_id: int | None = None,
                 eos_token_id: int | list[int] | None = None) -> None:
        self.model = model
        self._pad = pad_token_id
        self._eos = eos_token_id

    def bind(self, model: torch.nn.Module) -> None:
        if self.model is None:
            self.model = model
        elif self.model is not model:
            raise ValueError("HFEngine was built for another module than the one attached; build it with "
                             "HFEngine() and let attach() bind it, or pass the same model to both")

    def _module(self) -> torch.nn.Module:
        if self.model is None:
            raise EngineStateError("HFEngine has no model yet: pass it to HFEngine(model) or attach() it")
        return self.model

    def _special_ids(self, model: torch.nn.Module) -> tuple[int, list[int]]:
        gen_cfg = getattr(model, "generation_config", None)
        eos = self._eos if self._eos is not None else getattr(gen_cfg, "eos_token_id", None)
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        pad = self._pad if self._pad is not None else getattr(gen_cfg, "pad_token_id", None)
        if pad is None:
            pad = eos_ids[0] if eos_ids else 0
        return pad, eos_ids

    def generate(self, prompts: Sequence[Sequence[int]], sampling: Sampling) -> list[list[int]]:
        model = self._module()
        if not prompts:
            return []
        if any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        device = next(model.parameters()).device
        pad, eos_ids = self._special_ids(model)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every row's last prompt token is the last column
            ids[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
        greedy = sampling.temperature == 0
        # An FSDP2 model's forward is collective: every rank must step until all ranks' sequences have ended.
        # transformers only turns this on by itself for models it sharded.
        synced = distributed.is_distributed() and distributed.is_fsdp2(model)
        kwargs = dict(max_new_tokens=sampling.max_tokens, do_sample=not greedy, num_return_sequences=sampling.n,
                      use_cache=True, synced_gpus=synced,
                      pad_token_id=pad, eos_token_id=eos_ids or None)
        if not greedy:
            kwargs.update(temperature=sampling.temperature, top_p=sampling.top_p, top_k=0)
        was_training = model.training
        model.eval()
        devices = [device] if device.type == "cuda" else []
        try:
            with torch.no_grad(), torch.random.fork_rng(devices=devices, enabled=sampling.seed is not None):
                if sampling.seed is not None:
                    torch.manual_seed(sampling.seed)
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
        finally:
            model.train(was_training)
            distributed.reshard(model)
        completions = []
        for row in out[:, width:].tolist():
            for j, tok in enumerate(row):
                if tok in eos_ids:
                    row = row[: j + 1]
                    break
            completions.append(row)
        return completions

    def logprobs(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return sequence_logprobs(self._module(), sequences)

    def weight_fingerprints(self) -> dict[str, WeightPrint]:
        """The module's own parameters: the trainer's, by construction (collective under FSDP2)."""
        params = dict(trainer_weights(self._module()))
        return {name: WeightPrint(fp, numel, params[name].dtype, (name,))
                for name, (fp, numel) in module_fingerprints(self._module()).items()}
