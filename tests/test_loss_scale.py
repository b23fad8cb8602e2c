"""Loss scaling: the fused unscale-and-check pass and the device-side scale update."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

import srround

from .reference import bits

DTYPES = [np.float32, ml_dtypes.bfloat16, np.float16]


def _grads(backend, count=300, seed=0):
    rng = np.random.default_rng(seed)
    host = [
        (rng.standard_normal(int(rng.integers(0, 7))) * 1e3).astype(DTYPES[i % 3])
        for i in range(count)
    ]
    return host, [backend.put(g) for g in host]


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_single_non_finite_anywhere_is_found(writable_backend, bad):
    host, grads = _grads(writable_backend, count=120)
    found = writable_backend.get(srround.unscale_and_check(grads, 0.5))
    assert list(found) == [0.0]
    for k in (0, 57, 119):
        if host[k].size == 0:
            continue
        poisoned = [g.copy() for g in host]
        poisoned[k][-1] = bad
        found = srround.unscale_and_check([writable_backend.put(g) for g in poisoned], 0.5)
        assert list(writable_backend.get(found)) == [1.0], (k, poisoned[k].dtype)


def test_unscale_values_are_the_rounded_products(writable_backend):
    host, grads = _grads(writable_backend, count=30, seed=1)
    srround.unscale_and_check(grads, 1.0 / 3.0)
    for before, after in zip(host, grads):
        expected = (before.astype(np.float32) * np.float32(1.0 / 3.0)).astype(before.dtype)
        assert np.array_equal(bits(writable_backend.get(after)), bits(expected))


QNAN = {np.dtype(np.float32): 0x7FC00000, np.dtype(ml_dtypes.bfloat16): 0x7FC0}
QNAN[np.dtype(np.float16)] = 0x7E00


@pytest.mark.parametrize("inv_scale", [0.5, np.inf])
def test_unscaled_nan_is_the_positive_quiet_nan(writable_backend, inv_scale):
    """Unscaling -qNaN, a +NaN with a payload, 0 (times inf: an invalid product) and 1 writes
    every NaN as its dtype's +qNaN on every backend (x86 keeps the operand's sign, -qNaN for
    0 * inf; CUDA writes 0x7FFFFFFF)."""
    host = []
    for dtype, qnan in QNAN.items():
        g = np.array([0.0, 0.0, 0.0, 1.0], dtype)
        sign = 0x80000000 if dtype == np.float32 else 0x8000
        g[:2].view(np.uint32 if dtype == np.float32 else np.uint16)[:] = [sign | qnan, qnan | 3]
        host.append(g)
    grads = [writable_backend.put(g) for g in host]
    scale = writable_backend.put(np.float32([inv_scale]))  # an array: inf is accepted
    found = writable_backend.get(srround.unscale_and_check(grads, scale))
    assert list(found) == [1.0]
    nans = 3 if inv_scale == np.inf else 2
    for g in grads:
        got = writable_backend.get(g)
        assert [hex(v) for v in bits(got)[:nans]] == [hex(QNAN[got.dtype])] * nans, got.dtype
        assert got[3].astype(np.float32) == np.float32(inv_scale)


def test_matches_torch_amp_unscale():
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        theirs = [
            torch.from_numpy(rng.standard_normal(n).astype(np.float32) * 100).to(dtype)
            for n in (5, 0, 33)
        ]
        ours = [t.clone() for t in theirs]
        found_theirs = torch.zeros(1)
        inv = torch.tensor([1 / 1024.0])
        torch._amp_foreach_non_finite_check_and_unscale_(theirs, found_theirs, inv)
        found_ours = srround.unscale_and_check(ours, inv)
        assert torch.equal(found_ours, found_theirs)
        for a, b in zip(ours, theirs):
            assert torch.equal(
                a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                b.view(torch.int16 if b.element_size() == 2 else torch.int32),
            )


def test_per_tensor_flags_and_scales():
    grads = [np.ones(3, np.float32), np.array([1.0, np.nan], np.float16), np.ones(2, np.float32)]
    inv = np.float32([0.5, 0.25, 0.125])
    found = srround.unscale_and_check(grads, inv, per_tensor=True)
    assert list(found) == [0.0, 1.0, 0.0]
    assert list(grads[0]) == [0.5] * 3 and list(grads[2]) == [0.125] * 2
    # a given found_inf accumulates over calls (it is not cleared)
    again = srround.unscale_and_check([np.ones(1, np.float32)], 1.0, found_inf=np.float32([1.0]))
    assert list(again) == [1.0]


def test_per_tensor_with_one_array_scale_shares_it(writable_backend):
    """``per_tensor=True`` takes an array of 1 value (one scale, a flag per tensor): the kernels
    read the scale of tensor k at index k, past the end of that array (garbage scales)."""
    host = [np.full(3, 8.0, np.float32), np.array([8.0, np.inf], np.float16), np.full(2, 8.0)]
    host[2] = host[2].astype(ml_dtypes.bfloat16)
    grads = [writable_backend.put(g) for g in host]
    found = srround.unscale_and_check(
        grads, writable_backend.put(np.float32([0.5])), per_tensor=True
    )
    assert list(writable_backend.get(found)) == [0.0, 1.0, 0.0]
    assert [float(writable_backend.get(g)[0]) for g in grads] == [4.0, 4.0, 4.0]


@pytest.mark.parametrize(
    "init, growth_factor, backoff_factor", [(2.0**16, 2.0, 0.5), (3.0, 1.1, 0.9), (1e30, 1.3, 0.7)]
)
def test_scale_trajectory_matches_torch_gradscaler(init, growth_factor, backoff_factor):
    """torch multiplies the float32 scale by the float64 factor and rounds once: a factor that
    float32 cannot hold (0.9, 1.1) gave other bits when it was rounded to float32 first."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(3)
    events = rng.random(400) < 0.08
    scale_t, tracker_t = torch.tensor([init]), torch.zeros(1, dtype=torch.int32)
    scale, tracker = np.float32([init]), np.zeros(1, np.int32)
    factors = dict(growth_factor=growth_factor, backoff_factor=backoff_factor)
    for overflow in events:
        found = np.float32([float(overflow)])
        torch._amp_update_scale_(
            scale_t, tracker_t, torch.from_numpy(found), growth_factor, backoff_factor, 7
        )
        srround.update_scale(scale, tracker, found, growth_interval=7, **factors)
        assert scale.view(np.uint32)[0] == scale_t.numpy().view(np.uint32)[0]
        assert tracker[0] == tracker_t.item()


