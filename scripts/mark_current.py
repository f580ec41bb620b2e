"""Mark the newest entry of every dated table of docs/measured.md **current** (the rows of
the newest date and of the commit of that date's last row) and unmark the rest; run it
after adding a row (tests/test_readme.py checks the marks).

    python scripts/mark_current.py [docs/measured.md]
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
SEPARATOR = re.compile(r"^\s*\|[\s:|-]+\|\s*$")
MARK = " **current**"


def _cells(row: str) -> list[str]:
    return [c.strip() for c in row.strip().strip("|").split("|")]


def mark(lines: list[str]) -> list[str]:
    out, i, fenced = list(lines), 0, False
    while i < len(out):
        fenced ^= out[i].startswith("```")
        table = not fenced and out[i].lstrip().startswith("|") and i + 1 < len(out)
        if not (table and SEPARATOR.match(out[i + 1])):
            i += 1
            continue
        header = [c.lower() for c in _cells(out[i])]
        end = i + 2
        while end < len(out) and out[end].lstrip().startswith("|"):
            end += 1
        if "date" in header:
            col = header.index("date")
            ccol = header.index("commit") if "commit" in header else None
            rows = [_cells(out[k]) for k in range(i + 2, end)]
            dates = [(DATE.search(r[col]) or [""])[0] if len(r) > col else "" for r in rows]
            newest = max(dates)
            last = [n for n, d in enumerate(dates) if d == newest][-1]
            for n, row in enumerate(rows):
                row[col] = row[col].replace(MARK, "")
                same = n == last if ccol is None else row[ccol] == rows[last][ccol]
                if dates[n] == newest and same:
                    row[col] += MARK
                out[i + 2 + n] = "| " + " | ".join(row) + " |"
        i = end
    return out


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/measured.md")
    path.write_text("\n".join(mark(path.read_text().split("\n"))))
