"""The README is the front door (STYLE.md item 11): at most 200 lines, the two commands
first, links that resolve; every measured figure lives in docs/measured.md with its date,
commit and the command that reproduces it."""

import re
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_README_LINES = 200

LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REF_LINK = re.compile(r"^\s*\[[^\]]+\]:\s+<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
COMMIT = re.compile(r"\b[0-9a-f]{7,40}\b")


def _pages(root: Path) -> list[Path]:
    return [root / "README.md", *sorted((root / "docs").glob("*.md"))]


def _prose(text: str) -> str:
    """The text a reader sees as links: no fenced blocks, no inline code."""
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _links(text: str) -> list[str]:
    prose = _prose(text)
    return LINK.findall(prose) + REF_LINK.findall(prose)


def _is_external(target: str) -> bool:
    return re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) is not None  # http:, https:, mailto:


def broken_links(root: Path) -> list[str]:
    """Relative links and images of README.md and docs/*.md whose file does not exist."""
    broken = []
    for page in _pages(root):
        for target in _links(page.read_text()):
            if _is_external(target):
                continue
            path = target.split("#", 1)[0]
            if not path:  # an anchor in the same page
                continue
            if not (page.parent / path).exists():
                broken.append(f"{page.relative_to(root)}: {target}")
    return broken


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {_slug(h) for h in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, re.M)}


def broken_anchors(root: Path, into: tuple[str, ...]) -> list[str]:
    """Links from README.md and docs/*.md into the pages `into` whose #anchor is no heading."""
    wanted = {(root / p).resolve() for p in into}
    broken = []
    for page in _pages(root):
        for target in _links(page.read_text()):
            if _is_external(target) or "#" not in target:
                continue
            path, anchor = target.split("#", 1)
            dest = (page.parent / path).resolve() if path else page.resolve()
            if dest in wanted and dest.exists() and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(root)}: {target}")
    return broken


def _tables(text: str) -> list[tuple[int, list[str]]]:
    """(line index of the header, table lines) of every markdown table outside code."""
    lines = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text).splitlines()
    tables, i = [], 0
    while i < len(lines):
        if (
            lines[i].lstrip().startswith("|")
            and i + 1 < len(lines)
            and re.match(r"^\s*\|[\s:|-]+\|\s*$", lines[i + 1])
        ):
            j = i
            while j < len(lines) and lines[j].lstrip().startswith("|"):
                j += 1
            tables.append((i, lines[i:j]))
            i = j
        else:
            i += 1
    return tables


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def tables_without_provenance(measured: Path) -> list[str]:
    """Tables of docs/measured.md that carry neither date, commit and command columns (each
    row filled) nor `Date:`, `Commit:` and `Command:` lines in their section."""
    text = measured.read_text()
    lines = text.splitlines()
    bad = []
    for start, table in _tables(text):
        header = [c.lower() for c in _cells(table[0])]
        cols = {n: header.index(n) for n in ("date", "commit", "command") if n in header}
        where = f"table at line {start + 1} ({table[0][:60]})"
        if len(cols) == 3:
            for row in table[2:]:
                cells = _cells(row)
                if not (
                    len(cells) == len(header)
                    and DATE.search(cells[cols["date"]])
                    and COMMIT.search(cells[cols["commit"]])
                    and "`" in cells[cols["command"]]
                ):
                    bad.append(f"{where}: row without date, commit or command: {row[:80]}")
            continue
        top = max((k for k in range(start) if lines[k].startswith("#")), default=0)
        section = "\n".join(lines[top:start])
        if not (
            re.search(r"^Date: \d{4}-\d{2}-\d{2}\b", section, re.M)
            and re.search(r"Commit: (recorded at )?[0-9a-f]{7,40}\b", section)
            and re.search(r"^Command: `[^`]+`", section, re.M)
        ):
            bad.append(f"{where}: no date/commit/command columns nor Date:/Commit:/Command: lines")
    return bad


def test_readme_is_at_most_200_lines():
    n = len((ROOT / "README.md").read_text().splitlines())
    assert n <= MAX_README_LINES, f"README.md has {n} lines; figures go to docs/measured.md"


def test_readme_starts_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first = FENCE.search(text)
    assert first is not None, "README.md has no code block"
    commands = [line.split("#")[0].strip() for line in first.group(0).splitlines()[1:-1]]
    assert commands[:2] == ["make demo", "make test"], commands
    before = text[: first.start()]
    assert before.count("\n## ") <= 1, "the two commands come right after what it is"


