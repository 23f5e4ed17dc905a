"Integer-only residual add and concatenation: bit-exact with a scalar reference of TFLite's arithmetic, and close to the real result."
import numpy as np
import pytest

from tinycomp import io
from tinycomp.errors import TinycompError
from tinycomp.nn.modules import Sequential
from tinycomp.quantization.core import dequantize, quantize_multiplier, quantize_per_tensor
from tinycomp.quantization.layers import (ADD_LEFT_SHIFT, QuantizedAdd, QuantizedCat, add_rescale, quantized_add,
                                          rescale_int8, rescale_multiplier)

pytestmark = pytest.mark.module04


def srdhm(a, b):
    "TFLite's SaturatingRoundingDoublingHighMul on Python ints (C++ division truncates toward zero)."
    if a == b == -2 ** 31: return 2 ** 31 - 1
    ab = a * b
    n = ab + (2 ** 30 if ab >= 0 else 1 - 2 ** 30)
    return n // 2 ** 31 if n >= 0 else -((-n) // 2 ** 31)


def rounding_divide_by_pot(x, exponent):
    "TFLite's RoundingDivideByPOT on Python ints: x / 2**exponent, ties away from zero."
    mask = (1 << exponent) - 1
    remainder, threshold = x & mask, (mask >> 1) + (1 if x < 0 else 0)
    return (x >> exponent) + (1 if remainder > threshold else 0)


def mbqm(x, multiplier, shift):
    "TFLite's MultiplyByQuantizedMultiplier, one Python int at a time."
    left, right = max(shift, 0), max(-shift, 0)
    return rounding_divide_by_pot(srdhm(x * (1 << left), multiplier), right)


def reference_add(qa, za, qb, zb, sa, sb, s_out, z_out, relu=False):
    "TFLite's reference int8 Add (AddElementwise), element by element, from the real scales."
    twice_max = 2 * max(sa, sb)
    (ma, ea), (mb, eb) = (tuple(int(v) for v in quantize_multiplier(np.float64(s) / twice_max)) for s in (sa, sb))
    mo, eo = (int(v) for v in quantize_multiplier(twice_max / ((1 << 20) * s_out)))
    out = np.empty(np.broadcast_shapes(qa.shape, qb.shape), np.int64)
    for idx in np.ndindex(out.shape):
        a, b = int(np.broadcast_to(qa, out.shape)[idx]) - za, int(np.broadcast_to(qb, out.shape)[idx]) - zb
        total = mbqm(a << 20, ma, ea) + mbqm(b << 20, mb, eb)
        out[idx] = min(max(mbqm(total, mo, eo) + z_out, z_out if relu else -128), 127)
    return out.astype(np.int8)


def test_the_left_shift_is_tflites():
    assert ADD_LEFT_SHIFT == 20


@pytest.mark.parametrize('seed', range(6))
def test_the_int8_add_is_bit_exact_with_tflites_arithmetic_and_within_a_step_of_the_real_sum(seed):
    rng = np.random.default_rng(seed)
    sa, sb, s_out = (float(np.float32(v)) for v in rng.uniform(0.005, 0.2, 3))
    za, zb, z_out = (int(v) for v in rng.integers(-20, 21, 3))
    qa = rng.integers(-128, 128, (3, 4, 5)).astype(np.int8)
    qb = rng.integers(-128, 128, (4, 1) if seed % 2 else (3, 4, 5)).astype(np.int8)       # broadcasting too
    relu = bool(seed % 3 == 0)
    got = QuantizedAdd([sa, sb], [za, zb], s_out, z_out, relu)(qa, qb).data
    assert got.dtype == np.int8 and np.array_equal(got, reference_add(qa, za, qb, zb, sa, sb, s_out, z_out, relu))
    real = dequantize(qa, sa, za) + dequantize(qb, sb, zb)
    rounded = np.clip(np.round(real / s_out) + z_out, z_out if relu else -128, 127)
    assert np.abs(got.astype(int) - rounded).max() <= 1


