"Tests for tinycomp.bench: timing statistics, the conv benchmark's structure and JSON, thread counts, and the CLI wiring."
import argparse
import json

import numba
import pytest

import tinycomp.bench as bench
from tinycomp.bench import (add_cli, check_threads, conv_benchmark, set_threads, thread_info, threads_arg, time_fn,
                            usable_cores)
from tinycomp.errors import TinycompError


def test_time_fn_statistics():
    calls = []
    t = time_fn(lambda: calls.append(1), repeats=7, warmup=3)
    assert len(calls) == 10 and t['repeats'] == 7
    assert 0 <= t['min'] <= t['median'] <= t['p90'] and t['cv'] >= 0 and isinstance(t['noisy'], bool)


def test_conv_benchmark_small_shapes_and_json(tmp_path, capsys):
    path = tmp_path / 'conv.json'
    res = conv_benchmark(threads=1, json_path=str(path), repeats=2, shapes=[(2, 1, 5, 5, 4), (2, 4, 6, 6, 8)], use_torch=False)
    out = capsys.readouterr().out
    assert 'GFLOP/s' in out and '(2,1,5,5->4)' in out and '(2,4,6,6->8)' in out
    saved = json.loads(path.read_text())
    assert saved['meta']['threads']['numba'] == 1 and saved['meta']['repeats'] == 2
    small, big = saved['rows']
    assert set(small['timings']) == {'naive', 'numpy_im2col', 'tinycomp_fwd', 'tinycomp_bwd'}
    assert 'naive' not in big['timings']
    assert big['gflop'] == 2 * 2 * 8 * 36 * 4 * 9 / 1e9
    assert all(v['gflops'] > 0 for v in big['timings'].values()) and res['rows'][1]['bwd_over_fwd'] > 0
    assert 'NUMBA_NUM_THREADS' in thread_info()


def test_cli_registers_bench_conv_and_train():
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_cli(parser.add_subparsers(dest='command'))
    args = parser.parse_args(['bench', 'conv', '--threads', '1', '--json', 'out.json', '--repeats', '5', '--no-torch'])
    assert (args.threads, args.json, args.repeats, args.no_torch) == (1, 'out.json', 5, True) and callable(args.func)
    args = parser.parse_args(['bench', 'train', '--epochs', '2', '--runs', '1'])
    assert (args.epochs, args.runs, args.threads) == (2, 1, None) and callable(args.func)


# --- thread counts ---------------------------------------------------------------------------------------

def test_usable_thread_counts_pass():
    cores = usable_cores()
    assert 1 <= cores <= (__import__('os').cpu_count() or cores)
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
    monkeypatch.setattr(bench, 'usable_cores', lambda: 64)
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


@pytest.mark.parametrize('argv', [['bench', 'conv', '--repeats', '0'], ['bench', 'train', '--epochs', '0'],
                                  ['bench', 'train', '--runs', '-1']])
def test_counts_below_one_are_argparse_errors(argv, capsys):
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_cli(parser.add_subparsers(dest='command'))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and 'at least 1' in capsys.readouterr().err
