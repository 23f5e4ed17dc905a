"""A gradebook an instructor can trust: each learner's fresh inputs come from a secret nobody else can know, a
submission is the learner's own regular files, one row per learner, and a row the machine was too busy to finish is
graded again. Each attack has a control that shows it works where the defence is off."""
import csv, hashlib, json, os, resource, subprocess, sys
from pathlib import Path

import numpy as np
import pytest

from tinycomp.cli import main
from tinycomp.course.gradebook import grade, grading_key, key_id, learner_seed, learners, submission_id
from tinycomp.course.grading import grade_notebook
from tinycomp.course.notebooks import read_notebook
from tinycomp.course.progress import load_progress
from tinycomp.course.refs import prepare_checks
from tinycomp.course.spec import get_spec
from tinycomp.errors import GradingError

pytestmark = pytest.mark.grader

ROOT = Path(__file__).resolve().parent.parent
SPEC = get_spec('01')
KEY = bytes(range(32))
SOLUTIONS = sorted((ROOT / 'nbs').glob('01?_*.ipynb'))


def copy_solutions(folder):
    folder.mkdir(parents=True, exist_ok=True)
    for p in SOLUTIONS: (folder / p.name).write_text(p.read_text())
    return folder


def rows_of(out): return {r['learner']: r for r in csv.DictReader(open(out))}


# ---------------------------------------------------------------- seeds nobody can know in advance

def _fingerprint(inputs):
    return hashlib.sha256(b''.join(k.encode() + np.ascontiguousarray(v).tobytes() for k, v in sorted(inputs.items()))).hexdigest()

ANSWER_TABLE = r'''
import hashlib as _h, json as _json, numpy as _np
import tinycomp.checks.tensor as _checks
_TABLE = _json.loads(@@TABLE@@)
def _fp(inputs):
    return _h.sha256(b''.join(k.encode() + _np.ascontiguousarray(v).tobytes() for k, v in sorted(inputs.items()))).hexdigest()
def _answer(cid):
    def run(ns, inputs, *oracle):
        out = _TABLE[cid].get(_fp(inputs))
        if out is None: raise KeyError('these inputs are not in my table')
        return {k: _np.array(v, dtype=d).reshape(s) for k, (d, s, v) in out.items()}
    return run
for _c in _checks.MODULE.checks: _c.run = _answer(_c.id)
'''


def answer_table_notebooks(folder, seed):
    "Module 01's student notebooks plus a cell answering every check from a table made for `seed` with the reference."
    table = {}
    for j in prepare_checks(SPEC, seed)[1]:
        table.setdefault(j.check.id, {})[_fingerprint(j.check.visible(j.inputs))] = \
            {k: (str(v.dtype), list(v.shape), v.ravel().tolist()) for k, v in j.expected.items()}
    parts = sorted((ROOT / 'modules' / SPEC.folder).glob('*.ipynb'))
    folder.mkdir(parents=True, exist_ok=True)
    for p in parts:
        nb = read_notebook(p)
        if p == parts[-1]:
            nb['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
                                'source': '#| export\n' + ANSWER_TABLE.replace('@@TABLE@@', repr(json.dumps(table)))})
        (folder / p.name).write_text(json.dumps(nb))
    return folder


def test_an_answer_table_for_a_known_seed_gains_nothing_in_the_gradebook(sandbox, tmp_path):
    known = 4242
    d = tmp_path / 'class'
    cheat = answer_table_notebooks(d / 'mallory', known)
    control = grade_notebook(SPEC, cheat, prepared=prepare_checks(SPEC, known), sandbox=True)
    assert control.points == SPEC.possible, "the table answers everything for the seed it was made for"
    copy_solutions(d / 'alice')
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, progress=False) == 0
    rows = rows_of(out)
    assert float(rows['mallory']['total']) == 0 and 'fresh' in rows['mallory']['errors']
    assert float(rows['alice']['total']) == SPEC.possible


