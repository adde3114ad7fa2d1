"""CheckpointManager for your own train step: a model, an nnx.Optimizer and an OnlineState.

``save(step, model=..., optimizer=..., state=...)`` / ``restore(model=..., optimizer=...,
state=...)``: a stream of ``online_grad`` chunks inside a user's ``@nnx.jit`` train step,
interrupted, saved and resumed into new objects (another seed, as in a new process), goes on
bit-identically. Steps are validated before orbax writes anything, ``max_to_keep=0`` follows
orbax (keep only the best), and a failed call changes nothing.
"""

from __future__ import annotations

import os
import pathlib
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import braintrace
from braintrace import layers

B, IN, HID, OUT, T = 2, 3, 5, 2, 4
mse = lambda y, t: jnp.mean((y - t) ** 2)


class Net(nnx.Module):
    """Linear -> Dropout (the RNG is state) -> LIF -> Linear."""

    def __init__(self, seed):
        rngs = nnx.Rngs(seed, dropout=seed + 100)
        self.enc = layers.ETPLinear(IN, HID, rngs=rngs)
        self.drop = nnx.Dropout(0.3, rngs=rngs)
        self.lif = layers.LIF(HID)
        self.out = layers.ETPLinear(HID, OUT, rngs=rngs)

    def __call__(self, x):
        return self.out(self.lif(self.drop(self.enc(x) + 1.0)))


class Objects(NamedTuple):
    model: Net
    optimizer: nnx.Optimizer
    learner: braintrace.OnlineLearner
    online: braintrace.OnlineGradient
    train_step: Any


def setup(seed):
    """Everything a process builds before training: model, optimizer, pure functions, step."""
    model = Net(seed)
    learner = braintrace.compile(model, "d_rtrl", jnp.zeros((B, IN)), batch_size=B)
    online = braintrace.online_grad(learner, mse)
    optimizer = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0),
                                                 optax.adamw(1e-2)), wrt=nnx.Param)

    @nnx.jit
    def train_step(model, optimizer, state, xs, ys):
        grads, state, stats = online.grad(model, state, xs, ys)
        optimizer.update(model, grads)
        return state, stats.losses

    return Objects(model, optimizer, learner, online, train_step)


def chunk(i):
    xs = 2.0 * jax.random.normal(jax.random.key(i), (T, B, IN))
    return xs, jnp.tanh(jnp.cumsum(xs[..., :OUT], axis=0))


def flat(tree):
    """Every leaf as a NumPy array (PRNG keys as their key data)."""
    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                       else a) for a in jax.tree.leaves(tree)]


def assert_same(a, b):
    a, b = flat(a), flat(b)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def differs(a, b):
    return any(u.shape != v.shape or not np.array_equal(u, v) for u, v in zip(flat(a), flat(b)))


def run(objects, state, chunks):
    """The train step over ``chunks``, carrying ``state``: the last state and every loss."""
    losses = []
    for i in chunks:
        state, step_losses = objects.train_step(objects.model, objects.optimizer, state,
                                                *chunk(i))
        losses.append(np.asarray(step_losses))
    return state, np.concatenate(losses)


def snapshot(model, optimizer):
    """Copies of the arrays now in ``model`` and ``optimizer`` (``nnx.state`` shares Variables)."""
    return flat([nnx.state(model), nnx.state(optimizer)])


class Stream(NamedTuple):
    directory: pathlib.Path
    losses: np.ndarray
    state: list
    params: list
    optimizer: list
    saved_params: list


@pytest.fixture(scope="module")
def stream(tmp_path_factory):
    """Four chunks run straight; in ``directory``, step 2 saved after two chunks of a second run.

    Tests only read ``directory`` (each error test checks that its files are unchanged).
    """
    straight = setup(0)
    state, losses = run(straight, straight.online.init(straight.model), range(4))
    saved = setup(0)
    saved_state, _ = run(saved, saved.online.init(saved.model), range(2))
    directory = tmp_path_factory.mktemp("saved")
    with braintrace.CheckpointManager(directory) as manager:
        assert manager.save(2, model=saved.model, optimizer=saved.optimizer, state=saved_state)
    return Stream(directory, losses, flat(state), flat(nnx.state(straight.model, nnx.Param)),
                  flat(nnx.state(straight.optimizer)), flat(nnx.state(saved.model, nnx.Param)))


# -- item 1: the pure API's state ----------------------------------------------------------------


@pytest.mark.parametrize("how", ["latest", "restore(step, ...)", "abstract state"])
def test_a_resumed_online_grad_stream_is_bit_identical_to_an_uninterrupted_one(stream, how):
    fresh = setup(1)  # as a new process would build it, from another seed
    template = (jax.eval_shape(fresh.online.init, fresh.model) if how == "abstract state" else
                fresh.online.init(fresh.model))
    assert differs(nnx.state(fresh.model, nnx.Param), stream.params)
    with braintrace.CheckpointManager(stream.directory) as manager:
        args = {"model": fresh.model, "optimizer": fresh.optimizer, "state": template}
        step, state = (manager.restore(2, **args) if how == "restore(step, ...)" else
                       manager.restore(**args))
    assert step == 2 and isinstance(state, braintrace.OnlineState)
    assert int(fresh.optimizer.step[...]) == 2
    state, losses = run(fresh, state, range(2, 4))

    np.testing.assert_array_equal(losses, stream.losses[2 * T:])
    assert_same(nnx.state(fresh.model, nnx.Param), stream.params)
    assert_same(nnx.state(fresh.optimizer), stream.optimizer)
    assert_same(state, stream.state)
    assert differs(stream.losses[:2 * T], stream.losses[2 * T:])  # the chunks are not alike


