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
    if len(shape) >= 1 and tuple(shape[:-1]) != batch:
        new_batch = shape[0] if len(shape) == 2 else None
        hint = (f"call braintrace.init_states(model, batch_size={new_batch})"
                if len(shape) <= 2 else "flatten the batch axes into one")
        raise ValueError(
            f"{name}: input of shape {tuple(shape)} does not match the batch of {state_name} "
            f"of shape {tuple(state.shape)}; expected input shape {expected}. To step a "
            f"different batch size, {hint} first.")
    raise ValueError(
        f"{name}: input of shape {tuple(shape)} has the wrong feature size; expected input "
        f"shape {expected}.")
