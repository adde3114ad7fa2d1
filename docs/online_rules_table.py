"""The table of ``docs/online_rules.md``, generated from the committed benchmark results.

Usage (from the repository root)::

    python docs/online_rules_table.py          # prints the table
    python docs/online_rules_table.py --write  # rewrites it in docs/online_rules.md

Each row's fixed columns (what the rule keeps, its memory, when it is exact) are
:data:`ROWS`; the measured ones are read from ``benchmarks/results``:

* time per step, the ratio to BPTT's in the same run (``ratio_to_bptt``, median over the
  round-robin passes) of the ``snn`` model (two recurrent LIF layers and a leaky readout,
  hidden 256, batch 16, T = 200): ``throughput_spiking_rules.json`` (CPU) and
  ``throughput_spiking_rules_tpu.json`` (TPU);
* test accuracy, mean ± spread over the seeds, of the ``alif`` model (a recurrent ALIF layer
  and a leaky readout) on ``spiking_digits`` and ``mnist1d``: ``tasks_spiking_rules.json``.

A file or a row not there yet reads ``—`` (not measured). ``tests/test_docs.py`` checks
that the page holds exactly this table.
"""

from __future__ import annotations

import argparse
import json
import pathlib
from typing import NamedTuple

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "online_rules.md"
RESULTS = ROOT / "benchmarks" / "results"
THROUGHPUT = {"CPU": "throughput_spiking_rules.json", "TPU": "throughput_spiking_rules_tpu.json"}
TASKS = "tasks_spiking_rules.json"
START, END = "<!-- table: start -->", "<!-- table: end -->"
MISSING = "—"


class Row(NamedTuple):
    """One rule: its name in the benchmarks, and the columns no run measures."""

    rule: str
    method: str
    keeps: str
    memory: str
    exact: str


ROWS = (
    Row("BPTT", "bptt", "the whole gradient", "grows with `T`", "always"),
    Row("D-RTRL", "d_rtrl", "each weight's exact influence on its own neurons",
        "`B·P·S`", "recurrence neuron by neuron, no state with memory reading the layer"),
    Row("ES-D-RTRL", "es_d_rtrl", "smoothed input and output factors of that influence",
        "`B·(I + O·S)`", "`T = 1`"),
    Row("e-prop", "eprop", "D-RTRL's traces, low-pass filtered by `kappa` (0.9 in the tasks)",
        "`B·P·S`", "`kappa = 0` (D-RTRL)"),
    Row("OTTT", "ottt", "a presynaptic trace decayed by `λ`, times each step's spatial gradient",
        "`B·I`", "leak `λ`, reset without derivative, one layer, memoryless readout"),
    Row("SLTT", "sltt", "each step's spatial gradient", "none",
        "no state carries credit across steps"),
    Row("OTPE", "otpe", "D-RTRL's traces and a leaky estimate of their effect on the reading "
        "neurons", "`B·P·(S + readers)`", "one layer under a leaky readout of leak `λ`"),
)
"""One row per rule, in table order."""

HEADER = ("| rule | keeps | memory per operation | time per step, CPU | TPU | spiking digits "
          "| MNIST-1D | exact (= BPTT) when |\n|---|---|---|---|---|---|---|---|")


def _load(name: str) -> dict | None:
    path = RESULTS / name
    return json.loads(path.read_text()) if path.exists() else None


def time_cell(payload: dict | None, method: str) -> str:
    """``×r`` of ``method`` on the ``snn`` model, or ``—``."""
    row = (payload or {}).get("results", {}).get("snn", {}).get("methods", {}).get(method)
    return MISSING if row is None else f"×{row['ratio_to_bptt']:.2f}"


def accuracy_cell(payload: dict | None, task: str, method: str) -> str:
    """``mean ± spread`` of ``method``'s test accuracy on ``task`` (``alif``), or ``—``."""
    row = (payload or {}).get("results", {}).get(task, {}).get("alif", {}).get(method)
    if row is None or "test_accuracy_mean" not in row:
        return MISSING
    return f"{row['test_accuracy_mean']:.3f} ± {row['test_accuracy_std']:.3f}"


def table() -> str:
    """The table as the page holds it."""
    times = {device: _load(name) for device, name in THROUGHPUT.items()}
    tasks = _load(TASKS)
    lines = [HEADER]
    for row in ROWS:
        cells = (f"{row.rule} (`'{row.method}'`)", row.keeps, row.memory,
                 time_cell(times["CPU"], row.method), time_cell(times["TPU"], row.method),
                 accuracy_cell(tasks, "spiking_digits", row.method),
                 accuracy_cell(tasks, "mnist1d", row.method), row.exact)
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def page_table(text: str) -> str:
    """The table between the page's markers."""
    return text.split(START, 1)[1].split(END, 1)[0].strip()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the page's table")
    args = parser.parse_args(argv)
    if not args.write:
        print(table())
        return
    text = PAGE.read_text()
    before, rest = text.split(START, 1)
    after = rest.split(END, 1)[1]
    PAGE.write_text(f"{before}{START}\n{table()}\n{END}{after}")


if __name__ == "__main__":
    main()
