"""Tests for the leaderboard's web server and client (tinycomp.leaderboard.app and .client), all on loopback with real
uvicorn servers: the HTTP API end to end, a class of 8 concurrent submitters, every abuse case of issue 16 item 8
(refused with its status, nothing written), the server answering while a measurement runs, SIGKILLs of the server
and of the worker at random moments, and the page in headless Chromium (with a screenshot)."""
import copy
import hashlib
import http.client
import json
import os
import random
import re
import shutil
import signal
import socket
import sqlite3
import struct
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.cli import main as cli_main
from tinycomp.data import load_digits
from tinycomp.errors import TinycompError
from tinycomp.leaderboard.app import LeaderboardServer, bearer_token, make_app
from tinycomp.leaderboard.client import submit_remote
from tinycomp.leaderboard.store import open_store
from tinycomp.leaderboard.worker import measure_next
from tinycomp.models import load_pretrained
from tinycomp.nn.modules import Flatten, Linear, Sequential

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
FAST = dict(rounds=2, calls=1, calibration_jobs=0)   # the harness at its cheapest: these tests check plumbing, not speed


# ---------------------------------------------------------------- fixtures and helpers
_BASE = {}

def variant(i: int, tmp, metadata=None) -> bytes:
    "A distinct valid model file: digits_cnn with its weights nudged by seed `i` (same accuracy, different bytes)."
    if 'm' not in _BASE: _BASE['m'] = load_pretrained('digits_cnn')
    m = copy.deepcopy(_BASE['m'])
    rng = np.random.default_rng(1000 + i)
    for p in m.parameters(): p.data = p.data + (1e-4 * rng.standard_normal(p.data.shape)).astype(np.float32)
    path = tio.save(m, Path(tmp) / f'v{i}.npz', metadata=metadata)
    return path.read_bytes()


def new_db(task, tmp, **settings):
    path = Path(tmp) / 'lb.db'
    store = open_store(path, create=True)
    store.init(task=dict(name='digits64', data_npz=task / 'task.npz', baseline=task / 'baseline.npz'),
               **{**FAST, **settings})
    return store


