"""Bad arguments and shapes that used to escape (issue 33, items 5, 6, 7, 10).

Each is now a clear error naming the argument (or the state's path) and what
to do, raised before anything changes: the learner works afterwards exactly
as before. NumPy integers are integers; a bool, a float or a string is not.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers

B, I, H, O = 3, 4, 5, 2


def mse(y, t):
    return jnp.mean((y - t) ** 2)


class LeakyNet(nnx.Module):
    """A hidden state of the model itself, without a layer's own shape checks."""

    def __init__(self, rngs, state_shape=(H,)):
        self.w_in = layers.ETPLinear(I, H, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros(state_shape))
        self.out = layers.ETPLinear(H, O, rngs=rngs)

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.w_in(x)
        return self.out(jnp.tanh(self.h[...]))


class MatrixState(nnx.Module):
    """A per-sample ``(B, H)`` state that is *not* a batch axis: it runs at any batch size."""

    def __init__(self, rngs):
        self.w_in = layers.ETPLinear(I, H, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros((B, H)))

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.w_in(x)[..., None, :]
        return jnp.sum(self.h[...], axis=-2)


class EmbedNet(nnx.Module):
    def __init__(self, rngs):
        self.emb = layers.ETPEmbed(10, H, rngs=rngs)
        self.lif = layers.LIF(H)

    def __call__(self, ids):
        return self.lif(self.emb(ids))


def data(T=4, key=0):
    kx, ky = jax.random.split(jax.random.key(key))
    return jax.random.normal(kx, (T, B, I)), jax.random.normal(ky, (T, B, O))


def leaky(algorithm="d_rtrl"):
    return braintrace.compile(LeakyNet(nnx.Rngs(0)), algorithm, jnp.zeros((B, I)),
                              batch_size=B)


def snapshot(learner, trainer=None):
    arrays = [*jax.tree.leaves(nnx.state(learner.model)), *jax.tree.leaves(learner.traces)]
    if trainer is not None:
        arrays += jax.tree.leaves(trainer.opt_state)
    return [np.asarray(a) for a in arrays]


