"Tests of tinycomp.quantization.kernels and .int8_conv: bit-exactness of the fast integer kernels, bounds and errors."
import numpy as np
import pytest

from tinycomp.conv import conv2d_forward
from tinycomp.pooling import adaptive_avg_pool2d, max_pool2d
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.quantization.core import multiply_by_quantized_multiplier, quantize_multiplier
from tinycomp.profiling.timing import set_threads, thread_info, usable_cores
from tinycomp.quantization import int8_conv as K
from tinycomp.quantization.analysis import format_benchmark, int8_conv_benchmark
from tinycomp.quantization.int8_conv import quantized_conv2d, quantized_linear
from tinycomp.quantization.kernels import (MAX_REDUCTION, _mbqm, int8_matmul, quantized_adaptive_avg_pool2d,
                                           quantized_conv2d_naive, quantized_max_pool2d, requantize)

pytestmark = pytest.mark.module04

# every kernel level this CPU runs ('vnni', 'avx2', 'loops' on an AVX-512 VNNI machine; 'loops' alone on ARM);
# TINYCOMP_INT8_KERNEL=avx2|loops caps the list, to test the lower levels on their own
KERNELS = ['auto'] + list(K.KERNEL_LEVELS)


def case(rng, n, c, h, w, cout, kh, kw, groups=1, xdtype=np.int8, extreme=False, shifts=(-12, -6)):
    "Random quantized conv arguments; per-channel multipliers with shifts in `shifts`."
    lo, hi = (-128, 128) if xdtype == np.int8 else (0, 256)
    xq = rng.integers(lo, hi, (n, c, h, w)).astype(xdtype)
    wq = rng.integers(-127, 128, (cout, c // groups, kh, kw)).astype(np.int8)
    if extreme:
        xq[..., ::2] = lo; xq[..., 1::2] = hi - 1
        wq[::2] = 127; wq[1::2] = -127
    bias = rng.integers(-30000, 30000, cout).astype(np.int32)
    mult = rng.integers(2**30, 2**31 - 1, cout).astype(np.int32)
    shift = rng.integers(shifts[0], shifts[1] + 1, cout).astype(np.int32)
    zx = int(rng.integers(lo, hi))
    return xq, zx, wq, bias, mult, shift


def reference(xq, zx, wq, bias, mult, shift, zp, qmin, qmax, stride=1, padding=0, dilation=1, groups=1):
    "Independent reference: float64 conv of (xq - zx) (exact), int64 bias, core's requantization."
    acc = conv2d_forward(xq.astype(np.float64) - zx, wq.astype(np.float64), None, stride, padding, dilation, groups)
    acc = np.rint(acc).astype(np.int64) + (0 if bias is None else bias.astype(np.int64)[None, :, None, None])
    assert np.abs(acc).max() < 2**31
    r = multiply_by_quantized_multiplier(acc.astype(np.int32), mult[None, :, None, None], shift[None, :, None, None])
    return np.clip(r.astype(np.int64) + zp, qmin, qmax)


GEOMETRIES = [  # (n, c, h, w, cout, kh, kw, stride, padding, dilation, groups)
    (1, 3, 9, 9, 8, 3, 3, 1, 1, 1, 1),
    (2, 8, 10, 7, 16, 3, 3, 2, 1, 1, 1),          # stride 2 with padding
    (3, 5, 8, 8, 20, 3, 3, 1, 0, 1, 1),           # padding 0, C not a multiple of 4
    (2, 6, 9, 11, 7, 3, 3, 1, 2, 1, 1),           # padding 2
    (1, 4, 12, 12, 33, 3, 3, 1, 2, 2, 1),         # dilation 2, Cout over two vectors
    (2, 8, 7, 7, 12, 3, 3, 1, 1, 1, 2),           # groups 2, Cout != groups
    (2, 6, 7, 8, 6, 3, 3, 1, 1, 1, 6),            # depthwise
    (2, 6, 7, 8, 12, 3, 3, 2, 1, 1, 6),           # depthwise multiplier 2
    (4, 16, 5, 5, 40, 1, 1, 1, 0, 1, 1),          # 1x1
    (2, 5, 9, 10, 17, 2, 3, (2, 1), (1, 0), (1, 2), 1),   # non-square kernel, per-axis geometry
    (1, 12, 6, 6, 64, 3, 1, 1, (1, 0), 1, 1),     # 3x1 kernel, 4 vectors of 16 channels
    (5, 9, 6, 5, 48, 3, 3, 1, 1, 1, 3),           # groups 3 with 16 channels each
    (1, 64, 14, 14, 64, 3, 3, 1, 1, 1, 1),        # a real layer
]


@pytest.mark.parametrize('geom', GEOMETRIES)
@pytest.mark.parametrize('kernel', KERNELS)
def test_conv_bit_exact(geom, kernel):
    n, c, h, w, cout, kh, kw, stride, padding, dilation, groups = geom
    rng = np.random.default_rng(hash(geom) % 2**32)
    xq, zx, wq, bias, mult, shift = case(rng, n, c, h, w, cout, kh, kw, groups)
    kw_ = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    naive = quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 3, **kw_)
    fast = quantized_conv2d(xq, zx, wq, bias, mult, shift, 3, **kw_, kernel=kernel)
    assert fast.dtype == np.int8 and naive.dtype == np.int8
    np.testing.assert_array_equal(fast, naive)
    np.testing.assert_array_equal(naive, reference(xq, zx, wq, bias, mult, shift, 3, -128, 127, **kw_))
    assert len(np.unique(fast)) > 20            # the test exercises many output values, not just the clamps


@pytest.mark.parametrize('kernel', KERNELS)
def test_conv_uint8_input_and_output(kernel):
    rng = np.random.default_rng(1)
    xq, zx, wq, bias, mult, shift = case(rng, 2, 7, 8, 9, 24, 3, 3, xdtype=np.uint8)
    for dtype, zp, qmin, qmax in (('int8', -7, -128, 127), ('uint8', 120, 0, 255)):
        naive = quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, zp, qmin, qmax, padding=1, dtype=dtype)
        fast = quantized_conv2d(xq, zx, wq, bias, mult, shift, zp, qmin, qmax, padding=1, dtype=dtype, kernel=kernel)
        assert fast.dtype == np.dtype(dtype)
        np.testing.assert_array_equal(fast, naive)


