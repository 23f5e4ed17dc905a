"""Tests for tinycomp.pruning.masks: magnitude/random/global/Ln-structured/N:M masks (against slow Python references),
masked layers that stay masked through training (SGD and Adam, masks changed mid-training), prune/make_permanent/
sparsity on models, model files with masks, and bad input."""

import copy

import numpy as np
import pytest

from tinycomp.conv import Conv2d
from tinycomp.data import DataLoader
from tinycomp.errors import ModelFileError, ShapeError, TinycompError
from tinycomp.io import load, save
from tinycomp.models import digits_cnn_wide, fit
from tinycomp.nn.functional import cross_entropy
from tinycomp.nn.modules import Flatten, Linear, ReLU, Sequential
from tinycomp.optim import SGD, Adam
from tinycomp.pooling import MaxPool2d
from tinycomp.pruning.masks import (
    PRUNE_METHODS, MaskedConv2d, MaskedLinear, global_unstructured, l1_unstructured, ln_structured, make_permanent,
    nm_mask, prunable_layers, prune, random_unstructured, slice_norms, sparsity)
from tinycomp.tensor import Tensor, default_generator, manual_seed, no_grad

pytestmark = pytest.mark.module05

F32 = np.float32


# ---- slow references, written independently of the package ------------------------------------------------------

def ref_count(amount, n):
    "PyTorch's _compute_nparams_toprune: an int as it is, a float rounded with Python's round (half to even)."
    return amount if isinstance(amount, int) else round(amount * n)

def ref_magnitude(flat_abs, k):
    "Indices pruned: the k smallest, ties by lower index (sort on (value, index))."
    return {i for _, i in sorted((float(v), i) for i, v in enumerate(flat_abs))[:k]}

def ref_l1(w, amount):
    flat = np.abs(np.asarray(w, F32)).ravel()
    pruned = ref_magnitude(flat, ref_count(amount, flat.size))
    return np.array([0.0 if i in pruned else 1.0 for i in range(flat.size)], F32).reshape(np.shape(w))

def ref_global(ws, amount):
    flat = np.concatenate([np.abs(np.asarray(w, F32)).ravel() for w in ws])
    pruned = ref_magnitude(flat, ref_count(amount, flat.size))
    out, start = [], 0
    for w in ws:
        n = np.size(w)
        out.append(np.array([0.0 if start + i in pruned else 1.0 for i in range(n)], F32).reshape(np.shape(w)))
        start += n
    return out

def ref_nm(w, n, m):
    rows = np.abs(np.asarray(w, F32)).reshape(w.shape[0], -1)
    mask = np.ones(rows.shape, F32)
    for r in range(rows.shape[0]):
        for g in range(0, rows.shape[1], m):
            for i in ref_magnitude(rows[r, g:g + m], m - n): mask[r, g + i] = 0
    return mask.reshape(w.shape)

def ref_ln(w, amount, p, dim):
    w = np.asarray(w, np.float64)
    c = w.shape[dim]
    norms = []
    for i in range(c):
        s = np.abs(np.take(w, i, axis=dim)).ravel()
        norms.append(float(s.max(initial=0)) if np.isinf(p) else float(np.sum(s ** p) ** (1 / p)))
    pruned = ref_magnitude(np.array(norms, F32), ref_count(amount, c))
    mask = np.ones(w.shape, F32)
    for i in pruned:
        idx = [slice(None)] * w.ndim; idx[dim] = i
        mask[tuple(idx)] = 0
    return mask

def rnd(shape, seed=0, ties=False):
    r = np.random.default_rng(seed)
    w = r.standard_normal(shape).astype(F32)
    if ties: w = (np.round(w * 2) / 2).astype(F32)          # many equal |w|, both signs, zeros
    return w


