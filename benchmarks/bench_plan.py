"""The memory planner against measurement: per-phase device memory of real GRPO cycles next to `swaprl.plan`.

    python benchmarks/bench_plan.py                 # one GPU: Qwen2.5-72B's layers cut to 2, 4, 8 (those the plan fits)
    python benchmarks/bench_plan.py --depths 2      # one depth per command, results merged into the same --out
    python benchmarks/bench_plan.py --smoke --out /tmp/plan_smoke   # CPU, tiny preset, embedded engine: plumbing only

For each depth the plan is made first, for one GPU of this machine's memory (NVML) and the rollout below; a depth
whose plan fits nothing is reported with the planner's verdict and not run (8 of 72B's layers are 9.5 B parameters:
bf16 parameters, gradients and AdamW states alone take 71 GiB of an 80 GB GPU's 73 GiB training budget, so the plan
streams half of the states through the optimizer step). Each depth that fits runs in its own process (vLLM's
sleep-mode allocator is one per process): write a random checkpoint and load the trainer, both in `--dtype` (bf16),
make the plan again from the checkpoint's config.json with the GPU's exact size, build `VLLMEngine` (after the model
is on the GPU, before the first optimizer step: it sizes itself), `AdamW(fused=True)`, `swaprl.attach` with the
`SwapConfig` the plan chose (`Settings.swap_config()`: the optimizer states' split, gradients, parameters, sleep
level; gradient checkpointing only if the plan chose it), then `--cycles` GRPO cycles: generate the rollout
(`--prompts` x `--completions`, `--prompt-tokens` + `--completion-tokens`), then `examples/grpo.py`'s loss over it
in micro-batches of `--micro-batch` sequences and one optimizer step. The same choices go to the plan: parameters,
gradients, AdamW states (torch keeps them in the parameters' dtype) and compute in `--dtype`, micro batch =
`--micro-batch` sequences, the engine's batch limits, CUDA graphs off unless `--cuda-graphs` (they add minutes to the
engine's start).

Measured, for the last cycle (the first creates the optimizer states and page-locks the host buffers), per phase:
the peak of the device figure, the larger of (a) NVML sampled every `--interval` s by swaprl's profiler inside the
phase and (b) the figure at the phase's start plus the growth of torch's reserved memory during it (exact: torch's
peak counter). Device figures are in the CUDA driver's units, the base the planner's `gpu_memory_bytes` uses: NVML's
`used` less the driver's own reservation, measured at the child's start. Per category: the profiler's attribution
taken at the end of each phase (train: after the optimizer step, before the gradients are dropped), when torch's
cache still holds the phase's activation blocks. A phase row is flagged when planned / measured is outside
[0.9, 1.1]; a category row when it is and the two differ by more than 0.25 GiB. The table ends with one JSON line;
`--out` receives plan_validation.json, README.md and the profiles (profile_<N>l.jsonl.gz, `swaprl report` reads
them).

--smoke runs the same path on the CPU with the tiny preset (depths 1 and 2), float32 and the embedded HF engine: there
is no device figure, so the phase totals are not compared (the table says so); the trainer's categories still are.
"""

from __future__ import annotations

import argparse
import gzip
import json
import logging
import os
import platform
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path

from child import run_child, start

ROOT = Path(__file__).resolve().parent.parent
GiB = 2**30
TOLERANCE = 0.10
CATEGORY_FLOOR = GiB // 4  # category rows closer than this are not flagged, whatever their ratio
OTHER = ("engine_other", "activations", "cuda_context", "unattributed")  # split differently by plan and profiler

