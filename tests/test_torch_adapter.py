"""The torch adapter: same bits as the NumPy path, zero-copy in and out, native torch dtypes,
autograd-safe in-place updates, and clear errors naming the argument."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

torch = pytest.importorskip("torch")

from .reference import bits, run_python  # noqa: E402

FMT_NAMES = ["bfloat16", "float16"]
TORCH_DTYPE = {"bfloat16": torch.bfloat16, "float16": torch.float16}

SPECIAL = np.array(
    [
        0x7FFFFFFF,  # NaN with a full payload
        0xFFC00001,  # negative NaN
        0x7F800001,  # signalling NaN
        0x7F800000,  # +inf
        0xFF800000,  # -inf
        0x80000000,  # -0.0
        0x00000000,  # +0.0
        0x00000001,  # smallest fp32 subnormal
        0x80000001,
        0x3F800000,  # 1.0
        0x3F808000,  # bf16 tie
        0x3F818000,
        0x7F7FFFFF,  # fp32 max: overflows both formats
        0x477FF000,  # fp16 tie at max -> inf
        0x33800000,  # fp16 smallest subnormal
        0x33000000,  # half of it: a tie to zero
    ],
    dtype=np.uint32,
)


def np_f32(n=1000, seed=0, special=True):
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(n) * np.exp2(rng.integers(-30, 30, n))).astype(np.float32)
    if special:
        x[: SPECIAL.size] = SPECIAL.view(np.float32)
    return x


def tbits(t):
    """The bit patterns of a CPU tensor as a NumPy unsigned array (no value conversion)."""
    t = t.detach().cpu().contiguous()
    if t.element_size() == 2:
        return t.view(torch.int16).numpy().view(np.uint16)
    return t.view(torch.int32).numpy().view(np.uint32)


def as_torch(a):
    """A torch tensor with the bits of NumPy array ``a`` (bf16 via its uint16 bits)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16).copy()).view(torch.bfloat16)
    return torch.from_numpy(a.copy())


# -- same bits as the NumPy path ----------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMT_NAMES)
@pytest.mark.parametrize("offset", [0, 5])
def test_stochastic_round_same_bits_as_numpy(fmt, offset):
    x = np_f32().reshape(10, 100)
    expected = srround.stochastic_round(x, dtype=fmt, seed=42, offset=offset)
    got = srround.stochastic_round(torch.from_numpy(x), dtype=fmt, seed=42, offset=offset)
    assert isinstance(got, torch.Tensor) and got.dtype == TORCH_DTYPE[fmt]
    assert got.shape == (10, 100) and got.device.type == "cpu"
    assert np.array_equal(tbits(got).reshape(x.shape), bits(expected))


@pytest.mark.parametrize("fmt", FMT_NAMES)
@pytest.mark.parametrize("overflow", ["inf", "saturate"])
def test_round_nearest_same_bits_as_numpy(fmt, overflow):
    x = np_f32()
    expected = srround.round_nearest(x, dtype=fmt, overflow=overflow)
    got = srround.round_nearest(torch.from_numpy(x), dtype=fmt, overflow=overflow)
    assert got.dtype == TORCH_DTYPE[fmt]
    assert np.array_equal(tbits(got), bits(expected))


@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_round_nearest_matches_torch_cast(fmt):
    x = torch.from_numpy(np_f32(1 << 14))
    got = srround.round_nearest(x, dtype=fmt)
    cast = x.to(TORCH_DTYPE[fmt])
    nan = torch.isnan(x).numpy()
    assert np.array_equal(tbits(got)[~nan], tbits(cast)[~nan])
    # NaN: ours is the canonical quiet NaN with the sign kept. torch's own CPU cast is not one
    # pattern: its vectorised bf16 path writes 0xFFFF for every NaN, its scalar path 0x7FC0, and
    # its fp16 cast keeps payload bits - so only NaN-ness is compared.
    assert torch.isnan(got[torch.from_numpy(nan)]).all() and torch.isnan(cast[nan]).all()
    quiet = 0x7FC0 if fmt == "bfloat16" else 0x7E00
    sign = (x.view(torch.int32).numpy().view(np.uint32)[nan] >> 31).astype(np.uint16) << 15
    assert np.array_equal(tbits(got)[nan], sign | quiet)


