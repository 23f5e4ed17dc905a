"""Course tooling on a small synthetic module: markers, release, refs, the grader, progress and the gradebook."""
import csv, json, sys, zipfile
from pathlib import Path

import numpy as np
import pytest

from tinycomp.cli import main
from tinycomp.course.cli import (add_grade_cli, add_refs_cli, add_release_cli, add_sandbox_cli, add_status_cli,
                                 add_test_cli)
from tinycomp.course.gradebook import grade
from tinycomp.course.grading import format_report, grade_notebook
from tinycomp.course.notebooks import exported_code, find_exercises, make_notebook
from tinycomp.course.progress import load_progress, record_progress, status
from tinycomp.course.refs import load_npz, prepare_checks, refs, save_npz
from tinycomp.course.release import build_release, release, student_notebook
from tinycomp.errors import GradingError

SOLUTION_CELLS = [
    ('markdown', '# 09 Demo: a tiny module\n\n> Three small exercises for testing the grader.'),
    ('code', '#| default_exp demo'),
    ('markdown', '## Objectives\n\n- scale arrays\n- count things'),
    ('code', '#| export\nimport numpy as np'),
    ('code', '#| export\ndef double(x):\n    "Return `2 * x`."\n    ### BEGIN SOLUTION\n    return 2.0 * x\n    ### END SOLUTION'),
    ('code', 'assert (double(np.ones(2)) == 2).all()'),
    ('code', '#| export\nclass Acc:\n    "Accumulator."\n    def __init__(self, start): self.value = start\n\n'
             '    def add(self, x):\n        "Add the column sums of `x` to `self.value`; return it."\n'
             '        x = np.asarray(x)\n        ### BEGIN SOLUTION\n        self.value = self.value + x.sum(axis=0)\n'
             '        return self.value\n        ### END SOLUTION\n\n    def reset(self): self.value = 0'),
    ('code', '#| export\ndef ranks(x):\n    "Rank of every entry of 1-D `x` (0 = smallest)."\n    ### BEGIN SOLUTION\n'
             '    return np.argsort(np.argsort(x, kind="stable"), kind="stable")\n    ### END SOLUTION'),
    ('code', '#| hide\nprint("not exported")'),
]


CHECKS_SRC = '''
import numpy as np
from tinycomp.course.spec import Check, ModuleSpec, arr
def run_double(ns, i): return {{'out': arr(ns.double(i['x']))}}
def run_add(ns, i):
    acc = ns.Acc(np.zeros(i['x'].shape[1], np.float32))
    acc.add(i['x'])
    return {{'out': arr(acc.add(i['x']))}}
def run_ranks(ns, i): return {{'out': arr(ns.ranks(i['x']))}}
def mk_x(rng): return {{'x': rng.standard_normal((int(rng.integers(2, 5)), int(rng.integers(2, 5)))).astype(np.float32)}}
def mk_v(rng): return {{'x': rng.permutation(int(rng.integers(4, 9))).astype(np.float64)}}
SPEC = ModuleSpec('09', 'demo', reference=('{ref}',), refs_dir={refs!r}, checks=[
    Check('double', 'small', 1, mk_x, run_double, timeout=5),
    Check('double', 'again', 1, mk_x, run_double, timeout=5),
    Check('Acc.add', 'twice', 2, mk_x, run_add, timeout=5),
    Check('ranks', 'perm', 1, mk_v, run_ranks, timeout=5),
])
'''


@pytest.fixture(scope='module')
def demo(tmp_path_factory):
    "A repo with nbs/09_demo.ipynb, its reference module and check registry importable by the children."
    root = tmp_path_factory.mktemp('repo')
    (root / 'nbs').mkdir()
    (root / 'settings.ini').write_text('[DEFAULT]\n')
    nb = make_notebook(SOLUTION_CELLS)
    (root / 'nbs' / '09_demo.ipynb').write_text(json.dumps(nb))
    lib = root / 'lib'; lib.mkdir()
    code, _ = exported_code([('09_demo', nb)])
    (lib / 'tc_demo_ref.py').write_text(code)
    (lib / 'tc_demo_checks.py').write_text(CHECKS_SRC.format(ref='tc_demo_ref',
                                                             refs=str(root / 'refs' / '09')))
    sys.path.insert(0, str(lib))
    import tc_demo_checks
    spec = tc_demo_checks.SPEC
    assert refs(specs={'09': spec}, quiet=True) == 0
    assert release(root, specs={'09': spec}, quiet=True) == 0
    yield dict(root=root, lib=lib, spec=spec, nb=nb, specs={'09': spec},
               kw=dict(spec_ref='tc_demo_checks:SPEC', sys_path=[str(lib)]))
    sys.path.remove(str(lib))


