"""Hostile structures and bad inputs: every one is a clear error or a defined result.

Nothing may give a silent result: no NaN handed to an optimiser, no corrupted
learner after an error, no checkpoint that loads wrongly or fails anonymously.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from helpers import compilations

import braintrace
from braintrace import layers

B, I, H, O = 3, 4, 5, 2


def mse(y, t):
    return jnp.mean((y - t) ** 2)


def sqrt_of_excess(y, t):
    """Finite everywhere, but its gradient is NaN where ``y < t`` (0 · ∞)."""
    return jnp.mean(jnp.sqrt(jnp.maximum(y - t, 0.0)))


class LeakyNet(nnx.Module):
    def __init__(self, rngs, dtype=jnp.float32, out=O):
        self.w_in = layers.ETPLinear(I, H, rngs=rngs, param_dtype=dtype)
        self.h = braintrace.HiddenState(jnp.zeros((H,), dtype))
        self.out = layers.ETPLinear(H, out, rngs=rngs, param_dtype=dtype)

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.w_in(x)
        return self.out(jnp.tanh(self.h[...]))


class DropNet(nnx.Module):
    """A model holding ``nnx.Rngs``: dropout draws a new mask every step."""

    def __init__(self, rngs):
        self.w_in = layers.ETPLinear(I, H, rngs=rngs)
        self.drop = nnx.Dropout(0.5, rngs=rngs)
        self.h = braintrace.HiddenState(jnp.zeros((H,)))
        self.out = layers.ETPLinear(H, O, rngs=rngs)

    def __call__(self, x):
        self.h[...] = 0.8 * self.h[...] + self.drop(self.w_in(x))
        return self.out(self.h[...])


class OneSampleOnly(nnx.Module):
    """A per-sample model that refuses a batch axis."""

    def __init__(self, rngs):
        self.lin = layers.ETPLinear(3, 4, rngs=rngs)
        self.lif = layers.LIF(4)

    def __call__(self, x):
        if x.ndim != 1:
            raise ValueError(f"OneSampleOnly takes one sample of shape (3,), got {x.shape}.")
        return self.lif(self.lin(x))


class PerSample(nnx.Module):
    def __init__(self, rngs):
        self.lin = layers.ETPLinear(3, 4, rngs=rngs)
        self.lif = layers.LIF(4)

    def __call__(self, x):
        return self.lif(self.lin(x))


def data(T, key=0, batch=B):
    kx, ky = jax.random.split(jax.random.key(key))
    return jax.random.normal(kx, (T, batch, I)), jax.random.normal(ky, (T, batch, O))


def leaky(rngs=0, dtype=jnp.float32, **kwargs):
    return braintrace.compile(LeakyNet(nnx.Rngs(rngs), dtype, **kwargs), "d_rtrl",
                              jnp.zeros((B, I), dtype), batch_size=B)


def snapshot(learner, trainer=None):
    """Host copies of everything a call may change: Params, all model state, traces."""
    arrays = [*jax.tree.leaves(nnx.state(learner.model)), *jax.tree.leaves(learner.traces)]
    if trainer is not None:
        arrays += jax.tree.leaves(trainer.opt_state)
    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(
        a.dtype, jax.dtypes.prng_key) else a) for a in arrays]


def assert_same(before, after):
    assert len(before) == len(after)
    for a, b in zip(before, after):
        np.testing.assert_array_equal(a, b)


def warmed(learner, steps=3):
    """The learner after a few steps, so its hidden state and traces are not initial."""
    learner.etrace_evolve(data(steps, key=9)[0])
    return learner


# -- 3. masks, non-finite losses and empty sequences -------------------------------------------

def test_all_zero_mask_is_an_error_with_mean_and_zero_gradients_with_sum():
    xs, ys = data(4)
    learner = warmed(leaky())
    before = snapshot(learner)
    with pytest.raises(ValueError, match="mask sums to 0.*reduction='sum'"):
        learner.etrace_grad(xs, ys, mse, mask=jnp.zeros(4))
    assert_same(before, snapshot(learner))
    grads = learner.etrace_grad(xs, ys, mse, mask=jnp.zeros(4), reduction="sum")
    leaves = jax.tree.leaves(grads)
    assert leaves and all(np.array_equal(g, np.zeros_like(g)) for g in leaves)


def test_non_finite_mask_is_an_error_naming_the_step():
    xs, ys = data(4)
    with pytest.raises(ValueError, match=r"mask\[2\] is nan"):
        leaky().etrace_grad(xs, ys, mse, mask=jnp.array([1.0, 1.0, jnp.nan, 1.0]),
                            reduction="sum")


def zeros(grads):
    return all(np.array_equal(g, np.zeros_like(g)) for g in jax.tree.leaves(grads))


def params_and_opt_state(learner, trainer=None):
    """Host copies of the Params (and the optimiser state): what a call never changes to
    values that are not finite, even before its check is read."""
    arrays = jax.tree.leaves(nnx.state(learner.model, nnx.Param))
    return [np.asarray(a) for a in arrays + jax.tree.leaves(getattr(trainer, "opt_state", []))]


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_non_finite_loss_names_the_step_and_keeps_the_learner(bad):
    """The call returns at once, with zero gradients; the next call reads its check, puts
    back the hidden state and traces it started from, raises its error and changes nothing;
    the error is raised once."""
    xs, ys = data(5)
    learner = warmed(leaky())
    before = snapshot(learner)
    assert zeros(learner.etrace_grad(xs, ys.at[2].set(bad), mse))
    with pytest.raises(FloatingPointError, match=r"etrace_grad \(the last call.*\): the loss at "
                                                 r"time step 2 is (inf|nan), not finite"):
        learner.etrace_grad(xs, ys, mse)
    assert_same(before, snapshot(learner))
    assert not zeros(learner.etrace_grad(xs, ys, mse))
    learner.sync()


def test_non_finite_gradient_with_finite_losses_names_the_param_and_keeps_the_learner(tmp_path):
    xs, ys = data(3)
    learner = warmed(leaky())
    before = snapshot(learner)
    assert zeros(learner.etrace_grad(xs, ys, sqrt_of_excess))
    with pytest.raises(FloatingPointError, match=r"gradient of Param .*'out.kernel'.* not finite"):
        learner.save(str(tmp_path / "ckpt"))  # a save reads the check first
    assert not (tmp_path / "ckpt").exists()
    assert_same(before, snapshot(learner))
    learner.sync()  # raised once


def test_empty_time_axis_is_an_error():
    xs, ys = data(0)
    learner = leaky()
    with pytest.raises(ValueError, match=r"no time steps \(T = 0\)"):
        learner.etrace_grad(xs, ys, mse)
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse)
    with pytest.raises(ValueError, match="positive multiple of update_every"):
        trainer.step(xs, ys)


@pytest.mark.parametrize("bad", [jnp.inf, jnp.nan])
def test_trainer_non_finite_loss_discards_the_whole_call_and_says_so(bad):
    xs, ys = data(6)
    learner = warmed(leaky())
    trainer = braintrace.OnlineTrainer(learner, optax.adam(0.1), loss_fn=mse, update_every=2)
    trainer.step(xs, ys)
    before, kept = snapshot(learner, trainer), params_and_opt_state(learner, trainer)
    trainer.step(xs, ys.at[3].set(bad))
    assert_same(kept, params_and_opt_state(learner, trainer))  # kept on the device
    with pytest.raises(FloatingPointError,
                       match=r"time step 3 of that call is (inf|nan).*whole call was discarded"):
        trainer.sync()
    assert_same(before, snapshot(learner, trainer))
    with pytest.raises(FloatingPointError, match="time step 0 of that call") as info:
        trainer.fit([(xs, ys), (xs, ys.at[0].set(bad)), (xs, ys)], progress=False)
    assert "epoch 0, batch 1; 1 earlier batch(es) stay learnt" in info.value.__notes__[0]
    assert [r["step"] for r in trainer.history.steps] == [1]  # the discarded batch left out


def test_trainer_update_to_non_finite_params_is_an_error_naming_the_param():
    xs, ys = data(4)
    learner = warmed(leaky())
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=sqrt_of_excess,
                                       update_every=2)
    before = snapshot(learner, trainer)
    trainer.step(xs, ys)
    with pytest.raises(FloatingPointError,
                       match=r"update after time step 1 .*'out.kernel'.*whole call was discarded"):
        trainer.step(xs, ys)  # the next call raises the last one's error, changing nothing
    assert_same(before, snapshot(learner, trainer))


def test_trainer_names_the_first_update_to_non_finite_params_not_the_last():
    """The trainer checks the Params once, after the last update, and only on failure runs
    the call again, checked after every update: the error names the first bad update
    (after step 1, ``out.kernel`` alone), not the state at the end (every Param after step 7,
    the NaN spread by the later updates)."""
    xs, ys = data(8)
    learner = warmed(leaky())
    kernel_out = lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "out" in jax.tree_util.keystr(path)
        and "kernel" in jax.tree_util.keystr(path), params)
    tx = optax.chain(optax.sgd(0.1), optax.masked(optax.scale(jnp.inf), kernel_out))
    trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=mse, update_every=2)
    before = snapshot(learner, trainer)
    trainer.step(xs, ys)
    with pytest.raises(FloatingPointError,
                       match=r"update after time step 1 of that call made Param 'out.kernel' "
                             r"not finite although"):
        trainer.sync()
    assert_same(before, snapshot(learner, trainer))


# -- 4. reset on a per-sample learner; a failed reset changes nothing ---------------------------

def test_reset_gives_a_per_sample_learner_a_batch_axis():
    xs = jax.random.normal(jax.random.key(1), (4, 2, 3))
    learner = braintrace.compile(PerSample(nnx.Rngs(0)), "d_rtrl", jnp.ones(3))
    assert learner.batch_size is None
    learner.reset(batch_size=2)
    assert learner.batch_size == 2 and learner.model.lif.v.shape == (2, 4)
    batched = braintrace.compile(PerSample(nnx.Rngs(0)), "d_rtrl", jnp.ones((2, 3)),
                                 batch_size=2)
    np.testing.assert_array_equal(learner.etrace_evolve(xs), batched.etrace_evolve(xs))


def test_failed_reset_leaves_the_learner_exactly_as_it_was():
    xs = jax.random.normal(jax.random.key(1), (3, 3))
    learner = braintrace.compile(OneSampleOnly(nnx.Rngs(0)), "d_rtrl", jnp.ones(3))
    twin = braintrace.compile(OneSampleOnly(nnx.Rngs(0)), "d_rtrl", jnp.ones(3))
    learner.etrace_evolve(xs)
    twin.etrace_evolve(xs)
    graph, before = learner.graph, snapshot(learner)
    with pytest.raises(ValueError, match=r"reset\(batch_size=4\).*OneSampleOnly takes one sample"
                                         r".*learner is unchanged and still runs per sample"):
        learner.reset(batch_size=4)
    assert learner.graph is graph and learner.batch_size is None
    assert_same(before, snapshot(learner))
    np.testing.assert_array_equal(learner.etrace_evolve(xs), twin.etrace_evolve(xs))
    with pytest.raises(ValueError, match="positive int"):
        learner.reset(batch_size=2.0)


# -- 5. models holding nnx.Rngs save and restore -----------------------------------------------

def test_model_with_rngs_saves_and_continues_bit_identically(tmp_path):
    xs, ys = data(6)
    path = str(tmp_path / "dropout.ckpt")

    def learner(seed):
        return braintrace.compile(DropNet(nnx.Rngs(seed)), "d_rtrl", xs[0], batch_size=B)

    first = learner(0)
    first.etrace_grad(xs[:3], ys[:3], mse)
    first.save(path)
    expected, expected_losses = first.etrace_grad(xs[3:], ys[3:], mse, return_losses=True)

    resumed = learner(1)
    assert not np.array_equal(jax.random.key_data(resumed.model.drop.rngs.key[...]),
                              jax.random.key_data(first.model.drop.rngs.key[...]))
    resumed.restore(path)
    got, losses = resumed.etrace_grad(xs[3:], ys[3:], mse, return_losses=True)
    np.testing.assert_array_equal(losses, expected_losses)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        np.testing.assert_array_equal(a, b)
    assert_same(snapshot(first), snapshot(resumed))


def test_trainer_with_rngs_saves_and_continues_bit_identically(tmp_path):
    xs, ys = data(6)
    path = str(tmp_path / "trainer.ckpt")

    def trainer(seed):
        learner = braintrace.compile(DropNet(nnx.Rngs(seed)), "d_rtrl", xs[0], batch_size=B)
        return braintrace.OnlineTrainer(learner, optax.adam(1e-2), loss_fn=mse)

    first = trainer(0)
    first.step(xs[:3], ys[:3])
    first.save(path)
    expected = first.step(xs[3:], ys[3:])
    resumed = trainer(1)
    resumed.restore(path)
    np.testing.assert_array_equal(resumed.step(xs[3:], ys[3:]), expected)
    assert_same(snapshot(first.learner, first), snapshot(resumed.learner, resumed))


# -- 6. damaged and mismatched checkpoints -----------------------------------------------------

def _flip(content, where):
    position = {"first": 0, "middle": len(content) // 2, "last": len(content) - 1}[where]
    return content[:position] + bytes([content[position] ^ 0x01]) + content[position + 1:]


DAMAGE = {
    "flipped first byte": lambda c: _flip(c, "first"),
    "flipped middle byte": lambda c: _flip(c, "middle"),
    "flipped last byte": lambda c: _flip(c, "last"),
    "truncated": lambda c: c[:len(c) // 2],
    "garbage": lambda c: bytes(np.random.default_rng(0).integers(0, 256, len(c), np.uint8)),
    "empty": lambda c: b"",
}


def _checkpoint_files(path, part):
    """The files of an orbax checkpoint directory: its JSON record, or the Params' array data."""
    if part == "record":
        return [path / "braintrace" / "metadata"]
    return sorted(f for f in (path / "params").rglob("*") if f.is_file() and f.parent.name == "d")


