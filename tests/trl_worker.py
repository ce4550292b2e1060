"""One rank of tests/test_trl_multi.py: a real tiny GRPOTrainer on several processes, plain TRL and wrapped by swaprl.

    torchrun --standalone --nproc-per-node 2 tests/trl_worker.py --layout ddp --out DIR --checkpoint CK
    torchrun --standalone --nproc-per-node 2 tests/trl_worker.py --layout fsdp2 --vllm-tp 2 --runs wrapped ...
    torchrun --standalone --nproc-per-node 2 tests/trl_worker.py --layout fsdp2 --device cuda ...   # 2 GPUs

`--layout`: how accelerate spreads the trainer over the ranks (ddp, or fsdp2: accelerate's FSDP2 through
GRPOConfig(fsdp=True, fsdp_config={"version": 2})). `--vllm-tp N`: TRL's vLLM colocate mode with
vllm_tensor_parallel_size=N (0: generation with transformers). `--runs`: plain TRL, swaprl's wrap, or both one after
the other (TRL's vLLM starts once per process, so a vLLM layout gets one launch per run); "twice" and "detached"
are the wrapper's other paths (see their functions), "wrapped_host" the wrapped run with
SwapConfig(optimizer_states="host"). `--device cuda`: one GPU per rank, NCCL (with `--deterministic`, runs that can
be compared bit for bit). Each rank writes
DIR/rank{N}.json with what it saw (and the traceback if it failed) and DIR/rank{N}_{run}.pt with its final
parameters (its shards under FSDP2), so the test can assert on every rank.

On CPUs (gloo) accelerate turns FSDP on only for GPU-like distributed types: `AcceleratorState` sets
`DistributedType.FSDP` in its branch for MULTI_GPU and its kin and never for MULTI_CPU (accelerate 1.15,
accelerate/state.py), so a CPU trainer asking for FSDP2 silently gets DDP. `cpu_fsdp_gate_lifted` lets that one
branch see MULTI_GPU while the trainer's Accelerator is built; everything after it is accelerate's own FSDP2 path
(fully_shard in fsdp2_prepare_model, the optimizer switched to the DTensor shards) and TRL's, on gloo CPU ranks.
On GPUs nothing is lifted.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import traceback
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the swaprl under test, wherever torchrun runs

import swaprl
from swaprl.compat.torch import local_tensor
from tests import vllm_cpu
from tests.test_trl import make_trainer

# Before any trainer exists: TRL's trainer imports vLLM, which keeps an import error of an optional dependency with
# its traceback, and so every frame on the stack at that import. Imported first inside a run, that run's trainer and
# the process group would live on to the interpreter's teardown (benchmarks/bench_grpo.py's child says what followed).
from trl import GRPOTrainer  # noqa: E402,F401


@contextlib.contextmanager
def cpu_fsdp_gate_lifted():
    """While the trainer's Accelerator is built on CPU ranks: accelerate's FSDP gate sees MULTI_GPU (module doc)."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    init = AcceleratorState.__init__

    def lifted(self, *args, **kwargs):
        shared = PartialState._shared_state
        was = shared.get("distributed_type")
        if was == DistributedType.MULTI_CPU:
            shared["distributed_type"] = DistributedType.MULTI_GPU
        try:
            init(self, *args, **kwargs)
        finally:
            # With FSDP on, accelerate records FSDP as the process's type (PartialState's too): keep that.
            if shared.get("distributed_type") == DistributedType.MULTI_GPU:
                shared["distributed_type"] = was

    AcceleratorState.__init__ = lifted
    try:
        yield
    finally:
        AcceleratorState.__init__ = init


def shards(model) -> dict[str, torch.Tensor]:
    return {n: local_tensor(p).detach().cpu().clone() for n, p in model.named_parameters()}


def build(args, run: str):
    overrides = {}
    if args.layout == "fsdp2":
        overrides.update(fsdp=True, fsdp_config={"version": 2})
    if args.vllm_tp:
        overrides.update(vllm_tensor_parallel_size=args.vllm_tp, vllm_importance_sampling_correction=False)
    cuda = args.device == "cuda"
    gate = cpu_fsdp_gate_lifted() if args.layout == "fsdp2" and not cuda else contextlib.nullcontext()
    with gate:
        return make_trainer(args.checkpoint, Path(args.out) / run, steps=args.steps, use_vllm=args.vllm_tp > 0,
                            cuda=cuda, **overrides)


