"""The grader can fail: every learner module's solution notebook gets full marks, its student notebook zero,
each mutant loses exactly its exercise's points, cheating notebooks gain nothing, and an infinite loop costs
only its own exercise."""
import copy, json, re
from dataclasses import replace
from pathlib import Path

import pytest

from tinycomp.checks import MODULES, get_spec
from tinycomp.course import (cell_source, find_exercises, grade_notebook, prepare_checks, read_notebook,
                             learner_notebooks, build_release)

ROOT = Path(__file__).resolve().parent.parent
KEYS = sorted(MODULES)
SEED = 12345

# Plausible-but-wrong variants of each exercise: (old, new) replaced inside that exercise's solution block.
MUTANTS = {
    '01': {
        'unbroadcast': ('range(extra)', 'range(1, extra + 1)'),                       # wrong axes summed
        'add_backward': ('unbroadcast(grad, b_shape)', '-unbroadcast(grad, b_shape)'),  # sign
        'mul_backward': ('unbroadcast(grad * b, ', 'unbroadcast(grad * a, '),          # transposed roles
        'matmul_backward': ('grad = grad[..., None, :]', 'grad = grad[..., :, None]'),  # transposed index (1-D a)
        'relu_backward': ('(x > 0)', '(x >= 0)'),                                      # boundary
        'log_softmax_forward': ('shifted = x - np.max(x, axis=axis, keepdims=True)', 'shifted = x'),  # unstable
        'log_softmax_backward': ('np.sum(grad, axis=axis, keepdims=True)', 'np.sum(grad, axis=-1, keepdims=True)'),
        'cross_entropy': ('losses = -logits.log_softmax(axis=1)', 'losses = logits.log_softmax(axis=1)'),  # sign
        'Linear.forward': ('return y + self.bias if self.bias is not None else y', 'return y'),  # missing bias
        'SGD.step': ('d = d + self.momentum * v if self.nesterov else v', 'd = d - self.momentum * v if self.nesterov else v'),
        'Adam.step': ('m_hat = self.m[i] / (1 - b1 ** self.t)', 'm_hat = self.m[i]'),  # missing bias correction
    },
    '02': {
        'conv2d_naive': ('xp[n, c, y * stride + i, xo * stride + j]', 'xp[n, c, y + i, xo + j]'),   # stride ignored
        'im2col': ('xp[:, :, i:i + stride * oh:stride, j:j + stride * ow:stride]',
                   'xp[:, :, j:j + stride * oh:stride, i:i + stride * ow:stride]'),                 # i and j swapped
        'conv2d_direct_kernel': ('ix = xo * stride_w - pad_w + j * dil_w', 'ix = xo * stride_w - pad_w + j'),  # dilation lost
        'conv2d_weight_grad_kernel': ('iy = y * stride_h - pad_h + i * dil_h', 'iy = y * stride_h + i * dil_h'),  # padding lost
        'max_pool2d_backward': ('dx[n, c, k // width, k % width] += ', 'dx[n, c, k // width, k % width] = '),  # overwrite
    },
}


def solution_path(key):
    spec = get_spec(key)
    return ROOT / 'nbs' / f'{spec.notebook}.ipynb'


def student_path(key):
    spec = get_spec(key)
    return ROOT / 'modules' / spec.notebook / f'{spec.notebook}.ipynb'


def mutate(nb, exercise, old, new):
    "Copy of notebook `nb` with `old` -> `new` inside the solution block of `exercise` only."
    nb = copy.deepcopy(nb)
    ex = next(e for e in find_exercises(nb) if e.name == exercise)
    cell = nb['cells'][ex.cell]
    lines = cell_source(cell).splitlines()
    block = '\n'.join(lines[ex.begin + 1:ex.end])
    assert old in block, f"mutant text {old!r} not found in the solution of {exercise}"
    lines[ex.begin + 1:ex.end] = block.replace(old, new, 1).splitlines()
    cell['source'] = '\n'.join(lines)
    return nb


def write(tmp, name, nb):
    p = Path(tmp) / name
    p.write_text(json.dumps(nb))
    return p


def points(report): return {e.name: e.points for e in report.exercises}


@pytest.fixture(scope='module', params=KEYS)
def module(request):
    spec = get_spec(request.param)
    return spec, prepare_checks(spec, SEED)


