"""Four forced host devices: many calls back to back neither hang nor abort, and no trace rows
move between devices inside the time loop.

One subprocess (``jax_num_cpu_devices=4``, a timeout: a hang fails) runs the configurations
of ``benchmarks/sharding.py`` at small sizes, several calls back to back: ``etrace_grad``
(a sequence longer than one time block, so both the blocks' loop and the shorter last block
run), ``online_grad`` inside ``jit``, ``OnlineTrainer`` updates, ``evaluate``, a checkpoint
save and restore, then the gradient again, and ``etrace_grad`` with a ``(T, B)`` padding
mask. It compares every result with the same learner on one device, and has XLA write each
compiled program's optimised HLO; the tests here read those programs.

XLA:CPU runs every device's program on a shared pool of threads (as many as there are
devices on a machine with fewer cores) and a collective holds a thread until every device
has joined it. A program with several independent collectives (per-sample slices of a
batch-sharded trace moved by collective-permutes, gathers of the batch) let a device wait in
two at once and the pool ran out: the 4-device benchmark aborted in XLA's rendezvous. The
data-parallel programs now hold all-reduces only (of gradients and losses, never of a batch
axis), which these tests check.
"""

import glob
import json
import os
import re
import subprocess
import sys
import textwrap

import pytest
from helpers import subprocess_env

SCRIPT = textwrap.dedent("""
    import json, os, sys, tempfile
    import jax
    jax.config.update("jax_num_cpu_devices", 4)
    import jax.numpy as jnp, numpy as np, optax
    from flax import nnx
    import braintrace
    from braintrace import layers

    B, T, I, H, O = 8, 36, 3, 6, 2   # T > the default block of 32 steps: blocks and a tail

    class GRUNet(nnx.Module):   # the benchmark's gru model
        def __init__(self):
            self.rnn = layers.Stateful(layers.GRUCell(I, H, rngs=nnx.Rngs(0)))
            self.readout = layers.ETPLinear(H, O, rngs=nnx.Rngs(1))
        def __call__(self, x):
            return self.readout(self.rnn(x))

    class SNN(nnx.Module):
        def __init__(self):
            self.l1 = layers.RecurrentSpiking(I, layers.ALIF(H), rngs=nnx.Rngs(0))
            self.readout = layers.LeakyReadout(H, O, rngs=nnx.Rngs(1))
        def __call__(self, x):
            return self.readout(self.l1(x))

    def gap(a, b):  # relative to the largest value
        a, b = ([np.asarray(u, np.float32) for u in jax.tree.leaves(t)] for t in (a, b))
        scale = max(float(np.max(np.abs(u))) for u in a)
        return max(float(np.max(np.abs(u - v))) for u, v in zip(a, b)) / scale

    mesh = jax.make_mesh((4,), ("data",))
    xs = 2.0 * jax.random.normal(jax.random.key(0), (T, B, I))
    ys = jax.random.normal(jax.random.key(1), (T, B, O))
    mse = lambda y, t: jnp.mean((y - t) ** 2)
    out = {"devices": jax.device_count()}

    kept = {}   # each configuration's learners (one device, four), for the masked case

    def run(make, method, compare, everything=False):
        # calls back to back on 4 devices (and, with compare, on one device: the gaps)
        learners = [braintrace.compile(make(), method, xs[0], batch_size=B, **kw)
                    for kw in (({},) if compare else ()) + ({"mesh": mesh},)]
        kept[make.__name__, method] = learners
        four, gaps = learners[-1], {}
        r = {"param_shapes": sorted({tuple(p.shape) for p in four.leaves().params})}
        differ = (lambda f: gap(*map(f, learners))) if compare else (lambda f: f(four) and 0.0)
        for k in range(2):        # back to back, state carried from call to call
            gaps[f"etrace_grad {k}"] = differ(lambda l: l.etrace_grad(xs, ys, mse))
        trainers = {id(l): braintrace.OnlineTrainer(l, optax.adam(1e-2), loss_fn=mse,
                                                    update_every=4) for l in learners}
        for k in range(2):
            gaps[f"trainer {k}"] = differ(lambda l: (trainers[id(l)].step(xs, ys),
                                                     nnx.state(l.model, nnx.Param))[1])
        r["gaps"] = gaps
        if not everything:
            return r
        gaps["evaluate"] = differ(lambda l: l.evaluate(xs))
        gaps["online_grad"] = differ(lambda l: nnx.jit(
            lambda m, s, o=braintrace.online_grad(l, mse): o.grad(m, s, xs, ys)[0])(
                l.model, braintrace.online_grad(l, mse).init(l.model)))
        path = os.path.join(tempfile.mkdtemp(), "run.ckpt")
        four.save(path)
        before = four.etrace_grad(xs, ys, mse)
        four.restore(path)
        gaps["restored"] = gap(before, four.etrace_grad(xs, ys, mse))
        r["temp_bytes"] = [
            l.lower_etrace_grad(xs, ys, mse).compile().memory_analysis().temp_size_in_bytes
            for l in learners]
        jax.block_until_ready(jax.tree.leaves(four.traces))
        return r

    def masked(learners):
        # a (T, B) padding mask: sample b scored on its first lengths[b] steps (0: a padded
        # sample; each device holds 2 samples, so some steps score nothing on some device)
        lengths = jnp.array([T, 30, 0, 17, 5, T, 1, 24])
        mask = (jnp.arange(T)[:, None] < lengths[None]).astype(jnp.float32)
        got = {}
        for name, kw in (("masked", {"mask": mask}), ("unmasked", {})):
            for l in learners:
                l.reset()   # fresh hidden state and traces; the Params are those of run()
            got[name] = [l.etrace_grad(xs, ys, mse, return_losses=True, **kw) for l in learners]
        (g1, l1), (g4, l4) = got["masked"]
        g4u, l4u = got["unmasked"][1]
        return {"grads": gap(g1, g4), "losses": gap(l1, l4),
                "unmasked grads": gap(g4u, g4), "unmasked losses": gap(l4u, l4)}

    out["gru d_rtrl"] = run(GRUNet, "d_rtrl", compare=True, everything=True)
    out["gru d_rtrl masked"] = masked(kept["GRUNet", "d_rtrl"])
    out["gru es_d_rtrl"] = run(GRUNet, "es_d_rtrl", compare=False)
    out["alif d_rtrl"] = run(SNN, "d_rtrl", compare=True)
    print("RESULT" + json.dumps(out))
""")

