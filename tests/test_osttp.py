"""OSTTP: OSTL's traces, the hidden layers' learning signal a fixed random projection of the target.

The oracle is float64 BPTT of two objectives, written with Flax alone: each hidden layer's
Params get the gradient of ``Σ_t w_t ⟨z^t, y*^t B⟩`` through the layer's own dynamics
(``z^t`` the input of the ETP operation reading the layer, ``B`` the rule's matrix), the output
layer's Params the gradient of the loss. Where the traces are exact (leaky or spiking
layers without recurrent weights) OSTTP equals that oracle to 1e-8, on every ETP primitive,
time-blocked and per step; on a single layer the loss reads it equals BPTT.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import bptt_grads, built_on_the_host, mse
from test_gradient_contract import assert_live, relative_errors

import braintrace
from braintrace import layers

F64 = jnp.float64
B, IN, OUT, T = 2, 4, 3, 3
SPARSE = np.random.default_rng(0).random((IN, 3)) < 0.6
KERNEL0 = "['layers'][0]['kernel'].value"


@pytest.fixture(autouse=True)
def x64():
    with jax.enable_x64(True):
        yield


def _random_hidden(model, seed=5):
    braintrace.init_states(model, B)
    for k, (_, node) in enumerate(nnx.iter_graph(model)):
        if isinstance(node, braintrace.HiddenState):
            node.set_value(0.5 * jax.random.normal(jax.random.key(seed + k), node.shape, F64))
    return model


@built_on_the_host
class Drives(nnx.Module):
    """Every ETP primitive driving a leaky state of its own, ``h_k' = a_k h_k + drive_k(x)``
    (the dense state's decay a learned elementwise operation); one ``ETPLinear`` reads
    ``tanh`` of them all."""

    def __init__(self):
        kw = {"param_dtype": F64}
        lora = layers.ETPLoRALinear(IN, 3, lora_rank=2, lora_param_dtype=F64, rngs=nnx.Rngs(1),
                                    **kw)
        lora.lora.lora_b.set_value(jax.random.normal(jax.random.key(9), (2, 3), F64))
        self.drives = nnx.List([
            layers.ETPLinear(IN, 3, rngs=nnx.Rngs(0), **kw),
            lora,
            layers.ETPConv(1, 2, (2,), rngs=nnx.Rngs(2), **kw),
            layers.ETPSparseLinear(IN, 3, connectivity=SPARSE, rngs=nnx.Rngs(3), **kw),
            layers.ETPEmbed(5, 3, rngs=nnx.Rngs(4), **kw),
            layers.ETPEinsum("bd,dhk->bhk", (IN, 2, 2), (2, 2), rngs=nnx.Rngs(5), **kw),
            layers.ETPGroupedLinear(IN, 4, 2, rngs=nnx.Rngs(6), **kw)])
        self.decay = layers.ETPElemwise(jnp.zeros((3,)), jax.nn.sigmoid, **kw)
        self.shapes = ((3,), (3,), (IN, 2), (3,), (3,), (2, 2), (4,))
        self.h = nnx.List([braintrace.HiddenState(jnp.zeros(s, F64)) for s in self.shapes])
        self.out = layers.ETPLinear(sum(int(np.prod(s)) for s in self.shapes), OUT,
                                    rngs=nnx.Rngs(7), **kw)

    def features(self, x):
        """The new states, ``tanh``-ed and concatenated: the input of ``out``."""
        inputs = (x, x, x[..., None], x, (x[..., 0] > 0).astype(jnp.int32) + 2, x, x)
        found = []
        for k, (drive, h, u) in enumerate(zip(self.drives, self.h, inputs, strict=True)):
            decay = self.decay() if k == 0 else 0.7
            h[...] = decay * h[...] + drive(u)
            found.append(jnp.tanh(h[...]).reshape(x.shape[0], -1))
        return jnp.concatenate(found, axis=-1)

    def __call__(self, x):
        return self.out(self.features(x))


class Split(nnx.Module):
    """``model`` as ``x -> (readout(sg(z)), z)``: its hidden layers' output ``z = hidden(x)``
    and its output layer, the derivative between them cut."""

    def __init__(self, model, hidden, readout):
        self.model = model
        self.hidden = hidden
        self.readout = readout

    def __call__(self, x):
        z = self.hidden(self.model, x)
        return self.readout(self.model, jax.lax.stop_gradient(z)), z


def oracle(model, learner, xs, targets, y_star, weights, per_sample, hidden, readout):
    """BPTT of ``Σ_{t,b} w_tb (ℓ(y_tb, target_tb) + ⟨z_tb, y*_tb B⟩)`` with ``y`` the output
    layer's on ``sg(z)`` (``B`` the rule's matrix): the output layer's Params get the loss's
    gradient, the hidden layers' that of the projection. By path."""
    (matrix,) = learner.rules.learning_signal.matrices

    def objective(out, target):
        (y, z), (labels, y_star, w) = out, target
        return jnp.sum(w * (per_sample(y, labels) + jnp.sum(z * (y_star @ matrix), axis=-1)))

    grads = bptt_grads(Split(model, hidden, readout), xs, (targets, y_star, weights),
                       loss_fn=objective)
    return {jax.tree_util.keystr(p)[len("['model']"):]: np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(grads)[0]}


