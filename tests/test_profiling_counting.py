"Tests for tinycomp.profiling.counting: FLOP and shape counting against loops and real layers, the per-layer profile, traces."

import csv
import json
import math

import numpy as np
import pytest

from tinycomp.batchnorm import BatchNorm2d
from tinycomp.conv import Conv2d, conv_output_size
from tinycomp.errors import TinycompError
from tinycomp.graph import Function, trace
from tinycomp.models import digits_cnn, digits_cnn_wide
from tinycomp.nn.modules import Add, Cat, Dropout, Flatten, Linear, Module, ReLU, ReLU6, Sequential, Sigmoid, Tanh
from tinycomp.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from tinycomp.profiling.counting import (PROFILE_COLUMNS, Profile, activation_bytes, conv2d_flops, layer_cost,
                                         output_shape, profile_model, trace_events)
from tinycomp.tensor import Tensor, as_tensor
from tinycomp.tensor import no_grad

from graph_models import BranchyNet, trained_like

pytestmark = pytest.mark.module03


def pair(v): return (v, v) if isinstance(v, int) else tuple(v)

def flops_by_loops(in_shape, cout, k, s, p, d, groups, bias):
    "Walk every output position, output channel and kernel tap (padded zeros included), 2 per multiply-add."
    n, cin, h, w = in_shape
    (kh, kw), (sh, sw), (ph, pw), (dh, dw) = pair(k), pair(s), pair(p), pair(d)
    count = 0
    for _ in range(n):
        for y in range(0, h + 2 * ph - dh * (kh - 1), sh):
            for x in range(0, w + 2 * pw - dw * (kw - 1), sw):
                for _co in range(cout):
                    for _c in range(cin // groups):
                        for i in range(kh):
                            for j in range(kw):
                                assert 0 <= y + i * dh < h + 2 * ph and 0 <= x + j * dw < w + 2 * pw
                                count += 2
                    count += bool(bias)
    return count

CONV_CASES = [((1, 1, 5, 5), 1, 3, 1, 0, 1, 1, True),
              ((2, 3, 8, 8), 4, 3, 1, 1, 1, 1, False),
              ((1, 4, 9, 7), 6, (3, 2), (2, 1), (1, 0), (2, 1), 2, True),      # groups 2, Cout != groups
              ((2, 6, 10, 11), 6, 3, 2, 2, 2, 6, False),                        # depthwise, stride with padding, dilation
              ((1, 8, 5, 5), 4, 1, 1, 0, 1, 4, True),                          # 1x1 grouped
              ((1, 2, 7, 6), 4, (2, 3), 3, (1, 1), (3, 2), 1, True)]


@pytest.mark.parametrize('case', CONV_CASES)
def test_conv2d_flops_matches_loops(case):
    got = conv2d_flops(*case)
    assert type(got) is int and got == flops_by_loops(*case)


def test_conv2d_flops_keywords_and_bias():
    with_bias = conv2d_flops((2, 3, 8, 8), 4, 3, stride=2, padding=1, dilation=1, groups=1, bias=True)
    no_bias = conv2d_flops((2, 3, 8, 8), 4, 3, stride=2, padding=1, bias=False)
    assert with_bias - no_bias == 2 * 4 * 4 * 4 and no_bias == 2 * 2 * 4 * 16 * 27


def random_layer(rng):
    "A random supported leaf layer and an input shape it accepts."
    kind = rng.integers(12)
    n, c, h, w = int(rng.integers(1, 3)), int(rng.integers(1, 4)) * 2, int(rng.integers(6, 11)), int(rng.integers(6, 11))
    if kind == 0:
        g = int(rng.choice([1, 2]))
        k, s, d = (int(rng.integers(1, 4)), int(rng.integers(1, 3))), (int(rng.integers(1, 3)), 1), (1, int(rng.integers(1, 3)))
        return Conv2d(c, 2 * g, k, stride=s, padding=(int(rng.integers(0, 2)), 0), dilation=d, groups=g,
                      bias=bool(rng.integers(2))), (n, c, h, w)
    if kind == 1:
        k = int(rng.integers(2, 4))
        return MaxPool2d(k, stride=None if rng.integers(2) else int(rng.integers(1, 3)), padding=int(rng.integers(0, k // 2 + 1)),
                         dilation=int(rng.integers(1, 3))), (n, c, h, w)
    if kind == 2:
        k = (int(rng.integers(2, 4)), int(rng.integers(1, 3)))
        return AvgPool2d(k, stride=None if rng.integers(2) else (2, 1), padding=(int(rng.integers(0, k[0] // 2 + 1)), 0)), (n, c, h, w)
    if kind == 3: return AdaptiveAvgPool2d((int(rng.integers(1, 4)), int(rng.integers(1, 4)))), (n, c, h, w)
    if kind == 4: return BatchNorm2d(c), (n, c, h, w)
    if kind == 5: return Linear(w, int(rng.integers(1, 6)), bias=bool(rng.integers(2))), (n, c, w)
    if kind == 6: return Flatten(int(rng.integers(1, 4))), (n, c, h, w)
    if kind == 7: return Flatten(), (n, c, h)
    return [ReLU(), Sigmoid(), Tanh(), Dropout(0.5)][kind - 8], (n, c, h, w)


@pytest.mark.parametrize('seed', range(60))
def test_output_shape_matches_forward(seed):
    rng = np.random.default_rng(seed)
    m, shape = random_layer(rng)
    m.eval()
    x = rng.standard_normal(shape).astype(np.float32)
    with no_grad(): y = m(x)
    assert output_shape(m, shape) == tuple(y.shape)
    assert all(type(v) is int for v in output_shape(m, shape))
    assert activation_bytes(m, shape) == y.data.size * 4 and activation_bytes(m, shape, itemsize=1) == y.data.size


def test_every_layer_type_covered():
    seen = {type(random_layer(np.random.default_rng(s))[0]) for s in range(200)}
    assert seen >= {Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, BatchNorm2d, Linear, Flatten, ReLU, Sigmoid, Tanh, Dropout}


def test_output_shape_unknown_type():
    class Odd(Module):
        def forward(self, x): return x
    with pytest.raises(TinycompError, match='Odd'): output_shape(Odd(), (1, 2))
    with pytest.raises(TinycompError, match='Sequential'): layer_cost(Sequential(ReLU()), (1, 2))


def test_layer_cost_linear_by_hand():
    c = layer_cost(Linear(20, 7), (3, 5, 20))
    rows = 15
    assert c['flops'] == 2 * rows * 20 * 7 + rows * 7
    assert c['params'] == 147 and c['weight_bytes'] == 147 * 4
    assert c['input_bytes'] == rows * 20 * 4 and c['activation_bytes'] == rows * 7 * 4
    assert c['bytes_moved'] == (rows * 20 + 147 + rows * 7) * 4
    assert c['intensity'] == pytest.approx(c['flops'] / c['bytes_moved'])
    assert layer_cost(Linear(20, 7, bias=False), (4, 20))['flops'] == 2 * 4 * 20 * 7


def test_layer_cost_conv_by_hand():
    m = Conv2d(4, 6, 3, stride=2, padding=1, groups=2)
    c = layer_cost(m, (2, 4, 9, 9))
    oh = conv_output_size(9, 3, 2, 1)
    assert (oh, c['output_shape']) == (5, (2, 6, 5, 5))
    assert c['flops'] == 2 * 2 * 6 * 25 * 2 * 9 + 2 * 6 * 25
    assert c['params'] == 6 * 2 * 9 + 6 and c['weight_bytes'] == 4 * c['params']
    assert c['bytes_moved'] == 4 * (2 * 4 * 81) + c['weight_bytes'] + 4 * (2 * 6 * 25)
    assert c['intensity'] == pytest.approx(c['flops'] / c['bytes_moved'])


def test_layer_cost_other_layers():
    assert layer_cost(MaxPool2d(2), (1, 3, 8, 8))['flops'] == 3 * 16 * 4
    assert layer_cost(BatchNorm2d(3), (2, 3, 4, 4))['flops'] == 4 * 96
    assert layer_cost(BatchNorm2d(3, affine=False), (2, 3, 4, 4))['flops'] == 2 * 96
    assert layer_cost(ReLU(), (2, 3, 4, 4))['flops'] == 96 and layer_cost(Flatten(), (2, 3, 4, 4))['flops'] == 0
    c = layer_cost(ReLU6(), (2, 3, 4, 4))
    assert (c['output_shape'], c['flops'], c['params'], c['activation_bytes']) == ((2, 3, 4, 4), 2 * 96, 0, 4 * 96)
    assert layer_cost(AdaptiveAvgPool2d(1), (2, 3, 5, 5))['flops'] == 2 * 3 * 25
    assert layer_cost(AdaptiveAvgPool2d(2), (1, 1, 5, 5))['flops'] == 6 * 6     # overlapping bins of 3 rows/cols


def run_model(model, x):
    model.eval()
    with no_grad(): return model(x)


@pytest.fixture(scope='module')
def x_digits():
    return np.random.default_rng(0).standard_normal((8, 1, 8, 8)).astype(np.float32)


@pytest.mark.parametrize('make', [digits_cnn, digits_cnn_wide])
def test_profile_rows_cover_every_leaf(make, x_digits):
    model = make()
    p = profile_model(model, x_digits, repeats=3, warmup=1)
    leaves = [(n, m) for n, m in model.named_modules() if not m._modules]
    assert [r['name'] for r in p.rows] == [n for n, _ in leaves]
    assert [r['type'] for r in p.rows] == [type(m).__name__ for _, m in leaves]
    assert all(r['latency_ms'] > 0 and r['duration_s'] > 0 for r in p.rows)
    assert set(p.rows[0]) == set(PROFILE_COLUMNS)
    shapes, expected, h = [], 0, x_digits.shape
    for _, m in leaves:
        c = layer_cost(m, h); expected += c['flops']; h = c['output_shape']; shapes.append(h)
    assert p.flops == expected and [r['output_shape'] for r in p.rows] == shapes
    assert p.rows[-1]['output_shape'] == tuple(run_model(make(), x_digits).shape)
    assert p.total_ms == pytest.approx(sum(r['latency_ms'] for r in p.rows))
    assert p.model_ms > 0 and p.hooked_ms > 0 and p.overhead == pytest.approx(p.hooked_ms / p.model_ms - 1)
    assert sum(r['share'] for r in p.rows) == pytest.approx(1.0)
    assert 'Conv2d' in repr(p) and 'overhead' in p.table()


def test_profile_leaves_no_hooks_and_restores_training(x_digits):
    model = digits_cnn_wide()
    model.train(); model[0].eval()
    before = [m.training for m in model.modules()]
    running = model[1].running_mean.copy()
    profile_model(model, x_digits, repeats=2, warmup=0)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())
    assert [m.training for m in model.modules()] == before
    np.testing.assert_array_equal(model[1].running_mean, running)       # eval mode: BatchNorm statistics untouched


def test_profile_removes_hooks_on_error():
    class Boom(Module):
        def forward(self, x): raise RuntimeError('boom')
    model = Sequential(ReLU(), Boom())
    with pytest.raises(RuntimeError): profile_model(model, np.ones((1, 2), np.float32), repeats=2)
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_profile_nested_and_unknown_layers(x_digits):
    class Scale(Module):
        def forward(self, x): return x * 2.0
    model = Sequential(Sequential(Conv2d(1, 4, 3, padding=1), Scale()), Flatten(), Sequential(Linear(256, 10)))
    p = profile_model(model, x_digits, repeats=2, warmup=1)
    assert [r['name'] for r in p.rows] == ['0.0', '0.1', '1', '2.0']
    assert p.uncounted == ['Scale'] and p.rows[1]['flops'] == 0 and p.rows[1]['output_shape'] == (8, 4, 8, 8)
    with pytest.raises(TinycompError): profile_model(model, x_digits, repeats=0)


def test_csv_and_trace(tmp_path, x_digits):
    p = profile_model(digits_cnn(), x_digits, repeats=3, warmup=1)
    path = p.write_csv(tmp_path / 'sub' / 'profile.csv')
    rows = list(csv.DictReader(path.open()))
    assert list(rows[0]) == PROFILE_COLUMNS and len(rows) == len(p.rows) and rows[0]['output_shape'] == '8x16x8x8'
    doc = json.loads(p.to_chrome_trace(tmp_path / 'trace.json').read_text())
    assert set(doc) == {'traceEvents', 'displayTimeUnit'} and doc['displayTimeUnit'] == 'ms'
    events = doc['traceEvents']
    assert len(events) == len(p.rows) + 1
    for e in events:
        assert {'name', 'ph', 'ts', 'dur', 'pid', 'tid', 'args'} <= set(e) and e['ph'] == 'X' and e['dur'] >= 0
    model_ev, layer_ev = events[0], events[1:]
    assert model_ev['name'] == 'Sequential' and model_ev['args']['flops'] == p.flops
    for e, r in zip(layer_ev, p.rows):
        assert model_ev['ts'] <= e['ts'] and e['ts'] + e['dur'] <= model_ev['ts'] + model_ev['dur']
        assert e['name'] == r['name'] and e['args'] == {'flops': r['flops'], 'output_shape': list(r['output_shape'])}
    assert not list(tmp_path.glob('.*.tmp'))                               # atomic writes leave no temporary file


def test_trace_events_exact():
    rows = [dict(name='a', start_s=0.5e-6, duration_s=3e-6, flops=np.int64(12), output_shape=(2, 3), extra=1),
            dict(name='b', start_s=4e-6, duration_s=0.0, flops=0, output_shape=[5])]
    ev = trace_events(rows, pid=7, tid=2)
    assert ev == [{'name': 'a', 'ph': 'X', 'ts': 0.5, 'dur': 3.0, 'pid': 7, 'tid': 2, 'args': {'flops': 12, 'output_shape': [2, 3]}},
                  {'name': 'b', 'ph': 'X', 'ts': 4.0, 'dur': 0.0, 'pid': 7, 'tid': 2, 'args': {'flops': 0, 'output_shape': [5]}}]
    assert type(ev[0]['args']['flops']) is int and json.dumps(ev)
    assert trace_events([]) == []


def test_profile_class_from_rows():
    rows = [dict(name='0', type='ReLU', output_shape=(1, 2), params=0, flops=2, weight_bytes=0, activation_bytes=8,
                 bytes_moved=16, latency_ms=1.0, share=0.25, gflops=0.0, intensity=0.125, start_s=0.0, duration_s=1e-3),
            dict(name='1', type='ReLU', output_shape=(1, 2), params=0, flops=2, weight_bytes=0, activation_bytes=8,
                 bytes_moved=16, latency_ms=3.0, share=0.75, gflops=0.0, intensity=0.125, start_s=1e-3, duration_s=3e-3)]
    p = Profile(rows, model_ms=5.0, hooked_ms=5.5)
    assert p.total_ms == 4.0 and p.coverage == pytest.approx(0.8) and p.overhead == pytest.approx(0.1) and p.flops == 4
    assert math.isclose(sum(r['share'] for r in p.rows), 1.0)


def test_a_layer_can_describe_its_own_cost(x_digits):
    "Layers the rules do not know (quantized, sparse) define cost(in_shape); the profiler passes real item sizes."
    class Halve(Module):                                   # int8 in, int8 out, one op per value
        def forward(self, x): return Tensor(as_tensor(x).data[..., ::2].astype(np.int8))
        def cost(self, in_shape):
            return dict(output_shape=in_shape[:-1] + (in_shape[-1] // 2,), flops=math.prod(in_shape), params=7,
                        output_itemsize=1)
    c = layer_cost(Halve(), (2, 3, 8), itemsize=1)
    assert (c['output_shape'], c['flops'], c['params']) == ((2, 3, 4), 48, 7)
    assert (c['input_bytes'], c['activation_bytes']) == (48, 24)
    x8 = np.zeros((4, 1, 8, 8), np.int8)
    p = profile_model(Sequential(Halve(), Flatten()), x8, repeats=2)
    assert p.uncounted == [] and [r['flops'] for r in p.rows] == [256, 0]
    assert [r['activation_bytes'] for r in p.rows] == [128, 128]        # Flatten of int8 data: 1 byte per value


def test_branches_meeting_are_counted_and_a_graph_profiles_like_its_model(tmp_path, x_digits):
    "Residual add, concatenation and the tensor ops between layers each get a row; blocks show in the trace."
    net = trained_like(BranchyNet())
    p = profile_model(net, x_digits, repeats=2, warmup=1)
    rows = {r['name']: r for r in p.rows}
    assert [r['name'] for r in p.rows] == [n.name for n in trace(net, x_digits)]
    n = len(x_digits)
    assert (rows['block.add']['type'], rows['block.add']['flops'], rows['block.add']['params']) == ('Add', n * 8 * 64, 0)
    assert rows['block.add']['bytes_moved'] == 3 * n * 8 * 64 * 4
    assert (rows['cat']['type'], rows['cat']['flops'], rows['cat']['output_shape']) == ('Cat', 0, (n, 16, 8, 8))
    assert (rows['mul']['type'], rows['mul']['flops']) == ('mul', n * 8 * 64) and rows['sum']['flops'] == n * 4 * 64
    assert p.uncounted == [] and p.params == sum(q.data.size for q in net.parameters())
    again = profile_model(trace(net, x_digits), x_digits, repeats=2, warmup=1)
    assert [(r['name'], r['flops'], r['output_shape']) for r in again.rows] == [(r['name'], r['flops'], r['output_shape']) for r in p.rows]
    events = json.loads(p.to_chrome_trace(tmp_path / 't.json').read_text())['traceEvents']
    block = next(e for e in events if e['name'] == 'block')
    inside = [e for e in events if e['name'].startswith('block.')]
    assert len(inside) == 7 and block['args']['flops'] == sum(rows[e['name']]['flops'] for e in inside)
    assert all(block['ts'] <= e['ts'] and e['ts'] + e['dur'] <= block['ts'] + block['dur'] + 1e-6 for e in inside)
    assert layer_cost(Add(), [(2, 3, 4, 4), (2, 3, 4, 4)])['flops'] == 96
    assert layer_cost(Cat(), [(2, 3, 4, 4), (2, 5, 4, 4)])['output_shape'] == (2, 8, 4, 4)
    softmax = layer_cost(Function('softmax', {'axis': -1}), (4, 10))
    assert (softmax['output_shape'], softmax['flops']) == ((4, 10), 160)
    flat = layer_cost(Function('reshape', {'shape': (4, -1)}, batch_shape=True), (10 ** 6, 3, 8, 8))
    assert (flat['output_shape'], flat['flops']) == ((10 ** 6, 192), 0)       # shapes only: nothing that large is made


def test_a_layer_called_twice_has_its_parameters_counted_once(x_digits):
    class Twice(Module):
        def __init__(self):
            super().__init__()
            self.fc = Linear(4, 4)
        def forward(self, x): return self.fc(self.fc(x).relu())
    p = profile_model(Twice(), np.ones((3, 4), np.float32), repeats=2, warmup=1)
    assert [r['name'] for r in p.rows] == ['fc', 'relu', 'fc_1'] and [r['params'] for r in p.rows] == [20, 0, 0]
    assert p.params == 20 and p.rows[2]['flops'] == p.rows[0]['flops'] > 0
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter('error')
        assert layer_cost(Function('log', {}), (2, 3))['flops'] == 6                # no divide-by-zero warning
    assert layer_cost(Function('exp', {}), (10 ** 6, 10 ** 6))['output_shape'] == (10 ** 6, 10 ** 6)   # nothing allocated
