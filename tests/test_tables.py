"""The pages' numbers are the committed JSONs': every generated table re-renders unchanged.

``benchmarks/render_tables.py`` writes the tables of ``README.md``, ``benchmarks/README.md``
and ``docs/`` from ``benchmarks/results/*.json``. These tests fail while a page differs from
its JSONs, while a result file is shown by no page, while a page quotes a measured number
outside its generated blocks, or while a page grows past its length.
"""

import copy
import importlib.util
import json
import pathlib
import re
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("render_tables",
                                               ROOT / "benchmarks" / "render_tables.py")
render_tables = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(render_tables)
import _accelerator_tables as accelerator  # benchmarks/, put on the path by render_tables
import _readme_tables as readme
import _tables
from _online_rules_table import RULES, online_rules, published_ordering
from _rule_runs import TaskRun
from _table_format import MISSING, RESULTS, Results, ratio
from _tables import BLOCKS

import braintrace

RERUN = "run `python benchmarks/render_tables.py` and commit the pages"
MEASURED = re.compile(r"\d[\d.,]*\s?(?:×|ms\b|µs\b|s\b|KiB|MiB|GiB|MB\b|GB\b|%)")
"""A number with a unit of time, memory, ratio or share: a measurement."""


def _prose(text: str) -> str:
    """``text`` without its generated blocks, fenced code, inline code and HTML comments."""
    text = render_tables.BLOCK.sub("", text)
    text = re.sub(r"^```.*?^```$", "", text, flags=re.MULTILINE | re.DOTALL)
    text = re.sub(r"`[^`\n]*`", "", text)
    return re.sub(r"<!--.*?-->", "", text, flags=re.DOTALL)


def test_every_generated_block_is_what_its_jsons_render_to():
    assert not render_tables.stale(), f"stale tables: {render_tables.stale()}; {RERUN}"


