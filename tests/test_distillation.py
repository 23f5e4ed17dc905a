"Tests for tinycomp.distillation: the KD, hint and relation losses against NumPy formulas, gradients, training, errors."

import numpy as np
import pytest

from tinycomp.conv import Conv2d
from tinycomp.data import DataLoader, load_digits
from tinycomp.distillation import (cache_teacher_logits, distill, hint_loss, hint_regressor, kd_loss, kd_loss_grad,
                                   paired_summary, relation_loss, softmax_with_temperature, tiny_cnn, train_student)
from tinycomp.errors import TinycompError
from tinycomp.models import digits_cnn, digits_cnn_wide, fit
from tinycomp.nn.modules import Flatten, Linear, Sequential
from tinycomp.optim import Adam
from tinycomp.tensor import Tensor, gradcheck, manual_seed, no_grad

pytestmark = pytest.mark.module06


# ---- NumPy formulas, written independently of the package -------------------------------------------------------

def np_softmax(z, axis=-1):
    z = np.asarray(z, np.float64)
    e = np.exp(z - z.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)

def np_kd(zs, zt, y, T, alpha, t_squared=True):
    n, c = zs.shape
    ce = -np.log(np_softmax(zs)[np.arange(n), y]).mean()
    p, q = np_softmax(zt / T, 1), np_softmax(zs / T, 1)
    kl = np.sum(p * (np.log(p) - np.log(q))) / n
    return alpha * ce + (1 - alpha) * (T * T if t_squared else 1.0) * kl

def np_kd_grad(zs, zt, y, T, alpha, t_squared=True):
    n, c = zs.shape
    soft = (np_softmax(zs / T, 1) - np_softmax(zt / T, 1)) / (T * n)
    return alpha * (np_softmax(zs, 1) - np.eye(c)[y]) / n + (1 - alpha) * (T * T if t_squared else 1.0) * soft

def np_hint(fs, ft, w, b):
    pred = np.einsum('oc,nchw->nohw', w[:, :, 0, 0], fs) + b[None, :, None, None]
    return np.mean((pred - ft) ** 2)

def np_relation(fs, ft):
    def g(f):
        f = f.reshape(len(f), -1).astype(np.float64)
        m = f @ f.T
        return m / np.sqrt((m ** 2).sum(1))[:, None]
    return np.sum((g(fs) - g(ft)) ** 2) / len(fs) ** 2

def random_logits(seed, n=6, c=5, scale=3.0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((n, c)) * scale, rng.standard_normal((n, c)) * scale, rng.integers(0, c, n)

CASES = [(1.0, 0.5), (4.0, 0.5), (2.0, 0.1), (8.0, 0.0), (3.0, 1.0), (0.5, 0.7)]


# ---- softmax with temperature -----------------------------------------------------------------------------------

@pytest.mark.parametrize('T', [0.5, 1.0, 4.0, 20.0])
def test_softmax_with_temperature_formula(T):
    z = np.random.default_rng(0).standard_normal((4, 7)) * 5
    np.testing.assert_allclose(softmax_with_temperature(Tensor(z, dtype=np.float64), T).data, np_softmax(z / T), atol=1e-10)

def test_softmax_with_temperature_stable_and_differentiable():
    out = softmax_with_temperature(np.array([[1e4, 0., -1e4], [1e4, 1e4, 1e4]]), 1.0).data
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, [[1, 0, 0], [1 / 3, 1 / 3, 1 / 3]], atol=1e-6)
    assert gradcheck(lambda z: softmax_with_temperature(z, 2.5), np.random.default_rng(1).standard_normal((3, 4)))
    np.testing.assert_allclose(softmax_with_temperature(np.ones((2, 3, 4)), 2.0).data.sum(-1), 1, atol=1e-6)  # last axis

@pytest.mark.parametrize('T', [0, -1.0, float('inf'), float('nan'), True, '2'])
def test_softmax_with_temperature_bad_T(T):
    with pytest.raises(TinycompError, match='T must be a finite number > 0'): softmax_with_temperature(np.ones((2, 3)), T)