# ---- l1 / random ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('shape', [(7,), (4, 6), (3, 2, 3, 3), (5, 1)])
@pytest.mark.parametrize('ties', [False, True])
def test_l1_matches_reference(shape, ties):
    w = rnd(shape, 1, ties)
    n = w.size
    for amount in [0, 1, n // 2, n, 0.0, 0.1, 0.25, 0.5, 0.7, 1.0, 1 / 3]:
        m = l1_unstructured(w, amount)
        assert m.dtype == F32 and m.shape == w.shape
        np.testing.assert_array_equal(m, ref_l1(w, amount))
        assert int((m == 0).sum()) == ref_count(amount, n)

def test_l1_rounding_is_half_to_even():
    for n, k in [(5, 2), (7, 4), (9, 4), (11, 6), (1, 0), (3, 2)]:       # 0.5 * n = x.5: round to the even neighbour
        assert int((l1_unstructured(np.ones(n, F32), 0.5) == 0).sum()) == k
    assert int((l1_unstructured(np.ones(8, F32), 0.3125) == 0).sum()) == 2  # 2.5 -> 2
    assert int((l1_unstructured(np.ones(8, F32), 0.4375) == 0).sum()) == 4  # 3.5 -> 4

def test_l1_ties_lower_index_first_and_signs():
    np.testing.assert_array_equal(l1_unstructured(np.array([2, -1, 1, -1, 0.5], F32), 3), [1, 0, 0, 1, 0])
    np.testing.assert_array_equal(l1_unstructured(np.zeros((2, 2), F32), 3), [[0, 0], [0, 1]])

def test_l1_int_count_vs_fraction_and_inputs():
    w = rnd((4, 5), 2)
    assert int((l1_unstructured(w, 1) == 0).sum()) == 1 and int((l1_unstructured(w, 1.0) == 0).sum()) == 20
    assert int((l1_unstructured(w, np.int64(3)) == 0).sum()) == 3
    assert int((l1_unstructured(w, np.float32(0.25)) == 0).sum()) == 5
    before = w.copy(); l1_unstructured(w, 0.5); np.testing.assert_array_equal(w, before)
    np.testing.assert_array_equal(l1_unstructured(Tensor(w), 7), l1_unstructured(w, 7))
    np.testing.assert_array_equal(l1_unstructured(w.astype(np.float64), 7), l1_unstructured(w, 7))

@pytest.mark.parametrize('amount,msg', [(1.5, 'must lie in [0, 1]'), (-0.2, 'must lie in [0, 1]'), (21, 'only 20'),
                                        (-1, 'only 20'), (True, 'got True'), ('half', "got 'half'"),
                                        (float('nan'), 'must lie in [0, 1]'), (None, 'got None')])
def test_l1_bad_amount(amount, msg):
    with pytest.raises(TinycompError) as e: l1_unstructured(rnd((4, 5)), amount)
    assert msg in str(e.value)

def test_l1_bad_weight():
    with pytest.raises(TinycompError, match='NaN or infinite'): l1_unstructured(np.array([1.0, np.inf]), 1)
    with pytest.raises(TinycompError, match='numeric array'): l1_unstructured(np.array(['a', 'b']), 1)
    with pytest.raises(ShapeError): l1_unstructured(np.float32(1.0), 0)

def test_random_unstructured():
    w = rnd((6, 7), 3)
    for amount in (0, 5, 0.5, 1.0, 0.3):
        m = random_unstructured(w, amount, rng=4)
        assert m.dtype == F32 and m.shape == w.shape and set(np.unique(m)) <= {0.0, 1.0}
        assert int((m == 0).sum()) == ref_count(amount, w.size)
    np.testing.assert_array_equal(random_unstructured(w, 0.5, 9), random_unstructured(w, 0.5, np.random.default_rng(9)))
    manual_seed(1); a = random_unstructured(w, 0.5)
    manual_seed(1); b = random_unstructured(w, 0.5)
    np.testing.assert_array_equal(a, b)
    assert not np.array_equal(random_unstructured(w, 0.5, 1), random_unstructured(w, 0.5, 2))
    with pytest.raises(TinycompError, match='rng must be'): random_unstructured(w, 0.5, 'x')
    with pytest.raises(TinycompError, match='only 42'): random_unstructured(w, 43, 0)


# ---- global ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('ties', [False, True])
def test_global_matches_reference(ties):
    ws = [rnd((3, 4), 5, ties), rnd((2, 2, 3, 3), 6, ties) * 0.5, rnd((5,), 7, ties)]
    n = sum(w.size for w in ws)
    for amount in [0, 1, 17, n, 0.0, 0.5, 0.8, 0.9, 1.0]:
        ms = global_unstructured(ws, amount)
        assert isinstance(ms, list) and len(ms) == 3
        for m, r, w in zip(ms, ref_global(ws, amount), ws):
            assert m.dtype == F32 and m.shape == w.shape
            np.testing.assert_array_equal(m, r)
        assert sum(int((m == 0).sum()) for m in ms) == ref_count(amount, n)

def test_global_threshold_is_shared_and_order_matters_for_ties():
    small, big = np.full(4, 0.1, F32), np.full(4, 1.0, F32)
    ma, mb = global_unstructured([small, big], 0.5)
    np.testing.assert_array_equal(ma, np.zeros(4, F32)); np.testing.assert_array_equal(mb, np.ones(4, F32))
    a, b = global_unstructured([np.ones(3, F32), np.ones(3, F32)], 4)
    np.testing.assert_array_equal(a, np.zeros(3, F32)); np.testing.assert_array_equal(b, [0, 1, 1])
    b, a = global_unstructured([np.ones(3, F32), np.ones(3, F32)][::-1], 4)
    np.testing.assert_array_equal(b, np.zeros(3, F32))

def test_global_single_layer_equals_l1_and_inputs_untouched():
    w = rnd((5, 6), 8, True)
    for amount in (0, 3, 0.5, 0.35, 1.0): np.testing.assert_array_equal(global_unstructured([w], amount)[0], l1_unstructured(w, amount))
    ws = [rnd((3, 3), 1), rnd((4,), 2)]; before = [w.copy() for w in ws]
    global_unstructured(ws, 0.5)
    for w, b in zip(ws, before): np.testing.assert_array_equal(w, b)
    assert len(global_unstructured(tuple(ws), 0.5)) == 2

def test_global_bad_input():
    with pytest.raises(TinycompError, match='non-empty list'): global_unstructured(rnd((3, 3)), 0.5)
    with pytest.raises(TinycompError, match='non-empty list'): global_unstructured([], 0.5)
    with pytest.raises(TinycompError, match='only 13'): global_unstructured([rnd((3, 3)), rnd((4,))], 14)
    with pytest.raises(TinycompError, match=r'weights\[1\] contains'): global_unstructured([rnd((3,)), np.array([np.nan])], 1)


# ---- Ln structured ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('shape,dim', [((6, 3, 2, 2), 0), ((6, 3, 2, 2), 1), ((5, 7), 0), ((5, 7), 1), ((5, 7), -1),
                                       ((4, 2, 3, 3), 3)])
