"""What a learner sees when submitting to a leaderboard, on loopback with real servers: the upload line or bar, the
place in the queue and the expected wait, a server that stops answering mid-wait and comes back on the same database
and port, where the learner's entries stand at the end (and the baseline), their own history (GET /api/me and
`tinycomp submissions`), the errors that say what to do (an /api address, https against plain HTTP, PyTorch and ONNX
files, `submit --local` without HTTP codes), `submit_local` from a script on stdin, and `tinycomp compress` naming the
model its ratios are relative to."""
import argparse
import copy
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.cli import main as cli_main
from tinycomp.errors import TinycompError
from tinycomp.leaderboard.app import LeaderboardServer, typical_job_seconds
from tinycomp.leaderboard.cli import add_submissions_cli, format_submission, submit_local
from tinycomp.leaderboard.client import my_submissions, submit_remote
from tinycomp.leaderboard.store import SHIPPED_TASKS, open_store
from tinycomp.leaderboard.worker import measure_next
from tinycomp.models import load_pretrained
from tinycomp.nn.modules import Flatten, Linear, Sequential

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FAST = dict(rounds=2, calls=1, calibration_jobs=0)   # the harness at its cheapest: these tests check what is said, not speed


def variant(i, folder, metadata=None, wreck=False) -> Path:
    "A distinct valid model file: digits_cnn with its weights nudged by seed `i`; `wreck`: its last layer zeroed (accuracy ~10 %)."
    m = copy.deepcopy(load_pretrained('digits_cnn'))
    rng = np.random.default_rng(1000 + i)
    for p in m.parameters(): p.data = p.data + (1e-4 * rng.standard_normal(p.data.shape)).astype(np.float32)
    if wreck:
        last = list(m.parameters())[-2]
        last.data = np.zeros_like(last.data)
    return tio.save(m, Path(folder) / f'v{i}.npz', metadata=metadata)


def new_db(task, tmp, **settings):
    store = open_store(Path(tmp) / 'lb.db', create=True)
    store.init(task=dict(name='digits64', data_npz=task / 'task.npz', baseline=task / 'baseline.npz'), **{**FAST, **settings})
    return store


def get(url, token=None):
    "(status, parsed JSON) of a GET; never raises for an HTTP error status."
    req = urllib.request.Request(url, headers={'Authorization': f'Bearer {token}'} if token else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r: return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e: return e.code, json.loads(e.read())


def post(url, path, token):
    req = urllib.request.Request(url + '/api/submissions', data=Path(path).read_bytes(), method='POST',
                                 headers={'Authorization': f'Bearer {token}'})
    with urllib.request.urlopen(req, timeout=30) as r: return json.loads(r.read())


def wait_for(pred, timeout, what, every=0.05):
    deadline = time.monotonic() + timeout
    while not (got := pred()):
        if time.monotonic() > deadline: raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)
    return got


class Submitting:
    "`submit_remote` in a thread, its status lines in `lines`, its result (or error) when it ends."
    def __init__(self, *args, **kw):
        self.lines, self.result, self.error = [], None, None
        self.thread = threading.Thread(target=self._run, args=args, kwargs=dict(kw, log=self.lines.append), daemon=True)
        self.thread.start()

    def _run(self, *args, **kw):
        try: self.result = submit_remote(*args, **kw)
        except TinycompError as e: self.error = e

    def said(self, pattern, timeout=60):
        return wait_for(lambda: next((l for l in list(self.lines) if re.search(pattern, l)), None), timeout, repr(pattern))

    def join(self, timeout=180):
        self.thread.join(timeout)
        assert not self.thread.is_alive(), self.lines


def submissions_cli(argv) -> int:
    "`tinycomp submissions ...` through its own registering function (as its entry point runs it)."
    parser = argparse.ArgumentParser(prog='tinycomp')
    add_submissions_cli(parser.add_subparsers())
    args = parser.parse_args(['submissions', *argv])
    return args.func(args)


