"""The benchmarks of the sparse kernels: ``scale.py``'s batches and throughput, the device
script ``sparse_kernels_tpu.py`` (one sum measured, a kernel that fails recorded and the rest
measured) and the tables that show them."""

from __future__ import annotations

import copy
import json
import os
import sys

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import scale
import sparse_kernels_tpu as kernels_run
from _sparse_tables import sparse_kernels
from _table_format import RESULTS, Results
from _tables import scale_tpu

from braintrace._platform import formulation
from braintrace._primitives import _sparse_tpu as tpu
from braintrace._primitives._sparse import Connectivity


def _record(batch: int, method: str, seconds: float) -> dict:
    return {"neurons": 131072, "T": 30, "method": method, "batch": batch, "executed": True,
            "s_per_update": seconds, "s_per_step": seconds / 30, "loop": None,
            "rss": {"peak_bytes": 2**31}, "xla": {"peak_bytes": 2**30}}


RECORDS = [_record(32, "bptt", 0.4), _record(32, "es_d_rtrl", 0.3),
           _record(128, "bptt", 0.5), _record(128, "es_d_rtrl", 0.35)]


def test_scale_summarises_each_batch_against_its_own_bptt_with_sample_steps_per_second():
    summary = scale.summarise(RECORDS, 32)
    assert set(summary) == {"N=131072,T=30", "N=131072,T=30,B=128"}  # the first batch as before
    large = summary["N=131072,T=30,B=128"]["es_d_rtrl"]
    assert large["sample_steps_per_s"] == pytest.approx(128 * 30 / 0.35)
    assert large["time_ratio_to_bptt"] == pytest.approx(0.35 / 0.5)
    assert summary["N=131072,T=30"]["es_d_rtrl"]["time_ratio_to_bptt"] == pytest.approx(0.75)
    assert set(scale.summarise(RECORDS[:2], None)) == {"N=131072,T=30"}  # --batch auto
    assert scale._batch("32,128") == [32, 128] and scale._batch("auto") == "auto"


def test_the_scale_table_shows_each_batch_against_its_own_bptt_and_the_kernels_run(tmp_path):
    run = json.loads((RESULTS / "scale_tpu.json").read_text())
    run["results"], run["summary"] = RECORDS, scale.summarise(RECORDS, 32)
    run["config"]["sparse_sums"] = kernels_run.sparse_sums("tpu", None, "staged")
    results = tmp_path / "results"
    results.mkdir()
    for name in ("scale_tpu_t300.json", "scale_tpu_1m_t300.json"):
        (results / name).write_text((RESULTS / name).read_text())
    (results / "scale_tpu_staged.json").write_text(json.dumps(run))  # a listed run, present
    rows = [line.split(" | ") for line in scale_tpu(Results(results)).splitlines()
            if line.startswith("| 131,072 | 30 |")]
    assert [(r[2], r[3], r[4]) for r in rows] == [
        ("`bptt`", "32", "Pallas `staged`"), ("`es_d_rtrl`", "32", "Pallas `staged`"),
        ("`bptt`", "128", "Pallas `staged`"), ("`es_d_rtrl`", "128", "Pallas `staged`")]
    assert "0.70×" in rows[3]  # over BPTT at batch 128, not at 32
    assert kernels_run.sparse_sums("tpu", "accelerator", "cells") == "XLA"


def _connectivity(n: int = 48) -> Connectivity:
    return Connectivity.from_indices(*scale.connectivity(n, 4), n, n)


def test_the_device_script_measures_each_variant_and_survives_a_kernel_that_fails(
        monkeypatch):
    conn = _connectivity()
    variants = ("cells", "staged@128")
    with formulation("pallas"):  # the kernels in interpret mode
        programs = kernels_run.compile_all(conn, {"forward": 6}, variants, None)
        entry = kernels_run.measure_sum("forward", conn, 6, 1, programs["forward"])
    for v in variants:
        assert entry["pallas:" + v]["max_rel_error"] < 1e-6
        assert entry["pallas:" + v]["ms_median"] > 0
    assert entry["fastest"] in ("pallas:cells", "pallas:staged@128")
    assert entry["xla_over_fastest"] > 0
    assert entry["floor_ms"] == pytest.approx(conn.nnz * kernels_run.ROW_NS * 1e-6)
    assert not any(k.startswith("tables") for k in entry)  # uniform: no gather of the tables
    assert (tpu.KERNELS, tpu.BLOCK_ROWS) == ("packed", None)  # each variant's sizes restored

    def broken(*args):
        raise RuntimeError("Mosaic failed to compile the kernel")

    monkeypatch.setattr(tpu, "product", broken)
    programs = kernels_run.compile_all(conn, {"forward": 3}, variants, None)
    entry = kernels_run.measure_sum("forward", conn, 3, 1, programs["forward"])
    assert all("Mosaic failed" in entry["pallas:" + v]["error"] for v in variants)
    assert entry["xla"]["ms_median"] > 0 and "fastest" not in entry
    assert kernels_run._line(48, 3, "forward", entry).count("ERROR") == 2
    with pytest.raises(ValueError, match="unknown variant 'tiles'"):
        kernels_run.main(["--variants", "cells,tiles"])
    with pytest.raises(SystemExit):  # a timed run needs XLA's values as the reference
        kernels_run.main(["--kernels-only", "--quick"])


