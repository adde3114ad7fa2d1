"""Smoke test of the benchmarks: each script's ``--quick`` mode runs and writes its results.

The three scripts run at once, each in its own process (the memory benchmark
starts one more process per configuration). Only the shape of the output is
checked here (keys present, numbers finite); the measured numbers are in
``benchmarks/results`` and ``benchmarks/README.md``.
"""

import json
import math
import os
import subprocess
import sys
import time

import numpy as np
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = ("memory_vs_length", "throughput", "fidelity")
EXTRA_ARGS = {"throughput": ["--jit-step", "--host-time"]}


def finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


@pytest.fixture(scope="module")
def quick_results(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench")
    start = time.perf_counter()
    procs = {name: subprocess.Popen(
        [sys.executable, os.path.join(ROOT, "benchmarks", f"{name}.py"), "--quick", "--out",
         str(out), *EXTRA_ARGS.get(name, [])],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
        for name in SCRIPTS}
    logs = {}
    for name, proc in procs.items():
        try:
            logs[name] = proc.communicate(timeout=600)[0]
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()
            pytest.fail(f"{name} --quick did not finish within 600 s")
        assert proc.returncode == 0, f"{name} --quick failed:\n{logs[name][-4000:]}"
    elapsed = time.perf_counter() - start
    print(f"benchmarks --quick, all three at once: {elapsed:.1f} s")
    results = {}
    for name in SCRIPTS:
        assert (out / f"{name}.png").stat().st_size > 0
        results[name] = json.loads((out / f"{name}.json").read_text())
    return results


def test_memory_quick_writes_analysis_and_rss_per_configuration(quick_results):
    payload = quick_results["memory_vs_length"]
    assert payload["benchmark"] == "memory_vs_length" and payload["quick"] is True
    records = payload["results"]
    methods = {r["method"] for r in records}
    assert "bptt" in methods and len(methods) >= 2
    assert len({r["T"] for r in records}) >= 2
    for r in records:
        assert r["executed"] is True, r.get("skipped_reason")
        for key in ("argument_bytes", "output_bytes", "temp_bytes", "peak_bytes"):
            assert finite(r["xla"][key]) and r["xla"][key] >= 0
        assert finite(r["rss"]["peak_bytes"]) and r["rss"]["peak_bytes"] > 0
        assert finite(r["compile_s"]) and finite(r["exec_s"])
    streamed = sorted((r for r in records if r["method"].endswith("_streamed")),
                      key=lambda r: r["T"])
    assert len(streamed) >= 2
    # Streaming runs one chunk program whatever T is: its analysis cannot change with T.
    assert len({r["xla"]["peak_bytes"] for r in streamed}) == 1
    longest = streamed[-1]
    assert f"{longest['T'] // longest['stream_chunk']} chunks" in longest["executed_via"]
    for entry in payload["summary"].values():
        assert all(v is None or isinstance(v, bool) or finite(v) for v in entry.values())
        assert finite(entry[next(k for k in entry if k.startswith("xla_temp_ratio"))])
        assert finite(entry[next(k for k in entry if k.startswith("rss_peak_ratio"))])


def test_throughput_quick_writes_step_times_and_ratios(quick_results):
    payload = quick_results["throughput"]
    assert payload["benchmark"] == "throughput" and payload["quick"] is True
    assert payload["results"]
    for model in payload["results"].values():
        methods = model["methods"]
        assert {"bptt", "d_rtrl", "es_d_rtrl", "d_rtrl@1"} <= set(methods)  # blocked and per step
        assert methods["bptt"]["ratio_to_bptt"] == pytest.approx(1.0)
        for entry in methods.values():
            for key in ("step_us_median", "step_us_min", "compile_s", "ratio_to_bptt"):
                assert finite(entry[key]) and entry[key] > 0, key
        for name, entry in methods.items():  # --jit-step: online_grad in a jitted step
            if name != "bptt":
                for key in ("jit_step_us_median", "jit_ratio_to_bptt"):
                    assert finite(entry[key]) and entry[key] > 0, (name, key)
        for name, entry in methods.items():  # the analytic floor
            found = entry["floor"]
            assert found["formula"] == ("2*W + X + 4*Hd" if name == "bptt"
                                        else "W + X + 2*Hd + 2*Tr*ceil(T/K)/T")
            terms = found["terms"]
            passes = None if name == "bptt" else -(-model["T"] // terms["K"])
            bytes_per_step = (2 * terms["W"] + terms["X"] + 4 * terms["Hd"] if name == "bptt"
                              else terms["W"] + terms["X"] + 2 * terms["Hd"]
                              + 2 * terms["Tr"] * passes / model["T"])
            assert bytes_per_step > 0 and found["bytes_per_step"] == pytest.approx(bytes_per_step)
            assert found["us_per_step"] == pytest.approx(
                found["bytes_per_step"] / payload["bandwidth"]["bytes_per_s"] * 1e6)
            assert finite(found["ratio"]) and found["ratio"] > 0
        assert methods["d_rtrl@1"]["floor"]["terms"]["K"] == 1  # the per-step form
        assert methods["d_rtrl"]["floor"]["terms"]["K"] > 1     # time blocks
        assert all(methods[m]["floor"]["terms"]["T"] == model["T"] for m in methods
                   if m != "bptt")
        assert methods["d_rtrl"]["floor"]["terms"]["Tr"] > methods["es_d_rtrl"]["floor"][
            "terms"]["Tr"]  # B·|θ|·S against B·(I + O·S)
        assert set(model["per_call"]) == set(methods)  # --host-time: bptt through the API too
        for row in model["per_call"].values():
            for key in ("stateful_us", "program_us", "jit_us"):
                assert finite(row[key]) and row[key] > 0, key
            assert row["driver_us"] == pytest.approx(row["stateful_us"] - row["program_us"])
            assert row["host_us"] is None  # no --device-time


def test_fidelity_quick_writes_cosines_against_a_live_bptt_reference(quick_results):
    payload = quick_results["fidelity"]
    assert payload["benchmark"] == "fidelity" and payload["quick"] is True
    for config in payload["results"].values():
        assert config["models"]
        for model in config["models"].values():
            assert finite(model["bptt_grad_norm"]) and model["bptt_grad_norm"] > 0
            assert finite(model["control_random_direction"]["cosine"])
            assert model["algorithms"]
            for alg in model["algorithms"].values():
                for key in ("cosine", "relative_error", "norm_ratio", "sign_agreement"):
                    assert finite(alg[key]), key
                assert -1.0 <= alg["cosine"] <= 1.0


def test_tasks_quick_trains_every_model_and_reports_test_accuracy(tmp_path):
    # Its own process, not the fixture's: the three scripts above already share the 2 cores.
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "tasks.py"), "--quick", "--out",
         str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, f"tasks --quick failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    assert (tmp_path / "tasks.png").stat().st_size > 0
    payload = json.loads((tmp_path / "tasks.json").read_text())
    assert payload["benchmark"] == "tasks" and payload["quick"] is True
    results = payload["results"]
    assert set(results) == {"mnist1d", "digits", "spiking_digits"}
    models = {m for task in results.values() for m in task}
    assert models == {"gru", "lru_mlp", "mingru2", "alif"}
    methods = {meth for task in results.values() for rows in task.values() for meth in rows}
    assert {"bptt", "d_rtrl@8", "es_d_rtrl", "eprop"} <= methods
    for task in results.values():
        for rows in task.values():
            for row in rows.values():
                assert 0.0 <= row["test_accuracy_mean"] <= 1.0
                assert finite(row["train_wall_s_mean"]) and row["lr"] in payload["config"]["lrs"]
                assert all(0.0 <= v <= 1.0 for v in row["validation_accuracy_per_lr"].values())
    # D-RTRL equals BPTT on one LRU under an MLP readout
    lru = results["mnist1d"]["lru_mlp"]
    exact = [lru[m]["runs"][0]["test_loss"] for m in ("bptt", "d_rtrl")]
    np.testing.assert_allclose(exact[0], exact[1], rtol=1e-5)
    # --jobs 2: rows in their own processes, two at once, give the rows of the serial run
    # (same seeds, batches and initialisation)
    par = tmp_path / "parallel"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "tasks.py"), "--quick", "--jobs", "2",
         "--tasks", "mnist1d", "--models", "gru", "--methods", "bptt,d_rtrl@8",
         "--out", str(par)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, f"tasks --jobs 2 failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    parallel = json.loads((par / "tasks.json").read_text())
    assert parallel["jobs"] == 2 and parallel["complete"] is True
    rows = parallel["results"]["mnist1d"]
    assert list(rows) == ["gru"] and list(rows["gru"]) == ["bptt", "d_rtrl@8"]
    losses = lambda row: [r["test_loss"] for r in row["runs"]]
    for method in ("bptt", "d_rtrl@8"):
        assert losses(rows["gru"][method]) == losses(results["mnist1d"]["gru"][method])


def test_sparse_quick_writes_trace_memory_and_step_time_against_dense(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "sparse.py"), "--quick", "--out",
         str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, f"sparse --quick failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    assert (tmp_path / "sparse.png").stat().st_size > 0
    payload = json.loads((tmp_path / "sparse.json").read_text())
    assert payload["benchmark"] == "sparse" and payload["quick"] is True
    assert set(payload["results"]) == {"d_rtrl", "d_rtrl@1"}
    for results in payload["results"].values():
        assert {"dense", "sparse_10pct", "sparse_1pct"} <= set(results)
        assert results["dense"]["trace_ratio_to_dense"] == pytest.approx(1.0)
        for entry in results.values():
            for key in ("trace_bytes", "step_us_median", "step_us_min", "compile_s"):
                assert finite(entry[key]) and entry[key] > 0, key
        # Fewer connections, a smaller trace: it scales with nnz, not in x out.
        assert results["sparse_1pct"]["trace_bytes"] < results["sparse_10pct"]["trace_bytes"] \
            < results["dense"]["trace_bytes"]
    assert isinstance(payload["summary"]["targets_met"], bool)


def test_scale_quick_writes_times_memory_and_the_analytic_floor(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "scale.py"), "--quick", "--out",
         str(tmp_path)], capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, f"scale --quick failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    assert (tmp_path / "scale.png").stat().st_size > 0
    payload = json.loads((tmp_path / "scale.json").read_text())
    assert payload["benchmark"] == "scale" and payload["quick"] is True
    records = payload["results"]
    assert {r["method"] for r in records} >= {"bptt", "es_d_rtrl", "es_d_rtrl@1"}
    for r in records:
        assert r["executed"] is True, r.get("skipped_reason") or r.get("error")
        assert len(r["update_s"]) >= 2 and all(finite(t) and t > 0 for t in r["update_s"])
        assert finite(r["compile_s"]) and r["rss"]["peak_bytes"] > 0
        assert r["xla"]["peak_bytes"] > 0 and r["batch"] == 4
        assert finite(r["bandwidth"]["gb_per_s"]) and r["bandwidth"]["gb_per_s"] > 0
        assert finite(r["index_rate"]["rows_per_s"]) and r["index_rate"]["rows_per_s"] > 0
        floor = r["floor"]  # the analytic floor: bytes and gathered rows by term, the formula
        assert "indices" in floor["formula"] and floor["bytes"] == sum(
            floor["bytes_by_term"].values())
        assert floor["s_per_step"] == max(floor["s_bytes"], floor["s_indices"]) > 0
        assert floor["measured_over_floor"] == pytest.approx(r["s_per_step"]
                                                            / floor["s_per_step"])
    (summary,) = payload["summary"].values()
    assert summary["bptt"]["time_ratio_to_bptt"] == pytest.approx(1.0)
    assert finite(summary["es_d_rtrl@1"]["rss_ratio_to_bptt"])
    for order in ("in_output_order", "random_order"):
        ops = payload["ops"][order]
        assert {"forward", "grad_x", "xy_to_dw", "xy_to_dw_block", "dt_to_t", "contract"} <= set(ops)
        for entry in ops.values():
            assert finite(entry["ratio_to_best_plain"]) and entry["primitive"]["ms_median"] > 0


