"""Grading that counts runs learner code in the OS sandbox. Each attack a determined learner tried against the
grader is rerun here: under the sandbox it gets zero marks or is contained. Where an attack is harmless to run
without the sandbox (or without the defence it tests), a control run shows it does work there, so these tests can fail."""
import csv, json, os, signal, subprocess, sys, time, uuid
from pathlib import Path

from tinycomp.course.grading import grade_notebook
from tinycomp.course.gradebook import grade
from tinycomp.course.refs import prepare_checks
from tinycomp.course.spec import get_spec

from learner_notebooks import with_export_cell
import pytest

pytestmark = pytest.mark.grader

ROOT = Path(__file__).resolve().parent.parent
SPEC = get_spec('01')
PREPARED = {}
KEY = bytes(range(32))              # a grading key for tests (an instructor's lives in a private file)


def prepared():
    if 'p' not in PREPARED: PREPARED['p'] = prepare_checks(SPEC, 4242)
    return PREPARED['p']


def student_with(tmp, source):
    "Module 01's student notebooks with an export cell `source` appended to the last part, written under `tmp`."
    return with_export_cell(tmp, '01', source)


def points(r): return {e.name: e.points for e in r.exercises}


def class_folder(tmp_path, good_learners, killer_code):
    "A class folder: learners handing in module 01's solutions, and `mallory`, whose notebook runs `killer_code`."
    d = tmp_path / 'class'; d.mkdir()
    for who in good_learners:
        (d / who).mkdir()
        for p in sorted((ROOT / 'nbs').glob('01?_*.ipynb')): (d / who / p.name).write_text(p.read_text())
    student_with(d / 'mallory', killer_code)
    return d


def alive(token):
    "Pids of processes whose command line holds `token`."
    found = []
    for d in Path('/proc').iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid(): continue
        try:
            if token.encode() in (d / 'cmdline').read_bytes(): found.append(int(d.name))
        except OSError: pass
    return found


# ---------------------------------------------------------------- reading the solution

EXEC_REFERENCE = r'''
import glob as _glob, importlib.util as _ilu, json as _json, os as _os, re as _re, sys as _sys, tinycomp as _tc
_sys.meta_path[:] = [f for f in _sys.meta_path if type(f).__name__ != 'Blocker']        # remove the import blocker
_found = []
def _grab(path):
    try: src = open(path).read()
    except OSError: return
    if 'def unbroadcast' not in src and 'class SGD' not in src and 'def cross_entropy' not in src: return
    src = _re.sub(r'from \.+(\w*)', lambda m: 'from tinycomp.' + m.group(1) if m.group(1) else 'from tinycomp', src)
    try: exec(src, globals()); _found.append(path)
    except Exception: pass
_pkg = _os.path.dirname(_tc.__file__)
for _f in ('tensor.py', 'nn/functional.py', 'nn/modules.py', 'optim.py'): _grab(_os.path.join(_pkg, _f))
for _name in ('tinycomp.tensor', 'tinycomp.optim'):
    try: _grab(_ilu.find_spec(_name).origin)
    except Exception: pass
import numpy as _np
for _p in _glob.glob(_os.path.join(_os.path.dirname(_np.__file__), '..', '**', 'tinycomp', '*.py'), recursive=True): _grab(_p)
for _nb in _glob.glob(_os.path.join(_pkg, '..', 'nbs', '01*.ipynb')):                  # the solution notebooks
    try:
        for _c in _json.load(open(_nb))['cells']:
            _s = ''.join(_c['source'])
            if _s.startswith('#| export'): exec(_s, globals())
    except Exception: pass
for _name, _f in (('_ref_tensor', 'tensor.py'), ('_ref_optim', 'optim.py')):            # the file under another name
    try:
        _spec = _ilu.spec_from_file_location(_name, _os.path.join(_pkg, _f)); _m = _ilu.module_from_spec(_spec)
        _spec.loader.exec_module(_m); globals().update({k: v for k, v in vars(_m).items() if not k.startswith('__')})
    except Exception: pass
try:                                                                                       # an alias package
    import types as _types
    _alias = _types.ModuleType('_alias'); _alias.__path__ = [_pkg]; _sys.modules['_alias'] = _alias
    from _alias.tensor import *
except Exception: pass
'''


def test_reading_or_importing_the_reference_solution_gains_nothing_in_the_sandbox(sandbox, tmp_path):
    nbs = student_with(tmp_path / 'a', EXEC_REFERENCE)
    r = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
    assert r.points == 0, points(r)
    control = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=False)
    assert control.points > 0, "the attack should work without the sandbox (else this test proves nothing)"


