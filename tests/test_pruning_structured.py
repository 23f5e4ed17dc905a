"Tests for tinycomp.pruning.structured: channel importance, slicing, dependency chains, prune_channels."
import copy

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.batchnorm import BatchNorm2d
from tinycomp.conv import Conv2d
from tinycomp.errors import TinycompError
from tinycomp import nn
from tinycomp.graph import trace
from tinycomp.models import digits_cnn, digits_mobilenet, digits_resnet, load_pretrained
from tinycomp.nn import parameter_counts
from tinycomp.nn.modules import Dropout, Flatten, Linear, ReLU, Sequential, Sigmoid, Tanh
from tinycomp.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from tinycomp.pruning import structured as S
from tinycomp.tensor import Tensor, manual_seed, no_grad

from graph_models import BranchyNet, images, trained_like

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


def switched_off(model, plan, input_shape):
    """The masked original, built independently of prune_channels: for every value that loses channels, the rows of
    the weights and biases of the layer that makes it set to zero (conv and depthwise filters, BatchNorm scale and shift)."""
    z = copy.deepcopy(model)
    for n in trace(z, np.zeros(input_shape, np.float32)):
        off = np.setdiff1d(np.arange(n.shape[1]), plan.get(n.name, np.arange(n.shape[1])))
        for name in ('weight', 'bias'):
            p = n.module._parameters.get(name)
            if p is not None and len(off): p.data[off] = 0
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
    ref = switched_off(model, {'0': keep, '1': keep}, (1, 3, 7, 7))
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
    ref = switched_off(Sequential(conv, ReLU(), Flatten(), lin), {'0': np.array([0, 3])}, (1, 2, 3, 3))
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


# ---------------------------------------------------------------- flows and dependency groups
def groups_of(model, shape=(1, 1, 8, 8)):
    return S.dependency_groups(trace(model, np.zeros(shape, np.float32)))


def test_groups_of_wide_and_reasons():
    gs = groups_of(load_pretrained('digits_cnn_wide'))
    assert [g.producers for g in gs] == [(), ('0',), ('3',), ('7',), ('12',), ('14',)]
    assert gs[3].values == ('7', '8', '9', '10', '11') and len(gs[3].labels) == 64       # the Flatten's 1024 features
    assert 'input' in gs[0].reason and 'output' in gs[5].reason and all(g.reason is None for g in gs[1:5])
    def reason(model, shape=(1, 1, 8, 8)): return groups_of(model, shape)[1].reason
    assert 'Sigmoid' in reason(Sequential(Conv2d(1, 4, 3), Sigmoid(), Conv2d(4, 2, 1)))
    assert 'Conv2d' in reason(Sequential(Conv2d(1, 4, 3), Conv2d(4, 4, 3, groups=2), Conv2d(4, 2, 1), Flatten(), Linear(32, 1)))
    assert 'Flatten' in reason(Sequential(Conv2d(1, 4, 3), Flatten(start_dim=2), Linear(36, 1)))
    assert 'Linear' in reason(Sequential(Conv2d(1, 4, 3), Linear(6, 1)))                  # a Linear on the W axis


def test_channel_groups_couple_adds_depthwise_and_concat_slices():
    g = trace(trained_like(BranchyNet()), images(2))
    labels = S.channel_groups(g)
    assert set(labels) == {'input', *g.nodes} and all(v.dtype == np.int64 for v in labels.values())
    assert np.array_equal(labels['block.add'], labels['stem']) and np.array_equal(labels['block.bn2'], labels['stem'])
    assert np.array_equal(labels['depthwise'], labels['stem']) and np.array_equal(labels['mul'], labels['stem'])
    assert np.array_equal(labels['cat'], np.concatenate([labels['stem'], labels['stem']]))
    assert not np.isin(labels['block.conv1'], labels['stem']).any() and len(set(labels['stem'])) == 8
    assert np.array_equal(labels['div'], labels['pointwise']) and np.array_equal(labels['flatten'], labels['pointwise'])


