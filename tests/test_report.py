"""`swaprl report`: reports from a recorded CPU run and from synthetic CUDA profiles, bad and cut-off input, and
the HTML as a browser renders it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

import swaprl
from swaprl.cli import main
from swaprl.profile import attribute

GiB, MiB = 2**30, 2**20
CHROMIUM = Path("/usr/bin/chromium")


def synthetic_profile(path: Path, *, rank: int = 0, cycles: int = 4, nvml: bool = True,
                      leak_per_cycle: int = 0, free_cached: int = GiB, private_free: int = 0,
                      alloc_conf: str | None = None, peak_held: int | None = None, cache_per_cycle: int = 0,
                      lends: bool = False) -> Path:
    """A CUDA profile as the recorder writes it: 8 GiB params, 16 GiB optimizer states offloaded in 1 s; torch's
    allocator holds `free_cached` bytes of free blocks at every sample, `private_free` of them in private pools.
    `peak_held`: the records carry torch's peak counters of each span, reserved `peak_held` above allocated (a
    profile from before the recorder took them has none). `cache_per_cycle`: torch caches that many more free bytes
    at each cycle; `lends`: the engine wakes on torch's cached pages (which it keeps mapped there)."""
    t0 = 1_700_000_000.0
    bw = {"h2d_GBps": 25.0, "d2h_GBps": 20.0, "bytes": 256 * MiB}
    header = {"schema": "swaprl.profile", "version": 1, "type": "header", "rank": rank, "world_size": 2, "pid": 1,
              "device": "cuda:0",
              "device_name": "NVIDIA H100 80GB HBM3", "device_total": 80 * GiB, "host": "node0",
              "host_total": 1024 * GiB, "python": "3.11", "torch": "2.11", "swaprl": swaprl.__version__,
              "nvml": nvml, "device_used_source": "nvml" if nvml else "cuda_driver", "copy_bandwidth": bw,
              "interval_s": 0.05, "engine": "VLLMEngine", "config": {}, "t0": t0, "engine_lends": lends}
    if alloc_conf is not None:
        header["alloc_conf"] = alloc_conf
    recs: list[dict] = [header]
    t = t0
    context = GiB // 2

    def status(phase: str, cycle: int) -> dict:
        leak = leak_per_cycle * cycle
        train = phase == "train"
        engine = ({"location": "released", "bytes": GiB // 4, "weights_bytes": 0, "kv_cache_bytes": 0,
                   "other_bytes": GiB // 4} if train else
                  {"location": "device", "bytes": 40 * GiB, "weights_bytes": 8 * GiB, "kv_cache_bytes": 31 * GiB,
                   "other_bytes": GiB})
        params, opt = 8 * GiB, (16 * GiB if train and cycle >= 2 else 0)
        cached = free_cached + cache_per_cycle * cycle
        reserved = params + opt + GiB + cached + leak
        used = reserved + engine["bytes"] + context
        return {"phase": phase, "device": "cuda:0", "params": {"location": "device", "bytes": params, "host_bytes": 0},
                "grads": {"location": "host", "bytes": 0, "host_bytes": 0},
                "optimizer": {"location": "device" if train else "host", "bytes": opt, "host_bytes": 0},
                "engine": engine, "host_buffers": {"bytes": 16 * GiB, "pinned": True, "buffers": [
                    {"name": "optimizer", "bytes": 16 * GiB, "locked_bytes": 16 * GiB, "lock_seconds": 0.9,
                     "lock_span": [t0 + 0.1, t0 + 1.0], "background": True, "waited_seconds": 0.0,
                     "attach_waited_seconds": 0.25}]},
                "device_memory": {"used": used, "total": 80 * GiB, "torch_allocated": reserved - cached,
                                  "torch_reserved": reserved}}

    def boundary(phase, src, cycle, seconds, moved):
        st = status(phase, cycle or 0)
        a = attribute(st, source=header["device_used_source"],
                      process_used_bytes=st["device_memory"]["used"] if nvml else None)
        return {"type": "phase", "t": t, "phase": phase, "from": src, "cycle": cycle, "seconds": seconds,
                "bytes": moved, "host_rss": 20 * GiB, "status": st, "attribution": a,
                "torch_private_free": private_free, **span_peaks(st)}

    def span_peaks(st: dict) -> dict:
        if peak_held is None:
            return {}
        reserved = st["device_memory"]["torch_reserved"]
        return {"torch_peak_reserved": reserved, "torch_peak_allocated": reserved - peak_held}

    def samples(phase, cycle, n=10):
        nonlocal t
        dm = status(phase, cycle)["device_memory"]
        for _ in range(n):
            t += 0.05
            recs.append({"type": "sample", "t": t, "host_rss": 20 * GiB, "host_buffers": 16 * GiB,
                         "device_used": dm["used"], "torch_allocated": dm["torch_allocated"],
                         "torch_reserved": dm["torch_reserved"]})

    recs.append(boundary("train", None, None, 0.0, 0))
    samples("train", 0)
    for c in range(1, cycles + 1):
        for step, moved, sec in (("offload optimizer", 16 * GiB, 1.0), ("offload grads", 0, 0.001),
                                 ("engine wake weights", 0, 0.2), ("sync weights", 8 * GiB, 0.05)):
            t += sec
            recs.append({"type": "step", "t": t, "transition": "train->generate", "step": step, "bytes": moved,
                         "seconds": sec})
        recs.append(boundary("generate", "train", c, 1.251, 24 * GiB))
        samples("generate", c)
        for step, moved, sec in (("engine sleep", 0, 0.1), ("reload optimizer", 16 * GiB, 0.8)):
            t += sec
            recs.append({"type": "step", "t": t, "transition": "generate->train", "step": step, "bytes": moved,
                         "seconds": sec})
        recs.append(boundary("train", "generate", c, 0.9, 16 * GiB))
        samples("train", c)
    recs.append({"type": "end", "t": t + 0.01, "reason": "detach", "samples": 0, **span_peaks(status("train", cycles))})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    return path


def report(capsys, *args) -> tuple[int, str, str]:
    rc = main(["report", *map(str, args)])
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture
def recorded(tiny_checkpoint, tmp_path) -> Path:
    """A profile of three generate/train cycles of a tiny Qwen2 on the CPU."""
    path = tmp_path / "run.jsonl"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    rt = swaprl.attach(model, opt, config=swaprl.SwapConfig(profile=path))
    for _ in range(3):
        with swaprl.phase("generate"):
            out = rt.engine.generate([[1, 2, 3]], swaprl.Sampling(max_tokens=4, seed=0))
        with swaprl.phase("train"):
            ids = torch.tensor([[1, 2, 3, *out[0]]])
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad()
    swaprl.detach()
    return path


def test_report_of_a_recorded_cpu_run(recorded, tmp_path, capsys):
    out = tmp_path / "rep"
    rc, stdout, _ = report(capsys, recorded, "-o", out)
    assert rc == 0 and "report.html" in stdout
    md = (out / "report.md").read_text()
    html = (out / "report.html").read_text()
    assert "no device memory figures" in md  # CPU: no NVML, no device figure, said so
    assert "| rank 0 | train->generate | offload optimizer | 3 |" in md
    assert "| rank 0 | optimizer | " in md and "attach, in the background" in md  # AdamW's states, known ahead
    assert "Warning" not in md
    pngs = sorted(p.name for p in out.glob("*.png"))
    assert pngs == ["attribution_rank0.png", "memory_rank0.png"]
    for name in pngs:
        assert 1_000 < (out / name).stat().st_size < 300_000
        assert f"]({name})" in md
    # self-contained: every figure embedded, nothing fetched from anywhere
    assert html.count("src='data:image/png;base64,") == 2
    assert "http://" not in html and "https://" not in html and "<link" not in html


def test_default_output_directory_is_beside_the_run(recorded, capsys):
    rc, _, _ = report(capsys, recorded)
    assert rc == 0 and (recorded.parent / "run-report" / "report.html").exists()


def test_truncated_profile_still_reports(recorded, tmp_path, capsys):
    lines = recorded.read_bytes().splitlines(keepends=True)
    cut = tmp_path / "cut.jsonl"
    cut.write_bytes(b"".join(lines[:-3]) + lines[-3][: len(lines[-3]) // 2])  # a crash mid-write
    rc, _, err = report(capsys, cut, "-o", tmp_path / "rep")
    assert rc == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "the last line is cut off" in md and "no end record" in md and "the last line is cut off" in err
    assert "offload optimizer" in md


def test_header_only_profile_says_it_is_empty(recorded, tmp_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text(recorded.read_text().splitlines()[0] + "\n")
    rc, _, _ = report(capsys, empty, "-o", tmp_path / "rep")
    assert rc == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "empty run" in md and not list((tmp_path / "rep").glob("*.png"))


@pytest.mark.parametrize("content, message", [
    ('{"loss": 1.0}\n', 'has no "schema": "swaprl.profile"'),
    ("step,loss\n1,2.0\n", "first line is not JSON"),
    ("", "is empty"),
])
def test_other_files_are_refused_with_the_fix(tmp_path, capsys, content, message):
    bad = tmp_path / "metrics.jsonl"
    bad.write_text(content)
    rc, _, err = report(capsys, bad, "-o", tmp_path / "rep")
    assert rc == 2
    assert message in err and "SwapConfig(profile=PATH)" in err
    assert not (tmp_path / "rep").exists()


def test_unknown_schema_version_is_refused(tmp_path, capsys):
    path = synthetic_profile(tmp_path / "run.jsonl")
    lines = path.read_text().splitlines()
    header = json.loads(lines[0]) | {"version": 7, "swaprl": "9.0.0"}
    path.write_text("\n".join([json.dumps(header), *lines[1:]]) + "\n")
    rc, _, err = report(capsys, path, "-o", tmp_path / "rep")
    assert rc == 2 and "schema version 7" in err and "pip install swaprl==9.0.0" in err


def test_missing_file_is_an_error(tmp_path, capsys):
    rc, _, err = report(capsys, tmp_path / "nope.jsonl")
    assert rc == 2 and "nope.jsonl" in err


def test_without_matplotlib_the_report_names_its_extra(tmp_path, capsys, monkeypatch):
    """The core install has no matplotlib: `swaprl report` says which extra brings it, with no traceback."""
    for name in [n for n in sys.modules if n == "matplotlib" or n.startswith("matplotlib.")] + ["matplotlib"]:
        monkeypatch.setitem(sys.modules, name, None)
    rc, _, err = report(capsys, synthetic_profile(tmp_path / "run.jsonl"), "-o", tmp_path / "out")
    assert rc == 1 and 'pip install -e ".[report]"' in err and "Traceback" not in err


def test_multi_rank_report_has_a_row_per_rank(tmp_path, capsys):
    runs = [synthetic_profile(tmp_path / f"run.rank{r}.jsonl", rank=r) for r in (0, 1)]
    out = tmp_path / "rep"
    rc, _, _ = report(capsys, *runs, "-o", out)
    assert rc == 0
    md = (out / "report.md").read_text()
    for r in (0, 1):
        assert f"| rank {r} | run.rank{r}.jsonl | NVIDIA H100 80GB HBM3 |" in md
        assert f"| rank {r} | train->generate | offload optimizer | 4 |" in md
        assert f"| rank {r} | generate |" in md  # peak table
        assert (out / f"memory_rank{r}.png").exists() and (out / f"attribution_rank{r}.png").exists()


def test_transitions_against_the_copy_ceiling(tmp_path, capsys):
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "run.jsonl"), "-o", tmp_path / "rep")
    assert rc == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    # 16 GiB offloaded in 1.0 s = 17.18 GB/s against a 20 GB/s device-to-host ceiling; reloads in 0.8 s vs 25 GB/s
    assert "| offload optimizer | 4 | 16.00 GiB | 1.000 | 1.000 | 0.859 | 17.18 | 20.0 | 86% |" in md
    assert "| reload optimizer | 4 | 16.00 GiB | 0.800 | 0.800 | 0.687 | 21.47 | 25.0 | 86% |" in md
    assert "| rank 0 | generate | 4 | 50.50 GiB | 1 |" in md  # peak device used while generating


def test_host_buffers_show_when_and_how_fast_they_were_locked(tmp_path, capsys):
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "run.jsonl"), "-o", tmp_path / "rep")
    assert rc == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    # 16 GiB locked in 0.9 s from 0.1 s on = 19.1 GB/s, in the background at attach, which waited 0.25 s for it
    # at its end; no switch waited
    assert ("| rank 0 | optimizer | 16.00 GiB | 16.00 GiB | attach, in the background | 0.1 | 0.90 | 19.1 | 0.250 "
            "| 0.000 |") in md


