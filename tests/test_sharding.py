"""Data parallel on 4 forced host devices: the same gradients and Params as on one device
(float32 and bfloat16 traces).

The test process keeps its one device; the sharded runs happen in one
subprocess with ``jax_num_cpu_devices=4``, which reports what it measured as
JSON and the tests below check it.
"""

import json
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import pytest
from flax import nnx
from helpers import subprocess_env

import braintrace
from braintrace import layers

SCRIPT = textwrap.dedent("""
    import json
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp, optax
    from flax import nnx
    import braintrace
    from braintrace import layers

    def make():
        return nnx.Sequential(layers.Stateful(layers.GRUCell(3, 8, rngs=nnx.Rngs(0))),
                              layers.ETPLinear(8, 2, rngs=nnx.Rngs(1)))

    def gap(a, b):
        return max(jax.tree.leaves(jax.tree.map(lambda u, v: float(jnp.max(jnp.abs(u - v))),
                                                a, b)))

    mesh = jax.make_mesh((4,), ("data",))
    B = 8
    xs = jax.random.normal(jax.random.key(0), (4, B, 3))
    ys = jax.random.normal(jax.random.key(1), (4, B, 2))
    mse = lambda y, t: jnp.mean((y - t) ** 2)
    out = {"devices": jax.device_count()}
    for alg in ["d_rtrl", "es_d_rtrl"]:
        one = braintrace.compile(make(), alg, jnp.ones((B, 3)), batch_size=B)
        four = braintrace.compile(make(), alg, jnp.ones((B, 3)), batch_size=B, mesh=mesh)
        r = {"grad": gap(one.etrace_grad(xs, ys, mse), four.etrace_grad(xs, ys, mse))}
        if alg == "d_rtrl":  # the same programs for every algorithm
            r["windowed"] = gap(one.etrace_grad(xs, ys, mse, chunk_size=2),
                                four.etrace_grad(xs, ys, mse, chunk_size=2))
            r["evolve"] = gap(one.etrace_evolve(xs), four.etrace_evolve(xs))
        batched = [t for t in jax.tree.leaves(four.traces) if t.ndim]
        r["trace_rows_per_device"] = sorted({t.addressable_shards[0].data.shape[0]
                                             for t in batched})
        r["trace_specs"] = sorted({str(t.sharding.spec) for t in batched})
        r["hidden_rows_per_device"] = [h.addressable_shards[0].data.shape[0]
                                       for h in four.leaves().hidden]
        r["params_replicated"] = all(p.sharding.is_fully_replicated
                                     for p in four.leaves().params)
        out[alg] = r
    narrow = [braintrace.compile(make(), "d_rtrl", jnp.ones((B, 3)), batch_size=B,
                                 trace_dtype=jnp.bfloat16, **kw) for kw in ({}, {"mesh": mesh})]
    grads = [[n.etrace_grad(xs, ys, mse, block_size=2) for n in narrow] for _ in range(2)]
    out["bf16_traces"] = {
        "grad": max(gap(*g) for g in grads),
        "dtypes": sorted({str(t.dtype) for t in jax.tree.leaves(narrow[1].traces)}),
        "specs": sorted({str(t.sharding.spec) for t in jax.tree.leaves(narrow[1].traces)})}
    def spiking():  # a LIF layer read by a leaky readout: OTPE's readers, OTTT's outputs
        return nnx.Sequential(layers.ETPLinear(3, 8, rngs=nnx.Rngs(0)), layers.LIF(8, tau=4.0),
                              layers.LeakyReadout(8, 2, rngs=nnx.Rngs(1)))

    for alg in ["ottt", "sltt", "otpe"]:
        grads = [braintrace.compile(spiking(), alg, jnp.ones((B, 3)), batch_size=B,
                                    **kw).etrace_grad(2.0 * xs, ys, mse)
                 for kw in ({}, {"mesh": mesh})]
        out[alg] = {"grad": gap(*grads), "size": max(float(jnp.max(jnp.abs(g)))
                                                     for g in jax.tree.leaves(grads[0]))}
    snap = [braintrace.compile(make(), braintrace.SnAp(1), jnp.ones((B, 3)), batch_size=B,
                               **kw).etrace_grad(xs, ys, mse) for kw in ({}, {"mesh": mesh})]
    out["snap"] = {"grad": gap(*snap), "size": max(float(jnp.max(jnp.abs(g)))
                                                   for g in jax.tree.leaves(snap[0]))}
    for alg in ["fptt", "osttp"]:  # no traces; a target projected onto the GRU's output
        pair = [braintrace.compile(make(), alg, jnp.ones((B, 3)), batch_size=B, **kw)
                for kw in ({}, {"mesh": mesh})]
        grads = [learner.etrace_grad(xs, ys, mse) for learner in pair]
        out[alg] = {"grad": gap(*grads), "size": max(float(jnp.max(jnp.abs(g)))
                                                     for g in jax.tree.leaves(grads[0]))}
    t1 = braintrace.OnlineTrainer(one, optax.adam(1e-2), loss_fn=mse, update_every=2)
    t4 = braintrace.OnlineTrainer(four, optax.adam(1e-2), loss_fn=mse, update_every=2)
    t1.step(xs, ys)
    t4.step(xs, ys)
    out["trainer"] = gap(nnx.state(one.model, nnx.Param), nnx.state(four.model, nnx.Param))
    out["opt_state_replicated"] = all(a.sharding.is_fully_replicated
                                      for a in jax.tree.leaves(t4.opt_state))
    errors = {}
    for name, kwargs in [("indivisible", dict(batch_size=6, mesh=mesh)),
                         ("no_axis", dict(batch_size=8, mesh=mesh, data_axis="batch"))]:
        try:
            braintrace.compile(make(), "d_rtrl", jnp.ones((kwargs["batch_size"], 3)), **kwargs)
        except ValueError as err:
            errors[name] = str(err)
    try:
        four.reset(batch_size=6)
    except ValueError as err:
        errors["reset"] = str(err)
    errors["reset_kept"] = four.batch_size
    out["errors"] = errors

    # Inputs split over the mesh's explicit axes (jax.make_mesh's default), given to learners
    # compiled without mesh=: gathered outside jit, named inside it.
    split = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(None, "data"))
    sx, sy = jax.device_put(xs, split), jax.device_put(ys, split)
    explicit = {"typed": str(jax.typeof(sx))}
    fresh = lambda: braintrace.compile(make(), "d_rtrl", jnp.ones((B, 3)), batch_size=B)
    try:
        explicit["grad"] = gap(fresh().etrace_grad(xs, ys, mse), fresh().etrace_grad(sx, sy, mse))
        model = make()
        online = braintrace.online_grad(braintrace.compile(model, "d_rtrl", jnp.ones((B, 3)),
                                                           batch_size=B), mse)
        explicit["online_grad"] = gap(online.grad(model, online.init(model), xs, ys)[0],
                                      online.grad(model, online.init(model), sx, sy)[0])
        trainers = [braintrace.OnlineTrainer(fresh(), optax.adam(1e-2), loss_fn=mse,
                                             update_every=2) for _ in range(2)]
        trainers[0].step(xs, ys)
        trainers[1].fit([(sx, sy)], validation=(sx, sy), progress=False)
        explicit["trainer"] = gap(*(nnx.state(t.learner.model, nnx.Param) for t in trainers))
        jax.jit(lambda s, x, y: online.grad(model, s, x, y)[0])(online.init(model), sx, sy)
    except Exception as err:
        explicit["error"] = f"{type(err).__name__}: {err}"
    out["explicit"] = explicit
    print("RESULT" + json.dumps(out))
""")