@pytest.mark.parametrize('kernel', KERNELS)
def test_conv_extremes_relu_and_shifts(kernel):
    rng = np.random.default_rng(2)
    # extreme values -128/127 in the input and +-127 in the weights, zero points at the ends of the range
    for zx in (-128, 127, 0):
        xq, _, wq, bias, mult, shift = case(rng, 2, 9, 6, 6, 20, 3, 3, extreme=True)
        naive = quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 0, padding=1)
        np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, bias, mult, shift, 0, padding=1, kernel=kernel), naive)
    # fused ReLU: qmin = out_zero_point
    xq, zx, wq, bias, mult, shift = case(rng, 2, 8, 7, 7, 16, 3, 3)
    relu = quantized_conv2d(xq, zx, wq, bias, mult, shift, -20, -20, 127, padding=1, kernel=kernel)
    assert relu.min() == -20
    np.testing.assert_array_equal(relu, np.maximum(quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, -20, padding=1), -20))
    # per-channel shifts of both signs (left shifts wrap like TFLite's int32 shift)
    xq, zx, wq, bias, mult, shift = case(rng, 1, 4, 6, 6, 16, 1, 1, shifts=(-3, 3))
    mult = rng.integers(2**30, 2**31 - 1, 16).astype(np.int32)
    shift = np.array([-31, -20, -1, 0, 1, 2, 5, 30] * 2, np.int32)
    np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, bias, mult, shift, 1, kernel=kernel),
                                  quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 1))
    # no bias, a zero multiplier
    mult[3] = 0
    np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, None, mult, shift, 1, kernel=kernel),
                                  quantized_conv2d_naive(xq, zx, wq, None, mult, shift, 1))


def test_mbqm_matches_core():
    "The Numba scalar requantization is bit-exact with core.multiply_by_quantized_multiplier, extremes included."
    rng = np.random.default_rng(3)
    acc = np.concatenate([rng.integers(-2**31, 2**31, 3000), [-2**31, 2**31 - 1, 0, 1, -1, 2**30, -2**30]])
    mult = np.concatenate([rng.integers(0, 2**31, 3000), [2**31 - 1, 2**30, 0, 1, 2**31 - 1, 2**30 + 1, 1]])
    shift = np.concatenate([rng.integers(-31, 31, 3000), [30, -31, 0, 5, -1, 3, -30]])
    want = multiply_by_quantized_multiplier(acc, mult, shift)
    got = np.array([_mbqm(int(a), int(m), int(s)) for a, m, s in zip(acc, mult, shift)])
    np.testing.assert_array_equal(got, want)
    # the vectorised 32-bit tile version of the drivers too (multipliers >= 0, as quantize_multiplier gives them)
    for lanes in (1, 16, acc.size):
        rows = acc.size // lanes
        lp = np.stack([np.zeros(lanes), mult[:lanes], np.maximum(shift[:lanes], 0), np.maximum(-shift[:lanes], 0)]).astype(np.int32)
        r = np.empty(rows * lanes, np.int64)
        K._requant_rows(acc[:rows * lanes].astype(np.int32), rows, lanes, lp, 0, -2**40, 2**40, r)
        np.testing.assert_array_equal(r, multiply_by_quantized_multiplier(acc[:rows * lanes], np.tile(mult[:lanes], rows),
                                                                          np.tile(shift[:lanes], rows)))


