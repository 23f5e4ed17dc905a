"""What a learner's code may cost the grader, and what it may make the grader believe: it cannot make the grader hang,
hold its results in memory, write its output to the grader's disk, fill a folder of the sandbox outside its scratch,
pass its own stalling off as a busy machine, or turn a malformed message or unreadable code into a "grader error".
Each attack has a control showing what it measures."""
import ast, json, os, subprocess, sys, threading, time
from pathlib import Path

import pytest

from tinycomp.course.grading import grade_notebook
from tinycomp.course.refs import prepare_checks
from tinycomp.course.spec import get_spec

from learner_notebooks import with_export_cell

ROOT = Path(__file__).resolve().parent.parent


def by_name(report): return {e.name: e for e in report.exercises}


ORACLE_FLOOD = '''
def largest_batch(memory_of, budget, max_batch=4096):
    "Ask the grader question after question without ever reading an answer."
    from tinycomp.course.child import _send
    cells = dict(zip(memory_of.__code__.co_freevars, (c.cell_contents for c in memory_of.__closure__)))
    for _ in range(100000): _send(cells['out'], {'event': 'query', 'job': cells['job_id'], 'args': [1]})
    return 1
'''


def test_questions_never_read_cannot_hang_the_grader(sandbox, tmp_path):
    spec = get_spec('03')
    t0 = time.monotonic()
    r = grade_notebook(spec, with_export_cell(tmp_path, '03', ORACLE_FLOOD), prepared=prepare_checks(spec, 5), sandbox=True)
    e = by_name(r)['largest_batch']
    assert e.points == 0 and r.complete and time.monotonic() - t0 < 300
    assert 'without reading the answers' in e.diagnosis or 'called more than' in e.diagnosis, e.diagnosis


BIG_RESULTS = '''
def _big(*a, **k): return np.zeros((SIZE << 20) // 4, np.float32)
conv2d_naive = im2col = conv2d_direct_kernel = conv2d_weight_grad_kernel = max_pool2d_backward = _big
'''

GRADE_AND_REPORT_MEMORY = '''
import resource, sys
from tinycomp.course.grading import grade_notebook
from tinycomp.course.refs import prepare_checks
from tinycomp.course.spec import get_spec
spec = get_spec('02')
r = grade_notebook(spec, sys.argv[1], prepared=prepare_checks(spec, 3), sandbox=False)
print(r.points, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
'''


