"""torch.compile with srround: the custom ops (``adapters/torch/_ops.py``) and ``opt.step()``
inside a compiled function, traced with ``fullgraph=True`` (no graph break), same bits as
eager; and the step path reading no device value on the host (what CUDA-graph capture needs).

Compiles are slow on a small CI machine: tiny models, few steps, one inductor compile per
test at most (the others use ``aot_eager``, which still functionalizes the custom ops)."""

from __future__ import annotations

import contextlib
import weakref

import pytest

torch = pytest.importorskip("torch")

import srround  # noqa: E402
import srround.adapters.torch as st  # noqa: E402

from .reference import run_python  # noqa: E402


def _bits(t):
    return t.detach().view(torch.int16 if t.element_size() == 2 else torch.int32)


def _model(dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.Tanh(), torch.nn.Linear(6, 2))
    model[2].to(dtype)  # mixed: fp32 and bf16 parameters in one table
    return model


def _backward(model, step, scaler=None):
    x = torch.randn(5, 8, generator=torch.Generator().manual_seed(step))
    h = model[1](model[0](x))
    loss = model[2](h.to(model[2].weight.dtype)).float().square().mean()
    (loss if scaler is None else scaler.scale(loss)).backward()


@pytest.mark.parametrize(
    "make, backend",
    [
        (lambda ps: st.AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16, seed=11), "inductor"),
        (lambda ps: st.SGD(ps, lr=0.1, momentum=0.9, maximize=True, seed=11), "aot_eager"),
        (lambda ps: st.AdamW(ps, lr=1e-2, amsgrad=True, maximize=True, seed=11), "aot_eager"),
    ],
    ids=["adamw-inductor", "sgd-aot_eager", "amsgrad-aot_eager"],
)
def test_compiled_step_matches_eager_bits(make, backend):
    """Finding: Dynamo traced into Numba and died. ``opt.step()`` compiled with
    fullgraph=True (states created at trace time) gives eager's parameters, states and step
    counts, step after step; AMSGrad too (before: its step read the step count on the host and
    did not trace). The first parameter never has a gradient: the op keys noise to
    the parameter's place in the optimizer's order as eager does (it used to restart the
    stream at the first parameter with a gradient). A float ``inv_scale`` traces too (the
    eager host check of it did not)."""
    eager_model, compiled_model = _model(torch.bfloat16), _model(torch.bfloat16)
    unused = [torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16)) for _ in range(2)]
    eager = make([unused[0], *eager_model.parameters()])
    compiled = make([unused[1], *compiled_model.parameters()])

    @torch.compile(fullgraph=True, backend=backend)
    def step(opt):
        opt.step(inv_scale=0.5)

    for i in range(3):
        for model, run in (
            (eager_model, lambda: eager.step(inv_scale=0.5)),
            (compiled_model, lambda: step(compiled)),
        ):
            _backward(model, i)
            run()
            model.zero_grad(set_to_none=False)
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        assert torch.equal(_bits(p), _bits(q))
        for name, value in eager.state[p].items():
            assert torch.equal(_bits(value), _bits(compiled.state[q][name])), name
    assert int(compiled.state[q]["step"]) == 3


def test_compiled_step_keeps_no_gradient_alive():
    """Before: the op's cache of tables (the latest four) held the gradients each was built
    with, so with ``zero_grad()`` (``set_to_none=True``) a compiled step kept the gradients
    of the last four steps allocated. Now it keeps none; the bits are eager's."""
    eager_model, compiled_model = _model(torch.bfloat16), _model(torch.bfloat16)
    eager = st.AdamW(eager_model.parameters(), lr=1e-2, seed=11)
    compiled = st.AdamW(compiled_model.parameters(), lr=1e-2, seed=11)
    step = torch.compile(compiled.step, fullgraph=True, backend="aot_eager")
    freed = []
    for i in range(3):
        _backward(eager_model, i)
        eager.step()
        eager.zero_grad(set_to_none=False)
        _backward(compiled_model, i)
        freed.append(weakref.ref(compiled_model[2].weight.grad))
        step()
        compiled.zero_grad()
        assert all(r() is None for r in freed)
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        assert torch.equal(_bits(p), _bits(q))