def test_every_learner_module_is_graded_and_every_check_has_an_exercise():
    found = {key for key, _, _ in learner_notebooks(ROOT / 'nbs')}
    assert found == set(MODULES), "every learner notebook needs checks in tinycomp.checks and vice versa"
    for key in found:
        nb = read_notebook(solution_path(key))
        assert [e.name for e in find_exercises(nb)] == get_spec(key).exercise_names()
        assert all(c.points > 0 for c in get_spec(key).checks)


def test_release_is_up_to_date():
    files = build_release(ROOT / 'nbs')
    for rel, text in files.items():
        assert (ROOT / rel).read_text(encoding='utf-8') == text, f"{rel} is stale: run `tinycomp release`"


def test_solution_full_marks_student_zero(module):
    spec, prepared = module
    sol = grade_notebook(spec, solution_path(spec.key), prepared=prepared)
    assert sol.points == sol.possible > 0 and sol.passed, [(e.name, e.diagnosis) for e in sol.exercises if e.status != 'pass']
    stu = grade_notebook(spec, student_path(spec.key), prepared=prepared)
    assert stu.points == 0 and not stu.passed
    assert all(e.status == 'todo' for e in stu.exercises)


def test_every_exercise_has_a_mutant():
    for key in KEYS:
        assert set(MUTANTS.get(key, {})) == set(get_spec(key).exercise_names()), f"module {key} needs a mutant per exercise"


@pytest.mark.parametrize('key,exercise', [(k, e) for k in KEYS for e in MUTANTS.get(k, {})])
def test_mutant_loses_only_its_points(key, exercise, tmp_path):
    spec = get_spec(key)
    prepared = _prepared(key)
    old, new = MUTANTS[key][exercise]
    nb = mutate(read_notebook(solution_path(key)), exercise, old, new)
    r = grade_notebook(spec, write(tmp_path, 'mutant.ipynb', nb), prepared=prepared)
    full = spec.points_by_exercise()
    got = points(r)
    assert got[exercise] < full[exercise], f"mutant of {exercise} not caught: {r.exercises}"
    assert {n: p for n, p in got.items() if n != exercise} == {n: p for n, p in full.items() if n != exercise}, \
        [(e.name, e.diagnosis) for e in r.exercises if e.status != 'pass']
    bad = next(e for e in r.exercises if e.name == exercise)
    assert bad.diagnosis and bad.status in ('fail', 'partial', 'error')


_PREPARED = {}
def _prepared(key):
    if key not in _PREPARED: _PREPARED[key] = prepare_checks(get_spec(key), SEED)
    return _PREPARED[key]


def _with_cell(nb, source, at=None):
    nb = copy.deepcopy(nb)
    cell = {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None, 'source': source}
    nb['cells'].insert(len(nb['cells']) if at is None else at, cell)
    return nb


PATCH_EVERYTHING = '''#| export
import builtins, numpy, numpy.testing
numpy.allclose = lambda *a, **k: True
numpy.array_equal = lambda *a, **k: True
numpy.isclose = lambda a, b, *r, **k: numpy.ones(numpy.broadcast(a, b).shape, bool)
numpy.testing.assert_allclose = lambda *a, **k: None
numpy.testing.assert_array_equal = lambda *a, **k: None
builtins.isinstance = lambda *a: True
builtins.all = lambda *a: True
import tinycomp.course as _c
_c.compare_outputs = lambda *a, **k: (True, '')
'''

HARDCODE_STORED = '''#| export
import numpy as _np, glob as _glob, os as _os, tinycomp.checks as _chk
def _stored(check):
    import tinycomp
    path = _os.path.join(_os.path.dirname(tinycomp.__file__), 'refs', '{key}', check.id + '.npz')
    with _np.load(path) as z: return {{k: z[k] for k in z.files}}
def _cheat(check):
    st = _stored(check)
    def run(ns, inputs):
        same = all(k[3:] in inputs and _np.array_equal(inputs[k[3:]], v) for k, v in st.items() if k.startswith('in.'))
        outs = {{k[4:]: v for k, v in st.items() if k.startswith('out.')}}
        return outs if same else {{k: _np.zeros_like(v) for k, v in outs.items()}}
    return run
for _c in _chk.MODULES['{key}'].checks: _c.run = _cheat(_c)
'''