def request(method, url, body=None, token=None, headers=None, timeout=30):
    "(status, parsed JSON or text, headers) of one HTTP request; never raises for an HTTP error status."
    h = dict(headers or {})
    if token is not None: h['Authorization'] = f'Bearer {token}'
    req = urllib.request.Request(url, data=body, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r: status, raw, hdrs = r.status, r.read(), r.headers
    except urllib.error.HTTPError as e: status, raw, hdrs = e.code, e.read(), e.headers
    text = raw.decode('utf-8')
    return status, (json.loads(text) if 'json' in (hdrs.get('content-type') or '') else text), hdrs


def post(url, body, token=None, **kw): return request('POST', url + '/api/submissions', body, token, **kw)


def snapshot(db) -> str:
    "A digest of every row of every table of the database: equal digests, nothing written."
    con = sqlite3.connect(f'file:{db}?mode=ro', uri=True)
    try:
        h = hashlib.sha256()
        for (t,) in con.execute("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").fetchall():
            h.update(t.encode())
            for row in sorted(repr(r) for r in con.execute(f'SELECT * FROM "{t}"')): h.update(row.encode())
        return h.hexdigest()
    finally: con.close()


def files_beside(db) -> list:
    "The files next to the database other than SQLite's own (nothing else may appear)."
    return sorted(p.name for p in Path(db).parent.iterdir() if not p.name.startswith(Path(db).name))


def wait_for(pred, timeout, what, every=0.1):
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got: return got
        if time.monotonic() > deadline: raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(every)


def alive(pid) -> bool:
    "Is process `pid` running (a zombie waiting for its parent does not count)?"
    try: return Path(f'/proc/{pid}/stat').read_text().rsplit(') ', 1)[1][0] != 'Z'
    except (OSError, IndexError): return False


def statuses(db) -> dict:
    con = sqlite3.connect(f'file:{db}?mode=ro', uri=True)
    try: return dict(con.execute("SELECT id, status FROM submissions").fetchall())
    finally: con.close()


class Serve:
    "`tinycomp leaderboard serve` in a child process (the real command: uvicorn plus its worker process)."
    def __init__(self, db, port=0):
        env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get('PYTHONPATH', ''),
                   PYTHONUNBUFFERED='1')
        self.proc = subprocess.Popen([sys.executable, '-m', 'tinycomp.cli', 'leaderboard', 'serve', '--db', str(db),
                                      '--port', str(port)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env, cwd=str(db.parent))
        self.lines, self.url = [], None
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.url = wait_for(lambda: next((m.group(1) for l in list(self.lines)
                                          if (m := re.search(r' at (http://\S+?)/ ', l))), None)
                            or (self.proc.poll() is not None and self._died()), 60, 'the server to start')
        wait_for(lambda: self._up(), 30, 'the server to answer')

    def _died(self): raise AssertionError("serve exited early:\n" + ''.join(self.lines))

    def _read(self):
        for line in self.proc.stdout: self.lines.append(line)

    def _up(self):
        try: return request('GET', self.url + '/api/info', timeout=2)[0] == 200
        except OSError: return False

    @property
    def port(self): return int(self.url.rsplit(':', 1)[1])

    def worker_pid(self):
        "The pid of the worker process this server started (a child running worker_main)."
        for p in Path('/proc').iterdir():
            if not p.name.isdigit(): continue
            try:
                stat = (p / 'stat').read_text()
                cmd = (p / 'cmdline').read_bytes()
            except OSError: continue
            if int(stat.rsplit(')', 1)[1].split()[1]) == self.proc.pid and b'worker_main' in cmd: return int(p.name)
        return None

    def kill(self):
        self.proc.kill()
        self.proc.wait(10)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try: self.proc.wait(20)
            except subprocess.TimeoutExpired: self.kill()
        self._reader.join(5)


# ---------------------------------------------------------------- hostile files
def parts(blob, tmp):
    "(manifest, arrays) of a good model file, read with plain NumPy."
    p = Path(tmp) / 'parts.npz'
    p.write_bytes(blob)
    with np.load(p, allow_pickle=False) as f: arrays = {k: f[k] for k in f.files}
    return json.loads(arrays.pop('__manifest__').tobytes()), arrays


def craft(tmp, manifest, arrays) -> bytes:
    "A (possibly hostile) .npz: arrays plus the manifest as JSON bytes (np.savez pickles object arrays: on purpose)."
    p = Path(tmp) / 'crafted.npz'
    np.savez(p, __manifest__=np.frombuffer(json.dumps(manifest).encode(), np.uint8), **arrays)
    return p.read_bytes()


def npy_header(shape, dtype=np.float32) -> bytes:
    import io
    f = io.BytesIO()
    np.lib.format.write_array_header_1_0(f, {'descr': np.lib.format.dtype_to_descr(np.dtype(dtype)),
                                             'fortran_order': False, 'shape': tuple(shape)})
    return f.getvalue()


def raw_zip(members) -> bytes:
    "A zip archive from [(name, method, crc, size, compressed bytes or list of chunks)], written by hand."
    out, central, offset = [], [], 0
    for name, method, crc, size, data in members:
        chunks = data if isinstance(data, list) else [data]
        csize = sum(map(len, chunks))
        local = struct.pack('<4s5H3L2H', b'PK\x03\x04', 20, 0, method, 0, 0x21, crc, csize, size, len(name), 0) + name
        central.append(struct.pack('<4s6H3L5H2L', b'PK\x01\x02', 20, 20, 0, method, 0, 0x21, crc, csize, size,
                                   len(name), 0, 0, 0, 0, 0, offset) + name)
        out += [local, *chunks]
        offset += len(local) + csize
    cd = b''.join(central)
    return b''.join(out) + cd + struct.pack('<4s4H2LH', b'PK\x05\x06', 0, 0, len(members), len(members), len(cd), offset, 0)


def zip_bomb(n=20000) -> bytes:
    """The issue's zip bomb: a valid model file holding Linear(n, n) of zeros, deflated (about 1.6 MB holding 1.6 GB),
    built from one deflated block repeated after full flushes (so it takes a fraction of a second)."""
    import tempfile
    with tempfile.TemporaryDirectory() as d:
        man, _ = parts(tio.save(Sequential(Flatten(), Linear(2, 2)), Path(d) / 's.npz').read_bytes(), d)
    man['model']['children']['1']['config'].update(in_features=n, out_features=n)
    man['arrays'] = {'1.weight': {'shape': [n, n], 'dtype': 'float32'}, '1.bias': {'shape': [n], 'dtype': 'float32'}}
    members = []
    def stored(name, payload):
        members.append((name.encode(), 0, zlib.crc32(payload), len(payload), payload))
    import io
    f = io.BytesIO(); np.save(f, np.frombuffer(json.dumps(man).encode(), np.uint8)); stored('__manifest__.npy', f.getvalue())
    head, block, nblocks = npy_header((n, n)), bytes(16_000_000), n * n * 4 // 16_000_000
    assert nblocks * len(block) == n * n * 4
    c = zlib.compressobj(9, zlib.DEFLATED, -15)
    first = c.compress(head) + c.flush(zlib.Z_FULL_FLUSH)
    body = c.compress(block) + c.flush(zlib.Z_FULL_FLUSH)      # after a full flush the same input deflates the same
    crc = zlib.crc32(head)
    for _ in range(nblocks): crc = zlib.crc32(block, crc)
    members.append((b'1.weight.npy', 8, crc, len(head) + n * n * 4, [first] + [body] * nblocks + [c.flush()]))
    f = io.BytesIO(); np.save(f, np.zeros(n, np.float32)); stored('1.bias.npy', f.getvalue())
    return raw_zip(members)


# ---------------------------------------------------------------- small pieces
def test_bearer_token_and_make_app_errors(tmp_path):
    assert bearer_token('Bearer t0k') == 't0k' and bearer_token('Basic t0k') is None and bearer_token(None) is None
    with pytest.raises(TinycompError, match='leaderboard init'):
        make_app(tmp_path / 'missing.db')
    open_store(tmp_path / 'empty.db', create=True)
    with pytest.raises(TinycompError, match='no task yet'):
        make_app(tmp_path / 'empty.db')


# ---------------------------------------------------------------- the API end to end
def test_api_end_to_end(task, tmp_path, capsys):
    store = new_db(task, tmp_path)
    ada, bob = store.issue_token('Ada'), store.issue_token('Bob')
    f1, f2 = tmp_path / 'ada.npz', tmp_path / 'bob.npz'
    claims = {'score': 1000.0, 'accuracy': 1.0, 'speedup': 49.0}        # metadata may say anything: never read
    f1.write_bytes(variant(1, tmp_path, metadata=claims)); f2.write_bytes(variant(2, tmp_path))
    with LeaderboardServer(store.path) as server:
        url = server.url
        status, info, _ = request('GET', url + '/api/info')
        assert status == 200 and info['max_body'] == store.settings['max_file_bytes']
        empty = request('GET', url + '/api/leaderboard')[1]
        assert empty['tracks'] == {'closed': [], 'open': []} and 'Ada' not in request('GET', url + '/')[1]
        status, sub, hdrs = post(url, f1.read_bytes(), ada, headers={'Content-Type': 'application/octet-stream'})
        assert status == 202 and sub['status'] in ('queued', 'measuring', 'measured') and sub['name'] == 'Ada'
        assert hdrs['Location'] == f"/api/submissions/{sub['id']}"
        assert not any('token' in k for k in sub)
        # the client: upload, wait until measured, the entry with scores and ranks
        entry = submit_remote(f2, url, bob, progress=False)
        assert entry['status'] == 'measured' and entry['name'] == 'Bob'
        assert set(entry['scores']) >= {'accuracy', 'speedup', 'compression', 'score', 'latency_ms'}
        assert set(entry['rank']) == {'closed', 'open'}
        wait_for(lambda: request('GET', f"{url}/api/submissions/{sub['id']}")[1]['status'] == 'measured', 30, 'Ada measured')
        status, board, hdrs = request('GET', url + '/api/leaderboard')
        assert status == 200 and hdrs['content-type'] == 'application/json'
        assert {r['name'] for r in board['tracks']['open']} == {'Ada', 'Bob'} and board['split'] == 'public'
        ada_row = next(r for r in board['tracks']['closed'] if r['name'] == 'Ada')
        assert ada_row['score'] < 10 and ada_row['speedup'] < 10          # measured, not the file's claims
        status, page, hdrs = request('GET', url + '/')
        assert status == 200 and 'Ada' in page and 'Bob' in page and "default-src 'none'" in hdrs['Content-Security-Policy']
        # the command line: `tinycomp submit FILE --server URL --token T` prints the scores and the rank
        f3 = tmp_path / 'ada2.npz'
        f3.write_bytes(variant(3, tmp_path))
        assert cli_main(['submit', str(f3), '--server', url, '--token', ada, '--no-progress']) == 0
        out = capsys.readouterr().out
        assert 'by Ada' in out and 'measured' in out and 'closed track' in out and 'score' in out
        # refusals from the client are one line, with the server's status and reason
        with pytest.raises(TinycompError, match=r'\(HTTP 409\): you already submitted this model as your entry #'):
            submit_remote(f3, url, ada, progress=False)
        with pytest.raises(TinycompError, match=r'\(HTTP 401\): unknown token'):
            submit_remote(f3, url, 'not-a-token', progress=False)
        assert cli_main(['submit', str(f3), '--server', url, '--token', 'nope', '--no-progress']) == 2
        assert 'tinycomp: error: the server refused the submission (HTTP 401)' in capsys.readouterr().err
        # the cached answers follow every change: a removal, then closing (private scores)
        store.remove(entry['id'], 'a test')
        assert {r['name'] for r in request('GET', url + '/api/leaderboard')[1]['tracks']['open']} == {'Ada'}
        page = request('GET', url + '/')[1]                 # the page says it was removed, not the instructor's words
        assert 'removed by the instructor (the reason goes to the participant alone)' in page and 'a test' not in page
        store.close()
        assert request('GET', url + '/api/leaderboard')[1]['split'] == 'private'
        assert post(url, f1.read_bytes(), ada)[0] == 423
        # unknown things are JSON 404/405, never a traceback
        for method, path, code in (('GET', '/api/submissions/99999', 404), ('GET', '/api/submissions/abc', 404),
                                   ('GET', '/nothing', 404), ('GET', '/api/submissions', 405),
                                   ('DELETE', '/api/leaderboard', 405)):
            status, body, _ = request(method, url + path)
            assert status == code and 'error' in body, (path, status, body)
    with pytest.raises(TinycompError, match='cannot reach the leaderboard server'):
        submit_remote(f3, server.url, ada, progress=False)
    with pytest.raises(TinycompError, match='not a server address'):
        submit_remote(f3, 'ftp://x', ada, progress=False)
    with pytest.raises(TinycompError, match='no model file'):
        submit_remote(tmp_path / 'nope.npz', server.url, ada, progress=False)


# ---------------------------------------------------------------- a class: 8 submitters x 5 submissions
def test_a_class_of_eight_concurrent_submitters(task, tmp_path):
    store = new_db(task, tmp_path, isolate=False)
    tokens = [store.issue_token(f'student{k}') for k in range(8)]
    blobs = {k: [variant(10 * k + j, tmp_path) for j in range(5)] for k in range(8)}
    shas = {hashlib.sha256(b).hexdigest() for bs in blobs.values() for b in bs}
    assert len(shas) == 40
    server = Serve(store.path)
    try:
        def student(k):
            got = []
            for b in blobs[k]:
                t0 = time.monotonic()
                status, body, _ = post(server.url, b, tokens[k])
                got.append((status, body, time.monotonic() - t0))
            # a sixth submission is over the rate limit of 5 a day: 429 with the time of the next one
            status, body, _ = post(server.url, variant(900 + k, tmp_path / f's{k}'), tokens[k])
            return got, (status, body)
        for k in range(8): (tmp_path / f's{k}').mkdir()
        with ThreadPoolExecutor(8) as ex: results = list(ex.map(student, range(8)))
        ids = []
        for got, (status, body) in results:
            assert [s for s, _, _ in got] == [202] * 5, [b for _, b, _ in got]
            ids += [b['id'] for _, b, _ in got]
            assert status == 429 and 'next submission is allowed at' in body['error']
        assert len(set(ids)) == 40
        # the server answers while the worker measures the queue: requests per second on GET /api/leaderboard
        wait_for(lambda: 'measuring' in statuses(store.path).values(), 30, 'a measurement to start')
        counts, errors, stop = [0] * 4, [], threading.Event()
        def reader(i):
            c = http.client.HTTPConnection('127.0.0.1', server.port, timeout=10)
            while not stop.is_set():
                c.request('GET', '/api/leaderboard')
                r = c.getresponse(); r.read()
                if r.status != 200: errors.append(r.status)
                counts[i] += 1
            c.close()
        measured = lambda: sum(v == 'measured' for v in statuses(store.path).values())
        before = measured()
        t0 = time.monotonic()
        threads = [threading.Thread(target=reader, args=(i,)) for i in range(4)]
        for t in threads: t.start()
        try: wait_for(lambda: measured() > before, 120, 'a job to finish while we read')   # not a timing test: however
        finally:                                                                           # slow the machine, the worker
            stop.set()                                                                     # keeps measuring while the
            for t in threads: t.join()                                                     # server answers
        read_s = time.monotonic() - t0
        rps = sum(counts) / read_s
        assert not errors and sum(counts) > 0
        # everything measured; nothing lost, nothing duplicated
        wait_for(lambda: set(statuses(store.path).values()) == {'measured'}, 120, 'all 40 measured', every=0.5)
        rows = store.query("SELECT s.id, s.sha256, s.created, s.started, s.finished, p.name FROM submissions s "
                           "JOIN participants p ON p.id = s.participant_id")
        assert sorted(r['id'] for r in rows) == sorted(ids) and {r['sha256'] for r in rows} == shas
        assert len(store.query("SELECT submission_id FROM measurements")) == 40
        board = request('GET', server.url + '/api/leaderboard')[1]
        assert sorted(r['name'] for r in board['tracks']['open']) == [f'student{k}' for k in range(8)]
        job = float(np.median([r['finished'] - r['started'] for r in rows]))
        waited = float(np.median([r['finished'] - r['created'] for r in rows]))
        upload = float(np.median([t for got, _ in results for _, _, t in got]))
        print(f"\nclass of 8 x 5: median upload+accept {upload * 1e3:.0f} ms, median job (claimed -> measured) "
              f"{job * 1e3:.0f} ms, median accepted -> measured {waited:.1f} s (queue of 40), GET /api/leaderboard "
              f"while measuring: {rps:.0f} requests/s ({sum(counts)} in {read_s:.1f} s, 4 clients)")
    finally: server.stop()


# ---------------------------------------------------------------- abuse (item 8): refused, nothing written
def test_every_abuse_case_is_refused_and_writes_nothing(task, tmp_path):
    store = new_db(task, tmp_path, rate_per_day=2, max_file_bytes=2 << 20)
    ada = store.issue_token('Ada')
    good = variant(7, tmp_path)
    man, arrays = parts(good, tmp_path)
    nan = dict(arrays); nan['0.weight'] = arrays['0.weight'].copy(); nan['0.weight'][0, 0, 1, 1] = np.nan
    unknown = copy.deepcopy(man); unknown['model']['children']['0']['type'] = 'EvilLayer'
    huge = copy.deepcopy(man); huge['arrays']['0.weight'] = {'shape': [100000, 100000], 'dtype': 'float32'}
    huge_file = craft(tmp_path, huge, arrays)
    with zipfile.ZipFile(tmp_path / 'crafted.npz') as zf: members = {i.filename: zf.read(i.filename) for i in zf.infolist()}
    members['0.weight.npy'] = npy_header((100000, 100000)) + b'\0' * 64
    with zipfile.ZipFile(tmp_path / 'huge.npz', 'w') as zf:
        for k, v in members.items(): zf.writestr(k, v)
    huge_file = (tmp_path / 'huge.npz').read_bytes()
    bomb = zip_bomb()
    assert len(bomb) < 2_000_000
    with zipfile.ZipFile(__import__('io').BytesIO(bomb)) as zf:          # it really holds 1.6 GB
        assert sum(i.file_size for i in zf.infolist()) > 1_600_000_000 and zf.testzip() is None
    obj = dict(arrays); obj['0.bias'] = np.array([{'evil': 1}] * 4, dtype=object)
    cases = {   # name: (body, token, headers, status, words in the reason)
        'no token': (good, None, {}, 401, 'missing token'),
        'wrong token': (good, 'x' * 43, {}, 401, 'unknown token'),
        'not a bearer token': (good, None, {'Authorization': f'Basic {ada}'}, 401, 'missing token'),
        'empty body': (b'', ada, {}, 400, 'empty'),
        'not a zip': (b'hello, I am a model', ada, {}, 422, 'not a zip'),
        'truncated': (good[:len(good) // 2], ada, {}, 422, 'not an acceptable'),
        'NaN weights': (craft(tmp_path, man, nan), ada, {}, 422, 'NaN'),
        'unknown layer type': (craft(tmp_path, unknown, arrays), ada, {}, 422, "'EvilLayer'"),
        'huge declared shape': (huge_file, ada, {}, 422, 'declare more than'),
        'a manifest field claiming a score': (craft(tmp_path, dict(man, score=99.9, accuracy=1.0), arrays), ada, {},
                                              422, 'unknown manifest fields'),
        'pickled object array': (craft(tmp_path, man, obj), ada, {}, 422, 'not an acceptable'),
        'zip bomb': (bomb, ada, {}, 422, 'more than the limit'),
        'the baseline itself': ((task / 'baseline.npz').read_bytes(), ada, {}, 409, 'baseline'),
    }
    with LeaderboardServer(store.path, worker=False) as server:
        before, beside = snapshot(store.path), files_beside(store.path)
        import tracemalloc
        for name, (body, token, headers, status, words) in cases.items():
            tracemalloc.start()                   # the server runs in a thread of this process: its allocations count
            try:
                got, answer, _ = post(server.url, body, token, headers=headers)
                peak = tracemalloc.get_traced_memory()[1]
            finally: tracemalloc.stop()
            assert peak < 32 << 20, (name, peak)  # the 1.6 GB zip bomb included: nothing array-sized was allocated
            assert got == status, (name, got, answer)
            assert words in answer['error'], (name, answer)
            assert snapshot(store.path) == before and files_beside(store.path) == beside, name
        # an oversized body is refused from its Content-Length before the body is sent at all (so a client that waits
        # for '100 Continue', as curl does, never sends it; `tinycomp submit` checks GET /api/info first) ...
        def raw(head: bytes, body: bytes = b'') -> bytes:
            with socket.create_connection(('127.0.0.1', server.port), timeout=10) as s:
                s.sendall(head + body)
                return s.recv(65536)
        head = (f"POST /api/submissions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ada}\r\n"
                f"Content-Length: {10 << 30}\r\n\r\n").encode()
        assert raw(head).startswith(b'HTTP/1.1 413')
        assert raw(head.replace(ada.encode(), b'wrong')).startswith(b'HTTP/1.1 401')     # and a bad token too
        # ... and a chunked body (no length) or a lying Content-Length is counted as it streams and cut at the cap
        chunk = b'%x\r\n%s\r\n' % (256 << 10, bytes(256 << 10))
        chunked = (f"POST /api/submissions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {ada}\r\n"
                   "Transfer-Encoding: chunked\r\n\r\n").encode()
        assert raw(chunked, chunk * 9).startswith(b'HTTP/1.1 413')                      # 2.25 MiB > 2 MiB
        assert raw(head.replace(b'Content-Length: %d' % (10 << 30), b'Content-Length: 1000'),
                   bytes(3 << 20)).startswith(b'HTTP/1.1 422')      # a lying length: only what it declares is read
        assert snapshot(store.path) == before
        # the rate limit (2 a day here), a duplicate and a closed competition
        assert post(server.url, good, ada)[0] == 202
        status, body, _ = post(server.url, good, ada)
        assert status == 409 and 'you already submitted this model as your entry #1' in body['error']
        assert post(server.url, variant(8, tmp_path), ada)[0] == 202
        before = snapshot(store.path)
        status, body, _ = post(server.url, variant(9, tmp_path), ada)
        assert status == 429 and re.search(r'next submission is allowed at \d{4}-\d\d-\d\d \d\d:\d\d UTC', body['error'])
        assert snapshot(store.path) == before
        store.close()
        before = snapshot(store.path)
        status, body, _ = post(server.url, variant(10, tmp_path), store.issue_token('Late'))
        assert status == 423 and 'closed' in body['error']
        assert request('GET', server.url + '/api/leaderboard')[0] == 200        # still serving after all that


# ---------------------------------------------------------------- SIGKILL the server and the worker, restart
def test_killing_the_server_or_the_worker_loses_nothing(task, tmp_path):
    store = new_db(task, tmp_path, rate_per_day=0, max_attempts=100)        # isolate: measured in a child process
    tokens = [store.issue_token('Ada'), store.issue_token('Bob')]
    blobs = [variant(200 + i, tmp_path) for i in range(8)]
    shas = [hashlib.sha256(b).hexdigest() for b in blobs]
    accepted, rng = {}, random.Random(16)
    def submit_all(url):
        for i, b in enumerate(blobs):
            if shas[i] in accepted: continue
            try: status, body, _ = post(url, b, tokens[i % 2], timeout=10)
            except OSError: continue                                  # the server died mid-request: try again later
            if status == 202: accepted[shas[i]] = body['id']
            elif status == 409: accepted[shas[i]] = int(re.search(r'entry #(\d+)', body['error']).group(1))
            else: raise AssertionError((status, body))
    server, kills, pending_at_kill = Serve(store.path), [], []
    try:
        for cycle in range(6):
            t = threading.Thread(target=submit_all, args=(server.url,))
            t.start()
            time.sleep(rng.uniform(0.2, 2.5))
            left = [s for s in statuses(store.path).values() if s in ('queued', 'measuring')]
            pending_at_kill.append(len(left))
            if cycle % 2 == 0:                                           # the server (its worker dies with it)
                port, orphan = server.port, server.worker_pid()
                server.kill()
                t.join()
                if orphan:                                               # the worker does not outlive its server
                    wait_for(lambda: not alive(orphan), 10, 'the orphan worker to die')
                kills.append(('server', len(left)))
                server = Serve(store.path, port=port)
            else:                                                        # the worker only: the server restarts it
                pid = wait_for(server.worker_pid, 10, 'the worker')
                os.kill(pid, signal.SIGKILL)
                kills.append(('worker', len(left)))
                t.join()
                wait_for(lambda: server.worker_pid() not in (None, pid), 30, 'the worker to be restarted')
        submit_all(server.url)
        assert len(accepted) == len(blobs)
        wait_for(lambda: set(statuses(store.path).values()) == {'measured'}, 90, 'every job measured', every=0.3)
    finally: server.stop()
    assert any(n > 0 for n in pending_at_kill), kills                   # at least one kill hit pending jobs
    rows = store.query("SELECT id, sha256, status, attempts FROM submissions ORDER BY id")
    assert sorted(r['sha256'] for r in rows) == sorted(shas)             # none lost, none twice
    assert {r['sha256']: r['id'] for r in rows} == accepted              # every 202 (or 409) points at its row
    con = sqlite3.connect(store.path)
    assert con.execute('PRAGMA integrity_check').fetchone()[0] == 'ok'
    assert con.execute('PRAGMA foreign_key_check').fetchall() == []
    assert con.execute("SELECT count(*) FROM measurements").fetchone()[0] == len(blobs)
    for (raw,) in con.execute("SELECT raw FROM measurements"): assert json.loads(raw)['results']
    con.close()
    from tinycomp.leaderboard.submissions import rescore
    assert rescore(store) == []                                          # every stored score re-derives from its samples
    print(f"\nkills: {kills}; attempts per job: {[r['attempts'] for r in rows]}")


# ---------------------------------------------------------------- the page in headless Chromium
def test_the_page_in_headless_chromium(task, tmp_path, chromium):
    from playwright.sync_api import sync_playwright
    from tinycomp.pruning.structured import prune_channels
    from tinycomp.quantization.models import quantize_static
    store = new_db(task, tmp_path, isolate=False)
    evil = '<script>alert("pwned")</script>'
    base = load_pretrained('digits_cnn')
    models = {'Ada': quantize_static(base, load_digits('train')[0][:256]),      # int8
              'Grace': prune_channels(base, 0.5, input_shape=(1, 1, 8, 8)),                              # half the channels
              evil: None}                                                      # nudged weights
    for k, (name, m) in enumerate(models.items()):
        blob = tio.save(m, tmp_path / f'{k}.npz').read_bytes() if m is not None else variant(300 + k, tmp_path)
        store.accept(store.issue_token(name), blob)
    store.accept(store.issue_token('Edsger'), variant(310, tmp_path))
    while measure_next(store) is not None: pass
    shots = tmp_path / 'screenshots'
    shots.mkdir()
    with LeaderboardServer(store.path, worker=False) as server, sync_playwright() as p:
        args = ['--no-sandbox'] if os.geteuid() == 0 else []           # Chromium refuses root without it
        browser = p.chromium.launch(executable_path=chromium, args=args)
        try:
            page = browser.new_page(viewport={'width': 1200, 'height': 900})
            dialogs = []
            page.on('dialog', lambda d: (dialogs.append(d.message), d.dismiss()))
            assert page.goto(server.url + '/').status == 200
            text = page.inner_text('body')
            for name in ('Ada', 'Grace', 'Edsger', evil): assert name in text, name   # the script name shown as text
            assert page.evaluate('document.scripts.length') == 0 and not dialogs
            assert page.locator('table').count() >= 2 and page.locator('svg').count() >= 1
            page.screenshot(path=str(shots / 'leaderboard.png'), full_page=True)
            phone = browser.new_page(viewport={'width': 390, 'height': 844}, is_mobile=True)
            phone.goto(server.url + '/')
            width = phone.evaluate('document.documentElement.scrollWidth')
            assert width <= 400, width                                   # no sideways scrolling of the page itself
            phone.screenshot(path=str(shots / 'leaderboard-phone.png'), full_page=True)
        finally: browser.close()
    assert (shots / 'leaderboard.png').stat().st_size > 10_000
    copy_to = os.environ.get('TINYCOMP_LEADERBOARD_SCREENSHOT')         # for a person to look at
    if copy_to:
        shutil.copy(shots / 'leaderboard.png', copy_to)
        shutil.copy(shots / 'leaderboard-phone.png', Path(copy_to).with_name(Path(copy_to).stem + '-phone.png'))


def test_an_entry_read_by_anyone_but_its_owner_hides_the_instructors_words(task, tmp_path):
    from tinycomp.leaderboard.app import LeaderboardServer
    store = new_db(task, tmp_path)
    ada, bob = store.issue_token('Ada'), store.issue_token('Bob')
    sid = store.accept(ada, variant(1, tmp_path))['id']
    store.remove(sid, "copied from Bob's notebook")
    with LeaderboardServer(store.path, worker=False) as server:
        url = f"{server.url}/api/submissions/{sid}"
        for token in (None, bob):
            status, body, _ = request('GET', url, token=token)
            assert status == 200 and body['reason'] == 'removed by the instructor'
            assert not {'actions', 'sha256', 'model_sha256'} & set(body)
        status, body, _ = request('GET', url, token=ada)
        assert body['reason'] == "removed by the instructor: copied from Bob's notebook" and body['sha256']
        assert [a['reason'] for a in body['actions']] == ["copied from Bob's notebook"]