# ---------------------------------------------------------------- the queue: place and expected wait
def test_the_queue_says_its_place_and_the_expected_wait(task, tmp_path, capsys):
    store = new_db(task, tmp_path, rate_per_day=0, isolate=False)
    ada = store.issue_token('Ada')
    files = [variant(i, tmp_path) for i in range(4)]
    with LeaderboardServer(store.path, worker=False) as server:
        ids = [post(server.url, f, ada)['id'] for f in files[:3]]
        for place, sid in enumerate(ids, 1):                    # nothing measured yet: no estimate
            sub = get(f"{server.url}/api/submissions/{sid}")[1]
            assert (sub['status'], sub['queue_position'], sub['expected_wait_s']) == ('queued', place, None)
        assert measure_next(store) == ids[0]
        job = typical_job_seconds(store)
        assert job == store.query("SELECT seconds FROM measurements")[0]['seconds'] and job > 0
        sub = get(f"{server.url}/api/submissions/{ids[2]}")[1]
        assert (sub['queue_position'], sub['expected_wait_s']) == (2, pytest.approx(job))   # one job ahead
        assert 'queue_position' not in get(f"{server.url}/api/submissions/{ids[0]}")[1]     # measured: no wait
        # the client: one line for the upload, then its place and the wait, once each
        run = Submitting(files[3], server.url, ada, progress=False, poll=0.1)
        assert run.said(r'^uploaded \d+ KiB: accepted as #4$')
        line = run.said(r'^submission #4 queued')
        assert re.fullmatch(r'submission #4 queued: 3rd in line, its measurement starts in about \d+ s', line), line
        while measure_next(store) is not None: pass
        run.join()
        assert run.result['status'] == 'measured' and run.error is None
        places = [int(m.group(1)) for l in run.lines if (m := re.search(r'queued: (\d)\w\w in line', l))]
        assert places == sorted(set(places), reverse=True) and places[0] == 3, run.lines   # each place once, moving up
        # a large file: a bar on stderr that moves to the end, then says the server is checking the file
        big = tio.save(Sequential(Flatten(), Linear(64, 4500), Linear(4500, 10)), tmp_path / 'big.npz')
        assert big.stat().st_size > 1 << 20
        capsys.readouterr()
        run = Submitting(big, server.url, ada, progress=True, poll=0.1)
        run.said(r'^submission #5 queued')
        measure_next(store)
        run.join()
        err = capsys.readouterr().err
        assert 'uploaded; the server is checking the file: 100%' in err, err[-500:]
        assert run.lines[0] == f"uploaded {big.stat().st_size / (1 << 20):.1f} MiB: accepted as #5"
    print('\n' + '\n'.join(run.lines))


# ---------------------------------------------------------------- the server goes down mid-wait, and comes back
def test_a_server_that_stops_answering_is_said_at_once_and_followed_when_back(task, tmp_path):
    store = new_db(task, tmp_path, rate_per_day=0)
    ada = store.issue_token('Ada')
    server = LeaderboardServer(store.path, worker=False).start()
    url, port = server.url, server.port
    try:
        run = Submitting(variant(1, tmp_path), url, ada, progress=False, poll=0.2, patience=120)
        run.said(r'queued: 1st in line')
        server.stop()
        down = run.said(r'not answering')
        assert re.fullmatch(r"the server is not answering since \d\d:\d\d:\d\d \(.+\); your submission #1 is safe in "
                            r"its database; still trying for 2 min \.\.\.", down), down
        time.sleep(1.0)
        assert run.thread.is_alive() and run.error is None                  # still trying
        server = LeaderboardServer(store.path, port=port).start()         # same database, same port, with its worker
        run.join()
        assert run.error is None and run.result['status'] == 'measured', (run.error, run.lines)
        back = next(l for l in run.lines if 'answers again' in l)
        assert re.fullmatch(r'the server answers again \(no answer for \d+ s\)', back), back
        assert run.lines.index(back) > run.lines.index(down)
        server.stop()
        print('\n' + '\n'.join(run.lines))
        # ... and when it does not come back: a clear end, with where the result will appear
        server = LeaderboardServer(store.path, port=port, worker=False).start()
        run = Submitting(variant(2, tmp_path), url, ada, progress=False, poll=0.2, patience=1.0)
        run.said(r'queued: 1st in line')
        server.stop()
        run.join()
        assert re.fullmatch(rf"the server at {url} has not answered since \d\d:\d\d:\d\d \(.+\); your submission #2 is "
                            rf"safe in its database and will be measured when the server runs again: its result will "
                            rf"appear at {url}/api/submissions/2 and on the page {url}/ \(or run `tinycomp submissions "
                            rf"--server {url}`\)", str(run.error)), run.error
    finally: server.stop()
    assert store.query("SELECT id, status FROM submissions") == [{'id': 1, 'status': 'measured'}, {'id': 2, 'status': 'queued'}]
    print('\n' + '\n'.join(run.lines + [str(run.error)]))


