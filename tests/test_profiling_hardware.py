"Tests for tinycomp.profiling.hardware: the roofline, memory, the largest batch, the hardware profile and `tinycomp profile`."
import csv
import json
import math

import numpy as np
import pytest

from tinycomp.cli import main
from tinycomp.errors import TinycompError
from tinycomp.models import digits_cnn, load_pretrained
from tinycomp.profiling import profile_model, roofline as roofline_from_namespace, time_fn
from tinycomp.profiling.hardware import (attainable_flops, auto_adjust_batch_size, batch_sweep, bound,
                                         build_hardware_profile, estimate_batch_memory_mb, format_table, knee,
                                         largest_batch, peak_memory_mb, ridge_point, roofline,
                                         thread_sweep, write_hardware_profile_artifacts)
from tinycomp.profiling.timing import thread_info, usable_cores
from tinycomp.io import save
from tinycomp.nn import Module

pytestmark = pytest.mark.module03

# the machine figures are passed in by hand wherever a test does not need them measured
PEAK, BW = 100.0, 20.0


# --- the roofline ----------------------------------------------------------------------------------------

def test_attainable_flops_by_hand():
    got = attainable_flops([0.5, 2, 5, 10, 100], PEAK, BW)
    assert isinstance(got, np.ndarray) and got.dtype == np.float64
    np.testing.assert_array_equal(got, [10., 40., 100., 100., 100.])


def test_attainable_flops_scalars_and_broadcasting():
    one = attainable_flops(1, 100, 20)
    assert isinstance(one, np.ndarray) and one.shape == () and one.dtype == np.float64 and float(one) == 20.
    assert float(attainable_flops(np.float32(10), np.float32(50), 20)) == 50.
    np.testing.assert_array_equal(attainable_flops(np.array([[1.], [10.]]), np.array([5., 500.]), 20.),
                                  [[5., 20.], [5., 200.]])
    np.testing.assert_array_equal(attainable_flops([0, 3], 7, 0), [0., 0.])
    # float64 arithmetic: a float32 computation would give 0.1f * 3 = 0.30000001192...
    assert attainable_flops(np.float32(0.25), 100., 3.)[()] == np.float64(np.float32(0.25)) * 3.


def test_ridge_point_and_bound():
    assert ridge_point(PEAK, BW) == 5.
    assert [bound(i, PEAK, BW) for i in (0.01, 4.999, 5., 5.001, 1e6)] == ['memory', 'memory', 'compute', 'compute', 'compute']


def test_roofline_places_and_labels_hand_rows(tmp_path):
    rows = [dict(name='0', type='Conv2d', flops=2e6, bytes_moved=1e5, latency_ms=0.1),
            dict(name='1', type='ReLU', flops=1e4, bytes_moved=8e4, latency_ms=0.01),
            dict(name='2', type='Flatten', flops=0, bytes_moved=0, latency_ms=0.001)]
    r = roofline(rows, peak=PEAK, bandwidth=BW, path=tmp_path / 'sub' / 'roof.png')
    assert (tmp_path / 'sub' / 'roof.png').stat().st_size > 1000
    assert [p['bound'] for p in r['rows']] == ['compute', 'memory', None]
    assert r['rows'][0]['intensity'] == 20. and r['rows'][0]['achieved_gflops'] == pytest.approx(20.)
    assert r['rows'][1]['attainable_gflops'] == pytest.approx(0.125 * BW)
    ax = r['figure'].axes[0]
    assert ax.get_xscale() == ax.get_yscale() == 'log'
    assert 'FLOP/byte' in ax.get_xlabel() and 'GFLOP/s' in ax.get_ylabel()
    assert {t.get_text() for t in ax.texts} == {'0 Conv2d', '1 ReLU'}
    import matplotlib.pyplot as plt
    plt.close(r['figure'])


def test_roofline_on_a_real_profile():
    x = np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)
    prof = profile_model(digits_cnn(), x, repeats=2)
    r = roofline_from_namespace(prof, peak=PEAK, bandwidth=BW)
    assert [p['name'] for p in r['rows']] == [row['name'] for row in prof.rows]
    assert all(p['bound'] in ('compute', 'memory') for p in r['rows'] if p['flops'] > 0)
    import matplotlib.pyplot as plt
    plt.close(r['figure'])