def test_concatenation_copies_what_is_at_the_output_scale_and_rescales_the_rest_within_half_a_step():
    rng = np.random.default_rng(7)
    qa, qb = rng.integers(-128, 128, (2, 3, 4)).astype(np.int8), rng.integers(-128, 128, (2, 5, 4)).astype(np.int8)
    cat = QuantizedCat([0.013, 0.05], [5, -2], 0.05, -2)
    out = cat(qa, qb).data
    assert out.shape == (2, 8, 4) and np.array_equal(out[:, 3:], qb)
    want = np.clip(dequantize(qa, float(np.float32(0.013)), 5) / float(np.float32(0.05)) - 2, -128.5, 127.5)
    assert np.abs(out[:, :3] - want).max() <= 0.5 + 1e-6
    m, e = rescale_multiplier(0.013, 0.05)
    assert np.array_equal(out[:, :3], rescale_int8(qa, 5, m, e, -2))
    for q in range(-128, 128):                                    # the scalar reference, value by value
        assert rescale_int8(np.array([q]), 5, m, e, -2)[0] == min(max(mbqm((q - 5) << 20, m, e) - 2, -128), 127)


def test_joins_refuse_what_does_not_fit_and_save_and_load():
    add = QuantizedAdd([0.1, 0.2], [0, 1], 0.3, -1, relu=True)
    with pytest.raises(TinycompError, match='expects int8 activations'):
        add(np.zeros((2, 2), np.int8), np.zeros((2, 2), np.float32))
    with pytest.raises(TinycompError, match='was built for 2 inputs, got 3'):
        add(*[np.zeros((2, 2), np.int8)] * 3)
    with pytest.raises(TinycompError, match='at least two inputs'):
        QuantizedCat([0.1], [0], 0.1, 0)
    with pytest.raises(TinycompError, match='QuantizedAdd input 1 scale must be finite and > 0'):
        QuantizedAdd([0.1, 0.0], [0, 0], 0.1, 0)
    assert add.cost((2, 3), (2, 3))['flops'] == 6 and QuantizedCat([0.1, 0.1], [0, 0], 0.1, 0).cost((1, 2), (1, 3))['output_shape'] == (1, 5)
    assert add_rescale([0.1, 0.2], 0.3)[0][1] == (1 << 30, 0)                  # the larger input: exactly 1/2
    assert np.array_equal(quantized_add([np.int8(3), np.int8(-4)], [0, 1], add.rescale, -1, True), add(np.int8(3), np.int8(-4)).data)


def test_a_join_survives_a_model_file(tmp_path):
    model = Sequential(QuantizedCat([0.02, 0.05], [1, -3], 0.05, -3, dim=-1))
    back = io.load(io.save(model, tmp_path / 'cat.npz'))
    qa = quantize_per_tensor(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), 0.02, 1)
    assert np.array_equal(back[0](qa, qa).data, model[0](qa, qa).data) and back[0].config() == model[0].config()


@pytest.mark.parametrize('seed', range(20))
def test_the_numba_add_kernel_is_bit_exact_with_the_numpy_steps(seed):
    "Two int8 inputs of one shape take the kernel; int16 copies of the same values take the NumPy expression."
    rng = np.random.default_rng(seed)
    shape = (int(rng.integers(1, 5)), int(rng.integers(1, 9)), int(rng.integers(1, 400)), int(rng.integers(1, 12)))
    a, b = (rng.integers(-128, 128, shape).astype(np.int8) for _ in range(2))
    a.flat[0], b.flat[-1] = -128, 127                                     # the ends of the range
    scales = rng.uniform(1e-3, 0.5, 3)
    zps = [int(z) for z in rng.integers(-128, 128, 3)]
    rescale = add_rescale(scales[:2], scales[2])
    for relu in (False, True):
        fast = quantized_add([a, b], zps[:2], rescale, zps[2], relu)
        slow = quantized_add([a.astype(np.int16), b.astype(np.int16)], zps[:2], rescale, zps[2], relu)
        assert fast.dtype == np.int8 and fast.shape == shape
        np.testing.assert_array_equal(fast, slow)
