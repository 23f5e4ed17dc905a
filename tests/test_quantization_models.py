"""Tests for tinycomp.quantization.layers, .models and .analysis: integer-only layers and models, model files, QAT,
mixed precision, bench."""
import copy
import json
import subprocess
import sys

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.io import model_size
from tinycomp.batchnorm import BatchNorm2d
from tinycomp.conv import Conv2d
from tinycomp.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from tinycomp.data import DataLoader, load_digits
from tinycomp.errors import ModelFileError, TinycompError, TinycompWarning
from tinycomp.models import evaluate, fit, load_pretrained
from tinycomp.nn.modules import Dropout, Flatten, Linear, Module, ReLU, Sequential, Sigmoid, Tanh
from tinycomp.optim import Adam
from tinycomp.quantization import analysis as A, layers as L, models as Q
from tinycomp.quantization.core import pack_int4, sqnr, unpack_int4
from tinycomp.tensor import Tensor, manual_seed, no_grad

pytestmark = pytest.mark.module04


@pytest.fixture(scope='module')
def digits():
    Xtr, ytr = load_digits('train')
    return dict(calib=Xtr[:128], train=(Xtr, ytr), test=load_digits('test'), val=load_digits('val'))


@pytest.fixture(scope='module')
def cnn(): return load_pretrained('digits_cnn')


@pytest.fixture(scope='module')
def wide(): return load_pretrained('digits_cnn_wide')


@pytest.fixture(scope='module')
def q8(cnn, digits): return Q.quantize_static(cnn, digits['calib'])


def snapshot(m): return {k: v.copy() for k, v in m.state_dict().items()}


def same_state(a, b): return list(a) == list(b) and all(np.array_equal(a[k], b[k]) and a[k].dtype == b[k].dtype for k in a)


def small_cnn(seed=0):
    "Every supported layer kind, nested, with BatchNorm statistics that are not the defaults."
    manual_seed(seed)
    m = Sequential(Conv2d(1, 4, 3, padding=1, bias=False), BatchNorm2d(4), ReLU(),
                   Sequential(Conv2d(4, 6, 3, padding=1, groups=2), ReLU(), MaxPool2d(2)),
                   Conv2d(6, 8, 1), AvgPool2d(2), ReLU(), AdaptiveAvgPool2d(1), Flatten(), Dropout(0.2), Linear(8, 5))
    bn = m[1]
    bn._buffers['running_mean'] = np.linspace(-0.5, 0.5, 4).astype(np.float32)
    bn._buffers['running_var'] = np.linspace(0.5, 2, 4).astype(np.float32)
    bn.weight.data = np.array([1.5, -0.7, 1.0, 0.3], np.float32)
    return m.eval()


# ---------------------------------------------------------------- integer-only inference
def test_static_int8_accuracy_and_dtypes(cnn, q8, digits):
    X, y = digits['test']
    assert evaluate(q8, (X, y)).accuracy >= evaluate(cnn, (X, y)).accuracy - 0.01
    seen = []
    hooks = [m.register_forward_hook(lambda mod, a, o: seen.append((type(mod), L._data(a[0]).dtype, L._data(o).dtype)))
             for m in q8]
    q8(Tensor(X[:7]))
    for h in hooks: h.remove()
    assert seen[0][0] is L.QuantStub and seen[-1][0] is L.DeQuantStub
    assert all(din == np.int8 for _, din, _ in seen[1:])              # between the stubs: int8 in ...
    assert all(dout == np.int8 for _, _, dout in seen[:-1])           # ... and int8 out
    assert seen[-1][2] == np.float32 and seen[0][1] == np.float32


def test_every_supported_layer_kind_and_lsb_agreement(digits):
    m = small_cnn()
    before = snapshot(m)
    q = Q.quantize_static(m, DataLoader(*digits['train'], batch_size=50), per_channel=True)
    assert same_state(before, snapshot(m))
    kinds = [type(l).__name__ for l in q]
    assert kinds == ['QuantStub', 'QuantizedConv2d', 'QuantizedConv2d', 'QuantizedMaxPool2d', 'QuantizedConv2d',
                     'QuantizedAvgPool2d', 'QuantizedReLU', 'QuantizedAdaptiveAvgPool2d', 'Flatten', 'QuantizedLinear',
                     'DeQuantStub']
    assert q[1].relu and q[2].relu and not q[4].relu and q[2].groups == 2
    agree = A.lsb_agreement(q, digits['test'][0])
    # 1-LSB differences in early layers (ties of the integer average pool, the fixed-point multiplier) propagate
    # through four more layers of this random network; the digits models are held to 99.9 % below
    assert agree['within_1'] >= 0.95 and agree['max_diff'] <= 4
    rep = A.quantization_report(m, q, digits['test'][0][:64])
    assert [r['kind'] for r in rep] == ['conv', 'conv', 'maxpool', 'conv', 'avgpool', 'relu', 'adaptive', 'flatten', 'linear']
    assert all(r['sqnr_db'] > 15 for r in rep)


