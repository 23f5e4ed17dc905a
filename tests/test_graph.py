"Tracing models into graphs: exact replay, residual/depthwise/concat structure, refusals, rewrites."
import copy

import numpy as np
import pytest

from tinycomp import nn
from tinycomp import tensor as T
from tinycomp.graph import Function, Graph, GraphError, Node, trace
from tinycomp.models import load_pretrained
from tinycomp.tensor import Tensor, cat

from graph_models import BranchyNet, images, trained_like


@pytest.mark.parametrize('name', ['digits_cnn', 'digits_cnn_wide'])
def test_the_shipped_models_run_bit_exact_through_their_graph(name):
    model = load_pretrained(name)
    g = trace(model, images(2))
    assert [n.op for n in g] == [type(m).__name__ for m in model] and [n.name for n in g] == [str(i) for i in range(len(model))]
    from tinycomp.data import load_digits
    test_x, _ = load_digits('test')
    for batch in (1, 64, len(test_x)):
        x = test_x[:batch]
        assert np.array_equal(g(x).data, model(x).data) and g(x).dtype == model(x).dtype


def test_residual_depthwise_and_concat_become_nodes_and_edges():
    net = trained_like(BranchyNet())
    g = trace(net, images(3))
    ops = {n.name: (n.op, n.inputs) for n in g}
    assert ops['block.add'] == ('Add', ('block.bn2', 'stem'))                       # the skip connection
    assert ops['block.relu'] == ('ReLU', ('block.bn1',)) and ops['block.relu_1'] == ('ReLU', ('block.add',))
    assert ops['mul'] == ('mul', ('depthwise',)) and g['mul'].module.constants[1].data == np.float32(0.5)
    assert ops['cat'] == ('Cat', ('block.relu_1', 'mul')) and g['cat'].module.dim == 1
    assert ops['flatten'][0] == 'Flatten' and ops['fc'] == ('Linear', ('flatten',))
    assert g['cat'].shape == (3, 16, 8, 8) and g['fc'].shape == (3, 10) and g['fc'].dtype == np.float32
    for batch in (1, 5, 64):
        x = images(batch, seed=batch)
        assert np.array_equal(g(x).data, net(x).data)
    assert set(g.state_dict()) - set(net.state_dict()) == {'mul.constant1', 'div.constant1'} and set(net.state_dict()) <= set(g.state_dict())
    assert sum(p.data.size for p in g.parameters()) == sum(p.data.size for p in net.parameters())


def test_the_print_has_one_line_a_node_with_name_op_inputs_shape_and_parameters():
    g = trace(BranchyNet(), images(2))
    lines = str(g).splitlines()
    assert lines[0].split() == ['name', 'op', 'inputs', 'output', 'shape', 'parameters']
    assert len(lines) == len(g) + 3
    row = next(line for line in lines if line.startswith('block.add '))
    assert row.split()[:4] == ['block.add', 'Add', 'block.bn2,', 'stem'] and '(2, 8, 8, 8)' in row
    assert next(line for line in lines if line.startswith('stem ')).split()[-1] == '80'
    assert lines[-1] == f"output: fc; {len(g)} nodes, 1,462 parameters"


def test_a_layer_used_twice_is_two_nodes_sharing_one_module():
    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)
        def forward(self, x): return self.fc(self.fc(x).relu())
    m = Twice()
    g = trace(m, np.ones((2, 4), np.float32))
    assert [n.name for n in g] == ['fc', 'relu', 'fc_1'] and g['fc'].module is g['fc_1'].module
    assert list(g.state_dict()) == ['fc.weight', 'fc.bias']
    x = np.random.default_rng(1).standard_normal((3, 4)).astype(np.float32)
    assert np.array_equal(g(x).data, m(x).data)


def test_a_single_layer_and_a_layer_that_returns_its_input():
    g = trace(nn.Linear(3, 2), np.ones((1, 3), np.float32))
    assert [(n.name, n.op) for n in g] == [('linear', 'Linear')]
    seq = nn.Sequential(nn.Dropout(0.5), nn.ReLU()).eval()
    g = trace(seq, -np.ones((2, 3), np.float32))
    assert [(n.op, n.inputs) for n in g] == [('Dropout', ('input',)), ('ReLU', ('0',))]
    assert np.array_equal(g(np.ones((4, 3), np.float32)).data, np.ones((4, 3), np.float32))


