"Tests for tinycomp.bench: the conv benchmark's structure and JSON and the CLI wiring (the timer and thread counts: test_profiling_timing.py)."
import argparse
import json

import pytest

from tinycomp.bench import add_cli, conv_benchmark


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
    assert 'NUMBA_NUM_THREADS' in saved['meta']['threads']
    assert all(k in v for v in big['timings'].values() for k in ('median', 'p99', 'ci_low', 'ci_high', 'threads'))


def test_cli_registers_bench_conv_and_train():
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_cli(parser.add_subparsers(dest='command'))
    args = parser.parse_args(['bench', 'conv', '--threads', '1', '--json', 'out.json', '--repeats', '5', '--no-torch'])
    assert (args.threads, args.json, args.repeats, args.no_torch) == (1, 'out.json', 5, True) and callable(args.func)
    args = parser.parse_args(['bench', 'train', '--epochs', '2', '--runs', '1'])
    assert (args.epochs, args.runs, args.threads) == (2, 1, None) and callable(args.func)


@pytest.mark.parametrize('argv', [['bench', 'conv', '--repeats', '0'], ['bench', 'train', '--epochs', '0'],
                                  ['bench', 'train', '--runs', '-1']])
def test_counts_below_one_are_argparse_errors(argv, capsys):
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_cli(parser.add_subparsers(dest='command'))
    with pytest.raises(SystemExit) as e:
        parser.parse_args(argv)
    assert e.value.code == 2 and 'at least 1' in capsys.readouterr().err