def test_a_variant_sets_the_kernels_the_chunked_pair_sum_and_the_block_within_its_block():
    with kernels_run.variant("staged+chunked_pair@256"):
        assert (tpu.KERNELS, tpu.CHUNKED_PAIR, tpu.BLOCK_ROWS) == ("staged", True, 256)
        with kernels_run.variant("staged"):
            assert (tpu.CHUNKED_PAIR, tpu.BLOCK_ROWS) == (False, None)
        assert tpu.CHUNKED_PAIR
        with kernels_run.variant("packed+own_pair"):  # each chunk's own connections
            assert (tpu.KERNELS, tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR) == ("packed", True, True)
            assert kernels_run.default_variant() == "packed+own_pair"
        assert not tpu.OWN_CHUNK_PAIR
    assert (tpu.KERNELS, tpu.CHUNKED_PAIR, tpu.OWN_CHUNK_PAIR, tpu.BLOCK_ROWS) == (
        "packed", True, True, None)  # the defaults
    for name in ("staged+chunked", "staged@256+chunked_pair", "chunked_pair"):
        with pytest.raises(ValueError, match="optionally \\+chunked_pair"):
            kernels_run.main(["--variants", name])
    with pytest.raises(ValueError, match="unknown variant 'cells\\+pair'"):
        scale.main(["--kernels", "cells+pair"])


def test_the_kernels_table_shows_each_sum_its_fallback_and_a_failure(tmp_path):
    timed = {"ms_median": 1.0, "over_floor": 1.5, "max_rel_error": 2e-7}
    entry = {"rows": 32, "floor_ms": 0.5, "xla": {"ms_median": 3.0}, "pallas": dict(timed),
             "xla_over_pallas": 3.0}
    record = {"neurons": 131072, "batch": 32, **{s: copy.deepcopy(entry)
                                                  for s in kernels_run.SUMS}}
    record["x_bar"]["pallas_small"] = record["x_bar"].pop("pallas")
    record["dw"]["pallas"] = {"error": "failed"}
    del record["dw"]["xla_over_pallas"]
    env = json.loads((RESULTS / "scale_tpu.json").read_text())["environment"]
    payload = {"environment": env, "results": [record],
               "config": {"degree": 8, "block": 3, "repeats": 5, "row_ns": 1.2}}
    (tmp_path / kernels_run.NAME).with_suffix(".json").write_text(json.dumps(payload))
    text = sparse_kernels(Results(tmp_path))
    rows = {line.split(" | ")[2]: line for line in text.splitlines() if "| 131,072 |" in line}
    assert "1.00 ms" in rows["forward `y`"] and "3.00×" in rows["forward `y`"]
    assert text.count("Pallas, small blocks") == 1  # the fallback's column
    assert rows["input pullback `x̄`"].split(" | ")[5:7] == ["—", "1.00 ms"]
    assert rows["weight pullback `dw`"].split(" | ")[5:] == ["failed", "—", "—", "0.50 ms",
                                                            "—", "—", "— |"]
    assert np.isclose(float(rows["forward `y`"].split(" | ")[-1].rstrip(" |")), 2e-7)


def test_the_kernels_table_shows_every_variant_and_the_fastest_ones_tables(tmp_path):
    """A run of ``--variants cells,staged``: a column per variant; the tables' gather, the
    floor's ratio and the error are the fastest variant's."""
    entry = {"rows": 32, "floor_ms": 0.5, "xla": {"ms_median": 3.0},
             "pallas:cells": {"ms_median": 2.0, "max_rel_error": 1e-7},
             "pallas:staged": {"ms_median": 1.0, "max_rel_error": 3e-7},
             "tables:cells": {"ms_median": 0.25}, "tables:staged": {"ms_median": 0.125}}
    record = {"neurons": 131072, "batch": 32, "x_bar": entry}
    env = json.loads((RESULTS / "scale_tpu.json").read_text())["environment"]
    payload = {"environment": env, "results": [record],
               "config": {"degree": 8, "block": 3, "repeats": 5, "row_ns": 1.2}}
    (tmp_path / kernels_run.NAME).with_suffix(".json").write_text(json.dumps(payload))
    text = sparse_kernels(Results(tmp_path))
    assert "| XLA | Pallas `cells` | Pallas `staged` | tables alone |" in text
    assert "each variant of the kernels" in " ".join(text.split())
    row = next(line for line in text.splitlines() if "| 131,072 |" in line).split(" | ")
    assert row[4:10] == ["3.00 ms", "2.00 ms", "1.00 ms", "0.12 ms", "0.50 ms", "2.00×"]
    assert row[10:] == ["3.00×", "3e-07 |"]
