"""tinycomp.leaderboard (scoring, validation, store, submissions, worker, page, cli): scoring, ranking, the store,
acceptance and limits, the worker, the page, the CLI."""
import copy
import io
import json
import math
import os
import sqlite3
import subprocess
import sys
import threading
import time
import zipfile
from pathlib import Path

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.cli import main
from tinycomp.data import load_digits
from tinycomp.errors import TinycompError
import tinycomp.leaderboard as lb
from tinycomp.leaderboard import cli as lb_cli, store as lb_store
from tinycomp.leaderboard.scoring import entry_metrics, log_speedup, rank_entries, synthetic_measurement
from tinycomp.leaderboard.submissions import DAY
from tinycomp.leaderboard.validation import SubmissionRejected
from tinycomp.models import load_pretrained, pretrained_path
from tinycomp.nn.modules import Linear, Sequential, Flatten

Y = np.arange(200) % 10
ALL = np.ones(200, bool)


def wrong(n, y=Y):
    p = y.copy()
    p[:n] = (p[:n] + 1) % 10
    return p


# ---------------------------------------------------------------- scoring (pure functions of stored measurements)
def test_entry_metrics_by_hand():
    m = entry_metrics(synthetic_measurement(Y, Y, base_ms=(2, 8), sub_ms=(1, 2), base_bytes=4000, sub_bytes=1000), Y, ALL)
    assert m['speedup_at'] == {1: 2.0, 64: 4.0}
    assert math.isclose(m['speedup'], math.sqrt(8)) and m['compression'] == 4.0
    assert math.isclose(m['score'], math.sqrt(math.sqrt(8) * 4))
    assert m['accuracy'] == 1.0 and m['dacc_points'] == 0.0 and m['gate'] == 'passed' and m['flags'] == []
    assert m['latency_ms'] == {1: 1.0, 64: 2.0} and m['file_bytes'] == 1000 and m['n'] == 200
    lo, hi = m['accuracy_ci']
    assert lo < 1.0 and hi == pytest.approx(1.0)


def test_medians_not_means_of_the_samples():
    raw = synthetic_measurement(Y, Y)
    raw['results']['submission']['latency']['1']['samples_s'] = [1e-3, 1e-3, 1e-3, 1e-3, 1.0]   # one outlier
    assert entry_metrics(raw, Y, ALL)['speedup_at'][1] == pytest.approx(2.0)


def test_gate_one_point_and_significance():
    def gate(n_wrong, base_wrong=0):
        return entry_metrics(synthetic_measurement(wrong(base_wrong), wrong(n_wrong)), Y, ALL)['gate']
    assert gate(2) == 'passed'                              # exactly -1 point on 200 samples
    assert gate(3) == 'passed (drop not significant)'       # -1.5 points, McNemar p = 0.25
    assert gate(12) == 'failed'                             # -6 points, p < 0.05
    assert gate(12, base_wrong=10) == 'passed'              # -1 point against a weaker baseline
    m = entry_metrics(synthetic_measurement(Y, wrong(12)), Y, ALL)
    assert m['p_value'] < lb.GATE_P and m['dacc_points'] == pytest.approx(-6.0)


def test_compliance_and_plausibility_flags():
    f = entry_metrics(synthetic_measurement(Y, Y, passed=False, repeat_ratio=3.0), Y, ALL)['flags']
    assert len(f) == 1 and f[0].startswith('failed compliance') and '3.00x slower' in f[0]
    assert entry_metrics(synthetic_measurement(Y, Y, sub_ms=(2 / 51, 2)), Y, ALL)['flags'] == [
        'under investigation: speedup 51.0x at batch size 1 above the plausibility limits (50x speedup, 32x compression)']
    assert entry_metrics(synthetic_measurement(Y, Y, sub_ms=(2 / 49, 8 / 49)), Y, ALL)['flags'] == []
    assert entry_metrics(synthetic_measurement(Y, Y, sub_bytes=4000 / 33), Y, ALL)['flags'][0].startswith('under investigation')
    assert entry_metrics(synthetic_measurement(Y, Y, sub_bytes=4000 / 31), Y, ALL)['flags'] == []


def test_public_and_private_parts_use_their_own_samples():
    sub = Y.copy()
    sub[100:110] = (sub[100:110] + 1) % 10                  # wrong only in the second half
    first = np.arange(200) < 100
    raw = synthetic_measurement(Y, sub)
    assert entry_metrics(raw, Y, first)['accuracy'] == 1.0
    assert entry_metrics(raw, Y, ~first)['accuracy'] == 0.9 and entry_metrics(raw, Y, ~first)['n'] == 100
    with pytest.raises(TinycompError, match='empty'):
        entry_metrics(raw, Y, np.zeros(200, bool))


# ---------------------------------------------------------------- ranking
def entry(i, who, n_wrong=0, ms=(1, 2), size=1000, created=None, **kw):
    m = entry_metrics(synthetic_measurement(Y, wrong(n_wrong), sub_ms=ms, sub_bytes=size, **kw), Y, ALL)
    return dict(m, id=i, participant_id=who, name=f'p{who}', created=created if created is not None else i)


def test_closed_ranking_order_and_bands():
    es = [entry(1, 1, 0, created=5), entry(2, 2, 0, created=3),          # the same score and accuracy: earlier first
          entry(3, 3, 2, created=1),                                       # the same score, lower accuracy
          entry(4, 4, 0, ms=(0.5, 1), created=9)]                          # faster: first
    r = rank_entries(es)['closed']
    assert [(e['id'], e['rank'], e['band'], e['tied']) for e in r] == \
        [(4, 1, [1, 1], False), (2, 2, [2, 4], True), (1, 2, [2, 4], True), (3, 2, [2, 4], True)]
    assert r[0]['why'].startswith('first') and r[1]['why'].startswith('tied for places 2–4')