DELEGATE_BY_FRAMES = r'''
import builtins as _b, gc as _gc, sys as _sys
_caught = []
_exec, _imp = _b.exec, _b.__import__
def _spy_exec(code, g=None, l=None):                              # keep every namespace the grader builds
    if isinstance(g, dict): _caught.append(g)
    return _exec(code, g, l)
def _spy_import(name, g=None, *a, **k):
    if isinstance(g, dict): _caught.append(g)
    return _imp(name, g, *a, **k)
_b.exec, _b.__import__ = _spy_exec, _spy_import
def _reference(name):
    f = _sys._getframe(1)
    while f is not None:                                         # walk up to the child's frames
        for d in (f.f_locals, f.f_globals):
            for v in list(d.values()):
                if isinstance(v, dict) and callable(v.get(name)) and getattr(v[name], '__module__', '') != __name__: return v[name]
        f = f.f_back
    for d in _caught:                                            # or in a namespace the spies caught
        if callable(d.get(name)) and getattr(d[name], '__module__', '') != __name__: return d[name]
    for o in _gc.get_objects():                                  # or anything the garbage collector knows
        if getattr(o, '__name__', None) == name and getattr(o, '__module__', None) not in (__name__, None) and callable(o): return o
    raise RuntimeError('no reference found')
def unbroadcast(grad, shape): return _reference('unbroadcast')(grad, shape)
def log_softmax_forward(x, axis=-1): return _reference('log_softmax_forward')(x, axis)
'''


def test_reference_versions_of_other_exercises_cannot_be_reached_from_an_exercise(sandbox, tmp_path):
    "A child grades one exercise and holds only the reference deps of that exercise, so delegating finds nothing."
    r = grade_notebook(SPEC, student_with(tmp_path, DELEGATE_BY_FRAMES), prepared=prepared(), sandbox=True)
    assert points(r)['unbroadcast'] == 0 and points(r)['log_softmax_forward'] == 0
    assert 'no reference found' in next(e for e in r.exercises if e.name == 'unbroadcast').diagnosis


# ---------------------------------------------------------------- what the child can see and touch

PROBE = r'''
import json as _json, os as _os, socket as _socket, tinycomp as _tc
_pkg = _os.path.dirname(_tc.__file__)
def _readable(p):
    try: return len(open(p, 'rb').read(64)) > 0
    except OSError: return False
_graders = [d for d in _os.listdir('/proc') if d.isdigit() and b'tinycomp.cli' in (open(f'/proc/{d}/cmdline', 'rb').read() if _os.access(f'/proc/{d}/cmdline', _os.R_OK) else b'')]
_seen = {'grader_visible': bool(_graders),
         'grader_memory': any(_os.access(f'/proc/{d}/mem', _os.R_OK) for d in _graders),
         'reference_source': _readable(_os.path.join(_pkg, 'tensor.py')),
         'solution_notebooks': _os.path.exists(_os.path.join(_pkg, '..', 'nbs')),
         'git_history': _os.path.exists(_os.path.join(_pkg, '..', '.git')),
         'reference_outputs': bool(_os.path.isdir(_os.path.join(_pkg, 'refs', '01')) and _os.listdir(_os.path.join(_pkg, 'refs', '01'))),
         'package_writable': _os.access(_os.path.join(_pkg, 'course', 'grading.py'), _os.W_OK),
         'files_outside_visible': _os.path.exists('OUTSIDE'),
         'seed_visible': False, 'network': False}
for _d in _os.listdir('/proc'):
    if not _d.isdigit(): continue
    for _f in ('cmdline', 'environ'):
        try:
            if b'SEED' in open(f'/proc/{_d}/{_f}', 'rb').read(): _seen['seed_visible'] = True
        except OSError: pass
try: _socket.create_connection(('127.0.0.1', PORT), timeout=2).close(); _seen['network'] = True
except OSError: pass
raise RuntimeError('PROBE' + _json.dumps(_seen))
'''


def _probe(tmp_path, sandbox_flag):
    "Run the probe through `tinycomp test` in a subprocess (so a seed is on the grader's command line)."
    import socket
    server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen(1)
    seed = '987654321987'
    src = PROBE.replace('SEED', seed).replace('PORT', str(server.getsockname()[1])).replace('OUTSIDE', str(tmp_path))
    nbs = student_with(tmp_path, src)
    env = {**os.environ, 'TINYCOMP_HOME': str(tmp_path / 'home')}
    cmd = [sys.executable, '-m', 'tinycomp.cli', 'test', '01', '--notebook', *map(str, nbs), '--seed', seed,
           '--json', str(tmp_path / 'r.json')] + ([] if sandbox_flag else ['--no-sandbox'])
    try: subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    finally: server.close()
    error = json.loads((tmp_path / 'r.json').read_text())['error']
    return json.loads(error[error.index('PROBE') + 5:].split('}')[0] + '}')