def test_a_depthwise_multiplier_inside_a_residual_block():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.dw, self.pw = Conv2d(1, 4, 3, padding=1), Conv2d(4, 8, 3, padding=1, groups=4), Conv2d(8, 4, 1)
            self.fc = Linear(4, 3)
        def forward(self, x):
            x = self.stem(x)
            return self.fc((x + self.pw(self.dw(x).relu())).mean((2, 3)))
    manual_seed(0)
    model = Block().eval()
    labels = S.channel_groups(trace(model, np.zeros((1, 1, 8, 8), np.float32)))
    assert np.array_equal(labels['dw'], np.repeat(labels['stem'], 2)) and np.array_equal(labels['add'], labels['stem'])
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert (new.stem.out_channels, new.dw.in_channels, new.dw.groups, new.dw.out_channels, new.pw.in_channels) == (2, 2, 2, 4, 4)
    assert new.pw.out_channels == 2 and new.fc.in_features == 2
    x = np.random.default_rng(0).normal(size=(3, 1, 8, 8)).astype(np.float32)
    plan = S.channel_plan(model, 0.5, input_shape=(1, 1, 8, 8))
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (1, 1, 8, 8)), x), atol=1e-5)


@pytest.mark.parametrize('make', [lambda: trained_like(BranchyNet()), lambda: randomize_bn(digits_resnet()),
                                  lambda: randomize_bn(digits_mobilenet())], ids=['branchy', 'resnet', 'mobilenet'])
def test_models_that_are_not_chains_shrink_and_equal_the_switched_off_original(make, tmp_path):
    manual_seed(0)
    model = make()
    before = snapshot(model)
    plan = S.channel_plan(model, 0.5, input_shape=(1, 1, 8, 8))
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert same_state(snapshot(model), before) and type(new) is type(model)
    x = np.random.default_rng(3).normal(size=(5, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (1, 1, 8, 8)), x), atol=1e-4)
    assert parameter_counts(new).parameters < 0.5 * parameter_counts(model).parameters
    saved = new if type(model).__name__ != 'BranchyNet' else trace(new, images(1))    # a class of the tests: saved as its graph
    back = tio.load(tio.save(saved, tmp_path / 'p.npz')).eval()
    np.testing.assert_array_equal(run(back, x), run(new, x))


def test_clamps_pass_channels_through():
    manual_seed(0)
    model = Sequential(Conv2d(1, 8, 3, padding=1), nn.ReLU6(), Conv2d(8, 8, 3, padding=1), nn.Hardtanh(-0.5, 0.5),
                       Flatten(), Linear(8 * 64, 10)).eval()
    plan = S.channel_plan(model, 0.5, input_shape=(1, 1, 8, 8))
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert [type(m).__name__ for m in new] == ['Conv2d', 'ReLU6', 'Conv2d', 'Hardtanh', 'Flatten', 'Linear']
    assert new[2].in_channels == 4 and new[5].in_features == 4 * 64
    x = np.random.default_rng(3).normal(size=(5, 1, 8, 8)).astype(np.float32) * 3
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (1, 1, 8, 8)), x), atol=1e-5)


def test_a_graph_is_pruned_in_place_of_its_layers(tmp_path):
    model = trained_like(BranchyNet())
    g = tio.load(tio.save(trace(model, images(2)), tmp_path / 'g.npz')).eval()
    new = S.prune_channels(g, 0.5)                                      # a graph knows its input shape
    assert type(new).__name__ == 'Graph' and new['stem'].shape == (2, 4, 8, 8) and new['cat'].shape == (2, 8, 8, 8)
    x = images(3, seed=1)
    np.testing.assert_allclose(run(new, x), run(S.prune_channels(model, 0.5, input_shape=(2, 1, 8, 8)), x), atol=1e-5)
    assert g['stem'].module.out_channels == 8                          # the input is untouched


def test_a_layer_called_twice_keeps_its_channels():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.shared, self.fc = Conv2d(1, 4, 3, padding=1), Conv2d(4, 4, 3, padding=1), Linear(4, 2)
        def forward(self, x): return self.fc(self.shared(self.shared(self.stem(x)).relu()).mean((2, 3)))
    gs = groups_of(Twice())
    assert all('used 2 times' in g.reason for g in gs if set(g.producers) & {'stem', 'shared', 'shared_1'})
    with pytest.raises(TinycompError, match="used 2 times"): S.prune_channels(Twice(), 0.5, input_shape=(1, 1, 8, 8))


def test_masked_layers_lose_their_mask_rows_too():
    from tinycomp.pruning import prune
    model = prune(wide_like(), 0.3)
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert new[0].weight_mask.shape == new[0].weight.shape == (4, 1, 3, 3) and new[3].weight_mask.shape == (6, 4, 3, 3)
    x = np.random.default_rng(1).normal(size=(3, 1, 8, 8)).astype(np.float32)
    plan = S.channel_plan(model, 0.5, input_shape=(1, 1, 8, 8))
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (1, 1, 8, 8)), x), atol=1e-4)


