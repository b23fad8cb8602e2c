"""What every benchmark shares: timing loops, contention accounting, the machine description and
the ``--json`` envelope that ``benchmarks/results.py`` turns into ``benchmarks/RESULTS.md``.

The JSON envelope (schema 1)::

    {"schema": 1, "benchmark": "bench_round", "date": "2026-11-25T14:02:11Z",
     "command": ["benchmarks/bench_round.py", "--quick"],
     "machine": {"cpu_model": ..., "cores": ..., "usable_cores": ..., "gpu": ..., ...},
     "baseline": "what the same-run baseline rows are",
     "columns": [[key, title, format], ...],   # what RESULTS.md shows of each row
     "results": [{...}, ...], "notes": [...], "meta": {...}}

Rows keep every raw field; ``columns`` only selects and formats (``format`` is a
``str.format`` spec such as ``".3f"``, with ``"ms"``/``"us"``/``"%"`` scaling seconds and
fractions).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import io
import json
import logging
import math
import os
import platform
import statistics
import sys
import time
import types
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUSY_MARK = 0.3  # CPUs used by other processes while a cell was timed -> flagged noisy
SCHEMA = 1


class Unavailable(ImportError):
    """A row or section that cannot run here (missing package or device); printed as a note."""


def quiet_import(name: str):
    """Import ``name`` with its import-time log and warning chatter suppressed.

    Raises:
        Unavailable: the module cannot be imported (the reason is in the message).
    """
    import importlib

    logging.disable(logging.WARNING)
    try:
        with (
            warnings.catch_warnings(),
            contextlib.redirect_stdout(io.StringIO()),
            contextlib.redirect_stderr(io.StringIO()),
        ):
            warnings.simplefilter("ignore")
            return importlib.import_module(name)
    except ImportError as exc:
        raise Unavailable(f"{name} not importable ({exc})") from None
    finally:
        logging.disable(logging.NOTSET)


def repo_on_path() -> None:
    """Make the repository root importable (``tests.reference`` holds shared reference code)."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))


# --------------------------------------------------------------------------------------------
# contention
# --------------------------------------------------------------------------------------------


def cpu_counters():
    """(wall s, machine busy s over all CPUs, this process's CPU s), or None off Linux."""
    try:
        with open("/proc/stat") as f:
            v = [int(t) for t in f.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait
    own = os.times()
    return time.perf_counter(), busy, own.user + own.system


def others_busy(before, after) -> float | None:
    """CPUs used by other processes between two ``cpu_counters`` (clock-tick resolution)."""
    if before is None or after is None or after[0] - before[0] <= 0:
        return None
    wall = after[0] - before[0]
    return round(max(0.0, ((after[1] - before[1]) - (after[2] - before[2])) / wall), 3)


def busy_cpus(interval: float = 0.5) -> float | None:
    """CPUs kept busy by other processes while this one sleeps ``interval`` seconds."""
    before = cpu_counters()
    time.sleep(interval)
    busy = others_busy(before, cpu_counters())
    return None if busy is None else round(busy, 2)


# --------------------------------------------------------------------------------------------
# timing
# --------------------------------------------------------------------------------------------


def measure(
    fn,
    sync=None,
    *,
    cell_time: float,
    batch_time: float = 0.0,
    min_samples: int = 3,
    max_samples: int = 200,
) -> dict:
    """Median seconds per call of ``fn``, sampling for about ``cell_time`` seconds.

    ``sync(result)`` waits for asynchronous work (device synchronize, ``block_until_ready``).
    ``batch_time`` > 0 groups calls into batches of about that length with one sync at the end
    (GPU); otherwise every call is timed on its own (CPU). The first call (compilation, first
    touch) is not timed.
    """
    sync = sync or (lambda r: None)

    def run(k):
        t0 = time.perf_counter()
        for _ in range(k):
            r = fn()
        sync(r)
        return (time.perf_counter() - t0) / k

    sync(fn())
    before = cpu_counters()
    first = run(1)  # may still pay page faults the untimed call did not take
    per_sample = max(1, math.ceil(batch_time / first)) if batch_time > 0 else 1
    samples = int(min(max_samples, max(min_samples, math.ceil(cell_time / (first * per_sample)))))
    if per_sample == 1 and first * min_samples >= cell_time:
        # slow calls (> cell_time / 3): keep the first timed call as one of the samples
        times = [first] + [run(1) for _ in range(samples - 1)]
    else:
        times = [run(per_sample) for _ in range(samples)]
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "samples": samples,
        "calls_per_sample": per_sample,
        "others_busy_cpus": others_busy(before, cpu_counters()),
    }


@contextlib.contextmanager
def numba_compile_timer():
    """``with numba_compile_timer() as timer: ...``, then ``timer.seconds``: the wall time Numba
    spent compiling inside the block, in any thread (a load from its disk cache is not a
    compile: Numba times only ``numba:compile`` events, which a cache hit never starts)."""
    from numba.core import event

    timer = types.SimpleNamespace(seconds=0.0)
    with event.install_timer("numba:compile", lambda seconds: setattr(timer, "seconds", seconds)):
        yield timer


