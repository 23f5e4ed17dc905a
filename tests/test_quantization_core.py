"""Tests for tinycomp.quantization.core and .observers: qparams, quantize/dequantize, observers, TFLite fixed-point
multipliers (against slow Python-integer references), fake quantization with the STE, BatchNorm folding and int4
packing."""

import math
from fractions import Fraction

import numpy as np
import pytest

from tinycomp.batchnorm import BatchNorm2d
from tinycomp.conv import Conv2d
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.quantization.core import (
    QUANT_DTYPES, calculate_qparams, dequantize, fake_quantize, fold_batchnorm, multiply_by_quantized_multiplier,
    pack_int4, per_channel_qparams, qrange, quantize_multiplier, quantize_per_channel, quantize_per_tensor, sqnr,
    unpack_int4)
from tinycomp.quantization.observers import (
    KLObserver, MinMaxObserver, MovingAverageMinMaxObserver, MSEObserver, Observer, PercentileObserver,
    PerChannelMinMaxObserver, mse_range)
from tinycomp.quantization.observers import _Histogram, _entropy_threshold, _entropy_threshold_naive
from tinycomp.tensor import Tensor, default_generator, manual_seed, no_grad

pytestmark = pytest.mark.module04

F32 = np.float32


# ---- slow references in Python integers / float32 scalars, written independently of the package -----------------

def wrap32(v):
    "Two's-complement wrap of a Python int to int32."
    return (v + 2**31) % 2**32 - 2**31

def trunc_div(n, d):
    "C++ integer division: truncates toward zero."
    q = abs(n) // abs(d)
    return q if (n >= 0) == (d > 0) else -q

def ref_quantize_multiplier(real):
    "TFLite's QuantizeMultiplier with exact rational arithmetic."
    if real == 0: return 0, 0
    mant, shift = math.frexp(real)
    q = Fraction(mant) * 2**31
    q_fixed = math.floor(q + Fraction(1, 2))          # std::round of a positive value: half away from zero
    assert q_fixed <= 2**31
    if q_fixed == 2**31: q_fixed //= 2; shift += 1
    if shift < -31: shift, q_fixed = 0, 0
    if shift > 30: shift, q_fixed = 30, 2**31 - 1
    return q_fixed, shift

def ref_srdhm(a, b):
    "gemmlowp's SaturatingRoundingDoublingHighMul, line by line, in Python ints."
    if a == b == -2**31: return 2**31 - 1
    ab = a * b
    nudge = (1 << 30) if ab >= 0 else 1 - (1 << 30)
    return trunc_div(ab + nudge, 1 << 31)

def ref_rdbpot(x, exponent):
    "RoundingDivideByPOT as exact rational rounding: nearest, ties away from zero."
    f = Fraction(x, 2**exponent)
    r = math.floor(abs(f) + Fraction(1, 2))
    return r if f >= 0 else -r

def ref_mbqm(acc, mult, shift):
    "TFLite's MultiplyByQuantizedMultiplier (default double-rounding build), in Python ints."
    left, right = max(shift, 0), max(-shift, 0)
    return ref_rdbpot(ref_srdhm(wrap32(acc * 2**left), mult), right)

def ref_qparams(lo, hi, dtype, symmetric):
    "calculate_qparams for one pair, in float32 scalars."
    qmin, qmax = qrange(dtype, symmetric)
    lo, hi = min(F32(lo), F32(0)), max(F32(hi), F32(0))
    if symmetric:
        s = F32(max(-lo, hi)) / F32((qmax - qmin) / 2)
    else:
        s = F32(hi - lo) / F32(qmax - qmin)
    if not s >= np.finfo(F32).tiny: s = F32(1.0)
    if symmetric: z = 128 if dtype == 'uint8' else 0
    else: z = int(min(max(qmin - np.round(F32(lo) / s), qmin), qmax))
    return F32(s), z

def ref_quantize(x, s, z, dtype):
    qmin, qmax, t = QUANT_DTYPES[dtype]
    out = [min(max(float(np.round(F32(v) / F32(s))) + z, qmin), qmax) for v in np.ravel(x)]
    return np.array(out).astype(t).reshape(np.shape(x))


# ---- ranges and qparams ---------------------------------------------------------------------------------------------

def test_qrange_and_dtypes():
    assert qrange() == (-128, 127) and qrange('int8', True) == (-127, 127)
    assert qrange('uint8') == qrange('uint8', True) == (0, 255)
    assert qrange('int4') == (-8, 7) and qrange('int4', True) == (-7, 7)
    assert QUANT_DTYPES['int4'][2] is np.int8 and QUANT_DTYPES['uint8'][2] is np.uint8
    for bad in ('int16', 'INT8', None, np.int8, 8):
        with pytest.raises(TinycompError, match="unknown quantized dtype"): qrange(bad)
    with pytest.raises(TinycompError, match="symmetric must be True or False"): qrange('int8', 'yes')


@pytest.mark.parametrize('dtype', ['int8', 'uint8', 'int4'])
@pytest.mark.parametrize('symmetric', [False, True])
def test_calculate_qparams_matches_scalar_reference(dtype, symmetric):
    rng = np.random.default_rng(0)
    lo = np.concatenate([-rng.exponential(size=200), rng.uniform(0, 2, 20), [0., 0., -1e-3, -5.]])
    hi = np.concatenate([rng.exponential(size=200), rng.uniform(2, 3, 20), [0., 1e-3, 0., -1.]])
    s, z = calculate_qparams(lo, hi, dtype, symmetric)
    assert s.dtype == np.float32 and z.dtype == np.int32 and s.shape == z.shape == lo.shape
    for i in range(len(lo)):
        rs, rz = ref_qparams(lo[i], hi[i], dtype, symmetric)
        assert s[i] == rs and z[i] == rz, (i, lo[i], hi[i], s[i], z[i], rs, rz)
        qmin, qmax = qrange(dtype, symmetric)
        assert qmin <= z[i] <= qmax and s[i] > 0