@pytest.mark.parametrize('p', [1, 2, np.inf, 'fro', 3])
def test_ln_matches_reference(shape, dim, p):
    w = rnd(shape, 11)
    c = shape[dim]
    for amount in (0, 1, c, 0.5, 0.34, 1.0):
        m = ln_structured(w, amount, p, dim)
        assert m.dtype == F32 and m.shape == w.shape and m.flags.writeable
        np.testing.assert_array_equal(m, ref_ln(w, amount, 2 if p == 'fro' else p, dim % len(shape)))

def test_ln_ties_and_norms():
    w = np.ones((4, 3), F32)
    np.testing.assert_array_equal(ln_structured(w, 2, 2, 0)[:, 0], [0, 0, 1, 1])
    np.testing.assert_allclose(slice_norms(np.array([[3, 4], [1, 0]], F32), 2, 0), [5, 1])
    np.testing.assert_allclose(slice_norms(np.array([[3, 4], [1, 0]], F32), 1, 1), [4, 4])
    assert slice_norms(rnd((3, 4)), np.inf, 0).dtype == F32

def test_ln_bad_input():
    w = rnd((4, 3))
    with pytest.raises(TinycompError, match='only 4'): ln_structured(w, 5, 2, 0)
    with pytest.raises(ShapeError, match='not an axis'): ln_structured(w, 1, 2, 2)
    with pytest.raises(TinycompError, match='positive number'): ln_structured(w, 1, 0, 0)
    with pytest.raises(TinycompError, match='positive number'): ln_structured(w, 1, 'nuc', 0)
    with pytest.raises(TinycompError, match='must lie in'): ln_structured(w, 1.5, 2, 0)


