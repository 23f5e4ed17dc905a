"Module 01, parts 01b (tinycomp.nn.functional) and 01c (tinycomp.nn.modules), and the tinycomp.nn namespace."
import math
import subprocess
import sys

import numpy as np
import pytest

import tinycomp.nn as nn
import tinycomp.nn.functional as F
import tinycomp.nn.modules as M
import tinycomp.tensor as T
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.files import CONTAINERS, LAYERS
from tinycomp.nn import Dropout, Flatten, Linear, Module, Parameter, ReLU, Sequential, Sigmoid, Tanh
from tinycomp.nn.functional import cross_entropy, dropout, linear, mse_loss
from tinycomp.tensor import Tensor, gradcheck

pytestmark = pytest.mark.module01

rng = np.random.default_rng(4321)


def randn(*shape):
    return rng.standard_normal(shape)


# ------------------------------------------------------------------------------------------- 01b: functional
GRADCHECK_CASES = [
    ('cross_entropy', lambda a: cross_entropy(a, np.array([0, 2, 1, 2])), [randn(4, 3)]),
    ('cross_entropy-sum', lambda a: cross_entropy(a, np.array([1, 0]), reduction='sum'), [randn(2, 3)]),
    ('cross_entropy-none', lambda a: cross_entropy(a, np.array([1, 0]), reduction='none'), [randn(2, 3)]),
    ('mse_loss', lambda a, b: mse_loss(a, b), [randn(3, 4), randn(3, 4)]),
    ('mse_loss-none', lambda a, b: mse_loss(a, b, reduction='none'), [randn(3, 4), randn(3, 4)]),
    ('linear', lambda x, w, b: linear(x, w, b), [randn(2, 5), randn(3, 5), randn(3)]),
    ('linear-3d-no-bias', lambda x, w: linear(x, w), [randn(2, 4, 5), randn(3, 5)]),
]


@pytest.mark.parametrize('name,fn,inputs', GRADCHECK_CASES, ids=[c[0] for c in GRADCHECK_CASES])
def test_gradcheck_functional(name, fn, inputs):
    assert gradcheck(fn, *inputs)


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


@pytest.mark.parametrize('loss', [lambda r: cross_entropy(Tensor(np.zeros((2, 3))), np.array([0, 1]), reduction=r),
                                  lambda r: mse_loss(np.zeros(3), np.ones(3), reduction=r)])
def test_losses_reject_unknown_reduction(loss):
    with pytest.raises(TinycompError, match="reduction must be 'mean', 'sum' or 'none', got 'avg'"):
        loss('avg')


def test_mse_loss_values_and_shape_check():
    x, t = np.array([1., 2., 3.]), np.array([1., 0., 0.])
    assert mse_loss(x, t).item() == pytest.approx(13 / 3)
    assert mse_loss(x, t, reduction='sum').item() == pytest.approx(13)
    np.testing.assert_allclose(mse_loss(x, t, reduction='none').data, [0, 4, 9])
    with pytest.raises(ShapeError, match='differ in shape'):
        mse_loss(np.ones((3, 1)), np.ones(3))