def test_calculate_qparams_cases():
    s, z = calculate_qparams(-1.0, 1.55)
    assert abs(float(s) - 0.01) < 1e-8 and int(z) == -28
    assert isinstance(s, np.ndarray) and s.shape == () and z.shape == ()
    s, z = calculate_qparams(0.0, 6.0, 'uint8')
    assert int(z) == 0 and s == F32(F32(6) / F32(255))
    assert int(calculate_qparams(0.0, 6.0, 'int8')[1]) == -128
    assert int(calculate_qparams(-6.0, 0.0, 'int8')[1]) == 127
    s, z = calculate_qparams(-0.5, 2.0, symmetric=True)
    assert s == F32(2) / F32(127) and int(z) == 0
    s, z = calculate_qparams(-1.0, 1.0, 'uint8', True)
    assert int(z) == 128 and s == F32(1) / F32(127.5)
    assert calculate_qparams(-3.5, 2.0, 'int4', True)[0] == F32(0.5)
    # the range always contains 0
    assert calculate_qparams(2., 4.) == calculate_qparams(0., 4.)
    assert calculate_qparams(-4., -2., 'int8', True) == calculate_qparams(-4., 0., 'int8', True)
    # zero range (a constant-zero tensor): scale 1, documented
    assert calculate_qparams(0., 0.) == (F32(1), -128)
    assert calculate_qparams(0., 0., 'uint8') == (F32(1), 0)
    assert calculate_qparams(0., 0., 'int8', True) == (F32(1), 0)
    assert calculate_qparams(0., 1e-45)[0] == F32(1)        # underflowing scale -> 1 as well
    # broadcasting (a scalar minimum with per-channel maxima); float64 inputs are computed in float32
    s, z = calculate_qparams(0.0, np.array([1.0, 2.0]))
    assert s.shape == (2,) and s[1] == F32(2) / F32(255)
    assert calculate_qparams(np.float64(0.1), 0.3)[0] == calculate_qparams(F32(0.1), F32(0.3))[0]


def test_calculate_qparams_bad_input():
    with pytest.raises(TinycompError, match="min_val contains 1 NaN"): calculate_qparams(np.nan, 1.)
    with pytest.raises(TinycompError, match="max_val contains 0 NaN and 1 inf"): calculate_qparams(0., np.inf)
    with pytest.raises(TinycompError, match="min_val contains 0 NaN and 1 inf"): calculate_qparams(-np.inf, 1.)
    with pytest.raises(TinycompError, match="min_val > max_val"): calculate_qparams(1., -1.)
    with pytest.raises(ShapeError, match="do not broadcast"): calculate_qparams(np.zeros(3), np.ones(2))
    with pytest.raises(TinycompError, match="numeric"): calculate_qparams('a', 1.)
    with pytest.raises(TinycompError, match="unknown quantized dtype"): calculate_qparams(0., 1., 'int2')
    with pytest.raises(TinycompError): calculate_qparams(0., 1e39)      # overflows float32 -> inf


# ---- quantize / dequantize ------------------------------------------------------------------------------------------

def test_quantize_rounds_half_to_even_and_clamps():
    x = np.array([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.49, 1000., -1000.], np.float32)
    test = quantize_per_tensor(x, 1.0, 0)
    assert test.dtype == np.int8
    np.testing.assert_array_equal(test, [0, 2, 2, 0, -2, -2, 3, 127, -128])
    # exact ties x / s = k + 0.5 with a power-of-two scale
    np.testing.assert_array_equal(quantize_per_tensor(np.array([0.125, 0.375], np.float32), 0.25, 1), [1, 3])   # 0.5 -> 0, 1.5 -> 2
    np.testing.assert_array_equal(quantize_per_tensor([-1., 0., 1.], 1 / 255, 0, 'uint8'), np.array([0, 0, 255], np.uint8))
    assert quantize_per_tensor([1.], 1., 0, 'uint8').dtype == np.uint8
    np.testing.assert_array_equal(quantize_per_tensor([-100., 0., 100.], 1., 0, 'int4'), np.array([-8, 0, 7], np.int8))
    np.testing.assert_array_equal(quantize_per_tensor([-np.inf, np.inf], 0.1, 0), [-128, 127])


