"Module 08: the graph rewrites keep the outputs, the memory plan never shares live bytes, and the frozen model computes what the model does, allocating nothing."
import copy

import numpy as np
import pytest

from tinycomp import nn
from tinycomp.data import load_shipped
from tinycomp.deploy.memory import assign_offsets, overlapping_values, plan_memory, value_lifetimes
from tinycomp.deploy.passes import (FLOAT_PASSES, FusedConv2d, fold_batchnorms, fuse_activations, optimize,
                                    same_outputs, use_fused_layers)
from tinycomp.deploy.runtime import freeze, steady_state_allocations
from tinycomp.errors import ShapeError, TinycompError
from tinycomp.graph import Graph, GraphError, Node, trace
from tinycomp.models import MODELS, load_pretrained, model_data
from tinycomp.quantization.layers import QuantizedConv2d, QuantizedLinear
from tinycomp.quantization.models import quantize_static
from tinycomp.tensor import Tensor, no_grad

from graph_models import BranchyNet, QuantizableNet, images, trained_like

pytestmark = pytest.mark.module08


def _eager(model, x):
    with no_grad(): return model(Tensor(x)).data


def _data(name):
    return load_shipped(model_data(name), 'test')[0]


@pytest.mark.parametrize('name', sorted(MODELS))
def test_every_pass_keeps_the_outputs_of_every_shipped_model(name):
    x = _data(name)[:5]
    graph = trace(load_pretrained(name), x)
    for k in range(1, len(FLOAT_PASSES) + 1):              # each prefix of the passes, checked pass by pass
        optimize(graph, FLOAT_PASSES[:k], check_input=x)
    done = optimize(graph, check_input=x)
    assert not [n for n in done if n.op in ('BatchNorm2d', 'Dropout', 'Conv2d')]
    assert same_outputs(load_pretrained(name), done, _data(name)[100:164]) < 1e-5


@pytest.mark.parametrize('name', sorted(MODELS))
@pytest.mark.parametrize('precision', ['float32', 'int8'])
def test_the_frozen_model_computes_what_the_model_does(name, precision):
    X = _data(name)
    model = load_pretrained(name)
    if precision == 'int8': model = quantize_static(model, load_shipped(model_data(name), 'train')[0][:256])
    frozen = freeze(model, X[:4])
    for batch in (1, 7, 64):
        ref, got = _eager(model, X[:batch]), frozen.run(X[:batch])
        if precision == 'int8': assert np.array_equal(got, ref)                      # bit for bit
        else: np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert frozen.run(X[:1]).shape == (1, 10)               # an arena per batch size, each reused
    assert {b for b, _ in frozen._bound} == {4, 1, 7, 64}       # (4: the check at freeze time)


def test_int8_depthwise_convolutions_run_nhwc_between_the_vector_kernels():
    X = _data('mobilenet_v2_tiny')
    model = quantize_static(load_pretrained('mobilenet_v2_tiny'), load_shipped('mnist5k', 'train')[0][:256])
    frozen = freeze(model, X[:4])
    kinds = [s.kind for s in frozen.steps]
    assert kinds.count('int8 depthwise conv (NHWC, vectors over the channels)') == 8
    assert not any(k.endswith('(eager)') for k in kinds)
    from tinycomp.quantization.int8_conv import KERNEL_LEVELS
    if KERNEL_LEVELS[0] != 'loops':                         # with module 04's vector kernels: NHWC from end to end
        assert not any('loops' in k for k in kinds)
        assert [k for k in kinds if k.startswith('reorder')] == ['reorder nchw -> nhwc']    # the input's, no other
    assert np.array_equal(frozen.run(X[:33]), _eager(model, X[:33]))


def test_an_int8_model_runs_batches_of_256_rows_and_more():
    X = _data('digits_cnn')             # the int8 kernels' uint8 scratch was once sized by calling np.uint8 on the batch
    model = quantize_static(load_pretrained('digits_cnn'), load_shipped('digits', 'train')[0][:256])
    assert np.array_equal(freeze(model, X[:4]).run(X[:300]), _eager(model, X[:300]))


