"""Numba's on-disk cache for srround's kernels, keyed on a hash of srround's own sources.

Numba keys a cached function on its own source file only. A kernel in ``_cpu.py`` that inlines a
body from ``_scalar.py`` therefore keeps the old body after ``_scalar.py`` is edited (a source
checkout, an editable install). Here every srround function compiled with ``cache=True`` is
cached under a directory named after a SHA-256 of all ``*.py`` files of the package, and that
hash is also its source stamp: any edit to any srround source selects a fresh cache, so a stale
body can never run.

Where: ``$NUMBA_CACHE_DIR/srround-<hash>/`` when ``NUMBA_CACHE_DIR`` is set; else the package's
``__pycache__/numba-<hash>/`` when writable (other ``numba-*`` folders there are removed once
unused for a day); else
the user-wide Numba cache folder. Functions outside srround keep Numba's own locators.

``install()`` must run before the first ``@njit(cache=True)`` of srround is decorated
(``srround/__init__.py`` calls it first); ``install_cuda()`` does the same for ``numba.cuda``
and runs when CUDA is first imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent
_PREFIX = "numba-"


def source_hash(root: Path = PACKAGE) -> str:
    """First 16 hex digits of a SHA-256 over every ``*.py`` under ``root`` (paths and bytes)."""
    h = hashlib.sha256()
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode())
        h.update(b"\0")
        h.update(path.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


SOURCE_HASH = source_hash()


def _writable(folder: Path) -> bool:
    try:
        folder.mkdir(parents=True, exist_ok=True)
        probe = folder / f".probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError:
        return False
    return True


# another source's cache is removed once nothing was written to it for this long: a process
# still running the sources it was built from (a training job, when srround is upgraded or
# edited under it) compiles new configurations into it, and failed once it was gone
_STALE_AFTER_S = 24 * 3600


def _last_write(folder: Path) -> float:
    """The newest modification time of ``folder`` and anything in it."""
    return max((p.stat().st_mtime for p in folder.rglob("*")), default=folder.stat().st_mtime)


def _prune(folder: Path, keep: str, now: float | None = None) -> None:
    """Remove the other ``numba-*`` caches of this checkout that are stale (``_STALE_AFTER_S``;
    best effort)."""
    now = time.time() if now is None else now
    with contextlib.suppress(OSError):
        for old in folder.glob(_PREFIX + "*"):
            if old.name != keep and old.is_dir() and now - _last_write(old) > _STALE_AFTER_S:
                shutil.rmtree(old, ignore_errors=True)


def cache_root() -> Path:
    """The folder srround's compiled kernels are cached in (created if missing)."""
    if getattr(cache_root, "_root", None) is not None:
        return cache_root._root  # type: ignore[attr-defined]
    from numba import config

    if config.CACHE_DIR:
        root = Path(config.CACHE_DIR) / f"srround-{SOURCE_HASH}"
    else:
        in_tree = PACKAGE / "__pycache__"
        root = in_tree / f"{_PREFIX}{SOURCE_HASH}"
        if _writable(root):
            _prune(in_tree, root.name)
        else:
            from numba.misc.appdirs import AppDirs

            user = Path(AppDirs(appname="numba", appauthor=False).user_cache_dir)
            root = user / f"srround-{SOURCE_HASH}"
    cache_root._root = root  # type: ignore[attr-defined]
    return root


def _locator_class(mixin, base):
    """A Numba cache locator for functions defined in srround's files, built on Numba's
    (or numba-cuda's) own ``_SourceFileBackedLocatorMixin`` and ``_CacheLocator``."""

    class SourceHashLocator(mixin, base):
        def __init__(self, py_func, py_file):
            self._py_file = py_file
            self._lineno = py_func.__code__.co_firstlineno
            rel = Path(py_file).resolve().parent.relative_to(PACKAGE)
            self._cache_path = str(cache_root() / rel)

        def get_cache_path(self):
            return self._cache_path

        def get_source_stamp(self):
            return SOURCE_HASH

        @classmethod
        def from_function(cls, py_func, py_file):
            try:
                Path(py_file).resolve().relative_to(PACKAGE)
            except (ValueError, OSError):
                return None  # not srround's: Numba's own locators decide
            return super().from_function(py_func, py_file)

    return SourceHashLocator


def _insert(impl, locator) -> None:
    classes = impl._locator_classes
    if not any(getattr(c, "__name__", "") == locator.__name__ for c in classes):
        classes.insert(0, locator)  # shared by the subclasses (one list object)


def install() -> None:
    """Route srround's ``numba.njit(cache=True)`` functions to the source-hash cache."""
    from numba.core import caching

    locator = _locator_class(caching._SourceFileBackedLocatorMixin, caching._CacheLocator)
    _insert(caching.CacheImpl, locator)


def install_cuda() -> None:
    """The same for ``numba.cuda.jit(cache=True)`` (numba-cuda keeps its own locator list)."""
    try:
        from numba.cuda.core import caching
    except ImportError:  # an older numba-cuda without its own caching module
        return
    if not hasattr(caching, "CacheImpl"):
        return
    locator = _locator_class(caching._SourceFileBackedLocatorMixin, caching._CacheLocator)
    _insert(caching.CacheImpl, locator)