def test_int8_matmul_and_requantize():
    rng = np.random.default_rng(4)
    w = rng.integers(-127, 128, (6, 50)).astype(np.int8)
    x = rng.integers(0, 256, (50, 9)).astype(np.uint8)
    b = rng.integers(-10**6, 10**6, 6).astype(np.int32)
    acc = int8_matmul(w, x, 131, b)
    assert acc.dtype == np.int32
    np.testing.assert_array_equal(acc, w.astype(np.int64) @ (x.astype(np.int64) - 131) + b[:, None])
    x0 = x.copy(); int8_matmul(w, x, 131, b); np.testing.assert_array_equal(x, x0)     # inputs untouched
    mult, shift = quantize_multiplier(rng.uniform(1e-5, 1e-3, 6))
    q = requantize(acc, mult, shift, 4)
    want = np.clip(multiply_by_quantized_multiplier(acc, mult[:, None], shift[:, None]).astype(np.int64) + 4, -128, 127)
    np.testing.assert_array_equal(q, want)
    assert q.dtype == np.int8
    np.testing.assert_array_equal(requantize(acc, mult, shift, 4, qmin=4), np.maximum(want, 4))
    assert requantize(acc, mult, shift, 200, 0, 255, 'uint8').dtype == np.uint8


def test_overflow_bound():
    assert MAX_REDUCTION == (2**31 - 1) // (127 * 255)
    assert MAX_REDUCTION * 127 * 255 < 2**31 <= (MAX_REDUCTION + 1) * 127 * 255
    w = np.ones((1, MAX_REDUCTION + 1), np.int8)
    x = np.ones((MAX_REDUCTION + 1, 1), np.int8)
    with pytest.raises(TinycompError, match='overflow'):
        int8_matmul(w, x, 0)
    int8_matmul(w[:, :MAX_REDUCTION], x[:MAX_REDUCTION], 0)                       # at the bound: fine
    with pytest.raises(TinycompError, match='MAX_REDUCTION'):
        int8_matmul(w[:, :MAX_REDUCTION], x[:MAX_REDUCTION], 0, np.array([10**6], np.int32))   # the bias counts
    big_c = MAX_REDUCTION // 9 + 1                                                 # a 3x3 conv with too many channels
    xq = np.zeros((1, big_c, 3, 3), np.int8)
    wq = np.zeros((1, big_c, 3, 3), np.int8)
    for fn in (quantized_conv2d, quantized_conv2d_naive):
        with pytest.raises(TinycompError, match='overflow'):
            fn(xq, 0, wq, None, [2**30], [0], 0)
    with pytest.raises(TinycompError, match='overflow'):
        quantized_linear(np.zeros((1, MAX_REDUCTION + 1), np.int8), 0, np.zeros((1, MAX_REDUCTION + 1), np.int8), None, [1], [0], 0)


