"Tests of tinycomp.pruning.sparse: CSR conversion and validation, sparse x dense kernels, sparse layers, model files."
import json

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.conv import Conv2d, conv2d_forward
from tinycomp.errors import ModelFileError, ShapeError, TinycompError
from tinycomp.nn.modules import Flatten, Linear, ReLU, Sequential
from tinycomp.pruning import sparse as S
from tinycomp.tensor import Tensor, manual_seed

pytestmark = pytest.mark.module05


def sparse_matrix(rng, m, k, density, dtype=np.float32):
    w = rng.standard_normal((m, k)).astype(dtype)
    return np.where(rng.random((m, k)) < density, w, 0).astype(dtype)


def csr_reference(a):
    "Row-by-row CSR built with plain Python (independent of the implementation)."
    indptr, indices, data = [0], [], []
    for row in a:
        for j, v in enumerate(row):
            if v != 0: indices.append(j); data.append(v)
        indptr.append(len(indices))
    return np.array(indptr, np.int32), np.array(indices, np.int32), np.array(data, np.float32)


# ---------------------------------------------------------------- to_csr / csr_to_dense / check_csr
@pytest.mark.parametrize('shape, density', [((1, 1), 1.0), ((5, 7), 0.3), ((13, 1), 0.5), ((1, 40), 0.2), ((30, 17), 0.05),
                                            ((8, 8), 0.0), ((6, 9), 1.0)])
def test_to_csr_matches_reference(shape, density):
    rng = np.random.default_rng(sum(shape))
    a = sparse_matrix(rng, *shape, density)
    a[0, 0] = -0.0 if a.size > 1 else a[0, 0]
    before = a.copy()
    got = S.to_csr(a)
    want = csr_reference(a)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and np.array_equal(g, w)
    assert np.array_equal(a, before)
    assert np.array_equal(S.csr_to_dense(*got, shape), a)
    S.check_csr(*got, shape)


def test_to_csr_dtypes_and_inputs():
    ip, ix, da = S.to_csr(np.array([[0, 3], [2, 0]], np.int64))
    assert (ip.dtype, ix.dtype, da.dtype) == (np.int32, np.int32, np.float32)
    assert ip.tolist() == [0, 1, 2] and ix.tolist() == [1, 0] and da.tolist() == [3.0, 2.0]
    ip, ix, da = S.to_csr(np.zeros((3, 4)))
    assert ip.tolist() == [0, 0, 0, 0] and ix.size == 0 and da.size == 0
    with pytest.raises(ShapeError, match='2-D'): S.to_csr(np.ones(4))
    with pytest.raises(ShapeError, match='2-D'): S.to_csr(np.ones((2, 2, 2)))
    with pytest.raises(TinycompError, match='NaN'): S.to_csr(np.array([[1.0, np.nan]]))
    with pytest.raises(TinycompError, match='NaN'): S.to_csr(np.array([[np.inf]]))


def _good():
    a = np.array([[0, 2, 0, 1], [0, 0, 0, 0], [5, 0, 6, 0]], np.float32)
    return [x.copy() for x in S.to_csr(a)], (3, 4)


@pytest.mark.parametrize('edit, match', [
    (lambda c: c.__setitem__(0, c[0].astype(np.int64)), 'indptr must be a 1-D int32'),
    (lambda c: c.__setitem__(1, c[1].astype(np.int64)), 'indices must be a 1-D int32'),
    (lambda c: c.__setitem__(2, c[2].astype(np.float64)), 'data must be a 1-D float32'),
    (lambda c: c.__setitem__(0, c[0][:-1].copy()), 'rows \\+ 1 = 4'),
    (lambda c: c.__setitem__(0, c[0] + 1), r'indptr\[0\] must be 0'),
    (lambda c: c.__setitem__(0, np.array([0, 2, 1, 4], np.int32)), 'monotonic'),
    (lambda c: c.__setitem__(0, np.array([0, 2, 2, 3], np.int32)), 'nnz mismatch'),
    (lambda c: c.__setitem__(1, c[1][:-1].copy()), 'nnz mismatch'),
    (lambda c: c.__setitem__(2, c[2][:-1].copy()), 'nnz mismatch'),
    (lambda c: c[1].__setitem__(3, 4), r'indices must lie in \[0, 4\)'),
    (lambda c: c[1].__setitem__(0, -1), r'indices must lie in \[0, 4\)'),
    (lambda c: c[1].__setitem__(1, 1), 'strictly increasing.*row 0'),          # duplicate column
    (lambda c: c[1].__setitem__(slice(2, 4), [2, 0]), 'strictly increasing.*row 2'),
    (lambda c: c[2].__setitem__(0, np.nan), 'NaN'),
])
def test_check_csr_rules(edit, match):
    csr, shape = _good()
    S.check_csr(*csr, shape)
    edit(csr)
    with pytest.raises(TinycompError, match=match): S.check_csr(*csr, shape)


