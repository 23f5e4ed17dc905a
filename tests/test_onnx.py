"""tinycomp.onnx: export (float, pruned, sparse, half, int8 in both forms), agreement with ONNX Runtime (on this CPU
and on an emulated AVX2-only one), import (ours, PyTorch's, and hostile files), the commands and the benchmark."""
import json
import os
import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

import tinycomp
from tinycomp.batchnorm import BatchNorm2d
from tinycomp.cli import build_parser, main
from tinycomp.conv import Conv2d
from tinycomp.data import load_digits
from tinycomp.errors import TinycompError
from tinycomp.models import evaluate, load_pretrained
from tinycomp.nn.modules import Dropout, Flatten, Linear, Module, ReLU, Sequential, Sigmoid, Tanh
from tinycomp.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from tinycomp.tensor import Tensor, manual_seed, no_grad

import onnx                   # noqa: E402  never skipped: onnx and onnxruntime are in the dev extra, a missing one fails
import onnxruntime            # noqa: E402,F401
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from tinycomp.onnx import (QUANTIZED_FORMS, export_onnx, import_onnx, lsb_diff, ort_agreement,  # noqa: E402
                           run_onnx, run_onnx_emulated, to_onnx)

DATA = Path(__file__).parent / 'data'
X_TEST, Y_TEST = load_digits('test')
CALIB = load_digits('train')[0][:256]


@pytest.fixture(scope='module')
def models():
    from tinycomp.pruning.structured import prune_channels
    from tinycomp.quantization.models import quantize_static
    cnn, wide = load_pretrained('digits_cnn'), load_pretrained('digits_cnn_wide')
    return dict(cnn=cnn, wide=wide, pruned=prune_channels(wide, 0.5, input_shape=(1, 1, 8, 8)).eval(),
                int8=quantize_static(cnn, CALIB))


def _props(m): return {p.key: p.value for p in m.metadata_props}


# --- the optional dependency -------------------------------------------------------------------------------

def test_core_and_cli_work_without_onnx(monkeypatch):
    for name in ('onnx', 'onnxruntime'): monkeypatch.setitem(sys.modules, name, None)   # `import onnx` now fails
    from tinycomp import onnx as tonnx
    with pytest.raises(TinycompError, match=r"needs? the onnx extra: pip install 'tinycomp\[onnx\]'"):
        tonnx.to_onnx(load_pretrained('digits_cnn'), (1, 1, 8, 8))
    with pytest.raises(TinycompError, match='tinycomp\\[onnx\\]'): tonnx.import_onnx(DATA / 'torch_cnn.onnx')
    parser = build_parser()                     # the commands are still discovered and listed
    sub = next(a for a in parser._actions if a.dest == 'command').choices
    assert {'export', 'import'} <= set(sub)


