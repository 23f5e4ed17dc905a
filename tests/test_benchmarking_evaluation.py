"Tests for tinycomp.benchmarking.evaluation: agreement, per-class accuracy, confusion, critical failures, ECE, Pareto front, knee, plots, reports."
import numpy as np
import pytest

import matplotlib
matplotlib.use('Agg')
import matplotlib.pyplot as plt

from tinycomp.benchmarking import evaluation as E
from tinycomp.errors import ShapeError, TinycompError

pytestmark = pytest.mark.module07


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close('all')


def random_probs(rng, n, c, scale=3.0):
    z = rng.standard_normal((n, c)) * scale
    p = np.exp(z - z.max(axis=1, keepdims=True))
    return p / p.sum(axis=1, keepdims=True)


# ---------------------------------------------------------------- plain functions
def test_softmax_matches_definition_and_is_stable():
    rng = np.random.default_rng(0)
    z = rng.standard_normal((7, 5)).astype(np.float32)
    p = E.softmax(z)
    assert p.dtype == np.float64 and p.shape == (7, 5)
    ref = np.exp(z.astype(np.float64)) / np.exp(z.astype(np.float64)).sum(axis=1, keepdims=True)
    np.testing.assert_allclose(p, ref, rtol=1e-12)
    np.testing.assert_allclose(E.softmax([[1e4, 0.0], [-1e4, -1e4]]), [[1.0, 0.0], [0.5, 0.5]])
    np.testing.assert_allclose(E.softmax(z).sum(axis=1), 1.0, rtol=0, atol=1e-14)


@pytest.mark.parametrize('bad,msg', [([1.0, 2.0], '2-D'), ([[np.inf, 0.0]], 'NaN or inf'), (np.zeros((0, 3)), 'empty'),
                                     ([['a', 'b']], 'numeric')])
def test_softmax_rejects_bad_logits(bad, msg):
    with pytest.raises(TinycompError, match=msg): E.softmax(bad)


def test_agreement_per_class_confusion_critical_against_loops():
    rng = np.random.default_rng(1)
    for _ in range(20):
        n, c = int(rng.integers(1, 80)), int(rng.integers(1, 7))
        y, a, b = (rng.integers(0, c, n) for _ in range(3))
        assert E.agreement(a, b) == pytest.approx(sum(int(u == v) for u, v in zip(a, b)) / n)
        M = np.zeros((c, c), np.int64)
        for t, p in zip(y, a): M[t, p] += 1
        cm = E.confusion_matrix(a, y, c)
        assert cm.dtype == np.int64 and np.array_equal(cm, M)
        pca = E.per_class_accuracy(a, y, c)
        for k in range(c):
            if (y == k).any(): assert pca[k] == pytest.approx(M[k, k] / M[k].sum())
            else: assert np.isnan(pca[k])
        crit = E.critical_failures(a, b, y)
        assert crit.dtype == np.int64 and crit.tolist() == [i for i in range(n) if a[i] == y[i] and b[i] != y[i]]


def test_plain_functions_validate():
    with pytest.raises(ShapeError, match='same length'): E.agreement([0, 1], [0])
    with pytest.raises(TinycompError, match='integer class indices'): E.agreement([0.0], [0])
    with pytest.raises(TinycompError, match='empty'): E.agreement([], [])
    with pytest.raises(ShapeError, match='1-D'): E.confusion_matrix([[0]], [[0]], 2)
    with pytest.raises(TinycompError, match=r'\[0, 2\)'): E.confusion_matrix([0, 2], [0, 1], 2)
    with pytest.raises(TinycompError, match='n_classes must be an integer >= 1'): E.per_class_accuracy([0], [0], 0)
    with pytest.raises(TinycompError, match='n_classes'): E.per_class_accuracy([0], [0], True)
    with pytest.raises(TinycompError, match='>= 0'): E.critical_failures([-1], [0], [0])
    with pytest.raises(ShapeError, match='same length'): E.critical_failures([0, 1], [0, 1], [0])