def test_tracing_leaves_the_model_and_the_tensor_class_as_they_were():
    net = trained_like(BranchyNet()).train()
    before = copy.deepcopy(net.state_dict())
    g = trace(net, images(4))
    assert all(m.training for m in net.modules()) and g.training          # modes restored; no batch statistics updated
    assert all(np.array_equal(v, before[k]) for k, v in net.state_dict().items())
    assert T._tracer is None and 'item' in Tensor.__dict__ and '__bool__' not in Tensor.__dict__
    with pytest.raises(GraphError):
        trace(nn.Sequential(nn.ReLU()), np.zeros((0, 3), np.float32))
    class Reads(nn.Module):
        def __init__(self):
            super().__init__()
            self.a = nn.ReLU()
        def forward(self, x): return self.a(x) * x.sum().item()
    with pytest.raises(GraphError):
        trace(Reads(), np.ones((2, 3), np.float32))
    assert T._tracer is None and '__float__' not in Tensor.__dict__ and Tensor(np.ones(1)).item() == 1.0


class TwoWays(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.ReLU(), nn.Tanh()


@pytest.mark.parametrize('forward,x,message', [
    (lambda self, x: self.a(x) if x.sum().item() > 0 else self.b(x), images(2),
     "reads the values of the result of op 'sum' (with .item())"),
    (lambda self, x: self.a(x) if float(self.a(x).max()) > 1 else self.b(x), images(2), "reads the values of the result of op 'max' (with float())"),
    (lambda self, x: self.a(x) if self.a(x) else self.b(x), images(2), "reads the values of layer 'a' (with an if or a while)"),
    (lambda self, x: self.a(x) if x.data.mean() > 0 else self.b(x), np.abs(images(2)), "ran b (Tanh) where it ran a (ReLU)"),
    (lambda self, x: self.a(x) * Tensor(x.data.std()), images(2), "node 'mul' (mul) computes other values"),
    (lambda self, x: self.a(x).mean(0), images(2), "uses the batch size as a number"),
    (lambda self, x: self.a(x).reshape(2, -1), images(2), "uses the batch size as a number"),
    (lambda self, x: self.a(x)[x.argmax()], images(2), "reads the values of the input (with .argmax())"),
    (lambda self, x: (self.a(x), self.b(x)), images(2), "returned a tuple; a graph has one output"),
    (lambda self, x: Tensor(x.data * 2), images(2), "not computed from its input by layers and tensor ops"),
    (lambda self, x: self.a(Tensor(x.data)), images(2), "layer 'a' reads a tensor that is not computed from the model's input"),
    (lambda self, x: nn.functional.conv2d(x, Tensor(np.ones((1, 1, 1, 1), np.float32))), images(2),
     "calls the op 'conv2d' between layers"),
], ids=['item', 'float', 'bool', 'data_branch', 'data_constant', 'batch_mean', 'batch_reshape', 'argmax', 'tuple',
        'numpy_output', 'numpy_input', 'functional_conv'])
def test_a_forward_that_depends_on_the_data_is_refused_naming_what(forward, x, message, monkeypatch):
    monkeypatch.setattr(TwoWays, 'forward', forward)
    with pytest.raises(GraphError) as e:
        trace(TwoWays(), x)
    assert message in str(e.value), str(e.value)


def test_a_layer_called_with_something_else_than_tensors_is_refused():
    class Odd(nn.Module):
        def forward(self, x, scale): return x * scale
    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.odd = Odd()
        def forward(self, x): return self.odd(x, 2.0)
    with pytest.raises(GraphError, match="layer 'odd' \\(Odd\\) was called with float arguments"):
        trace(Outer(), np.ones((2, 2), np.float32))


def test_rewrites_replace_insert_and_remove_keep_the_graph_runnable():
    net = trained_like(BranchyNet())
    g = copy.deepcopy(trace(net, images(2)))
    assert g['stem'].module is not net.stem                                       # a deep copy is independent
    g.insert_after('stem', 'stem_relu', nn.ReLU())
    assert g['block.conv1'].inputs == ('stem_relu',) and g['block.add'].inputs == ('block.bn2', 'stem_relu')
    assert [n.name for n in g.users('stem_relu')] == ['block.conv1', 'block.add']
    g.remove('mul')
    assert g['cat'].inputs == ('block.relu_1', 'depthwise')
    old = g.replace('block.relu_1', nn.Tanh())
    assert type(old).__name__ == 'ReLU'
    x = images(3)
    s = net.stem(x).relu()
    y = net.block.bn2(net.block.conv2(net.block.bn1(net.block.conv1(s)).relu()))
    y = (y + s).tanh()
    want = net.fc(net.pointwise(cat([y, net.depthwise(y)], 1)).mean((2, 3)))
    assert np.allclose(g(x).data, want.data, atol=1e-6)
    g.insert_after('input', 'scaled', Function('mul', constants={1: Tensor(np.float32(2))}))
    assert g['stem'].inputs == ('scaled',) and next(iter(g)).name == 'scaled'
    g.remove('fc')
    assert g.output == 'flatten' and g.infer_shapes()['flatten'].shape == (2, 4)


def test_rewrites_that_would_break_the_graph_are_refused():
    g = trace(BranchyNet(), images(2))
    with pytest.raises(GraphError, match="node 'cat' reads 2 values"):
        g.remove('cat')
    with pytest.raises(GraphError, match="there is a node named 'stem' already"):
        g.insert_after('input', 'stem', nn.ReLU())
    with pytest.raises(GraphError, match="no node named 'nope'; the nodes are \\['stem'"):
        g.replace('nope', nn.ReLU())
    with pytest.raises(GraphError, match="node 'b' reads \\['c'\\], which no node before it makes"):
        Graph([Node('b', nn.ReLU(), ('c',)), Node('c', nn.ReLU(), ('input',))], 'c')
    with pytest.raises(GraphError, match="output 'z' is not a node"):
        Graph([Node('b', nn.ReLU(), ('input',))], 'z')
    with pytest.raises(GraphError, match="node 'stem.relu' is named inside another node's layer"):
        g.insert_after('stem', 'stem.relu', nn.ReLU())
    before = [(n.name, n.module, n.inputs) for n in g]
    assert g['block.conv1'].inputs == ('stem',) and g.output == 'fc'                # the refused rewrite was undone
    x = images(2)
    assert np.array_equal(g(x).data, g(x, keep_all=True)['fc'].data)
    with pytest.raises(GraphError):
        g.replace('stem', None)
    assert [(n.name, n.module, n.inputs) for n in g] == before
    with pytest.raises(GraphError, match="knows no input shape: pass an input"):
        Graph([Node('b', nn.ReLU(), ('input',))], 'b').infer_shapes()


def test_a_function_runs_every_op_it_may_hold_exactly_as_the_tensor_op():
    x = Tensor(np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32))
    cases = [('sum', {'axis': (1,), 'keepdims': True}, lambda t: t.sum(1, True)), ('max', {'axis': (2,), 'keepdims': False}, lambda t: t.max(2)),
             ('permute', {'dims': (0, 2, 1)}, lambda t: t.permute(0, 2, 1)), ('getitem', {'index': (slice(None), 1)}, lambda t: t[:, 1]),
             ('softmax', {'axis': -1}, lambda t: t.softmax(-1)), ('log_softmax', {'axis': 1}, lambda t: t.log_softmax(1)),
             ('exp', {}, lambda t: t.exp()), ('abs', {}, lambda t: t.abs()), ('neg', {}, lambda t: -t), ('pow', {'exponent': 2.0}, lambda t: t ** 2)]
    for op, settings, direct in cases:
        assert np.array_equal(Function(op, settings)(x).data, direct(x).data), op
    with pytest.raises(GraphError, match="no way to run the op 'conv2d'"):
        Function('conv2d')