@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_to_float32_same_bits_as_numpy_and_torch(fmt):
    h = srround.round_nearest(np_f32(), dtype=fmt)
    h[:4] = np.array([0x7F81, 0xFFC1, 0x7C01, 0xFE01], np.uint16).view(h.dtype)  # NaN payloads
    expected = srround.to_float32(h)
    got = srround.to_float32(as_torch(h))
    assert got.dtype == torch.float32
    assert np.array_equal(tbits(got), bits(expected))
    # exact widening: equal to torch's own cast (NaN payloads included for bf16)
    cast = as_torch(h).float()
    if fmt == "bfloat16":
        assert np.array_equal(tbits(got), tbits(cast))
    else:
        nan = np.isnan(expected)
        assert np.array_equal(tbits(got)[~nan], tbits(cast)[~nan])


@pytest.mark.parametrize("fmt", FMT_NAMES)
@pytest.mark.parametrize("offset", [0, 3])
def test_stochastic_add_same_bits_as_numpy(fmt, offset):
    w0 = srround.round_nearest(np_f32(seed=1), dtype=fmt)
    u = np_f32(seed=2)
    w_np = w0.copy()
    srround.stochastic_add(w_np, u, alpha=-0.5, seed=7, offset=offset)
    w_t = as_torch(w0)
    result = srround.stochastic_add(w_t, torch.from_numpy(u), alpha=-0.5, seed=7, offset=offset)
    assert result is w_t
    assert np.array_equal(tbits(w_t), bits(w_np))


@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_special_values(fmt):
    x = SPECIAL.view(np.float32)
    got = srround.stochastic_round(torch.from_numpy(x), dtype=fmt, seed=3)
    assert np.array_equal(tbits(got), bits(srround.stochastic_round(x, dtype=fmt, seed=3)))
    b = tbits(got)
    quiet = 0x7FC0 if fmt == "bfloat16" else 0x7E00
    inf = 0x7F80 if fmt == "bfloat16" else 0x7C00
    assert list(b[:7]) == [quiet, 0x8000 | quiet, quiet, inf, 0x8000 | inf, 0x8000, 0]
    back = srround.to_float32(got)
    assert torch.isinf(back[3:5]).all() and torch.signbit(back[5]) and back[6] == 0


def test_raw_uint16_with_dtype():
    h = srround.round_nearest(np_f32(), dtype="bfloat16")
    raw = torch.from_numpy(h.view(np.uint16).copy()).view(torch.uint16)
    got = srround.to_float32(raw, dtype="bfloat16")
    assert np.array_equal(tbits(got), bits(srround.to_float32(h)))
    with pytest.raises(TypeError, match=r"y: expected a narrow float tensor.*dtype= given"):
        srround.to_float32(raw)
    w = raw.clone()
    assert srround.stochastic_add(w, torch.ones(h.shape), dtype="bf16", seed=0) is w
    assert w.dtype == torch.uint16


def test_zero_dim_and_empty_tensors():
    s = srround.stochastic_round(torch.tensor(1.5), seed=0)
    assert s.shape == () and s.dtype == torch.bfloat16 and s.item() == 1.5
    e = srround.stochastic_round(torch.empty(0, 3), seed=0)
    assert e.shape == (0, 3) and e.dtype == torch.bfloat16


# -- zero-copy -----------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_out_is_written_in_place_and_returned(fmt):
    x = torch.from_numpy(np_f32(special=False))
    out = torch.zeros(x.shape, dtype=TORCH_DTYPE[fmt])
    ptr = out.data_ptr()
    result = srround.round_nearest(x, dtype=fmt, out=out)
    assert result is out and out.data_ptr() == ptr
    assert torch.equal(out, x.to(TORCH_DTYPE[fmt]))
    f = torch.empty(x.shape)
    assert srround.to_float32(out, out=f) is f and torch.equal(f, out.float())


