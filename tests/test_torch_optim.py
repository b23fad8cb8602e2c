"""srround.adapters.torch.AdamW / SGD, what is torch's own: param groups and schedulers, autograd
and version counters, the cached table, fused loss scaling with the GradScaler, state_dict
resume, errors; plus a custom optimizer (Lion) built from the public primitives. The optimizer
contract (torch.optim's math, the weight modes' bits, found_inf, CPU/CUDA identity) is tested
once for every front end in tests/test_optim_contract.py."""

from __future__ import annotations

import collections
import copy
import io
import time
import weakref

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import srround
from srround.adapters.torch import SGD, AdamW, GradScaler

SHAPES = [(5, 3), (7,), (4, 2, 2)]
STEP_SHIFT = 36


def _params(dtype=torch.bfloat16, shapes=SHAPES, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.nn.Parameter(torch.randn(s, generator=gen).to(device=device, dtype=dtype))
        for s in shapes
    ]


def _grads(step, shapes=SHAPES, dtype=torch.float32, scale=1.0):
    gen = torch.Generator().manual_seed(1000 + step)
    return [(torch.randn(s, generator=gen) * scale).to(dtype) for s in shapes]


def _set_grads(params, grads):
    for p, g in zip(params, grads):
        p.grad = g.to(device=p.device, dtype=p.dtype).clone()


def _bits(t):
    return t.detach().cpu().view(torch.int16 if t.element_size() == 2 else torch.int32).clone()


def _assert_bits_equal(a, b, msg=""):
    assert torch.equal(_bits(a), _bits(b)), msg


def _ulp_close(actual, expected, ulps, msg=""):
    """|actual - expected| <= ulps * ulp(expected) elementwise (float32)."""
    expected = expected.detach().float()
    spacing = torch.abs(torch.nextafter(expected, torch.full_like(expected, np.inf)) - expected)
    err = (actual.detach().float() - expected).abs()
    assert bool((err <= ulps * spacing).all()), f"{msg}: max {float((err / spacing).max())} ulp"


# -- fp32 math against torch.optim -----------------------------------------------------------


# -- weight modes: exact contracts --------------------------------------------------------------


def test_kahan_state_and_bf16_moments():
    ps = _params()
    opt = AdamW(ps, lr=1e-3, rounding="kahan", state_dtype=torch.bfloat16, seed=9)
    for step in range(3):
        _set_grads(ps, _grads(step, dtype=torch.bfloat16))
        opt.step()
    for p in ps:
        st = opt.state[p]
        assert st["kahan_comp"].dtype == torch.bfloat16
        assert st["exp_avg"].dtype == st["exp_avg_sq"].dtype == torch.bfloat16
        assert bool(torch.isfinite(p).all())


# -- groups, schedulers, autograd, caching ------------------------------------------------------


def test_param_groups_and_step_lr():
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = AdamW(
        [{"params": ours[:2]}, {"params": ours[2:], "lr": 0.1, "weight_decay": 0.0}],
        lr=1e-2,
        rounding="master",
        seed=0,
    )
    ref_opt = torch.optim.AdamW(
        [{"params": ref[:2]}, {"params": ref[2:], "lr": 0.1, "weight_decay": 0.0}], lr=1e-2
    )
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.1)
    ref_sched = torch.optim.lr_scheduler.StepLR(ref_opt, step_size=3, gamma=0.1)
    for step in range(10):
        grads = _grads(step)
        _set_grads(ours, grads)
        _set_grads(ref, grads)
        opt.step()
        ref_opt.step()
        sched.step()
        ref_sched.step()
    assert opt.param_groups[1]["lr"] == pytest.approx(0.1 * 0.1**3)
    for p, r in zip(ours, ref):
        _ulp_close(p, r, 4, "param")
    # the lr really matters: a run without the schedule ends elsewhere
    other = _params(torch.float32)
    other_opt = AdamW(
        [{"params": other[:2]}, {"params": other[2:], "lr": 0.1, "weight_decay": 0.0}],
        lr=1e-2,
        seed=0,
    )
    for step in range(10):
        _set_grads(other, _grads(step))
        other_opt.step()
    assert not torch.allclose(other[2], ours[2])


def test_version_bump_and_autograd():
    """The update acts as under torch.no_grad(): no graph, version counter bumped."""
    (p,) = _params(shapes=[(4,)])
    opt = SGD([p], lr=0.1, seed=0)
    p.grad = torch.ones(4, dtype=torch.bfloat16)
    before = p._version
    opt.step()
    assert p._version > before
    assert p.requires_grad and p.grad_fn is None


def test_table_cached_and_rebuilt_when_grads_move():
    ps = _params(torch.float32)
    ref = _params(torch.float32)
    opt = AdamW(ps, lr=1e-2, seed=0)
    ref_opt = AdamW(ref, lr=1e-2, seed=0)
    _set_grads(ps, _grads(0))
    opt.step()
    entry = opt._entry
    for step in range(1, 3):  # grads kept in place (zero_grad(set_to_none=False) style)
        for p, g in zip(ps, _grads(step)):
            p.grad.copy_(g)
        opt.step()
        assert opt._entry is entry
    _set_grads(ps, _grads(3))  # new gradient tensors
    ps[1].grad = None  # and one parameter without a gradient
    opt.step()
    assert opt._entry is not entry
    for step in range(4):
        _set_grads(ref, _grads(step))
        if step == 3:
            ref[1].grad = None
        ref_opt.step()
    for p, r in zip(ps, ref):
        _assert_bits_equal(p, r)
    assert [int(opt.state[p]["step"]) for p in ps] == [4, 3, 4]


@pytest.mark.parametrize("set_to_none", [True, False])
def test_the_step_keeps_no_gradient_alive(set_to_none):
    """Before: the cached table held the gradients it was built with, so after
    ``zero_grad()`` (``set_to_none=True``, torch's default) the last step's gradients stayed
    allocated through the next backward - a second set of gradients in memory. The bits are
    those of gradients kept in place."""
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4).to(torch.bfloat16)
    ref = copy.deepcopy(model)
    opt = AdamW(model.parameters(), lr=1e-2, seed=0)
    ref_opt = AdamW(ref.parameters(), lr=1e-2, seed=0)
    freed = []
    for step in range(3):
        x = torch.randn(2, 8, generator=torch.Generator().manual_seed(step)).bfloat16()
        for m in (model, ref):
            m(x).float().square().mean().backward()
        freed.append(weakref.ref(model.weight.grad))
        opt.step()
        ref_opt.step()
        opt.zero_grad(set_to_none=set_to_none)
        ref_opt.zero_grad(set_to_none=False)
        assert all(r() is None for r in freed) == set_to_none
    for p, r in zip(model.parameters(), ref.parameters()):
        _assert_bits_equal(p, r)