def test_a_changed_number_in_a_json_makes_exactly_its_tables_stale(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    path = results / "throughput_spiking_rules.json"
    run = json.loads(path.read_text())
    run["results"]["snn"]["methods"]["d_rtrl"]["ratio_to_bptt"] *= 2
    path.write_text(json.dumps(run))
    assert render_tables.stale(ROOT, Results(results)) == [
        "README.md: algorithms", "docs/online_rules.md: online_rules"]


def _row(block: str, first_cell: str) -> list[str]:
    """The cells of the table row of ``block`` that starts with ``first_cell``."""
    line = next(line for line in block.splitlines() if line.startswith(f"| {first_cell} |"))
    return [cell.strip() for cell in line.strip("|").split(" | ")]


def test_runs_under_the_listed_names_fill_the_cells_not_measured_yet(tmp_path):
    """A TPU run of the spiking rules and a tasks run of the ALIF network, written under the
    names of ``_rule_runs``, fill the online-rules table's and the README's empty cells: the
    runs made later need no code change."""
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for name in ("throughput_spiking_rules_tpu.json", "tasks_spiking_rules.json"):
        (results / name).unlink()  # as if not run yet
    assert not Results(results).present(["throughput_spiking_rules_tpu.json",
                                         "tasks_spiking_rules.json"])
    before = online_rules(Results(results))
    assert _row(before, "OTTT (`'ottt'`)")[4:7] == [MISSING] * 3
    run = json.loads((results / "throughput_spiking_rules.json").read_text())
    run["environment"] |= {"backend": "tpu", "device_kind": "TPU v5 lite"}
    for entry in run["results"]["snn"]["methods"].values():
        entry["jit_ratio_to_bptt"] = entry["ratio_to_bptt"] / 2
    (results / "throughput_spiking_rules_tpu.json").write_text(json.dumps(run))
    tasks = json.loads((results / "tasks.json").read_text())
    scored = lambda mean: {"test_accuracy_mean": mean, "test_accuracy_std": 0.01, "hidden": 64}
    tasks["config"]["seeds"] = 3
    tasks["results"] = {task: {"alif": {"bptt": scored(0.9), "ottt": scored(0.45)}}
                        for task in ("spiking_digits", "mnist1d")}
    (results / "tasks_spiking_rules.json").write_text(json.dumps(tasks))
    filled = Results(results)
    assert render_tables.stale(ROOT, filled) == ["README.md: algorithms",
                                                 "docs/accelerators.md: trace_dtype_accuracy",
                                                 "docs/online_rules.md: online_rules"]
    after = online_rules(filled)
    ottt = run["results"]["snn"]["methods"]["ottt"]["jit_ratio_to_bptt"]
    assert _row(after, "OTTT (`'ottt'`)")[4:7] == [ratio(ottt), "0.450 ± 0.010",
                                                     "0.450 ± 0.010"]
    # the rules' run comes first: D-RTRL's TPU time is now its; one no run measured stays empty
    d_rtrl = run["results"]["snn"]["methods"]["d_rtrl"]["jit_ratio_to_bptt"]
    assert _row(before, "D-RTRL (`'d_rtrl'`)")[4] not in (ratio(d_rtrl), MISSING)
    assert _row(after, "D-RTRL (`'d_rtrl'`)")[4] == ratio(d_rtrl)
    assert _row(after, "OSTTP (`'osttp'`)")[5] == MISSING
    assert "3 seeds in `tasks_spiking_rules.json`" in " ".join(after.split())
    assert _row(readme.algorithms(filled), "`OTTT(decay)`, `'ottt'`")[-1] == ratio(0.5)


def test_the_published_ordering_is_said_from_the_runs():
    def runs(ottt, otpe, bptt):
        rows = {m: {"test_accuracy_mean": a} for m, a in
                (("ottt", ottt), ("otpe", otpe), ("bptt", bptt))}
        return [TaskRun("tasks_spiking_rules.json", rows, 3)]

    said = published_ordering({"spiking_digits": runs(0.7, 0.75, 0.8),
                                "mnist1d": runs(0.5, 0.4, 0.6)})  # OTTT above OTPE
    assert "holds on spiking digits and does not hold on MNIST-1D" in said


def test_every_rule_of_the_online_rules_table_is_compiled_by_its_name():
    names = [rule.method for rule in RULES]
    assert [braintrace._algorithms.get_algorithm(name).name for name in names] == names
    assert {"ottt", "sltt", "otpe", "osttp", "fptt"} <= set(names)
    assert {"ottt", "sltt", "otpe", "osttp", "fptt"} <= {a.key for a in readme.ALGORITHMS}


def test_every_table_is_on_a_page_and_every_result_file_is_shown():
    results = Results(RESULTS)
    shown = []
    for page in render_tables.pages():
        text = page.read_text()
        render_tables.render(text, results, str(page))
        shown += render_tables.names(text)
    assert set(shown) == set(BLOCKS)
    assert results.read == {p.name for p in RESULTS.glob("*.json")}, (
        "a result file that no table reads: show it on a page, or delete it")
    benchmarks = (ROOT / "benchmarks" / "README.md").read_text()
    plots = {p.name for p in RESULTS.glob("*.png")}
    assert plots == set(re.findall(r"\]\(results/(\w+\.png)\)", benchmarks)), (
        "a plot that benchmarks/README.md does not show, or one it shows that is gone")
    assert {p.name for p in RESULTS.iterdir()} == plots | results.read


@pytest.mark.parametrize("page", ["README.md", "benchmarks/README.md"])
def test_the_page_quotes_no_measured_number_outside_its_tables(page):
    found = MEASURED.findall(_prose((ROOT / page).read_text()))
    assert not found, f"{page} quotes {found} by hand: put them in a generated table"


def test_the_measured_number_check_sees_a_number_by_hand():
    text = "ES-D-RTRL takes 0.75× BPTT's time and 2.5 MiB.\n<!-- generated: x -->\n1.2 ms\n"
    assert MEASURED.findall(_prose(text + "<!-- /generated -->\n")) == ["0.75×", "2.5 MiB"]


@pytest.mark.parametrize("page, most", [("README.md", 250), ("benchmarks/README.md", 400)])
def test_the_page_stays_short(page, most):
    assert len((ROOT / page).read_text().splitlines()) <= most


def test_the_pages_tell_no_story_of_how_the_project_was_built():
    pages = [*render_tables.pages(), *sorted((ROOT / "docs").glob("*/*.md"))]
    told = [f"{page.relative_to(ROOT)}: {m}" for page in pages
            for m in re.findall(r"(?i)\b(?:round|stop) \d", page.read_text())]
    assert not told


def _rows_of(block: str, first_cell: str) -> list[list[str]]:
    """The cells of every table row of ``block`` that starts with ``first_cell``."""
    return [[cell.strip() for cell in line.strip("|").split(" | ")]
            for line in block.splitlines() if line.startswith(f"| {first_cell} |")]


def test_the_million_neuron_run_shows_its_time_and_a_run_that_did_not_finish_none(tmp_path):
    block = BLOCKS["scale_tpu"](Results(RESULTS))
    run = json.loads((RESULTS / "scale_tpu_1m_t300.json").read_text())
    record = run["results"][0]
    summary = run["summary"]["N=1048576,T=300"]["es_d_rtrl"]
    (million,) = [row for row in _rows_of(block, "1,048,576") if row[1] == "300"
                  and row[4] == "XLA"]
    s_update, _, over_bptt, rss, xla, floor = million[6:]
    assert s_update == f"{record['s_per_update']:.3g} s" and over_bptt == MISSING
    assert (xla, rss) == (f"{summary['xla_peak_gib']:.2f} GiB", f"{summary['peak_rss_gib']:.2f} GiB")
    assert floor == MISSING and "floor_withdrawn" in record  # its probe's floor is withdrawn
    # the files of one machine and commit are named together, the others apart
    assert block.startswith("`benchmarks/results/scale_tpu.json` (one TPU v5e chip")
    # a run that compiled and timed out shows its memory and no time
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    for key in ("executed", "warmup_s", "update_s", "s_per_update", "s_per_step", "rss"):
        record.pop(key)
    record["error"] = "timed out after 560 s"
    run["summary"]["N=1048576,T=300"]["es_d_rtrl"].update(s_per_update=None, peak_rss_gib=None)
    (results / "scale_tpu_1m_t300.json").write_text(json.dumps(run))
    (row,) = [r for r in _rows_of(BLOCKS["scale_tpu"](Results(results)), "1,048,576")
              if r[1] == "300" and r[4] == "XLA"]
    status, steps, *rest = row[6:]
    assert status.startswith("compiled") and "not finished within 560 s" in status
    assert steps == MISSING
    assert rest == [MISSING, MISSING, f"{summary['xla_peak_gib']:.2f} GiB", MISSING]
    # and one that timed out before it compiled shows no memory either
    del record["xla"]
    (results / "scale_tpu_1m_t300.json").write_text(json.dumps(run))
    (row,) = [r for r in _rows_of(BLOCKS["scale_tpu"](Results(results)), "1,048,576")
              if r[1] == "300" and r[4] == "XLA"]
    assert row[6:] == ["not run: timed out after 560 s", *[MISSING] * 5]


def test_the_million_neuron_paragraph_quotes_its_runs():
    """The numbers of ``docs/accelerators.md``'s paragraph on 1,048,576 neurons are the runs'."""
    million = json.loads((RESULTS / "scale_tpu_1m_t300.json").read_text())["results"][0]
    small = next(r for r in json.loads((RESULTS / "scale_tpu.json").read_text())["results"]
                 if r["method"] == "es_d_rtrl" and r["T"] == 30)
    (bptt,) = json.loads((RESULTS / "scale_bptt_1m_compiled.json").read_text())["results"]
    assert bptt["method"] == "bptt" and bptt["neurons"] == 2**20 and not bptt["executed"]
    text = " ".join((ROOT / "docs" / "accelerators.md").read_text().split())
    paragraph = text[text.index("At 1,048,576 neurons (batch 32, T = 300)"):]
    paragraph = paragraph[:paragraph.index("```")]
    quoted = (f"{million['s_per_update']:.1f} s per update",
              f"{million['s_per_step'] * 1e3:.0f} ms per step",
              f"XLA peak of {million['xla']['peak_bytes'] / 2**30:.2f} GiB",
              f"{million['s_per_step'] / small['s_per_step']:.1f}× the 131,072-neuron step",
              "blocks of two steps" if million["loop"] == "Blocked(size=2)" else million["loop"],
              f"BPTT's update at that size needs {bptt['xla']['peak_bytes'] / 2**30:.0f} GiB")
    for figure in quoted:
        assert figure in paragraph, figure


def test_the_methods_a_table_leaves_out_are_in_their_runs_and_in_no_cell():
    results = Results(RESULTS)
    shown = BLOCKS["throughput_tpu"](results) + BLOCKS["throughput_tpu_other"](results)
    for run in (*accelerator.LATEST_RUNS, *accelerator.OTHER_RUNS):
        for method, why in run.left_out:
            entries = [e["methods"] for e in results(run.name)["results"].values()]
            assert all(method in e for e in entries), f"{run.name} has no {method!r}: {why}"
            for e in entries:
                figures = " / ".join(ratio(e[method][key]) for key in (
                    "ratio_to_bptt", "jit_ratio_to_bptt", "device_ratio_to_bptt"))
                assert figures not in shown
            assert f"`{method}` of `{run.name}` ({why})" in " ".join(shown.split())


def test_bfloat16_traces_are_set_against_their_float32_run_and_the_floor():
    run = json.loads((RESULTS / "throughput_tpu_h1024_jit_device.json").read_text())
    block = BLOCKS["throughput_tpu_floor"](Results(RESULTS))
    header = next(line for line in block.splitlines() if line.startswith("| model |"))
    column = [c.strip() for c in header.strip("|").split(" | ")].index("`d_rtrl_bf16`")
    for model in ("gru", "snn"):
        low, full = (run["results"][model]["methods"][m] for m in ("d_rtrl_bf16", "d_rtrl"))
        cells = [row[column] for row in _rows_of(block, f"`{model}`, hidden 1024, batch 64, "
                                                        "T = 100") if row[column] != MISSING]
        # the stateful call's device time, over the floor and over float32's, then the jitted
        # step's device time and over the floor
        expected = (f"{low['device_step_us']:.0f} µs, {ratio(low['floor']['ratio'])}, "
                    f"{ratio(low['device_step_us'] / full['device_step_us'])} float32's; "
                    f"jitted {low['jit_device_step_us']:.0f} µs, "
                    f"{ratio(low['floor']['jit_device_ratio'])}")
        assert cells == [expected]
        assert low["floor"]["jit_device_ratio"] < low["floor"]["ratio"]  # its traces not copied


def test_the_tpu_time_of_a_run_of_several_lengths_is_its_longest(tmp_path):
    run = json.loads((RESULTS / "throughput_tpu_host.json").read_text())
    older = json.loads((RESULTS / "throughput_tpu.json").read_text())["results"]
    host = run["results"]
    # the committed run (one length, T = 1000) as a run of two: a shorter length of other
    # ratios beside it, each under its `model@T` key
    assert host["snn"]["T"] == 1000
    shorter = copy.deepcopy(host["snn"])
    shorter["T"] = 100
    shorter["methods"]["es_d_rtrl"]["jit_ratio_to_bptt"] *= 1.5
    host = {"gru": host["gru"], "snn@T100": shorter, "snn@T1000": host["snn"]}
    longest, shortest = (host[f"snn@T{t}"]["methods"]["es_d_rtrl"]["jit_ratio_to_bptt"]
                         for t in (1000, 100))
    assert ratio(longest) != ratio(shortest)
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    (results / "throughput_tpu_host.json").write_text(json.dumps({**run, "results": host}))
    (results / "throughput_spiking_rules_tpu.json").unlink()  # the host run first
    table = readme.algorithms(Results(results))
    assert _row(table, "`ESDRTRL()`, `'es_d_rtrl'`")[4] == ratio(longest)
    assert _row(table, "`DRTRL()`, `'d_rtrl'`")[4] == ratio(
        older["snn"]["methods"]["d_rtrl"]["jit_ratio_to_bptt"])


def test_the_kernels_runs_stand_beside_xlas_with_their_sample_steps():
    """The Pallas runs of ``scale.py`` are rows of the TPU scale table marked as such, with
    batch and sample-steps per second; the page's ratio of the million-neuron step is theirs."""
    block = BLOCKS["scale_tpu"](Results(RESULTS))
    kernel_runs = ("scale_tpu_pallas.json", "scale_tpu_staged.json", *_tables.BLOCK_SCALE_RUNS)
    records = {name: json.loads((RESULTS / name).read_text())["results"] for name in kernel_runs}
    for name in ("scale_tpu_pallas.json", "scale_tpu_staged.json"):
        run = json.loads((RESULTS / name).read_text())
        for record in run["results"]:
            key = "N=131072,T=30" + ("" if record["batch"] == 32 else f",B={record['batch']}")
            summary = run["summary"][key][record["method"]]
            rows = [r for r in _rows_of(block, "131,072") if r[2] == f"`{record['method']}`"
                    and r[3] == str(record["batch"]) and r[4].startswith("Pallas")]
            runs = sum(any((r["neurons"], r["T"], r["method"], r.get("batch", 32))
                           == (131072, 30, record["method"], record["batch"]) for r in rs)
                       for rs in records.values())
            assert len(rows) == runs >= 1  # one row per run
            assert f"{summary['sample_steps_per_s']:,.0f}" in [row[7] for row in rows]
    assert len([r for r in _rows_of(block, "131,072") if r[4] == "XLA"]) == 3
    million = json.loads((RESULTS / "scale_tpu_1m_own.json").read_text())["results"][0]
    latest = json.loads((RESULTS / "scale_tpu_131k.json").read_text())
    small = next(r for r in latest["results"] if r["method"] == "es_d_rtrl" and r["batch"] == 32)
    text = " ".join((ROOT / "docs" / "accelerators.md").read_text().split())
    times = round(million["s_per_step"] / small["s_per_step"])
    assert f"the step is {times} times the 131,072-neuron step" in text


def test_the_host_table_sets_the_stateful_ratio_beside_the_jitted_steps():
    block = BLOCKS["throughput_tpu_host"](Results(RESULTS))
    for name in accelerator.HOST_RUNS:
        rows = _rows_of(block, f"`{name}`")
        run = json.loads((RESULTS / name).read_text())["results"]
        assert len(rows) == sum(len(entry["per_call"]) for entry in run.values())
        for entry in run.values():
            for method, calls in entry["per_call"].items():
                row = next(r for r in rows if r[2] == f"`{method}`"
                           and r[3] == f"{calls['stateful_us'] / 1000:.2f} ms")
                if method == "bptt":
                    assert row[-1] == MISSING
                    continue
                # per call, both forms over BPTT's jitted grad (what a user would run instead)
                bptt = entry["per_call"]["bptt"]["jit_us"]
                stateful, jitted = calls["stateful_us"] / bptt, calls["jit_us"] / bptt
                assert row[-1] == (f"{ratio(stateful)} / {ratio(jitted)} "
                                   f"({stateful - jitted:+.2f})")


def test_d_rtrls_block_sizes_are_set_against_a_floor_of_whole_passes():
    """Blocks of 32 over T = 100 pass over the traces 4 times (three blocks and a tail): the
    table's floor counts 4 passes where the run recorded 3.125 (T/K), and 2 for blocks of 50."""
    block = BLOCKS["trace_blocks_tpu"](Results(RESULTS))
    for name in accelerator.TRACE_BLOCK_RUNS:
        run = json.loads((RESULTS / name).read_text())
        for model, entry in run["results"].items():
            for method, e in entry["methods"].items():
                if not method.startswith("d_rtrl"):
                    continue
                terms, length = e["floor"]["terms"], entry["T"]
                config = run["config"]
                row = next(r for r in _rows_of(block, f"`{model}`, hidden {config['hidden']}, "
                                                      f"batch {config['batch']}, T = {length}")
                           if r[1] == f"`{name}`" and r[2] == f"`{method}`")
                passes = -(-length // terms["K"])
                assert row[3:5] == [str(terms["K"]), str(passes)]
                whole = (terms["W"] + terms["X"] + 2 * terms["Hd"]
                         + 2 * terms["Tr"] * passes / length)
                assert row[6] == ratio(e["jit_device_step_us"] * 1e-6
                                       * run["bandwidth"]["bytes_per_s"] / whole)
                if passes > 1.1 * length / terms["K"]:  # the run's own floor: T/K (3.125)
                    assert row[6] != ratio(e["floor"]["jit_device_ratio"])