def test_package_does_not_import_onnx_at_import_time():
    import ast
    files = sorted((Path(tinycomp.__file__).parent / 'onnx').glob('*.py'))
    assert {f.name for f in files} >= {'__init__.py', 'export.py', 'importer.py', 'runtime.py', 'cli.py'}, files
    for f in files:
        tree = ast.parse(f.read_text())
        top = [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        top += [n.module or '' for n in tree.body if isinstance(n, ast.ImportFrom)]
        assert top and not any(m.split('.')[0] in ('onnx', 'onnxruntime') for m in top), (f.name, top)


# --- export: float models --------------------------------------------------------------------------------------

@pytest.mark.parametrize('key', ['cnn', 'wide', 'pruned'])
def test_float_models_match_onnx_runtime(models, key, tmp_path):
    p = export_onnx(models[key], tmp_path / 'm.onnx', (1, 1, 8, 8), name=key)
    r = ort_agreement(models[key], p, X_TEST)
    assert r['rel_err'] < 1e-5 and r['class_agreement'] == 1.0, r
    m = onnx.load(p)
    onnx.checker.check_model(m, full_check=True)
    props = _props(m)
    assert props['model_name'] == key and props['tinycomp_version'] == tinycomp.__version__ == m.producer_version
    assert json.loads(props['input_shape']) == ['N', 1, 8, 8] and props['input_dtype'] == 'float32'
    assert props['input_name'] == m.graph.input[0].name == 'input'


def test_pruned_model_is_smaller_in_onnx_too(models, tmp_path):
    full = export_onnx(models['wide'], tmp_path / 'w.onnx', (1, 1, 8, 8)).stat().st_size
    pruned = export_onnx(models['pruned'], tmp_path / 'p.onnx', (1, 1, 8, 8)).stat().st_size
    assert pruned < 0.5 * full


def _geometry_model(seed=0):
    manual_seed(seed)
    bn = BatchNorm2d(8)
    rng = np.random.default_rng(seed)
    bn.running_mean = rng.normal(size=8).astype(np.float32); bn.running_var = rng.uniform(0.5, 2, 8).astype(np.float32)
    bn.weight.data = rng.normal(1, 0.2, 8).astype(np.float32); bn.bias.data = rng.normal(0, 0.2, 8).astype(np.float32)
    bn._buffers['running_mean'] = bn.running_mean; bn._buffers['running_var'] = bn.running_var
    return Sequential(
        Conv2d(3, 8, (3, 5), stride=(1, 2), padding=(1, 2), dilation=(2, 1)), bn, Tanh(),
        Conv2d(8, 8, 3, padding=1, groups=4, bias=False), Sigmoid(),
        MaxPool2d(3, stride=2, padding=1), ReLU(),
        Sequential(Conv2d(8, 6, 1), AvgPool2d(2, stride=1, padding=1, count_include_pad=False)),
        AvgPool2d(2, padding=1), Linear(3, 5), Dropout(0.3), Flatten(), Linear(120, 7, bias=False)).eval()


def test_geometry_groups_dilation_pools_activations_match_and_round_trip(tmp_path):
    model = _geometry_model()
    shape = (2, 3, 12, 16)
    with no_grad(): assert model(Tensor(np.zeros(shape, np.float32))).shape == (2, 7)
    p = export_onnx(model, tmp_path / 'g.onnx', shape)
    ops = [n.op_type for n in onnx.load(p).graph.node]
    assert {'Conv', 'BatchNormalization', 'Tanh', 'Sigmoid', 'MaxPool', 'Relu', 'AveragePool', 'MatMul', 'Add',
            'Flatten', 'Gemm'} <= set(ops) and 'Dropout' not in ops
    X = np.random.default_rng(1).normal(size=(5,) + shape[1:]).astype(np.float32)
    r = ort_agreement(model, p, X)
    assert r['rel_err'] < 1e-5, r
    back = import_onnx(p)
    with no_grad(): test = back(Tensor(X)).data, model(Tensor(X)).data
    np.testing.assert_array_equal(*test)
    again = to_onnx(back, shape)
    assert again.graph.SerializeToString() == onnx.load(p).graph.SerializeToString()


def test_relu6_and_hardtanh_export_as_clip_and_come_back(tmp_path):
    from tinycomp.nn.modules import Hardtanh, ReLU6
    from tinycomp.quantization.models import quantize_static
    manual_seed(0)
    model = Sequential(Conv2d(1, 6, 3, padding=1), ReLU6(), Conv2d(6, 6, 3, padding=1), Hardtanh(-0.5, 0.75),
                       Flatten(), Linear(6 * 64, 10)).eval()
    X = X_TEST[:32] * 3                                      # every clamp holds somewhere
    p = export_onnx(model, tmp_path / 'c.onnx', (1, 1, 8, 8))
    assert [n.op_type for n in onnx.load(p).graph.node].count('Clip') == 2
    assert ort_agreement(model, p, X)['rel_err'] < 1e-5
    back = import_onnx(p)
    assert [type(m).__name__ for m in back.modules() if isinstance(m, Hardtanh)] == ['ReLU6', 'Hardtanh']
    with no_grad(): np.testing.assert_array_equal(back(Tensor(X)).data, model(Tensor(X)).data)
    q = quantize_static(model, X)
    assert [type(m).__name__ for m in q].count('QuantizedHardtanh') == 2
    for form in QUANTIZED_FORMS:
        m = to_onnx(q, (1, 1, 8, 8), quantized_form=form)
        with no_grad(): ours = q(Tensor(X)).data
        r = lsb_diff(ours, run_onnx(m, X), q[-1].scale)
        assert r['max_lsb'] <= 2 and r['lsb_within_1'] >= 0.99, (form, r)
    one_sided = _model([helper.make_node('Clip', ['x', 'lo'], ['y'], name='c')], [numpy_helper.from_array(np.float32(0), 'lo')])
    with pytest.raises(TinycompError, match="node 'c' \\(Clip\\): a Clip without a max bound"):
        import_onnx(_save(tmp_path, one_sided))


def test_adaptive_pool_export(tmp_path):
    manual_seed(0)
    for out, op in ((1, 'GlobalAveragePool'), (2, 'AveragePool')):
        model = Sequential(Conv2d(1, 4, 3, padding=1), AdaptiveAvgPool2d(out), Flatten()).eval()
        p = export_onnx(model, tmp_path / f'a{out}.onnx', (1, 1, 8, 8))
        assert op in [n.op_type for n in onnx.load(p).graph.node]
        assert ort_agreement(model, p, X_TEST[:50])['rel_err'] < 1e-5
    with pytest.raises(TinycompError, match='bins of different sizes'):
        to_onnx(Sequential(AdaptiveAvgPool2d(3)), (1, 1, 8, 8))


def test_export_at_other_opsets(models, tmp_path):
    for opset in (13, 21):
        for key in ('cnn', 'int8'):
            p = export_onnx(models[key], tmp_path / f'{key}{opset}.onnx', (1, 1, 8, 8), opset=opset)
            assert onnx.load(p).opset_import[0].version == opset
            r = ort_agreement(models[key], p, X_TEST[:64])
            assert r['class_agreement'] == 1.0 and (r['rel_err'] < 1e-5 if key == 'cnn' else r['lsb_within_1'] == 1.0)


def test_masked_sparse_and_half_layers_export_dense_with_a_note(models, tmp_path):
    from tinycomp.pruning.masks import prune
    from tinycomp.pruning.schedules import to_sparse
    from tinycomp.quantization.layers import HalfConv2d, HalfLinear
    masked = prune(models['cnn'], 0.7)
    sparse = to_sparse(masked, max_density=0.5)
    cnn = models['cnn']
    half = Sequential(HalfConv2d.from_float(cnn[0]), ReLU(), cnn[2], ReLU(), MaxPool2d(2), Flatten(),
                      HalfLinear.from_float(cnn[6])).eval()
    for name, model in (('masked', masked), ('sparse', sparse), ('half', half)):
        p = export_onnx(model.eval(), tmp_path / f'{name}.onnx', (1, 1, 8, 8))
        m = onnx.load(p)
        r = ort_agreement(model, p, X_TEST)
        assert r['rel_err'] < 1e-5 and r['class_agreement'] == 1.0, (name, r)
        if name == 'half':
            assert 'Cast' in [n.op_type for n in m.graph.node]
            assert any(t.data_type == TensorProto.FLOAT16 for t in m.graph.initializer)
        else:
            assert 'stored dense' in _props(m)['notes']
            w = numpy_helper.to_array(next(t for t in m.graph.initializer if t.name == 'l0.weight'))
            assert (w == 0).mean() > 0.5           # the zeros are in the file


# --- export: int8 models ---------------------------------------------------------------------------------------

@pytest.mark.parametrize('form', QUANTIZED_FORMS)
def test_int8_model_matches_onnx_runtime(models, form, tmp_path):
    q = models['int8']
    p = export_onnx(q, tmp_path / f'{form}.onnx', (1, 1, 8, 8), quantized_form=form)
    r = ort_agreement(q, p, X_TEST)
    assert r['lsb_within_1'] >= 0.999 and r['max_lsb'] <= 1 and r['class_agreement'] == 1.0, r
    m = onnx.load(p)
    ops = [n.op_type for n in m.graph.node]
    if form == 'qdq':
        assert ops.count('DequantizeLinear') >= 3 and 'QLinearConv' not in ops and 'Conv' in ops
    else:
        assert ops.count('QLinearConv') == 3 and 'Conv' not in ops   # the linear layer (with bias): a 1x1 QLinearConv
    inits = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    w = inits['l1.weight']                             # the first QuantizedConv2d: uint8 = int8 + 128, zero point 128
    assert w.dtype == np.uint8 and np.array_equal(w.astype(np.int32) - 128, q[1].int_weight())
    assert (inits['l1.weight_zero_point'] == 128).all() and inits['l1.bias'].dtype == np.int32
    assert _props(m)['int8_types'] == 'activations uint8, weights uint8'


def _odd_int8_model():
    "Per-tensor int4 weights, a standalone ReLU, average pools and a bias-free Linear (QLinearMatMul)."
    from tinycomp.quantization.models import quantize_static
    manual_seed(3)
    model = Sequential(Conv2d(1, 6, 3, padding=1), MaxPool2d(2), ReLU(), Conv2d(6, 8, 3, padding=1), ReLU(),
                       AvgPool2d(2), AdaptiveAvgPool2d(1), Flatten(), Linear(8, 10, bias=False)).eval()
    from tinycomp.models import fit
    from tinycomp.data import DataLoader
    fit(model, DataLoader(*load_digits('train'), batch_size=64, shuffle=True, seed=0), epochs=2, progress=False)
    return quantize_static(model.eval(), CALIB, per_channel=False, weight_bits=4)


def test_int8_pools_relu_int4_per_tensor_and_qlinearmatmul(tmp_path):
    """Each int8 layer of a model with per-tensor int4 weights, a standalone ReLU, average pools and a bias-free Linear,
    exported alone between stubs and fed int8 values exactly on its input grid (so both sides see the same integers):
    within 1 LSB of ours. (End to end, 1-LSB differences of early layers grow in later ones at such small scales.)"""
    from tinycomp.quantization.layers import (DeQuantStub, QuantizedAdaptiveAvgPool2d, QuantizedAvgPool2d, QuantizedReLU,
                                              QuantStub)
    q = _odd_int8_model()
    assert {QuantizedReLU, QuantizedAvgPool2d, QuantizedAdaptiveAvgPool2d} <= {type(l) for l in q}
    rng = np.random.default_rng(0)
    shapes, x = [], Tensor(X_TEST[:8])
    with no_grad():
        for layer in q: shapes.append(x.shape); x = layer(x)
    qp = (q[0].scale, q[0].zero_point)
    seen = set()
    for k in range(1, len(q) - 1):
        layer = q[k]
        out_qp = (layer.output_scale, layer.output_zero_point) if hasattr(layer, 'output_scale') else qp
        sub = Sequential(QuantStub(*qp), layer, DeQuantStub(*out_qp)).eval()
        ints = rng.integers(-128, 128, size=(64,) + tuple(shapes[k][1:]))
        X = ((ints - qp[1]) * np.float32(qp[0])).astype(np.float32)
        for form in QUANTIZED_FORMS:
            m = to_onnx(sub, X.shape, quantized_form=form)
            seen |= {n.op_type for n in m.graph.node}
            with no_grad(): ours = sub(Tensor(X)).data
            r = lsb_diff(ours.reshape(64, -1), run_onnx(m, X).reshape(64, -1), out_qp[0])
            assert r['lsb_within_1'] >= 0.999 and r['max_lsb'] <= 1, (k, type(layer).__name__, form, r)
        qp = out_qp
    assert {'Max', 'QLinearMatMul', 'AveragePool', 'GlobalAveragePool', 'MaxPool', 'QLinearConv'} <= seen


def test_dynamic_quantized_linear_export(models, tmp_path):
    from tinycomp.quantization.models import quantize_dynamic
    dq = quantize_dynamic(models['cnn'])
    p = export_onnx(dq, tmp_path / 'dyn.onnx', (1, 1, 8, 8))
    assert {'DynamicQuantizeLinear', 'MatMulInteger'} <= {n.op_type for n in onnx.load(p).graph.node}
    r = ort_agreement(dq, p, X_TEST)
    assert r['rel_err'] < 1e-3 and r['class_agreement'] == 1.0, r


def test_int8_is_exact_on_avx2_kernels_under_emulation(models, tmp_path, qemu_x86):
    """ORT's kernels on an emulated AVX2-only CPU (QEMU user mode, Haswell): the exported forms stay within 1 LSB.
    The emulated process must see AVX2 and no AVX-512 (NumPy's CPU feature detection, i.e. cpuid, inside it), so ORT
    picks its AVX2 kernels there. The int8 x int8 QDQ form, which saturated ORT's int16 intermediate on such a CPU
    (up to 22 LSB when this was written), is reported for information, not asserted: a fix in ORT must not fail us."""
    import subprocess, sys
    probe = ("import numpy as np; core = getattr(np, '_core', None) or np.core; "
             "f = core._multiarray_umath.__cpu_features__; print(f['AVX2'], f['AVX512F'])")
    seen = subprocess.run([shutil.which('qemu-x86_64'), '-cpu', 'Haswell', sys.executable, '-c', probe],
                          capture_output=True, text=True, check=True).stdout.split()
    assert seen == ['True', 'False'], f"the emulated CPU should have AVX2 and no AVX-512F, it reports {seen}"
    q = models['int8']
    paths = [export_onnx(q, tmp_path / f'{f}.onnx', (1, 1, 8, 8), quantized_form=f) for f in QUANTIZED_FORMS]
    paths.append(export_onnx(q, tmp_path / 'trap.onnx', (1, 1, 8, 8), quantized_form='qdq', int8_types=('int8', 'int8')))
    with no_grad(): ours = q(Tensor(X_TEST)).data
    outs = run_onnx_emulated(paths, X_TEST)
    scale = q[-1].scale
    for form, out in zip(QUANTIZED_FORMS, outs):
        r = lsb_diff(ours, out, scale)
        assert r['lsb_within_1'] >= 0.999 and r['max_lsb'] <= 1 and r['class_agreement'] == 1.0, (form, r)
    print('int8 x int8 QDQ on the emulated AVX2 CPU (not our export form):', lsb_diff(ours, outs[2], scale))


@pytest.mark.slow
def test_a_pytorch_model_is_compressed_by_the_pipeline(tmp_path):
    "The model trained in PyTorch goes through module 07's pipeline: channels pruned, distilled, int8; measured; exported."
    from tinycomp.benchmarking import compress
    model = import_onnx(DATA / 'torch_cnn.onnx').eval()
    recipe = [{'prune_channels': {'ratio': 0.5}}, {'distill': {'teacher': 'original', 'epochs': 2}},
              {'quantize_static': {'per_channel': True}}]
    final, report = compress(model, recipe, progress=False, rounds=2, calls=1)
    assert [r['stage'] for r in report.rows] == ['original', 'prune_channels', 'distill', 'quantize_static']
    last = report.rows[-1]
    assert last['compression'] > 4 and last['accuracy'] > 0.95 and last['dacc_points'] > -3, report.table()
    assert type(final[1]).__name__ == 'QuantizedConv2d'
    path = export_onnx(final, tmp_path / 'compressed.onnx', (1, 1, 8, 8))      # and back out to ONNX Runtime
    r = ort_agreement(final, path, X_TEST)
    assert r['class_agreement'] >= 0.99, r


def test_export_errors(models):
    assert [n.op_type for n in to_onnx(Conv2d(1, 2, 3), (1, 1, 8, 8)).graph.node] == ['Conv']   # a single layer is a graph too

    class Odd(Module):
        def forward(self, x): return x * 1
    with pytest.raises(TinycompError, match=r"cannot export node '1' \(Odd\).*export_onnx"): to_onnx(Sequential(ReLU(), Odd()), (1, 3))
    with pytest.raises(TinycompError, match='opset'): to_onnx(models['cnn'], (1, 1, 8, 8), opset=9)
    with pytest.raises(TinycompError, match='quantized_form'): to_onnx(models['cnn'], (1, 1, 8, 8), quantized_form='int8')
    with pytest.raises(TinycompError, match='int8_types'): to_onnx(models['int8'], (1, 1, 8, 8), int8_types=('int4', 'int8'))
    with pytest.raises(TinycompError, match='input_shape'): to_onnx(models['cnn'], (0, 1, 8, 8))
    with pytest.raises(TinycompError, match='does not run'): to_onnx(models['cnn'], (1, 3, 8, 8))
    with pytest.raises(TinycompError, match='DeQuantStub'): to_onnx(models['int8'][:-1], (1, 1, 8, 8))


def test_export_is_atomic_and_deterministic(models, tmp_path):
    a = export_onnx(models['int8'], tmp_path / 'a.onnx', (1, 1, 8, 8)).read_bytes()
    b = export_onnx(models['int8'], tmp_path / 'b.onnx', (1, 1, 8, 8)).read_bytes()
    assert a == b and sorted(os.listdir(tmp_path)) == ['a.onnx', 'b.onnx']


# --- import ------------------------------------------------------------------------------------------------

def test_export_import_export_is_stable(models, tmp_path):
    for key in ('cnn', 'wide', 'pruned'):
        first = to_onnx(models[key], (1, 1, 8, 8), name=key)
        p = tmp_path / f'{key}.onnx'
        p.write_bytes(first.SerializeToString())
        back = import_onnx(p)
        assert not any(isinstance(l, Dropout) for l in back)
        with no_grad(): np.testing.assert_array_equal(back(Tensor(X_TEST)).data, models[key].eval()(Tensor(X_TEST)).data)
        assert to_onnx(back, (1, 1, 8, 8), name=key).SerializeToString() == first.SerializeToString()
        assert back.onnx_info['producer'] == 'tinycomp' and back.onnx_info['input_shape'] == ['N', 1, 8, 8]


def test_pytorch_export_imports_with_pytorchs_outputs():
    path = DATA / 'torch_cnn.onnx'
    assert path.stat().st_size < 200_000 and (DATA / 'torch_cnn_io.npz').stat().st_size < 200_000
    io = np.load(DATA / 'torch_cnn_io.npz', allow_pickle=False)
    np.testing.assert_array_equal(io['inputs'], X_TEST[:len(io['inputs'])])    # normalized as load_digits does
    model = import_onnx(path)
    assert model.onnx_info['producer'] == 'pytorch'
    assert [type(l).__name__ for l in model] == ['Conv2d', 'BatchNorm2d', 'ReLU', 'Conv2d', 'BatchNorm2d', 'ReLU',
                                                 'MaxPool2d', 'Flatten', 'Linear', 'ReLU', 'Linear']
    with no_grad(): out = model(Tensor(io['inputs'])).data
    ref = io['outputs']
    assert np.abs(out - ref).max() <= 1e-5 * np.abs(ref).max()
    assert abs(evaluate(model, (X_TEST, Y_TEST)).accuracy - float(io['test_accuracy'])) < 1e-9


def test_imported_pytorch_model_compresses_with_the_course_tools(tmp_path):
    from tinycomp.io import load, save
    from tinycomp.pruning.structured import prune_channels
    from tinycomp.quantization.models import quantize_static
    model = import_onnx(DATA / 'torch_cnn.onnx')
    base = evaluate(model, (X_TEST, Y_TEST)).accuracy
    pruned = prune_channels(model, 0.25, input_shape=(1, 1, 8, 8))
    q = quantize_static(model, CALIB)
    assert sum(p.data.size for p in pruned.parameters()) < sum(p.data.size for p in model.parameters())
    assert evaluate(q, (X_TEST, Y_TEST)).accuracy > base - 0.03
    loaded = load(save(q, tmp_path / 'q.npz'))
    r = ort_agreement(loaded, export_onnx(loaded, tmp_path / 'q.onnx', (1, 1, 8, 8)), X_TEST)
    assert r['lsb_within_1'] >= 0.999 and r['class_agreement'] >= 0.99, r     # a 1-LSB difference may flip a near tie


# crafted files -----------------------------------------------------------------------------------------------

def _model(nodes, inits=(), in_shape=(None, 3), out_shape=(None, 3), inputs=None, opset=17, **kw):
    g = helper.make_graph(nodes, 'g', inputs or [helper.make_tensor_value_info('x', TensorProto.FLOAT, list(in_shape))],
                          [helper.make_tensor_value_info('y', TensorProto.FLOAT, list(out_shape))], list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid('', opset)], ir_version=8, **kw)