@pytest.mark.parametrize("device", ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"])
@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_new_gradients_each_step_reuse_the_table(kind, device, monkeypatch):
    """torch's default ``zero_grad(set_to_none=True)``: backward allocates new gradients every
    step. Before, each step rebuilt the whole table (a host loop over every tensor, many
    times the step's own host cost); now the table reads the new gradients in place of the
    old ones, with the bits of gradients kept in place."""
    make = {
        "adamw": lambda ps: AdamW(ps, lr=1e-2, seed=0),
        "sgd": lambda ps: SGD(ps, lr=1e-2, momentum=0.9, seed=0),
    }[kind]
    ours, ref = _params(device=device), _params(device=device)
    opt, ref_opt = make(ours), make(ref)
    builds = []
    build = type(opt)._build
    monkeypatch.setattr(
        type(opt), "_build", lambda self, *a: builds.append(self) or build(self, *a)
    )
    for step in range(4):
        _set_grads(ours, _grads(step))  # new tensors, the old ones freed
        if ref[0].grad is None:
            _set_grads(ref, _grads(step))
        for p, g in zip(ref, _grads(step)):
            p.grad.copy_(g)  # in place: the table stays cached
        opt.step()
        ref_opt.step()
        opt.zero_grad()
    assert builds.count(opt) == 1 and builds.count(ref_opt) == 1
    for p, r in zip(ours, ref):
        _assert_bits_equal(p, r)


def test_new_gradients_that_differ_rebuild_the_table():
    """A new gradient of another dtype or layout, a parameter newly without one, or one that
    shares memory with a parameter: the table is rebuilt (or the step refuses, as at the first
    step), never read with the old gradients' formats or addresses."""
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = SGD(ours, lr=0.1, seed=0)
    ref_opt = torch.optim.SGD(ref, lr=0.1)
    changes = [
        lambda g: g,
        lambda g: [g[0].bfloat16(), *g[1:]],  # another dtype
        lambda g: [g[0].t().contiguous().t(), *g[1:]],  # another layout (copied in)
        lambda g: [None, *g[1:]],  # no gradient
    ]
    ours[0].grad_dtype = None  # a bf16 gradient for a float32 parameter: srround takes it
    for step, change in enumerate(changes):
        grads = change(_grads(step))
        for params in (ours, ref):
            for p, g in zip(params, grads):
                p.grad = None if g is None else g.to(p.grad_dtype or g.dtype, copy=True)
        opt.step()
        ref_opt.step()
        for p, r in zip(ours, ref):
            _ulp_close(p, r, 0, f"step {step}")
    ours[1].grad = ours[2].detach().view(-1)[:7]  # the same dtype and layout as before
    ours[2].grad = torch.zeros_like(ours[2])
    with pytest.raises(ValueError, match="shares memory"):
        opt.step()


def _reset_state(opt, p, how):
    if how == "new state":
        opt.state = collections.defaultdict(dict)
    elif how == "clear":
        opt.state.clear()
    elif how == "del":
        del opt.state[p]
    elif how == "exp_avg":
        opt.state[p]["exp_avg"] = torch.zeros_like(p)
    else:
        opt.state[p]["step"] = torch.tensor(0.0)


@pytest.mark.parametrize("how", ["new state", "clear", "del", "exp_avg", "step"])
def test_a_state_reset_or_replaced_between_steps_is_used(how):
    """Before: with gradients kept in place (the cached table), a reset of the optimizer's
    state (``opt.state = defaultdict(dict)``, ``.clear()``, ``del opt.state[p]``) or a state
    tensor replaced (``state[p]["exp_avg"] = ...``, ``["step"]``) was ignored: the step went on
    with the old buffers, silently. Now the step uses what ``opt.state`` holds, as torch's."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    opt = AdamW(ours, lr=1e-2, seed=0)
    ref = torch.optim.AdamW(theirs, lr=1e-2)
    for step in range(3):
        if step == 2:
            for o, ps in ((opt, ours), (ref, theirs)):
                _reset_state(o, ps[1], how)
        for o, ps in ((opt, ours), (ref, theirs)):
            if ps[0].grad is None:
                _set_grads(ps, _grads(step))
            for p, g in zip(ps, _grads(step)):
                p.grad.copy_(g)  # in place: the table stays cached
            o.step()
    for p, r in zip(ours, theirs):
        _ulp_close(p, r, 4, how)
        assert int(opt.state[p]["step"]) == int(ref.state[r]["step"])


def test_table_rebuilt_when_a_param_changes_group_or_storage():
    """Moving a parameter to another group (editing ``group["params"]``) and replacing a
    parameter's storage (``p.data = ...``, as ``module.to``/``.half`` do) both rebuild the table:
    the step uses the new group's lr and writes the new storage."""
    ours, ref = _params(torch.float32), _params(torch.float32)
    opt = SGD([{"params": ours[:2]}, {"params": ours[2:], "lr": 0.5}], lr=0.1, seed=0)
    ref_opt = torch.optim.SGD([{"params": ref[:2]}, {"params": ref[2:], "lr": 0.5}], lr=0.1)
    for step in range(4):
        if step == 2:  # ours[1] joins group 1 (same flat order, other group sizes)
            for o in (opt, ref_opt):
                moved = o.param_groups[0]["params"].pop()
                o.param_groups[1]["params"].insert(0, moved)
        if step == 3:  # new storage for a parameter
            for p in (ours[0], ref[0]):
                p.data = p.data.clone()
        grads = _grads(step)
        for params in (ours, ref):  # gradients kept in place: only the change can rebuild
            if params[0].grad is None:
                _set_grads(params, grads)
            for p, g in zip(params, grads):
                p.grad.copy_(g)
        opt.step()
        ref_opt.step()
        for p, r in zip(ours, ref):
            _assert_bits_equal(p, r, f"step {step}")


def test_no_grads_is_a_no_op():
    ps = _params()
    opt = AdamW(ps, seed=0)
    before = [p.detach().clone() for p in ps]
    opt.step()
    for p, b in zip(ps, before):
        _assert_bits_equal(p, b)


def test_closure():
    w = torch.nn.Parameter(torch.tensor([2.0, -1.0]))
    opt = SGD([w], lr=0.1, seed=0)

    def closure():
        opt.zero_grad()
        loss = (w**2).sum()
        loss.backward()
        return loss

    loss = opt.step(closure)
    assert float(loss.detach()) == 5.0
    torch.testing.assert_close(w.detach(), torch.tensor([1.6, -0.8]))


# -- loss scaling ---------------------------------------------------------------------------


def _model(dtype, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 1)).to(
        dtype
    )


def _snapshot(model, opt):
    out = [_bits(p) for p in model.parameters()]
    for p in model.parameters():
        for v in opt.state[p].values():
            out.append(_bits(v) if v.dtype != torch.int16 else v.clone())
    return out


def test_found_inf_skips_on_device_then_continues():
    model = _model(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, state_dtype=torch.bfloat16, seed=4)
    scaler = GradScaler("cpu", init_scale=2.0**8)
    x, y = torch.randn(8, 4).bfloat16(), torch.randn(8, 1).bfloat16()
    for step in range(3):
        opt.zero_grad()
        scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
        if step == 1:
            model[0].weight.grad[0, 0] = float("inf")
            before = _snapshot(model, opt)
        scaler.step(opt)
        scaler.update()
        if step == 1:
            after = _snapshot(model, opt)
            assert all(torch.equal(a, b) for a, b in zip(before, after))
            assert scaler.get_scale() == 2.0**7
            assert float(scaler.last_step_skipped) == 1.0
    assert all(int(opt.state[p]["step"]) == 2 for p in model.parameters())
    assert not all(torch.equal(a, b) for a, b in zip(after, _snapshot(model, opt)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_scaler_equals_torch_scaler(dtype):
    """srround's GradScaler (check only + unscale fused into the step) and torch.amp.GradScaler
    (unscale pass, then the plain step) give the same bits: the scale is a power of two, so
    grad * (1/scale) is exact whether or not it is rounded to the gradient's dtype first."""
    runs = []
    for scaler in (
        GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
        torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2),
    ):
        model = _model(dtype)
        opt = AdamW(model.parameters(), lr=1e-2, seed=7)
        x, y = (
            torch.randn(8, 4, generator=torch.Generator().manual_seed(1)).to(dtype),
            torch.randn(8, 1, generator=torch.Generator().manual_seed(2)).to(dtype),
        )
        scales = []
        for step in range(5):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if step == 2:
                model[2].bias.grad[0] = float("nan")
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
        runs.append((_snapshot(model, opt), scales))
    (a, sa), (b, sb) = runs
    assert sa == sb
    assert all(torch.equal(u, v) for u, v in zip(a, b))


def test_fused_scaler_reads_grads_once_without_writing_them():
    """unscale_grads=False: the fused path never writes the gradients, they stay scaled."""
    model = _model(torch.bfloat16)
    opt = AdamW(model.parameters(), lr=1e-2, seed=0)
    scaler = GradScaler("cpu", init_scale=2.0**4, unscale_grads=False)
    scaler.scale(model(torch.randn(3, 4).bfloat16()).sum()).backward()
    before = [p.grad.clone() for p in model.parameters()]
    scaler.step(opt)
    scaler.update()
    assert all(torch.equal(p.grad, b) for p, b in zip(model.parameters(), before))
    assert scaler.get_scale() == 2.0**4


def test_fused_scaler_after_explicit_unscale():
    """unscale_ (for clipping) then step: only the flag reaches the fused step."""
    runs = []
    for explicit in (False, True):
        model = _model(torch.float32)
        opt = SGD(model.parameters(), lr=0.1, momentum=0.9, seed=0)
        scaler = GradScaler("cpu", init_scale=2.0**6)
        x, y = torch.randn(8, 4, generator=torch.Generator().manual_seed(1)), torch.ones(8, 1)
        for _ in range(2):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if explicit:
                scaler.unscale_(opt)
            scaler.step(opt)
            scaler.update()
        runs.append([_bits(p) for p in model.parameters()])
    assert all(torch.equal(u, v) for u, v in zip(*runs))


# -- state dict -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make",
    [
        lambda ps, seed: AdamW(
            ps, lr=1e-2, rounding="stochastic", state_dtype=torch.bfloat16, seed=seed
        ),
        lambda ps, seed: AdamW(ps, lr=1e-2, rounding="remainder", seed=seed),
        lambda ps, seed: SGD(ps, lr=0.1, momentum=0.9, rounding="kahan", seed=seed),
    ],
    ids=["adamw-stochastic-bf16-states", "adamw-remainder", "sgd-kahan"],
)
def test_state_dict_resume_is_bit_identical(make):
    def train(params, opt, steps):
        for step in steps:
            opt.zero_grad(set_to_none=True)
            _set_grads(params, _grads(step, dtype=torch.bfloat16))
            opt.step()

    straight = _params()
    opt = make(straight, 123)
    train(straight, opt, range(6))

    first = _params()
    opt1 = make(first, 123)
    train(first, opt1, range(3))
    buffer = io.BytesIO()
    torch.save({"params": [p.detach() for p in first], "opt": opt1.state_dict()}, buffer)
    buffer.seek(0)
    saved = torch.load(buffer)
    resumed = [torch.nn.Parameter(t.clone()) for t in saved["params"]]
    opt2 = make(resumed, 999)  # another seed: the loaded one must win
    opt2.load_state_dict(saved["opt"])
    assert opt2.param_groups[0]["seed"] == 123
    train(resumed, opt2, range(3, 6))
    for p, q in zip(straight, resumed):
        _assert_bits_equal(p, q)
        assert opt.state[p].keys() == opt2.state[q].keys()
        for name, value in opt.state[p].items():
            other = opt2.state[q][name]
            assert value.dtype == other.dtype, name
            assert torch.equal(value, other), name


# -- errors -----------------------------------------------------------------------------------