@functools.cache
def _damage_target():
    """A learner shared by the damaged-checkpoint cases (each saves it, then moves it on, so
    what a refused restore must leave unchanged differs from the checkpoint)."""
    return leaky()


@pytest.mark.parametrize("part", ["record", "arrays"])
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_the_file_and_changes_nothing(tmp_path, damage,
                                                                           part):
    xs, ys = data(4)
    learner = _damage_target()  # one learner for the twelve cases: its programs compile once
    path = tmp_path / "run.ckpt"
    learner.save(str(path))
    files = _checkpoint_files(path, part)
    assert files
    for f in files:
        f.write_bytes(DAMAGE[damage](f.read_bytes()))
    warmed(learner)
    learner.etrace_grad(xs, ys, mse)
    before = snapshot(learner)
    with pytest.raises(ValueError) as info:
        learner.restore(str(path))
    assert str(path) in str(info.value)
    assert "damaged" in str(info.value) or "not a braintrace checkpoint" in str(info.value)
    assert_same(before, snapshot(learner))


def test_checkpoint_of_another_shape_names_the_leaf_and_both_shapes(tmp_path):
    path = str(tmp_path / "run.ckpt")
    leaky(out=2).save(path)
    other = warmed(leaky(out=3))
    before = snapshot(other)
    with pytest.raises(ValueError, match=r"run\.ckpt does not match at 'params/out\.bias': it "
                                         r"stores \(2,\) float32, but \(3,\) float32 is expected"):
        other.restore(path)
    assert_same(before, snapshot(other))


