"""The runner's clock and channel: deadlines count the learner's own CPU time (a busy machine cannot fail correct
work), code that waits instead of computing still times out, a check the machine starved is run again or reported as
the grader's failure, and what a check counts (oracle calls) is counted by the parent."""
import copy, json, os, subprocess, sys, time
from pathlib import Path

import pytest

from tinycomp.course.grading import format_report, grade_notebook
from tinycomp.course.notebooks import read_notebook
from tinycomp.course.refs import prepare_checks, refs
from tinycomp.course.runner import Budget, run_jobs, wall_cap
from tinycomp.course.sandbox import TreeClock, TreeLimit, _descendants, _process_cpu
from tinycomp.course.spec import get_spec

pytestmark = pytest.mark.grader

ROOT = Path(__file__).resolve().parent.parent

REFERENCE = '''
import time
import numpy as np
def spin(x, seconds):
    "Burn `seconds` of CPU time, then return 2 * x."
    t = time.process_time()
    while time.process_time() - t < seconds: pass
    return 2 * x
'''

CHECKS = '''
import numpy as np
from tinycomp.course.spec import Check, ModuleSpec
def make(rng): return {{'x': rng.standard_normal(3), 'seconds': np.array({seconds})}}
def run(ns, i): return {{'y': np.asarray(ns.spin(i['x'], float(i['seconds'])))}}
SPEC = ModuleSpec('09', 'runner', reference=('{ref}',), refs_dir={refs!r}, checks=[Check('spin', 'cpu', 1, make, run, timeout={limit})])
'''


def synthetic(tmp_path, name, seconds, limit):
    "A one-exercise module whose reference burns `seconds` of CPU time, with a CPU-time limit of `limit` s."
    lib = tmp_path / f'lib_{name}'; lib.mkdir()
    (lib / f'{name}_ref.py').write_text(REFERENCE)
    (lib / f'{name}_checks.py').write_text(CHECKS.format(seconds=seconds, ref=f'{name}_ref', refs=str(tmp_path / f'refs_{name}'), limit=limit))
    sys.path.insert(0, str(lib))                   # the parent imports the reference and the checks too
    spec = __import__(f'{name}_checks').SPEC
    assert refs(specs={'09': spec}, quiet=True) == 0
    return spec, dict(spec_ref=f'{name}_checks:SPEC', sys_path=[str(lib)])


def run(spec, kw, code, tmp_path, sandbox=False):
    work = tmp_path / f'work{time.monotonic_ns()}'; work.mkdir()
    _, jobs = prepare_checks(spec, 1)
    return jobs, run_jobs(spec, code, jobs, work, kw['spec_ref'], sys_path=kw['sys_path'], sandbox=sandbox)


# ---------------------------------------------------------------- the clock

class FakeClock:
    def __init__(self): self.t_cpu, self.t_wait = 0.0, 0.0
    def cpu(self): return self.t_cpu
    def waiting(self): return self.t_wait


def test_a_budget_tells_computing_too_long_from_waiting_from_being_starved(monkeypatch):
    from tinycomp.course.sandbox import machine_cpus
    now, busy = [100.0], [0.0]
    monkeypatch.setattr(time, 'monotonic', lambda: now[0])
    clock = FakeClock(); b = Budget(clock, 2.0, machine=lambda: busy[0])
    cap, cpus = wall_cap(2.0) + 1, machine_cpus()
    clock.t_cpu = 1.9; now[0] += 50                               # long on the clock, but inside the CPU budget...
    assert b.spent() in ('stalled', 'starved')                    # ...past the clock-time cap, so it is judged
    b.restart(); assert b.spent() is None
    clock.t_cpu += 2.1; assert b.spent() == 'cpu' and 'timed out after 2 s of CPU time' in b.message('cpu', 'this check')
    b.restart(); now[0] += cap; clock.t_cpu += 0.1; clock.t_wait += 0.2; busy[0] += 0.3
    assert b.spent() == 'stalled' and 'is it sleeping' in b.message('stalled', 'this check')
    b.restart(); now[0] += cap; clock.t_cpu += 1.0; clock.t_wait += cap; busy[0] += 1.0 + 0.9 * cpus * cap
    assert b.spent() == 'starved' and 'says nothing about your code' in b.message('starved', 'this check')
    # its own processes queueing for a CPU, the rest of the machine idle: the learner's code stalled itself
    b.restart(); now[0] += cap; clock.t_cpu += 1.0; clock.t_wait += 20 * cap; busy[0] += 1.0
    assert b.spent() == 'stalled'