# ---- KD loss and its gradient -----------------------------------------------------------------------------------

@pytest.mark.parametrize('seed', range(3))
@pytest.mark.parametrize('T,alpha', CASES)
def test_kd_loss_matches_formula(seed, T, alpha):
    zs, zt, y = random_logits(seed)
    got = kd_loss(Tensor(zs, dtype=np.float64), Tensor(zt, dtype=np.float64), y, T, alpha).item()
    assert got == pytest.approx(np_kd(zs, zt, y, T, alpha), abs=1e-5, rel=1e-5)
    if alpha < 1 and T != 1:   # the T^2 factor is there: the loss without it is a different number
        assert abs(got - np_kd(zs, zt, y, T, alpha, t_squared=False)) > 1e-3

def test_kd_loss_float32_and_scalar():
    zs, zt, y = random_logits(7)
    loss = kd_loss(zs.astype(np.float32), zt.astype(np.float32), y)
    assert isinstance(loss, Tensor) and loss.shape == () and loss.dtype == np.float32
    assert loss.item() == pytest.approx(np_kd(zs, zt, y, 4.0, 0.5), rel=1e-5)

@pytest.mark.parametrize('seed', range(3))
@pytest.mark.parametrize('T,alpha', CASES)
def test_kd_loss_grad_matches_formula_and_autograd(seed, T, alpha):
    zs, zt, y = random_logits(seed + 10)
    g = kd_loss_grad(zs, zt, y, T, alpha)
    assert isinstance(g, np.ndarray) and g.dtype == np.float64 and g.shape == zs.shape
    np.testing.assert_allclose(g, np_kd_grad(zs, zt, y, T, alpha), atol=1e-5)
    S = Tensor(zs, requires_grad=True, dtype=np.float64)
    kd_loss(S, Tensor(zt, dtype=np.float64), y, T, alpha).backward()
    np.testing.assert_allclose(S.grad, g, atol=1e-5)
    if alpha < 1 and T != 1:   # the gradient without T^2 is measurably different
        assert np.abs(g - np_kd_grad(zs, zt, y, T, alpha, t_squared=False)).max() > 1e-4

def test_kd_loss_gradcheck():
    zs, zt, y = random_logits(3, n=4, c=3)
    for T, alpha in [(1.0, 0.5), (4.0, 0.2), (2.0, 0.0)]:
        assert gradcheck(lambda s: kd_loss(s, zt, y, T, alpha), zs)

def test_teacher_receives_no_gradient():
    zs, zt, y = random_logits(4)
    S, Tt = Tensor(zs, requires_grad=True), Tensor(zt, requires_grad=True)
    kd_loss(S, Tt, y, 4.0, 0.3).backward()
    assert Tt.grad is None and S.grad is not None
    teacher = Linear(3, 5)
    x = np.random.default_rng(0).standard_normal((6, 3))
    kd_loss(S, teacher(Tensor(x)), y).backward()
    assert teacher.weight.grad is None

def test_kd_loss_extreme_logits_no_nan():
    assert np.isfinite(kd_loss([[1e4, 0., -1e4]], [[-1e4, 0., 1e4]], np.array([0]), 1.0, 0.5).item())
    assert np.isfinite(kd_loss_grad([[1e4, 0., -1e4]], [[-1e4, 0., 1e4]], np.array([0]), 1.0, 0.5)).all()

def test_kd_loss_same_logits_has_zero_kl():
    zs, _, y = random_logits(5)
    assert kd_loss(zs, zs, y, 4.0, 0.0).item() == pytest.approx(0, abs=1e-5)