@pytest.mark.parametrize('dtype', ['int8', 'uint8', 'int4'])
def test_quantize_matches_reference(dtype):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((3, 4, 5)) * 3).astype(np.float32)
    qmin, qmax, _ = QUANT_DTYPES[dtype]
    for s, z in [(0.05, 0), (0.1, qmin + 3), (F32(0.0371), (qmin + qmax) // 2), (1.0, qmax)]:
        x0 = x.copy()
        q = quantize_per_tensor(x, s, z, dtype)
        np.testing.assert_array_equal(q, ref_quantize(x, s, z, dtype))
        assert q.dtype == QUANT_DTYPES[dtype][2] and q.shape == x.shape
        np.testing.assert_array_equal(x, x0)


def test_quantize_bad_input():
    with pytest.raises(TinycompError, match="NaN"): quantize_per_tensor([np.nan], 0.1, 0)
    for s in (0.0, -0.1, np.inf, np.nan, 1e-50):
        with pytest.raises(TinycompError, match="scale must be finite and > 0"): quantize_per_tensor([1.], s, 0)
    with pytest.raises(TinycompError, match=r"zero_point 128 is outside \[-128, 127\]"): quantize_per_tensor([1.], 0.1, 128)
    with pytest.raises(TinycompError, match=r"outside \[0, 255\]"): quantize_per_tensor([1.], 0.1, -1, 'uint8')
    with pytest.raises(TinycompError, match=r"outside \[-8, 7\]"): quantize_per_tensor([1.], 0.1, 8, 'int4')
    with pytest.raises(TinycompError, match="whole numbers"): quantize_per_tensor([1.], 0.1, 0.5)
    with pytest.raises(ShapeError, match="single number"): quantize_per_tensor([1.], [0.1, 0.2], 0)
    with pytest.raises(TinycompError, match="unknown quantized dtype"): quantize_per_tensor([1.], 0.1, 0, 'fp8')
    with pytest.raises(TinycompError, match="numeric"): quantize_per_tensor(['a'], 0.1, 0)


def test_dequantize():
    q = np.array([-128, -1, 0, 127], np.int8)
    out = dequantize(q, 0.5, -1)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, [-63.5, 0., 0.5, 64.])
    np.testing.assert_array_equal(dequantize(np.array([0, 255], np.uint8), 1.0, 128), [-128., 127.])
    np.testing.assert_array_equal(dequantize(np.array([5], np.int32), 2.0, 0), [10.])
    s = F32(0.1)
    np.testing.assert_array_equal(dequantize(q, s, 3), ((q.astype(np.int64) - 3).astype(np.float32) * s))
    q2 = np.arange(24, dtype=np.int8).reshape(2, 3, 4) - 12
    for axis in (0, 1, 2, -1):
        n = q2.shape[axis]
        sc, zp = np.linspace(0.1, 0.5, n).astype(np.float32), np.arange(n) - 1
        got = dequantize(q2, sc, zp, axis=axis)
        shape = [1, 1, 1]; shape[axis] = n
        np.testing.assert_array_equal(got, (q2 - zp.reshape(shape)).astype(np.float32) * sc.reshape(shape))
        assert got.dtype == np.float32
    with pytest.raises(TinycompError, match="must be an integer array"): dequantize(np.array([1.]), 0.1, 0)
    with pytest.raises(ShapeError, match="axis 1 of the input has length 3"): dequantize(q2, [1., 2.], 0, axis=1)
    with pytest.raises(ShapeError, match="single number"): dequantize(q2, [1., 2.], 0)
    with pytest.raises(TinycompError, match="axis=3 is not an axis"): dequantize(q2, 1., 0, axis=3)
    with pytest.raises(TinycompError, match=r"outside \[0, 255\]"): dequantize(np.array([1], np.uint8), 1., -1)
    with pytest.raises(TinycompError, match="scale must be finite and > 0"): dequantize(q2, [1., 0., 1.], 0, axis=1)


def test_quantize_dequantize_error_bound():
    x = np.random.default_rng(2).uniform(-3, 5, 10_000).astype(np.float32)
    for dtype in ('int8', 'uint8', 'int4'):
        for symmetric in (False, True):
            s, z = calculate_qparams(x.min(), x.max(), dtype, symmetric)
            err = np.abs(dequantize(quantize_per_tensor(x, s, z, dtype), s, z) - x)
            assert err.max() <= float(s) / 2 * (1 + 1e-5), (dtype, symmetric)
    # zero is exact whatever the range
    for lo, hi in [(-0.37, 1.91), (0.2, 0.9), (-5., -1.)]:
        s, z = calculate_qparams(lo, hi)
        assert dequantize(quantize_per_tensor([0.], s, z), s, z)[0] == 0


def test_quantize_per_channel():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 3, 2)).astype(np.float32)
    for axis in (0, 1, 2, -2):
        n = w.shape[axis]
        s, z = per_channel_qparams(w, axis % 3, 'int8', False)
        q = quantize_per_channel(w, s, z, axis)
        assert q.dtype == np.int8 and q.shape == w.shape
        for c in range(n):
            np.testing.assert_array_equal(np.take(q, c, axis), quantize_per_tensor(np.take(w, c, axis), s[c], z[c]))
        np.testing.assert_array_equal(dequantize(q, s, z, axis=axis),
                                      np.stack([dequantize(np.take(q, c, axis), s[c], z[c]) for c in range(n)], axis=axis))
    q = quantize_per_channel(w, [0.1, 0.2, 0.3, 0.4], 0, 0, 'uint8')      # one zero point for all channels
    assert q.dtype == np.uint8
    with pytest.raises(ShapeError, match=r"scales has shape \(3,\)"): quantize_per_channel(w, [1., 1., 1.], 0, 0)
    with pytest.raises(TinycompError, match="zero_points 300 is outside"): quantize_per_channel(w, np.ones(4), [0, 0, 0, 300], 0)
    with pytest.raises(TinycompError, match="is not an axis"): quantize_per_channel(w, np.ones(4), 0, 5)
    with pytest.raises(TinycompError, match="NaN"): quantize_per_channel(np.array([np.nan]), [1.], 0, 0)


def test_per_channel_qparams():
    rng = np.random.default_rng(4)
    w = rng.standard_normal((6, 2, 3, 3)).astype(np.float32)
    w[2] *= 10; w[4] = 0
    s, z = per_channel_qparams(w)
    assert s.shape == z.shape == (6,) and s.dtype == np.float32 and z.dtype == np.int32
    for c in range(6):
        assert (s[c], z[c]) == tuple(v.item() for v in calculate_qparams(w[c].min(), w[c].max(), 'int8', True))
    assert s[4] == 1.0 and (z == 0).all()
    s1, z1 = per_channel_qparams(w.reshape(6, -1).T, axis=1, dtype='uint8', symmetric=False)
    for c in range(6):
        assert (s1[c], z1[c]) == tuple(v.item() for v in calculate_qparams(w[c].min(), w[c].max(), 'uint8', False))
    np.testing.assert_array_equal(per_channel_qparams(np.array([1., -3., 0.]))[0], np.array([1 / 127, 3 / 127, 1.], np.float32))
    with pytest.raises(TinycompError, match="w contains 1 NaN"): per_channel_qparams(np.array([np.nan, 1.]))
    with pytest.raises(TinycompError, match="is not an axis"): per_channel_qparams(w, axis=4)
    with pytest.raises(ShapeError, match="empty"): per_channel_qparams(np.zeros((0, 3)))


def test_sqnr():
    assert sqnr([1., 2.], [1., 2.]) == float('inf')
    assert sqnr(np.zeros(3), np.ones(3)) == float('-inf')
    assert abs(sqnr([3., 4.], [3., 3.]) - 10 * np.log10(25)) < 1e-12
    assert abs(sqnr(Tensor([1., 1.]), Tensor([1.1, 0.9])) - 10 * np.log10(2 / 0.02)) < 1e-5
    with pytest.raises(ShapeError, match="x has shape"): sqnr([1., 2.], [1.])
    with pytest.raises(TinycompError, match="NaN"): sqnr([np.nan], [1.])


# ---- observers ------------------------------------------------------------------------------------------------------