def test_overlapping_intervals_tie_and_separate_ones_do_not():
    a, b, c = entry(1, 1, created=1), entry(2, 2, created=2), entry(3, 3, created=3)
    a['score'], a['score_ci'] = 2.10, [2.00, 2.20]
    b['score'], b['score_ci'] = 2.05, [1.95, 2.15]                         # overlaps a: tied with it
    c['score'], c['score_ci'] = 1.80, [1.70, 1.90]                         # wholly below both: third
    r = rank_entries([c, b, a])['closed']
    assert [(e['id'], e['band']) for e in r] == [(1, [1, 2]), (2, [1, 2]), (3, [3, 3])]
    assert r[2]['why'] == 'place 3: the score intervals of 2 entries lie wholly above its own'
    c['score_ci'] = [1.70, 1.97]                                            # now overlaps b but not a
    r = rank_entries([c, b, a])['closed']
    assert [(e['id'], e['band']) for e in r] == [(1, [1, 2]), (2, [1, 3]), (3, [2, 3])]


def test_intervals_widen_with_the_job_noise():
    raw = synthetic_measurement(Y, Y, jitter=0.05, rounds=20, calls=5)
    alone, noisy = entry_metrics(raw, Y, ALL), entry_metrics(raw, Y, ALL, job_noise=0.05)
    assert alone['score_ci'][0] < alone['score'] < alone['score_ci'][1]
    assert noisy['score'] == alone['score'] and noisy['score_ci'][0] < alone['score_ci'][0]
    assert entry_metrics(raw, Y, ALL) == alone                              # a fixed seed: the same interval every time
    # the score's interval is half the speedup's on the log scale (the size has no noise)
    lo, hi = noisy['speedup_ci']
    assert math.log(noisy['score_ci'][1] / noisy['score_ci'][0]) == pytest.approx(math.log(hi / lo) / 2)


def test_best_entry_per_participant_and_history_kept():
    es = [entry(1, 1, 0, ms=(1, 2)), entry(2, 1, 0, ms=(0.5, 1)), entry(3, 1, 0, ms=(2, 4)), entry(4, 2, 0)]
    r = rank_entries(es)
    assert [e['id'] for e in r['closed']] == [2, 4]
    assert sorted(e['id'] for e in r['open']) == [2, 4]
    assert len(es) == 4 and 'rank' not in es[0]                             # inputs untouched


def test_flagged_and_gated_entries():
    es = [entry(1, 1, 12, ms=(0.5, 1)),                                     # fails the gate: open track only
          entry(2, 2, 0, passed=False),                                     # compliance: nowhere
          entry(3, 3, 0, ms=(0.01, 0.01)),                                  # implausible: nowhere
          entry(4, 4, 0)]
    r = rank_entries(es)
    assert [e['id'] for e in r['closed']] == [4]
    assert sorted(e['id'] for e in r['open']) == [4]                      # below the open track's floor too
    assert sorted(e['id'] for e in r['unranked']) == [2, 3]
    assert 'below the accuracy floor' in r['standing'][1] and r['standing'][2].startswith('not ranked: failed compliance')
    assert sorted(e['id'] for e in rank_entries(es, open_min_accuracy=0.5)['open']) == [1, 4]   # an instructor's lower floor


def test_a_random_model_never_ranks_on_the_open_track():
    junk = entry(9, 9, 180, ms=(0.1, 0.2), size=200)                     # 10 % accuracy, fast and small
    es = [entry(1, 1, 0), entry(2, 2, 1, ms=(0.8, 1.5)), junk]
    r = rank_entries(es)
    assert 9 not in [e['id'] for e in r['open']] and all(e['on_front'] for e in r['open'])
    assert r['standing'][9].startswith('closed track: fails the accuracy gate')


def test_each_open_entry_says_why_it_ranks_there_and_others_who_stands_for_them():
    es = [entry(1, 1, 0, ms=(1, 2), size=1000), entry(2, 2, 0, ms=(1, 2), size=2000),    # 2: dominated by 1 on size
          entry(3, 1, 0, ms=(2, 4), size=1000)]                                         # p1's slower entry
    r = rank_entries(es)
    why = {e['id']: e['why'] for e in r['open']}
    assert why[1].startswith('on the Pareto front')
    assert why[2] == "dominated by p1's entry #1: as good or better on all three, better on size"
    assert r['standing'] == {3: 'closed track: your entry #1 stands for you (score 3.364 against 2.378); open track: your '
                                'entry #1 stands for you (its Pareto rank is better, or equal with higher accuracy or an '
                                'earlier submission)'}


def test_the_baseline_row():
    es = [entry(1, 1, 0), entry(2, 2, 0, base_ms=(4.0, 8.0)), entry(3, 3, 0, base_ms=(3.0, 6.0))]
    row = lb.baseline_row(es, 'digits_cnn')
    assert row['latency_ms'] == {1: 3.0, 64: 8.0} and row['file_bytes'] == 4000 and row['accuracy'] == 1.0
    assert row['baseline'] and row['score'] == row['speedup'] == row['compression'] == 1.0
    assert lb.baseline_row([], 'digits_cnn') == dict(name='digits_cnn', baseline=True, speedup=1.0, compression=1.0,
                                                    score=1.0, rel_latency=1.0)


def test_pareto_ranks_by_non_dominated_sorting():
    pts = [[0.9, 1.0, 100], [0.95, 2.0, 100], [0.9, 2.0, 200], [0.8, 3.0, 300], [0.95, 2.0, 100]]
    assert lb.pareto_ranks(pts, [True, False, False]).tolist() == [1, 1, 2, 3, 1]    # duplicates share the front


