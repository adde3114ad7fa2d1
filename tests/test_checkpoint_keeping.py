"""CheckpointManager never loses the best or the last complete step, and refuses before writing.

Each case reopens the directory, as a later process would: a NaN or infinite
metric is never best, so it never deletes the best step; old steps are deleted
only once the new step is complete (a crash simulated by a write that raises);
two managers on one directory read the directory; a step not larger than every
saved one, metrics that ``best_fn`` cannot read and an abstract state are
errors naming the argument, with nothing written.
"""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from helpers import mse

import braintrace
import braintrace._drivers._manager as manager_module
from braintrace import layers


def make_model(seed=0):
    return nnx.Sequential(layers.ETPLinear(2, 3, rngs=nnx.Rngs(seed)), layers.LIF(3))


def kernel(model):
    return np.asarray(model.layers[0].kernel[...])


def listing(directory):
    """Every entry under ``directory`` (steps, orbax's temporary directories, files)."""
    return sorted(os.path.relpath(os.path.join(root, name), directory)
                  for root, dirs, files in os.walk(directory) for name in dirs + files)


def contents(directory):
    """Every file under ``directory`` with its bytes."""
    return {name: (directory / name).read_bytes() for name in listing(directory)
            if (directory / name).is_file()}


def manager(directory, **options):
    return braintrace.CheckpointManager(directory, **options)


def loss_best(**options):
    return {"best_fn": lambda m: m["loss"], **options}


@pytest.mark.parametrize("mode, bad", [("min", [math.nan, -math.inf, math.inf]),
                                       ("max", [math.nan, math.inf, -math.inf])])
def test_a_nan_or_infinite_metric_is_never_best_and_never_deletes_the_best(tmp_path, mode,
                                                                           bad):
    model = make_model()
    with manager(tmp_path, max_to_keep=1, best_mode=mode, **loss_best()) as saving:
        saving.save(0, model=model, metrics={"loss": 1.0})
        for step, value in enumerate(bad, start=1):
            saving.save(step, model=model, metrics={"loss": jnp.float32(value)})
            assert saving.all_steps() == [0, step] and saving.best_step() == 0
    with manager(tmp_path, max_to_keep=1, best_mode=mode, **loss_best()) as reopened:
        assert reopened.all_steps() == [0, 3] and reopened.best_step() == 0
        assert reopened.restore(0, model=make_model(1)) == 0


def test_no_step_is_best_when_every_metric_is_nan(tmp_path):
    with manager(tmp_path, max_to_keep=2, **loss_best(best_mode="min")) as saving:
        saving.save(0, model=make_model(), metrics={"loss": math.nan})
        assert saving.best_step() is None and saving.latest_step() == 0


def test_save_of_a_step_not_larger_than_every_saved_one_is_an_error(tmp_path):
    model = make_model()
    with manager(tmp_path, **loss_best(best_mode="min")) as saving:
        saving.save(0, model=model, metrics={"loss": 1.0})
        saving.save(5, model=model, metrics={"loss": 2.0})
        assert saving.restore(saving.best_step(), model=model) == 0
        before = listing(tmp_path)
        with pytest.raises(ValueError, match=r"step 3 is not larger than every saved step "
                                             r"\(the latest is 5\)"):
            saving.save(3, model=model, metrics={"loss": 0.5})
    assert listing(tmp_path) == before


def test_two_managers_on_one_directory_read_the_directory(tmp_path):
    first_model, second_model = make_model(0), make_model(1)
    with manager(tmp_path) as first, manager(tmp_path) as second:
        first.save(0, model=first_model)
        second.save(1, model=second_model)
        assert first.all_steps() == [0, 1] and first.latest_step() == 1
        restored = make_model(2)
        assert first.restore(model=restored) == 1
        np.testing.assert_array_equal(kernel(restored), kernel(second_model))
        before = contents(tmp_path)
        with pytest.raises(ValueError, match=r"Step 1 is already saved in .*nothing is written"):
            first.save(1, model=first_model)
    assert contents(tmp_path) == before


def test_old_steps_are_deleted_only_after_the_new_step_is_complete(tmp_path, monkeypatch):
    model = make_model()
    with manager(tmp_path, max_to_keep=1) as saving:
        saving.save(0, model=model)
        saved_kernel = kernel(model)
        nnx.update(model, jax.tree.map(lambda p: p + 1, nnx.state(model, nnx.Param)))

        def crash(where):
            raise OSError(f"disk full while writing the manifest of {where}")

        monkeypatch.setattr(manager_module, "write_manifest", crash)
        with pytest.raises(OSError, match="disk full"):
            saving.save(1, model=model)
    monkeypatch.undo()
    with manager(tmp_path, max_to_keep=1) as reopened:
        restored = make_model(3)
        assert reopened.restore(model=restored) == 0
        np.testing.assert_array_equal(kernel(restored), saved_kernel)
        reopened.save(2, model=model)  # the next complete save then deletes the older steps
        assert reopened.all_steps() == [2]


