"""tinycomp.leaderboard: the phases of a competition (dates, close, reopen) and the final measurements a close queues."""
import copy
import json
import sqlite3

import numpy as np
import pytest

from tinycomp import io as tio
from tinycomp.cli import main
from tinycomp.errors import TinycompError
import tinycomp.leaderboard as lb
from tinycomp.leaderboard import store as lb_store, worker as lb_worker
from tinycomp.leaderboard.scoring import entry_metrics, synthetic_measurement
from tinycomp.leaderboard.validation import SubmissionRejected
from tinycomp.models import load_pretrained, pretrained_path

T0 = lb_store._parse_when('2026-12-01 18:00')
HOUR = 3600.0


@pytest.fixture(scope='module')
def files(tmp_path_factory, task):
    d = tmp_path_factory.mktemp('closefiles')
    base = load_pretrained('digits_cnn')
    out = dict(task=task / 'task.npz', baseline=pretrained_path('digits_cnn'))
    for i in range(6):                                      # the baseline nudged: other models, as accurate
        m = copy.deepcopy(base)
        w = next(iter(m.parameters()))
        w.data = w.data * np.float32(1 - (i + 1) / 1000)
        out[i] = tio.save(m, d / f'nudged{i}.npz')
    return out


def make_store(tmp_path, files, **settings):
    s = lb.open_store(tmp_path / 'lb.db', create=True)
    s.init(dict(name='digits64', data_npz=files['task'], baseline=files['baseline']),
           **dict(dict(rounds=2, calls=1, isolate=False), **settings))
    return s


def clock(monkeypatch, t):
    "The store's clock (phases and close dates) set to `t`."
    monkeypatch.setattr(lb_store, '_now', lambda: t)


def made_up(s, token, file, wrong=0, ms=(1.0, 2.0)):
    """Accept `file` and store a made-up measurement for it: `wrong` wrong answers (the first ones of each part), latency
    `ms` at batch sizes 1 and 64 against a baseline of (2, 8) ms."""
    sub = s.accept(token, file.read_bytes())
    y, private = s.task()['labels'], s.task()['private']
    pred = y.copy()
    for part in (private, ~private):
        idx = np.flatnonzero(part)[:wrong]
        pred[idx] = (pred[idx] + 1) % 10
    raw = synthetic_measurement(y, pred, sub_ms=ms, base_bytes=1000, sub_bytes=500)
    with s.tx() as c:
        c.execute("INSERT INTO measurements VALUES (?, 0, 0, ?, '{}')", (sub['id'], json.dumps(raw)))
        c.execute("UPDATE submissions SET status = 'measured' WHERE id = ?", (sub['id'],))
    return sub['id']


def finals(s, closing=None):
    rows = s.query("SELECT closing, submission_id, status, reason, raw FROM final_measurements ORDER BY closing, submission_id")
    return [r for r in rows if closing is None or r['closing'] == closing]


# ---------------------------------------------------------------- the store
def test_a_store_of_the_previous_version_gains_the_final_measurements_table(tmp_path):
    c = sqlite3.connect(tmp_path / 'v2.db', isolation_level=None)
    lb_store._migrate(c, 'v2.db', upto=2)
    assert not c.execute("SELECT name FROM sqlite_master WHERE name = 'final_measurements'").fetchall()
    c.close()
    s = lb.open_store(tmp_path / 'v2.db')
    assert int(s._meta('schema_version')) >= 3 and s.query("SELECT name FROM sqlite_master WHERE name = 'final_measurements'")
    s.disconnect()