def test_the_tree_clock_counts_cpu_time_of_a_whole_process_tree():
    code = 'import subprocess, sys, time\nt = time.process_time()\nwhile time.process_time() - t < 0.6: pass\n' \
           'subprocess.run([sys.executable, "-c", "import time\\nt = time.process_time()\\nwhile time.process_time() - t < 0.6: pass"])\n' \
           'time.sleep(5)'
    tree = TreeLimit.create(1 << 30)
    try:
        for t in ([tree] if tree else []) + [None]:
            p = subprocess.Popen(t.wrap([sys.executable, '-c', code]) if t else [sys.executable, '-c', code])
            time.sleep(0.2)
            clock = TreeClock(p.pid, t)
            deadline = time.monotonic() + 60
            while clock.cpu() < 1.1 and time.monotonic() < deadline: time.sleep(0.1)
            assert clock.cpu() >= 1.1, (t, clock.cpu())           # both processes' time, the finished child's too
            assert p.pid in _descendants(p.pid) and _process_cpu(p.pid) >= 0
            p.kill(); p.wait()
    finally:
        if tree: tree.close()


# ---------------------------------------------------------------- load

def test_a_busy_machine_cannot_time_out_correct_work(tmp_path):
    "A check that needs 1 s of CPU with a 2 s CPU budget passes while hogs take most of the CPU."
    spec, kw = synthetic(tmp_path, 'tc_load', seconds=1.0, limit=2.0)
    hogs = [subprocess.Popen([sys.executable, '-c', 'while True: pass']) for _ in range(3 * (os.cpu_count() or 2))]
    try:
        time.sleep(0.5)
        t0 = time.monotonic()                                      # the control: 1 s of CPU takes longer than 2 s here
        subprocess.run([sys.executable, '-c', 'import time\nt = time.process_time()\nwhile time.process_time() - t < 1.0: pass'])
        loaded = time.monotonic() - t0
        jobs, results = run(spec, kw, REFERENCE, tmp_path)
    finally:
        for h in hogs: h.kill(); h.wait()
    assert loaded > 2.0, f"the hogs did not load the machine ({loaded:.1f} s): a clock-time deadline would have passed too"
    assert all(r['status'] == 'done' for r in results.values()), results


def test_code_that_waits_instead_of_computing_still_times_out(tmp_path):
    spec, kw = synthetic(tmp_path, 'tc_sleep', seconds=0.0, limit=1.0)
    code = 'import time\ndef spin(x, seconds):\n    time.sleep(600)\n'
    t0 = time.monotonic()
    _, results = run(spec, kw, code, tmp_path)
    assert time.monotonic() - t0 < wall_cap(1.0) + 20
    assert {r['status'] for r in results.values()} == {'timeout'}
    assert any('is it sleeping' in r['message'] for r in results.values())


def test_a_starved_check_is_run_again_and_passes(tmp_path, monkeypatch):
    spec, kw = synthetic(tmp_path, 'tc_retry', seconds=0.5, limit=5.0)
    calls = []
    real = Budget.spent
    def starved_once(self):
        calls.append(1)
        return 'starved' if len(calls) == 1 else real(self)
    monkeypatch.setattr(Budget, 'spent', starved_once)
    _, results = run(spec, kw, REFERENCE, tmp_path)
    assert calls and all(r['status'] == 'done' for r in results.values()), results