@pytest.mark.parametrize('fn', [kd_loss, kd_loss_grad])
def test_kd_bad_inputs(fn):
    zs, zt, y = random_logits(6)
    with pytest.raises(TinycompError, match=r'student has 5 classes.*teacher has 4'): fn(zs, zt[:, :4], y)
    with pytest.raises(TinycompError, match='different batch sizes'): fn(zs, zt[:4], y)
    with pytest.raises(TinycompError, match='2-D'): fn(zs[0], zt[0], y)
    for T in (0, -2.0):
        with pytest.raises(TinycompError, match='T must be'): fn(zs, zt, y, T=T)
    for alpha in (-0.01, 1.01, 2):
        with pytest.raises(TinycompError, match='alpha'): fn(zs, zt, y, alpha=alpha)
    with pytest.raises(TinycompError, match='labels'): fn(zs, zt, np.full(6, 9))


# ---- hint and relation losses -----------------------------------------------------------------------------------

@pytest.mark.parametrize('cs,ct', [(3, 5), (8, 2), (4, 4)])
def test_hint_loss_matches_formula(cs, ct):
    manual_seed(cs)
    reg = hint_regressor(cs, ct)
    assert isinstance(reg, Conv2d) and reg.kernel_size == (1, 1) and (reg.in_channels, reg.out_channels) == (cs, ct)
    rng = np.random.default_rng(ct)
    fs, ft = rng.standard_normal((3, cs, 4, 5)), rng.standard_normal((3, ct, 4, 5))
    got = hint_loss(Tensor(fs, dtype=np.float64), Tensor(ft, dtype=np.float64), reg).item()
    assert got == pytest.approx(np_hint(fs, ft, reg.weight.data.astype(np.float64), reg.bias.data.astype(np.float64)), rel=1e-5)
    assert gradcheck(lambda s: hint_loss(s, ft[:2, :, :2, :3], reg), fs[:2, :, :2, :3])

def test_hint_loss_gradients_reach_student_and_regressor_not_teacher():
    manual_seed(0)
    reg = hint_regressor(2, 3)
    S = Tensor(np.random.default_rng(0).standard_normal((2, 2, 3, 3)), requires_grad=True)
    Tt = Tensor(np.random.default_rng(1).standard_normal((2, 3, 3, 3)), requires_grad=True)
    hint_loss(S, Tt, reg).backward()
    assert Tt.grad is None and S.grad is not None and reg.weight.grad is not None and reg.bias.grad is not None

def test_hint_loss_bad_inputs():
    reg = hint_regressor(3, 5)
    with pytest.raises(TinycompError, match=r'\(2, 3, 4, 4\).*\(2, 5, 2, 2\)'): hint_loss(np.ones((2, 3, 4, 4)), np.ones((2, 5, 2, 2)), reg)
    with pytest.raises(TinycompError, match='batch and spatial'): hint_loss(np.ones((2, 3, 4, 4)), np.ones((3, 5, 4, 4)), reg)
    with pytest.raises(TinycompError, match='4-D'): hint_loss(np.ones((2, 3, 4)), np.ones((2, 5, 4)), reg)
    with pytest.raises(TinycompError, match=r'maps 3 to 5 channels'): hint_loss(np.ones((2, 4, 4, 4)), np.ones((2, 5, 4, 4)), reg)
    with pytest.raises(TinycompError, match=r'maps 3 to 5 channels'): hint_loss(np.ones((2, 3, 4, 4)), np.ones((2, 6, 4, 4)), reg)
    with pytest.raises(TinycompError, match='positive'): hint_regressor(3, 0)

@pytest.mark.parametrize('s_shape,t_shape', [((4, 3, 4, 4), (4, 8, 2, 2)), ((5, 16), (5, 3, 3, 3)), ((3, 2, 2, 2), (3, 2, 2, 2))])
def test_relation_loss_matches_formula(s_shape, t_shape):
    rng = np.random.default_rng(len(s_shape) + s_shape[0])
    fs, ft = rng.standard_normal(s_shape), rng.standard_normal(t_shape)
    got = relation_loss(Tensor(fs, dtype=np.float64), Tensor(ft, dtype=np.float64))
    assert got.shape == () and got.item() == pytest.approx(np_relation(fs, ft), rel=1e-5, abs=1e-9)
    assert gradcheck(lambda s: relation_loss(s, ft), fs)
    Tt = Tensor(ft, requires_grad=True)
    relation_loss(Tensor(fs, requires_grad=True), Tt).backward()
    assert Tt.grad is None