def test_open_track_pareto_marks_and_order():
    es = [entry(1, 1, 0, ms=(1, 2), size=1000), entry(2, 2, 2, ms=(0.5, 2), size=1000),    # faster, less accurate
          entry(3, 3, 0, ms=(1, 2), size=2000),                                            # dominated by 1
          entry(4, 4, 0, ms=(1, 2), size=1000, created=0)]                                  # equals 1, earlier
    o = rank_entries(es)['open']
    assert [(e['id'], e['pareto_rank'], e['on_front'], e['rank']) for e in o] == \
        [(4, 1, True, 1), (1, 1, True, 2), (2, 1, True, 3), (3, 2, False, 4)]
    # relative latency is the batch-1 speedup's inverse: a slower baseline in another job makes an entry look faster
    e = entry(5, 5, 0, ms=(1, 2))
    e2 = dict(entry_metrics(synthetic_measurement(Y, Y, base_ms=(4, 8), sub_ms=(1, 2)), Y, ALL), id=6, participant_id=6,
              name='p6', created=6)
    assert [x['id'] for x in rank_entries([e, e2])['open'] if x['on_front']] == [6]


# ---------------------------------------------------------------- fixtures: a small task and a few models
@pytest.fixture(scope='module')
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp('lbfiles')
    X, y = load_digits('test')
    np.savez(d / 'task.npz', X=X[:64], y=y[:64])
    base = load_pretrained('digits_cnn')
    from tinycomp.benchmarking.stages import make_context, run_stage
    ctx = make_context(base)
    int8 = run_stage('quantize_static', base, {}, ctx)
    out = dict(dir=d, task=d / 'task.npz', baseline=pretrained_path('digits_cnn'))
    out['int8'] = tio.save(int8, d / 'int8.npz')
    for i in range(3):                                      # three more models: the baseline nudged, then quantized
        out[f'int8_{i}'] = tio.save(run_stage('quantize_static', nudged(base, i + 1), {}, ctx), d / f'int8_{i}.npz')
    out['float'] = tio.save(nudged(base, 10), d / 'float.npz', metadata={'copy': 'float'})   # not the baseline itself
    return out


def nudged(model, k):
    "A copy of `model` with its first weight scaled by 1 - k/1000: another model, as accurate."
    m = copy.deepcopy(model)
    w = next(iter(m.parameters()))
    w.data = w.data * np.float32(1 - k / 1000)
    return m


def make_store(tmp_path, files, **settings):
    s = lb.open_store(tmp_path / 'lb.db', create=True)
    s.init(dict(name='digits64', data_npz=files['task'], baseline=files['baseline']),
           **dict(dict(rounds=2, calls=1, isolate=False), **settings))
    return s


def count(store, table='submissions'):
    return store.query(f"SELECT COUNT(*) AS n FROM {table}")[0]['n']


# ---------------------------------------------------------------- the store
def test_store_is_wal_versioned_and_migrates(tmp_path):
    s = lb.open_store(tmp_path / 'a.db', create=True)
    assert s.query('PRAGMA journal_mode')[0]['journal_mode'] == 'wal'
    assert s.query('PRAGMA foreign_keys')[0]['foreign_keys'] == 1
    assert int(s._meta('schema_version')) == lb.SCHEMA_VERSION == len(lb.MIGRATIONS)
    s.disconnect()
    c = sqlite3.connect(tmp_path / 'old.db', isolation_level=None)   # a store left at schema version 1
    lb_store._migrate(c, 'old.db', upto=1)
    assert not c.execute("SELECT name FROM sqlite_master WHERE name = 'submissions_by_participant'").fetchall()
    c.close()
    s = lb.open_store(tmp_path / 'old.db')
    assert int(s._meta('schema_version')) == lb.SCHEMA_VERSION
    assert s.query("SELECT name FROM sqlite_master WHERE name = 'submissions_by_participant'")
    with s.tx() as c: c.execute("UPDATE meta SET value = '99' WHERE key = 'schema_version'")
    s.disconnect()
    with pytest.raises(TinycompError, match='newer than this tinycomp'):
        lb.open_store(tmp_path / 'old.db')
    with pytest.raises(TinycompError, match='leaderboard init'):
        lb.open_store(tmp_path / 'missing.db')
    (tmp_path / 'junk.db').write_bytes(b'not sqlite' * 100)
    with pytest.raises(TinycompError, match='not a usable leaderboard database'):
        lb.open_store(tmp_path / 'junk.db')


def test_a_failed_transaction_writes_nothing(tmp_path, files):
    s = make_store(tmp_path, files)
    with pytest.raises(RuntimeError):
        with s.tx() as c:
            c.execute("INSERT INTO participants (name, token_sha256, created) VALUES ('x', 'h', 0)")
            raise RuntimeError('crash in the middle')
    assert count(s, 'participants') == 0


def test_init_default_task_and_split(tmp_path):
    s = lb.open_store(tmp_path / 'd.db', create=True)
    info = s.init()
    X, y = load_digits('test')
    assert info['name'] == 'digits' and info['samples'] == len(y) and info['public'] + info['private'] == len(y)
    t = s.task()
    assert np.array_equal(t['labels'], y) and t['baseline'] == pretrained_path('digits_cnn').read_bytes()
    for c in range(10):                                    # stratified: about half of every class is private
        n = (y == c).sum()
        assert abs(int(t['private'][y == c].sum()) - n / 2) <= 1
    assert np.array_equal(lb_store._private_mask(y), t['private'])        # fixed seed: the same split every time
    with pytest.raises(TinycompError, match='already has a task'):
        s.init()


def test_init_refuses_bad_task_data(tmp_path, files):
    s = lb.open_store(tmp_path / 'e.db', create=True)
    np.savez(tmp_path / 'bad.npz', X=np.zeros((5, 1, 8, 8)), y=np.zeros(4, np.int64))
    with pytest.raises(TinycompError, match='same length'):
        s.init(dict(data_npz=tmp_path / 'bad.npz', baseline=files['baseline']))
    np.savez(tmp_path / 'nan.npz', X=np.full((5, 1, 8, 8), np.nan), y=np.zeros(5, np.int64))
    with pytest.raises(TinycompError, match='NaN'):
        s.init(dict(data_npz=tmp_path / 'nan.npz', baseline=files['baseline']))
    with pytest.raises(TinycompError, match='needs a baseline'):
        s.init(dict(data_npz=files['task']))
    with pytest.raises(TinycompError, match='unknown leaderboard settings'):
        s.init(dict(data_npz=files['task'], baseline=files['baseline']), rate=3)
    with pytest.raises(TinycompError, match='rounds >= 2'):
        s.init(dict(data_npz=files['task'], baseline=files['baseline']), rounds=1)
    assert count(s, 'tasks') == 0