def test_the_gradebook_shows_no_seed_and_a_late_learner_gets_a_seed_of_their_own(tmp_path, capsys):
    d = tmp_path / 'class'
    for who in ('alice', 'bob'): copy_solutions(d / who)
    (d / 'bob' / SOLUTIONS[0].name).write_text(SOLUTIONS[0].read_text() + ' ')     # another version of a notebook
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0
    text = out.read_text()
    rows = rows_of(out)
    assert 'seed' not in next(csv.reader(open(out))) and {r['key_id'] for r in rows.values()} == {key_id(KEY)}
    seeds = {who: learner_seed(KEY, '01', who, sorted((d / who).glob('*.ipynb'))) for who in ('alice', 'bob')}
    assert len(set(seeds.values())) == 2 and not any(str(s) in text for s in seeds.values())
    assert not any(str(s) in capsys.readouterr().out for s in seeds.values())
    copy_solutions(d / 'carol')                                                    # hands in late
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0
    assert 'resuming' in capsys.readouterr().out and rows_of(out)['alice'] == rows['alice']
    late = learner_seed(KEY, '01', 'carol', sorted((d / 'carol').glob('*.ipynb')))
    assert late not in seeds.values() and str(late) not in out.read_text()
    assert float(rows_of(out)['carol']['total']) == SPEC.possible
    with pytest.raises(GradingError, match='another grading key'): grade(d, '01', out, key=bytes(32), sandbox=False, progress=False)


def test_the_seed_depends_on_the_key_the_learner_and_the_notebook(tmp_path):
    nb = copy_solutions(tmp_path / 'a') / SOLUTIONS[0].name
    s = learner_seed(KEY, '01', 'ada', [nb])
    assert s == learner_seed(KEY, '01', 'ada', [nb]) and 0 <= s < 2**62
    assert len({s, learner_seed(bytes(32), '01', 'ada', [nb]), learner_seed(KEY, '01', 'bea', [nb]),
                learner_seed(KEY, '02', 'ada', [nb])}) == 4
    nb.write_text(nb.read_text() + '\n')
    assert learner_seed(KEY, '01', 'ada', [nb]) != s


def test_the_grading_key_is_made_private_once_and_checked(tmp_path, capsys):
    path = tmp_path / 'keys' / 'course.key'
    with pytest.raises(GradingError, match='no grading key at .*course.key: check the path'): grading_key(path)   # a typo
    assert not path.exists()
    key = grading_key(path, create=True)
    assert len(key) == 32 and oct(path.stat().st_mode & 0o777) == '0o600' and 'created the grading key' in capsys.readouterr().err
    assert grading_key(path) == key and capsys.readouterr().err == ''               # read, not made again
    os.chmod(path, 0o644)
    with pytest.raises(GradingError, match='can be read by other users: make it private'): grading_key(path)
    os.chmod(path, 0o600); path.write_text('not a key')
    with pytest.raises(GradingError, match='is not a grading key'): grading_key(path)


def test_a_seed_of_your_own_is_practice_and_not_recorded(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    assert main(['test', '01', '--notebook', *map(str, SOLUTIONS), '--seed', '7', '--no-sandbox']) == 0
    assert 'practice run with the seed you chose, 7: not recorded' in capsys.readouterr().out
    assert load_progress() == {'modules': {}}
    assert main(['test', '01', '--notebook', *map(str, SOLUTIONS), '--no-sandbox']) == 0       # without: recorded
    assert load_progress()['modules']['01']


# ---------------------------------------------------------------- submissions are the learner's own regular files

def test_links_devices_and_oversized_files_are_refused_with_the_reason(tmp_path):
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    copy_solutions(d / 'zed')                                           # the control: the same files, really handed in
    (d / 'bob').symlink_to(d / 'alice', target_is_directory=True)      # a classmate's folder
    (d / 'carol').mkdir()
    for p in SOLUTIONS: (d / 'carol' / p.name).symlink_to(p)           # the instructor's solutions
    (d / 'dave.ipynb').symlink_to('/dev/zero')                          # a device: reading it never ends
    os.mkfifo(d / 'erin.ipynb')                                         # a pipe: opening it would block
    with open(d / 'frank.ipynb', 'wb') as f: f.truncate(40 << 20)       # 40 MiB
    (d / 'gina').mkdir(); os.mkfifo(d / 'gina' / '01a_tensor.ipynb')
    copy_solutions(tmp_path / 'elsewhere')                              # a copy of the solutions outside the class
    (d / 'hank').mkdir()
    for p in SOLUTIONS: os.link(tmp_path / 'elsewhere' / p.name, d / 'hank' / p.name)   # hard links: regular files
    out = tmp_path / 'gradebook.csv'
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=False) == 0
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 100 << 10       # KiB: nothing big was read
    rows = rows_of(out)
    assert float(rows['alice']['total']) == float(rows['zed']['total']) == SPEC.possible
    for who, why in (('bob', 'bob is a symbolic link'), ('carol', 'are links or not regular files'),
                     ('dave', 'dave.ipynb is a symbolic link'), ('erin', 'erin.ipynb is not a regular file'),
                     ('frank', 'larger than 32 MiB'), ('gina', 'is a link or not a regular file'), ('hank', 'is a hard link')):
        assert float(rows[who]['total']) == 0 and why in rows[who]['errors'], (who, rows[who]['errors'])