def test_stochastic_add_mutates_storage():
    w = torch.zeros(64, dtype=torch.bfloat16)
    ptr = w.data_ptr()
    assert srround.stochastic_add(w, torch.full((64,), 1.0), seed=0) is w
    assert w.data_ptr() == ptr and torch.all(w == 1)


def test_contiguous_view_with_storage_offset():
    big = torch.zeros(4, 8, dtype=torch.bfloat16)
    row = big[2]  # contiguous, storage offset 16
    srround.stochastic_add(row, torch.ones(8), seed=0)
    assert torch.all(big[2] == 1) and big.sum() == 8
    out = torch.zeros(3, 8, dtype=torch.float16)
    srround.round_nearest(torch.full((8,), 2.0), dtype="fp16", out=out[1])
    assert torch.all(out[1] == 2) and out.sum() == 16


def test_input_is_not_copied():
    x = torch.from_numpy(np_f32(special=False))
    from srround.adapters.torch import _views as adapter

    view, _ = adapter.source(x, "x")
    assert view.bits.ctypes.data == x.data_ptr() and view.result is x
    assert view.bits.dtype == np.uint32


def test_cpu_bit_views_share_memory():
    """fp32, bf16, raw uint16, int32 and requires-grad tensors: NumPy bit views of the same
    memory (the bits the NumPy path sees)."""
    from srround.adapters.torch import _views as adapter

    x = np_f32().reshape(4, 250)
    got = srround.stochastic_round(torch.from_numpy(x), seed=1)
    assert np.array_equal(tbits(got).reshape(x.shape), bits(srround.stochastic_round(x, seed=1)))
    cases = [
        (got, True, np.uint16),
        (got.view(torch.uint16), True, np.uint16),
        (torch.zeros(3, dtype=torch.int32), False, np.uint32),
        (torch.nn.Parameter(torch.ones(5)), False, np.uint32),
        (torch.nn.Parameter(torch.ones(5, dtype=torch.float16)), True, np.uint16),
    ]
    for t, narrow, dtype in cases:
        view = adapter._view(t, narrow, "t")
        assert view.bits.dtype == dtype and view.bits.ctypes.data == t.data_ptr()
        assert view.bits.size == t.numel() and view.result is t


# -- autograd --------------------------------------------------------------------------------


def test_requires_grad_parameter_updated_in_place():
    p = torch.nn.Parameter(torch.ones(16, dtype=torch.bfloat16))
    version = p._version
    ptr = p.data_ptr()
    assert srround.stochastic_add(p, torch.full((16,), 1.0), seed=0) is p
    assert p.data_ptr() == ptr and torch.all(p == 2)
    assert p.requires_grad and p.is_leaf and p.grad_fn is None and p.grad is None
    assert p._version > version  # as an in-place update under torch.no_grad() does


