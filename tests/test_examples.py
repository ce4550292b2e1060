"""The examples double as tests: each runs its `main()` on the tiny preset and leaves its outputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))


def test_grpo_example_trains_and_reports(tmp_path):
    import grpo

    summary = grpo.main(["--steps", "3", "--engine", "hf", "--out", str(tmp_path / "out"),
                         "--checkpoint-dir", str(tmp_path / "ck")])
    assert len(summary["steps"]) == 3
    assert all(s["rollout_tokens"] > 0 for s in summary["steps"])
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["engine"] == "HFEngine"
    html = (tmp_path / "out" / "report" / "report.html").read_text()
    assert "generate" in html and "data:image/png;base64," in html


def test_qwen72b_example_plans_then_runs_on_the_tiny_preset(tmp_path, capsys):
    import qwen72b

    assert qwen72b.main(["--steps", "2", "--out", str(tmp_path / "q")]) == 0
    out = capsys.readouterr().out
    assert "per GPU (GiB)" in out and "fits" in out  # the plan is printed first
    assert (tmp_path / "q" / "report" / "report.md").exists()
    sys.modules.pop("grpo", None)