# ---------------------------------------------------------------- expected calibration error
def ece_slow(probs, labels, n_bins):
    "Reference: one example at a time, bins (b/n, (b+1)/n] (edges b/n in float64, as specified) found by a search."
    sums = {}
    for row, y in zip(np.asarray(probs, np.float64), labels):
        conf = max(row)
        pred = list(row).index(conf)
        b = 0 if conf == 0 else next(k for k in range(n_bins) if k / n_bins < conf <= (k + 1) / n_bins)
        s = sums.setdefault(b, [0, 0.0, 0.0])
        s[0] += 1; s[1] += float(pred == y); s[2] += conf
    N = len(labels)
    return sum(cnt / N * abs(hit / cnt - conf / cnt) for cnt, hit, conf in sums.values())


def test_ece_matches_slow_loop_on_random_inputs():
    rng = np.random.default_rng(2)
    for _ in range(60):
        n, c, nb = int(rng.integers(1, 120)), int(rng.integers(2, 11)), int(rng.integers(1, 25))
        p, y = random_probs(rng, n, c, float(rng.uniform(0.3, 5))), rng.integers(0, c, n)
        got = E.expected_calibration_error(p, y, nb)
        assert isinstance(got, float)
        assert got == pytest.approx(ece_slow(p, y, nb), rel=1e-12, abs=1e-15)
        assert E.calibration_bins(p, y, nb)['ece'] == pytest.approx(got, rel=1e-12, abs=1e-15)


def test_ece_edges_ties_and_sure_rows():
    # 5 bins: 0.2 -> bin 0, 0.4 -> bin 1, 0.6 -> bin 2, 1.0 -> bin 4 (right edges included)
    p = np.array([[0.2] * 5, [0.4, 0.3, 0.3, 0, 0], [0.6, 0.4, 0, 0, 0], [1.0, 0, 0, 0, 0], [0.4, 0.4, 0.2, 0, 0]])
    y = np.array([0, 0, 1, 0, 1])          # row 0 ties five ways (predicts 0), row 4 ties (predicts 0, label 1)
    cb = E.calibration_bins(p, y, 5)
    assert cb['counts'].tolist() == [1, 2, 1, 0, 1]
    np.testing.assert_allclose(cb['accuracy'][[0, 1, 2, 4]], [1.0, 0.5, 0.0, 1.0])
    expected = (abs(1 - 0.2) + 2 * abs(0.5 - 0.4) + abs(0 - 0.6) + 0) / 5    # bins 0, 1 (two rows), 2, 4
    assert E.expected_calibration_error(p, y, 5) == pytest.approx(expected, abs=1e-15)
    assert E.expected_calibration_error(p, y, 5) == pytest.approx(ece_slow(p, y, 5), abs=1e-15)
    # 8 bins with dyadic edges: 0.25, 0.375, 0.5 exactly on edges
    rng = np.random.default_rng(3)
    for _ in range(20):
        confs = rng.choice([0.25, 0.375, 0.5, 0.625, 1.0, 0.3, 0.45], 30)
        rows = np.array([[c, 1 - c] + [0.0] * 2 if c > 0.5 else [c, (1 - c) / 3, (1 - c) / 3, (1 - c) / 3] for c in confs])
        y = rng.integers(0, 4, 30)
        assert E.expected_calibration_error(rows, y, 8) == pytest.approx(ece_slow(rows, y, 8), abs=1e-15)


def test_ece_properties():
    rng = np.random.default_rng(4)
    p, y = random_probs(rng, 50, 4), rng.integers(0, 4, 50)
    conf, right = p.max(1), p.argmax(1) == y
    assert E.expected_calibration_error(p, y, 1) == pytest.approx(abs(right.mean() - conf.mean()))
    assert E.expected_calibration_error(np.eye(4), np.arange(4), 15) == 0.0
    assert E.expected_calibration_error(np.eye(4), (np.arange(4) + 1) % 4, 15) == 1.0
    assert 0.0 <= E.expected_calibration_error(p, y) <= 1.0
    p32 = p.astype(np.float32)
    assert np.isfinite(E.expected_calibration_error(p32, y))        # float32 softmax output is accepted
    before = p.copy(), y.copy()
    E.expected_calibration_error(p, y, 7); E.calibration_bins(p, y, 7)
    assert np.array_equal(p, before[0]) and np.array_equal(y, before[1])


