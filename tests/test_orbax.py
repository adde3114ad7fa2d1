"""Orbax checkpoints of sharded learners: save on 4 devices, restore on 4 or 2, continue.

(``learner.save`` / ``trainer.save`` and ``braintrace.CheckpointManager``.)

(``tests/test_multihost.py`` restores a checkpoint of two processes on one device.) One subprocess with ``jax_num_cpu_devices=4`` runs every scenario and reports
as JSON whether the resumed runs equal the uninterrupted ones bit for bit.
"""

import json
import subprocess
import sys
import textwrap

import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import subprocess_env

import braintrace
from braintrace import layers

SCRIPT = textwrap.dedent("""
    import json, sys
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import braintrace
    from braintrace import layers

    tmp = sys.argv[1]
    B = 8
    xs = jax.random.normal(jax.random.key(0), (6, B, 3))
    ys = jax.random.normal(jax.random.key(1), (6, B, 2))
    mse = lambda y, t: jnp.mean((y - t) ** 2)

    def mesh(n):
        return None if n is None else jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])

    def learner(n, seed=0):
        model = nnx.Sequential(layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(seed))),
                               layers.ETPLinear(8, 2, rngs=nnx.Rngs(seed + 1)))
        return braintrace.compile(model, "d_rtrl", jnp.ones((B, 3)), batch_size=B, mesh=mesh(n))

    def trainer(n, seed=0):
        return braintrace.OnlineTrainer(learner(n, seed), optax.adam(1e-2), loss_fn=mse,
                                        update_every=3)

    def same(a, b):
        a, b = jax.tree.leaves(a), jax.tree.leaves(b)
        return len(a) == len(b) and all(np.array_equal(np.asarray(u), np.asarray(v))
                                        for u, v in zip(a, b))

    out = {}
    # etrace_grad: the first half on 4 devices, saved; the second half restored on n
    # (per-sample hidden states and traces are bitwise the same on any number of devices).
    first = learner(4)
    first.etrace_grad(xs[:3], ys[:3], mse)
    first.save(f"{tmp}/learner")
    for n in (2,):
        straight = learner(n)
        straight.etrace_grad(xs[:3], ys[:3], mse)
        expected = straight.etrace_grad(xs[3:], ys[3:], mse)
        resumed = learner(n, seed=5)
        resumed.restore(f"{tmp}/learner")
        shards = {str(t.sharding.spec) for t in jax.tree.leaves(resumed.traces)
                  if hasattr(t.sharding, "spec") and t.ndim}
        got = resumed.etrace_grad(xs[3:], ys[3:], mse)
        out[f"learner_{n}"] = {"grads": same(got, expected),
                               "state": same(resumed.state(), straight.state()),
                               "trace_specs": sorted(shards)}
    # OnlineTrainer: Params and optimizer state change inside the scan. The uninterrupted
    # run on n devices starts from the live state of the first half on 4 (a gradient summed
    # over 4 devices is not bitwise the one summed over 2).
    first = trainer(4)
    first.step(xs[:3], ys[:3])
    first.save(f"{tmp}/trainer")
    with braintrace.CheckpointManager(f"{tmp}/managed", max_to_keep=1) as manager:
        manager.save(3, first)
    live = (first.learner.state(), first.opt_state)
    continued = trainer(2, seed=7)
    continued.learner.load_state(live[0])
    continued.opt_state = live[1]
    runs = {4: first, 2: continued}
    for n in (4, 2):
        expected = runs[n].step(xs[3:], ys[3:])
        resumed = trainer(n, seed=5)
        resumed.restore(f"{tmp}/trainer")
        got = resumed.step(xs[3:], ys[3:])
        out[f"trainer_{n}"] = {"losses": same(got, expected),
                               "state": same(resumed.learner.state(), runs[n].learner.state()),
                               "opt_state": same(resumed.opt_state, runs[n].opt_state)}
        managed = trainer(n, seed=6)
        with braintrace.CheckpointManager(f"{tmp}/managed", max_to_keep=1) as manager:
            manager.restore(managed)
        out[f"managed_{n}"] = same(managed.step(xs[3:], ys[3:]), expected)
    # A checkpoint of another batch size is refused on a mesh, and nothing changes.
    other = braintrace.compile(
        nnx.Sequential(layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(0))),
                       layers.ETPLinear(8, 2, rngs=nnx.Rngs(1))),
        "d_rtrl", jnp.ones((4, 3)), batch_size=4, mesh=mesh(4))
    before = other.state()
    try:
        other.restore(f"{tmp}/learner")
    except ValueError as err:
        out["mismatch"] = str(err)
    out["mismatch_unchanged"] = same(before, other.state())
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def resumed(tmp_path_factory):
    env = subprocess_env()
    tmp = str(tmp_path_factory.mktemp("orbax"))
    done = subprocess.run([sys.executable, "-c", SCRIPT, tmp], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_learner_saved_on_four_devices_resumes_on_two_bit_identically(resumed):
    r = resumed["learner_2"]
    assert r["grads"] and r["state"]
    assert r["trace_specs"] == ["P('data',)"]


@pytest.mark.parametrize("devices", ["4", "2"])
def test_trainer_saved_on_four_devices_resumes_bit_identically(resumed, devices):
    r = resumed[f"trainer_{devices}"]
    assert r["losses"] and r["state"] and r["opt_state"]
    assert resumed[f"managed_{devices}"]  # through braintrace.CheckpointManager


def test_checkpoint_of_another_batch_size_on_a_mesh_names_the_leaf_and_changes_nothing(
        resumed):
    assert "does not match at 'hidden/layers.0.carry': it stores (8, 8) float32, but (4, 8) " in (
        resumed["mismatch"])
    assert resumed["mismatch_unchanged"]


def test_save_never_replaces_something_that_is_not_a_checkpoint(tmp_path):
    learner = braintrace.compile(layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0))),
                                 "d_rtrl", jnp.ones((2, 2)), batch_size=2)
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="exists and is not a braintrace checkpoint"):
        learner.save(str(tmp_path))
    assert (tmp_path / "notes.txt").read_text() == "mine"
    learner.save(str(tmp_path / "run"))
    learner.save(str(tmp_path / "run"))  # a checkpoint is replaced
    learner.restore(str(tmp_path / "run"))