def assert_same(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def finite(tree):
    leaves = jax.tree.leaves(tree)
    return bool(leaves) and all(bool(jnp.all(jnp.isfinite(a))) for a in leaves)


def max_gap(a, b):
    return max(float(jnp.max(jnp.abs(u - v))) for u, v in zip(jax.tree.leaves(a),
                                                             jax.tree.leaves(b)))


# -- 5. SnAp with a mesh ----------------------------------------------------------------------

def test_snap_rules_are_built_under_a_trace_and_with_a_one_device_mesh():
    """SnAp's patterns are NumPy: built eagerly even under ``jax.eval_shape`` / ``jax.jit``
    (a GRU's gate slices used to hit a traced int32 position map)."""
    make = lambda: layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
    model = make()
    braintrace.init_states(model, 4)
    graph = braintrace.compile_graph(model, jnp.ones((4, 2)), scope="full")
    eager = braintrace.SnAp(1).rules(graph)
    traced = []
    jax.eval_shape(lambda p: traced.append(braintrace.SnAp(1).rules(graph)) or p, jnp.ones(2))
    assert len(traced[0].relation_rules) == len(eager.relation_rules) > 0

    mesh = jax.make_mesh((1,), ("data",))
    xs, ys = jax.random.normal(jax.random.key(0), (3, 4, 2)), jnp.zeros((3, 4, 3))
    plain = braintrace.compile(make(), braintrace.SnAp(1), jnp.ones((4, 2)), batch_size=4)
    meshed = braintrace.compile(make(), braintrace.SnAp(1), jnp.ones((4, 2)), batch_size=4,
                                mesh=mesh)
    assert max_gap(plain.etrace_grad(xs, ys, mse), meshed.etrace_grad(xs, ys, mse)) < 1e-6


# -- 6. a hidden state declared with a batch axis ---------------------------------------------

@pytest.mark.parametrize("algorithm", ["rtrl", "d_rtrl", "bptt"])
def test_hidden_state_declared_with_a_batch_axis_is_named_at_compile(algorithm):
    model = LeakyNet(nnx.Rngs(0), state_shape=(B, H))
    with pytest.raises(ValueError, match=r"Hidden state 'h' was declared with shape \(3, 5\), "
                                         r"which leads with the batch size 3.*declare the "
                                         r"per-sample shape \(5,\)"):
        braintrace.compile(model, algorithm, jnp.zeros((B, I)), batch_size=B)
    assert model.h.shape == (B, H)  # not batched again: nothing changed
    braintrace.init_states(model, B)  # batched by hand first: named all the same
    with pytest.raises(ValueError, match=r"Hidden state 'h' was declared with shape \(3, 5\)"):
        braintrace.compile(model, algorithm, jnp.zeros((B, I)))
    fixed = braintrace.compile(LeakyNet(nnx.Rngs(0)), algorithm, jnp.zeros((B, I)),
                               batch_size=B)
    assert finite(fixed.etrace_grad(*data(), mse))


def test_per_sample_state_whose_first_axis_equals_the_batch_size_is_accepted():
    learner = braintrace.compile(MatrixState(nnx.Rngs(0)), "rtrl", jnp.zeros((B, I)),
                                 batch_size=B)
    assert learner.model.h.shape == (B, B, H)
    assert learner.etrace_evolve(data()[0]).shape == (4, B, H)


# -- 7. bad arguments: each named, the learner unchanged --------------------------------------

def test_float_ids_into_an_embedding_learner_name_the_input_and_change_nothing():
    learner = braintrace.compile(EmbedNet(nnx.Rngs(0)), "d_rtrl", jnp.zeros((B,), jnp.int32),
                                 batch_size=B)
    ids = jax.random.randint(jax.random.key(0), (4, B), 0, 10)
    learner.etrace_evolve(ids)
    before = snapshot(learner)
    with pytest.raises(TypeError, match=r"xs has dtype float32, but the model was compiled for "
                                        r"int32 inputs .*xs\.astype\(jnp\.int32\)"):
        learner.etrace_grad(ids.astype(jnp.float32), jnp.zeros((4, B, H)), mse)
    with pytest.raises(TypeError, match=r"xs has dtype float32"):
        learner.etrace_evolve(ids.astype(jnp.float32))
    assert_same(before, snapshot(learner))
    assert finite(learner.etrace_grad(ids, jnp.zeros((4, B, H)), mse))


def test_complex_mask_is_refused_naming_the_mask_and_changes_nothing():
    learner, (xs, ys) = leaky(), data()
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse)
    before = snapshot(learner, trainer)
    mask = jnp.ones(4) * (1 + 1j)
    with pytest.raises(TypeError, match=r"mask must hold real step weights .*complex64"):
        learner.etrace_grad(xs, ys, mse, mask=mask)
    with pytest.raises(TypeError, match=r"mask must hold real step weights"):
        trainer.step(xs, ys, mask=mask)
    with pytest.raises(TypeError, match=r"mask must hold real step weights .*<U1"):
        learner.etrace_grad(xs, ys, mse, mask=np.array(list("1111")))
    assert_same(before, snapshot(learner, trainer))
    assert finite(learner.etrace_grad(xs, ys, mse, mask=jnp.abs(mask)))


def test_complex_mask_is_refused_by_the_functional_api_even_traced():
    learner, (xs, ys) = leaky(), data()
    online = braintrace.online_grad(learner, mse)
    state = online.init(learner.model)
    grad = nnx.jit(lambda m, s, x, y, mask: online.grad(m, s, x, y, mask=mask)[0])
    for call in (online.grad, grad):
        with pytest.raises(TypeError, match=r"mask must hold real step weights .*complex64"):
            call(learner.model, state, xs, ys, mask=jnp.ones(4, jnp.complex64))
    assert finite(grad(learner.model, state, xs, ys, mask=jnp.ones(4)))


def test_example_whose_batch_differs_from_batch_size_is_named_before_anything_changes():
    model = LeakyNet(nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"example_x has shape \(4, 4\), but batch_size=3: the "
                                         r"leading axis of every input is the batch\. Pass an "
                                         r"example of shape \(3, 4\)"):
        braintrace.compile(model, "d_rtrl", jnp.zeros((4, I)), batch_size=B)
    assert model.h.shape == (H,)  # init_states did not run
    with pytest.raises(ValueError, match=r"example_x\['x'\] has shape \(\)"):
        braintrace.compile(model, "d_rtrl", {"x": jnp.float32(0)}, batch_size=B)
    assert finite(braintrace.compile(model, "d_rtrl", jnp.zeros((B, I)),
                                     batch_size=B).etrace_grad(*data(), mse))


