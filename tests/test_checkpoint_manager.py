"""braintrace.CheckpointManager: numbered steps, keep the last N and the best, resume exactly.

The Params of a checkpoint are the orbax item ``params``, ``nnx.state(model,
nnx.Param)`` under its Flax paths: a subprocess that imports only orbax, flax,
jax and numpy restores them. A failed restore raises a clear ValueError and
changes nothing.
"""

import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import optax
import orbax.checkpoint as ocp
import pytest
from flax import nnx

import braintrace
from braintrace import layers

B, I, H = 2, 3, 4
mse = lambda y, t: jnp.mean((y - t) ** 2)


def make_model(seed=0, hidden=H):
    return nnx.Sequential(layers.Stateful(layers.GRUCell(I, hidden, rngs=nnx.Rngs(seed))),
                          layers.ETPLinear(hidden, 1, rngs=nnx.Rngs(seed + 1)))


def make_learner(seed=0, hidden=H):
    return braintrace.compile(make_model(seed, hidden), "d_rtrl", jnp.ones((B, I)), batch_size=B)


def make_trainer(seed=0):
    return braintrace.OnlineTrainer(make_learner(seed), optax.adam(1e-2), loss_fn=mse,
                                    update_every=2)


def batch(i, T=4):
    xs = jax.random.normal(jax.random.key(i), (T, B, I))
    return xs, jnp.cumsum(xs[..., :1], axis=0) / 4


def flat(tree):
    """Every leaf of ``tree`` as a NumPy array (PRNG keys as their key data)."""
    return [np.asarray(jax.random.key_data(a) if jax.dtypes.issubdtype(a.dtype, jax.dtypes.prng_key)
                       else a) for a in jax.tree.leaves(tree)]


def assert_same(a, b):
    a, b = flat(a), flat(b)
    assert len(a) == len(b)
    for u, v in zip(a, b):
        np.testing.assert_array_equal(u, v)


def snapshot(learner, *others):
    return [nnx.state(learner.model), learner.traces, *others]


def steps_on_disk(directory):
    return sorted(int(p) for p in os.listdir(directory) if p.isdigit())


def save_steps(directory, losses, **options):
    learner = make_learner()
    with braintrace.CheckpointManager(directory, **options) as manager:
        for step, loss in enumerate(losses):
            learner.etrace_grad(*batch(step, T=2), mse)
            assert manager.save(step, learner, metrics={"loss": jnp.float32(loss)})
        return manager.all_steps(), manager.best_step()


# -- keep-N, keep-best -------------------------------------------------------------------------

@pytest.mark.parametrize("how", ["max_to_keep", "orbax options, async"])
def test_only_the_last_n_step_directories_remain(tmp_path, how):
    options = ({"max_to_keep": 2} if how == "max_to_keep" else
               {"options": ocp.CheckpointManagerOptions(max_to_keep=2,
                                                        enable_async_checkpointing=True)})
    kept, _ = save_steps(tmp_path, [5.0, 4.0, 3.0, 2.0, 1.0], **options)
    assert kept == [3, 4] == steps_on_disk(tmp_path)
    for step in kept:
        assert os.path.isfile(tmp_path / str(step) / "braintrace.sha256.json")
        assert os.path.isdir(tmp_path / str(step) / "params")


@pytest.mark.parametrize("mode, best", [("min", 1), ("max", 0)])
def test_the_best_step_by_a_metric_is_kept_beside_the_last_n(tmp_path, mode, best):
    kept, best_step = save_steps(tmp_path, [5.0, 1.0, 4.0, 3.0, 2.0], max_to_keep=2,
                                 best_fn=lambda m: m["loss"], best_mode=mode)
    assert best_step == best
    assert kept == sorted({best, 3, 4}) == steps_on_disk(tmp_path)
    with braintrace.CheckpointManager(tmp_path) as reopened:  # a later process sees them
        assert reopened.all_steps() == kept and reopened.latest_step() == 4
        learner = make_learner(seed=3)
        assert reopened.restore(learner, best) == best


# -- resume bit for bit ------------------------------------------------------------------------

def train_with_optimizer(learner, optimizer, batches):
    losses = []
    for i in batches:
        grads, loss = learner.etrace_grad(*batch(i), mse, return_losses=True)
        optimizer.update(learner.model, grads)
        losses.append(np.asarray(loss))
    return losses