def test_the_sandboxed_child_sees_no_solution_no_grader_no_seed_and_no_network(sandbox, tmp_path):
    seen = _probe(tmp_path / 'in', True)
    assert not any(seen.values()), seen
    control = _probe(tmp_path / 'out', False)
    assert control['grader_visible'] and control['grader_memory'] and control['reference_source'] and control['seed_visible'], control
    assert control['network'] and control['files_outside_visible'], control


def test_the_package_cannot_be_changed_from_the_sandbox(sandbox, tmp_path):
    target = ROOT / 'tinycomp' / 'course' / 'grading.py'
    before = target.read_bytes()
    attack = f"try: open({str(target)!r}, 'a').write('\\n_c = None  # pwned\\n')\nexcept OSError as e: raise RuntimeError('write refused: ' + str(e))"
    r = grade_notebook(SPEC, student_with(tmp_path, attack), prepared=prepared(), sandbox=True)
    assert target.read_bytes() == before and 'write refused' in r.error and r.points == 0


# ---------------------------------------------------------------- processes and memory

def test_daemons_die_with_the_sandbox(sandbox, tmp_path):
    token, target = f"tinycomp-daemon-{uuid.uuid4().hex}", tmp_path / 'pwned.txt'
    daemon = (f"import subprocess as _sp, sys as _sys\n"
              f"for _ in range(5): _sp.Popen([_sys.executable, '-c', 'import time; time.sleep(2); open({str(target)!r}, \"w\").write(\"x\")', "
              f"'{token}'], start_new_session=True)")
    r = grade_notebook(SPEC, student_with(tmp_path / 'nb', daemon), prepared=prepared(), sandbox=True)
    assert r.points == 0 and alive(token) == []           # every process the learner started is gone at once
    time.sleep(3)
    assert not target.exists()


def test_memory_is_limited_for_the_whole_process_tree(tree_limit, tmp_path):
    "Twelve children of 300 MiB each cannot all live: the tree shares one budget (TREE_MEMORY, 2 GiB)."
    from tinycomp.course.runner import TREE_MEMORY
    token = f"tinycomp-hog-{uuid.uuid4().hex}"
    hogs = (f"import subprocess as _sp, sys as _sys, time as _t\n"
            f"_kids = [_sp.Popen([_sys.executable, '-c', 'import numpy as np, time; a = np.ones(300 << 20, np.uint8); time.sleep(60)', "
            f"'{token}'], start_new_session=True) for _ in range(12)]\n"
            f"_t.sleep(6)\n"
            f"raise RuntimeError(f'HOGS {{sum(k.poll() is None for k in _kids)}} of 12 alive')")
    r = grade_notebook(SPEC, student_with(tmp_path, hogs), prepared=prepared(), sandbox=True, import_timeout=60)
    assert r.points == 0 and alive(token) == []
    if 'HOGS' in r.error:
        n = int(r.error.split('HOGS ')[1].split()[0])
        assert n * (300 << 20) < TREE_MEMORY, r.error
    else: assert 'ran out of memory' in r.error, r.error           # the importing process itself was the one stopped


def test_killing_everything_in_sight_only_kills_the_sandbox(sandbox, tmp_path, monkeypatch):
    "A learner who kills the grader (or every process it can see) loses its own grading, nobody else's row."
    d = class_folder(tmp_path, ('alice', 'zed'), "import os as _os, signal as _sig\n_os.kill(_os.getppid(), _sig.SIGKILL)\n_os.kill(-1, _sig.SIGKILL)")
    out = tmp_path / 'gradebook.csv'
    import tempfile
    (tmp_path / 'scratch').mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path / 'scratch'))     # this test's own scratch space
    assert grade(d, '01', out, key=KEY, progress=False, sandbox=True) == 0
    assert list((tmp_path / 'scratch').iterdir()) == []         # no scratch folder left behind
    rows = {r['learner']: r for r in csv.DictReader(out.open())}
    assert float(rows['alice']['total']) == float(rows['zed']['total']) == SPEC.possible
    assert float(rows['mallory']['total']) == 0 and rows['mallory']['errors']


