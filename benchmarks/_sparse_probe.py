"""The sparse product's three sums alone, in plain JAX: the accelerator formulation before and now.

For ``scale.py``'s recurrent layer (``N`` neurons, ``degree`` random synapses into each,
connections in output order) and ``B`` samples, each sum is timed (median and minimum
of ``--repeats`` calls, candidates of one sum round-robin), with XLA's temporary
bytes and its largest difference to the current formulation (relative to the largest
value):

* ``forward`` ``y = Σ_{post[k]=o} w[k] x[pre[k]]``: ``before``, the per-output table
  gathered from ``x``'s columns in one expression (what ``_sparse_accelerator.product``
  was); ``now``, the same over ``Connectivity.incoming``, in groups of at most
  ``GATHER_BUDGET`` bytes;
* ``x_bar`` ``x̄ = Σ_{pre[k]=i} w[k] ȳ[post[k]]``: ``before``, each connection's
  ``w[k]·ȳ[post[k]]`` scatter-added into ``pre[k]`` (``segment_sum``); ``autodiff``,
  JAX's transpose of the forward's gather (a scatter-add too); ``now``, a gather over
  each input's outgoing connections (``Connectivity.outgoing``), the weights gathered
  into its slices in the call; ``tables``, that gather of the weights alone (a value
  that does not change within a time loop, which XLA hoists out of it);
* ``dw`` ``dw[k] = Σ_r x[r, pre[k]] d[r, post[k]]`` over ``B`` rows and over a block of
  ``(K + 1)·B`` rows (ES-D-RTRL's block product, ``--block``): ``before``, the table
  gathered from ``x``'s columns per group of rows of at most 256 MiB; ``now``, rows of
  ``xᵀ`` gathered per connection.

Usage (one TPU v5e: ``N = 131,072``, ``B = 32``, seconds)::

    python benchmarks/_sparse_probe.py --out benchmarks/results
    python benchmarks/_sparse_probe.py --quick
"""

from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import jax
import jax.numpy as jnp
import numpy as np
from _models import environment, write_json
from _scale_ops import time_round_robin

from braintrace._primitives import _sparse_accelerator as accelerator
from braintrace._primitives._sparse import Connectivity
from braintrace._primitives._sparse_accelerator import _slice_weights

NAME = "sparse_probe"
FULL = {"neurons": 131072, "batch": 32, "degree": 8, "block": 3, "repeats": 20}
QUICK = {"neurons": 4096, "batch": 8, "degree": 8, "block": 3, "repeats": 3}
OLD_BUDGET = 256 * 2**20
"""The old formulation's bytes of gathered values per group of rows."""


def _padded(a: jax.Array) -> jax.Array:
    return jnp.concatenate([a, jnp.zeros((*a.shape[:-1], 1), a.dtype)], axis=-1)


def forward_before(x, weight, conn):
    """The old ``product``: the per-output table gathered from ``x``'s columns."""
    layout = conn.by_output
    x = _padded(x) if layout.padded else x
    rows = jnp.take(x.T, jnp.asarray(layout.pre), axis=0)  # (O, F, R)
    return jnp.sum(rows * layout.table(weight)[..., None], axis=1).T