def flat(state):
    return {jax.tree_util.keystr(p): np.asarray(v)
            for p, v in jax.tree_util.tree_flatten_with_path(state)[0]}


def test_osttp_equals_the_projected_target_oracle_on_every_primitive():
    model = _random_hidden(Drives())
    xs = jax.random.normal(jax.random.key(1), (T, B, IN), F64)
    ys = jax.random.normal(jax.random.key(2), (T, B, OUT), F64)
    learner = braintrace.compile(model, "osttp", xs[0])
    kinds = {r.primitive.name for r in learner.graph.relations}
    assert kinds == {"etp_dense_batched", "etp_lora_batched", "etp_conv_batched",
                     "etp_sparse_batched", "etp_embed_batched", "etp_einsum_batched",
                     "etp_grouped_batched", "etp_elemwise"}
    weights = jnp.full((T, B), 1.0 / B, F64)  # reduction='sum' of a loss averaged over B
    want = oracle(model, learner, xs, ys, ys, weights,
                  lambda y, t: jnp.mean((y - t) ** 2, axis=-1), lambda m, x: m.features(x),
                  lambda m, z: m.out(z))
    assert all(np.max(np.abs(v)) > 1e-6 for v in want.values())
    # time-blocked (a block of 2 steps and one of 1); the per-step loop: the next test
    got = flat(learner.etrace_grad(xs, ys, mse, reduction="sum", block_size=2))
    errors = {k: np.max(np.abs(got[k] - want[k])) / np.max(np.abs(want[k])) for k in want}
    assert max(errors.values()) <= 1e-8, errors


@built_on_the_host
def spiking_net():
    model = nnx.Sequential(layers.ETPLinear(IN, 6, param_dtype=F64, rngs=nnx.Rngs(0)),
                           layers.LIF(6, tau=4.0, v_th=0.3, param_dtype=F64),
                           layers.LeakyReadout(6, OUT, tau=3.0, learn_tau=True, param_dtype=F64,
                                               rngs=nnx.Rngs(1)))
    return _random_hidden(model)