PROGRAMS = ("jit_checked_grad_program", "jit_checked_train_program", "jit_evolve_program")
MOVING = ("all-gather", "collective-permute", "all-to-all", "reduce-scatter", "ragged-all-to-all")
CONFIGS = ("gru d_rtrl", "gru es_d_rtrl", "alif d_rtrl")


@pytest.fixture(scope="module")
def four(tmp_path_factory):
    dump = tmp_path_factory.mktemp("hlo")
    env = subprocess_env(f"--xla_dump_to={dump}", "--xla_dump_hlo_as_text",
                         "--xla_dump_hlo_module_re=.*_program.*")
    try:
        done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                              env=env, timeout=240, check=False)
    except subprocess.TimeoutExpired as err:
        pytest.fail(f"4 devices: the calls hung (no result in {err.timeout} s)")
    assert done.returncode == 0, done.stderr[-3000:]
    line = next(ln for ln in done.stdout.splitlines() if ln.startswith("RESULT"))
    programs = {}
    for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
        name = os.path.basename(path)
        if any(p in name for p in PROGRAMS):
            with open(path) as f:
                programs[name] = f.read()
    return json.loads(line[len("RESULT"):]), programs


def test_back_to_back_calls_on_four_devices_equal_one_device(four):
    result, _ = four
    assert result["devices"] == 4
    calls = {"etrace_grad 0", "etrace_grad 1", "trainer 0", "trainer 1"}
    for config in CONFIGS:  # gru es_d_rtrl: 4 devices only (its gaps: test_sharding.py)
        gaps = result[config]["gaps"]
        everything = calls | {"evaluate", "online_grad", "restored"}
        assert set(gaps) == (everything if config == "gru d_rtrl" else calls), config
        assert max(gaps.values()) < 1e-5, (config, gaps)  # float32: the sums' order differs


