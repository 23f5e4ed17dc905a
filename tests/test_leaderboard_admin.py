"""tinycomp.leaderboard, the instructor's side: duplicates by model (not by bytes), remove/restore with reasons,
tokens (a new one for a participant, a whole class from a CSV list), the CSV export's ranks, file modes, and a worker
stopped by SIGTERM at any moment."""
import csv
import json
import os
import signal
import sqlite3
import stat
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import tinycomp.leaderboard as lb
from tinycomp import io as tio
from tinycomp.cli import main
from tinycomp.errors import TinycompError
from tinycomp.leaderboard import store as lb_store
from tinycomp.leaderboard.validation import SubmissionRejected, model_fingerprint
from tinycomp.leaderboard.worker import _WORKER_CODE
from tinycomp.models import load_pretrained, pretrained_path


@pytest.fixture(scope='module')
def files(tmp_path_factory, task):
    "The 64-sample digits task, and models that are each a little different from the baseline (and from each other)."
    d = tmp_path_factory.mktemp('adminfiles')
    out = dict(dir=d, task=task / 'task.npz', baseline=pretrained_path('digits_cnn'))
    for k in range(3):
        m = load_pretrained('digits_cnn')
        w = next(iter(m.parameters()))
        w.data = w.data * np.float32(1 - 1e-3 * (k + 1))
        out[f'm{k}'] = tio.save(m, d / f'm{k}.npz')
        out[f'm{k}_again'] = tio.save(m, d / f'm{k}_again.npz', metadata={'name': 'my best', 'note': f'saved again {k}'})
    out['baseline_again'] = tio.save(load_pretrained('digits_cnn'), d / 'base_again.npz', metadata={'note': 'mine!'})
    return out


def make_store(path, files, **settings):
    s = lb.open_store(path, create=True)
    s.init(dict(name='digits64', data_npz=files['task'], baseline=files['baseline']),
           **dict(dict(rounds=2, calls=1, isolate=False, rate_per_day=0), **settings))
    return s


def refusal(store, token, path):
    with pytest.raises(SubmissionRejected) as e:
        store.accept(token, Path(path).read_bytes())
    return e.value.status, e.value.reason


def count(store, table='submissions'):
    return store.query(f"SELECT COUNT(*) AS n FROM {table}")[0]['n']


# ---------------------------------------------------------------- duplicates are the same model
def test_fingerprint_ignores_metadata_not_weights(files):
    a, b = tio.load(files['m0']), tio.load(files['m0_again'])
    assert files['m0'].read_bytes() != files['m0_again'].read_bytes()
    assert model_fingerprint(a) == model_fingerprint(b) != model_fingerprint(tio.load(files['m1']))


def test_own_duplicate_refused_with_own_number_and_a_classmates_accepted(tmp_path, files):
    s = make_store(tmp_path / 'lb.db', files)
    ann, ben, cat = (s.issue_token(n) for n in ('ann', 'ben', 'cat'))
    a = s.accept(ann, files['m0'].read_bytes())
    for again in ('m0', 'm0_again'):                        # the same file, and the same model saved with other metadata
        status, reason = refusal(s, ann, files[again])
        assert status == 409 and f"you already submitted this model as your entry #{a['id']}" in reason
        assert 'not measured again' in reason
    b = s.accept(ben, files['m0'].read_bytes())             # a classmate's byte-identical file: their own entry
    c = s.accept(cat, files['m0_again'].read_bytes())       # and the same model under other metadata
    assert (b['name'], b['status'], c['name'], c['status']) == ('ben', 'queued', 'cat', 'queued')
    assert b['reason'] is None and c['reason'] is None
    status, reason = refusal(s, cat, files['m0'])           # cat's own duplicate names cat's entry, and only it
    assert status == 409 and f"your entry #{c['id']}" in reason
    assert f"#{a['id']}" not in reason and f"#{b['id']}" not in reason and 'ann' not in reason and 'ben' not in reason
    assert refusal(s, ann, files['baseline_again'])[1].startswith("this is the task's baseline model itself")
    assert count(s) == 3 and count(s, 'files') == 3         # baseline, m0, m0_again: one stored blob per file