def test_hysteresis_min_and_max():
    scale, growth, overflows = np.float32([8.0]), np.zeros(1, np.int32), np.zeros(1, np.int32)

    def step(flag, **kw):
        srround.update_scale(
            scale,
            growth,
            np.float32([flag]),
            overflow_tracker=overflows,
            growth_interval=2,
            hysteresis=2,
            min_scale=2.0,
            max_scale=16.0,
            **kw,
        )
        return float(scale[0])

    assert [step(1), step(1)] == [8.0, 4.0]  # backs off on the second consecutive overflow
    assert [step(1), step(0), step(1)] == [4.0, 4.0, 4.0]  # a clean step resets the count
    assert [step(1), step(1), step(1), step(1)] == [2.0, 2.0, 2.0, 2.0]  # floor at min_scale
    assert [step(0), step(0), step(0), step(0), step(0), step(0)][-1] == 16.0  # cap at max
    static = np.float32([4.0])
    for flag in (1, 0, 0, 1):
        srround.update_scale(
            static,
            np.zeros(1, np.int32),
            np.float32([flag]),
            growth_factor=1.0,
            backoff_factor=1.0,
            growth_interval=1,
        )
    assert static[0] == 4.0


def test_update_scale_on_cuda_matches_cpu(writable_backend):
    flags = (np.random.default_rng(4).random(40) < 0.3).astype(np.float32)
    results = []
    for place in ("cpu", writable_backend):
        put = (lambda a: a) if place == "cpu" else writable_backend.put
        get = (lambda a: a) if place == "cpu" else writable_backend.get
        scale, tracker = put(np.float32([2.0**10, 2.0**12])), put(np.zeros(2, np.int32))
        for i in range(0, 40, 2):
            srround.update_scale(scale, tracker, put(flags[i : i + 2].copy()), growth_interval=3)
        results.append((get(scale).tolist(), get(tracker).tolist()))
    assert results[0] == results[1]


