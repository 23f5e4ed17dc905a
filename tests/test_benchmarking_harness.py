"Tests for tinycomp.benchmarking.harness: the statistics against independent formulas, counting, benchmark, compare, compliance."

import copy
import json
import math

import numpy as np
import pytest

from tinycomp.io import model_size
from tinycomp.nn import parameter_counts
from tinycomp.benchmarking.harness import (CONVENTIONS, REPEAT_TOLERANCE, BenchmarkResult, benchmark, compare, environment,
                                           mcnemar, paired_difference_ci, predict, ratio_ci,
                                           wilson_interval)
from tinycomp.data import load_digits
from tinycomp.distillation import tiny_cnn
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.models import load_pretrained
from tinycomp.nn.modules import Module
from tinycomp.profiling.timing import using_threads
from tinycomp.tensor import manual_seed

pytestmark = pytest.mark.module07

FAST = dict(rounds=2, calls=2, memory=False)


@pytest.fixture(scope='module')
def digits():
    X, y = load_digits('test')
    return X[:48], y[:48]


@pytest.fixture(scope='module')
def tiny():
    manual_seed(0)
    return tiny_cnn(4).eval()


# ---- statistics --------------------------------------------------------------------------------------------------

def test_wilson_matches_the_closed_form_and_edges():
    for k, n in [(357, 359), (0, 10), (10, 10), (1, 1), (50, 100)]:
        p, z = k / n, 1.96
        center = (p + z * z / (2 * n)) / (1 + z * z / n)
        half = z / (1 + z * z / n) * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
        lo, hi = wilson_interval(k, n)
        assert lo == pytest.approx(max(0, center - half), abs=1e-12) and hi == pytest.approx(min(1, center + half), abs=1e-12)
        assert 0 <= lo <= p <= hi <= 1
    assert wilson_interval(10, 10)[0] < 1 and wilson_interval(0, 10)[1] > 0     # never zero width at the edges
    assert wilson_interval(50, 100, z=2.58)[1] > wilson_interval(50, 100)[1]     # wider for 99 %


@pytest.mark.parametrize('args, message', [((11, 10), 'between 0 and n'), ((-1, 10), 'between 0 and n'), ((1, 0), 'at least 1'),
                                           ((1.5, 10), 'between 0 and n'), ((1, 10, 0), 'positive')])
def test_wilson_rejects_bad_input(args, message):
    with pytest.raises(TinycompError, match=message): wilson_interval(*args)


def _binomial_two_sided(b, c):
    n = b + c
    return min(1.0, 2 * sum(math.comb(n, k) for k in range(min(b, c) + 1)) / 2 ** n)


def test_mcnemar_counts_and_both_regimes():
    rng = np.random.default_rng(0)
    for _ in range(50):
        n = int(rng.integers(1, 300))
        a, c = rng.random(n) < 0.9, rng.random(n) < rng.uniform(0.5, 1)
        r = mcnemar(a, c)
        b_, c_ = int((a & ~c).sum()), int((~a & c).sum())
        assert (r['b'], r['c']) == (b_, c_)
        if b_ + c_ == 0: assert r == dict(b=0, c=0, statistic=0.0, p_value=1.0); continue
        stat = (abs(b_ - c_) - 1) ** 2 / (b_ + c_)
        assert r['statistic'] == pytest.approx(stat)
        expected = _binomial_two_sided(b_, c_) if b_ + c_ < 25 else math.erfc(math.sqrt(stat / 2))
        assert r['p_value'] == pytest.approx(expected)
        assert type(r['b']) is int and type(r['p_value']) is float


def test_mcnemar_is_symmetric_and_rejects_bad_input():
    a = np.array([True, True, False, True]); c = np.array([False, True, True, False])
    r1, r2 = mcnemar(a, c), mcnemar(c, a)
    assert (r1['b'], r1['c']) == (r2['c'], r2['b']) and r1['p_value'] == r2['p_value']
    with pytest.raises(TinycompError, match='boolean arrays'): mcnemar(a.astype(int), c)
    with pytest.raises(TinycompError, match='boolean arrays'): mcnemar(a, c[:3])


def test_ratio_ci_matches_a_transcription_of_the_procedure():
    rng = np.random.default_rng(3)
    base, cand = rng.lognormal(0, 0.2, 31), rng.lognormal(-0.7, 0.2, 17)
    r = ratio_ci(base, cand, np.random.default_rng(5), n_boot=400)
    g = np.random.default_rng(5)
    ib, ic = g.integers(0, 31, (400, 31)), g.integers(0, 17, (400, 17))
    ratios = np.median(base[ib], 1) / np.median(cand[ic], 1)
    assert r['ratio'] == pytest.approx(np.median(base) / np.median(cand))
    assert (r['ci_low'], r['ci_high']) == pytest.approx(tuple(np.percentile(ratios, [2.5, 97.5])))
    with pytest.raises(TinycompError, match='positive'): ratio_ci([1.0, -1.0], [1.0], rng)
    with pytest.raises(TinycompError, match='non-empty'): ratio_ci([], [1.0], rng)
    with pytest.raises(TinycompError, match='positive, finite'): ratio_ci([np.nan], [1.0], rng)


