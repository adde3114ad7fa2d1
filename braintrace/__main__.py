"""``python -m braintrace``: online learning against BPTT as the sequences grow.

A recurrent layer of adaptive LIF neurons with a leaky readout learns the
built-in :class:`~braintrace.tasks.SpikePatterns` task at several sequence
lengths ``T`` (100, 1,000 and 10,000 steps by default). At each length the
same network, from the same initialisation, sees the same batches twice: once
trained with an online eligibility-trace algorithm (ES-D-RTRL by default),
once with backpropagation through time (``braintrace.BPTT()``). Both go
through the code a Flax user writes: ``braintrace.compile``, then
``braintrace.online_grad`` inside one ``@nnx.jit`` train step with an
``nnx.Optimizer`` (Adam), then ``braintrace.evaluate`` on a test set.

The online method takes each batch as a stream, in chunks of ``--chunk`` steps
(100 by default): each chunk is put on the device on its own and the train
step is called once per chunk, with the hidden states and traces carried from
one chunk to the next. ``optax.MultiSteps`` sums the chunks' gradients into one
Adam update per batch, so both methods follow the gradient of the same loss
(the mean over the scored steps of the whole sequence), one update per batch.
BPTT, which needs the whole sequence for its backward pass, takes it in one
call.

Per length and method the job prints the test accuracy and loss, the steps of
one call of the train step, the memory of that compiled call (every buffer XLA
allocates for it: the call's data, Params, Adam's state, hidden states, traces
and temporaries) and its data, the time of one training step (one batch, one
update) after compilation, and the compilation time apart. The online train
step is the same program at every length, so its memory does not grow with
``T``; BPTT's grows with ``T``, because it stores every step for the backward
pass. Where BPTT's train step would exceed the memory budget
(``--memory-budget``), it is compiled (to measure it; lowering needs no data)
but not trained. A log-log plot of memory and time per training step against
``T`` is written as a PNG.

Run ``python -m braintrace --help`` for the options.
"""

from __future__ import annotations

import argparse
import statistics
import textwrap
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._algorithms import ALGORITHMS
from braintrace._main_report import HEADER, Result, footnote, format_row, plot, summary
from braintrace.tasks import Batch, SpikePatterns, accuracy

FULL = {"lengths": (100, 1_000, 10_000), "hidden": 64, "steps": 40, "batch_size": 32,
        "chunk": 100, "memory_budget": 256.0}
QUICK = {"lengths": (32, 640), "hidden": 16, "steps": 3, "batch_size": 8, "chunk": 32,
         "memory_budget": 1.5}
RESPONSE_STEPS = 20
"""Steps at the end of each sequence in which the class is scored (fewer for short T)."""
TEST_SIZE = 256
"""Sequences in the test set (at least; in batches of the training batch size)."""
MIN_LENGTH = 12


