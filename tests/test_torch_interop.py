"""Migrating from torchao's and optimi's low-precision optimizers: their state dicts loaded
into srround's ``AdamW`` (values preserved, or a clear error), and their parameters."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from srround.adapters.torch import AdamW  # noqa: E402


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