def test_removed_entries_count_and_failed_ones_do_not(tmp_path, files):
    s = make_store(tmp_path / 'lb.db', files)
    ann = s.issue_token('ann')
    a = s.accept(ann, files['m0'].read_bytes())
    s.remove(a['id'], 'handed in twice')
    status, reason = refusal(s, ann, files['m0_again'])
    assert status == 409 and f"your entry #{a['id']}" in reason and 'removed' in reason
    b = s.accept(ann, files['m1'].read_bytes())
    with s.tx() as c: c.execute("UPDATE submissions SET status = 'failed' WHERE id = ?", (b['id'],))
    assert s.accept(ann, files['m1_again'].read_bytes())['status'] == 'queued'     # a failed measurement may be retried


def test_a_store_from_before_fingerprints_is_migrated_and_its_entries_still_count(tmp_path, files):
    new = make_store(tmp_path / 'new.db', files)
    new.issue_token('ann')
    new.disconnect()
    version = next(i for i, m in enumerate(lb_store.MIGRATIONS) if 'model_sha256' in m)
    old = tmp_path / 'old.db'
    c = sqlite3.connect(old, isolation_level=None)
    c.execute('PRAGMA foreign_keys = ON')
    lb_store._migrate(c, old, upto=version)                  # the schema as an older tinycomp left it
    blob = files['m0'].read_bytes()
    c.execute("ATTACH DATABASE ? AS new", (str(tmp_path / 'new.db'),))
    for table in ('files', 'tasks', 'participants'): c.execute(f"INSERT INTO {table} SELECT * FROM new.{table}")
    c.execute("INSERT OR REPLACE INTO meta SELECT * FROM new.meta WHERE key != 'schema_version'")
    c.execute("DETACH DATABASE new")
    c.execute("INSERT INTO files VALUES (?, ?, ?)", (lb_store._sha256(blob), len(blob), blob))
    c.execute("INSERT INTO submissions (participant_id, task_id, sha256, created, status, file_bytes, unpacked_bytes, "
              "params, flops, kind) VALUES (1, 1, ?, 1.0, 'measured', ?, 1, 1, 1, 'float')", (lb_store._sha256(blob), len(blob)))
    c.execute("INSERT INTO measurements VALUES (1, 2.0, 0.5, '{}', '{}')")
    with pytest.raises(sqlite3.IntegrityError):             # before: one entry per file, whoever sent it
        c.execute("INSERT INTO submissions (participant_id, task_id, sha256, created, status, file_bytes, "
                  "unpacked_bytes, params, flops, kind) VALUES (1, 1, ?, 1.0, 'queued', 1, 1, 1, 1, 'float')",
                  (lb_store._sha256(blob),))
    c.close()
    s = lb.open_store(old)
    assert s.query("SELECT value FROM meta WHERE key = 'schema_version'")[0]['value'] == str(lb_store.SCHEMA_VERSION)
    assert s.query("SELECT submission_id, raw FROM measurements") == [{'submission_id': 1, 'raw': '{}'}]
    assert s.query("PRAGMA foreign_key_check") == []
    indexes = {r['name'] for r in s.query("SELECT name FROM sqlite_master WHERE type = 'index'")}
    assert {'submissions_by_participant', 'submissions_by_model'} <= indexes
    # the old entry is fingerprinted when its owner submits again: the same model is still refused
    ann = s.reissue_token('ann')
    assert refusal(s, ann, files['m0_again']) == (409, refusal(s, ann, files['m0'])[1])
    assert 'your entry #1' in refusal(s, ann, files['m0_again'])[1]
    assert s.accept(s.issue_token('ben'), blob)['status'] == 'queued'     # the same bytes from another participant