def test_tokens_are_random_and_only_their_hash_is_stored(tmp_path, files):
    s = make_store(tmp_path, files)
    t1, t2 = s.issue_token('ann'), s.issue_token('ben')
    assert t1 != t2 and len(t1) >= 40
    assert s.participant(t1)['name'] == 'ann' and s.participant(t2)['name'] == 'ben'
    assert s.participant('') is None and s.participant(None) is None and s.participant(t1 + 'x') is None
    s.disconnect()
    for f in tmp_path.glob('lb.db*'):
        assert t1.encode() not in f.read_bytes()
    with pytest.raises(TinycompError, match='already exists'):
        s.issue_token('ANN')
    for bad in ('', '   ', 'x' * 41, 'a\x00b'):
        with pytest.raises(TinycompError, match='display name'):
            s.issue_token(bad)


# ---------------------------------------------------------------- acceptance
def test_accept_queues_and_every_refusal_writes_nothing(tmp_path, files, monkeypatch):
    s = make_store(tmp_path, files, rate_per_day=0)
    tok = s.issue_token('ann')
    data = files['int8'].read_bytes()
    before = (count(s), count(s, 'files'))

    def refused(status, match, token, blob):
        with pytest.raises(SubmissionRejected, match=match) as e:
            s.accept(token, blob)
        assert e.value.status == status and (count(s), count(s, 'files')) == before
    refused(401, 'unknown token', 'nope', data)
    refused(401, 'unknown token', '', data)
    refused(409, "task's baseline", tok, files['baseline'].read_bytes())
    refused(422, 'not an acceptable tinycomp model file', tok, b'hello')
    refused(422, r'made for the mnist5k data \(1x28x28 inputs\), but this task.s inputs are 1x8x8', tok,
            pretrained_path('resnet8').read_bytes())
    torch_zip = io.BytesIO()
    with zipfile.ZipFile(torch_zip, 'w') as zf: zf.writestr('model/data.pkl', b'\x80\x02}q\x00.')
    refused(422, r'looks like a PyTorch file, not a tinycomp model file: convert it first with `tinycomp import`',
            tok, torch_zip.getvalue())
    s.configure(max_file_bytes=1000)
    refused(413, 'more than the limit of 1,000', tok, data)
    s.configure(max_file_bytes=16 << 20)
    sub = s.accept(tok, data)
    assert sub['status'] == 'queued' and sub['name'] == 'ann' and sub['file_bytes'] == len(data) and sub['kind'] == 'quantized'
    assert s.query("SELECT sha256 FROM files WHERE size = ?", (len(data),))[0]['sha256'] == sub['sha256']
    before = (count(s), count(s, 'files'))
    refused(409, f"you already submitted this model as your entry #{sub['id']}", tok, data)
    other = s.issue_token('ben')
    assert s.accept(other, data)['name'] == 'ben'           # someone else's copy of the same file: their own entry


def hostile(tmp_path, files, name, edit_manifest=None, edit_arrays=None):
    "A copy of the float model file with its manifest and/or arrays edited."
    with np.load(files['float'], allow_pickle=False) as f:
        arrays = {k: f[k] for k in f.files}
    man = json.loads(arrays.pop('__manifest__').tobytes())
    if edit_manifest: edit_manifest(man)
    if edit_arrays: edit_arrays(arrays)
    p = tmp_path / name
    np.savez(p, __manifest__=np.frombuffer(json.dumps(man).encode(), np.uint8), **arrays)
    return p.read_bytes()


def test_hostile_and_over_limit_files_get_422(tmp_path, files):
    s = make_store(tmp_path, files, rate_per_day=0)
    tok = s.issue_token('ann')
    first = next(k for k in np.load(files['float']).files if k.endswith('weight'))

    def nan(a): a[first] = a[first].copy(); a[first].flat[0] = np.nan
    def unknown(m): m['model']['children']['0']['type'] = 'EvilLayer'
    def claim(m): m['score'] = 99.9
    cases = {'nan': (None, nan, 'NaN'), 'unknown': (unknown, None, 'not in the allow-list'),
             'claim': (claim, None, "unknown manifest fields \\['score'\\]")}
    for name, (em, ea, match) in cases.items():
        with pytest.raises(SubmissionRejected, match=match) as e:
            s.accept(tok, hostile(tmp_path, files, name + '.npz', em, ea))
        assert e.value.status == 422 and str(tmp_path) not in e.value.reason
    # a valid file that unpacks to far more than it weighs: refused from the zip directory
    m = Sequential(Flatten(), Linear(64, 3000), Linear(3000, 10))
    for p in m.parameters(): p.data[...] = 0
    raw = tio.save(m, tmp_path / 'big_raw.npz')
    with zipfile.ZipFile(raw) as src, zipfile.ZipFile(tmp_path / 'bomb.npz', 'w', zipfile.ZIP_DEFLATED) as dst:
        for i in src.infolist(): dst.writestr(i.filename, src.read(i.filename))
    s.configure(max_unpacked_bytes=100_000)
    with pytest.raises(SubmissionRejected, match='zip directory declares .* more than the limit of 100,000') as e:
        s.accept(tok, (tmp_path / 'bomb.npz').read_bytes())
    assert e.value.status == 422
    s.configure(max_unpacked_bytes=64 << 20, max_params=100_000)
    with pytest.raises(SubmissionRejected, match='225,010 parameters, more than the limit of 100,000'):
        s.accept(tok, (tmp_path / 'bomb.npz').read_bytes())
    s.configure(max_params=1_000_000, max_flops=1000)
    with pytest.raises(SubmissionRejected, match='FLOPs per sample, more than the limit of 1,000'):
        s.accept(tok, (tmp_path / 'bomb.npz').read_bytes())
    s.configure(max_flops=10 ** 9)
    small = tio.save(Sequential(Flatten(), Linear(64, 5)), tmp_path / 'five.npz').read_bytes()
    with pytest.raises(SubmissionRejected, match='10 finite class scores'):
        s.accept(tok, small)
    wrong_input = tio.save(Sequential(Flatten(), Linear(32, 10)), tmp_path / 'w.npz').read_bytes()
    with pytest.raises(SubmissionRejected, match='fails on one input of shape \\(1, 1, 8, 8\\)'):
        s.accept(tok, wrong_input)
    assert count(s) == 0 and count(s, 'files') == 1       # only the baseline