def test_bad_inputs():
    rng = np.random.default_rng(5)
    xq, zx, wq, bias, mult, shift = case(rng, 1, 4, 5, 5, 8, 3, 3)
    for fn in (quantized_conv2d, quantized_conv2d_naive):
        with pytest.raises(TinycompError, match='int8 or uint8'):
            fn(xq.astype(np.int16), zx, wq, bias, mult, shift, 0)
        with pytest.raises(TinycompError, match='integers'):
            fn(xq.astype(np.float32), zx, wq, bias, mult, shift, 0)
        with pytest.raises(TinycompError, match='wq must be int8'):
            fn(xq, zx, wq.astype(np.int32), bias, mult, shift, 0)
        with pytest.raises(ShapeError, match='4-D'):
            fn(xq[0], zx, wq, bias, mult, shift, 0)
        with pytest.raises(ShapeError, match='channels'):
            fn(xq[:, :3], zx, wq, bias, mult, shift, 0)
        with pytest.raises(ShapeError, match='bias'):
            fn(xq, zx, wq, bias[:5], mult, shift, 0)
        with pytest.raises(ShapeError, match='one value per output channel'):
            fn(xq, zx, wq, bias, mult[:3], shift[:3], 0)
        with pytest.raises(TinycompError, match='outside'):
            fn(xq, 300, wq, bias, mult, shift, 0)
        with pytest.raises(TinycompError, match='qmin'):
            fn(xq, zx, wq, bias, mult, shift, 0, 10, 5)
        with pytest.raises(TinycompError, match='shift'):
            fn(xq, zx, wq, bias, mult, np.full(8, 40), 0)
        with pytest.raises(ShapeError, match='too small'):
            fn(xq[:, :, :2, :2], zx, wq, bias, mult, shift, 0)
        with pytest.raises(ShapeError, match='groups'):
            fn(xq, zx, wq[:, :2], bias, mult, shift, 0, groups=3)
    with pytest.raises(TinycompError, match='kernel'):
        quantized_conv2d(xq, zx, wq, bias, mult, shift, 0, kernel='fast')
    with pytest.raises(ShapeError, match='features'):
        quantized_linear(np.zeros((2, 5), np.int8), 0, np.zeros((3, 4), np.int8), None, [1, 1, 1], [0, 0, 0], 0)
    with pytest.raises(TinycompError, match='dtype'):
        requantize(np.zeros((2, 2), np.int32), [1, 1], [0, 0], 0, dtype='float32')
    with pytest.raises(TinycompError, match='integers'):
        quantized_max_pool2d(np.zeros((1, 1, 4, 4), np.float32), 2)
    with pytest.raises(TinycompError, match='int8 or uint8'):
        quantized_max_pool2d(np.zeros((1, 1, 4, 4), np.int32), 2)
    with pytest.raises(ShapeError, match='4-D'):
        quantized_adaptive_avg_pool2d(np.zeros((4, 4), np.int8), 1)
    with pytest.raises(ShapeError, match='half the kernel'):
        quantized_max_pool2d(np.zeros((1, 1, 4, 4), np.int8), 2, padding=2)


@pytest.mark.parametrize('kernel', KERNELS)
def test_linear(kernel):
    rng = np.random.default_rng(6)
    for n, k, m in ((1, 10, 3), (7, 64, 40), (33, 37, 70)):
        xq = rng.integers(-128, 128, (n, k)).astype(np.int8)
        wq = rng.integers(-127, 128, (m, k)).astype(np.int8)
        b = rng.integers(-5000, 5000, m).astype(np.int32)
        mult, shift = quantize_multiplier(rng.uniform(1e-4, 5e-3, m))
        want = requantize(int8_matmul(wq, xq.T.copy(), -9, b), mult, shift, 2).T
        got = quantized_linear(xq, -9, wq, b, mult, shift, 2, kernel=kernel)
        assert got.shape == (n, m) and got.dtype == np.int8
        np.testing.assert_array_equal(got, want)


def test_max_pool():
    rng = np.random.default_rng(7)
    for dtype, lo, hi in ((np.int8, -128, 128), (np.uint8, 0, 256)):
        x = rng.integers(lo, hi, (2, 3, 9, 8)).astype(dtype)
        x[0, 0] = lo                                   # padding must never win, even against the minimum
        for ks, st, pad in ((2, None, 0), (3, 2, 1), ((3, 2), (1, 2), (1, 1)), (3, 1, 1)):
            got = quantized_max_pool2d(x, ks, st, pad)
            want = np.asarray(max_pool2d(x.astype(np.float32), ks, st, pad).data)
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, want.astype(dtype))
        assert quantized_max_pool2d(x, 3, 2, 1)[0, 0].max() == lo


