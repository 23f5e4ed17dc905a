"""The grader can fail: every learner module's solution notebooks get full marks, its student notebooks zero,
each mutant (declared beside the module's checks) loses exactly its exercise's points, cheating notebooks gain
nothing, an infinite loop costs only its own exercise, and every module is complete."""
import copy, json
from dataclasses import replace
from pathlib import Path

import pytest

from tinycomp.course.grading import grade_notebook
from tinycomp.course.notebooks import cell_source, find_exercises, learner_modules, read_notebook
from tinycomp.course.refs import prepare_checks
from tinycomp.course.release import module_problems
from tinycomp.course.spec import get_spec, module_mutants, modules, mutant_notebook

pytestmark = pytest.mark.grader

ROOT = Path(__file__).resolve().parent.parent
KEYS = sorted(modules())
SEED = 12345


def solution_parts(key):
    return learner_modules(ROOT / 'nbs')[key].parts


def student_folder(key):
    return ROOT / 'modules' / get_spec(key).folder


def write(tmp, name, nb):
    p = Path(tmp) / name
    p.parent.mkdir(parents=True, exist_ok=True)
    p.write_text(json.dumps(nb))
    return p


def with_part(tmp, parts, index, nb):
    "The list of part notebooks with part `index` replaced by `nb` (written under `tmp` with the same name)."
    parts = list(parts)
    parts[index] = write(tmp, parts[index].name, nb)
    return parts


def part_of(key, exercise):
    "(index of the part holding `exercise`, that part's notebook)."
    for i, p in enumerate(solution_parts(key)):
        nb = read_notebook(p)
        if any(e.name == exercise for e in find_exercises(nb)): return i, nb
    raise KeyError(exercise)


def points(report): return {e.name: e.points for e in report.exercises}


_PREPARED = {}
def _prepared(key):
    if key not in _PREPARED: _PREPARED[key] = prepare_checks(get_spec(key), SEED)
    return _PREPARED[key]


def test_every_module_is_complete():
    "Declaration, checks for every exercise, a mutant for every exercise, student version, refs, README row."
    problems = module_problems(ROOT)
    assert not problems, '\n'.join(problems)


def test_an_incomplete_module_is_reported(tmp_path):
    import shutil
    root = tmp_path / 'repo'
    shutil.copytree(ROOT / 'nbs', root / 'nbs')
    shutil.copytree(ROOT / 'modules', root / 'modules')
    (root / 'README.md').write_text((ROOT / 'README.md').read_text())
    # a new module without declaration, student version or README row
    nb = read_notebook(ROOT / 'nbs' / '02a_conv.ipynb')
    (root / 'nbs' / '09_new.ipynb').write_text(json.dumps(nb))
    # an exercise added to module 02 without checks
    cell = {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
            'source': '#| export\ndef extra(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION'}
    nb['cells'].append(cell)
    (root / 'nbs' / '02a_conv.ipynb').write_text(json.dumps(nb))
    problems = '\n'.join(module_problems(root))
    assert 'module 09: no declaration; create nbs/checks/09_new.ipynb' in problems
    assert "module 02: exercises" in problems and "'extra'" in problems and 'do not match the graded checks' in problems
    # a missing mutant and a missing student version
    decl = read_notebook(ROOT / 'nbs' / 'checks' / '01_tensor.ipynb')
    for c in decl['cells']:
        if cell_source(c).startswith('MUTANTS'):
            c['source'] = cell_source(c).replace("'relu_backward': [", "'relu_backward_gone': [")
    (root / 'nbs' / 'checks' / '01_tensor.ipynb').write_text(json.dumps(decl))
    first = sorted((root / 'modules' / '01_tensor').glob('*.ipynb'))[0]; first.unlink()
    problems = '\n'.join(module_problems(root))
    assert 'module 01: exercise relu_backward has no mutant' in problems
    assert f"module 01: no student version modules/01_tensor/{first.name}; run `tinycomp release`" in problems
    assert "mutants for 'relu_backward_gone', which is not an exercise" in problems