def test_check_csr_row_boundaries_are_not_violations():
    # row 0 ends at column 3, row 1 starts at column 0: fine
    ip, ix, da = S.to_csr(np.array([[0, 0, 0, 1], [1, 0, 0, 0], [0, 0, 0, 0], [0, 1, 0, 0]], np.float32))
    S.check_csr(ip, ix, da, (4, 4))
    S.check_csr(np.zeros(1, np.int32), np.zeros(0, np.int32), np.zeros(0, np.float32), (0, 5))


# ---------------------------------------------------------------- products
@pytest.mark.parametrize('m, k, n, density, block', [(1, 1, 1, 1.0, 512), (7, 5, 3, 0.5, 512), (37, 50, 1037, 0.2, 512),
                                                    (37, 50, 1037, 0.2, 7), (64, 33, 64, 0.1, 64), (16, 40, 513, 0.9, 512),
                                                    (10, 12, 5, 0.0, 4),
                                                    (20, 70, 100, 0.3, 16), (21, 70, 128, 0.3, 512), (5, 9, 130, 0.5, 512)])
def test_csr_matmul_naive_and_fast_match_dense(m, k, n, density, block):
    rng = np.random.default_rng(m * 1000 + n)
    a = sparse_matrix(rng, m, k, density)
    if m > 3: a[2] = 0                                   # an empty row
    x = rng.standard_normal((k, n)).astype(np.float32)
    csr = S.to_csr(a)
    copies = [c.copy() for c in csr] + [x.copy()]
    want = a.astype(np.float64) @ x.astype(np.float64)
    naive = S.csr_matmul(*csr, x)
    fast = S.csr_matmul_fast(*csr, x, block=block)
    for got in (naive, fast):
        assert got.dtype == np.float32 and got.shape == (m, n)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
    for c, d in zip(list(csr) + [x], copies): assert np.array_equal(c, d)


def test_csr_matmul_fast_out_and_noncontiguous_input():
    rng = np.random.default_rng(1)
    a = sparse_matrix(rng, 9, 11, 0.4)
    x = rng.standard_normal((6, 11)).astype(np.float32).T      # (11, 6), not C-contiguous
    out = np.full((9, 6), np.nan, np.float32)
    res = S.csr_matmul_fast(*S.to_csr(a), x, out=out)
    assert res is out
    np.testing.assert_allclose(out, a @ x, rtol=1e-5, atol=1e-5)
    with pytest.raises(ShapeError, match='out must be'): S.csr_matmul_fast(*S.to_csr(a), x, out=np.empty((9, 5), np.float32))
    with pytest.raises(TinycompError, match='block'): S.csr_matmul_fast(*S.to_csr(a), x, block=0)


def test_csr_matmul_bad_input():
    csr = S.to_csr(np.eye(3, dtype=np.float32))
    for fn in (S.csr_matmul, S.csr_matmul_fast):
        with pytest.raises(TinycompError, match='float32'): fn(*csr, np.ones((3, 2)))
        with pytest.raises(ShapeError, match='2-D'): fn(*csr, np.ones(3, np.float32))
        with pytest.raises(TinycompError, match=r'\[0, 2\)'): fn(*csr, np.ones((2, 2), np.float32))
        with pytest.raises(TinycompError, match='nnz mismatch'): fn(csr[0], csr[1][:2], csr[2], np.ones((3, 2), np.float32))