def test_final_measurements_survive_the_later_migrations(tmp_path):
    c = sqlite3.connect(tmp_path / 'v3.db', isolation_level=None)
    c.execute('PRAGMA foreign_keys = ON')
    lb_store._migrate(c, 'v3.db', upto=3)                  # a store closed at schema version 3, a final job queued
    c.execute("INSERT INTO files VALUES ('f', 1, x'00')")
    c.execute("INSERT INTO participants VALUES (1, 'ann', 'h', 0)")
    c.execute("INSERT INTO tasks VALUES (1, 't', 0, x'00', x'00', x'00', 0, 'f', 'base.npz')")
    c.execute("INSERT INTO submissions (id, participant_id, task_id, sha256, created, status, file_bytes, unpacked_bytes, "
              "params, flops, kind) VALUES (1, 1, 1, 'f', 0, 'measured', 1, 1, 1, 1, 'float')")
    c.execute("INSERT INTO final_measurements (closing, submission_id, queued, status) VALUES (1, 1, 0, 'queued')")
    c.close()
    s = lb.open_store(tmp_path / 'v3.db')
    assert int(s._meta('schema_version')) == lb.SCHEMA_VERSION
    assert s.query("SELECT closing, submission_id, status FROM final_measurements") == [
        dict(closing=1, submission_id=1, status='queued')]
    s.disconnect()


# ---------------------------------------------------------------- dates
def test_dates_are_read_in_utc_or_with_their_offset_and_bad_ones_are_refused(tmp_path, files):
    assert lb_store._parse_when('2026-12-01T19:30+01:30') == T0 == lb_store._parse_when('2026-12-01T18:00Z')
    assert lb_store._parse_when('none') is None
    for bad in ('tomorrow', '2026-13-01 18:00', '01/12/2026 18:00', ''):
        with pytest.raises(TinycompError, match="like '2026-12-01 18:00'"):
            lb_store._parse_when(bad, '--opens')
    s = make_store(tmp_path, files)
    with pytest.raises(TinycompError, match='before it opens'):
        s.schedule(opens='2026-12-08 18:00', closes='2026-12-01 18:00', now=T0 - 24 * HOUR)
    with pytest.raises(TinycompError, match='before it opens'):
        s.schedule(opens='2026-12-01 18:00', closes='2026-12-01 18:00', now=T0 - 24 * HOUR)
    with pytest.raises(TinycompError, match='has passed'):
        s.schedule(closes='2026-12-01 17:00', now=T0)
    assert (s.settings['opens'], s.settings['closes']) == (None, None)          # nothing was stored
    with pytest.raises(TinycompError, match='setting opens must be a time'):
        s.configure(opens='2026-12-01')
    assert s.schedule(opens='2026-12-01 18:00', now=T0 - HOUR) == dict(phase='not open yet', opens='2026-12-01 18:00 UTC',
                                                                      closes=None)
    assert s.schedule(closes='2026-12-08T19:00+01:00', now=T0 - HOUR)['closes'] == '2026-12-08 18:00 UTC'
    assert s.schedule(opens='none', now=T0 - HOUR) == dict(phase='open', opens=None, closes='2026-12-08 18:00 UTC')


def test_submissions_before_the_opening_are_refused_with_the_time_left(tmp_path, files, monkeypatch):
    s = make_store(tmp_path, files)
    s.schedule(opens='2026-12-01 18:00', closes='2026-12-08 18:00', now=T0 - 3 * HOUR)
    clock(monkeypatch, T0 - (2 * HOUR + 5 * 60))
    assert s.phase() == 'not open yet' and not s.closed
    with pytest.raises(SubmissionRejected) as e:
        s.check_open()
    assert e.value.status == 423 and e.value.reason.startswith('the competition opens at 2026-12-01 18:00 UTC (in 2 h 5 min)')
    board = s.leaderboard()
    assert (board['phase'], board['opens'], board['closes']) == ('not open yet', '2026-12-01 18:00 UTC', '2026-12-08 18:00 UTC')
    clock(monkeypatch, T0)
    s.check_open()                                        # open from the opening minute on
    assert s.phase() == 'open' and s.leaderboard()['final'] is None