def _save(tmp_path, m, name='m.onnx'):
    p = tmp_path / name
    p.write_bytes(m.SerializeToString())
    return p


def _mm(w_name='w'): return helper.make_node('MatMul', ['x', w_name], ['y'], name='mm')


def _external(name, location, offset=0, length=36, shape=(3, 3)):
    t = numpy_helper.from_array(np.ones(shape, np.float32), name)
    t.ClearField('raw_data')
    t.data_location = TensorProto.EXTERNAL
    for k, v in (('location', location), ('offset', str(offset)), ('length', str(length))): t.external_data.add(key=k, value=v)
    return t


def test_import_reads_external_data_inside_its_folder(tmp_path):
    w = np.arange(9, dtype=np.float32).reshape(3, 3)
    (tmp_path / 'weights.bin').write_bytes(b'\0' * 8 + w.tobytes())
    p = _save(tmp_path, _model([_mm()], [_external('w', 'weights.bin', offset=8)]))
    model = import_onnx(p)
    np.testing.assert_array_equal(model[0].weight.data, w.T)


def test_import_rejects_external_data_outside_or_inconsistent(tmp_path):
    folder = tmp_path / 'model'; folder.mkdir()
    secret = tmp_path / 'secret.bin'; secret.write_bytes(b'\1' * 64)
    (folder / 'link.bin').symlink_to(secret)
    (folder / 'short.bin').write_bytes(b'\0' * 20)
    (folder / 'ok.bin').write_bytes(b'\0' * 36)
    cases = [('../secret.bin', 0, 36, 'inside the model'), (str(secret), 0, 36, 'inside the model'),
             ('link.bin', 0, 36, 'resolves outside'), ('short.bin', 0, 36, 'does not fit'),
             ('ok.bin', 4, 36, 'does not fit'), ('ok.bin', 0, 32, 'does not fit'), ('missing.bin', 0, 36, 'missing'),
             ('', 0, 36, 'relative path')]
    for loc, off, length, msg in cases:
        p = _save(folder, _model([_mm()], [_external('w', loc, off, length)]))
        with pytest.raises(TinycompError, match=msg): import_onnx(p)