def test_paired_difference_ci_contains_the_difference():
    a = np.array([True] * 80 + [False] * 20); c = a.copy(); c[:6] = False; c[95:] = True
    lo, hi = paired_difference_ci(a, c)
    d = (c.mean() - a.mean())
    assert lo < d < hi and hi - lo < 0.2
    assert paired_difference_ci(a, a) == (0.0, 0.0)


# ---- predictions, data and counting ------------------------------------------------------------------------------

def test_predict_restores_the_training_flag_and_checks_shapes(tiny, digits):
    X, _ = digits
    tiny.train()
    logits = predict(tiny, X, batch_size=7)
    assert tiny.training and logits.shape == (len(X), 10) and logits.dtype == np.float32
    tiny.eval()
    np.testing.assert_allclose(predict(tiny, X, batch_size=100), logits, rtol=1e-5, atol=1e-6)
    with pytest.raises(ShapeError, match=r'cannot take samples of shape \(1, 6, 6\)'): predict(tiny, X[:, :, :6, :6])


@pytest.mark.parametrize('make, message', [
    (lambda X, y: X, 'pair'), (lambda X, y: (X, y[:-1]), 'one label per sample'),
    (lambda X, y: (X, y.astype(np.float32)), 'integers'), (lambda X, y: (X[:0], y[:0]), 'non-empty'),
    (lambda X, y: (np.where(np.arange(X.size).reshape(X.shape) == 5, np.nan, X), y), 'NaN')])
def test_bad_data_is_a_clear_error(tiny, digits, make, message):
    with pytest.raises(TinycompError, match=message): benchmark(tiny, make(*digits), **FAST)


def test_labels_beyond_the_outputs_are_refused(tiny, digits):
    X, y = digits
    with pytest.raises(ShapeError, match='outputs but the labels go up to 12'): benchmark(tiny, (X, np.full(len(y), 12)), **FAST)


def test_parameter_counts_for_every_kind_of_model():
    from tinycomp.pruning import prune, prune_channels, to_sparse
    from tinycomp.quantization import quantize_dynamic, quantize_static
    model = load_pretrained('digits_cnn')
    n = sum(p.data.size for p in model.parameters())
    assert parameter_counts(model) == (n, int(sum(np.count_nonzero(p.data) for p in model.parameters())))
    calib = load_digits('train')[0][:64]
    for variant in (quantize_static(model, calib), quantize_static(model, calib, weight_bits=4), quantize_dynamic(model)):
        total, nonzero = parameter_counts(variant)                # each stands for the float model's weights
        assert total == n and 0.5 * total < nonzero <= total
    q = quantize_static(model, calib)
    assert parameter_counts(q)[1] == sum(int(np.count_nonzero(m.int_weight())) + int(np.count_nonzero(m.bias))
                                         for m in q.modules() if hasattr(m, 'int_weight'))
    masked = prune(model, 0.7, method='global')
    total, nonzero = parameter_counts(masked)
    assert total == n and nonzero < 0.45 * n
    sparse = to_sparse(masked, max_density=0.5)
    assert parameter_counts(sparse) == (n, nonzero)
    assert parameter_counts(prune_channels(model, 0.5, input_shape=(1, 1, 8, 8)))[0] < 0.5 * n


def test_model_size_is_the_saved_file(tiny, tmp_path):
    from tinycomp.io import save
    assert model_size(tiny) == save(tiny, tmp_path / 'm.npz').stat().st_size


def test_environment_records_threads_and_versions():
    env = environment()
    assert env['usable_cores'] >= 1 and env['threads']['numba'] >= 1 and env['numpy'] == np.__version__ and env['cpu']


# ---- benchmark ---------------------------------------------------------------------------------------------------

