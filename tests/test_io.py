"Tests for tinycomp.io: exact round trips and hostile model files."
import copy
import json
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp import tensor as T
from tinycomp.batchnorm import BatchNorm2d
from tinycomp.conv import Conv2d
from tinycomp.errors import ModelFileError, TinycompError
from tinycomp.pooling import AdaptiveAvgPool2d, AvgPool2d, MaxPool2d
from tinycomp import files as tfiles
from tinycomp.nn.modules import Dropout, Flatten, Linear, Module, ReLU, Sequential, Sigmoid, Tanh
from tinycomp.tensor import no_grad


def cnn():
    T.manual_seed(0)
    m = Sequential(Conv2d(1, 4, 3, padding=1), BatchNorm2d(4), ReLU(), MaxPool2d(2),
                   Conv2d(4, 6, (3, 1), stride=(1, 2), padding=(1, 0), bias=False), Tanh(), AvgPool2d(2),
                   Sequential(AdaptiveAvgPool2d(1), Flatten()), Dropout(0.25), Linear(6, 10), Sigmoid())
    bn = m[1]  # non-default buffers, so the round trip has something to prove
    bn._buffers['running_mean'] = np.linspace(-1, 1, 4).astype(np.float32)
    bn._buffers['running_var'] = np.linspace(0.5, 2, 4).astype(np.float32)
    bn._buffers['num_batches_tracked'] = np.array(17, np.int64)
    return m