def test_import_rejects_malformed_and_huge_files(tmp_path):
    def rejects(m_or_bytes, msg, **kw):
        p = tmp_path / 'x.onnx'
        p.write_bytes(m_or_bytes if isinstance(m_or_bytes, bytes) else m_or_bytes.SerializeToString())
        with pytest.raises(TinycompError, match=msg): import_onnx(p, **kw)
    rejects(b'', 'not an ONNX model')
    rejects(b'\x89PNG\r\n\x1a\n' + bytes(range(256)) * 4, 'not an ONNX model')
    rejects((Path(tinycomp.__file__).parent / 'pretrained' / 'digits_cnn.npz').read_bytes(), 'not an ONNX model')
    good = _model([_mm()], [numpy_helper.from_array(np.ones((3, 3), np.float32), 'w')])
    rejects(good, 'more than the 100 allowed', max_bytes=100)
    short = numpy_helper.from_array(np.ones((3, 3), np.float32), 'w'); short.raw_data = short.raw_data[:20]
    rejects(_model([_mm()], [short]), r'stores 20 bytes')
    typed = TensorProto(name='w', data_type=TensorProto.FLOAT, dims=[3, 3]); typed.float_data.extend([1.0] * 5)
    rejects(_model([_mm()], [typed]), 'stores 5 values')
    huge = TensorProto(name='w', data_type=TensorProto.FLOAT, dims=[10**6, 10**6])
    rejects(_model([_mm()], [huge]), 'more than the')
    rejects(_model([_mm()], [numpy_helper.from_array(np.ones((3, 3), np.float32), 'w')], in_shape=(1, 10**6, 10**6),
                   out_shape=(1, 10**6, 3)), 'values per sample')
    rejects(_model([_mm()], [numpy_helper.from_array(np.ones((3, 3), np.float32), 'w')], in_shape=('N', 'F')),
            'fixed positive sizes')
    neg = TensorProto(name='w', data_type=TensorProto.FLOAT, dims=[-3, 3]); neg.float_data.extend([1.0] * 9)
    rejects(_model([_mm()], [neg]), 'negative')
    strs = TensorProto(name='w', data_type=TensorProto.STRING, dims=[1]); strs.string_data.append(b'x')
    rejects(_model([_mm()], [strs]), 'element type')
    nan = numpy_helper.from_array(np.full((3, 3), np.nan, np.float32), 'w')
    rejects(_model([_mm()], [nan]), 'NaN')
    bad_shape = numpy_helper.from_array(np.ones((4, 3), np.float32), 'w')     # does not fit the input (N, 3)
    rejects(_model([_mm()], [bad_shape]), 'not a valid ONNX model|does not fit')


