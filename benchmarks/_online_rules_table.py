"""The table of ``docs/online_rules.md`` ("Choosing an online rule"): one row per rule.

What each rule keeps, its memory and when it is exact are written here (:data:`RULES`);
its time per step over BPTT's (CPU, TPU) and its accuracy on the two tasks of the ALIF
network come from the runs of ``_rule_runs.py``, as in the README's algorithms table, so a
rule reads the same on both. A cell that no run measured reads ``—``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from _rule_runs import (
    TASK_MODEL,
    TIME_MODEL,
    TIME_RUNS,
    accuracy,
    task_runs,
    time_ratio,
    timed_by,
    timings,
)
from _table_format import MISSING, Results, captioned, ratio, table, wrap


class Rule(NamedTuple):
    """One row: the rule, its name (for ``compile`` and in the JSONs), and the columns no
    run measures."""

    label: str
    method: str
    keeps: str
    memory: str
    exact: str


RULES = (
    Rule("BPTT", "bptt", "the whole gradient", "grows with `T`", "always"),
    Rule("D-RTRL", "d_rtrl", "each weight's exact influence on its own neurons", "`B·P·S`",
         "recurrence neuron by neuron, no state with memory reading the layer"),
    Rule("ES-D-RTRL", "es_d_rtrl", "smoothed input and output factors of that influence",
         "`B·(I + O·S)`", "`T = 1`"),
    Rule("e-prop", "eprop", "D-RTRL's traces, low-pass filtered by `kappa` (0.9 in the tasks)",
         "`2·B·P·S`", "`kappa = 0` (D-RTRL)"),
    Rule("OTTT", "ottt", "a presynaptic trace decayed by `λ`, times each step's spatial "
         "gradient", "`B·I`", "leak `λ`, reset without derivative, one layer, memoryless "
         "readout"),
    Rule("SLTT", "sltt", "each step's spatial gradient", "none",
         "no state carries credit across steps"),
    Rule("OTPE", "otpe", "D-RTRL's traces and a leaky estimate of their effect on the "
         "reading neurons", "`B·P·(S + readers)`", "one layer read by leaky readouts of leak `λ` "
         "(memoryless paths beside them)"),
    Rule("OSTTP", "osttp", "D-RTRL's traces in each layer; a hidden layer learns from a fixed "
         "random projection of the target", "`B·P·S` + the projections",
         "no ETP operation reads a layer's new state (then it is OSTL)"),
    Rule("FPTT", "fptt", "each step's own gradient; `fptt_regularizer` pulls the Params "
         "towards their running average", "none (the regulariser: `2·P`)",
         "as SLTT: its gradient is SLTT's"),
)
"""One row per rule, in the page's order."""

TASKS = {"spiking_digits": "spiking digits", "mnist1d": "MNIST-1D"}
"""The tasks of the accuracy columns, by their key in the tasks runs."""


def online_rules(results: Results) -> str:
    times = {backend: timings(results, backend) for backend in TIME_RUNS}
    runs = {task: task_runs(results, task) for task in TASKS}

    def score(task: str, method: str) -> str:
        found = accuracy(runs[task], method)
        if found is None:
            return MISSING
        row = found[0]
        return f"{row['test_accuracy_mean']:.3f} ± {row['test_accuracy_std']:.3f}"

    rows = [(f"{r.label} (`'{r.method}'`)", r.keeps, r.memory,
             *(ratio(time_ratio(times[b], r.method)) for b in TIME_RUNS),
             *(score(task, r.method) for task in TASKS), r.exact) for r in RULES]
    config = times["CPU"][0].config
    timed = "; ".join(f"{b}: {timed_by(times[b]) or 'not measured yet'}" for b in TIME_RUNS)
    seeds = dict.fromkeys(f"{run.seeds} seeds in `{run.name}`"
                          for task_runs_of in runs.values() for run in task_runs_of)
    scored = ", ".join(seeds) or "not measured yet"
    caption = (
        f"Time per step over BPTT's in the same run of `benchmarks/throughput.py`, its "
        f"`{TIME_MODEL}` model (two recurrent LIF layers and a leaky readout; hidden "
        f"{config['hidden']}, input {config['inputs']}, batch {config['batch']}); {timed}. "
        f"Accuracy: `benchmarks/tasks.py`'s test accuracy of the `{TASK_MODEL}` network (a "
        f"recurrent ALIF layer and a leaky readout), mean ± std over the seeds ({scored}). "
        f"{MISSING}: not measured. `B` is the batch, `P` an operation's weights, `I` and `O` "
        "its inputs and outputs, `S` the states per neuron, `λ` the rule's decay.")
    lines = table(
        ("rule", "keeps", "memory per operation", *(f"time, {b}" for b in TIME_RUNS),
         *(f"accuracy, {label}" for label in TASKS.values()), "exact (= BPTT) when"), rows)
    return captioned(caption, *lines, "", wrap(published_ordering(runs)))


PUBLISHED_ORDER = ("ottt", "otpe", "bptt")
"""The ordering the OTPE paper reports on SHD (OTTT 70.5 ≤ OTPE 75.2 ≤ BPTT 78.1)."""


def published_ordering(runs: dict[str, Any]) -> str:
    """Whether the mean test accuracies follow :data:`PUBLISHED_ORDER` on each task, said from
    the runs (one sentence; the tasks without all three rules are not named)."""
    verdicts = []
    for task, label in TASKS.items():
        means = [accuracy(runs[task], m) for m in PUBLISHED_ORDER]
        if any(m is None for m in means):
            continue
        values = [m[0]["test_accuracy_mean"] for m in means]
        holds = all(a <= b for a, b in zip(values, values[1:]))
        verdicts.append(f"{'holds' if holds else 'does not hold'} on {label}")
    if not verdicts:
        return "The published ordering OTTT ≤ OTPE ≤ BPTT is not measured yet."
    return ("The published ordering OTTT ≤ OTPE ≤ BPTT (Summe et al., on SHD) of the mean test "
            f"accuracies {' and '.join(verdicts)}.")