log = logging.getLogger("bench_plan")


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny preset, embedded HF engine: plumbing only")
    ap.add_argument("--preset", default=None, help="architecture (default qwen2.5-72b; tiny with --smoke)")
    ap.add_argument("--depths", default=None, help="layers to keep, comma-separated (default 2,4,8; 1,2 with --smoke)")
    ap.add_argument("--force", action="store_true", help="also run depths whose plan fits nothing")
    ap.add_argument("--prompts", type=int, default=None, help="default 8 (2 with --smoke)")
    ap.add_argument("--completions", type=int, default=None, help="per prompt, default 8 (2 with --smoke)")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="default 256 (8 with --smoke)")
    ap.add_argument("--completion-tokens", type=int, default=None, help="default 512 (8 with --smoke)")
    ap.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                    help="trainer parameters, gradients, AdamW states and compute (default bfloat16; float32 with "
                         "--smoke, where the CPU's bf16 kernels are slow)")
    ap.add_argument("--micro-batch", type=int, default=1,
                    help="sequences per forward/backward (default 1: the planner's default micro batch)")
    ap.add_argument("--cycles", type=int, default=2, help="generate + train cycles; the last one is measured")
    ap.add_argument("--cuda-graphs", action="store_true", help="let vLLM capture CUDA graphs (slower start)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384, help="vLLM's, and the plan's")
    ap.add_argument("--max-num-seqs", type=int, default=1024, help="vLLM's, and the plan's")
    ap.add_argument("--interval", type=float, default=0.02, help="profiler sampling interval, seconds")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=900, help="seconds per depth's process")
    ap.add_argument("--workdir", default=str(Path(tempfile.gettempdir()) / "swaprl-checkpoints"),
                    help="where random checkpoints are written (and reused), with the children's logs")
    ap.add_argument("--out", default=None, help="default benchmarks/results/plan_validation_<gpu>/")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)  # internal: a spec file, run one depth
    return ap


def fill_defaults(args: argparse.Namespace) -> None:
    smoke = args.smoke
    args.preset = args.preset or ("tiny" if smoke else "qwen2.5-72b")
    args.dtype = args.dtype or ("float32" if smoke else "bfloat16")
    args.depths = [int(d) for d in (args.depths or ("1,2" if smoke else "2,4,8")).split(",")]
    for name, gpu, cpu in (("prompts", 8, 2), ("completions", 8, 2), ("prompt_tokens", 256, 8),
                           ("completion_tokens", 512, 8)):
        if getattr(args, name) is None:
            setattr(args, name, cpu if smoke else gpu)


# ---------------------------------------------------------------- the plan, made the same way by parent and child
def make_plan(spec: dict, model: str, layers: int | None, gpu_memory_bytes: int, host_memory_bytes: int):
    from swaprl import plan as planner

    seq = spec["prompt_tokens"] + spec["completion_tokens"]
    return planner.plan(
        model, layers=layers,
        cluster=planner.Cluster(gpus_per_node=1, gpu_memory_bytes=gpu_memory_bytes,
                                host_memory_bytes=host_memory_bytes),
        rollout=planner.Rollout(prompts=spec["prompts"], completions_per_prompt=spec["completions"],
                                prompt_tokens=spec["prompt_tokens"], completion_tokens=spec["completion_tokens"]),
        param_dtype=spec["dtype"], optimizer="adamw", optimizer_dtype=spec["dtype"], compute_dtype=spec["dtype"],
        engine_dtype="bfloat16", micro_batch_tokens=spec["micro_batch"] * seq,
        engine_max_batched_tokens=spec["max_num_batched_tokens"], engine_max_seqs=spec["max_num_seqs"],
        cuda_graphs=spec["cuda_graphs"], processes_per_gpu=1)


def plan_summary(p) -> dict:
    return {"ok": p.ok, "verdict": p.verdict, "settings": None if p.settings is None else p.settings.describe(),
            "swap_config": None if p.settings is None else p.swap_config(), "state_bytes": p.state_bytes,
            "parameters": p.parameters, "layers": p.layers, "gpu": p.gpu, "total": {ph: p.total(ph) for ph in p.gpu},
            "budget": p.gpu_budget_bytes, "kv_cache_bytes": p.kv_cache_bytes, "inputs": p.inputs}


