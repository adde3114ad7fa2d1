"""One configuration of ``scale.py`` in a fresh process: compile, read the memory, run, floor.

``child(cfg)`` prints ``RESULT {json}`` lines, the last one complete:

1. compiles one update at ``cfg['batch']`` samples and reads XLA's memory analysis; with
   ``cfg['batch_auto']`` it then tries twice the batch while XLA's peak, extrapolated
   from this one (Params fixed, the rest proportional to the batch), would stay under
   90 % of the limit and ``cfg['max_batch']`` (each try compiled and checked), or halves
   it down to 8 until it fits: the largest batch that fits (``tried`` in the record);
2. unless ``cfg['compile_only']`` or the peak exceeds the limit, runs it once (warm-up)
   and ``cfg['repeats']`` times: seconds per update (median) and the process peak RSS;
3. measures the streaming bandwidth and the gather rate in the same process
   (``_scale_floor.py``) and sets the analytic floor of one step against the measured
   step: ``floor.measured_over_floor``.

A program that does not compile (a TPU refuses one above its memory) is recorded with
the error and, when the message says it, the memory it asked for (``xla_needed_bytes``);
with ``cfg['host_fallback']`` it is also compiled for the host's CPU and XLA:CPU's memory
analysis recorded (``on_host``).
``cfg['formulation']`` ('cpu', 'accelerator' or 'pallas') makes every ``by_platform`` computation
take that formulation (``braintrace._platform.formulation``): the accelerators' programs
compiled and measured on the CPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import resource
import time

import jax
import jax.numpy as jnp
import numpy as np
from _models import block, count_params, timed
from _scale_floor import analytic_floor, bandwidth_probe, floor_seconds, index_probe
from scale import LOOPS, build, data, program

MIN_BATCH = 8
"""The smallest batch ``batch_auto`` tries."""

HEADROOM = 0.9
"""``batch_auto`` tries a larger batch only if its extrapolated peak is below this share of
the limit."""

_UNITS = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _rss_bytes() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024  # Linux: KiB


def _current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def emit(record: dict) -> None:
    print("RESULT " + json.dumps(record), flush=True)


def xla_memory(compiled) -> dict:
    ma = compiled.memory_analysis()
    out = {"argument_bytes": int(ma.argument_size_in_bytes),
           "output_bytes": int(ma.output_size_in_bytes),
           "temp_bytes": int(ma.temp_size_in_bytes), "alias_bytes": int(ma.alias_size_in_bytes)}
    out["peak_bytes"] = (out["argument_bytes"] + out["output_bytes"] + out["temp_bytes"]
                         - out["alias_bytes"])
    return out


def needed_bytes(message: str) -> int | None:
    """The memory a refused program asked for, from XLA:TPU's message (``Used 20.4G of
    15.5G hbm``); ``None`` if the message does not say."""
    match = re.search(r"Used ([\d.]+)([KMGT])i?B? of [\d.]+[KMGT]i?B? hbm", message)
    return None if match is None else int(float(match.group(1)) * _UNITS[match.group(2)])


def compile_update(cfg: dict) -> tuple[object, object, dict]:
    """``(compiled or None, args, info)`` of one update at ``cfg['batch']`` samples."""
    n, T, method = cfg["neurons"], cfg["T"], cfg["method"]
    xs_np, ys_np, mask = data(T, cfg)
    model = build(n, cfg)
    info = {"batch": cfg["batch"], "params": count_params(model),
            "rss_after_build_bytes": _rss_bytes()}
    start = time.perf_counter()
    lowered, args = program(model, method, jnp.asarray(xs_np), jnp.asarray(ys_np), mask)
    info.update(lower_s=time.perf_counter() - start, rss_after_lower_bytes=_rss_bytes(),
                loop=LOOPS.get(method))
    try:
        compiled = lowered.compile()
    except Exception as e:  # noqa: BLE001 - a refused program is a result
        message = str(e)
        info.update(compile_s=time.perf_counter() - start, compile_error=message[-1500:],
                    xla_needed_bytes=needed_bytes(message))
        return None, args, info
    info.update(compile_s=time.perf_counter() - start, xla=xla_memory(compiled))
    return compiled, args, info


def _fits(info: dict, limit: float) -> bool:
    return "xla" in info and info["xla"]["peak_bytes"] <= limit


def _extrapolated(info: dict, batch: int) -> float:
    """XLA's peak at ``batch`` from ``info``'s: the Params (arguments, gradients and their
    sums: three copies) fixed, the rest proportional to the batch."""
    fixed = 3 * 4 * info["params"]
    return fixed + (info["xla"]["peak_bytes"] - fixed) * batch / info["batch"]


def fitting_update(cfg: dict) -> tuple[object, object, dict, list[dict]]:
    """:func:`compile_update` at ``cfg['batch']``, or with ``batch_auto`` at the largest batch
    that fits the limit (module docstring); returns the tries too."""
    limit = cfg["memory_limit_gib"] * 2**30
    compiled, args, info = compile_update(cfg)
    tried = [_try(info)]
    if not cfg.get("batch_auto"):
        return compiled, args, info, tried
    while _fits(info, limit) and 2 * info["batch"] <= cfg["max_batch"] \
            and _extrapolated(info, 2 * info["batch"]) <= HEADROOM * limit:
        larger = compile_update({**cfg, "batch": 2 * info["batch"]})
        tried.append(_try(larger[2]))
        if not _fits(larger[2], limit):
            break
        compiled, args, info = larger
    while not _fits(info, limit) and info["batch"] // 2 >= MIN_BATCH:
        compiled = args = None
        compiled, args, info = compile_update({**cfg, "batch": info["batch"] // 2})
        tried.append(_try(info))
    return compiled, args, info, tried


def _try(info: dict) -> dict:
    peak = info["xla"]["peak_bytes"] if "xla" in info else info.get("xla_needed_bytes")
    return {"batch": info["batch"], "xla_peak_bytes": peak, "compiled": "xla" in info}


def time_updates(compiled, args, count: int) -> list[float]:
    """Wall seconds of ``count`` runs of ``compiled(*args)``, outputs blocked on; ``args`` may
    be a function making fresh arguments (donated ones), called outside the timing."""
    times = []
    for _ in range(count):
        run_args = args() if callable(args) else args
        block(run_args)
        times.append(timed(lambda a=run_args: compiled(*a)))
    return times


def _block_size(loop: str | None) -> int:
    """``K`` from ``'Blocked(size=K)'``; 1 for the per-step loop or BPTT."""
    match = re.search(r"size=(\d+)", loop or "")
    return int(match.group(1)) if match else 1


def add_floor(record: dict, cfg: dict) -> None:
    """The probes and the analytic floor of one step, against the measured step."""
    record["bandwidth"] = bandwidth_probe(cfg["probe_elements"])
    record["index_rate"] = index_probe(record["neurons"], cfg["degree"], record["batch"])
    floor = analytic_floor(record["method"], neurons=record["neurons"], batch=record["batch"],
                           degree=cfg["degree"], inputs=cfg["inputs"], params=record["params"],
                           block=_block_size(record.get("loop")))
    if floor is None:
        return
    floor = floor_seconds(floor, record["bandwidth"], record["index_rate"])
    if record.get("s_per_step"):
        floor["measured_over_floor"] = record["s_per_step"] / floor["s_per_step"]
        floor["measured_over_bytes_floor"] = record["s_per_step"] / floor["s_bytes"]
    record["floor"] = floor


def on_host(cfg: dict) -> dict:
    """XLA's memory analysis of the update compiled for the host's CPU (a program the
    accelerator refused: what it needs there, XLA:CPU's buffer assignment)."""
    with jax.default_device(jax.devices("cpu")[0]):
        _, _, info = compile_update(cfg)
    return {key: info[key] for key in ("xla", "compile_s", "compile_error") if key in info}


def measure(cfg: dict) -> None:
    n, T, method = cfg["neurons"], cfg["T"], cfg["method"]
    record = {"neurons": n, "T": T, "method": method, "rss_after_import_bytes": _rss_bytes()}
    compiled, args, info, tried = fitting_update(cfg)
    record.update(info, tried=tried)
    emit(record)
    if compiled is None and cfg.get("host_fallback") and jax.default_backend() != "cpu":
        args = None
        record["on_host"] = on_host({**cfg, "batch": info["batch"]})
        emit(record)
    limit = cfg["memory_limit_gib"] * 2**30
    if compiled is None:
        record["skipped_reason"] = "did not compile (compile_error)"
    elif cfg.get("compile_only"):
        record["skipped_reason"] = "--compile-only: compiled and analysed, not executed"
    elif not _fits(info, limit):
        record["skipped_reason"] = (
            f"XLA peak {info['xla']['peak_bytes'] / 2**30:.1f} GiB exceeds "
            f"--memory-limit-gib={cfg['memory_limit_gib']}: compiled and analysed, not executed")
    record["executed"] = "skipped_reason" not in record
    if record["executed"]:
        current_before = _current_rss_bytes()
        first, *times = time_updates(compiled, args, 1 + cfg["repeats"])
        record.update(warmup_s=first, update_s=times, s_per_update=float(np.median(times)),
                      s_per_step=float(np.median(times)) / T,
                      rss={"peak_bytes": _rss_bytes(), "current_before_exec_bytes": current_before})
    emit(record)
    compiled = args = None  # the probes run alone
    add_floor(record, cfg)
    emit(record)


def child(cfg: dict) -> None:
    """Measures one configuration (module docstring), under ``cfg['formulation']`` if set,
    with the Pallas kernels ``cfg['kernels']`` on a TPU (``sparse_kernels_tpu.variant``; and
    with ``cfg['sparse_staged']``, the staged form of the cells' uniform sparse forward)."""
    if cfg.get("sparse_staged"):
        from braintrace._primitives import _sparse_pallas

        _sparse_pallas.STAGED = True
    with contextlib.ExitStack() as stack:
        if cfg.get("kernels"):
            from sparse_kernels_tpu import variant

            stack.enter_context(variant(cfg["kernels"]))
        if cfg.get("formulation"):
            from braintrace._platform import formulation

            stack.enter_context(formulation(cfg["formulation"]))
        measure(cfg)
