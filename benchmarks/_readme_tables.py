"""The README's generated blocks: the main job's output and the algorithms table.

The main job's blocks quote ``results/main_job.json`` (written by ``readme_main_job.py``).
The algorithms table has one row per entry of :data:`ALGORITHMS`: what it is and when it is
exact are written here; its time and accuracy ratios come from the runs of ``_rule_runs.py``
(``throughput.json``, the TPU runs, ``tasks.json`` and the spiking rules' runs). A
new algorithm is one line of :data:`ALGORITHMS`, then ``python benchmarks/render_tables.py``.
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
from _table_format import (
    MISSING,
    Results,
    captioned,
    lengths,
    machine,
    ratio,
    seconds,
    table,
    wrap,
)


def main_job_parts(output: str) -> tuple[list[str], list[str], list[str]]:
    """The table (header and rows), the footnote with the plot line, the closing sentence."""
    lines = output.strip("\n").splitlines()
    plot = next(i for i, line in enumerate(lines) if line.startswith("plot: "))
    notes = next(i for i, line in enumerate(lines) if line.startswith("chance accuracy"))
    return lines[:notes], lines[notes:plot + 1], lines[plot + 1:]


def _main_run(results: Results, run: str) -> dict[str, Any]:
    return results("main_job.json")["runs"][run]


def payoff(results: Results) -> str:
    """The README's one sentence: online memory against BPTT's at the longest sequence."""
    table_lines, _, _ = main_job_parts(_main_run(results, "full")["output"])
    rows = [line.split() for line in table_lines[1:]]
    online = [r for r in rows if r[1] != "bptt"]
    bptt = [r for r in rows if r[1] == "bptt"]

    def memory(row: list[str]) -> str:  # T, method, accuracy, loss, chunk, memory (two words)
        return " ".join(row[5:7])

    if len({memory(r) for r in online}) != 1:
        raise ValueError("main_job.json: the online train step's memory is not the same at "
                         "every length; the README's sentence says it is")
    return wrap(f"In the main job below, the online train step takes **{memory(online[-1])}** "
                f"per call at every sequence length up to T = {int(online[-1][0]):,}; BPTT's "
                f"takes **{memory(bptt[-1])}** at T = {int(bptt[-1][0]):,}.")


def main_job(results: Results) -> str:
    run = results("main_job.json")
    full = run["runs"]["full"]
    table_lines, _, closing = main_job_parts(full["output"])
    return captioned(
        f"On {machine(run['environment'])} it took {seconds(full['wall_s'])} and printed "
        "(`benchmarks/results/main_job.json`; `python -m braintrace --help` says what each "
        "column is):",
        "```", *table_lines, *closing, "```")


def main_job_run(results: Results, run: str, command: str) -> str:
    record = _main_run(results, run)
    env = results("main_job.json")["environment"]
    return captioned(f"`{command}` on {machine(env)}, {seconds(record['wall_s'])} "
                     f"({seconds(record['cpu_s'])} of CPU time):",
                     "```", record["output"].strip("\n"), "```")


class Algorithm(NamedTuple):
    """One row of the README's algorithms table.

    ``key`` names it in ``throughput*.json`` and ``tasks.json``; ``time_key`` /
    ``task_key`` where the two name it differently (``None``: not measured there).
    """

    key: str
    label: str
    exact: str
    memory: str
    time_key: str | None = ""
    task_key: str | None = ""

    def keys(self) -> tuple[str | None, str | None]:
        return (self.key if self.time_key == "" else self.time_key,
                self.key if self.task_key == "" else self.task_key)


ALGORITHMS = (
    Algorithm("d_rtrl", "`DRTRL()`, `'d_rtrl'`",
              "the recurrence is position-diagonal and each weight reaches its state "
              "elementwise (leaky, LIF/ALIF/IF/CuBaLIF, minGRU, one LRU)", "`O(B·\\|θ\\|·S)`"),
    Algorithm("es_d_rtrl", "`ESDRTRL()`, `'es_d_rtrl'`",
              "`T = 1` only (a smoothed factorisation of D-RTRL's traces)", "`O(B·(I + O·S))`"),
    Algorithm("windowed", "`DRTRL()` with `chunk_size=16`",
              "inside each window of 16 steps (exact reverse mode there)", "+ one window",
              time_key=None, task_key="d_rtrl@16"),
    Algorithm("eprop", "`EProp(kappa)`, `'eprop'`",
              "`kappa = 0` with symmetric feedback (it is then D-RTRL)", "2 × D-RTRL"),
    Algorithm("ostl_recurrent", "`OSTLRecurrent()`", "as D-RTRL, in the coupled scope",
              "as D-RTRL"),
    Algorithm("ostl_feedforward", "`OSTLFeedforward()`", "`T = 1` only", "as ES-D-RTRL"),
    Algorithm("rtrl", "`RTRL()`, `'rtrl'`",
              "every trainable operation is an ETP op (recurrent kernels included)",
              "`O(B·\\|θ\\|·N)`"),
    Algorithm("snap", "`SnAp(n)`, `'snap'`",
              "`n` at least the model's saturation (then it is RTRL)", "RTRL's, masked"),
    Algorithm("uoro", "`UORO()`, `'uoro'`", "never: unbiased, one random draw",
              "`O(B·(N + \\|θ\\|))`"),
    Algorithm("three_factor", "`ThreeFactor()`",
              "a modulated rule; D-RTRL when the modulator is `∂L_t/∂h^t`", "as D-RTRL"),
    Algorithm("dni", "`DNI(synthesizer)`", "with a perfect synthesiser",
              "the base's + the synthesiser"),
    Algorithm("ottt", "`OTTT(decay)`, `'ottt'`",
              "the neurons leak by `decay` and reset without derivative, one layer under a "
              "readout without memory", "`O(B·I)`"),
    Algorithm("sltt", "`SLTT()`, `'sltt'`", "no state carries credit from step to step",
              "none"),
    Algorithm("otpe", "`OTPE(decay)`, `'otpe'`",
              "one LIF/ALIF layer read by `LeakyReadout`s of leak `decay` (memoryless "
              "readouts beside them)",
              "D-RTRL's + `O(B·\\|θ\\|)` per reader"),
    Algorithm("osttp", "`OSTTP()`, `'osttp'`",
              "no ETP operation reads a layer's new state (it is then OSTL)",
              "as D-RTRL + the projections"),
    Algorithm("fptt", "`FPTT()`, `'fptt'`",
              "as SLTT: its gradient is each step's own (`fptt_regularizer` in the optimiser)",
              "none"),
    Algorithm("bptt", "`BPTT()`, `'bptt'`", "always (the reference)", "`O(T·B·N)`: grows with T"),
)
LEARNING = "spiking_digits"
"""The task of ``tasks.json`` whose accuracies (of ``_rule_runs.TASK_MODEL``) the table shows."""
MODELS = {"snn": "two recurrent LIF layers and a leaky readout",
          "gru": "a GRU", "alif": "`snn` with ALIF neurons",
          "demo": "the main job's one ALIF layer"}
"""The throughput benchmark's models (``_models.py``), as the caption names them."""
OTHER_MODELS_RUN = "throughput.json"
"""The CPU run whose other models' D-RTRL and ES-D-RTRL times the caption quotes."""