def test_residual_growth_is_flagged(tmp_path, capsys):
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "leak.jsonl", cycles=5, leak_per_cycle=100 * MiB),
                      "-o", tmp_path / "leak")
    assert rc == 0
    md = (tmp_path / "leak" / "report.md").read_text()
    assert "GROWS" in md and "grew by 300.00 MiB from cycle 2 to cycle 5" in md
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "ok.jsonl", cycles=5), "-o", tmp_path / "ok")
    md = (tmp_path / "ok" / "report.md").read_text()
    assert "GROWS" not in md and "| ok |" in md
    # free blocks torch keeps cached for an engine that wakes on them are no leak; a leak beside them still is, and
    # so is a cache that grows where the runtime hands it back at every switch
    cached = synthetic_profile(tmp_path / "cached.jsonl", cycles=5, cache_per_cycle=2 * GiB, lends=True)
    rc, _, _ = report(capsys, cached, "-o", tmp_path / "cached")
    assert "GROWS" not in (tmp_path / "cached" / "report.md").read_text()
    kept = synthetic_profile(tmp_path / "kept.jsonl", cycles=5, cache_per_cycle=2 * GiB)
    rc, _, _ = report(capsys, kept, "-o", tmp_path / "kept")
    assert "grew by 6.00 GiB from cycle 2 to cycle 5" in (tmp_path / "kept" / "report.md").read_text()
    both = synthetic_profile(tmp_path / "both.jsonl", cycles=5, cache_per_cycle=2 * GiB, leak_per_cycle=100 * MiB,
                             lends=True)
    rc, _, _ = report(capsys, both, "-o", tmp_path / "both")
    assert "grew by 300.00 MiB from cycle 2 to cycle 5" in (tmp_path / "both" / "report.md").read_text()


