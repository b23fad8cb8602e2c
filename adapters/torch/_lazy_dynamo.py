"""Dynamo (``torch._dynamo``) is imported by torch.compile, not by srround: importing it takes
about as long as importing torch, and most programs never compile. What srround tells Dynamo
(the ops' rules in ``_ops``, the fp8 step's graph break in ``optim``, a DTensor piece as a
constant in ``_dist``) is given when Dynamo is imported, by a post-import hook (``wrapt``, of the
``torch`` extra); without ``wrapt``, Dynamo is imported at once and told then."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType


def when_imported(hook: Callable[[ModuleType], None]) -> None:
    """``hook(torch._dynamo)`` once Dynamo is imported: now if it is (or if ``wrapt`` is
    missing: Dynamo is then imported here), else right after its import, before anything is
    traced."""
    try:
        import wrapt
    except ImportError:
        hook(importlib.import_module("torch._dynamo"))
        return
    wrapt.register_post_import_hook(hook, "torch._dynamo")