def test_learner_and_nnx_optimizer_resume_from_the_latest_step_bit_identically(tmp_path):
    straight = make_learner()
    straight_opt = nnx.Optimizer(straight.model, optax.adam(1e-2), wrt=nnx.Param)
    train_with_optimizer(straight, straight_opt, range(3))
    with braintrace.CheckpointManager(tmp_path, max_to_keep=1) as manager:
        manager.save(3, straight, optimizer=straight_opt)
    expected = train_with_optimizer(straight, straight_opt, range(3, 5))

    resumed = make_learner(seed=7)  # fresh: other Params, fresh traces and optimizer
    resumed_opt = nnx.Optimizer(resumed.model, optax.adam(1e-2), wrt=nnx.Param)
    with braintrace.CheckpointManager(tmp_path, max_to_keep=1) as manager:
        assert manager.restore(resumed, optimizer=resumed_opt) == 3
    got = train_with_optimizer(resumed, resumed_opt, range(3, 5))
    assert_same(got, expected)
    assert_same(nnx.state(resumed.model, nnx.Param), nnx.state(straight.model, nnx.Param))
    assert_same(snapshot(resumed, nnx.state(resumed_opt)),
                snapshot(straight, nnx.state(straight_opt)))


def test_trainer_resumes_from_the_latest_step_bit_identically(tmp_path):
    straight = make_trainer()
    with braintrace.CheckpointManager(tmp_path, max_to_keep=2) as manager:
        for i in range(3):
            straight.step(*batch(i))
            manager.save(i, straight, metrics={"loss": 0.0})
    expected = [np.asarray(straight.step(*batch(i))) for i in range(3, 5)]

    resumed = make_trainer(seed=7)
    with braintrace.CheckpointManager(tmp_path, max_to_keep=2) as manager:
        assert manager.restore(resumed) == 2
    got = [np.asarray(resumed.step(*batch(i))) for i in range(3, 5)]
    assert_same(got, expected)
    assert_same(snapshot(resumed.learner, resumed.opt_state),
                snapshot(straight.learner, straight.opt_state))


def test_resume_skips_a_step_whose_save_was_interrupted_before_its_manifest(tmp_path):
    learner = make_learner()
    with braintrace.CheckpointManager(tmp_path) as manager:
        for step in range(2):
            learner.etrace_grad(*batch(step, T=2), mse)
            manager.save(step, learner)
        (tmp_path / "1" / "braintrace.sha256.json").unlink()  # as if killed before it
        fresh = make_learner(seed=2)
        assert manager.restore(fresh) == 0
        with pytest.raises(ValueError, match="manifest .* is missing"):
            manager.restore(fresh, 1)


def test_learner_save_takes_an_nnx_optimizer_too(tmp_path):
    learner = make_learner()
    optimizer = nnx.Optimizer(learner.model, optax.adam(1e-2), wrt=nnx.Param)
    train_with_optimizer(learner, optimizer, range(2))
    learner.save(str(tmp_path / "run"), optimizer=optimizer)
    fresh = make_learner(seed=4)
    fresh_opt = nnx.Optimizer(fresh.model, optax.adam(1e-2), wrt=nnx.Param)
    fresh.restore(str(tmp_path / "run"), optimizer=fresh_opt)
    assert_same(snapshot(fresh, nnx.state(fresh_opt)), snapshot(learner, nnx.state(optimizer)))


# -- plain orbax and Flax read the Params -----------------------------------------------------

PLAIN = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    import orbax.checkpoint as ocp
    import flax  # noqa: F401  (what a Flax user has; braintrace is not imported)

    def by_path(tree):
        flat, _ = jax.tree_util.tree_flatten_with_path(tree)
        return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path):
                np.asarray(a).tolist() for path, a in flat}

    managed, single = sys.argv[1], sys.argv[2]
    with ocp.CheckpointManager(managed) as manager:
        step = manager.latest_step()
        restored = manager.restore(step, args=ocp.args.Composite(
            params=ocp.args.StandardRestore()))["params"]
    with ocp.StandardCheckpointer() as checkpointer:
        saved = checkpointer.restore(single + "/params")
    assert not any(name.startswith("braintrace") for name in sys.modules)
    print("RESULT" + json.dumps({"step": step, "managed": by_path(restored),
                                 "single": by_path(saved)}))
