"Tests for tinycomp.pruning.structured: channel importance, slicing, dependency chains, prune_channels."
import copy

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.batchnorm import BatchNorm2d
from tinycomp.conv import Conv2d
from tinycomp.errors import TinycompError
from tinycomp.models import digits_cnn, load_pretrained
from tinycomp.nn import parameter_counts
from tinycomp.nn.modules import Dropout, Flatten, Linear, ReLU, Sequential, Sigmoid, Tanh
from tinycomp.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from tinycomp.pruning import structured as S
from tinycomp.tensor import Tensor, manual_seed, no_grad

pytestmark = pytest.mark.module05


def snapshot(m): return {k: v.copy() for k, v in m.state_dict().items()}


def same_state(a, b): return list(a) == list(b) and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def randomize_bn(model, seed=0):
    "Give every BatchNorm non-default statistics, scales and shifts (so a forgotten slice shows)."
    rng = np.random.default_rng(seed)
    for m in model.modules():
        if isinstance(m, BatchNorm2d):
            n = m.num_features
            m._buffers['running_mean'] = rng.normal(size=n).astype(np.float32)
            m._buffers['running_var'] = rng.uniform(0.5, 2, n).astype(np.float32)
            m.weight.data = rng.normal(size=n).astype(np.float32)
            m.bias.data = rng.normal(size=n).astype(np.float32)
    return model.eval()


def wide_like(seed=0):
    "digits_cnn_wide's layout, smaller."
    manual_seed(seed)
    return randomize_bn(Sequential(
        Conv2d(1, 8, 3, padding=1, bias=False), BatchNorm2d(8), ReLU(),
        Conv2d(8, 12, 3, padding=1), BatchNorm2d(12), ReLU(), MaxPool2d(2),
        Conv2d(12, 10, 3, padding=1, bias=False), BatchNorm2d(10), ReLU(),
        Flatten(), Dropout(0.25), Linear(10 * 4 * 4, 7), ReLU(), Linear(7, 3)), seed)


def mobile_like(seed=0):
    "Nested Sequentials, a depthwise conv with multiplier 2 followed by a depthwise conv with multiplier 1, pools."
    manual_seed(seed)
    return randomize_bn(Sequential(
        Sequential(Conv2d(2, 6, 3, padding=1), BatchNorm2d(6), ReLU()),
        Sequential(Conv2d(6, 12, 3, padding=1, groups=6, bias=False), BatchNorm2d(12), Tanh(),
                   Conv2d(12, 12, 3, padding=1, groups=12), AvgPool2d(2)),
        Conv2d(12, 5, 1), BatchNorm2d(5), ReLU(), AdaptiveAvgPool2d(1), Flatten(), Linear(5, 4)), seed)


def leaves(model): return [m for _, _, m in S._leaves(model)]


def switched_off(model, plan):
    """The masked original, built independently of prune_channels: every removed channel zeroed in its conv (filter
    and bias), and in every BatchNorm and depthwise conv of its chain (scale, shift, filter, bias)."""
    z = copy.deepcopy(model)
    ls = leaves(z)
    for i, keep in plan.items():
        off = np.setdiff1d(np.arange(ls[i].out_channels), keep)
        per = 1
        for j in range(i, len(ls)):
            m = ls[j]
            planes = (off[:, None] * per + np.arange(per)).ravel()
            if j == i or (isinstance(m, Conv2d) and m.groups > 1):
                if j != i:
                    per *= m.out_channels // m.in_channels
                    planes = (off[:, None] * per + np.arange(per)).ravel()
                m.weight.data[planes] = 0
                if m.bias is not None: m.bias.data[planes] = 0
            elif isinstance(m, BatchNorm2d):
                m.weight.data[planes] = 0; m.bias.data[planes] = 0
            elif isinstance(m, (Conv2d, Linear)): break
    return z


def run(model, x):
    with no_grad(): return model(Tensor(x)).data