def test_compiled_step_reads_new_gradients_without_a_new_table(monkeypatch):
    """Before: the op's table cache was keyed by every buffer's address, so gradients at new
    addresses each step (``zero_grad()``, torch's default) built a new table every step. Now
    the table reads them in place of the old ones; the bits are eager's."""
    from srround.adapters.torch import _ops

    builds = []
    build = _ops.build_entry
    monkeypatch.setattr(_ops, "build_entry", lambda *a: builds.append(1) or build(*a))
    eager_model, compiled_model = _model(torch.bfloat16), _model(torch.bfloat16)
    eager = st.AdamW(eager_model.parameters(), lr=1e-2, seed=11)
    compiled = st.AdamW(compiled_model.parameters(), lr=1e-2, seed=11)
    # inductor re-inplaces the op (aot_eager hands it fresh copies of the written buffers)
    step = torch.compile(compiled.step, fullgraph=True)
    old = []  # kept alive: each step's gradients are at new addresses
    for i in range(4):
        _backward(eager_model, i)
        eager.step()
        eager.zero_grad(set_to_none=False)
        _backward(compiled_model, i)
        old.append([p.grad for p in compiled_model.parameters()])
        step()
        compiled.zero_grad()
    assert len(builds) == 1
    for p, q in zip(eager_model.parameters(), compiled_model.parameters()):
        assert torch.equal(_bits(p), _bits(q))


@pytest.mark.parametrize(
    "make",
    [
        lambda ps: st.AdamW(ps, lr=1e-2, seed=11),
        lambda ps: st.SGD(ps, lr=0.1, momentum=0.9, seed=11),
        lambda ps: st.AdamW(ps, lr=1e-2, amsgrad=True, seed=11),
    ],
    ids=["adamw", "sgd", "amsgrad"],
)
def test_compiled_step_follows_an_lr_scheduler(make):
    """Before: Dynamo runs ``_init_group`` eagerly, and the hyperparameters it returned became
    constants of the graph with no guard: after the first recompile a scheduler's new learning
    rates were silently not used (compiled and eager bits parted from step 3 on). Now the step
    reads them in traced code: each change recompiles (torch's float-lr behaviour) and the
    bits stay eager's. The recompiles count against Dynamo's limit for the code of
    ``opt.step``'s wrapper, shared by every optimizer of the process: reset afterwards."""
    runs = []
    for compile_it in (False, True):
        model = _model(torch.bfloat16)
        opt = make(model.parameters())
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))

        def step(opt=opt):
            opt.step()

        if compile_it:
            step = torch.compile(step, backend="aot_eager")
        for i in range(4):
            _backward(model, i)
            step()
            model.zero_grad(set_to_none=False)
            sched.step()
        runs.append([_bits(p) for p in model.parameters()])
    torch._dynamo.reset()
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_compiled_stochastic_round_and_unscale_match_eager():
    """Finding: ``srround.unscale_and_check`` in a compiled function did not trace (fullgraph:
    Dynamo stopped in its argument checks). Dynamo now traces the custom op in its place:
    eager bits and flag, and the eager error (naming the argument, nothing written)."""
    x = torch.randn(64) * 3
    grads = [torch.randn(5, 3), torch.randn(4).bfloat16()]
    grads[0][1, 1] = float("inf")

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, grads, inv):
        y = st.stochastic_round(x * 2, seed=5, offset=7)
        found = srround.unscale_and_check(grads, inv)
        return y.float() + 1, found

    compiled_grads = [g.clone() for g in grads]
    out, found = f(x, compiled_grads, 0.25)
    expected = srround.stochastic_round(x * 2, seed=5, offset=7).float() + 1
    assert torch.equal(out, expected)
    eager_found = srround.unscale_and_check(grads, 0.25)
    assert float(found) == float(eager_found) == 1.0
    for a, b in zip(compiled_grads, grads):
        assert torch.equal(_bits(a), _bits(b))
    with pytest.raises(ValueError, match="inv_scale"):
        f(x, compiled_grads, -1.0)
    for a, b in zip(compiled_grads, grads):
        assert torch.equal(_bits(a), _bits(b))
    with pytest.raises(TypeError, match="seed"):
        st.stochastic_round(x, seed=None)


