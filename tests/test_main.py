"""``python -m braintrace``: the command-line demonstration."""

import re
import subprocess
import sys

import pytest

from braintrace.__main__ import FULL, QUICK, parse_args

ROW = re.compile(r"^(\w+)\s+([01]\.\d{3})\s+(\d+\.\d{3})\s+([\d.]+ (?:B|KiB|MiB|GiB))\s+"
                 r"([\d.]+)s$")


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def test_quick_run_prints_online_and_bptt_results_with_memory():
    result = subprocess.run([sys.executable, "-m", "braintrace", "--quick", "--seed", "1"],
                            capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith("braintrace ") and "online learning vs BPTT" in lines[0]
    assert f"T={QUICK['seq_len']}" in lines[1]
    assert f"{QUICK['hidden']} neurons" in lines[2] and "seed 1" in lines[2]
    header = lines.index(next(line for line in lines if line.startswith("method")))
    rows = {m.group(1): m.groups()[1:] for m in map(ROW.match, lines[header + 1:]) if m}
    assert set(rows) == {"es_d_rtrl", "bptt"}, result.stdout
    for accuracy, loss, memory, seconds in rows.values():
        assert 0.0 <= float(accuracy) <= 1.0
        assert float(loss) > 0.0 and _bytes(memory) > 0 and float(seconds) > 0
    assert "%|" not in result.stdout  # tqdm progress bars go to stderr
    assert re.search(r"es_d_rtrl: +\d+%\|", result.stderr)
    assert re.search(r"bptt: +\d+%\|", result.stderr)


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--algorithm", "--seq-len", "--hidden", "--steps", "--seed", "--quick",
                   "es_d_rtrl", "d_rtrl"):
        assert option in text


def test_options_default_to_full_or_quick_sizes_and_explicit_values_win():
    assert {k: getattr(parse_args([]), k) for k in FULL} == FULL
    quick = parse_args(["--quick", "--hidden", "5"])
    assert {k: getattr(quick, k) for k in QUICK} == {**QUICK, "hidden": 5}
    assert parse_args(["--algorithm", "d_rtrl"]).algorithm == "d_rtrl"


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "bptt"], "invalid choice: 'bptt'"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--seq-len", "5"], "--seq-len must be at least 12"),
])
def test_bad_options_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