def test_format_table():
    assert format_table([dict(a='x', b=1.5), dict(a='yy', b=None)], [('a', 'n', ''), ('b', 'v', '.1f')]).splitlines() == \
        ['n     v', 'x   1.5', 'yy    -']


# --- memory ----------------------------------------------------------------------------------------------

class Alloc(Module):
    "Allocates `n` float64 numbers in its forward pass and returns them."
    def __init__(self, n): super().__init__(); self.n = n
    def forward(self, x): return np.ones(self.n)


def test_peak_memory_sees_a_known_allocation():
    assert peak_memory_mb(Alloc(1_000_000), np.zeros(1)) == pytest.approx(8.0, rel=0.01)
    assert peak_memory_mb(Alloc(10), np.zeros(1)) < 0.01


def test_peak_memory_grows_with_the_batch():
    model = load_pretrained('digits_cnn')
    small, large = (peak_memory_mb(model, np.zeros((b, 1, 8, 8), np.float32)) for b in (4, 256))
    assert large > 10 * small > 0
    assert estimate_batch_memory_mb(model, 32, probes=(4, 32)) == pytest.approx(
        peak_memory_mb(model, np.zeros((32, 1, 8, 8), np.float32)), rel=0.05)


def counted(fn):
    calls = []
    def memory_of(b):
        calls.append(b)
        return fn(b)
    return memory_of, calls


@pytest.mark.parametrize('fn, budget, max_batch, expected', [
    (lambda b: 10 + 3 * b, 100, 4096, 30),
    (lambda b: 10 + 3 * b, 99, 4096, 29),
    (lambda b: 10 + 3 * b, 13, 4096, 1),
    (lambda b: 10 + 3 * b, 10 ** 9, 4096, 4096),
    (lambda b: b, 4095, 4096, 4095),
    (lambda b: b, 5, 1, 1),
    (lambda b: b, 5, 2, 2),
    (lambda b: 0 if b <= 777 else 1, 0, 1000, 777),
    (lambda b: math.floor(math.log2(b)), 3, 100, 15),        # steps: many equal values
    (lambda b: 2.5 * b, 7.5, 3000, 3),                       # float memory, exactly on the budget
])
def test_largest_batch_exact_and_logarithmic(fn, budget, max_batch, expected):
    memory_of, calls = counted(fn)
    got = largest_batch(memory_of, budget, max_batch=max_batch)
    assert got == expected and isinstance(got, (int, np.integer))
    assert len(calls) <= 2 * math.ceil(math.log2(max_batch)) + 2, calls
    assert all(1 <= b <= max_batch for b in calls)


def test_largest_batch_default_max_batch():
    memory_of, calls = counted(lambda b: 0)
    assert largest_batch(memory_of, 1) == 4096 and len(calls) <= 2 * 12 + 2


def test_largest_batch_error_when_batch_one_does_not_fit():
    memory_of, calls = counted(lambda b: 13 + b)
    with pytest.raises(TinycompError) as e:
        largest_batch(memory_of, 12.5)
    assert '14' in str(e.value) and '12.5' in str(e.value) and 'batch of 1' in str(e.value)


@pytest.mark.slow
def test_auto_adjust_batch_size_by_measurement():
    model = load_pretrained('digits_cnn')
    b = auto_adjust_batch_size(model, 1.0, max_batch=512)
    mem = lambda n: peak_memory_mb(model, np.random.default_rng(0).standard_normal((n, 1, 8, 8)).astype(np.float32))
    assert 1 <= b < 512 and mem(b) <= 1.0 < mem(b + 1)
    with pytest.raises(TinycompError, match='batch of 1 needs .* MB'):
        auto_adjust_batch_size(model, 1e-6)


# --- sweeps ----------------------------------------------------------------------------------------------

def test_knee():
    assert knee([1, 2, 4, 8], [10, 50, 95, 100]) == 4
    assert knee([1, 2, 4, 8], [10, 50, 89, 100]) == 8
    assert knee([1, 2, 4], [100, 50, 20]) == 1


def test_batch_sweep_rows():
    model = load_pretrained('digits_cnn')
    s = batch_sweep(model, np.zeros((3, 1, 8, 8), np.float32), (1, 4, 16), repeats=2)
    assert [r['batch'] for r in s['rows']] == [1, 4, 16] and s['knee'] in (1, 4, 16)
    for r in s['rows']:
        assert r['throughput'] == pytest.approx(r['batch'] / (r['latency_ms'] / 1e3))
        assert r['per_sample_us'] == pytest.approx(r['latency_ms'] * 1e3 / r['batch'])


