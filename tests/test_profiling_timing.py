"Tests for tinycomp.profiling.timing: latency_stats, the one timer time_fn, and the thread controls."
import argparse
import os

import numba
import numpy as np
import pytest

import tinycomp.profiling.timing as timing
from tinycomp.errors import TinycompError
from tinycomp.profiling.timing import (check_threads, latency_stats, measure_times, set_threads, thread_info, threads_arg,
                                       time_fn, usable_cores)

pytestmark = pytest.mark.module03

KEYS = {'median', 'p90', 'p99', 'mean', 'cv', 'ci_low', 'ci_high'}


# --- latency_stats ---------------------------------------------------------------------------------------

def test_latency_stats_by_hand():
    s = latency_stats(np.array([1., 2., 3., 4., 10.]), np.random.default_rng(0))
    assert set(s) == KEYS and all(type(v) is float for v in s.values())
    # sorted positions h = 4 q / 100: p90 at 3.6 -> 4 + 0.6 * 6, p99 at 3.96 -> 4 + 0.96 * 6
    assert s['median'] == 3 and s['p90'] == pytest.approx(7.6) and s['p99'] == pytest.approx(9.76)
    assert s['mean'] == 4 and s['cv'] == pytest.approx(np.sqrt(10) / 4)   # deviations -3 -2 -1 0 6: variance 50 / 5


def test_latency_stats_unsorted_input_same_percentiles():
    a = latency_stats([10., 1., 4., 3., 2.], np.random.default_rng(0))
    b = latency_stats([1., 2., 3., 4., 10.], np.random.default_rng(0))
    assert (a['median'], a['p90'], a['p99'], a['mean'], a['cv']) == (b['median'], b['p90'], b['p99'], b['mean'], b['cv'])


@pytest.mark.parametrize('n, n_boot', [(5, 1000), (37, 200), (200, 50)])
def test_bootstrap_follows_the_procedure_exactly(n, n_boot):
    t = np.random.default_rng(n).lognormal(-8, 0.4, n)
    s = latency_stats(t, np.random.default_rng(7), n_boot=n_boot)
    g = np.random.default_rng(7)
    idx = g.integers(0, n, size=(n_boot, n))
    lo, hi = np.percentile(np.median(t[idx], axis=1), [2.5, 97.5])
    assert (s['ci_low'], s['ci_high']) == (float(lo), float(hi))
    assert s['median'] == float(np.percentile(t, 50)) and s['p99'] == float(np.percentile(t, 99))
    assert s['cv'] == float(t.std() / t.mean())


def test_generator_is_used_once_and_results_are_reproducible():
    t = np.random.default_rng(1).lognormal(-7, 0.3, 50)
    g1, g2 = np.random.default_rng(3), np.random.default_rng(3)
    first = latency_stats(t, g1, n_boot=100)
    g2.integers(0, 50, size=(100, 50))
    assert g1.integers(0, 2**62) == g2.integers(0, 2**62)
    assert latency_stats(t, np.random.default_rng(3), n_boot=100) == first


def test_one_sample_and_constant_times():
    assert latency_stats(np.array([0.25]), np.random.default_rng(0)) == dict(
        median=0.25, p90=0.25, p99=0.25, mean=0.25, cv=0.0, ci_low=0.25, ci_high=0.25)
    s = latency_stats(np.full(9, 3e-4), np.random.default_rng(0))
    assert s['cv'] == 0.0 and s['ci_low'] == s['median'] == s['ci_high'] == s['p99'] == pytest.approx(3e-4)
    assert latency_stats(np.zeros(4), np.random.default_rng(0))['cv'] == 0.0   # no division by a zero mean


def test_invariants_on_skewed_data_and_input_unchanged():
    t = np.random.default_rng(2).lognormal(-6, 0.5, 300)
    t[::50] *= 20                                                       # a few disturbed runs
    before = t.copy()
    s = latency_stats(t, np.random.default_rng(0))
    assert s['median'] <= s['p90'] <= s['p99'] <= t.max()
    assert s['ci_low'] <= s['median'] <= s['ci_high'] and s['mean'] > s['median'] and s['cv'] > 0
    assert np.array_equal(t, before)


# --- the timer -------------------------------------------------------------------------------------------