def test_errors():
    ps = _params()
    with pytest.raises(ValueError, match="rounding"):
        AdamW(ps, rounding="up")
    with pytest.raises(ValueError, match="state_dtype"):
        AdamW(ps, state_dtype=torch.float16)
    with pytest.raises(ValueError, match="rounding"):
        AdamW(_params(torch.float16), rounding="remainder")
    with pytest.raises(TypeError, match="params"):
        SGD(_params(torch.float64), lr=0.1)
    with pytest.raises(ValueError, match="found_inf: needed with check_grads=True"):
        AdamW(ps).step(check_grads=True)
    with pytest.raises(TypeError, match="seed"):
        SGD(ps, lr=0.1, seed="x")
    with pytest.raises(ValueError, match="nesterov"):
        SGD(ps, lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(ps, amsgrad=True, rounding="kahan")
    with pytest.raises(ValueError, match="rounding"):
        AdamW([{"params": ps[:1]}, {"params": ps[1:], "rounding": "nearest"}])
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = SGD(emb.parameters(), lr=0.1)
    emb(torch.tensor([1, 2])).sum().backward()
    with pytest.raises(TypeError, match="grads"):
        opt.step()
    dense = torch.nn.Parameter(torch.zeros(3))  # no gradient, beside the sparse one
    opt = SGD([dense, *emb.parameters()], lr=0.1)
    with pytest.raises(TypeError, match="grads"):
        opt.step()
    opt = AdamW(ps)
    ps[0].grad = torch.zeros_like(ps[0])
    with pytest.raises(TypeError, match="found_inf"):
        opt.step(found_inf=torch.zeros(1, dtype=torch.float64))


# -- a custom optimizer from the public primitives ---------------------------------------------


class Lion(torch.optim.Optimizer):
    """Lion (Chen et al. 2023) on bf16 weights: fp32 update in torch, one
    ``srround.stochastic_add`` per tensor; one seed, offsets t * 2**36 + the tensor's start in
    the flat parameter order, so every step and element gets its own random bits."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99), weight_decay=0.0, seed=0):
        super().__init__(params, {"lr": lr, "betas": betas, "weight_decay": weight_decay})
        self.seed = seed
        self.t = 0

    @torch.no_grad()
    def step(self):
        self.t += 1
        start = 0
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for p in group["params"]:
                if p.grad is not None:
                    g = p.grad.float()
                    m = self.state[p].setdefault(
                        "exp_avg", torch.zeros_like(p, dtype=torch.float32)
                    )
                    update = (m * beta1 + g * (1 - beta1)).sign_()
                    update.add_(p.float(), alpha=group["weight_decay"])
                    srround.stochastic_add(
                        p,
                        update,
                        alpha=-group["lr"],
                        seed=self.seed,
                        offset=(self.t << STEP_SHIFT) + start,
                    )
                    m.mul_(beta2).add_(g, alpha=1 - beta2)
                start += p.numel()


def test_lion_from_primitives_trains():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    y = x @ torch.randn(8, 1, generator=gen)
    w = torch.nn.Parameter(torch.zeros(8, 1, dtype=torch.bfloat16))
    opt = Lion([w], lr=3e-2, seed=1)
    losses = []
    for _ in range(150):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(x.bfloat16() @ w, y.bfloat16())
        loss.backward()
        opt.step()
        losses.append(float(loss.detach()))
    assert losses[-1] < 0.02 * losses[0]


# -- CUDA (real devices only: torch has no CUDA simulator) ------------------------------------


# -- host overhead (measured, not asserted) ----------------------------------------------------


def test_host_overhead_200_tensors(capsys):
    params = [torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16)) for _ in range(200)]
    for p in params:
        p.grad = torch.ones_like(p)
    opt = AdamW(params, lr=1e-3, seed=0)
    opt.step()  # builds the table
    n = 200
    t0 = time.perf_counter()
    for _ in range(n):
        opt.step()
    per_step = (time.perf_counter() - t0) / n * 1e6
    with capsys.disabled():
        print(f"\nsrround AdamW, 200 tensors x 4 bf16: {per_step:.0f} us/step (CPU, cached table)")


# -- torch.optim parity: flags, maximize, state dicts both ways, layouts ---------------------


def _run(opt, params, steps, dtype=torch.float32, start=0):
    for step in range(start, start + steps):
        _set_grads(params, _grads(step, dtype=dtype))
        opt.step()


@pytest.mark.parametrize(
    "make, ref",
    [
        (
            lambda ps, **kw: AdamW(ps, lr=1e-2, weight_decay=0.1, seed=1, **kw),
            lambda ps, **kw: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1, **kw),
        ),
        (
            lambda ps, **kw: SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, seed=1, **kw),
            lambda ps, **kw: torch.optim.SGD(ps, lr=0.05, momentum=0.9, weight_decay=0.01, **kw),
        ),
    ],
    ids=["adamw", "sgd"],
)
def test_maximize_and_implementation_flags_match_torch(make, ref):
    """Finding: maximize unsupported, foreach/fused/differentiable/capturable=False
    rejected. fp32 parameters: torch.optim's result within a few ulp."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    flags = {"maximize": True, "foreach": False, "differentiable": False}
    opt = make(ours, fused=False, **flags)
    ref_opt = ref(theirs, **flags)
    _run(opt, ours, 20)
    _run(ref_opt, theirs, 20)
    for p, r in zip(ours, theirs):
        _ulp_close(p, r, 4, "param")
    for flag in ({"foreach": True}, {"fused": True}, {"fused": None}):
        make(_params(), **flag)
    AdamW(_params(), capturable=True)
    with pytest.raises(ValueError, match="differentiable"):
        make(_params(), differentiable=True)
    with pytest.raises(ValueError, match="maximize: one value per optimizer"):
        ps = _params()
        AdamW([{"params": ps[:1]}, {"params": ps[1:], "maximize": True}])


def _torch_trained(kind, steps=3):
    params = _params(torch.float32)
    opt = (
        torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1)
        if kind == "adamw"
        else torch.optim.SGD(params, lr=0.05, momentum=0.9, nesterov=True)
    )
    _run(opt, params, steps)
    return params, opt


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_loads_a_torch_optim_state_dict_and_continues(kind):
    """Finding: a torch.optim state_dict loaded, then step() raised KeyError: 'rounding'. The
    srround keys now come from the defaults; continuing matches torch continuing."""
    params, torch_opt = _torch_trained(kind)
    ours = [torch.nn.Parameter(p.detach().clone()) for p in params]
    make = AdamW if kind == "adamw" else SGD
    opt = make(ours, lr=1.0, seed=5)
    opt.load_state_dict(torch_opt.state_dict())
    group = opt.param_groups[0]
    assert group["rounding"] == "stochastic" and group["seed"] == 5 and group["lr"] != 1.0
    _run(opt, ours, 3, start=3)
    _run(torch_opt, params, 3, start=3)
    for p, r in zip(ours, params):
        _ulp_close(p, r, 4, "param")
        if kind == "adamw":
            assert int(opt.state[p]["step"]) == 6


@pytest.mark.parametrize("make", [AdamW, SGD])
def test_param_group_added_after_load_state_dict_takes_the_loaded_settings(make):
    """Finding (Lightning: a run resumed with ``ckpt_path``, then ``BackboneFinetuning``
    unfreezing the backbone, ``optimizer.add_param_group``): the new group took ``seed`` (and
    ``rounding``, ``state_dtype``) from the constructor's defaults, the loaded groups had the
    state dict's, and the next step raised "must be the same in every group". A state dict
    sets the one-per-optimizer values, defaults included; the resumed run matches one that was
    never interrupted."""
    settings = dict(lr=1e-2, rounding="kahan", state_dtype=torch.bfloat16, seed=1)
    runs = []
    for resumed in (False, True):
        first, second = _params(seed=1), _params(seed=2)
        opt = make(first, **settings)
        _run(opt, first, 2)
        if resumed:
            state_dict = opt.state_dict()
            opt = make(first, lr=1.0, seed=2)  # a fresh process: seed=None draws another seed
            opt.load_state_dict(state_dict)
        opt.add_param_group({"params": second, "lr": 1e-3})
        assert opt.param_groups[1]["seed"] == 1 and opt.param_groups[1]["rounding"] == "kahan"
        for step in (2, 3):
            _set_grads(first + second, _grads(step) + _grads(step + 10))
            opt.step()
        runs.append([p.detach() for p in first + second])
    assert all(torch.equal(p, q) for p, q in zip(*runs))


def test_lightning_resume_ends_on_the_uninterrupted_bits(tmp_path):
    """PyTorch Lightning (when installed): bf16-true parameters, seed=None under
    ``seed_everything``, a per-step LR schedule, ``ModelCheckpoint`` then
    ``trainer.fit(ckpt_path=...)`` from a process seeded otherwise, ``BackboneFinetuning``
    adding a param group after the resume (before: "must be the same in every group"): the
    resumed run ends on the bits of the uninterrupted one."""
    pl = pytest.importorskip("pytorch_lightning")
    from torch.utils.data import DataLoader, TensorDataset

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.backbone = torch.nn.Linear(8, 8)
            self.net = torch.nn.Sequential(
                torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)
            )

        def training_step(self, batch, index):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(self.backbone(x)).float(), y.float())

        def configure_optimizers(self):
            opt = AdamW([p for p in self.parameters() if p.requires_grad], lr=1e-2)
            sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
            return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    gen = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(8, 8, generator=gen), torch.randn(8, 1, generator=gen))

    def fit(seed, ckpt_path=None, callbacks=()):
        pl.seed_everything(seed, verbose=False)
        module = Module()
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=1,
            max_steps=4,
            precision="bf16-true",
            logger=False,
            callbacks=[pl.callbacks.BackboneFinetuning(3), *callbacks],
            enable_checkpointing=bool(callbacks),
            enable_progress_bar=False,
            enable_model_summary=False,
        )
        trainer.fit(module, DataLoader(data, batch_size=8), ckpt_path=ckpt_path)
        assert len(trainer.optimizers[0].param_groups) == 2  # the backbone's group added
        return [p.detach() for p in module.parameters()]

    checkpoint = pl.callbacks.ModelCheckpoint(tmp_path, every_n_train_steps=2, save_top_k=-1)
    full = fit(1, callbacks=[checkpoint])
    resumed = fit(2, ckpt_path=next(tmp_path.glob("*step=2*")))
    assert all(torch.equal(p, q) for p, q in zip(full, resumed))