def test_patching_numpy_builtins_and_the_comparison_gains_nothing(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        nb = _with_cell(read_notebook(student_path(key)), PATCH_EVERYTHING, at=2)
        r = grade_notebook(spec, write(tmp_path, f'patch{key}.ipynb', nb), prepared=_prepared(key))
        assert r.points == 0, points(r)


def test_hard_coding_the_stored_answers_gains_nothing(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        nb = _with_cell(read_notebook(student_path(key)), HARDCODE_STORED.format(key=key))
        r = grade_notebook(spec, write(tmp_path, f'hard{key}.ipynb', nb), prepared=_prepared(key))
        assert r.points == 0, points(r)
        # the visible (fixed) cases did "pass": only the fresh inputs catch it
        assert any('fresh' in e.diagnosis for e in r.exercises)


def test_exiting_early_gains_nothing(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        nb = _with_cell(read_notebook(student_path(key)), '#| export\nimport os\nos._exit(0)')
        r = grade_notebook(spec, write(tmp_path, f'exit{key}.ipynb', nb), prepared=_prepared(key))
        assert r.points == 0 and r.error


def test_importing_the_reference_solution_is_blocked(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        nb = _with_cell(read_notebook(student_path(key)), f'#| export\nfrom {spec.ref_module} import *')
        r = grade_notebook(spec, write(tmp_path, f'imp{key}.ipynb', nb), prepared=_prepared(key))
        assert r.points == 0 and 'not allowed while grading' in r.error


def test_infinite_loop_times_out_only_that_exercise(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        names = spec.exercise_names()
        victim = names[len(names) // 2]
        ex = next(e for e in find_exercises(read_notebook(solution_path(key))) if e.name == victim)
        nb = copy.deepcopy(read_notebook(solution_path(key)))
        lines = cell_source(nb['cells'][ex.cell]).splitlines()
        lines.insert(ex.begin + 1, f"{ex.indent}while True: pass")
        nb['cells'][ex.cell]['source'] = '\n'.join(lines)
        fast = replace(spec, checks=[replace(c, timeout=3.0) if c.exercise == victim else c for c in spec.checks])
        r = grade_notebook(fast, write(tmp_path, f'loop{key}.ipynb', nb), prepared=_prepared(key),
                           spec_ref=f'tinycomp.checks:MODULES/{key}')
        by = {e.name: e for e in r.exercises}
        assert by[victim].points == 0 and by[victim].status == 'timeout'
        assert 'timed out after 3 s' in by[victim].diagnosis
        assert all(e.points == e.possible for n, e in by.items() if n != victim)


def test_memory_hog_fails_only_that_exercise(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        victim = spec.exercise_names()[0]
        ex = next(e for e in find_exercises(read_notebook(solution_path(key))) if e.name == victim)
        nb = copy.deepcopy(read_notebook(solution_path(key)))
        lines = cell_source(nb['cells'][ex.cell]).splitlines()
        lines.insert(ex.begin + 1, f"{ex.indent}_hog = np.ones((1 << 40,), np.uint8)")
        nb['cells'][ex.cell]['source'] = '\n'.join(lines)
        r = grade_notebook(spec, write(tmp_path, f'mem{key}.ipynb', nb), prepared=_prepared(key))
        by = {e.name: e for e in r.exercises}
        assert by[victim].points == 0 and 'MemoryError' in by[victim].diagnosis
        assert all(e.points == e.possible for n, e in by.items() if n != victim)


DELEGATE = '''#| export
import gc as _gc, sys as _sys
def _find_reference(name):
    for m in list(_sys.modules.values()):
        f = getattr(m, name, None)
        if callable(f) and not getattr(m, '__name__', '').startswith('learner_'): return f
    for dep in ('log_softmax_forward', 'log_softmax_backward', 'unbroadcast', 'add_backward'):
        g = getattr(globals()[dep], '__globals__', {})
        if name in g: return g[name]
    for o in _gc.get_objects():
        code = getattr(o, '__code__', None)
        if getattr(o, '__name__', None) == name and code is not None and 'learner_' not in code.co_filename: return o
    return None
def cross_entropy(logits, labels, reduction='mean'):
    f = _find_reference('cross_entropy')
    if f is None: raise RuntimeError('no reference found')
    return f(logits, labels, reduction)
'''


def test_delegating_to_the_reference_through_the_grader_gains_nothing(tmp_path):
    "Dependencies swapped in for a check are private copies: no path from them (or sys.modules, or gc) to the solution."
    spec = get_spec('01')
    nb = _with_cell(read_notebook(student_path('01')), DELEGATE)
    r = grade_notebook(spec, write(tmp_path, 'delegate.ipynb', nb), prepared=_prepared('01'))
    assert points(r)['cross_entropy'] == 0, r.exercises
    assert 'no reference found' in next(e for e in r.exercises if e.name == 'cross_entropy').diagnosis