def test_in_place_update_is_seen_by_autograd_like_no_grad_update():
    p = torch.nn.Parameter(torch.ones(4, dtype=torch.bfloat16))
    loss = (p * p).sum()  # saves p for backward
    srround.stochastic_add(p, torch.ones(4), seed=0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_out_of_place_on_requires_grad_input():
    x = torch.randn(32, requires_grad=True)
    y = srround.stochastic_round(x, seed=0)
    assert not y.requires_grad and y.grad_fn is None
    assert np.array_equal(tbits(y), tbits(srround.stochastic_round(x.detach(), seed=0)))
    z = srround.to_float32(torch.ones(4, dtype=torch.bfloat16, requires_grad=True))
    assert not z.requires_grad and torch.all(z == 1)


# -- errors naming the argument ----------------------------------------------------------------


def test_non_contiguous_errors():
    x = torch.ones(8, 8)
    with pytest.raises(ValueError, match=r"x: must be contiguous.*x\.contiguous\(\)"):
        srround.stochastic_round(x.t(), seed=0)
    with pytest.raises(ValueError, match=r"out: must be contiguous"):
        srround.stochastic_round(x, seed=0, out=torch.empty(8, 8, dtype=torch.bfloat16).t())
    w = torch.zeros(8, 16, dtype=torch.bfloat16)[:, ::2]
    with pytest.raises(ValueError, match=r"w: must be contiguous"):
        srround.stochastic_add(w, torch.ones(8, 8), seed=0)
    with pytest.raises(ValueError, match=r"u: must be contiguous"):
        srround.stochastic_add(torch.zeros(8, 8, dtype=torch.bfloat16), x.t(), seed=0)


def test_wrong_dtype_errors():
    with pytest.raises(TypeError, match=r"x: expected a torch.float32 tensor, got torch.int32"):
        srround.stochastic_round(torch.ones(4, dtype=torch.int32), seed=0)
    f64 = r"x: expected a torch.float32 tensor, got torch.float64.*round twice.*\.float\(\)"
    with pytest.raises(TypeError, match=f64):
        srround.stochastic_round(torch.ones(4, dtype=torch.float64), seed=0)
    with pytest.raises(TypeError, match=r"x: expected a torch.float32 tensor, got torch.bfloat16"):
        srround.round_nearest(torch.ones(4, dtype=torch.bfloat16))
    with pytest.raises(TypeError, match=r"out: dtype torch.float16 does not match dtype='bf"):
        srround.stochastic_round(torch.ones(4), seed=0, out=torch.empty(4, dtype=torch.float16))
    with pytest.raises(TypeError, match=r"w: expected a narrow float tensor.*got torch.float32"):
        srround.stochastic_add(torch.ones(4), torch.ones(4), seed=0)
    with pytest.raises(TypeError, match=r"u: expected a torch.float32 tensor, got torch.bfloat16"):
        srround.stochastic_add(torch.ones(4, dtype=torch.bfloat16), torch.ones(4).bfloat16())
    with pytest.raises(TypeError, match=r"out: expected a torch.float32 tensor, got torch.float64"):
        srround.to_float32(torch.ones(4).bfloat16(), out=torch.ones(4, dtype=torch.float64))


def test_shape_errors():
    with pytest.raises(ValueError, match=r"out: shape \(5,\) does not match"):
        srround.stochastic_round(torch.ones(4), seed=0, out=torch.empty(5, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"u: shape \(5,\) does not match w's shape \(4,\)"):
        srround.stochastic_add(torch.ones(4, dtype=torch.bfloat16), torch.ones(5), seed=0)


def test_mixed_frameworks_rejected():
    with pytest.raises(TypeError, match=r"u: is a numpy array but w is a torch array"):
        srround.stochastic_add(torch.ones(4, dtype=torch.bfloat16), np.ones(4, np.float32))
    with pytest.raises(TypeError, match=r"out: is a torch array but x is a numpy array"):
        srround.stochastic_round(np.ones(4, np.float32), out=torch.empty(4, dtype=torch.bfloat16))


def test_unsupported_device_and_layout():
    with pytest.raises(ValueError, match=r"x: is on meta; srround runs on CPU and CUDA"):
        srround.stochastic_round(torch.ones(4, device="meta"), seed=0)
    with pytest.raises(TypeError, match=r"x: torch.sparse_coo tensors are not supported"):
        srround.stochastic_round(torch.ones(4).to_sparse(), seed=0)


def test_tensor_list_errors_name_the_tensor():
    """Tensor-list calls (unscale_and_check, adamw_step) check hundreds of tensors in C-level
    passes, then name the first bad one."""
    ok = torch.ones(3)
    cases = [
        (
            [ok, torch.ones(3, dtype=torch.int32)],
            TypeError,
            r"grads\[1\]: expected a float32, bfloat16 or float16 tensor, got torch.int32",
        ),
        ([ok, ok, torch.ones(3, 2).t()], ValueError, r"grads\[2\]: must be contiguous"),
        ([ok, torch.ones(3).to_sparse()], TypeError, r"grads\[1\]: torch.sparse_coo tensors"),
        ([ok, torch.ones(3, device="meta")], ValueError, r"grads: tensors on several devices"),
        ([torch.ones(3, device="meta")], ValueError, r"grads: is on meta"),
        ([ok, np.ones(3, np.float32)], TypeError, r"grads\[1\]: is a numpy array but grads\[0\]"),
    ]
    for grads, error, message in cases:
        with pytest.raises(error, match=message):
            srround.unscale_and_check(grads, 0.5)
    with pytest.raises(TypeError, match=r"grads\[1\]: is a numpy array but params\[0\]"):
        srround.adamw_step(
            [ok, ok], [ok, np.ones(3, np.float32)], [ok, ok], [ok, ok], lr=1e-3, step=None, seed=0
        )
    with pytest.raises(
        TypeError, match=r"params\[1\]: expected float32, bfloat16 or float16, got int16"
    ):
        srround.adamw_step(
            [ok, torch.ones(3, dtype=torch.int16)],
            [ok, ok],
            [ok, ok],
            [ok, ok],
            lr=1e-3,
            step=None,
            seed=0,
        )


def test_tensor_subclasses_without_storage_fail_clearly():
    """A wrapper tensor subclass (torchao's wrappers, torch's TwoTensor) has no storage of
    its own: ``data_ptr()`` is 0. Before: ``unscale_and_check`` with one after a plain
    gradient (also ``GradScaler.unscale_`` of a torch optimizer's gradients) wrote to address
    0 - a segmentation fault - and the single-tensor calls raised torch's ".numpy() is not
    supported". Now a TypeError naming the tensor, before anything is written."""
    two_tensor = pytest.importorskip("torch.testing._internal.two_tensor")
    wrapped = two_tensor.TwoTensor(torch.ones(4), torch.ones(4))
    ok = torch.ones(4)
    with pytest.raises(TypeError, match=r"^grads\[1\]: a TwoTensor \(a tensor subclass"):
        srround.unscale_and_check([ok, wrapped], 0.5)
    assert torch.equal(ok, torch.ones(4))
    with pytest.raises(TypeError, match=r"^x: a TwoTensor"):
        srround.stochastic_round(wrapped, seed=0)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.ones(4)) for _ in range(2)], lr=0.1)
    opt.param_groups[0]["params"][0].grad = ok
    opt.param_groups[0]["params"][1].grad = wrapped
    scaler = srround.adapters.torch.GradScaler("cpu")
    scaler.scale(torch.ones(()))  # as a training step does before unscale_
    with pytest.raises(TypeError, match=r"^grads\[1\]: a TwoTensor"):
        scaler.unscale_(opt)


