"""What ``python -m braintrace`` reports: one result per method and length, the printed
table, its footnote and closing sentence, and the plot (``braintrace/__main__.py`` runs the
job)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["HEADER", "Result", "footnote", "format_row", "plot", "summary"]


class Result(NamedTuple):
    """One method at one length.

    Attributes:
        length: The sequence length ``T``.
        method: The algorithm's name.
        chunk: Time steps of one call of the train step (BPTT: ``T``).
        memory: Bytes of every buffer of one compiled call of the train step.
        data: Bytes of one call's data (inputs, labels and mask).
        compile_s: Seconds to lower and compile the train step.
        step_s: Median seconds of one training step (one batch, every call, one
            update) after compilation (``None``: not trained, over the memory budget).
        accuracy: Test accuracy (``None``: not trained).
        loss: Test loss (``None``: not trained).
    """

    length: int
    method: str
    chunk: int
    memory: int
    data: int
    compile_s: float
    step_s: float | None = None
    accuracy: float | None = None
    loss: float | None = None



def _format_bytes(n: float) -> str:
    """``n`` bytes in B, KiB, MiB or GiB."""
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


HEADER = (f"{'T':>6}  {'method':<10}{'test acc':>9}{'test loss':>11}{'chunk':>7}{'memory':>10}"
          f"{'data':>11}{'time/step':>11}{'compile':>8}")


def format_row(r: Result) -> str:
    """One line of the table (``-`` where the method was not trained)."""
    trained = r.step_s is not None
    acc = f"{r.accuracy:.3f}" if trained else "-"
    loss = f"{r.loss:.3f}" if trained else "-"
    step = f"{r.step_s * 1e3:.1f} ms" if trained else "-"
    row = (f"{r.length:>6}  {r.method:<10}{acc:>9}{loss:>11}{r.chunk:>7}"
           f"{_format_bytes(r.memory):>10}{_format_bytes(r.data):>11}{step:>11}"
           f"{r.compile_s:>6.1f} s")
    return row if trained else row + "  (over budget)"


def footnote(results: Sequence[Result]) -> str:
    """What the columns mean: chunk, memory, data and time per step."""
    online = next(r for r in results if r.method != "bptt")
    return (f"chunk: time steps per call of the train step ({online.method}: the batch in "
            "chunks, its state carried from call to call, one Adam update per batch from the "
            "chunks' summed gradients; bptt: the whole sequence); memory: every buffer of one "
            f"compiled call, data: its inputs, labels and mask (both per chunk for "
            f"{online.method}); time/step: one batch (all its calls, one update), after "
            "compilation")


def summary(results: Sequence[Result], budget_mib: float) -> str:
    """The closing sentence: what the numbers mean."""
    online = [r for r in results if r.method != "bptt"]
    bptt = [r for r in results if r.method == "bptt"]
    first, last = online[0], online[-1]
    over = [r.length for r in bptt if r.step_s is None]
    where = f"at T={over[0]}" if len(over) == 1 else f"from T={over[0]} on" if over else ""
    fits = (f"beyond the {budget_mib:g} MiB budget {where}, where it was not trained" if over
            else f"within the {budget_mib:g} MiB budget at every length")
    memory = {r.memory for r in online}
    takes = (f"takes {_format_bytes(first.memory)} per call at every length" if len(memory) == 1
             else f"takes from {_format_bytes(min(memory))} to {_format_bytes(max(memory))} per "
                  "call")
    return (f"From T={first.length} to T={last.length}, {first.method}'s train step, called "
            f"once per chunk of at most {last.chunk} steps, {takes}, while BPTT's, called once "
            "on the whole sequence and keeping every step for the backward pass, grows from "
            f"{_format_bytes(bptt[0].memory)} to {_format_bytes(bptt[-1].memory)}, {fits}; "
            "both make one update per batch, the time of a training step grows with T for "
            "both, and compilation is paid once per length and method.")


def plot(results: Sequence[Result], budget_mib: float, path: str) -> None:
    """Writes memory and time per step against T, both methods, log-log, as a PNG."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullFormatter

    figure = Figure(figsize=(9, 3.6), layout="constrained")
    memory_ax, time_ax = figure.subplots(1, 2)
    for method in dict.fromkeys(r.method for r in results):
        rows = [r for r in results if r.method == method]
        label = method if method == "bptt" else f"{method}, per chunk of {rows[-1].chunk}"
        line, = memory_ax.plot([r.length for r in rows], [r.memory / 2**20 for r in rows],
                               "o-", label=label)
        trained = [r for r in rows if r.step_s is not None]
        time_ax.plot([r.length for r in trained], [r.step_s * 1e3 for r in trained], "o-",
                     color=line.get_color(), label=method)
        skipped = [r for r in rows if r.step_s is None]
        if skipped:
            memory_ax.plot([r.length for r in skipped], [r.memory / 2**20 for r in skipped],
                           "o", markerfacecolor="white", color=line.get_color(),
                           label=f"{method}: over budget, not trained")
    data = {r.length: r.data / 2**20 for r in results if r.method == "bptt"}
    memory_ax.plot(list(data), list(data.values()), ":", color="gray",
                   label="one batch's data (whole)")
    memory_ax.axhline(budget_mib, color="gray", linestyle="--", label="memory budget")
    memory_ax.set(xscale="log", yscale="log", xlabel="sequence length T",
                  ylabel="memory of one train-step call (MiB)", title="memory")
    time_ax.set(xscale="log", yscale="log", xlabel="sequence length T",
                ylabel="time per training step (ms)", title="time per batch (compiled)")
    lengths = sorted({r.length for r in results})
    for ax in (memory_ax, time_ax):
        ax.set_xticks(lengths, labels=[f"{t:,}" for t in lengths])
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.legend(fontsize="small", loc="upper left")
        ax.grid(True, which="both", alpha=0.3)
    figure.savefig(path, dpi=120)