def test_the_readmes_only_tables_are_rendered_from_results_files():
    """The demo's answer, the bake-off's and the drift's tables, each rendered from its results file
    (tests/test_figures.py checks the rendering); every other measured figure belongs in
    docs/measured.md."""
    from evaluation.figures import BLOCK

    text = (ROOT / "README.md").read_text()
    outside = BLOCK.sub("", text)
    assert _tables(outside) == [], "other measured figures belong in docs/measured.md"
    for block in BLOCK.finditer(text):
        if block.group(2) in ("demo", "bakeoff"):  # drafters, each against the n-gram one
            for _, table in _tables(block.group(3)):
                assert "n-gram" in "\n".join(table)


def test_links_and_images_resolve():
    assert broken_links(ROOT) == []


def test_links_into_readme_and_measured_name_a_heading():
    assert broken_anchors(ROOT, ("README.md", "docs/measured.md")) == []


def test_every_measured_table_has_date_commit_and_command():
    measured = ROOT / "docs" / "measured.md"
    assert measured.is_file()
    assert _tables(measured.read_text()), "docs/measured.md holds no table"
    assert tables_without_provenance(measured) == []


def test_the_checks_can_fail(tmp_path):
    """A broken link, a missing image, a wrong anchor and a table without provenance are
    each caught on a copy of the pages."""
    (tmp_path / "docs").mkdir()
    shutil.copy(ROOT / "README.md", tmp_path / "README.md")
    for page in (ROOT / "docs").glob("*.md"):
        shutil.copy(page, tmp_path / "docs" / page.name)
    for name in ("recipes", "specforge_dspark"):
        (tmp_path / name).symlink_to(ROOT / name)
    for image in (ROOT / "docs").glob("*.png"):
        (tmp_path / "docs" / image.name).symlink_to(image)
    if (ROOT / "docs" / "results").is_dir():  # the results files the README links
        (tmp_path / "docs" / "results").symlink_to(ROOT / "docs" / "results")
    assert broken_links(tmp_path) == broken_links(ROOT) == []

    readme = tmp_path / "README.md"
    readme.write_text(readme.read_text() + "\n[gone](docs/nowhere.md#x) ![](docs/no.png)\n")
    assert broken_links(tmp_path) == ["README.md: docs/nowhere.md#x", "README.md: docs/no.png"]

    readme.write_text(readme.read_text() + "\n[old](docs/measured.md#no-such-heading)\n")
    assert broken_anchors(tmp_path, ("docs/measured.md",)) == [
        "README.md: docs/measured.md#no-such-heading"
    ]

    measured = tmp_path / "docs" / "measured.md"
    measured.write_text(
        measured.read_text()
        + "\n## A new benchmark\n\nSome figure.\n\n| what | figure |\n|---|---|\n| x | 1.0 |\n"
        + "\n## Another\n\n| date | commit | command | figure |\n|---|---|---|---|\n"
        + "| 2026-12-02 | | `make demo` | 2.0 |\n"
    )
    bad = tables_without_provenance(measured)
    assert len(bad) == 2 and "no date/commit/command" in bad[0] and "row without" in bad[1]


def test_recipe_comments_point_at_pages_and_sections_that_exist():
    """A recipe's comments name docs by path (`docs/X.md#section`): each page and section
    exists, and no comment points at a README section by title (the README is a front door
    whose sections move)."""
    broken = []
    for recipe in sorted((ROOT / "recipes").glob("*.yaml")):
        comments = "\n".join(line.partition("#")[2] for line in recipe.read_text().splitlines())
        for path, anchor in re.findall(r"(docs/[\w-]+\.md)(?:#([\w-]+))?", comments):
            page = ROOT / path
            if not page.is_file() or (anchor and anchor not in _anchors(page)):
                broken.append(f"{recipe.name}: {path}#{anchor}")
        broken += [f"{recipe.name}: README {m}" for m in re.findall(r'README,? "[^"]+"', comments)]
    assert not broken, broken


def current_marks(measured: Path) -> list[str]:
    """Dated tables of docs/measured.md whose newest entry (the rows of the newest date and
    of the commit of that date's last row) is not marked **current**, or whose other rows
    are."""
    bad = []
    for start, table in _tables(measured.read_text()):
        header = [c.lower() for c in _cells(table[0])]
        if "date" not in header:
            continue
        col, ccol = header.index("date"), header.index("commit") if "commit" in header else None
        rows = [_cells(r) for r in table[2:]]
        dates = [(DATE.search(r[col]) or [""])[0] if len(r) > col else "" for r in rows]
        newest = max(dates)
        last = [i for i, d in enumerate(dates) if d == newest][-1]
        for i, (row, date) in enumerate(zip(rows, dates, strict=True)):
            same = i == last if ccol is None else row[ccol] == rows[last][ccol]
            marked = "**current**" in row[col]
            if marked != (date == newest and same):
                bad.append(f"table at line {start + 1}: {date} {'' if marked else 'not '}marked")
    return bad


def test_the_newest_row_of_each_dated_table_is_marked_current():
    assert current_marks(ROOT / "docs" / "measured.md") == []
