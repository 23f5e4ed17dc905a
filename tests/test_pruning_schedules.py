"Tests for tinycomp.pruning.schedules: AGP schedule, AGP pruning, rewinding, movement pruning, sensitivity, compress_to_size, bench prune."
import json

import numpy as np
import pytest

from tinycomp.io import model_size
from tinycomp.data import DataLoader, load_digits
from tinycomp.errors import TinycompError
from tinycomp.models import digits_cnn, evaluate, load_pretrained
from tinycomp.pruning import schedules as S
from tinycomp.pruning.masks import MaskedConv2d, MaskedLinear, prunable_layers, prune, sparsity
from tinycomp.pruning.sparse import SparseConv2d, SparseLinear
from tinycomp.tensor import manual_seed

pytestmark = pytest.mark.module05


def snapshot(m): return {k: v.copy() for k, v in m.state_dict().items()}


def same_state(a, b): return list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)


@pytest.fixture(scope='module')
def small():
    X, y = load_digits('train')
    return X[:256], y[:256]


@pytest.fixture(scope='module')
def val():
    X, y = load_digits('val')
    return X[:120], y[:120]


def loader(small, seed=0): return DataLoader(*small, batch_size=64, shuffle=True, seed=seed)


# --- AGP schedule -----------------------------------------------------------------------------------------------
def cubic(si, sf, k, n): return sf + (si - sf) * (1 - k / n) ** 3


def test_agp_endpoints_and_holds():
    assert S.agp_sparsity(0, 0.1, 0.9, 5, 4, 3) == pytest.approx(0.1)
    assert S.agp_sparsity(5, 0.1, 0.9, 5, 4, 3) == pytest.approx(0.1)          # t0 itself: k = 0
    assert S.agp_sparsity(17, 0.1, 0.9, 5, 4, 3) == pytest.approx(0.9)         # t0 + n*f
    assert S.agp_sparsity(10_000, 0.1, 0.9, 5, 4, 3) == pytest.approx(0.9)
    assert isinstance(S.agp_sparsity(7, 0.0, 0.5, 0, 3), float)


def test_agp_by_hand_and_frequency():
    for t in range(5, 17):
        k = (t - 5) // 3
        assert S.agp_sparsity(t, 0.1, 0.9, 5, 4, 3) == pytest.approx(cubic(0.1, 0.9, k, 4))
    assert S.agp_sparsity(8, 0.0, 0.8, 5, 4, 3) == S.agp_sparsity(10, 0.0, 0.8, 5, 4, 3)    # same staircase step
    assert S.agp_sparsity(11, 0.0, 0.8, 5, 4, 3) > S.agp_sparsity(10, 0.0, 0.8, 5, 4, 3)
    assert S.agp_sparsity(3, 0.0, 0.8, 0, 10) == pytest.approx(cubic(0, 0.8, 3, 10))       # frequency 1
    assert S.agp_sparsity(np.int64(4), 0.0, 0.5, 0, 4) == pytest.approx(0.5)


def test_agp_monotone():
    rng = np.random.default_rng(0)
    for _ in range(20):
        si, sf = sorted(rng.uniform(0, 1, 2)); t0, n, f = (int(v) for v in rng.integers(0, 10, 3) + [0, 1, 1])
        s = [S.agp_sparsity(t, si, sf, t0, n, f) for t in range(0, t0 + n * f + 5)]
        assert all(a <= b + 1e-12 for a, b in zip(s, s[1:]))
        assert s[0] == pytest.approx(si) and s[-1] == pytest.approx(sf)


@pytest.mark.parametrize('args, msg', [((0, 0.5, 0.1, 0, 3), 'only raises'), ((0, -0.1, 0.5, 0, 3), '[0, 1]'),
                                        ((0, 0.0, float('nan'), 0, 3), '[0, 1]'), ((0, 0.0, 0.5, 0, 0), 'n_steps'),
                                        ((0, 0.0, 0.5, -1, 3), 'start_step'), ((0.5, 0.0, 0.5, 0, 3), 'integer'),
                                        ((0, 0.0, 0.5, 0, 3, 0), 'frequency')])
def test_agp_bad_input(args, msg):
    with pytest.raises(TinycompError, match=msg.replace('[', r'\[').replace(']', r'\]')): S.agp_sparsity(*args)


