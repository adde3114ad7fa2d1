"""Shape checks shared by the layers: errors that say which layer, what shape, what to do."""

from __future__ import annotations

from braintrace._hidden import HiddenState


def _where(state: HiddenState, attr: str) -> str:
    """`` at 'module.path'`` of the layer whose state at ``attr`` is ``state``, if recorded."""
    path = state.get_metadata("path", None)
    if not path or not (path == attr or path.endswith("." + attr)):
        return ""
    module_path = path[:-len(attr)].rstrip(".")
    return f" at '{module_path}'" if module_path else " (the model itself)"


def check_features(name: str, shape: tuple[int, ...], features: int) -> None:
    """Raises if the last axis of an input of shape ``shape`` is not ``features`` long."""
    if len(shape) < 1 or shape[-1] != features:
        raise ValueError(
            f"{name}: input of shape {tuple(shape)} has the wrong feature "
            f"size; expected shape (..., {features}).")


ONE_STEP = ("A call of the model is one time step: a sequence xs (time axis first: T, batch, "
            "*features) goes through braintrace.evaluate(model, xs) to run it, or a learner to "
            "train on it (braintrace.compile(model, algorithm, xs[0], batch_size=xs.shape[1]), "
            "then etrace_grad, OnlineTrainer or online_grad)")
"""What a whole sequence given to one step of a model is told."""


def check_step_input(name: str, shape: tuple[int, ...], state: HiddenState, features: int,
                     attr: str) -> None:
    """Raises if an input of shape ``shape`` does not fit a step on ``state``.

    The input must be ``(*batch, features)`` where ``batch`` is the batch shape
    of the hidden state ``state`` (its shape without the trailing feature axis).
    ``attr`` is the state's attribute path inside the layer named ``name``.
    """
    batch = tuple(state.shape[:-1])
    expected = (*batch, features)
    if tuple(shape) == expected:
        return
    name = f"{name}{_where(state, attr)}"
    path = state.get_metadata("path", None)
    state_name = f"hidden state '{path}'" if path else "its hidden state"
    shape = tuple(shape)
    if batch and shape[1:] == expected:  # (T, *batch, features): a whole sequence
        raise ValueError(
            f"{name}: input of shape {shape} is {shape[0]} steps of the shape {expected} that "
            f"one step takes. {ONE_STEP}.")
    if len(shape) == len(expected) + 2 and not batch and shape[-1] == features:
        raise ValueError(  # (T, batch, features) on per-sample states, most likely
            f"{name}: input of shape {shape} has two axes more than the shape {expected} that "
            f"one step of {state_name} (one sample) takes. {ONE_STEP}. For one step of a batch "
            "with several axes, flatten them into one and call "
            "braintrace.init_states(model, batch_size=...) first.")
    if len(shape) >= 1 and shape[:-1] != batch:
        new_batch = shape[0] if len(shape) == 2 else None
        hint = (f"call braintrace.init_states(model, batch_size={new_batch})"
                if len(shape) <= 2 else "flatten the batch axes into one")
        raise ValueError(
            f"{name}: input of shape {shape} does not match the batch of {state_name} "
            f"of shape {tuple(state.shape)}; expected input shape {expected}. To step a "
            f"different batch size, {hint} first.")
    raise ValueError(
        f"{name}: input of shape {tuple(shape)} has the wrong feature size; expected input "
        f"shape {expected}.")