def assert_same_model(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert sa[k].dtype == sb[k].dtype and sa[k].shape == sb[k].shape, k
        assert sa[k].tobytes() == sb[k].tobytes(), k                 # bitwise
    assert [type(m) for m in a.modules()] == [type(m) for m in b.modules()]
    assert [m.config() for m in a.modules()] == [m.config() for m in b.modules()]
    assert repr(a) == repr(b)


def parts(path):
    "(manifest dict, arrays dict) of a good model file, read with plain NumPy."
    with np.load(path, allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    return json.loads(arrays.pop('__manifest__').tobytes()), arrays


def craft(path, manifest, arrays, raw_manifest=None):
    "Write a (possibly hostile) .npz: arrays plus a manifest given as dict, or raw array/bytes."
    if raw_manifest is None:
        raw_manifest = np.frombuffer(json.dumps(manifest).encode(), np.uint8)
    elif isinstance(raw_manifest, bytes):
        raw_manifest = np.frombuffer(raw_manifest, np.uint8)
    np.savez(path, __manifest__=raw_manifest, **arrays)        # np.savez pickles object arrays: hostile on purpose
    return path


@pytest.fixture
def good(tmp_path):
    m = cnn()
    path = tio.save(m, tmp_path / 'good.npz', metadata={'accuracy': 0.9})
    man, arrays = parts(path)
    return m, path, man, arrays


def bad(tmp_path, man, arrays, match, **kw):
    path = craft(tmp_path / 'bad.npz', man, arrays, **kw)
    with pytest.raises(ModelFileError, match=match):
        tio.load(path)
    return path


# ---------------------------------------------------------------- round trips
def test_round_trip_is_exact(good):
    m, path, _, _ = good
    back = tio.load(path)
    assert_same_model(m, back)
    x = np.random.default_rng(0).normal(size=(3, 1, 8, 8)).astype(np.float32)
    m.eval(), back.eval()
    with no_grad():
        assert m(x).data.tobytes() == back(x).data.tobytes()
    assert tio.read_manifest(path)[0]['metadata'] == {'accuracy': 0.9}


def test_round_trip_of_every_layer_type_and_nesting(tmp_path):
    T.manual_seed(1)
    m = Sequential(Sequential(Linear(3, 4, bias=False), Sequential(ReLU())), Flatten(0), Dropout(), Linear(4, 2))
    assert_same_model(m, tio.load(tio.save(m, tmp_path / 'n.npz')))
    e = Sequential()
    assert_same_model(e, tio.load(tio.save(e, tmp_path / 'e.npz')))
    single = Linear(2, 2)                                         # a bare layer is a model too
    assert_same_model(single, tio.load(tio.save(single, tmp_path / 's.npz')))


def test_same_model_same_bytes_and_atomic_overwrite(tmp_path, good):
    m, path, _, _ = good
    p2 = tio.save(m, tmp_path / 'again.npz', metadata={'accuracy': 0.9})
    assert p2.read_bytes() == path.read_bytes()                  # reproducible files
    tio.save(Linear(2, 3), path)                                  # replaces the old file in one step
    assert isinstance(tio.load(path), Linear)
    assert sorted(p.name for p in tmp_path.iterdir()) == ['again.npz', 'good.npz']


def test_load_does_not_disturb_the_seeded_generator(good):
    _, path, _, _ = good
    T.manual_seed(5)
    expected = T.default_generator().random(3)
    T.manual_seed(5)
    tio.load(path)
    assert np.array_equal(T.default_generator().random(3), expected)


def test_allow_list_contents():
    for cls in (Sequential, Linear, ReLU, Sigmoid, Tanh, Flatten, Dropout,
                Conv2d, MaxPool2d, AvgPool2d, AdaptiveAvgPool2d, BatchNorm2d):
        assert tfiles.LAYERS[cls.__name__] is cls


@pytest.fixture
def restore_layers():
    saved = dict(tfiles.LAYERS)
    yield
    tfiles.LAYERS.clear(); tfiles.LAYERS.update(saved)


def test_register_layer_for_later_modules(tmp_path, restore_layers):

    class Scale(Module):
        def __init__(self, n, bits=8):
            super().__init__()
            self.n, self.bits = n, bits
            self.register_buffer('q', np.zeros(n, np.int8))
            self.register_buffer('scale', np.ones(n, np.float32))
            self.register_buffer('mask', np.ones(n, bool))

        def config(self): return dict(n=self.n, bits=self.bits)
        def forward(self, x): return x
        def check_state(self):
            if not (self.scale > 0).all(): raise TinycompError("scales must be > 0")

    m = Sequential(Scale(3, bits=4), Linear(3, 1))
    with pytest.raises(ModelFileError, match="allow-list.*register_layer"):
        tio.save(m, tmp_path / 'q.npz')
    assert not (tmp_path / 'q.npz').exists() and list(tmp_path.iterdir()) == []
    assert tfiles.register_layer(Scale) is Scale
    m[0]._buffers['q'] = np.array([-128, 0, 127], np.int8)
    m[0]._buffers['mask'] = np.array([True, False, True])
    assert_same_model(m, tio.load(tio.save(m, tmp_path / 'q.npz')))
    m[0]._buffers['scale'] = np.array([1, 0, 1], np.float32)             # load runs the layer's check_state()
    with pytest.raises(ModelFileError, match=r"q.npz: layer 0 \(Scale\): scales must be > 0"):
        tio.load(tio.save(m, tmp_path / 'q.npz'))

    class Block(Module):                                          # builds its own sub-layers
        def __init__(self, n):
            super().__init__()
            self.n, self.lin, self.act = n, Linear(n, n), ReLU()

        def config(self): return dict(n=self.n)
        def forward(self, x): return self.act(self.lin(x))

    tfiles.register_layer(Block)
    T.manual_seed(3)
    blocks = Sequential(Block(3), Block(3))
    path = tio.save(blocks, tmp_path / 'b.npz')
    assert_same_model(blocks, tio.load(path))
    man, arrays = parts(path)
    man['model']['children']['1']['children']['act']['type'] = 'Tanh'
    bad(tmp_path, man, arrays, r"model.1.act: expected a ReLU, the manifest says Tanh")
    del man['model']['children']['1']['children']['act']
    bad(tmp_path, man, arrays, r"rebuilt Block has children \['lin', 'act'\]")

    class Other(Module):
        pass
    Other.__name__ = 'Scale'
    with pytest.raises(TinycompError, match="already registered"):
        tfiles.register_layer(Other)
    with pytest.raises(TinycompError, match="layer class with a config"):
        tfiles.register_layer(int)


def test_save_refuses_what_load_would_refuse(tmp_path):
    m = Linear(2, 2)
    m.weight.data[0, 0] = np.nan
    with pytest.raises(ModelFileError, match="NaN or infinite"):
        tio.save(m, tmp_path / 'nan.npz')

    class Sub(Linear):                                            # a subclass is not the allow-listed class
        pass
    with pytest.raises(ModelFileError, match="allow-list"):
        tio.save(Sub(2, 2), tmp_path / 'sub.npz')
    with pytest.raises(ModelFileError, match="metadata is not JSON-safe"):
        tio.save(Linear(2, 2), tmp_path / 'meta.npz', metadata={'x': object()})
    shared = Sequential(Linear(2, 2), Linear(2, 2))
    shared[1].weight = shared[0].weight
    with pytest.raises(ModelFileError, match="weight tying"):
        tio.save(shared, tmp_path / 'tied.npz')
    assert list(tmp_path.iterdir()) == []                        # nothing written, no temp files


# ---------------------------------------------------------------- hostile and broken files
def test_pickled_object_array_is_never_unpickled(tmp_path, good):
    _, _, man, arrays = good
    marker = tmp_path / 'pwned'

    class Boom:
        def __reduce__(self):
            return (marker.write_text, ('pickle code ran',))
    arrays = dict(arrays, **{'0.bias': np.array([Boom()], dtype=object)})
    bad(tmp_path, man, arrays, "pickles are never loaded")
    man2 = copy.deepcopy(man)
    man2['arrays']['0.bias'] = {'shape': [1], 'dtype': 'object'}  # even when the manifest admits it
    bad(tmp_path, man2, arrays, "pickles are never loaded|'0.bias'")
    assert not marker.exists()


def test_pickled_manifest_is_rejected(tmp_path, good):
    _, _, man, arrays = good
    bad(tmp_path, man, arrays, "must be a 1-D uint8", raw_manifest=np.array([man], dtype=object))


def test_shape_and_dtype_mismatch(tmp_path, good):
    _, _, man, arrays = good
    bad(tmp_path, man, dict(arrays, **{'9.weight': arrays['9.weight'].T.copy()}), r"'9.weight' is float32 \[6, 10\]")
    bad(tmp_path, man, dict(arrays, **{'9.bias': arrays['9.bias'].astype(np.float64)}), "'9.bias' is float64")
    # manifest and arrays agree with each other but not with the layer config
    man2 = copy.deepcopy(man)
    man2['model']['children']['9']['config']['in_features'] = 7
    bad(tmp_path, man2, arrays, "config and the weights disagree")


def test_unknown_layer_type_and_bad_config(tmp_path, good):
    _, _, man, arrays = good
    man2 = copy.deepcopy(man)
    man2['model']['children']['2']['type'] = 'os.system'
    bad(tmp_path, man2, arrays, "'os.system' at model.2 is not in the allow-list")
    man3 = copy.deepcopy(man)
    man3['model']['children']['9']['config']['evil'] = 1
    bad(tmp_path, man3, arrays, "cannot build Linear")
    man4 = copy.deepcopy(man)
    man4['model']['children']['2']['children']['x.y'] = {'type': 'ReLU', 'config': {}, 'children': {}}
    bad(tmp_path, man4, arrays, "child name 'x.y'")
    man5 = copy.deepcopy(man)
    del man5['model']['children']['2']['config']
    bad(tmp_path, man5, arrays, "exactly 'type', 'config', 'children'")
    man6 = copy.deepcopy(man)
    del man6['model']['children']['2']                            # tree and arrays no longer line up
    man6['model']['children']['3']['children']['0'] = {'type': 'ReLU', 'config': {}, 'children': {}}
    bad(tmp_path, man6, arrays, "Sequential children must be named")
    man7 = copy.deepcopy(man)
    man7['model']['children']['3']['children']['0'] = {'type': 'ReLU', 'config': {}, 'children': {}}
    bad(tmp_path, man7, arrays, r"rebuilt MaxPool2d has children \[\], the manifest lists \['0'\]")


def test_missing_and_extra_keys(tmp_path, good):
    _, _, man, arrays = good
    short = {k: v for k, v in arrays.items() if k != '1.running_var'}
    bad(tmp_path, man, short, r"missing from the file: \['1.running_var'\]")
    bad(tmp_path, man, dict(arrays, extra=np.zeros(2, np.float32)), r"does not list: \['extra'\]")
    man2 = copy.deepcopy(man)
    del man2['arrays']['0.weight']
    bad(tmp_path, man2, {k: v for k, v in arrays.items() if k != '0.weight'}, "rebuilt model has arrays")
    p = tmp_path / 'nomanifest.npz'
    np.savez(p, **arrays)
    with pytest.raises(ModelFileError, match="no __manifest__"):
        tio.load(p)


def test_truncated_and_corrupt_files(tmp_path, good):
    _, path, _, _ = good
    blob = path.read_bytes()
    for n in (0, 10, len(blob) // 2, len(blob) - 30):
        p = tmp_path / f'cut{n}.npz'
        p.write_bytes(blob[:n])
        with pytest.raises(ModelFileError):
            tio.load(p)
    flipped = bytearray(blob)                                     # flip one byte inside the first array's data
    with zipfile.ZipFile(path) as zf:
        info = zf.getinfo('0.weight.npy')
    flipped[info.header_offset + 30 + len(info.filename) + 140] ^= 0xFF
    (tmp_path / 'flip.npz').write_bytes(bytes(flipped))
    with pytest.raises(ModelFileError, match="'0.weight'"):       # CRC check fails on read
        tio.load(tmp_path / 'flip.npz')
    for junk in ('hello', '{}', ''):                                # np.load would take these for pickles
        (tmp_path / 'text.npz').write_text(junk)
        with pytest.raises(ModelFileError, match=r"not a \.npz model file \(not a zip archive\)") as e:
            tio.load(tmp_path / 'text.npz')
        assert 'allow_pickle' not in str(e.value) and 'pickle.load' not in str(e.value)
    np.save(tmp_path / 'single.npy', np.zeros(3))
    with pytest.raises(ModelFileError, match="single .npy"):
        tio.load(tmp_path / 'single.npy')
    with pytest.raises(ModelFileError, match="no model file"):
        tio.load(tmp_path / 'nothing.npz')


def test_unknown_version_and_format(tmp_path, good):
    _, _, man, arrays = good
    bad(tmp_path, dict(man, version=3), arrays, "format version 3 is not supported")
    bad(tmp_path, dict(man, modules=['os']), arrays, "'modules' must be a list of tinycomp module names")
    bad(tmp_path, dict(man, modules='tinycomp.conv'), arrays, "'modules' must be a list")
    bad(tmp_path, dict(man, modules=['tinycomp.no_such_module']), arrays, "which this tinycomp does not have")
    bad(tmp_path, dict(man, version='1'), arrays, "format version '1'")
    bad(tmp_path, dict(man, version=True), arrays, "format version True")
    bad(tmp_path, dict(man, format='pytorch'), arrays, "not a 'tinycomp-model' manifest")
    bad(tmp_path, dict(man, surprise=1), arrays, "unknown manifest fields")


def test_nan_and_inf_weights(tmp_path, good):
    _, _, man, arrays = good
    w = arrays['0.weight'].copy()
    w[0, 0, 1, 1] = np.nan
    bad(tmp_path, man, dict(arrays, **{'0.weight': w}), "'0.weight' contains 1 NaN or infinite")
    v = arrays['1.running_var'].copy()
    v[2] = -np.inf
    bad(tmp_path, man, dict(arrays, **{'1.running_var': v}), "'1.running_var' contains 1 NaN or infinite")


def test_manifest_not_json(tmp_path, good):
    _, _, man, arrays = good
    bad(tmp_path, man, arrays, "not valid UTF-8 JSON", raw_manifest=b'{"format": "tinycomp-model", ')
    bad(tmp_path, man, arrays, "not valid UTF-8 JSON", raw_manifest=b'\xff\xfe\x00junk')
    bad(tmp_path, man, arrays, "not valid UTF-8 JSON", raw_manifest=json.dumps(man).replace('0.9', 'NaN').encode())
    bad(tmp_path, man, arrays, "not a 'tinycomp-model'", raw_manifest=b'[1, 2, 3]')
    bad(tmp_path, man, arrays, "1-D uint8", raw_manifest=np.zeros(4, np.float32))
    man2 = copy.deepcopy(man)
    man2['arrays']['0.weight'] = {'shape': '4,1,3,3', 'dtype': 'float32'}
    bad(tmp_path, man2, arrays, "manifest entry of array '0.weight'")
    man3 = copy.deepcopy(man)
    man3['arrays']['0.weight']['dtype'] = 'not-a-dtype'
    bad(tmp_path, man3, arrays, "unknown dtype")


def test_deep_manifest_is_rejected(tmp_path, good):
    _, _, man, arrays = good
    node = {'type': 'Sequential', 'config': {}, 'children': {}}
    for _ in range(200):
        node = {'type': 'Sequential', 'config': {}, 'children': {'0': node}}
    bad(tmp_path, dict(man, model=node), arrays, "deeper than")


def test_version_1_files_still_load(tmp_path, good):
    m, _, man, arrays = good
    old = {k: v for k, v in man.items() if k != 'modules'} | {'version': 1}
    assert_same_model(m, tio.load(craft(tmp_path / 'v1.npz', old, arrays)))
    bad(tmp_path, dict(old, modules=['tinycomp.conv']), arrays, r"unknown manifest fields \['modules'\]")


def test_file_names_the_modules_of_its_layers(good):
    _, _, man, _ = good
    assert man['version'] == 2 and man['modules'] == ['tinycomp.batchnorm', 'tinycomp.conv', 'tinycomp.nn.modules', 'tinycomp.pooling']


def test_files_from_before_module_02_was_split_still_load(tmp_path, good):
    "A file naming only tinycomp.conv for its pooling and BatchNorm layers loads, also where nothing imported them yet."
    from tinycomp.models import pretrained_path       # the shipped weights were written then
    m, _, man, arrays = good
    old = dict(man, modules=['tinycomp.conv', 'tinycomp.nn.modules'])
    path = craft(tmp_path / 'old.npz', old, arrays)
    assert_same_model(m, tio.load(path))
    code = ("import sys, tinycomp.io as tio\n"
            "assert not {'tinycomp.conv', 'tinycomp.pooling', 'tinycomp.batchnorm'} & set(sys.modules)\n"
            f"for p in [{str(path)!r}, *({str(pretrained_path('digits_cnn'))!r}, {str(pretrained_path('digits_cnn_wide'))!r})]:\n"
            "    tio.load(p)\n")
    subprocess.run([sys.executable, '-c', code], check=True, timeout=300)


def test_a_redefined_layer_class_is_named_in_the_error(tmp_path):
    class Linear(Module):                      # e.g. a notebook's own Linear, never registered
        def config(self): return {}
    with pytest.raises(ModelFileError, match=r"not the registered tinycomp.nn.modules.Linear \(a class redefined in a notebook\?\)"):
        tio.save(Sequential(Linear()), tmp_path / 'x.npz')
    assert not (tmp_path / 'x.npz').exists()


def test_a_notebooks_own_version_of_a_layer_saves_as_the_package_layer(tmp_path):
    "Notebooks (module __main__) redefine package layers; their models save under the package's names."
    from tinycomp.nn.modules import Parameter
    class Linear(Module):
        def __init__(self):
            super().__init__()
            self.weight, self.bias = Parameter(np.full((2, 3), 0.5, np.float32)), Parameter(np.zeros(2, np.float32))
        def config(self): return dict(in_features=3, out_features=2, bias=True)
        def forward(self, x): return x
    Linear.__module__, Linear.__qualname__ = '__main__', 'Linear'      # as a notebook defines it
    back = tio.load(tio.save(Sequential(Linear()), tmp_path / 'nb.npz'))
    assert type(back[0]) is tfiles.LAYERS['Linear'] and np.array_equal(back[0].weight.data, np.full((2, 3), 0.5, np.float32))


def test_the_package_class_replaces_a_notebooks_earlier_registration(restore_layers):
    "nbdev_test runs several notebooks in one process: a notebook may register its layer before the package does."
    mine = type('Scale7', (), {'config': lambda self: {}, '__module__': '__main__'})
    package = type('Scale7', (), {'config': lambda self: {}, '__module__': 'tinycomp.somewhere'})
    tfiles.register_layer(mine)
    assert tfiles.register_layer(package) is package and tfiles.LAYERS['Scale7'] is package
    assert tfiles.register_layer(mine) is mine and tfiles.LAYERS['Scale7'] is package       # and it stays


# ---------------------------------------------------------------- unpacked-size limit and memory (issue 16, item 8)
def zeros_linear_file(path, n, deflate=True):
    "A valid model file holding Linear(n, n) of zeros, deflated: it weighs a tiny fraction of what it unpacks to."
    m = Linear(n, n)
    m.weight.data[...] = 0
    m.bias.data[...] = 0
    raw = tio.save(m, path.with_suffix('.raw.npz'))
    with zipfile.ZipFile(raw) as src, zipfile.ZipFile(path, 'w', zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED) as dst:
        for info in src.infolist():
            dst.writestr(info.filename, src.read(info.filename))
    raw.unlink()
    return path


def traced_peak(fn):
    import tracemalloc
    tracemalloc.start()
    try:
        try: out = fn()
        except Exception as e: out = e
        return out, tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_zip_bomb_is_refused_from_the_zip_directory_without_allocating(tmp_path, monkeypatch):
    path = zeros_linear_file(tmp_path / 'bomb.npz', 2000)                  # 16 MB of float32 zeros, ~20 KB on disk
    assert path.stat().st_size < 100_000
    err, peak = traced_peak(lambda: tio.load(path, max_bytes=1 << 20))
    assert isinstance(err, ModelFileError), err
    assert 'zip directory declares 16,008,' in str(err) and 'limit of 1,048,576 bytes' in str(err) and 'on disk' in str(err)
    assert peak < 2 << 20, peak                                            # nothing array-sized was allocated
    monkeypatch.setattr(tio, 'MAX_UNPACKED_BYTES', 1 << 20)                # the module constant is the default
    with pytest.raises(ModelFileError, match='more than the limit'):
        tio.read_manifest(path)
    assert isinstance(tio.load(path, max_bytes=32 << 20), Linear)          # a caller may raise the limit on purpose
    with pytest.raises(TinycompError, match='max_bytes must be'):
        tio.load(path, max_bytes=-1)


def test_array_headers_are_checked_against_the_limit_and_the_members(tmp_path, good):
    _, path, man, arrays = good
    # a header declaring a huge shape whose member holds almost nothing: refused by the limit, then as inconsistent
    big = dict(man, arrays=dict(man['arrays'], **{'0.weight': {'shape': [20000, 20000], 'dtype': 'float32'}}))
    p = tmp_path / 'liar.npz'
    buf = _io_bytes_of_npy_header((20000, 20000), np.float32) + b'\0' * 64
    craft(p, big, arrays)
    with zipfile.ZipFile(p) as zf:
        members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    members['0.weight.npy'] = buf
    with zipfile.ZipFile(p, 'w') as zf:
        for k, v in members.items(): zf.writestr(k, v)
    err, peak = traced_peak(lambda: tio.load(p))
    assert isinstance(err, ModelFileError) and 'array headers declare more than' in str(err), err
    assert '1,600,000,000 bytes' in str(err) and peak < 2 << 20
    err = traced_peak(lambda: tio.load(p, max_bytes=4 << 30))[0]           # within the limit: the member is too short
    assert isinstance(err, ModelFileError) and 'its zip member holds 64' in str(err), err


def _io_bytes_of_npy_header(shape, dtype):
    import io
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {'descr': np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             'fortran_order': False, 'shape': shape})
    return f.getvalue()


def test_a_config_building_more_than_the_limit_is_stopped(tmp_path):
    path = tio.save(Sequential(Linear(2, 3)), tmp_path / 'small.npz')
    man, arrays = parts(path)
    node = man['model']['children']['0']
    node['config'] = dict(node['config'], in_features=3000, out_features=3000)   # the arrays stay small
    p = craft(tmp_path / 'cfg.npz', man, arrays)
    with pytest.raises(ModelFileError, match=r'layer configs build more weights than the limit of 1,048,576 bytes.*at model\.0'):
        tio.load(p, max_bytes=1 << 20)
    with pytest.raises(ModelFileError, match='the config and the weights disagree'):
        tio.load(p)


def test_load_allocates_about_what_the_arrays_hold(tmp_path):
    path = zeros_linear_file(tmp_path / 'z.npz', 1000)                     # 4 MB of weights
    model, peak = traced_peak(lambda: tio.load(path))
    assert isinstance(model, Linear) and not model.weight.data.any()
    held = model.weight.data.nbytes + model.bias.data.nbytes
    # tracemalloc also counts the np.empty a constructor makes (never touched, so never resident): 2x, was 5x
    assert peak < 2.2 * held, (peak, held)
    code = ("import resource, sys; from tinycomp import io; import tinycomp.nn.modules; "
            "r0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss; io.load(sys.argv[1]); "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - r0)")
    big = zeros_linear_file(tmp_path / 'big.npz', 3000)                   # 36 MB of weights
    grew_kb = int(subprocess.run([sys.executable, '-c', code, str(big)], capture_output=True, text=True,
                                 check=True).stdout)
    assert grew_kb * 1024 < 1.3 * 36e6, grew_kb                             # resident memory: about what it holds
    rng = np.random.default_rng(0)                                         # and the values are the file's, bitwise
    m = Linear(300, 200); m.weight.data[...] = rng.normal(size=(200, 300)).astype(np.float32)
    back = tio.load(tio.save(m, tmp_path / 'r.npz'))
    assert back.weight.data.tobytes() == m.weight.data.tobytes() and back.weight.data.flags.writeable


def test_a_fortran_order_member_still_loads(tmp_path):
    m = Linear(5, 4)
    path = tio.save(m, tmp_path / 'c.npz')
    man, arrays = parts(path)
    arrays['weight'] = np.asfortranarray(arrays['weight'])
    back = tio.load(craft(tmp_path / 'f.npz', man, arrays))
    assert np.array_equal(back.weight.data, m.weight.data) and back.weight.data.flags.c_contiguous


def test_parallel_loads_are_correct_and_leave_the_generator_alone(tmp_path, good):
    import threading
    m, path, _, _ = good
    before = T.default_generator()
    T.manual_seed(3)
    seeded = T.default_generator()
    expected = np.random.default_rng(3).random(4)
    errors, done = [], []
    def work():
        try:
            for _ in range(5): assert_same_model(tio.load(path), m); done.append(1)
        except Exception as e: errors.append(e)
    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert not errors and len(done) == 30, errors
    assert T.default_generator() is seeded and np.array_equal(seeded.random(4), expected)
    assert before is not None


def test_write_json_takes_numpy_values_and_writes_atomically(tmp_path):
    import json
    from tinycomp.files import write_json
    path = write_json({'n': np.int64(3), 'x': np.float32(0.5), 'ok': np.bool_(True), 'a': np.arange(3)}, tmp_path / 'r.json')
    assert json.loads(path.read_text()) == {'n': 3, 'x': 0.5, 'ok': True, 'a': [0, 1, 2]}
    with pytest.raises(TypeError, match='not JSON serializable'): write_json({'f': object()}, path)
    assert json.loads(path.read_text())['n'] == 3 and sorted(p.name for p in tmp_path.iterdir()) == ['r.json']