# ---------------------------------------------------------------- child: one depth, one process
class PhaseMeter:
    """Device figures at the start and end of a phase, torch's peaks in between, the attribution at the end."""

    def __init__(self, rt, prof, offset: int) -> None:
        import torch

        self.rt, self.prof, self.offset = rt, prof, offset
        self.cuda = rt.device.type == "cuda"
        self.torch = torch
        self.start: dict = {}
        self.t0 = 0.0

    def _used(self) -> int:
        from swaprl import memory

        return memory.device_used_bytes(self.rt.device) - self.offset

    def begin(self) -> None:
        torch = self.torch
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.start = {"used": self._used(), "allocated": torch.cuda.memory_allocated(),
                          "reserved": torch.cuda.memory_reserved()}
        self.t0 = time.perf_counter()

    def end(self) -> dict:
        torch = self.torch
        rec: dict = {"seconds": None}
        if self.cuda:
            torch.cuda.synchronize()
            s = self.start
            rec.update(used_start=s["used"], used_end=self._used(),
                       allocated_basis=s["used"] + torch.cuda.max_memory_allocated() - s["allocated"],
                       reserved_basis=s["used"] + torch.cuda.max_memory_reserved() - s["reserved"])
        rec["seconds"] = time.perf_counter() - self.t0
        rec["categories"], rec["notes"] = self.attribution()
        return rec

    def attribution(self) -> tuple[dict, list]:
        """The profiler's attribution of the device now, in the CUDA driver's units (see the module docstring)."""
        from swaprl import memory
        from swaprl.profile import attribute

        status = self.rt.status()
        if not self.cuda:
            a = attribute(status, source="runtime")
            return a["categories"], a["notes"]
        driver = memory.device_reserved_bytes(self.rt.device)
        a = attribute(status, source="nvml", private_pool_bytes=memory.private_pool_bytes(self.rt.device)[0],
                      process_used_bytes=self.prof._process_used_bytes(), driver_reserved_bytes=driver)
        cats = dict(a["categories"])
        if a["notes"] or not driver:  # the driver's reservation sits in unattributed
            cats["unattributed"] -= self.offset
        else:  # in cuda_context; anything else NVML counts and the driver does not stays in unattributed
            cats["cuda_context"] -= driver
            cats["unattributed"] -= self.offset - driver
        return cats, a["notes"]


