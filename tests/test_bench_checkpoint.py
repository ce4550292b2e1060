"""benchmarks/bench_checkpoint.py on the tiny preset on the CPU: the plumbing the GPU run relies on.

    python -m pytest tests/test_bench_checkpoint.py -q
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def test_the_checkpoint_benchmark_times_save_load_and_the_disk_and_ends_with_one_json_line(tmp_path, monkeypatch,
                                                                                           capsys):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import bench_checkpoint

    result = bench_checkpoint.main(["--preset", "tiny", "--master-weights", "--warmup", "0", "--repeats", "1",
                                    "--dir", str(tmp_path / "disk"), "--checkpoint-dir", str(tmp_path / "ck"),
                                    "--out", str(tmp_path / "out")])
    sys.modules.pop("grpo", None)
    printed = capsys.readouterr().out.strip().splitlines()
    med = result["median"]
    assert all(med[k] > 0 for k in ("save_s", "dcp_save_s", "check_s", "load_s", "disk_write_s", "disk_read_s"))
    assert med["dcp_save_s"] <= med["save_s"] and med["bytes"] > 4 * 2**20  # the masters and states are in it
    assert result["optimizer_homes_bytes"]["host"] > 0
    assert json.loads(printed[-1])["save_over_disk_write"] == result["save_over_disk_write"]
    assert "disk: write + fsync" in "\n".join(printed)
    assert json.loads((tmp_path / "out" / "checkpoint.json").read_text())["runs"] == result["runs"]
    assert not list((tmp_path / "disk").glob("run*")) and not list((tmp_path / "disk").glob("disk*"))
