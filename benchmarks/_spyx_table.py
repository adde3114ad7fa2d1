"""The table of ``spyx_compare.py``: our BPTT and online rules beside spyx 1.0.0's BPTT."""

from __future__ import annotations

from typing import Any

from _table_format import Results, captioned, micro, ratio, size, source, table

NAME = "spyx_compare.json"


def _cells(entry: dict[str, Any]) -> tuple[str, str]:
    """``time (× spyx's wall / CPU)``, ``temporaries (× spyx's)`` of one method at one length."""
    time = (f"{micro(entry['step_us_median'])} ({ratio(entry['time_ratio_to_spyx'])} / "
            f"{ratio(entry['cpu_ratio_to_spyx'])})")
    return time, f"{size(entry['xla']['temp'])} ({ratio(entry['temp_ratio_to_spyx'])})"


def spyx_compare(results: Results) -> str:
    """Time per step and XLA temporaries of each train step, over spyx's, at each length."""
    run = results(NAME)
    config = run["config"]
    lengths = list(run["results"])
    methods = list(dict.fromkeys(m for entries in run["results"].values() for m in entries))
    rows = [(f"`{m}`", *(c for t in lengths for c in _cells(run["results"][t][m])))
            for m in methods]
    header = [f"{what}, T = {int(t.removeprefix('T=')):,}" for t in lengths
              for what in ("time per step", "XLA temporaries")]
    return captioned(
        f"{source(results, NAME)}, spyx {run['spyx']}: {config['inputs']} inputs, "
        f"{config['hidden']} LIF neurons, {config['outputs']} outputs, batch "
        f"{config['batch']}; a train step (gradient, Adam update), medians of {run['repeats']} "
        "round-robin rounds: time per step (over spyx's: wall / CPU time), XLA temporaries.",
        *table(("method", *header), rows))