def test_adaptive_avg_pool_rounding():
    # means 1.5, 2.5, -1.5, -2.5, 0.5, -0.5: halves go to the even neighbour
    x = np.array([[[[1, 2]], [[2, 3]], [[-1, -2]], [[-2, -3]], [[0, 1]], [[0, -1]]]], np.int8)
    np.testing.assert_array_equal(quantized_adaptive_avg_pool2d(x, 1)[0, :, 0, 0], [2, 2, -2, -2, 0, 0])
    # thirds round to the nearest
    x = np.array([[[[1, 1, 2]], [[2, 2, 1]], [[-1, -1, -2]], [[127, 127, 127]], [[-128, -128, -127]]]], np.int8)
    np.testing.assert_array_equal(quantized_adaptive_avg_pool2d(x, 1)[0, :, 0, 0], [1, 2, -1, 127, -128])
    rng = np.random.default_rng(8)
    for dtype, lo, hi in ((np.int8, -128, 128), (np.uint8, 0, 256)):
        x = rng.integers(lo, hi, (2, 5, 7, 9)).astype(dtype)
        for size in (1, (3, 2), (7, 9), (4, 5)):
            got = quantized_adaptive_avg_pool2d(x, size)
            want = np.round(np.asarray(adaptive_avg_pool2d(x.astype(np.float64), size).data))
            assert got.dtype == dtype
            np.testing.assert_array_equal(got, want.astype(dtype))


def test_benchmark_rows_and_threads_restored():
    before = thread_info()['numba']
    other = 1 if before != 1 else min(2, K.numba.config.NUMBA_NUM_THREADS, usable_cores())
    set_threads(other)
    try:
        rows = int8_conv_benchmark(shapes=((2, 4, 6, 6, 8),), repeats=2, threads=1, levels=K.KERNEL_LEVELS)
        assert thread_info()['numba'] == other                    # the caller's setting is back
    finally:
        set_threads(before)
    r = rows[0]
    assert len(rows) == 1 and r['int8_ms'] > 0 and r['float32_ms'] > 0 and r['threads'] == 1
    for level in K.KERNEL_LEVELS:
        assert r[f'{level}_ms'] > 0 and r[f'{level}_speedup'] > 0
    table = format_benchmark(rows)
    assert 'auto/f32' in table and all(f'{level}/f32' in table for level in K.KERNEL_LEVELS)
    with pytest.raises(TinycompError, match='kernel'):
        int8_conv_benchmark(shapes=((1, 4, 6, 6, 8),), repeats=1, levels=('fast',))


@pytest.mark.parametrize('kernel', KERNELS)
def test_prepacked_weights(kernel):
    rng = np.random.default_rng(9)
    for geom in GEOMETRIES[:8]:
        n, c, h, w, cout, kh, kw, stride, padding, dilation, groups = geom
        xq, zx, wq, bias, mult, shift = case(rng, n, c, h, w, cout, kh, kw, groups)
        kw_ = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
        packed = K.pack_conv_weights(wq, groups, kernel=kernel)
        assert packed.level in K.KERNEL_LEVELS and packed.shape == wq.shape
        want = quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 3, **kw_)
        for _ in range(2):                                          # reused: the packed weights are not modified
            np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, bias, mult, shift, 3, **kw_, packed=packed), want)
        np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, None, mult, shift, 3, **kw_, packed=packed),
                                      quantized_conv2d_naive(xq, zx, wq, None, mult, shift, 3, **kw_))


def test_prepacked_weights_errors():
    rng = np.random.default_rng(10)
    xq, zx, wq, bias, mult, shift = case(rng, 1, 8, 6, 6, 16, 3, 3)
    packed = K.pack_conv_weights(wq)
    with pytest.raises(ShapeError, match='packed weights are for'):
        quantized_conv2d(xq[:, :4], zx, wq[:, :4], bias, mult, shift, 0, packed=packed)
    with pytest.raises(ShapeError, match='packed weights are for'):
        quantized_conv2d(xq, zx, wq[:, :4], bias, mult, shift, 0, groups=2, packed=packed)
    with pytest.raises(TinycompError, match='pack_conv_weights'):
        quantized_conv2d(xq, zx, wq, bias, mult, shift, 0, packed=(wq,))
    other = [lv for lv in K.KERNEL_LEVELS if lv != packed.level]
    if other:
        with pytest.raises(TinycompError, match='packed for kernel'):
            quantized_conv2d(xq, zx, wq, bias, mult, shift, 0, kernel=other[0], packed=packed)
    with pytest.raises(ShapeError, match='groups'):
        K.pack_conv_weights(wq, groups=3)
    with pytest.raises(TinycompError, match='int8'):
        K.pack_conv_weights(wq.astype(np.int16))
    with pytest.raises(TinycompError, match='kernel'):
        K.pack_conv_weights(wq, kernel='fast')


