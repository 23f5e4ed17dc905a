"Module 01, part 01a (tinycomp.tensor): autograd, every op's backward rule, gradcheck."
import math

import numpy as np
import pytest

import tinycomp.tensor as T
from tinycomp.errors import AutogradError, ShapeError
from tinycomp.tensor import Tensor, cat, gradcheck, no_grad, stack

pytestmark = pytest.mark.module01

rng = np.random.default_rng(1234)


def randn(*shape, positive=False):
    x = rng.standard_normal(shape)
    return np.abs(x) + 0.5 if positive else x


# (name, fn, input arrays): every op, with broadcasting and batching
GRADCHECK_CASES = [
    ('add-broadcast', lambda a, b: a + b, [randn(3, 1, 4), randn(5, 4)]),
    ('radd-scalar', lambda a: 2.5 + a, [randn(3)]),
    ('sub-broadcast', lambda a, b: a - b, [randn(2, 3), randn(3)]),
    ('rsub', lambda a: 1.0 - a, [randn(2, 3)]),
    ('mul-broadcast', lambda a, b: a * b, [randn(2, 3, 4), randn(3, 1)]),
    ('div-broadcast', lambda a, b: a / b, [randn(3, 4), randn(4, positive=True)]),
    ('rdiv', lambda a: 2.0 / a, [randn(3, positive=True)]),
    ('neg', lambda a: -a, [randn(2, 2)]),
    ('pow', lambda a: a ** 3, [randn(3, 2)]),
    ('pow-frac', lambda a: a ** 0.5, [randn(4, positive=True)]),
    ('matmul-2d', lambda a, b: a @ b, [randn(3, 4), randn(4, 2)]),
    ('matmul-batched-broadcast', lambda a, b: a @ b, [randn(2, 1, 3, 4), randn(5, 4, 2)]),
    ('matmul-vec-mat', lambda a, b: a @ b, [randn(4), randn(2, 4, 3)]),
    ('matmul-mat-vec', lambda a, b: a @ b, [randn(2, 3, 4), randn(4)]),
    ('matmul-vec-vec', lambda a, b: a @ b, [randn(4), randn(4)]),
    ('sum-all', lambda a: a.sum(), [randn(3, 4)]),
    ('sum-axes-keepdims', lambda a: a.sum(axis=(0, 2), keepdims=True), [randn(2, 3, 4)]),
    ('mean-axis', lambda a: a.mean(axis=-1), [randn(2, 3, 4)]),
    ('max-axis', lambda a: a.max(axis=1), [randn(3, 5)]),
    ('max-all-keepdims', lambda a: a.max(axis=None, keepdims=True), [randn(3, 5)]),
    ('reshape', lambda a: a.reshape(4, 6), [randn(2, 3, 4)]),
    ('permute', lambda a: a.permute(2, 0, 1), [randn(2, 3, 4)]),
    ('transpose', lambda a: a.transpose(0, 1), [randn(2, 3, 4)]),
    ('T', lambda a: a.T, [randn(2, 3)]),
    ('getitem-slice', lambda a: a[1:, ::2], [randn(3, 5)]),
    ('getitem-fancy-repeat', lambda a: a[[0, 0, 2], 1], [randn(3, 5)]),
    ('cat', lambda a, b: cat([a, b], dim=1), [randn(2, 3), randn(2, 4)]),
    ('stack', lambda a, b: stack([a, b], dim=2), [randn(2, 3), randn(2, 3)]),
    ('exp', lambda a: a.exp(), [randn(3, 3)]),
    ('log', lambda a: a.log(), [randn(3, 3, positive=True)]),
    ('sqrt', lambda a: a.sqrt(), [randn(3, 3, positive=True)]),
    ('relu', lambda a: a.relu(), [randn(4, 5)]),
    ('sigmoid', lambda a: a.sigmoid(), [randn(4, 5) * 3]),
    ('tanh', lambda a: a.tanh(), [randn(4, 5)]),
    ('softmax', lambda a: a.softmax(axis=0), [randn(4, 5)]),
    ('log_softmax', lambda a: a.log_softmax(axis=-1), [randn(4, 5)]),
    ('chain-reuse', lambda a, b: ((a @ b).tanh() * a.sum() + a.mean()).log_softmax(), [randn(3, 3), randn(3, 3)]),
]