# ---------------------------------------------------------------- channel_importance
def test_importance_values_and_dtype():
    rng = np.random.default_rng(0)
    w = rng.normal(size=(5, 3, 2, 2)).astype(np.float32)
    before = w.copy()
    np.testing.assert_allclose(S.channel_importance(w), np.abs(w).reshape(5, -1).sum(1), rtol=1e-6)
    np.testing.assert_allclose(S.channel_importance(Tensor(w), 'l2'), np.sqrt((w.astype(np.float64) ** 2).reshape(5, -1).sum(1)), rtol=1e-6)
    assert S.channel_importance(w).dtype == np.float32 and S.channel_importance(w, 'l2').dtype == np.float32
    assert np.array_equal(w, before)
    bn = BatchNorm2d(5); bn.weight.data = np.array([-3, 0, 1, 2, -0.5], np.float32)
    np.testing.assert_array_equal(S.channel_importance(w, 'bn_gamma', bn), [3, 0, 1, 2, 0.5])
    np.testing.assert_array_equal(S.channel_importance(w, 'bn_gamma', np.array([1, -2, 0, 0, 0], np.float32)), [1, 2, 0, 0, 0])
    lin = rng.normal(size=(4, 7)).astype(np.float32)             # a Linear weight: one score per neuron
    np.testing.assert_allclose(S.channel_importance(lin), np.abs(lin).sum(1), rtol=1e-6)


def test_importance_l1_and_l2_rank_differently():
    w = np.zeros((2, 4, 1, 1), np.float32)
    w[0, :, 0, 0] = 1.0          # L1 4, L2 2
    w[1, 0, 0, 0] = 3.0          # L1 3, L2 3
    assert S.channel_importance(w).argmax() == 0 and S.channel_importance(w, 'l2').argmax() == 1


@pytest.mark.parametrize('args, match', [
    ((np.ones((3, 2), np.float32), 'l3'), "importance must be one of"),
    ((np.ones((3, 2), np.float32), 'bn_gamma'), "needs the BatchNorm"),
    ((np.ones((3, 2), np.float32), 'bn_gamma', BatchNorm2d(4)), "3 output channels"),
    ((np.ones((3, 2), np.float32), 'bn_gamma', BatchNorm2d(3, affine=False)), "affine"),
    ((np.array([[1., np.inf]], np.float32),), "NaN or inf"),
    ((np.ones(3, np.float32),), "at least 2 axes"),
    ((np.ones((0, 3), np.float32),), "empty"),
    ((np.ones((3, 2), np.int32),), "floats"),
])
def test_importance_bad_input(args, match):
    with pytest.raises(TinycompError, match=match.replace('(', r'\(')): S.channel_importance(*args)


# ---------------------------------------------------------------- channels_to_keep
def test_keep_rounding_and_ties():
    assert S.channels_to_keep([3., 1., 2., 1.], 0.5).tolist() == [0, 2]
    assert S.channels_to_keep([1., 1., 1., 1.], 0.25).tolist() == [1, 2, 3]
    assert S.channels_to_keep([1., 1., 1., 1.], 0.75).tolist() == [3]
    assert S.channels_to_keep(np.arange(6.)[::-1], 0.25).tolist() == [0, 1, 2, 3]      # round(1.5) = 2
    assert S.channels_to_keep(np.arange(10.), 0.25).tolist() == list(range(2, 10))     # round(2.5) = 2
    assert S.channels_to_keep(np.arange(10.), 0.35).tolist() == list(range(4, 10))     # round(3.5) = 4
    assert S.channels_to_keep([5., 4.], 0.0).tolist() == [0, 1]
    assert S.channels_to_keep([5., 4.], 0.0).dtype == np.int64


@pytest.mark.parametrize('scores, ratio, match', [
    ([1., 2.], 1.0, "would remove all 2 channels"), ([1., 2., 3.], 0.9, "would remove all 3"),
    ([1., 2.], -0.1, "must be in"), ([1., 2.], 1.5, "must be in"), ([1., 2.], float('nan'), "must be in"),
    ([1., 2.], '0.5', "must be a number"), ([1., 2.], True, "must be a number"),
    ([], 0.5, "non-empty"), ([[1.]], 0.5, "non-empty 1-D"), ([1., np.nan], 0.5, "NaN"),
])
def test_keep_bad_input(scores, ratio, match):
    with pytest.raises(TinycompError, match=match): S.channels_to_keep(scores, ratio)