def test_two_cycles_are_too_few_for_growth(tmp_path, capsys):
    report(capsys, synthetic_profile(tmp_path / "run.jsonl", cycles=2), "-o", tmp_path / "rep")
    assert "needs at least 3 cycles" in (tmp_path / "rep" / "report.md").read_text()


def test_cached_free_blocks_at_a_peak_are_shown_and_the_allocator_setting_named(tmp_path, capsys):
    # 8 GiB of free blocks at every sample: 10% of the 80 GiB device, over the 5% worth a note
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "frag.jsonl", free_cached=8 * GiB, alloc_conf=""),
                      "-o", tmp_path / "frag")
    md = (tmp_path / "frag" / "report.md").read_text()
    assert rc == 0
    assert "| rank 0 | train | 5 | 33.75 GiB | 2 | 17.75 GiB | 33.75 GiB | 33.00 GiB | 25.00 GiB | 8.00 GiB |" in md
    assert "train: at the device peak torch's allocator held 8.00 GiB of free cached blocks (10% of the device)." in md
    assert md.count("Start the run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True") == 1
    # already on: the figure, no advice; the default 1 GiB: no note; a profile from before the setting was recorded
    # (no alloc_conf in its header): the figure, no advice
    # 5 of the 8 GiB in private pools (a CUDA graph's, a paused pool's): 3 GiB of fragmentation, under 5%
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "priv.jsonl", free_cached=8 * GiB, private_free=5 * GiB,
                                                alloc_conf=""), "-o", tmp_path / "priv")
    md = (tmp_path / "priv" / "report.md").read_text()
    assert "| rank 0 | train | 5 | 33.75 GiB | 2 | 17.75 GiB | 33.75 GiB | 33.00 GiB | 25.00 GiB | 3.00 GiB |" in md
    for name, kw in (("on", dict(free_cached=8 * GiB, alloc_conf="expandable_segments:True")),
                     ("small", dict(alloc_conf="")), ("old", dict(free_cached=8 * GiB)),
                     ("private", dict(free_cached=8 * GiB, private_free=5 * GiB, alloc_conf=""))):
        report(capsys, synthetic_profile(tmp_path / f"{name}.jsonl", **kw), "-o", tmp_path / name)
        md = (tmp_path / name / "report.md").read_text()
        assert "expandable_segments" not in md, name
        assert ("free cached blocks" in md) == (name not in ("small", "private")), name


