"""Shows a private module's docstring on the page of a public object that refers to it.

Some public objects keep their equations or their protocol in the docstring of the private
module that defines them and say so ("See the module docstring for the equations", "(module
docstring)"): :class:`braintrace.layers.LIF`, :func:`braintrace.online_grad`,
:class:`braintrace.OnlineGradient`, ... The API reference has no page for private modules, so
for such an object (a class or function, or a class one of whose own methods refers to it) this
appends that module's docstring to the object's page, under the rubric "Module docstring".
Objects of a public module (``braintrace.nir``) are left alone: its docstring is on the
module's page.
"""

from __future__ import annotations

import inspect
import re
import types

REFERENCE = re.compile(r"\bmodule(?:'s)?\s+docstring\b")
RUBRIC = "Module docstring"


def refers_to_module_docstring(obj: object) -> bool:
    """Whether ``obj``'s docstring (or, for a class, one of its own methods') refers to it."""
    docs = [inspect.getdoc(obj) or ""]
    if inspect.isclass(obj):
        docs += [inspect.getdoc(member) or "" for member in vars(obj).values()
                 if inspect.isroutine(member) or isinstance(member, property)]
    return any(REFERENCE.search(doc) for doc in docs)


def private_module(obj: object) -> types.ModuleType | None:
    """The module defining ``obj`` when a part of its dotted name is private, else ``None``."""
    module = inspect.getmodule(obj)
    if module is None or not any(part.startswith("_") for part in module.__name__.split(".")):
        return None
    return module


def appended_lines(obj: object) -> list[str]:
    """The lines to append to ``obj``'s docstring on its page (none for most objects)."""
    module = private_module(obj)
    if module is None or not module.__doc__ or not refers_to_module_docstring(obj):
        return []
    return ["", f".. rubric:: {RUBRIC}", "", *inspect.cleandoc(module.__doc__).splitlines()]


def _on_process_docstring(app, what, name, obj, options, lines) -> None:
    if what in ("class", "function"):
        lines.extend(appended_lines(obj))


def setup(app):
    # Before napoleon (priority 500), so that the appended text is read as the rest is.
    app.connect("autodoc-process-docstring", _on_process_docstring, priority=400)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