def test_unusable_torch_state_dict_fails_at_load_with_nothing_loaded():
    params = _params(torch.float32)
    torch_opt = torch.optim.AdamW(params, lr=1e-2, differentiable=True)
    opt = AdamW(_params(torch.float32), lr=1e-3, seed=1)
    with pytest.raises(ValueError, match="differentiable"):
        opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-3 and len(opt.state) == 0
    sd = AdamW(_params(), seed=1).state_dict()
    sd["param_groups"][0]["rounding"] = "up"
    with pytest.raises(ValueError, match="rounding"):
        opt.load_state_dict(sd)


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
@pytest.mark.parametrize("bad", [-1.0, 5.5, float("nan"), 2.0**26 - 1, 1e12])
def test_a_step_count_that_cannot_continue_fails_at_load_with_nothing_loaded(kind, bad):
    """Finding (11-28): a saved ``step`` that is negative, fractional, NaN or beyond the
    kernels' range (the next step must be below 2**26) was cast to int32 silently: -1 wrote NaN
    weights at the next AdamW step (bias correction 1 - beta1**0 = 0), 5.5 became 5 and 1e12 a
    negative count. Now a ValueError naming the state, before anything is loaded."""
    torch_cls, ours = {"adamw": (torch.optim.AdamW, AdamW), "sgd": (torch.optim.SGD, SGD)}[kind]
    params = _params(torch.float32)
    for p in params:
        p.grad = torch.ones_like(p)
    torch_opt = torch_cls(params, lr=1e-3, **({"momentum": 0.9} if kind == "sgd" else {}))
    torch_opt.step()
    sd = torch_opt.state_dict()
    sd["state"][1]["step"] = torch.tensor(bad, dtype=torch.float64)
    opt = ours(_params(torch.float32), lr=1e-2, seed=1)
    with pytest.raises(ValueError, match=r"^state_dict: state\[1\]\['step'\]: .* steps taken"):
        opt.load_state_dict(sd)
    assert opt.param_groups[0]["lr"] == 1e-2 and len(opt.state) == 0
    sd["state"][1]["step"] = 2**26 - 2  # the largest that can take a step (not a float32)
    opt.load_state_dict(sd)
    for p in opt.param_groups[0]["params"]:
        p.grad = torch.ones_like(p)
    opt.step()
    assert int(opt.state[opt.param_groups[0]["params"][1]]["step"]) == 2**26 - 1
    # one more: refused before the step (before 11-29 it ran, and the optimizer then refused
    # to load its own state dict)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    with pytest.raises(ValueError, match=r"^step\[1\]: 67108863 steps taken"):
        opt.step()
    assert int(opt.state[opt.param_groups[0]["params"][1]]["step"]) == 2**26 - 1
    assert all(torch.equal(p, b) for p, b in zip(opt.param_groups[0]["params"], before))


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_a_parameter_whose_data_changed_shape_is_a_clear_error(rounding):
    """Before: ``p.data = <another shape>`` after a step failed in the next one with a
    broadcasting error from a state copy. The parameters are not written."""
    params = _params()
    opt = AdamW(params, seed=1, rounding=rounding)
    _run(opt, params, 1)
    with torch.no_grad():
        params[0].data = torch.zeros(6, 3, dtype=torch.bfloat16)
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.ones_like(p)
    with pytest.raises(
        ValueError, match=r"^state: exp_avg has shape \(5, 3\), its parameter \(6, 3\)"
    ):
        opt.step()
    for p, b in zip(params, before):
        _assert_bits_equal(p, b)


def test_state_dict_of_another_optimizer_or_other_shapes_fails_at_load():
    """Before: an SGD state dict (torch's or srround's) loaded into AdamW took betas and eps
    from AdamW's defaults and the SGD step count as its own (the first Adam step then
    bias-corrected as a late one), silently, and AdamW's into SGD likewise; moments of
    another shape failed in the step with a broadcasting error. Now: errors naming what is
    wrong, with nothing loaded."""
    sgd_params = _params(torch.float32)
    torch_sgd = torch.optim.SGD(sgd_params, lr=0.1, momentum=0.9)
    ours_sgd = SGD(_params(torch.float32), lr=0.1, momentum=0.9, seed=1)
    for source in (torch_sgd, ours_sgd):
        _run(source, source.param_groups[0]["params"], 2)
        opt = AdamW(_params(torch.float32), lr=1e-3, seed=1)
        with pytest.raises(ValueError, match="param group 0 has no betas, eps: not a state dict"):
            opt.load_state_dict(source.state_dict())
        assert opt.param_groups[0]["lr"] == 1e-3 and len(opt.state) == 0
    # torch.optim.Adam's groups have AdamW's keys; with weight decay its L2 decay (before:
    # loaded silently, and continued as decoupled decay); without, Adam is AdamW
    for weight_decay, loads in ((0.01, False), (0.0, True)):
        adam = torch.optim.Adam(_params(torch.float32), lr=1e-3, weight_decay=weight_decay)
        _run(adam, adam.param_groups[0]["params"], 1)
        opt = AdamW(_params(torch.float32), lr=1e-2, seed=1)
        if loads:
            opt.load_state_dict(adam.state_dict())
            assert opt.param_groups[0]["lr"] == 1e-3 and len(opt.state) == len(SHAPES)
            continue
        with pytest.raises(ValueError, match=r"^decoupled_weight_decay \(param group 0\)"):
            opt.load_state_dict(adam.state_dict())
        assert opt.param_groups[0]["lr"] == 1e-2 and len(opt.state) == 0
    adamw = AdamW(_params(torch.float32), seed=1)
    _run(adamw, adamw.param_groups[0]["params"], 2)
    with pytest.raises(ValueError, match="has no momentum, dampening, nesterov"):
        SGD(_params(torch.float32), lr=0.1, seed=1).load_state_dict(adamw.state_dict())
    shapes = [(s[0] + 1,) + tuple(s[1:]) if i == 1 else s for i, s in enumerate(SHAPES)]
    other = AdamW(_params(torch.float32, shapes=shapes), seed=1)
    with pytest.raises(ValueError, match=r"state\[1\]\['exp_avg'\] has shape"):
        other.load_state_dict(adamw.state_dict())
    assert len(other.state) == 0


def test_non_float8_states_into_float8_states_fail_at_load():
    """A torch.optim dict (no ``state_dtype`` of its own: the optimizer's float8 applies)
    loaded into AdamW with float8 states: a ValueError at load naming the state, nothing
    loaded. Before, the load went through and the first step refused it (float8 states are
    not converted). srround's own dict carries its ``state_dtype``, which replaces the
    constructor's (README)."""
    source = torch.optim.AdamW(_params(torch.bfloat16), lr=1e-3)
    _run(source, source.param_groups[0]["params"], 1)
    opt = AdamW(_params(torch.bfloat16), lr=1e-2, seed=1, state_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=r"^state_dict: state\[0\]\['exp_avg'\] is torch"):
        opt.load_state_dict(source.state_dict())
    assert opt.param_groups[0]["lr"] == 1e-2 and len(opt.state) == 0


@pytest.mark.parametrize("scale", ["exp_avg_scale", "exp_avg_sq_scale"])
def test_float8_states_without_their_scales_fail_at_load(scale):
    """A saved float8 moment without its block scales loaded silently, and the first step
    made zero scales: the saved codes were read as 0 (the moment lost). Now a ValueError at
    load naming both, nothing loaded."""
    source = AdamW(_params(torch.bfloat16), lr=1e-3, seed=1, state_dtype=torch.float8_e4m3fn)
    _run(source, source.param_groups[0]["params"], 1)
    saved = copy.deepcopy(source.state_dict())
    del saved["state"][1][scale]
    opt = AdamW(_params(torch.bfloat16), lr=1e-2, seed=1, state_dtype=torch.float8_e4m3fn)
    with pytest.raises(ValueError, match=rf"^state_dict: state\[1\] has .* but not '{scale}'"):
        opt.load_state_dict(saved)
    assert opt.param_groups[0]["lr"] == 1e-2 and len(opt.state) == 0


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_torch_optim_loads_srround_state_dict(kind):
    ours = _params(torch.float32)
    opt = (
        AdamW(ours, lr=1e-2, weight_decay=0.1, seed=1)
        if kind == "adamw"
        else SGD(ours, lr=0.05, momentum=0.9, seed=1)
    )
    _run(opt, ours, 3)
    theirs = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    torch_opt = (torch.optim.AdamW if kind == "adamw" else torch.optim.SGD)(theirs)
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # as saved: no shared tensors
    _run(torch_opt, theirs, 3, start=3)
    _run(opt, ours, 3, start=3)
    for p, r in zip(ours, theirs):
        _ulp_close(p, r, 4, "param")


def test_channels_last_parameters_update_in_place_noise_in_memory_order():
    """Finding: channels_last weights were rejected. A channels_last bf16 weight is updated
    in place, its states are channels_last, and its bits equal those of a contiguous
    parameter holding its memory order (NHWC): the noise follows memory order."""
    gen = torch.Generator().manual_seed(0)
    nchw = torch.randn(4, 3, 5, 5, generator=gen).bfloat16()
    weight = torch.nn.Parameter(nchw.to(memory_format=torch.channels_last))
    nhwc = torch.nn.Parameter(nchw.permute(0, 2, 3, 1).contiguous())
    address = weight.data_ptr()
    opt_cl = AdamW([weight], lr=1e-2, state_dtype=torch.bfloat16, seed=9)
    opt_ref = AdamW([nhwc], lr=1e-2, state_dtype=torch.bfloat16, seed=9)
    for step in range(3):
        g = torch.randn(4, 3, 5, 5, generator=gen).bfloat16()
        weight.grad = g.to(memory_format=torch.channels_last)
        nhwc.grad = g.permute(0, 2, 3, 1).contiguous()
        opt_cl.step()
        opt_ref.step()
    assert weight.data_ptr() == address
    assert weight.is_contiguous(memory_format=torch.channels_last)
    for name in ("exp_avg", "exp_avg_sq"):
        assert opt_cl.state[weight][name].is_contiguous(memory_format=torch.channels_last)
    _assert_bits_equal(weight.permute(0, 2, 3, 1).contiguous(), nhwc)
    # a gradient of another layout than its parameter: copied into the parameter's layout
    weight.grad = weight.grad.contiguous()
    nhwc.grad = nhwc.grad.clone()
    opt_cl.step()
    opt_ref.step()
    _assert_bits_equal(weight.permute(0, 2, 3, 1).contiguous(), nhwc)