def test_stochastic_round_op_records_no_graph_and_checks_offset_like_the_eager_call():
    """``st.stochastic_round`` of a tensor that requires grad: before, the result required
    grad, its backward raised "no autograd formula", and a compiled function calling it
    failed to compile (BackendCompilerFailed); now, as the eager call, no graph is recorded.
    A bad ``offset`` is the eager call's error (before: the op's schema error, or True as 1)."""
    x = torch.randn(16, requires_grad=True)
    y = st.stochastic_round(x, seed=5, offset=3)
    assert not y.requires_grad
    assert torch.equal(_bits(y), _bits(srround.stochastic_round(x, seed=5, offset=3)))

    @torch.compile(fullgraph=True, backend="aot_eager")
    def f(x, offset):
        return st.stochastic_round(x * 2, seed=5, offset=offset).float().sum() + x.sum()

    for offset in (0, 4, 8):  # a changing offset: a dynamic size in the graph
        x.grad = None
        loss = f(x, offset)
        loss.backward()
        assert torch.equal(x.grad, torch.ones(16))
        eager = srround.stochastic_round(x.detach() * 2, seed=5, offset=offset)
        assert float(loss.detach()) == float(eager.float().sum() + x.detach().sum())
    for bad, error in ((1.5, TypeError), (True, TypeError), (2**62, ValueError), (-1, ValueError)):
        with pytest.raises(error, match="^offset"):
            st.stochastic_round(x, seed=5, offset=bad)


@contextlib.contextmanager
def _no_host_reads():
    """Fail on any read of a tensor's value into Python (``.item()``, ``bool()``, ...): on
    CUDA each is a sync, and inside CUDA-graph capture an error."""

    def refuse(*args, **kwargs):
        raise AssertionError("a tensor value was read on the host")

    names = ("item", "tolist", "__bool__", "__float__", "__int__", "__index__")
    saved = {n: getattr(torch.Tensor, n) for n in names}
    try:
        for n in names:
            setattr(torch.Tensor, n, refuse)
        yield
    finally:
        for n, fn in saved.items():
            setattr(torch.Tensor, n, fn)


def test_step_reads_no_device_value_on_the_host():
    """The capturable contract, checked on CPU: with step counts, found_inf and the loss
    scale as tensors, neither the optimizer step nor the scaler's unscale/step/update reads a
    value back (after the first step, which builds the table)."""
    model = _model(torch.bfloat16)
    opt = st.AdamW(model.parameters(), lr=1e-2, capturable=True, seed=2)
    scaler = st.GradScaler("cpu", init_scale=2.0**8)
    _backward(model, 0)
    opt.step()
    for i in range(2):
        model.zero_grad(set_to_none=False)
        scaler.scale(torch.ones(()))  # creates nothing new after the first iteration
        _backward(model, i)
        with _no_host_reads():
            opt.step(found_inf=torch.zeros(1), inv_scale=torch.ones(1))
            scaler.step(opt)
            scaler.update()
    assert int(opt.state[model[0].weight]["step"]) == 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_graph_capture_replays_the_step_with_fresh_noise():
    """CUDA graphs (GPU only): with the table built by a warm-up step, ``opt.step()`` is
    captured in ``torch.cuda.graph`` (no host sync, launches on the capture stream) and each
    replay is one more eager step: fresh noise from the device step count, same bits."""
    gen = torch.Generator().manual_seed(0)
    start = torch.randn(4096, generator=gen).bfloat16().cuda()
    grad = torch.randn(4096, generator=gen).bfloat16().cuda()
    p, q = torch.nn.Parameter(start.clone()), torch.nn.Parameter(start.clone())
    p.grad, q.grad = grad.clone(), grad.clone()
    captured = st.AdamW([p], lr=1e-2, capturable=True, seed=3)
    eager = st.AdamW([q], lr=1e-2, seed=3)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        captured.step()  # warm-up: builds the table and the cached device scalars
    torch.cuda.current_stream().wait_stream(side)
    eager.step()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured.step()
    for _ in range(3):
        graph.replay()
        eager.step()
    torch.cuda.synchronize()
    assert torch.equal(_bits(p), _bits(q))
    assert int(captured.state[p]["step"]) == int(eager.state[q]["step"]) == 4


