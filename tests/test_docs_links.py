"""The documentation's links lead somewhere: every relative link of README.md, docs/*.md and the results' markdown
resolves to a file or folder of the repository, its #anchor (if any) to a heading of that page, every result folder
is a row of the results' index, and benchmarks/results holds results only (no generated HTML or
PNG, which `python benchmarks/rebuild_reports.py` rebuilds from the profiles kept, and no code)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
GENERATED = (".html", ".png")  # swaprl report's output, rebuilt beside each report.md (benchmarks/rebuild_reports.py)

_FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
_CODE = re.compile(r"`([^`\n]+)`")
# A path written as code rather than as a link, in the results' own style: `../other_result/` or
# `benchmarks/results/...`; a command's arguments or a bare file name are not checked.
_CODE_PATH = re.compile(r"^(?:\.\./|benchmarks/results/)[\w./+-]*$")


def _documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted(RESULTS.rglob("*.md"))]


def _targets(doc: Path) -> list[tuple[str, Path]]:
    """(as written, the path it names) for each relative link of `doc`, and each path written as code."""
    text = _FENCE.sub("", doc.read_text(encoding="utf-8"))
    out = []
    for written in _LINK.findall(_CODE.sub("", text)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", written, re.IGNORECASE) or written.startswith("#"):
            continue  # a URL, mailto:, or an anchor of the page itself
        out.append((written, (doc.parent / written.split("#")[0]).resolve()))
    for written in _CODE.findall(text):
        if _CODE_PATH.match(written):
            base = ROOT if written.startswith("benchmarks/") else doc.parent
            out.append((written, (base / written).resolve()))
    return out


def _anchors(page: Path) -> set[str]:
    """The anchors GitHub gives `page`'s headings: lowercased, punctuation but hyphens and underscores dropped,
    spaces as hyphens, a repeated heading suffixed -1, -2..."""
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6}[ \t]+(.*?)[ \t#]*$", _FENCE.sub("", page.read_text(encoding="utf-8")),
                              re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        count = seen[slug] = seen.get(slug, -1) + 1
        found.add(f"{slug}-{count}" if count else slug)
    return found


def _anchored(doc: Path) -> list[tuple[str, Path, str]]:
    """(as written, the markdown page it names, the anchor) for each relative link of `doc` with an #anchor."""
    text = _CODE.sub("", _FENCE.sub("", doc.read_text(encoding="utf-8")))
    out = []
    for written in _LINK.findall(text):
        if "#" not in written or re.match(r"^[a-z][a-z0-9+.-]*:", written, re.IGNORECASE):
            continue
        path, anchor = written.split("#", 1)
        page = (doc.parent / path).resolve() if path else doc
        page = page / "README.md" if page.is_dir() else page
        if page.suffix == ".md" and page.exists():
            out.append((written, page, anchor))
    return out


def _rebuilt(target: Path) -> bool:
    """A report's HTML or figure: not kept in git, rebuilt beside its report.md from the profiles kept with it."""
    if target.suffix not in GENERATED or RESULTS not in target.parents:
        return False
    where = target.parent
    profiles = [p for d in (where, where.parent) for p in (*d.glob("profile*.jsonl"), *d.glob("profile*.jsonl.gz"))]
    return (where / "report.md").exists() and bool(profiles)


def test_every_relative_link_resolves():
    broken = []
    for doc in _documents():
        for written, target in _targets(doc):
            if not (target.exists() or _rebuilt(target)):
                broken.append(f"{doc.relative_to(ROOT)}: {written}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_the_readme_links_every_page_of_the_docs():
    """The README's index of docs/ is how a newcomer finds a page: one it does not link is one nobody reads."""
    linked = {target for _, target in _targets(ROOT / "README.md")}
    missing = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked)
    assert not missing, f"pages of docs/ the README does not link: {missing}"


def test_every_anchor_names_a_heading_of_its_page():
    broken = [f"{doc.relative_to(ROOT)}: {written}" for doc in _documents()
              for written, page, anchor in _anchored(doc) if anchor not in _anchors(page)]
    assert not broken, "anchors that name no heading:\n" + "\n".join(broken)


def test_the_anchors_are_githubs(tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# vLLM 0.33: refused\n## Lent pages: an engine that wakes on torch's cache\n## Tests\n"
                    "```\n# not a heading\n```\n## Tests\n[a](#tests-1) [b](#gone)\n")
    assert _anchors(page) == {"vllm-033-refused", "lent-pages-an-engine-that-wakes-on-torchs-cache", "tests",
                              "tests-1"}
    assert [a for _, _, a in _anchored(page)] == ["tests-1", "gone"]


def test_the_check_sees_a_broken_link(tmp_path, monkeypatch):
    doc = tmp_path / "README.md"
    doc.write_text("[gone](benchmarks/results/gone/README.md) and `../gone_either/`, but `--out x.json` is a command\n"
                   "```\n[in a code block](nowhere.md)\n```\n[a page](https://example.org/x) [here](#top)\n")
    assert [w for w, t in _targets(doc) if not t.exists()] == ["benchmarks/results/gone/README.md", "../gone_either/"]


def test_the_results_hold_no_generated_files_and_no_code():
    try:
        tracked = subprocess.run(["git", "ls-files", "benchmarks/results"], cwd=ROOT, capture_output=True, text=True,
                                 check=True, timeout=60).stdout.split()
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout: the tracked files cannot be listed")
    wrong = [f for f in tracked if f.endswith((*GENERATED, ".py"))]
    assert not wrong, f"generated files or code under benchmarks/results (benchmarks/ holds the scripts): {wrong}"


def test_every_result_folder_is_a_row_of_the_index():
    """benchmarks/results/README.md is where the README's table and the docs cite figures from: a folder it does not
    list is a result no reader finds."""
    index = (RESULTS / "README.md").read_text(encoding="utf-8")
    listed = {(RESULTS / t.split("#")[0]).resolve() for t in _LINK.findall(index)}
    missing = sorted(d.name for d in RESULTS.iterdir() if d.is_dir() and d.resolve() not in listed)
    assert not missing, f"result folders with no row in benchmarks/results/README.md: {missing}"