def test_rate_limit_says_when_the_next_submission_is_allowed(tmp_path, files):
    s = make_store(tmp_path, files, rate_per_day=2)
    tok = s.issue_token('ann')
    t0 = 1_700_000_000.0
    s.accept(tok, files['int8_0'].read_bytes(), now=t0)
    s.accept(tok, files['int8_1'].read_bytes(), now=t0 + 3600)
    with pytest.raises(SubmissionRejected) as e:
        s.accept(tok, files['int8_2'].read_bytes(), now=t0 + 7200)
    assert e.value.status == 429 and 'at most 2 submissions in 24 hours' in e.value.reason
    assert lb_store._iso(t0 + DAY) in e.value.reason and 'in 22 h 0 min' in e.value.reason and count(s) == 2
    other = s.issue_token('ben')                                          # per participant
    s.accept(other, files['int8_2'].read_bytes(), now=t0 + 7200)
    assert count(s) == 3
    s.accept(tok, files['float'].read_bytes(), now=t0 + DAY + 1)       # a day after the first: allowed again
    assert count(s) == 4


def test_concurrent_acceptance_never_refuses_a_valid_file(tmp_path, files):
    "CPython gh-106905: .npy header parsing in parallel threads once raised SystemError; validation holds a lock."
    s = make_store(tmp_path, files, rate_per_day=0)
    models = [nudged(load_pretrained('digits_cnn'), j + 1) for j in range(5)]
    blobs = []
    for i in range(40):                                     # each participant sends five models, classmates the same ones
        tio.save(models[i % 5], tmp_path / 'c.npz', metadata={'i': i})
        blobs.append((tmp_path / 'c.npz').read_bytes())
    tokens = [s.issue_token(f'user{i}') for i in range(8)]
    errors, ids = [], []
    def submitter(k):
        try:
            for j in range(5): ids.append(s.accept(tokens[k], blobs[5 * k + j])['id'])
        except Exception as e: errors.append(repr(e))
    threads = [threading.Thread(target=submitter, args=(k,)) for k in range(8)]
    for t in threads: t.start()
    for t in threads: t.join()
    assert errors == [] and sorted(ids) == list(range(1, 41)) and count(s) == 40


def test_metadata_claiming_a_score_is_never_used(tmp_path, files):
    s = make_store(tmp_path, files)
    tok = s.issue_token('eve')
    tio.save(tio.load(files['int8']), tmp_path / 'claim.npz', metadata={'score': 1e9, 'accuracy': 1.0, 'speedup': 1e6})
    sub = s.accept(tok, (tmp_path / 'claim.npz').read_bytes())
    lb.measure_next(s)
    got = s.submission(sub['id'])
    assert got['status'] == 'measured' and got['scores']['score'] < 100 and got['scores']['speedup'] < 50


# ---------------------------------------------------------------- the worker
@pytest.mark.slow
def test_measure_rank_rescore_and_export(tmp_path, files):
    s = make_store(tmp_path, files)
    ann, ben = s.issue_token('ann'), s.issue_token('<script>alert(1)</script>')
    a = s.accept(ann, files['int8'].read_bytes())
    b = s.accept(ben, files['float'].read_bytes())
    assert lb.measure_next(s) == a['id'] and lb.measure_next(s) == b['id'] and lb.measure_next(s) is None
    sa = s.submission(a['id'])
    assert sa['status'] == 'measured' and sa['split'] == 'public' and sa['rank']['closed'] in (1, 2)
    raw = json.loads(s.query("SELECT raw FROM measurements WHERE submission_id = ?", (a['id'],))[0]['raw'])
    r = raw['results']
    assert set(r) == {'baseline', 'submission'} and len(r['submission']['predictions']) == 64
    assert len(r['baseline']['latency']['1']['samples_s']) == 2 and r['submission']['environment']['cpu']
    assert r['submission']['compliance']['passed'] in (True, False) and r['baseline']['settings']['batch_sizes'] == [1, 64]
    board = s.leaderboard()
    assert board['split'] == 'public' and board['samples'] == int((~s.task()['private']).sum())
    assert {e['id'] for e in board['tracks']['open']} | {e['id'] for e in board['unranked']} == {a['id'], b['id']}
    assert lb.rescore(s) == []
    # tamper with a raw sample: rescore notices, and update=True stores the new numbers
    r['submission']['latency']['1']['samples_s'] = [x * 2 for x in r['submission']['latency']['1']['samples_s']]
    with s.tx() as c: c.execute("UPDATE measurements SET raw = ? WHERE submission_id = ?", (json.dumps(raw), a['id']))
    diffs = lb.rescore(s)
    assert diffs and {d['id'] for d in diffs} == {a['id']} and {'speedup', 'score'} <= {d['field'] for d in diffs}
    assert lb.rescore(s, update=True) and lb.rescore(s) == []
    # export
    rows = (tmp_path / 'x.csv', tmp_path / 'x.json')
    s.export_csv(rows[0]); s.export_json(rows[1])
    import csv
    lines = list(csv.DictReader(rows[0].open()))
    assert [int(l['id']) for l in lines] == [a['id'], b['id']] and lines[1]['name'] == '<script>alert(1)</script>'
    assert lines[0]['public_score'] and lines[0]['private_score'] and lines[0]['status'] == 'measured'
    doc = json.loads(rows[1].read_text())
    assert doc['private']['split'] == 'private' and doc['submissions'][0]['raw']['results']['submission']['predictions']
    # the page
    page = lb.render_page(s)
    assert page.startswith('<!doctype html>') and 'name="viewport"' in page and '<svg' in page
    assert '&lt;script&gt;alert(1)&lt;/script&gt;' in page and '<script' not in page
    assert 'Closed track' in page and 'Open track' in page and 'History' in page and lb.SCORE_FORMULA.split(',')[0] in page
    external = [w for w in ('http://', 'https://', '//cdn', '<link', '<img', '@import', 'url(')
                if w in page.replace('xmlns="http://www.w3.org/2000/svg"', '')]
    assert external == []
    assert page.count('class="best"') == 2 * len(board['tracks']['open'])    # each best entry, in both plots