def test_checkpoint_of_another_dtype_names_the_leaf_and_both_dtypes(tmp_path):
    path = str(tmp_path / "run.ckpt")
    with jax.enable_x64(True):
        leaky().save(path)
        other = leaky(dtype=jnp.float64)
        before = snapshot(other)
        with pytest.raises(ValueError, match=r"'params/out\.bias': it stores \(2,\) float32, "
                                             r"but \(2,\) float64"):
            other.restore(path)
        assert_same(before, snapshot(other))


def test_checkpoint_of_another_algorithm_or_a_learner_into_a_trainer_names_the_leaves(tmp_path):
    path = str(tmp_path / "run.ckpt")
    leaky().save(path)
    other = braintrace.compile(LeakyNet(nnx.Rngs(0)), "es_d_rtrl", jnp.zeros((B, I)),
                               batch_size=B)
    with pytest.raises(ValueError, match=r"run\.ckpt does not match: it lacks 'traces"):
        other.restore(path)
    trainer = braintrace.OnlineTrainer(leaky(), optax.adam(1e-2), loss_fn=mse)
    before = snapshot(trainer.learner, trainer)
    with pytest.raises(ValueError, match=r"it lacks 'opt_state"):
        trainer.restore(path)
    assert_same(before, snapshot(trainer.learner, trainer))