def test_import_rejects_unsupported_graphs_naming_op_and_node(tmp_path):
    w = numpy_helper.from_array(np.ones((3, 3), np.float32), 'w')
    conv_w = numpy_helper.from_array(np.ones((2, 1, 3, 3), np.float32), 'cw')
    img = dict(in_shape=('N', 1, 8, 8), out_shape=('N', 2, 8, 8))
    cases = [
        (_model([helper.make_node('Erf', ['x'], ['y'], name='erf')]), "node 'erf' \\(Erf\\): operator Erf is not supported"),
        (_model([helper.make_node('MatMul', ['x', 'x'], ['y'], name='square')]), "node 'square' \\(MatMul\\): it reads 2 tensors"),
        (_model([helper.make_node('Conv', ['x', 'cw'], ['y'], name='c', pads=[1, 1, 2, 2])], [conv_w], ('N', 1, 8, 8), ('N', 2, 9, 9)),
         "node 'c' \\(Conv\\).*symmetrically"),
        (_model([helper.make_node('Conv', ['x', 'cw'], ['y'], name='c', auto_pad='SAME_UPPER')], [conv_w], **img), 'auto_pad=SAME_UPPER'),
        (_model([helper.make_node('MaxPool', ['x'], ['y'], name='p', kernel_shape=[3, 3], ceil_mode=1)], [], ('N', 1, 8, 8), ('N', 1, 6, 6)),
         "node 'p' \\(MaxPool\\): ceil_mode=1"),
        (_model([helper.make_node('Gemm', ['x', 'w'], ['y'], name='g', alpha=2.0)], [w]), "node 'g' \\(Gemm\\): only Gemm with alpha"),
        (_model([helper.make_node('Flatten', ['x'], ['y'], name='f', axis=2)], [], ('N', 1, 8, 8), ('M', 64)), 'axis=2'),
        (_model([helper.make_node('Reshape', ['x', 's'], ['y'], name='r')], [numpy_helper.from_array(np.array([0, 8, 8], np.int64), 's')],
                ('N', 1, 8, 8), ('N', 8, 8)), "node 'r' \\(Reshape\\).*flatten"),
        (_model([helper.make_node('Relu', ['x'], ['y'])], inputs=[helper.make_tensor_value_info('x', TensorProto.INT64, ['N', 3])]),
         'must be float32'),
        (_model([helper.make_node('Relu', ['x'], ['y'])], inputs=[helper.make_tensor_value_info('x', TensorProto.FLOAT, ['N', 3]),
                                                                   helper.make_tensor_value_info('z', TensorProto.FLOAT, ['N', 3])]),
         '2 inputs'),
    ]
    for m, msg in cases:
        with pytest.raises(TinycompError, match=msg): import_onnx(_save(tmp_path, m))
    custom = _model([helper.make_node('Foo', ['x'], ['y'], domain='evil.ops')])
    custom.opset_import.append(helper.make_opsetid('evil.ops', 1))
    with pytest.raises(TinycompError, match='custom operator domains'): import_onnx(_save(tmp_path, custom))