# ---------------------------------------------------------------- layers
def test_sparse_linear_equals_dense():
    manual_seed(0)
    rng = np.random.default_rng(2)
    for bias in (True, False):
        lin = Linear(23, 9, bias=bias)
        lin.weight.data[rng.random((9, 23)) < 0.7] = 0
        sl = S.SparseLinear.from_dense(lin)
        assert sl.nnz == np.count_nonzero(lin.weight.data) and ('bias' in sl._buffers) == bias
        x = rng.standard_normal((5, 23)).astype(np.float32)
        np.testing.assert_allclose(sl(Tensor(x)).data, lin(Tensor(x)).data, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(sl(x).data, lin(Tensor(x)).data, rtol=1e-5, atol=1e-5)
        assert np.array_equal(sl.weight_matrix(), lin.weight.data)
        assert sl.density() == pytest.approx(sl.nnz / (9 * 23))
    with pytest.raises(ShapeError, match='23 input features'): sl(Tensor(np.ones((2, 22), np.float32)))


class _Masked:
    "A stand-in for part a's masked layers: weight, weight_mask, bias."
    def __init__(self, w, m, b): self.weight, self.weight_mask, self.bias = w, m, b


def test_from_dense_applies_a_mask():
    rng = np.random.default_rng(3)
    w = rng.standard_normal((4, 6)).astype(np.float32)
    mask = (rng.random((4, 6)) < 0.5).astype(np.float32)
    sl = S.SparseLinear.from_dense(_Masked(w, mask, np.zeros(4, np.float32)))
    assert np.array_equal(sl.weight_matrix(), w * mask)


@pytest.mark.parametrize('n, c, h, w, cout, k, stride, padding, dilation', [
    (2, 6, 9, 8, 8, (3, 2), (2, 1), (1, 2), (1, 2)), (1, 3, 5, 5, 4, 3, 1, 1, 1), (3, 4, 7, 6, 5, 1, 1, 0, 1),
    (1, 8, 40, 60, 6, 3, 1, 1, 1),                      # several chunks of output pixels
    (65, 2, 6, 6, 4, 3, 2, 0, 1)])
def test_sparse_conv2d_equals_dense(n, c, h, w, cout, k, stride, padding, dilation):
    manual_seed(1)
    rng = np.random.default_rng(n + c)
    conv = Conv2d(c, cout, k, stride, padding, dilation)
    conv.weight.data[rng.random(conv.weight.shape) < 0.75] = 0
    sc = S.SparseConv2d.from_dense(conv)
    x = rng.standard_normal((n, c, h, w)).astype(np.float32)
    x0 = x.copy()
    np.testing.assert_allclose(sc(Tensor(x)).data, conv2d_forward(x, conv.weight.data, conv.bias.data, stride, padding, dilation),
                               rtol=1e-4, atol=1e-4)
    assert np.array_equal(x, x0)
    assert np.array_equal(sc.weight_matrix(), conv.weight.data.reshape(cout, -1))


def test_sparse_layer_errors():
    with pytest.raises(TinycompError, match='groups=1'): S.SparseConv2d.from_dense(Conv2d(4, 4, 3, groups=2))
    with pytest.raises(TinycompError, match='nnz must lie'): S.SparseLinear(3, 2, nnz=7)
    with pytest.raises(TinycompError, match='nnz must lie'): S.SparseConv2d(1, 2, 3, nnz=-1)
    sc = S.SparseConv2d.from_dense(Conv2d(3, 4, 3))
    with pytest.raises(ShapeError, match='4-D'): sc(Tensor(np.ones((3, 5, 5), np.float32)))
    with pytest.raises(ShapeError, match='channels'): sc(Tensor(np.ones((1, 2, 5, 5), np.float32)))


# ---------------------------------------------------------------- model files
def _model(density=0.1, seed=0):
    manual_seed(seed)
    rng = np.random.default_rng(seed)
    conv, lin = Conv2d(4, 16, 3, padding=1), Linear(16 * 6 * 6, 64)
    for layer in (conv, lin):
        layer.weight.data[rng.random(layer.weight.shape) >= density] = 0
    dense = Sequential(conv, ReLU(), Flatten(), lin)
    return dense, Sequential(S.SparseConv2d.from_dense(conv), ReLU(), Flatten(), S.SparseLinear.from_dense(lin))


def test_save_load_round_trip_and_file_size(tmp_path):
    dense, sparse = _model()
    x = np.random.default_rng(5).standard_normal((3, 4, 6, 6)).astype(np.float32)
    back = tio.load(tio.save(sparse, tmp_path / 's.npz'))
    for a, b in zip(sparse, back):
        assert type(a) is type(b)
        for k, v in a._buffers.items(): assert np.array_equal(v, b._buffers[k]) and v.dtype == b._buffers[k].dtype
    np.testing.assert_allclose(back(Tensor(x)).data, dense(Tensor(x)).data, rtol=1e-4, atol=1e-4)
    d = tio.save(dense, tmp_path / 'd.npz').stat().st_size
    s = (tmp_path / 's.npz').stat().st_size
    assert s <= 0.3 * d, (s, d)


def _rewrite(model, tmp_path, edit):
    path = tio.save(model, tmp_path / 'src.npz')
    with np.load(path, allow_pickle=False) as f: arrays = {k: f[k] for k in f.files}
    manifest = json.loads(arrays.pop('__manifest__').tobytes())
    edit(manifest, arrays)
    out = tmp_path / 'bad.npz'
    np.savez(out, __manifest__=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
    return out


def _set(name, fn):
    def edit(man, arr):
        arr[name] = fn(arr[name].copy())
        man['arrays'][name] = {'shape': list(arr[name].shape), 'dtype': arr[name].dtype.name}
    return edit


def _bump(a, i, v): a[i] = v; return a


@pytest.mark.parametrize('edit, match', [
    (_set('0.indptr', lambda a: _bump(a, 0, 1)), r'layer 0 \(SparseConv2d\): CSR indptr\[0\] must be 0'),
    (_set('3.indptr', lambda a: _bump(a, 5, a[4] - 1)), r'layer 3 \(SparseLinear\).*monotonic'),
    (_set('3.indptr', lambda a: _bump(a, -1, a[-1] - 1)), 'nnz mismatch'),
    (_set('3.indices', lambda a: _bump(a, 0, 576)), r'indices must lie in \[0, 576\)'),
    (_set('0.indices', lambda a: _bump(a, 0, -3)), r'indices must lie in \[0, 36\)'),
    (_set('3.indices', lambda a: a[::-1].copy()), 'strictly increasing'),
    (_set('0.indices', lambda a: _bump(a, 1, a[0])), 'strictly increasing'),
    (_set('3.indptr', lambda a: a.astype(np.int64)), "indptr' is int64 .* expects int32"),
    (_set('3.data', lambda a: a.astype(np.float64)), "data' is float64 .* expects float32"),
    (_set('3.indptr', lambda a: a[:-1].copy()), 'expects int32 .65,.'),
    (_set('3.data', lambda a: _bump(a, 0, np.nan)), 'NaN or infinite'),
])
def test_malformed_sparse_files(tmp_path, edit, match):
    _, sparse = _model()
    with pytest.raises(ModelFileError, match=match): tio.load(_rewrite(sparse, tmp_path, edit))


def test_malformed_nnz_in_manifest(tmp_path):
    _, sparse = _model()
    def edit(man, arr):
        man['model']['children']['3']['config']['nnz'] += 1
    with pytest.raises(ModelFileError, match="indices' is int32 .* expects int32"): tio.load(_rewrite(sparse, tmp_path, edit))
    def edit2(man, arr):                       # nnz, indices and data all shrunk together: indptr no longer agrees
        man['model']['children']['3']['config']['nnz'] -= 1
        for k in ('3.indices', '3.data'):
            arr[k] = arr[k][:-1].copy(); man['arrays'][k]['shape'] = [arr[k].size]
    with pytest.raises(ModelFileError, match='nnz mismatch'): tio.load(_rewrite(sparse, tmp_path, edit2))


# ---------------------------------------------------------------- benchmark plumbing (no timing assertions)
def test_benchmark_rows_and_crossover():
    rows = S.sparse_benchmark(densities=(0.5, 0.05), repeats=1, threads=1,
                              cases=[('tiny gemm', 'gemm', (16, 32, 24)), ('tiny conv', 'conv', (1, 4, 6, 6, 8))])
    assert [(r['case'], r['density']) for r in rows] == [('tiny gemm', 0.5), ('tiny gemm', 0.05), ('tiny conv', 0.5), ('tiny conv', 0.05)]
    assert all(r['dense_ms'] > 0 and r['sparse_ms'] > 0 and r['threads'] == 1 for r in rows)
    assert 'crossover tiny gemm' in S.format_sparse_benchmark(rows)
    fake = [dict(case='c', density=d, speedup=s) for d, s in ((0.5, 0.5), (0.2, 1.0 / 1.0001), (0.1, 2.0))]
    c = S.crossover_density(fake, 'c')
    assert 0.1 < c < 0.2
    fake2 = [dict(case='c', density=d, speedup=s) for d, s in ((0.5, 0.25), (0.1, 4.0))]
    assert S.crossover_density(fake2, 'c') == pytest.approx(np.sqrt(0.05))
    assert S.crossover_density([dict(case='c', density=0.5, speedup=2.0), dict(case='c', density=0.1, speedup=3.0)], 'c') is None
    w = S._random_sparse(np.random.default_rng(0), (10, 10), 0.23)
    assert np.count_nonzero(w) == 23