@pytest.mark.parametrize('kernel', KERNELS)
def test_packed_memo_is_never_stale(kernel):
    "The packed object remembers layouts per call signature, keyed by value: new values or in-place edits recompute."
    rng = np.random.default_rng(12)
    xq, zx, wq, bias, mult, shift = case(rng, 2, 8, 7, 7, 24, 3, 3)
    packed = K.pack_conv_weights(wq, kernel=kernel)
    run = lambda xq_, zx_, b, m, s, zp=3, **kw: quantized_conv2d(xq_, zx_, wq, b, m, s, zp, padding=1, packed=packed, **kw)
    want = lambda xq_, zx_, b, m, s, zp=3, **kw: quantized_conv2d_naive(xq_, zx_, wq, b, m, s, zp, padding=1, **kw)
    np.testing.assert_array_equal(run(xq, zx, bias, mult, shift), want(xq, zx, bias, mult, shift))
    assert len(packed.memo) == 2                                    # requantization lanes + geometry
    bias[:5] += 1000; mult[3] //= 3; shift[7] -= 2                  # edited in place: same objects, new values
    np.testing.assert_array_equal(run(xq, zx, bias, mult, shift), want(xq, zx, bias, mult, shift))
    np.testing.assert_array_equal(run(xq, zx - 7, bias, mult, shift, zp=-9), want(xq, zx - 7, bias, mult, shift, zp=-9))
    np.testing.assert_array_equal(run(xq, zx, None, mult, shift, qmin=3), want(xq, zx, None, mult, shift, qmin=3))
    np.testing.assert_array_equal(run(xq, zx, bias, int(mult[0]), int(shift[0])), want(xq, zx, bias, mult[0], shift[0]))
    xs = rng.integers(-128, 128, (1, 8, 5, 9)).astype(np.int8)     # another input shape, then a uint8 input
    np.testing.assert_array_equal(run(xs, zx, bias, mult, shift), want(xs, zx, bias, mult, shift))
    xu = (xq.astype(np.int16) + 128).astype(np.uint8)
    np.testing.assert_array_equal(run(xu, 200, bias, mult, shift, dtype='uint8', qmin=0, qmax=255),
                                  want(xu, 200, bias, mult, shift, dtype='uint8', qmin=0, qmax=255))
    with pytest.raises(TinycompError, match='int8 or uint8'):      # a list: no memo, the full checks
        run(xq.tolist(), zx, bias, mult, shift)
    for i in range(3 * K._MEMO_SIZE):                               # bounded
        run(xq, zx, bias + i, mult, shift)
    assert len(packed.memo) <= K._MEMO_SIZE


def test_packed_memo_still_checks_every_call():
    "A remembered call does not let a later bad call through: each new argument value is checked in full."
    rng = np.random.default_rng(13)
    xq, zx, wq, bias, mult, shift = case(rng, 1, 8, 6, 6, 16, 3, 3)
    packed = K.pack_conv_weights(wq)
    ok = quantized_conv2d(xq, zx, wq, bias, mult, shift, 0, packed=packed)
    call = lambda **kw: quantized_conv2d(**{**dict(xq=xq, x_zero_point=zx, wq=wq, bias=bias, multiplier=mult,
                                                   shift=shift, out_zero_point=0, packed=packed), **kw})
    with pytest.raises(TinycompError, match='multiplier must lie'):
        call(multiplier=-mult)
    with pytest.raises(TinycompError, match='shift must lie'):
        call(shift=shift - 40)
    with pytest.raises(ShapeError, match='bias must have shape'):
        call(bias=bias[:3])
    with pytest.raises(TinycompError, match='int8 or uint8'):
        call(xq=xq.astype(np.int16))
    with pytest.raises(TinycompError, match='integers'):
        call(xq=xq.astype(np.float32))
    with pytest.raises(ShapeError):
        call(xq=xq[:, :5])                                          # wrong channel count
    with pytest.raises(ShapeError):
        call(xq=xq[0])                                              # 3-D
    with pytest.raises(TinycompError, match='outside'):
        call(x_zero_point=300)
    with pytest.raises(TinycompError, match='overflow'):
        call(bias=np.full(16, 2**31 - 1, np.int32))
    with pytest.raises(ShapeError, match='packed weights are for'):
        call(wq=wq[:8], bias=bias[:8], multiplier=mult[:8], shift=shift[:8])
    with pytest.raises(ShapeError, match='packed weights are for'):
        call(wq=wq[:, :4], xq=xq[:, :8], groups=2)
    with pytest.raises(TinycompError, match='wq must be int8'):
        call(wq=wq.astype(np.int16))
    with pytest.raises(TinycompError, match='kernel must be'):
        call(kernel='fast')
    np.testing.assert_array_equal(call(), ok)                      # and the good call still runs from the memo