@pytest.mark.parametrize('key', KEYS)
def test_solution_full_marks_student_zero(key):
    spec = get_spec(key)
    sol = grade_notebook(spec, solution_parts(key), prepared=_prepared(key))
    assert sol.points == sol.possible > 0 and sol.passed, [(e.name, e.diagnosis) for e in sol.exercises if e.status != 'pass']
    stu = grade_notebook(spec, student_folder(key), prepared=_prepared(key))
    assert stu.points == 0 and not stu.passed
    assert all(e.status == 'todo' for e in stu.exercises), [(e.name, e.diagnosis) for e in stu.exercises]


def _mutants():
    return [(k, e, i, old, new) for k in KEYS for e, ms in module_mutants(get_spec(k), ROOT).items()
            for i, (old, new) in enumerate(ms)]


@pytest.mark.parametrize('key,exercise,i,old,new', _mutants(), ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_mutant_loses_only_its_points(key, exercise, i, old, new, tmp_path):
    spec = get_spec(key)
    index, nb = part_of(key, exercise)
    parts = with_part(tmp_path, solution_parts(key), index, mutant_notebook(nb, exercise, old, new))
    r = grade_notebook(spec, parts, prepared=_prepared(key))
    full = spec.points_by_exercise()
    got = points(r)
    assert got[exercise] < full[exercise], f"mutant of {exercise} not caught: {r.exercises}"
    assert {n: p for n, p in got.items() if n != exercise} == {n: p for n, p in full.items() if n != exercise}, \
        [(e.name, e.diagnosis) for e in r.exercises if e.status != 'pass']
    bad = next(e for e in r.exercises if e.name == exercise)
    assert bad.diagnosis and bad.status in ('fail', 'partial', 'error')


def _student_with_cell(tmp, key, source, at=None):
    "The student notebooks of module `key`, with a code cell inserted at `at` in the first part (default: the end of the last)."
    parts = sorted(student_folder(key).glob('*.ipynb'))
    index = 0 if at is not None else len(parts) - 1
    nb = copy.deepcopy(read_notebook(parts[index]))
    cell = {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None, 'source': source}
    nb['cells'].insert(len(nb['cells']) if at is None else at, cell)
    return with_part(tmp, parts, index, nb)


PATCH_EVERYTHING = '''#| export
import builtins, numpy, numpy.testing
numpy.allclose = lambda *a, **k: True
numpy.array_equal = lambda *a, **k: True
numpy.isclose = lambda a, b, *r, **k: numpy.ones(numpy.broadcast(a, b).shape, bool)
numpy.testing.assert_allclose = lambda *a, **k: None
numpy.testing.assert_array_equal = lambda *a, **k: None
builtins.isinstance = lambda *a: True
builtins.all = lambda *a: True
import tinycomp.course.grading as _c
_c.compare_outputs = lambda *a, **k: (True, '')
'''

HARDCODE_STORED = '''#| export
import numpy as _np, glob as _glob, os as _os, tinycomp.course.spec as _chk
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
for _c in _chk.get_spec('{key}').checks: _c.run = _cheat(_c)
'''


def test_patching_numpy_builtins_and_the_comparison_gains_nothing(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        r = grade_notebook(spec, _student_with_cell(tmp_path / f'patch{key}', key, PATCH_EVERYTHING, at=2), prepared=_prepared(key))
        assert r.points == 0, points(r)


def test_hard_coding_the_stored_answers_gains_nothing(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        r = grade_notebook(spec, _student_with_cell(tmp_path / f'hard{key}', key, HARDCODE_STORED.format(key=key)), prepared=_prepared(key))
        assert r.points == 0, points(r)
        # the visible (fixed) cases did "pass": only the fresh inputs catch it
        assert any('fresh' in e.diagnosis for e in r.exercises)


def test_exiting_early_gains_nothing(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        r = grade_notebook(spec, _student_with_cell(tmp_path / f'exit{key}', key, '#| export\nimport os\nos._exit(0)'), prepared=_prepared(key))
        assert r.points == 0 and r.error


def test_importing_the_reference_solution_is_blocked(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        r = grade_notebook(spec, _student_with_cell(tmp_path / f'imp{key}', key, f'#| export\nimport {spec.reference[0]}'), prepared=_prepared(key))
        assert r.points == 0 and 'not allowed while grading' in r.error


def test_infinite_loop_times_out_only_that_exercise(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        names = spec.exercise_names()
        victim = names[len(names) // 2]
        index, nb = part_of(key, victim)
        ex = next(e for e in find_exercises(nb) if e.name == victim)
        lines = cell_source(nb['cells'][ex.cell]).splitlines()
        lines.insert(ex.begin + 1, f"{ex.indent}while True: pass")
        nb['cells'][ex.cell]['source'] = '\n'.join(lines)
        fast = replace(spec, checks=[replace(c, timeout=3.0) if c.exercise == victim else c for c in spec.checks])
        r = grade_notebook(fast, with_part(tmp_path / f'loop{key}', solution_parts(key), index, nb), prepared=_prepared(key),
                           spec_ref=spec.origin)
        by = {e.name: e for e in r.exercises}
        assert by[victim].points == 0 and by[victim].status == 'timeout'
        assert 'timed out after 3 s' in by[victim].diagnosis
        assert all(e.points == e.possible for n, e in by.items() if n != victim)


def test_memory_hog_fails_only_that_exercise(tmp_path):
    for key in KEYS:
        spec = get_spec(key)
        victim = spec.exercise_names()[0]
        index, nb = part_of(key, victim)
        ex = next(e for e in find_exercises(nb) if e.name == victim)
        lines = cell_source(nb['cells'][ex.cell]).splitlines()
        lines.insert(ex.begin + 1, f"{ex.indent}_hog = np.ones((1 << 40,), np.uint8)")
        nb['cells'][ex.cell]['source'] = '\n'.join(lines)
        r = grade_notebook(spec, with_part(tmp_path / f'mem{key}', solution_parts(key), index, nb), prepared=_prepared(key))
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
    r = grade_notebook(spec, _student_with_cell(tmp_path, '01', DELEGATE), prepared=_prepared('01'))
    assert points(r)['cross_entropy'] == 0, r.exercises
    assert 'no reference found' in next(e for e in r.exercises if e.name == 'cross_entropy').diagnosis


SEEDS = range(20)


@pytest.mark.parametrize('key,exercise,i,old,new', _mutants(), ids=lambda v: v if isinstance(v, str) and len(v) < 30 else None)
def test_mutant_is_caught_under_every_seed(key, exercise, i, old, new, tmp_path):
    "A check must catch its bug whatever the seed: every mutant fails its exercise under each of 20 seeds."
    from tinycomp.course.grading import surviving_seeds
    index, nb = part_of(key, exercise)
    parts = with_part(tmp_path, solution_parts(key), index, mutant_notebook(nb, exercise, old, new))
    assert surviving_seeds(get_spec(key), parts, exercise, SEEDS) == []


@pytest.mark.parametrize('key', KEYS)
def test_the_solution_survives_every_seed(key):
    "The other side: the solutions pass under all those seeds (so a killed mutant is the mutant's fault)."
    from tinycomp.course.grading import surviving_seeds
    spec = get_spec(key)
    for exercise in spec.exercise_names():
        assert surviving_seeds(spec, solution_parts(key), exercise, SEEDS) == list(SEEDS), exercise


def test_fresh_inputs_cannot_be_looked_up_in_a_table():
    "Every check's fresh inputs differ from seed to seed (98 % of 300 draws distinct), so no table of answers covers them."
    import hashlib
    import numpy as np
    for key in KEYS:
        for c in get_spec(key).checks:
            seen = set()
            for s in range(300):
                h = hashlib.sha256()
                for k, v in sorted(c.make_inputs(np.random.default_rng([s, 99])).items()):
                    a = np.asarray(v); h.update(f"{k}{a.dtype}{a.shape}".encode() + a.tobytes())
                seen.add(h.hexdigest())
            assert len(seen) >= 294, f"{c.id}: only {len(seen)} distinct inputs in 300 draws"


OLD_CSR_GENERATOR = '''
def _csr_mm_inputs(rng):          # a generator that built its CSR input from a dense matrix: to_csr's solution
    m, k, n = int(rng.integers(3, 9)), int(rng.integers(3, 12)), int(rng.integers(1, 6))
    a = _sparse(rng, m, k, float(rng.uniform(0.2, 0.6)))
    mask = a != 0
    indptr = np.concatenate([[0], np.cumsum(mask.sum(axis=1))]).astype(np.int32)
    rows, cols = np.nonzero(mask)
    return {'indptr': indptr, 'indices': cols.astype(np.int32), 'data': a[rows, cols], 'x': f32(rng, k, n)}
'''

def _to_csr_through_the_generators(checks_module, dense):
    "The cheat: feed the learner's matrix to every input generator of the checks module and keep a CSR that comes out."
    import numpy as np
    saved = checks_module._sparse
    checks_module._sparse = lambda rng, m, k, density: dense
    try:
        for name in dir(checks_module):
            f = getattr(checks_module, name)
            if name.endswith('_inputs') and callable(f):
                try: out = f(np.random.default_rng(0))
                except Exception: continue
                if not (isinstance(out, dict) and 'indptr' in out and len(out['indptr']) == len(dense) + 1): continue
                back = np.zeros_like(dense)                                  # keep it only if it is this matrix
                back[np.repeat(np.arange(len(dense)), np.diff(out['indptr'])), out['indices']] = out['data']
                if np.array_equal(back, dense): return out['indptr'], out['indices'], out['data']
    finally: checks_module._sparse = saved
    raise RuntimeError('no generator converts a dense matrix')


def test_no_input_generator_holds_solution_code(tmp_path):
    "The checks module is readable by learner code: its generators build CSR inputs row by row, never from a dense matrix."
    import types
    import numpy as np
    import tinycomp.checks.pruning as ours
    from tinycomp.pruning import to_csr
    dense = np.array([[0, 1.5, 0], [0, 0, 0], [2, 0, -3]], np.float32)
    with pytest.raises(RuntimeError, match='no generator converts'): _to_csr_through_the_generators(ours, dense)
    old = types.ModuleType('old_checks'); old.__dict__.update(vars(ours))       # the control: the old generator
    exec(OLD_CSR_GENERATOR, old.__dict__)
    got, want = _to_csr_through_the_generators(old, dense), to_csr(dense)
    assert all(np.array_equal(g, w) for g, w in zip(got, want))
    # and through the grader, the cheat gains nothing
    cheat = ('#| export\nimport tinycomp.checks.pruning as _ck\n' + __import__('inspect').getsource(_to_csr_through_the_generators)
             + 'def to_csr(dense): return _to_csr_through_the_generators(_ck, dense)\n')
    r = grade_notebook(get_spec('05'), _student_with_cell(tmp_path, '05', cheat), prepared=_prepared('05'))
    assert points(r)['to_csr'] == 0 and 'no generator converts' in next(e for e in r.exercises if e.name == 'to_csr').diagnosis


@pytest.mark.parametrize('key', KEYS)
def test_every_helper_set_aside_is_a_function_the_module_defines_for_an_exercise_it_has(key):
    "A name set aside that the learner's code does not define would protect nothing: each is a top-level function there (or a method of a top-level class)."
    import ast
    from tinycomp.course.grading import _learner_code
    from tinycomp.course.provided import _named_functions
    spec = get_spec(key)
    _, code, _ = _learner_code(spec, student_folder(key))
    defined = {name for name, _ in _named_functions(ast.parse(code))}
    assert set(spec.set_aside) <= set(spec.exercise_names())
    for exercise, names in spec.set_aside.items():
        assert exercise not in names and set(names) <= defined, (exercise, set(names) - defined)