def test_benchmark_measures_everything(tiny, digits):
    X, y = digits
    r = benchmark(tiny, digits, batch_sizes=(1, 8), name='tiny', rounds=3, calls=2)
    assert isinstance(r, BenchmarkResult) and r.name == 'tiny' and r.n_test == len(y)
    assert r.accuracy == pytest.approx((predict(tiny, X).argmax(1) == y).mean())
    assert r.accuracy_ci == wilson_interval(round(r.accuracy * len(y)), len(y))
    for b in (1, 8):
        lat = r.latency[b]
        assert len(lat['samples_s']) == 6 and len(lat['visit_minima_s']) == 3
        assert lat['min_s'] <= lat['visit_min_s'] <= lat['median_s'] <= lat['p90_s'] <= lat['p99_s']
        assert lat['throughput'] == pytest.approx(b / lat['median_s']) and lat['noisy'] == (lat['cv'] > 0.1)
        assert r.peak_memory_mb[b] > 0
    assert r.params == 690 and r.file_bytes == model_size(tiny) and r.bits_per_param == pytest.approx(8 * r.file_bytes / 690)
    assert r.compliance['passed'] and r.settings['rounds'] == 3
    assert r.row(8) == dict(name='tiny', accuracy=r.accuracy, latency_ms=r.latency[8]['median_s'] * 1e3,
                            file_bytes=r.file_bytes, params=690)
    json.dumps(r.to_dict())
    assert 'compliance: passed' in r.table()
    with pytest.raises(TinycompError, match='not 64'): r.row(64)


def test_deployed_times_the_frozen_model(digits, monkeypatch):
    from tinycomp.deploy.runtime import InferenceModel, freeze
    X, y = digits
    model = load_pretrained('digits_cnn')
    calls = []
    run = InferenceModel.run
    monkeypatch.setattr(InferenceModel, 'run', lambda self, x, out=None: calls.append(len(x)) or run(self, x, out))
    r = benchmark(model, digits, batch_sizes=(1, 8), rounds=2, calls=2, deployed=True)
    assert r.settings['deployed'] and 'frozen for deployment' in r.table()
    assert sum(1 for b in calls if b == 8) >= 2 * (1 + 2)                # every timed call (and its warm-up) ran frozen
    assert (r.params, r.file_bytes) == (parameter_counts(model)[0], model_size(model))   # the model's, not the graph's
    with using_threads(1):                                          # the plan's scratch arrays depend on the threads
        assert r.peak_memory_mb[8] == freeze(model, X[:8]).memory_plan(8).arena_bytes / 1e6 > 0
    assert r.compliance['passed'] and (r.predictions == predict(model, X).argmax(1)).all()
    eager = benchmark(model, digits, batch_sizes=(1,), **FAST)
    assert not eager.settings['deployed'] and 'frozen' not in eager.table() and 'peak MB' in eager.table()
    assert 'arena MB' in r.table()
    c = compare(('float32', model), {'twin': copy.deepcopy(model)}, digits, batch_sizes=(1,), deployed=True, **FAST)
    assert 'every model frozen for deployment' in c.table()


def test_a_model_that_cannot_be_frozen_is_named(digits):
    class Noisy(Module):                                   # a different answer on every call: freezing must refuse it
        def __init__(self, inner): super().__init__(); self.inner = inner
        def forward(self, x): return self.inner(x) + float(np.random.default_rng().random())
    with pytest.raises(TinycompError, match="noisy cannot be frozen for deployment"):
        benchmark(Noisy(load_pretrained('digits_cnn')), digits, name='noisy', deployed=True, **FAST)


@pytest.mark.parametrize('kw, message', [(dict(batch_sizes=()), 'batch_sizes'), (dict(batch_sizes=(0,)), 'batch_sizes'),
                                         (dict(rounds=1), 'rounds'), (dict(calls=0), 'calls'), (dict(threads=10**6), 'threads')])
def test_benchmark_rejects_bad_settings(tiny, digits, kw, message):
    with pytest.raises(TinycompError, match=message): benchmark(tiny, digits, **{**FAST, **kw})


class _Memo(Module):
    "Caches answers by input bytes: fast on a repeated input."
    def __init__(self, inner):
        super().__init__(); self.inner = inner; object.__setattr__(self, 'seen', {})
    def forward(self, x):
        key = x.data.tobytes()
        if key not in self.seen: self.seen[key] = self.inner(x)
        return self.seen[key]


class _Slow(Module):
    "An honest but slower model (the forward pass runs several times): the repeat check must not flag it."
    def __init__(self, inner): super().__init__(); self.inner = inner
    def forward(self, x):
        for _ in range(3): out = self.inner(x)
        return out


class _Sloppy(Module):
    "Correct for its first few calls, then returns its last answer."
    def __init__(self, inner):
        super().__init__(); self.inner = inner; object.__setattr__(self, 'state', [0, None])
    def forward(self, x):
        self.state[0] += 1
        if self.state[0] > 3 and self.state[1] is not None and self.state[1].shape[0] == x.shape[0]: return self.state[1]
        self.state[1] = self.inner(x)
        return self.state[1]