@pytest.mark.parametrize('kernel', KERNELS)
def test_serial_and_parallel_drivers_agree(kernel, monkeypatch):
    "Small convs run serially (no thread launch), big ones in parallel: both paths bit-exact."
    rng = np.random.default_rng(14)
    xq, zx, wq, bias, mult, shift = case(rng, 3, 12, 9, 8, 40, 3, 3)
    want = quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 2, padding=1)
    before = thread_info()['numba']
    set_threads(min(2, K.numba.config.NUMBA_NUM_THREADS, usable_cores()))
    try:
        for macs in (0, 1 << 62):
            monkeypatch.setattr(K, 'PARALLEL_MACS', macs)
            np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, bias, mult, shift, 2, padding=1, kernel=kernel), want)
    finally:
        set_threads(before)


@pytest.mark.parametrize('level', [lv for lv in K.KERNEL_LEVELS if lv != 'loops'])
@pytest.mark.parametrize('groups, stride, padding', [(1, 1, 1), (2, 2, 0), (1, 2, 1)])
def test_the_drivers_read_and_write_nhwc_too(level, groups, stride, padding):
    "The layout module 08's runtime keeps int8 activations in: NHWC in (x_nhwc) and out (channel stride 1), bit-exact."
    rng = np.random.default_rng(15)
    xq, zx, wq, bias, mult, shift = case(rng, 3, 12, 9, 8, 40, 3, 3, groups=groups)
    want = quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 2, stride=stride, padding=padding, groups=groups)
    packed = K.pack_conv_weights(wq, groups, kernel=level)
    rq = K._requant_entry(xq, zx, wq, bias, mult, shift, 2, -128, 127, stride, padding, 1, groups, 'int8', level, packed)
    ge = K._geometry_entry(xq.shape, wq.shape, stride, padding, 1, groups, packed, nhwc=True)
    out = np.empty(want.transpose(0, 2, 3, 1).shape, np.int8)
    serial, _ = K._DRIVERS[level][packed.mv]
    serial(np.ascontiguousarray(xq.transpose(0, 2, 3, 1)).view(np.uint8), True, rq['flip'], rq['add'], rq['padv'],
           ge['geom'][2], ge['geom'][3], wq.shape[1], packed.cgp, np.empty(ge['xpshape'], ge['xpdtype']), packed.weights,
           ge['base'], ge['obase'], ge['koff'], rq['lp'], rq['zp'], rq['qmin'], rq['qmax'], groups, 40 // groups, 1,
           out.view(np.uint8), *K._scratch(level, packed.mv, True), K.NO_ADD, K.NO_ADD)
    np.testing.assert_array_equal(out.transpose(0, 3, 1, 2), want)


def test_kernel_levels_and_env(monkeypatch):
    "Levels follow the CPU features, best first; TINYCOMP_INT8_KERNEL caps them."
    assert K.KERNEL_LEVELS[-1] == 'loops' and list(K.KERNEL_LEVELS) == [lv for lv in K._LEVELS if lv in K.KERNEL_LEVELS]
    assert K.HAS_VNNI == ('vnni' in K.KERNEL_LEVELS) and K.HAS_AVX2 == ('avx2' in K.KERNEL_LEVELS)
    monkeypatch.setattr(K, '_cpu_features', lambda: {'avx2', 'avx512f', 'avx512bw', 'avx512vnni'})
    for env, want in (({}, ('vnni', 'avx2', 'loops')), ({'TINYCOMP_INT8_KERNEL': 'avx2'}, ('avx2', 'loops')),
                      ({'TINYCOMP_INT8_KERNEL': 'LOOPS'}, ('loops',))):
        monkeypatch.delenv('TINYCOMP_INT8_KERNEL', raising=False)
        for k, v in env.items(): monkeypatch.setenv(k, v)
        assert K._kernel_levels() == want
    monkeypatch.setenv('TINYCOMP_INT8_KERNEL', 'sse')
    with pytest.raises(TinycompError, match='TINYCOMP_INT8_KERNEL'):
        K._kernel_levels()
    monkeypatch.setenv('TINYCOMP_INT8_KERNEL', 'vnni')                # a cap above what the CPU has: what it has
    monkeypatch.setattr(K, '_cpu_features', lambda: {'avx2', 'fma'})
    assert K._kernel_levels() == ('avx2', 'loops')
    monkeypatch.setattr(K, '_cpu_features', lambda: set())           # ARM: the plain loops
    assert K._kernel_levels() == ('loops',)