def test_an_interrupted_gradebook_keeps_its_rows_and_resumes(tmp_path):
    "Without the sandbox a learner can kill the grader; every row finished before is kept, and a rerun resumes."
    d = class_folder(tmp_path, ('alice', 'bob'), "import os as _os, signal as _sig\n_os.kill(_os.getppid(), _sig.SIGKILL)")
    good = sorted((ROOT / 'nbs').glob('01?_*.ipynb'))
    out = tmp_path / 'gradebook.csv'
    env = {**os.environ, 'TINYCOMP_GRADING_KEY': str(tmp_path / 'keys' / 'course.key')}
    cmd = [sys.executable, '-m', 'tinycomp.cli', 'grade', str(d), '--module', '01', '--gradebook', str(out), '--no-sandbox', '--new-key']
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == -signal.SIGKILL and 'not tamper-proof' in r.stderr and 'created the grading key' in r.stderr
    rows = {r['learner']: r for r in csv.DictReader(out.open())}
    assert set(rows) == {'alice', 'bob'} and all(float(x['total']) == SPEC.possible for x in rows.values())
    import shutil; shutil.rmtree(d / 'mallory'); (d / 'carol').mkdir()
    for p in good: (d / 'carol' / p.name).write_text(p.read_text())
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 0 and 'resuming' in r.stdout and '2 learner(s) already graded, 1 to go' in r.stdout
    rows2 = {r['learner']: r for r in csv.DictReader(out.open())}
    assert set(rows2) == {'alice', 'bob', 'carol'} and rows2['alice'] == rows['alice']
    r = subprocess.run(cmd + ['--key-file', str(tmp_path / 'keys' / 'other.key'), '--new-key'], capture_output=True, text=True,
                       timeout=600, cwd=ROOT, env=env)
    assert r.returncode == 2 and 'was graded with another grading key' in r.stderr


# ---------------------------------------------------------------- what the child sends back

def test_huge_or_forged_results_are_refused_without_allocating(sandbox, tmp_path):
    import resource
    forge = r'''
import json as _json, os as _os, struct as _st, sys as _sys
def unbroadcast(grad, shape):
    import numpy as _np
    return _np.zeros(200 << 20, _np.uint8)                          # a 200 MiB result
def add_backward(grad, a_shape, b_shape):                            # a forged message: a huge array, no data
    h = _json.dumps({'event': 'result', 'job': JOB, 'arrays': [{'name': 'ga', 'dtype': '<f8', 'shape': [1 << 40]}]}).encode()
    _os.write(int(_sys.argv[3]), _st.pack('>II', len(h), 0) + h)
    raise SystemExit
'''
    spec_jobs = prepared()[1]
    job = next(j.id for j in spec_jobs if j.check.exercise == 'add_backward')
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = grade_notebook(SPEC, student_with(tmp_path, forge.replace('JOB', str(job))), prepared=prepared(), sandbox=True)
    by = {e.name: e for e in r.exercises}
    assert by['unbroadcast'].points == 0 and 'the limit is 64 MiB' in by['unbroadcast'].diagnosis
    assert by['add_backward'].points == 0 and any('bigger than the data sent' in c.message for c in by['add_backward'].cases)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before < 150 << 10     # KiB: the parent never held 200 MiB


def test_the_sandbox_costs_little(sandbox, capsys):
    "Not a timing assertion: `tinycomp sandbox --bench` runs and reports the cost (the closing note quotes it)."
    from tinycomp.course.cli import sandbox_command
    assert sandbox_command('01', repeats=1) == 0
    out = capsys.readouterr().out
    assert 'sandbox cost:' in out and 'in the sandbox: median' in out


# ---------------------------------------------------------------- only what an exercise may call reaches its child

def whole_module_dependencies(monkeypatch):
    """The control: deliver the dependencies of every check of the module to every child (what a grader that writes
    one dependency file per module does), so an attack that reads them has something to find."""
    import tinycomp.course.runner as runner
    every = sorted({d for c in SPEC.checks for d in c.deps})
    original = runner.dependency_source
    monkeypatch.setattr(type(SPEC), 'deps_of', lambda self, exercise: every)
    monkeypatch.setattr(runner, 'dependency_source', lambda spec, names, exercise=None: original(spec, names))