@pytest.mark.parametrize("keep", ["nothing", "all but the rng"])
def test_without_the_saved_state_or_its_rng_the_resumed_stream_differs(stream, keep):
    """Negative control: the state (hidden, traces, and the dropout RNG in other) matters."""
    fresh = setup(1)
    # Before the restore, copied (a state shares the model's Variables): the RNG of seed 1.
    new = jax.tree.map(jnp.copy, fresh.online.init(fresh.model))
    with braintrace.CheckpointManager(stream.directory) as manager:
        _, state = manager.restore(model=fresh.model, optimizer=fresh.optimizer,
                                   state=fresh.online.init(fresh.model))
    state = new if keep == "nothing" else state._replace(other=new.other)
    _, losses = run(fresh, state, range(2, 4))
    assert not np.array_equal(losses, stream.losses[2 * T:])


def test_the_params_of_a_state_checkpoint_are_plain_flax_under_their_paths(stream):
    step_dir = stream.directory / "2"
    abstract = nnx.state(nnx.eval_shape(lambda: Net(7)), nnx.Param)
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(step_dir / "params", abstract)
    assert_same(params, stream.saved_params)
    assert {"params", "hidden", "other", "optimizer", "state_hidden", "state_other",
            "state_traces", "braintrace"} <= set(os.listdir(step_dir))


def test_a_model_and_optimizer_without_a_state_restore_too(tmp_path):
    first = setup(0)
    run(first, first.online.init(first.model), range(1))
    with braintrace.CheckpointManager(tmp_path) as manager:
        assert manager.save(0, model=first.model, optimizer=first.optimizer)
        fresh = setup(1)
        assert manager.restore(model=fresh.model, optimizer=fresh.optimizer) == 0
    assert_same(snapshot(fresh.model, fresh.optimizer), snapshot(first.model, first.optimizer))


def test_a_learner_checkpoint_restored_into_a_bare_model_names_the_traces_it_holds(tmp_path):
    learner = setup(0).learner
    learner.etrace_grad(*chunk(0), mse)
    with braintrace.CheckpointManager(tmp_path) as manager:
        manager.save(0, learner)
        fresh = setup(1).model
        before = snapshot(fresh, nnx.Dict())
        with pytest.raises(ValueError, match=r"holds 'traces\[0\]"):
            manager.restore(model=fresh)
    assert_same(snapshot(fresh, nnx.Dict()), before)


def other_batch_state():
    learner = braintrace.compile(Net(3), "d_rtrl", jnp.zeros((B + 1, IN)), batch_size=B + 1)
    return braintrace.online_grad(learner, mse).init(learner.model)


def bad_calls(manager, learner, model, optimizer, state):
    return {
        "neither": (lambda: manager.save(3, optimizer=optimizer), TypeError,
                    (r"CheckpointManager.save takes a learner or trainer \(target\), or the model "
                     r"of your own train step .*got neither")),
        "both": (lambda: manager.save(3, learner, model=model), TypeError, r"got both"),
        "state with a learner": (lambda: manager.save(3, learner, state=state), TypeError,
                                 r"state=\.\.\. goes with model=\.\.\.; the OnlineLearner carries"),
        "online_update's pair": (
            lambda: manager.save(3, model=model, state=(None, state)), TypeError,
            (r"state must be a braintrace.OnlineState .*got tuple\. online_update's init "
             r"returns \(opt_state, state\)")),
        "not a model": (lambda: manager.save(3, model=learner), TypeError,
                        r"model must be an nnx.Module .*got OnlineLearner"),
        "inside jit": (lambda: nnx.jit(lambda m: manager.save(3, model=m))(model), TypeError,
                       (r"CheckpointManager.save reads and writes files on the host, so it cannot "
                        r"run inside jax.jit")),
        "restore: not a target": (lambda: manager.restore(optimizer), TypeError,
                                  r"target must be an OnlineLearner .*got Optimizer"),
        "restore: step twice": (lambda: manager.restore(2, 2, model=model, state=state),
                                TypeError, r"step given twice"),
        "restore without the state": (
            lambda: manager.restore(model=model, optimizer=optimizer), ValueError,
            r"does not match: it lacks nothing, expected here, and holds 'state_hidden/"),
        "restore without the optimizer": (
            lambda: manager.restore(model=model, state=state), ValueError,
            r"does not match: it lacks nothing, expected here, and holds 'optimizer/"),
        "restore another batch size": (
            lambda: manager.restore(model=model, optimizer=optimizer,
                                    state=other_batch_state()),
            ValueError, (r"does not match at 'state_hidden/lif\.v': it stores \(2, 5\) float32, "
                         r"but \(3, 5\) float32 is expected here")),
    }