def time_in_turns(steps, reps: int) -> list[dict]:
    """``time_steps`` of several stateful steps (``(step, sync)`` pairs, each already called
    once: its first call timed by the caller) in turns: after one warm-up call each, every
    round times one call of each step, so on a shared machine all of them see the same load.
    Returns per step what ``time_steps`` does, but ``first_s`` (batch 1)."""
    for step, sync in steps:
        step()
        sync()
    before = cpu_counters()
    per_step: list[list[float]] = [[] for _ in steps]
    host: list[list[float]] = [[] for _ in steps]
    for _ in range(reps):
        for (step, sync), times, hosts in zip(steps, per_step, host):
            t0 = time.perf_counter()
            step()
            hosts.append(time.perf_counter() - t0)
            sync()
            times.append(time.perf_counter() - t0)
    busy = others_busy(before, cpu_counters())
    return [
        {
            "median_s": statistics.median(times),
            "min_s": min(times),
            "host_s": statistics.median(hosts),
            "reps": reps,
            "batch": 1,
            "others_busy_cpus": busy,
        }
        for times, hosts in zip(per_step, host)
    ]


def time_steps(step, sync, reps: int, batch: int = 1) -> dict:
    """Time a stateful step: the first call (compile, allocation) and one warm-up apart, then
    ``reps`` samples of ``batch`` calls closed by one ``sync()``.

    Returns seconds: ``first_s``, ``median_s`` and ``min_s`` per call, and ``host_s``, the median
    time until a call returns without a sync (the host cost of an asynchronous launch). Work
    still pending from the setup (asynchronous launches that made the inputs) is waited for
    before the first call's timer starts.
    """
    sync()
    t0 = time.perf_counter()
    step()
    sync()
    first = time.perf_counter() - t0
    step()
    sync()
    before = cpu_counters()
    per_step, host = [], []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(batch):
            h0 = time.perf_counter()
            step()
            host.append(time.perf_counter() - h0)
        sync()
        per_step.append((time.perf_counter() - t0) / batch)
    return {
        "first_s": first,
        "median_s": statistics.median(per_step),
        "min_s": min(per_step),
        "host_s": statistics.median(host),
        "reps": reps,
        "batch": batch,
        "others_busy_cpus": others_busy(before, cpu_counters()),
    }


# --------------------------------------------------------------------------------------------
# machine and JSON
# --------------------------------------------------------------------------------------------


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo`` on Linux, ``platform.processor()`` elsewhere)."""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(gpu: str | None = None) -> dict:
    """The machine a benchmark ran on: CPU model, cores, OS, Python and library versions."""
    out = {
        "cpu_model": cpu_model(),
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0))
        if hasattr(os, "sched_getaffinity")
        else os.cpu_count(),
        "arch": platform.machine(),
        "os": platform.platform(terse=True),
        "python": platform.python_version(),
    }
    for name in ("numpy", "numba", "srround"):
        with contextlib.suppress(Exception):
            out[name] = quiet_import(name).__version__
    with contextlib.suppress(Exception):
        out["numba_threads"] = quiet_import("numba").get_num_threads()
    for name in ("torch", "jax"):
        if name in sys.modules:
            out[name] = getattr(sys.modules[name], "__version__", "?")
    if gpu:
        out["gpu"] = gpu
    return out


def utc_now() -> str:
    """The current UTC time as ``YYYY-MM-DDTHH:MM:SSZ``."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def bench_parser(doc: str, quick_help: str, device_help: str | None = None):
    """An ``argparse`` parser with the first paragraph of ``doc``, ``--quick``, ``--device``.

    ``--device`` takes cpu, cuda or all (the default); the caller adds ``--json`` last.
    """
    parser = argparse.ArgumentParser(
        description=doc.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=quick_help)
    parser.add_argument("--device", choices=("cpu", "cuda", "all"), default="all", help=device_help)
    return parser


def add_json_argument(parser) -> None:
    """Add ``--json PATH`` to an ``argparse`` parser."""
    parser.add_argument(
        "--json",
        metavar="PATH",
        help="also write the results as JSON (machine, date, baselines; see benchmarks/results.py)",
    )


def print_notes(notes: list, t_start: float) -> None:
    """Print the run's ``notes`` (skipped rows, contention) and the time since ``t_start``."""
    if notes:
        print("\nnotes:")
        for note in notes:
            print("  - " + note)
    print(f"\ntotal benchmark time {time.perf_counter() - t_start:.1f} s")


def write_json(
    path: str | None,
    benchmark: str,
    *,
    results: list,
    columns: list,
    baseline: str,
    notes: list | None = None,
    meta: dict | None = None,
    gpu: str | None = None,
    started: str | None = None,
    **extra,
) -> dict:
    """Write the schema-1 envelope to ``path`` (nothing when ``path`` is None) and return it.

    Args:
        path: output file, or None.
        benchmark: the script's name, e.g. ``"bench_round"``.
        results: one dict per measured row, same-run baselines included.
        columns: ``[key, title, format]`` triples that ``results.py`` shows of each row.
        baseline: which rows are the same-run baselines the others are compared with.
        notes: skipped rows, contention warnings.
        meta: run settings (sizes, repetitions, versions of compared packages).
        gpu: the GPU's name when one was used.
        started: the run's start time (``utc_now()``); default now.
        **extra: further top-level fields (e.g. ``latency``).
    """
    envelope = {
        "schema": SCHEMA,
        "benchmark": benchmark,
        "date": started or utc_now(),
        "command": [os.path.relpath(sys.argv[0], ROOT) if sys.argv[0] else "", *sys.argv[1:]],
        "machine": machine(gpu),
        "baseline": baseline,
        "columns": [list(c) for c in columns],
        "results": results,
        "notes": list(notes or []),
        "meta": dict(meta or {}),
        **extra,
    }
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            json.dump(envelope, f, indent=1, default=str)
        print(f"wrote {path}")
    return envelope