@pytest.mark.slow
def test_close_remove_and_history(tmp_path, files):
    s = make_store(tmp_path, files)
    ann = s.issue_token('ann')
    a = s.accept(ann, files['int8'].read_bytes())
    b = s.accept(ann, files['float'].read_bytes())
    while lb.measure_next(s): pass
    pub = s.leaderboard()
    s.remove(b['id'], 'copied   from a classmate')
    assert s.submission(b['id'])['status'] == 'removed'
    assert b['id'] not in {e['id'] for t in s.leaderboard()['tracks'].values() for e in t}
    h = s.history()['ann']
    assert [x['id'] for x in h] == [a['id'], b['id']] and h[1]['reason'] == 'removed by the instructor: copied from a classmate'
    with pytest.raises(TinycompError, match='give a reason'):
        s.remove(a['id'], ' ')
    with pytest.raises(TinycompError, match='no submission #99'):
        s.remove(99, 'x')
    s.close()
    assert s.closed and s.leaderboard()['split'] == 'private' and s.submission(a['id'])['split'] == 'private'
    assert s.leaderboard(private=False)['split'] == 'public' and pub['split'] == 'public'
    with pytest.raises(SubmissionRejected) as e:
        s.accept(ann, files['int8_0'].read_bytes())
    assert e.value.status == 423
    assert 'final ranking on the private part' in lb.render_page(s)


def test_a_task_can_time_the_models_frozen_for_deployment(tmp_path, files, capsys):
    s = make_store(tmp_path, files, deployed=True)
    a = s.accept(s.issue_token('ann'), files['float'].read_bytes())
    assert lb.measure_next(s) == a['id'] and s.submission(a['id'])['status'] == 'measured'
    raw = json.loads(s.query("SELECT raw FROM measurements WHERE submission_id = ?", (a['id'],))[0]['raw'])
    assert all(r['settings']['deployed'] for r in raw['results'].values())
    board = s.leaderboard()
    assert board['deployed'] and 'frozen for deployment' in lb.format_leaderboard(board)
    assert 'frozen for deployment' in lb.render_page(s) and 'b64 ms (frozen)' in lb.render_page(s)
    assert 'deployment latency (both models frozen)' in lb.format_submission(s.submission(a['id']))
    (tmp_path / 'eager').mkdir()
    assert not make_store(tmp_path / 'eager', files).leaderboard()['deployed']
    db = str(tmp_path / 'cli.db')
    assert main(['leaderboard', 'init', '--db', db, '--task-data', str(files['task']), '--baseline',
                 str(files['baseline']), '--deployed']) == 0
    assert lb.open_store(db).settings['deployed'] is True and 'timed frozen for deployment' in capsys.readouterr().out


def test_a_job_left_measuring_is_measured_again_and_a_crashing_one_fails(tmp_path, files):
    s = make_store(tmp_path, files, max_attempts=2)
    tok = s.issue_token('ann')
    a = s.accept(tok, files['int8'].read_bytes())
    with s.tx() as c:                            # as a worker killed mid-job leaves it
        c.execute("UPDATE submissions SET status = 'measuring', attempts = 1 WHERE id = ?", (a['id'],))
    assert lb.measure_next(s) == a['id'] and s.submission(a['id'])['status'] == 'measured'
    b = s.accept(tok, files['float'].read_bytes())
    with s.tx() as c:                            # it killed the worker twice already
        c.execute("UPDATE submissions SET status = 'measuring', attempts = 2 WHERE id = ?", (b['id'],))
    assert lb.measure_next(s) == b['id']
    sb = s.submission(b['id'])
    assert sb['status'] == 'failed' and 'stopped 2 times' in sb['reason'] and count(s, 'measurements') == 1


def test_isolated_measurement_and_the_time_budget(tmp_path, files):
    s = make_store(tmp_path, files, isolate=True)
    tok = s.issue_token('ann')
    a = s.accept(tok, files['int8'].read_bytes())
    assert lb.measure_next(s) == a['id'] and s.submission(a['id'])['status'] == 'measured'
    s.configure(time_budget_s=0.05)
    b = s.accept(tok, files['float'].read_bytes())
    lb.measure_next(s)
    sb = s.submission(b['id'])
    assert sb['status'] == 'failed' and 'time budget of 0.05 s' in sb['reason']
    assert b['id'] not in {e['id'] for e in s.entries()}


@pytest.mark.slow
def test_killing_the_worker_mid_job_loses_nothing(tmp_path, files):
    s = make_store(tmp_path, files, rounds=400, calls=5)        # a long job, so the kill lands inside it
    tok = s.issue_token('ann')
    a = s.accept(tok, files['int8'].read_bytes())
    code = ("import sys; from tinycomp.leaderboard.worker import run_worker; "
            "run_worker(sys.argv[1], once=True, isolate=False, log=None)")
    proc = subprocess.Popen([sys.executable, '-c', code, str(s.path)])
    try:
        deadline = time.time() + 60
        while s.submission(a['id'])['status'] != 'measuring' and time.time() < deadline: time.sleep(0.05)
        assert s.submission(a['id'])['status'] == 'measuring'
        proc.kill()
    finally:
        proc.wait()
    s.configure(rounds=2, calls=1)
    assert lb.measure_next(s) == a['id']
    got = s.submission(a['id'])
    assert got['status'] == 'measured' and got['attempts'] == 2 and count(s, 'measurements') == 1