def test_published_ours_only_quick_writes_times_cosines_and_exits_2_without_a_venv(tmp_path):
    script = os.path.join(ROOT, "benchmarks", "published.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path)], capture_output=True,
                          text=True, cwd=ROOT, timeout=60, check=False)
    assert proc.returncode == 2 and "braintrace==0.2.8" in proc.stderr
    proc = subprocess.run(
        [sys.executable, script, "--ours-only", "--quick", "--models", "gru", "--methods",
         "es_d_rtrl:fast", "--rounds", "1", "--repeats", "1", "--out", str(tmp_path)],
        capture_output=True, text=True, cwd=ROOT, timeout=600, check=False)
    assert proc.returncode == 0, f"published --ours-only failed:\n{proc.stderr[-4000:]}"
    assert (tmp_path / "published.png").stat().st_size > 0
    methods = json.loads((tmp_path / "published.json").read_text())["models"]["gru"]["methods"]
    assert set(methods) == {"bptt", "es_d_rtrl:fast"}
    assert methods["bptt"]["cosine"] == pytest.approx(1.0)
    fast = methods["es_d_rtrl:fast"]
    assert 0.0 < fast["cosine"] < 1.0 and fast["zero_params"] == []  # approximate, nothing dead
    assert set(fast["cosine_per_param"]) == set(methods["bptt"]["cosine_per_param"])
    assert finite(fast["ms_per_step"]) and fast["ms_per_step"] > 0
    assert finite(fast["ratio_to_our_bptt"])