def test_compliance_catches_caching_and_behaviour_changes(digits):
    model = load_pretrained('digits_cnn').eval()
    memo = benchmark(_Memo(copy.deepcopy(model)), digits, batch_sizes=(1,), rounds=6, calls=2, memory=False)
    assert not memo.compliance['repeat_ok'] and memo.compliance['repeat_ratio'] > REPEAT_TOLERANCE and not memo.compliance['passed']
    sloppy = benchmark(_Sloppy(copy.deepcopy(model)), digits, batch_sizes=(1, 4), rounds=3, calls=2, memory=False)
    assert not sloppy.compliance['predictions_match'] and sloppy.compliance['timed_mismatches'] > 0
    assert 'FAILED' in sloppy.table()
    slow = benchmark(_Slow(copy.deepcopy(model)), digits, batch_sizes=(1,), rounds=6, calls=2, memory=False)
    assert slow.compliance['passed'], slow.compliance
    assert slow.file_bytes is None and 'no file size' in slow.table()      # a layer io cannot save: measured without a size


# ---- compare -----------------------------------------------------------------------------------------------------

def test_compare_rows_against_the_baseline(digits):
    from tinycomp.pruning import prune_channels
    from tinycomp.quantization import quantize_static
    model = load_pretrained('digits_cnn')
    int8 = quantize_static(model, load_digits('train')[0][:64])
    cut = prune_channels(model, 0.75, input_shape=(1, 1, 8, 8))
    c = compare(('float32', model), {'twin': copy.deepcopy(model), 'int8': int8, 'cut': cut}, digits, rounds=3, calls=2,
                memory=False)
    assert [r['name'] for r in c.rows] == ['float32', 'twin', 'int8', 'cut'] and c.baseline == 'float32'
    base, twin = c.row('float32'), c.row('twin')
    assert base['compression'] == 1.0 and base['dacc_points'] == 0.0 and base['speedup'][1]['ratio'] == 1.0
    assert twin['p_value'] == 1.0 and twin['dacc_ci'] == (0.0, 0.0) and not twin['significant']
    r = c.row('int8')
    assert r['compression'] == pytest.approx(c.result('float32').file_bytes / c.result('int8').file_bytes) and r['compression'] > 2
    for b in (1, 64):
        s = r['speedup'][b]
        assert s['ratio'] == pytest.approx(c.result('float32').latency[b]['median_s'] / c.result('int8').latency[b]['median_s'])
        assert s['ci_low'] <= s['ci_high']
        assert s['min_ratio'] == pytest.approx(c.result('float32').latency[b]['visit_min_s'] / c.result('int8').latency[b]['visit_min_s'])
    y = digits[1]
    ok_b, ok_c = c.result('float32').predictions == y, c.result('cut').predictions == y
    assert c.row('cut')['p_value'] == mcnemar(ok_b, ok_c)['p_value']
    assert c.row('cut')['dacc_points'] == pytest.approx((ok_c.mean() - ok_b.mean()) * 100)
    text = c.table()
    assert CONVENTIONS in text and 'b64 speedup [CI]' in text and 'twin' in text
    json.dumps(c.to_dict())


def test_compare_interleaves_in_a_random_order(digits, tiny):
    "Every round visits each model once, and the orders differ between rounds."
    from tinycomp.benchmarking import harness
    class SpyRng:
        def __init__(self): self.rng, self.orders = np.random.default_rng(0), []
        def permutation(self, x):
            out = self.rng.permutation(x); self.orders.append(tuple(out)); return out
    spy = SpyRng()
    models = {n: copy.deepcopy(tiny) for n in 'ABCD'}
    harness._timed_rounds(models, digits[0], 1, 12, 1, spy)
    assert len(spy.orders) == 12 and all(sorted(o) == list('ABCD') for o in spy.orders) and len(set(spy.orders)) > 3


def test_compare_bad_arguments(tiny, digits):
    with pytest.raises(TinycompError, match='non-empty dict'): compare(tiny, {}, digits, **FAST)
    with pytest.raises(TinycompError, match='like the baseline'): compare(('a', tiny), {'a': tiny}, digits, **FAST)
    with pytest.raises(TinycompError, match='no model named'): compare(tiny, {'b': tiny}, digits, batch_sizes=(1,), **FAST).result('zzz')


def test_threads_are_set_while_measuring_and_restored(tiny, digits):
    from tinycomp.profiling.timing import thread_info
    before = thread_info()
    r = benchmark(tiny, digits, threads=1, **FAST)
    after = thread_info()
    assert r.environment['threads']['numba'] == 1
    assert (after['numba'], after['blas']) == (before['numba'], before['blas'])
