"""The README's Python examples, for the tests that run them (``tests/test_readme.py``, and the
multi-device ones in ``tests/jax_sharded_cases.py`` and ``tests/test_torch_dist.py``)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def examples() -> dict[str, tuple[int, str]]:
    """Every fenced ``python`` block of the README by its first line: ``(line number, code)``."""
    text = README.read_text()
    found = {}
    for match in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M):
        code = match.group(1)
        line = text.count("\n", 0, match.start()) + 2
        found[code.splitlines()[0]] = (line, code)
    return found


def run(start: str, given: dict) -> dict:
    """Run the one example whose first line starts with ``start`` in a namespace holding
    ``given`` (the names it assumes); returns the namespace. A README edit of that line fails
    here, by name."""
    known = [k for k in examples() if k.startswith(start)]
    assert len(known) == 1, f"README examples starting with {start!r}: {known}"
    line, code = examples()[known[0]]
    namespace = dict(given)
    padded = "\n" * (line - 1) + code  # tracebacks name the README's own lines
    exec(compile(padded, str(README), "exec"), namespace)
    return namespace