# --- movement scores ----------------------------------------------------------------------------------------------
def test_movement_update():
    rng = np.random.default_rng(1)
    s, w, g = (rng.standard_normal((3, 4)).astype(np.float32) for _ in range(3))
    s0 = s.copy()
    out = S.movement_scores_update(s, w, g)
    np.testing.assert_allclose(out, s0 - w * g, rtol=1e-6)
    assert out.dtype == np.float32 and np.array_equal(s, s0)
    # a weight moving away from zero (w > 0, gradient negative) gains score
    assert S.movement_scores_update(np.zeros(1, np.float32), np.ones(1, np.float32), -np.ones(1, np.float32))[0] == 1
    with pytest.raises(TinycompError, match='same shape'): S.movement_scores_update(s, w, g[:2])
    with pytest.raises(TinycompError, match='finite'): S.movement_scores_update(s, w * np.nan, g)


# --- prune_with_agp / movement_prune --------------------------------------------------------------------------------
def check_masked_zero(model):
    layers = [m for _, m in prunable_layers(model)]
    assert layers and all(isinstance(m, (MaskedConv2d, MaskedLinear)) for m in layers)
    for m in layers:
        m.check_state()
        assert (m.weight.data[m.weight_mask == 0] == 0).all()


@pytest.mark.parametrize('method', ['global', 'l1'])
def test_prune_with_agp(small, method):
    base = load_pretrained('digits_cnn')
    before = snapshot(base)
    m, h = S.prune_with_agp(base, loader(small), 0.8, epochs=2, method=method)
    assert same_state(before, snapshot(base))                           # input untouched
    assert sparsity(m)['global'] == pytest.approx(0.8, abs=2e-3)
    if method == 'l1':
        for v in sparsity(m)['layers'].values(): assert v == pytest.approx(0.8, abs=0.01)
    check_masked_zero(m)
    steps = [s for s, _ in h['prune_steps']]; targets = [v for _, v in h['prune_steps']]
    assert steps == sorted(steps) and targets == sorted(targets) and targets[-1] == pytest.approx(0.8)
    assert len(h['train_loss']) == 2 and not m.training


def test_prune_with_agp_one_epoch_reaches_final(small):
    m, h = S.prune_with_agp(digits_cnn(), loader(small), 0.5, epochs=1, frequency=1)
    assert sparsity(m)['global'] == pytest.approx(0.5, abs=2e-3)
    with pytest.raises(TinycompError, match='method'): S.prune_with_agp(digits_cnn(), loader(small), 0.5, 1, method='nm')
    with pytest.raises(TinycompError, match='epochs'): S.prune_with_agp(digits_cnn(), loader(small), 0.5, 0)


@pytest.mark.parametrize('scope', ['global', 'layer'])
def test_movement_prune(small, scope):
    base = load_pretrained('digits_cnn')
    before = snapshot(base)
    m, h = S.movement_prune(base, loader(small), 0.7, epochs=2, scope=scope)
    assert same_state(before, snapshot(base))
    assert sparsity(m)['global'] == pytest.approx(0.7, abs=2e-3)
    if scope == 'layer':
        for v in sparsity(m)['layers'].values(): assert v == pytest.approx(0.7, abs=0.01)
    check_masked_zero(m)
    assert h['prune_steps'][0][0] >= 1 and len(h['scores']) == len(prunable_layers(m))
    assert any(np.abs(s).sum() > 0 for s in h['scores'])


def test_topk_masks_keeps_highest_scores():
    scores = [np.array([3., 1., 2., 0.], np.float32), np.array([5., -1.], np.float32)]
    ones = [np.ones(4, np.float32), np.ones(2, np.float32)]
    g = S._topk_masks(scores, ones, 0.5, 'global')
    assert g[0].tolist() == [1, 0, 1, 0] and g[1].tolist() == [1, 0]
    l = S._topk_masks(scores, ones, 0.5, 'layer')
    assert l[0].tolist() == [1, 0, 1, 0] and l[1].tolist() == [1, 0]
    prior = [np.array([0, 1, 1, 1], np.float32), np.ones(2, np.float32)]   # already-pruned weight goes first
    g = S._topk_masks(scores, prior, 0.5, 'global')       # pruned: the old one, then scores -1 and 0
    assert g[0].tolist() == [0, 1, 1, 0] and g[1].tolist() == [1, 0]