# ---------------------------------------------------------------- remove, restore, and their reasons
def test_remove_restore_and_the_history_of_reasons(tmp_path, files, capsys):
    s = make_store(tmp_path / 'lb.db', files)
    ann = s.issue_token('ann')
    a = s.accept(ann, files['m0'].read_bytes())
    b = s.accept(ann, files['m1'].read_bytes())
    assert lb.measure_next(s) == a['id']
    s.remove(a['id'], 'looks   copied')
    with pytest.raises(TinycompError, match=r'already removed \(removed by the instructor: looks copied\).*restore it'):
        s.remove(a['id'], 'another reason')
    assert s.submission(a['id'])['reason'] == 'removed by the instructor: looks copied'     # not replaced
    assert a['id'] not in {r['id'] for t in s.leaderboard()['tracks'].values() for r in t}
    got = s.restore(a['id'], 'it was not')
    assert got['status'] == 'measured' and got['reason'] is None
    assert a['id'] in {r['id'] for r in s.leaderboard()['tracks']['open']}
    with pytest.raises(TinycompError, match='is measured, not removed'):
        s.restore(a['id'], 'again')
    with pytest.raises(TinycompError, match='give a reason for restoring'):
        s.restore(b['id'], '  ')
    s.remove(b['id'], 'wrong file')                          # never measured: restored to the queue
    assert s.restore(b['id'], 'right file after all')['status'] == 'queued'
    h = {x['id']: x for x in s.history()['ann']}
    assert [(x['action'], x['reason']) for x in h[a['id']]['actions']] == [('remove', 'looks copied'), ('restore', 'it was not')]
    assert [x['action'] for x in s.instructor_actions()] == ['remove', 'restore', 'remove', 'restore']
    text = lb.format_submission(s.submission(a['id']))
    assert 'removed by the instructor (' in text and '): looks copied' in text and 'restored by the instructor (' in text
    # the command line
    db = str(s.path)
    assert main(['leaderboard', 'remove', str(a['id']), '--reason', 'copied after all', '--db', db]) == 0
    assert 'removed by the instructor: copied after all' in capsys.readouterr().out
    assert main(['leaderboard', 'remove', str(a['id']), '--reason', 'twice', '--db', db]) == 2
    assert 'already removed' in capsys.readouterr().err
    assert main(['leaderboard', 'show', '--db', db]) == 0
    assert f"removed: #{a['id']} ann: removed by the instructor: copied after all" in capsys.readouterr().out
    assert main(['leaderboard', 'show', '--json', '--db', db]) == 0
    assert [r['id'] for r in json.loads(capsys.readouterr().out)['removed']] == [a['id']]
    assert main(['leaderboard', 'restore', str(a['id']), '--reason', 'cleared', '--db', db]) == 0
    out = capsys.readouterr().out
    assert ': measured' in out and 'restored by the instructor (' in out and 'cleared' in out


# ---------------------------------------------------------------- tokens
def test_a_new_token_revokes_the_old_one(tmp_path, files, capsys):
    s = make_store(tmp_path / 'lb.db', files)
    db = str(s.path)
    assert main(['leaderboard', 'token', 'ann', '--db', db]) == 0
    old = capsys.readouterr().out.strip()
    assert main(['leaderboard', 'token', 'ann', '--db', db]) == 2
    assert '--new' in capsys.readouterr().err
    assert main(['leaderboard', 'token', 'ANN', '--new', '--db', db]) == 0
    captured = capsys.readouterr()
    new = captured.out.strip()
    assert new != old and 'their old one no longer works' in captured.err
    assert s.participant(old) is None and s.participant(new)['name'] == 'ann'
    assert refusal(s, old, files['m0'])[0] == 401
    assert s.accept(new, files['m0'].read_bytes())['name'] == 'ann'
    assert main(['leaderboard', 'token', 'nobody', '--new', '--db', db]) == 2
    assert 'no participant named' in capsys.readouterr().err


