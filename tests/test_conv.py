"""Tests for module 02 (tinycomp.conv, tinycomp.pooling, tinycomp.batchnorm): conv2d, pooling and BatchNorm against naive
references, plus gradient checks, and the conv benchmark (`tinycomp bench conv`)."""

import json
import warnings

import numba
import numpy as np
import pytest
from numba.core.errors import NumbaPerformanceWarning

import tinycomp.batchnorm
import tinycomp.conv
import tinycomp.pooling
from tinycomp.batchnorm import BatchNorm2d, batch_norm
from tinycomp.conv import (Conv2d, conv2d, conv2d_backward, conv2d_direct_kernel, conv2d_forward, conv2d_im2col,
                           conv2d_naive, conv2d_weight_grad_kernel, conv_benchmark, conv_output_size, im2col, njit)
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.files import LAYERS
from tinycomp.pooling import (AdaptiveAvgPool2d, AvgPool2d, MaxPool2d, adaptive_avg_pool2d, avg_pool2d, max_pool2d,
                              max_pool2d_backward)
from tinycomp.tensor import Tensor, gradcheck

pytestmark = pytest.mark.module02


def ref_conv(x, w, b, stride, padding, dilation, groups):
    "Float64 reference: explicit loops over the kernel, vectorised over pixels."
    sh, sw = stride; ph, pw = padding; dh, dw = dilation
    n, c, h, wd = x.shape
    cout, cg, kh, kw = w.shape
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    oh = (h + 2 * ph - dh * (kh - 1) - 1) // sh + 1
    ow = (wd + 2 * pw - dw * (kw - 1) - 1) // sw + 1
    out = np.zeros((n, cout, oh, ow))
    cog = cout // groups
    for co in range(cout):
        g = co // cog
        for cl in range(cg):
            for i in range(kh):
                for j in range(kw):
                    patch = xp[:, g * cg + cl, i * dh:i * dh + sh * (oh - 1) + 1:sh, j * dw:j * dw + sw * (ow - 1) + 1:sw]
                    out[:, co] += w[co, cl, i, j] * patch
        if b is not None: out[:, co] += b[co]
    return out


def ref_pool(x, k, s, p, mode):
    n, c, h, w = x.shape
    oh, ow = (h + 2 * p - k) // s + 1, (w + 2 * p - k) // s + 1
    fill = -np.inf if mode == 'max' else 0.0
    xp = np.pad(x.astype(np.float64), ((0, 0), (0, 0), (p, p), (p, p)), constant_values=fill)
    out = np.zeros((n, c, oh, ow))
    for y in range(oh):
        for xo in range(ow):
            win = xp[:, :, y * s:y * s + k, xo * s:xo * s + k]
            out[:, :, y, xo] = win.max(axis=(2, 3)) if mode == 'max' else win.sum(axis=(2, 3)) / (k * k)
    return out


def random_configs(count, seed):
    rng = np.random.default_rng(seed)
    for _ in range(count):
        groups_kind = rng.integers(3)
        cg = int(rng.integers(1, 4))
        groups = 1 if groups_kind == 0 else 2 if groups_kind == 1 else int(rng.integers(2, 5))
        c = cg * groups
        if groups_kind == 2:                   # depthwise (groups == C), channel multiplier 1 or 2
            c, groups = groups, groups
        cout = groups * int(rng.integers(1, 6))
        k = (int(rng.integers(1, 4)), int(rng.integers(1, 4)))
        stride = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        padding = (int(rng.integers(0, 3)), int(rng.integers(0, 3)))
        dilation = (int(rng.integers(1, 3)), int(rng.integers(1, 3)))
        n = int(rng.integers(1, 4))
        h = int(rng.integers(dilation[0] * (k[0] - 1) + 1, 12))
        w = int(rng.integers(dilation[1] * (k[1] - 1) + 1, 12))
        yield n, c, h, w, cout, k, stride, padding, dilation, groups