def test_graphs_not_chains_match_onnx_runtime_float_pruned_and_int8(tmp_path):
    "A residual block, a depthwise-separable branch concatenated with it, a ResNet and a MobileNet-style net: float, pruned, int8."
    from graph_models import trained_quantizable
    from tinycomp.models import digits_mobilenet, digits_resnet
    from tinycomp.pruning.structured import prune_channels
    from tinycomp.quantization.models import quantize_static
    manual_seed(0)
    nets = dict(branches=trained_quantizable(epochs=2), resnet=digits_resnet().eval(), mobilenet=digits_mobilenet().eval())
    for name, net in nets.items():
        for label, model in (('float', net), ('pruned', prune_channels(net, 0.5, input_shape=(1, 1, 8, 8)).eval())):
            r = ort_agreement(model, export_onnx(model, tmp_path / f'{name}_{label}.onnx', (1, 1, 8, 8)), X_TEST)
            assert r['rel_err'] <= 1e-5, (name, label, r)
        q = quantize_static(net, CALIB)
        assert type(q).__name__ == 'Graph'
        for form in QUANTIZED_FORMS:
            p = export_onnx(q, tmp_path / f'{name}_int8_{form}.onnx', (1, 1, 8, 8), quantized_form=form)
            r = ort_agreement(q, p, X_TEST)
            # each integer layer rounds TFLite's way (a doubling high multiply, then a rounding shift: two roundings),
            # ORT in float (one): about 0.1-1 % of a layer's outputs differ by 1 LSB, and the differences compound
            # through the layers of a deep net (measured per layer in tests/bench_graph_models.py)
            assert r['lsb_within_1'] >= 0.99 and r['max_lsb'] <= 2 and r['class_agreement'] >= 0.99, (name, form, r)
            ops = [n.op_type for n in onnx.load(p).graph.node]
            assert ops.count('Add') + ops.count('Concat') >= 1, ops