def test_unavailable_level_is_refused(monkeypatch):
    rng = np.random.default_rng(11)
    xq, zx, wq, bias, mult, shift = case(rng, 1, 4, 5, 5, 8, 3, 3)
    monkeypatch.setattr(K, 'KERNEL_LEVELS', ('loops',))
    for level in ('vnni', 'avx2'):
        with pytest.raises(TinycompError, match='needs'):
            quantized_conv2d(xq, zx, wq, bias, mult, shift, 0, kernel=level)
    np.testing.assert_array_equal(quantized_conv2d(xq, zx, wq, bias, mult, shift, 0),         # auto: the loops
                                  quantized_conv2d_naive(xq, zx, wq, bias, mult, shift, 0))
    assert K.pack_conv_weights(wq).level == 'loops'


@pytest.mark.slow
def test_drivers_come_from_numbas_cache_in_a_new_process():
    "The int8 drivers are closures; keyed by variant, a second process loads them instead of compiling them again."
    import subprocess, sys, textwrap
    code = textwrap.dedent('''
        import numpy as np
        from tinycomp.quantization import int8_conv
        rng = np.random.default_rng(0)
        x = rng.integers(-128, 128, (1, 8, 6, 6)).astype(np.int8)
        w = rng.integers(-127, 128, (16, 8, 3, 3)).astype(np.int8)
        level = int8_conv.KERNEL_LEVELS[0]
        if level != 'loops':
            int8_conv.quantized_conv2d(x, 0, w, np.zeros(16, np.int32), np.full(16, 1 << 30, np.int32), np.full(16, -8, np.int32),
                                       0, padding=1)
            used = [d for pair in int8_conv._DRIVERS[level].values() for d in pair if d.signatures]
            print(sum(sum(d.stats.cache_hits.values()) for d in used), sum(sum(d.stats.cache_misses.values()) for d in used), len(used))
        else: print(1, 0, 1)
    ''')
    run = lambda: subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, check=True).stdout.split()
    run()                                                       # compiles (or loads) and saves
    hits, misses, used = map(int, run())
    assert used >= 1 and hits >= 1 and misses == 0, (hits, misses, used)


@pytest.mark.slow
def test_driver_variants_from_the_cache_keep_their_own_environment(tmp_path):
    """Two driver variants compiled first thing in two processes must not share a name when a third process loads
    both from the cache (the second one crashed with 'descr is NULL', or could read the other's constants)."""
    import os, subprocess, sys, textwrap
    level = K.KERNEL_LEVELS[0]
    if level == 'loops': pytest.skip('no micro-kernel level on this CPU')
    lanes = 16 if level == 'vnni' else 8
    a, b = (2 * lanes, 4 * lanes) if level == 'vnni' else (lanes, 2 * lanes)      # two variants (vectors per call)
    code = textwrap.dedent(f'''
        import sys
        import numpy as np
        from tinycomp.quantization import int8_conv
        from tinycomp.quantization.kernels import quantized_conv2d_naive
        rng = np.random.default_rng(0)
        x = rng.integers(-128, 128, (1, 8, 6, 6)).astype(np.int8)
        for cout in map(int, sys.argv[2:]):
            w = rng.integers(-127, 128, (cout, 8, 3, 3)).astype(np.int8)
            if sys.argv[1] == 'helpers':     # compile (and cache) the packing helpers, not a driver
                int8_conv._geometry_entry(x.shape, w.shape, 1, 1, 1, 1, int8_conv.pack_conv_weights(w, kernel={level!r}))
                continue
            args = (x, 0, w, np.zeros(cout, np.int32), np.full(cout, 1 << 30, np.int32), np.full(cout, -8, np.int32), 0)
            got = int8_conv.quantized_conv2d(*args, padding=1, kernel={level!r})
            assert np.array_equal(got, quantized_conv2d_naive(*args, padding=1)), cout
    ''')
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / 'cache'))
    run = lambda *argv: subprocess.run([sys.executable, '-c', code, *map(str, argv)], env=env, capture_output=True,
                                       text=True)
    for argv in (('helpers', a, b), ('run', a), ('run', a, b)):   # each variant compiled first in its own process
        assert run(*argv).returncode == 0
    last = run('run', a, b)                                      # both from the cache
    assert last.returncode == 0, last.stderr[-2000:]