CASES = ["neither", "both", "state with a learner", "online_update's pair", "not a model",
         "inside jit", "restore: not a target", "restore: step twice",
         "restore without the state", "restore without the optimizer",
         "restore another batch size"]


@pytest.mark.parametrize("case", CASES)
def test_a_wrong_save_or_restore_is_a_clear_error_and_changes_nothing(stream, case):
    fresh = setup(1)
    state = fresh.online.init(fresh.model)
    before = snapshot(fresh.model, fresh.optimizer) + flat([state, fresh.learner.traces])
    files = sorted(os.walk(stream.directory))
    with braintrace.CheckpointManager(stream.directory) as manager:
        call, error, message = bad_calls(manager, fresh.learner, fresh.model, fresh.optimizer,
                                         state)[case]
        with pytest.raises(error, match=message):
            call()
        assert manager.all_steps() == [2]
    assert_same(snapshot(fresh.model, fresh.optimizer) + flat([state, fresh.learner.traces]),
                before)
    assert sorted(os.walk(stream.directory)) == files


# -- item 2: the step ----------------------------------------------------------------------------


@pytest.mark.parametrize("step, error, message", [
    (-1, ValueError, r"CheckpointManager.save: step must be a non-negative int, got -1"),
    (2.5, TypeError, (r"CheckpointManager.save: step must be a non-negative int \(a Python or "
                      r"NumPy integer, not a bool or a float\), got 2.5 of type float")),
    (True, TypeError, r"got True of type bool"),
    ("3", TypeError, r"got '3' of type str"),
])
def test_save_refuses_a_step_that_is_not_a_non_negative_int_and_writes_nothing(tmp_path, step,
                                                                                error, message):
    objects = setup(0)
    learner, model, optimizer = objects.learner, objects.model, objects.optimizer
    with braintrace.CheckpointManager(tmp_path) as manager:
        manager.save(0, learner)
        learner.etrace_grad(*chunk(0), mse)  # differs from step 0 now
        files = sorted(os.walk(tmp_path))
        before = snapshot(model, optimizer) + flat(learner.traces)
        with pytest.raises(error, match=message):
            manager.save(step, learner)
        with pytest.raises(error, match=message):
            manager.save(step, model=model, optimizer=optimizer)
        assert sorted(os.walk(tmp_path)) == files
        with pytest.raises(error, match=message.replace("save", "restore")):
            manager.restore(learner, step)
        with pytest.raises(error, match=message.replace("save", "restore")):
            manager.restore(step, model=model)
        assert_same(snapshot(model, optimizer) + flat(learner.traces), before)
    with braintrace.CheckpointManager(tmp_path) as reopened:
        assert reopened.all_steps() == [0]


def test_numpy_integer_steps_are_steps(tmp_path):
    model, optimizer = setup(0)[:2]
    with braintrace.CheckpointManager(tmp_path) as manager:
        assert manager.save(np.int64(4), model=model, optimizer=optimizer)
        assert manager.restore(np.int32(4), model=model, optimizer=optimizer) == 4
    with braintrace.CheckpointManager(tmp_path) as reopened:
        assert reopened.all_steps() == [4]


# -- item 3: max_to_keep=0 ------------------------------------------------------------------------


def test_max_to_keep_zero_with_best_fn_keeps_only_the_best_as_orbax_does(tmp_path):
    model, optimizer = setup(0)[:2]
    saved_params = {}
    with braintrace.CheckpointManager(tmp_path, max_to_keep=0, best_fn=lambda m: m["loss"],
                                      best_mode="min") as manager:
        kept = []
        for step, loss in enumerate([3.0, 1.0, 2.0, 4.0]):
            model.enc.kernel[...] = jnp.full((IN, HID), float(step))
            saved_params[step] = flat(nnx.state(model, nnx.Param))
            kept.append(manager.save(step, model=model, optimizer=optimizer,
                                     metrics={"loss": loss}))
            assert manager.all_steps() == [0 if step == 0 else 1]
        assert kept == [True, True, False, False]
        assert manager.best_step() == 1
    assert sorted(os.listdir(tmp_path)) == ["1"]
    fresh_model, fresh_optimizer = setup(1)[:2]
    with braintrace.CheckpointManager(tmp_path) as reopened:
        assert reopened.restore(model=fresh_model, optimizer=fresh_optimizer) == 1
    assert_same(flat(nnx.state(fresh_model, nnx.Param)), saved_params[1])


@pytest.mark.parametrize("options", [{}, {"best_fn": lambda m: m["loss"], "keep_best": 0}])
def test_max_to_keep_zero_that_would_keep_nothing_is_refused_at_construction(tmp_path, options):
    directory = tmp_path / "run"
    with pytest.raises(ValueError, match=(
            r"max_to_keep=0 keeps none of the last steps, and without best_fn \(or with "
            r"keep_best=0\) no step at all.*Pass max_to_keep >= 1, None \(keep all\), or "
            r"best_fn")):
        braintrace.CheckpointManager(directory, max_to_keep=0, **options)
    assert not directory.exists()
