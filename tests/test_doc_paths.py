"""Every repository path a reference doc names exists: in backticks (`src/lpf/...`, `tests/...`, `bench/...`,
`scripts/...`, `docs/...`, `plugins/...`) or as a link target (relative links resolved from the doc's
folder), and a link's `#anchor` into a Markdown file is one of its headings. docs/history/ is exempt as a
source (it records what was true on its dates, paths since renamed included), not as a target."""

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md"]
ROOTS = ("src/lpf/", "tests/", "bench/", "scripts/", "docs/", "plugins/")
EXTERNAL = ("tests/unit_tests/",)  # another project's paths a doc quotes (Megatron-Bridge's, conformance.md)
_TICKED = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"\]\(([^)\s]+)\)")
_PATH = re.compile(r"(?:^|[\s(\"'=])((?:%s)[\w./*{},-]*)" % "|".join(map(re.escape, ROOTS)))


def _exists(path: str) -> bool:
    path = path.rstrip(".,;:)")
    if "*" in path or "{" in path:  # a glob (bench/results/*.json) names at least one file
        pattern = re.sub(r"\{([^}]*)\}", lambda m: "[" + "".join(m.group(1).split(",")) + "]", path)
        return any(ROOT.glob(pattern)) or any(ROOT.glob(path.replace("{", "").replace("}", "")))
    return (ROOT / path).exists()


def named_paths(doc: Path) -> list[tuple[int, str]]:
    """(line, path) for each repository path the doc names."""
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for span in _TICKED.findall(line):
            for m in _PATH.finditer(" " + span):
                p = m.group(1).split("::")[0]
                if "<" not in p and not p.endswith("/...") and not p.startswith(EXTERNAL):
                    out.append((n, p))
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a URL or an anchor in the same page
            rel = (doc.parent / target.split("#")[0]).resolve()
            out.append((n, str(rel.relative_to(ROOT)) if rel.is_relative_to(ROOT) else target))
    return out


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation but - and _ dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(doc: Path) -> set[str]:
    return {_slug(line.lstrip("#")) for line in doc.read_text().splitlines() if re.match(r"#{1,6} ", line)}


def broken_anchors(doc: Path) -> list[str]:
    out = []
    for n, line in enumerate(doc.read_text().splitlines(), 1):
        for target in _LINK.findall(line):
            if re.match(r"[a-z]+:", target) or "#" not in target:
                continue
            file, anchor = target.split("#", 1)
            dest = (doc.parent / file).resolve() if file else doc
            if dest.suffix == ".md" and dest.exists() and anchor not in anchors(dest):
                out.append(f"{doc.name}:{n}: {target}")
    return out


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_link_anchor_is_a_heading(doc):
    broken = broken_anchors(doc)
    assert not broken, "anchors that name no heading:\n" + "\n".join(broken)


@pytest.mark.parametrize("doc", DOCS, ids=lambda d: d.name)
def test_every_path_a_doc_names_exists(doc):
    missing = [f"{doc.name}:{n}: {p}" for n, p in named_paths(doc) if not _exists(p)]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_check_sees_paths_in_backticks_and_links(tmp_path):
    doc = ROOT / "docs" / "design.md"
    found = {p for _, p in named_paths(doc)}
    assert "src/lpf/builtin/drill_catalog.py" in found  # named in backticks
    assert not _exists("src/lpf/no_such_module.py") and _exists("bench/results/*.json")
    assert _slug("The bug class, drill by drill (`bench/bugs.py`)") == "the-bug-class-drill-by-drill-benchbugspy"
    bad = tmp_path / "x.md"
    bad.write_text("# Title\n[a](#title) [b](#no-such-heading)\n")
    assert broken_anchors(bad) == ["x.md:2: #no-such-heading"]
