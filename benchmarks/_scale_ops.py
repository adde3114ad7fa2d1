"""The sparse operation of ``scale.py`` on its own: the primitive's rules against plain JAX.

At ``B = 32`` samples and ``N`` neurons with 8 synapses each (``N = 16,384``:
131,072 connections), for the connections in output order (the model's) and
in a random order, each operation of ``ETPSparseLinear`` is timed against
plain formulations of the same sum:

* ``forward``: ``y = Σ_{post[k]=o} w[k] x[pre[k]]``; plain: gathered products
  ``segment_sum``-ed over ``post`` (unsorted, and with ``indices_are_sorted``
  where ``post`` is sorted);
* ``grad_x``: the cotangent of ``x`` (a learning signal, BPTT); plain: autodiff
  of the ``segment_sum`` form (a scatter);
* ``xy_to_dw``: ``dw[k] = Σ_r x[r, pre[k]] d[r, post[k]]`` over ``B`` rows and
  over a block of ``32·B`` rows; plain: gathered products reduced over rows;
* ``dt_to_t`` and ``contract``: ``ε[r, k]·d[r, post[k]]`` and its sum over
  rows; plain: a gather of ``d`` times the trace (summed over rows).

Candidates of one operation are timed round-robin; each gets its median and
minimum (ms), XLA's temporary bytes, and the ratio of the primitive's median
to the best plain one (``ratio_to_best_plain``, below 1: the primitive is
faster).
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

from braintrace._primitives._sparse import SPARSE_RULES, Connectivity, sparse_matmul

FULL = {"neurons": 16384, "batch": 32, "degree": 8, "block": 32, "repeats": 7}
QUICK = {"neurons": 512, "batch": 4, "degree": 8, "block": 4, "repeats": 2}


def _segment_forward(conn: Connectivity, sorted_post: bool):
    def forward(x, w):
        products = jnp.take(x, conn.pre, axis=-1) * w
        return jax.ops.segment_sum(products.T, conn.post, num_segments=conn.num_out,
                                   indices_are_sorted=sorted_post).T
    return forward


def _candidates(conn: Connectivity, in_order: bool) -> dict:
    """``{operation: ({name: fn}, args_maker)}``; the primitive's entry is named ``primitive``."""
    rules = lambda name: getattr(SPARSE_RULES, name)
    forward = {"primitive": lambda x, w, d: sparse_matmul(x, w, conn),
               "segment_sum": lambda x, w, d: _segment_forward(conn, False)(x, w)}
    grad_x = {"primitive": lambda x, w, d: jax.vjp(lambda x: sparse_matmul(x, w, conn), x)[1](d),
              "segment_sum": lambda x, w, d: jax.vjp(
                  lambda x: _segment_forward(conn, False)(x, w), x)[1](d)}
    if in_order:
        forward["segment_sum_sorted"] = lambda x, w, d: _segment_forward(conn, True)(x, w)
    pull = {"primitive": lambda x, w, d: rules("xy_to_dw")(x, d, {"weight": w},
                                                            connectivity=conn),
            "gather_reduce": lambda x, w, d: jnp.sum(jnp.take(x, conn.pre, axis=-1)
                                                     * jnp.take(d, conn.post, axis=-1), axis=0)}
    scale = {"primitive": lambda t, d: rules("dt_to_t")(d, {"weight": t}, connectivity=conn),
             "gather": lambda t, d: t * jnp.take(d, conn.post, axis=-1)}
    contract = {"primitive": lambda t, d: rules("contract")(d, {"weight": t}, connectivity=conn),
                "gather_reduce": lambda t, d: jnp.sum(t * jnp.take(d, conn.post, axis=-1), 0)}
    return {"forward": (forward, "xwd"), "grad_x": (grad_x, "xwd"),
            "xy_to_dw": (pull, "xwd"), "xy_to_dw_block": (pull, "block"),
            "dt_to_t": (scale, "td"), "contract": (contract, "td")}


def _arguments(kind: str, conn: Connectivity, cfg: dict, rng) -> tuple:
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    rows = cfg["batch"] * (cfg["block"] if kind == "block" else 1)
    if kind in ("xwd", "block"):
        return normal(rows, conn.num_in), normal(conn.nnz), normal(rows, conn.num_out)
    return normal(rows, conn.nnz), normal(rows, conn.num_out)


def time_round_robin(compiled: dict, args: tuple, repeats: int) -> dict:
    """``{name: [ms, ...]}``: each of ``compiled`` run once, then ``repeats`` rounds of one call
    each in turn (so a drift of the machine touches every candidate alike)."""
    for fn in compiled.values():
        jax.block_until_ready(fn(*args))
    times = {name: [] for name in compiled}
    for _ in range(repeats):
        for name, fn in compiled.items():
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times[name].append((time.perf_counter() - start) * 1e3)
    return times


def measure_ops(quick: bool = False) -> dict:
    """``{order: {operation: {candidate: record, 'ratio_to_best_plain': r}}}``."""
    from scale import connectivity

    cfg = QUICK if quick else FULL
    pre, post = connectivity(cfg["neurons"], cfg["degree"])
    order = np.random.default_rng(1).permutation(pre.size)
    orders = {"in_output_order": (pre, post), "random_order": (pre[order], post[order])}
    out = {"config": cfg}
    for label, (p, q) in orders.items():
        conn = Connectivity.from_indices(p, q, cfg["neurons"], cfg["neurons"])
        rng = np.random.default_rng(0)
        out[label] = {}
        for op, (fns, kind) in _candidates(conn, label == "in_output_order").items():
            args = _arguments(kind, conn, cfg, rng)
            compiled = {name: jax.jit(fn).lower(*args).compile() for name, fn in fns.items()}
            times = time_round_robin(compiled, args, cfg["repeats"])
            entry = {name: {"ms_median": float(np.median(t)), "ms_min": float(np.min(t)),
                            "temp_bytes": int(compiled[name].memory_analysis()
                                              .temp_size_in_bytes)}
                     for name, t in times.items()}
            best = min(v["ms_median"] for k, v in entry.items() if k != "primitive")
            entry["ratio_to_best_plain"] = entry["primitive"]["ms_median"] / best
            out[label][op] = entry
            print(f"ops {label:16s} {op:15s} " + "  ".join(
                f"{k}={v['ms_median']:.2f}ms" for k, v in entry.items() if k != "ratio_to_best_plain")
                + f"  ratio={entry['ratio_to_best_plain']:.2f}", flush=True)
    return out