EXEC_DEPENDENCY_FILES = r'''
import glob as _glob, os as _os
_here = _os.path.dirname(_os.path.abspath(__file__))                  # the child's folder, beside its job file
for _d in {_here, _os.path.dirname(_here), _os.getcwd(), _os.environ.get('HOME', '.'), '/tmp'} - {'/'}:
    for _p in _glob.glob(_os.path.join(_d, '**', '*.py'), recursive=True)[:50]:
        if 'learner_' in _p: continue
        try: exec(open(_p).read(), globals())
        except Exception: pass
'''


def test_the_dependency_file_holds_no_reference_of_the_exercise_being_graded(sandbox, tmp_path, monkeypatch):
    "Exec-ing every source file the child can find (its dependency file included) gains nothing."
    nbs = student_with(tmp_path / 'a', EXEC_DEPENDENCY_FILES)
    r = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
    assert r.points == 0, points(r)
    whole_module_dependencies(monkeypatch)
    control = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
    assert control.points >= 9, ("with the whole module's dependencies in every child the attack gains points "
                                 "(else this test proves nothing)", points(control))


def test_an_import_hook_finds_no_reference_of_the_exercise_being_graded(sandbox, tmp_path, monkeypatch):
    "A `builtins.__import__` hook sees the namespace the dependencies are loaded into: it holds only other exercises."
    src = DELEGATE_BY_FRAMES + ''.join(f"def {n}(*a, **k): return _reference({n!r})(*a, **k)\n"
                                       for n in ('add_backward', 'mul_backward', 'matmul_backward'))
    nbs = student_with(tmp_path / 'a', src)
    r = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
    assert r.points == 0, points(r)
    whole_module_dependencies(monkeypatch)
    control = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
    assert control.points >= 9, points(control)


LEAVE_NOTES = r'''
import glob as _glob, json as _json, os as _os
_seen = set()
for _d in {_os.getcwd(), _os.path.dirname(_os.getcwd()), _os.environ.get('HOME', '.'), '/tmp'}:
    _seen |= {_os.path.basename(p) for p in _glob.glob(_os.path.join(_d, 'NOTE_TOKEN_*'))}
    try: open(_os.path.join(_d, f'NOTE_TOKEN_{_os.getpid()}'), 'w').write('x')
    except OSError: pass
def unbroadcast(grad, shape): raise RuntimeError('SEEN ' + _json.dumps(sorted(_seen)))
def relu_backward(grad, x): raise RuntimeError('SEEN ' + _json.dumps(sorted(_seen)))
def linear(x, weight, bias=None): raise RuntimeError('SEEN ' + _json.dumps(sorted(_seen)))
'''


def test_each_child_starts_in_a_fresh_folder_nothing_left_by_another(sandbox, tmp_path):
    "Files one child writes (in its folder, the folder above, its home, /tmp) never reach the child of another exercise."
    token = uuid.uuid4().hex
    nbs = student_with(tmp_path / 'a', LEAVE_NOTES.replace('TOKEN', token))
    seen = lambda r: {e.name: e.diagnosis[e.diagnosis.index('SEEN'):].split(']')[0] + ']' for e in r.exercises if 'SEEN' in e.diagnosis}
    try:
        r = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
        assert set(seen(r)) == {'unbroadcast', 'relu_backward', 'linear'} and set(seen(r).values()) == {'SEEN []'}, seen(r)
        control = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=False)
        assert any(v != 'SEEN []' for v in seen(control).values()), seen(control)   # unsandboxed, /tmp is shared
    finally:
        import glob
        for p in glob.glob(f'/tmp/NOTE_{token}_*'): os.remove(p)


# ---------------------------------------------------------------- libraries

USE_A_LIBRARY = r'''
import importlib as _il, os as _os, sys as _sys
_sys.meta_path[:] = [f for f in _sys.meta_path if type(f).__name__ != 'Blocker']     # past the import blocker
def _importable(name):
    try: _il.import_module(name); return True
    except Exception: return False
_libs = {n: _importable(n) for n in ('onnx', 'onnxruntime')}
def unbroadcast(grad, shape):                       # correct, but only "with the library's help"
    if not any(_libs.values()): raise RuntimeError(f'LIBS {_libs}')
    grad = grad.sum(axis=tuple(range(grad.ndim - len(shape)))) if grad.ndim > len(shape) else grad
    return grad.sum(axis=tuple(i for i, s in enumerate(shape) if s == 1 and grad.shape[i] != 1), keepdims=True) if shape else grad.sum()
'''


