"""The learner's loop on the real modules: feedback that shows the failing case, one exercise or part at a time,
`--json` and `--repro`, progress kept per exercise, hints revealed one at a time, input checks folded away."""
import json
import re
from pathlib import Path

import pytest

from tinycomp.course.cli import hint_command, parse_target, test_module
from tinycomp.course.grading import format_report, grade_notebook, replay, write_repro
from tinycomp.course.notebooks import cell_source, read_notebook
from tinycomp.course.progress import load_progress, status
from tinycomp.course.release import build_release, exercise_help
from tinycomp.course.spec import get_spec, module_mutants, mutant_notebook
from tinycomp.errors import GradingError

ROOT = Path(__file__).resolve().parents[1]


def mistake(tmp_path, key, part, exercise, which):
    "A learner folder holding notebook `part` with the course's mutant `which` of `exercise` (a deliberate mistake)."
    old, new = module_mutants(get_spec(key))[exercise][which]
    nb = mutant_notebook(read_notebook(ROOT / 'nbs' / f'{part}.ipynb'), exercise, old, new)
    folder = tmp_path / f'{exercise}_{which}'
    folder.mkdir()
    (folder / f'{part}.ipynb').write_text(json.dumps(nb))
    return folder


@pytest.fixture(scope='module')
def ties(tmp_path_factory):
    "Module 04's quantize_per_tensor rounding ties up (floor(x / scale + 0.5)), graded alone."
    folder = mistake(tmp_path_factory.mktemp('ties'), '04', '04a_quantization', 'quantize_per_tensor', 0)
    spec = get_spec('04')
    return folder, grade_notebook(spec, folder, seed=3, exercises=spec.select('04.2'), selection='04.2')


def test_targets_name_a_module_a_part_or_an_exercise():
    assert parse_target('04')[1] is None and parse_target('4')[0].key == '04'
    spec, names, label = parse_target('04.2')
    assert names == ['quantize_per_tensor'] and label == '04.2'
    assert parse_target('04c')[1] == ['int8_matmul', 'requantize'] and parse_target('06')[1] is None
    assert parse_target('01d')[1] == ['SGD.step', 'Adam.step']
    for bad in ('04.99', '04z', '4a.2', 'quantize'):
        with pytest.raises(GradingError, match='04|exercise|part'): parse_target(bad)


@pytest.mark.grader
@pytest.mark.module04
def test_a_wrong_rounding_shows_the_input_the_values_and_why(ties):
    _, r = ties
    assert [e.number for e in r.exercises] == ['04.2'] and r.selection == '04.2' and r.possible == 4
    e = r.exercises[0]
    assert e.status == 'fail' and "dtype='int8'" in e.diagnosis and 'dtype=0' not in e.diagnosis
    detail = e.details[e.diagnosis.splitlines().index(next(l for l in e.diagnosis.splitlines() if l.startswith('ties')))]
    at = re.search(r'at q\[(\d+), (\d+)\]: x\[\1, \2\] = ([-\d.]+) -> expected (-?\d+), got (-?\d+)', detail)
    assert at, detail
    expected, got = int(at.group(4)), int(at.group(5))
    assert got == expected + 1                                   # a tie rounded up instead of to even
    assert 'lies exactly halfway' in detail and 'rounds half to even' in detail
    assert re.search(r'expected q\[\d+, :\] = \[.*\*-?\d+\*.*\]', detail) and '     got q[' in detail
    text = format_report(r)
    assert 'Module 04, 04.2 only' in text and 'why: x / scale' in text and 'fresh inputs from seed 3' in text