class ClampNet(nn.Module):
    "ReLU6 and a Hardtanh after a conv, a depthwise conv, a residual conv and a linear layer (fused), and one after a pool (not)."
    def __init__(self):
        super().__init__()
        self.conv, self.dw, self.pw = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1, groups=8), nn.Conv2d(8, 8, 1)
        self.a1, self.a2, self.a3, self.a4 = nn.ReLU6(), nn.Hardtanh(-0.5, 1.5), nn.ReLU6(), nn.ReLU6()
        self.pool, self.flat, self.fc, self.a5 = nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16, 10), nn.Hardtanh(-2.0, 2.0)
    def forward(self, x):
        h = self.a1(self.conv(x))
        h = self.a3(self.pw(self.a2(self.dw(h))) + h)
        return self.a5(self.fc(self.flat(self.a4(self.pool(h)))))


@pytest.mark.parametrize('precision', ['float32', 'int8'])
def test_relu6_and_clamps_go_into_the_epilogue_or_run_as_a_clamp(precision):
    x = images(16, seed=4) * 3                               # large enough that every clamp holds somewhere
    model = trained_like(ClampNet())
    if precision == 'int8': model = quantize_static(model, x)
    frozen = freeze(model, x[:4])
    kinds = [s.kind for s in frozen.steps]
    if precision == 'float32':
        acts = [n.module.activation for n in frozen.graph if hasattr(n.module, 'activation')]
        assert acts == [(0.0, 6.0), (-0.5, 1.5), (0.0, 6.0), (-2.0, 2.0)]      # conv, depthwise, residual conv, linear
        assert kinds.count('clamp') == 1 and not any(k.endswith('(eager)') for k in kinds)   # the ReLU6 after the pool
        np.testing.assert_allclose(frozen.run(x), _eager(model, x), rtol=0, atol=1e-5)
    else:                                                    # int8: the clamps join the conv's and linear's own clamp
        fused = [n.module.clamp_levels is not None for n in frozen.graph if isinstance(n.module, (QuantizedConv2d, QuantizedLinear))]
        assert fused == [True, True, True]                  # conv, depthwise, linear (the residual conv's add comes first)
        assert kinds.count('clamp') == 2 and not any(k.endswith('(eager)') for k in kinds)   # after the add, after the pool
        assert sum(k.endswith('+ add (table)') for k in kinds) == 1
        assert np.array_equal(frozen.run(x), _eager(model, x))
    assert np.unique(frozen.run(x)).size > 10