class SpikingNet(nnx.Module):
    """ALIF neurons with recurrent connections and a leaky-integrator readout."""

    def __init__(self, num_inputs: int, hidden: int, num_classes: int, *, rngs: nnx.Rngs):
        neurons = layers.ALIF(hidden, tau=20.0, tau_a=100.0)
        self.recurrent = layers.RecurrentSpiking(num_inputs, neurons, rngs=rngs)
        self.readout = layers.LeakyReadout(hidden, num_classes, tau=10.0, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        """One time step: spikes in, class logits out."""
        return self.readout(self.recurrent(x))


def cross_entropy(logits: jax.Array, labels: jax.Array) -> jax.Array:
    """Mean softmax cross-entropy of one step."""
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def make_train_step(online: braintrace.OnlineGradient) -> Callable:
    """The user's train step: ``online.grad`` of a chunk, then ``optimizer.update``.

    The same code serves every algorithm, BPTT included; only ``online`` and the
    optimizer differ (the online method's sums its chunks' gradients, see
    :func:`make_optimizer`).
    """

    @nnx.jit
    def train_step(model, optimizer, state, xs, ys, mask):
        grads, state, stats = online.grad(model, state, xs, ys, mask=mask)
        optimizer.update(model, grads)
        return state, stats.losses

    return train_step


def make_optimizer(model: nnx.Module, lr: float, calls: int) -> nnx.Optimizer:
    """Adam, one update per batch of ``calls`` train-step calls (a batch's chunks).

    ``optax.MultiSteps`` sums the gradients of the ``calls`` chunks and applies Adam
    once, to their sum, after the last (the updates of the calls before it are zero):
    the gradient of the whole sequence, as BPTT's single call gives it.
    """
    tx = optax.MultiSteps(optax.adam(lr), every_k_schedule=calls, use_grad_mean=False)
    return nnx.Optimizer(model, tx.gradient_transformation(), wrt=nnx.Param)


def _memory(compiled: Any) -> int:
    """Bytes of every buffer of a compiled program: arguments, outputs and temporaries."""
    m = compiled.memory_analysis()
    return int(m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
               - m.alias_size_in_bytes)


def make_task(length: int, seed: int) -> SpikePatterns:
    """The spike-pattern task at one length (the same class templates at every length)."""
    response = min(RESPONSE_STEPS, max(length // 6, 2))
    return SpikePatterns(num_classes=10, num_inputs=20, seq_len=length,
                         response_steps=response, density=0.2, seed=seed)


def chunks(batch: Batch, size: int) -> Iterator[tuple[jax.Array, jax.Array, jax.Array]]:
    """A host batch's consecutive chunks of ``size`` steps, each put on the device alone.

    Each chunk is ``(xs, ys, weights)``: the mask divided by its sum over the whole
    sequence, so that the ``'sum'`` of the chunks' weighted losses is the mean loss of
    the scored steps. A last chunk shorter than ``size`` is padded with unscored steps
    (zero inputs, weight 0), so that every call has the same shapes
    (``tests/test_main.py`` shows it on a small batch).
    """
    xs, ys, mask = batch
    weights = np.asarray(mask, np.float32) / np.sum(mask, dtype=np.float32)
    for start in range(0, len(mask), size):
        parts = [a[start:start + size] for a in (xs, ys, weights)]
        pad = size - len(parts[2])
        if pad:
            parts = [np.pad(a, [(0, pad)] + [(0, 0)] * (a.ndim - 1)) for a in parts]
        yield jax.device_put(tuple(parts))


class Method(NamedTuple):
    """One method made ready to train at one length: model, optimizer, compiled step."""

    model: nnx.Module
    online: braintrace.OnlineGradient
    optimizer: nnx.Optimizer
    train_step: Callable
    result: Result


def prepare(algorithm: str | braintrace.AbstractAlgorithm, length: int,
            args: argparse.Namespace) -> Method:
    """Builds the model, its train step and optimizer, and compiles one call (no data).

    The online method's call takes ``args.chunk`` steps (at most ``length``), BPTT's
    the whole sequence.
    """
    task = make_task(length, args.seed)
    model = SpikingNet(task.num_inputs, args.hidden, task.num_classes,
                       rngs=nnx.Rngs(args.seed))
    example = jnp.zeros((args.batch_size, task.num_inputs))
    learner = braintrace.compile(model, algorithm, example, batch_size=args.batch_size)
    online = braintrace.online_grad(learner, cross_entropy, reduction="sum")
    chunk = length if learner.algorithm.name == "bptt" else min(args.chunk, length)
    optimizer = make_optimizer(model, args.lr, -(-length // chunk))
    train_step = make_train_step(online)

    # Lowering needs only shapes: BPTT's memory is known before any data is made.
    whole = jax.eval_shape(lambda: task.sample(jax.random.key(0), args.batch_size))
    shapes = [jax.ShapeDtypeStruct((chunk, *a.shape[1:]), a.dtype) for a in whole]
    start = time.perf_counter()
    compiled = train_step.lower(model, optimizer, online.init(model), *shapes).compile()
    result = Result(length, learner.algorithm.name, chunk, _memory(compiled),
                    sum(a.size * a.dtype.itemsize for a in shapes),
                    time.perf_counter() - start)
    return Method(model, online, optimizer, train_step, result)


def _train(method: Method, batches: Callable[[int], Batch], steps: int, desc: str) -> float:
    """Trains for ``steps`` batches; the median seconds of one (compiled already)."""
    from tqdm.auto import tqdm

    seconds = []
    for i in tqdm(range(steps), desc=desc, leave=False):
        batch = batches(i)  # on the host
        state = method.online.init(method.model)  # independent sequences: fresh state
        start = time.perf_counter()
        for xs, ys, weights in chunks(batch, method.result.chunk):
            state, _ = method.train_step(method.model, method.optimizer, state, xs, ys, weights)
        jax.block_until_ready(state)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


@jax.jit
def _scores(outputs: jax.Array, batch: Batch) -> tuple[jax.Array, jax.Array]:
    """Accuracy and masked mean cross-entropy of one batch's outputs."""
    losses = jax.vmap(cross_entropy)(outputs, batch.ys)
    return accuracy(outputs, batch), jnp.sum(losses * batch.mask) / jnp.sum(batch.mask)


def _test(model: nnx.Module, test: Callable[[int], Batch], count: int) -> tuple[float, float]:
    """Test accuracy and loss (means over ``count`` test batches), from fresh hidden states.

    The batches are drawn again for each model, one at a time: a long test set is
    never held in memory whole.
    """
    model.eval()
    scores = []
    for j in range(count):
        batch = jax.device_put(test(j))
        outputs = braintrace.evaluate(model, batch.xs, batch_size=batch.xs.shape[1])
        scores.append([float(s) for s in _scores(outputs, batch)])
    return statistics.fmean(s[0] for s in scores), statistics.fmean(s[1] for s in scores)


def run_method(algorithm: str | braintrace.AbstractAlgorithm, length: int,
               args: argparse.Namespace, batches: Callable[[int], Batch],
               test: Callable[[int], Batch]) -> Result:
    """Compiles, measures, trains (within the memory budget) and tests one method."""
    method = prepare(algorithm, length, args)
    result = method.result
    if result.memory > args.memory_budget * 2**20:
        return result
    step_s = _train(method, batches, args.steps, f"T={length} {result.method}")
    test_accuracy, test_loss = _test(method.model, test, -(-TEST_SIZE // args.batch_size))
    return result._replace(step_s=step_s, accuracy=test_accuracy, loss=test_loss)


def _host_device() -> jax.Device | None:
    """The CPU device, where the batches are drawn; ``None`` (the default device) where JAX
    was started without its CPU backend (``JAX_PLATFORMS=tpu``)."""
    try:
        return jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        return None


def run_length(length: int, args: argparse.Namespace) -> list[Result]:
    """Both methods at one length, on the same batches and the same test set.

    The batches are drawn on the host's CPU and kept there: the online method puts
    one chunk at a time on the device, BPTT the whole batch.
    """
    host = _host_device()
    sample = jax.jit(make_task(length, args.seed).sample, static_argnums=1)
    train_key, test_key = jax.random.split(jax.random.key(args.seed))

    def draw(key: jax.Array) -> Batch:
        with jax.default_device(host):
            return Batch(*map(np.asarray, sample(jax.device_put(key, host), args.batch_size)))

    def batches(i: int) -> Batch:
        return draw(jax.random.fold_in(train_key, i))

    def test(j: int) -> Batch:
        return draw(jax.random.fold_in(test_key, j))

    return [run_method(algorithm, length, args, batches, test)
            for algorithm in (args.algorithm, braintrace.BPTT())]


def _lengths(text: str) -> tuple[int, ...]:
    """``'100,1000'`` -> ``(100, 1000)``, sorted, without repeats."""
    try:
        values = {int(part) for part in text.split(",")}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}") from None
    if min(values) < MIN_LENGTH:
        raise argparse.ArgumentTypeError(
            f"every length must be at least {MIN_LENGTH} (a pattern period and a response "
            f"period), got {text!r}")
    return tuple(sorted(values))


def _sizes(key: str) -> str:
    """The full and ``--quick`` defaults of an option, for its help."""
    full, quick = FULL[key], QUICK[key]
    if key == "lengths":
        full, quick = ",".join(map(str, full)), ",".join(map(str, quick))
    return f"(default: {full}, --quick: {quick})"


COLUMNS = """\
the table it prints, one row per length and method:
  T              the sequence length
  method         the online algorithm (--algorithm), then bptt
  test acc       accuracy on the test set, the class read over the scored steps
  test loss      cross-entropy on the test set, mean over the scored steps
  chunk          time steps per call of the train step: the online method takes each
                 batch as a stream of chunks, its hidden states and traces carried from
                 call to call, and optax.MultiSteps sums the chunks' gradients into one
                 Adam update per batch; bptt takes the whole sequence in one call
  memory         every buffer XLA allocates for one compiled call of the train step: its
                 data, the Params, Adam's state, hidden states, traces, temporaries
  data           one call's inputs, labels and mask
  time/step      median time of one training step (a batch: all its calls, one update),
                 after compilation; '-' where the method was not trained
  compile        seconds to lower and compile the train step, once per length and method
  (over budget)  its memory exceeds --memory-budget: compiled to measure it, not trained"""
"""The help's description of the printed table's columns."""


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options, with the full or ``--quick`` sizes as defaults."""
    parser = argparse.ArgumentParser(
        prog="python -m braintrace",
        description=textwrap.fill(
            "Train a recurrent spiking network on a built-in spike-pattern task online (the "
            "sequence streamed in chunks) and with BPTT (same initialisation, same batches) at "
            "growing sequence lengths; print accuracy, memory and time per training step, and "
            "plot them.", width=79),
        epilog=COLUMNS, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--algorithm", default="es_d_rtrl",
                        choices=sorted(set(ALGORITHMS) - {"bptt"}),
                        help="online learning algorithm (default: %(default)s)")
    parser.add_argument("--lengths", type=_lengths,
                        help=f"comma-separated sequence lengths T {_sizes('lengths')}")
    parser.add_argument("--hidden", type=int, help=f"number of spiking neurons {_sizes('hidden')}")
    parser.add_argument("--steps", type=int,
                        help=f"training steps per length, one batch each {_sizes('steps')}")
    parser.add_argument("--batch-size", type=int,
                        help=f"sequences per batch {_sizes('batch_size')}")
    parser.add_argument("--chunk", type=int,
                        help="time steps per call of the online method's train step; BPTT "
                             f"takes the whole sequence {_sizes('chunk')}")
    parser.add_argument("--memory-budget", type=float, metavar="MIB",
                        help="MiB a train step may take; BPTT is not trained beyond it "
                             f"{_sizes('memory_budget')}")
    parser.add_argument("--lr", type=float, default=1e-2,
                        help="Adam learning rate (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0,
                        help="seed of the task, the weights and the batches (default: "
                             "%(default)s)")
    parser.add_argument("--plot", default="braintrace_main.png", metavar="PATH",
                        help="where to write the plot, a PNG (default: %(default)s)")
    parser.add_argument("--quick", action="store_true",
                        help="tiny sizes for a smoke test (seconds after compilation)")
    args = parser.parse_args(argv)
    for key, value in (QUICK if args.quick else FULL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    for key in ("hidden", "steps", "batch_size", "chunk"):
        if getattr(args, key) < 1:
            parser.error(f"--{key.replace('_', '-')} must be a positive integer.")
    if not args.memory_budget > 0:
        parser.error("--memory-budget must be positive (MiB).")
    return args


def main(argv: Sequence[str] | None = None) -> None:
    """Runs the comparison, prints the table and the closing sentence, writes the plot."""
    args = parse_args(argv)
    task = make_task(args.lengths[0], args.seed)
    lengths = ", ".join(f"{t:,}" for t in args.lengths)
    print(f"braintrace {braintrace.__version__}: online learning ({args.algorithm}) vs BPTT "
          f"as the sequences grow")
    print(f"task:  SpikePatterns, {task.num_classes} classes of {task.num_inputs}-channel "
          f"spike trains, T = {lengths}, answer in the last {RESPONSE_STEPS} steps (T/6 if "
          "shorter)")
    print(f"model: RecurrentSpiking(ALIF, {args.hidden} neurons) -> LeakyReadout"
          f"({task.num_classes}); {args.steps} Adam steps (lr {args.lr}) per length and "
          f"method on batches of {args.batch_size}, seed {args.seed}; test set "
          f"{-(-TEST_SIZE // args.batch_size) * args.batch_size}")
    print(f"memory budget: {args.memory_budget:g} MiB per call of the train step (BPTT is "
          "not trained beyond it)")
    print(HEADER)
    results = []
    for length in args.lengths:
        for result in run_length(length, args):
            results.append(result)
            print(format_row(result), flush=True)
    plot(results, args.memory_budget, args.plot)
    print(textwrap.fill(f"chance accuracy {1 / task.num_classes:.3f}; {footnote(results)}",
                        width=100))
    print(f"plot: {args.plot}")
    print(textwrap.fill(summary(results, args.memory_budget), width=100))


if __name__ == "__main__":
    main()