@pytest.fixture(scope="module")
def sharded():
    env = subprocess_env()
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          env=env, timeout=300, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
    return json.loads(line[len("RESULT"):])


def test_the_test_process_keeps_one_device():
    assert jax.device_count() == 1


@pytest.mark.parametrize("alg", ["d_rtrl", "es_d_rtrl"])
def test_gradients_on_four_devices_equal_one_device(sharded, alg):
    assert sharded["devices"] == 4
    assert sharded[alg]["grad"] < 1e-6
    if alg == "d_rtrl":
        assert sharded[alg]["windowed"] < 1e-6 and sharded[alg]["evolve"] < 1e-6


@pytest.mark.parametrize("alg", ["ottt", "sltt", "otpe"])
def test_spiking_rules_on_four_devices_equal_one_device(sharded, alg):
    assert sharded[alg]["size"] > 1e-4 and sharded[alg]["grad"] < 1e-6


def test_snap_on_four_devices_equals_one_device(sharded):
    """SnAp's NumPy patterns are built outside the mesh layout's ``jax.eval_shape``."""
    assert sharded["snap"]["size"] > 1e-4 and sharded["snap"]["grad"] < 1e-6


@pytest.mark.parametrize("alg", ["fptt", "osttp"])
def test_fptt_and_osttp_on_four_devices_equal_one_device(sharded, alg):
    assert sharded[alg]["size"] > 1e-4 and sharded[alg]["grad"] < 1e-6


