"""The runs the algorithm tables read: each method's time and accuracy against BPTT's.

The README's algorithms table and the table of ``docs/online_rules.md`` show the same
measurements, so a method reads the same on both: its time per step over BPTT's on the
``snn`` model of the benchmarks, on the CPU and on the TPU (:data:`TIME_RUNS`), and its test
accuracy with the ALIF network of ``benchmarks/tasks.py`` (:data:`TASK_RUNS`). A cell comes
from the first run of its list that measured the method, against BPTT in that same run; a
run not made yet (its file absent) is skipped, and a cell that no run measured reads ``—``.
A new run under one of these names shows on the next ``python benchmarks/render_tables.py``;
a run under another name is one more entry of its list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

from _table_format import Results, lengths, machine

TIME_MODEL = "snn"
"""The throughput benchmark's model whose times the tables show."""
TIME_RUNS = {"CPU": ("throughput_spiking_rules.json", "throughput.json"),
             "TPU": ("throughput_spiking_rules_tpu.json", "throughput_tpu_host.json",
                     "throughput_tpu.json")}
"""Per backend, the throughput runs a time cell reads, first come first served (a run of
several lengths at its longest). The run that times every rule of ``docs/online_rules.md``
comes first, so that the rules are compared within one run."""
TASK_MODEL = "alif"
"""The model of ``tasks.json`` whose accuracies the tables show."""
TASK_RUNS = ("tasks_spiking_rules.json", "tasks.json")
"""The tasks runs an accuracy cell reads, first come first served: the run of every spiking rule
next to BPTT, D-RTRL, ES-D-RTRL and e-prop (3 seeds) first."""


class Timing(NamedTuple):
    """One throughput run: its methods on :data:`TIME_MODEL`, the key of their time over
    BPTT's, where it ran (length, machine), what it timed and the run's configuration."""

    name: str
    methods: dict[str, Any]
    key: str
    where: str
    how: str
    config: dict[str, Any]


def timings(results: Results, backend: str) -> list[Timing]:
    """The present runs of ``TIME_RUNS[backend]`` at their longest length, each timed by
    ``online_grad`` in a jitted step where it measured that, else by ``etrace_grad``."""
    found = []
    for name in results.present(TIME_RUNS[backend]):
        run = results(name)
        _, length, entry = max((r for r in lengths(run) if r[0] == TIME_MODEL),
                               key=lambda r: r[1])
        methods = entry["methods"]
        key, how = (("jit_ratio_to_bptt", "`online_grad` in a jitted step")
                    if any("jit_ratio_to_bptt" in e for e in methods.values())
                    else ("ratio_to_bptt", "`etrace_grad`"))
        where = f"T = {length} on {machine(run['environment'])}"
        found.append(Timing(name, methods, key, where, how, run["config"]))
    return found


def time_ratio(runs: Sequence[Timing], method: str | None) -> float | None:
    """``method``'s time over BPTT's in the first of ``runs`` that timed it."""
    for run in runs:
        if method in run.methods:
            return 1.0 if method == "bptt" else run.methods[method][run.key]
    return None


def timed_by(runs: Sequence[Timing]) -> str:
    """What the times of ``runs`` are and which files hold them, e.g. ``T = 200 on a 2-core
    CPU (`etrace_grad`; `throughput.json`, then `throughput_spiking_rules.json`)``."""
    files: dict[tuple[str, str], list[str]] = {}
    for run in runs:
        files.setdefault((run.where, run.how), []).append(f"`{run.name}`")
    return " and ".join(f"{where} ({how}; {', then '.join(names)})"
                        for (where, how), names in files.items())


class TaskRun(NamedTuple):
    """One tasks run's rows of :data:`TASK_MODEL` on one task, by method."""

    name: str
    rows: dict[str, Any]
    seeds: int


def task_runs(results: Results, task: str) -> list[TaskRun]:
    """The present runs of :data:`TASK_RUNS` that trained :data:`TASK_MODEL` on ``task``."""
    found = []
    for name in results.present(TASK_RUNS):
        run = results(name)
        rows = run["results"].get(task, {}).get(TASK_MODEL)
        if rows:
            found.append(TaskRun(name, rows, run["config"]["seeds"]))
    return found


def accuracy(runs: Sequence[TaskRun], method: str | None) -> tuple[dict, dict | None] | None:
    """``method``'s row in the first of ``runs`` that measured it, and that run's BPTT row."""
    for run in runs:
        row = run.rows.get(method, {})
        if "test_accuracy_mean" in row:
            return row, run.rows.get("bptt")
    return None