class Sliced(nn.Module):
    "A parameter used by an op between layers, a slice, a permute and a reshape to the batch: settings of every kind."
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(1, 4, 3, padding=1)
        self.gain = nn.Parameter(np.full((1, 4, 1, 1), 1.5, np.float32))
        self.fc = nn.Linear(24, 3)

    def forward(self, x):
        y = (self.conv(x) * self.gain)[:, 1:, ::2, ...]
        return self.fc(y.permute(0, 1, 3, 2).reshape(len(x), -1)[:, :24])


@pytest.mark.parametrize('make', [lambda: trained_like(BranchyNet()), Sliced, lambda: load_pretrained('digits_cnn_wide')],
                         ids=['branchy', 'sliced', 'digits_cnn_wide'])
def test_a_graph_saves_and_loads_and_computes_the_same(make, tmp_path):
    from tinycomp import io
    model = make().eval()
    g = trace(model, images(2))
    back = io.load(io.save(g, tmp_path / 'g.npz')).eval()
    assert type(back) is Graph and [(n.name, n.op, n.inputs, n.shape) for n in back] == [(n.name, n.op, n.inputs, n.shape) for n in g]
    x = images(7, seed=5)
    assert np.array_equal(back(x).data, model(x).data)
    assert io.model_size(g) == (tmp_path / 'g.npz').stat().st_size
    assert sum(p.data.size for p in back.parameters()) == sum(p.data.size for p in model.parameters())