def child(spec_path: str) -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    spec = json.loads(Path(spec_path).read_text())
    import psutil
    import torch
    from transformers import AutoModelForCausalLM

    import swaprl
    from swaprl import memory
    from swaprl.checkpoints import write_random_checkpoint
    from swaprl.profile import attach_profiler
    from swaprl.profile.report import intervals, load_run

    sys.path.insert(0, str(ROOT / "examples"))
    from grpo import grpo_loss

    depth, cuda = spec["depth"], torch.cuda.is_available() and not spec["smoke"]
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    timings: dict[str, float] = {}
    out: dict = {"depth": depth, "device": str(device)}
    if cuda:
        torch.zeros(1, device=device)  # the CUDA context, before anything is measured
        torch.cuda.synchronize()
        free, total = torch.cuda.mem_get_info(device)
        out["offset_bytes"] = memory.device_used_bytes(device) - (total - free)  # NVML's used less the driver's
        out["context_bytes"] = total - free
        gpu_total, host_total = total, psutil.virtual_memory().total
    else:  # the CPU stands in for the GPU (as examples/qwen72b.py does): half of memory each
        out["offset_bytes"] = 0
        gpu_total = host_total = psutil.virtual_memory().total // 2

    t = time.perf_counter()
    dtype = getattr(torch, spec["dtype"])
    path = write_random_checkpoint(spec["preset"], Path(spec["workdir"]) / f"{spec['preset']}-{depth}l", layers=depth,
                                   dtype=dtype, seed=spec["seed"], device="cuda" if cuda else "cpu")
    timings["checkpoint_s"] = time.perf_counter() - t
    if cuda:
        torch.cuda.empty_cache()
    p = make_plan(spec, str(path), None, gpu_total, host_total)  # from the checkpoint's config.json
    out["plan"] = plan_summary(p)
    log.info("plan of depth %d:\n%s", depth, p.table())
    if p.settings is None:
        if not spec["force"]:
            raise SystemExit(f"depth {depth}: the plan fits nothing: {p.verdict}")
        settings = p.shown
    else:
        settings = p.settings

    t = time.perf_counter()
    torch.manual_seed(spec["seed"])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device)
    model.config.use_cache = False
    if settings.activation_checkpointing:
        model.gradient_checkpointing_enable()
    model.train()
    timings["load_s"] = time.perf_counter() - t
    seq = spec["prompt_tokens"] + spec["completion_tokens"]
    if cuda:
        torch.cuda.empty_cache()  # the engine sizes itself on what is free now
        out["free_before_engine_bytes"] = torch.cuda.mem_get_info(device)[0]
        from swaprl.engines.vllm import VLLMEngine

        # the engine the plan counts (make_plan leaves release_other at the planner's default: off)
        engine = VLLMEngine(path, dtype="bfloat16", max_model_len=seq + 8, enforce_eager=not spec["cuda_graphs"],
                            seed=spec["seed"], max_num_batched_tokens=spec["max_num_batched_tokens"],
                            max_num_seqs=spec["max_num_seqs"], release_other=False)
        out["engine"] = {"kind": "VLLMEngine", "weights_bytes": engine.weights_bytes,
                         "kv_cache_bytes": engine.kv_cache_bytes, **engine.stats}
    else:
        engine = swaprl.engines.HFEngine()
        out["engine"] = {"kind": "HFEngine"}
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], fused=True)  # fused: as the plan assumes
    rt = swaprl.attach(model, optimizer, engine, config=swaprl.SwapConfig(**settings.swap_config()))
    profile_path = Path(spec["profile"])
    prof = attach_profiler(rt, profile_path, interval_s=spec["interval"])
    meter = PhaseMeter(rt, prof, out["offset_bytes"])

    gen = torch.Generator().manual_seed(spec["seed"])
    vocab = min(model.config.vocab_size, 256)  # byte tokens: inside every tokenizer swaprl writes
    pad_id = model.generation_config.pad_token_id or 0
    cycles = []
    for cycle in range(1, spec["cycles"] + 1):
        prompts = torch.randint(0, vocab, (spec["prompts"], spec["prompt_tokens"]), generator=gen).tolist()
        rec: dict = {"cycle": cycle}
        with swaprl.phase("generate"):
            meter.begin()
            completions = rt.engine.generate(prompts, swaprl.Sampling(
                max_tokens=spec["completion_tokens"], n=spec["completions"], seed=spec["seed"] + cycle))
            rec["generate"] = meter.end()
        with swaprl.phase("train"):
            meter.begin()
            _, tokens = grpo_loss(model, prompts, completions, spec["completions"], micro_batch=spec["micro_batch"],
                                  pad_id=pad_id)
            optimizer.step()
            rec["train"] = meter.end()  # gradients still here: the phase's peak holds them
            optimizer.zero_grad(set_to_none=True)
        rec["longest_sequence"] = spec["prompt_tokens"] + max(map(len, completions))
        rec["completion_tokens"] = tokens
        cycles.append(rec)
        log.info("cycle %d: generate %.1f s, train %.1f s", cycle, rec["generate"]["seconds"], rec["train"]["seconds"])
    swaprl.detach()  # closes the profiler
    engine.close()

    # NVML samples inside each phase, from the profile (its phase records bound the spans).
    run = load_run(profile_path)
    samples = sorted((s for s in run.samples if "device_used" in s), key=lambda s: s["t"])
    for iv in intervals(run):
        inside = [s["device_used"] for s in samples if iv.start <= s["t"] <= iv.end]
        if iv.kind in ("train", "generate") and iv.cycle is not None and inside:
            cycles[iv.cycle - 1][iv.kind]["sampled_peak"] = max(inside) - out["offset_bytes"]
            cycles[iv.cycle - 1][iv.kind]["samples"] = len(inside)
    for rec in cycles:
        for phase in ("generate", "train"):
            m = rec[phase]
            figures = [m.get(k) for k in ("sampled_peak", "reserved_basis", "used_end")]
            m["peak"] = max((f for f in figures if f is not None), default=None)
    out.update(cycles=cycles, timings=timings, settings_run=settings.describe())
    Path(spec["result"]).write_text(json.dumps(out, default=str))