def write_nb(path, cells):
    path.write_text(json.dumps(make_notebook(cells)))
    return path


def replace_cell(cells, index, source):
    cells = list(cells); cells[index] = ('code', source); return cells


# ---------------------------------------------------------------- markers and student versions

def _err(cells):
    with pytest.raises(GradingError) as e: find_exercises(make_notebook(cells), 'x.ipynb')
    return str(e.value)

def test_exercises_found_in_order_with_qualified_names():
    ex = find_exercises(make_notebook(SOLUTION_CELLS))
    assert [(e.number, e.name, e.cell) for e in ex] == [(1, 'double', 4), (2, 'Acc.add', 6), (3, 'ranks', 7)]

@pytest.mark.parametrize('src,msg', [
    ('#| export\ndef f():\n    ### BEGIN SOLUTION\n    return 1', 'cell 0, line 3: '),
    ('#| export\ndef f():\n    return 1\n    ### END SOLUTION', 'cell 0, line 4: '),
    ('#| export\ndef f():\n    ### BEGIN SOLUTION\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION\n    ### END SOLUTION', 'line 4: nested'),
    ('#| export\nx = 1\n### BEGIN SOLUTION\ny = 2\n### END SOLUTION', 'line 3: solution block outside'),
    ('#| export\ndef f():\n    ### BEGIN SOLUTION\n    a = 1\n    ### END SOLUTION\n    ### BEGIN SOLUTION\n    return a\n    ### END SOLUTION', 'second solution block'),
    ('def f():\n    ### BEGIN SOLUTION\n    return 1\n    ### END SOLUTION', 'not `#| export`'),
    ('#| export\ndef f():\n    ## BEGIN SOLUTION\n    return 1\n    ### END SOLUTION', 'malformed marker'),
    ('#| export\ndef f():\n    ### BEGIN SOLUTION\n    return 1\n### END SOLUTION', 'indented differently'),
])
def test_bad_markers_are_refused_with_cell_and_line(src, msg):
    m = _err([('code', src)])
    assert 'x.ipynb, cell 0' in m and msg in m

def test_marker_in_markdown_refused():
    assert 'markdown cell' in _err([('markdown', 'write between ### BEGIN SOLUTION and the end')])

def test_student_version_keeps_signature_docstring_and_code_around_the_block():
    stu, ex = student_notebook(make_notebook(SOLUTION_CELLS), '09')
    src = ''.join(stu['cells'][6]['source'])
    assert 'def add(self, x):' in src and '"Add the column sums' in src and 'x = np.asarray(x)' in src
    assert '        raise NotImplementedError("Exercise 09.2 Acc.add: ' in src
    assert 'def reset(self)' in src and 'x.sum(axis=0)' not in src
    assert 'BEGIN SOLUTION' not in json.dumps(stu) and 'END SOLUTION' not in json.dumps(stu)
    assert all(c.get('outputs', []) == [] and c.get('execution_count') is None for c in stu['cells'] if c['cell_type'] == 'code')
    compile(''.join(stu['cells'][6]['source']), 'cell', 'exec')

def test_surviving_solution_code_is_refused():
    cells = SOLUTION_CELLS + [('code', 'x = np.arange(5.)\ntest_eq(ranks(x), np.argsort(np.argsort(x, kind="stable"), kind="stable"))')]
    with pytest.raises(GradingError, match=r'cell 9, line 2: solution code of ranks would survive'):
        student_notebook(make_notebook(cells), '09', 'x.ipynb')