@pytest.mark.parametrize('name,fn,inputs', GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck_every_op(name, fn, inputs):
    assert gradcheck(fn, *inputs)


def test_gradcheck_detects_a_wrong_rule():
    wrong_square = lambda a: Tensor.from_op(a.data ** 2, (a,), lambda g: (g * a.data,), 'bad-square')
    with pytest.raises(AutogradError, match='gradcheck failed'):
        gradcheck(wrong_square, randn(3))


def test_float32_by_default():
    assert Tensor([1, 2.5]).dtype == np.float32
    assert Tensor(np.zeros(3, np.float64)).dtype == np.float32
    assert Tensor(np.arange(3)).dtype.kind == 'i'
    assert (Tensor(np.ones(2)) * 2.0).dtype == np.float32


def test_softmax_and_log_softmax_known_values():
    x = Tensor([[1., 2., 3.], [1000., 1000., 1000.]])
    expected = np.exp([1., 2., 3.]) / np.exp([1., 2., 3.]).sum()
    np.testing.assert_allclose(x.softmax().data[0], expected, rtol=1e-6)
    np.testing.assert_allclose(x.softmax().data[1], np.full(3, 1 / 3), rtol=1e-6)
    np.testing.assert_allclose(x.log_softmax().data[1], np.full(3, -math.log(3)), rtol=1e-6)
    big = Tensor([[1e4, -1e4, 0.]]).log_softmax()
    assert np.isfinite(big.data).all()
    np.testing.assert_allclose(big.data, [[0., -2e4, -1e4]], rtol=1e-6)


def test_gradient_accumulates_across_uses_and_backward_calls():
    a = Tensor([1., 2.], requires_grad=True)
    (a * a + a).sum().backward()
    np.testing.assert_allclose(a.grad, [3., 5.])
    (a * 3).sum().backward()
    np.testing.assert_allclose(a.grad, [6., 8.])


def test_deep_graph_does_not_hit_recursion_limit():
    x = Tensor([1.0], requires_grad=True)
    y = x
    for _ in range(5000): y = y + 1e-3
    y.sum().backward()
    np.testing.assert_allclose(x.grad, [1.0])


def test_backward_misuse_is_a_clear_error():
    a = Tensor(np.ones((2, 2)), requires_grad=True)
    with pytest.raises(AutogradError, match='non-scalar'):
        (a * 2).backward()
    with pytest.raises(AutogradError, match='does not require grad'):
        Tensor([1.0]).sum().backward()
    with pytest.raises(ShapeError, match='does not match'):
        (a * 2).backward(np.ones(3))
    with pytest.raises(AutogradError, match='only float tensors'):
        Tensor([1, 2], requires_grad=True)
    (a * 2).backward(np.ones((2, 2)))
    np.testing.assert_allclose(a.grad, np.full((2, 2), 2.))


def test_custom_op_returning_wrong_gradient_shape_is_reported():
    a = Tensor(np.ones(3), requires_grad=True)
    bad = Tensor.from_op(a.data.sum(), (a,), lambda g: (np.ones(2),), 'bad')
    with pytest.raises(AutogradError, match="'bad' returned a gradient of shape"):
        bad.backward()


def test_no_grad_records_nothing():
    a = Tensor([1., 2.], requires_grad=True)
    with no_grad():
        b = a * 2
    assert not b.requires_grad and b._parents == ()
    assert T.is_grad_enabled()
    assert (a * 2).requires_grad


@pytest.mark.parametrize('a,b', [((2, 3), (4, 5)), ((2, 3, 4), (3, 3, 2)), ((3,), (4,))])
def test_matmul_shape_errors(a, b):
    with pytest.raises(ShapeError):
        Tensor(np.ones(a)) @ Tensor(np.ones(b))


def test_reshape_and_axis_errors():
    with pytest.raises(ShapeError, match='cannot reshape'):
        Tensor(np.ones(6)).reshape(4, 2)
    with pytest.raises(ShapeError, match='out of range'):
        Tensor(np.ones((2, 2))).sum(axis=3)




def test_manual_seed_replaces_the_default_generator():
    T.manual_seed(5); a = T.default_generator().random(4)
    T.manual_seed(5); b = T.default_generator().random(4)
    np.testing.assert_array_equal(a, b)


def test_function_forms_match_methods():
    x = randn(3, 4)
    for fn, method in [(T.relu, 'relu'), (T.sigmoid, 'sigmoid'), (T.tanh, 'tanh'), (T.exp, 'exp')]:
        np.testing.assert_array_equal(fn(x).data, getattr(Tensor(x), method)().data)
    np.testing.assert_allclose(T.log_softmax(x, dim=0).data, Tensor(x).log_softmax(axis=0).data)
    np.testing.assert_allclose(T.softmax(x).data.sum(-1), np.ones(3), rtol=1e-6)


def test_tensor_module_holds_only_part_01a():
    # layers, losses and optimizers live in their own files (parts 01b-01d), not in tinycomp.tensor
    for name in ('Module', 'Linear', 'cross_entropy', 'mse_loss', 'SGD', 'Adam', 'two_spirals'):
        assert not hasattr(T, name), name
