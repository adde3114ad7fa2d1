"""The table of ``shd_compare.py``: SHD-format data, our BPTT and online rules beside spyx's."""

from __future__ import annotations

from typing import Any

from _table_format import Results, captioned, micro, ratio, seconds, size, source, table

NAME = "shd_compare.json"


def _row(method: str, e: dict[str, Any]) -> tuple[str, ...]:
    return (f"`{method}`",
            (f"{micro(e['step_us_median'])} ({ratio(e['time_ratio_to_spyx'])} / "
            f"{ratio(e['cpu_ratio_to_spyx'])})"),
            f"{size(e['xla']['temp'])} ({ratio(e['temp_ratio_to_spyx'])})",
            f"{e['test_accuracy']:.3f}", seconds(e["train_s"]))


def shd_compare(results: Results) -> str:
    """Time per step, XLA temporaries and test accuracy of each method on SHD-format data."""
    run = results(NAME)
    c = run["config"]
    return captioned(
        f"{source(results, NAME)}, spyx {run['spyx']}: a generated SHD-format data set "
        f"({c['train']} training and {c['test']} test samples, 20 classes) binned into "
        f"T = {c['num_steps']} steps over {c['max_time']} s on {c['inputs']} channels with "
        f"(T, B) padding masks; {c['hidden']} LIF neurons, a leaky readout, batch {c['batch']}, "
        f"the same initial weights and batches. Time per step of a train step (gradient, Adam "
        f"update; medians of {run['repeats']} round-robin rounds, over spyx's: wall / CPU time), "
        f"XLA temporaries of the compiled step, test accuracy after {c['steps']} updates at rate "
        f"{c['learning_rate']:g} and the time they took.",
        *table(("method", "time per step", "XLA temporaries", "test accuracy", "training"),
               [_row(m, e) for m, e in run["results"].items()]))