def test_thread_sweep_records_and_restores_threads():
    before = thread_info()['numba']
    s = thread_sweep(load_pretrained('digits_cnn'), np.zeros((4, 1, 8, 8), np.float32), repeats=2)
    assert [r['threads'] for r in s['rows']] == list(range(1, usable_cores() + 1))
    assert all(r['numba'] == r['threads'] for r in s['rows']) and s['rows'][0]['speedup'] == 1.
    assert all(r['efficiency'] == pytest.approx(r['speedup'] / r['threads']) for r in s['rows'])
    assert thread_info()['numba'] == before == s['after']['numba']


# --- the hardware profile --------------------------------------------------------------------------------

def test_hardware_profile_keys_and_csv_files(tmp_path):
    model = load_pretrained('digits_cnn')
    hp = build_hardware_profile(model, 8, stream_interval_ms=5, repeats=3, peak=PEAK, bandwidth=BW, sweep_batches=(1, 4))
    assert set(hp) == {'operator_profile', 'totals', 'precision_tradeoffs', 'edge_constraints'}
    ops = hp['operator_profile']
    assert len(ops) == 7 and all(set(o) == {'operator', 'latency_ms', 'memory_kb'} for o in ops)
    t = hp['totals']
    assert {'latency_ms', 'memory_kb', 'estimated_bandwidth_mb_s', 'stream_utilization'} <= set(t)
    assert t['stream_utilization'] == pytest.approx(t['latency_ms'] / 5)
    assert t['estimated_bandwidth_mb_s'] == pytest.approx(t['bytes_moved'] / (t['latency_ms'] / 1e3) / 1e6)
    p = hp['precision_tradeoffs']
    assert p['fp32']['weight_kb'] == pytest.approx(9930 * 4 / 1e3) and p['fp16']['weight_kb'] == pytest.approx(9930 * 2 / 1e3)
    assert p['int8']['weight_kb'] < p['fp16']['weight_kb'] and 'measured' in p['note']
    e = hp['edge_constraints']
    assert e['bottleneck']['bound'] in ('compute', 'memory') and e['bottleneck']['operator'] in [o['operator'] for o in ops]
    assert e['cache_sensitivity'] >= 1 and [r['batch'] for r in e['batch_sweep']] == [1, 4]
    json.dumps(hp)  # plain data
    assert build_hardware_profile(model, 2, repeats=2, peak=PEAK, bandwidth=BW, sweep_batches=(1, 2))['totals']['stream_utilization'] is None
    paths = write_hardware_profile_artifacts(hp, tmp_path / 'out')
    assert sorted(p.name for p in paths) == ['hardware_totals.csv', 'operator_profile.csv']
    with open(tmp_path / 'out' / 'operator_profile.csv') as f: rows = list(csv.DictReader(f))
    assert [r['operator'] for r in rows] == [o['operator'] for o in ops] and list(rows[0]) == ['operator', 'latency_ms', 'memory_kb']
    with open(tmp_path / 'out' / 'hardware_totals.csv') as f: totals = {r['metric']: r['value'] for r in csv.DictReader(f)}
    assert float(totals['latency_ms']) == pytest.approx(t['latency_ms'])
    assert not [p for p in (tmp_path / 'out').iterdir() if p.name.startswith('.')]  # no temporary files left
    with pytest.raises(TinycompError, match='at least 1'): build_hardware_profile(model, 0)


# --- the command line ------------------------------------------------------------------------------------

@pytest.mark.slow
def test_profile_command_end_to_end(writes_only, capsys):
    out = writes_only.cwd / 'tinycomp_profile'                                      # the default --out
    assert main(['profile', '--batch', '8', '--repeats', '3', '--trace', '--roofline']) == 0
    printed = capsys.readouterr().out
    assert 'Conv2d' in printed and 'total:' in printed and 'bottleneck' in printed
    assert len(writes_only.check(printed, 'tinycomp_profile')) == 4                 # nothing else, every path printed
    assert sorted(p.name for p in out.iterdir()) == ['hardware_totals.csv', 'operator_profile.csv', 'roofline.png', 'trace.json']
    trace = json.loads((out / 'trace.json').read_text())
    assert len(trace['traceEvents']) == 1 + 7


