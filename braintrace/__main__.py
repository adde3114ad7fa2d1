"""``python -m braintrace``: train a spiking network online and compare it with BPTT.

A recurrent layer of adaptive LIF neurons with a leaky readout learns the
built-in :class:`~braintrace.tasks.SpikePatterns` task twice from the same
initialisation and the same batches: once with an online eligibility-trace
algorithm (``braintrace.compile`` + ``etrace_grad``), once with
backpropagation through time (``jax.grad`` through ``jax.lax.scan``). Both
take one Adam step per batch. The script prints each one's test accuracy and
loss, and the memory of one compiled training pass (every buffer XLA
allocates: the batch, Params, states, traces and temporaries). BPTT's grows
with the sequence length; an online algorithm's grows only by the batch's data.

Run ``python -m braintrace --help`` for the options.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._algorithms import ALGORITHMS
from braintrace._compiler import split_model
from braintrace.tasks import Batch, SpikePatterns, accuracy

FULL = {"seq_len": 100, "hidden": 64, "steps": 150, "batch_size": 32}
QUICK = {"seq_len": 20, "hidden": 16, "steps": 4, "batch_size": 8}
EVAL_BATCH = 256


class SpikingNet(nnx.Module):
    """ALIF neurons with recurrent connections and a leaky-integrator readout."""

    def __init__(self, num_inputs: int, hidden: int, num_classes: int, *, rngs: nnx.Rngs):
        neurons = layers.ALIF(hidden, tau=20.0, tau_a=100.0)
        self.recurrent = layers.RecurrentSpiking(num_inputs, neurons, rngs=rngs)
        self.readout = layers.LeakyReadout(hidden, num_classes, tau=10.0, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.readout(self.recurrent(x))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of one step."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def _scan_model(model: nnx.Module, batch_size: int) -> Callable:
    """``run(params, xs) -> outputs``: the model from fresh hidden state over ``xs``."""
    model = nnx.clone(model)
    braintrace.init_states(model, batch_size)
    graphdef, _, hidden, other = split_model(model)

    def run(params, xs):
        def body(h, x):
            m = nnx.merge(graphdef, params, h, other, copy=True)
            y = m(x)
            return split_model(m)[2], y

        return jax.lax.scan(body, hidden, xs)[1]

    return run


def _masked_loss(outputs: jax.Array, batch: Batch) -> jax.Array:
    losses = jax.vmap(cross_entropy)(outputs, batch.ys)
    return jnp.sum(losses * batch.mask) / jnp.sum(batch.mask)


def _bptt_grad_fn(model: nnx.Module, batch_size: int) -> Callable:
    """``grad(params, batch)`` of the masked sequence loss by BPTT, jitted."""
    run = _scan_model(model, batch_size)
    return jax.jit(jax.grad(lambda params, batch: _masked_loss(run(params, batch.xs), batch)))


def _memory(lowered: jax.stages.Lowered) -> int:
    """Bytes of every buffer of the compiled program: arguments, outputs and temporaries."""
    m = lowered.compile().memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def _train(name: str, model: nnx.Module, batches: Callable[[int], Batch], steps: int,
           grad_step: Callable[[Batch], Any], lr: float) -> float:
    from tqdm.auto import tqdm

    optimizer = nnx.Optimizer(model, optax.adam(lr), wrt=nnx.Param)
    start = time.perf_counter()
    for i in tqdm(range(steps), desc=f"{name:>16}", leave=False):
        optimizer.update(model, grad_step(batches(i)))
    return time.perf_counter() - start


def _format_bytes(n: int) -> str:
    for unit in ("B", "KiB", "MiB"):
        if n < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m braintrace",
        description="Train a recurrent spiking network online on a built-in spike-pattern "
                    "task and compare it with BPTT (same initialisation, same batches).")
    parser.add_argument("--algorithm", default="es_d_rtrl", choices=sorted(ALGORITHMS),
                        help="online learning algorithm (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, help=f"sequence length T (default: "
                        f"{FULL['seq_len']}, --quick: {QUICK['seq_len']})")
    parser.add_argument("--hidden", type=int, help=f"number of spiking neurons (default: "
                        f"{FULL['hidden']}, --quick: {QUICK['hidden']})")
    parser.add_argument("--steps", type=int, help=f"training steps, one batch each (default: "
                        f"{FULL['steps']}, --quick: {QUICK['steps']})")
    parser.add_argument("--batch-size", type=int, help=f"sequences per batch (default: "
                        f"{FULL['batch_size']}, --quick: {QUICK['batch_size']})")
    parser.add_argument("--lr", type=float, default=1e-2,
                        help="Adam learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the task, the weights and the batches (default: "
                             "%(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes for a smoke test (a few seconds after compilation)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in FULL:
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be a positive integer.")
    if args.seq_len < 12:
        parser.error("--seq-len must be at least 12 (a pattern period and a response period).")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the comparison and prints a table of the results."""
    args = parse_args(argv)
    response = max(args.seq_len // 6, 2)
    task = SpikePatterns(num_classes=10, num_inputs=20, seq_len=args.seq_len,
                         response_steps=response, density=0.2, seed=args.seed)
    train_key, test_key = jax.random.split(jax.random.key(args.seed))

    def batches(i: int) -> Batch:
        return task.sample(jax.random.fold_in(train_key, i), args.batch_size)

    test = task.sample(test_key, EVAL_BATCH)

    def new_model() -> SpikingNet:
        return SpikingNet(task.num_inputs, args.hidden, task.num_classes,
                          rngs=nnx.Rngs(args.seed))

    print(f"braintrace {braintrace.__version__}: online learning vs BPTT")
    print(f"task:  SpikePatterns, {task.num_classes} classes of {task.num_inputs}-channel spike "
          f"trains, T={task.seq_len}, answer in the last {task.response_steps} steps")
    print(f"model: RecurrentSpiking(ALIF, {args.hidden} neurons) -> LeakyReadout"
          f"({task.num_classes}); {args.steps} Adam steps (lr {args.lr}) on batches of "
          f"{args.batch_size}, seed {args.seed}")

    results = {}

    # Online: eligibility traces, one forward pass, memory independent of T.
    model = new_model()
    example = jnp.zeros((args.batch_size, task.num_inputs))
    learner = braintrace.compile(model, args.algorithm, example, batch_size=args.batch_size)

    def online_grad(batch: Batch) -> nnx.State:
        learner.reset()
        return learner.etrace_grad(batch.xs, batch.ys, cross_entropy, mask=batch.mask)

    seconds = _train(learner.algorithm.name, model, batches, args.steps, online_grad, args.lr)
    first = batches(0)
    memory = _memory(learner.lower_etrace_grad(first.xs, first.ys, cross_entropy,
                                               mask=first.mask))
    results[learner.algorithm.name] = (model, memory, seconds)

    # BPTT: the exact gradient, storing every step for the backward pass.
    model = new_model()
    bptt_grad = _bptt_grad_fn(model, args.batch_size)

    def offline_grad(batch: Batch) -> nnx.State:
        return bptt_grad(nnx.state(model, nnx.Param), batch)

    seconds = _train("bptt", model, batches, args.steps, offline_grad, args.lr)
    memory = _memory(bptt_grad.lower(nnx.state(model, nnx.Param), first))
    results["bptt"] = (model, memory, seconds)

    print(f"{'method':<16}{'test accuracy':>15}{'test loss':>11}{'memory':>12}{'time':>9}")
    for name, (model, memory, seconds) in results.items():
        outputs = jax.jit(_scan_model(model, EVAL_BATCH))(nnx.state(model, nnx.Param), test.xs)
        print(f"{name:<16}{float(accuracy(outputs, test)):>15.3f}"
              f"{float(_masked_loss(outputs, test)):>11.3f}{_format_bytes(memory):>12}"
              f"{seconds:>8.1f}s")
    data = sum(a.nbytes for a in first)
    print(f"chance accuracy {1 / task.num_classes:.3f}; memory: all buffers of one compiled "
          f"training pass (the gradient of one batch, whose data take {_format_bytes(data)}); "
          "time: training including compilation")


if __name__ == "__main__":
    main()