@pytest.mark.parametrize('probs,labels,n_bins,msg', [
    (np.array([[2.0, -1.0]]), [0], 15, 'did you pass logits'),
    (np.array([[0.5, 0.4]]), [0], 15, 'sum to 1'),
    (np.array([[np.nan, 1.0]]), [0], 15, 'NaN'),
    (np.zeros((0, 2)), np.zeros(0, np.int64), 15, 'empty'),
    (np.array([0.5, 0.5]), [0], 15, '2-D'),
    (np.array([[0.5, 0.5]]), [0, 1], 15, 'same length'),
    (np.array([[0.5, 0.5]]), [2], 15, r'\[0, 2\)'),
    (np.array([[0.5, 0.5]]), [0.0], 15, 'integer class indices'),
    (np.array([[0.5, 0.5]]), [0], 0, 'n_bins must be an integer >= 1'),
    (np.array([[0.5, 0.5]]), [0], 2.5, 'n_bins must be an integer >= 1'),
])
def test_ece_rejects_bad_input(probs, labels, n_bins, msg):
    with pytest.raises(TinycompError, match=msg): E.expected_calibration_error(probs, np.asarray(labels), n_bins)
    with pytest.raises(TinycompError, match=msg): E.calibration_bins(probs, np.asarray(labels), n_bins)


# ---------------------------------------------------------------- Pareto front
def brute_front(P, mx):
    s = [[v if m else -v for v, m in zip(row, mx)] for row in np.asarray(P, float).tolist()]
    def dominates(a, b): return all(x >= y for x, y in zip(a, b)) and any(x > y for x, y in zip(a, b))
    return [i for i in range(len(s)) if not any(dominates(s[j], s[i]) for j in range(len(s)))]


def test_pareto_front_matches_brute_force_with_ties_and_duplicates():
    rng = np.random.default_rng(5)
    for t in range(150):
        n, k = int(rng.integers(1, 30)), int(rng.integers(1, 5))
        P = rng.integers(0, 4, (n, k)).astype(float) if t % 2 == 0 else rng.standard_normal((n, k))
        if n > 1 and t % 3 == 0: P[-1] = P[0]                              # an exact duplicate
        mx = [bool(v) for v in rng.integers(0, 2, k)]
        before = P.copy()
        front = E.pareto_front(P, mx)
        assert front.dtype == np.int64 and front.tolist() == brute_front(P, mx)
        assert np.flatnonzero(E.pareto_mask(P, mx)).tolist() == front.tolist()
        assert np.array_equal(P, before)
        assert len(front) >= 1


def test_pareto_front_fixed_cases():
    pts = np.array([[0.90, 5.0], [0.95, 4.0], [0.97, 6.0], [0.97, 6.0], [0.97, 7.0], [0.99, 9.0]])
    assert E.pareto_front(pts, [True, False]).tolist() == [1, 2, 3, 5]
    assert E.pareto_front(pts, np.array([True, False])).tolist() == [1, 2, 3, 5]     # numpy bools are fine
    assert E.pareto_front(pts, (False, True)).tolist() == [0, 4, 5]
    assert E.pareto_front(np.ones((4, 3)), [True, False, True]).tolist() == [0, 1, 2, 3]
    assert E.pareto_front([[1.0]], [False]).tolist() == [0]
    three = [[1, 2, 3], [1, 2, 2], [0, 3, 3], [1, 2, 2]]
    assert E.pareto_front(three, [True, True, False]).tolist() == [1, 2, 3]
    # minimising everything is maximising the negatives
    rng = np.random.default_rng(6)
    P = rng.integers(0, 5, (20, 3)).astype(float)
    assert E.pareto_front(P, [False] * 3).tolist() == E.pareto_front(-P, [True] * 3).tolist()