def test_profile_command_sweeps_and_model_files(tmp_path, capsys):
    path = save(load_pretrained('digits_cnn_wide'), tmp_path / 'wide.npz')
    before = thread_info()['numba']
    assert main(['profile', str(path), '--batch', '2', '--repeats', '2', '--out', str(tmp_path / 'a'), '--sweep', 'threads',
                 '--threads', '1']) == 0
    assert thread_info()['numba'] == before
    printed = capsys.readouterr().out
    assert (tmp_path / 'a' / 'thread_sweep.png').exists() and 'BatchNorm2d' in printed and str(tmp_path / 'a' / 'thread_sweep.png') in printed
    assert main(['profile', 'digits_cnn', '--batch', '2', '--repeats', '2', '--out', str(tmp_path / 'b'), '--sweep', 'batch']) == 0
    assert (tmp_path / 'b' / 'batch_sweep.png').exists() and 'knee' in capsys.readouterr().out


def test_resolve_model(tmp_path):
    from tinycomp.models import resolve_model
    assert type(resolve_model('digits_cnn')).__name__ == 'Sequential'
    with pytest.raises(TinycompError, match='neither a shipped model'): resolve_model('nope')


def _bad_cases(tmp_path):
    garbage = tmp_path / 'garbage.npz'
    garbage.write_bytes(b'not a zip file at all')
    text = tmp_path / 'notes.txt'
    text.write_text('hello')
    a_file = tmp_path / 'file'
    a_file.write_text('')
    return [
        (['no_such_model'], 'neither a shipped model'),
        ([str(garbage)], 'garbage.npz'),
        ([str(text)], 'notes.txt'),
        ([str(tmp_path)], 'is a directory'),
        (['--out', str(a_file)], 'not a directory'),
        (['--batch', '0'], 'at least 1'),
        (['--batch', 'x'], 'whole number'),
        (['--repeats', '0'], 'at least 1'),
        (['--threads', str(usable_cores() + 1)], 'this machine has'),
        (['--threads', '0'], 'at least 1'),
        (['--sweep', 'epochs'], 'invalid choice'),
        (['--shape', '1,0,8'], 'positive whole numbers'),
        (['--shape', '3,32,32'], 'does not accept inputs'),
    ]


def test_profile_command_bad_input_is_one_line(tmp_path, capsys):
    for args, message in _bad_cases(tmp_path):
        assert main(['profile', *args, '--repeats', '2', '--out', str(tmp_path / 'o')] if args[0] not in ('--repeats', '--out') else
                    ['profile', *args]) == 2, args
        err = capsys.readouterr().err
        assert 'Traceback' not in err and message in err, (args, err)
        errors = [line for line in err.strip().splitlines() if 'error' in line]
        assert len(errors) == 1, (args, err)
        if err.startswith('tinycomp: error:'): assert len(err.strip().splitlines()) == 1, err


def test_one_timer():
    from tinycomp.profiling import hardware
    assert hardware.time_fn is time_fn


def test_profile_output_is_git_ignored():
    from pathlib import Path
    import subprocess
    repo = Path(__file__).resolve().parents[1]
    assert 'tinycomp_*/' in (repo / '.gitignore').read_text().splitlines()
    if (repo / '.git').exists():
        assert subprocess.run(['git', 'check-ignore', '-q', 'tinycomp_profile/operator_profile.csv'], cwd=repo).returncode == 0


def test_variant_table():
    "Measured variants against the first row: Δacc in points, file ratio, speedup = baseline / this latency."
    from tinycomp.profiling.hardware import variant_table
    lat = lambda ms, noisy=False: {1: dict(median=ms * 1e-3, noisy=noisy), 64: dict(median=10 * ms * 1e-3, noisy=False)}
    rows = [dict(name='float32', accuracy=0.99, weights=100, file_bytes=400, latency=lat(2.0)),
            dict(name='int8', accuracy=0.985, weights=100, file_bytes=100, latency=lat(0.5, noisy=True))]
    text = variant_table(rows, 'title', note='a note')
    lines = text.splitlines()
    assert lines[0] == 'title' and 'x float32' in lines[1] and lines[-1].endswith('; a note')
    assert lines[3].split() == ['int8', '98.50%', '-0.50', '100', '100', '0.25', '0.500*', '4.00', '5.000', '4.00']