# --- rewind -----------------------------------------------------------------------------------------------------------
def test_rewind_keeps_masks(small):
    manual_seed(0)
    net = digits_cnn()
    ckpt = net.state_dict()
    from tinycomp.models import fit
    fit(net, loader(small), epochs=1, progress=False)
    ticket = prune(net, 0.7, 'global')
    before = snapshot(ticket)
    rw = S.rewind(ticket, ckpt)
    assert same_state(before, snapshot(ticket))
    for (_, a), (_, b) in zip(prunable_layers(rw), prunable_layers(ticket)):
        assert np.array_equal(a.weight_mask, b.weight_mask)
    for name, m in prunable_layers(rw):
        np.testing.assert_array_equal(m.weight.data, ckpt[f'{name}.weight'] * m.weight_mask)
        if m.bias is not None: np.testing.assert_array_equal(m.bias.data, ckpt[f'{name}.bias'])
    check_masked_zero(rw)
    with pytest.raises(TinycompError, match='checkpoint has no'): S.rewind(ticket, {})
    with pytest.raises(TinycompError, match='state_dict'): S.rewind(ticket, [1])


# --- sensitivity -------------------------------------------------------------------------------------------------------
def test_sensitivity_and_choose(val):
    model = load_pretrained('digits_cnn')
    rows = S.sensitivity_scan(model, val, ratios=(0.5, 0.9))
    names = [n for n, _ in prunable_layers(model)]
    assert [(r['layer'], r['ratio']) for r in rows] == [(n, r) for n in names for r in (0.5, 0.9)]
    for r in rows:
        assert r['drop'] == pytest.approx(r['baseline'] - r['accuracy'])
        m = dict(prunable_layers(model))[r['layer']]
        assert r['weights'] == m.weight.data.size
    assert S.sensitivity_scan(model, val, ratios=(0.0,))[0]['drop'] == 0
    with pytest.raises(TinycompError): S.sensitivity_scan(model, val, ratios=(1.5,))


def fake_rows():
    mk = lambda l, r, w, d: dict(layer=l, ratio=r, weights=w, accuracy=0.9 - d, drop=d, baseline=0.9)
    return [mk('a', 0.5, 100, 0.00), mk('a', 0.9, 100, 0.05), mk('b', 0.5, 900, 0.02), mk('b', 0.9, 900, 0.03)]


def test_choose_ratios_by_hand():
    rows = fake_rows()
    assert S.choose_ratios(rows, max_drop=0.0) == {'a': 0.5, 'b': 0.0}
    assert S.choose_ratios(rows, max_drop=0.025) == {'a': 0.5, 'b': 0.5}
    assert S.choose_ratios(rows, max_drop=1.0) == {'a': 0.9, 'b': 0.9}
    assert S.choose_ratios(rows, target_sparsity=0.05) == {'a': 0.5, 'b': 0.0}        # 50/1000 reached
    assert S.choose_ratios(rows, target_sparsity=0.5) == {'a': 0.5, 'b': 0.5}         # 500/1000
    assert S.choose_ratios(rows, target_sparsity=0.86) == {'a': 0.5, 'b': 0.9}        # 860/1000
    assert S.choose_ratios(rows, target_sparsity=0.9) == {'a': 0.9, 'b': 0.9}
    with pytest.raises(TinycompError, match='out of reach'): S.choose_ratios(rows, target_sparsity=0.95)
    with pytest.raises(TinycompError, match='exactly one'): S.choose_ratios(rows)
    with pytest.raises(TinycompError, match='exactly one'): S.choose_ratios(rows, 0.5, 0.1)


def test_apply_ratios():
    model = load_pretrained('digits_cnn')
    names = [n for n, _ in prunable_layers(model)]
    m = S.apply_ratios(model, {names[0]: 0.5, names[-1]: 0.25})
    sp = sparsity(m)['layers']
    assert sp[names[0]] == pytest.approx(0.5, abs=0.01) and sp[names[-1]] == pytest.approx(0.25, abs=0.01)