@pytest.mark.parametrize('points,maximize,msg', [
    (np.zeros((3, 2)), [True], 'maximize has 1 entries'),
    (np.zeros((3, 2)), [1, 0], 'booleans'),
    (np.zeros((3, 2)), True, 'sequence of booleans'),
    (np.zeros((3, 2)), 'tf', 'sequence of booleans'),
    (np.zeros((0, 2)), [True, True], 'empty'),
    (np.zeros((3, 0)), [], 'no objectives'),
    (np.array([[np.nan, 1.0]]), [True, True], 'NaN'),
    (np.array([1.0, 2.0]), [True], '2-D'),
    ([['a', 'b']], [True, True], 'numeric'),
])
def test_pareto_rejects_bad_input(points, maximize, msg):
    for f in (E.pareto_front, E.pareto_mask, E.knee_point):
        with pytest.raises(TinycompError, match=msg): f(points, maximize)


# ---------------------------------------------------------------- knee
def knee_ref(P, mx):
    P = np.asarray(P, float)
    idx = brute_front(P, mx)
    F = P[idx]
    best = None
    for r, i in enumerate(idx):
        d2 = 0.0
        for j in range(P.shape[1]):
            lo, hi = F[:, j].min(), F[:, j].max()
            if hi == lo: continue
            u = (F[r, j] - lo) / (hi - lo) if mx[j] else (hi - F[r, j]) / (hi - lo)
            d2 += (1 - u) ** 2
        if best is None or d2 < best[0]: best = (d2, i)
    return best[1]


def test_knee_matches_reference_on_random_sets():
    rng = np.random.default_rng(7)
    for _ in range(120):
        n, k = int(rng.integers(1, 25)), int(rng.integers(1, 4))
        P = rng.standard_normal((n, k))
        mx = [bool(v) for v in rng.integers(0, 2, k)]
        got = E.knee_point(P, mx)
        assert type(got) is int and got == knee_ref(P, mx)
        assert got in E.pareto_front(P, mx).tolist()


def test_knee_fixed_cases():
    pts = np.array([[0.90, 5.0], [0.95, 4.0], [0.97, 6.0], [0.97, 6.0], [0.97, 7.0], [0.99, 9.0]])
    assert E.knee_point(pts, [True, False]) == 2                            # copies 2 and 3: the lowest index
    far = np.vstack([[[0.05, 9.9]], pts])                                   # a terrible dominated model, first
    assert E.knee_point(far, [True, False]) == 3                            # normalised over the front: unchanged
    assert E.knee_point([[0.0, 1.0], [1.0, 0.0]], [True, True]) == 0        # a tie
    assert E.knee_point([[1.0, 1.0], [0.0, 0.0]], [True, True]) == 0        # one front point
    assert E.knee_point([[5.0, 1.0], [5.0, 1.0]], [True, True]) == 0
    const = [[0.9, 5.0, 7.0], [0.95, 6.0, 7.0], [0.99, 9.0, 7.0], [0.9, 9.0, 8.0]]
    assert E.knee_point(const, [True, False, False]) == 1
    # invariant to positive affine maps of each column and to negating a column with its direction
    rng = np.random.default_rng(8)
    P, mx = rng.standard_normal((15, 3)), [True, False, True]
    k = E.knee_point(P, mx)
    assert E.knee_point(P * [3.0, 0.5, 10.0] + [1.0, -2.0, 5.0], mx) == k
    assert E.knee_point(P * [-1.0, 1.0, 1.0], [False, False, True]) == k


