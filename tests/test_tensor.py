"Module 01: autograd ops, losses, modules and optimizers."
import math

import numpy as np
import pytest

import tinycomp.tensor as T
from tinycomp.errors import AutogradError, ShapeError, TinycompError
from tinycomp.tensor import (Adam, CosineAnnealingLR, Dropout, Flatten, Linear, Module, Parameter, ReLU, SGD,
                             Sequential, Sigmoid, StepLR, Tanh, Tensor, cat, cross_entropy, gradcheck, mse_loss,
                             no_grad, stack)

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
    ('cross_entropy', lambda a: cross_entropy(a, np.array([0, 2, 1, 2])), [randn(4, 3)]),
    ('cross_entropy-sum', lambda a: cross_entropy(a, np.array([1, 0]), reduction='sum'), [randn(2, 3)]),
    ('mse_loss', lambda a, b: mse_loss(a, b), [randn(3, 4), randn(3, 4)]),
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


def test_cross_entropy_known_values_and_large_logits():
    # values from torch.nn.functional.cross_entropy
    logits = Tensor([[2., 1., 0.1], [0.5, 2.5, 0.3]], requires_grad=True)
    loss = cross_entropy(logits, np.array([0, 1]))
    assert loss.item() == pytest.approx(0.318540, abs=1e-5)
    loss.backward()
    p = np.exp(logits.data) / np.exp(logits.data).sum(1, keepdims=True)
    np.testing.assert_allclose(logits.grad, (p - np.eye(3)[[0, 1]]) / 2, rtol=1e-5, atol=1e-7)
    huge = Tensor([[1000., -1000., 0.]], requires_grad=True)
    loss = cross_entropy(huge, np.array([1]))
    assert loss.item() == pytest.approx(2000.0)
    loss.backward()
    assert np.isfinite(huge.grad).all()
    np.testing.assert_allclose(huge.grad, [[1., -1., 0.]], atol=1e-6)
    np.testing.assert_allclose(cross_entropy(Tensor(np.zeros((4, 5))), np.arange(4), reduction='none').data,
                               np.full(4, math.log(5)), rtol=1e-6)


@pytest.mark.parametrize('labels,match', [(np.array([0, 5]), 'must lie in'), (np.array([0]), 'labels of shape'),
                                          (np.array([0.0, 1.0]), 'integer class indices')])
def test_cross_entropy_rejects_bad_labels(labels, match):
    with pytest.raises(ShapeError, match=match):
        cross_entropy(Tensor(np.zeros((2, 5))), labels)


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


def _square_grad_steps(optimizer, steps, **kw):
    w = Parameter(np.array([1.0, -2.0]))
    opt = optimizer([w], **kw)
    for _ in range(steps):
        opt.zero_grad()
        (w * w).sum().backward()
        opt.step()
    return w.data


def test_sgd_hand_computed():
    np.testing.assert_allclose(_square_grad_steps(SGD, 1, lr=0.1), [0.8, -1.6], rtol=1e-6)
    # momentum: v1 = 2w0; w1 = w0 - lr v1 = 0.8 w0; v2 = 0.9 v1 + 2 w1 = 3.4 w0; w2 = 0.8 w0 - 0.34 w0
    np.testing.assert_allclose(_square_grad_steps(SGD, 2, lr=0.1, momentum=0.9), [0.46, -0.92], rtol=1e-6)
    # nesterov: d1 = 2w0, v1 = d1, step = d1 + 0.9 v1 = 3.8 w0 -> w1 = 0.62 w0
    np.testing.assert_allclose(_square_grad_steps(SGD, 1, lr=0.1, momentum=0.9, nesterov=True), [0.62, -1.24], rtol=1e-6)
    # weight decay 0.5: g = 2w + 0.5w = 2.5w -> w1 = 0.75 w0
    np.testing.assert_allclose(_square_grad_steps(SGD, 1, lr=0.1, weight_decay=0.5), [0.75, -1.5], rtol=1e-6)


def test_adam_hand_computed():
    # the first bias-corrected step moves every coordinate by lr (m_hat = g, v_hat = g^2)
    np.testing.assert_allclose(_square_grad_steps(Adam, 1, lr=0.1), [0.9, -1.9], rtol=1e-6)
    # step 2 by hand for w0 = 1: g1 = 2, w1 = 0.9; g2 = 1.8
    b1, b2, g1, g2 = 0.9, 0.999, 2.0, 1.8
    m = (1 - b1) * g1; v = (1 - b2) * g1 ** 2
    m = b1 * m + (1 - b1) * g2; v = b2 * v + (1 - b2) * g2 ** 2
    w2 = 0.9 - 0.1 * (m / (1 - b1 ** 2)) / (math.sqrt(v / (1 - b2 ** 2)) + 1e-8)
    assert _square_grad_steps(Adam, 2, lr=0.1)[0] == pytest.approx(w2, rel=1e-6)
    # L2 weight decay enters the gradient: g = 2w + w = 3w; still a step of exactly lr on step 1
    np.testing.assert_allclose(_square_grad_steps(Adam, 1, lr=0.1, weight_decay=1.0), [0.9, -1.9], rtol=1e-6)


