"""Data-parallel online learning over several processes (hosts) with ``jax.distributed``.

Run one process per host; here, two processes on this machine (CPU, gloo collectives)::

    python benchmarks/multihost_example.py --process-id 0 --num-processes 2 --port 12355 &
    python benchmarks/multihost_example.py --process-id 1 --num-processes 2 --port 12355

Every process runs the same program. The mesh spans the devices of all
processes; each process feeds only its local part of the batch (the rows
``[process_id * B/P, (process_id + 1) * B/P)`` of the global batch) and
braintrace assembles the global arrays with
``jax.make_array_from_process_local_data``. Gradients are summed across
processes by XLA; Params and the optimiser state stay replicated, so every
process ends with the same Params. With ``--neuron-devices K`` the mesh is
``(devices / K, K)`` over ``('data', 'neuron')``: the hidden units are split over
the ``K`` devices of each process too (``neuron_axis='neuron'``). With ``--out``, process 0 writes them to an
``.npz`` file; with ``--checkpoint``, all processes write one orbax checkpoint.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.experimental import multihost_utils

import braintrace
from braintrace import layers

BATCH, INPUTS, HIDDEN, OUTPUTS, STEPS, SEQUENCES = 8, 3, 16, 2, 8, 3


def make_model() -> nnx.Module:
    """A GRU and a linear readout, the same on every process (fixed seeds)."""
    return nnx.Sequential(layers.Stateful(layers.GRUCell(INPUTS, HIDDEN, rngs=nnx.Rngs(0))),
                          layers.ETPLinear(HIDDEN, OUTPUTS, rngs=nnx.Rngs(1)))


def global_batches() -> list[tuple[np.ndarray, np.ndarray]]:
    """The whole data set (every process can make it; each uses only its rows)."""
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(SEQUENCES):
        xs = rng.normal(size=(STEPS, BATCH, INPUTS)).astype(np.float32)
        ys = np.cumsum(xs[..., :OUTPUTS], axis=0).astype(np.float32) / 4
        batches.append((xs, ys))
    return batches


def mse(y: jax.Array, t: jax.Array) -> jax.Array:
    return jnp.mean((y - t) ** 2)


def train(mesh: jax.sharding.Mesh | None, rows: slice,
          neuron_axis: str | None = None) -> braintrace.OnlineTrainer:
    """Online training on ``mesh``, feeding the batch ``rows`` of this process."""
    learner = braintrace.compile(make_model(), "d_rtrl", jnp.ones((BATCH, INPUTS)),
                                 batch_size=BATCH, mesh=mesh, neuron_axis=neuron_axis)
    trainer = braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=mse, update_every=4)
    for xs, ys in global_batches():
        learner.reset()
        trainer.step(xs[:, rows], ys[:, rows])
    return trainer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--process-id", type=int, required=True)
    parser.add_argument("--num-processes", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--local-devices", type=int, default=1)
    parser.add_argument("--neuron-devices", type=int, default=None,
                        help="split the hidden units over this many devices of each process")
    parser.add_argument("--out", default=None, help="process 0 writes the final Params here")
    parser.add_argument("--checkpoint", default=None, help="an orbax checkpoint directory")
    args = parser.parse_args()

    jax.config.update("jax_num_cpu_devices", args.local_devices)
    jax.distributed.initialize(coordinator_address=f"localhost:{args.port}",
                               num_processes=args.num_processes, process_id=args.process_id)
    k = args.neuron_devices
    mesh = (jax.make_mesh((jax.device_count(),), ("data",)) if k is None
            else jax.make_mesh((jax.device_count() // k, k), ("data", "neuron")))
    local = BATCH // jax.process_count()
    rows = slice(jax.process_index() * local, (jax.process_index() + 1) * local)
    trainer = train(mesh, rows, None if k is None else "neuron")
    if args.checkpoint:
        trainer.save(args.checkpoint)
    params = [np.asarray(multihost_utils.process_allgather(p, tiled=True))
              for p in trainer.learner.leaves().params]
    if args.out and jax.process_index() == 0:
        np.savez(args.out, *params)
    print(f"process {jax.process_index()}/{jax.process_count()}: {jax.device_count()} devices, "
          f"Param norm {sum(float(np.sum(p ** 2)) for p in params) ** 0.5:.6f}")
    jax.distributed.shutdown()


if __name__ == "__main__":
    main()