# ---------------------------------------------------------------- closing queues the counted entries, once
def test_the_close_date_closes_the_competition_by_itself(tmp_path, files, monkeypatch):
    s = make_store(tmp_path, files)
    ann, ben = s.issue_token('ann'), s.issue_token('ben')
    clock(monkeypatch, T0)
    s.schedule(closes='2026-12-01 20:00')
    a1 = made_up(s, ann, files[0], ms=(1.0, 2.0))
    a2 = made_up(s, ann, files[1], ms=(1.5, 3.0))            # slower: not counted
    b1 = made_up(s, ben, files[2], ms=(1.2, 2.0))
    assert s.phase() == 'open' and s.leaderboard()['split'] == 'public'
    clock(monkeypatch, T0 + 2 * HOUR)                        # nobody runs a command
    assert s.closed and s.phase() == 'closed' and s._meta('closed') == '0'
    with pytest.raises(SubmissionRejected) as e:
        s.accept(ann, files[3].read_bytes())
    assert e.value.status == 423
    board = s.leaderboard()                                  # the first look records the close and queues the finals
    assert s._meta('closed') == '1' and board['split'] == 'private' and board['phase'] == 'closed'
    assert board['final'] == dict(closed_at='2026-12-01 20:00 UTC', chosen=True, waiting=0, pending=2, done=0,
                                  in_progress=True, failed=[])
    assert [(r['submission_id'], r['status']) for r in finals(s)] == [(a1, 'queued'), (b1, 'queued')]
    assert {r['id'] for t in board['tracks'].values() for r in t} == {a1, b1}
    assert board['standing'][str(a2)].startswith('not counted') and f'#{a1}' in board['standing'][str(a2)]
    assert {r['final'] for t in board['tracks'].values() for r in t} == {'pending'}
    assert s.close() == s.final_status() and len(finals(s)) == 2 and s._meta('closing') == '1'   # closing again: nothing new


def test_entries_still_waiting_at_the_close_are_measured_before_the_finals_are_chosen(tmp_path, files, monkeypatch):
    s = make_store(tmp_path, files)
    ann, ben = s.issue_token('ann'), s.issue_token('ben')
    a = made_up(s, ann, files[0], ms=(1.5, 3.0))
    b = s.accept(ben, files[1].read_bytes())['id']          # queued, not measured yet
    final = s.close()
    assert final['chosen'] is False and final['waiting'] == 1 and final['in_progress'] and finals(s) == []
    assert lb.measure_next(s) == b and s.submission(b)['status'] == 'measured'
    assert lb.measure_next(s) in (a, b)                      # now the finals are chosen: both are counted
    assert sorted(r['submission_id'] for r in finals(s)) == [a, b]


@pytest.mark.slow
def test_final_measurements_are_new_jobs_and_decide_the_final_ranking(tmp_path, files, capsys):
    s = make_store(tmp_path, files)
    ann, ben = s.issue_token('ann'), s.issue_token('ben')
    ids = [s.accept(ann, files[0].read_bytes())['id'], s.accept(ann, files[1].read_bytes())['id'],
           s.accept(ben, files[2].read_bytes())['id']]
    while lb.measure_next(s): pass
    public = s.leaderboard()
    counted = sorted({r['id'] for t in public['tracks'].values() for r in t})
    s.close()
    assert sorted(r['submission_id'] for r in finals(s)) == counted
    assert lb.run_worker(s.path, once=True, isolate=False, log=print) == len(counted)
    assert capsys.readouterr().out.count('final measurement measured') == len(counted)
    assert lb.measure_next(s) is None and s.close()['done'] == len(counted) and len(finals(s)) == len(counted)
    task = s.task()
    entries = {e['id']: e for e in s.entries()}
    for r in finals(s):
        raw = json.loads(r['raw'])
        sid = r['submission_id']
        assert raw['results']['submission']['settings']['seed'] == sid + 1_000_003      # another seed than at submission
        again = entry_metrics(raw, task['labels'], task['private'])
        first = json.loads(s.query("SELECT raw FROM measurements WHERE submission_id = ?", (sid,))[0]['raw'])
        assert raw['results']['submission']['latency'] != first['results']['submission']['latency']
        e = entries[sid]
        assert e['final'] == 'measured' and e['counted'] and e['n'] == int(task['private'].sum())
        assert e['latency_ms'] == again['latency_ms'] and e['speedup'] == again['speedup'] and e['accuracy'] == again['accuracy']
    board = s.leaderboard()
    assert board['final']['in_progress'] is False and board['split'] == 'private'
    assert {r['id'] for t in board['tracks'].values() for r in t} <= set(counted)
    for row in board['tracks']['closed']:
        assert row['speedup'] == pytest.approx(entries[row['id']]['speedup']) and row['final'] == 'measured'
    assert board['measurement']['rounds'] == 2 and board['measurement']['batch_sizes'] == [1, 64]
    assert board['measurement']['cpu'] and board['measurement']['cores'] >= 1
    # the public ranking keeps its measurements at submission, every entry (its intervals, and so its bands, may
    # widen: the final jobs are repeats of the same models, which the job noise pools)
    def scores(board): return {t: [(r['id'], r['score']) for r in rows] for t, rows in board['tracks'].items()}
    assert scores(s.leaderboard(private=False)) == scores(public)
    history = s.history()['ann']
    assert [h['id'] for h in history] == ids[:2] and all('accuracy' in h for h in history)