def test_a_padding_mask_on_four_devices_equals_one_device(four):
    """A ``(T, B)`` padding mask on a batch-sharded learner: its gradient and losses are those
    on one device (``'mean'`` divides by the scored pairs of every device, not of one), and
    the mask matters (the unmasked gradient differs)."""
    result, _ = four
    gaps = result["gru d_rtrl masked"]
    assert max(gaps["grads"], gaps["losses"]) < 1e-5, gaps  # float32: the sums' order differs
    assert min(gaps["unmasked grads"], gaps["unmasked losses"]) > 1e-2, gaps


def test_temporary_memory_per_device_at_most_one_device(four):
    """XLA's temporary buffers of ``etrace_grad`` per device: no copy of other devices'
    trace rows, so not more than one device needs for the whole batch."""
    result, _ = four
    one, per_device = result["gru d_rtrl"]["temp_bytes"]
    assert 0 < per_device <= one


def _computations(text: str) -> dict[str, list[str]]:
    comps, current = {}, None
    for line in text.splitlines():
        if not line.startswith((" ", "}")) and line.rstrip().endswith("{") and "(" in line:
            current = re.match(r"^(?:ENTRY )?%?([\w.\-]+)", line).group(1)
            comps[current] = []
        elif line.startswith("}"):
            current = None
        elif current is not None:
            comps[current].append(line)
    return comps


def _loop_computations(comps: dict[str, list[str]]) -> set[str]:
    """The while bodies and every computation they call."""
    called = {name: {c for line in lines for c in re.findall(
        r"(?:body|condition|to_apply|calls)=%?([\w.\-]+)", line)} for name, lines in comps.items()}
    stack = [b for lines in comps.values() for line in lines
             for b in re.findall(r"body=%?([\w.\-]+)", line)]
    seen = set()
    while stack:
        name = stack.pop()
        if name not in seen:
            seen.add(name)
            stack.extend(called.get(name, ()))
    return seen


def _collectives(lines: list[str], kinds: tuple[str, ...]) -> list[str]:
    return [ln for ln in lines for k in kinds if re.search(rf"\s{k}(-start)?\(", ln)]


def _shapes(line: str) -> list[tuple[int, ...]]:
    """The shapes of an all-reduce's results (a tuple for combined ones)."""
    shapes = re.match(r"\s*%[\w.\-]+ = (\(.*?\)|\S+) all-reduce", line).group(1)
    return [tuple(int(d) for d in dims.split(",") if d)
            for dims in re.findall(r"\w+\[([\d,]*)\]", shapes)]


def test_the_sharded_programs_were_compiled_and_read(four):
    _, programs = four
    names = " ".join(programs)
    assert all(p in names for p in ("jit_checked_grad_program", "jit_checked_train_program")), \
        names
    loops = [_loop_computations(_computations(t)) for t in programs.values()]
    assert all(loops)  # every program has its time loop


def test_no_rows_move_between_devices_in_the_data_parallel_programs(four):
    """No gather, permute or all-to-all anywhere: data stays on its device; what crosses
    devices is all-reduces of gradients and losses."""
    _, programs = four
    for name, text in programs.items():
        moving = _collectives(text.splitlines(), MOVING)
        assert not moving, (name, moving[:3])


def test_inside_the_time_loop_only_gradient_sized_all_reduces(four):
    """What an all-reduce in the loop carries is shaped like a Param (a gradient, summed over
    the devices' samples) or is a loss; a trace row carries a sample axis besides."""
    result, programs = four
    allowed = {()} | {tuple(sorted(s)) for c in CONFIGS for s in result[c]["param_shapes"]}
    for name, text in programs.items():
        comps = _computations(text)
        loop = [ln for c in _loop_computations(comps) for ln in comps.get(c, [])]
        for line in _collectives(loop, ("all-reduce",)):
            shapes = {tuple(sorted(shape)) for shape in _shapes(line)}  # or transposed
            assert shapes and shapes <= allowed, (name, shapes, line[:200])