def test_libraries_outside_the_allow_list_cannot_be_imported_in_the_sandbox(sandbox, tmp_path):
    "Even past the in-process blocker, a package outside the allow-list (ONNX here) is not in the sandbox at all."
    import importlib.util
    assert importlib.util.find_spec('onnx'), "the dev install brings onnx: the control needs it"
    nbs = student_with(tmp_path / 'a', USE_A_LIBRARY)
    r = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=True)
    assert points(r)['unbroadcast'] == 0 and "LIBS {'onnx': False" in next(e for e in r.exercises if e.name == 'unbroadcast').diagnosis
    control = grade_notebook(SPEC, nbs, prepared=prepared(), sandbox=False)
    assert points(control)['unbroadcast'] > 0, points(control)


def test_the_import_blocker_states_the_library_policy(sandbox, tmp_path):
    for use in (True, False):
        r = grade_notebook(SPEC, student_with(tmp_path / str(use), 'import onnx'), prepared=prepared(), sandbox=use)
        assert r.points == 0 and '`import onnx` is not available while grading' in r.error and 'NumPy and Numba' in r.error


PACKAGE_FOLDERS = r'''
import json as _json, os as _os
def _ls(d):
    try: return sorted(_os.listdir(d))
    except OSError: return []
_seen = {'onnx': any('onnx' in _ls(d) for d in OWN), 'numpy': all('numpy' in _ls(d) for d in OWN),
         'extra': sorted({e for d in OWN for e in _ls(d)} - set(ALLOWED))[:3],
         'others': [d for d in OTHERS if _ls(d)][:2]}
raise RuntimeError('FOLDERS' + _json.dumps(_seen))
'''


def test_the_sandbox_shows_only_the_allowed_packages(sandbox, tmp_path):
    "The environment's package folder shows only the allow-list; every other package folder (the base interpreter's) is empty."
    from tinycomp.course.sandbox import _site_dirs, allowed_packages
    own, others = _site_dirs()
    allowed = sorted({e for entries in allowed_packages().values() for e in entries or ()})
    src = PACKAGE_FOLDERS.replace('OWN', repr(own)).replace('OTHERS', repr(others)).replace('ALLOWED', repr(allowed))
    def seen(use):
        r = grade_notebook(SPEC, student_with(tmp_path / str(use), src), prepared=prepared(), sandbox=use)
        return json.loads(r.error[r.error.index('FOLDERS') + 7:].split('}')[0] + '}')
    inside = seen(True)
    assert inside == {'onnx': False, 'numpy': True, 'extra': [], 'others': []}, inside
    outside = seen(False)
    assert outside['onnx'] and outside['extra'], outside                  # the control: they are installed


def test_the_grading_key_is_hidden_even_inside_a_visible_folder(sandbox, tmp_path):
    from tinycomp.course.sandbox import sandbox_args, sandbox_env
    from tinycomp.course.spec import package_dir
    shared = tmp_path / 'shared'; shared.mkdir()
    key = shared / 'grading.key'; key.write_text('ab' * 32)
    work = tmp_path / 'w'; work.mkdir()
    code = [sys.executable, '-c', f"print(open({str(key)!r}).read())"]
    run = lambda hidden: subprocess.run(sandbox_args(work, package_dir(), hidden_files=hidden, read_only=[shared]) + code,
                                        env=sandbox_env(), capture_output=True, text=True, timeout=60)
    hidden = run([key])
    assert 'ab' * 32 not in hidden.stdout and ('Permission denied' in hidden.stderr or hidden.stdout.strip() == '')
    assert run([]).stdout.strip() == 'ab' * 32                            # the control: the folder is visible


# ---------------------------------------------------------------- the verdict is the parent's

FORGE_VERDICTS = r'''
import tinycomp.course.child as _c
_send = _c._send
def _forged(out, header, payload=b''):
    if header.get('event') in ('result', 'error'):            # every result becomes an "error" that claims a pass,
        header, payload = {'event': 'error', 'job': header.get('job'), 'status': 'pass', 'grader': True,   # a busy machine,
                           'restart': True, 'phase': 'import', 'calls': [], 'message': 'FORGED'}, b''  # a retry...
    _send(out, header, payload)
_c._send = _forged
'''

FORGE_IMPORT = r'''
import os as _os, sys as _sys
from tinycomp.course.child import frame as _frame
_os.write(int(_sys.argv[3]), _frame({'event': 'import_error', 'status': 'pass', 'message': ['not', 'text'], 'file_line': 'x'}))
_os._exit(0)
'''


