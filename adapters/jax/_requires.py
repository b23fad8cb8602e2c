"""The oldest JAX the adapter works with, checked when it is imported: an older JAX is an
``ImportError`` naming both versions, not an ``AttributeError`` from deep inside a first call
(JAX 0.8 and older lack ``jax.enable_x64``; 0.9.2 fails uneven sharded splits in its compile).
Kept equal to the ``jax`` extra's floor in ``pyproject.toml``."""

from __future__ import annotations

import re

import jax

MIN_JAX = (0, 10)


def check(version: str) -> None:
    """``ImportError`` if JAX ``version`` (a ``jax.__version__`` string) is older than
    ``MIN_JAX``."""
    found = tuple(int(part) for part in re.findall(r"\d+", version)[: len(MIN_JAX)])
    if found < MIN_JAX:
        needed = ".".join(map(str, MIN_JAX))
        raise ImportError(
            f"srround.adapters.jax needs JAX >= {needed}, found {version}: pip install -U"
            f" 'jax>={needed}' (JAX {needed} needs Python >= 3.11)"
        )


check(jax.__version__)