def test_errors():
    with pytest.raises(
        TypeError, match=r"grads\[1\]: expected a float32, bfloat16 or float16 array, got int64"
    ):
        srround.unscale_and_check([np.ones(2, np.float32), np.ones(2, np.int64)], 0.5)
    with pytest.raises(ValueError, match=r"inv_scale: expected 1 or 2 values, got 3"):
        srround.unscale_and_check(
            [np.ones(2, np.float32)] * 2, np.ones(3, np.float32), per_tensor=True
        )
    with pytest.raises(TypeError, match=r"growth_tracker: expected an int32 array, got int64"):
        srround.update_scale(np.float32([1.0]), np.zeros(1, np.int64), np.float32([0.0]))
    with pytest.raises(ValueError, match=r"overflow_tracker: needed when hysteresis > 1"):
        srround.update_scale(
            np.float32([1.0]), np.zeros(1, np.int32), np.float32([0.0]), hysteresis=3
        )
    ro = np.ones(2, np.float32)
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"grads\[0\]: is read-only"):
        srround.unscale_and_check([ro], 0.5)


def test_max_scale_and_backoff_must_hold_in_float32():
    """The bounds are applied in float32, and a backoff factor below float32's range is
    refused: 1e-50 became 0 there (the next backoff set the scale to 0), a max_scale of 1e39
    a cast-overflow warning."""
    args = np.float32([8.0]), np.zeros(1, np.int32), np.float32([0.0])
    with pytest.raises(ValueError, match=r"^max_scale: 1e-50 rounds to 0 in float32"):
        srround.update_scale(*args, growth_interval=1, max_scale=1e-50)
    with pytest.raises(ValueError, match=r"^max_scale: 1e\+39 overflows float32.*inf"):
        srround.update_scale(*args, growth_interval=1, max_scale=1e39)
    with pytest.raises(ValueError, match=r"^backoff_factor: 1e-50 rounds to 0 in float32"):
        srround.update_scale(*args, backoff_factor=1e-50)
    srround.update_scale(*args, growth_interval=1, max_scale=np.inf)
    assert args[0][0] == 16.0


def test_update_scale_refuses_shared_memory():
    """One array as both trackers, or a scale sharing memory with its flags: the update reads
    and writes them element by element, so the counts and the scale went wrong silently."""
    scale, found = np.float32([8.0]), np.float32([0.0])
    tracker = np.zeros(1, np.int32)
    with pytest.raises(ValueError, match=r"^overflow_tracker: shares memory with growth_tracker"):
        srround.update_scale(scale, tracker, found, overflow_tracker=tracker, hysteresis=2)
    with pytest.raises(ValueError, match=r"^found_inf: shares memory with scale"):
        srround.update_scale(scale, tracker, scale, growth_interval=1)
    assert scale[0] == 8.0 and tracker[0] == 0


def test_cuda_reuses_the_device_table_of_a_gradient_list(small_cuda_launch):
    """On CUDA the tensor list's table is copied to the device once per list (``_cuda``'s
    cache, the last few lists): the same list again reuses the copy, another list gets its own,
    and both unscale their own tensors (a stale table would write into the first list)."""
    from srround import _cuda

    from .reference import to_cuda

    first = [to_cuda(np.full(n, 2.0, np.float32)) for n in (5, 3, 9)]
    second = [to_cuda(np.full(n, 2.0, np.float32)) for n in (4, 6)]
    _cuda._TABLES.clear()
    srround.unscale_and_check(first, 0.5)
    copies = list(_cuda._TABLES.values())
    srround.unscale_and_check(first, 0.5)
    assert list(_cuda._TABLES.values()) == copies  # reused, not copied again
    srround.unscale_and_check(second, 0.25)
    assert len(_cuda._TABLES) == 2
    for g, value in [(g, 0.5) for g in first] + [(g, 0.5) for g in second]:
        np.testing.assert_array_equal(g.copy_to_host(), value)