def test_a_child_cannot_forge_its_verdict(sandbox, tmp_path):
    "Whatever a child writes on the channel, only a result the parent compared can pass, and retries stay bounded."
    import time
    t0 = time.monotonic()
    r = grade_notebook(SPEC, student_with(tmp_path / 'v', FORGE_VERDICTS), prepared=prepared(), sandbox=True)
    assert r.points == 0 and r.complete and time.monotonic() - t0 < 120, points(r)
    assert all(e.status == 'error' and 'FORGED' in e.diagnosis for e in r.exercises)   # the frames did arrive
    r = grade_notebook(SPEC, student_with(tmp_path / 'i', FORGE_IMPORT), prepared=prepared(), sandbox=True)
    assert r.points == 0 and r.error.startswith("importing your notebook's code failed") and r.to_json()['points'] == 0


FILL_THE_DISK = r'''
import os as _os
_wrote, _refused = 0, []
def _write(path, mib):
    global _wrote
    with open(path, 'wb') as f:
        for _ in range(mib): f.write(b'\1' * (1 << 20)); _wrote += 1
try: _write('big', 100)                                       # one file past the per-file limit
except OSError as _e: _refused.append(_e.strerror); _os.remove('big'); _wrote = 0
PLACES = (_os.getcwd(), _os.environ.get('HOME', '.'), _os.path.dirname(_os.path.abspath(__file__)))
for _k, _where in enumerate(PLACES):
    try:
        for _i in range(40): _write(_os.path.join(_where, f'fill{_k}_{_i}'), 48)    # 1.9 GiB in files under that limit
    except OSError as _e: _refused.append(_e.strerror)
raise RuntimeError(f'FILL wrote {_wrote} MiB, refused: {sorted(set(_refused))}')
'''
ONLY_ITS_FOLDER = FILL_THE_DISK.replace('PLACES = (', 'PLACES = (_os.getcwd(),) or (').replace('range(40)', 'range(1)')


def test_a_child_cannot_fill_a_disk_or_change_its_folder(tree_limit, tmp_path):
    "It writes only to a private scratch of bounded size (in its memory budget); its folder, with its job, is read-only."
    r = grade_notebook(SPEC, student_with(tmp_path / 'f', FILL_THE_DISK), prepared=prepared(), sandbox=True)
    assert r.points == 0 and 'FILL wrote' in r.error, r.error
    wrote = int(r.error.split('FILL wrote ')[1].split()[0])
    refused = r.error.split('refused: ')[1]
    assert wrote <= 512 and all(e in refused for e in ('File too large', 'No space left on device', 'Read-only file system')), r.error
    unsandboxed = grade_notebook(SPEC, student_with(tmp_path / 'g', ONLY_ITS_FOLDER), prepared=prepared(), sandbox=False)
    assert "wrote 48 MiB, refused: ['File too large']" in unsandboxed.error, unsandboxed.error  # the control: outside, the
                                                                                                # folder is writable


# ---------------------------------------------------------------- what a module provides does not answer its exercises

SOFTMAX_FROM_TENSOR = '''
def log_softmax_forward(x, axis=-1):
    return np.log(_softmax(Tensor(x), axis).data)
'''

AUTOGRAD = '''
def mul_backward(grad, a, b):
    A, B = Tensor(a, requires_grad=True), Tensor(b, requires_grad=True)
    (A / B ** -1.0 / Tensor(np.ones(grad.shape, np.float32))).backward(grad)
    return A.grad, B.grad
'''

INT8_HELPERS = '''
def requantize(acc, multiplier, shift, out_zero_point, qmin=-128, qmax=127, dtype='int8'):
    acc = np.asarray(acc, np.int32); m = np.asarray(multiplier, np.int32); s = np.asarray(shift, np.int32)
    out = np.empty(acc.shape, {'int8': np.int8, 'uint8': np.uint8}[dtype])
    for r in range(acc.shape[0]):
        lp = np.array([np.zeros(acc.shape[1]), np.full(acc.shape[1], m[r]), np.full(acc.shape[1], max(s[r], 0)),
                       np.full(acc.shape[1], max(-s[r], 0))], np.int32)
        _requant_rows(np.ascontiguousarray(acc[r]), 1, acc.shape[1], lp, np.int32(out_zero_point), np.int32(qmin), np.int32(qmax), out[r])
    return out
def per_channel_qparams(w, axis=0, dtype='int8', symmetric=True):
    o = PerChannelMinMaxObserver(axis, dtype, symmetric); o.observe(w)
    return calculate_qparams(o.min_val.astype(np.float32), o.max_val.astype(np.float32), dtype, symmetric)
'''