# ---------------------------------------------------------------- the command line
def test_cli_init_token_submit_show_html_export_close_remove(tmp_path, files, capsys, monkeypatch, writes_only):
    db = str(tmp_path / 'cli.db')
    assert main(['leaderboard', 'init', '--db', db, '--task-data', str(files['task']), '--baseline',
                 str(files['baseline']), '--name', 'tiny', '--rounds', '2']) == 0
    assert "task 'tiny', 64 evaluation samples" in capsys.readouterr().out
    lb.open_store(db).configure(calls=1, isolate=False)
    assert main(['leaderboard', 'token', 'ann', '--db', db]) == 0
    token = capsys.readouterr().out.strip()
    monkeypatch.setenv('TINYCOMP_TOKEN', token)
    assert main(['submit', str(files['int8']), '--local', '--db', db]) == 0
    out = capsys.readouterr().out
    assert 'accepted as #1' in out and 'measured' in out and 'score' in out and 'closed track' in out
    assert main(['submit', str(files['int8']), '--local', '--db', db]) == 2
    assert 'tinycomp: error: submission refused: you already submitted this model as your entry #1' in capsys.readouterr().err
    assert main(['submit', str(files['float']), '--local', '--db', db, '--token', 'bad']) == 2
    assert 'submission refused: missing or unknown token' in capsys.readouterr().err
    assert main(['leaderboard', 'show', '--db', db, '--json']) == 0
    assert json.loads(capsys.readouterr().out)['task'] == 'tiny'
    assert main(['leaderboard', 'show', '--db', db]) == 0 and 'closed track' in capsys.readouterr().out
    writes_only.start()                                                     # the database is written where --db says
    assert main(['leaderboard', 'html', '--db', db, '--page', 'p.html']) == 0
    assert writes_only.check(capsys.readouterr().out, 'p.html') == ['p.html'] and '<svg' in Path('p.html').read_text()
    assert main(['leaderboard', 'export', '--db', db, '--csv', 'e.csv', '--json', 'e.json']) == 0
    assert writes_only.check(capsys.readouterr().out, 'e.csv', 'e.json') == ['e.csv', 'e.json']
    assert Path('e.csv').read_text().startswith('id,name')
    assert main(['leaderboard', 'remove', '1', '--reason', 'test', '--db', db]) == 0 and 'removed' in capsys.readouterr().out
    assert main(['leaderboard', 'close', '--db', db]) == 0
    assert main(['leaderboard', 'worker', '--db', db, '--once', '--in-process']) == 0
    assert 'measured 0 job(s)' in capsys.readouterr().out
    # one-line errors
    assert main(['leaderboard', 'show', '--db', str(tmp_path / 'none.db')]) == 2
    err = capsys.readouterr().err
    assert err.startswith('tinycomp: error: no leaderboard at') and err.count('\n') == 1
    assert main(['leaderboard', 'init', '--db', str(tmp_path / 'x.db'), '--task-data', str(files['task'])]) == 2
    assert '--task-data and --baseline go together' in capsys.readouterr().err
    assert main(['leaderboard', 'init', '--db', str(tmp_path / 'y.db'), '--task-data', str(tmp_path / 'nope.npz'),
                 '--baseline', str(files['baseline'])]) == 2
    assert not (tmp_path / 'y.db').exists()                                # no half-made database left behind
    monkeypatch.delenv('TINYCOMP_TOKEN')
    assert main(['submit', str(files['float']), '--local', '--db', db]) == 2
    assert 'TINYCOMP_TOKEN' in capsys.readouterr().err


def test_cli_is_registered_by_its_entry_points():
    from tinycomp.cli import COMMANDS, build_parser, registered
    eps = registered(COMMANDS)
    assert eps['leaderboard'].load() is lb_cli.add_leaderboard_cli and eps['submit'].load() is lb_cli.add_submit_cli
    sub = next(a for a in build_parser()._actions if a.dest == 'command')
    assert {'leaderboard', 'submit'} <= set(sub.choices)
    lb_sub = next(a for a in sub.choices['leaderboard']._actions if a.dest == 'lb_command')
    assert {'init', 'token', 'show', 'html', 'export', 'close', 'remove', 'worker'} <= set(lb_sub.choices)


def _die_silently(conn, payload):
    "A measurement child that dies before it reports (as a crashing model or a lost pipe would)."
    os._exit(3)


def test_a_child_that_dies_without_reporting_fails_fast():
    import time
    from tinycomp.leaderboard.worker import MeasurementFailed, _run_isolated
    t0 = time.monotonic()
    with pytest.raises(MeasurementFailed, match=r'died \(exit code 3\)'):
        _run_isolated({}, budget=120, target=_die_silently)
    assert time.monotonic() - t0 < 60            # not the whole budget


