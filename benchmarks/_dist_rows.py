"""The distributed rows of ``bench_optim.py``: FSDP2 (``fully_shard``) on 2 processes with the
gloo backend on CPU, srround's AdamW against torch's fused AdamW on the same sharded model.

Each process holds half of every bf16 parameter (a transformer-like list of tensors, the
``bench_optim`` shapes). Two timings per optimizer, medians on rank 0:

* ``opt step``: ``optimizer.step()`` alone on the local shards (gradients fixed);
* ``train step``: ``zero_grad`` + forward (FSDP2 all-gathers the parameters) + backward
  (reduce-scatters the gradients) + ``step``; the loss is ``sum(p.float() ** 2)``, so the
  step time is the optimizer's and FSDP2's communication, not a model's compute.

Then tensor parallel's layout (rows ``TP ...``), ``opt step`` only: every matrix ``Shard(1)``
(its local piece is rows of half the columns, as ``RowwiseParallel`` shards a weight; each row
a run of the full tensor's random stream), the rest ``Shard(0)``, gradients set directly.

The ratio srround / torch of each is the figure to compare (target: train step <= 1.2x).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time

WORLD = 2
LR = 1e-3
SEED = 1234


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _optimizers(torch):
    from srround.adapters.torch import AdamW

    return (
        (
            "srround AdamW stochastic fp32",
            22,
            lambda ps: AdamW(ps, lr=LR, seed=SEED),
        ),
        (
            "torch AdamW fused bf16 (RNE)",
            14,
            lambda ps: torch.optim.AdamW(ps, lr=LR, fused=True),
        ),
    )


def _worker(rank, port, shape_list, reps, out_path):
    import numba
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    torch.set_num_threads(1)  # 2 processes on the shared cores: one thread each
    numba.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD)

    class Flat(torch.nn.Module):
        def __init__(self):
            super().__init__()
            gen = torch.Generator().manual_seed(SEED)
            self.ps = torch.nn.ParameterList(
                torch.nn.Parameter((torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16))
                for s in shape_list
            )

        def forward(self):
            return sum((p.float() ** 2).sum() for p in self.ps)

    rows = []
    for label, nbytes, factory in _optimizers(torch):
        model = Flat()
        fully_shard(model)
        opt = factory(model.parameters())

        def train_step(model=model, opt=opt):
            opt.zero_grad()
            model().backward()
            opt.step()

        t0 = time.perf_counter()
        train_step()
        first = time.perf_counter() - t0
        train_step()
        train, step = [], []
        for _ in range(reps):
            dist.barrier()
            t0 = time.perf_counter()
            train_step()
            train.append(time.perf_counter() - t0)
        for _ in range(reps):
            t0 = time.perf_counter()
            opt.step()
            step.append(time.perf_counter() - t0)
        local = sum(p.to_local().numel() for p in model.parameters())
        rows.append(
            (label, nbytes, local, first, statistics.median(step), statistics.median(train))
        )
        del model, opt
    rows += _tensor_parallel_rows(torch, shape_list, reps)
    if rank == 0:
        torch.save(rows, out_path)
    dist.barrier()
    dist.destroy_process_group()


def _tensor_parallel_rows(torch, shape_list, reps):
    """``opt step`` of each optimizer on tensor parallel's layout (the module docstring)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    gen = torch.Generator().manual_seed(SEED)
    full = [(torch.randn(s, generator=gen) * 0.02).to(torch.bfloat16) for s in shape_list]
    grads = [(torch.randn(s, generator=gen) * 1e-3).to(torch.bfloat16) for s in shape_list]

    def place(t):
        return distribute_tensor(t, mesh, [Shard(1) if t.ndim == 2 else Shard(0)])

    rows = []
    for label, nbytes, factory in _optimizers(torch):
        params = [torch.nn.Parameter(place(t)) for t in full]
        for p, g in zip(params, grads):
            p.grad = place(g)
        opt = factory(params)
        t0 = time.perf_counter()
        opt.step()
        first = time.perf_counter() - t0
        opt.step()
        step = []
        for _ in range(reps):
            t0 = time.perf_counter()
            opt.step()
            step.append(time.perf_counter() - t0)
        local = sum(p.to_local().numel() for p in params)
        rows.append((f"TP {label}", nbytes, local, first, statistics.median(step), None))
        del params, opt
    return rows


def run_dist(shape_list, reps: int, notes: list) -> list[dict]:
    """Spawn the 2 ranks, return one row per optimizer and timing (``bench_optim`` rows)."""
    import torch
    import torch.multiprocessing as mp

    if not torch.distributed.is_available():
        notes.append("dist section skipped: torch.distributed is not available")
        return []
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(_worker, args=(_free_port(), shape_list, reps, out), nprocs=WORLD)
        raw = torch.load(out, weights_only=False)
    results = []
    for label, nbytes, local, first, step_s, train_s in raw:
        for what, median in (("opt step", step_s), ("train step", train_s)):
            if median is None:  # (tensor parallel: the optimizer step only)
                continue
            results.append(
                {
                    "section": "dist",
                    "device": "cpu",
                    "tensors": len(shape_list),
                    "params": local,  # per rank
                    "method": f"{label}: {what}",
                    "bytes_per_param": nbytes,
                    "gbps": nbytes * local / median / 1e9,
                    "median_s": median,
                    "host_s": median,
                    "first_s": first,
                    "reps": reps,
                    "world": WORLD,
                    "backend": "gloo",
                }
            )
    return results


def ratios(results: list[dict]) -> list[str]:
    """srround / torch fused step-time ratios of the dist rows."""
    lines = []
    for layout, tp in (("FSDP2", False), ("TP Shard(1)", True)):
        for what in ("opt step", "train step"):
            rows = [
                r for r in results if r["method"].endswith(what) and ("TP" in r["method"]) == tp
            ]
            mine = [r for r in rows if "srround" in r["method"]]
            torch_ = [r for r in rows if "torch" in r["method"]]
            if mine and torch_:
                ratio = mine[0]["median_s"] / torch_[0]["median_s"]
                lines.append(f"{layout} x2 (gloo, CPU) {what}: srround / torch fused = {ratio:.2f}")
    return lines
