"""benchmarks/bench_resume.py on the CPU: examples/grpo.py's tiny run straight, killed after its third step and
resumed from the checkpoint of its second, in processes of their own (the GPU run at 72B's shapes goes this way).

    python -m pytest tests/test_bench_resume.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RUN = [sys.executable, str(ROOT / "examples" / "grpo.py"), "--preset", "tiny", "--engine", "hf", "--warmup", "0",
       "--save-steps", "2", "--steps", "4"]


@pytest.fixture
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_resume

    return bench_resume


def test_a_run_killed_after_a_step_past_its_checkpoint_resumes_bit_for_bit(tmp_path, bench, capsys):
    out = tmp_path / "out"
    run = [*RUN, "--checkpoint-dir", str(tmp_path / "ck")]
    assert bench.main(["--out", str(out), "--kill-after", "3", "--", *run]) == 0
    result = json.loads((out / "resume.json").read_text())
    assert result["reproducible"] and result["bit_for_bit"] and result["resumed_from"] == 2
    assert result["runs"]["killed"]["killed"] and result["runs"]["killed"]["lines"] == 3
    assert [r["step"] for r in result["resumed_run"]] == [0, 1, 2, 3]
    assert all(r["loss"] is not None and r["loss"] == r["reference_loss"] for r in result["resumed_run"])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["bit_for_bit"] is True
    assert not (out / "resumed" / "checkpoints").exists() and not (out / "straight" / "checkpoints").exists()


def test_a_figure_that_differs_or_a_step_with_nothing_to_compare_is_not_equal(bench):
    reference = [{"step": 0, "loss": 0.5, "reward": 1.0, "step_s": 2.0}, {"step": 1, "loss": 0.25, "reward": 0.5}]
    assert all(r["equal"] and r["differs"] == [] for r in
               bench.compare([{**reference[0], "step_s": 9.0}, reference[1]], reference))
    moved = bench.compare([{**reference[1], "loss": 0.25000001}], reference)[0]
    assert not moved["equal"] and moved["differs"] == ["loss"]  # the figure that moved, named
    extra = bench.compare([{**reference[1], "kl": 0.0}], reference)[0]
    assert not extra["equal"] and extra["differs"] == ["kl"]  # a figure only one run gives differs too
    alone = bench.compare([{"step": 2, "loss": 0.5}], reference)[0]
    assert not alone["equal"] and alone["differs"] == ["loss", "step"]  # nothing to compare: every figure differs
    nan = [{"step": 0, "loss": float("nan")}]
    assert bench.compare([{"step": 0, "loss": float("nan")}], nan)[0]["equal"]  # the same bits, though NaN != NaN


def test_a_run_that_cannot_be_resumed_or_compared_is_refused_with_the_fix(tmp_path, bench):
    with pytest.raises(SystemExit, match="--save-steps"):
        bench.main(["--out", str(tmp_path / "a"), "--kill-after", "1", "--", sys.executable, "examples/grpo.py"])
    with pytest.raises(SystemExit, match="give the run after"):
        bench.main(["--out", str(tmp_path / "a"), "--kill-after", "1"])
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(SystemExit, match="not empty"):
        bench.main(["--out", str(tmp_path / "full"), "--kill-after", "1", "--", *RUN])
