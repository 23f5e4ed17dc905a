"Tests for tinycomp.bench: timing statistics, the conv benchmark's structure and JSON, and the CLI wiring."
import argparse
import json

from tinycomp.bench import add_cli, conv_benchmark, thread_info, time_fn


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


def test_cli_registers_bench_conv():
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_cli(parser.add_subparsers(dest='command'))
    args = parser.parse_args(['bench', 'conv', '--threads', '2', '--json', 'out.json', '--repeats', '5', '--no-torch'])
    assert (args.threads, args.json, args.repeats, args.no_torch) == (2, 'out.json', 5, True) and callable(args.func)