class AddFirstNet(nn.Module):
    "A residual add whose conv is the add's second input."
    def __init__(self):
        super().__init__()
        self.conv, self.pw, self.a1 = nn.Conv2d(1, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.ReLU()
        self.pool, self.flat, self.fc = nn.MaxPool2d(2), nn.Flatten(), nn.Linear(8 * 16, 10)
    def forward(self, x):
        h = self.a1(self.conv(x))
        return self.fc(self.flat(self.pool(h + self.pw(h))))


def test_int8_fusions_keep_the_add_order():
    from tinycomp.deploy.passes import PASSES, QuantizedConvAdd, add_table
    x = images(16, seed=5) * 3
    model = quantize_static(trained_like(AddFirstNet()), x)
    graph = optimize(trace(model, x[:2]), PASSES, check_input=x)            # bit for bit, pass by pass
    adds = [n.module for n in graph if isinstance(n.module, QuantizedConvAdd)]
    assert len(adds) == 1 and not adds[0].conv_first
    assert np.array_equal(adds[0].table().reshape(256, 256), add_table(adds[0].add).reshape(256, 256).T)
    frozen = freeze(model, x[:4])
    for threads in (1, 2):
        import numba
        before = numba.get_num_threads()
        numba.set_num_threads(threads)
        try: assert np.array_equal(frozen.run(x), _eager(model, x))
        finally: numba.set_num_threads(before)


def test_an_int8_clamp_whose_range_misses_the_conv_clamp_stays_a_clamp():
    from tinycomp.deploy.passes import fuse_int8_clamps
    from tinycomp.quantization.layers import QuantizedHardtanh
    conv = QuantizedConv2d(1, 2, 1, relu=True, output_zero_point=-20)      # its results are clamped to [-20, 127]
    graph = Graph([Node('conv', conv, ('input',)), Node('cut', QuantizedHardtanh(-100, -50), ('conv',)),
                   Node('keep', QuantizedHardtanh(-30, 40), ('cut',))], 'keep', 'input')
    assert [n.op for n in fuse_int8_clamps(copy.deepcopy(graph))] == ['QuantizedConv2d', 'QuantizedHardtanh', 'QuantizedHardtanh']
    graph.set_inputs('keep', ('conv',))
    graph.remove('cut', keep='conv')
    fused = fuse_int8_clamps(graph)
    assert [n.op for n in fused] == ['QuantizedConv2d'] and fused['conv'].module._clamp() == (-20, 40)
    assert conv.clamp_levels is None                                        # the model's own layer is left as it was


def test_a_fused_layer_with_a_clamp_is_saved_and_loaded(tmp_path):
    from tinycomp import io as tio
    graph = optimize(trace(trained_like(ClampNet()), images(2)), FLOAT_PASSES)
    back = tio.load(tio.save(graph, tmp_path / 'g.npz'))
    assert [getattr(n.module, 'activation', None) for n in back] == [getattr(n.module, 'activation', None) for n in graph]
    assert same_outputs(graph, back, images(3)) == 0
    with pytest.raises(TinycompError, match='low < high'):
        FusedConv2d(1, 1, 1, activation=(1.0, 1.0))


class Scaled(nn.Module):
    "A gain computed from a parameter on every call (constant), times the output of a conv."
    def __init__(self):
        super().__init__()
        self.conv, self.gain = nn.Conv2d(1, 4, 3, padding=1), nn.Parameter(np.arange(4, dtype=np.float32).reshape(1, 4, 1, 1))
    def forward(self, x): return self.conv(x) * (self.gain * 2.0 + 1.0)


def test_constants_are_folded_and_dead_nodes_removed(tmp_path):
    from tinycomp import io as tio
    from tinycomp.deploy.passes import Constant, fold_constants, remove_dead_nodes
    x = images(3, seed=5)
    model = Scaled().eval()
    graph = optimize(trace(model, x), check_input=x)
    assert [n.op for n in graph] == ['FusedConv2d', 'Constant', 'mul']                          # gain * 2 + 1 ran once
    assert np.array_equal(graph[[n.name for n in graph][1]].module.value, np.arange(4).reshape(1, 4, 1, 1) * 2.0 + 1.0)
    frozen = freeze(model, x)
    np.testing.assert_allclose(frozen.run(x), _eager(model, x), rtol=0, atol=1e-5)
    back = tio.load(tio.save(graph, tmp_path / 'c.npz'))                                      # a Constant is saved too
    assert same_outputs(graph, back, x) == 0
    inp = Graph([Node('a', nn.ReLU(), ('input',)), Node('dead', nn.Add(), ('input', 'a')), Node('b', nn.ReLU(), ('a',)),
                 Node('dead2', nn.ReLU(), ('dead',))], 'b', 'input')
    assert [n.name for n in remove_dead_nodes(copy.deepcopy(inp))] == ['a', 'b']
    assert [n.name for n in remove_dead_nodes(fold_constants(copy.deepcopy(inp)))] == ['a', 'b']   # nothing constant here
    assert isinstance(Constant.of(np.ones(2)), Constant)


def test_layers_without_a_kernel_run_eagerly_and_layouts_change_only_where_needed():
    for model in (trained_like(BranchyNet()), trained_like(QuantizableNet())):
        x = images(6, seed=3)
        frozen = freeze(model, x[:2])
        np.testing.assert_allclose(frozen.run(x), _eager(model, x), rtol=0, atol=1e-5)
        kinds = [s.kind for s in frozen.steps]
        assert any(k.endswith('(eager)') for k in kinds)             # the concat (and the mul, the mean) run eagerly
    reorders = [s for s in freeze(load_pretrained('resnet8'), _data('resnet8')[:2]).steps if s.kind.startswith('reorder')]
    assert [s.kind for s in reorders] == ['reorder nchw -> nhwc']    # once, at the input


def test_a_flatten_of_an_image_permutes_the_linear_weights_once_and_an_image_output_is_nchw():
    model = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 8 * 8, 5)).eval()
    x = images(3)
    frozen = freeze(model, x)
    assert [s.kind.split(' (')[0] for s in frozen.steps] == ['reorder nchw -> nhwc', 'conv', 'flatten', 'linear']
    np.testing.assert_allclose(frozen.run(x), _eager(model, x), rtol=0, atol=1e-5)
    convs = nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Conv2d(4, 6, 1)).eval()      # ends in an image
    frozen = freeze(convs, x)
    assert frozen.steps[-1].kind == 'reorder nhwc -> nchw' and frozen.run(x).shape == (3, 6, 8, 8)
    np.testing.assert_allclose(frozen.run(x), _eager(convs, x), rtol=0, atol=1e-5)