# ---------------------------------------------------------------- rows and plots
ROWS = [dict(name=n, accuracy=a, latency_ms=l, file_bytes=b, params=1) for n, a, l, b in
        [('float', 0.99, 9.0, 40000), ('int8', 0.99, 4.0, 12000), ('pruned', 0.97, 3.0, 9000), ('bad', 0.80, 5.0, 20000)]]


def test_pareto_rows_and_knee_row():
    assert [r['name'] for r in E.pareto_rows(ROWS)] == ['int8', 'pruned']
    assert [r['name'] for r in E.pareto_rows(ROWS, {'accuracy': 'max'})] == ['float', 'int8']
    assert [r['name'] for r in E.pareto_rows(ROWS, {'latency_ms': 'max'})] == ['float']
    assert E.knee_row(ROWS, {'accuracy': 'max', 'latency_ms': 'min'})['name'] == 'int8'
    assert E.knee_row(ROWS)['name'] in ('int8', 'pruned')
    with pytest.raises(TinycompError, match="has no \\['file_bytes'\\]"): E.pareto_rows([dict(name='x', accuracy=1, latency_ms=1)])
    with pytest.raises(TinycompError, match="'max' or 'min'"): E.pareto_rows(ROWS, {'accuracy': 'maximise'})
    with pytest.raises(TinycompError, match='no rows'): E.pareto_rows([])
    with pytest.raises(TinycompError, match='objectives is empty'): E.knee_row(ROWS, {})


def test_plots_return_figures_and_write_files(tmp_path):
    rng = np.random.default_rng(9)
    p, y = random_probs(rng, 40, 3), rng.integers(0, 3, 40)
    fig = E.plot_reliability(p, y, n_bins=10, path=tmp_path / 'rel.png', title='one')
    assert isinstance(fig, matplotlib.figure.Figure) and len(fig.axes) == 2 and (tmp_path / 'rel.png').stat().st_size > 0
    fig = E.plot_reliability({'a': p, 'b': np.full((40, 3), 1 / 3)}, y, path=tmp_path / 'sub' / 'rel2.png')
    assert len(fig.axes) == 4 and (tmp_path / 'sub' / 'rel2.png').exists()
    cm = E.confusion_matrix(p.argmax(1), y, 3)
    fig = E.plot_confusion({'a': cm, 'b': cm}, path=tmp_path / 'cm.png', class_names='abc')
    assert len(fig.axes) == 2 and (tmp_path / 'cm.png').exists()
    X = rng.standard_normal((40, 1, 8, 8)).astype(np.float32)
    base, cand = y.copy(), (y + 1) % 3
    fig = E.plot_critical_failures(X, y, base, cand, max_images=5, path=tmp_path / 'crit.png')
    assert len(fig.axes) == 5 and '40 critical failures' in fig._suptitle.get_text() and '(first 5 shown)' in fig._suptitle.get_text()
    assert (tmp_path / 'crit.png').exists()
    fig = E.plot_critical_failures(X.reshape(40, 64), y, base, base)
    assert 'no critical failures' in fig.axes[0].texts[0].get_text()
    fig = E.plot_pareto(ROWS, path=tmp_path / 'pareto.png', title='t')
    assert len(fig.axes) == 2 and (tmp_path / 'pareto.png').stat().st_size > 0
    labels = {t.get_text() for ax in fig.axes for t in ax.texts}
    assert labels == {'float', 'int8', 'pruned', 'bad'}
    fig = E.plot_pareto(ROWS, knee='pruned')                      # a given knee is starred in both panels
    stars = [c for ax in fig.axes for c in ax.collections if c.get_label().startswith('knee')]
    assert [c.get_label() for c in stars] == ['knee (all objectives)'] * 2
    pruned = next(r for r in ROWS if r['name'] == 'pruned')
    assert tuple(stars[0].get_offsets()[0]) == (pruned['latency_ms'], pruned['accuracy'])
    with pytest.raises(TinycompError, match='not the name of a row'): E.plot_pareto(ROWS, knee='nope')
    with pytest.raises(ShapeError, match='square'): E.plot_confusion(np.zeros((2, 3)))
    with pytest.raises(ShapeError, match='cannot show'): E.plot_critical_failures(np.zeros((40, 5)), y, base, cand)
    with pytest.raises(ShapeError, match='X has 39'): E.plot_critical_failures(X[:39], y, base, cand)