def test_a_notebook_that_is_not_a_regular_file_is_refused_by_test_too(tmp_path, capsys):
    os.mkfifo(tmp_path / '01a_tensor.ipynb')
    assert main(['test', '01', '--notebook', str(tmp_path / '01a_tensor.ipynb'), '--no-record', '--no-sandbox']) == 2
    assert 'is not a regular file' in capsys.readouterr().err


def test_a_learner_named_twice_gets_a_row_naming_both_and_the_class_is_graded(tmp_path):
    d = tmp_path / 'class'
    copy_solutions(d / 'bob')
    (d / 'bob.ipynb').write_text(SOLUTIONS[0].read_text())
    copy_solutions(d / 'carol')                                          # the control: graded as usual
    entries = {who: (nbs, why) for who, nbs, why in learners(d, SPEC)}
    assert entries['bob'][0] == [] and "two submissions for learner 'bob': bob and bob.ipynb" in entries['bob'][1]
    out = tmp_path / 'g.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=False) == 0
    rows = rows_of(out)
    assert float(rows['bob']['total']) == 0 and 'two submissions' in rows['bob']['errors']
    assert float(rows['carol']['total']) == SPEC.possible and len(rows) == 2


def test_escape_codes_in_a_learners_error_reach_the_gradebook_as_text(tmp_path):
    "A message that would move a terminal's cursor and erase a line is written as `\\x1b[...`, never raw."
    from learner_notebooks import with_export_cell
    with_export_cell(tmp_path / 'class' / 'ivan', '01', "raise RuntimeError('\\x1b[1A\\x1b[2Kivan 32/32 all pass')")
    out = tmp_path / 'g.csv'
    assert grade(tmp_path / 'class', '01', out, key=KEY, sandbox=False, progress=False) == 0
    raw = out.read_text()
    assert '\x1b' not in raw and '\\x1b[2K' in raw and float(rows_of(out)['ivan']['total']) == 0


def test_grade_and_test_write_only_the_files_they_are_asked_for(tmp_path, writes_only, monkeypatch, capsys):
    "In an empty folder: the gradebook (default gradebook_NN.csv) and `test --json`'s report, nothing else, paths printed."
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    monkeypatch.setenv('TINYCOMP_GRADING_KEY', str(tmp_path / 'k.key'))
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    assert main(['grade', str(d), '--module', '01', '--no-sandbox', '--new-key']) == 0
    assert writes_only.check(capsys.readouterr().out, 'gradebook_01.csv') == ['gradebook_01.csv']
    assert float(rows_of('gradebook_01.csv')['alice']['total']) == SPEC.possible
    assert main(['test', '01', '--notebook', str(d / 'alice'), '--json', 'report.json', '--no-sandbox']) == 0
    assert writes_only.check(capsys.readouterr().out, 'report.json') == ['report.json']


# ---------------------------------------------------------------- the machine's failures are not the learner's