def test_generic_srround_calls_break_the_graph_instead_of_failing():
    """Finding: any compiled region calling srround died with "exception table entry start
    instruction has no offset" (Dynamo inside Numba's dispatcher), even with fullgraph=False.
    The generic calls now run eagerly at a graph break, with the eager bits."""

    @torch.compile(backend="aot_eager")
    def f(x):
        return srround.stochastic_round(x * 2, seed=1, offset=3).float() + 1

    x = torch.randn(16)
    assert torch.equal(f(x), srround.stochastic_round(x * 2, seed=1, offset=3).float() + 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("amsgrad", [False, True], ids=["fused", "amsgrad"])
def test_compiled_step_on_cuda_matches_eager_bits(amsgrad):
    """torch.compile on CUDA (GPU only): ``srround.unscale_and_check`` then ``opt.step()``
    compiled with inductor (fullgraph) on CUDA parameters give the eager CUDA bits and flags,
    a parameter without a gradient included; the fused step and AMSGrad's op."""
    models = [_model(torch.bfloat16).cuda() for _ in range(2)]
    unused = [
        torch.nn.Parameter(torch.zeros(3, dtype=torch.bfloat16, device="cuda")) for _ in models
    ]
    state_dtype = torch.float32 if amsgrad else torch.bfloat16
    eager, compiled = (
        st.AdamW([u, *m.parameters()], lr=1e-2, amsgrad=amsgrad, state_dtype=state_dtype, seed=11)
        for u, m in zip(unused, models)
    )

    def unscale_and_step(opt, grads):
        found = srround.unscale_and_check(grads, 0.5)
        opt.step(found_inf=found)
        return found

    step = torch.compile(unscale_and_step, fullgraph=True)
    for i in range(3):
        flags = []
        for model, opt, run in ((models[0], eager, unscale_and_step), (models[1], compiled, step)):
            x = torch.randn(5, 8, generator=torch.Generator().manual_seed(i)).cuda()
            h = model[1](model[0](x))
            model[2](h.to(torch.bfloat16)).float().square().mean().backward()
            if i == 2:
                model[0].bias.grad[0] = float("nan")
            flags.append(float(run(opt, [p.grad for p in model.parameters()])))
            model.zero_grad(set_to_none=False)
        assert flags == [float(i == 2)] * 2
    for p, q in zip(models[0].parameters(), models[1].parameters()):
        assert torch.equal(_bits(p), _bits(q))


def test_compiled_scaler_step_and_update_match_eager():
    """Finding: ``scaler.step(opt); scaler.update()`` in a compiled function died in Numba
    (``max(float32, array(float32, 0d))``): Dynamo traced into ``srround.update_scale`` and
    made its ``np.float32`` factors 0-d arrays, a graph break at every line on the way. Now
    srround's functions run eagerly at one graph break each (and ``update()`` calls a custom
    op); the scale (backed off on the overflow step) and the bits are eager's."""
    runs = []
    for compile_it in (False, True):
        model = _model(torch.bfloat16)
        opt = st.AdamW(model.parameters(), lr=1e-2, seed=11)
        scaler = st.GradScaler("cpu", init_scale=2.0**10)

        def tail(opt=opt, scaler=scaler):
            scaler.step(opt)
            scaler.update()

        if compile_it:
            tail = torch.compile(tail, backend="aot_eager")
        scales = []
        for i in range(3):
            _backward(model, i, scaler)
            if i == 1:
                model[0].bias.grad[0] = float("inf")
            tail()
            scales.append(scaler.get_scale())
            model.zero_grad(set_to_none=True)
        runs.append((scales, [_bits(p) for p in model.parameters()]))
    torch._dynamo.reset()
    assert runs[0][0] == runs[1][0] == [1024.0, 512.0, 512.0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_srround_calls_in_compiled_code_are_one_graph_break_each():
    """Before: Dynamo traced into srround's functions, compiling every frame on the way
    (a graph break per line of ``srround.update_scale``). Now each call is one graph break,
    run with Dynamo off in all it calls; the eager result."""
    from torch._dynamo.utils import counters

    @torch.compile(backend="aot_eager")
    def f(scale, growth, found):
        srround.update_scale(scale, growth, found, growth_interval=1)
        return scale * 2

    counters.clear()
    scale, growth = torch.ones(1), torch.zeros(1, dtype=torch.int32)
    assert float(f(scale, growth, torch.zeros(1))) == 4.0
    assert sum(counters["graph_break"].values()) == 1
    torch._dynamo.reset()


def test_export_takes_the_ops_and_refuses_a_traced_tensor_clearly():
    """``torch.export.export(strict=True)`` takes ``st.stochastic_round`` and
    ``srround.unscale_and_check`` as the custom ops (eager bits and flag). Its default
    non-strict mode calls ``srround.unscale_and_check`` on FakeTensors: before, torch's
    "Cannot access data pointer of Tensor" RuntimeError from deep in the adapter; now a
    TypeError naming the argument that says how to trace srround."""

    class Step(torch.nn.Module):
        def forward(self, x, grads, inv):
            return st.stochastic_round(x * 2, seed=5, offset=7), srround.unscale_and_check(
                grads, inv
            )

    x, grads, inv = torch.randn(16), [torch.randn(4), torch.randn(3)], torch.tensor([0.5])
    exported = torch.export.export(Step(), (x, grads, inv), strict=True)
    copies = [g.clone() for g in grads]
    y, found = exported.module()(x, copies, inv)
    assert torch.equal(_bits(y), _bits(srround.stochastic_round(x * 2, seed=5, offset=7)))
    assert float(found) == 0.0
    assert all(torch.equal(c, g * 0.5) for c, g in zip(copies, grads))
    with pytest.raises(TypeError, match=r"^grads\[0\]: a traced .*strict=True"):
        torch.export.export(Step(), (x, grads, inv))


@pytest.mark.parametrize("per_tensor", [False, True], ids=["scalar", "per_tensor"])
def test_compiled_scaler_update_traces_fullgraph(per_tensor):
    """Before: ``scaler.update()`` broke the graph (``srround.update_scale`` runs eagerly), so
    a loss scaler's step compiled with ``fullgraph=True`` failed. It now calls the custom op
    ``srround::update_scale_``: one graph; scales (per-tensor: each module's) and bits eager's."""
    runs = []
    for compile_it in (False, True):
        model = _model(torch.bfloat16)
        opt = st.AdamW(model.parameters(), lr=1e-2, seed=11)
        scaler = st.GradScaler("cpu", init_scale=2.0**10, growth_interval=2, per_tensor=per_tensor)
        if per_tensor:
            scaler.attach(model)

        def tail(opt=opt, scaler=scaler):
            scaler.step(opt)
            scaler.update()

        if compile_it:
            tail = torch.compile(tail, fullgraph=True, backend="aot_eager")
        scales = []
        for i in range(3):
            _backward(model, i, scaler)
            if i == 1:
                model[2].weight.grad[0, 0] = float("inf")
            tail()
            scales.append(scaler.tensor_scales.tolist() if per_tensor else scaler.get_scale())
            model.zero_grad(set_to_none=True)
        runs.append((scales, [_bits(p) for p in model.parameters()]))
    torch._dynamo.reset()
    assert runs[0][0] == runs[1][0]
    for a, b in zip(runs[0][1], runs[1][1]):
        assert torch.equal(a, b)


def test_compiled_step_tables_die_with_their_optimizer():
    """Before: the op's cache of tables (the latest four, module-wide) kept the parameters and
    states each one writes alive after the model and optimizer were dropped (a notebook's
    next run, a sweep in one process: up to four dead models' weights and states pinned).
    Now an optimizer's tables go when it is collected."""
    import gc

    def train():
        model = _model(torch.bfloat16)
        opt = st.AdamW(model.parameters(), lr=1e-2, seed=11)
        step = torch.compile(opt.step, fullgraph=True)  # inductor: the op gets the buffers
        _backward(model, 0)
        step()
        return weakref.ref(model[2].weight), weakref.ref(opt.state[model[2].weight]["exp_avg"])

    refs = train()
    gc.collect()
    assert all(r() is None for r in refs)


def test_compiled_steps_of_five_optimizers_keep_their_tables(monkeypatch):
    """Before: the op's cache held the latest four tables, module-wide: a fifth optimizer
    (a GAN's and a few more, per-layer optimizers) evicted one at every step, so each step
    of each optimizer rebuilt its table (validation, planning, the table's copy to the
    device). Now a table only replaces its own parameters' older ones; the bits are eager's."""
    from srround.adapters.torch import _ops

    builds = []
    build = _ops.build_entry
    monkeypatch.setattr(_ops, "build_entry", lambda *a: builds.append(1) or build(*a))
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(3, generator=gen).bfloat16() for _ in range(5)]
    runs = []
    for compile_it in (False, True):
        params = [torch.nn.Parameter(s.clone()) for s in start]
        opts = [st.AdamW([p], lr=1e-2, seed=i) for i, p in enumerate(params)]

        def step(opts=opts):
            for opt in opts:
                opt.step()

        if compile_it:
            step = torch.compile(step, fullgraph=True)  # inductor: the op gets the buffers
        for i in range(3):
            for p in params:
                p.grad = torch.randn(3, generator=gen.manual_seed(i)).bfloat16()
            step()
        runs.append([_bits(p) for p in params])
    assert len(builds) == 5
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_straight_through_rounding_recipe_keeps_the_bits_under_inductor():
    """The README's straight-through activation rounding, ``x + (SR(x) - x).detach()``,
    compiled with inductor: the rounding's bits (eager's) and the gradient 1."""

    def f(x, offset):
        return x + (st.stochastic_round(x, seed=7, offset=offset).float() - x).detach()

    x = (torch.randn(256, generator=torch.Generator().manual_seed(0)) * 100).requires_grad_()
    y = torch.compile(f, fullgraph=True)(x, 3)
    assert torch.equal(y, st.stochastic_round(x, seed=7, offset=3).float())
    y.sum().backward()
    assert torch.equal(x.grad, torch.ones(256))


def test_compiled_step_with_float8_states_runs_eagerly_at_a_graph_break():
    """float8 states have no custom op yet. Before: a compiled function calling ``opt.step()``
    died in Dynamo (RecursionError: it compiled the eager fallback's srround calls), and with
    fullgraph=True said only "Observed exception". Now the step runs eagerly at a graph break
    (eager's bits, states included); fullgraph=True is refused with the reason."""
    runs = []
    for compile_it in (False, True):
        model = _model(torch.bfloat16)
        opt = st.AdamW(model.parameters(), lr=1e-2, state_dtype=torch.float8_e4m3fn, seed=11)

        def step(opt=opt):
            opt.step()

        if compile_it:
            step = torch.compile(step, backend="aot_eager")
        for i in range(2):
            _backward(model, i)
            step()
            model.zero_grad(set_to_none=True)
        runs.append(
            [_bits(p) for p in model.parameters()]
            + [
                s.view(torch.uint8)
                for p in model.parameters()
                for s in opt.state[p].values()
                if s.dtype == torch.float8_e4m3fn
            ]
        )
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    torch._dynamo.reset()  # else the frames compiled above run, with their graph break
    with pytest.raises(Exception, match="float8 states are not supported inside torch.compile"):
        torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    torch._dynamo.reset()


@pytest.mark.parametrize("wrapt", [True, False], ids=["wrapt", "no_wrapt"])
def test_importing_the_adapter_leaves_dynamo_to_the_first_compile(wrapt):
    """``import srround.adapters.torch`` imported Dynamo (about as long as importing torch) to
    give it srround's rules. Now Dynamo gets them when it is imported: in a fresh process the
    adapter's import leaves Dynamo out, and the first torch.compile still traces
    ``unscale_and_check`` fullgraph, breaks the graph at a generic call, refuses float8 states
    with the reason, and takes a DTensor piece as a constant. Without ``wrapt`` (torch
    installed without srround's ``torch`` extra) the import brings Dynamo in at once, as
    before, with the same rules."""
    code = f"""
import sys
if not {wrapt}:
    sys.modules["wrapt"] = None  # an import of wrapt raises ImportError
import torch
import srround
import srround.adapters.torch as st
assert ("torch._dynamo" in sys.modules) == (not {wrapt}), "Dynamo imported: " + str(not {wrapt})
"""
    code += """
@torch.compile(fullgraph=True, backend="aot_eager")
def unscale(grads):
    return srround.unscale_and_check(grads, 0.5)

grads = [torch.full((3,), 2.0)]
assert float(unscale(grads)) == 0.0 and torch.equal(grads[0], torch.ones(3))

@torch.compile(backend="aot_eager")
def generic(x):
    return srround.stochastic_round(x * 2, seed=1, offset=3).float() + 1

x = torch.randn(16)
assert torch.equal(generic(x), srround.stochastic_round(x * 2, seed=1, offset=3).float() + 1)
p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
p.grad = torch.ones(4, dtype=torch.bfloat16)
opt = st.AdamW([p], lr=1e-2, state_dtype=torch.float8_e4m3fn, seed=1)
try:
    torch.compile(opt.step, fullgraph=True, backend="aot_eager")()
    raise AssertionError("fullgraph with float8 states: no error")
except Exception as exc:
    assert "float8 states are not supported inside torch.compile" in str(exc), exc
from srround.adapters.torch import _dist
assert getattr(_dist._static_piece, "_dynamo_marked_constant", False)
print("ok")
"""
    run = run_python(["-c", code], env=None, cwd=None)
    assert run.stdout.strip().endswith("ok"), run.stdout