def test_a_graph_file_that_does_not_add_up_is_refused(tmp_path):
    "A manifest whose nodes name missing layers, read values made later, or are malformed: a clear ModelFileError."
    import json
    from tinycomp import io
    from tinycomp.errors import ModelFileError
    from tinycomp.files import write_npz
    good = io.save(trace(BranchyNet().eval(), images(2)), tmp_path / 'good.npz')
    manifest, arrays = io.read_manifest(good)

    def broken(change, name):
        m = json.loads(json.dumps(manifest))
        change(m['model']['config'])
        path = tmp_path / f"{name}.npz"
        with open(path, 'wb') as f: write_npz(f, {**arrays, io.MANIFEST_KEY: np.frombuffer(json.dumps(m).encode(), np.uint8)})
        with pytest.raises(ModelFileError) as e:
            io.load(path)
        return str(e.value)

    assert "names layer 'nowhere', which the graph does not hold" in broken(lambda c: c['nodes'][0].__setitem__(1, 'nowhere'), 'missing')
    assert "reads ['fc'], which no node before it makes" in broken(lambda c: c['nodes'][0].__setitem__(2, ['fc']), 'later')
    assert "a graph node must be [name, layer, [inputs], [shape], dtype]" in broken(lambda c: c['nodes'].append([1, 2]), 'malformed')
    assert "output 'nothing' is not a node" in broken(lambda c: c.__setitem__('output', 'nothing'), 'output')
    assert "names layer 'block', which the graph does not hold" in broken(lambda c: c['nodes'][0].__setitem__(1, 'block'), 'scope')


def test_what_a_reviewer_broke_stays_fixed(tmp_path):
    "Shapes other than the example's, names out of order, keyword calls, in-place edits, fixed reshapes, odd examples."
    net = trained_like(BranchyNet())
    g = trace(net, images(2))
    with pytest.raises(GraphError, match=r"made for inputs of shape \(N, 1, 8, 8\), got \(2, 1, 16, 16\)"):
        g(images(2, size=16))                                       # its mean keeps the count of an 8x8 input

    class Twice(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
        def forward(self, x): return self.fc(x) + self.fc(x * 2)
    m, x = Twice(), np.ones((2, 3), np.float32)
    g = trace(m, x)
    assert [n.name for n in g] == ['fc', 'mul', 'fc_1', 'add'] and list(g.state_dict()) == ['fc.weight', 'fc.bias', 'mul.constant1']
    g.load_state_dict({**m.state_dict(), 'mul.constant1': np.float32(2)})

    class Keywords(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
        def forward(self, x): return self.fc(x=x)
    with pytest.raises(GraphError, match="called without positional tensors"):
        trace(Keywords(), x)

    class InPlace(Twice):
        def forward(self, x):
            x.data += 1
            return self.fc(x)
    example = np.zeros((2, 3), np.float32)
    with pytest.raises(GraphError, match="computes other values"):
        trace(InPlace(), example)
    assert not example.any()                                              # the caller's example is left alone

    class FixedReshape(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)
        def forward(self, x): return self.fc(x).reshape(4, 3, 4)
    with pytest.raises(GraphError, match=r"running the model again on a batch of 3 instead of 2 failed \(ShapeError"):
        trace(FixedReshape(), np.ones((2, 3, 8), np.float32))
    with pytest.raises(GraphError, match="one example input, an array or a Tensor, got a tuple"):
        trace(m, (x, x))
    with pytest.raises(GraphError, match="holds NaN or infinite values"):
        trace(m, np.full((2, 3), np.nan, np.float32))
    with pytest.raises(GraphError, match="is not a dotted name"):
        g.insert_after('fc', 'x.', nn.ReLU())
    g.insert_after('add', 'act', nn.ReLU())
    assert g['act'].shape is None and '?' in str(g).splitlines()[-2]
    from tinycomp import io
    back = io.load(io.save(g, tmp_path / 'g.npz'))                         # shapes inferred on the way to the file
    assert back['act'].shape == (2, 3)