# ---------------------------------------------------------------- the end of submit: where you stand, the baseline
def test_the_end_of_submit_says_where_your_entries_stand_and_the_baseline(task, tmp_path, capsys):
    store = new_db(task, tmp_path, rate_per_day=0)
    ada, bob = store.issue_token('Ada'), store.issue_token('Bob')
    with LeaderboardServer(store.path) as server:
        first = submit_remote(variant(1, tmp_path), server.url, ada, progress=False, log=None)
        assert first['place']['tracks']['closed']['entry'] == first['id']
        submit_remote(variant(2, tmp_path), server.url, bob, progress=False, log=None)
        # a second entry of Ada's, 8 times the bytes for the same model: measured, but her first one stays her best
        padded = variant(3, tmp_path, metadata={'notes': 'x' * 300_000})
        assert cli_main(['submit', str(padded), '--server', server.url, f'--token={ada}', '--no-progress']) == 0
        out = capsys.readouterr().out
        print(out)
        assert re.search(r"score \d\.\d{3}", out)
        assert f"  closed track: your best, entry #{first['id']}, is #" in out and ' of 2' in out
        assert "  speedup, compression and score are relative to the task's baseline, baseline.npz (1.0: as fast and " \
               "as small as it)" in out
        # an entry below the accuracy gate: the reason in words, and Ada's standing unchanged
        wrecked = submit_remote(variant(4, tmp_path, wreck=True), server.url, ada, progress=False, log=None)
        text = format_submission(wrecked)
        print(text)
        assert wrecked['scores']['gate'] == 'failed'
        assert re.search(r"  ! the accuracy gate failed: accuracy \d+\.\d\d% is \d+\.\d\d points below the baseline's "
                         r"\d+\.\d\d%: more than the 1 point allowed, and McNemar's test says the drop is real "
                         r"\(p = 0\.\d{3} < 0\.05\)", text), text
        assert f"closed track: your best, entry #{first['id']}" in text
        standing = wrecked['place']['standing']
        if standing is not None: assert f"this entry: {standing}" in text