ALL_OBSERVERS = [MinMaxObserver, MovingAverageMinMaxObserver, PerChannelMinMaxObserver, PercentileObserver,
                 MSEObserver, KLObserver]

@pytest.mark.parametrize('cls', ALL_OBSERVERS)
def test_observer_common_behaviour(cls):
    ob = cls()
    assert isinstance(ob, Observer)
    with pytest.raises(TinycompError, match="empty calibration"): ob.calculate_qparams()
    x = np.random.default_rng(5).standard_normal((8, 3, 4)).astype(np.float32)
    assert ob.observe(x) is x and ob(x) is x
    t = Tensor(x)
    assert ob(t) is t
    before = (np.copy(ob.min_val), np.copy(ob.max_val))
    with pytest.raises(TinycompError, match="NaN"): ob.observe(np.array([[np.nan, 1., 2.]]).reshape(1, 3, 1))
    with pytest.raises(TinycompError, match="inf"): ob.observe(np.full((1, 3, 1), np.inf))
    with pytest.raises(ShapeError, match="empty"): ob.observe(np.zeros((0, 3, 4)))
    np.testing.assert_array_equal(ob.min_val, before[0]); np.testing.assert_array_equal(ob.max_val, before[1])
    s, z = ob.calculate_qparams()
    assert s.dtype == np.float32 and z.dtype == np.int32 and (s > 0).all()
    assert 'batch' in repr(ob)
    ob.reset()
    with pytest.raises(TinycompError, match="empty calibration"): ob.calculate_qparams()
    # a constant-zero input: zero range, scale 1
    c = cls(); c.observe(np.zeros((2, 3, 2)))
    assert (c.calculate_qparams()[0] == 1).all()
    with pytest.raises(TinycompError, match="unknown quantized dtype"): cls(dtype='int7')


def test_minmax_observers():
    ob = MinMaxObserver(dtype='uint8')
    ob.observe(np.array([-1., 0.5])); ob.observe(np.array([3., 0.]))
    assert (ob.min_val, ob.max_val) == (-1., 3.)
    assert ob.calculate_qparams() == calculate_qparams(-1., 3., 'uint8')
    ob = MinMaxObserver(symmetric=True); ob.observe(np.array([-5., 2.]))
    assert ob.calculate_qparams() == calculate_qparams(-5., 2., 'int8', True)
    ma = MovingAverageMinMaxObserver(averaging_constant=0.25)
    ma.observe(np.array([-4., 4.])); ma.observe(np.array([0., 8.]))
    assert (ma.min_val, ma.max_val) == (-3., 5.)
    for bad in (0, -0.1, 1.5, True, 'x'):
        with pytest.raises(TinycompError, match="averaging_constant"): MovingAverageMinMaxObserver(averaging_constant=bad)
    pc = PerChannelMinMaxObserver(axis=1)
    assert pc.symmetric
    pc.observe(np.array([[1., -2.], [0., 5.]])); pc.observe(np.array([[-1., 0.]]))
    np.testing.assert_array_equal(pc.min_val, [-1., -2.]); np.testing.assert_array_equal(pc.max_val, [1., 5.])
    s, z = pc.calculate_qparams()
    np.testing.assert_array_equal(s, np.array([1 / 127, 5 / 127], np.float32))
    with pytest.raises(ShapeError, match="has 3 channels along axis 1"): pc.observe(np.zeros((2, 3)))
    with pytest.raises(TinycompError, match="is not an axis"): PerChannelMinMaxObserver(axis=2).observe(np.zeros(3))
    with pytest.raises(TinycompError, match="axis must be an int"): PerChannelMinMaxObserver(axis=0.5)


def test_histogram_growth_is_exact():
    rng = np.random.default_rng(6)
    parts = [rng.normal(0, s, 3000) for s in (0.01, 0.3, 1.0, 30.0)] + [np.abs(rng.normal(0, 100, 10))]
    h = _Histogram(256)
    h.add(np.zeros(4))
    assert h.total == 4 and h.edges() is None
    for p in parts: h.add(p)
    allx = np.concatenate(parts + [np.zeros(4)])
    assert h.total == allx.size == h.counts.sum()
    e = h.edges()
    assert e[0] <= allx.min() and e[-1] > allx.max() and abs(e[h.n_neg]) < 1e-12    # 0 is an edge
    direct = np.bincount(np.clip(np.floor(allx / h.width).astype(int) + h.n_neg, 0, 255), minlength=256)
    assert np.abs(direct - h.counts).sum() <= 4                                    # only float ties at edges may differ
    # quantiles and samples
    q = h.quantiles([0.0, 0.5, 1.0])
    assert e[0] <= q[0] <= q[1] <= q[2] <= e[-1]
    assert abs(q[1] - np.median(allx)) <= h.width
    assert len(h.sample(100)) == 100 and len(h.sample(10**9)) == h.total
    # absolute values only: no negative bins
    ha = _Histogram(64); ha.add(np.abs(allx))
    assert ha.n_neg == 0
    with pytest.raises(TinycompError, match="bins"): _Histogram(1)