def test_cached_free_at_a_peak_comes_from_the_spans_peaks_not_from_a_sample_between_two_allocations(tmp_path, capsys):
    # Every sample sees 8 GiB of reserved over allocated, as one taken while the backward has just freed a layer's
    # tensors would; torch's own peaks over each span say that at the peak only 0.5 GiB was held and free.
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "peaks.jsonl", free_cached=8 * GiB, peak_held=GiB // 2,
                                                alloc_conf=""), "-o", tmp_path / "peaks")
    md = (tmp_path / "peaks" / "report.md").read_text()
    assert rc == 0
    assert "| rank 0 | train | 5 | 33.75 GiB | 2 | 17.75 GiB | 33.75 GiB | 33.00 GiB | 25.00 GiB | 512.00 MiB |" in md
    assert "free cached blocks" not in md and "expandable_segments" not in md
    # the span's peaks less the private pools' free bytes
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "both.jsonl", free_cached=8 * GiB, peak_held=6 * GiB,
                                                private_free=GiB, alloc_conf=""), "-o", tmp_path / "both")
    md = (tmp_path / "both" / "report.md").read_text()
    assert "| rank 0 | train | 5 | 33.75 GiB | 2 | 17.75 GiB | 33.75 GiB | 33.00 GiB | 25.00 GiB | 5.00 GiB |" in md
    assert "train: at the device peak torch's allocator held 5.00 GiB of free cached blocks (6% of the device)." in md