PRUNING_HELPERS = '''
def nm_mask(weight, n=2, m=4):
    w = np.asarray(weight, np.float32)
    groups = list(np.abs(w).reshape(-1, m))
    return np.stack(_topk_masks(groups, [np.ones(m, np.float32)] * len(groups), (m - n) / m, 'layer')).reshape(w.shape)
def slice_conv_bn_next(conv, bn, next_layer, keep):
    keep = np.asarray(keep, np.int64)
    nxt = None
    if next_layer is not None:
        hw = 1 if isinstance(next_layer, Conv2d) else next_layer.in_features // conv.out_channels
        cols = np.repeat(keep * hw, hw) + np.tile(np.arange(hw), len(keep))
        nxt = next_layer.keep_channels([cols], np.arange(next_layer.weight.shape[0]))
    conv_keep = conv.keep_channels([np.arange(conv.in_channels)], keep)
    return conv_keep, None if bn is None else bn.keep_channels([keep], keep), nxt
def csr_matmul(indptr, indices, data, x):
    return csr_to_dense(indptr, indices, data, (len(indptr) - 1, x.shape[0])) @ x
'''

def _helper_attacks():
    "(module, part to append to, code, exercises it answers with provided helpers)."
    return [('01', '01a_tensor', SOFTMAX_FROM_TENSOR, ['log_softmax_forward']),
            ('01', '01a_tensor', AUTOGRAD, ['mul_backward']),
            ('04', '04d_int8_conv', INT8_HELPERS, ['requantize', 'per_channel_qparams']),
            ('05', '05d_schedules', PRUNING_HELPERS, ['nm_mask', 'slice_conv_bn_next', 'csr_matmul']),
            ('07', '07b_evaluation', 'def pareto_front(points, maximize):\n    return np.flatnonzero(pareto_mask(points, maximize)).astype(np.int64)\n'
                                     'def expected_calibration_error(probs, labels, n_bins=15):\n    return calibration_bins(probs, labels, n_bins)["ece"]\n',
             ['pareto_front', 'expected_calibration_error']),
            ('05', '05a_pruning', 'def l1_unstructured(weight, amount):\n    w = np.asarray(weight, np.float32)\n'
                                  '    return ln_structured(w.reshape(-1, 1), amount, n=1, dim=0).reshape(w.shape).astype(np.float32)\n',
             ['l1_unstructured'])]


def test_helpers_a_module_provides_are_set_aside_while_the_exercise_they_answer_is_graded(sandbox, tmp_path, monkeypatch):
    from tinycomp.course.spec import get_spec as spec_of
    for key, part, code, answered in _helper_attacks():
        spec = spec_of(key)
        nbs = with_export_cell(tmp_path / key, key, code, part=part)
        r = grade_notebook(spec, nbs, prepared=prepare_checks(spec, 3), sandbox=True)
        assert all(points(r)[e] == 0 for e in answered), (key, points(r))
        assert 'is set aside while' in next(e for e in r.exercises if e.name == answered[0]).diagnosis
        monkeypatch.setattr(spec, 'set_aside', {})                       # the control: without setting them aside
        control = grade_notebook(spec, nbs, prepared=prepare_checks(spec, 3), sandbox=True)
        assert all(points(control)[e] > 0 for e in answered), (key, points(control))
        monkeypatch.undo()


SOFTMAX_FROM_LATER = '''
def softmax_with_temperature(logits, T=1.0):
    from tinycomp.benchmarking.evaluation import softmax    # module 07's (a NumPy one: its import is the point here)
    return (logits / T).softmax(axis=-1)
'''


def test_later_modules_are_hidden_while_an_earlier_one_is_graded(sandbox, tmp_path, monkeypatch):
    "Module 07 has a softmax; while module 06 (which asks for one) is graded, module 07's files are not there."
    from tinycomp.course.spec import ModuleSpec, get_spec as spec_of
    spec = spec_of('06')
    assert 'tinycomp.benchmarking.evaluation' in spec.hidden()
    nbs = with_export_cell(tmp_path / 'a', '06', SOFTMAX_FROM_LATER, part='06_distillation')
    r = grade_notebook(spec, nbs, prepared=prepare_checks(spec, 3), sandbox=True)
    e = next(e for e in r.exercises if e.name == 'softmax_with_temperature')
    assert e.points == 0 and 'belongs to a later module' in e.diagnosis, e.diagnosis
    monkeypatch.setattr(ModuleSpec, 'hidden', lambda self: self.reference)     # the control: only its own files hidden
    control = grade_notebook(spec, nbs, prepared=prepare_checks(spec, 3), sandbox=True)
    assert points(control)['softmax_with_temperature'] > 0
