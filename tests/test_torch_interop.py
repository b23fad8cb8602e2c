"""Migrating from torchao's and optimi's low-precision optimizers: their state dicts loaded
into srround's ``AdamW`` (values preserved, or a clear error), and their parameters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from srround.adapters.torch import SGD, AdamW  # noqa: E402


def _torch_run(steps=3):
    """A torch.optim.AdamW run of bf16-representable fp32 weights (its state dict: fp32)."""
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter(torch.randn(8, 256, generator=gen).bfloat16().float())
    opt = torch.optim.AdamW([p], lr=1e-3, weight_decay=0.01)
    for _ in range(steps):
        p.grad = torch.randn(8, 256, generator=gen)
        opt.step()
    return p, opt


def _subclass_states(state_dict, quantize):
    """``state_dict`` as torchao saves it: ``lr`` a 0-d tensor, moments quantized."""
    state = {
        i: {k: quantize(v) if k != "step" else v for k, v in s.items()}
        for i, s in state_dict["state"].items()
    }
    groups = [dict(g, lr=torch.tensor(g["lr"])) for g in state_dict["param_groups"]]
    return {"state": state, "param_groups": groups}


@pytest.mark.parametrize("bits", ["8bit", "4bit", "fp8"])
def test_loads_torchao_quantized_adamw_states_by_their_values(bits):
    """Finding: a state dict of torchao's ``AdamW8bit`` / ``AdamW4bit`` / ``AdamWFp8`` (moments
    ``OptimState8bit`` etc., ``lr`` a 0-d tensor) failed in ``load_state_dict`` ("lr: a tensor
    is not supported"), and with a float ``lr`` the first step raised torchao's dispatch error
    (``aten.as_strided``) with fp32 states, or cast the subclasses with bf16 states. Now the
    moments load as their dequantized float32 values, ``lr`` as its float, and the run goes
    on as from the unquantized moments (within the formats' error)."""
    subclass = pytest.importorskip(f"torchao.optim.subclass_{bits}")
    cls = {"8bit": "OptimState8bit", "4bit": "OptimState4bit", "fp8": "OptimStateFp8"}[bits]
    cls = getattr(subclass, cls)

    def quantize(v):
        kw = {} if bits == "fp8" else {"signed": bool((v < 0).any())}
        q = cls.zeros(v.shape, block_size=256, **kw)
        q.copy_(v)
        return q

    p, torch_opt = _torch_run()
    saved = _subclass_states(torch_opt.state_dict(), quantize)
    ours, ref = (torch.nn.Parameter(p.detach().bfloat16()) for _ in range(2))
    opt, ref_opt = (AdamW([q], lr=1.0, seed=0, rounding="nearest") for q in (ours, ref))
    opt.load_state_dict(saved)
    ref_opt.load_state_dict(torch_opt.state_dict())
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3) and opt.defaults["lr"] == 1.0
    for name in ("exp_avg", "exp_avg_sq"):
        loaded = opt.state[ours][name]
        assert type(loaded) is torch.Tensor and loaded.dtype == torch.float32
        assert torch.equal(loaded, saved["state"][0][name].dequantize(torch.float32))
    assert int(opt.state[ours]["step"]) == 3
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        g = torch.randn(8, 256, generator=gen).bfloat16()
        ours.grad, ref.grad = g.clone(), g.clone()
        opt.step()
        ref_opt.step()
    assert int(opt.state[ours]["step"]) == 6
    moved = (ref.float() - p).abs().mean()
    assert (ours.float() - ref.float()).abs().mean() < 0.1 * moved


def test_a_state_subclass_that_cannot_dequantize_fails_at_load():
    """A state without storage of its own and no ``dequantize()`` (torch's TwoTensor) is a
    ValueError naming it, before anything is loaded (before: read at the step)."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    p, torch_opt = _torch_run()
    saved = _subclass_states(torch_opt.state_dict(), lambda v: two_tensor.TwoTensor(v, v.clone()))
    opt = AdamW([torch.nn.Parameter(p.detach().bfloat16())], seed=0)
    with pytest.raises(ValueError, match=r"state\[0\]\['exp_avg'\] is a TwoTensor"):
        opt.load_state_dict(saved)
    assert len(opt.state) == 0


def _srround_kahan_run(steps, p=None, opt=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        p.grad = torch.randn(p.shape, generator=gen).bfloat16()
        opt.step()


def test_a_weight_mode_buffer_the_rounding_does_not_use_fails_at_load():
    """Finding: a torch-style state dict carrying ``kahan_comp`` (optimi's Kahan buffer, or
    srround's without its ``rounding`` key) loaded into ``AdamW(rounding="stochastic")`` kept
    the buffer unused: the weights' compensated part was dropped silently. Now a ValueError
    naming the buffer and the rounding that uses it, before anything is loaded; with
    ``rounding="kahan"`` the buffer is used: the run goes on with the uninterrupted run's bits."""
    gen = torch.Generator().manual_seed(0)
    w0 = torch.randn(4, 64, generator=gen).bfloat16()
    p = torch.nn.Parameter(w0.clone())
    opt = AdamW([p], lr=1e-3, rounding="kahan", seed=3)
    _srround_kahan_run(3, p, opt)
    saved = opt.state_dict()
    for group in saved["param_groups"]:  # torch's keys only, as a converted optimi dict
        for key in ("rounding", "state_dtype", "seed"):
            del group[key]
    resumed = torch.nn.Parameter(p.detach().clone())
    wrong = AdamW([resumed], lr=1e-3, rounding="stochastic", seed=3)
    with pytest.raises(ValueError, match=r"state\[0\] has 'kahan_comp'.*rounding='kahan'"):
        wrong.load_state_dict(saved)
    assert len(wrong.state) == 0
    right = AdamW([resumed], lr=1e-3, rounding="kahan", seed=3)
    right.load_state_dict(saved)
    _srround_kahan_run(3, p, opt, seed=2)
    _srround_kahan_run(3, resumed, right, seed=2)
    assert torch.equal(resumed, p)
    assert torch.equal(right.state[resumed]["kahan_comp"], opt.state[p]["kahan_comp"])


@pytest.mark.parametrize("kind", ["adamw", "sgd"])
def test_an_optimi_state_dict_is_refused_naming_the_conversion(kind):
    """optimi's AdamW keeps bias-corrected moments (``beta1``/``beta2``, one step count per
    group), its SGD the momentum in ``exp_avg`` (no ``nesterov``): loading them as torch's
    would be wrong, so the error says what differs (before: only the missing key)."""
    p = torch.nn.Parameter(torch.zeros(4))
    group = {"params": [0], "lr": 1e-3, "weight_decay": 0.0, "decouple_lr": False}
    if kind == "adamw":
        opt, missing = AdamW([p], seed=0), "betas"
        group |= {"beta1": 0.9, "beta2": 0.99, "eps": 1e-8, "step": 3}
    else:
        opt, missing = SGD([p], lr=0.1, seed=0), "nesterov"
        group |= {"momentum": 0.9, "dampening": False}
    saved = {"state": {}, "param_groups": [group]}
    with pytest.raises(ValueError, match=rf"no {missing}.*optimi's states differ"):
        opt.load_state_dict(saved)


def _from_optimi(saved):
    """An optimi ``AdamW`` state dict converted as the README says."""
    groups, states = [], {}
    for g in saved["param_groups"]:
        b1, b2, t = g["beta1"], g["beta2"], g["step"]
        wd = g["weight_decay"] / g["max_lr"] if g["decouple_lr"] else g["weight_decay"]
        groups.append(
            {"params": g["params"], "lr": g["lr"], "betas": (b1, b2), "eps": g["eps"]}
            | {"weight_decay": wd}
        )
        for i in g["params"]:
            s = saved["state"][i]
            states[i] = {
                "step": torch.tensor(float(t)),
                "exp_avg": s["exp_avg"].float() * (1 - b1**t),
                "exp_avg_sq": s["exp_avg_sq"].float() * (1 - b2**t),
            }
            if s.get("kahan_comp") is not None:
                states[i]["kahan_comp"] = s["kahan_comp"]
    return {"state": states, "param_groups": groups}


@pytest.mark.parametrize("decouple_lr", [False, True])
def test_resumes_an_optimi_kahan_run_converted_as_the_readme_says(decouple_lr):
    """optimi ``AdamW(kahan_sum=True)`` on bf16 weights, 3 steps, converted and loaded into
    ``AdamW(rounding="kahan")``, then 3 more steps of each: the weights stay within a few
    hundredths of the distance moved (srround's Kahan step is optimi's method, not its
    bits: README, "Fused optimizers")."""
    optimi = pytest.importorskip("optimi")
    gen = torch.Generator().manual_seed(0)
    p = torch.nn.Parameter((torch.randn(4096, generator=gen) * 0.02).bfloat16())
    w0 = p.detach().float()
    kw = {"lr": 1e-3, "weight_decay": 1e-4, "max_lr": 1e-3} if decouple_lr else {"lr": 1e-3}
    theirs = optimi.AdamW([p], kahan_sum=True, decouple_lr=decouple_lr, foreach=False, **kw)
    grads = [torch.randn(4096, generator=gen).bfloat16() for _ in range(6)]
    for g in grads[:3]:
        p.grad = g.clone()
        theirs.step()
    saved = theirs.state_dict()
    with pytest.raises(ValueError, match="optimi"):
        AdamW([p], seed=0).load_state_dict(saved)
    ours = torch.nn.Parameter(p.detach().clone())
    opt = AdamW([ours], lr=1.0, rounding="kahan", seed=0)
    opt.load_state_dict(_from_optimi(saved))
    for g in grads[3:]:
        p.grad, ours.grad = g.clone(), g.clone()
        theirs.step()
        opt.step()
    moved = (p.detach().float() - w0).abs().mean()
    assert (ours.float() - p.float()).abs().mean() < 0.05 * moved
