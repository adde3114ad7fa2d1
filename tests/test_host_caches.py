"""The stateful drivers' caches between calls see every change that matters.

``learner.etrace_grad``, ``etrace_evolve``, ``OnlineTrainer.step`` and ``learner.reset``
keep, from one call to the next, the model's view while a ``GraphSnapshot`` holds, the
results of their argument checks by the call's signature (``CheckedCalls``) and a reset
that worked (``Reset``). Each test changes what one of them is keyed on and checks that the
call behaves as one that cached nothing: it reads the model as it is now (against a plain
forward pass of the model), or raises the error it raised before; with a control showing
that the change matters.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._drivers._checked_calls import CheckedCalls, call_signature
from braintrace._drivers._deferred import _start_copy
from braintrace._drivers._graph_snapshot import GraphSnapshot

B, I, H, O, T = 3, 4, 5, 2, 4


def mse(y, t):
    return jnp.mean((y - t) ** 2)


class Net(nnx.Module):
    def __init__(self, rngs, rate=0.0):
        self.w_in = layers.ETPLinear(I, H, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros((H,)))
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = layers.ETPLinear(H, O, rngs=rngs)
        self.extras = nnx.data([layers.LIF(2)])

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.w_in(x)
        return self.out(self.drop(jnp.tanh(self.h[...])))


def data(key=0, length=T):
    kx, ky = jax.random.split(jax.random.key(key))
    return jax.random.normal(kx, (length, B, I)), jax.random.normal(ky, (length, B, O))


def learner_of(algorithm="d_rtrl", rate=0.0):
    model = Net(nnx.Rngs(0), rate)
    braintrace.init_states(model, B)
    return braintrace.compile(model, algorithm, jnp.zeros((B, I)), batch_size=B)


def plain(model, xs, ys):
    """The model's own outputs and losses over ``xs`` from its current state (a copy runs)."""
    copy = nnx.clone(model)
    outputs = [copy(x) for x in xs]
    return jnp.stack(outputs), jnp.stack([mse(y, t) for y, t in zip(outputs, ys)])


@pytest.fixture(scope="module")
def cached():
    """A learner and a trainer that have run once (their caches are warm)."""
    learner = learner_of()
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse, update_every=2)
    xs, ys = data()
    learner.etrace_grad(xs, ys, mse)
    trainer.step(xs, ys)
    return learner, trainer


def rename_last(module, name):
    """Moves ``module``'s last attribute to ``name``: the same values in the same order."""
    last = list(vars(module))[-1]
    value = getattr(module, last)
    delattr(module, last)
    setattr(module, name, value)


MUTATIONS = {
    "param replaced": lambda m: setattr(m.out, "kernel", nnx.Param(m.out.kernel[...])),
    "param added": lambda m: setattr(m, "gain", nnx.Param(jnp.ones(()))),
    "submodule swapped": lambda m: setattr(m, "out", layers.ETPLinear(H, O, rngs=nnx.Rngs(1))),
    "mode switched": lambda m: m.eval(),
    "metadata changed": lambda m: m.h.set_metadata("note", "changed"),
    "metadata value changed": lambda m: m.h.set_metadata("init", 1.0),  # same keys
    "list grown in place": lambda m: m.extras.append(layers.LIF(2)),
    "list item replaced": lambda m: m.extras.__setitem__(0, layers.LIF(2)),
    "attribute renamed": lambda m: rename_last(m.out, "renamed"),  # a static one, last
}


@pytest.mark.parametrize("mutation", MUTATIONS)
def test_the_snapshot_breaks_on_every_change_of_the_graph_and_holds_through_new_values(mutation):
    model = Net(nnx.Rngs(0))
    snapshot = GraphSnapshot.of(model)
    model.h.set_value(jnp.ones((H,)))  # values are not structure: the control holds
    model.out.kernel[...] = 2.0 * model.out.kernel[...]
    assert snapshot.holds()
    MUTATIONS[mutation](model)
    assert not snapshot.holds()
    assert GraphSnapshot.of(model).holds()


def test_the_snapshot_compares_metadata_by_equality_and_an_array_in_it_without_raising():
    model = Net(nnx.Rngs(0))
    scale = jnp.ones((2,))
    model.h.set_metadata("scale", scale)
    snapshot = GraphSnapshot.of(model)
    model.h.set_metadata("scale", scale)  # the same object again: unchanged
    model.h.set_metadata("init", float(model.h.get_metadata("init")))  # an equal value
    assert snapshot.holds()
    model.h.set_metadata("scale", 2.0 * scale)  # an array's == is not a bool: changed
    assert not snapshot.holds()


def test_a_replaced_param_is_the_one_every_driver_reads_and_writes(cached):
    learner, trainer = cached
    model = learner.model
    xs, ys = data(1)
    old = model.out.kernel
    _, stale = plain(model, xs, ys)
    model.out.kernel = nnx.Param(3.0 * old[...] + 1.0)
    _, want = plain(model, xs, ys)
    assert not np.allclose(want, stale, rtol=1e-3)  # control: a stale read would show
    _, losses = learner.etrace_grad(xs, ys, mse, return_losses=True)
    np.testing.assert_allclose(losses, want, rtol=1e-5)
    kept, new = np.asarray(old[...]), model.out.kernel
    before = np.asarray(new[...])
    trainer.step(xs, ys)
    assert model.out.kernel is new and not np.allclose(new[...], before)
    np.testing.assert_array_equal(old[...], kept)  # the replaced Param is not written