def test_entropy_threshold_fast_matches_naive():
    rng = np.random.default_rng(7)
    for trial in range(6):
        n, levels = (512, 16) if trial % 2 else (300, 8)
        h = np.bincount(np.minimum((np.abs(rng.standard_normal(4000)) * n / (3 + trial)).astype(int), n - 1), minlength=n)
        h[rng.integers(0, n, 5)] = 0                                       # holes
        if trial >= 2: h[-1] += trial                                      # outliers in the last bin
        if trial >= 4: h[n // 2: n - 1] = 0                                # outliers far out, empty bins before
        bn, dn = _entropy_threshold_naive(h, levels)
        bf, df = _entropy_threshold(h, levels)
        assert bn == bf
        np.testing.assert_array_equal(np.isfinite(dn), np.isfinite(df))
        np.testing.assert_allclose(dn[np.isfinite(dn)], df[np.isfinite(df)], rtol=1e-9, atol=1e-12)


def test_clipping_observers():
    rng = np.random.default_rng(8)
    g = rng.standard_normal(50_000).astype(np.float32); g[:5] = 30.0
    for ob, top in [(PercentileObserver(99.99), 5.0), (KLObserver(), 10.0)]:
        for part in np.array_split(g, 7): ob.observe(part)
        lo, hi = ob.clip_range()
        assert 1.0 < hi < top and lo < -1.0 and ob.max_val == 30.0
        s, z = ob.calculate_qparams()
        assert (s, z) == calculate_qparams(lo, hi, ob.dtype, ob.symmetric)
    # percentile close to numpy's (within two bins)
    for sym in (False, True):
        p = PercentileObserver(99.0, symmetric=sym); p.observe(g)
        lo, hi = p.clip_range()
        ref = np.percentile(np.abs(g), 99.0) if sym else np.percentile(g, 99.0)
        assert abs(hi - ref) <= 2 * p.histogram.width
        if not sym: assert abs(lo - np.percentile(g, 1.0)) <= 2 * p.histogram.width
        else: assert lo == -hi
    # MSE clips heavy tails (int4), and agrees with mse_range on the data (up to the histogram's resolution)
    lap = rng.laplace(size=50_000).astype(np.float32)
    m = MSEObserver(dtype='int4'); m.observe(lap[:10]); m.observe(lap[10:])
    lo, hi = m.clip_range()
    rlo, rhi = mse_range(lap, 'int4')
    assert hi < 0.8 * lap.max() and abs(hi - rhi) < 0.1 * lap.max() and abs(lo - rlo) < 0.1 * abs(lap.min())
    # KL on int4 uses 8 levels; with symmetric=False the threshold clips an asymmetric range
    assert KLObserver(dtype='int4').levels == 8 and KLObserver().levels == 128
    k = KLObserver(symmetric=False); k.observe(np.abs(g))
    lo, hi = k.clip_range()
    assert lo == float(np.abs(g).min()) and 1.0 < hi < 10.0
    for bad in (50, 100.5, 'x'):
        with pytest.raises(TinycompError, match="percentile must be"): PercentileObserver(percentile=bad)
    with pytest.raises(TinycompError, match="levels must be"): KLObserver(levels=4096)


def test_observers_accumulate_like_one_batch():
    rng = np.random.default_rng(9)
    x = rng.standard_normal(20_000).astype(np.float32)
    for cls in (MinMaxObserver, PercentileObserver, KLObserver, MSEObserver):
        a, b = cls(), cls()
        a.observe(x)
        for part in np.array_split(x, 4): b.observe(part)
        # the first batch fixes the histogram's layout; later ones grow it only if needed: compare with tolerance
        la, ha = a.clip_range(); lb, hb = b.clip_range()
        assert abs(ha - hb) <= 0.05 * x.max() and abs(la - lb) <= 0.05 * abs(x.min()), cls


# ---- mse_range ------------------------------------------------------------------------------------------------------

def brute_mse_range(x, dtype, symmetric, grid):
    x = np.asarray(x, np.float32)
    mn, mx = min(float(x.min()), 0.), max(float(x.max()), 0.)
    best, best_err = None, None
    for a in np.linspace(1 / grid, 1, grid):
        lo, hi = mn * a, mx * a
        s, z = ref_qparams(lo, hi, dtype, symmetric)
        xh = (ref_quantize(x, s, z, dtype).astype(np.int64) - z).astype(np.float32) * s
        err = float(np.mean((xh.astype(np.float64) - x) ** 2))
        if best_err is None or err <= best_err: best, best_err = (lo, hi), err       # '<=': ties -> widest
    return best


@pytest.mark.parametrize('dtype,symmetric', [('int8', False), ('int8', True), ('uint8', False), ('int4', True)])
def test_mse_range_matches_brute_force(dtype, symmetric):
    rng = np.random.default_rng(10)
    x = np.concatenate([rng.laplace(size=300), [9.0]]).astype(np.float32)
    got = mse_range(x, dtype, symmetric, grid=25)
    assert got == pytest.approx(brute_mse_range(x, dtype, symmetric, 25), abs=1e-12)
    assert all(isinstance(v, float) for v in got)


def test_mse_range_cases():
    u = np.random.default_rng(11).uniform(-1, 1, 5000).astype(np.float32)
    lo, hi = mse_range(u)
    assert lo < -0.95 and hi > 0.95
    assert mse_range(np.zeros(5)) == (0.0, 0.0)
    assert mse_range(np.full(4, 2.0), grid=4) == (0.0, 2.0)
    assert mse_range(np.full(4, -2.0), grid=4) == (-2.0, 0.0)
    assert mse_range(u) == mse_range(u)                                            # deterministic
    with pytest.raises(TinycompError, match="NaN"): mse_range(np.array([np.nan]))
    with pytest.raises(ShapeError, match="empty"): mse_range(np.array([]))
    for g in (0, -1, 2.5, True):
        with pytest.raises(TinycompError, match="grid must be a positive int"): mse_range(u, grid=g)


# ---- fixed-point multipliers ----------------------------------------------------------------------------------------

def test_quantize_multiplier_matches_reference():
    rng = np.random.default_rng(12)
    reals = np.concatenate([rng.uniform(0, 1, 500), 10 ** rng.uniform(-12, 12, 500),
                            (np.arange(2**30, 2**30 + 200) + 0.5) / 2**31 * 2.0 ** rng.integers(-20, 5, 200),  # exact halves
                            [0., 0.5, 0.25, 1.0, 0.75, 1 - 2**-40, 2.0**-31, 2.0**-32, 2.0**-31.5, 2.0**40, 2.0**31,
                             5e-324, 1e-300, (2**31 - 0.5) / 2**31, float(np.float32(0.1))]])
    m, s = quantize_multiplier(reals)
    assert m.dtype == np.int32 and s.dtype == np.int32 and m.shape == reals.shape
    for r, mi, si in zip(reals, m, s):
        assert (int(mi), int(si)) == ref_quantize_multiplier(float(r)), r
    assert quantize_multiplier(0.5) == (2**30, 0)
    assert quantize_multiplier(0.25) == (2**30, -1)
    assert quantize_multiplier(1.0) == (2**30, 1)
    assert quantize_multiplier(0.0) == (0, 0)
    assert quantize_multiplier(2.0**-40) == (0, 0)
    assert quantize_multiplier(2.0**40) == (2**31 - 1, 30)
    assert quantize_multiplier(1 - 2**-40) == (2**30, 1)
    m2, s2 = quantize_multiplier(np.full((2, 3), 0.3))
    assert m2.shape == (2, 3) and (m2 == m2[0, 0]).all()
    for bad in (-0.5, np.nan, np.inf, [0.1, -1e-9]):
        with pytest.raises(TinycompError, match="finite and >= 0"): quantize_multiplier(bad)
    with pytest.raises(TinycompError, match="numeric"): quantize_multiplier('0.5')


def test_srdhm_reference_is_vqrdmulh_rounding():
    "Sanity of the Python reference itself: SRDHM is floor(ab / 2^31 + 1/2) (ties toward +inf), except a = b = -2^31."
    rng = np.random.default_rng(13)
    for a, b in list(zip(rng.integers(-2**31, 2**31, 300).tolist(), rng.integers(-2**31, 2**31, 300).tolist())) + \
            [(-1, 2**30), (1, 2**30), (-3, 2**30), (3, 2**30), (2**31 - 1, 2**31 - 1), (-2**31, 2**31 - 1)]:
        assert ref_srdhm(a, b) == math.floor(Fraction(a * b, 2**31) + Fraction(1, 2))
    assert ref_srdhm(-1, 2**30) == 0 and ref_srdhm(1, 2**30) == 1             # -0.5 -> 0, 0.5 -> 1
    assert ref_rdbpot(-3, 1) == -2 and ref_rdbpot(3, 1) == 2 and ref_rdbpot(-5, 2) == -1   # ties away from zero


def test_multiply_by_quantized_multiplier_matches_reference():
    rng = np.random.default_rng(14)
    n = 3000
    acc = np.concatenate([rng.integers(-2**31, 2**31, n), rng.integers(-300, 300, n), rng.integers(-2**20, 2**20, n)])
    mult = np.concatenate([rng.integers(2**30, 2**31, n), rng.integers(-2**31, 2**31, n), np.full(n, 2**30)])
    shift = np.concatenate([rng.integers(-31, 31, n), rng.integers(-31, 1, n), rng.integers(-31, 3, n)])
    got = multiply_by_quantized_multiplier(acc, mult, shift)
    assert got.dtype == np.int32 and got.shape == acc.shape
    for a, m, s, g in zip(acc.tolist(), mult.tolist(), shift.tolist(), got.tolist()):
        assert g == ref_mbqm(a, m, s), (a, m, s, g)


def test_multiply_by_quantized_multiplier_hand_cases():
    f = multiply_by_quantized_multiplier
    acc = np.array([-7, -6, -5, -3, -2, -1, 0, 1, 2, 3, 5, 6, 7])
    # M = 0.5 (M0 = 2^30, shift 0): one rounding in SRDHM, ties toward +inf
    np.testing.assert_array_equal(f(acc, *quantize_multiplier(0.5)), [-3, -3, -2, -1, -1, 0, 0, 1, 1, 2, 3, 3, 4])
    # M = 0.25: SRDHM (ties up) then RDBPOT by 1 (ties away from zero); 1 * 0.25 -> 0.5 -> 1 -> 1 (double rounding)
    np.testing.assert_array_equal(f(acc, *quantize_multiplier(0.25)), [-2, -2, -1, -1, -1, 0, 0, 1, 1, 1, 2, 2, 2])
    # negative exact halves in RDBPOT: M = 0.125 on multiples of 4: -12/8 = -1.5 -> -2, 12/8 -> 2, -4/8 -> -1, 4/8 -> 1
    np.testing.assert_array_equal(f(np.array([-12, -4, 4, 12]), *quantize_multiplier(0.125)), [-2, -1, 1, 2])
    np.testing.assert_array_equal(f(acc, *quantize_multiplier(1.0)), acc)
    np.testing.assert_array_equal(f(acc, *quantize_multiplier(8.0)), 8 * acc)
    # values near 2^31
    np.testing.assert_array_equal(f(np.array([2**31 - 1, -2**31]), *quantize_multiplier(0.5)), [2**30, -2**30])
    np.testing.assert_array_equal(f(np.array([2**31 - 1, -2**31 + 1]), 2**31 - 1, 0), [2**31 - 2, -2**31 + 2])
    assert f(-2**31, -2**31, 0) == 2**31 - 1                                      # the saturating case
    np.testing.assert_array_equal(f(np.array([2**31 - 1, -2**31]), *quantize_multiplier(1.0)), [-1, 0])   # wraps, as TFLite
    assert f(12345, 0, 0) == 0
    # right shift 31 (the largest): tiny results
    assert f(2**31 - 1, 2**31 - 1, -31) == 1 and f(-2**31, 2**31 - 1, -31) == -1


def test_multiply_by_quantized_multiplier_broadcasting_and_errors():
    rng = np.random.default_rng(15)
    acc = rng.integers(-2**20, 2**20, (6, 7)).astype(np.int32)
    m, s = quantize_multiplier(10 ** rng.uniform(-4, 0, 6))
    out = multiply_by_quantized_multiplier(acc, m.reshape(6, 1), s.reshape(6, 1))
    assert out.shape == (6, 7) and out.dtype == np.int32
    for r in range(6):
        np.testing.assert_array_equal(out[r], multiply_by_quantized_multiplier(acc[r], m[r], s[r]))
    acc0 = acc.copy(); multiply_by_quantized_multiplier(acc, 2**30, -3); np.testing.assert_array_equal(acc, acc0)
    # away from the double-rounding window it is round(acc * M) exactly
    exact = acc * (m.astype(np.float64) * 2.0 ** (s.astype(np.float64) - 31)).reshape(6, 1)
    window = np.where(s < 0, 0.5 / 2.0 ** np.maximum(-s, 0), 0).reshape(6, 1) + 1e-6
    ok = np.abs(np.abs(exact - np.floor(exact)) - 0.5) > window
    np.testing.assert_array_equal(out[ok], np.round(exact[ok]))
    with pytest.raises(TinycompError, match="acc must be an integer array"): multiply_by_quantized_multiplier(np.array([1.5]), 2**30, 0)
    with pytest.raises(TinycompError, match="acc must lie in"): multiply_by_quantized_multiplier(np.array([2**31]), 2**30, 0)
    with pytest.raises(TinycompError, match="multiplier must lie in"): multiply_by_quantized_multiplier(1, 2**31, 0)
    with pytest.raises(TinycompError, match=r"shift must lie in \[-31, 30\]"): multiply_by_quantized_multiplier(1, 2**30, 31)
    with pytest.raises(TinycompError, match=r"shift must lie in \[-31, 30\]"): multiply_by_quantized_multiplier(1, 2**30, -32)
    with pytest.raises(ShapeError, match=r"\(M, 1\)"): multiply_by_quantized_multiplier(acc, m, s)


# ---- fake quantization ----------------------------------------------------------------------------------------------

def test_fake_quantize_forward_equals_integer_path():
    rng = np.random.default_rng(16)
    x = (rng.standard_normal((3, 4, 5, 5)) * 2).astype(np.float32)
    for dtype, sym in [('int8', False), ('uint8', False), ('int4', True), ('int8', True)]:
        s, z = calculate_qparams(x.min() * 0.6, x.max() * 0.6, dtype, sym)
        qmin, qmax, _ = QUANT_DTYPES[dtype]
        y = fake_quantize(x, s, z, qmin, qmax)
        assert isinstance(y, Tensor) and y.dtype == np.float32
        np.testing.assert_array_equal(y.data, dequantize(quantize_per_tensor(x, s, z, dtype), s, z))
    sc, zc = per_channel_qparams(x, axis=1)
    np.testing.assert_array_equal(fake_quantize(x, sc, zc, -128, 127, axis=1).data,
                                  dequantize(quantize_per_channel(x, sc, zc, 1), sc, zc, axis=1))
    # exact ties round half to even in the forward too
    np.testing.assert_array_equal(fake_quantize(np.array([0.5, 1.5, 2.5, -0.5], np.float32), 1.0, 0, -128, 127).data,
                                  [0., 2., 2., -0.])


def test_fake_quantize_ste_gradient():
    x = np.array([-3.0, -2.6, -2.4, -0.9, 0.0, 0.4, 0.9, 1.01, 1.1, 3.0])
    t = Tensor(x, requires_grad=True, dtype=np.float64)
    y = fake_quantize(t, 0.5, 1, -4, 3)         # integers round(x/0.5) + 1 inside [-4, 3]: x in [-2.5, 1.0] (roughly)
    g = np.arange(1., 11.)
    y.backward(g)
    u = np.round(x / 0.5) + 1
    np.testing.assert_array_equal(t.grad, g * ((u >= -4) & (u <= 3)))
    assert t.grad.dtype == np.float64
    assert t.grad[0] == 0 and t.grad[-1] == 0 and t.grad[4] == g[4]
    # gradcheck-like: equal to the central differences of the clamp surrogate away from its edges
    rng = np.random.default_rng(17)
    s, z, qmin, qmax = F32(0.05), -2, -10, 12
    lo_edge, hi_edge = (qmin - z) * float(s), (qmax - z) * float(s)
    xs = rng.uniform(-1.5, 1.5, 500)
    xs = xs[(np.abs(xs - lo_edge) > 0.05) & (np.abs(xs - hi_edge) > 0.05)]
    t = Tensor(xs, requires_grad=True, dtype=np.float64)
    v = rng.standard_normal(xs.shape)
    (fake_quantize(t, s, z, qmin, qmax) * Tensor(v, dtype=np.float64)).sum().backward()
    clamp = lambda a: np.clip(a, lo_edge, hi_edge)
    numeric = (clamp(xs + 1e-7) - clamp(xs - 1e-7)) / 2e-7 * v
    np.testing.assert_allclose(t.grad, numeric, atol=1e-6)
    assert (t.grad == 0).sum() > 50 and (t.grad != 0).sum() > 50            # both regions exercised
    # per channel: each channel clamps at its own range
    t = Tensor(np.array([[0.9, 1.1, -1.2], [0.9, 1.1, -1.2]], np.float32), requires_grad=True)
    fake_quantize(t, np.array([1 / 127, 2 / 127], np.float32), 0, -127, 127, axis=0).sum().backward()
    np.testing.assert_array_equal(t.grad, [[1, 0, 0], [1, 1, 1]])
    # no graph when the input does not require a gradient
    assert not fake_quantize(np.ones(3), 0.1, 0, -128, 127).requires_grad


def test_fake_quantize_errors():
    x = np.ones((4, 3), np.float32)
    with pytest.raises(TinycompError, match=r"qmin \(5\) must be smaller than qmax \(-5\)"): fake_quantize(x, 0.1, 0, 5, -5)
    with pytest.raises(TinycompError, match="qmin must be an int"): fake_quantize(x, 0.1, 0, -128.0, 127)
    with pytest.raises(TinycompError, match=r"outside \[-128, 127\]"): fake_quantize(x, 0.1, 200, -128, 127)
    with pytest.raises(TinycompError, match="scale must be finite and > 0"): fake_quantize(x, -0.1, 0, -128, 127)
    with pytest.raises(ShapeError, match="axis 0 of the input has length 4"): fake_quantize(x, [0.1, 0.2], 0, -128, 127, axis=0)
    with pytest.raises(ShapeError, match="single number"): fake_quantize(x, [0.1, 0.2, 0.3], 0, -128, 127)
    with pytest.raises(TinycompError, match="NaN"): fake_quantize(np.array([np.nan]), 0.1, 0, -128, 127)


# ---- BatchNorm folding ----------------------------------------------------------------------------------------------

def random_bn(c, rng, affine=True):
    bn = BatchNorm2d(c, eps=1e-3, affine=affine)
    if affine:
        bn.weight.data = (rng.uniform(0.3, 3.0, c) * rng.choice([-1, 1], c)).astype(np.float32)
        bn.bias.data = rng.standard_normal(c).astype(np.float32)
    bn.running_mean[:] = rng.standard_normal(c) * 2
    bn.running_var[:] = rng.uniform(0.05, 5.0, c)
    return bn.eval()


@pytest.mark.parametrize('cfg', [
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1),
    dict(in_channels=3, out_channels=5, kernel_size=3, padding=1, bias=False),
    dict(in_channels=4, out_channels=8, kernel_size=(3, 2), stride=2, padding=(1, 0), groups=2),
    dict(in_channels=6, out_channels=6, kernel_size=3, padding=2, dilation=2, groups=6, bias=False),
    dict(in_channels=4, out_channels=12, kernel_size=1, groups=4),
])
@pytest.mark.parametrize('affine', [True, False])
def test_fold_batchnorm(cfg, affine):
    rng = np.random.default_rng(18)
    manual_seed(0)
    conv = Conv2d(**cfg)
    if conv.bias is not None: conv.bias.data = rng.standard_normal(conv.out_channels).astype(np.float32)
    bn = random_bn(cfg['out_channels'], rng, affine)
    before = {k: np.array(v, copy=True) for k, v in {**conv.state_dict(), **bn.state_dict()}.items()}
    state = default_generator().bit_generator.state
    fused = fold_batchnorm(conv, bn)
    assert default_generator().bit_generator.state == state                       # no random numbers consumed
    assert isinstance(fused, Conv2d) and fused is not conv and fused.bias is not None
    assert fused.config() == {**conv.config(), 'bias': True}
    assert fused.weight.dtype == np.float32 and fused.bias.dtype == np.float32
    after = {**conv.state_dict(), **bn.state_dict()}
    assert all(np.array_equal(v, after[k]) for k, v in before.items())           # inputs untouched
    x = Tensor(rng.standard_normal((2, cfg['in_channels'], 9, 8)).astype(np.float32))
    with no_grad(): ref, out = bn(conv(x)).data, fused(x).data
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-4 * np.abs(ref).max())
    # the formula, in float64
    f = (bn.weight.data if affine else 1.0) / np.sqrt(bn.running_var.astype(np.float64) + bn.eps)
    b = conv.bias.data if conv.bias is not None else 0.0
    np.testing.assert_allclose(fused.bias.data, (b - bn.running_mean) * f + (bn.bias.data if affine else 0.0), rtol=1e-6, atol=1e-6)