def test_linear_matches_definition_and_checks_shapes():
    x, w, b = randn(2, 7, 5).astype(np.float32), randn(3, 5).astype(np.float32), randn(3).astype(np.float32)
    np.testing.assert_allclose(linear(x, w, b).data, x @ w.T + b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(linear(x, w).data, x @ w.T, rtol=1e-5, atol=1e-6)
    assert isinstance(linear(x, w), Tensor)
    with pytest.raises(ShapeError, match='last dimension 5'):
        linear(np.ones((2, 4)), w)
    with pytest.raises(ShapeError, match='weight of shape'):
        linear(x, np.ones(5))
    with pytest.raises(ShapeError, match=r'bias of shape \(3,\)'):
        linear(x, w, np.ones(4))


def test_dropout_function_is_seeded_scaled_and_checked():
    T.manual_seed(11); a = dropout(np.ones(4000, np.float32), p=0.3).data
    T.manual_seed(11); b = dropout(np.ones(4000, np.float32), p=0.3).data
    np.testing.assert_array_equal(a, b)
    assert set(np.unique(a)) <= {0.0, np.float32(1 / 0.7)} and 0.25 < (a == 0).mean() < 0.35
    np.testing.assert_array_equal(dropout(np.ones(3), p=0.5, training=False).data, np.ones(3))
    np.testing.assert_array_equal(dropout(np.ones(3), p=0.0).data, np.ones(3))
    with pytest.raises(TinycompError, match=r'\[0, 1\)'):
        dropout(np.ones(3), p=1.0)


def test_functional_reexports_the_activations_of_part_01a():
    for name in ('relu', 'sigmoid', 'tanh', 'softmax', 'log_softmax'):
        assert getattr(F, name) is getattr(T, name)


# --------------------------------------------------------------------------------------------- 01c: modules
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


def test_hardtanh_and_relu6_clamp_and_pass_the_gradient_inside_only():
    x = np.array([[-3.0, -1.0, -0.2, 0.0, 0.3, 5.9, 6.0, 7.5]], np.float32)
    for layer, lo, hi in ((M.ReLU6(), 0.0, 6.0), (M.Hardtanh(-1.0, 0.25), -1.0, 0.25)):
        np.testing.assert_array_equal(layer(x).data, np.clip(x, lo, hi))
        t = Tensor(x, requires_grad=True)
        layer(t).sum().backward()
        np.testing.assert_array_equal(t.grad, ((x > lo) & (x < hi)).astype(float))
        inside = np.array([[lo + 0.1, (lo + hi) / 2, hi - 0.1]])         # away from the kinks
        assert gradcheck(lambda a, layer=layer: layer(a), inside)
    assert M.ReLU6()(np.ones(3, np.float32)).dtype == np.float32
    for bad in ((1, 1), (2, 1), (float('nan'), 1), (0, float('inf'))):
        with pytest.raises(TinycompError, match='min_val < max_val'): M.Hardtanh(*bad)


def test_seeded_initialisation_is_reproducible():
    T.manual_seed(42); a = Linear(10, 10).weight.data
    T.manual_seed(42); b = Linear(10, 10).weight.data
    np.testing.assert_array_equal(a, b)


def test_layers_call_the_functional_forms(monkeypatch):
    calls = []
    real_linear, real_dropout = F.linear, F.dropout
    monkeypatch.setattr(F, 'linear', lambda *a: calls.append('linear') or real_linear(*a))
    monkeypatch.setattr(F, 'dropout', lambda *a: calls.append('dropout') or real_dropout(*a))
    Sequential(Linear(3, 2), Dropout(0.5))(np.ones((1, 3)))
    assert calls == ['linear', 'dropout']


def test_initialisers_draw_from_the_seeded_generator():
    w = Parameter(np.zeros((64, 32)))
    T.manual_seed(9); a = M.kaiming_uniform_(w).data.copy()
    T.manual_seed(9); np.testing.assert_array_equal(M.kaiming_uniform_(w).data, a)
    M.xavier_normal_(w, rng=np.random.default_rng(0))
    assert w.data.std() == pytest.approx(math.sqrt(2 / 96), rel=0.05)


def test_every_layer_is_on_the_model_file_allow_list():
    for cls in (Linear, ReLU, M.ReLU6, M.Hardtanh, Sigmoid, Tanh, Flatten, Dropout, Sequential):
        assert LAYERS[cls.__name__] is cls and cls.__module__ == 'tinycomp.nn.modules'
    for layer in (Linear(3, 2, bias=False), ReLU(), M.ReLU6(), M.Hardtanh(-2, 0.5), Sigmoid(), Tanh(), Flatten(2), Dropout(0.2)):
        assert type(layer)(**layer.config()).config() == layer.config()   # what a model file stores rebuilds it
    assert 'Sequential' in CONTAINERS and 'Linear' not in CONTAINERS


# -------------------------------------------------------------------------------------------- the namespace
def test_nn_namespace_reexports_modules():
    for name in ('Module', 'Parameter', 'Sequential', 'Linear', 'ReLU', 'ReLU6', 'Hardtanh', 'Sigmoid', 'Tanh', 'Flatten', 'Dropout',
                 'calculate_gain', 'kaiming_normal_', 'kaiming_uniform_', 'normal_', 'uniform_', 'xavier_normal_',
                 'xavier_uniform_', 'zeros_', 'default_init_'):
        assert getattr(nn, name) is getattr(M, name), name
    assert nn.functional is F


@pytest.mark.parametrize('mod,names', [(nn, ('Conv2d', 'MaxPool2d', 'AvgPool2d', 'AdaptiveAvgPool2d', 'BatchNorm2d')),
                                       (F, ('conv2d', 'max_pool2d', 'avg_pool2d', 'adaptive_avg_pool2d', 'batch_norm'))])
def test_module_02_names_are_listed_but_not_in_all(mod, names):
    assert set(names) <= set(dir(mod))
    assert not set(names) & set(mod.__all__)
    with pytest.raises(AttributeError, match="has no attribute 'Conv3d'"):
        mod.Conv3d


def test_nn_and_functional_do_not_import_module_02():
    code = ("import sys, tinycomp.nn, tinycomp.nn.functional, tinycomp.optim\n"
            "from tinycomp.nn import *\nfrom tinycomp.nn.functional import *\n"
            "assert not {'tinycomp.conv', 'tinycomp.pooling', 'tinycomp.batchnorm'} & set(sys.modules), 'module 02 was imported'")
    subprocess.run([sys.executable, '-c', code], check=True, timeout=120)