def test_without_the_spans_peaks_cached_free_is_the_spans_highest_reserved_less_its_highest_allocated(tmp_path,
                                                                                                         capsys):
    # A profile from before the records carried torch's peaks, or the tail of a run cut short: the device peak's
    # sample caught allocated 6 GiB below its level (between two of the backward's allocations); the span's other
    # samples show 1 GiB free. The figure is the span's, not that sample's 7 GiB.
    path = synthetic_profile(tmp_path / "old.jsonl", free_cached=GiB, alloc_conf="")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    last = max(i for i, r in enumerate(recs) if r["type"] == "phase" and r["phase"] == "train")
    trough = recs[last + 4]
    assert trough["type"] == "sample"
    trough["torch_allocated"] -= 6 * GiB
    trough["device_used"] += 2**20  # the device peak
    for cut in (False, True):  # with its end record, and cut short before it
        kept = [r for r in recs if not (cut and r["type"] == "end")]
        path.write_text("".join(json.dumps(r) + "\n" for r in kept))
        report(capsys, path, "-o", tmp_path / f"rep{cut}")
        md = (tmp_path / f"rep{cut}" / "report.md").read_text()
        row = next(line for line in md.splitlines() if line.startswith("| rank 0 | train |"))
        assert row.split("|")[10].strip() == "1.00 GiB", (cut, row)


def test_cached_free_at_a_peak_comes_from_the_record_that_ends_the_span(tmp_path, capsys):
    # Each record holds peaks of its own (the k-th: k x 64 MiB free at the peak), so the row tells which one it took:
    # the record that ends the span holding the device peak, not the one that began it. The train peak (cycle 2, the
    # first of the equal later ones) is in the span that the switch into generate of cycle 3 ends: the 6th record;
    # the generate peak (cycle 1) in the one the switch into train of cycle 1 ends: the 3rd.
    path = synthetic_profile(tmp_path / "run.jsonl", free_cached=8 * GiB, peak_held=0, alloc_conf="")
    recs = [json.loads(line) for line in path.read_text().splitlines()]
    for k, r in enumerate((r for r in recs if r["type"] in ("phase", "end")), 1):
        r["torch_peak_reserved"], r["torch_peak_allocated"] = 40 * GiB, 40 * GiB - k * 64 * MiB
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    rc, _, _ = report(capsys, path, "-o", tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert rc == 0
    assert "| rank 0 | train | 5 | 33.75 GiB | 2 | 17.75 GiB | 33.75 GiB | 33.00 GiB | 25.00 GiB | 384.00 MiB |" in md
    assert "| rank 0 | generate | 4 | 57.50 GiB | 1 | 57.50 GiB | 57.50 GiB | 17.00 GiB | 9.00 GiB | 192.00 MiB |" in md
    # A sample stamped at a record's time, the run's device peak: in the span that record ends (the 4th), whose
    # peaks torch counted up to after that time, in the transition it ends and the generate span it begins alike.
    gen2 = next(r for r in recs if r["type"] == "phase" and r["phase"] == "generate" and r["cycle"] == 2)
    recs.append({"type": "sample", "t": gen2["t"], "host_rss": 20 * GiB, "host_buffers": 16 * GiB,
                 "device_used": 70 * GiB, "torch_allocated": 30 * GiB, "torch_reserved": 38 * GiB})
    path.write_text("".join(json.dumps(r) + "\n" for r in recs))
    report(capsys, path, "-o", tmp_path / "at")
    md = (tmp_path / "at" / "report.md").read_text()
    for phase, spans in (("generate", 4), ("transition", 8)):
        assert (f"| rank 0 | {phase} | {spans} | 70.00 GiB | 2 | 57.50 GiB | 70.00 GiB | 38.00 GiB | 30.00 GiB | "
                "256.00 MiB |") in md, phase


def test_missing_nvml_is_noted(tmp_path, capsys):
    rc, _, _ = report(capsys, synthetic_profile(tmp_path / "run.jsonl", nvml=False), "-o", tmp_path / "rep")
    md = (tmp_path / "rep" / "report.md").read_text()
    assert rc == 0 and "NVML unavailable" in md and "cuda_context not measured" in md


@pytest.mark.browser
@pytest.mark.skipif(not CHROMIUM.exists(), reason="needs headless Chromium at /usr/bin/chromium "
                                                    "(apt-get install chromium)")
def test_report_renders_in_a_browser(tmp_path, capsys):
    from PIL import Image, ImageStat

    out = tmp_path / "rep"
    assert report(capsys, synthetic_profile(tmp_path / "run.jsonl"), "-o", out)[0] == 0
    shot = tmp_path / "shot.png"
    subprocess.run([str(CHROMIUM), "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                    "--disable-background-networking", "--disable-component-update", "--disable-sync",
                    f"--user-data-dir={tmp_path / 'profile'}", f"--screenshot={shot}", "--window-size=1200,1600",
                    (out / "report.html").resolve().as_uri()], check=True, capture_output=True, timeout=120)
    img = Image.open(shot).convert("RGB")
    assert img.size == (1200, 1600)
    # text, tables and the embedded figures drew something: far from a blank (uniform) page
    assert max(ImageStat.Stat(img).var) > 100
    colours = img.getcolors(maxcolors=1 << 20) or []
    assert len(colours) > 50


def test_python_m_swaprl_report(tmp_path):
    path = synthetic_profile(tmp_path / "run.jsonl")
    res = subprocess.run([sys.executable, "-m", "swaprl", "report", str(path), "-o", str(tmp_path / "rep")],
                 capture_output=True, text=True, cwd=Path(__file__).resolve().parents[1])
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "rep" / "report.html").exists()