def test_outputs_are_cleared():
    nb = make_notebook(SOLUTION_CELLS)
    nb['cells'][5]['outputs'] = [{'output_type': 'stream', 'name': 'stdout', 'text': 'secret answer 42'}]
    nb['cells'][5]['execution_count'] = 3
    stu, _ = student_notebook(nb, '09')
    assert 'secret answer' not in json.dumps(stu)


# ---------------------------------------------------------------- release

def test_release_writes_notebook_and_readme(demo):
    d = demo['root'] / 'modules' / '09_demo'
    stu = json.loads((d / '09_demo.ipynb').read_text())
    assert 'raise NotImplementedError(\\"Exercise 09.3 ranks' in json.dumps(stu)
    readme = (d / 'README.md').read_text()
    assert '# Module 09: Demo: a tiny module' in readme and '- scale arrays' in readme
    assert '| 09.2 | `Acc.add` | 09_demo | 2 |' in readme and '**5**' in readme and 'tinycomp test 09' in readme

def test_release_check_detects_changes_and_stale_files(demo, capsys):
    root, specs = demo['root'], demo['specs']
    assert release(root, check=True, specs=specs) == 0
    p = root / 'modules' / '09_demo' / 'README.md'
    text = p.read_text()
    p.write_text(text + 'edited\n')
    assert release(root, check=True, specs=specs) == 1
    p.write_text(text)
    stale = root / 'modules' / '08_old' / '08_old.ipynb'
    stale.parent.mkdir(); stale.write_text(json.dumps({'cells': [], 'metadata': {'tinycomp': {'generated_from': 'nbs/08_old.ipynb'}}}))
    mine = root / 'modules' / '09_demo' / 'my_notes.ipynb'        # a learner's own files are never touched
    mine.write_text('{"cells": []}'); (root / 'modules' / '08_old' / 'notes.md').write_text('mine')
    assert release(root, check=True, specs=specs) == 1
    assert 'stale' in capsys.readouterr().out
    assert release(root, specs=specs, quiet=True) == 0 and not stale.exists()
    assert mine.exists() and (root / 'modules' / '08_old' / 'notes.md').exists()
    mine.unlink(); (root / 'modules' / '08_old' / 'notes.md').unlink(); stale.parent.rmdir()
    assert release(root, check=True, specs=specs) == 0

def test_release_refuses_and_writes_nothing(demo, tmp_path):
    root = tmp_path / 'r'; (root / 'nbs').mkdir(parents=True)
    bad = replace_cell(SOLUTION_CELLS, 7, '#| export\ndef ranks(x):\n    ### BEGIN SOLUTION\n    return x')
    write_nb(root / 'nbs' / '09_demo.ipynb', bad)
    with pytest.raises(GradingError, match=r'nbs/09_demo.ipynb, cell 7, line 3: .* never closed'):
        release(root, specs=demo['specs'])
    assert not (root / 'modules').exists()

def test_release_refuses_ungraded_exercises(demo, tmp_path):
    root = tmp_path / 'r'; (root / 'nbs').mkdir(parents=True)
    cells = SOLUTION_CELLS + [('code', '#| export\ndef extra(x):\n    ### BEGIN SOLUTION\n    return x\n    ### END SOLUTION')]
    write_nb(root / 'nbs' / '09_demo.ipynb', cells)
    with pytest.raises(GradingError, match='do not match the graded checks'):
        build_release(root / 'nbs', demo['specs'])


# ---------------------------------------------------------------- refs

def test_refs_are_deterministic_pickle_free_and_checked(demo, capsys):
    spec, specs = demo['spec'], demo['specs']
    files = sorted(Path(spec.refs_dir).glob('*.npz'))
    assert [f.name for f in files] == sorted(f'{c.id}.npz' for c in spec.checks)
    before = {f: f.read_bytes() for f in files}
    assert refs(specs=specs, quiet=True) == 0
    assert all(f.read_bytes() == b for f, b in before.items())
    for f in files:
        with zipfile.ZipFile(f) as z: assert all(n.endswith('.npy') for n in z.namelist())
        assert all(a.dtype.kind != 'O' for a in load_npz(f).values())
    assert refs(check=True, specs=specs) == 0
    victim = files[0]
    data = load_npz(victim); key = next(k for k in data if k.startswith('out.'))
    data[key] = data[key] + 1
    save_npz(victim, data)
    assert refs(check=True, specs=specs) == 1
    (Path(spec.refs_dir) / 'double.gone.npz').write_bytes(before[victim])
    victim.unlink()
    assert refs(check=True, specs=specs) == 1
    out = capsys.readouterr().out
    assert 'missing' in out and 'stale' in out
    assert refs(specs=specs, quiet=True) == 0 and refs(check=True, specs=specs, quiet=True) == 0
    assert not (Path(spec.refs_dir) / 'double.gone.npz').exists()

