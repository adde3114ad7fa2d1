"""Shows the members a public class inherits from braintrace's own base classes.

The API pages document each class with ``:inherited-members:`` (``_templates/autosummary``),
so that ``OnlineLearner.save`` and ``restore``, written once on a private base class, are on
the learner's page. Members inherited from other packages' classes (``flax.nnx.Module``'s,
``tuple``'s, ``object``'s) stay off the page: this hook skips a member unless braintrace
defines it.
"""

from __future__ import annotations

import functools
import inspect

OWN_PACKAGES = ("braintrace",)


def defining_module(obj: object) -> str:
    """The module that defines ``obj`` (a function, property, cached property or method
    descriptor), or ``''`` for anything else (a data attribute: never skipped).

    Example:
        >>> from braintrace import OnlineLearner
        >>> defining_module(OnlineLearner.save)
        'braintrace._drivers._checkpointable'
    """
    if isinstance(obj, property):
        obj = obj.fget
    elif isinstance(obj, functools.cached_property):
        obj = obj.func
    obj = getattr(obj, "__func__", obj)  # classmethod / staticmethod
    if inspect.isfunction(obj) or inspect.isclass(obj):
        return obj.__module__ or ""
    if inspect.isroutine(obj):  # a builtin's method (tuple.count): its class's module
        owner = getattr(obj, "__objclass__", None) or getattr(obj, "__self__", None)
        return getattr(owner, "__module__", None) or "builtins"
    return ""


def _on_skip_member(app, what, name, obj, skip, options):
    if what == "class" and not skip:
        module = defining_module(obj)
        if module and not module.startswith(OWN_PACKAGES):
            return True
    return None


def setup(app):
    app.connect("autodoc-skip-member", _on_skip_member)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