def test_an_output_shares_a_dying_input_only_when_nothing_else_reads_it():
    class Blocks(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b, self.c = nn.Conv2d(4, 4, 1), nn.Conv2d(4, 4, 3, padding=1), nn.Conv2d(4, 4, 1)
        def forward(self, x):
            y = self.a(x) + x                      # the 1x1 conv reads x while adding x: no sharing
            z = (self.b(y) + y).relu()             # y dies here, read only through the padded copy: shared
            return self.c(z) + z
    model = Blocks().eval()
    x = images(5, channels=4)
    frozen = freeze(model, x[:2])
    assert frozen.memory_shared() == {}                 # each residual is also its conv's input, still being read
    np.testing.assert_allclose(frozen.run(x), _eager(model, x), rtol=0, atol=1e-5)
    resnet = freeze(load_pretrained('resnet8'), _data('resnet8')[:2])
    shared = resnet.memory_shared()
    assert shared == {'layer1.conv2': 'conv1', 'layer2.downsample.0': 'layer2.conv2',      # residuals that die there
                      'layer3.downsample.0': 'layer3.conv2', 'flatten': 'avgpool'}         # and a view
    X = _data('resnet8')[:64]
    np.testing.assert_allclose(resnet.run(X), _eager(load_pretrained('resnet8'), X), rtol=0, atol=1e-4)


def test_fold_and_fuse_leave_a_shared_output_alone():
    class Shared(nn.Module):
        def __init__(self):
            super().__init__()
            self.conv, self.bn, self.relu, self.other = nn.Conv2d(1, 3, 3, padding=1), nn.BatchNorm2d(3), nn.ReLU(), nn.Conv2d(3, 3, 1)
        def forward(self, x):
            z = self.conv(x)
            return self.relu(self.bn(z)) + self.other(z)
    model = trained_like(Shared())
    x = images(2)
    g = trace(model, x)
    before = copy.deepcopy(g)
    fold_batchnorms(g)
    assert [n.op for n in g] == [n.op for n in before]                  # conv is read twice: no fold
    g = fuse_activations(use_fused_layers(g))
    assert [n.op for n in g] == ['FusedConv2d', 'BatchNorm2d', 'ReLU', 'FusedConv2d', 'Add']
    same_outputs(model, g, x)


def test_a_pass_that_changes_the_outputs_is_named():
    def broken(graph):
        node = next(n for n in graph if isinstance(n.module, FusedConv2d))
        node.module.bias.data = node.module.bias.data + 1
        return graph
    with pytest.raises(TinycompError, match='the pass broken is wrong'):
        optimize(trace(load_pretrained('digits_cnn'), images(2)), FLOAT_PASSES + (broken,), check_input=images(2))


def _random_graph(rng, n):
    nodes = []
    for k in range(n):
        reads = [rng.integers(-1, k)] + ([rng.integers(-1, k)] if rng.random() < 0.5 else [])
        names = tuple('input' if j < 0 else f"v{j}" for j in reads)
        nodes.append(Node(f"v{k}", nn.Add() if len(names) == 2 else nn.ReLU(), names))
    return Graph(nodes, f"v{int(rng.integers(0, n))}", 'input')


@pytest.mark.parametrize('seed', range(30))
def test_random_plans_never_share_bytes_between_live_values(seed):
    rng = np.random.default_rng(seed)
    g = _random_graph(rng, int(rng.integers(3, 25)))
    life = value_lifetimes(g)
    order = list(g.nodes)
    for name, (a, b) in life.items():                     # born at its node, dead after its last reader
        readers = [order.index(n.name) for n in g.users(name)]
        assert a == order.index(name) and b == max(readers + [a] + ([len(order) - 1] if name == g.output else []))
    sizes = {k: int(v) for k, v in zip(life, rng.integers(1, 5000, len(life)))}
    plan = plan_memory(life, sizes)
    names = list(life)
    assert not overlapping_values([-(-sizes[k] // 64) * 64 for k in names], [life[k][0] for k in names],
                                  [life[k][1] for k in names], [plan.offsets[k] for k in names])
    assert plan.arena_bytes <= plan.separate_bytes and all(o % 64 == 0 for o in plan.offsets.values())
    peak_live = max(sum(-(-sizes[k] // 64) * 64 for k in names if life[k][0] <= t <= life[k][1]) for t in range(len(order)))
    assert plan.arena_bytes >= peak_live                    # no plan beats what is alive at one step


def test_the_program_a_frozen_model_plans_reads_like_a_graph():
    frozen = freeze(load_pretrained('resnet8'), _data('resnet8')[:2])
    program = frozen._program()
    names = [s.name for s in program]
    assert list(program.nodes) == names and program['conv1'].inputs == ('input@nhwc',)
    assert [s.name for s in program.users('conv1')] == ['layer1.conv1', 'layer1.conv2']
    assert program.output == 'fc' and len(program) == len(names)


def test_assign_offsets_prefers_the_tightest_gap_and_keeps_touching_lifetimes_apart():
    assert list(assign_offsets([10, 10, 3, 3, 2], [0, 0, 0, 1, 2], [1, 3, 1, 3, 2])) == [0, 10, 20, 23, 20]
    assert list(assign_offsets([4, 4], [0, 1], [1, 2])) == [0, 4]          # both alive at step 1
    assert list(assign_offsets([4, 4], [0, 2], [1, 2])) == [0, 0]


def test_the_steady_state_allocates_no_array_and_the_arena_is_smaller_than_the_values():
    X = _data('resnet8')
    frozen = freeze(load_pretrained('resnet8'), X[:4])
    small, large = (steady_state_allocations(frozen, X[:b]) for b in (1, 64))
    assert small['array_bytes'] == large['array_bytes'] == 0
    assert large['peak_bytes'] < 65536                        # frames and argument objects; a conv output is 800 KB
    plan = frozen.memory_plan(64)
    assert plan.arena_bytes < 0.6 * plan.separate_bytes
    q = freeze(quantize_static(load_pretrained('resnet8'), load_shipped('mnist5k', 'train')[0][:64]), X[:4])
    small, large = (steady_state_allocations(q, X[:b]) for b in (1, 64))     # int8: the drivers' scratch is planned too
    assert small['array_bytes'] == large['array_bytes'] == 0 and large['peak_bytes'] < 16384


def test_bad_input_is_refused_with_what_to_do():
    X = _data('digits_cnn')
    frozen = freeze(load_pretrained('digits_cnn'), X[:2])
    with pytest.raises(ShapeError, match=r'frozen for inputs of shape \(N, 1, 8, 8\)'): frozen.run(X[:2, :, :4])
    with pytest.raises(TinycompError, match='float input'): frozen.run(X[:2].astype(np.int64))
    with pytest.raises(ShapeError, match='batch is empty'): frozen.run(X[:0])
    with pytest.raises(TinycompError, match='NumPy array or a Tensor'): frozen.run([[0.0]])
    with pytest.raises(ShapeError, match='out must be'): frozen.run(X[:2], np.empty((3, 10), np.float32))
    with pytest.raises(TinycompError, match='runs inference only'): frozen.train()
    np.testing.assert_allclose(frozen.run(X[:2].astype(np.float64)), frozen.run(X[:2]))      # float64 is cast once
    q = freeze(quantize_static(load_pretrained('digits_cnn'), load_shipped('digits', 'train')[0][:64]), X[:2])
    bad = X[:2].copy(); bad[1, 0, 3, 3] = np.inf
    with pytest.raises(TinycompError, match='NaN or infinite'): q.run(bad)
    with pytest.raises(GraphError): Graph([Node('a', nn.ReLU(), ('nowhere',))], 'a')


def test_bench_onnx_rows_time_the_frozen_model_too(monkeypatch):
    pytest.importorskip('onnxruntime')
    from tinycomp.onnx import runtime as R
    res = R.onnx_benchmark(threads=1, repeats=2, verbose=False, batches=(1, 2), models=('digits_cnn',))
    assert [r['precision'] for r in res['rows']] == ['float32', 'int8']
    for r in res['rows']:
        for lat in r['latency'].values():
            assert lat['frozen'] > 0 and abs(lat['frozen_ratio'] - lat['frozen'] / lat['ort']) < 1e-12