# ---------------------------------------------------------------- a learner's own history
def test_a_learner_sees_every_submission_of_their_own_and_nothing_of_anyone_else(task, tmp_path, capsys):
    store = new_db(task, tmp_path, rate_per_day=0, isolate=False)
    ada, bob = store.issue_token('Ada'), store.issue_token('Bob')
    for k, (tok, kw) in enumerate([(ada, {}), (bob, {}), (ada, dict(wreck=True)), (ada, {}), (ada, {})]):
        store.accept(tok, variant(10 + k, tmp_path, **kw).read_bytes())
    for _ in range(4): measure_next(store)                     # #5 stays queued
    store.remove(4, 'copied from a classmate')
    with LeaderboardServer(store.path, worker=False) as server:
        status, me = get(server.url + '/api/me', ada)
        assert status == 200 and me['name'] == 'Ada' and me['baseline'] == 'baseline.npz'
        rows = {r['id']: r for r in me['submissions']}
        assert sorted(rows) == [1, 3, 4, 5]
        assert rows[1]['status'] == 'measured' and set(rows[1]['latency_ms']) == {'1', '64'}
        assert {'speedup', 'score', 'gate', 'rank', 'standing', 'gate_reason'} <= set(rows[1])
        assert rows[1]['score_ci'][0] <= rows[1]['score'] <= rows[1]['score_ci'][1]
        assert rows[1]['speedup_ci'][0] <= rows[1]['speedup'] <= rows[1]['speedup_ci'][1]
        assert rows[1]['rank']['closed'] == 1 or rows[1]['rank']['open'] is not None
        assert rows[3]['gate'] == 'failed' and 'points below the baseline' in rows[3]['gate_reason']
        assert rows[4]['status'] == 'removed' and rows[4]['reason'] == 'removed by the instructor: copied from a classmate'
        assert (rows[5]['status'], rows[5]['queue_position']) == ('queued', 1)
        text = json.dumps(me)
        assert 'Bob' not in text and 'token' not in text and 'sha256' not in text
        bob_id = store.participant(bob)['id']
        assert all(r.get('participant_id') in (None, store.participant(ada)['id']) for r in me['submissions'])
        assert get(server.url + '/api/me', bob)[1]['submissions'][0]['id'] == 2 and bob_id != 1
        assert get(server.url + '/api/me')[0] == 401 and get(server.url + '/api/me', 'x' * 43)[0] == 401
        # the command, against the server (an address copied with /api works too) and on the database itself
        assert submissions_cli(['--server', server.url + '/api', f'--token={ada}']) == 0
        out = capsys.readouterr().out
        print(out)
        assert out.startswith("Ada's submissions to digits64 (public scores; every ratio relative to the baseline baseline.npz)")
        assert re.search(r"^#1 \(.+\): measured, score \d\.\d{3} \[\d\.\d{3}, \d\.\d{3}\], closed track", out, re.M), out
        assert '#4 (' in out and 'removed - removed by the instructor: copied from a classmate' in out
        assert re.search(r'^#5 \(.+\): queued: 1st in line', out, re.M) and '! the accuracy gate failed' in out
        assert submissions_cli(['--local', '--db', str(store.path), f'--token={ada}']) == 0
        assert capsys.readouterr().out.splitlines()[0] == out.splitlines()[0]
        assert my_submissions(server.url, ada)['submissions'][0]['id'] == 1
        with pytest.raises(TinycompError, match=r'the server refused \(HTTP 401\): unknown token'):
            my_submissions(server.url, 'nope')


