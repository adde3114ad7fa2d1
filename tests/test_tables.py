"""The pages' numbers are the committed JSONs': every generated table re-renders unchanged.

``benchmarks/render_tables.py`` writes the tables of ``README.md``, ``benchmarks/README.md``
and ``docs/`` from ``benchmarks/results/*.json``. These tests fail while a page differs from
its JSONs, while a result file is shown by no page, while a page quotes a measured number
outside its generated blocks, or while a page grows past its length.
"""

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
from _table_format import RESULTS, Results  # benchmarks/, put on the path by render_tables
from _tables import BLOCKS

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
    path = results / "throughput.json"
    run = json.loads(path.read_text())
    run["results"]["snn"]["methods"]["d_rtrl"]["ratio_to_bptt"] *= 2
    path.write_text(json.dumps(run))
    assert render_tables.stale(ROOT, Results(results)) == [
        "README.md: algorithms", "benchmarks/README.md: throughput_cpu"]


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
