"Module 01, part 01d (tinycomp.optim): SGD, Adam, learning-rate schedules, and an MLP trained with module 01."
import math

import numpy as np
import pytest

import tinycomp.tensor as T
from tinycomp.data import two_spirals
from tinycomp.errors import TinycompError
from tinycomp.nn import Linear, Parameter, Sequential, Tanh
from tinycomp.nn.functional import cross_entropy
from tinycomp.optim import SGD, Adam, CosineAnnealingLR, Optimizer, StepLR
from tinycomp.tensor import Tensor, no_grad

pytestmark = pytest.mark.module01


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


def test_optimizer_validation():
    w = Parameter(np.ones(2))
    with pytest.raises(TinycompError, match='requires_grad=True'):
        SGD([Tensor(np.ones(2))], lr=0.1)
    with pytest.raises(TinycompError, match='learning rate must be >= 0'):
        Adam([w], lr=-0.1)
    with pytest.raises(TinycompError, match='needs momentum > 0'):
        SGD([w], nesterov=True)
    assert isinstance(Adam([w]), Optimizer)


def test_steps_keep_float32():
    w = Parameter(np.ones(3))
    for opt in (SGD([w], lr=0.1, momentum=0.9, weight_decay=0.1), Adam([w], lr=0.1, weight_decay=0.1)):
        opt.zero_grad(); (w * w).sum().backward(); opt.step()
        assert w.dtype == np.float32


def test_mlp_learns_two_spirals():
    X, Y = two_spirals(n_per_class=100)
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