def train(args, run: str) -> dict:
    """Train a few GRPO steps, plain TRL or wrapped; what this rank saw."""
    from transformers import TrainerCallback

    from swaprl.integrations.trl import wrap

    trainer = build(args, run)
    out: dict = {"fsdp": trainer.is_fsdp_enabled}
    initial = shards(trainer.model)
    full_param_bytes = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
    seen: dict = {"phases": [], "generate": [], "train": [], "syncs": [], "steps": [], "streamed": []}
    rt = None
    if run.startswith("wrapped"):
        # "wrapped_host": the states stay in host memory and stream through each step, in chunks of 1 MiB (under
        # FSDP2 the streamed step is installed after train() built the LR scheduler around the optimizer's step).
        # "swap": the states' moves (on a GPU, "auto" would keep this tiny model's beside the engine).
        config = swaprl.SwapConfig(optimizer_states="host", stream_chunk_bytes=2**20) if run == "wrapped_host" \
            else swaprl.SwapConfig(optimizer_states="swap")
        rt = wrap(trainer, config=config)
        out["current_is_rt"] = swaprl.current() is rt
        try:
            rt.status()
            out["status_before_train"] = "answered"
        except swaprl.PhaseError as exc:
            out["status_before_train"] = str(exc)

        def on_event(e: dict) -> None:
            if e["type"] == "phase":
                seen["phases"].append(e["phase"])
                seen[e["phase"]].append({"optimizer": e["status"]["optimizer"], "engine": e["status"]["engine"]})
            elif e["type"] == "sync":
                seen["syncs"].append({"weights": e["weights"], "ok": e["ok"], "checked": e["checked"]})
            elif e.get("transition") == "optimizer.step":
                seen["streamed"].append(e["chunks"])

        rt.add_listener(on_event)

        class OnStep(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                seen["steps"].append({"phase": rt.current_phase, "optimizer": rt.status()["optimizer"]})

        trainer.add_callback(OnStep())
    trainer.train()
    final = shards(trainer.model)
    torch.save(final, Path(args.out) / f"rank{dist.get_rank()}_{run}.pt")
    out.update(seen)
    out["moved"] = any(not torch.equal(final[n], initial[n]) for n in final)
    out["grad_norms"] = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    out["full_param_bytes"] = full_param_bytes
    out["sharded"] = any(type(p).__name__ == "DTensor" for p in trainer.model.parameters())
    if rt is not None:
        out["logged_weights_exact"] = [h["swaprl/weights_exact"] for h in trainer.state.log_history
                                       if "swaprl/weights_exact" in h]
        if args.vllm_tp:
            out["engine_weights_bytes"] = rt.engine.weights_bytes
        rt.detach()
    if args.vllm_tp and args.device == "cpu":  # what the plain run's sync needs (tests/vllm_cpu.py)
        from swaprl.compat.vllm import apply_model

        out["packed_linears"] = sum(apply_model(trainer.vllm_generation.llm, vllm_cpu.packed_linears), [])
        out["amx"] = bool(torch.cpu._is_amx_tile_supported())
    return out


def train_twice(args, run: str) -> dict:
    """Wrapped, then train() twice: the second finds the model sharded and the runtime holding it already."""
    from swaprl.integrations.trl import wrap

    trainer = build(args, run)
    rt = wrap(trainer)
    phases: list[str] = []
    rt.add_listener(lambda e: phases.append(e["phase"]) if e["type"] == "phase" else None)
    trainer.train()
    first = len(phases)
    trainer.train()
    out = {"first": phases[:first], "second": phases[first:], "optimizer": rt.status()["optimizer"]}
    rt.detach()
    return out


def detached_before_train(args, run: str) -> dict:
    """Wrapped and detached before train(): the trainer trains as TRL's own, with no runtime attached."""
    from transformers import TrainerCallback

    from swaprl.integrations.trl import runtime_of, wrap

    trainer = build(args, run)
    wrap(trainer).detach()
    attached = []

    class OnStep(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            try:
                swaprl.current()
                attached.append(True)
            except swaprl.PhaseError:
                attached.append(False)

    trainer.add_callback(OnStep())
    trainer.train()
    return {"attached_during_steps": attached, "runtime_of": runtime_of(trainer) is not None,
            "steps": trainer.state.global_step}


RUNS = {"plain": train, "wrapped": train, "wrapped_host": train, "twice": train_twice,
        "detached": detached_before_train}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layout", choices=["ddp", "fsdp2"], required=True)
    ap.add_argument("--vllm-tp", type=int, default=0)
    ap.add_argument("--runs", default="plain,wrapped", help=f"comma-separated, of {sorted(RUNS)}")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch's deterministic algorithms, so that two runs on GPUs can be compared bit for bit "
                         "(attention's backward and cuBLAS otherwise sum in an order that varies from run to run)")
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    rank = int(os.environ.get("RANK", "0"))
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    result: dict = {"rank": rank}
    if args.vllm_tp and args.device == "cpu":
        vllm_cpu.keep_weights_as_loaded()
    if args.deterministic:
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # read when cuBLAS starts: before any CUDA work
        torch.use_deterministic_algorithms(True)
    try:
        for run in args.runs.split(","):
            result[run] = RUNS[run](args, run)
    except BaseException:
        result["error"] = traceback.format_exc()
        raise
    finally:
        (out_dir / f"rank{rank}.json").write_text(json.dumps(result, indent=1, default=str))
    if dist.is_initialized():
        # Torn down here, not by the interpreter's exit: a gloo group left to it once aborted a CPU rank ("terminate
        # called without an active exception") after its report was written (benchmarks/bench_grpo.py does the same).
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
    print("trl_worker: main returned", flush=True)  # an exit code set after this comes from interpreter shutdown