def test_time_fn_keys_warmup_and_threads():
    calls = []
    t = time_fn(lambda: calls.append(1), repeats=7, warmup=3)
    assert len(calls) == 10
    assert set(t) >= KEYS | {'min', 'noisy', 'repeats', 'warmup', 'threads'}
    assert (t['repeats'], t['warmup']) == (7, 3) and type(t['noisy']) is bool and t['noisy'] == (t['cv'] > 0.10)
    assert 0 <= t['min'] <= t['median'] <= t['p90'] <= t['p99'] and t['cv'] >= 0
    assert t['threads'] == thread_info() and t['threads']['numba'] == numba.get_num_threads()


def test_time_fn_records_the_threads_set():
    before = thread_info()['numba']
    try:
        assert set_threads(1)['numba'] == 1
        t = time_fn(lambda: None, repeats=2, warmup=0, rng=np.random.default_rng(1))
        assert t['threads']['numba'] == 1 and t['threads'] == thread_info()
    finally:
        set_threads(before)


def test_time_fn_statistics_are_latency_stats_of_the_timings(monkeypatch):
    ticks = iter(np.cumsum([0, 1000, 0, 3000, 0, 2000, 0, 9000]).tolist())   # perf_counter_ns reads: 1, 3, 2, 9 us
    monkeypatch.setattr(timing.time, 'perf_counter_ns', lambda: next(ticks))
    t = time_fn(lambda: None, repeats=4, warmup=0)
    ref = latency_stats(np.array([1e-6, 3e-6, 2e-6, 9e-6]), np.random.default_rng(0))
    assert {k: t[k] for k in KEYS} == pytest.approx(ref) and t['min'] == pytest.approx(1e-6)


def test_measure_times_counts_and_refuses_bad_counts():
    calls = []
    ts = measure_times(lambda: calls.append(1), repeats=5, warmup=2)
    assert ts.shape == (5,) and len(calls) == 7 and (ts >= 0).all()
    assert len(measure_times(lambda: None, repeats=1, warmup=0)) == 1
    for kw, msg in [(dict(repeats=0), 'at least 1'), (dict(repeats=2.5), 'whole number'), (dict(warmup=-1), 'at least 0'),
                    (dict(repeats=True), 'whole number')]:
        with pytest.raises(TinycompError, match=msg):
            time_fn(lambda: None, **kw)


# --- thread counts ---------------------------------------------------------------------------------------

def test_usable_thread_counts_pass():
    cores = usable_cores()
    assert 1 <= cores <= (os.cpu_count() or cores)
    assert check_threads(1) == 1 and check_threads('1') == 1
    assert check_threads(min(cores, numba.config.NUMBA_NUM_THREADS)) == min(cores, numba.config.NUMBA_NUM_THREADS)


@pytest.mark.parametrize('n', [0, -3, '0', '-3'])
def test_fewer_than_one_thread_is_refused(n):
    with pytest.raises(TinycompError, match=r'at least 1, got -?\d'):
        check_threads(n)
    with pytest.raises(TinycompError, match='at least 1'):
        set_threads(n)


def test_more_threads_than_cores_is_refused_not_clamped():
    cores = usable_cores()
    before = thread_info()
    with pytest.raises(TinycompError, match=f"this machine has {cores} core"):
        set_threads(cores + 1)
    assert thread_info()['numba'] == before['numba'] and thread_info()['blas'] == before['blas']  # nothing changed


def test_more_threads_than_numbas_pool_is_refused(monkeypatch):
    monkeypatch.setattr(timing, 'usable_cores', lambda: 64)
    monkeypatch.setattr(numba.config, 'NUMBA_NUM_THREADS', 2)
    assert check_threads(2) == 2
    with pytest.raises(TinycompError, match='NUMBA_NUM_THREADS is 2'):
        check_threads(3)


@pytest.mark.parametrize('n', ['two', '1.5', None, True, 2.5])
def test_non_numbers_are_refused(n):
    with pytest.raises(TinycompError, match='whole number'):
        check_threads(n)


def test_threads_arg_is_an_argparse_type():
    assert threads_arg('1') == 1
    with pytest.raises(argparse.ArgumentTypeError, match='at least 1'):
        threads_arg('0')
    with pytest.raises(argparse.ArgumentTypeError, match='this machine has'):
        threads_arg(str(usable_cores() + 1))


def test_thread_info_records_counts_and_environment():
    info = thread_info()
    assert info['numba'] >= 1 and info['usable_cores'] == usable_cores()
    assert {'blas', 'torch', 'NUMBA_NUM_THREADS', 'OMP_NUM_THREADS', 'OPENBLAS_NUM_THREADS', 'cpu_count'} <= set(info)