# --- compress_to_size ---------------------------------------------------------------------------------------------------
def test_to_sparse_and_model_size():
    model = load_pretrained('digits_cnn_wide')
    sp = S.to_sparse(prune(model, 0.9, 'global'))
    assert any(isinstance(m, (SparseConv2d, SparseLinear)) for m in sp.modules())
    assert model_size(sp) <= 0.3 * model_size(model)
    X, y = load_digits('test')
    assert evaluate(sp, (X, y)).accuracy == pytest.approx(evaluate(prune(model, 0.9, 'global'), (X, y)).accuracy)


def test_compress_to_size_meets_budget(val, small):
    model = load_pretrained('digits_cnn')
    before = snapshot(model)
    full = model_size(model)
    budget = int(0.4 * full)
    kw = dict(sparsities=(0.5, 0.9), channel_ratios=(0.5, 0.75))
    m, rep = S.compress_to_size(model, budget, val, **kw)
    assert model_size(m) <= budget and rep['chosen']['file_bytes'] <= budget
    fitting = [r for r in rep['candidates'] if r['file_bytes'] <= budget]
    assert len(fitting) >= 2 and len(fitting) < len(rep['candidates'])
    assert rep['chosen']['accuracy'] == max(r['accuracy'] for r in fitting)
    assert all(r['accuracy'] is None for r in rep['candidates'] if r['file_bytes'] > budget)
    assert same_state(before, snapshot(model))
    assert S.compress_to_size(model, budget, val, **kw)[1] == rep                  # deterministic
    big, rep3 = S.compress_to_size(model, 10 * full, val, sparsities=(), channel_ratios=())
    assert rep3['chosen']['name'] == 'float32' and big is model


def test_compress_to_size_searches_bit_width(val, small):
    model = load_pretrained('digits_cnn')
    budget = int(0.3 * model_size(model))
    m, rep = S.compress_to_size(model, budget, val, calibration=small[0][:64], sparsities=(), channel_ratios=(0.5,), bits=(4,))
    names = [r['name'] for r in rep['candidates']]
    assert names == ['float32', 'int4', 'channels 50%', 'channels 50% + int4']
    sizes = dict((r['name'], r['file_bytes']) for r in rep['candidates'])
    assert sizes['channels 50% + int4'] < sizes['int4'] < 0.3 * sizes['float32']
    assert rep['chosen']['file_bytes'] <= budget and model_size(m) <= budget


def test_compress_to_size_with_fine_tune(val, small):
    model = load_pretrained('digits_cnn_wide')
    budget = int(0.3 * model_size(model))
    m, rep = S.compress_to_size(model, budget, val, train_loader=loader(small), sparsities=(0.9,), channel_ratios=(), epochs=1)
    assert rep['chosen']['name'] == 'global 90% sparse' and model_size(m) <= budget


def test_compress_to_size_impossible(val):
    model = load_pretrained('digits_cnn_wide')
    with pytest.raises(TinycompError, match='smallest this search reached is [0-9]+ bytes'):
        S.compress_to_size(model, 1000, val, sparsities=(0.9,), channel_ratios=(0.5,))
    with pytest.raises(TinycompError, match='target_bytes'): S.compress_to_size(model, 0, val)
    with pytest.raises(TinycompError, match='data'): S.compress_to_size(model, 10_000, None)


# --- bench prune ---------------------------------------------------------------------------------------------------------
@pytest.mark.slow
def test_bench_prune_cli(tmp_path, capsys):
    from tinycomp.cli import main
    out = tmp_path / 'prune.json'
    assert main(['bench', 'prune', '--repeats', '1', '--epochs', '1', '--json', str(out)]) == 0
    res = json.loads(out.read_text())
    assert {r['density'] for r in res['kernels']} == {0.5, 0.3, 0.1, 0.05}
    names = [r['name'] for r in res['models']]
    assert names == ['dense', '50% channels removed + fine-tune', '90% global AGP, sparse']
    for r in res['models']: assert set(r['latency']) == {'1', '64'} and r['file_bytes'] > 0 and 0 <= r['accuracy'] <= 1
    assert len(res['acceptance']) == 5
    text = capsys.readouterr().out
    assert 'crossover' in text and '90% global AGP, sparse' in text
    assert main(['bench', 'prune', '--repeats', '0']) == 2