# ---------------------------------------------------------------- slice_conv_bn_next
def test_slice_conv_bn_conv_equals_switched_off():
    manual_seed(1)
    conv, bn, nxt = Conv2d(3, 6, 3, padding=1), BatchNorm2d(6), Conv2d(6, 4, 3, stride=2, padding=1)
    model = randomize_bn(Sequential(conv, bn, ReLU(), nxt))
    before = snapshot(model)
    keep = np.array([1, 4, 5])
    c, b, n = S.slice_conv_bn_next(conv, bn, nxt, keep)
    assert same_state(snapshot(model), before)
    assert (c.out_channels, b.num_features, n.in_channels) == (3, 3, 3)
    assert c.weight.shape == (3, 3, 3, 3) and c.bias.shape == (3,) and n.weight.shape == (4, 3, 3, 3)
    np.testing.assert_array_equal(b.running_var, before['1.running_var'][keep])
    assert b.running_mean.dtype == np.float32 and c.weight.data.dtype == np.float32
    assert int(b.num_batches_tracked) == int(before['1.num_batches_tracked'])
    x = np.random.default_rng(0).normal(size=(2, 3, 7, 7)).astype(np.float32)
    ref = switched_off(model, {0: keep})
    np.testing.assert_allclose(run(Sequential(c, b, ReLU(), n).eval(), x), run(ref, x), atol=1e-5)


def test_slice_conv_linear_blocks_and_no_bn():
    manual_seed(2)
    conv, lin = Conv2d(2, 4, 3, padding=1, bias=False), Linear(4 * 3 * 3, 5)
    c, b, n = S.slice_conv_bn_next(conv, None, lin, [0, 3])
    assert b is None and c.bias is None
    np.testing.assert_array_equal(n.weight.data, lin.weight.data[:, [0, 1, 2, 3, 4, 5, 6, 7, 8, 27, 28, 29, 30, 31, 32, 33, 34, 35]])
    np.testing.assert_array_equal(n.bias.data, lin.bias.data)
    assert n.in_features == 18
    x = np.random.default_rng(0).normal(size=(3, 2, 3, 3)).astype(np.float32)
    ref = switched_off(Sequential(conv, ReLU(), Flatten(), lin), {0: np.array([0, 3])})
    np.testing.assert_allclose(run(Sequential(c, ReLU(), Flatten(), n), x), run(ref, x), atol=1e-5)
    c2, b2, n2 = S.slice_conv_bn_next(conv, BatchNorm2d(4, affine=False), None, np.array([2], np.int32))
    assert n2 is None and b2.weight is None and b2.running_mean.shape == (1,) and c2.out_channels == 1


def test_slice_unsorted_keep_is_sorted():
    manual_seed(3)
    conv = Conv2d(1, 5, 1)
    c, _, _ = S.slice_conv_bn_next(conv, None, None, [3, 0])
    np.testing.assert_array_equal(c.weight.data, conv.weight.data[[0, 3]])


@pytest.mark.parametrize('make, match', [
    (lambda: (Conv2d(4, 4, 3, groups=4), None, None, [0]), "groups=1"),
    (lambda: (Conv2d(1, 4, 3), BatchNorm2d(5), None, [0]), "BatchNorm2d\\(4\\)"),
    (lambda: (Conv2d(1, 4, 3), None, Conv2d(5, 2, 1), [0]), "4 input channels"),
    (lambda: (Conv2d(1, 4, 3), None, Conv2d(4, 4, 1, groups=2), [0]), "groups=1"),
    (lambda: (Conv2d(1, 4, 3), None, Linear(10, 2), [0]), "not a multiple of 4"),
    (lambda: (Conv2d(1, 4, 3), None, ReLU(), [0]), "Conv2d, a Linear or None"),
    (lambda: (Conv2d(1, 4, 3), None, None, []), "non-empty"),
    (lambda: (Conv2d(1, 4, 3), None, None, [1, 1]), "twice"),
    (lambda: (Conv2d(1, 4, 3), None, None, [4]), "outside"),
    (lambda: (Conv2d(1, 4, 3), None, None, [-1]), "outside"),
    (lambda: (Conv2d(1, 4, 3), None, None, [0.5]), "integer"),
])
def test_slice_bad_input(make, match):
    with pytest.raises(TinycompError, match=match): S.slice_conv_bn_next(*make())