@pytest.mark.parametrize("alg", ["d_rtrl", "es_d_rtrl"])
def test_traces_and_hidden_states_are_sharded_params_replicated(sharded, alg):
    r = sharded[alg]
    assert r["trace_rows_per_device"] == [2]          # B = 8 over 4 devices
    assert r["trace_specs"] == ["P('data',)"]
    assert r["hidden_rows_per_device"] == [2]
    assert r["params_replicated"] and sharded["opt_state_replicated"]


def test_bfloat16_traces_on_four_devices_equal_one_device(sharded):
    """Two calls (the second from the stored bfloat16 traces), in time blocks of 2."""
    r = sharded["bf16_traces"]
    assert r["grad"] < 1e-6
    assert r["dtypes"] == ["bfloat16"] and r["specs"] == ["P('data',)"]


def test_online_trainer_step_on_four_devices_gives_the_same_params(sharded):
    assert sharded["trainer"] < 1e-6  # ES-D-RTRL (the last learner compiled)


def test_indivisible_batch_or_missing_axis_is_a_clear_error(sharded):
    errors = sharded["errors"]
    assert "batch_size=6 is not divisible by the size 4 of the mesh's data axis 'data'" in (
        errors["indivisible"])
    assert "no axis named 'batch'" in errors["no_axis"] and "('data',)" in errors["no_axis"]
    assert "batch_size=6 is not divisible" in errors["reset"]
    assert errors["reset_kept"] == 8


def test_inputs_split_over_explicit_axes_are_gathered_for_a_learner_without_a_mesh(sharded):
    """``jax.make_mesh`` makes explicit axes: the split is in the arrays' type. A learner
    compiled without ``mesh=`` gathers such inputs (etrace_grad, online_grad, the trainer and
    fit give the unsplit results); inside ``jit`` it names them and says to pass ``mesh=``."""
    explicit = sharded["explicit"]
    assert explicit["typed"] == "float32[4,8@data,3]"
    assert explicit["grad"] == explicit["online_grad"] == explicit["trainer"] == 0.0
    assert explicit["error"].startswith(
        "ArgumentTypeError: online_grad: grad: xs is split over the mesh axes ['data'] "
        "(float32[4,8@data,3]) inside jit, but this learner was compiled without mesh=")
    assert "Pass the mesh to braintrace.compile(" in explicit["error"]


def test_per_sample_learner_cannot_be_data_parallel():
    mesh = jax.make_mesh((1,), ("data",))
    model = layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
    braintrace.init_states(model, None)
    with pytest.raises(ValueError, match="runs per sample"):
        braintrace.compile(model, "d_rtrl", jnp.ones((2,)), mesh=mesh)


def test_one_device_mesh_gives_the_unsharded_gradient():
    mesh = jax.make_mesh((1,), ("data",))
    make = lambda: layers.Stateful(layers.GRUCell(2, 3, rngs=nnx.Rngs(0)))
    xs, ys = jnp.ones((3, 4, 2)), jnp.zeros((3, 4, 3))
    mse = lambda y, t: jnp.mean((y - t) ** 2)
    plain = braintrace.compile(make(), "d_rtrl", jnp.ones((4, 2)), batch_size=4)
    meshed = braintrace.compile(make(), "d_rtrl", jnp.ones((4, 2)), batch_size=4, mesh=mesh)
    a, b = plain.etrace_grad(xs, ys, mse), meshed.etrace_grad(xs, ys, mse)
    assert all(bool(jnp.array_equal(u, v)) for u, v in zip(jax.tree.leaves(a),
                                                            jax.tree.leaves(b)))