BAD_INTEGERS = [2.5, 2.0, "3", None, True]


@pytest.mark.parametrize("bad", BAD_INTEGERS)
def test_trainer_and_functional_integer_arguments_name_the_argument(bad):
    learner = leaky()
    before = snapshot(learner)
    if bad is not None:  # the trainer's default: every step (BPTT: once per sequence)
        with pytest.raises(TypeError, match=rf"OnlineTrainer: update_every must be a positive "
                                            rf"int .*got {bad!r}"):
            braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=bad)
    with pytest.raises(TypeError, match=rf"update_every must be a positive int .*got {bad!r}"):
        braintrace.online_update(learner, mse, optax.sgd(0.1), update_every=bad)
    if bad is not None:  # chunk_size=None is single-step mode
        with pytest.raises(TypeError, match=rf"chunk_size must be a positive int .*got {bad!r}"):
            braintrace.online_grad(learner, mse, chunk_size=bad)
        with pytest.raises(ValueError, match=rf"chunk_size must be a positive int .*{bad!r}"):
            learner.etrace_grad(*data(), mse, chunk_size=bad)
    assert_same(before, snapshot(learner))


def test_numpy_integers_are_integers_everywhere():
    learner = leaky()
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse,
                                       update_every=np.int64(2))
    assert trainer.update_every == 2 and type(trainer.update_every) is int
    assert braintrace.online_update(learner, mse, optax.sgd(0.1), update_every=np.int32(2))
    assert braintrace.online_grad(learner, mse, chunk_size=np.int64(2))
    snap = braintrace.SnAp(np.int64(2))
    assert snap.n_steps == 2 and type(snap.n_steps) is int
    assert braintrace.UORO(seed=np.int64(3)).seed == 3
    assert braintrace.RTRL(max_trace_bytes=np.int64(10**6)).max_trace_bytes == 10**6
    xs, ys = data()
    grads = [braintrace.compile(LeakyNet(nnx.Rngs(0)), alg, jnp.zeros((B, I)),
                                batch_size=B).etrace_grad(xs, ys, mse)
             for alg in (snap, braintrace.SnAp(2))]
    assert finite(grads[0]) and max_gap(*grads) == 0.0


@pytest.mark.parametrize("make, name", [
    (lambda v: braintrace.UORO(seed=v), "UORO: seed must be an int"),
    (lambda v: braintrace.RTRL(max_trace_bytes=v), "RTRL: max_trace_bytes must be a positive"),
    (lambda v: braintrace.SnAp(v), "SnAp: n_steps must be a positive int"),
])
@pytest.mark.parametrize("bad", [None, 1.5, "x", True])
def test_algorithm_integer_arguments_name_the_argument(make, name, bad):
    with pytest.raises(TypeError, match=rf"{name} .*got {bad!r} of type {type(bad).__name__}"):
        make(bad)


def test_out_of_range_algorithm_integers_are_value_errors():
    with pytest.raises(ValueError, match=r"RTRL: max_trace_bytes must be a positive int, got 0"):
        braintrace.RTRL(max_trace_bytes=0)
    with pytest.raises(ValueError, match=r"SnAp: n_steps must be a positive int, got 0"):
        braintrace.SnAp(0)


# -- 10. settings that were silently rounded or dropped ---------------------------------------

def test_settings_that_were_silently_wrong_now_raise():
    """``update_every=2.5`` ran with 2, ``UORO(1.5)`` seeded with 1, a complex mask lost its
    imaginary part with only a ComplexWarning: each is refused, naming the argument."""
    learner, (xs, ys) = leaky(), data()
    with pytest.raises(TypeError, match=r"update_every must be a positive int .*got 2\.5"):
        braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=2.5)
    with pytest.raises(TypeError, match=r"UORO: seed must be an int .*got 1\.5"):
        braintrace.UORO(1.5)
    before = snapshot(learner)
    with pytest.raises(TypeError, match=r"mask must hold real step weights"):
        learner.etrace_grad(xs, ys, mse, mask=np.ones(4, complex))
    assert_same(before, snapshot(learner))