def test_a_row_the_machine_was_too_busy_for_is_marked_and_graded_again(tmp_path, monkeypatch, capsys):
    from tinycomp.course import runner
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    nb = json.loads((d / 'alice' / SOLUTIONS[0].name).read_text())     # importing takes 0.5 s of CPU: longer than a poll,
    nb['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,   # so the budget is
                        'source': '#| export\nimport time as _t\n_t0 = _t.process_time()\n'             # always consulted
                                  'while _t.process_time() - _t0 < 0.5: pass'})
    (d / 'alice' / SOLUTIONS[0].name).write_text(json.dumps(nb))
    out = tmp_path / 'gradebook.csv'
    monkeypatch.setattr(runner.Budget, 'spent', lambda self: 'starved')        # every step: the machine gave no CPU
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 1        # not complete: exit code 1
    row = rows_of(out)['alice']
    assert row['complete'] == 'no' and 'machine was too busy' in row['errors'] and 'not complete' in capsys.readouterr().out
    monkeypatch.undo()
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0
    assert '0 learner(s) already graded, 1 to go' in capsys.readouterr().out
    row = rows_of(out)['alice']
    assert row['complete'] == 'yes' and float(row['total']) == SPEC.possible


def test_an_answer_table_gains_nothing_under_tinycomp_test_either(tmp_path, monkeypatch, capsys):
    "`tinycomp test` draws its fresh inputs at random: a table made for any one seed misses them."
    monkeypatch.setenv('TINYCOMP_HOME', str(tmp_path / 'home'))
    cheat = answer_table_notebooks(tmp_path / 'mallory', 4242)
    assert main(['test', '01', '--notebook', str(cheat), '--json', str(tmp_path / 'r.json')]) == 1
    assert json.loads((tmp_path / 'r.json').read_text())['points'] == 0


def test_a_backup_beside_a_notebook_is_refused_for_that_learner_only(tmp_path, capsys):
    "Two notebooks for one part would merge (the later overwriting the earlier): the row says which, the class goes on."
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    copy_solutions(d / 'bob')
    (d / 'bob' / '01A_tensor_backup.IPYNB').write_text(SOLUTIONS[0].read_text())     # any case counts
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=False) == 0
    rows = rows_of(out)
    assert float(rows['alice']['total']) == SPEC.possible and float(rows['bob']['total']) == 0
    assert 'two notebooks for part 01a' in rows['bob']['errors'] and '01A_tensor_backup.IPYNB' in rows['bob']['errors']
    assert main(['test', '01', '--notebook', str(d / 'bob'), '--no-record', '--no-sandbox']) == 2     # test says so too
    assert 'two notebooks for part 01a' in capsys.readouterr().err


def test_a_changed_submission_and_a_grader_error_are_graded_again(tmp_path, monkeypatch, capsys):
    from tinycomp.course import gradebook
    d = tmp_path / 'class'
    copy_solutions(d / 'alice'); copy_solutions(d / 'bob')
    (d / 'notes.zip').write_bytes(b'PK')                                 # a stray file: named, not graded
    out = tmp_path / 'gradebook.csv'
    real, calls = gradebook.grade_notebook, []
    def flaky(spec, nbs, **kw):                                          # alice, then bob
        calls.append(nbs)
        if len(calls) == 2: raise RuntimeError('the grader broke')
        return real(spec, nbs, **kw)
    monkeypatch.setattr(gradebook, 'grade_notebook', flaky)
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 1
    rows = rows_of(out)
    assert rows['bob']['complete'] == 'no' and 'grader error: RuntimeError: the grader broke' in rows['bob']['errors']
    assert 'not a notebook or a folder (or hidden), so not graded: notes.zip' in capsys.readouterr().err
    monkeypatch.undo()
    alice = d / 'alice' / SOLUTIONS[0].name                              # alice hands in her student version instead
    alice.write_text((ROOT / 'modules' / SPEC.folder / SOLUTIONS[0].name).read_text())
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0
    assert '0 learner(s) already graded, 2 to go' in capsys.readouterr().out
    again = rows_of(out)
    assert float(again['bob']['total']) == SPEC.possible and again['bob']['complete'] == 'yes'
    assert float(again['alice']['total']) < float(rows['alice']['total']) and again['alice']['submission'] != rows['alice']['submission']
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0      # the control: nothing changed, nothing graded
    assert '2 learner(s) already graded, 0 to go' in capsys.readouterr().out and rows_of(out) == again