def test_trainer_step_quick_writes_ratios_and_the_per_step_floor(tmp_path):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "benchmarks", "trainer_step.py"), "--quick",
         "--repeats", "2", "--out", str(tmp_path)], capture_output=True, text=True, cwd=ROOT,
        timeout=600, check=False)
    assert proc.returncode == 0, f"trainer_step --quick failed:\n{(proc.stdout + proc.stderr)[-4000:]}"
    assert (tmp_path / "trainer_step.png").stat().st_size > 0
    payload = json.loads((tmp_path / "trainer_step.json").read_text())
    for model in ("gru", "snn"):
        for method in ("d_rtrl", "es_d_rtrl"):
            row = payload["models"][model][method]
            for variant in payload["variants"]:
                assert finite(row[variant]["step_us"]) and row[variant]["step_us"] > 0, variant
            assert row["grad"]["ratio_to_grad"] == pytest.approx(1.0)
            floor = row["grad@1"]["step_us"] + row["optimizer"]["step_us"]
            assert row["per_step_floor"]["step_us"] == pytest.approx(floor)


def test_device_profile_compiles_scale_updates_and_writes_their_hlo(tmp_path):
    """``device_profile.py scale:…`` builds ``scale.py``'s update (BPTT and ES-D-RTRL with its
    fast signal) and writes each program's HLO; on the CPU no device time (no device lane)."""
    import tarfile

    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    import device_profile

    payload = device_profile.main(["--out", str(tmp_path), "--kernels", "packed+chunked_pair",
                                   "scale:256:2:4:bptt,es_d_rtrl:fast"])
    assert payload["kernels"] == "packed+chunked_pair"
    results = payload["results"]
    assert set(results) == {"scale_n256_b2_T4_bptt", "scale_n256_b2_T4_es_d_rtrl:fast"}
    for row in results.values():
        assert "error" not in row, row.get("error")
        assert row["device_us_per_step"] is None and row["ops"] == [] and row["compile_s"] > 0
    with tarfile.open(tmp_path / "hlo.tar.gz") as tar:
        texts = {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()}
    assert set(texts) == {f"{key}.hlo.txt" for key in results}
    assert all("HloModule" in text for text in texts.values())