def test_plot_pareto_without_knee_exercise(monkeypatch):
    def todo(points, maximize): raise NotImplementedError("Exercise 07.6 knee_point: not done yet")
    monkeypatch.setattr(E, 'knee_point', todo)
    fig = E.plot_pareto(ROWS)
    assert 'Exercise 07.6' in fig._suptitle.get_text()


# ---------------------------------------------------------------- reports
def test_evaluation_report_and_format():
    zb = np.log(np.array([[.8, .1, .1], [.2, .7, .1], [.3, .3, .4], [.6, .3, .1]]))
    zc = np.log(np.array([[.5, .4, .1], [.6, .3, .1], [.2, .2, .6], [.1, .8, .1]]))
    y = np.array([0, 1, 2, 1])
    r = E.evaluation_report(zb, zc, y, n_bins=5, names=('float', 'int8'))
    assert r['names'] == ('float', 'int8') and r['n'] == 4 and r['n_classes'] == 3 and r['n_bins'] == 5
    assert r['baseline']['accuracy'] == 0.75 and r['candidate']['accuracy'] == 0.75
    assert r['agreement'] == 0.5 and r['critical_failures'] == 1 and r['critical_indices'].tolist() == [1]
    assert r['fixed'] == 1 and r['fixed_indices'].tolist() == [3]
    assert r['baseline']['predictions'].tolist() == [0, 1, 2, 0]
    assert r['candidate']['confusion'].tolist() == [[1, 0, 0], [1, 1, 0], [0, 0, 1]]
    assert r['candidate']['ece'] == pytest.approx(E.expected_calibration_error(E.softmax(zc), y, 5))
    np.testing.assert_allclose(r['baseline']['per_class'], [1.0, 0.5, 1.0])
    text = E.format_evaluation(r)
    assert 'int8 against float on 4 labelled examples' in text and 'agreement with float: 0.5000' in text
    assert 'critical failures (float right, int8 wrong): 1' in text and 'percentage points' in text
    r2 = E.evaluation_report(zb, zb, np.array([0, 1, 2, 0]))
    assert r2['agreement'] == 1.0 and r2['critical_failures'] == 0 and 'class' in E.format_evaluation(r2)
    r3 = E.evaluation_report(np.zeros((2, 3)), np.zeros((2, 3)), np.array([0, 0]))    # classes 1, 2 absent
    assert np.isnan(r3['baseline']['per_class'][1]) and '-' in E.format_evaluation(r3)
    with pytest.raises(ShapeError, match='same shape'): E.evaluation_report(zb, zc[:3], y)
    with pytest.raises(ShapeError, match='same length'): E.evaluation_report(zb, zc, y[:3])
    with pytest.raises(TinycompError, match='names must be two'): E.evaluation_report(zb, zc, y, names=('a',))


def test_evaluate_against_runs_both_models():
    from tinycomp.data import load_digits
    from tinycomp.models import digits_cnn
    from tinycomp.tensor import manual_seed
    X, y = load_digits('test')
    X, y = X[:64], y[:64]
    manual_seed(0); a = digits_cnn()
    manual_seed(1); b = digits_cnn()
    r = E.evaluate_against(a, b, (X, y), batch_size=16)
    assert r['n'] == 64 and 0 <= r['agreement'] <= 1
    assert E.evaluate_against(a, a, (X, y))['agreement'] == 1.0
    with pytest.raises(TinycompError, match=r'pair \(X, y\)'): E.evaluate_against(a, b, X)
    with pytest.raises(ShapeError, match='cannot take samples'): E.evaluate_against(a, b, (X.reshape(64, 4, 4, 4), y))