def test_the_grader_holds_one_result_at_a_time(tmp_path):
    "Every check answers with 60 MiB: compared on arrival, the grader's memory grows by one result, not by all of them."
    def peak(size):
        folder = tmp_path / str(size)
        with_export_cell(folder, '02', BIG_RESULTS.replace('SIZE', str(size)))
        out = subprocess.run([sys.executable, '-c', GRADE_AND_REPORT_MEMORY, str(folder)], capture_output=True, text=True,
                             timeout=900, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        points, mib = out.stdout.split()[-2:]
        assert float(points) == 0
        return int(mib)
    small, big = peak(1), peak(60)
    jobs = len(prepare_checks(get_spec('02'), 3)[1])
    assert jobs * 60 > 1000                                          # holding them all would take over a GiB
    assert big - small < 4 * 60, (small, big)                        # a few results' worth (decoding, comparing)


GRADE_07_AND_REPORT_MEMORY = '''
import resource, sys
from tinycomp.course.grading import grade_notebook
from tinycomp.course.refs import prepare_checks
from tinycomp.course.spec import get_spec
from tinycomp.errors import GradingError
spec = get_spec('07')
try: r = grade_notebook(spec, sys.argv[1], prepared=prepare_checks(spec, 3), sandbox=False); said = f"{r.points} points"
except GradingError as e: said = str(e)
print(said, '|', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss >> 10)
'''


def test_code_too_long_to_be_exercises_is_refused_before_the_grader_parses_it(tmp_path):
    "Three MB of one-letter lines would take the grader about 2 GB to parse (a syntax tree costs about a kilobyte a token)."
    def graded(lines):
        folder = tmp_path / str(lines)
        with_export_cell(folder, '07', 'a = 1\n' + 'a\n' * lines)
        out = subprocess.run([sys.executable, '-c', GRADE_07_AND_REPORT_MEMORY, str(folder)], capture_output=True,
                             text=True, timeout=900, cwd=ROOT)
        assert out.returncode == 0, out.stderr[-2000:]
        said, mib = out.stdout.strip().rsplit(' | ', 1)
        return said, int(mib)
    said, small = graded(1_000)                                          # the control: read and graded
    assert said == '0.0 points'
    said, big = graded(1_500_000)
    assert 'more than 120,000 tokens' in said and '07e_sweep.ipynb' in said
    assert big - small < 100, (small, big)                               # MiB


FLOOD_OUTPUT = '''
import os as _os
_chunk = b'x' * (1 << 20)
try:
    for _ in range(64): _os.write(1, _chunk)
except OSError: pass
def _crash(*a, **k): _os._exit(3)
conv2d_naive = im2col = conv2d_direct_kernel = conv2d_weight_grad_kernel = max_pool2d_backward = _crash
'''


def _size_of(folder) -> int:
    total = 0
    for root, _, files in os.walk(folder):
        for f in files:
            try: total += os.lstat(os.path.join(root, f)).st_size
            except OSError: pass
    return total


def test_what_a_child_prints_never_reaches_the_graders_disk(tmp_path, monkeypatch):
    "64 MiB printed by every child (one per check, each crashing): the grader keeps a short tail in memory, no file."
    import tempfile
    work = tmp_path / 'work'; work.mkdir()
    monkeypatch.setattr(tempfile, 'tempdir', str(work))
    nbs = with_export_cell(tmp_path / 'nb', '02', FLOOD_OUTPUT)
    peak, done = [0], threading.Event()
    def watch():
        while not done.is_set(): peak[0] = max(peak[0], _size_of(work)); time.sleep(0.05)
    t = threading.Thread(target=watch); t.start()
    try: r = grade_notebook(get_spec('02'), nbs, prepared=prepare_checks(get_spec('02'), 3), sandbox=False)
    finally: done.set(); t.join()
    assert r.points == 0 and 'exited (code 3)' in by_name(r)['conv2d_naive'].diagnosis
    assert peak[0] < 8 << 20, f"{peak[0] >> 20} MiB on the grader's disk"      # inputs and code only


FILL_OTHER_PLACES = r'''
import os as _os, sys as _sys, tinycomp as _tc
_places = {'dev': '/dev', 'shm': '/dev/shm', 'pycache': _os.path.join(_os.path.dirname(_tc.__file__), '__pycache__'),
           'site': [p for p in _sys.path if p.endswith('site-packages')][0]}
_wrote, _refused = {}, {}  # short labels: the message a learner's error carries is cut at 300 characters
for _label, _where in _places.items():
    _wrote[_label] = 0
    try:
        for _i in range(40):
            with open(_os.path.join(_where, f'fill{_i}'), 'wb') as _f:
                for _ in range(48): _f.write(b'\1' * (1 << 20)); _wrote[_label] += 1
    except OSError as _e: _refused[_label] = _e.strerror
raise RuntimeError(f'FILL wrote {_wrote} refused {_refused}')
'''


def test_no_folder_of_the_sandbox_but_its_scratch_takes_more_than_a_little(sandbox, tmp_path):
    "The empty folders that hide things are read-only, and /dev/shm holds 16 MiB: memory a learner cannot hoard."
    r = grade_notebook(get_spec('01'), with_export_cell(tmp_path, '01', FILL_OTHER_PLACES),
                       prepared=prepare_checks(get_spec('01'), 3), sandbox=True)
    wrote, refused = r.error.split('FILL wrote ')[1].split(' (in ')[0].split(' refused ')
    wrote, refused = ast.literal_eval(wrote), ast.literal_eval(refused)
    assert 0 < wrote.pop('shm') <= 16 and wrote == {'dev': 0, 'pycache': 0, 'site': 0}, r.error
    assert refused == {'dev': 'Read-only file system', 'shm': 'No space left on device',
                       'pycache': 'Read-only file system', 'site': 'Read-only file system'}, r.error


FAKE_STARVATION = '''
def relu_backward(grad, x):
    "Wrong on purpose: it never computes; its processes queue for one CPU to look like a machine too busy to grade."
    import os, time
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    def burst():
        while True:
            now = time.time(); time.sleep((int(now * 2) + 1) / 2 - now)
            t = time.perf_counter()
            while time.perf_counter() - t < 0.001: pass
    for _ in range(50):
        if os.fork() == 0:
            try: burst()
            finally: os._exit(0)
    while True: time.sleep(1)
'''


def test_processes_queueing_for_one_cpu_are_the_learners_stall_not_a_busy_machine(sandbox, tmp_path):
    spec = get_spec('01')
    jobs = [j for j in prepare_checks(spec, 3)[1] if j.check.exercise == 'relu_backward']
    r = grade_notebook(spec, with_export_cell(tmp_path, '01', FAKE_STARVATION), prepared=(3, jobs), sandbox=True)
    e = by_name(r)['relu_backward']
    assert e.status == 'timeout' and 'is it sleeping' in e.diagnosis and r.complete, (e.status, e.diagnosis)


DEEP_CODE = '_x = a' + '.b' * 30000 + '\n'       # deep, yet short of the grader's limit on tokens

DEEP_MESSAGE = '''
import os as _os, struct as _st, sys as _sys
def unbroadcast(grad, shape):
    h = ('[' * 30000 + ']' * 30000).encode()
    _os.write(int(_sys.argv[3]), _st.pack('>II', len(h), 0) + h)
    _os._exit(0)
'''


def test_code_or_messages_nested_too_deeply_are_the_learners_error(tmp_path):
    "Neither is a 'grader error' that leaves the row incomplete for ever; a deep message costs only its exercise."
    spec, prepared = get_spec('01'), prepare_checks(get_spec('01'), 3)
    r = grade_notebook(spec, with_export_cell(tmp_path / 'code', '01', DEEP_CODE), prepared=prepared)
    assert r.points == 0 and r.complete and 'recursion' in r.error.lower(), r.error[:300]
    solutions = sorted((ROOT / 'nbs').glob('01?_*.ipynb'))
    folder = tmp_path / 'msg'; folder.mkdir()
    for p in solutions: (folder / p.name).write_text(p.read_text())
    nb = json.loads(solutions[-1].read_text())
    nb['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
                        'source': '#| export\n' + DEEP_MESSAGE})
    (folder / solutions[-1].name).write_text(json.dumps(nb))
    r = grade_notebook(spec, folder, prepared=prepared)
    e = by_name(r)
    assert e['unbroadcast'].points == 0 and 'nested too deeply' in e['unbroadcast'].diagnosis, e['unbroadcast'].diagnosis
    assert r.complete and r.points == spec.possible - e['unbroadcast'].possible      # the control: everything else passes