@pytest.mark.parametrize('name', ['digits_cnn', 'digits_cnn_wide'])
def test_integer_path_matches_fake_quant_simulation(name, digits):
    q = Q.quantize_static(load_pretrained(name), digits['calib'])
    X = digits['test'][0]
    agree = A.lsb_agreement(q, X)
    assert agree['n'] == len(X) * 10 and agree['within_1'] >= 0.999 and agree['max_diff'] <= 2
    from tinycomp.tensor import default_generator
    state = default_generator().bit_generator.state
    sim = A.simulate(q)
    assert default_generator().bit_generator.state == state          # seeded runs undisturbed
    assert all(type(l).__name__ not in ('QuantStub', 'DeQuantStub') for l in sim)


def test_per_tensor_and_int4_weights(cnn, digits):
    qt = Q.quantize_static(cnn, digits['calib'], per_channel=False)
    mult, shift = qt[1].requant_params()
    assert qt[1].weight_scale.shape == (1,) and mult.shape == shift.shape == (16,)
    assert len(set(mult.tolist())) == 1                               # one scale: one multiplier for every channel
    q4 = Q.quantize_static(cnn, digits['calib'], weight_bits=4)
    conv = q4[2]
    assert conv.weight.dtype == np.uint8 and conv.weight.shape == ((32 * 16 * 9 + 1) // 2,)
    w = conv.int_weight()
    assert w.dtype == np.int8 and w.shape == (32, 16, 3, 3) and np.abs(w).max() == 7
    assert conv.int_weight() is w                                     # unpacked once
    X, y = digits['test']
    assert evaluate(q4, (X, y)).accuracy > 0.9


def test_model_is_not_modified_and_new_models_returned(wide, digits):
    before = snapshot(wide)
    for fn in (lambda: Q.quantize_static(wide, digits['calib']), lambda: Q.quantize_dynamic(wide),
               lambda: Q.prepare_qat(wide, weight_bits=4)):
        out = fn()
        assert out is not wide and same_state(before, snapshot(wide))
    assert wide.training is False


# ---------------------------------------------------------------- bad input
def test_calibration_errors(cnn, digits):
    with pytest.raises(TinycompError, match="empty calibration"): Q.quantize_static(cnn, [])
    with pytest.raises(TinycompError, match="empty calibration"): Q.quantize_static(cnn, DataLoader(np.zeros((0, 1, 8, 8), np.float32), np.zeros(0)))
    bad = digits['calib'][:10].copy(); bad[4, 0, 1, 1] = np.inf
    with pytest.raises(TinycompError, match="batch 0 contains 1 NaN or infinite"): Q.quantize_static(cnn, bad)
    bad[4, 0, 1, 1] = np.nan
    with pytest.raises(TinycompError, match="NaN or infinite"): Q.quantize_static(cnn, [(bad, np.zeros(10))])
    with pytest.raises(TinycompError, match="dtype int64"): Q.quantize_static(cnn, [np.zeros((2, 1, 8, 8), np.int64)])
    q = Q.quantize_static(cnn, np.zeros((4, 1, 8, 8), np.float32))      # constant input: zero range, documented scale 1
    assert float(q[0].scale) == 1.0 and np.isfinite(q(Tensor(digits['calib'][:3])).data).all()


@pytest.mark.parametrize('layer, why', [(Sigmoid(), r"'1' \(Sigmoid\) stays float32: its layer type has no integer version"),
                                        (Tanh(), r"'1' \(Tanh\) stays float32"),
                                        (AvgPool2d(2, padding=1), "the integer average pool has no padding"),
                                        (MaxPool2d(2, dilation=2), "dilation"),
                                        (BatchNorm2d(3), "folded only into a Conv2d directly before it")])
def test_a_layer_without_an_integer_version_stays_float_with_a_warning(layer, why, digits):
    first = [Conv2d(1, 3, 3, padding=1)] + ([ReLU()] if isinstance(layer, BatchNorm2d) else [])   # a BN after a ReLU: nothing to fold into
    m = Sequential(*first, layer, AdaptiveAvgPool2d(2), Flatten(), Linear(12, 2)).eval()
    with pytest.warns(TinycompWarning, match=why): q = Q.quantize_static(m, digits['calib'])
    kept = type(layer)
    assert [type(l).__name__ for l in q].count(kept.__name__) == 1 and 'QuantizedLinear' in [type(l).__name__ for l in q]
    x = Tensor(digits['calib'][:16])
    with no_grad(): assert np.abs(q(x).data - m(x).data).max() < 0.1 * np.abs(m(x).data).max() + 0.05


def test_custom_layer_and_non_sequential(digits):
    class Custom(Module):
        def forward(self, x): return x * 2
    with pytest.warns(TinycompWarning, match=r"'1' \(Custom\) stays float32"):
        mixed = Q.quantize_static(Sequential(Conv2d(1, 2, 3), Custom(), Conv2d(2, 2, 1)), digits['calib'])
    assert [type(m).__name__ for m in mixed] == ['QuantStub', 'QuantizedConv2d', 'DeQuantStub', 'Custom', 'QuantStub',
                                                 'QuantizedConv2d', 'DeQuantStub']
    bare = Q.quantize_static(Conv2d(1, 2, 3), digits['calib'])                 # a lone layer is a chain of one
    assert [type(m).__name__ for m in bare] == ['QuantStub', 'QuantizedConv2d', 'DeQuantStub']
    with pytest.warns(TinycompWarning, match="fold_bn=True folds it"):
        Q.quantize_static(Sequential(Conv2d(1, 2, 3), BatchNorm2d(2)), digits['calib'], fold_bn=False)
    with pytest.raises(TinycompError, match="nothing to quantize"): Q.quantize_static(Sequential(Flatten()), digits['calib'])


def test_layers_refuse_float_activations(q8):
    with pytest.raises(TinycompError, match="expects int8 activations"): q8[1](Tensor(np.zeros((1, 1, 8, 8), np.float32)))
    with pytest.raises(TinycompError, match="expects float input"): q8[0](np.zeros((1, 1, 8, 8), np.int8))
    with pytest.raises(TinycompError, match="NaN"): q8[0](np.full((1, 1, 8, 8), np.nan, np.float32))
    for bits in (1, 5, 16, True):
        with pytest.raises(TinycompError, match=r"weight_bits must be one of \(2, 3, 4, 8\)"): L.QuantizedLinear(3, 2, weight_bits=bits)


@pytest.mark.parametrize('bits', [2, 3, 4])
def test_narrow_weights_are_packed_and_exact(cnn, digits, tmp_path, bits):
    "2-, 3- and 4-bit weights: values in [-qmax, qmax], stored packed, the same in QAT and after convert."
    q = Q.quantize_static(cnn, digits['calib'], weight_bits=bits)
    qmax = L.weight_qmax(bits)
    for m in q:
        if isinstance(m, (L.QuantizedConv2d, L.QuantizedLinear)):
            w = m.int_weight()
            assert m.weight.dtype == np.uint8 and m.weight.size == (w.size + 1) // 2
            assert np.abs(w).max() == qmax                       # the largest weight of each layer uses the top level
    back = tio.load(tio.save(q, tmp_path / 'n.npz'))
    assert np.array_equal(back(Tensor(digits['test'][0][:20])).data, q(Tensor(digits['test'][0][:20])).data)
    path = tio.save(q, tmp_path / 'bad.npz')                     # a value beyond the width is refused on load
    with np.load(path, allow_pickle=False) as f: arrays = {k: f[k] for k in f.files}
    w = unpack_int4(arrays['1.weight'], 144).copy(); w[0] = -qmax - 1; arrays['1.weight'] = pack_int4(w)
    np.savez(tmp_path / 'bad2.npz', **arrays)
    with pytest.raises(ModelFileError, match=rf"holds values in \[-{qmax + 1}, -?\d+\], outside the allowed \[-{qmax}, {qmax}\]"):
        tio.load(tmp_path / 'bad2.npz')
    qat = Q.prepare_qat(cnn, weight_bits=bits)                   # QAT's fake weights are exactly the converted ones
    with no_grad(): qat(Tensor(digits['calib']))
    conv = Q.convert(qat)
    for a, b in zip([m for m in qat if hasattr(m, 'fake_weight')], [m for m in conv if isinstance(m, (L.QuantizedConv2d, L.QuantizedLinear))]):
        assert np.array_equal(a.fake_weight().data, b.float_weight())


# ---------------------------------------------------------------- model files
def test_save_load_round_trip(q8, cnn, digits, tmp_path):
    X = digits['test'][0][:40]
    for model in (q8, Q.quantize_static(cnn, digits['calib'], weight_bits=4), Q.quantize_dynamic(cnn)):
        back = tio.load(tio.save(model, tmp_path / 'm.npz'))
        assert same_state(snapshot(model), snapshot(back))
        assert np.array_equal(back(Tensor(X)).data, model(Tensor(X)).data)
    manifest, arrays = tio.read_manifest(tmp_path / 'm.npz')
    assert 'tinycomp.quantization.layers' in manifest['modules']
    f32, i8 = tio.save(cnn, tmp_path / 'f.npz').stat().st_size, tio.save(q8, tmp_path / 'q.npz').stat().st_size
    arrays = lambda m: sum(a.nbytes for a in m.state_dict().values())    # without the manifest and zip headers
    assert model_size(q8) == i8 and i8 < 0.36 * f32 and arrays(q8) <= 0.27 * arrays(cnn)


def test_files_naming_the_former_module_of_the_layers_still_load(q8, digits, tmp_path):
    "Files written when the quantized layers were defined in tinycomp.quantization.models name that module: they load."
    with np.load(tio.save(q8, tmp_path / 'q.npz'), allow_pickle=False) as f: arrays = {k: f[k] for k in f.files}
    manifest = json.loads(arrays.pop('__manifest__').tobytes())
    manifest['modules'] = [m.replace('quantization.layers', 'quantization.models') for m in manifest['modules']]
    assert 'tinycomp.quantization.models' in manifest['modules']
    old = tmp_path / 'old.npz'
    np.savez(old, __manifest__=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
    X = digits['test'][0][:20]
    np.save(tmp_path / 'x.npy', X)
    code = ("import sys, numpy as np, tinycomp.io as tio\nfrom tinycomp.tensor import Tensor\n"
            f"m = tio.load({str(old)!r})\n"
            f"np.save({str(tmp_path / 'y.npy')!r}, m(Tensor(np.load({str(tmp_path / 'x.npy')!r}))).data)")
    subprocess.run([sys.executable, '-c', code], check=True)           # a fresh process: nothing imported before
    assert np.array_equal(np.load(tmp_path / 'y.npy'), q8(Tensor(X)).data)

def _tampered(model, layer, buffer, change):
    m = copy.deepcopy(model)
    b = m[layer]._buffers[buffer].copy()
    m[layer]._buffers[buffer] = change(b)
    return m


@pytest.mark.parametrize('layer, buffer, change, match', [
    (1, 'weight', lambda b: (b.__setitem__((0, 0, 0, 0), -128), b)[1], r"weight holds values in \[-128"),
    (1, 'weight_scale', lambda b: (b.__setitem__(3, 0.0), b)[1], "weight_scale must be > 0"),
    (1, 'weight_scale', lambda b: (b.__setitem__(3, -1.0), b)[1], "weight_scale must be > 0"),
    (1, 'weight_scale', lambda b: b[:3].copy(), "weight_scale' is float32 .3,. but the rebuilt layer expects float32 .16,."),
    (1, 'bias', lambda b: b.astype(np.int64), "bias' is int64 .16,. but the rebuilt layer expects int32"),
])
def test_malformed_quantized_files(q8, tmp_path, layer, buffer, change, match):
    path = tio.save(_tampered(q8, layer, buffer, change), tmp_path / 'bad.npz')
    with pytest.raises(ModelFileError, match=match): tio.load(path)


@pytest.mark.parametrize('layer, key, value, match', [
    ('0', 'scale', 0.0, "QuantStub scale must be finite and > 0"),
    ('0', 'scale', 1e400, "QuantStub scale must be finite and > 0"),              # JSON 1e400 parses as inf
    ('1', 'output_zero_point', 128, r"output zero point must be an integer in \[-128, 127\]"),
    ('1', 'input_scale', -0.5, "input scale must be finite and > 0"),
    ('1', 'input_zero_point', 2.5, "input zero point must be an integer"),
    ('7', 'zero_point', -129, "DeQuantStub zero point must be an integer"),
])
def test_malformed_quantization_parameters_in_the_manifest(q8, tmp_path, layer, key, value, match):
    path = tio.save(q8, tmp_path / 'q.npz')
    with np.load(path, allow_pickle=False) as f: arrays = {k: f[k] for k in f.files}
    manifest = json.loads(arrays.pop('__manifest__').tobytes())
    children = manifest['model']['children']
    layer = layer if layer != '7' else str(len(children) - 1)
    assert key in children[layer]['config']
    children[layer]['config'][key] = value
    out = tmp_path / 'bad.npz'
    text = json.dumps(manifest).replace('Infinity', '1e400')         # JSON has no inf; 1e400 overflows to it
    np.savez(out, __manifest__=np.frombuffer(text.encode(), np.uint8), **arrays)
    with pytest.raises(ModelFileError, match=match): tio.load(out)


def test_malformed_files_with_crafted_arrays(q8, cnn, digits, tmp_path):
    "Arrays that save() itself would refuse or that change shape/dtype: rewrite the file with plain NumPy."
    def rewrite(model, edit):
        path = tio.save(model, tmp_path / 'src.npz')
        with np.load(path, allow_pickle=False) as f: arrays = {k: f[k] for k in f.files}
        manifest = json.loads(arrays.pop('__manifest__').tobytes())
        edit(manifest, arrays)
        out = tmp_path / 'bad.npz'
        np.savez(out, __manifest__=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
        return out
    def nan_scale(man, arr): arr['1.weight_scale'] = np.full_like(arr['1.weight_scale'], np.nan)
    with pytest.raises(ModelFileError, match="NaN or infinite"): tio.load(rewrite(q8, nan_scale))
    def widen(man, arr):                                   # int16 weights with a value no int8 can hold
        w = arr['1.weight'].astype(np.int16); w[0, 0, 0, 0] = 300; arr['1.weight'] = w
        man['arrays']['1.weight']['dtype'] = 'int16'
    with pytest.raises(ModelFileError, match="int16.*expects int8"): tio.load(rewrite(q8, widen))
    q4 = Q.quantize_static(cnn, digits['calib'], weight_bits=4)
    def short(man, arr):                                    # packed int4 of the wrong size
        arr['2.weight'] = arr['2.weight'][:-3]; man['arrays']['2.weight']['shape'] = [len(arr['2.weight'])]
    with pytest.raises(ModelFileError, match="2.weight"): tio.load(rewrite(q4, short))
    def int4_out_of_range(man, arr):                        # -8 is an int4 value, but not a symmetric weight
        w = unpack_int4(arr['1.weight'], 144).copy(); w[5] = -8; arr['1.weight'] = pack_int4(w)
    with pytest.raises(ModelFileError, match=r"unpacked int4\) holds values in \[-8"): tio.load(rewrite(q4, int4_out_of_range))


def test_check_state_packed_size_direct():
    layer = L.QuantizedLinear(3, 3, weight_bits=4)
    layer._buffers['weight_scale'] = np.ones(3, np.float32)
    layer.check_state()
    layer._buffers['weight'] = np.zeros(4, np.uint8)
    with pytest.raises(TinycompError, match=r"packed int4 weight must be uint8 of shape \(5,\)"): layer.check_state()
    layer._buffers['weight'] = np.array([0, 0, 0, 0, 0x10], np.uint8)
    with pytest.raises(TinycompError, match="padding nibble"): layer.check_state()


# ---------------------------------------------------------------- dynamic, QAT, mixed precision, report
def test_quantize_dynamic(wide, digits):
    qd = Q.quantize_dynamic(wide)
    lins = [m for m in qd.modules() if isinstance(m, L.DynamicQuantizedLinear)]
    assert len(lins) == 2 and not any(type(m) is Linear for m in qd.modules())
    assert [n for n, _ in qd.named_children()] == [str(i) for i in range(15)]        # order kept
    assert [type(m).__name__ for m in qd][12:] == ['DynamicQuantizedLinear', 'ReLU', 'DynamicQuantizedLinear']
    assert any(type(m) is Conv2d for m in qd.modules())
    X, y = digits['test']
    assert evaluate(qd, (X, y)).accuracy >= evaluate(wide, (X, y)).accuracy - 0.02
    lin = wide[-1]
    x = np.random.default_rng(0).standard_normal((5, 48)).astype(np.float32)
    with no_grad(): ref = lin(Tensor(x)).data
    assert sqnr(ref, L.DynamicQuantizedLinear.from_float(lin)(x).data) > 30
    with pytest.raises(TinycompError, match="last dimension 48"): lins[-1](np.zeros((2, 7), np.float32))
    rep = A.quantization_report(wide, qd, X[:32])
    assert [r['precision'] for r in rep if r['kind'] == 'linear'] == ['dynamic int8', 'dynamic int8']


def test_qat_trains_and_converts(cnn, digits):
    manual_seed(0)
    qat = Q.prepare_qat(cnn, weight_bits=4)
    with pytest.raises(TinycompError, match="has not seen any data"): Q.convert(qat)
    Xtr, ytr = digits['train']
    w0 = qat[1].weight.data.copy()
    hist = fit(qat, DataLoader(Xtr[:256], ytr[:256], batch_size=64, shuffle=True, seed=0), epochs=1,
               optimizer=Adam(qat.parameters(), lr=1e-4), progress=False)
    assert np.isfinite(hist['train_loss'][0]) and not np.array_equal(w0, qat[1].weight.data)
    qat.train()
    x = Tensor(Xtr[:8]); out = qat(x); out.sum().backward()
    assert qat[1].weight.grad is not None and np.abs(qat[1].weight.grad).sum() > 0      # straight-through gradient
    q = Q.convert(qat)
    assert [type(l).__name__ for l in q][1] == 'QuantizedConv2d' and q[1].weight_bits == 4
    X, y = digits['test']
    assert evaluate(q, (X, y)).accuracy > 0.9
    # the integer model agrees with the QAT model in eval mode (same weights, frozen ranges) almost everywhere
    with no_grad(): a, b = qat.eval()(Tensor(X)).data.argmax(1), q(Tensor(X)).data.argmax(1)
    assert (a == b).mean() > 0.97
    with pytest.raises(TinycompError, match="made by prepare_qat"): Q.convert(cnn)


def test_qat_wins_back_what_ternary_ptq_loses(cnn, digits):
    "2-bit (ternary) weights: PTQ loses many points on digits_cnn, a few epochs of QAT win back more than half."
    Xtr, ytr = digits['train']
    X, y = digits['test']
    acc = lambda m: evaluate(m, (X, y)).accuracy
    manual_seed(0)
    qat = Q.prepare_qat(cnn, weight_bits=2)
    fit(qat, DataLoader(Xtr, ytr, batch_size=64, shuffle=True, seed=0), epochs=5, optimizer=Adam(qat.parameters(), lr=1e-3),
        progress=False)
    loss_ptq = acc(cnn) - acc(Q.quantize_static(cnn, digits['calib'], weight_bits=2))
    loss_qat = acc(cnn) - acc(Q.convert(qat))
    assert loss_ptq > 0.05 and loss_qat < loss_ptq / 2, (loss_ptq, loss_qat)


def test_layer_sensitivity_and_mixed_precision(cnn, digits, tmp_path):
    val = (digits['val'][0][:100], digits['val'][1][:100])
    rows = A.layer_sensitivity(cnn, digits['calib'][:64], val)
    assert [(r['op'], r['bits']) for r in rows] == [(0, 8), (0, 4), (1, 8), (1, 4), (4, 8), (4, 4)]
    for i in (0, 2, 4): assert rows[i]['sqnr_db'] > rows[i + 1]['sqnr_db']      # int4 noisier than int8
    full = model_size(Q.quantize_static(cnn, digits['calib'][:64]))
    all4 = model_size(Q.quantize_static(cnn, digits['calib'][:64], weight_bits=4))
    with pytest.raises(TinycompError, match=f"even all-int4 weights need {all4} bytes"):
        A.mixed_precision(cnn, digits['calib'][:64], val, all4 - 1, sensitivity=rows)
    with pytest.raises(TinycompError, match="positive whole number"): A.mixed_precision(cnn, digits['calib'], val, -5)
    big = A.mixed_precision(cnn, digits['calib'][:64], val, model_size(cnn), sensitivity=rows)
    assert A.precision_plan(big) == ['float32'] * 3                   # fits already: nothing quantized
    m = A.mixed_precision(cnn, digits['calib'][:64], val, full - 500, sensitivity=rows)
    plan = A.precision_plan(m)
    assert model_size(m) <= full - 500 and 'int4' in plan
    half = A.mixed_precision(cnn, digits['calib'][:64], val, model_size(cnn) - 1000, sensitivity=rows)
    assert A.precision_plan(half) == ['float32', 'float32', 'float16']    # the lossless step that saves the most
    assert type(half[-1]).__name__ == 'HalfLinear' and half[-1].weight.dtype == np.float16
    mid = A.mixed_precision(cnn, digits['calib'][:64], val, model_size(cnn) // 2 - 1000, sensitivity=rows)
    plan = A.precision_plan(mid)
    assert model_size(mid) <= model_size(cnn) // 2 - 1000 and any(isinstance(l, L.QuantStub) for l in mid)
    assert {'float16', 'float32'} & set(plan) and {'int8', 'int4'} & set(plan), plan
    X = digits['test'][0][:30]
    for model in (m, half, mid):
        back = tio.load(tio.save(model, tmp_path / 'mixed.npz'))
        assert np.array_equal(back(Tensor(X)).data, model(Tensor(X)).data)
    rep = A.quantization_report(cnn, mid, X)
    assert len(rep) == 5 and {'float16', 'float32'} & {r['precision'] for r in rep}


def test_build_quantized_float_islands(cnn, digits):
    ops = Q.quantization_plan(cnn)
    in_qp, out_qp = Q.calibrate(ops, digits['calib'])
    m = Q.build_quantized(ops, in_qp, out_qp, [None, 8, None])
    kinds = [type(l).__name__ for l in m]
    assert kinds == ['Conv2d', 'ReLU', 'QuantStub', 'QuantizedConv2d', 'QuantizedMaxPool2d', 'Flatten', 'DeQuantStub', 'Linear']
    assert m[0] is not cnn[0] and m[0].weight is not cnn[0].weight
    with pytest.raises(TinycompError, match="bits has 2 entries for 3"): Q.build_quantized(ops, in_qp, out_qp, [8, 8])


def test_histogram_plot(cnn, q8, digits, tmp_path):
    import matplotlib; matplotlib.use('Agg')
    fig = A.plot_quantization_histograms(cnn, q8, digits['test'][0][:50], path=tmp_path / 'h.png')
    assert len(fig.axes) == 6 and (tmp_path / 'h.png').stat().st_size > 0
    import matplotlib.pyplot as plt; plt.close(fig)


# ---------------------------------------------------------------- bench
def test_bench_quant_command(tmp_path, capsys):
    from tinycomp.cli import main
    out = tmp_path / 'q.json'
    assert main(['bench', 'quant', '--repeats', '1', '--json', str(out)]) == 0
    text = capsys.readouterr().out
    assert 'digits_cnn end to end' in text and 'static int8 per-channel' in text
    r = json.loads(out.read_text())
    assert len(r['conv']) == 5 and r['digits_cnn']['file_ratio'] < 1 and set(r['digits_cnn']['speedup']) == {'1', '64'}
    assert main(['bench', 'quant', '--repeats', '0']) == 2


def test_module_03_profiles_integer_models(wide, digits):
    "Every integer layer describes its cost: same operation counts as the float layers, one byte per activation."
    from tinycomp.profiling.counting import profile_model
    x = digits['test'][0][:4]
    for q in (Q.quantize_static(wide, digits['calib']), Q.quantize_static(wide, digits['calib'], weight_bits=4),
              Q.quantize_dynamic(wide)):
        p = profile_model(q, x, repeats=1, warmup=0)
        assert p.uncounted == [], p.uncounted
    pf, pq = profile_model(wide, x, repeats=1, warmup=0), profile_model(Q.quantize_static(wide, digits['calib']), x, repeats=1, warmup=0)
    f = {r['type']: r for r in pf.rows}
    convs_f = [r for r in pf.rows if r['type'] in ('Conv2d', 'Linear')]
    convs_q = [r for r in pq.rows if r['type'] in ('QuantizedConv2d', 'QuantizedLinear')]
    assert [r['flops'] for r in convs_q] == [r['flops'] + (int(np.prod(r['output_shape'])) if r['type'] == 'Conv2d' else 0)
                                             for r in convs_f]          # the wide convs have no bias; folding BN adds one
    bn = sum(r['params'] for r in pf.rows if r['type'] == 'BatchNorm2d')
    assert sum(r['params'] for r in pq.rows) == sum(r['params'] for r in pf.rows) - bn + sum(                  # BN folded into biases
        r['output_shape'][1] for r in convs_f if r['type'] == 'Conv2d')
    for r in pq.rows:
        if r['type'].startswith('Quantized'): assert r['activation_bytes'] == int(np.prod(r['output_shape']))
    assert pq.rows[0]['type'] == 'QuantStub' and pq.rows[-1]['activation_bytes'] == 4 * int(np.prod(pq.rows[-1]['output_shape']))
    assert f['Conv2d']['activation_bytes'] == 4 * int(np.prod(f['Conv2d']['output_shape']))


# ---------------------------------------------------------------- models that are not chains
@pytest.fixture(scope='module')
def residual():
    from graph_models import trained_quantizable
    return trained_quantizable()


@pytest.mark.slow
def test_a_residual_network_is_int8_between_its_stubs_and_within_a_point_of_float(residual, digits, tmp_path):
    "Residual add and concatenation included: every layer between QuantStub and DeQuantStub reads and writes int8."
    from tinycomp.graph import Graph
    q = Q.quantize_static(residual, digits['calib'])
    assert isinstance(q, Graph)
    ops = [n.op for n in q]
    assert ops.count('QuantStub') == 1 and ops.count('DeQuantStub') == 1 and {'QuantizedAdd', 'QuantizedCat'} <= set(ops)
    assert 'BatchNorm2d' not in ops and 'ReLU' not in ops                          # folded and fused
    X, y = digits['test']
    assert evaluate(q, (X, y)).accuracy >= evaluate(residual, (X, y)).accuracy - 0.01
    seen = []
    hooks = [n.module.register_forward_hook(lambda mod, a, o: seen.append((type(mod).__name__, [L._data(v).dtype for v in a], L._data(o).dtype)))
             for n in q]
    q(Tensor(X[:5]))
    for h in hooks: h.remove()
    assert [s[0] for s in seen] == ops
    assert all(d == np.int8 for _, ins, _ in seen[1:] for d in ins) and all(out == np.int8 for _, _, out in seen[:-1])
    back = tio.load(tio.save(q, tmp_path / 'residual_int8.npz')).eval()
    assert np.array_equal(back(Tensor(X[:50])).data, q(Tensor(X[:50])).data)


def test_a_residual_plan_reads_its_branches_and_keeps_float_where_asked(residual, digits):
    from tinycomp.graph import Graph
    ops = Q.quantization_plan(residual, example=digits['calib'][:2])
    kinds = [(op['kind'], op['inputs'], op['relu']) for op in ops]
    add = next(i for i, op in enumerate(ops) if op['kind'] == 'add')
    assert kinds[add] == ('add', [add - 1, 0], True)                              # conv2 (+bn2) and the stem, then relu
    assert ops[0]['names'] == ['stem', 'bn', 'relu'] and ops[add]['names'] == ['block.add', 'block.relu_1']
    with pytest.raises(TinycompError, match="pass an example input"):
        Q.quantization_plan(residual)
    in_qp, out_qp = Q.calibrate(ops, digits['calib'])
    assert set(out_qp) == {i for i, op in enumerate(ops) if op['kind'] in ('conv', 'linear', 'add', 'cat')}
    mixed = Q.build_quantized(ops, in_qp, out_qp, [8, None, 8, 8, 8, 8])          # block.conv1 kept float32
    assert isinstance(mixed, Graph) and [n.op for n in mixed].count('DeQuantStub') == 2
    X, y = digits['test']
    assert evaluate(mixed.eval(), (X, y)).accuracy >= evaluate(residual, (X, y)).accuracy - 0.02
    with pytest.raises(TinycompError, match="the per-layer analysis reads models that are chains"):
        A.quantization_report(residual, mixed, X[:4])
    with pytest.raises(TinycompError, match="not a chain of layers: pass an example input"):
        Q.prepare_qat(residual)                                              # a graph needs an input to be traced on


def test_a_relu_is_not_fused_into_a_value_another_branch_reads_through_a_dropout(digits):
    "conv -> dropout -> relu, and the conv's output also added back: the ReLU must stay an op of its own."
    from tinycomp.nn.modules import Add
    class Branch(Module):
        def __init__(self):
            super().__init__()
            self.conv, self.drop, self.relu, self.add = Conv2d(1, 1, 3, padding=1), Dropout(0.1), ReLU(), Add()
            self.fc = Linear(64, 3)
        def forward(self, x):
            y = self.conv(x)
            return self.fc(self.add(self.relu(self.drop(y)), y).flatten(1))
    model = Branch().eval()
    ops = Q.quantization_plan(model, example=digits['calib'][:2])
    assert [op['kind'] for op in ops] == ['conv', 'relu', 'add', 'flatten', 'linear'] and not ops[0]['relu']
    q = Q.quantize_static(model, digits['calib'])
    X = digits['test'][0][:64]
    assert np.abs(q(Tensor(X)).data - model(Tensor(X)).data).max() < 0.1 * np.abs(model(Tensor(X)).data).max() + 0.05


def test_an_add_that_reads_the_models_input_is_integer_too(digits):
    "relu(x + conv(x)): the skip reads the float input; the add quantizes it (sharing the input's stub) and stays int8."
    from tinycomp.nn.modules import Add
    class Skip(Module):
        def __init__(self):
            super().__init__()
            self.conv, self.add, self.fc = Conv2d(1, 1, 3, padding=1), Add(), Linear(64, 3)
        def forward(self, x): return self.fc(self.add(x, self.conv(x)).relu().flatten(1))
    q = Q.quantize_static(Skip().eval(), digits['calib'])
    ops = [(n.op, n.inputs) for n in q]
    assert ops[:3] == [('QuantStub', ('input',)), ('QuantizedConv2d', ('input_quant',)), ('QuantizedAdd', ('input_quant', 'conv'))]
    assert [op for op, _ in ops].count('QuantStub') == 1 and [op for op, _ in ops].count('DeQuantStub') == 1


def test_qat_on_a_residual_network_with_a_concatenation(digits):
    "prepare_qat traces a model with branches into a graph: fake-quantized adds and concatenations; convert plans it again."
    from graph_models import trained_quantizable
    from tinycomp.data import DataLoader
    from tinycomp.graph import Graph
    from tinycomp.models import fit
    float_model = trained_quantizable(epochs=2)
    qat = Q.prepare_qat(float_model, example=digits['calib'][:1])
    assert isinstance(qat, Graph) and sum(isinstance(n.module, Q.FakeQuantize) for n in qat) == 3     # input, add, cat
    manual_seed(0)
    X, y = load_digits('train')
    fit(qat, DataLoader(X, y, batch_size=64, shuffle=True, seed=0), epochs=1, progress=False)
    q = Q.convert(qat.eval())
    ops = [n.op for n in q]
    assert isinstance(q, Graph) and 'QuantizedAdd' in ops and 'QuantizedCat' in ops and ops.count('QuantStub') == 1
    Xt, yt = digits['test']
    with no_grad(): agree = (q(Tensor(Xt)).data.argmax(1) == qat.eval()(Tensor(Xt)).data.argmax(1)).mean()
    assert agree >= 0.98, agree
    with pytest.raises(TinycompError, match="pass an example input"): Q.prepare_qat(float_model)
