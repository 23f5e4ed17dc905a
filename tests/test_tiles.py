"Module 02 part (d): the register-tiled convolution, on this CPU's widest vectors, on AVX2 code, and where it is missing."
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tinycomp.conv import conv2d_forward
from tinycomp.errors import ShapeError
from tinycomp.tiles import conv2d_tiled, pack_tiled_weights

pytestmark = pytest.mark.module02


@pytest.mark.parametrize('n,c,h,w,cout,k,stride,padding,dilation', [
    (2, 3, 9, 7, 5, 3, 1, 1, 1), (3, 16, 8, 8, 32, 3, 2, 1, 1), (1, 4, 11, 11, 40, 3, 1, 2, 2), (2, 8, 6, 6, 16, 1, 1, 0, 1),
    (1, 1, 28, 28, 16, 5, 1, 2, 1), (30, 2, 5, 5, 3, 3, 1, 1, 1), (1, 17, 3, 4, 33, 3, (2, 1), (0, 1), 1)])
def test_the_tiled_conv_computes_what_conv2d_computes(n, c, h, w, cout, k, stride, padding, dilation, float_tiles):
    rng = np.random.default_rng(cout)
    x, wt = rng.standard_normal((n, c, h, w)).astype(np.float32), rng.standard_normal((cout, c, k, k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    ref = conv2d_forward(x, wt, b, stride, padding, dilation)
    packed = pack_tiled_weights(wt)
    for _ in range(2):                                           # the second call reuses the offsets it remembered
        got = conv2d_tiled(x, wt, b, stride, padding, dilation, packed=packed)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert len(packed.offsets) == 1


@pytest.mark.parametrize('nchw', [True, False])
@pytest.mark.parametrize('clamp', [None, (0.0, np.inf), (0.0, 6.0), (-0.5, 0.25)])
def test_the_epilogue_adds_the_residual_then_clamps(nchw, clamp, float_tiles):
    from tinycomp.tiles import pad_nchw_to_nhwc, run_tiles, tile_offsets
    rng = np.random.default_rng(7)
    x, w, b = (rng.standard_normal(s).astype(np.float32) for s in ((3, 5, 9, 7), (20, 5, 3, 3), (20,)))
    ref = conv2d_forward(x, w, b, 1, 1)
    residual = rng.standard_normal(ref.shape).astype(np.float32)
    ref = ref + residual if clamp is None else np.clip(ref + residual, *clamp)
    packed = pack_tiled_weights(w)
    base, koff, oh, ow = tile_offsets(3, 9, 7, 5, 3, 3, (1, 1), (1, 1), (1, 1))
    xp = np.empty((3, 11, 9, 5), np.float32)
    pad_nchw_to_nhwc(x, 1, 1, xp)
    if nchw: out, res, want = np.empty_like(ref), residual, ref
    else: out, res, want = (np.empty((3 * oh * ow, 20), np.float32), np.ascontiguousarray(residual.transpose(0, 2, 3, 1)).reshape(-1, 20),
                            ref.transpose(0, 2, 3, 1).reshape(-1, 20))
    run_tiles(xp, packed, base, koff, b, out, residual=res, clamp=clamp)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize('threads', [1, 2])
@pytest.mark.parametrize('n,c,h,w,cout,k,stride,padding,dilation', [
    (2, 3, 32, 32, 32, 3, 1, 1, 1), (3, 1, 28, 40, 20, 5, 1, 2, 1), (2, 16, 33, 47, 17, 3, (2, 1), 1, (1, 2)),
    (1, 3, 9, 70, 9, 3, (3, 1), 0, 1), (5, 2, 40, 33, 8, 1, 1, 0, 1)])
def test_a_short_window_over_wide_rows_runs_by_rows_and_computes_the_same(n, c, h, w, cout, k, stride, padding, dilation,
                                                                          threads, float_tiles):
    import numba
    from tinycomp.tiles import ROW_PIXELS
    rng = np.random.default_rng(cout)
    x, wt = rng.standard_normal((n, c, h, w)).astype(np.float32), rng.standard_normal((cout, c, k, k)).astype(np.float32)
    b = rng.standard_normal(cout).astype(np.float32)
    ref = conv2d_forward(x, wt, b, stride, padding, dilation)
    assert ref.shape[3] >= ROW_PIXELS
    packed = pack_tiled_weights(wt)
    before = numba.get_num_threads()
    numba.set_num_threads(threads)
    try: got = conv2d_tiled(x, wt, b, stride, padding, dilation, packed=packed)
    finally: numba.set_num_threads(before)
    assert [by_rows for by_rows, *_ in packed.offsets.values()] == [True]
    np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())


def test_many_channels_or_narrow_rows_stay_with_the_tiles(float_tiles):
    for c, w in ((17, 40), (3, 8)):
        rng = np.random.default_rng(c)
        x, wt = rng.standard_normal((2, c, 9, w)).astype(np.float32), rng.standard_normal((5, c, 3, 3)).astype(np.float32)
        packed = pack_tiled_weights(wt)
        got = conv2d_tiled(x, wt, None, 1, 1, packed=packed)
        assert [by_rows for by_rows, *_ in packed.offsets.values()] == [False]
        ref = conv2d_forward(x, wt, None, 1, 1)
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-5 * np.abs(ref).max())
    assert pack_tiled_weights(np.ones((4, 17, 3, 3), np.float32)).rows is None      # 153 inputs: not packed for rows


