"""The README is a front page that fits on a few screens, and every link in it and in docs/ leads somewhere."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*_]", "", heading.strip().lower())
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
    return {slug(m.group(1)) for m in re.finditer(r"^#+ (.+)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    """The relative links of ``page`` whose file or #anchor does not exist."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto: not checked offline
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        if not path.exists():
            broken.append(target)
        elif anchor and path.suffix == ".md" and anchor not in anchors(path):
            broken.append(target)
    return broken


def test_readme_is_a_front_page():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 250
    headings = [line for line in lines if line.startswith("## ")]
    assert headings[:2] == ["## Two commands", "## Use"]
    assert "## Results" in headings


def test_every_relative_link_resolves():
    tracked = subprocess.run(["git", "ls-files", "*.md"], cwd=ROOT, capture_output=True, text=True, check=True)
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    pages += [ROOT / p for p in tracked.stdout.split() if p.startswith(("benchmarks/", "kernels/", "data/"))]
    assert len(pages) > 5
    found = {str(page.relative_to(ROOT)): broken_links(page) for page in pages}
    assert found == {page: [] for page in found}


def test_the_link_checker_sees_a_broken_link_and_a_missing_anchor(tmp_path):
    (tmp_path / "a.md").write_text("# Top\n\n## Two words\n\n[ok](#two-words) [bad](#nowhere) [gone](b.md)\n")
    assert broken_links(tmp_path / "a.md") == ["#nowhere", "b.md"]
    assert slug("How `generate` reaches DSpark") == "how-generate-reaches-dspark"


def test_docstrings_cite_pages_that_exist():
    cited = set()
    for path in (ROOT / "hf_dspark").rglob("*.py"):
        cited |= set(re.findall(r"docs/\w+\.md", path.read_text()))
    assert cited and all((ROOT / page).is_file() for page in cited)
    source = "\n".join(p.read_text() for p in (ROOT / "hf_dspark").rglob("*.py"))
    assert "DSPARK" + ".md" not in source  # the paper's notes are not in this repository


def test_the_readme_use_snippet_runs_as_written(capsys):
    """The first Python block under "## Use" runs as a newcomer would paste it (the embedded target and the shipped
    draft, offline), and its greedy output is plain greedy's, token for token (float32 here)."""
    text = (ROOT / "README.md").read_text()
    use = text.split("\n## Use\n", 1)[1]
    snippet = re.search(r"```python\n(.*?)```", use, flags=re.S).group(1)
    namespace: dict = {}
    exec(compile(snippet, "README.md (Use)", "exec"), namespace)
    printed = capsys.readouterr().out.strip().splitlines()
    target, inputs, out, draft = (namespace[k] for k in ("target", "inputs", "out", "draft"))
    assert target.dtype == draft.dtype
    assert out.tolist() == target.generate(**inputs, max_new_tokens=64, do_sample=False).tolist()
    assert printed[0].strip() and draft.stats.rounds > 0 and draft.stats.tau >= 1.0
    assert printed[-1].startswith(f"{draft.stats.tau} [")
