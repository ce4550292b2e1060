"""The on-policy check at a model's depth: its cost against the weight sync's, and the rollout-training mismatch.

    python benchmarks/bench_verify.py --preset qwen2.5-1.5b \
        --out benchmarks/results/verify_h200/verify_qwen2.5-1.5b.json
    python benchmarks/bench_verify.py --preset qwen2.5-7b --out benchmarks/results/verify_h200/verify_qwen2.5-7b.json
    python benchmarks/bench_verify.py --preset qwen2.5-72b --layers 20 \
        --out benchmarks/results/verify_h200/verify_qwen2.5-72b-20l.json

One process per model (vLLM's sleep-mode allocator is one per process). Writes a random checkpoint, loads a bf16 trainer
with plain SGD (no optimizer states: only the sync and the check move anything; `--optimizer adamw` adds AdamW's states,
swapped to the host, whose copies run under the sync and the check as they do in a real run), builds a colocated vLLM
engine with swaprl's defaults (the check on, no bounds), and runs `--warmup + --cycles` cycles: the engine generates a
batch, the trainer takes a policy-gradient step on it, and the next switch syncs the moved weights, proves them
bit-exact and measures the mismatch on the probe. Times are the runtime's own step times; medians after warm-up.

Floors, measured in the same run: the sync is (trainer bytes read + engine bytes written) over the device copy rate
(read + write); the weight check reads every trainer and engine byte once, so its floor is those bytes over the
same rate. The mismatch probe (a short generation and one trainer forward) has no byte floor; its time is reported.

Then faults at this size, each of which must be caught: one element of one engine tensor changed after a sync,
and a sync that drops one bucket.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

import swaprl
from swaprl.checkpoints import write_random_checkpoint
from swaprl.compat import vllm as vllm_compat
from swaprl.compat.transformers import enable_activation_checkpointing

from bench_transitions import device_copy_GBps

STEPS = ("sync weights", "verify weights", "sample probe", "score probe")  # the probe: engine, then trainer


def policy_step(model, opt, prompts, completions, n: int, micro_batch: int) -> None:
    """One policy-gradient step on the rollouts with random advantages: moves every weight a little."""
    gen = torch.Generator().manual_seed(len(completions))
    adv = torch.randn(len(completions), generator=gen)
    device = next(model.parameters()).device
    for lo in range(0, len(completions), micro_batch):
        rows = [list(prompts[i // n]) + list(completions[i]) for i in range(lo, min(lo + micro_batch,
                                                                               len(completions)))]
        width = max(map(len, rows))
        ids = torch.zeros((len(rows), width), dtype=torch.long)
        for j, r in enumerate(rows):
            ids[j, : len(r)] = torch.tensor(r)
        ids = ids.to(device)
        logp = torch.log_softmax(model(input_ids=ids).logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
        (-(logp.mean(1) * adv[lo: lo + len(rows)].to(device)).sum() / len(completions)).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="qwen2.5-1.5b")
    ap.add_argument("--layers", type=int, default=None, help="cut the checkpoint to this many layers")
    ap.add_argument("--param-dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--cycles", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--completions", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", default="sgd", choices=["sgd", "adamw"],
                    help="adamw: states swapped to the host, their copies overlapping the sync and the check")
    ap.add_argument("--enforce-eager", action="store_true", help="vLLM without torch.compile and CUDA graphs")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"))
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM

    from swaprl.engines.vllm import VLLMEngine

    d2d = device_copy_GBps()
    torch.cuda.empty_cache()
    name = args.preset + (f"-{args.layers}l" if args.layers else "")
    t0 = time.perf_counter()
    path = write_random_checkpoint(args.preset, Path(args.workdir) / name, layers=args.layers)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.param_dtype), device_map="cuda")
    enable_activation_checkpointing(model)
    model.config.use_cache = False
    model.train()
    load_s = time.perf_counter() - t0
    torch.cuda.empty_cache()
    engine = VLLMEngine(path, max_model_len=256, enforce_eager=args.enforce_eager)
    opt = (torch.optim.AdamW(model.parameters(), lr=args.lr) if args.optimizer == "adamw"
           else torch.optim.SGD(model.parameters(), lr=args.lr))
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(grads="free"))
    times: dict[str, list[float]] = {s: [] for s in STEPS}
    rt.add_listener(lambda e: times[e["step"]].append(e["seconds"])
                    if e["type"] == "step" and e["step"] in times else None)

    gen = torch.Generator().manual_seed(0)
    cycles = []
    for cycle in range(args.warmup + args.cycles):
        prompts = torch.randint(0, 256, (args.prompts, 16), generator=gen).tolist()
        t = time.perf_counter()
        with swaprl.phase("generate"):
            switch_s = time.perf_counter() - t
            completions = rt.engine.generate(prompts, swaprl.Sampling(max_tokens=args.max_tokens,
                                                                      n=args.completions, seed=cycle))
        report = rt.last_sync  # complete: the trainer scored the probe as training started
        with swaprl.phase("train"):
            policy_step(model, opt, prompts, completions, args.completions, micro_batch=8)
        cycles.append({"cycle": cycle, "switch_s": switch_s, **report.as_dict()})
        print(f"cycle {cycle}: weights {report.weights} ({report.checked} tensors), sync {report.sync_seconds:.3f} s, "
              f"check {report.verify_seconds:.4f} s, probe {report.mismatch_seconds:.3f} s, mismatch max "
              f"{report.mismatch.max_abs:.4f} mean {report.mismatch.mean_abs:.4f} KL {report.mismatch.kl:.2e} "
              f"outside {report.mismatch.outside:.2%}", flush=True)

    faults = inject_faults(rt, engine, model, opt, args)
    swaprl.detach()

    trainer_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    weights = engine.weights_bytes
    floors = {"sync weights": (trainer_bytes + weights) / (d2d * 1e9),
              "verify weights": (trainer_bytes + weights) / (d2d * 1e9)}
    rows = []
    print(f"{'step':<20}{'median s':>10}{'first s':>10}{'floor s':>10}{'floor/time':>11}")
    for step in STEPS:
        later = times[step][args.warmup:] or times[step]
        med = statistics.median(later)
        floor = floors.get(step)
        rows.append({"step": step, "median_s": med, "first_s": times[step][0], "floor_s": floor,
                     "ratio": floor / med if floor else None, "all_s": times[step]})
        print(f"{step:<20}{med:>10.4f}{times[step][0]:>10.4f}{floor or float('nan'):>10.4f}"
              f"{floor / med if floor else float('nan'):>11.2f}")
    sync_med = rows[0]["median_s"]
    check_med = rows[1]["median_s"]
    probe_med = rows[2]["median_s"] + rows[3]["median_s"]
    print(f"weight check / sync: {check_med / sync_med:.1%}; mismatch probe / sync: {probe_med / sync_med:.1%}")
    import vllm

    result = {"benchmark": "verify", "preset": args.preset, "layers": args.layers, "param_dtype": args.param_dtype,
              "engine_dtype": str(engine.dtype), "engine_weights_bytes": weights, "trainer_param_bytes": trainer_bytes,
              "load_s": load_s, "engine_start_s": engine.stats.get("start_s"), "d2d_read_write_GBps": d2d,
              "steps": rows, "check_over_sync": check_med / sync_med,
              "probe_over_sync": probe_med / sync_med, "cycles": cycles, "faults": faults,
              "gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "vllm": vllm.__version__,
              "swaprl": swaprl.__version__, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    print(json.dumps({k: v for k, v in result.items() if k not in ("cycles", "steps")}, default=str))
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1, default=str))
    engine.close()
    return result


def inject_faults(rt, engine, model, opt, args) -> dict:
    """Each fault on the real engine at this size, and what the check said."""
    out = {}
    with swaprl.phase("generate"):
        layer = model.config.num_hidden_layers // 2
        target = f"model.layers.{layer}.mlp.down_proj.weight"

        def poke(m, value=None):
            with torch.no_grad():
                flat = m.get_parameter(target).view(-1)
                old = flat[12345].clone()
                flat[12345] = old + 1.0 if value is None else value
                return old

        old = vllm_compat.apply_model(engine.llm, poke)[0]
        t = time.perf_counter()
        report = rt.verify_sync()
        out["one_element_changed"] = {"caught": report.weights == "differ" and target in report.differing,
                                      "differing": list(report.differing), "seconds": time.perf_counter() - t}
        vllm_compat.apply_model(engine.llm, lambda m: poke(m, old))
    with swaprl.phase("train"):
        policy_step(model, opt, [[1, 2, 3, 4]], [[5, 6, 7, 8]] * 2, 2, micro_batch=2)
    load = engine.load_weights
    seen = {"n": 0}

    def drop_second_bucket(weights):
        seen["n"] += 1
        if seen["n"] != 2:
            load(weights)

    engine.load_weights = drop_second_bucket
    try:
        with swaprl.phase("generate"):
            out["bucket_not_sent"] = {"caught": False}
    except swaprl.EngineStateError as exc:
        out["bucket_not_sent"] = {"caught": True, "message": str(exc)[:600], "phase_after": rt.current_phase}
    finally:
        engine.load_weights = load
    with swaprl.phase("generate"):  # and the next switch, with the whole sync, checks out again
        out["recovered"] = rt.last_sync.weights == "exact"
    for name, f in out.items():
        print(f"fault {name}: {f}", flush=True)
    return out


if __name__ == "__main__":
    main()