def test_relation_loss_scale_invariant_and_bad_batch():
    fs = np.random.default_rng(0).standard_normal((4, 6))
    assert relation_loss(fs, 3 * fs).item() == pytest.approx(0, abs=1e-6)
    with pytest.raises(TinycompError, match=r'same batch size.*\(4, 6\).*\(5, 6\)'): relation_loss(fs, np.ones((5, 6)))
    with pytest.raises(TinycompError, match='same batch size'): relation_loss(np.ones(4), np.ones(4))


# ---- training ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope='module')
def small_task():
    "A fixed random teacher-size CNN (no training needed) and a 300-digit subset."
    X, y = load_digits('train')
    manual_seed(123)
    teacher = digits_cnn_wide().eval()
    return teacher, X[:300], y[:300]

def test_cache_teacher_logits_equals_running_teacher(small_task):
    teacher, X, _ = small_task
    teacher.train()
    cached = cache_teacher_logits(teacher, X, batch_size=64)
    assert teacher.training                                   # mode restored
    teacher.eval()
    with no_grad(): expect = teacher(Tensor(X)).data
    assert cached.shape == (300, 10) and cached.dtype == np.float32
    np.testing.assert_allclose(cached, expect, atol=1e-5)
    with pytest.raises(TinycompError, match='non-empty'): cache_teacher_logits(teacher, X[:0])

def run(teacher, X, y, epochs=2, seed=0, **kw):
    manual_seed(seed)
    student = digits_cnn()
    loader = DataLoader(X, y, batch_size=32, shuffle=True, seed=seed)
    return student, distill(teacher, student, loader, (X, y), epochs, optimizer=Adam(student.parameters(), lr=1e-2),
                            progress=False, **kw)

def test_distill_improves_over_chance():
    X, y = load_digits('train')
    teacher = load_pretrained_teacher()
    student, h = run(teacher, X[:300], y[:300], epochs=3)
    assert set(h) >= {'epoch', 'train_loss', 'train_acc', 'val_loss', 'val_acc', 'lr', 'seconds', 'hint_loss'}
    assert h['epoch'] == [1, 2, 3] and len(h['val_acc']) == 3
    Xv, yv = load_digits('val')
    from tinycomp.models import evaluate
    assert evaluate(student, (Xv, yv)).accuracy > 0.5          # chance is 0.1
    assert not teacher.training

def load_pretrained_teacher():
    from tinycomp.models import load_pretrained
    return load_pretrained('digits_cnn_wide')

def test_distill_cached_equals_uncached_and_alpha1_equals_fit(small_task):
    teacher, X, y = small_task
    s1, h1 = run(teacher, X, y)
    s2, h2 = run(teacher, X, y, teacher_logits=cache_teacher_logits(teacher, X))
    for p1, p2 in zip(s1.parameters(), s2.parameters()): np.testing.assert_allclose(p1.data, p2.data, atol=1e-5)
    s3, _ = run(teacher, X, y, alpha=1.0)
    manual_seed(0)
    s4 = digits_cnn()
    fit(s4, DataLoader(X, y, batch_size=32, shuffle=True, seed=0), None, 2, Adam(s4.parameters(), lr=1e-2), progress=False)
    for p3, p4 in zip(s3.parameters(), s4.parameters()): np.testing.assert_allclose(p3.data, p4.data, atol=1e-5)

def test_distill_teacher_untouched(small_task):
    teacher, X, y = small_task
    before = [p.data.copy() for p in teacher.parameters()]
    buffers = [b.copy() for _, b in teacher.named_buffers()]
    run(teacher, X, y, epochs=1, feature_pairs=[('3', '5')])
    for b, p in zip(before, teacher.parameters()): np.testing.assert_array_equal(b, p.data)
    for b, (_, nb) in zip(buffers, teacher.named_buffers()): np.testing.assert_array_equal(b, nb)
    assert all(p.grad is None for p in teacher.parameters())