def test_rolled_back_transition_shows_in_the_report(tiny_checkpoint, tmp_path):
    """A failed transition is undone by the runtime; the profile records it and the report warns about it."""
    import torch
    from transformers import AutoModelForCausalLM

    import swaprl
    from swaprl.profile.report import load_run, write_report

    model = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    opt = torch.optim.AdamW(model.parameters())
    rt = swaprl.attach(model, opt, "hf", config=swaprl.SwapConfig(profile=tmp_path / "run.jsonl"))
    rt.add_listener(lambda e: (_ for _ in ()).throw(KeyboardInterrupt())
                    if e["type"] == "step" and e["step"] == "offload optimizer" else None)
    with pytest.raises(KeyboardInterrupt):
        with swaprl.phase("generate"):
            pass
    swaprl.detach()
    run = load_run(tmp_path / "run.jsonl")
    assert any(w.startswith("run.jsonl: train->generate failed at step") and "rolled back" in w
               for w in run.warnings), run.warnings
    write_report([run], tmp_path / "rep")
    assert "rolled back" in (tmp_path / "rep" / "report.md").read_text()


def test_overlapped_offload_is_rated_over_its_whole_span():
    """A finished overlapped offload waited 0.1 s but its copies ran for 0.8 s: 16 GiB / 0.8 s, not / 0.1 s."""
    from swaprl.profile.report import Run, transition_rows

    run = Run(Path("run.jsonl"), {"copy_bandwidth": {"d2h_GBps": 25.0, "h2d_GBps": 25.0}})
    run.steps = [{"t": float(i), "transition": "train->generate", "step": "finish offload optimizer",
                  "bytes": 16 * GiB, "seconds": 0.1, "span_seconds": 0.8} for i in range(3)]
    (row,) = transition_rows(run)
    assert row["GBps"] == pytest.approx(16 * GiB / 0.8 / 1e9)
    assert row["ceiling_GBps"] == 25.0 and row["floor_s"] == pytest.approx(16 * GiB / 25e9)


def test_a_step_that_only_queued_its_copies_has_no_rate():
    """An optimizer reload left running under the forward (overlap_optimizer_reload) took 0.05 s to queue 16 GiB:
    no GB/s from that (it read as 233% of the copy ceiling), and no fraction of the ceiling."""
    from swaprl.profile.report import Run, transition_rows

    run = Run(Path("run.jsonl"), {"copy_bandwidth": {"d2h_GBps": 25.0, "h2d_GBps": 25.0}})
    run.steps = [{"t": float(i), "transition": "generate->train", "step": "reload optimizer", "bytes": 16 * GiB,
                  "seconds": 0.05, "issued": True} for i in range(3)]
    (row,) = transition_rows(run)
    assert row["GBps"] is None and row["fraction"] is None and row["later_s"] == 0.05


