"""The README's generated blocks: the main job's output and the algorithms table.

The main job's blocks quote ``results/main_job.json`` (written by ``readme_main_job.py``).
The algorithms table has one row per entry of :data:`ALGORITHMS`: what it is and when it is
exact are written here; its time and accuracy ratios come from ``throughput.json``,
``throughput_tpu.json`` and ``tasks.json``. A new algorithm is one line of
:data:`ALGORITHMS`, then ``python benchmarks/render_tables.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from _table_format import MISSING, Results, captioned, machine, ratio, seconds, table, wrap


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
              "elementwise (leaky, LIF/ALIF, minGRU, one LRU)", "`O(B·\\|θ\\|·S)`"),
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
    Algorithm("bptt", "`BPTT()`, `'bptt'`", "always (the reference)", "`O(T·B·N)`: grows with T"),
)
TIME_MODEL = "snn"
"""The throughput benchmark's model whose times the README's table shows."""
LEARNING = ("spiking_digits", "alif")
"""The task and model of ``tasks.json`` whose accuracies the README's table shows."""


def _timing(results: Results, name: str) -> tuple[str, str]:
    """The key of the online methods' time over BPTT's in ``name``, and what it times:
    ``online_grad`` in a jitted step where the run measured it, else ``etrace_grad``."""
    methods = results(name)["results"][TIME_MODEL]["methods"]
    if any("jit_ratio_to_bptt" in e for e in methods.values()):
        return "jit_ratio_to_bptt", "`online_grad` in a jitted step"
    return "ratio_to_bptt", "`etrace_grad`"


def algorithms(results: Results) -> str:
    times = []
    for name in ("throughput.json", "throughput_tpu.json"):
        key, how = _timing(results, name)
        run = results(name)
        times.append((run["results"][TIME_MODEL]["methods"], key,
                      f"T = {run['config']['T']} on {machine(run['environment'])} ({how})"))
    task, model = LEARNING
    rows_of_task = results("tasks.json")["results"][task][model]
    reference = rows_of_task["bptt"]["test_accuracy_mean"]

    def time_cell(methods: dict[str, Any], key: str, method: str | None) -> str:
        if method == "bptt":
            return ratio(1.0)
        entry = methods.get(method) if method else None
        return ratio(entry[key]) if entry else MISSING

    rows = []
    for a in ALGORITHMS:
        time_key, task_key = a.keys()
        row = rows_of_task.get(task_key, {}) if task_key else {}
        learn = (ratio(row["test_accuracy_mean"] / reference) if "test_accuracy_mean" in row
                 else MISSING)
        rows.append((a.label, a.exact, a.memory,
                     *(time_cell(methods, key, time_key) for methods, key, _ in times), learn))
    config = results("throughput.json")["config"]
    caption = (
        f"Time and accuracy as ratios to BPTT's ({MISSING}: not measured). Time: the "
        f"`{TIME_MODEL}` model of the benchmarks (hidden {config['hidden']}, batch "
        f"{config['batch']}), {' and '.join(what for _, _, what in times)}. Accuracy: "
        f"{task.replace('_', ' ')}, the `{model}` network (hidden "
        f"{rows_of_task['bptt']['hidden']}), test accuracy over BPTT's {reference:.3f}. `B` "
        "batch, `|θ|` weights, `S` states per neuron, `I`/`O` a layer's inputs/outputs, `N` "
        "hidden units.")
    return captioned(caption, *table(("algorithm", "exact (= BPTT) when", "trace memory",
                                      "time, CPU", "time, TPU", "accuracy"), rows))