RENAMED_COPY = '''
def _my_softmax(self, axis=-1):
    shifted = np.exp(self.data - self.data.max(axis=axis, keepdims=True))
    s = shifted / shifted.sum(axis=axis, keepdims=True)
    return Tensor.from_op(s, (self,), lambda g: (s * (g - (g * s).sum(axis=axis, keepdims=True)),), 'softmax', axis=axis)

def log_softmax_forward(x, axis=-1):
    return np.log(_my_softmax(Tensor(x), axis).data)
'''

HIDDEN_COPY = '''
if True:
    class _Helpers:
        @staticmethod
        def normalise(t, axis=-1):
            shifted = np.exp(t.data - t.data.max(axis=axis, keepdims=True))
            s = shifted / shifted.sum(axis=axis, keepdims=True)
            return Tensor.from_op(s, (t,), lambda g: (s * (g - (g * s).sum(axis=axis, keepdims=True)),), 'softmax', axis=axis)

def log_softmax_forward(x, axis=-1):
    return np.log(_Helpers.normalise(Tensor(x), axis).data)
'''


PADDED_COPY = '''
def _my_softmax(self, axis=-1):
    shifted = np.exp(self.data - self.data.max(axis=axis, keepdims=True))
    pass
    unused = [axis] * 2
    s = shifted / shifted.sum(axis=axis, keepdims=True)
    if unused: pass
    return Tensor.from_op(s, (self,), lambda g: (s * (g - (g * s).sum(axis=axis, keepdims=True)),), 'softmax', axis=axis)

def log_softmax_forward(x, axis=-1):
    return np.log(_my_softmax(Tensor(x), axis).data)
'''


@pytest.mark.parametrize('copy_of_helper', [RENAMED_COPY, HIDDEN_COPY, PADDED_COPY],
                         ids=['renamed', 'in_a_class_in_an_if', 'with_lines_that_do_nothing'])