def test_save_npz_refuses_object_arrays(tmp_path):
    with pytest.raises(GradingError): save_npz(tmp_path / 'x.npz', {'a': np.array([{}, 1], dtype=object)})


# ---------------------------------------------------------------- the grader

@pytest.fixture(scope='module')
def prepared(demo): return prepare_checks(demo['spec'], 7)

def grade_cells(demo, prepared, tmp_path, cells, **kw):
    return grade_notebook(demo['spec'], write_nb(tmp_path / 'nb.ipynb', cells), prepared=prepared, **demo['kw'], **kw)

def pts(r): return {e.name: e.points for e in r.exercises}

@pytest.mark.grader
def test_solution_full_marks_and_student_zero(demo, prepared, tmp_path):
    r = grade_cells(demo, prepared, tmp_path, SOLUTION_CELLS)
    assert pts(r) == {'double': 2, 'Acc.add': 2, 'ranks': 1} and r.passed and r.points == r.possible == 5
    stu = grade_notebook(demo['spec'], demo['root'] / 'modules' / '09_demo' / '09_demo.ipynb', prepared=prepared, **demo['kw'])
    assert stu.points == 0 and {e.status for e in stu.exercises} == {'todo'} and not stu.passed
    assert 'not done yet (in 09_demo.ipynb, the cell defining `double`, line 4)' in stu.exercises[0].diagnosis
    text = format_report(stu)
    assert '09.1' in text and '0/2' in text and 'todo' in text and '0/5' in text

@pytest.mark.grader
def test_wrong_value_is_diagnosed_with_expected_got_and_error(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x):\n    return 2.0 * x + (x > 0)')
    r = grade_cells(demo, prepared, tmp_path, cells)
    e = r.exercises[0]
    assert e.points == 0 and e.status == 'fail' and pts(r)['Acc.add'] == 2 and pts(r)['ranks'] == 1
    assert 'expected' in e.diagnosis and 'got' in e.diagnosis and 'max abs error 1' in e.diagnosis and 'x(' in e.diagnosis

@pytest.mark.grader
def test_wrong_shape_and_dtype(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x):\n    return (2.0 * x).ravel()')
    cells = replace_cell(cells, 7, '#| export\ndef ranks(x):\n    return np.argsort(np.argsort(x)).astype(float)')
    r = grade_cells(demo, prepared, tmp_path, cells)
    by = {e.name: e for e in r.exercises}
    assert by['double'].points == 0 and 'expected shape' in by['double'].diagnosis
    assert by['ranks'].points == 0 and 'ranks' in by['ranks'].name and by['Acc.add'].points == 2

@pytest.mark.grader
def test_exception_names_the_learners_line(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 7, '#| export\ndef ranks(x):\n    y = x + 1\n    return y[99]')
    r = grade_cells(demo, prepared, tmp_path, cells)
    e = r.exercises[2]
    assert e.status == 'error' and 'IndexError' in e.diagnosis
    assert '(in nb.ipynb, the cell defining `ranks`, line 4: `return y[99]`)' in e.diagnosis

@pytest.mark.grader
def test_timeout_in_one_exercise_others_still_graded(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x):\n    while True: pass')
    r = grade_cells(demo, prepared, tmp_path, cells)
    assert pts(r) == {'double': 0, 'Acc.add': 2, 'ranks': 1}
    assert r.exercises[0].status == 'timeout' and 'timed out after 5 s' in r.exercises[0].diagnosis