def test_a_layer_type_without_the_protocol_is_left_alone():
    class Scale2(nn.Module):                          # knows nothing of channels: what goes in and out of it stays
        def forward(self, x): return x * 2
    model = Sequential(Conv2d(1, 4, 3, padding=1), Scale2(), Conv2d(4, 4, 3, padding=1), ReLU(), Flatten(), Linear(256, 2))
    assert 'Scale2' in groups_of(model)[1].reason
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert (new[0].out_channels, new[2].in_channels, new[2].out_channels, new[5].in_features) == (4, 4, 2, 128)


# ---------------------------------------------------------------- prune_channels
@pytest.mark.parametrize('importance', ['l1', 'l2', 'bn_gamma'])
@pytest.mark.parametrize('ratio', [0.25, 0.5, 0.75])
def test_pruned_equals_switched_off_wide_like(importance, ratio):
    model = wide_like()
    before = snapshot(model)
    plan = S.channel_plan(model, ratio, importance, input_shape=(1, 1, 8, 8))
    assert sorted(plan) == ['0', '1', '10', '11', '2', '3', '4', '5', '6', '7', '8', '9']
    new = S.prune_channels(model, ratio, importance, input_shape=(1, 1, 8, 8))
    assert same_state(snapshot(model), before)                     # input untouched
    x = np.random.default_rng(5).normal(size=(6, 1, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (1, 1, 8, 8)), x), atol=1e-4)
    assert parameter_counts(new).parameters < parameter_counts(model).parameters
    assert [m.out_channels for m in new if isinstance(m, Conv2d)] == [len(plan['0']), len(plan['3']), len(plan['7'])]
    assert new[12].in_features == len(plan['7']) * 16 and new[12].out_features == 7 and new[14].out_features == 3


def test_plan_follows_importance():
    model = wide_like()
    g = np.abs(model[1].weight.data)
    assert S.channel_plan(model, 0.5, 'bn_gamma', (1, 1, 8, 8))['0'].tolist() == np.sort(np.argsort(g, kind='stable')[4:]).tolist()
    l1 = np.abs(model[0].weight.data).reshape(8, -1).sum(1)
    assert S.channel_plan(model, 0.5, input_shape=(1, 1, 8, 8))['0'].tolist() == np.sort(np.argsort(l1, kind='stable')[4:]).tolist()


def test_a_group_is_scored_by_the_sum_over_its_layers():
    model = randomize_bn(digits_resnet())
    plan = S.channel_plan(model, 0.5, input_shape=(1, 1, 8, 8))
    l1 = lambda conv: np.abs(conv.weight.data.astype(np.float64)).reshape(conv.out_channels, -1).sum(1)
    total = l1(model.conv1) + l1(model.layer1.conv2)                     # both sides of the first residual add
    assert plan['conv1'].tolist() == np.sort(np.argsort(total.astype(np.float32), kind='stable')[16:]).tolist()
    assert np.array_equal(plan['layer1.add'], plan['conv1'])


def test_pruned_mobile_like_depthwise_nested():
    model = mobile_like()
    plan = S.channel_plan(model, {'0.0': 0.5, '2': 0.4}, input_shape=(2, 2, 8, 8))
    assert (len(plan['0.0']), len(plan['1.0']), len(plan['1.3']), len(plan['2'])) == (3, 6, 6, 3)
    new = S.prune_channels(model, {'0.0': 0.5, '2': 0.4}, input_shape=(2, 2, 8, 8))
    assert isinstance(new[0], Sequential) and isinstance(new[1], Sequential)          # structure kept
    assert (new[0][0].out_channels, new[0][1].num_features) == (3, 3)
    assert (new[1][0].in_channels, new[1][0].groups, new[1][0].out_channels, new[1][1].num_features) == (3, 3, 6, 6)
    assert (new[1][3].in_channels, new[1][3].groups, new[1][3].out_channels) == (6, 6, 6)
    assert (new[2].in_channels, new[2].out_channels, new[3].num_features, new[7].in_features) == (6, 3, 3, 3)
    x = np.random.default_rng(2).normal(size=(4, 2, 8, 8)).astype(np.float32)
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (2, 2, 8, 8)), x), atol=1e-4)


