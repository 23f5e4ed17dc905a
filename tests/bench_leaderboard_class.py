"""Benchmark (not collected by pytest): a class of 8 simulated participants x 5 submissions on loopback against
`tinycomp leaderboard serve` with the default task and settings (digits test split, digits_cnn baseline, 20 rounds of
5 calls, each job in its own process, after the server's calibration of six jobs). Prints the time per submission and the requests per second the server sustains
while a measurement runs. Run from the repository: `python tests/bench_leaderboard_class.py` (about a minute)."""
import http.client, sys, tempfile, threading, time, statistics
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parent))
import test_leaderboard_server as T
from tinycomp.leaderboard.store import open_store

def rps(port, seconds=2.0, clients=4, path='/api/leaderboard'):
    counts, stop, bad = [0] * clients, threading.Event(), []
    def reader(i):
        c = http.client.HTTPConnection('127.0.0.1', port, timeout=10)
        while not stop.is_set():
            c.request('GET', path); r = c.getresponse(); r.read()
            if r.status != 200: bad.append(r.status)
            counts[i] += 1
    ts = [threading.Thread(target=reader, args=(i,)) for i in range(clients)]
    t0 = time.monotonic(); [t.start() for t in ts]; time.sleep(seconds); stop.set(); [t.join() for t in ts]
    assert not bad, bad
    return sum(counts) / (time.monotonic() - t0)

if __name__ == '__main__':
    d = Path(tempfile.mkdtemp(prefix='tinycomp-class-'))
    store = open_store(d / 'lb.db', create=True)
    print(store.init(), store.settings)
    tokens = [store.issue_token(f'student{k}') for k in range(8)]
    blobs = {k: [T.variant(10 * k + j, d) for j in range(5)] for k in range(8)}
    server = T.Serve(store.path)
    try:
        idle = rps(server.port)
        print(f"idle GET /api/leaderboard: {idle:.0f} req/s; GET /: {rps(server.port, path='/'):.0f} req/s")
        t0 = time.monotonic()
        def student(k): return [T.post(server.url, b, tokens[k])[0] for b in blobs[k]]
        with ThreadPoolExecutor(8) as ex: codes = list(ex.map(student, range(8)))
        print('statuses', codes, f'all 40 accepted in {time.monotonic() - t0:.2f} s')
        busy = []
        while True:
            st = T.statuses(store.path)
            if set(st.values()) <= {'measured', 'failed'}: break
            if 'measuring' in st.values(): busy.append(rps(server.port, 2.0))
            else: time.sleep(0.2)
        wall = time.monotonic() - t0
        rows = store.query("SELECT created, started, finished, status, sha256 FROM submissions")
        job = statistics.median(r['finished'] - r['started'] for r in rows)
        wait = statistics.median(r['finished'] - r['created'] for r in rows)
        print(f"measured {sum(r['status'] == 'measured' for r in rows)}/40, distinct files {len({r['sha256'] for r in rows})}; "
              f"wall {wall:.1f} s; median job (claimed -> measured) {job:.2f} s; median accepted -> measured {wait:.1f} s "
              f"(queue of 40); GET /api/leaderboard while measuring: median {statistics.median(busy):.0f} req/s over "
              f"{len(busy)} 2-s windows (min {min(busy):.0f}, max {max(busy):.0f}); idle {idle:.0f} req/s")
        cal = store.calibration
        print(f"calibration before the first job: {cal['jobs']} jobs in {cal['seconds']:.0f} s, job noise {cal['job_noise']:.1%}")
        ranked = store.leaderboard()['tracks']['closed']
        print(f"closed track: {len(ranked)} ranked, places {sorted({tuple(r['band']) for r in ranked})}")
        print(f"after: GET /api/leaderboard with 40 entries {rps(server.port):.0f} req/s, GET / {rps(server.port, path='/'):.0f} req/s")
    finally: server.stop()
