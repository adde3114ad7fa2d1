"""``python -m braintrace``: the main job, at tiny sizes, against the README's quoted output."""

import pathlib
import re

import pytest

from braintrace.__main__ import FULL, QUICK, main, parse_args

ROOT = pathlib.Path(__file__).resolve().parents[1]
SIZE = r"[\d.]+ (?:B|KiB|MiB|GiB)"
ROW = re.compile(rf"^ *(\d+)  (\w+) +(?:([01]\.\d{{3}}) +(\d+\.\d{{3}})|- +-) +({SIZE}) +"
                 rf"({SIZE}) +(?:([\d.]+) ms|-) +([\d.]+) s(  \(over budget\))?$")
CLOSING = re.compile(
    rf"^From T=\d+ to T=\d+, (\w+)'s train step grows from {SIZE} to {SIZE}, in step with the "
    rf"batch's data \({SIZE} to {SIZE}\), while BPTT's, which keeps every step for the "
    rf"backward pass, grows from {SIZE} to {SIZE}, (?:beyond the [\d.]+ MiB budget "
    r"(?:at T=\d+|from T=\d+ on), where it was not trained|within the [\d.]+ MiB budget at "
    r"every length); the time of a step grows with T for both, and compilation is paid once per "
    r"length and method\.$")
# hidden 32 against 20 inputs and a batch of 2: BPTT's stored steps outgrow the batch's data
TINY = ["--quick", "--hidden", "32", "--batch-size", "2", "--steps", "2", "--lengths", "16,320",
        "--memory-budget", "0.4"]


def _bytes(text: str) -> float:
    value, unit = text.split()
    return float(value) * {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}[unit]


def _readme_block() -> list[str]:
    """The main job's output as the README's "Two commands" section quotes it."""
    text = (ROOT / "README.md").read_text()
    section = text.split("\n## Two commands\n", 1)[1].split("\n## ", 1)[0]
    blocks = re.findall(r"^```(\w*)\n(.*?)^```$", section, re.DOTALL | re.MULTILINE)
    return next(body for lang, body in blocks if not lang and "method" in body).splitlines()


def _table(lines: list[str]) -> tuple[str, list[re.Match], list[str]]:
    """The header, the rows and the lines after the table."""
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("T  method"))
    rows = []
    for line in lines[start + 1:]:
        match = ROW.match(line)
        if not match:
            break
        rows.append(match)
    return lines[start], rows, lines[start + 1 + len(rows):]


def test_readme_quotes_a_full_run():
    header, rows, after = _table(_readme_block())
    lengths = [int(r.group(1)) for r in rows]
    assert sorted(set(lengths)) == list(FULL["lengths"])
    assert [r.group(2) for r in rows] == ["es_d_rtrl", "bptt"] * len(FULL["lengths"])
    assert rows[-1].group(9) and not any(r.group(9) for r in rows[:-1])  # BPTT skipped at 10k
    budget = FULL["memory_budget"] * 2**20  # parts BPTT from online at the longest length
    assert _bytes(rows[-2].group(5)) < budget < _bytes(rows[-1].group(5))
    assert after[0].startswith("chance accuracy 0.100; memory:")
    assert after[1] == "plot: braintrace_main.png"
    assert CLOSING.match(" ".join(after[2:])), after[2:]
    assert all(len(line) <= 100 for line in [header, *(r.group(0) for r in rows), *after])


def test_quick_run_prints_the_readme_table_and_writes_the_plot(tmp_path, capsys):
    plot = tmp_path / "main.png"
    main([*TINY, "--seed", "1", "--plot", str(plot)])
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("braintrace ") and "online learning (es_d_rtrl) vs BPTT" in lines[0]
    assert "T = 16, 320" in lines[1] and "32 neurons" in lines[2] and "seed 1" in lines[2]
    header, rows, after = _table(lines)
    readme_header, readme_rows, readme_after = _table(_readme_block())
    assert header == readme_header
    assert [r.group(2) for r in rows] == [r.group(2) for r in readme_rows][:4]
    assert [int(r.group(1)) for r in rows] == [16, 16, 320, 320]
    for row in rows:
        trained = row.group(9) is None
        assert trained == (row.group(2) != "bptt" or _bytes(row.group(5)) <= 0.4 * 2**20)
        if trained:
            assert 0.0 <= float(row.group(3)) <= 1.0 and float(row.group(4)) > 0
            assert float(row.group(7)) > 0
        assert float(row.group(8)) > 0 and _bytes(row.group(6)) > 0
    assert not rows[0].group(9) and rows[3].group(9), captured.out  # BPTT over budget at 320
    assert after[0] == readme_after[0] and after[1] == f"plot: {plot}"
    assert CLOSING.match(" ".join(after[2:])), after[2:]  # the closing sentence, wrapped
    assert all(len(line) <= 100 for line in after)
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "%|" not in captured.out and "T=16 es_d_rtrl" in captured.err  # progress: stderr


def test_help_lists_the_options(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(["--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--algorithm", "--lengths", "--hidden", "--steps", "--batch-size", "--lr",
                   "--seed", "--memory-budget", "--plot", "--quick", "es_d_rtrl", "d_rtrl"):
        assert option in text


def test_options_default_to_full_or_quick_sizes_and_explicit_values_win():
    assert {k: getattr(parse_args([]), k) for k in FULL} == FULL
    quick = parse_args(["--quick", "--hidden", "5", "--lengths", "300,20,300"])
    assert {k: getattr(quick, k) for k in QUICK} == {**QUICK, "hidden": 5, "lengths": (20, 300)}
    assert parse_args(["--algorithm", "d_rtrl"]).algorithm == "d_rtrl"
    assert parse_args([]).plot == "braintrace_main.png"


@pytest.mark.parametrize("argv, message", [
    (["--algorithm", "bptt"], "invalid choice: 'bptt'"),
    (["--steps", "0"], "--steps must be a positive integer"),
    (["--batch-size", "-1"], "--batch-size must be a positive integer"),
    (["--lengths", "100,5"], "every length must be at least 12"),
    (["--lengths", "100,x"], "expected comma-separated integers"),
    (["--memory-budget", "0"], "--memory-budget must be positive"),
])
def test_bad_options_are_refused_with_a_reason(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err