def test_import_srround_does_not_import_torch_adapter_by_itself():
    code = "import srround, sys; assert 'torch' not in sys.modules, 'torch imported'"
    run_python(["-c", code], env=None, cwd=None)


# -- CUDA (real GPU only: torch CUDA tensors do not exist under the simulator) -------------------

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch CUDA not available")


@cuda
@pytest.mark.parametrize("fmt", FMT_NAMES)
def test_cuda_same_bits_as_cpu(fmt):
    x = torch.from_numpy(np_f32(1 << 16).reshape(256, 256))
    xc = x.cuda()
    for kwargs in ({"seed": 5}, {"seed": 5, "offset": 3}):
        cpu = srround.stochastic_round(x, dtype=fmt, **kwargs)
        gpu = srround.stochastic_round(xc, dtype=fmt, **kwargs)
        assert gpu.device == xc.device and gpu.dtype == TORCH_DTYPE[fmt]
        assert np.array_equal(tbits(gpu), tbits(cpu))
    rn = srround.round_nearest(xc, dtype=fmt)
    assert np.array_equal(tbits(rn), tbits(srround.round_nearest(x, dtype=fmt)))
    assert np.array_equal(tbits(srround.to_float32(rn)), tbits(srround.to_float32(rn.cpu())))
    w_cpu = srround.round_nearest(x, dtype=fmt)
    w_gpu = w_cpu.cuda()
    u = torch.from_numpy(np_f32(1 << 16, seed=9, special=False).reshape(256, 256))
    srround.stochastic_add(w_cpu, u, alpha=0.25, seed=1)
    assert srround.stochastic_add(w_gpu, u.cuda(), alpha=0.25, seed=1) is w_gpu
    assert np.array_equal(tbits(w_gpu), tbits(w_cpu))