def test_a_copy_of_a_helper_set_aside_is_set_aside_too(tmp_path, monkeypatch, copy_of_helper):
    "The module's softmax answers `log_softmax_forward`: a renamed copy of it, or one hidden in a class inside an `if`, is stubbed as well."
    from tinycomp.course import runner
    spec, prepared = get_spec('01'), prepare_checks(get_spec('01'), 3)
    nbs = with_export_cell(tmp_path / 'copy', '01', copy_of_helper)
    e = by_name(grade_notebook(spec, nbs, prepared=prepared))['log_softmax_forward']
    assert e.points == 0 and 'set aside' in e.diagnosis, e.diagnosis
    monkeypatch.setattr(runner, 'provided_bodies', lambda spec, names: {})     # the control: copies not looked for
    assert by_name(grade_notebook(spec, nbs, prepared=prepared))['log_softmax_forward'].points > 0


ASKING_ON = '''
def largest_batch(memory_of, budget, max_batch=4096):
    "Go on asking after being told the number of calls is used up."
    for _ in range(20000):
        try: memory_of(1)
        except Exception: pass
    return 1
'''


def test_asking_on_past_the_limit_is_named_for_what_it_is(tmp_path):
    from tinycomp.checks.profiling import _MEMORY
    spec, prepared = get_spec('03'), prepare_checks(get_spec('03'), 3)
    e = by_name(grade_notebook(spec, with_export_cell(tmp_path / 'ask', '03', ASKING_ON), prepared=prepared))['largest_batch']
    assert e.points == 0 and f'told that {_MEMORY.max_calls} calls is the limit' in e.diagnosis, e.diagnosis


def test_scratch_folders_of_a_killed_grader_are_removed_by_the_next_run(tmp_path, monkeypatch):
    "A grader killed with SIGKILL cannot clean up; the next run removes the folders it left, and none of a live grader."
    import tempfile
    dead = subprocess.Popen([sys.executable, '-c', 'pass']); dead.wait()            # a PID that no longer runs
    monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
    left = [tmp_path / f'tinycomp-grade-01-{dead.pid}-abc', tmp_path / f'tinycomp-submission-{dead.pid}-def']
    live = [tmp_path / f'tinycomp-grade-01-{os.getpid()}-ghi', tmp_path / f'tinycomp-other-{dead.pid}-x']
    for d in left + live: (d / 'sub').mkdir(parents=True); (d / 'sub' / 'f').write_text('x'); os.chmod(d / 'sub', 0o500)
    spec, prepared = get_spec('01'), prepare_checks(get_spec('01'), 3)
    grade_notebook(spec, sorted((ROOT / 'nbs').glob('01?_*.ipynb')), prepared=prepared)
    assert not any(d.exists() for d in left) and all(d.exists() for d in live)      # the control: a live grader's stays
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(f'tinycomp-grade-01-{os.getpid()}-') and p not in live]


def test_cgroups_of_a_killed_grader_are_removed_by_the_next_one(tree_limit, monkeypatch):
    from tinycomp.course import sandbox
    dead = subprocess.Popen([sys.executable, '-c', 'pass']); dead.wait()
    real_pid = os.getpid
    monkeypatch.setattr(sandbox.os, 'getpid', lambda: dead.pid)                 # a cgroup as a killed grader left it
    stale = sandbox.TreeLimit.create(64 << 20)
    monkeypatch.setattr(sandbox.os, 'getpid', real_pid)
    assert all(d.exists() and str(dead.pid) in d.name for d in stale.dirs)
    fresh = sandbox.TreeLimit.create(64 << 20)
    try: assert not any(d.exists() for d in stale.dirs) and all(d.exists() for d in fresh.dirs)   # a live one stays
    finally: fresh.close()


def test_a_diagnosis_shows_only_the_inputs_the_learners_code_was_given(tmp_path):
    "largest_batch's oracle keeps the model and the step to itself; the report does not show them either."
    spec = get_spec('03')
    r = grade_notebook(spec, with_export_cell(tmp_path, '03', 'largest_batch = lambda memory_of, budget, max_batch=4096: 1'),
                       prepared=prepare_checks(spec, 5), sandbox=False)
    cases = [c for e in r.exercises if e.name == 'largest_batch' for c in e.cases]
    assert cases and all(set(c.inputs) == {'budgets', 'max_batch'} for c in cases), [c.inputs for c in cases]
    assert all(c.status != 'pass' for c in cases)