@pytest.mark.parametrize("rounding", ["stochastic", "kahan"])
def test_strided_parameters_get_the_bits_of_a_contiguous_copy(rounding):
    """A Parameter made from a non-dense view (as torch's optimizer tests do): the slower path
    gives exactly the bits of a contiguous parameter, and the rest of the base is untouched."""
    gen = torch.Generator().manual_seed(0)
    base = torch.randn(6, 8, generator=gen).bfloat16()
    untouched = base[:, 1::2].clone()
    view = torch.nn.Parameter(base[:, ::2])
    assert not view.is_contiguous()
    copy = torch.nn.Parameter(view.detach().contiguous())
    opt_view = SGD([view], lr=0.1, momentum=0.9, rounding=rounding, seed=4)
    opt_copy = SGD([copy], lr=0.1, momentum=0.9, rounding=rounding, seed=4)
    for step in range(3):
        g = torch.randn(6, 4, generator=gen).bfloat16()
        view.grad, copy.grad = g.clone(), g.clone()
        opt_view.step()
        opt_copy.step()
    _assert_bits_equal(view.contiguous(), copy)
    _assert_bits_equal(base[:, 1::2], untouched)
    _assert_bits_equal(base[:, ::2].contiguous(), copy)


def test_unsupported_parameters_and_gradients_fail_clearly():
    with pytest.raises(TypeError, match=r"params\[0\].*float64 parameters are not supported"):
        AdamW([torch.nn.Parameter(torch.zeros(3, dtype=torch.float64))])
    # Finding: the index is the one within its group, which the error did not name (the
    # Trainer builds two groups: decay, no decay)
    decay, other = _params(torch.float32), _params(torch.float32)
    other[1] = torch.nn.Parameter(other[1].detach().double())
    with pytest.raises(TypeError, match=r"params\[1\] \(param group 1\): .* got torch.float64"):
        AdamW([{"params": decay}, {"params": other, "weight_decay": 0.0}])
    p = torch.nn.Parameter(torch.zeros(3))
    opt = AdamW([p], seed=0)
    with pytest.raises(TypeError, match="float64"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.zeros(2).double())]})
    assert len(opt.param_groups) == 1  # the bad group was not added
    emb = torch.nn.Embedding(4, 2, sparse=True)
    opt = SGD([p, *emb.parameters()], lr=0.1, momentum=0.9)
    p.grad = torch.ones(3)
    emb(torch.tensor([1])).sum().backward()
    with pytest.raises(TypeError, match=r"grads\[1\] \(param group 0\): torch.sparse_coo"):
        opt.step()
    assert len(opt.state) == 0  # nothing created before the error


@pytest.mark.parametrize("which", ["grad", "param"])
def test_tensor_subclasses_without_storage_fail_clearly(which):
    """A wrapper tensor subclass (torchao's weight and state wrappers, torch's TwoTensor) has
    no storage of its own: its ``data_ptr()`` is 0. Before: such a gradient crashed the
    process (the fused kernel read address 0: a segmentation fault; on CUDA an illegal
    address), and such a parameter was "sharing memory" with its gradient. Now a TypeError
    naming it, before any state exists."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")

    def wrapped(t):
        return two_tensor.TwoTensor(t, t.clone())

    plain = torch.nn.Parameter(torch.zeros(3))
    p = torch.nn.Parameter(wrapped(torch.zeros(2))) if which == "param" else plain
    opt = AdamW([plain, p] if which == "param" else [p], seed=0)
    plain.grad = torch.ones(3)
    p.grad = wrapped(torch.ones(2)) if which == "param" else wrapped(torch.ones(3))
    index = 1 if which == "param" else 0
    with pytest.raises(TypeError, match=rf"^{which}s\[{index}\] \(param group 0\): a TwoTensor"):
        opt.step()
    assert len(opt.state) == 0


def test_a_step_error_names_the_parameter_by_its_index_in_its_group():
    """Finding: the step's checks named a parameter by its index among the parameters with
    gradients, so a frozen parameter before it shifted the index: torchao's
    ``WeightWithDynamicFloat8CastTensor`` weight after a frozen one was "params[0]", the
    frozen one's index. Now ``params[j] (param group g)``, as the constructor names them."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    plain, frozen = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    wrapped = torch.nn.Parameter(two_tensor.TwoTensor(torch.zeros(2), torch.zeros(2)))
    opt = AdamW([{"params": [plain]}, {"params": [frozen, wrapped]}], seed=0)
    wrapped.grad = two_tensor.TwoTensor(torch.ones(2), torch.ones(2))
    with pytest.raises(TypeError, match=r"^params\[1\] \(param group 1\): a TwoTensor"):
        opt.step()
    assert len(opt.state) == 0


# -- torch's optimizer tests (pytorch test/test_optim.py, OptimizerInfo for AdamW / SGD),
#    adapted: the generic behaviour every torch.optim optimizer has ------------------------

TORCH_SUITE = [
    pytest.param(lambda ps: AdamW(ps, lr=1e-2, seed=0), id="adamw"),
    pytest.param(lambda ps: AdamW(ps, lr=1e-2, maximize=True, seed=0), id="adamw-maximize"),
    pytest.param(
        lambda ps: AdamW(ps, lr=1e-2, state_dtype=torch.bfloat16, seed=0), id="adamw-bf16states"
    ),
    pytest.param(lambda ps: SGD(ps, lr=1e-2, seed=0), id="sgd"),
    pytest.param(
        lambda ps: SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=0.1, seed=0),
        id="sgd-nesterov",
    ),
]


@pytest.mark.parametrize("make", TORCH_SUITE)
def test_suite_forloop_goes_right_direction(make):
    """test_forloop_goes_right_direction: a few steps on a small problem lower the loss (or
    raise it with maximize), for fp32 and bf16 weights."""
    for dtype in (torch.float32, torch.bfloat16):
        torch.manual_seed(0)
        weight = torch.nn.Parameter(torch.randn(10, 5, dtype=dtype))
        bias = torch.nn.Parameter(torch.randn(10, dtype=dtype))
        x = torch.randn(5, dtype=dtype)
        opt = make([weight, bias])
        maximize = opt.param_groups[0].get("maximize", False)

        def closure():
            opt.zero_grad()
            loss = (weight.mv(x) + bias).float().pow(2).sum()
            loss.backward()
            return loss

        initial = closure().item()
        for _ in range(5):
            closure()
            opt.step()
        final = closure().item()
        assert (final > initial) if maximize else (final < initial), (dtype, initial, final)


@pytest.mark.parametrize("make", TORCH_SUITE)
def test_suite_step_is_noop_when_params_have_no_grad(make):
    params = [torch.nn.Parameter(torch.randn(2, 3)) for _ in range(2)]
    before = [p.detach().clone() for p in params]
    opt = make(params)
    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, params))
    assert len(opt.state) == 0


@pytest.mark.parametrize("make", TORCH_SUITE)
def test_suite_state_dict_deterministic_and_weights_only(make, tmp_path):
    """test_state_dict_deterministic + test_save_load_equality_with_weights_only: a state dict
    saved and loaded (``torch.load(weights_only=True)``) into a fresh optimizer steps exactly
    as the original."""
    params = _params()
    opt = make(params)
    _run(opt, params, 2, dtype=torch.bfloat16)
    path = tmp_path / "opt.pt"
    torch.save(opt.state_dict(), path)
    clone = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt2 = make(clone)
    opt2.load_state_dict(torch.load(path, weights_only=True))
    _run(opt, params, 2, dtype=torch.bfloat16, start=2)
    _run(opt2, clone, 2, dtype=torch.bfloat16, start=2)
    for p, q in zip(params, clone):
        _assert_bits_equal(p, q)
    assert opt.state_dict()["param_groups"] == opt2.state_dict()["param_groups"]


@pytest.mark.parametrize("make", TORCH_SUITE)
def test_suite_can_load_older_state_dict_and_nontensor_step(make):
    """test_can_load_older_state_dict (group keys of older releases missing) and
    test_load_nontensor_step (``step`` saved as a Python number)."""
    params = _params()
    opt = make(params)
    _run(opt, params, 1, dtype=torch.bfloat16)
    sd = copy.deepcopy(opt.state_dict())
    for group in sd["param_groups"]:
        for key in ("foreach", "maximize", "fused", "differentiable", "capturable"):
            group.pop(key, None)
    for state in sd["state"].values():
        state["step"] = int(state["step"])
    opt2 = make([torch.nn.Parameter(p.detach().clone()) for p in params])
    opt2.load_state_dict(sd)
    assert opt2.param_groups[0]["maximize"] == opt.param_groups[0]["maximize"] or not sd
    _run(opt2, opt2.param_groups[0]["params"], 1, dtype=torch.bfloat16, start=1)
    assert all(int(s["step"]) == 2 for s in opt2.state.values())