@pytest.mark.grader
def test_crash_in_one_exercise_costs_only_that_exercise(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 6, '#| export\nimport os\nclass Acc:\n    def __init__(self, s): os._exit(3)')
    cells = replace_cell(cells, 7, '#| export\nimport sys\ndef ranks(x): sys.exit(0)')
    r = grade_cells(demo, prepared, tmp_path, cells)
    assert pts(r) == {'double': 2, 'Acc.add': 0, 'ranks': 0}
    assert 'exited (code 3)' in r.exercises[1].diagnosis and 'SystemExit' in r.exercises[2].diagnosis

@pytest.mark.grader
def test_cheats_gain_nothing(demo, prepared, tmp_path):
    patch = ('#| export\nimport builtins, numpy, numpy.testing\nnumpy.allclose = lambda *a, **k: True\n'
             'numpy.testing.assert_allclose = lambda *a, **k: None\nbuiltins.isinstance = lambda *a: True\n'
             'import tinycomp.course.grading as c\nc.compare_outputs = lambda *a, **k: (True, "")\n'
             'numpy.array_equal = lambda *a, **k: True\n')
    stu = json.loads((demo['root'] / 'modules' / '09_demo' / '09_demo.ipynb').read_text())
    cells = [(c['cell_type'], ''.join(c['source'])) for c in stu['cells']] + [('code', patch)]
    assert grade_cells(demo, prepared, tmp_path, cells).points == 0
    # hard-coding the stored (visible) answers passes the fixed inputs only
    hard = ('#| export\nimport numpy as np, glob\nREFS = [dict(np.load(f)) for f in glob.glob(%r + "/double.*.npz")]\n'
            'def double(x):\n    for r in REFS:\n        if r["in.x"].shape == x.shape and (r["in.x"] == x).all(): return r["out.out"]\n'
            '    return x\n') % demo['spec'].refs_dir
    r = grade_cells(demo, prepared, tmp_path, replace_cell(SOLUTION_CELLS, 4, hard))
    assert pts(r)['double'] == 0 and 'fresh' in r.exercises[0].diagnosis and pts(r)['ranks'] == 1

@pytest.mark.grader
def test_reference_module_cannot_be_imported(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\nimport importlib\ndouble = importlib.import_module("tc_demo_ref").double')
    r = grade_cells(demo, prepared, tmp_path, cells)
    assert r.points == 0 and 'not allowed while grading module 09' in r.error
    # an import of the module's own file by name means the learner's own code (a later part importing an earlier one)
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\nfrom tc_demo_ref import double')
    r = grade_cells(demo, prepared, tmp_path, cells)
    assert pts(r)['double'] == 0 and '`double` is not defined in the notebook code being graded' in r.exercises[0].diagnosis


# ---------------------------------------------------------------- gradebook

@pytest.mark.grader
def test_gradebook_survives_good_broken_and_hostile_notebooks(demo, tmp_path):
    d = tmp_path / 'class'; d.mkdir()
    write_nb(d / 'alice.ipynb', SOLUTION_CELLS)
    (d / 'bob').mkdir(); write_nb(d / 'bob' / '09_demo.ipynb', replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x): return x'))
    (d / 'carol.ipynb').write_text('{"cells": [ this is not json')
    (d / 'dave').mkdir()                                                         # nothing handed in
    write_nb(d / 'erin.ipynb', SOLUTION_CELLS[:3] + [('code', '#| export\nwhile True: pass')])  # loops at import
    write_nb(d / 'frank.ipynb', SOLUTION_CELLS + [('code', '#| export\nimport os\nos._exit(1)')])
    write_nb(d / 'gina.ipynb', SOLUTION_CELLS + [('code', '#| export\nimport numpy as np\nhog = np.ones(1 << 40, np.uint8)')])
    write_nb(d / 'hank.ipynb', [('markdown', 'no code at all')])
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '09', out, spec=demo['spec'], jobs=2, key=bytes(32), progress=False, import_timeout=10, **demo['kw']) == 0
    rows = {r['learner']: r for r in csv.DictReader(out.open())}
    assert set(rows) == {'alice', 'bob', 'carol', 'dave', 'erin', 'frank', 'gina', 'hank'}
    assert float(rows['alice']['total']) == 5 and rows['alice']['errors'] == '' and float(rows['alice']['possible']) == 5
    assert float(rows['bob']['total']) == 3 and float(rows['bob']['09.1 double']) == 0 and '09.1 fail' in rows['bob']['errors']
    assert 'not a valid notebook' in rows['carol']['errors'] and float(rows['carol']['total']) == 0
    assert 'no notebook of module 09' in rows['dave']['errors']
    assert 'timed out' in rows['erin']['errors'] and float(rows['erin']['total']) == 0
    assert 'exited' in rows['frank']['errors'] and float(rows['frank']['total']) == 0
    assert 'MemoryError' in rows['gina']['errors'] and float(rows['gina']['total']) == 0
    assert 'no `#| export` cells' in rows['hank']['errors']