def other_models(results: Results) -> str:
    """How the time depends on the model: D-RTRL's and ES-D-RTRL's ratios to BPTT on the other
    models of :data:`OTHER_MODELS_RUN` (empty without that run)."""
    if OTHER_MODELS_RUN not in results.present((OTHER_MODELS_RUN,)):
        return ""
    parts = [f"{ratio(e['methods']['d_rtrl']['ratio_to_bptt'])} and "
             f"{ratio(e['methods']['es_d_rtrl']['ratio_to_bptt'])} on `{model}` "
             f"({MODELS[model]})"
             for model, _, e in lengths(results(OTHER_MODELS_RUN))
             if model != TIME_MODEL and model in MODELS]
    return (f" They depend on the model: in `{OTHER_MODELS_RUN}` D-RTRL and ES-D-RTRL take "
            + "; ".join(parts) + ".") if parts else ""


def algorithms(results: Results) -> str:
    times = {backend: timings(results, backend) for backend in TIME_RUNS}
    runs = task_runs(results, LEARNING)

    def learn(method: str | None) -> str:
        found = accuracy(runs, method) if method else None
        if found is None or found[1] is None:
            return MISSING
        row, bptt = found
        return ratio(row["test_accuracy_mean"] / bptt["test_accuracy_mean"])

    rows = []
    for a in ALGORITHMS:
        time_key, task_key = a.keys()
        rows.append((a.label, a.exact, a.memory,
                     *(ratio(time_ratio(times[b], time_key)) for b in TIME_RUNS),
                     learn(task_key)))
    config = times["CPU"][0].config
    references = ", ".join(f"{run.rows['bptt']['test_accuracy_mean']:.3f} in `{run.name}`"
                           for run in runs if "bptt" in run.rows)
    caption = (
        f"Time and accuracy as ratios to BPTT's in the same run ({MISSING}: not measured). "
        f"Time: measured on one model, the benchmarks' `{TIME_MODEL}` ({MODELS[TIME_MODEL]}, "
        f"hidden {config['hidden']}, batch {config['batch']}), "
        f"{' and '.join(timed_by(times[b]) for b in TIME_RUNS)}.{other_models(results)} "
        f"Accuracy: {LEARNING.replace('_', ' ')}, the `{TASK_MODEL}` network (hidden "
        f"{runs[0].rows['bptt']['hidden']}), test accuracy over BPTT's ({references}). `B` "
        "batch, `|θ|` weights, `S` states per neuron, `I`/`O` a layer's inputs/outputs, `N` "
        "hidden units.")
    return captioned(caption, *table(("algorithm", "exact (= BPTT) when", "trace memory",
                                      *(f"time, {b}" for b in TIME_RUNS), "accuracy"), rows))