def test_a_tile_scratch_too_small_is_refused(float_tiles):
    from tinycomp.tiles import TILE_FLOATS, pad_nchw_to_nhwc, run_tiles, tile_offsets
    x, w = np.ones((1, 2, 5, 5), np.float32), np.ones((3, 2, 3, 3), np.float32)
    base, koff, oh, ow = tile_offsets(1, 5, 5, 2, 3, 3, (1, 1), (1, 1), (1, 1))
    xp = np.empty((1, 7, 7, 2), np.float32)
    pad_nchw_to_nhwc(x, 1, 1, xp)
    with pytest.raises(ShapeError, match='tile scratch needs'):
        run_tiles(xp, pack_tiled_weights(w), base, koff, np.zeros(3, np.float32), np.empty((1, 3, 5, 5), np.float32),
                  tile=np.empty(TILE_FLOATS - 1, np.float32))


def test_bad_shapes_are_refused(float_tiles):
    wt = np.ones((4, 3, 3, 3), np.float32)
    with pytest.raises(ShapeError, match='expects 3'): conv2d_tiled(np.ones((1, 2, 5, 5), np.float32), wt)
    with pytest.raises(ShapeError, match='too small'): conv2d_tiled(np.ones((1, 3, 2, 2), np.float32), wt)
    with pytest.raises(ShapeError, match='4-D weight'): pack_tiled_weights(np.ones((4, 3), np.float32))


_CHILD = textwrap.dedent("""
    import json, numpy as np
    from tinycomp.tiles import FLOAT_LANES, VECTOR_LANES
    from tinycomp.conv import conv2d_forward
    from tinycomp.data import load_shipped
    from tinycomp.deploy.runtime import freeze
    from tinycomp.models import load_pretrained
    from tinycomp.tensor import Tensor, no_grad
    out = {'lanes': VECTOR_LANES}
    X = load_shipped('mnist5k', 'test')[0][:16]
    m = load_pretrained('resnet8')
    f = freeze(m, X[:2])
    with no_grad(): ref = m(Tensor(X)).data
    out['err'] = float(np.abs(f.run(X) - ref).max() / np.abs(ref).max())
    out['kinds'] = sorted({s.kind for s in f.steps if s.kind.startswith('conv')})
    if FLOAT_LANES:
        from tinycomp.tiles import conv2d_tiled
        rng = np.random.default_rng(0)
        x, w = rng.standard_normal((4, 8, 9, 9)).astype(np.float32), rng.standard_normal((12, 8, 3, 3)).astype(np.float32)
        r = conv2d_forward(x, w, None, 1, 1)
        out['tiled_err'] = float(np.abs(conv2d_tiled(x, w, None, 1, 1) - r).max() / np.abs(r).max())
        x, w = rng.standard_normal((2, 3, 20, 40)).astype(np.float32), rng.standard_normal((7, 3, 3, 3)).astype(np.float32)
        r = conv2d_forward(x, w, None, 1, 1)
        out['rows_err'] = float(np.abs(conv2d_tiled(x, w, None, 1, 1) - r).max() / np.abs(r).max())
    else:
        from tinycomp.tiles import pack_tiled_weights
        try: pack_tiled_weights(np.ones((2, 2, 3, 3), np.float32))
        except Exception as e: out['refused'] = str(e)
    print(json.dumps(out))
""")

_HASWELL = '+avx,+avx2,+fma,+f16c,+bmi,+bmi2,+lzcnt,+movbe,+popcnt,+sse,+sse2,+sse3,+ssse3,+sse4.1,+sse4.2,+cx16,+xsave'


def _child(tmp_path, **env):
    e = {**os.environ, 'NUMBA_CACHE_DIR': str(tmp_path / 'numba_cache'), 'NUMBA_NUM_THREADS': '1', **env}
    r = subprocess.run([sys.executable, '-c', _CHILD], capture_output=True, text=True, env=e, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_the_avx2_kernel_compiled_for_a_haswell_computes_the_same(tmp_path, float_tiles):
    got = _child(tmp_path, TINYCOMP_FLOAT_KERNEL='avx2', NUMBA_CPU_NAME='haswell', NUMBA_CPU_FEATURES=_HASWELL)
    assert got['lanes'] == 8 and got['kinds'] == ['conv (register tiles)']
    assert got['err'] < 1e-5 and got['tiled_err'] < 1e-5 and got['rows_err'] < 1e-5


@pytest.mark.slow
def test_without_the_kernel_the_runtime_uses_im2col_and_a_matrix_product(tmp_path):
    got = _child(tmp_path, TINYCOMP_FLOAT_KERNEL='none')
    assert got['lanes'] == 0 and got['kinds'] == ['conv (im2col + GEMM)'] and got['err'] < 1e-5
    assert 'needs an x86 CPU with AVX2 and FMA' in got['refused']