# ---------------------------------------------------------------- reopen
def test_reopen_discards_the_finals_and_shows_public_scores_again(tmp_path, files, monkeypatch):
    s = make_store(tmp_path, files)
    ann = s.issue_token('ann')
    a = made_up(s, ann, files[0])
    with pytest.raises(TinycompError, match='not closed'):
        s.reopen()
    clock(monkeypatch, T0)
    s.schedule(closes='2026-12-01 20:00')
    clock(monkeypatch, T0 + 3 * HOUR)
    s.leaderboard()
    assert [r['status'] for r in finals(s)] == ['queued']
    with pytest.raises(TinycompError, match=r"2026-12-01 20:00 UTC has passed.*--closes none"):
        s.reopen(now=T0 + 3 * HOUR)
    assert s.reopen(closes='2026-12-02 18:00', now=T0 + 3 * HOUR) == dict(phase='open', opens=None,
                                                                           closes='2026-12-02 18:00 UTC')
    assert not s.closed and s.leaderboard()['split'] == 'public' and s.leaderboard()['final'] is None
    assert s.entries()[0]['counted'] is None
    assert [(r['status'], r['reason']) for r in finals(s)] == [('failed', 'not measured: the competition was reopened')]
    assert lb.measure_next(s) is None                        # the set-aside job is not measured
    b = made_up(s, ann, files[1], ms=(0.5, 1.0))             # submissions are accepted again
    s.close()                                                # the second close measures again, from scratch
    assert s._meta('closing') == '2' and [r['submission_id'] for r in finals(s, 2)] == [b]
    assert {e['id']: e['counted'] for e in s.entries()} == {a: False, b: True}
    s.reopen(closes='none')
    assert s.settings['closes'] is None and s.phase() == 'open'


# ---------------------------------------------------------------- a final job that fails
def test_a_failing_final_job_is_reported_and_keeps_the_measurement_at_submission(tmp_path, files, monkeypatch):
    s = make_store(tmp_path, files, max_attempts=2)
    ann, ben = s.issue_token('ann'), s.issue_token('ben')
    a = s.accept(ann, files[0].read_bytes())['id']
    b = s.accept(ben, files[1].read_bytes())['id']
    while lb.measure_next(s): pass
    before = {e['id']: e for e in s.entries(private=True)}
    s.close()
    real = lb_worker._measure_payload
    def crash_for_a(p):
        if p['seed'] == a + 1_000_003: raise RuntimeError('the model crashed the harness')
        return real(p)
    monkeypatch.setattr(lb_worker, '_measure_payload', crash_for_a)
    assert lb.measure_next(s) == a and lb.measure_next(s) == b and lb.measure_next(s) is None
    final = s.final_status()
    assert final['done'] == 1 and final['pending'] == 0 and not final['in_progress']
    assert final['failed'] == [dict(id=a, name='ann', reason='the harness could not measure the model: RuntimeError: '
                                                               'the model crashed the harness')]
    e = {x['id']: x for x in s.entries()}[a]
    assert e['final'] == 'failed' and 'ranked with its measurement at submission' in e['final_note']
    assert e['latency_ms'] == before[a]['latency_ms']
    board = s.leaderboard()
    row = next(r for r in board['tracks']['closed'] if r['id'] == a)
    assert row['final'] == 'failed' and 'crashed the harness' in row['final_note']
    # a final job left 'measuring' by a killed worker is measured again, up to max_attempts
    with s.tx() as c:
        c.execute("UPDATE final_measurements SET status = 'measuring', attempts = 2 WHERE submission_id = ?", (b,))
    assert lb.recover(s) == 1 and lb.measure_next(s) == b
    assert 'stopped 2 times' in [r for r in finals(s) if r['submission_id'] == b][0]['reason']