# ---------------------------------------------------------------- errors that say what to do
def test_addresses_and_files_that_are_not_right_are_named_with_what_to_do(task, tmp_path, capsys):
    store = new_db(task, tmp_path, rate_per_day=0)
    ada = store.issue_token('Ada')
    f = variant(1, tmp_path)
    with LeaderboardServer(store.path, worker=False) as server:
        url, host = server.url, server.url.split('://')[1]
        # an address copied from the API: the /api tail is dropped, and nothing else changes
        with pytest.raises(TinycompError) as e:
            submit_remote(f, url + '/api/', ada, progress=False, log=None, timeout=0.5)
        assert str(e.value) == (f"submission #1 is still queued after 1 s; its result will appear at "
                                f"{url}/api/submissions/1 and on the page {url}/")
        # another path the server does not serve, from the client and from the server itself
        with pytest.raises(TinycompError) as e:
            submit_remote(f, url + '/leaderboard', ada, progress=False, log=None)
        assert str(e.value) == (f"{url}/leaderboard answers, but not as a leaderboard server: give the server's "
                                f"address alone, like {url} (no /api or other path)")
        status, body = get(url + '/leaderboard/api/info')
        assert status == 404 and "give the server's address alone, like http://HOST:PORT" in body['error']
        # https against this plain-HTTP server
        with pytest.raises(TinycompError) as e:
            submit_remote(f, f"https://{host}", ada, progress=False, log=None)
        assert str(e.value) == f"the server at https://{host} does not speak HTTPS: use http://{host}"
        # PyTorch and ONNX files are named before anything is sent, with the way to convert them
        with zipfile.ZipFile(tmp_path / 'net.pt', 'w') as zf:
            zf.writestr('net/data.pkl', pickle.dumps({'w': [1.0]}, protocol=2))
            zf.writestr('net/version', '3\n')
        (tmp_path / 'legacy.pth').write_bytes(pickle.dumps({'w': [1.0]}, protocol=4))
        (tmp_path / 'net.onnx').write_bytes(b'\x08\x08\x12\x07pytorch\x1a\x052.1.0:\x00')
        before = store.query("SELECT count(*) AS n FROM submissions")[0]['n']
        capsys.readouterr()                           # (uvicorn's warning about the TLS handshake it could not read)
        for name, kind in (('net.pt', 'PyTorch'), ('legacy.pth', 'PyTorch'), ('net.onnx', 'ONNX')):
            assert cli_main(['submit', str(tmp_path / name), '--server', url, f'--token={ada}']) == 2
            err = capsys.readouterr().err
            assert err.startswith(f"tinycomp: error: {tmp_path / name} looks like a{'n' if kind == 'ONNX' else ''} "
                                  f"{kind} file, not a tinycomp model file: ") and '`tinycomp import ' in err, err
            print(err.strip())
        assert store.query("SELECT count(*) AS n FROM submissions")[0]['n'] == before
    # `submit --local`: the same file checks, and refusals without HTTP status codes
    assert cli_main(['submit', str(tmp_path / 'net.onnx'), '--local', '--db', str(store.path), f'--token={ada}']) == 2
    assert 'looks like an ONNX file' in capsys.readouterr().err
    assert cli_main(['submit', str(f), '--local', '--db', str(store.path), f'--token={ada}']) == 2
    err = capsys.readouterr().err
    assert err.startswith("tinycomp: error: submission refused: you already submitted this model as your entry #1 (")
    assert err.endswith("re-submitting the same model is not measured again (saving it with other metadata does not "
                        "make it another model)\n")
    assert cli_main(['submit', str(variant(2, tmp_path)), '--local', '--db', str(store.path), '--token=nope']) == 2
    err = capsys.readouterr().err
    assert 'submission refused: missing or unknown token' in err and not re.search(r'\b(HTTP|401)\b', err), err