def test_graphs_export_import_export_is_stable(tmp_path):
    from graph_models import BranchyNet, images, trained_like
    from tinycomp.models import digits_resnet
    from tinycomp.graph import trace
    manual_seed(0)
    for model, shape in ((trained_like(BranchyNet()), (1, 1, 8, 8)), (digits_resnet().eval(), (1, 1, 8, 8))):
        first = to_onnx(model, shape, name='m')
        p = tmp_path / 'm.onnx'; p.write_bytes(first.SerializeToString())
        back = import_onnx(p)
        assert type(back).__name__ == 'Graph'
        x = images(5, seed=2)
        with no_grad(): np.testing.assert_allclose(back(Tensor(x)).data, model(Tensor(x)).data, rtol=1e-5, atol=1e-6)
        assert to_onnx(back, shape, name='m').graph.SerializeToString() == first.graph.SerializeToString()
        assert trace(back, images(1)).nodes.keys() == back.nodes.keys()


def test_a_pytorch_resnet_imports_with_pytorchs_outputs(tmp_path):
    "Residual adds, a strided downsample branch, a BatchNorm after an add and an Identity of an initializer (PyTorch's dedup)."
    path = DATA / 'torch_resnet.onnx'
    assert path.stat().st_size < 200_000 and (DATA / 'torch_resnet_io.npz').stat().st_size < 200_000
    m = onnx.load(path)
    assert any(n.op_type == 'Identity' and n.input[0] in {t.name for t in m.graph.initializer} for n in m.graph.node)
    io = np.load(DATA / 'torch_resnet_io.npz', allow_pickle=False)
    np.testing.assert_array_equal(io['inputs'], X_TEST[:len(io['inputs'])])
    model = import_onnx(path)
    assert type(model).__name__ == 'Graph' and model.onnx_info['producer'] == 'pytorch'
    ops = [n.op for n in model]
    assert ops.count('Add') == 2 and ops.count('BatchNorm2d') == 7 and model['post_bn'].inputs == ('layer2_relu_1',)
    with no_grad(): out = model(Tensor(io['inputs'])).data
    assert np.abs(out - io['outputs']).max() <= 1e-5 * np.abs(io['outputs']).max()
    assert abs(evaluate(model, (X_TEST, Y_TEST)).accuracy - float(io['test_accuracy'])) < 1e-9
    from tinycomp.io import load, save
    back = load(save(model, tmp_path / 'resnet.npz')).eval()             # a graph saves and loads like any model
    with no_grad(): np.testing.assert_array_equal(back(Tensor(X_TEST[:8])).data, model(Tensor(X_TEST[:8])).data)