# ---- N:M -----------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('shape', [(3, 8), (4, 12), (2, 4, 3, 3), (5, 2, 2, 2)])
@pytest.mark.parametrize('nm', [(2, 4), (1, 4), (0, 4), (4, 4), (1, 2), (3, 8)])
@pytest.mark.parametrize('ties', [False, True])
def test_nm_matches_reference(shape, nm, ties):
    n, m = nm
    w = rnd(shape, 13, ties)
    if int(np.prod(shape[1:])) % m: return
    mask = nm_mask(w, n, m)
    assert mask.dtype == F32 and mask.shape == w.shape
    np.testing.assert_array_equal(mask, ref_nm(w, n, m))
    np.testing.assert_array_equal(mask.reshape(shape[0], -1, m).sum(-1), np.full((shape[0], np.prod(shape[1:]) // m), n))

def test_nm_groups_run_along_input_dim():
    w = np.array([[4, 3, 2, 1, 1, 2, 3, 4]], F32)           # groups [4 3 2 1] [1 2 3 4]
    np.testing.assert_array_equal(nm_mask(w, 2, 4), [[1, 1, 0, 0, 0, 0, 1, 1]])
    np.testing.assert_array_equal(nm_mask(w.reshape(2, 4), 2, 4), [[1, 1, 0, 0], [0, 0, 1, 1]])        # rows are separate
    with pytest.raises(ShapeError): nm_mask(w.reshape(8, 1), 2, 4)                                        # not along axis 0
    c = np.arange(2 * 2 * 2 * 2, dtype=F32).reshape(2, 2, 2, 2)   # each output channel: 8 consecutive in*kh*kw values
    np.testing.assert_array_equal(nm_mask(c, 1, 4).reshape(2, 8), [[0, 0, 0, 1, 0, 0, 0, 1]] * 2)
    np.testing.assert_array_equal(nm_mask(np.ones((1, 4), F32), 2, 4), [[0, 0, 1, 1]])
    np.testing.assert_array_equal(nm_mask(np.array([[-5, 1, -1, 0.5]], F32), 2, 4), [[1, 0, 1, 0]])   # |1| = |-1|: lower index pruned

def test_nm_defaults_and_untouched():
    w = rnd((4, 8), 3); before = w.copy()
    np.testing.assert_array_equal(nm_mask(w), nm_mask(w, 2, 4))
    np.testing.assert_array_equal(w, before)

def test_nm_bad_input():
    with pytest.raises(ShapeError, match='not divisible by 4'): nm_mask(rnd((3, 6)), 2, 4)
    with pytest.raises(ShapeError, match='not divisible by 4'): nm_mask(rnd((3, 1, 3, 3)), 2, 4)
    with pytest.raises(TinycompError, match='n=5 > m=4'): nm_mask(rnd((3, 8)), 5, 4)
    with pytest.raises(TinycompError, match='must not be negative'): nm_mask(rnd((3, 8)), -1, 4)
    with pytest.raises(TinycompError, match='at least 1'): nm_mask(rnd((3, 8)), 0, 0)
    with pytest.raises(TinycompError, match='must be an int'): nm_mask(rnd((3, 8)), 2.0, 4)
    with pytest.raises(ShapeError, match='at least 2 dimension'): nm_mask(rnd((8,)), 2, 4)


# ---- masked layers -------------------------------------------------------------------------------------------------

def test_masked_linear_forward_backward():
    manual_seed(0)
    lin = Linear(6, 5)
    mask = l1_unstructured(lin.weight.data, 0.6)
    ml = MaskedLinear.from_dense(lin, mask)
    assert type(ml) is MaskedLinear and ml.config() == lin.config() and ml.weight_mask.dtype == F32
    np.testing.assert_array_equal(ml.weight.data, lin.weight.data * mask)
    x = Tensor(np.random.default_rng(1).standard_normal((4, 6)).astype(F32), requires_grad=True)
    out = ml(x)
    np.testing.assert_allclose(out.data, x.data @ (lin.weight.data * mask).T + lin.bias.data, rtol=1e-5, atol=1e-6)
    out.sum().backward()
    assert (ml.weight.grad[mask == 0] == 0).all() and (ml.weight.grad[mask == 1] != 0).all()
    assert x.grad is not None and ml.bias.grad is not None
    np.testing.assert_array_equal(lin.weight.data != 0, np.ones_like(mask, bool))            # the source is untouched
    with pytest.raises(ShapeError, match='last dimension 6'): ml(Tensor(np.zeros((2, 5), F32)))

@pytest.mark.parametrize('cfg', [dict(in_channels=2, out_channels=4, kernel_size=3, padding=1),
                                 dict(in_channels=4, out_channels=4, kernel_size=3, stride=2, groups=2, bias=False),
                                 dict(in_channels=3, out_channels=3, kernel_size=(3, 1), dilation=2, groups=3)])
def test_masked_conv_equals_conv_with_masked_weights(cfg):
    manual_seed(2)
    conv = Conv2d(**cfg)
    mask = random_unstructured(conv.weight.data, 0.5, 3)
    mc = MaskedConv2d.from_dense(conv, mask)
    ref = copy.deepcopy(conv); ref.weight.data = conv.weight.data * mask
    x = Tensor(np.random.default_rng(4).standard_normal((2, cfg['in_channels'], 7, 7)).astype(F32))
    with no_grad(): np.testing.assert_allclose(mc(x).data, ref(x).data, rtol=1e-5, atol=1e-5)
    mc(x).sum().backward()
    assert (mc.weight.grad[mask == 0] == 0).all()
    dense = mc.to_dense()
    assert type(dense) is Conv2d and dense.config() == conv.config()
    with no_grad(): np.testing.assert_allclose(dense(x).data, ref(x).data, rtol=1e-5, atol=1e-5)

def test_masked_layers_do_not_disturb_the_default_generator():
    lin = Linear(3, 2)
    manual_seed(5); a = default_generator().random(3)
    manual_seed(5)
    MaskedLinear.from_dense(lin); make_permanent(prune(lin, 0.5)); prune(_small_model_fixed(), 0.5, 'global')
    np.testing.assert_array_equal(default_generator().random(3), a)

def _small_model_fixed():
    rng = default_generator(); state = rng.bit_generator.state
    try: return _small_model()
    finally: rng.bit_generator.state = state

def test_set_mask_check_state_and_errors():
    ml = MaskedLinear(4, 3)
    assert (ml.weight_mask == 1).all() and ml.weight_mask.shape == (3, 4)
    ml.set_mask(np.eye(3, 4, dtype=bool))
    assert ml.weight_mask.dtype == F32 and int(ml.weight_mask.sum()) == 3
    assert (ml.weight.data[ml.weight_mask == 0] == 0).all()
    ml.check_state()
    with pytest.raises(ShapeError, match='has shape'): ml.set_mask(np.ones((4, 3)))
    with pytest.raises(TinycompError, match='only 0'): ml.set_mask(np.full((3, 4), 0.5))
    with pytest.raises(TinycompError, match='only 0'): ml.set_mask(np.full((3, 4), np.nan))
    ml._buffers['weight_mask'] = np.ones((3, 4), np.float64)
    with pytest.raises(TinycompError, match='must be float32'): ml.check_state()
    ml._buffers['weight_mask'] = np.ones((3, 5), F32)
    with pytest.raises(TinycompError, match='has shape'): ml.check_state()
    with pytest.raises(TinycompError, match='needs a Conv2d'): MaskedConv2d.from_dense(Linear(2, 2))
    with pytest.raises(TinycompError, match='needs a Linear'): MaskedLinear.from_dense(MaskedLinear(2, 2))

def _digits_like(n=96, seed=0):
    r = np.random.default_rng(seed)
    return r.standard_normal((n, 1, 8, 8)).astype(F32), r.integers(0, 10, n).astype(np.int64)

def _small_model():
    return Sequential(Conv2d(1, 4, 3, padding=1), ReLU(), MaxPool2d(2), Flatten(), Linear(64, 10))

@pytest.mark.parametrize('opt', ['adam', 'adam_wd', 'sgd_momentum'])
def test_pruned_weights_stay_exactly_zero_through_fit(opt):
    manual_seed(0)
    model = prune(_small_model(), 0.7, 'global')
    start = {n: m.weight.data.copy() for n, m in prunable_layers(model)}
    params = list(model.parameters())
    o = {'adam': lambda: Adam(params, lr=1e-2), 'adam_wd': lambda: Adam(params, lr=1e-2, weight_decay=1e-2),
         'sgd_momentum': lambda: SGD(params, lr=0.05, momentum=0.9, weight_decay=1e-3)}[opt]()
    X, y = _digits_like()
    fit(model, DataLoader(X, y, batch_size=16), epochs=2, optimizer=o, progress=False)
    for name, m in prunable_layers(model):
        pruned = m.weight_mask == 0
        assert pruned.any() and (m.weight.data[pruned] == 0).all()               # exactly zero in storage
        assert np.abs(m.weight.data - start[name])[~pruned].max() > 1e-4          # the kept weights trained

def test_mask_changed_mid_training_with_stale_momentum():
    manual_seed(1)
    model = prune(_small_model(), 0.3, 'l1')
    opt = Adam(list(model.parameters()), lr=1e-2)
    X, y = _digits_like()
    fit(model, DataLoader(X, y, batch_size=16), epochs=1, optimizer=opt, progress=False)
    for _, m in prunable_layers(model): m.set_mask(m.weight_mask * l1_unstructured(m.weight.data * m.weight_mask, 0.8))
    xb = Tensor(X[:16])
    opt.zero_grad(); cross_entropy(model(xb), y[:16]).backward(); opt.step()
    lin = model[4]
    stale = (lin.weight.data[lin.weight_mask == 0] != 0).sum()
    assert stale > 0                                                                # Adam's momentum moved them in storage ...
    with no_grad(): out = model(xb).data                                           # ... but never into an output
    ref = make_permanent(model)
    with no_grad(): np.testing.assert_allclose(ref(xb).data, out, rtol=1e-5, atol=1e-6)
    for _, m in prunable_layers(model): assert (m.weight.data[m.weight_mask == 0] == 0).all()   # and forward cleared them
    fit(model, DataLoader(X, y, batch_size=16), epochs=1, optimizer=opt, progress=False)
    for _, m in prunable_layers(model):
        m.apply_mask(); assert (m.weight.data[m.weight_mask == 0] == 0).all()
    assert abs(sparsity(model)['global'] - 0.8) < 0.01


# ---- model level ------------------------------------------------------------------------------------------------

def _wide():
    manual_seed(3)
    return digits_cnn_wide().eval()

def test_prune_returns_new_model_and_leaves_input_untouched():
    model = _wide()
    before = model.state_dict()
    for method, kw in [('l1', {}), ('random', {'rng': 0}), ('global', {}), ('ln', {'n': 1, 'dim': 0})]:
        p = prune(model, 0.5, method, **kw)
        assert p is not model
        after = model.state_dict()
        assert all(np.array_equal(before[k], after[k]) for k in before)
        assert [type(m).__name__ for m in model] == [type(m).__name__ for m in digits_cnn_wide()]
        types = [type(m).__name__ for m in p]
        assert types.count('MaskedConv2d') == 3 and types.count('MaskedLinear') == 2 and types.count('BatchNorm2d') == 3
        assert [n for n, _ in prunable_layers(p)] == ['0', '3', '7', '12', '14']      # order of children kept
    p = prune(model, method='nm', layers=[3, 7, 12, 14])
    assert type(p[0]) is Conv2d and type(p[3]) is MaskedConv2d

def test_prune_masks_equal_the_mask_functions():
    model = _wide()
    ws = [m.weight.data for _, m in prunable_layers(model)]
    p = prune(model, 0.8, 'l1')
    for (_, m), w in zip(prunable_layers(p), ws): np.testing.assert_array_equal(m.weight_mask, l1_unstructured(w, 0.8))
    p = prune(model, 0.8, 'global')
    for (_, m), r in zip(prunable_layers(p), global_unstructured(ws, 0.8)): np.testing.assert_array_equal(m.weight_mask, r)
    p = prune(model, 0.25, 'ln', n=2, dim=0)
    for (_, m), w in zip(prunable_layers(p), ws): np.testing.assert_array_equal(m.weight_mask, ln_structured(w, 0.25, 2, 0))
    p = prune(model, method='nm', layers=['3', '12'], n=1, m=4)
    np.testing.assert_array_equal(p[3].weight_mask, nm_mask(ws[1], 1, 4))
    np.testing.assert_array_equal(p[12].weight_mask, nm_mask(ws[3], 1, 4))
    assert type(p[7]) is Conv2d
    a, b = prune(model, 0.5, 'random', rng=7), prune(model, 0.5, 'random', rng=7)
    for (_, x), (_, y) in zip(prunable_layers(a), prunable_layers(b)): np.testing.assert_array_equal(x.weight_mask, y.weight_mask)

def test_prune_global_over_selected_layers_only():
    model = _wide()
    p = prune(model, 0.5, 'global', layers=[3, 7])
    s = sparsity(p)
    assert s['layers']['0'] == 0 and s['layers']['14'] == 0
    n3, n7 = p[3].weight.data.size, p[7].weight.data.size
    assert int(round(s['layers']['3'] * n3 + s['layers']['7'] * n7)) == round(0.5 * (n3 + n7))

def test_prune_again_keeps_old_zeros_and_reaches_total_target():
    model = _wide()
    p1 = prune(model, 0.5)
    p2 = prune(p1, 0.8)
    for (_, a), (_, b) in zip(prunable_layers(p1), prunable_layers(p2)):
        assert (b.weight_mask <= a.weight_mask).all()
        assert int((b.weight_mask == 0).sum()) == round(0.8 * b.weight.data.size)
    assert all(int((m.weight_mask == 0).sum()) == round(0.5 * m.weight.data.size) for _, m in prunable_layers(p1))
    for again in (prune(p2, 0.5), prune(p2, 0.5, 'random', rng=0), prune(p2, 0.0)):    # a lower target never revives
        for (_, a), (_, b) in zip(prunable_layers(p2), prunable_layers(again)):
            assert (b.weight_mask <= a.weight_mask).all() and (b.weight.data[b.weight_mask == 0] == 0).all()
    r = prune(p2, 0.5, 'random', rng=0)
    assert sparsity(r)['global'] > 0.85                                              # random zeros land on kept weights too

def test_make_permanent_and_sparsity():
    model = _wide()
    p = prune(model, 0.9, 'global')
    perm = make_permanent(p)
    assert [type(m) for m in perm] == [type(m) for m in model]
    assert all(type(m).__name__.startswith('Masked') for _, m in prunable_layers(p))     # p untouched
    x = Tensor(np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(F32))
    with no_grad(): np.testing.assert_allclose(perm(x).data, p(x).data, rtol=1e-5, atol=1e-5)
    s = sparsity(perm)
    assert s == sparsity(p) and abs(s['global'] - 0.9) < 1e-4 and set(s['layers']) == {'0', '3', '7', '12', '14'}
    assert sparsity(model)['global'] == 0.0
    single = prune(Linear(8, 4), 0.5)
    assert type(single) is MaskedLinear and type(make_permanent(single)) is Linear
    assert sparsity(single)['global'] == 0.5

def test_masked_model_file_round_trip_and_corrupt_masks(tmp_path):
    p = prune(_wide(), 0.7, 'global')
    path = save(p, tmp_path / 'p.npz')
    back = load(path)
    assert [type(m) for m in back] == [type(m) for m in p]
    for (_, a), (_, b) in zip(prunable_layers(p), prunable_layers(back)):
        np.testing.assert_array_equal(a.weight_mask, b.weight_mask); np.testing.assert_array_equal(a.weight.data, b.weight.data)
    bad = copy.deepcopy(p); bad[3]._buffers['weight_mask'] = bad[3].weight_mask * 0.5
    save(bad, tmp_path / 'bad.npz')
    with pytest.raises(ModelFileError, match='only 0'): load(tmp_path / 'bad.npz')

def test_prune_bad_input():
    model = _wide()
    with pytest.raises(TinycompError, match='unknown pruning method'): prune(model, 0.5, 'magnitude')
    with pytest.raises(TinycompError, match='must lie in'): prune(model, 1.5)
    with pytest.raises(TinycompError, match='there are only'): prune(model, 10**6)
    with pytest.raises(TinycompError, match='needs an amount'): prune(model)
    with pytest.raises(TinycompError, match='not Conv2d/Linear'): prune(model, 0.5, layers=[1])
    with pytest.raises(TinycompError, match='not Conv2d/Linear'): prune(model, 0.5, layers=['99'])
    with pytest.raises(TinycompError, match='not Conv2d/Linear'): prune(model, 0.5, layers=[])
    with pytest.raises(TinycompError, match=r"takes no argument\(s\) \['m'\]"): prune(model, 0.5, 'l1', m=4)
    with pytest.raises(ShapeError, match="layers \\['0'\\]"): prune(model, method='nm')
    with pytest.raises(TinycompError, match='pass amount=None'): prune(model, 0.8, 'nm', layers=[3])
    prune(model, 0.5, 'nm', layers=[3])                                       # 0.5 == 1 - 2/4 is accepted
    with pytest.raises(TinycompError, match='no Conv2d or Linear'): prune(Sequential(ReLU()), 0.5)
    with pytest.raises(TinycompError, match='must be a tinycomp Module'): prune(np.zeros(3), 0.5)
    assert set(PRUNE_METHODS) == {'l1', 'random', 'global', 'ln', 'nm'}