# ---------------------------------------------------------------- progress and CLI

@pytest.mark.grader
def test_progress_is_recorded_per_notebook_and_shown(demo, prepared, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    good = grade_cells(demo, prepared, tmp_path, SOLUTION_CELLS)
    record_progress(good)
    bad = grade_cells(demo, prepared, tmp_path, replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x): return x'))
    record_progress(bad)
    entry = load_progress()['modules']['09'][str(tmp_path.resolve())]
    assert entry['points'] == 3 and entry['best'] == 5 and entry['exercises']['double'] == [0, 2, 'fail']
    assert [p.name for p in (tmp_path / 'home').iterdir()] == ['progress.json']
    # another notebook (say, the instructor's solutions) is kept apart and does not count for the learner's copy
    (tmp_path / 'elsewhere').mkdir()
    other = grade_notebook(demo['spec'], write_nb(tmp_path / 'elsewhere' / 'x.ipynb', SOLUTION_CELLS), prepared=prepared, **demo['kw'])
    record_progress(other)
    assert len(load_progress()['modules']['09']) == 2
    status(specs=demo['specs'], root=None)
    out = capsys.readouterr().out
    assert '09 demo' in out and '5/5' in out           # the most recent graded notebook, with per-exercise detail
    assert '09.1' in out and 'double' in out
    (tmp_path / 'home' / 'progress.json').write_text('garbage')
    assert load_progress() == {'modules': {}}


def test_cli_registers_subcommands(monkeypatch, tmp_path, capsys):
    import argparse
    p = argparse.ArgumentParser(); sub = p.add_subparsers(dest='cmd')
    for add in (add_test_cli, add_status_cli, add_release_cli, add_refs_cli, add_grade_cli, add_sandbox_cli): add(sub)
    for argv in (['release', '--check'], ['refs'], ['test', '01', '--notebook', 'x.ipynb', '--json', 'r.json'],
                 ['status'], ['grade', 'dir', '--module', '01', '--gradebook', 'g.csv']):
        assert callable(p.parse_args(argv).func)
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path))
    assert main(['status']) == 0 and '01 tensor' in capsys.readouterr().out
    assert main(['test', '77']) == 2 and 'tinycomp: error: no graded module' in capsys.readouterr().err


# ---------------------------------------------------------------- diagnoses a learner can act on

@pytest.mark.grader
def test_syntax_error_names_the_learners_cell_not_a_temporary_file(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 7, '#| export\ndef ranks(x):\n    return np.argsort(x kind="stable")')
    r = grade_cells(demo, prepared, tmp_path, cells)
    assert r.points == 0 and 'SyntaxError' in r.error
    assert 'the cell starting `def ranks(x):`, line 3' in r.error and 'learner_' not in r.error
    text = format_report(r)
    assert text.count('error') <= 2 and 'nothing can be graded until this is fixed' in text   # one line, not a row per exercise

@pytest.mark.grader
def test_missing_return_is_named(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x):\n    y = 2.0 * x')
    e = grade_cells(demo, prepared, tmp_path, cells).exercises[0]
    assert e.points == 0 and '`double` returned None: is a `return` missing?' in e.diagnosis

@pytest.mark.grader
def test_every_failing_check_is_shown_with_its_inputs(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x):\n    return 3.0 * x')
    r = grade_cells(demo, prepared, tmp_path, cells)
    e = r.exercises[0]
    assert e.diagnosis.count('\n') == 1 and 'small [' in e.diagnosis and 'again [' in e.diagnosis
    text = format_report(r)
    assert '    - small [fixed inputs: x(' in text and '    - again [' in text
    rep = r.to_json()['exercises'][0]
    assert {(c['check'], c['case']) for c in rep['cases']} == {('small', 'fixed'), ('small', 'fresh'), ('again', 'fixed'), ('again', 'fresh')}
    assert all(len(c['inputs']['x']['shape']) == 2 and c['inputs']['x']['dtype'] == 'float32' for c in rep['cases'])

