"""Renders every table of the README, ``benchmarks/README.md`` and ``docs/`` from the JSONs.

From the repository root::

    python benchmarks/render_tables.py           # rewrite every generated block
    python benchmarks/render_tables.py --check   # exit 1 and name the stale blocks

A generated block is the text between two marker lines, ``<!-- generated: NAME -->`` and
``<!-- /generated -->``; :data:`_tables.BLOCKS` renders ``NAME`` from
``benchmarks/results/*.json``. After a benchmark writes a new JSON (its default name is the
one its table reads: ``throughput.json``, ``scale.json``; the accelerator runs' ``--name`` as
``_accelerator_tables.py``, ``_sparse_tables.py`` and ``_tables.scale_tpu`` list them), one run of this script brings
every page up to date; ``tests/test_tables.py`` fails while a page differs from its JSONs.
"""

from __future__ import annotations

import argparse
import pathlib
import re
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from _table_format import RESULTS, Results
from _tables import BLOCKS

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = re.compile(r"^<!-- generated: (\w+) -->\n(.*?)^<!-- /generated -->$",
                   re.MULTILINE | re.DOTALL)


def pages(root: pathlib.Path = ROOT) -> list[pathlib.Path]:
    """The Markdown files that may hold generated blocks."""
    return [root / "README.md", root / "benchmarks" / "README.md",
            *sorted((root / "docs").glob("*.md"))]


def render(text: str, results: Results, where: str = "text") -> str:
    """``text`` with every generated block rendered again from ``results``."""

    def block(match: re.Match) -> str:
        name = match.group(1)
        if name not in BLOCKS:
            raise SystemExit(f"{where}: no table is named {name!r} (known: {sorted(BLOCKS)})")
        return f"<!-- generated: {name} -->\n{BLOCKS[name](results)}\n\n<!-- /generated -->"

    return BLOCK.sub(block, text)


def names(text: str) -> list[str]:
    """The names of the generated blocks in ``text``, in order."""
    return [m.group(1) for m in BLOCK.finditer(text)]


def stale(root: pathlib.Path = ROOT, results: Results | None = None) -> list[str]:
    """``page: block`` for every generated block that differs from its JSONs."""
    results = results or Results(RESULTS)
    found = []
    for page in pages(root):
        text = page.read_text()
        fresh = render(text, results, str(page))
        pairs = zip(BLOCK.finditer(text), BLOCK.finditer(fresh), strict=True)
        found += [f"{page.relative_to(root)}: {old.group(1)}" for old, new in pairs
                  if old.group(0) != new.group(0)]
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true",
                        help="change nothing; exit 1 if a block differs from its JSONs")
    args = parser.parse_args(argv)
    if args.check:
        found = stale()
        for line in found:
            print(f"stale: {line}")
        return int(bool(found))
    results = Results(RESULTS)
    for page in pages():
        text = page.read_text()
        fresh = render(text, results, str(page))
        if fresh != text:
            page.write_text(fresh)
            print(f"{page.relative_to(ROOT)}: {', '.join(names(text))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