def test_a_residual_network_is_measured_against_the_limits_through_its_graph(tmp_path):
    "Its adds are counted (FLOPs, no parameters), float and int8 alike; a limit it breaks is refused with the figure."
    from tinycomp.leaderboard.validation import SubmissionRejected, validate_model_bytes
    from tinycomp.leaderboard.store import DEFAULT_SETTINGS
    from tinycomp.models import digits_resnet
    from tinycomp.profiling.counting import profile_model
    from tinycomp.quantization import quantize_static
    from tinycomp.tensor import manual_seed
    manual_seed(0)
    X = load_digits('test')[0]
    float_model = digits_resnet().eval()
    for model in (float_model, quantize_static(float_model, X[:64])):
        info = validate_model_bytes(tio.save(model, tmp_path / 'm.npz').read_bytes(), X, 10, dict(DEFAULT_SETTINGS))
        rows = profile_model(model, X[:1], repeats=1, warmup=0).rows
        assert info['flops'] == sum(r['flops'] for r in rows) and info['params'] > 70_000
        assert [r['flops'] > 0 and r['params'] == 0 for r in rows if r['type'] in ('Add', 'QuantizedAdd')] == [True, True]
    with pytest.raises(SubmissionRejected, match='FLOPs per sample, more than the limit of 1,000'):
        validate_model_bytes(tio.save(float_model, tmp_path / 'm.npz').read_bytes(), X, 10, dict(DEFAULT_SETTINGS, max_flops=1000))


# ---------------------------------------------------------------- the calibration of the noise between jobs
def test_calibrate_measures_the_job_noise_and_widens_every_interval(tmp_path, files, capsys):
    s = make_store(tmp_path, files, rate_per_day=0)
    s.accept(s.issue_token('ann'), files['int8'].read_bytes())
    assert lb.measure_next(s) == 1
    before = s.leaderboard()['tracks']['closed'][0]
    assert s.calibration is None and s.job_noise == 0.0
    assert main(['leaderboard', 'calibrate', '--db', str(s.path), '--jobs', '3', '--in-process']) == 0
    out = capsys.readouterr().out
    assert 'calibration job 3/3' in out and 'against its int8 version' in out and 'job noise' in out
    cal = s.calibration
    assert cal['jobs'] == 3 and len(cal['speedups']) == 3 and cal['job_noise'] > 0
    assert s.job_noise == cal['job_noise']
    after = s.leaderboard()['tracks']['closed'][0]
    assert after['score'] == before['score']                               # the same measurement ...
    assert after['score_ci'][0] < before['score_ci'][0] and after['score_ci'][1] > before['score_ci'][1]   # ... wider
    with pytest.raises(TinycompError, match='at least 2 jobs'): lb.calibrate(s, jobs=1)
    with pytest.raises(TinycompError, match='calibration_jobs 0 or >= 2'): s.configure(calibration_jobs=1)


def test_a_worker_that_runs_for_good_calibrates_once_before_its_first_job(tmp_path, files):
    s = make_store(tmp_path, files, calibration_jobs=2)
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.Popen([sys.executable, '-m', 'tinycomp.cli', 'leaderboard', 'worker', '--db', str(s.path),
                             '--in-process'], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=str(root)))
    try:
        deadline = time.monotonic() + 180
        while s.calibration is None and time.monotonic() < deadline and proc.poll() is None: time.sleep(0.5)
        assert s.calibration is not None and s.calibration['jobs'] == 2
    finally:
        proc.terminate()
        out = proc.communicate(timeout=30)[0]
    assert 'calibration job 2/2' in out and 'Traceback' not in out
    assert lb.run_worker(s.path, once=True, log=None) == 0 and s.calibration['jobs'] == 2   # --once: no new calibration


def test_repeated_jobs_of_identical_models_feed_the_job_noise(tmp_path, files):
    s = make_store(tmp_path, files, rate_per_day=0)
    for name in ('ann', 'ben', 'cat'): s.accept(s.issue_token(name), files['int8'].read_bytes())   # classmates' copies
    while lb.measure_next(s): pass
    sd, df = s.repeats()
    logs = [log_speedup(json.loads(r['raw'])) for r in s.query("SELECT raw FROM measurements")]
    assert df == 2 and sd == pytest.approx(float(np.std(logs, ddof=1))) and s.job_noise == sd   # not calibrated yet
    s.configure(calibration_jobs=2)
    with s.tx() as c: c.execute("INSERT INTO meta VALUES ('calibration', ?)", (json.dumps(dict(job_noise=sd + 0.01)),))
    assert s.job_noise == sd + 0.01                                        # the larger of the two
    assert s.leaderboard()['measurement']['repeats'] == 2


def test_the_open_track_counts_latency_only_when_the_intervals_part():
    a, b = entry(1, 1, 0, ms=(1.00, 2)), entry(2, 2, 0, ms=(1.03, 2))       # 3 % apart
    a['rel_latency_ci'], b['rel_latency_ci'] = [0.47, 0.53], [0.49, 0.55]   # overlapping: as fast as each other
    assert [e['pareto_rank'] for e in rank_entries([a, b])['open']] == [1, 1]
    b['rel_latency_ci'] = [0.54, 0.60]                                      # wholly slower: dominated
    o = {e['id']: e for e in rank_entries([a, b])['open']}
    assert (o[1]['pareto_rank'], o[2]['pareto_rank']) == (1, 2)
    assert o[2]['why'] == "dominated by p1's entry #1: as good or better on all three, better on latency"
    m = entry_metrics(synthetic_measurement(Y, Y, jitter=0.05, rounds=20, calls=5), Y, ALL, job_noise=0.03)
    assert m['rel_latency_ci'][0] < m['rel_latency'] < m['rel_latency_ci'][1]


def test_html_into_a_folder_and_schedule_after_the_close(tmp_path, files, capsys, monkeypatch):
    s = make_store(tmp_path, files)
    monkeypatch.chdir(tmp_path)
    assert main(['leaderboard', 'html', '--page', 'site/', '--db', str(s.path)]) == 0
    assert (tmp_path / 'site' / 'index.html').is_file() and 'wrote site/index.html' in capsys.readouterr().out
    assert main(['leaderboard', 'html', '--page', 'new/page.html', '--db', str(s.path)]) == 0
    assert (tmp_path / 'new' / 'page.html').is_file()
    s.close()
    assert main(['leaderboard', 'schedule', '--db', str(s.path)]) == 0 and 'closed' in capsys.readouterr().out
    assert main(['leaderboard', 'schedule', '--closes', '2099-01-01 10:00', '--db', str(s.path)]) == 2