def test_dict_ratio_only_named_layers_and_linear_neurons_by_name():
    model = wide_like()
    new = S.prune_channels(model, {'3': 0.5}, input_shape=(1, 1, 8, 8))
    assert [m.out_channels for m in new if isinstance(m, Conv2d)] == [8, 6, 10]
    assert new[7].in_channels == 6 and new[4].num_features == 6
    x = np.random.default_rng(1).normal(size=(3, 1, 8, 8)).astype(np.float32)
    plan = S.channel_plan(model, {'3': 0.5}, input_shape=(1, 1, 8, 8))
    np.testing.assert_allclose(run(new, x), run(switched_off(model, plan, (1, 1, 8, 8)), x), atol=1e-4)
    neurons = S.prune_channels(model, {'12': 3 / 7}, input_shape=(1, 1, 8, 8))
    assert (neurons[12].out_features, neurons[14].in_features) == (4, 4)


def test_zero_ratio_is_identity_and_copy():
    model = wide_like()
    new = S.prune_channels(model, 0.0, input_shape=(1, 1, 8, 8))
    assert new is not model and same_state(snapshot(new), snapshot(model))
    new[0].weight.data[:] = 0
    assert np.abs(model[0].weight.data).sum() > 0


def test_last_layer_outputs_never_pruned():
    manual_seed(0)
    model = Sequential(Conv2d(1, 4, 3, padding=1), ReLU(), Conv2d(4, 3, 1)).eval()
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 5, 5))
    assert new[2].out_channels == 3 and new[0].out_channels == 2 and new[2].in_channels == 2
    with pytest.raises(TinycompError, match="model's output"): S.prune_channels(model, {'2': 0.5}, input_shape=(1, 1, 5, 5))


def test_digits_cnn_no_bn():
    model = digits_cnn()
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert [m.out_channels for m in new if isinstance(m, Conv2d)] == [8, 16] and new[6].in_features == 16 * 16
    with pytest.raises(TinycompError, match="the channels of 0: importance='bn_gamma' needs"):
        S.prune_channels(model, 0.5, 'bn_gamma', input_shape=(1, 1, 8, 8))


def test_training_mode_kept_and_trainable():
    model = wide_like().train()
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    assert new.training and all(m.training for m in new.modules())
    out = new(Tensor(np.random.default_rng(0).normal(size=(4, 1, 8, 8)).astype(np.float32)))
    out.sum().backward()
    assert all(p.grad is not None and p.grad.shape == p.shape for p in new.parameters())


@pytest.mark.parametrize('ratio, match', [
    (1.0, "would remove all 8 channels"), ({'0': 1.0}, "would remove all 8"), ({'1': 0.5}, r"'1' \(BatchNorm2d\) is not one"),
    ({'99': 0.5}, "'99' is not one"), ({0: 0.5}, "0 is not one"), ({'0': 2.0}, "ratio of 0"), (-0.5, "must be in"),
])
def test_prune_bad_ratio(ratio, match):
    with pytest.raises(TinycompError, match=match): S.prune_channels(wide_like(), ratio, input_shape=(1, 1, 8, 8))


def test_prune_bad_importance_and_input_shape():
    with pytest.raises(TinycompError, match="importance must be one of"): S.prune_channels(wide_like(), 0.5, 'l0', (1, 1, 8, 8))
    with pytest.raises(TinycompError, match="pass input_shape"): S.prune_channels(wide_like(), 0.5)
    with pytest.raises(TinycompError, match="input_shape must be a tuple"): S.prune_channels(wide_like(), 0.5, input_shape='big')
    with pytest.raises(TinycompError): S.prune_channels(wide_like(), 0.5, input_shape=(1, 1, 6, 6))
    with pytest.raises(TinycompError, match="no conv channels that can be removed"):
        S.prune_channels(Sequential(Conv2d(1, 2, 3), Sigmoid(), Conv2d(2, 2, 1)), 0.5, input_shape=(1, 1, 5, 5))


def test_file_shrinks_and_round_trips(tmp_path):
    model = load_pretrained('digits_cnn_wide')
    new = S.prune_channels(model, 0.5, input_shape=(1, 1, 8, 8))
    pa, pb = tio.save(model, tmp_path / 'a.npz'), tio.save(new, tmp_path / 'b.npz')
    assert pb.stat().st_size <= 0.55 * pa.stat().st_size
    assert parameter_counts(new).parameters <= 0.45 * parameter_counts(model).parameters
    back = tio.load(pb).eval()
    x = np.random.default_rng(0).normal(size=(5, 1, 8, 8)).astype(np.float32)
    np.testing.assert_array_equal(run(back, x), run(new.eval(), x))