@pytest.mark.grader
@pytest.mark.module04
def test_json_holds_the_arrays_of_failing_cases_and_repro_replays_them(ties, tmp_path, capsys):
    folder, r = ties
    case = next(c for c in r.to_json()['exercises'][0]['cases'] if c['status'] == 'fail' and c['check'] == 'ties')
    assert case['inputs']['dtype'] == {'value': 'int8'} and case['inputs']['x']['shape'] == [20, 2]
    assert case['arrays']['inputs']['x']['dtype'] == 'float32' and len(case['arrays']['inputs']['x']['data']) == 20
    assert case['arrays']['expected']['q']['data'] != case['arrays']['got']['q']['data'] and 'raw' not in case
    json.dumps(r.to_json())                                      # it can be written
    written = write_repro(r, tmp_path / 'repro')
    ties_npz = next(p for p in written if '.ties.' in p.name)
    lines = ties_npz.with_suffix('.py').read_text()
    assert 'replay(' in lines and 'quantize_per_tensor' in lines and str(ties_npz) in lines
    wrong = {}
    exec('import numpy as np\nfrom tinycomp.quantization.core import QUANT_DTYPES\n'
         'def quantize_per_tensor(x, scale, zero_point, dtype="int8"):\n'
         '    qmin, qmax, t = QUANT_DTYPES[dtype]\n'
         '    return np.clip(np.floor(x / scale + 0.5) + zero_point, qmin, qmax).astype(t)\n', wrong)
    out = replay(ties_npz, wrong)
    said = capsys.readouterr().out
    assert 'q: expected' in said and 'halfway' in said and out['inputs']['dtype'] == 'int8'
    from tinycomp.quantization.core import quantize_per_tensor
    replay(ties_npz, {'quantize_per_tensor': quantize_per_tensor})
    assert 'passes now' in capsys.readouterr().out


@pytest.mark.grader
@pytest.mark.module05
def test_a_truncated_pruning_amount_is_explained_as_counts(tmp_path):
    folder = mistake(tmp_path, '05', '05a_pruning', 'global_unstructured', 1)
    spec = get_spec('05')
    r = grade_notebook(spec, folder, seed=1, exercises=['global_unstructured'])
    detail = ' '.join(r.exercises[0].details)
    assert re.search(r'expected \d+ of \d+ entries pruned \(0 in the mask\), got \d+', detail), detail
    assert 'round, do not truncate' in detail


@pytest.mark.grader
@pytest.mark.module04
def test_one_part_notebook_grades_that_part_only_and_progress_keeps_the_rest(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    folder = mistake(tmp_path, '04', '04a_quantization', 'dequantize', 1)
    assert test_module('04', notebooks=[folder], seed=None, sandbox=False) == 1
    out = capsys.readouterr().out
    assert 'not defined' not in out and 'int8_matmul' not in out and 'graded 04a only' in out
    assert 'in that type it wraps around' in out                # q - zero_point overflowed int8
    kept = next(iter(load_progress()['modules']['04'].values()))
    assert len(kept['exercises']) == 13 and kept['exercises']['dequantize'][0] == 0 and kept['possible'] == 42
    assert kept['exercises']['calculate_qparams'] == [4.0, 4.0, 'pass'] and kept['exercises']['int8_matmul'] == [0.0, 4.0, 'todo']


@pytest.mark.grader
@pytest.mark.module04
def test_an_instructors_fresh_inputs_stay_secret(tmp_path):
    folder = mistake(tmp_path, '04', '04a_quantization', 'quantize_per_tensor', 0)
    r = grade_notebook(get_spec('04'), folder, seed=5, exercises=['quantize_per_tensor'], reveal=False)
    cases = [c for c in r.exercises[0].cases if c.status == 'fail']
    assert {c.case for c in cases} == {'fixed', 'fresh'}
    assert all(c.arrays is None and c.detail == '' and c.raw is None for c in cases if c.case == 'fresh')
    assert all('value' not in d for c in cases if c.case == 'fresh' for d in c.inputs.values())   # not even the scalars
    assert all(c.arrays is not None and 'at q[' in c.detail for c in cases if c.case == 'fixed')
    assert not [p for p in write_repro(r, tmp_path / 'repro') if '.fresh.' in p.name]


def test_student_notebooks_fold_the_approach_and_each_hint():
    files = build_release(ROOT / 'nbs', keys=['04'])
    nb = json.loads(files['modules/04_quantization/04a_quantization.ipynb'])
    cells = nb['cells']
    at = next(i for i, c in enumerate(cells) if 'def quantize_per_tensor' in cell_source(c))
    code, help_cell = cell_source(cells[at]), cell_source(cells[at + 1])
    assert 'TODO:' in code and 'APPROACH' not in code and 'HINT' not in code and 'NotImplementedError' in code
    assert cells[at + 1]['cell_type'] == 'markdown' and help_cell.count('<details>') >= 2
    assert '<summary>The approach</summary>' in help_cell and '<summary>Hint 1</summary>' in help_cell
    assert 'tinycomp hint 04.2' in help_cell
    from tinycomp.quantization import core
    h = exercise_help(core.quantize_per_tensor.__doc__)
    assert h['approach'] and h['approach'][:40] in ' '.join(help_cell.split())
    folded = [c for c in cells if c.get('metadata', {}).get('jupyter', {}).get('source_hidden')]
    assert folded and all('#| hide' in cell_source(c) and 'def _check' in cell_source(c) for c in folded)


def test_hints_come_one_at_a_time(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path))
    from tinycomp.quantization import core
    h = exercise_help(core.dequantize.__doc__)
    n = 1 + len(h['hints'])
    seen = []
    for _ in range(n + 1):
        hint_command('04.3')
        seen.append(capsys.readouterr().out)
    assert 'The approach (1 of' in seen[0] and 'Hint 1 (2 of' in seen[1] and 'Hint 1' not in seen[0]
    assert 'that is every hint' in seen[-1] and 'more: run `tinycomp hint 04.3`' in seen[0]
    hint_command('04.3', again=True)
    assert capsys.readouterr().out.count(' of ') >= n
    with pytest.raises(GradingError, match='not one exercise'): hint_command('04a')