def test_streamed_optimizer_step_is_rated_against_both_directions_at_once():
    """The streamed step copies 4 GiB in and 4 GiB out: at best each direction at its own speed, at the same time."""
    from swaprl.profile.report import Run, transition_rows

    run = Run(Path("run.jsonl"), {"copy_bandwidth": {"d2h_GBps": 20.0, "h2d_GBps": 25.0}})
    run.steps = [{"t": float(i), "transition": "optimizer.step", "step": "stream optimizer states",
                  "bytes": 8 * GiB, "h2d_bytes": 4 * GiB, "d2h_bytes": 4 * GiB, "seconds": 0.5, "chunks": 4}
                 for i in range(3)]
    (row,) = transition_rows(run)
    floor_s = 4 * GiB / 20e9  # the slower direction
    assert row["ceiling_GBps"] == pytest.approx(8 * GiB / floor_s / 1e9)
    assert row["fraction"] == pytest.approx(floor_s / 0.5)


def test_the_ceiling_is_the_faster_of_the_start_and_end_measures_and_a_step_above_it_has_no_floor():
    """Measured at start-up beside host memory being page-locked, the host-to-device speed read half the link's (26.5
    GB/s), and the streamed step then showed 126% of its ceiling. The end's measure is taken too; a step still faster
    than the best measure says the measure is wrong, and gets no floor or fraction rather than one above 100%."""
    from swaprl.profile.report import Run, copy_ceiling, transition_rows

    steps = [{"t": float(i), "transition": "optimizer.step", "step": "stream optimizer states", "bytes": 8 * GiB,
              "h2d_bytes": 4 * GiB, "d2h_bytes": 4 * GiB, "seconds": 0.1, "chunks": 4} for i in range(3)]
    run = Run(Path("run.jsonl"), {"copy_bandwidth": {"d2h_GBps": 55.0, "h2d_GBps": 26.5}})
    run.steps = steps
    (row,) = transition_rows(run)
    assert row.get("over_ceiling") and row["fraction"] is None and row["floor_s"] is None
    run.end = {"type": "end", "t": 9.0, "reason": "close", "copy_bandwidth": {"d2h_GBps": 54.0, "h2d_GBps": 53.0}}
    assert copy_ceiling(run) == {"h2d_GBps": 53.0, "d2h_GBps": 55.0}
    (row,) = transition_rows(run)
    assert not row.get("over_ceiling") and row["floor_s"] == pytest.approx(4 * GiB / 53e9)
    assert row["fraction"] == pytest.approx(row["floor_s"] / 0.1)


def test_a_weight_sync_is_rated_against_device_to_device_copying():
    """The sync copies the trainer's weights into the engine's: its floor is those bytes at the device-to-device
    copy speed measured in the run. Other steps named after the sync (its report) have no ceiling."""
    from swaprl.profile.report import Run, transition_rows

    run = Run(Path("run.jsonl"), {"copy_bandwidth": {"d2h_GBps": 50.0, "h2d_GBps": 50.0, "d2d_GBps": 1500.0}})
    run.steps = [{"t": float(i), "transition": "train->generate", "step": step, "bytes": b, "seconds": 0.2}
                 for i in range(3) for step, b in (("sync weights", 30 * GiB), ("report sync", 0))]
    sync, report_row = transition_rows(run)
    assert sync["ceiling_GBps"] == 1500.0 and sync["floor_s"] == pytest.approx(30 * GiB / 1500e9)
    assert sync["fraction"] == pytest.approx(sync["floor_s"] / 0.2)
    assert report_row["step"] == "report sync" and report_row["ceiling_GBps"] is None


def test_a_sample_taken_after_a_switch_began_is_the_switchs_even_if_its_phase_record_came_late():
    """Profiles stamped the phase record after a status read (25 ms at 72B), so `t - seconds` began the switch
    after its first steps: a sample of the engine's wake-up counted as the train peak (74.84 GiB for 60.93). The
    switch begins at its first step's start."""
    from swaprl.profile.report import Run, intervals

    run = Run(Path("run.jsonl"), {"t0": 0.0})
    run.phases = [{"t": 0.0, "phase": "train", "from": None, "cycle": None, "seconds": 0.0},
                  {"t": 10.0, "phase": "generate", "from": "train", "cycle": 1, "seconds": 0.5}]
    run.steps = [{"t": 8.0, "transition": "optimizer.step", "step": "stream optimizer states", "seconds": 3.0},
                 {"t": 9.45, "transition": "train->generate", "step": "free grads", "seconds": 0.01},
                 {"t": 9.9, "transition": "train->generate", "step": "engine wake weights", "seconds": 0.4}]
    train, switch, _ = intervals(run)
    assert (train.kind, switch.kind) == ("train", "transition")
    assert switch.start == pytest.approx(9.44) and train.end == pytest.approx(9.44)