# ---------------------------------------------------------------- dependencies
def test_dependencies_of_wide_and_reasons():
    d = S.channel_dependencies(load_pretrained('digits_cnn_wide'))
    assert sorted(d) == [0, 3, 7]
    assert (d[0]['consumer'], d[3]['consumer'], d[7]['consumer']) == (3, 7, 12)
    assert d[7]['kind'] == 'linear' and d[7]['hw'] == 16 and d[3]['bns'] == [(4, 1)]
    r = S.channel_dependencies(Sequential(Conv2d(1, 4, 3), Sigmoid(), Conv2d(4, 2, 1)))
    assert 'Sigmoid' in r[0]['reason'] and 'last layer' in r[2]['reason']
    g = S.channel_dependencies(Sequential(Conv2d(1, 4, 3), Conv2d(4, 4, 3, groups=2), Conv2d(4, 2, 1), Flatten(), Linear(2, 1)))
    assert 'grouped' in g[0]['reason'] and g[2]['kind'] == 'linear'
    f = S.channel_dependencies(Sequential(Conv2d(1, 4, 3), Flatten(start_dim=2), Linear(4, 1)))
    assert 'start_dim' in f[0]['reason']
    n = S.channel_dependencies(Sequential(Conv2d(1, 4, 3), Linear(6, 1)))     # Linear on the W axis, no Flatten
    assert 'Linear' in n[0]['reason']


def test_not_sequential_is_an_error():
    with pytest.raises(TinycompError, match="Sequential models"): S.prune_channels(Conv2d(1, 2, 3), 0.5)


# ---------------------------------------------------------------- prune_channels
@pytest.mark.parametrize('importance', ['l1', 'l2', 'bn_gamma'])
@pytest.mark.parametrize('ratio', [0.25, 0.5, 0.75])
def test_pruned_equals_switched_off_wide_like(importance, ratio):
    model = wide_like()
    before = snapshot(model)
    plan = S.channel_plan(model, ratio, importance)
    assert sorted(plan) == [0, 3, 7]
    new = S.prune_channels(model, ratio, importance, input_shape=(1, 1, 8, 8))
    assert same_state(snapshot(model), before)                     # input untouched
    x = np.random.default_rng(5).normal(size=(6, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan), x), atol=1e-4)
    assert parameter_counts(new).parameters < parameter_counts(model).parameters
    assert [m.out_channels for m in new if isinstance(m, Conv2d)] == [len(plan[0]), len(plan[3]), len(plan[7])]
    assert new[12].in_features == len(plan[7]) * 16 and new[14].out_features == 3


def test_plan_follows_importance():
    model = wide_like()
    g = np.abs(model[1].weight.data)
    assert S.channel_plan(model, 0.5, 'bn_gamma')[0].tolist() == np.sort(np.argsort(g, kind='stable')[4:]).tolist()
    l1 = np.abs(model[0].weight.data).reshape(8, -1).sum(1)
    assert S.channel_plan(model, 0.5)[0].tolist() == np.sort(np.argsort(l1, kind='stable')[4:]).tolist()


def test_pruned_mobile_like_depthwise_nested():
    model = mobile_like()
    d = S.channel_dependencies(model)
    assert sorted(d) == [0, 8]                   # the depthwise convs (3, 6) follow conv 0
    assert d[0]['depthwise'] == [(3, 2, 1), (6, 1, 2)] and d[0]['bns'] == [(1, 1), (4, 2)]
    assert (d[0]['consumer'], d[0]['planes'], d[8]['kind']) == (8, 2, 'linear')
    plan = S.channel_plan(model, {0: 0.5, 8: 0.4})
    assert (len(plan[0]), len(plan[8])) == (3, 3)
    new = S.prune_channels(model, {0: 0.5, 8: 0.4}, input_shape=(2, 2, 8, 8))
    ls = leaves(new)
    assert isinstance(new[0], Sequential) and isinstance(new[1], Sequential)          # structure kept
    assert (ls[0].out_channels, ls[1].num_features) == (3, 3)
    assert (ls[3].in_channels, ls[3].groups, ls[3].out_channels, ls[4].num_features) == (3, 3, 6, 6)
    assert (ls[6].in_channels, ls[6].groups, ls[6].out_channels) == (6, 6, 6)
    assert (ls[8].in_channels, ls[8].out_channels, ls[9].num_features, ls[13].in_features) == (6, 3, 3, 3)
    x = np.random.default_rng(2).normal(size=(4, 2, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan), x), atol=1e-4)