def test_ctrl_c_stops_every_child_and_keeps_the_finished_rows(tmp_path):
    import signal, time
    from tinycomp.course.sandbox import _descendants
    below = lambda pid: _descendants(pid)[1:]
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    copy_solutions(d / 'zoe')
    nb = json.loads((d / 'zoe' / SOLUTIONS[0].name).read_text())       # zoe's import computes for a long time
    nb['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
                        'source': '#| export\nwhile True: pass'})
    (d / 'zoe' / SOLUTIONS[0].name).write_text(json.dumps(nb))
    out, scratch = tmp_path / 'gradebook.csv', tmp_path / 'tmp'
    scratch.mkdir()
    env = {**os.environ, 'TINYCOMP_GRADING_KEY': str(tmp_path / 'course.key'), 'TMPDIR': str(scratch)}
    # a shell that starts a job in the background (`cmd &`) ignores SIGINT for it, and Python then never turns SIGINT
    # into KeyboardInterrupt: give the grader the default handling, as a terminal does
    p = subprocess.Popen([sys.executable, '-m', 'tinycomp.cli', 'grade', str(d), '--module', '01', '--gradebook', str(out),
                          '--no-sandbox', '--new-key'], env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:                               # until alice is in and zoe's child spins
            if out.exists() and 'alice' in rows_of(out) and below(p.pid): break
            time.sleep(0.2)
        kids = below(p.pid)
        assert kids, 'no grading child to interrupt'
        p.send_signal(signal.SIGINT)
        try: _, err = p.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            p.kill()
            raise AssertionError(f"tinycomp grade did not exit within 60 s of the interrupt; it printed: {p.communicate()[1]}") from None
    finally:
        if p.poll() is None: p.kill()
    assert p.returncode == 130 and 'interrupted' in err and 'run the same command to go on' in err, err
    assert not [k for k in kids if Path(f'/proc/{k}').exists()], 'a grading child outlived the grader'
    assert set(rows_of(out)) == {'alice'} and float(rows_of(out)['alice']['total']) == SPEC.possible
    assert list(scratch.iterdir()) == []                                 # every working folder removed


def test_a_grading_stuck_in_the_grader_does_not_hold_up_an_interrupt(tmp_path):
    "A grading that does not end once its children are killed (stuck in the grader itself) is left behind, and said."
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    code = f"""
import os, signal, time
signal.signal(signal.SIGINT, signal.default_int_handler)     # even when started from a background job (SIGINT ignored)
import tinycomp.course.gradebook as gb
gb.INTERRUPT_GRACE = 1.0
def stuck(*a, **k):
    time.sleep(0.5); os.kill(os.getpid(), signal.SIGINT)   # interrupted while this grading is under way
    while True: time.sleep(0.05)
gb.grade_notebook = stuck
gb.grade({str(d)!r}, '01', {str(tmp_path / 'g.csv')!r}, key=b'k' * 32, sandbox=False, progress=False)
"""
    r = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 130, r.stderr
    assert 'run the same command to go on' in r.stderr and '1 grading(s) still ran 1 s after the interrupt' in r.stderr
    assert 'in stuck' in r.stderr                                       # where it was stuck: the thread's stack


# ---------------------------------------------------------------- what is graded is what was read, once

def test_a_notebook_swapped_for_a_link_after_listing_is_refused(tmp_path, monkeypatch):
    "Between listing the class and reading a notebook, a learner swaps it (or a folder on its path) for a link."
    from tinycomp.course import gradebook
    d = tmp_path / 'class'
    for who in ('alice', 'bob', 'zed'): copy_solutions(d / who)
    (tmp_path / 'elsewhere').mkdir()
    real = gradebook.learners
    def swap_after_listing(directory, spec):
        out = real(directory, spec)
        nb = d / 'alice' / SOLUTIONS[0].name
        nb.unlink(); nb.symlink_to(SOLUTIONS[0])                             # the notebook becomes a link
        (d / 'bob').rename(tmp_path / 'elsewhere' / 'bob')
        (d / 'bob').symlink_to(tmp_path / 'elsewhere' / 'bob', target_is_directory=True)   # the folder does
        return out
    monkeypatch.setattr(gradebook, 'learners', swap_after_listing)
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=False) == 0
    rows = rows_of(out)
    assert float(rows['zed']['total']) == SPEC.possible                  # the control
    for who in ('alice', 'bob'):
        assert float(rows[who]['total']) == 0 and 'symbolic link' in rows[who]['errors'], rows[who]['errors']


