"""The D-RTRL trace is updated in place inside the fused scan.

The trace is the one large buffer of an online step (``B·|θ|·S`` numbers). If
XLA copies it inside the scan's loop body, every step pays extra passes over it
(before the per-state layout, seven passes instead of three: 6-8× BPTT's step
time). This checks the optimised HLO of ``etrace_grad``: with one state per
neuron (LIF), no ``copy`` of a trace-sized array inside the while loop. With
two coupled states (ALIF) each state's new trace reads both old ones, so XLA
copies each old trace once before overwriting it (XLA:CPU does not fuse the
two updates into one loop); more than that would be a regression. Speed itself
is measured by ``benchmarks/throughput.py``, not here.
"""

import collections
import re

import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import braintrace
from braintrace import layers


class TwoLayer(nnx.Module):
    def __init__(self, neuron, rngs):
        self.l1 = layers.RecurrentSpiking(6, neuron(24), rngs=rngs)
        self.readout = layers.LeakyReadout(24, 3, rngs=rngs)

    def __call__(self, x):
        return self.readout(self.l1(x))


def computation(hlo: str, name: str) -> str:
    """The text of the HLO computation called ``name`` (with its ``%``)."""
    match = re.search(rf"^(ENTRY )?{re.escape(name)} .*?^}}", hlo, re.DOTALL | re.MULTILINE)
    assert match, name
    return match.group(0)


def loop_body(hlo: str) -> str:
    """The body of the scan over time: the one while loop of the entry computation."""
    entry = re.search(r"^ENTRY (%[\w.\-]+)", hlo, re.MULTILINE).group(1)
    bodies = re.findall(r"body=(%[\w.\-]+)", computation(hlo, entry))
    assert len(bodies) == 1, bodies
    return computation(hlo, bodies[0])


def array_copies(body: str) -> list[tuple[int, ...]]:
    """Shapes of the arrays copied by ``copy`` instructions in ``body``."""
    shapes = re.findall(r"= \w+\[([\d,]*)\]\{[\d,]*\} copy\(", body)
    return [tuple(int(d) for d in s.split(",") if d) for s in shapes]


@pytest.mark.parametrize("block_size", [1, 2], ids=["per_step", "blocked"])
@pytest.mark.parametrize(("neuron", "copies_per_trace"), [(layers.LIF, 0), (layers.ALIF, 1)],
                         ids=["lif_S1", "alif_S2"])
def test_drtrl_trace_copies_inside_the_scan(neuron, copies_per_trace, block_size):
    """Per step the loop is the scan over time; blocked, the scan over blocks (T = 6 = 3·2).

    A block reads its entering trace twice (its contraction and its update)
    before writing it, so XLA may copy each trace once per block: one pass
    over the trace per ``K`` steps, where the per-step form must not copy at all.
    """
    batch = 4
    model = TwoLayer(neuron, nnx.Rngs(0))
    xs = jnp.ones((6, batch, 6))
    ys = jnp.zeros((6, batch, 3))
    learner = braintrace.compile(model, "d_rtrl", xs[0], batch_size=batch)
    traces = collections.Counter(leaf.shape for leaf in jax.tree.leaves(learner.traces)
                                 if leaf.size > 24 * 6)
    assert traces, "expected weight-sized traces"

    def mse(y, t):
        return jnp.mean((y - t) ** 2)

    hlo = learner.lower_etrace_grad(xs, ys, mse, block_size=block_size).compile().as_text()
    copied = collections.Counter(array_copies(loop_body(hlo)))
    allowed = copies_per_trace + (block_size > 1)
    for shape, leaves in traces.items():
        assert copied[shape] <= allowed * leaves, (
            f"{copied[shape]} copies of {leaves} trace arrays of shape {shape} inside the scan")
    # The parser does see copies: those the entry computation makes of the traces (into
    # the loop's own buffers) are found.
    assert set(traces) <= set(array_copies(hlo))