@pytest.mark.parametrize("make", TORCH_SUITE)
def test_suite_hooks_printing_deepcopy(make):
    """test_step_pre_hook / test_step_post_hook, test_optimizer_can_be_printed,
    test_deepcopy_copies_all_public_attrs, state_dict hooks: inherited from
    torch.optim.Optimizer and working."""
    params = _params()
    opt = make(params)
    calls = []
    opt.register_step_pre_hook(lambda o, a, k: calls.append("pre"))
    opt.register_step_post_hook(lambda o, a, k: calls.append("post"))
    opt.register_state_dict_post_hook(lambda o, sd: sd.setdefault("extra", 1) and sd)
    _run(opt, params, 1, dtype=torch.bfloat16)
    assert calls == ["pre", "post"]
    assert type(opt).__name__ in repr(opt) and "rounding" in repr(opt)
    assert opt.state_dict()["extra"] == 1
    twin = copy.deepcopy(opt)
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(twin) if not k.startswith("_")}
    _run(twin, twin.param_groups[0]["params"], 1, dtype=torch.bfloat16, start=1)
    _run(opt, params, 1, dtype=torch.bfloat16, start=1)
    for p, q in zip(params, twin.param_groups[0]["params"]):
        _assert_bits_equal(p, q)


@pytest.mark.parametrize("make", TORCH_SUITE)
def test_suite_lr_scheduler_and_param_groups(make):
    """test_param_groups_lr / an lr scheduler driving the fused step: a group with lr 0 does
    not move, the others follow the schedule."""
    params = _params(torch.float32)
    opt = make([{"params": params[:1], "lr": 0.0}, {"params": params[1:]}])
    frozen = params[0].detach().clone()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    for step in range(3):
        _run(opt, params, 1, start=step)
        sched.step()
    assert torch.equal(params[0], frozen)
    assert opt.param_groups[1]["lr"] == pytest.approx(1e-2 * 0.5**3)


@pytest.mark.parametrize("make", TORCH_SUITE[:1] + TORCH_SUITE[3:4])
def test_suite_named_parameters_and_non_empty_state(make):
    """test_can_load_from_to_named_state_dict and test_non_empty_state: an optimizer built
    from ``named_parameters()`` saves ``param_names``; torch's optimizer loads that state dict
    and srround's loads torch's; after a step every parameter with a gradient has state."""
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = make(model.named_parameters())
    model(torch.randn(4, 3)).sum().backward()
    opt.step()
    assert all(len(opt.state[p]) > 0 for p in model.parameters())
    sd = opt.state_dict()
    assert sd["param_groups"][0]["param_names"] == ["weight", "bias"]
    theirs = (torch.optim.AdamW if isinstance(opt, AdamW) else torch.optim.SGD)(
        model.named_parameters(), lr=1e-2
    )
    theirs.load_state_dict(sd)
    assert theirs.state_dict()["param_groups"][0]["param_names"] == ["weight", "bias"]
    again = make(torch.nn.Linear(3, 2).named_parameters())
    again.load_state_dict(theirs.state_dict())
    assert again.param_groups[0]["param_names"] == ["weight", "bias"]


@pytest.mark.parametrize("make", TORCH_SUITE[:1] + TORCH_SUITE[4:5])
def test_suite_load_state_dict_hooks(make):
    """test_load_state_dict_pre_hook_and_prepend / test_load_state_dict_post_hook: what a
    pre-hook returns is what loads (before: srround checked and restored the dict it was
    given, so a hook that renamed a key back failed and one that replaced a state was
    ignored), and a post-hook sees the loaded states and has the last word (before: they were
    replaced after it ran)."""
    params = _params(torch.float32)
    opt = make(params)
    _set_grads(params, _grads(0))
    opt.step()
    name = next(iter(opt.state[params[0]].keys() - {"step"}))
    saved = copy.deepcopy(opt.state_dict())
    saved["param_groups"][0]["old_lr"] = saved["param_groups"][0].pop("lr")
    calls = []

    def pre(o, sd):
        calls.append("pre")
        sd = copy.deepcopy(sd)
        sd["param_groups"][0]["lr"] = sd["param_groups"][0].pop("old_lr") * 2
        sd["state"][0][name] = torch.full_like(sd["state"][0][name], 5.0)
        return sd

    def post(o):
        calls.append("post")
        assert torch.all(o.state[params[0]][name] == 5.0)
        o.state[params[1]][name] = torch.full_like(o.state[params[1]][name], 7.0)

    again = make(params)
    again.register_load_state_dict_pre_hook(pre)
    again.register_load_state_dict_post_hook(post)
    again.load_state_dict(saved)
    assert calls == ["pre", "post"]
    assert again.param_groups[0]["lr"] == 2 * opt.param_groups[0]["lr"]
    assert torch.all(again.state[params[0]][name] == 5.0)
    assert torch.all(again.state[params[1]][name] == 7.0)
    expected = copy.deepcopy(saved)  # the same dict, edited by hand, loaded without hooks
    expected["param_groups"][0]["lr"] = expected["param_groups"][0].pop("old_lr") * 2
    expected["state"][0][name].fill_(5.0)
    expected["state"][1][name].fill_(7.0)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    third = make(twins)
    third.load_state_dict(expected)
    for o, ps in ((again, params), (third, twins)):
        _set_grads(ps, _grads(1))
        o.step()
    for p, q in zip(params, twins):
        _assert_bits_equal(p, q)


# torch/testing/_internal/common_optimizers.py optim_error_inputs_func_adamw / _sgd (and the
# generic ones of every optimizer): (optimizer, kwargs, error type, srround's message)
ERROR_INPUTS = [
    ("AdamW", {"lr": 1e-2, "weight_decay": -1}, ValueError, r"^weight_decay: .* got -1"),
    ("AdamW", {"lr": -1}, ValueError, r"^lr: .* got -1"),
    ("AdamW", {"lr": float("nan")}, ValueError, r"^lr: .* got nan"),
    ("AdamW", {"eps": -1}, ValueError, r"^eps: .* got -1"),
    ("AdamW", {"betas": (-1.0, 0.999)}, ValueError, r"^betas\[0\]: .* got -1.0"),
    ("AdamW", {"betas": (0.9, 1.0)}, ValueError, r"^betas\[1\]: expected in \[0, 1\)"),
    ("AdamW", {"betas": (torch.tensor(0.9), 0.99)}, ValueError, r"^betas\[0\]: a tensor"),
    ("AdamW", {"betas": 0.9}, TypeError, r"^betas: expected a pair"),  # before: not iterable
    ("AdamW", {"betas": None}, TypeError, r"^betas: expected a pair"),
    ("AdamW", {"lr": torch.tensor(1e-3), "foreach": True}, ValueError, r"^lr: a tensor"),
    ("AdamW", {"lr": "0.1"}, TypeError, r"^lr: expected a float, got str"),
    ("SGD", {"lr": 1e-2, "momentum": -0.5}, ValueError, r"^momentum: .* got -0.5"),
    ("SGD", {"lr": 1e-2, "weight_decay": -0.5}, ValueError, r"^weight_decay: .* got -0.5"),
    ("SGD", {"lr": -1}, ValueError, r"^lr: .* got -1"),
    (
        "SGD",
        {"lr": 1e-2, "momentum": 0.9, "dampening": 0.5, "nesterov": True},
        ValueError,
        r"^nesterov: needs momentum > 0 and dampening == 0",
    ),
]


@pytest.mark.parametrize("name, kwargs, error, message", ERROR_INPUTS)
def test_suite_error_inputs(name, kwargs, error, message):
    """torch's error inputs: srround raises the error type torch raises (a ValueError for
    a bad value, naming the argument), at construction, before any state exists. Where torch
    accepts the input (a tensor lr or betas) srround refuses it clearly: its hyperparameters
    are host floats (README, deliberate differences)."""
    params = _params(torch.float32)
    ours = {"AdamW": AdamW, "SGD": SGD}[name]
    theirs = getattr(torch.optim, name)
    with pytest.raises(error, match=message):
        ours(params, **kwargs)
    betas = kwargs.get("betas") if isinstance(kwargs.get("betas"), tuple) else ()
    tensor_hyper = any(isinstance(v, torch.Tensor) for v in [*kwargs.values(), *betas])
    if not tensor_hyper and not isinstance(kwargs.get("lr"), str):
        with pytest.raises(error):
            theirs(params, **kwargs)


@pytest.mark.parametrize(
    "name, key, value",
    [
        ("AdamW", "lr", float("inf")),
        ("AdamW", "lr", 1e300),
        ("AdamW", "weight_decay", float("inf")),
        ("AdamW", "eps", float("inf")),
        ("SGD", "lr", float("inf")),
        ("SGD", "momentum", 1e39),
        ("SGD", "dampening", -float("inf")),
    ],
)
def test_hyperparameters_must_be_finite_float32(name, key, value):
    """The README's scalar rule (finite, within float32) holds for the torch optimizers too:
    before, ``lr=inf`` or ``1e300`` was taken and wrote inf/NaN into every weight."""
    params = _params(torch.float32)
    ours = {"AdamW": AdamW, "SGD": SGD}[name]
    with pytest.raises(ValueError, match=rf"^{key}: expected a finite"):
        ours(params, **{key: value})