def test_the_attribution_figure_shows_whole_cycles_when_it_leaves_boundaries_out():
    """21 boundaries in 16 bars: picked one by one, every odd cycle lost its train bar (c1 gen, c2 gen, c2 train, c3
    gen, ...). Whole cycles are kept instead, the first and the last among them."""
    from swaprl.profile.report import _boundary_name, boundaries_shown

    recs = [{"phase": "train", "from": None, "cycle": None}]
    for c in range(1, 11):
        recs += [{"phase": "generate", "from": "train", "cycle": c}, {"phase": "train", "from": "generate", "cycle": c}]
    names = [_boundary_name(r) for r in boundaries_shown(recs, 16)]
    assert len(names) <= 16 and names[0] == "start" and names[-2:] == ["c10 gen", "c10 train"]
    assert all(names[i].split()[0] == names[i + 1].split()[0] for i in range(1, len(names), 2)), names
    assert boundaries_shown(recs[:5], 16) == recs[:5]


def test_the_first_cycles_peak_is_reported_apart_from_the_later_ones():
    """14B with fp32 masters peaked 11.6 GiB higher in its first train phase than in the later ones (the first step
    made its states whole on the device), which the single peak column hid: the first cycle and the later cycles
    are columns of their own, and a first cycle above the later ones by more than 5% of the device gets a note."""
    from swaprl.profile.report import Run, _first_cycle_notes, peaks

    run = Run(Path("run.jsonl"), {"t0": 0.0, "device_total": 80 * GiB})
    run.label = "rank 0"
    run.phases = [{"t": 0.0, "phase": "train", "from": None, "cycle": None, "seconds": 0.0}]
    run.samples = [{"t": 0.5, "device_used": 30 * GiB}]
    for c in (1, 2, 3):  # generate at 10c..10c+5, train after it; the first train peaks at 76, the others at 65
        run.phases += [{"t": 10.0 * c, "phase": "generate", "from": "train", "cycle": c, "seconds": 0.0},
                       {"t": 10.0 * c + 5, "phase": "train", "from": "generate", "cycle": c, "seconds": 0.0}]
        run.samples += [{"t": 10.0 * c + 2, "device_used": 70 * GiB},
                        {"t": 10.0 * c + 7, "device_used": (76 if c == 1 else 65) * GiB}]
    train, generate = peaks(run)
    assert (train["device_used"], train["cycle"]) == (76 * GiB, 1)
    assert (train["first_device"], train["later_device"]) == (76 * GiB, 65 * GiB)
    assert (generate["first_device"], generate["later_device"]) == (70 * GiB, 70 * GiB)
    (note,) = _first_cycle_notes(run)
    assert note.startswith("rank 0, train: the first cycle peaked 11.00 GiB above the later ones")


def test_on_policy_check_section_from_a_recorded_run(tmp_path, capsys):
    """A CPU run with an engine of its own weights: each sync's check is in the profile and the report, and a
    refused switch (weights that differ) is flagged at the top."""
    from swaprl.checkpoints import random_model

    from . import grpo

    torch.manual_seed(0)
    model = random_model("tiny", device="cpu")
    engine = grpo.ReplicaEngine(random_model("tiny", device="cpu").to(torch.bfloat16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    rt = swaprl.attach(model, opt, engine, config=swaprl.SwapConfig(profile=tmp_path / "run.jsonl"))
    grpo.run(model, opt, engine, steps=3, runtime=rt)
    load = engine.load_weights
    engine.load_weights = lambda weights: load([(n, t) for n, t in weights if "layers.1." not in n])
    with pytest.raises(swaprl.EngineStateError):
        with rt.phase("generate"):
            pass
    swaprl.detach()
    syncs = [json.loads(line) for line in (tmp_path / "run.jsonl").read_text().splitlines()
             if '"type":"sync"' in line]
    assert [s["weights"] for s in syncs] == ["exact"] * 3 + ["differ"]
    assert all(s["mismatch"]["tokens"] > 0 for s in syncs[:3]) and syncs[3]["mismatch"] is None
    assert main(["report", str(tmp_path / "run.jsonl"), "-o", str(tmp_path / "rep")]) == 0
    md = (tmp_path / "rep" / "report.md").read_text()
    assert "## On-policy check" in md and "mismatch_rank0.png" in md
    assert "| rank 0 | 3 | exact |" in md
    assert "at cycle 4 the engine did not hold the trainer's weights (model.layers.1." in md
    assert (tmp_path / "rep" / "mismatch_rank0.png").stat().st_size > 1000