# ---------------------------------------------------------------- parent: plan, launch, compare, report
def gpu_info() -> dict | None:
    """Name, driver and the CUDA-visible memory of the first GPU, from NVML (no CUDA context in this process)."""
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0]
        handle = pynvml.nvmlDeviceGetHandleByIndex(int(visible) if visible.isdigit() else 0)
        name = pynvml.nvmlDeviceGetName(handle)
        try:  # v2 separates the driver's reservation, which CUDA does not count as device memory
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=pynvml.nvmlMemory_v2)
            total = int(info.total) - int(info.reserved)
        except (pynvml.NVMLError, AttributeError, TypeError):  # older bindings or drivers: v1 only
            total = int(pynvml.nvmlDeviceGetMemoryInfo(handle).total)
        driver = pynvml.nvmlSystemGetDriverVersion()
    except pynvml.NVMLError as exc:  # no driver, no GPU
        log.info("no GPU through NVML (%s)", exc)
        return None

    def text(v):
        return v.decode() if isinstance(v, bytes) else v

    return {"gpu": text(name), "driver": text(driver), "gpu_memory_bytes": total}


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version()}
    for pkg in ("torch", "vllm", "transformers", "swaprl"):
        try:
            found[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    return found


def launch(spec: dict, run_dir: Path, timeout: float) -> dict:
    name = f"depth{spec['depth']}"
    child = run_child(__file__, {**spec, "profile": str(run_dir / f"{name}.profile.jsonl")}, name, run_dir, timeout)
    if child.result is not None:
        return {"ok": True, "wall_s": child.seconds, "profile": str(run_dir / f"{name}.profile.jsonl"),
                **child.result}
    tail = child.log_lines()[-15:]
    errors = [ln.strip() for ln in tail if re.search(r"Error|error|Killed|fits nothing", ln)]
    log.warning("depth %s failed (exit %s), log %s:\n%s", spec["depth"], child.rc, child.log, "\n".join(tail))
    return {"ok": False, "wall_s": child.seconds, "rc": child.rc, "log_tail": [ln[:300] for ln in tail],
            "error": (errors[-1] if errors else f"exit {child.rc}")[:300]}


def ratio(planned: int | None, measured: int | None) -> float | None:
    return planned / measured if planned is not None and measured else None


def compare(r: dict) -> dict:
    """Rows of planned vs measured for the last cycle: per phase, and per category at each phase's end."""
    plan, last = r["plan"], r["cycles"][-1]
    rows = {}
    for phase in ("train", "generate"):
        m = last[phase]
        planned, measured = plan["total"][phase], m["peak"]
        q = ratio(planned, measured)
        cats = []
        measured_cats = m["categories"]
        for cat in (*plan["gpu"][phase], "other"):
            pc = sum(plan["gpu"][phase][c] for c in OTHER) if cat == "other" else plan["gpu"][phase][cat]
            mc = sum(measured_cats[c] for c in OTHER) if cat == "other" else measured_cats[cat]
            if r["device"] == "cpu" and cat not in ("params", "grads", "optimizer"):
                mc = None  # no device figure: only the runtime's own tensors are measured
            cq = ratio(pc, mc)
            flag = mc is not None and abs(pc - mc) > CATEGORY_FLOOR and (cq is None or abs(cq - 1) > TOLERANCE)
            cats.append({"category": cat, "planned": pc, "measured": mc, "ratio": cq, "flag": bool(flag)})
        rows[phase] = {"planned": planned, "measured": measured, "ratio": q,
                       "flag": q is not None and abs(q - 1) > TOLERANCE,
                       "allocated_basis": m.get("allocated_basis"), "sampled_peak": m.get("sampled_peak"),
                       "reserved_basis": m.get("reserved_basis"), "categories": cats}
    return rows


def fmt(n: int | None) -> str:
    if n is None:
        return "n/a"
    return f"{n / GiB:.2f}" if abs(n) >= 10 * 2**20 or n == 0 else f"{n / 2**20:.2f}M"  # MiB for the tiny preset


def tables(result: dict) -> list[str]:
    lines = [(f"{'depth':<7}{'phase':<10}{'planned GiB':>12}{'measured GiB':>13}{'ratio':>7}  {'flag':<5}"
              f"{'alloc-basis GiB':>16}{'torch cache GiB':>16}")]
    for depth, d in sorted(result["depths"].items(), key=lambda kv: int(kv[0])):
        if not d.get("ok"):
            why = d.get("skipped") or d.get("error")
            lines.append(f"{depth:<7}{'skipped' if d.get('skipped') else 'failed'}: {why}")
            continue
        for phase, row in d["compare"].items():
            q = f"{row['ratio']:.3f}" if row["ratio"] is not None else "n/a"
            cache = (row["measured"] - row["allocated_basis"]) if row["allocated_basis"] is not None else None
            lines.append(f"{depth:<7}{phase:<10}{fmt(row['planned']):>12}{fmt(row['measured']):>13}{q:>7}  "
                         f"{'<<' if row['flag'] else '':<5}{fmt(row['allocated_basis']):>16}{fmt(cache):>16}")
    if any(d["compare"]["train"]["measured"] is None for d in result["depths"].values() if d.get("ok")):
        lines.append("(no device figure on this machine: phase totals are not measured, only the trainer's "
                     "categories)")
    for depth, d in sorted(result["depths"].items(), key=lambda kv: int(kv[0])):
        if not d.get("ok"):
            continue
        lines += ["", (f"depth {depth}, per category at the end of each phase (GiB; 'other' = "
                       f"{' + '.join(OTHER)}):"),
                  f"  {'category':<15}" + "".join(f"{h:>10}" for h in ("train plan", "measured", "ratio",
                                                                       "gen plan", "measured", "ratio"))]
        train, gen = (d["compare"][p]["categories"] for p in ("train", "generate"))
        for a, b in zip(train, gen):  # the same categories, in the same order
            if not any((a["planned"], a["measured"], b["planned"], b["measured"])):
                continue  # e.g. unattributed, which the plan never has, when the profiler found none either
            cells = ""
            for c in (a, b):
                q = f"{c['ratio']:.2f}" if c["ratio"] is not None else "n/a"
                cells += f"{fmt(c['planned']):>10}{fmt(c['measured']):>10}{q + (' <<' if c['flag'] else ''):>10}"
            lines.append(f"  {a['category']:<15}{cells}")
    return lines


def markdown(result: dict, lines: list[str]) -> str:
    s, hw = result["settings"], result["hardware"]
    skipped = [f"- depth {k}: {d['skipped']}" for k, d in sorted(result["depths"].items(), key=lambda kv: int(kv[0]))
               if d.get("skipped")]
    measured = [d for d in result["depths"].values() if d.get("ok")]
    offset = measured[0].get("offset_bytes") if measured else None
    offset_known = any(d["compare"]["train"]["measured"] is not None for d in measured)
    kind = measured[0]["engine"]["kind"] if measured else "VLLMEngine"
    engine = (f"vLLM in bf16, {s['max_num_batched_tokens']} batched tokens / {s['max_num_seqs']} sequences, CUDA "
              f"graphs {'on' if s['cuda_graphs'] else 'off'}, sized by `VLLMEngine` itself" if kind == "VLLMEngine"
              else f"the embedded {kind} (no vLLM: the plan's engine categories are not measured)")
    flagged = [f"depth {k} {p}" for k, d in result["depths"].items() if d.get("ok")
               for p, row in d["compare"].items() if row["flag"]]
    verdict = ("Every measured phase is within 10% of the plan." if measured and not flagged and result["within_10pct"]
               else f"Outside 10%: {', '.join(flagged)}." if flagged else "No phase total was measured.")
    return "\n".join([
        f"# The memory planner against measurement: {s['preset']}, "
        f"{', '.join(sorted(result['depths'], key=int))} layers", "",
        "Command:", "", *sorted({f"    {d.get('command') or result['command']}" for d in result["depths"].values()}),
        "",
        f"Hardware: {hw.get('gpu') or 'CPU'}" + (f" (driver {hw['driver']}, {hw['gpu_memory_bytes']:,} B as CUDA "
                                                 f"counts it)" if hw.get("driver") else "")
        + f". Software: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}. Date: {result['date']}.", "",
        (f"Settings: {s['prompts']} prompts x {s['completions']} completions of {s['prompt_tokens']} + "
         f"{s['completion_tokens']} tokens per cycle, micro-batches of {s['micro_batch']} sequence(s) "
         f"(`examples/grpo.py`'s loss), {s['dtype']} parameters, gradients and AdamW states (`fused=True`) "
         f"and compute; {engine}; swap settings and gradient checkpointing as the plan chose them; "
         f"{s['cycles']} cycles, the last measured."), "",
        *([] if not offset_known else [(
         "Measured peak: the larger of NVML sampled every "
         f"{s['interval'] * 1e3:.0f} ms inside the phase and the phase's starting figure plus torch's reserved-"
         "memory growth; all device figures are the CUDA driver's (NVML's `used` less the driver's own "
         f"{fmt(offset)} GiB), the base of the plan's GPU size. 'alloc-basis' is the same with torch's *allocated* "
         "peak: the gap to the measured peak is memory torch's cache held but did not use at the peak. Categories "
         "are swaprl's profiler attribution at the end of each phase; 'other' sums those the plan and the profiler "
         "split differently (the plan books vLLM's activation reserve as engine_other, the profiler sees it as "
         "torch activations while generating)."), ""]),
        verdict, "", "```", *lines, "```", "",
        *(["Depths the planner rejects (not run):", *skipped, ""] if skipped else []),
    ])


def previous_depths(out_dir: Path, settings: dict) -> dict:
    """Depths an earlier command measured into `out_dir` with the same settings (one depth per command is allowed)."""
    path = out_dir / "plan_validation.json"
    try:
        old = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    return {k: d for k, d in old.get("depths", {}).items() if d.get("ok")} if old.get("settings") == settings else {}


def save(result: dict, previous: dict, out_dir: Path) -> list[str]:
    """Write plan_validation.json and README.md for what is measured so far (a later failure keeps earlier depths);
    returns the table. A depth measured now replaces an earlier one; a failure or a skip does not."""
    depths = dict(previous)
    for k, d in result["depths"].items():
        if d.get("ok") or not depths.get(k, {}).get("ok"):
            depths[k] = d
    result = {**result, "depths": dict(sorted(depths.items(), key=lambda kv: int(kv[0])))}
    rows = [row for d in result["depths"].values() if d.get("ok") for row in d["compare"].values()
            if row["ratio"] is not None]
    result["within_10pct"] = bool(rows) and not any(row["flag"] for row in rows)
    lines = tables(result)
    (out_dir / "plan_validation.json").write_text(json.dumps(result, indent=1, default=str))
    (out_dir / "README.md").write_text(markdown(result, lines))
    return lines


def main(argv: list[str] | None = None) -> dict:
    args = start(build_parser(), argv, child)
    if args is None:
        return {}
    fill_defaults(args)
    import psutil

    hw = {"gpu": None} if args.smoke else (gpu_info() or {"gpu": None})
    if not args.smoke and hw.get("gpu") is None:
        raise SystemExit("no GPU found through NVML; run with --smoke on a machine without one")
    slug = "cpu" if args.smoke else (re.search(r"[A-Z]\d{2,4}", hw["gpu"]) or re.search(r"\w+", hw["gpu"]))[0].lower()
    out_dir = Path(args.out or ROOT / "benchmarks" / "results" / f"plan_validation_{slug}")
    out_dir.mkdir(parents=True, exist_ok=True)
    run_dir = Path(args.workdir) / "bench_plan"
    run_dir.mkdir(parents=True, exist_ok=True)
    settings = {k: getattr(args, k) for k in ("preset", "dtype", "prompts", "completions", "prompt_tokens",
                                              "completion_tokens", "micro_batch", "cycles", "cuda_graphs",
                                              "max_num_batched_tokens", "max_num_seqs", "interval", "lr", "seed")}
    spec_base = {**settings, "smoke": args.smoke, "force": args.force, "workdir": args.workdir}
    host = psutil.virtual_memory().total
    gpu_total, host_total = (host // 2, host // 2) if args.smoke else (hw["gpu_memory_bytes"], host)

    result = {"benchmark": "plan", "command": "python benchmarks/bench_plan.py " + " ".join(argv or sys.argv[1:]),
              "hardware": hw, "versions": versions(), "date": time.strftime("%Y-%m-%d"), "settings": settings,
              "depths": {}}
    previous = previous_depths(out_dir, settings)
    for depth in args.depths:
        p = make_plan(spec_base, args.preset, depth, gpu_total, host_total)
        if not p.ok and not args.force:
            log.info("depth %d: the planner says it does not fit, not run: %s", depth, p.verdict)
            result["depths"][str(depth)] = {"ok": False, "skipped": f"the plan fits nothing: {p.verdict}",
                                            "plan": plan_summary(p)}
            continue
        log.info("depth %d: plan %s; running it", depth, p.verdict)
        r = launch({**spec_base, "depth": depth}, run_dir, args.timeout)
        log.info("depth %d: %s in %.0f s", depth, "measured" if r["ok"] else "FAILED", r["wall_s"])
        if r["ok"]:
            r["compare"] = compare(r)
            profile = Path(r.pop("profile"))
            with open(profile, "rb") as src, gzip.open(out_dir / f"profile_{depth}l.jsonl.gz", "wb") as dst:
                shutil.copyfileobj(src, dst)
        result["depths"][str(depth)] = {**r, "command": result["command"]}
        save(result, previous, out_dir)
    lines = save(result, previous, out_dir)
    result = json.loads((out_dir / "plan_validation.json").read_text())
    print("\n".join(lines))
    final = {"benchmark": "plan", "preset": args.preset, "within_10pct": result["within_10pct"], "out": str(out_dir),
             "depths": {k: ({p: {"planned": row["planned"], "measured": row["measured"], "ratio": row["ratio"]}
                             for p, row in d["compare"].items()} if d.get("ok") else
                            {"skipped" if d.get("skipped") else "failed": d.get("skipped") or d.get("error")})
                        for k, d in result["depths"].items()}}
    print(json.dumps(final, default=str))
    return result


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))  # the swaprl next to this script, in the children too
    main()