@pytest.mark.parametrize(
    "make, key, value",
    [
        (lambda ps: AdamW(ps, seed=0), "lr", float("nan")),
        (lambda ps: AdamW(ps, seed=0), "betas", (1.0, 1.0)),
        (lambda ps: AdamW(ps, seed=0), "eps", -1.0),
        (lambda ps: AdamW(ps, seed=0), "lr", torch.tensor(0.5)),
        (lambda ps: SGD(ps, lr=0.1, seed=0), "lr", float("inf")),
    ],
)
def test_hyperparameters_edited_after_a_step_are_checked_before_the_next(make, key, value):
    """A param group edited between steps (by hand, a scheduler) is checked at the next step,
    before anything is written: before, AdamW took a NaN ``lr`` or ``betas=(1, 1)`` and wrote
    NaN into every weight (SGD already checked)."""
    params = _params(torch.float32)
    opt = make(params)
    _set_grads(params, _grads(0))
    opt.step()
    before = [p.detach().clone() for p in params]
    opt.param_groups[0][key] = value
    with pytest.raises(ValueError, match=rf"^{key}(\[\d\])? \(param group 0\)"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(params, before))


def test_suite_generic_error_inputs():
    """The Optimizer base class's error inputs (inherited): a tensor instead of an iterable,
    an empty list, a parameter in two groups; and a parameter twice in one group, which
    torch only warns about and srround refuses (its fused pass would alias the tensor)."""
    p = _params(torch.float32)
    with pytest.raises(TypeError, match="should be an iterable of Tensors or dicts"):
        AdamW(p[0])
    with pytest.raises(ValueError, match="empty parameter list"):
        SGD([])
    with pytest.raises(ValueError, match="some parameters appear in more than one"):
        AdamW([{"params": p[:2]}, {"params": p[1:]}])
    with pytest.warns(UserWarning, match="duplicate parameters"):
        with pytest.raises(ValueError, match=r"params\[2\]: appears twice in param group 0"):
            SGD([p[0], p[1], p[0]], lr=0.1)
    opt = SGD(p[:1], lr=0.1)
    with pytest.warns(UserWarning, match="duplicate parameters"):
        with pytest.raises(ValueError, match=r"params\[1\]: appears twice in param group 1"):
            opt.add_param_group({"params": [p[1], p[1]]})
    assert len(opt.param_groups) == 1  # the bad group was not kept


def test_suite_documented_differences():
    """The deliberate differences from torch.optim listed in the README raise clear errors."""
    ps = _params(torch.float32)
    with pytest.raises(ValueError, match="amsgrad"):
        AdamW(ps, amsgrad=True, rounding="remainder")
    with pytest.raises(ValueError, match="differentiable"):
        SGD(ps, differentiable=True)
    with pytest.raises(ValueError, match="lr"):
        AdamW(ps, lr=torch.tensor(0.01))
    with pytest.raises(TypeError, match="complex64"):
        AdamW([torch.nn.Parameter(torch.zeros(2, dtype=torch.complex64))])


def test_sgd_momentum_buffer_made_late_starts_at_zero():
    """The documented difference: the first momentum step is the parameter's first step, so a
    buffer made later starts at zero ((1 - dampening)·g; torch's is g)."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = SGD([p], lr=1.0, momentum=0.0, dampening=0.5, seed=0)
    p.grad = torch.ones(4)
    opt.step()
    opt.param_groups[0]["momentum"] = 0.9
    opt.step()
    assert torch.equal(opt.state[p]["momentum_buffer"], torch.full((4,), 0.5))


# -- AMSGrad: the per-tensor path -------------------------------------------------------------


@pytest.mark.parametrize("maximize", [False, True])
def test_amsgrad_fp32_is_torch_bits(maximize):
    """Finding: amsgrad unsupported. fp32 parameters: torch.optim.AdamW(amsgrad=True)'s bits
    (same torch ops), and a torch amsgrad state dict loads and continues."""
    ours, theirs = _params(torch.float32), _params(torch.float32)
    kw = {"lr": 1e-2, "weight_decay": 0.1, "amsgrad": True, "maximize": maximize}
    opt, ref = AdamW(ours, seed=1, **kw), torch.optim.AdamW(theirs, **kw)
    _run(opt, ours, 6)
    _run(ref, theirs, 6)
    for p, r in zip(ours, theirs):
        _assert_bits_equal(p, r)
        _assert_bits_equal(opt.state[p]["max_exp_avg_sq"], ref.state[r]["max_exp_avg_sq"])
    resumed = [torch.nn.Parameter(p.detach().clone()) for p in theirs]
    opt2 = AdamW(resumed, amsgrad=True, seed=1)
    opt2.load_state_dict(copy.deepcopy(ref.state_dict()))
    _run(opt2, resumed, 2, start=6)
    _run(ref, theirs, 2, start=6)
    for p, r in zip(resumed, theirs):
        _assert_bits_equal(p, r)


def test_amsgrad_torch_state_dict_of_bf16_params_runs_on_float32_states():
    """Finding: a torch.optim.AdamW(amsgrad=True) state dict of bf16 parameters (its states
    bf16) loaded: the moments became float32, ``max_exp_avg_sq`` stayed bf16, and every step
    rounded the running maximum to bf16. It is float32 too now, as the path's states are."""
    ours, theirs = _params(torch.bfloat16), _params(torch.bfloat16)
    ref = torch.optim.AdamW(theirs, lr=1e-2, amsgrad=True)
    _run(ref, theirs, 2, dtype=torch.bfloat16)
    opt = AdamW(ours, lr=1e-2, amsgrad=True, seed=1)
    opt.load_state_dict(ref.state_dict())
    loaded = [ref.state[r]["max_exp_avg_sq"].float() for r in theirs]
    _run(opt, ours, 1, dtype=torch.bfloat16, start=2)
    for p, before in zip(ours, loaded):
        state = opt.state[p]
        assert {state[k].dtype for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")} == {
            torch.float32
        }
        _assert_bits_equal(state["max_exp_avg_sq"], torch.maximum(before, state["exp_avg_sq"]))


@pytest.mark.parametrize(
    "dtype, rounding, qnan",
    [(torch.float32, "stochastic", 0x7FC00000), (torch.bfloat16, "nearest", 0x7FC0)],
    ids=["fp32", "bf16-nearest"],
)
def test_amsgrad_nan_results_are_the_positive_quiet_nan(dtype, rounding, qnan):
    """NaN gradients of both signs, an inf gradient (inf / inf in the update) and a -NaN
    weight: every NaN the per-tensor path writes - weights, moments, the running maximum - is
    the format's +qNaN (torch's CPU ops keep a NaN operand's sign, -qNaN for inf / inf)."""
    p = torch.nn.Parameter(torch.tensor([1.0, 2.0, 3.0, -1.0, 0.5]).to(dtype))
    p.data.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)[4] = -(
        1 << 6 if dtype == torch.bfloat16 else 1 << 22
    )
    g = torch.tensor([0.0, 1.0, float("inf"), 0.0, 0.1])
    g.view(torch.int32)[0] = -(1 << 22)  # -qNaN 0xFFC00000
    g.view(torch.int32)[3] = 0x7FC00001
    p.grad = g.to(dtype)
    opt = AdamW([p], lr=1e-2, amsgrad=True, rounding=rounding, seed=3)
    opt.step()
    state = opt.state[p]
    for name, t in [
        ("param", p),
        *((k, state[k]) for k in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")),
    ]:
        b = _bits(t).to(torch.int64) & (0xFFFF if t.element_size() == 2 else 0xFFFFFFFF)
        nan = torch.isnan(t.detach().float())
        assert bool(nan[[0, 2, 3, 4] if name == "param" else [0, 3]].all()), name
        want = qnan if name == "param" else 0x7FC00000
        assert b[nan].tolist() == [want] * int(nan.sum()), name


def test_amsgrad_bf16_stochastic_write_back_is_the_documented_stream():
    """bf16 parameters: the fp32 result of torch's math, stochastically rounded at offset
    t * 2**36 + the tensor's start (the fused step's stream). The first parameter has no
    gradient: the starts still count it, as the fused step's do (they used to restart at the
    first parameter with a gradient)."""
    ours = _params(torch.bfloat16)
    shadow = [torch.nn.Parameter(p.detach().float()) for p in ours]
    unused = torch.nn.Parameter(torch.zeros(6, dtype=torch.bfloat16))
    opt = AdamW([unused, *ours], lr=1e-2, amsgrad=True, seed=8)
    ref = torch.optim.AdamW(shadow, lr=1e-2, amsgrad=True)
    grads = _grads(0, dtype=torch.bfloat16)
    _set_grads(ours, grads)
    _set_grads(shadow, grads)
    opt.step()
    ref.step()
    start = unused.numel()
    assert unused not in opt.state
    for p, r in zip(ours, shadow):
        expected = srround.stochastic_round(r.detach(), seed=8, offset=(1 << STEP_SHIFT) + start)
        _assert_bits_equal(p, expected)
        start += p.numel()


# -- Hugging Face accelerate and transformers (run where they are installed; not in CI) --------


def _hf_train(make_optimizer, save=None, load=None):
    """Pure bf16 training with accelerate: two param groups (decay / no decay), a linear
    warmup schedule, gradient accumulation over 2 batches, clipping; ``save_state`` after
    batch 3 of 8, or ``load_state`` and resume from batch 4. Returns the final parameters."""
    accelerate = pytest.importorskip("accelerate")
    transformers = pytest.importorskip("transformers")
    from accelerate.state import AcceleratorState, GradientState

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 1)
    ).to(torch.bfloat16)
    decay = [model[0].weight, model[2].weight]
    rest = [p for p in model.parameters() if all(p is not q for q in decay)]
    opt = make_optimizer([{"params": decay, "weight_decay": 0.1}, {"params": rest}])
    schedule = transformers.get_linear_schedule_with_warmup(opt, 2, 8)
    gen = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(4, 8, generator=gen), torch.randn(4, 1, generator=gen)) for _ in range(8)
    ]
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16", gradient_accumulation_steps=2)
    try:
        model, opt, schedule = acc.prepare(model, opt, schedule)
        if load is not None:
            acc.load_state(load)
        for i, (x, y) in enumerate(batches[4 if load else 0 :], start=4 if load else 0):
            with acc.accumulate(model):
                acc.backward((model(x.to(torch.bfloat16)).float() - y).square().mean())
                if acc.sync_gradients:
                    acc.clip_grad_norm_(model.parameters(), 1.0)
                opt.step()
                schedule.step()
                opt.zero_grad()
            if i == 3 and save is not None:
                acc.save_state(save)
        return [p.detach().clone() for p in acc.unwrap_model(model).parameters()]
    finally:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()