def test_a_mode_switch_after_a_cached_call_takes_effect_at_once():
    learner = learner_of(rate=0.5)
    model = learner.model
    xs, ys = data(2)
    learner.etrace_evolve(xs)  # in training mode: dropout
    model.eval()
    want, _ = plain(model, xs, ys)
    np.testing.assert_allclose(learner.etrace_evolve(xs), want, rtol=1e-5, atol=1e-6)
    model.train()
    outputs = learner.etrace_evolve(xs)
    model.eval()
    assert not np.allclose(outputs, plain(model, xs, ys)[0], atol=1e-3)  # control


class Counting(CheckedCalls):
    """Records every check that runs (is not found)."""

    def __init__(self):
        super().__init__()
        self.ran = []

    def check(self, where, signature, checks):
        return super().check(where, signature, lambda: self.ran.append(signature) or checks())


def test_checks_are_remembered_only_for_the_same_signature(cached):
    learner, trainer = cached
    xs, ys = data(3)
    learner._checked = counting = Counting()
    learner.etrace_grad(xs, ys, mse)
    ran = len(counting.ran)
    assert ran > 0
    learner.etrace_grad(xs + 1.0, ys, mse)  # other values, the same signature
    assert len(counting.ran) == ran
    learner.etrace_grad(xs, ys, mse, reduction="sum")
    learner.etrace_grad(xs, ys, mse, reduction="sum")
    assert len(counting.ran) == ran + 1
    learner.etrace_grad(xs, ys, mse, mask=jnp.ones(T))  # a good mask of that shape passes
    with pytest.raises(ValueError, match="positive multiple of update_every=2"):
        trainer.step(xs[:3], ys[:3])
    with pytest.raises(ValueError, match="compiled for steps of shape"):
        learner.etrace_evolve(jnp.ones((T, B + 1, I)))


def test_a_call_is_remembered_by_the_signature_of_its_inputs_as_given(cached):
    learner, _ = cached
    xs, ys = data(4)
    learner._checked = counting = Counting()
    learner.etrace_grad(xs, ys, mse, chunk_size=2)
    assert counting.ran[0] == call_signature(xs, ys, statics=(2, None, "mean"))
    learner.etrace_grad(np.asarray(xs), np.asarray(ys), mse, chunk_size=2)  # placed first
    assert len(counting.ran) == 2  # the first call's checks and its loop's, no more


def test_a_flag_on_the_cpu_is_read_where_it_is_at_every_call():
    flags = [jnp.ones((3,), bool), jnp.zeros((2,), bool)]  # one sharding, its placement kept
    assert all(_start_copy(f) is f for f in flags)


BAD = {"xs of another width": {"xs": np.ones((T, B, I + 1), np.float32)},
       "ys of another length": {"ys": np.ones((T - 1, B, O), np.float32)},
       "a chunk size not dividing T": {"chunk_size": 3},
       "an unknown reduction": {"reduction": "avg"},
       "a zero block size": {"block_size": 0},
       "a mask with a NaN": {"mask": np.array([1.0, np.nan, 1.0, 1.0])},
       "a mask of zeros": {"mask": np.zeros(T)}}


@pytest.mark.parametrize("change", BAD)
def test_after_a_cached_call_each_bad_argument_is_still_refused(cached, change):
    learner, _ = cached
    xs, ys = data(3)
    kwargs = {"xs": xs, "ys": ys, **BAD[change]}
    with pytest.raises(ValueError):
        learner.etrace_grad(kwargs.pop("xs"), kwargs.pop("ys"), mse, **kwargs)


def test_leaf_and_trace_checks_still_name_what_changed(cached):
    learner, _ = cached
    model = learner.model
    xs, ys = data(4)
    kernel = model.out.kernel[...]
    model.out.kernel.set_value(np.asarray(kernel, np.float64))  # accepted before: still is
    learner.etrace_grad(xs, ys, mse)
    model.out.kernel.set_value(jnp.ones((H, O + 1)))
    with pytest.raises(ValueError, match=r"Param 'out\.kernel' is \(5, 3\) float32"):
        learner.etrace_grad(xs, ys, mse)
    model.out.kernel.set_value(kernel)
    traces = learner.traces
    learner.traces = jax.tree.map(lambda a: a[..., :1], traces)
    with pytest.raises(ValueError, match=r"call learner\.reset\(\)"):
        learner.etrace_grad(xs, ys, mse)
    learner.traces = traces
    learner.etrace_grad(xs, ys, mse)


@pytest.mark.parametrize("algorithm", ["es_d_rtrl", "uoro"])
def test_a_repeated_reset_gives_what_the_first_gave(algorithm):
    learner = learner_of(algorithm)
    model = learner.model
    xs, ys = data(5)
    learner.reset()  # the first: tried on a copy, then kept
    zeros = learner.compiled.zero_traces(learner._entry(), learner.leaves().params)  # eager
    learner.etrace_grad(xs, ys, mse)
    assert not np.allclose(model.h[...], 0.0)  # control: the call moved the state
    learner.reset()  # repeated
    np.testing.assert_array_equal(model.h[...], np.zeros((B, H)))
    for got, want in zip(jax.tree.leaves(learner.traces), jax.tree.leaves(zeros), strict=True):
        if jax.dtypes.issubdtype(want.dtype, jax.dtypes.prng_key):
            got, want = jax.random.key_data(got), jax.random.key_data(want)
        np.testing.assert_array_equal(got, want)
    learner.reset(batch_size=2)
    with pytest.raises(TypeError):  # a float is refused as before, also after a reset to 2
        learner.reset(batch_size=2.0)
    assert learner.batch_size == 2
    model.h.set_value(jnp.zeros((2, H), jnp.float16))  # a state of another dtype: reset
    learner.reset()                                    # keeps it, and the call names it
    assert model.h[...].dtype == jnp.float16
    with pytest.raises(ValueError, match=r"hidden state 'h' is \(2, 5\) float16"):
        learner.etrace_grad(xs[:, :2], ys[:, :2], mse)