def test_import_handles_constants_matmul_bias_and_flattening_reshape(tmp_path):
    rng = np.random.default_rng(0)
    cw, cb = rng.normal(size=(4, 1, 3, 3)).astype(np.float32), rng.normal(size=(4,)).astype(np.float32)
    w, b = rng.normal(size=(4 * 8 * 8, 5)).astype(np.float32), rng.normal(size=(5,)).astype(np.float32)
    nodes = [helper.make_node('Constant', [], ['cw'], value=numpy_helper.from_array(cw)),
             helper.make_node('Conv', ['x', 'cw'], ['c'], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node('Add', ['c', 'cb'], ['cbias']),
             helper.make_node('Identity', ['cbias'], ['i']),
             helper.make_node('Reshape', ['i', 'shape'], ['f']),
             helper.make_node('MatMul', ['f', 'w'], ['h']),
             helper.make_node('Add', ['h', 'b'], ['y'])]
    inits = [numpy_helper.from_array(cb.reshape(1, 4, 1, 1), 'cb'), numpy_helper.from_array(np.array([0, -1], np.int64), 'shape'),
             numpy_helper.from_array(w, 'w'), numpy_helper.from_array(b, 'b')]
    p = _save(tmp_path, _model(nodes, inits, ('N', 1, 8, 8), ('N', 5)))
    model = import_onnx(p)
    assert [type(l).__name__ for l in model] == ['Conv2d', 'Flatten', 'Linear']
    X = rng.normal(size=(3, 1, 8, 8)).astype(np.float32)
    with no_grad(): ours = model(Tensor(X)).data
    np.testing.assert_allclose(ours, run_onnx(p, X), rtol=1e-5, atol=1e-5)


# --- commands and benchmark ---------------------------------------------------------------------------------

def test_cli_export_and_import(models, tmp_path, writes_only, capsys):
    from tinycomp.io import load, save
    f = save(models['int8'], tmp_path / 'q.npz')
    assert main(['export', str(f), '--form', 'qlinear']) == 0                              # --out tinycomp_export
    out = capsys.readouterr().out
    assert 'QLinearConv' in out and 'onnx.checker (full) passed' in out
    assert writes_only.check(out, 'tinycomp_export') == ['tinycomp_export/q.onnx']
    assert main(['export', 'digits_cnn_wide', '--out', 'onnx', '--input-shape', '2,1,8,8']) == 0
    assert writes_only.check(capsys.readouterr().out, 'onnx') == ['onnx/digits_cnn_wide.onnx']
    assert main(['import', 'onnx/digits_cnn_wide.onnx']) == 0                             # --out tinycomp_import
    out = capsys.readouterr().out
    assert 'imported 14 layers' in out and writes_only.check(out, 'tinycomp_import') == ['tinycomp_import/digits_cnn_wide.npz']
    back = load('tinycomp_import/digits_cnn_wide.npz').eval()
    with no_grad(): np.testing.assert_array_equal(back(Tensor(X_TEST)).data, models['wide'](Tensor(X_TEST)).data)
    for argv, msg in ((['export', 'nope.npz', '--out', 'x'], 'neither a shipped model'),
                      (['export', 'digits_cnn', '--out', 'x', '--input-shape', '1,a'], 'integers'),
                      (['export', 'digits_cnn', '--out', str(f)], 'exists and is not a directory'),
                      (['import', str(f), '--out', 'x'], 'not an ONNX model'),
                      (['import', 'onnx/digits_cnn_wide.onnx', '--out', 'x', '--max-bytes', '10'], 'allowed')):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith('tinycomp: error:') and msg in err and err.count('\n') == 1, err
    assert not (writes_only.cwd / 'x').exists()                                           # a failed command leaves no folder


def test_bench_onnx_command(monkeypatch, tmp_path, capsys):
    from tinycomp.onnx import runtime as tonnx
    from tinycomp.data import load_shipped
    from tinycomp.models import model_data
    asked = []
    def float_only(names):          # the float rows only, to keep the test short
        asked.append(list(names))
        return [(n, 'float32', load_pretrained(n), load_shipped(model_data(n), 'test')[0]) for n in names[:1]]
    monkeypatch.setattr(tonnx, '_bench_models', float_only)
    path = tmp_path / 'bench.json'
    assert main(['bench', 'onnx', '--repeats', '2', '--threads', '1', '--json', str(path)]) == 0
    out = capsys.readouterr().out
    assert 'eager/ORT' in out and 'frozen/ORT' in out and 'b64 ORT ms' in out
    assert asked == [['digits_cnn', 'digits_cnn_wide', 'resnet8', 'mobilenet_v2_tiny', 'ds_cnn']]
    assert main(['bench', 'onnx', '--repeats', '2', '--threads', '1', '--model', 'ds_cnn', '--model', 'resnet8']) == 0
    assert asked[-1] == ['ds_cnn', 'resnet8'] and 'ds_cnn' in capsys.readouterr().out     # 28x28 inputs, its own data
    res = json.loads(path.read_text())
    assert res['meta']['ort_intra_op_threads'] == 1 and res['meta']['threads']['numba'] == 1
    lat = res['rows'][0]['latency']
    assert set(lat) == {'1', '64'} and all(v['ours'] > 0 and v['frozen'] > 0 and v['ort'] > 0 for v in lat.values())
    assert abs(lat['1']['ratio'] - lat['1']['ours'] / lat['1']['ort']) < 1e-12
    assert abs(lat['64']['frozen_ratio'] - lat['64']['frozen'] / lat['64']['ort']) < 1e-12