def test_distill_with_feature_pairs_trains_regressors(small_task):
    teacher, X, y = small_task
    _, h = run(teacher, X, y, epochs=2, feature_pairs=[('3', '5'), ('1', '2')])
    regs = h['regressors']
    assert [(r.in_channels, r.out_channels) for r in regs] == [(32, 64), (16, 32)]
    assert all(v > 0 for v in h['hint_loss'])
    manual_seed(5)
    fresh = hint_regressor(32, 64)
    assert not np.allclose(fresh.weight.data, regs[0].weight.data)   # trained, not just created
    # With distill's own optimizer (optimizer=None) too.
    manual_seed(0)
    h2 = distill(teacher, digits_cnn(), DataLoader(X, y, batch_size=64), epochs=1, feature_pairs=[('3', '5')], progress=False)
    assert h2['hint_loss'][0] > 0

def test_distill_bad_inputs(small_task):
    teacher, X, y = small_task
    loader = DataLoader(X, y, batch_size=64)
    go = lambda student=None, **kw: distill(teacher, student or digits_cnn(), loader, epochs=1, progress=False, **kw)
    with pytest.raises(TinycompError, match='student has 12 classes but the teacher has 10'):
        go(Sequential(Flatten(), Linear(64, 12)))
    with pytest.raises(TinycompError, match='student has 12 classes but the teacher has 10'):
        go(Sequential(Flatten(), Linear(64, 12)), teacher_logits=np.zeros((300, 10), np.float32))
    for T in (0, -1.0):
        with pytest.raises(TinycompError, match='T must be'): go(T=T)
    for alpha in (-0.5, 1.5):
        with pytest.raises(TinycompError, match='alpha'): go(alpha=alpha)
    with pytest.raises(TinycompError, match=r'same spatial size'): go(feature_pairs=[('3', '7')])
    with pytest.raises(TinycompError, match=r'same spatial size'): go(feature_pairs=[('6', '5')])   # student Flatten: 2-D
    with pytest.raises(TinycompError, match="no layer named 'nope'"): go(feature_pairs=[('nope', '5')])
    with pytest.raises(TinycompError, match='one row per training sample'): go(teacher_logits=np.zeros((10, 10)))
    with pytest.raises(TinycompError, match='DataLoader'):
        distill(teacher, digits_cnn(), list(loader), epochs=1, progress=False, teacher_logits=np.zeros((300, 10)))
    with pytest.raises(TinycompError, match='epochs'): distill(teacher, digits_cnn(), loader, epochs=0, progress=False)
    with pytest.raises(TinycompError, match='pairs'): go(feature_pairs=[('3',)])


# ---- study helpers ----------------------------------------------------------------------------------------------

def test_paired_summary():
    p = paired_summary([0.9, 0.95, 0.8], [0.85, 0.95, 0.9])
    np.testing.assert_allclose(p['diffs'], [0.05, 0, -0.1], atol=1e-12)
    assert p['diff_mean'] == pytest.approx(-0.05 / 3)
    assert p['diff_std'] == pytest.approx(np.std([0.05, 0, -0.1], ddof=1))
    assert (p['wins'], p['ties'], p['losses']) == (1, 1, 1)
    with pytest.raises(TinycompError): paired_summary([1, 2], [1, 2, 3])

def test_train_student_is_seeded():
    X, y = load_digits('train')
    data = (X[:128], y[:128])
    a = train_student(tiny_cnn, 3, epochs=1, data=data)
    b = train_student(tiny_cnn, 3, epochs=1, data=data)
    for p, q in zip(a.parameters(), b.parameters()): np.testing.assert_array_equal(p.data, q.data)
    assert sum(p.data.size for p in tiny_cnn().parameters()) == 690