# ---------------------------------------------------------------- the leaderboard's extras and the open floor
def test_the_open_floor_setting_and_the_extras_of_the_leaderboard(tmp_path, files):
    s = make_store(tmp_path, files)
    with pytest.raises(TinycompError, match='open_min_accuracy must be 0'):
        s.configure(open_min_accuracy=1.5)
    board = s.leaderboard()
    assert board['measurement'] is None and board['standing'] == {}
    assert board['baseline']['name'] == files['baseline'].name and 'accuracy' not in board['baseline']
    assert board['open_floor'].startswith("the closed track's accuracy gate")
    ann = s.issue_token('ann')
    a = made_up(s, ann, files[0])
    made_up(s, ann, files[1], ms=(1.5, 3.0))
    s.configure(open_min_accuracy=0.9)
    board = s.leaderboard()
    assert board['open_floor'].startswith('accuracy of at least 90.0%')
    assert board['baseline']['baseline'] is True and board['baseline']['name'] == files['baseline'].name
    assert board['baseline']['score'] == 1.0
    row = board['tracks']['closed'][0]
    assert row['id'] == a and {'band', 'tied', 'speedup_ci', 'score_ci', 'rel_latency'} <= set(row)
    assert 'why' in board['tracks']['open'][0] and len(board['standing']) == 1
    json.dumps(board)                                        # JSON-friendly all the way down


# ---------------------------------------------------------------- the command line
def test_cli_schedule_close_reopen_and_init_with_an_open_floor(tmp_path, files, capsys):
    db = str(tmp_path / 'cli.db')
    assert main(['leaderboard', 'init', '--db', db, '--task-data', str(files['task']), '--baseline',
                 str(files['baseline']), '--rounds', '2', '--open-min-accuracy', '0.9']) == 0
    assert lb.open_store(db).settings['open_min_accuracy'] == 0.9
    capsys.readouterr()
    assert main(['leaderboard', 'schedule', '--db', db, '--opens', '2099-01-01 10:00',
                 '--closes', '2099-01-08T10:00+01:00']) == 0
    assert capsys.readouterr().out.strip() == 'not open yet: opens 2099-01-01 10:00 UTC; closes 2099-01-08 09:00 UTC'
    assert main(['leaderboard', 'schedule', '--db', db, '--closes', 'next friday']) == 2
    assert "--closes 'next friday' is not a date and time" in capsys.readouterr().err
    assert main(['leaderboard', 'schedule', '--db', db, '--closes', '2098-12-31 10:00']) == 2
    assert 'before it opens' in capsys.readouterr().err
    assert main(['leaderboard', 'show', '--db', db]) == 0
    assert capsys.readouterr().out.startswith('not open yet: opens 2099-01-01 10:00 UTC')
    assert main(['leaderboard', 'schedule', '--db', db, '--opens', 'none']) == 0
    assert capsys.readouterr().out.startswith('open; closes 2099-01-08 09:00 UTC')
    assert main(['leaderboard', 'close', '--db', db]) == 0
    out = capsys.readouterr().out
    assert out.startswith('closed: no more submissions') and 'final measurement: 0 of 0 counted entries measured' in out
    assert main(['leaderboard', 'close', '--db', db]) == 0                  # again: nothing changes
    assert lb.open_store(db)._meta('closing') == '1'
    assert main(['leaderboard', 'schedule', '--db', db, '--closes', '2099-02-01 10:00']) == 2
    assert 'reopen' in capsys.readouterr().err
    assert main(['leaderboard', 'show', '--db', db]) == 0
    assert capsys.readouterr().out.startswith('closed since 20')
    assert main(['leaderboard', 'reopen', '--db', db, '--closes', '2099-02-01 10:00']) == 0
    assert capsys.readouterr().out.startswith('reopened: open; closes 2099-02-01 10:00 UTC')
    assert main(['leaderboard', 'reopen', '--db', db]) == 2
    assert 'not closed' in capsys.readouterr().err