def test_fold_batchnorm_uses_running_stats_in_training_mode_and_errors():
    rng = np.random.default_rng(19)
    conv, bn = Conv2d(2, 3, 3), random_bn(3, rng)
    bn.train()
    fused = fold_batchnorm(conv, bn)
    bn.eval()
    x = Tensor(rng.standard_normal((1, 2, 5, 5)).astype(np.float32))
    with no_grad(): np.testing.assert_allclose(fused(x).data, bn(conv(x)).data, rtol=1e-4, atol=1e-5)
    with pytest.raises(ShapeError, match="has 4 channels but the Conv2d has 3"): fold_batchnorm(conv, BatchNorm2d(4))
    with pytest.raises(TinycompError, match="conv must be a Conv2d"): fold_batchnorm(bn, bn)
    with pytest.raises(TinycompError, match="bn must be a BatchNorm2d"): fold_batchnorm(conv, conv)
    bad = random_bn(3, rng); bad.running_var[0] = np.nan
    with pytest.raises(TinycompError, match="running statistics"): fold_batchnorm(conv, bad)


# ---- int4 packing ---------------------------------------------------------------------------------------------------

def test_pack_unpack_int4():
    assert pack_int4(np.array([1, 2], np.int8)).tolist() == [0x21]
    assert pack_int4(np.array([-1, -8, 7], np.int8)).tolist() == [0x8F, 0x07]
    assert pack_int4(np.array([-8, 7], np.int8)).tolist() == [0x78]
    packed = pack_int4(np.array([], np.int8))
    assert packed.dtype == np.uint8 and packed.size == 0
    values = np.arange(-8, 8, dtype=np.int8)
    for order in (values, values[::-1], np.roll(values, 3)):
        p = pack_int4(order)
        assert p.dtype == np.uint8 and p.shape == (8,)
        np.testing.assert_array_equal(unpack_int4(p, 16), order)
    # every pair of values, both nibbles
    a, b = np.meshgrid(values, values)
    pairs = np.stack([a.ravel(), b.ravel()], axis=1).reshape(-1)
    p = pack_int4(pairs)
    np.testing.assert_array_equal(p, ((pairs[0::2] & 15) | ((pairs[1::2] & 15) << 4)).astype(np.uint8))
    np.testing.assert_array_equal(unpack_int4(p, pairs.size), pairs)
    rng = np.random.default_rng(20)
    for n in range(0, 12):
        v = rng.integers(-8, 8, n).astype(np.int8)
        p = pack_int4(v)
        assert len(p) == (n + 1) // 2
        out = unpack_int4(p, n)
        assert out.dtype == np.int8
        np.testing.assert_array_equal(out, v)
        if n % 2: assert p[-1] >> 4 == 0                                          # padded with 0
    m = rng.integers(-8, 8, (3, 5)).astype(np.int32)                              # any integer type, flattened in C order
    np.testing.assert_array_equal(unpack_int4(pack_int4(m), 15), m.ravel())
    np.testing.assert_array_equal(unpack_int4(np.array([0x8F, 0x07], np.uint8), 2), [-1, -8])
    with pytest.raises(TinycompError, match=r"must lie in \[-8, 7\]"): pack_int4(np.array([8]))
    with pytest.raises(TinycompError, match=r"must lie in \[-8, 7\]"): pack_int4(np.array([-9]))
    with pytest.raises(TinycompError, match="integer array"): pack_int4(np.array([0.5]))
    with pytest.raises(TinycompError, match="np.uint8 array"): unpack_int4(np.array([1], np.int8), 2)
    with pytest.raises(TinycompError, match=r"n must be an int in \[0, 2\]"): unpack_int4(np.array([1], np.uint8), 3)
    with pytest.raises(TinycompError, match="n must be an int"): unpack_int4(np.array([1], np.uint8), -1)