@pytest.mark.parametrize("rounding", ["stochastic", "master"])
def test_accelerate_resume_continues_the_same_bits(rounding, tmp_path):
    """accelerate's ``prepare`` (which reloads the state dict), ``accumulate``,
    ``clip_grad_norm_``, and ``save_state`` / ``load_state`` mid-run: the resumed run ends on
    the bits of the uninterrupted one."""

    def make(groups):
        return AdamW(groups, lr=1e-2, seed=3, rounding=rounding, state_dtype=torch.bfloat16)

    full = _hf_train(make, save=str(tmp_path))
    resumed = _hf_train(make, load=str(tmp_path))
    torch.manual_seed(0)
    assert not torch.equal(_bits(full[0]), _bits(torch.nn.Linear(8, 16).weight.bfloat16()))
    for a, b in zip(full, resumed):
        _assert_bits_equal(a, b)


def test_trainer_resume_continues_the_same_bits(tmp_path):
    """transformers' Trainer on a tiny GPT-2 in bf16 (tied embeddings, its decay / no-decay
    groups), srround's AdamW through ``optimizer_cls_and_kwargs``, accumulation and clipping:
    ``train(resume_from_checkpoint=...)`` ends on the bits of the uninterrupted run."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")

    class Tokens(torch.utils.data.Dataset):
        ids = torch.randint(0, 100, (16, 8), generator=torch.Generator().manual_seed(0))

        def __len__(self):
            return len(self.ids)

        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    def train(out, resume=None):
        torch.manual_seed(0)
        config = transformers.GPT2Config(
            n_layer=1, n_embd=16, n_head=2, vocab_size=100, n_positions=8
        )
        model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
        args = transformers.TrainingArguments(
            output_dir=str(out),
            use_cpu=True,
            max_steps=4,
            save_steps=2,
            gradient_accumulation_steps=2,
            per_device_train_batch_size=2,
            max_grad_norm=1.0,
            weight_decay=0.1,
            warmup_steps=1,
            report_to=[],
            seed=0,
        )
        trainer = transformers.Trainer(
            model=model,
            args=args,
            train_dataset=Tokens(),
            optimizer_cls_and_kwargs=(AdamW, {"lr": 1e-3, "seed": 3}),
        )
        trainer.train(resume_from_checkpoint=resume)
        groups = trainer.optimizer.param_groups
        assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
        return [p.detach().clone() for p in model.parameters()]

    full = train(tmp_path / "full")
    resumed = train(tmp_path / "resumed", resume=str(tmp_path / "full" / "checkpoint-2"))
    for a, b in zip(full, resumed):
        _assert_bits_equal(a, b)


@pytest.mark.parametrize("make", [AdamW, SGD])
def test_seed_none_follows_torch_manual_seed(monkeypatch, make):
    """Finding: ``seed=None`` drew from srround's own generator, which ``torch.manual_seed``
    (``transformers.set_seed``, Lightning's ``seed_everything``) does not seed: two identical
    runs rounded differently. It now draws from torch's default generator, as torchao's
    stochastic rounding does; ``srround.manual_seed`` still takes precedence."""
    from srround import _rng

    monkeypatch.setattr(_rng, "_manually_seeded", False)

    param = torch.nn.Parameter(torch.zeros(4))

    def seed(torch_seed):
        torch.manual_seed(torch_seed)
        return make([param], lr=1e-3).param_groups[0]["seed"]

    assert seed(3) == seed(3) != seed(4)
    outside = seed(3)
    with torch.device("meta"):  # a default device set for model init: torch's CPU generator
        assert seed(3) == outside  # before: the draw on the meta device failed
    monkeypatch.setattr(_rng, "_generator", np.random.default_rng(5))
    monkeypatch.setattr(_rng, "_manually_seeded", True)
    first = seed(3)
    monkeypatch.setattr(_rng, "_generator", np.random.default_rng(5))
    assert seed(4) == first  # the library generator's draw, whatever torch's seed


def test_master_copy_is_the_weight_of_record():
    """The README's rule: with ``rounding="master"`` a weight edited in place after the first
    step is overwritten from the fp32 copy at the next step (before it: kept); with
    ``"kahan"`` / ``"remainder"`` the edit holds."""
    for mode, kept in (("master", False), ("kahan", True), ("remainder", True)):
        p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
        opt = AdamW([p], lr=1e-3, rounding=mode, seed=1)
        with torch.no_grad():
            p.fill_(5.0)  # before the first step: taken
        p.grad = torch.ones(4, dtype=torch.bfloat16)
        opt.step()
        assert (p == 5.0).all()
        with torch.no_grad():
            p.fill_(9.0)
        opt.step()
        assert bool((p == 9.0).all()) is kept, mode


def _sharing(case):
    base = torch.zeros(4, 6)
    return {
        "dense_and_strided": [base[0], base[:, ::2]],  # share base[0, ::2]
        "two_strided": [base[:, ::2], base[:, ::3]],  # share column 0
        "expanded": [torch.ones(1, 3).expand(4, 3)],  # 4 rows over 3 elements
    }[case]


@pytest.mark.parametrize(
    "case, error",
    [
        ("dense_and_strided", r"params\[1\]: shares memory with params\[0\]"),
        ("two_strided", r"params\[1\]: shares memory with params\[0\]"),
        ("expanded", r"params\[0\]: several of its elements share memory"),
    ],
    ids=["dense_and_strided", "two_strided", "expanded"],
)
def test_non_dense_parameters_sharing_memory_are_refused_before_any_write(case, error):
    """Non-dense parameters run through a contiguous copy, and the memory check saw only the
    copy: a row and a strided view of one matrix stepped silently with one update lost (torch
    adds both), and an expanded parameter raised from ``copy_`` after the step had counted
    and written its moments. Both are now refused before anything is written."""
    params = [torch.nn.Parameter(t) for t in _sharing(case)]
    opt = AdamW(params, lr=0.1, seed=0)
    for p in params:
        p.grad = torch.ones(p.shape)
    before = [p.detach().clone() for p in params]
    with pytest.raises(ValueError, match=error):
        opt.step()
    assert all(torch.equal(p.detach(), b) for p, b in zip(params, before))
    assert all(int(s.get("step", 0)) == 0 for s in opt.state.values())


def test_strided_parameters_that_do_not_share_memory_step_as_torch():
    """Interleaved columns of one matrix share no element: they step as torch's SGD steps
    them."""
    results = []
    for make in (lambda ps: SGD(ps, lr=1.0, seed=0), lambda ps: torch.optim.SGD(ps, lr=1.0)):
        base = torch.zeros(4, 6)
        params = [torch.nn.Parameter(base[:, ::2]), torch.nn.Parameter(base[:, 1::2])]
        opt = make(params)
        params[0].grad, params[1].grad = torch.ones(4, 3), 2 * torch.ones(4, 3)
        opt.step()
        results.append(base.clone())
    assert torch.equal(*results)


def test_load_state_dict_refuses_a_rounding_its_params_cannot_take():
    """A saved rounding='remainder' for fp16 parameters is refused by load_state_dict, before
    anything is loaded, as the constructor refuses it (before: loaded, state and defaults
    replaced, and the first step raised)."""
    source_param = torch.nn.Parameter(torch.randn(8).bfloat16())
    source = AdamW([source_param], rounding="remainder", seed=0)
    source_param.grad = torch.ones_like(source_param)
    source.step()
    p16 = torch.nn.Parameter(torch.randn(8).half())
    opt = AdamW([p16], rounding="stochastic", seed=0)
    with pytest.raises(
        ValueError, match=r"^params\[0\] \(saved param group 0\): rounding='remainder'"
    ):
        opt.load_state_dict(source.state_dict())
    assert opt.defaults["rounding"] == "stochastic" and not opt.state
    p16.grad = torch.ones_like(p16)
    opt.step()  # still the optimizer it was


@pytest.mark.parametrize("kind", [AdamW, SGD])
def test_step_refuses_inference_tensor_params_outside_inference_mode(kind):
    """As torch.optim (whose in-place updates raise): a parameter made under
    torch.inference_mode() is not updated outside it (before: updated silently), and is
    inside it."""
    with torch.inference_mode():
        p = torch.ones(8, dtype=torch.bfloat16)
        p.grad = torch.full((8,), 0.5, dtype=torch.bfloat16)
    opt = kind([p], lr=0.1, seed=0)
    with pytest.raises(RuntimeError, match=r"^params\[0\]: an inference tensor"):
        opt.step()
    assert (p == 1).all()
    with torch.inference_mode():
        opt.step()
    assert (p < 1).all()


def test_add_param_group_rounding_error_names_the_group():
    """A parameter the optimizer's rounding cannot write, added in a later group: the error
    names it and its group, as the dtype errors do (before: ``params[0]`` alone)."""
    opt = AdamW([torch.nn.Parameter(torch.zeros(4, dtype=torch.bfloat16))], rounding="remainder")
    p16 = torch.nn.Parameter(torch.zeros(4, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^params\[0\] \(param group 1\): rounding='remainder'"):
        opt.add_param_group({"params": [p16]})
    assert len(opt.param_groups) == 1