def class_loss(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()


def test_osttp_on_a_spiking_network_with_class_labels_and_a_per_sample_mask():
    """Integer labels become one-hot ``y*``; the readout state learns from its true error,
    the LIF layer from the projection through its surrogate derivative."""
    model = spiking_net()
    xs = 2.0 * jax.random.normal(jax.random.key(1), (T, B, IN), F64)
    labels = jnp.asarray([[0, 2], [1, 1], [2, 0]])
    mask = jnp.asarray([[1.0, 0.0], [1.0, 1.0], [0.0, 1.0]], F64)
    learner = braintrace.compile(model, "osttp", xs[0])
    weights = mask / B
    want = oracle(model, learner, xs, labels, jax.nn.one_hot(labels, OUT, dtype=F64), weights,
                  optax.softmax_cross_entropy_with_integer_labels,
                  lambda m, x: m.layers[1](m.layers[0](x)), lambda m, z: m.layers[2](z))
    assert_live(want)
    masked = lambda y, lw: jnp.sum(lw[1] * optax.softmax_cross_entropy_with_integer_labels(
        y, lw[0]))
    loss = flat(bptt_grads(model, xs, (labels, weights), loss_fn=masked))  # BPTT's
    got = flat(learner.etrace_grad(xs, labels, class_loss, mask=mask, reduction="sum",
                                   block_size=1))
    errors = {k: np.max(np.abs(got[k] - want[k])) / np.max(np.abs(want[k])) for k in want}
    assert max(errors.values()) <= 1e-8, errors
    # a negative control: the hidden layer's gradient is not the error's (BPTT's)
    assert np.max(np.abs(got[KERNEL0] - loss[KERNEL0])) > 1e-3 * np.max(np.abs(want[KERNEL0]))
    kinds = [a.kind for a in learner.algorithm.approximations(learner.graph)]
    assert "target-projection" in kinds
    with pytest.raises(ValueError, match=r"(?s)algorithm 'osttp'.*random projection"):
        braintrace.compile(spiking_net(), "osttp", xs[0], strict=True)


def test_a_centred_target_projects_the_one_hot_less_its_mean():
    """The docs' remedy for a spiking layer's drift, ``OSTTP(target=...)`` mapping labels to
    ``one_hot - 1/C``: the LIF layer learns from that target's projection, at every step."""
    model = spiking_net()
    xs = 2.0 * jax.random.normal(jax.random.key(1), (T, B, IN), F64)
    labels = jnp.asarray([[0, 2], [1, 1], [2, 0]])
    centred = lambda y: jax.nn.one_hot(y, OUT, dtype=F64) - 1.0 / OUT
    learner = braintrace.compile(model, braintrace.OSTTP(target=centred), xs[0])
    weights = jnp.full((T, B), 1.0 / (T * B), F64)  # reduction='mean', no mask
    parts = (optax.softmax_cross_entropy_with_integer_labels,
             lambda m, x: m.layers[1](m.layers[0](x)), lambda m, z: m.layers[2](z))
    want = oracle(model, learner, xs, labels, centred(labels), weights, *parts)
    one_hot = oracle(model, learner, xs, labels, jax.nn.one_hot(labels, OUT, dtype=F64),
                     weights, *parts)
    got = flat(learner.etrace_grad(xs, labels, class_loss, block_size=1))
    errors = {k: np.max(np.abs(got[k] - want[k])) / np.max(np.abs(want[k])) for k in want}
    assert max(errors.values()) <= 1e-8, errors
    # a negative control: the one-hot target's projection is another gradient
    scale = np.max(np.abs(want[KERNEL0]))
    assert np.max(np.abs(got[KERNEL0] - one_hot[KERNEL0])) > 1e-3 * scale


def test_osttp_is_bptt_on_a_single_layer_the_loss_reads():
    """No ETP operation reads the new state: nothing is projected, OSTL's traces are exact."""
    model = _random_hidden(layers.LeakyReadout(IN, OUT, tau=3.0, learn_tau=True,
                                               param_dtype=F64, rngs=nnx.Rngs(0)))
    xs = jax.random.normal(jax.random.key(1), (5, B, IN), F64)
    ys = jax.random.normal(jax.random.key(2), (5, B, OUT), F64)
    want = bptt_grads(model, xs, ys)
    learner = braintrace.compile(model, "osttp", xs[0], strict=True)
    assert not learner.rules.learning_signal.cut_inputs
    assert "approximations: none" in learner.report()
    errors = relative_errors(learner.etrace_grad(xs, ys, mse, reduction="sum"), want)
    assert max(errors.values()) <= 1e-8, errors


def test_the_target_must_be_shaped_like_the_output_or_be_class_labels():
    model = spiking_net()
    learner = braintrace.compile(model, braintrace.OSTTP(), jnp.zeros((B, IN), F64))
    xs = jnp.ones((2, B, IN), F64)
    with pytest.raises(ValueError, match=r"shaped like the model's output \(2, 3\).*"
                                         r"float64 \(2, 4\).*OSTTP\(target=fn\)"):
        learner.etrace_grad(xs, jnp.zeros((2, B, 4), F64), lambda y, t: jnp.mean(y))
    mapped = braintrace.OSTTP(target=lambda t: t[..., :OUT])  # the target mapped to y*
    learner = braintrace.compile(spiking_net(), mapped, jnp.zeros((B, IN), F64))
    learner.etrace_grad(xs, jnp.zeros((2, B, 4), F64), lambda y, t: jnp.mean(y))
    two = nnx.Sequential(layers.ETPLinear(IN, 3, rngs=nnx.Rngs(0)), layers.LIF(3),
                         layers.ETPLinear(3, 2, rngs=nnx.Rngs(1)), lambda y: (y, 2 * y))
    with pytest.raises(ValueError, match="returns 2 arrays"):
        braintrace.compile(two, "osttp", jnp.zeros((IN,)))
    with pytest.raises(TypeError, match="target must be a function"):
        braintrace.OSTTP(target="one_hot")


def test_osttp_in_the_trainer_fit_and_online_update_equals_an_update_per_window_by_hand():
    xs = 2.0 * jax.random.normal(jax.random.key(1), (2, 4, B, IN), F64)
    labels = jax.random.randint(jax.random.key(2), (2, 4, B), 0, OUT)
    tx = optax.adam(0.05)
    params = lambda model: [np.asarray(a) for a in jax.tree.leaves(nnx.state(model, nnx.Param))]
    model = spiking_net()
    learner = braintrace.compile(model, "osttp", xs[0, 0])
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    update = nnx.jit(lambda model, optimizer, grads: optimizer.update(model, grads))
    want = []
    for batch in range(2):  # by hand: an update per window of 2 steps; fit resets the state
        if batch:
            learner.reset()
        for window in (slice(0, 2), slice(2, 4)):
            update(model, optimizer, learner.etrace_grad(xs[batch, window],
                                                         labels[batch, window], class_loss,
                                                         block_size=1))
        want.append(params(model))

    def close(got, want):
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-12)

    model = spiking_net()
    trainer = braintrace.OnlineTrainer(braintrace.compile(model, "osttp", xs[0, 0]), tx,
                                       loss_fn=class_loss, update_every=2)
    trainer.step(xs[0], labels[0])
    close(params(model), want[0])
    trainer.fit([(xs[1], labels[1])], progress=False)  # from a reset state
    close(params(model), want[1])

    model = spiking_net()  # a user's nnx.jit step
    train = braintrace.online_update(braintrace.compile(model, "osttp", xs[0, 0]), class_loss,
                                     tx, update_every=2)
    opt_state, state = train.init(model)
    new, *_ = nnx.jit(train.update)(model, opt_state, state, xs[0], labels[0])
    nnx.update(model, new)
    close(params(model), want[0])