def test_tokens_for_a_class_list(tmp_path, files, capsys, monkeypatch):
    s = make_store(tmp_path / 'lb.db', files)
    db = str(s.path)
    s.issue_token('zoe')
    monkeypatch.chdir(tmp_path)
    good = tmp_path / 'class.csv'
    good.write_text('\ufeffName,email\nann,a@example.org\n Ben  Ng ,b@example.org\n\n', encoding='utf-8')
    assert main(['leaderboard', 'tokens', '--csv', str(good), '--write', 'tokens.csv', '--db', db]) == 0
    assert 'registered 2 participants' in capsys.readouterr().out
    rows = list(csv.DictReader(open('tokens.csv')))
    assert [r['name'] for r in rows] == ['ann', 'Ben Ng']
    assert all(s.participant(r['token'])['name'] == r['name'] for r in rows)
    assert stat.S_IMODE(os.stat('tokens.csv').st_mode) == 0o600              # secrets: the owner only
    assert main(['leaderboard', 'tokens', '--csv', str(good), '--write', 'tokens.csv', '--db', db]) == 2
    assert 'already exists' in capsys.readouterr().err
    bad = {'no_column.csv': ('email\nx@example.org\n', "no 'name' column"),
           'empty_name.csv': ('name,email\ncarl,c@x\n,d@x\n', 'line 3: empty name'),
           'repeated.csv': ('name\ncarl\ndora\nCarl\n', "line 4: 'Carl' is already on line 2"),
           'registered.csv': ('name\ncarl\nZoe\n', "already registered: 'Zoe'"),
           'empty.csv': ('', "no 'name' column"),
           'header_only.csv': ('name\n', 'no names'),
           'long.csv': ('name\n' + 'x' * 41 + '\n', 'line 2: display name'),
           'latin1.csv': (None, 'not UTF-8')}
    before = count(s, 'participants')
    for name, (text, why) in bad.items():
        p = tmp_path / name
        if text is None: p.write_bytes('name\nJosé\n'.encode('latin-1'))
        else: p.write_text(text)
        assert main(['leaderboard', 'tokens', '--csv', str(p), '--write', f'{name}.tokens', '--db', db]) == 2, name
        err = capsys.readouterr().err
        assert why in err and err.count('\n') == 1, (name, err)
        assert not Path(f'{name}.tokens').exists()
    assert count(s, 'participants') == before                                  # nobody registered by a bad list


# ---------------------------------------------------------------- exports and pages: ranks, modes
def test_csv_export_has_ranks_and_deployed_and_files_are_readable_by_the_group(tmp_path, files, capsys):
    s = make_store(tmp_path / 'lb.db', files)
    ids = [s.accept(s.issue_token(n), files[k].read_bytes())['id'] for n, k in (('ann', 'm0'), ('ben', 'm1'))]
    while lb.measure_next(s): pass
    old = os.umask(0o022)
    try:
        s.export_csv(tmp_path / 'x.csv')
        s.export_json(tmp_path / 'x.json')
        assert main(['leaderboard', 'html', '--page', str(tmp_path / 'p.html'), '--db', str(s.path)]) == 0
        os.umask(0o027)
        s.export_csv(tmp_path / 'group.csv')
    finally:
        os.umask(old)
    modes = {n: oct(stat.S_IMODE((tmp_path / n).stat().st_mode)) for n in ('x.csv', 'x.json', 'p.html', 'group.csv', 'lb.db')}
    # exports hold private scores: the group may read them; the page is for everyone; the database (private labels,
    # every model file) for its owner only
    assert modes == {'x.csv': '0o640', 'x.json': '0o640', 'p.html': '0o644', 'group.csv': '0o640', 'lb.db': '0o600'}
    rows = list(csv.DictReader((tmp_path / 'x.csv').open()))
    assert [int(r['id']) for r in rows] == ids and all(r['deployed'] == 'False' for r in rows)
    for split in ('public', 'private'):
        board = s.leaderboard(split == 'private')
        closed = {r['id']: r for r in board['tracks']['closed']}
        opened = {r['id']: r['rank'] for r in board['tracks']['open']}
        for r in rows:
            i = int(r['id'])
            assert r[f'{split}_open_rank'] == str(opened.get(i, ''))
            assert r[f'{split}_closed_rank'] == str(closed[i]['rank'] if i in closed else '')
            if i in closed and 'band' in closed[i]:
                lo, hi = closed[i]['band']
                assert r[f'{split}_closed_band'] == (f'{lo}-{hi}' if lo != hi else str(lo))
    assert any(r['public_open_rank'] for r in rows)
    doc = json.loads((tmp_path / 'x.json').read_text())
    assert doc['submissions'][0]['model_sha256'] and doc['instructor_actions'] == []