def test_optimizer_skips_parameters_without_grad_and_validates():
    a, b = Parameter(np.ones(2)), Parameter(np.ones(2))
    opt = SGD([a, b], lr=0.5)
    (a * a).sum().backward()
    opt.step()
    np.testing.assert_allclose(b.data, [1., 1.])
    np.testing.assert_allclose(a.data, [0., 0.])
    with pytest.raises(TinycompError, match='empty parameter list'):
        SGD([], lr=0.1)


def test_lr_schedules():
    opt = SGD([Parameter(np.zeros(1))], lr=1.0)
    sched = StepLR(opt, step_size=2, gamma=0.5)
    lrs = []
    for _ in range(5): sched.step(); lrs.append(opt.lr)
    np.testing.assert_allclose(lrs, [1, 0.5, 0.5, 0.25, 0.25])
    opt = SGD([Parameter(np.zeros(1))], lr=1.0)
    sched = CosineAnnealingLR(opt, T_max=2, eta_min=0.2)
    sched.step(); assert opt.lr == pytest.approx(0.6)
    sched.step(); assert opt.lr == pytest.approx(0.2)


class TwoLayer(Module):
    def __init__(self):
        super().__init__()
        self.body = Sequential(Linear(4, 8), ReLU())
        self.head = Linear(8, 2, bias=False)
        self.register_buffer('calls', np.zeros(1))

    def forward(self, x): return self.head(self.body(x))


def test_module_tree_state_dict_round_trip():
    T.manual_seed(0)
    m = TwoLayer()
    names = [n for n, _ in m.named_parameters()]
    assert names == ['body.0.weight', 'body.0.bias', 'head.weight']
    sd = m.state_dict()
    assert set(sd) == set(names) | {'calls'}
    sd['calls'] = np.array([7.0])
    T.manual_seed(1)
    m2 = TwoLayer().load_state_dict(sd)
    x = randn(3, 4).astype(np.float32)
    np.testing.assert_array_equal(m2(x).data, m(x).data)
    assert m2.calls[0] == 7.0
    sd['head.weight'] += 1  # the state dict is a copy
    assert not np.array_equal(m.head.weight.data, sd['head.weight'])


def test_load_state_dict_errors():
    m = TwoLayer()
    sd = m.state_dict()
    with pytest.raises(ShapeError, match="'head.weight' has shape"):
        m.load_state_dict({**sd, 'head.weight': np.zeros((3, 3))})
    with pytest.raises(ShapeError, match='missing keys'):
        m.load_state_dict({k: v for k, v in sd.items() if k != 'calls'})
    with pytest.raises(ShapeError, match='unexpected keys'):
        m.load_state_dict({**sd, 'extra': np.zeros(1)})
    m.load_state_dict({'calls': np.ones(1)}, strict=False)


def test_module_without_super_init_is_explained():
    class Broken(Module):
        def __init__(self): self.fc = Linear(2, 2)
    with pytest.raises(TinycompError, match='super\\(\\).__init__'):
        Broken()


def test_train_eval_and_dropout():
    T.manual_seed(0)
    drop = Dropout(0.5)
    x = np.ones((1000,), np.float32)
    y = drop(x).data
    assert set(np.unique(y)) <= {0.0, 2.0} and 0.4 < (y == 0).mean() < 0.6
    net = Sequential(Linear(2, 2), drop)
    net.eval()
    assert not drop.training
    np.testing.assert_array_equal(drop(x).data, x)
    net.train()
    assert drop.training


def test_linear_matches_definition_and_repr():
    T.manual_seed(3)
    lin = Linear(5, 3)
    bound = 1 / math.sqrt(5)
    assert np.abs(lin.weight.data).max() <= bound and np.abs(lin.bias.data).max() <= bound
    x = randn(2, 7, 5).astype(np.float32)
    np.testing.assert_allclose(lin(x).data, x @ lin.weight.data.T + lin.bias.data, rtol=1e-5, atol=1e-6)
    assert gradcheck(lambda x, w: x @ w.T, randn(2, 5), lin.weight.data.astype(np.float64))
    r = repr(Sequential(Linear(2, 3), ReLU(), Sigmoid(), Tanh(), Flatten()))
    assert '(0): Linear(in_features=2, out_features=3, bias=True)' in r and '(4): Flatten(start_dim=1)' in r
    with pytest.raises(ShapeError, match='last dimension 5'):
        lin(np.ones((2, 4)))


def test_seeded_initialisation_is_reproducible():
    T.manual_seed(42); a = Linear(10, 10).weight.data
    T.manual_seed(42); b = Linear(10, 10).weight.data
    np.testing.assert_array_equal(a, b)


def test_mlp_learns_two_spirals():
    X, Y = T.two_spirals(n_per_class=100)
    T.manual_seed(0)
    mlp = Sequential(Linear(2, 32), Tanh(), Linear(32, 32), Tanh(), Linear(32, 2))
    opt = Adam(mlp.parameters(), lr=0.02)
    first = None
    for _ in range(200):
        opt.zero_grad()
        loss = cross_entropy(mlp(X), Y)
        first = first if first is not None else loss.item()
        loss.backward(); opt.step()
    assert loss.item() < first / 5
    with no_grad():
        assert (mlp(X).data.argmax(1) == Y).mean() > 0.9