def test_status_columns_line_up_for_long_names(tmp_path, capsys):
    spec = get_spec('04')
    done = {'points': 4, 'possible': 42, 'best': 4, 'time': 1, 'date': 'today',
            'exercises': {n: [4 if n == 'calculate_qparams' else 0, p] for n, p in spec.points_by_exercise().items()}}
    (tmp_path / 'p.json').write_text(json.dumps({'modules': {'04': {'/somewhere': done}}}))
    status(path=tmp_path / 'p.json')
    lines = capsys.readouterr().out.splitlines()
    rows = [l for l in lines if re.match(r'^\s+\d\d\.\d+\s', l)]
    cols = {l.index('/') for l in rows}
    assert len(rows) == 13 and len(cols) == 1, [l for l in rows if 'multiply_by' in l]
    assert not any('-/' in l for l in lines)


@pytest.mark.slow
def test_the_capstone_compresses_with_the_learners_own_code(tmp_path, monkeypatch):
    from tinycomp.conv import Conv2d
    from tinycomp.course.capstone import capstone
    from tinycomp.course.notebooks import learner_modules
    from tinycomp.data import DataLoader, load_splits
    from tinycomp.io import load, save
    from tinycomp.models import evaluate
    import tinycomp.quantization.models  # noqa: F401  (gives the layers their int8_plan)
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path))
    plan = Conv2d.int8_plan
    solved = {k: learner_modules(ROOT / 'nbs')[k].parts for k in ('04', '05', '06')}
    r = capstone(folders=solved, epochs=1)
    assert r.yours == ['prune', 'distill', 'quantize'], r.table()
    assert type(r.compressed).__module__.startswith('learner_') or any(
        type(m).__module__.startswith('learner_') for m in r.compressed.modules())
    assert Conv2d.int8_plan is plan                              # the package's layers are the package's again
    save(r.compressed, tmp_path / 'mine.npz')                   # the learner's layers are saved as the package's
    X, y = load_splits('digits')['test']
    assert evaluate(load(tmp_path / 'mine.npz'), DataLoader(X, y, batch_size=128)).accuracy > 0.9
    half = {**solved, '06': ROOT / 'modules' / '06_distillation'}           # module 06 not done yet
    r = capstone(folders=half, epochs=1)
    assert r.yours == ['prune', 'quantize'] and 'kd_loss' in r.steps[1].why and r.steps[1].ran == 'the reference'


def test_release_refuses_a_docstring_that_gives_solution_code():
    from tinycomp.course.release import solution_in_help
    doc = "Column sums.\n\nTODO: return the sums.\nAPPROACH: reduce.\nHINT: think of a ufunc.\nHINT: `np.add.reduce(x, axis=0)`"
    assert solution_in_help(doc, "    return np.add.reduce(x, axis = 0)") == 'np.add.reduce(x, axis=0)'
    assert solution_in_help(doc.replace('(x, axis=0)', ''), "    return np.add.reduce(x, axis=0)") is None   # a name is fine
    assert exercise_help(doc)['hints'] == ['think of a ufunc.', '`np.add.reduce(x, axis=0)`']