""")


def by_path(state):
    flat_state, _ = jax.tree_util.tree_flatten_with_path(state)
    return {"/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path): np.asarray(a)
            for path, a in flat_state}


def test_plain_orbax_restores_the_params_without_braintrace(tmp_path):
    learner = make_learner()
    learner.etrace_grad(*batch(0), mse)
    with braintrace.CheckpointManager(tmp_path / "managed") as manager:
        manager.save(5, learner)
    learner.save(str(tmp_path / "single"))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    done = subprocess.run([sys.executable, "-c", PLAIN, str(tmp_path / "managed"),
                           str(tmp_path / "single")], capture_output=True, text=True, env=env,
                          timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
    out = json.loads(line[len("RESULT"):])
    expected = by_path(nnx.state(learner.model, nnx.Param))
    assert out["step"] == 5
    assert "layers/0/cell/dense_i/kernel/value" in expected
    for which in ("managed", "single"):
        got = out[which]
        assert sorted(got) == sorted(expected)
        for path, value in expected.items():
            np.testing.assert_array_equal(np.asarray(got[path], value.dtype), value)


def test_flax_abstract_state_restores_the_params_item(tmp_path):
    learner = make_learner()
    learner.etrace_grad(*batch(0), mse)
    with braintrace.CheckpointManager(tmp_path) as manager:
        manager.save(0, learner)
        step_dir = manager.step_directory(0)
    abstract = nnx.eval_shape(lambda: make_model(seed=9))
    with ocp.StandardCheckpointer() as checkpointer:
        params = checkpointer.restore(os.path.join(step_dir, "params"),
                                      nnx.state(abstract, nnx.Param))
    model = make_model(seed=9)
    nnx.update(model, params)
    assert_same(nnx.state(model, nnx.Param), nnx.state(learner.model, nnx.Param))


# -- failed restores change nothing ------------------------------------------------------------

@pytest.fixture
def saved(tmp_path):
    """A directory with step 0 of a trained learner saved with an nnx.Optimizer."""
    learner = make_learner()
    optimizer = nnx.Optimizer(learner.model, optax.adam(1e-2), wrt=nnx.Param)
    train_with_optimizer(learner, optimizer, range(1))
    with braintrace.CheckpointManager(tmp_path) as manager:
        manager.save(0, learner, optimizer=optimizer)
    return tmp_path


def trained_target(hidden=H):
    learner = make_learner(seed=5, hidden=hidden)
    optimizer = nnx.Optimizer(learner.model, optax.adam(1e-2), wrt=nnx.Param)
    train_with_optimizer(learner, optimizer, range(7, 9))
    return learner, optimizer


def test_restore_of_other_shapes_is_a_clear_error_and_changes_nothing(saved):
    learner, optimizer = trained_target(hidden=H + 1)
    before = flat(snapshot(learner, nnx.state(optimizer)))
    with braintrace.CheckpointManager(saved) as manager, pytest.raises(
            ValueError, match=r"does not match at 'params/layers\.0\.cell\.dense_h\.kernel': "
                              r"it stores \(4, 12\) float32, but \(5, 15\) float32 is expected"):
        manager.restore(learner, optimizer=optimizer)
    assert_same(before, snapshot(learner, nnx.state(optimizer)))


@pytest.mark.parametrize("damage", ["flipped byte", "manifest removed", "record removed"])
def test_restore_of_a_damaged_step_is_a_clear_error_and_changes_nothing(saved, damage):
    step_dir = saved / "0"
    if damage == "flipped byte":
        victim = min(f for f in (step_dir / "params").rglob("*")
                     if f.is_file() and f.parent.name == "d")
        content = victim.read_bytes()
        victim.write_bytes(bytes([content[0] ^ 1]) + content[1:])
        match = r"is damaged: its file .*params.* has another SHA-256 digest"
    elif damage == "manifest removed":
        (step_dir / "braintrace.sha256.json").unlink()
        match = "is not a braintrace checkpoint: its manifest"
    else:
        (step_dir / "braintrace" / "metadata").unlink()
        match = r"is damaged: its file .*metadata is missing"
    learner, optimizer = trained_target()
    before = flat(snapshot(learner, nnx.state(optimizer)))
    with braintrace.CheckpointManager(saved) as manager, pytest.raises(ValueError, match=match):
        manager.restore(learner, optimizer=optimizer)
    assert_same(before, snapshot(learner, nnx.state(optimizer)))


def test_restore_asks_for_what_was_saved(saved):
    learner, optimizer = trained_target()
    trainer = braintrace.OnlineTrainer(learner, optax.adam(0.1), loss_fn=mse)
    before = flat(snapshot(learner, nnx.state(optimizer)))
    with braintrace.CheckpointManager(saved) as manager:
        with pytest.raises(ValueError, match=r"does not match: it lacks nothing, expected here, "
                                             r"and holds 'optimizer/"):
            manager.restore(learner)  # saved with an optimizer, restored without
        with pytest.raises(ValueError, match=r"it lacks 'opt_state"):
            manager.restore(trainer, optimizer=optimizer)
        with pytest.raises(ValueError, match=r"Step 3 is not saved in .*; saved: \[0\]"):
            manager.restore(learner, 3, optimizer=optimizer)
        with pytest.raises(ValueError, match="Step 0 is already saved"):
            manager.save(0, learner)
        with pytest.raises(TypeError, match="OnlineLearner"):
            manager.save(1, learner.model)
    assert_same(before, snapshot(learner, nnx.state(optimizer)))
    with braintrace.CheckpointManager(saved / "empty") as empty, pytest.raises(
            ValueError, match="holds no checkpoint"):
        empty.restore(learner)


def save_previous_format(path, trainer):
    """A trainer's checkpoint as the previous braintrace wrote it (``braintrace-ckpt/2``)."""
    import hashlib

    state = trainer.learner.state()
    graph = trainer.learner.graph
    names = [*(f"params/{p}" for p in graph.param_paths),
             *(f"hidden/{p}" for p in graph.hidden_paths),
             *(f"other/{p}" for p in graph.other_paths),
             *(f"traces{jax.tree_util.keystr(k)}" for k, _ in
               jax.tree_util.tree_flatten_with_path(state["traces"])[0]),
             *(f"opt_state{jax.tree_util.keystr(k)}" for k, _ in
               jax.tree_util.tree_flatten_with_path(trainer.opt_state)[0])]
    leaves = [*state["params"], *state["hidden"], *state["other"],
              *jax.tree.leaves(state["traces"]), *jax.tree.leaves(trainer.opt_state)]
    meta = {"format": "braintrace-ckpt/2",
            "leaves": [{"name": n, "impl": "", "shape": list(a.shape), "dtype": str(a.dtype)}
                       for n, a in zip(names, leaves, strict=True)]}
    with ocp.Checkpointer(ocp.CompositeCheckpointHandler()) as checkpointer:
        checkpointer.save(path, args=ocp.args.Composite(
            arrays=ocp.args.StandardSave({f"{i:06d}": a for i, a in enumerate(leaves)}),
            meta=ocp.args.JsonSave(meta)))
    digests = {str(f.relative_to(path)): hashlib.sha256(f.read_bytes()).hexdigest()
               for f in path.rglob("*") if f.is_file()}
    (path / "braintrace.sha256.json").write_text(json.dumps(digests))


def test_a_checkpoint_of_the_previous_format_still_restores(tmp_path):
    first = make_trainer()
    first.step(*batch(0))
    save_previous_format(tmp_path / "old.ckpt", first)
    expected = first.step(*batch(1))
    resumed = make_trainer(seed=3)
    resumed.restore(str(tmp_path / "old.ckpt"))
    assert_same(resumed.step(*batch(1)), expected)
    assert_same(snapshot(resumed.learner, resumed.opt_state),
                snapshot(first.learner, first.opt_state))
    other = braintrace.OnlineTrainer(make_learner(seed=3, hidden=H + 1), optax.adam(1e-2),
                                     loss_fn=mse, update_every=2)
    before = flat(snapshot(other.learner, other.opt_state))
    with pytest.raises(ValueError, match=r"old\.ckpt does not match at 'params/"):
        other.restore(str(tmp_path / "old.ckpt"))
    assert_same(before, snapshot(other.learner, other.opt_state))
