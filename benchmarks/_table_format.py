"""What the generated tables share: the results folder and the formatting of their numbers.

:class:`Results` reads each JSON of ``benchmarks/results`` once and records which were read
(``tests/test_tables.py`` checks that every result file is shown); the functions format
ratios, sizes and times alike in every table, and :func:`source` names where a table's
numbers come from (file, machine, commit).
"""

from __future__ import annotations

import json
import pathlib
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any

RESULTS = pathlib.Path(__file__).resolve().parent / "results"
DEVICE_NAMES = {"TPU v5 lite": "TPU v5e"}
MISSING = "—"
THROUGHPUT_FIGURES = (("ratio_to_bptt", "`etrace_grad`"),
                      ("jit_ratio_to_bptt", "`online_grad` in a jitted step"),
                      ("device_ratio_to_bptt", "the device's own time"))
"""A throughput run's ratios to BPTT (key in its JSON, what it times), in the tables' order."""


class Results:
    """The JSONs of one results folder, each read once."""

    def __init__(self, folder: pathlib.Path = RESULTS):
        self.folder = pathlib.Path(folder)
        self._cache: dict[str, Any] = {}
        self.read: set[str] = set()

    def __call__(self, name: str) -> Any:
        if name not in self._cache:
            path = self.folder / name
            if not path.exists():
                raise FileNotFoundError(f"{path}: a generated table reads it; run its benchmark "
                                        "or remove the table's block")
            self._cache[name] = json.loads(path.read_text())
        self.read.add(name)
        return self._cache[name]

    def present(self, names: Sequence[str]) -> list[str]:
        """Those of ``names`` that the folder holds, in order (a run not made yet is not)."""
        return [name for name in names if (self.folder / name).exists()]


def ratio(r: float | None) -> str:
    """``1.39×``: two decimals below 10, one below 100, none above."""
    if r is None:
        return MISSING
    return f"{r:.2f}×" if r < 10 else f"{r:.1f}×" if r < 100 else f"{r:.0f}×"


def size(n: float) -> str:
    """Bytes in KiB, MiB or GiB."""
    for unit in ("KiB", "MiB", "GiB"):
        n /= 1024
        if n < 1024 or unit == "GiB":
            return f"{n:.3g} {unit}" if n < 10 else f"{n:.1f} {unit}" if n < 100 else \
                f"{n:.0f} {unit}"
    raise AssertionError


def micro(us: float) -> str:
    return f"{us:.3g} µs" if us < 100 else f"{us:.0f} µs"


def wrap(text: str) -> str:
    """A paragraph in lines of at most 100 characters (words and code spans kept whole)."""
    return textwrap.fill(text, width=100, break_long_words=False, break_on_hyphens=False)


def captioned(caption: str, *lines: str) -> str:
    """A block: its caption (wrapped), a blank line, then ``lines``."""
    return "\n".join([wrap(caption), "", *lines])


def table(header: Sequence[str], rows: Iterable[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "| " + " | ".join("---" for _ in header) + " |"]
    return lines + ["| " + " | ".join(row) + " |" for row in rows]


def machine(env: dict[str, Any]) -> str:
    """``a 2-core CPU``, ``one TPU v5e chip``."""
    if env["backend"] == "cpu":
        return f"a {env['cpu_count']}-core CPU"
    kind = env.get("device_kind", env["backend"])
    return f"one {DEVICE_NAMES.get(kind, kind)} chip"


def source(results: Results, *names: str) -> str:
    """Where a table's numbers come from: files, machine, commit (files that share them named
    together)."""
    groups: dict[str, list[str]] = {}
    for name in names:
        env = results(name)["environment"]
        state = env["braintrace"]
        changes = " with uncommitted changes" if state.get("uncommitted_library_diff_sha1") else ""
        where = f"{machine(env)}, commit `{state['commit'][:7]}`{changes}"
        groups.setdefault(where, []).append(f"`benchmarks/results/{name}`")
    return "; ".join(f"{', '.join(files)} ({where})" for where, files in groups.items())


def lengths(run: dict[str, Any]) -> list[tuple[str, int, dict[str, Any]]]:
    """A throughput run's results as ``(model, T, entry)``: its keys are the model's name, or
    ``model@T`` when the run measured several lengths (``config['T']`` a list)."""
    found = []
    for key, entry in run["results"].items():
        model, _, length = key.partition("@T")
        found.append((model, int(length) if length else run["config"]["T"], entry))
    return found


def seconds(s: float) -> str:
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} minutes"


