"""srround.adapters.torch.GradScaler against torch.amp.GradScaler, and fp16 training."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from srround.adapters.torch import GradScaler  # noqa: E402


def _model(dtype=torch.float32, seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1)).to(
        dtype
    )


def test_same_trajectory_as_torch_gradscaler():
    """Same scale, growth tracker, skipped steps and parameters as torch's scaler for the same
    sequence of overflow events (an inf injected into one gradient)."""
    ours_model, theirs_model = _model(), _model()
    ours_opt = torch.optim.SGD(ours_model.parameters(), lr=0.01)
    theirs_opt = torch.optim.SGD(theirs_model.parameters(), lr=0.01)
    ours = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    theirs = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    events = np.random.default_rng(0).random(30) < 0.25
    for step, overflow in enumerate(events):
        for model, opt, scaler in ((ours_model, ours_opt, ours), (theirs_model, theirs_opt, theirs)):
            opt.zero_grad()
            scaler.scale(torch.nn.functional.mse_loss(model(x), y)).backward()
            if overflow:
                model[0].weight.grad[3, 2] = float("inf") if step % 2 else float("nan")
            scaler.step(opt)
            scaler.update()
        assert ours.get_scale() == theirs.get_scale(), step
        assert ours.state_dict()["_growth_tracker"] == theirs.state_dict()["_growth_tracker"]
        for a, b in zip(ours_model.parameters(), theirs_model.parameters()):
            assert torch.equal(a, b)
    assert int(ours.skipped_steps.item()) == int(events.sum())
    assert float(ours.last_step_skipped.item()) == float(events[-1])


def test_state_dict_round_trip_and_torch_compatibility():
    ours = GradScaler("cpu", init_scale=512.0, growth_interval=5, hysteresis=2, min_scale=1.0)
    theirs = torch.amp.GradScaler("cpu", init_scale=64.0)
    ours.load_state_dict(theirs.state_dict())  # loads torch's state dict
    assert ours.get_scale() == 64.0
    again = GradScaler("cpu")
    again.load_state_dict(ours.state_dict())
    assert again.state_dict() == ours.state_dict()


def test_skipped_step_leaves_parameters_bit_identical():
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu")
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.randn(4, 8)).sum()).backward()
    model[2].bias.grad.fill_(float("nan"))
    assert scaler.step(opt) is None
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert opt.state == {} or all(len(s) == 0 for s in opt.state.values())
    scaler.update()
    assert scaler.get_scale() == 2.0**15


def test_bf16_gradients_are_accepted():
    model = _model(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    scaler = GradScaler("cpu", init_scale=256.0)
    scaler.scale(model(torch.randn(4, 8, dtype=torch.bfloat16)).float().sum()).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    scaler.unscale_(opt)
    for before, p in zip(grads, model.parameters()):
        assert torch.equal(p.grad, (before.float() / 256.0).bfloat16())
    with pytest.raises(RuntimeError, match="already been called"):
        scaler.unscale_(opt)


class _HalfSGD(torch.optim.Optimizer):
    """SGD on fp16 parameters with the update formed in fp32 (lr too large for fp16)."""

    def __init__(self, params, lr):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.copy_((p.float() - group["lr"] * p.grad.float()).half())


def test_fp16_training_needs_the_scaler():
    """fp16 weights, a loss small enough that its gradients underflow to zero in fp16: plain
    training does not move, the dynamic scaler trains."""
    torch.manual_seed(1)
    x = torch.randn(256, 8)
    y = x @ torch.randn(8, 1)
    losses, zero_grads = {}, {}
    for name in ("plain", "scaled"):
        torch.manual_seed(2)
        model = torch.nn.Linear(8, 1).half()
        opt = _HalfSGD(model.parameters(), lr=3e7)
        scaler = GradScaler("cpu", init_scale=2.0**24, growth_interval=10)
        curve = []
        for _ in range(40):
            opt.zero_grad()
            loss = 1e-8 * torch.nn.functional.mse_loss(model(x.half()).float(), y)
            curve.append(loss.item())
            if name == "plain":
                loss.backward()
                zero_grads[name] = bool((model.weight.grad == 0).all())
                opt.step()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
        losses[name] = curve
    assert zero_grads["plain"]  # every fp16 gradient underflowed to zero
    assert losses["plain"][-1] == losses["plain"][0]  # so nothing moved
    assert losses["scaled"][-1] < 0.5 * losses["scaled"][0]  # 7.7e-8 -> 3.0e-8
