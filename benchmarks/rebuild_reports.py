"""Rebuild the HTML reports and PNG figures of the memory profiles kept under benchmarks/results (they are made by
`swaprl report`, and not kept in git: only each run's profile, its README and JSON are).

    python benchmarks/rebuild_reports.py            # every report.md's directory gets report.html and its PNGs again

Each report sits beside its run's profiles (profile*.jsonl[.gz]) or one directory below them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from swaprl.profile.report import load_run, profiles_in, write_report

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> int:
    built = 0
    for md in sorted(RESULTS.rglob("report.md")):
        for where in (md.parent, md.parent.parent):
            try:
                profiles = profiles_in(where)
            except ValueError:
                continue
            write_report([load_run(p) for p in profiles], md.parent)
            print(f"{md.parent.relative_to(RESULTS)}: report.html from {', '.join(p.name for p in profiles)}")
            built += 1
            break
        else:
            print(f"{md.parent.relative_to(RESULTS)}: no profile beside it", file=sys.stderr)
    return 0 if built else 1


if __name__ == "__main__":
    sys.exit(main())