def test_metrics_that_best_fn_cannot_read_are_an_error_and_nothing_is_written(tmp_path):
    with manager(tmp_path, max_to_keep=1, **loss_best()) as saving:
        before = listing(tmp_path)
        with pytest.raises(ValueError, match=r"CheckpointManager\.save: best_fn could not read "
                                             r"metrics=\{'accuracy': 0\.5\} \(KeyError: 'loss'\)"):
            saving.save(0, model=make_model(), metrics={"accuracy": 0.5})
        with pytest.raises(ValueError, match=r"best_fn\(metrics\) must be a number"):
            saving.save(0, model=make_model(), metrics={"loss": [1.0, 2.0]})
        assert saving.all_steps() == [] and listing(tmp_path) == before


@pytest.fixture(scope="module")
def online():
    model = make_model()
    learner = braintrace.compile(model, "d_rtrl", jnp.ones((1, 2)), batch_size=1)
    return model, braintrace.online_grad(learner, mse)


def test_saving_an_abstract_state_is_an_error_naming_it_and_nothing_is_written(tmp_path,
                                                                               online):
    model, functions = online
    abstract = jax.eval_shape(functions.init, model)
    with manager(tmp_path) as saving:
        before = listing(tmp_path)
        with pytest.raises(TypeError, match=r"CheckpointManager\.save: state holds abstract "
                                            r"arrays \(jax\.ShapeDtypeStruct.*'state_hidden/"):
            saving.save(0, model=model, state=abstract)
        with pytest.raises(TypeError, match=r"CheckpointManager\.save: model holds abstract"):
            saving.save(0, model=nnx.eval_shape(make_model))
        assert saving.all_steps() == [] and listing(tmp_path) == before
        assert saving.save(0, model=model, state=functions.init(model))


FAILED = object()
"""A save that fails before its manifest (as a full disk would), in a sequence below."""

SEQUENCE = [(0.5, FAILED), (1.0,), (0.2, FAILED), (0.1, FAILED), (2.0,), (3.0,), (0.05, FAILED)]
"""``(loss,)`` saved, or ``(loss, FAILED)``: the first save fails, then the best one so far,
twice in a row, before two worse complete saves, and the last save fails."""


def expected_kept(kept, step, loss, max_to_keep):
    """The complete steps ``{step: loss}`` left after ``step`` completes: the last
    ``max_to_keep`` and the best (lowest loss), among the complete steps alone."""
    kept = {**kept, step: loss}
    latest = sorted(kept)[-max_to_keep:]
    return {s: kept[s] for s in {*latest, min(kept, key=kept.get)}}


@pytest.mark.parametrize("max_to_keep", [1, 2])
@pytest.mark.parametrize("mode", ["min", "max"])
def test_a_save_that_fails_midway_is_never_best_nor_counted_and_never_deletes_the_best(
        tmp_path, monkeypatch, mode, max_to_keep):
    """After every save of ``SEQUENCE``, a reopened manager lists exactly the complete steps
    the rules keep among the complete ones, its best step restores the kernel saved there,
    and the directory holds no failed save older than the newest complete step; the last
    step's failed save is replaced when that step is saved again."""
    write_manifest = manager_module.write_manifest

    def manifest(where):
        if int(os.path.basename(where)) in failing:
            raise OSError(f"disk full while writing the manifest of {where}")
        write_manifest(where)

    monkeypatch.setattr(manager_module, "write_manifest", manifest)
    sign = 1.0 if mode == "min" else -1.0  # the same steps are best in both modes
    options = {"max_to_keep": max_to_keep, **loss_best(best_mode=mode)}
    model, kernels, kept, failing = make_model(), {}, {}, set()
    for step, (loss, *failed) in enumerate(SEQUENCE):
        model.layers[0].kernel[...] = jnp.full((2, 3), float(step))
        kernels[step] = kernel(model)
        with manager(tmp_path, **options) as saving:
            if failed:
                failing.add(step)
                with pytest.raises(OSError, match="disk full"):
                    saving.save(step, model=model, metrics={"loss": sign * loss})
            else:
                assert saving.save(step, model=model, metrics={"loss": sign * loss})
                kept = expected_kept(kept, step, loss, max_to_keep)
        best = min(kept, key=kept.get) if kept else None
        with manager(tmp_path, **options) as reopened:
            assert reopened.all_steps() == sorted(kept) and reopened.best_step() == best
            if best is not None:
                restored = make_model(1)
                assert reopened.restore(best, model=restored) == best
                np.testing.assert_array_equal(kernel(restored), kernels[best])
        left = sorted(int(name) for name in os.listdir(tmp_path) if name.isdigit())
        assert left == sorted(kept) + [s for s in failing if s > max(kept, default=-1)]
    failing.clear()
    with manager(tmp_path, **options) as saving:  # the failed last step, saved again
        assert saving.save(step, model=model, metrics={"loss": sign * loss})
        assert saving.all_steps() == sorted(expected_kept(kept, step, loss, max_to_keep))
        assert saving.best_step() == step