def test_dict_ratio_only_named_layers():
    model = wide_like()
    new = S.prune_channels(model, {3: 0.5})
    assert [m.out_channels for m in new if isinstance(m, Conv2d)] == [8, 6, 10]
    assert new[7].in_channels == 6 and new[4].num_features == 6
    x = np.random.default_rng(1).normal(size=(3, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(switched_off(model, S.channel_plan(model, {3: 0.5})), x), atol=1e-4)


def test_zero_ratio_is_identity_and_copy():
    model = wide_like()
    new = S.prune_channels(model, 0.0)
    assert new is not model and same_state(snapshot(new), snapshot(model))
    new[0].weight.data[:] = 0
    assert np.abs(model[0].weight.data).sum() > 0


def test_last_layer_outputs_never_pruned():
    manual_seed(0)
    model = Sequential(Conv2d(1, 4, 3, padding=1), ReLU(), Conv2d(4, 3, 1)).eval()
    new = S.prune_channels(model, 0.5)
    assert new[2].out_channels == 3 and new[0].out_channels == 2 and new[2].in_channels == 2
    with pytest.raises(TinycompError, match="last layer"): S.prune_channels(model, {2: 0.5})


def test_digits_cnn_no_bn():
    model = digits_cnn()
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert [m.out_channels for m in new if isinstance(m, Conv2d)] == [8, 16] and new[6].in_features == 16 * 16
    with pytest.raises(TinycompError, match="needs a BatchNorm2d right after the conv at layer 0"):
        S.prune_channels(model, 0.5, 'bn_gamma')


def test_training_mode_kept_and_trainable():
    model = wide_like().train()
    new = S.prune_channels(model, 0.5)
    assert new.training and all(m.training for m in new.modules())
    out = new(Tensor(np.random.default_rng(0).normal(size=(4, 1, 8, 8)).astype(np.float32)))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in new.parameters())


@pytest.mark.parametrize('ratio, match', [
    (1.0, "would remove all 8 channels"), ({0: 1.0}, "would remove all 8"), ({12: 0.5}, "not a Conv2d"),
    ({99: 0.5}, "layer indices"), ({'0': 0.5}, "layer indices"), ({0: 2.0}, "ratio of layer 0"), (-0.5, "must be in"),
])
def test_prune_bad_ratio(ratio, match):
    with pytest.raises(TinycompError, match=match): S.prune_channels(wide_like(), ratio)


def test_prune_bad_importance_and_input_shape():
    with pytest.raises(TinycompError, match="importance must be one of"): S.prune_channels(wide_like(), 0.5, 'l0')
    with pytest.raises(TinycompError, match="does not run"): S.prune_channels(wide_like(), 0.5, input_shape=(1, 1, 6, 6))
    with pytest.raises(TinycompError, match="no conv whose output channels"):
        S.prune_channels(Sequential(Conv2d(1, 2, 3), Sigmoid(), Conv2d(2, 2, 1)), 0.5)


def test_file_shrinks_and_round_trips(tmp_path):
    model = load_pretrained('digits_cnn_wide')
    new = S.prune_channels(model, 0.5)
    pa, pb = tio.save(model, tmp_path / 'a.npz'), tio.save(new, tmp_path / 'b.npz')
    assert pb.stat().st_size <= 0.55 * pa.stat().st_size
    assert parameter_counts(new).parameters <= 0.45 * parameter_counts(model).parameters
    back = tio.load(pb).eval()
    x = np.random.default_rng(0).normal(size=(5, 1, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(back, x), run(new.eval(), x))
