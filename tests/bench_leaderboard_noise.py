"""Benchmark (not collected by pytest): can measurement noise order a class? Eleven participants submit one model
(the int8 version of digits_cnn_wide, each file saved with its own metadata) and five submit another (the int8
version of digits_cnn), on the shipped digits task with the default settings: every job in its own process, after the
server's calibration of the noise between jobs. Prints each entry's score, its 95 % interval and the places it may
take, then the interval widths and the bands of each group (the goal: one band per group). Run from the repository:
`python tests/bench_leaderboard_noise.py` (about two minutes)."""
import statistics, sys, tempfile, time
from pathlib import Path

from tinycomp import io as tio
from tinycomp.data import load_shipped
from tinycomp.models import load_pretrained
from tinycomp.quantization import quantize_static
from tinycomp.leaderboard.store import open_store
from tinycomp.leaderboard.calibration import calibrate
from tinycomp.leaderboard.worker import measure_next
from tinycomp.leaderboard import submissions  # noqa: F401

if __name__ == '__main__':                    # the measuring child processes import this file again
    d = Path(tempfile.mkdtemp(prefix='tinycomp-noise-'))
    store = open_store(d / 'lb.db', create=True)
    print(store.init(rate_per_day=0))
    s = store.settings
    print(f"settings: {s['rounds']} rounds x {s['calls']} calls at batch sizes {s['batch_sizes']}, "
          f"{s['calibration_jobs']} calibration jobs")
    t0 = time.monotonic()
    cal = calibrate(store)
    print(f"calibration: {cal['pair']}; speedups {[round(v, 3) for v in cal['speedups']]}; job noise "
          f"{cal['job_noise']:.1%} of the log speedup; {time.monotonic() - t0:.0f} s")
    X, _ = load_shipped('digits', 'train')
    models = {'wide int8': quantize_static(load_pretrained('digits_cnn_wide'), X[:64]),
              'cnn int8': quantize_static(load_pretrained('digits_cnn'), X[:64])}
    groups = {'wide int8': [], 'cnn int8': []}
    for g, n in (('wide int8', 11), ('cnn int8', 5)):
        for k in range(n):
            name = f"{g.split()[0]}{k + 1:02d}"
            data = tio.save(models[g], d / f'{name}.npz', metadata={'author': name, 'note': f'copy {k}'}).read_bytes()
            groups[g].append(store.accept(store.issue_token(name), data)['id'])
    t0, seconds = time.monotonic(), []
    while (sid := measure_next(store)) is not None:
        seconds.append(store.query("SELECT seconds FROM measurements WHERE submission_id = ?", (sid,))[0]['seconds'])
    print(f"{len(seconds)} jobs in {time.monotonic() - t0:.0f} s: {statistics.median(seconds):.1f} s each (median), "
          f"{max(seconds):.1f} s at most")
    rows = {r['id']: r for r in store.leaderboard()['tracks']['closed']}
    for g, ids in groups.items():
        print(f"\n{g}: {len(ids)} entries of one model")
        widths = []
        for i in ids:
            r = rows[i]
            lo, hi = r['score_ci']
            widths.append((hi - lo) / r['score'])
            print(f"  #{i:2d} {r['name']}: score {r['score']:.3f} [{lo:.3f}, {hi:.3f}] (width {widths[-1]:.1%}), "
                  f"places {r['band'][0]}-{r['band'][1]}{' tied' if r['tied'] else ''}")
        scores = [rows[i]['score'] for i in ids]
        print(f"  scores {min(scores):.3f}-{max(scores):.3f} (spread {(max(scores) - min(scores)) / min(scores):.1%}); "
              f"interval widths: median {statistics.median(widths):.1%}, {min(widths):.1%}-{max(widths):.1%}")
        bands = {tuple(rows[i]['band']) for i in ids}
        tied = max(rows[i]['score_ci'][0] for i in ids) <= min(rows[i]['score_ci'][1] for i in ids)
        print(f"  bands: {sorted(bands)}; every interval of the group overlaps every other: {tied}")
    sys.exit(0)