def x_bar_before(ct, weight, conn):
    """The old ``transposed_product``: ``w[k]·ȳ[:, post[k]]`` scatter-added into ``pre[k]``."""
    spread = jnp.repeat(ct, conn.nnz // conn.num_out, axis=-1)
    return jax.ops.segment_sum((spread * weight).T, jnp.asarray(conn.pre),
                               num_segments=conn.num_in).T


def x_bar_autodiff(ct, weight, conn):
    """JAX's transpose of the forward's gather."""
    x = jnp.zeros((ct.shape[0], conn.num_in), ct.dtype)
    return jax.vjp(lambda x: forward_before(x, weight, conn), x)[1](ct)[0]


def dw_before(x, d, conn):
    """The old ``weight_pullback`` (connections in output order): the table gathered from
    ``x``'s columns, summed over groups of rows of at most :data:`OLD_BUDGET` bytes."""
    layout = conn.by_output
    inputs = jnp.asarray(layout.pre)
    tabled = lambda xr, dr: jnp.sum(jnp.take(xr, inputs, axis=-1) * dr[:, :, None], axis=0)
    rows = x.shape[0]
    group = max(1, min(rows, OLD_BUDGET // (layout.pre.size * x.dtype.itemsize)))
    if group >= rows:
        return tabled(x, d).reshape(-1)
    groups = -(-rows // group)
    pad = groups * group - rows
    xg = jnp.pad(x, ((0, pad), (0, 0))).reshape(groups, group, -1)
    dg = jnp.pad(d, ((0, pad), (0, 0))).reshape(groups, group, -1)
    total = jax.lax.fori_loop(0, groups, lambda g, acc: acc + tabled(xg[g], dg[g]),
                              jnp.zeros(layout.pre.shape, x.dtype))
    return total.reshape(-1)


def outgoing_tables(weight, conn):
    """The weights gathered into the outgoing slices, flat."""
    layout = conn.outgoing
    return jnp.concatenate([_slice_weights(weight, items, first).reshape(-1)
                            for items, first in zip(layout.items, layout.first, strict=True)])


def candidates(conn: Connectivity) -> dict:
    """``{sum: ({name: fn(a, b, w)}, argument kinds)}``; ``now`` is the reference."""
    return {
        "forward": ({"before": lambda x, d, w: forward_before(x, w, conn),
                     "now": lambda x, d, w: accelerator.product(x, w, conn)}, "x"),
        "x_bar": ({"before": lambda x, d, w: x_bar_before(d, w, conn),
                   "autodiff": lambda x, d, w: x_bar_autodiff(d, w, conn),
                   "now": lambda x, d, w: accelerator.transposed_product(d, w, conn),
                   "tables": lambda x, d, w: outgoing_tables(w, conn)}, "x"),
        "dw": ({"before": lambda x, d, w: dw_before(x, d, conn),
                "now": lambda x, d, w: accelerator.weight_pullback(x, d, conn)}, "x"),
        "dw_block": ({"before": lambda x, d, w: dw_before(x, d, conn),
                      "now": lambda x, d, w: accelerator.weight_pullback(x, d, conn)}, "block"),
    }


def measure(cfg: dict) -> dict:
    sys.path.insert(0, HERE)
    from scale import connectivity

    n = cfg["neurons"]
    conn = Connectivity.from_indices(*connectivity(n, cfg["degree"]), n, n)
    rng = np.random.default_rng(0)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape, np.float32))
    weight = normal(conn.nnz)
    out = {"config": cfg, "nnz": conn.nnz, "outgoing_slices": len(conn.outgoing.items),
           "outgoing_indices": conn.outgoing.indices, "incoming_indices": conn.incoming.indices}
    for name, (fns, kind) in candidates(conn).items():
        rows = cfg["batch"] * ((cfg["block"] + 1) if kind == "block" else 1)
        args = (normal(rows, n), normal(rows, n), weight)
        compiled = {k: jax.jit(f).lower(*args).compile() for k, f in fns.items()}
        times = time_round_robin(compiled, args, cfg["repeats"])
        reference = np.asarray(compiled["now"](*args))
        entry = {"rows": rows}
        for k, t in times.items():
            value = np.asarray(compiled[k](*args))
            same = value.shape == reference.shape
            entry[k] = {"ms_median": float(np.median(t)), "ms_min": float(np.min(t)),
                        "temp_bytes": int(compiled[k].memory_analysis().temp_size_in_bytes),
                        "max_rel_difference": float(np.max(np.abs(value - reference))
                                                    / np.max(np.abs(reference))) if same
                        else None}
        entry["before_over_now"] = entry["before"]["ms_median"] / entry["now"]["ms_median"]
        out[name] = entry
        print(f"{name:9s} rows={rows:4d} " + "  ".join(
            f"{k}={v['ms_median']:.3f}ms" for k, v in entry.items() if isinstance(v, dict))
            + f"  before/now={entry['before_over_now']:.2f}", flush=True)
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="4,096 neurons, seconds")
    p.add_argument("--neurons", type=int, default=None)
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--repeats", type=int, default=None)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    args = p.parse_args(argv)
    cfg = dict(QUICK if args.quick else FULL)
    cfg.update({k: v for k, v in (("neurons", args.neurons), ("batch", args.batch),
                                  ("repeats", args.repeats)) if v is not None})
    payload = {"benchmark": NAME, "environment": environment(), **measure(cfg)}
    write_json(os.path.join(args.out, f"{NAME}.json"), payload)
    return payload


if __name__ == "__main__":
    main()
