"""``OnlineTrainer.fit`` resumes: interrupted by Ctrl+C, restored from its checkpoint into a new
trainer, it continues bit for bit as the run that was never interrupted (History, early stop,
Params); Ctrl+C finishes the batch in flight and runs ``on_end``."""

import signal

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

import braintrace
from braintrace import layers
from braintrace._drivers._fit_arguments import batch_stream
from braintrace._drivers._interrupt import DeferredInterrupt
from braintrace.tasks import SpikePatterns

B = 4
TASK = SpikePatterns(num_classes=3, num_inputs=5, seq_len=12, response_steps=3, seed=0)


def cross_entropy(y, t):
    return optax.softmax_cross_entropy_with_integer_labels(y, t).mean()


class Ends(braintrace.Callback):
    """Records each ``on_end``: whether the run was interrupted, and its length."""

    def __init__(self):
        self.ends = []

    def on_end(self, trainer, history):
        self.ends.append((history.interrupted, len(history)))


def params(learner):
    return [np.asarray(p) for p in jax.tree.leaves(nnx.state(learner.model, nnx.Param))]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """One learner (one compiled program) for every trainer; its initial state saved."""
    model = nnx.Sequential(layers.ETPLinear(5, 8, rngs=nnx.Rngs(0)), layers.LIF(8, tau=5.0),
                           layers.LeakyReadout(8, 3, rngs=nnx.Rngs(1)))
    learner = braintrace.compile(model, "es_d_rtrl", jnp.zeros((B, 5)), batch_size=B)
    tx = optax.adam(0.05)
    initial = str(tmp_path_factory.mktemp("initial") / "ckpt")
    braintrace.OnlineTrainer(learner, tx, loss_fn=cross_entropy).save(initial)
    batches = [TASK.sample(jax.random.key(i), B) for i in range(16)]
    return learner, tx, initial, batches, TASK.sample(jax.random.key(10_000), B)


def test_a_fit_stopped_by_ctrl_c_resumes_from_its_checkpoint_as_if_never_stopped(
        setup, tmp_path, monkeypatch):
    learner, tx, initial, batches, validation = setup

    def trainer():  # a new trainer from the initial state (a new process would build it so)
        new = braintrace.OnlineTrainer(learner, tx, loss_fn=cross_entropy)
        new.restore(initial)
        return new

    def fit(trainer, directory, *extra):
        with braintrace.CheckpointManager(directory, max_to_keep=2) as manager:
            callbacks = [braintrace.ModelCheckpoint(manager, every=4),
                         braintrace.EarlyStopping(patience=2, restore_best=True), *extra]
            return trainer.fit(lambda start: iter(batches[start:]), steps=16,
                               validation=validation, eval_every=2, callbacks=callbacks,
                               progress=False)

    want = fit(trainer(), tmp_path / "whole")
    assert want.stopped_early and len(want) == 12  # early stopping decides where it ends
    want_params = params(learner)  # the best Params, restored at the end

    def interrupted_at(n):  # Ctrl+C while the stream is asked for batch n + 1
        def stream(start):
            for i in range(start, len(batches)):
                if i == n:
                    signal.raise_signal(signal.SIGINT)
                yield batches[i]
        return stream

    ends = Ends()
    stopped = trainer()
    with braintrace.CheckpointManager(tmp_path / "run", max_to_keep=2) as manager:
        callbacks = [braintrace.ModelCheckpoint(manager, every=4),
                     braintrace.EarlyStopping(patience=2, restore_best=True), ends]
        with pytest.raises(KeyboardInterrupt):
            stopped.fit(interrupted_at(10), steps=16, validation=validation, eval_every=2,
                        callbacks=callbacks, progress=False)
        # the batch in flight (the 11th) was finished, on_end ran, the last batch was saved
        assert stopped.history.interrupted and len(stopped.history) == 11
        assert ends.ends == [(True, 11)] and manager.all_steps() == [8, 11]
        assert callbacks[1].waited == 1  # a best value and a patience half used: state to keep
        assert stopped.history.steps == want.steps[:11]

    resumed = trainer()  # the initial Params again: only the restore can bring it to step 11
    with braintrace.CheckpointManager(tmp_path / "run") as manager:
        assert manager.restore(resumed) == 11
    with pytest.raises(ValueError, match=r"callbacks \['ModelCheckpoint', 'EarlyStopping', "
                                         r"'Ends'\]; this fit has \['ModelCheckpoint', "
                                         r"'EarlyStopping'\]"):
        fit(resumed, tmp_path / "run")
    got = fit(resumed, tmp_path / "run", Ends())
    assert got == want  # every record: losses, evaluations, spike rates, the early stop
    assert got.stopped_early and not got.interrupted and got.spike_rates
    for a, b in zip(params(learner), want_params, strict=True):
        np.testing.assert_array_equal(a, b)
    # the negative control: an EarlyStopping that forgets its state does not stop there
    control = trainer()
    with braintrace.CheckpointManager(tmp_path / "run") as manager:
        manager.restore(control, step=11)
    monkeypatch.setattr(braintrace.EarlyStopping, "load_state_dict", lambda self, state: None)
    assert len(fit(control, tmp_path / "control", Ends())) > 12


def test_keyboard_interrupt_raised_in_a_stream_runs_on_end_and_keeps_the_history(setup):
    learner, tx, initial, batches, _ = setup
    trainer = braintrace.OnlineTrainer(learner, tx, loss_fn=cross_entropy)
    trainer.restore(initial)
    ends = Ends()

    def stream():
        yield from batches[:2]
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        trainer.fit(stream(), callbacks=[ends], progress=False)
    assert ends.ends == [(True, 2)]
    assert [r["step"] for r in trainer.history.steps] == [1, 2]
    assert all(np.isfinite(r["loss"]) for r in trainer.history.steps)


def test_a_second_ctrl_c_stops_at_once():
    with DeferredInterrupt() as interrupt:
        interrupt.handle(signal.SIGINT, None)
        assert interrupt.requested
        with pytest.raises(KeyboardInterrupt):
            interrupt.handle(signal.SIGINT, None)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_the_stream_starts_at_the_first_batch_not_learnt():
    listed = ["a", "b", "c"]
    assert [b for _, b, _ in batch_stream(listed, 3, 7, 4, False)] == ["b", "c", "a"]
    assert [e for e, _, _ in batch_stream(listed, 3, 7, 4, False)] == [1, 1, 2]
    generator = (x for x in range(10))
    assert [b for _, b, _ in batch_stream(generator, 1, 6, 4, False)] == [4, 5]  # 4 dropped
    assert [b for _, b, _ in batch_stream(lambda start: range(start, 9), 1, 6, 4, False)] \
        == [4, 5]
    with pytest.raises(ValueError, match="a function.*rather than epochs"):
        batch_stream(lambda start: [], 2, None, 0, False)


def test_model_checkpoint_takes_a_checkpoint_manager_only():
    with pytest.raises(TypeError, match=r"manager must be a braintrace.CheckpointManager, "
                                        r"got dict"):
        braintrace.ModelCheckpoint({}, every=1)