def test_grading_uses_the_bytes_read_once_and_a_copy_shows_as_identical(tmp_path, monkeypatch, capsys):
    "A notebook swapped for a classmate's after it was read changes nothing; handed in for real, it is named a copy."
    from tinycomp.course import gradebook
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    (d / 'mallory').mkdir()
    student = [ROOT / 'modules' / SPEC.folder / p.name for p in SOLUTIONS]
    for p in student: (d / 'mallory' / p.name).write_text(p.read_text())
    real = gradebook.snapshot
    def swap_after_reading(directory, nbs, into):
        out = real(directory, nbs, into)
        if 'mallory' in str(nbs[0]):
            for p in SOLUTIONS: (d / 'mallory' / p.name).write_text(p.read_text())    # alice's notebooks, byte for byte
        return out
    monkeypatch.setattr(gradebook, 'snapshot', swap_after_reading)
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0
    rows = rows_of(out)
    assert float(rows['mallory']['total']) == 0 and rows['mallory']['submission'] == submission_id(student)
    assert 'identical submissions' not in capsys.readouterr().out
    monkeypatch.undo()
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0     # graded again: the submission changed
    rows = rows_of(out)
    assert float(rows['mallory']['total']) == SPEC.possible and rows['mallory']['submission'] == rows['alice']['submission']
    assert 'identical submissions (the same notebooks, byte for byte): alice, mallory' in capsys.readouterr().out


def test_a_folder_too_deep_or_too_big_is_refused_and_the_class_goes_on(tmp_path):
    from tinycomp.course.gradebook import MAX_DEPTH, MAX_ENTRIES
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    deep = d / 'dora'
    for i in range(MAX_DEPTH + 1): deep = deep / f'd{i}'
    copy_solutions(deep)
    big = copy_solutions(d / 'bill')
    for i in range(MAX_ENTRIES): (big / f'n{i}.txt').touch()
    ok = copy_solutions(d / 'nina' / 'a' / 'b')                           # nested, but not too deep: graded
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=False) == 0
    rows = rows_of(out)
    assert float(rows['alice']['total']) == float(rows['nina']['total']) == SPEC.possible and ok.exists()
    assert float(rows['dora']['total']) == 0 and f'nested more than {MAX_DEPTH} deep' in rows['dora']['errors']
    assert float(rows['bill']['total']) == 0 and f'more than {MAX_ENTRIES} files' in rows['bill']['errors']


def test_a_name_a_spreadsheet_would_run_is_text_and_resuming_still_works(tmp_path, capsys):
    d = tmp_path / 'class'
    copy_solutions(d / '=HYPERLINK("x",1)')
    copy_solutions(d / 'alice')
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=False) == 0
    cells = [row[0] for row in csv.reader(open(out))]
    assert "'=HYPERLINK(\"x\",1)" in cells and not any(c.startswith('=') for c in cells)
    rows = rows_of(out)
    assert float(rows['\'=HYPERLINK("x",1)']['total']) == SPEC.possible
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0       # read back as the learner's own name
    assert '2 learner(s) already graded, 0 to go' in capsys.readouterr().out


def test_a_mistyped_key_path_in_the_environment_is_an_error_not_a_new_key(tmp_path, monkeypatch):
    path = tmp_path / 'keys' / 'corse.key'
    monkeypatch.setenv('TINYCOMP_GRADING_KEY', str(path))
    with pytest.raises(GradingError, match='no grading key at .*corse.key'): grading_key()
    assert not path.exists()
    assert len(grading_key(create=True)) == 32 and path.exists()            # --new-key makes it


def test_hidden_entries_are_named_not_graded(tmp_path, capsys):
    d = tmp_path / 'class'
    copy_solutions(d / 'alice')
    copy_solutions(d / '.eve')
    (d / '.ipynb_checkpoints').mkdir()
    out = tmp_path / 'gradebook.csv'
    assert grade(d, '01', out, key=KEY, sandbox=False, progress=True) == 0
    assert set(rows_of(out)) == {'alice'}
    err = capsys.readouterr().err
    assert 'not a notebook or a folder (or hidden), so not graded: .eve' in err and 'checkpoints' not in err