CONFIGS = list(random_configs(24, seed=0)) + [
    (1, 3, 7, 5, 6, (3, 3), (1, 1), (1, 1), (1, 1), 1),      # batch 1, odd sizes
    (2, 4, 9, 9, 4, (3, 3), (2, 2), (2, 2), (2, 2), 4),      # depthwise, dilated, strided
    (2, 4, 6, 7, 8, (3, 3), (1, 2), (0, 1), (1, 1), 2),      # groups 2, GEMM path
    (25, 3, 10, 10, 8, (3, 3), (1, 1), (1, 1), (1, 1), 1),   # 100 pixels per sample: chunks of 20 samples (20 + 5)
    (1, 2, 50, 50, 4, (3, 3), (1, 1), (1, 1), (1, 1), 1),    # 2500 output pixels: split into row bands
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_conv2d_forward_matches_reference(cfg):
    n, c, h, w, cout, k, stride, padding, dilation, groups = cfg
    rng = np.random.default_rng(1)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    wt = rng.standard_normal((cout, c // groups, *k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    out = conv2d(x, wt, b, stride, padding, dilation, groups)
    assert out.dtype == np.float32
    np.testing.assert_allclose(out.data, ref_conv(x, wt, b, stride, padding, dilation, groups), rtol=1e-4, atol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("cfg", CONFIGS)
def test_conv2d_backward_matches_finite_differences(cfg):
    n, c, h, w, cout, k, stride, padding, dilation, groups = cfg
    rng = np.random.default_rng(2)
    x = rng.standard_normal((n, c, h, w))
    wt = rng.standard_normal((cout, c // groups, *k))
    b = rng.standard_normal(cout)
    out = conv2d_forward(x, wt, b, stride, padding, dilation, groups)
    v = rng.standard_normal(out.shape)
    grads = conv2d_backward(v, x, wt, stride, padding, dilation, groups)
    # the forward is linear in each argument: directional derivatives are exact up to rounding
    for idx, arr in enumerate((x, wt, b)):
        d = rng.standard_normal(arr.shape)
        args = [x, wt, b]
        args[idx] = arr + d
        plus = (conv2d_forward(*args, stride, padding, dilation, groups) * v).sum()
        args[idx] = arr - d
        minus = (conv2d_forward(*args, stride, padding, dilation, groups) * v).sum()
        np.testing.assert_allclose((plus - minus) / 2, (grads[idx] * d).sum(), rtol=1e-8, atol=1e-8)


def test_conv2d_gradcheck_through_autograd():
    rng = np.random.default_rng(3)
    for stride, padding, dilation, groups, c, cout in [(1, 1, 1, 1, 2, 4), (2, 2, 2, 2, 4, 4), (1, 0, 1, 3, 3, 3)]:
        gradcheck(lambda x, w, b: conv2d(x, w, b, stride, padding, dilation, groups),
                  rng.standard_normal((1, c, 5, 6)), rng.standard_normal((cout, c // groups, 3, 2)), rng.standard_normal(cout))


def test_conv2d_skips_gradients_nobody_needs():
    x = Tensor(np.ones((1, 2, 4, 4), np.float32))
    layer = Conv2d(2, 4, 3, padding=1)
    layer(x).sum().backward()
    assert x.grad is None and layer.weight.grad.shape == (4, 2, 3, 3) and layer.bias.grad.shape == (4,)
    np.testing.assert_allclose(layer.bias.grad, np.full(4, 16.0))


def test_conv2d_errors():
    x = np.zeros((1, 3, 5, 5), np.float32)
    with pytest.raises(ShapeError, match="channels"): conv2d(x, np.zeros((4, 2, 3, 3), np.float32))
    with pytest.raises(ShapeError, match="4-D"): conv2d(x[0], np.zeros((4, 3, 3, 3), np.float32))
    with pytest.raises(ShapeError, match="too small"): conv2d(x, np.zeros((4, 3, 7, 7), np.float32))
    with pytest.raises(ShapeError, match="groups"): Conv2d(3, 4, 3, groups=2)
    with pytest.raises(TinycompError, match="stride"): conv2d(x, np.zeros((4, 3, 3, 3), np.float32), stride=0)


def test_conv2d_layer_init_config_and_repr():
    layer = Conv2d(6, 4, (3, 1), stride=2, padding=(1, 0), groups=2, bias=False)
    assert layer.weight.shape == (4, 3, 3, 1) and layer.bias is None
    cfg = layer.config()
    assert cfg == dict(in_channels=6, out_channels=4, kernel_size=[3, 1], stride=2, padding=[1, 0], dilation=1,
                       groups=2, bias=False)
    assert type(layer)(**cfg).config() == cfg
    assert 'Conv2d(' in repr(layer)
    big = Conv2d(16, 8, 3)
    bound = 1 / np.sqrt(16 * 9)                 # kaiming_uniform(a=sqrt(5)) and the bias bound are both 1/sqrt(fan_in)
    assert np.abs(big.weight.data).max() <= bound + 1e-7 and np.abs(big.weight.data).max() > 0.8 * bound
    assert np.abs(big.bias.data).max() <= bound + 1e-7
    assert sorted(big.state_dict()) == ['bias', 'weight']


def test_exercise_functions_agree_with_reference():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 3, 6, 5)).astype(np.float32)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32)
    b = rng.standard_normal(4).astype(np.float32)
    for s, p in [(1, 0), (1, 1), (2, 1), (2, 2)]:
        ref = ref_conv(x, w, b, (s, s), (p, p), (1, 1), 1)
        np.testing.assert_allclose(conv2d_naive(x, w, b, s, p), ref, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(conv2d_im2col(x, w, b, s, p), ref, rtol=1e-4, atol=1e-4)
        cols = im2col(x, 3, 3, s, p)
        oh, ow = ref.shape[2:]
        assert cols.shape == (27, 2 * oh * ow)
        xp = np.pad(x, ((0, 0), (0, 0), (p, p), (p, p)))
        assert cols[(2 * 3 + 1) * 3 + 2, (1 * oh + oh - 1) * ow + 0] == xp[1, 2, (oh - 1) * s + 1, 0 * s + 2]
    g = rng.standard_normal((2, 4, 4, 3)).astype(np.float32)
    dw = conv2d_weight_grad_kernel(x.astype(np.float64), g.astype(np.float64), 3, 3, 2, 2, 2, 1, 1, 1, 1)
    np.testing.assert_allclose(dw, conv2d_backward(g, x.astype(np.float64), w.astype(np.float64), (2, 2), (2, 1))[1], rtol=1e-10)
    np.testing.assert_allclose(conv2d_direct_kernel(x, w, 2, 1, 0, 1, 1, 2, 1), ref_conv(x, w, None, (2, 1), (0, 1), (1, 2), 1),
                               rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("k,s,p", [(2, 2, 0), (3, 2, 1), (3, 1, 1), (2, 1, 0), (3, 3, 0)])
def test_pooling_forward_and_gradients(k, s, p):
    rng = np.random.default_rng(5)
    x = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    np.testing.assert_allclose(max_pool2d(x, k, s, p).data, ref_pool(x, k, s, p, 'max'), rtol=1e-6)
    np.testing.assert_allclose(avg_pool2d(x, k, s, p).data, ref_pool(x, k, s, p, 'avg'), rtol=1e-5, atol=1e-6)
    xs = rng.standard_normal((1, 2, 7, 6))
    gradcheck(lambda t: max_pool2d(t, k, s, p), xs)
    gradcheck(lambda t: avg_pool2d(t, k, s, p), xs)
    assert MaxPool2d(k, s, p)(x).shape == AvgPool2d(k, s, p)(x).shape


def test_max_pool_backward_exercise_routes_to_winners():
    g = np.arange(1.0, 5.0).reshape(1, 1, 2, 2)
    idx = np.array([[[[0, 0], [5, 5]]]], dtype=np.int64)        # overlapping windows sharing winners
    dx = max_pool2d_backward(g, idx, 3, 3)
    expected = np.zeros((1, 1, 3, 3)); expected[0, 0, 0, 0] = 3; expected[0, 0, 1, 2] = 7
    np.testing.assert_array_equal(dx, expected)


def test_adaptive_avg_pool():
    rng = np.random.default_rng(6)
    x = rng.standard_normal((2, 3, 5, 7))
    np.testing.assert_allclose(AdaptiveAvgPool2d(1)(x).data[..., 0, 0], x.mean(axis=(2, 3)), rtol=1e-5)
    out = adaptive_avg_pool2d(x, (2, 3)).data
    np.testing.assert_allclose(out[1, 2, 1, 2], x[1, 2, 2:5, 4:7].mean(), rtol=1e-5)   # rows floor(5/2)..ceil(10/2)
    gradcheck(lambda t: adaptive_avg_pool2d(t, 1), rng.standard_normal((2, 2, 3, 4)))
    gradcheck(lambda t: adaptive_avg_pool2d(t, (2, 3)), rng.standard_normal((1, 2, 5, 7)))
    assert AdaptiveAvgPool2d(1).config() == dict(output_size=1)


def test_batchnorm_train_eval_and_running_stats():
    rng = np.random.default_rng(7)
    bn = BatchNorm2d(3, momentum=0.2)
    bn.weight.data[:] = [1.0, 2.0, 0.5]; bn.bias.data[:] = [0.0, 1.0, -1.0]
    x1 = (rng.standard_normal((4, 3, 5, 5)) * 3 + 2).astype(np.float32)
    x2 = (rng.standard_normal((2, 3, 3, 4)) - 1).astype(np.float32)
    y = bn(x1).data
    mean, var = x1.mean(axis=(0, 2, 3)), x1.var(axis=(0, 2, 3))
    ref = (x1 - mean[:, None, None]) / np.sqrt(var[:, None, None] + 1e-5) * bn.weight.data[:, None, None] + bn.bias.data[:, None, None]
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-4)
    bn(x2)
    rm = 0.8 * (0.8 * 0 + 0.2 * mean) + 0.2 * x2.mean(axis=(0, 2, 3))
    rv = 0.8 * (0.8 * 1 + 0.2 * x1.var(axis=(0, 2, 3), ddof=1)) + 0.2 * x2.var(axis=(0, 2, 3), ddof=1)
    np.testing.assert_allclose(bn.running_mean, rm, rtol=1e-5); np.testing.assert_allclose(bn.running_var, rv, rtol=1e-5)
    assert int(bn.num_batches_tracked) == 2
    bn.eval()
    ye = bn(x2).data
    np.testing.assert_allclose(ye, (x2 - rm[:, None, None]) / np.sqrt(rv[:, None, None] + 1e-5) * bn.weight.data[:, None, None]
                               + bn.bias.data[:, None, None], rtol=1e-4, atol=1e-4)
    assert int(bn.num_batches_tracked) == 2 and np.allclose(bn.running_mean, rm)
    sd = bn.state_dict()
    assert set(sd) == {'weight', 'bias', 'running_mean', 'running_var', 'num_batches_tracked'}
    fresh = BatchNorm2d(**bn.config()); fresh.load_state_dict(sd); fresh.eval()
    np.testing.assert_allclose(fresh(x2).data, ye)
    with pytest.raises(ShapeError): bn(np.zeros((2, 4, 3, 3), np.float32))


def test_batchnorm_momentum_none_is_cumulative_average():
    rng = np.random.default_rng(8)
    bn = BatchNorm2d(2, momentum=None, affine=False)
    xs = [rng.standard_normal((3, 2, 2, 2)).astype(np.float32) for _ in range(3)]
    for x in xs: bn(x)
    np.testing.assert_allclose(bn.running_mean, np.mean([x.mean(axis=(0, 2, 3)) for x in xs], axis=0), rtol=1e-5, atol=1e-7)
    assert bn.weight is None and bn.parameters is not None and list(bn.parameters()) == []


def test_batchnorm_gradcheck_train_and_eval():
    rng = np.random.default_rng(9)
    x, g, b = rng.standard_normal((3, 2, 3, 2)), rng.standard_normal(2), rng.standard_normal(2)
    gradcheck(lambda x, g, b: batch_norm(x, None, None, g, b, training=True), x, g, b)
    gradcheck(lambda x, g, b: batch_norm(x, np.array([0.5, -1.0]), np.array([2.0, 0.5]), g, b, training=False), x, g, b)
    gradcheck(lambda x: batch_norm(x, None, None, training=True), x)


def test_small_cnn_learns():
    from tinycomp.nn import Flatten, Linear, ReLU, Sequential
    from tinycomp.nn.functional import cross_entropy
    from tinycomp.optim import SGD
    from tinycomp.tensor import manual_seed
    manual_seed(0)
    rng = np.random.default_rng(10)
    imgs = rng.standard_normal((32, 1, 8, 8)).astype(np.float32) * 0.3
    labels = rng.integers(0, 2, 32)
    for k, l in enumerate(labels):
        if l: imgs[k, 0, :, 3:5] += 1.5
        else: imgs[k, 0, 3:5, :] += 1.5
    net = Sequential(Conv2d(1, 4, 3, padding=1), BatchNorm2d(4), ReLU(), MaxPool2d(2), Conv2d(4, 4, 3, groups=4),
                     ReLU(), AdaptiveAvgPool2d(1), Flatten(), Linear(4, 2))
    opt = SGD(net.parameters(), lr=0.1, momentum=0.9)
    first = None
    for _ in range(25):
        loss = cross_entropy(net(imgs), labels)
        first = first if first is not None else loss.item()
        opt.zero_grad(); loss.backward(); opt.step()
    assert loss.item() < 0.5 * first


@pytest.mark.parametrize('code', [
    # conv first: tinycomp.conv imports tinycomp.nn.modules, which must not import tinycomp.conv back
    "import tinycomp.conv as conv, tinycomp.nn as nn, tinycomp.nn.functional as F\n"
    "import tinycomp.batchnorm as batchnorm\n"
    "assert nn.Conv2d is conv.Conv2d and F.conv2d is conv.conv2d and F.batch_norm is batchnorm.batch_norm",
    # pooling or BatchNorm first: the same for the other two files of module 02
    "import tinycomp.pooling as pooling, tinycomp.batchnorm as batchnorm, tinycomp.nn as nn, tinycomp.nn.functional as F\n"
    "assert nn.MaxPool2d is pooling.MaxPool2d and F.avg_pool2d is pooling.avg_pool2d and nn.BatchNorm2d is batchnorm.BatchNorm2d",
    # the namespace first: the conv names are imported on first use
    "import sys, tinycomp.nn as nn, tinycomp.nn.functional as F\n"
    "assert not {'tinycomp.conv', 'tinycomp.pooling', 'tinycomp.batchnorm'} & set(sys.modules)\n"
    "Conv2d, conv2d, MaxPool2d = nn.Conv2d, F.conv2d, nn.MaxPool2d\n"
    "import tinycomp.conv as conv, tinycomp.pooling as pooling, tinycomp.batchnorm as batchnorm\n"
    "assert Conv2d is conv.Conv2d and conv2d is conv.conv2d and MaxPool2d is pooling.MaxPool2d\n"
    "assert nn.BatchNorm2d is batchnorm.BatchNorm2d",
], ids=['conv-first', 'pooling-first', 'nn-first'])
def test_nn_namespace_reaches_conv_in_both_import_orders(code):
    import subprocess, sys
    subprocess.run([sys.executable, '-c', code], check=True, timeout=300)



def test_conv_output_size_from_python_and_from_numba():
    assert conv_output_size(8, 3, 1, 1) == 8 and conv_output_size(7, 3, 2, 1) == 4 and conv_output_size(7, 3, 1, 2, 2) == 7
    assert conv_output_size(np.int64(9), 2) == 8 and conv_output_size(2, 5) == -2     # defaults; Python's floor division
    for size, k, s, p, d in [(5, 3, 2, 0, 1), (11, 3, 3, 2, 2), (4, 5, 1, 0, 1), (1, 1, 1, 0, 1)]:
        assert conv_output_size(size, k, s, p, d) == (size + 2 * p - d * (k - 1) - 1) // s + 1

    @numba.njit
    def from_kernel(h, k, s, p, d): return conv_output_size(h, k, s, p, d)
    assert from_kernel(11, 3, 3, 2, 2) == 4


@pytest.mark.parametrize("k,s,p,d", [((2, 3), (1, 2), (1, 0), (2, 1)), ((3, 2), (2, 1), (1, 1), (1, 2))])
def test_max_pool_dilated_and_asymmetric(k, s, p, d):
    rng = np.random.default_rng(11)
    x = rng.standard_normal((2, 2, 7, 8)).astype(np.float32)
    out = max_pool2d(x, k, s, p, d).data
    xp = np.pad(x, ((0, 0), (0, 0), (p[0], p[0]), (p[1], p[1])), constant_values=-np.inf)
    oh = (7 + 2 * p[0] - d[0] * (k[0] - 1) - 1) // s[0] + 1
    ow = (8 + 2 * p[1] - d[1] * (k[1] - 1) - 1) // s[1] + 1
    ref = np.array([[[[xp[n, c, y * s[0]:y * s[0] + d[0] * (k[0] - 1) + 1:d[0], v * s[1]:v * s[1] + d[1] * (k[1] - 1) + 1:d[1]].max()
                       for v in range(ow)] for y in range(oh)] for c in range(2)] for n in range(2)])
    np.testing.assert_array_equal(out, ref)
    gradcheck(lambda t: max_pool2d(t, k, s, p, d), rng.standard_normal((1, 2, 7, 8)))


def test_layers_register_themselves_where_defined():
    for module, names in [(tinycomp.conv, ('Conv2d',)), (tinycomp.pooling, ('MaxPool2d', 'AvgPool2d', 'AdaptiveAvgPool2d')),
                          (tinycomp.batchnorm, ('BatchNorm2d',))]:
        for name in names:
            cls = getattr(module, name)
            assert LAYERS[name] is cls and cls.__module__ == module.__name__


def _performance_warnings(fn, *args):
    "Call `fn(*args)` (compiling it) and return the NumbaPerformanceWarnings it emitted."
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        try: fn(*args)
        except NotImplementedError: pass
    return [w for w in caught if issubclass(w.category, NumbaPerformanceWarning)]


def test_parallel_exercise_stub_compiles_without_performance_warning():
    "A student stub (the solution block replaced by a raise) under `njit(parallel=True)` must compile quietly."
    @njit(parallel=True, cache=False, fastmath=True)
    def stub(x, weight, stride_h, stride_w, pad_h, pad_w, dil_h, dil_w, groups):
        "Docstring, as in the exercises."
        raise NotImplementedError("Exercise 02.3 conv2d_direct_kernel: not done yet. Write your solution here, then run: tinycomp test 02")
    with pytest.raises(NotImplementedError, match="not done yet"):
        stub(np.zeros((1, 1, 3, 3), np.float32), np.zeros((1, 1, 3, 3), np.float32), 1, 1, 0, 0, 1, 1, 1)
    assert _performance_warnings(stub, np.zeros((1, 1, 3, 3)), np.zeros((1, 1, 3, 3)), 1, 1, 0, 0, 1, 1, 1) == []

    # the same stub under Numba's own njit does warn: the test above can fail
    @numba.njit(parallel=True, cache=False)
    def plain_stub(x):
        raise NotImplementedError("Exercise 02.3 plain_stub: not done yet")
    assert _performance_warnings(plain_stub, np.zeros(3))


def test_njit_keeps_the_warning_and_parallelism_for_real_code():
    @njit(parallel=True, cache=False)
    def serial_sum(x):                           # real code that cannot be parallelised: the warning is useful
        s = 0.0
        for i in range(x.shape[0]):
            s += x[i]
        return s
    assert serial_sum.targetoptions['parallel'] is True
    assert _performance_warnings(serial_sum, np.ones(4))

    @njit(parallel=True, cache=False)
    def parallel_sum(x):
        s = 0.0
        for i in numba.prange(x.shape[0]):
            s += x[i]
        return s
    assert _performance_warnings(parallel_sum, np.ones(4)) == [] and parallel_sum(np.ones(5)) == 5.0
    assert njit(lambda x: x + 1)(1) == 2 and njit(cache=False)(lambda x: 2 * x)(3) == 6
    for kernel in (conv2d_direct_kernel, conv2d_weight_grad_kernel):    # the reference kernels stay parallel
        assert kernel.targetoptions['parallel'] is True


# --- `tinycomp bench conv` (the timer and thread counts: test_profiling_timing.py) ---------------------------------

def test_conv_benchmark_small_shapes_and_json(tmp_path, capsys):
    path = tmp_path / 'conv.json'
    res = conv_benchmark(threads=1, json_path=str(path), repeats=2, shapes=[(2, 1, 5, 5, 4), (2, 4, 6, 6, 8)], use_torch=False)
    out = capsys.readouterr().out
    assert 'GFLOP/s' in out and '(2,1,5,5->4)' in out and '(2,4,6,6->8)' in out
    saved = json.loads(path.read_text())
    assert saved['meta']['threads']['numba'] == 1 and saved['meta']['repeats'] == 2
    small, big = saved['rows']
    from tinycomp.tiles import FLOAT_LANES
    assert set(small['timings']) == {'naive', 'numpy_im2col', 'tinycomp_fwd', 'tinycomp_bwd'} | ({'tinycomp_tiled'} if FLOAT_LANES else set())
    assert 'naive' not in big['timings']
    assert big['gflop'] == 2 * 2 * 8 * 36 * 4 * 9 / 1e9
    assert all(v['gflops'] > 0 for v in big['timings'].values()) and res['rows'][1]['bwd_over_fwd'] > 0
    assert 'NUMBA_NUM_THREADS' in saved['meta']['threads']
    assert all(k in v for v in big['timings'].values() for k in ('median', 'p99', 'ci_low', 'ci_high', 'threads'))