def test_a_check_the_machine_keeps_starving_is_the_graders_failure_not_the_learners(tmp_path, monkeypatch):
    spec = get_spec('01')
    monkeypatch.setattr(Budget, 'spent', lambda self: 'starved')
    slow = '#| export\nimport time as _t\n_t0 = _t.process_time()\nwhile _t.process_time() - _t0 < 0.5: pass\n'
    parts = sorted((ROOT / 'nbs').glob('01?_*.ipynb'))
    nb = copy.deepcopy(read_notebook(parts[0]))
    nb['cells'].insert(3, {'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None, 'source': slow})
    (tmp_path / parts[0].name).write_text(json.dumps(nb))
    r = grade_notebook(spec, [tmp_path / parts[0].name] + parts[1:], prepared=prepare_checks(spec, 1))
    assert not r.complete and r.points == 0 and not r.error and {e.status for e in r.exercises} == {'grader'}
    text = format_report(r)
    assert 'not graded because the machine was too busy' in text and 'says nothing about your code' in text


# ---------------------------------------------------------------- the channel

def test_a_second_begin_message_is_refused(tmp_path):
    "Announcing the start of a check again (to get a fresh budget) is writing to the grader's channel."
    spec, kw = synthetic(tmp_path, 'tc_begin', seconds=0.0, limit=5.0)
    code = ('import json, os, struct, sys\ndef spin(x, seconds):\n'
            '    h = json.dumps({"event": "begin", "job": 0}).encode()\n'
            '    os.write(int(sys.argv[3]), struct.pack(">II", len(h), 0) + h)\n    return 2 * x\n')
    _, results = run(spec, kw, code, tmp_path)
    assert results[0]['status'] == 'error' and "wrote to the grader's channel" in results[0]['message']


SCAN_AND_WIPE = r'''
import gc as _gc
def largest_batch(memory_of, budget, max_batch=4096):
    for _o in _gc.get_objects():                         # wipe any call log this process holds
        if type(_o) is list and _o and all(isinstance(v, (int, tuple)) for v in _o[:5]): _o.clear()
    for _c in getattr(memory_of, '__closure__', None) or ():
        if isinstance(_c.cell_contents, list): _c.cell_contents.clear()
    if memory_of(1) > budget: raise TinycompError('nothing fits')
    b = 1
    while b < max_batch and memory_of(b + 1) <= budget: b += 1         # a linear scan
    return b
'''


def test_calls_are_counted_by_the_grader_where_the_learners_code_cannot_reach(tmp_path):
    "A linear scan that wipes every call log it can find still loses: the count lives in the parent."
    spec = get_spec('03')
    parts = sorted((ROOT / 'modules' / spec.folder).glob('*.ipynb'))
    nb = copy.deepcopy(read_notebook(parts[-1]))
    nb['cells'].append({'cell_type': 'code', 'metadata': {}, 'outputs': [], 'execution_count': None,
                        'source': '#| export\nfrom tinycomp.errors import TinycompError\n' + SCAN_AND_WIPE})
    (tmp_path / parts[-1].name).write_text(json.dumps(nb))
    r = grade_notebook(spec, parts[:-1] + [tmp_path / parts[-1].name], prepared=prepare_checks(spec, 5))
    e = next(e for e in r.exercises if e.name == 'largest_batch')
    assert e.points == 0, e.diagnosis
    assert 'few_calls: expected 1, got 0' in e.diagnosis     # the results themselves were right: only the count fails


def test_set_aside_stubs_only_the_named_top_level_functions_and_keeps_every_line():
    from tinycomp.course.provided import set_aside
    code = ("import functools\n@functools.lru_cache\ndef _fast(x):\n    return x + 1\n\n"
            "def exercise(x):\n    return _fast(x)\n\nclass K:\n    def _fast(self): return 2\nshortcut = _fast\n")
    out = set_aside(code, ('_fast',), 'exercise')
    assert len(out.split('\n')) == len(code.split('\n'))                   # the learner's line numbers still hold
    ns = {}; exec(compile(out, 'learner.py', 'exec'), ns)
    with pytest.raises(NotImplementedError, match='`_fast` is set aside while `exercise` is graded'): ns['exercise'](1)
    with pytest.raises(NotImplementedError): ns['shortcut'](1)             # a reference taken at import time is the stub
    assert ns['K']()._fast() == 2                                           # a method of the same name is not touched
    assert set_aside(code, (), 'exercise') == code and set_aside('def (:', ('_fast',), 'e') == 'def (:'
    ns = {}; exec(code, ns); assert ns['exercise'](1) == 2                  # the control: the original answers