# -- 10. chunk sizes and hidden states re-initialised behind the learner's back ----------------

@pytest.mark.parametrize("chunk_size", [2.0, True, 0, -2, 3])
def test_bad_chunk_size_says_what_it_must_be(chunk_size):
    xs, ys = data(4)
    with pytest.raises(ValueError, match="chunk_size must be a positive int that divides the "
                                         "sequence length 4"):
        leaky().etrace_grad(xs, ys, mse, chunk_size=chunk_size)


def test_init_states_after_compile_is_caught_on_the_next_call():
    xs, ys = data(4)
    learner = leaky()
    trainer = braintrace.OnlineTrainer(learner, optax.sgd(0.1), loss_fn=mse)
    braintrace.init_states(learner.model, 1)
    message = r"hidden state 'h' is \(1, 5\).*compiled for \(3, 5\).*learner\.reset\(batch_size=1\)"
    with pytest.raises(ValueError, match=message):
        learner.etrace_grad(xs, ys, mse)
    with pytest.raises(ValueError, match=message):
        learner.etrace_evolve(xs)
    with pytest.raises(ValueError, match=message):
        trainer.step(xs, ys)
    learner.reset(batch_size=1)
    grads = learner.etrace_grad(xs[:, :1], ys[:, :1], mse)
    assert all(np.all(np.isfinite(g)) for g in jax.tree.leaves(grads))


# -- 11. a batch size that comes back reuses its compiled graph and programs --------------------

def test_reset_to_an_earlier_batch_size_does_not_recompile(monkeypatch):
    import braintrace._drivers._compiled as compiled_module

    calls = []
    compile_graph = compiled_module.compile_graph

    def counting(*args, **kwargs):
        calls.append(args[1])
        return compile_graph(*args, **kwargs)

    monkeypatch.setattr(compiled_module, "compile_graph", counting)
    xs, ys = data(4)
    learner = leaky()
    with compilations() as compiled:
        learner.etrace_grad(xs, ys, mse)
        learner.reset(batch_size=2)
        learner.etrace_grad(xs[:, :2], ys[:, :2], mse)
        learner.reset(batch_size=B)
        grads = learner.etrace_grad(xs, ys, mse)
    assert len(calls) == 2
    assert compiled.count("checked_grad_program") == 2  # one per batch size
    fresh = leaky().etrace_grad(xs, ys, mse)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(fresh)):
        np.testing.assert_allclose(a, b, rtol=1e-6)