@pytest.mark.grader
def test_numba_typing_error_shows_its_cause_and_the_learners_line(demo, prepared, tmp_path):
    src = ('#| export\nfrom numba import njit\n@njit\ndef _twice(x):\n    out = np.empty_like(x)\n'
           '    for i in range(x.shape[0]):\n        out[i] = x[i] * "2"\n    return out\n'
           'def double(x):\n    return _twice(x)')
    e = grade_cells(demo, prepared, tmp_path, replace_cell(SOLUTION_CELLS, 4, src)).exercises[0]
    assert e.status == 'error' and 'Numba could not compile' in e.diagnosis and 'NUMBA_DISABLE_JIT=1' in e.diagnosis
    assert 'Failed in nopython mode pipeline' not in e.diagnosis
    assert 'line 7: `out[i] = x[i] * "2"`' in e.diagnosis

@pytest.mark.parametrize('make,msg', [
    (lambda p: p, 'no such notebook'),
    (lambda p: (p.mkdir(), p)[1], 'is a folder, not a notebook'),
    (lambda p: (p.write_text('{"cells": ['), p)[1], 'not a valid notebook'),
])
def test_unreadable_notebook_is_one_line_and_records_nothing(monkeypatch, tmp_path, capsys, make, msg):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    path = make(tmp_path / '01a_tensor.ipynb')
    if path.is_dir(): (path / 'a.ipynb').write_text('{}'); (path / 'b.ipynb').write_text('{}')
    assert main(['test', '01', '--notebook', str(path)]) == 2
    out, err = capsys.readouterr()
    assert out == '' and len(err.strip().splitlines()) == 1 and err.startswith('tinycomp: error: ')
    assert (msg in err) or (path.is_dir() and 'holds no notebook of module 01' in err)
    assert not (tmp_path / 'home' / 'progress.json').exists()


@pytest.mark.grader
def test_full_marks_say_what_comes_next(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root)
    parts = [str(p) for p in sorted((root / 'nbs').glob('01?_*.ipynb'))]
    assert main(['test', '01', '--notebook', *parts, '--json', str(tmp_path / 'r.json')]) == 0
    out = capsys.readouterr().out
    assert 'Module 01 complete: every exercise passes. Next: module 02 (conv): jupyter lab modules/02_conv/' in out
    rep = json.loads((tmp_path / 'r.json').read_text())
    assert rep['passed'] and rep['points'] == rep['possible'] and len(rep['notebooks']) == 4
    entry = load_progress()['modules']['01'][str((root / 'nbs').resolve())]
    assert entry['points'] == rep['possible']


@pytest.mark.grader
def test_the_learners_folder_is_graded_by_default(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    root = Path(__file__).resolve().parent.parent
    monkeypatch.chdir(root / 'modules')
    assert main(['test', '01', '--json', str(tmp_path / 'r.json')]) == 1
    rep = json.loads((tmp_path / 'r.json').read_text())
    assert rep['points'] == 0 and all(e['status'] == 'todo' for e in rep['exercises'])
    assert [Path(n).name for n in rep['notebooks']] == ['01a_tensor.ipynb', '01b_functional.ipynb', '01c_nn.ipynb', '01d_optim.ipynb']
    assert load_progress()['modules']['01'][str((root / 'modules' / '01_tensor').resolve())]['points'] == 0
    status(root=root)
    out = capsys.readouterr().out
    assert '01 tensor' in out and '01.1' in out and 'unbroadcast' in out


@pytest.mark.grader
def test_changing_an_input_in_place_is_a_failure(demo, prepared, tmp_path):
    cells = replace_cell(SOLUTION_CELLS, 4, '#| export\ndef double(x):\n    x *= 2.0\n    return x')
    e = grade_cells(demo, prepared, tmp_path, cells).exercises[0]
    assert e.points == 0 and 'changed its input `x` in place' in e.diagnosis
