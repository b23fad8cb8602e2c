"""Bad input gets a clear error naming the argument, never a Numba traceback or a silent copy."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround


def test_wrong_input_dtype():
    with pytest.raises(TypeError, match=r"x: expected a float32 array, got int32"):
        srround.stochastic_round(np.ones(4, np.int32), seed=0)


def test_float64_rejected_with_double_rounding_note():
    with pytest.raises(TypeError, match=r"x: expected a float32 array, got float64.*twice"):
        srround.stochastic_round(np.ones(4), seed=0)


def test_out_shape_mismatch():
    out = np.empty(5, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"out: shape \(5,\) does not match"):
        srround.stochastic_round(np.ones(4, np.float32), seed=0, out=out)


def test_out_wrong_dtype():
    with pytest.raises(TypeError, match=r"out: dtype float16 does not match dtype='bfloat16'"):
        srround.stochastic_round(np.ones(4, np.float32), seed=0, out=np.empty(4, np.float16))


def test_non_contiguous_input():
    x = np.ones((4, 4), np.float32)[:, ::2]
    with pytest.raises(ValueError, match=r"x: must be C-contiguous.*np.ascontiguousarray"):
        srround.stochastic_round(x, seed=0)


def test_read_only_out_and_inplace_target():
    out = np.empty(4, ml_dtypes.bfloat16)
    out.flags.writeable = False
    with pytest.raises(ValueError, match=r"out: is read-only"):
        srround.stochastic_round(np.ones(4, np.float32), seed=0, out=out)
    w = np.zeros(4, ml_dtypes.bfloat16)
    w.flags.writeable = False
    with pytest.raises(ValueError, match=r"w: is read-only"):
        srround.stochastic_add(w, np.ones(4, np.float32), seed=0)


def test_read_only_input_is_fine():
    x = np.ones(4, np.float32)
    x.flags.writeable = False
    assert srround.stochastic_round(x, seed=0).dtype == ml_dtypes.bfloat16


def test_out_is_honoured():
    out = np.empty((2, 2), np.float16)
    result = srround.stochastic_round(np.ones((2, 2), np.float32), dtype="fp16", seed=0, out=out)
    assert result is out and np.all(out == 1)


def test_stochastic_add_shape_and_dtype():
    w = np.zeros(4, ml_dtypes.bfloat16)
    with pytest.raises(ValueError, match=r"u: shape \(3,\) does not match w's shape \(4,\)"):
        srround.stochastic_add(w, np.ones(3, np.float32), seed=0)
    with pytest.raises(TypeError, match=r"w: expected a narrow float array"):
        srround.stochastic_add(np.zeros(4, np.float32), np.ones(4, np.float32), seed=0)
    raw = np.zeros(4, np.uint16)  # bit patterns: fine once the format is named
    srround.stochastic_add(raw, np.ones(4, np.float32), seed=0, dtype="bfloat16")
    assert np.all(raw == 0x3F80)


def test_unsupported_type_and_mixed_frameworks():
    with pytest.raises(TypeError, match=r"x: unsupported array type builtins.list"):
        srround.stochastic_round([1.0, 2.0], seed=0)
    from numba import cuda

    if not cuda.is_available():
        pytest.skip("mixing needs a (simulated) CUDA array")
    with pytest.raises(TypeError, match=r"out: is a numba array but x is a numpy array"):
        srround.stochastic_round(
            np.ones(4, np.float32), seed=0, out=cuda.device_array(4, np.float16), dtype="fp16"
        )


def test_bad_dtype_and_overflow_names():
    with pytest.raises(ValueError, match=r"dtype: unsupported target format 'float8'.*'bfloat16'"):
        srround.stochastic_round(np.ones(4, np.float32), dtype="float8", seed=0)
    with pytest.raises(ValueError, match=r"overflow: expected one of \['inf', 'saturate'\]"):
        srround.stochastic_round(np.ones(4, np.float32), seed=0, overflow="clip")


def test_empty_and_scalar_inputs():
    assert srround.stochastic_round(np.empty(0, np.float32), seed=0).shape == (0,)
    assert srround.round_nearest(np.float32(1.5)).shape == ()


@pytest.mark.parametrize("optimizer", ["adamw", "sgd"])
def test_fused_step_reads_read_only_grads_and_rejects_read_only_params(optimizer):
    """The step only reads the gradients: read-only ones (e.g. views of another framework's
    buffers) are taken, with the same bits; what the step writes must be writable."""

    def step(grads, params):
        states = [[np.zeros(5, np.float32)], [np.zeros(5, np.float32)]]
        if optimizer == "adamw":
            srround.adamw_step(params, grads, *states, lr=1e-2, step=1, seed=3)
        else:
            srround.sgd_step(params, grads, states[0], lr=1e-2, momentum=0.9, step=1, seed=3)
        return params[0]

    grad = np.linspace(-1, 1, 5, dtype=np.float32)
    frozen = grad.copy()
    frozen.flags.writeable = False
    weights = np.full(5, 0.5, ml_dtypes.bfloat16)
    expected = step([grad], [weights.copy()])
    np.testing.assert_array_equal(
        step([frozen], [weights.copy()]).view(np.uint16), expected.view(np.uint16)
    )
    locked = weights.copy()
    locked.flags.writeable = False
    with pytest.raises(ValueError, match=r"params\[0\]: is read-only"):
        step([grad], [locked])


def test_numpy_scalars_are_refused_where_written_or_listed():
    """A NumPy scalar is immutable: as ``out``, an in-place target or an element of a tensor
    list it was converted to a temporary array - the result went to that copy (the caller's
    scalar unchanged) or, in a list, the kernel got the address of a freed temporary."""
    bf16, one = ml_dtypes.bfloat16, np.ones((), np.float32)
    cases = [
        ("out", lambda: srround.to_float32(np.float16(1.5), out=np.float32(0))),
        ("w", lambda: srround.stochastic_add(bf16(1), np.float32(1), seed=0)),
        (r"grads\[0\]", lambda: srround.unscale_and_check([np.float32(4)], 0.5)),
        ("scale", lambda: srround.update_scale(np.float32(2), np.zeros((), np.int32), one)),
        (r"params\[0\]", lambda: srround.sgd_step(np.float32(1), one, lr=0.1, step=1)),
        (r"grads\[0\]", lambda: srround.sgd_step(one.copy(), np.float32(1), lr=0.1, step=1)),
    ]
    for name, call in cases:
        with pytest.raises(TypeError, match=rf"^{name}: a NumPy scalar"):
            call()
    assert srround.round_nearest(np.float32(1.5)).shape == ()  # read-only inputs are fine


def test_none_and_arrays_where_a_value_is_expected_name_the_argument():
    """None for the array, a 0-d array for ``betas``, an array for ``quantize_blocks``'
    ``rounding``/``scale``: 'no array given', 'len() of unsized object' and NumPy's 'truth value
    of an array is ambiguous' named no argument."""
    with pytest.raises(TypeError, match=r"^x: expected an array, got None"):
        srround.stochastic_round(None, seed=0)
    with pytest.raises(TypeError, match=r"^grads: expected an array, got None"):
        srround.unscale_and_check(None, 0.5)
    p, g, m, v = (np.ones(4, np.float32) for _ in range(4))
    with pytest.raises(TypeError, match=r"^betas: expected a pair"):
        srround.adamw_step(p, g, m, v, lr=1e-3, betas=np.array(0.9), step=1)
    blocks = np.ones((2, 32), np.float32)
    for name in ("rounding", "scale"):
        with pytest.raises(ValueError, match=rf"^{name}: expected"):
            srround.quantize_blocks(blocks, "mxfp8_e4m3", **{name: np.ones(3)})