@cuda
def test_cuda_bf16_bits_not_values_reach_the_kernel():
    # a bf16 tensor handed to numba as __nv_bfloat16 would convert values: 1.0 (0x3F80) stored
    # by value as a uint16 would read back as 16256.0. Bits must pass through unchanged.
    w = torch.ones(1024, dtype=torch.bfloat16, device="cuda")
    srround.stochastic_add(w, torch.zeros(1024, device="cuda"), seed=0)
    assert torch.all(w == 1)
    h = torch.full((1024,), 3.0, dtype=torch.bfloat16, device="cuda")
    assert torch.all(srround.to_float32(h) == 3)


@cuda
def test_cuda_runs_on_current_stream_and_in_place():
    s = torch.cuda.Stream()
    x = torch.randn(1 << 20, device="cuda")
    w = torch.zeros(1 << 20, dtype=torch.bfloat16, device="cuda")
    ptr = w.data_ptr()
    expected = srround.stochastic_round(x.cpu(), seed=4)
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        out = torch.empty_like(w)
        result = srround.stochastic_round(x, seed=4, out=out)
        srround.stochastic_add(w, x, seed=4)  # from zero: the same rounding as above
        got = (result.view(torch.int16).cpu(), w.view(torch.int16).cpu())  # ordered on s
    assert result is out and w.data_ptr() == ptr
    assert np.array_equal(got[0].numpy().view(np.uint16), tbits(expected))
    assert np.array_equal(got[1].numpy().view(np.uint16), tbits(expected))


@cuda
def test_cuda_requires_grad_parameter():
    p = torch.nn.Parameter(torch.ones(256, dtype=torch.bfloat16, device="cuda"))
    srround.stochastic_add(p, torch.ones(256, device="cuda"), seed=0)
    assert torch.all(p == 2) and p.requires_grad and p.grad_fn is None


@cuda
def test_cuda_mixed_devices_rejected():
    with pytest.raises(ValueError, match=r"u: is on cpu but w is on cuda:0"):
        srround.stochastic_add(torch.ones(4, dtype=torch.bfloat16, device="cuda"), torch.ones(4))
    with pytest.raises(ValueError, match=r"out: is on cuda:0 but x is on cpu"):
        out = torch.empty(4, dtype=torch.bfloat16, device="cuda")
        srround.stochastic_round(torch.ones(4), out=out)


@cuda
def test_cuda_empty_tensor():
    e = srround.stochastic_round(torch.empty(0, device="cuda"), seed=0)
    assert e.shape == (0,) and e.is_cuda and e.dtype == torch.bfloat16


def test_in_place_writes_refuse_inference_tensors_outside_inference_mode():
    """As torch's ``add_`` under ``no_grad``: an inference tensor is not updated in place
    outside ``torch.inference_mode()`` (before: written with no error), and is inside it."""
    with torch.inference_mode():
        w = torch.zeros(4, dtype=torch.bfloat16)
        out = torch.empty(4, dtype=torch.bfloat16)
        found = torch.zeros(1)
    u = torch.full((4,), 0.5)
    message = r"an inference tensor.*outside torch.inference_mode"
    with pytest.raises(RuntimeError, match="^w: " + message):
        srround.stochastic_add(w, u, seed=0)
    with pytest.raises(RuntimeError, match="^out: " + message):
        srround.stochastic_round(u, seed=0, out=out)
    with pytest.raises(RuntimeError, match="^growth_tracker: " + message):
        with torch.inference_mode():
            tracker = torch.zeros(1, dtype=torch.int32)
        srround.update_scale(torch.ones(1), tracker, found)
    with pytest.raises(RuntimeError, match=r"^grads\[1\]: " + message):
        srround.unscale_and_check([torch.ones(2), found], 0.5)
    assert not w.any() and not found.any()
    with torch.inference_mode():
        srround.stochastic_add(w, u, seed=0)
        srround.stochastic_round(u, seed=0, out=out)
    assert (w == 0.5).all() and (out == 0.5).all()