# ---------------------------------------------------------------- the worker stops cleanly on SIGTERM
@pytest.mark.parametrize('delay', [0.0, 0.5])
def test_sigterm_stops_the_worker_cleanly_and_requeues_its_job(tmp_path, files, delay):
    "SIGTERM the moment the job is claimed (the measuring child is starting) or in the middle of the measurement."
    s = make_store(tmp_path / 'lb.db', files, rounds=400, calls=5, isolate=True, calibration_jobs=0)
    a = s.accept(s.issue_token('ann'), files['m0'].read_bytes())
    proc = subprocess.Popen([sys.executable, '-c', _WORKER_CODE, str(s.path), '0'],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 60
        while s.submission(a['id'])['status'] != 'measuring' and time.time() < deadline: time.sleep(0.01)
        assert s.submission(a['id'])['status'] == 'measuring'
        time.sleep(delay)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None: proc.kill(); proc.wait()
    assert proc.returncode == 0 and 'Traceback' not in err and err.strip() == '', err
    assert out.splitlines() == [f"tinycomp leaderboard worker: stopped (SIGTERM); job #{a['id']} is back in the queue"]
    lb.recover(s)
    got = s.submission(a['id'])
    assert (got['status'], got['attempts']) == ('queued', 1) and count(s, 'measurements') == 0


def test_remeasure_queues_a_doubted_measurement_again_with_its_reason(tmp_path, files, capsys):
    s = make_store(tmp_path / 'lb.db', files)
    a = s.accept(s.issue_token('ann'), files['m0'].read_bytes())
    with pytest.raises(TinycompError, match='is queued; only a measured or failed entry can be measured again'):
        s.remeasure(a['id'], 'too early')
    assert lb.measure_next(s) == a['id']
    first = s.query("SELECT raw FROM measurements WHERE submission_id = ?", (a['id'],))[0]['raw']
    assert main(['leaderboard', 'remeasure', str(a['id']), '--reason', 'flagged while the machine was busy',
                 '--db', str(s.path)]) == 0
    assert 'queued to be measured again by the instructor' in capsys.readouterr().out
    sub = s.submission(a['id'])
    assert sub['status'] == 'queued' and not s.query("SELECT 1 FROM measurements WHERE submission_id = ?", (a['id'],))
    assert [(x['action'], x['reason']) for x in sub['actions']] == [('remeasure', 'flagged while the machine was busy')]
    assert lb.measure_next(s) == a['id'] and s.submission(a['id'])['status'] == 'measured'
    assert s.query("SELECT raw FROM measurements WHERE submission_id = ?", (a['id'],))[0]['raw'] != first
    with pytest.raises(TinycompError, match='give a reason'): s.remeasure(a['id'], ' ')


def test_the_csv_export_marks_classmates_identical_models_and_defuses_formulas(tmp_path, files):
    s = make_store(tmp_path / 'lb.db', files)
    ann, ben, eve = s.issue_token('ann'), s.issue_token('ben'), s.issue_token('=HYPERLINK("http://x","eve")')
    a = s.accept(ann, files['m0'].read_bytes())['id']
    b = s.accept(ben, files['m0_again'].read_bytes())['id']                 # the same model, another file
    c = s.accept(eve, files['m1'].read_bytes())['id']
    rows = {int(r['id']): r for r in csv.DictReader(s.export_csv(tmp_path / 'x.csv').open())}
    assert (rows[a]['same_model_as'], rows[b]['same_model_as'], rows[c]['same_model_as']) == (f'#{b}', f'#{a}', '')
    assert rows[c]['name'] == '\'=HYPERLINK("http://x","eve")'