# ---------------------------------------------------------------- submit --local from a script on stdin
def test_submit_local_from_a_script_fed_on_stdin(task, tmp_path):
    store = new_db(task, tmp_path)                               # isolate: the worker's measurement child is spawned
    assert store.settings['isolate'] is True
    token = store.issue_token('Ada')
    model = variant(1, tmp_path)
    script = tmp_path / 'script.py'
    script.write_text("from tinycomp.leaderboard import open_store\nfrom tinycomp.leaderboard.cli import submit_local, "
                      "format_submission\n"
                      f"sub = submit_local(open_store({str(store.path)!r}), {str(model)!r}, {token!r})\n"
                      "print(format_submission(sub))\n")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''))
    with open(script) as stdin:
        r = subprocess.run([sys.executable, '-'], stdin=stdin, capture_output=True, text=True, timeout=300, env=env,
                           cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    print(r.stdout)
    lines = r.stdout.splitlines()
    assert lines[0] == "accepted as #1; it is measured against the baseline, interleaved, at batch sizes 1, 64"
    assert 'submission #1 queued: 1st in line' in lines and any(l.startswith('#1 by Ada') and l.endswith('measured') for l in lines)
    assert store.submission(1)['status'] == 'measured'


def test_submit_local_says_when_its_measuring_process_stops(task, tmp_path, monkeypatch):
    from tinycomp.leaderboard import cli
    store = new_db(task, tmp_path)
    token = store.issue_token('Ada')
    monkeypatch.setattr(cli, '_MEASURE_CODE', "import sys; sys.exit('the measuring process could not start')")
    with pytest.raises(TinycompError) as e:
        submit_local(store, variant(1, tmp_path), token, log=None)
    assert str(e.value) == (f"the measuring process stopped (exit code 1: the measuring process could not start); "
                            f"submission #1 is safe in {store.path}: measure it with `tinycomp leaderboard worker "
                            f"--db {store.path} --once`")
    assert store.submission(1)['status'] == 'queued'


# ---------------------------------------------------------------- tinycomp compress names its baseline
def test_compress_says_which_model_its_ratios_are_relative_to(tmp_path, capsys):
    from tinycomp.benchmarking.compression import LEADERBOARD_TASKS, compress_command
    assert {data: (name, base) for name, (data, base, _) in SHIPPED_TASKS.items()} == LEADERBOARD_TASKS
    compress_command([{'quantize_dynamic': {}}], 'digits_cnn_wide', tmp_path / 'out', progress=False, rounds=2, calls=1)
    out = capsys.readouterr().out
    assert ("ratios are relative to the original model, digits_cnn_wide; the class leaderboard's digits task scores "
            "against digits_cnn instead, so its speedup, compression and score for the same file differ from these") in out


# ---------------------------------------------------------------- the verdict's words, from the leaderboard's fields
def test_the_verdict_shows_intervals_ties_the_standing_line_and_the_baseline():
    from tinycomp.leaderboard.cli import format_leaderboard
    from tinycomp.leaderboard.client import place_of
    scores = dict(accuracy=0.98, accuracy_ci=[0.95, 0.99], dacc_points=-0.5, p_value=0.5, gate='passed',
                  latency_ms={'1': 0.1, '64': 1.0}, speedup_at={'1': 1.2, '64': 1.5}, speedup=1.34, speedup_ci=[1.2, 1.5],
                  file_bytes=1000, compression=4.0, score=2.315, score_ci=[2.2, 2.4], flags=[])
    sub = dict(id=7, name='Ada', participant_id=1, date='2026-01-05 10:00 UTC', status='measured', split='public',
               rank={'closed': None, 'open': None}, scores=scores)
    row = lambda i, pid, name, **kw: dict(dict(scores, id=i, participant_id=pid, name=name, date='2026-01-05 10:00 UTC',
                                               pareto_rank=1), **kw)
    board = dict(task='digits', closed=False, split='public', samples=180, baseline=dict(name='digits_cnn.npz'),
                 standing={'7': 'not ranked: your entry #5 stands for you on both tracks'}, unranked=[],
                 tracks=dict(closed=[row(3, 2, 'Bob', rank=1, band=[1, 2], tied=True),
                                     row(5, 1, 'Ada', rank=1, band=[1, 2], tied=True)],
                             open=[row(5, 1, 'Ada', rank=1, why='on the Pareto front'),
                                   row(3, 2, 'Bob', rank=2, why="dominated by Ada's entry #5: as good or better on all three, better on accuracy and size")]))
    sub['place'] = place_of(sub, board)
    assert format_submission(sub).splitlines() == [
        '#7 by Ada (2026-01-05 10:00 UTC): measured',
        '  accuracy 98.00% [95.0%, 99.0%] on the public part (-0.50 points vs the baseline, p = 0.500; gate passed)',
        '  latency b1 0.100 ms (1.20x), b64 1.000 ms (1.50x); speedup 1.34x [1.20, 1.50]',
        '  file 1,000 bytes, compression 4.00x; score 2.315 [2.200, 2.400] (95 % interval)',
        '  closed track: your best, entry #5, is #1 of 2 (tied: ranks 1-2)',
        '  open track: your best, entry #5, is #1 of 2 (on the Pareto front)',
        '  this entry: not ranked: your entry #5 stands for you on both tracks',
        "  speedup, compression and score are relative to the task's baseline, digits_cnn.npz (1.0: as fast and as "
        "small as it)"]
    table = format_leaderboard(board).splitlines()
    assert 'every ratio is relative to the baseline digits_cnn.npz (speedup, compression and score 1.0)' in table
    closed = table[table.index('closed track') + 2:table.index('closed track') + 4]
    assert [l.split()[:2] for l in closed] == [['1=', 'Bob'], ['1=', 'Ada']] and all('[2.200, 2.400]' in l for l in closed)
