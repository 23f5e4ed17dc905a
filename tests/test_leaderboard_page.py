"""The leaderboard page (tinycomp.leaderboard.page and .plots) for a class of 14: label placement, axes, units and
markers as pure functions, and the page itself in headless Chromium at desktop (1280 px) and phone (390 px) widths.
`TINYCOMP_SHOTS=1` also copies the screenshots to /tmp/leaderboard_shots."""
import hashlib
import json
import os
import shutil
import time
from pathlib import Path

import numpy as np
import pytest

from tinycomp.benchmarking.harness import environment
from tinycomp.leaderboard import page as page_mod, plots
from tinycomp.leaderboard.page import render_page
from tinycomp.leaderboard.plots import (accuracy_axis, boxes_meet, fmt_bytes, fmt_times, linear_ticks, log_range, log_ticks,
                                        participant_styles, place_labels, plot_frame, svg_scatter, text_width)
from tinycomp.leaderboard.scoring import synthetic_measurement
from tinycomp.leaderboard.store import open_store

# ---------------------------------------------------------------- a class of 14, written straight into a store
BASE_MS, BASE_BYTES = (0.25, 4.0), 42_729
LONG = ('Kateryna Oleksandrivna Shevchenko', 'Maximilian von Habsburg-Lothringen')
CLASS = {  # participant: their entries as (wrong answers among 359, batch-1 ms, batch-64 ms, file bytes, kind)
    'Ada': [(8, 0.120, 1.60, 12_000, 'int8'), (7, 0.130, 1.70, 12_100, 'int8')],
    'Ben': [(9, 0.115, 1.55, 11_900, 'int8')],
    'Chen Wei': [(10, 0.118, 1.58, 12_050, 'int8')],
    'Dmitri': [(8, 0.121, 1.61, 11_980, 'int8')],
    'Esther': [(12, 0.090, 1.10, 22_000, 'pruned'), (30, 0.070, 0.90, 15_000, 'pruned')],
    'Fatima': [(6, 0.240, 3.90, 21_500, 'float16')],
    'Gábor': [(14, 0.060, 0.70, 6_500, 'int8+pruned')],
    'Hiroshi': [(9, 0.119, 1.60, 12_010, 'int8')],
    'Ines': [(11, 0.300, 4.50, 40_000, 'float')],
    'Jamal': [(20, 0.050, 0.60, 5_200, 'int8+pruned')],
    LONG[0]: [(8, 0.117, 1.59, 12_020, 'int8')],
    'Lu': [(323, 0.250, 4.00, 42_700, 'float'), (9, 0.120, 1.60, 12_030, 'int8')],   # random weights first: ~10 %
    LONG[1]: [(7, 0.100, 1.30, 9_000, 'int8')],
    'Noor': [(10, 0.140, 1.90, 10_800, 'int8'), (8, 0.004, 0.05, 12_000, 'int8')],   # the second: implausibly fast
}


def _wrong(y, n, rng):
    p = y.copy()
    i = rng.choice(len(y), n, replace=False)
    p[i] = (p[i] + 1) % (int(y.max()) + 1)
    return p


def _jitter(raw, rng, rounds):
    "Latency samples that vary like real ones (3 %), so the intervals of scores are not points."
    for result in raw['results'].values():
        for b, lat in result['latency'].items():
            lat['samples_s'] = [lat['samples_s'][0] * float(np.exp(rng.normal(0, 0.03))) for _ in range(rounds)]
    return raw


def class_store(path, seed=0):
    "A leaderboard of the default task with the class of 14 measured (made-up measurements, no worker run)."
    store = open_store(path, create=True)
    store.init(rounds=8, calls=2, isolate=False)
    task, rng, env = store.task(), np.random.default_rng(seed), environment()
    y = task['labels']
    base_pred = _wrong(y, 6, rng)
    settings = dict(batch_sizes=[1, 64], rounds=8, calls=2, seed=0, threads=1, deployed=False)
    t0 = time.time() - 3 * 86400
    for k, (name, entries) in enumerate(CLASS.items()):
        store.issue_token(name)
        pid = store.query("SELECT id FROM participants WHERE name = ?", (name,))[0]['id']
        for j, (n_wrong, ms1, ms64, size, kind) in enumerate(entries):
            raw = _jitter(synthetic_measurement(base_pred, _wrong(y, n_wrong, rng), base_ms=BASE_MS, sub_ms=(ms1, ms64),
                                                base_bytes=BASE_BYTES, sub_bytes=size), rng, 8)
            for result in raw['results'].values(): result.update(environment=env, settings=settings)
            blob = f"{name} {j}".encode() * 10
            sha, created = hashlib.sha256(blob).hexdigest(), t0 + 3600 * (k + 20 * j)
            with store.tx() as c:
                c.execute("INSERT INTO files VALUES (?, ?, ?)", (sha, len(blob), blob))
                sid = c.execute("INSERT INTO submissions (participant_id, task_id, sha256, created, status, file_bytes, "
                                "unpacked_bytes, params, flops, kind, started, finished) VALUES (?, ?, ?, ?, 'measured', "
                                "?, ?, 9930, 100000, ?, ?, ?)", (pid, task['id'], sha, created, size, size, kind,
                                                                 created + 5, created + 30)).lastrowid
                c.execute("INSERT INTO measurements VALUES (?, ?, 25.0, ?, '{}')", (sid, created + 30, json.dumps(raw)))
    return store


# ---------------------------------------------------------------- labels, axes, units and markers (pure functions)
FRAME = plot_frame()


def _marker_boxes(points, r=6.0):
    return [(x - r, y - r, x + r, y + r) for x, y in points]


def _check_placement(points, names, priority_first=True):
    sizes = [(text_width(n, plots.FONT), plots.FONT * 1.25) for n in names]
    obstacles = _marker_boxes(points)
    got = place_labels(points, sizes, FRAME, obstacles=obstacles)
    placed = [(g[0], g[1], p) for g, p in zip(got, points) if g]
    boxes = [b for b, _, _ in placed]
    for i, a in enumerate(boxes):
        assert FRAME[0] <= a[0] and a[2] <= FRAME[2] and FRAME[1] <= a[1] and a[3] <= FRAME[3], a   # inside the edges
        assert a[1] > 24, a                                              # below the title (its baseline is at y = 20)
        for b in boxes[i + 1:]: assert not boxes_meet(a, b), (a, b)
        for m in obstacles: assert not boxes_meet(a, m), (a, m)         # over no marker, its own included
    for box, lead, (px, py) in placed:                                  # a leader line crosses no other label
        if lead: assert not any(plots.segment_meets_box((px, py), lead, b) for b in boxes if b != box)
    if priority_first: assert got[0] is not None                        # the most important label always has room
    for (w, _), g in zip(sizes, got):
        if g: assert abs((g[0][2] - g[0][0]) - w) < 1e-9
    return got


def test_fourteen_labels_at_almost_the_same_point_never_overlap():
    pts = [(200 + 0.4 * i, 150 - 0.3 * i) for i in range(14)]
    got = _check_placement(pts, list(CLASS))
    assert 4 <= sum(g is not None for g in got) < 14                     # some fit; the rest show on hover and tap


def test_long_names_and_points_in_the_corners_stay_inside_the_plot():
    x0, y0, x1, y1 = FRAME
    pts = [(x1 - 2, y0 + 2), (x0 + 2, y0 + 2), (x1 - 2, y1 - 2), (x0 + 2, y1 - 2), ((x0 + x1) / 2, y0 + 1)]
    got = _check_placement(pts, ['baseline', LONG[0], LONG[1], 'W' * 30, 'x' * 40])
    assert sum(g is not None for g in got) >= 3


def test_an_outlier_at_the_edge_and_a_crowd_keep_their_labels_apart():
    x0, y0, x1, y1 = FRAME
    pts = [((x0 + x1) / 2, y1 - 8)] + [(250 + 3 * (i % 4), 60 + 2 * i) for i in range(12)] + [(x0 + 10, 70)]
    _check_placement(pts, ['Lu #14'] + [f"learner number {i}" for i in range(12)] + ['baseline'])


def test_the_placement_is_deterministic_and_gives_up_rather_than_overlap():
    pts = [(100 + i, 100) for i in range(30)]
    sizes = [(300.0, 200.0)] * 30                                       # nearly the whole plot each
    got = place_labels(pts, sizes, FRAME)
    assert got == place_labels(pts, sizes, FRAME) and sum(g is not None for g in got) <= 1


def test_the_accuracy_axis_is_clamped_and_zooms_onto_the_class():
    acc = [98.3, 98.1, 98.4, 97.9, 98.3, 98.0, 97.6, 10.1]
    lo, hi, out = accuracy_axis(acc, anchors=(98.2, 97.2))
    assert out == [7] and 96 < lo < 97.2 and 98.4 < hi <= 100 and hi - lo < 5
    lo, hi, out = accuracy_axis([99.7, 99.9, 100.0, 99.8])
    assert hi == 100.0 and lo < 99.7 and out == []
    lo, hi, out = accuracy_axis([0.0, 0.2, 0.1])
    assert lo == 0.0 and hi > 0.2
    lo, hi, out = accuracy_axis([40.0, 60.0, 80.0, 99.0])               # a spread-out class: nothing is an outlier
    assert out == [] and lo < 40 and hi > 99 and 0 <= lo and hi <= 100
    assert accuracy_axis([]) == (0.0, 100.0, [])


@pytest.mark.parametrize('lo,hi', [(0.2, 1.3), (0.9, 1.1), (4_800, 46_000), (0.01, 20.0), (1e-3, 1e6), (37.0, 41.0)])
def test_log_ticks_are_round_few_and_inside_the_axis(lo, hi):
    a, b = log_range([lo, hi])
    ticks = log_ticks(a, b)
    assert 2 <= len(ticks) <= 6 and all(a <= t <= b for t in ticks) and ticks == sorted(ticks)
    for t in ticks:
        assert 'e' not in fmt_times(t) and 'e' not in fmt_bytes(t)
        assert float(f"{t:.2g}") == t                                   # round: two significant digits at most
    assert linear_ticks(96.25, 98.65) == [96.5, 97.0, 97.5, 98.0, 98.5]


def test_units_for_people():
    assert [fmt_bytes(n) for n in (999, 4_096, 16_000, 42_729, 2_500_000)] == ['999 B', '4.1 kB', '16 kB', '43 kB', '2.5 MB']
    assert [fmt_times(v) for v in (0.5, 1, 2, 0.25, 1.5)] == ['0.5×', '1×', '2×', '0.25×', '1.5×']


def test_fourteen_and_more_participants_each_have_their_own_marker():
    for n in (14, 21, 42):
        styles = participant_styles(range(n))
        assert len(set(styles.values())) == n
    styles = participant_styles(range(14))
    assert len({c for c, _, _ in styles.values()}) == 7 and len({s for _, s, _ in styles.values()}) == 2


def test_a_scatter_of_the_class_keeps_labels_off_each_other_and_the_title():
    pts = [dict(x=1.0, y=0.982, name='baseline', tip='baseline', kind='baseline', priority=0)]
    styles = participant_styles(range(14))
    for i, name in enumerate(CLASS):
        pts.append(dict(x=0.47 + 0.001 * i, y=0.98 - 0.0005 * i if name != 'Lu' else 0.101, name=name, tip=name,
                        kind='best', style=styles[i], priority=i + 1 if i < 6 else None))
    svg, edge = svg_scatter(pts, 'accuracy vs latency', 'latency', fmt_times, anchors=(98.2, 97.2), gate=97.2)
    assert [d['name'] for d in edge] == ['Lu'] and 'e+' not in svg
    import re
    labs = [(float(x), float(y), t) for x, y, t in re.findall(r'<text class="lab" x="([\d.]+)" y="([\d.]+)">([^<]*)<', svg)]
    boxes = [(x, y - plots.FONT * 0.95, x + text_width(t, plots.FONT), y + plots.FONT * 0.3) for x, y, t in labs]
    assert len(boxes) >= 2
    assert not any(boxes_meet(a, b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    assert all(b[1] > 24 and FRAME[0] <= b[0] and b[2] <= FRAME[2] and b[3] <= FRAME[3] for b in boxes)
    assert svg.count('class="tip"') == len(pts) - len(labs)              # every other point: its name on hover and tap


# ---------------------------------------------------------------- the page of the class
@pytest.fixture(scope='module')
def class_page(tmp_path_factory):
    store = class_store(tmp_path_factory.mktemp('class') / 'lb.db')
    yield store, render_page(store)
    store.disconnect()


def test_the_page_of_the_class_states_how_it_measured_and_shows_the_baseline_everywhere(class_page):
    store, page = class_page
    board = store.leaderboard()
    assert '<script' not in page and 'e+0' not in page and 'e-0' not in page
    m = board['measurement']
    assert f"{m['rounds']} rounds of {m['calls']} calls" in page and f"({m['cores']} cores)" in page
    assert f"relative to the baseline {board['baseline']['name']}" in page
    assert page.count('<table>') == page.count('<tr class="base">')      # the baseline: a row of every table
    closed = page[page.index('<h2>Closed track'):page.index('<h2>Open track')]
    assert all(f">{r['score']:.3f}</b>" in closed for r in board['tracks']['closed'])
    assert all(f'>={r["rank"]}<small class="band">{r["band"][0]}–{r["band"][1]}<' in closed
               for r in board['tracks']['closed'] if r['tied']) and any(r['tied'] for r in board['tracks']['closed'])
    opened = page[page.index('<h2>Open track'):page.index('<h2>Pareto plots')]
    assert all(html_escape(r['why']) in opened for r in board['tracks']['open'])
    assert html_escape(board['open_floor']) in opened and html_escape(board['rules']) in page
    history = page[page.index('<h2>History'):]
    for sid, line in board['standing'].items():                    # the page speaks of 'their' entries, not 'your'
        assert html_escape(page_mod._public_standing(board, sid)) in history and 'your entry' not in history, (sid, line)
    assert board['standing'] and page.count('<svg class="plot"') == 2 and '▼ at the bottom edge: Lu #' in page


def html_escape(s):
    import html
    return html.escape(str(s), quote=True)


# ---------------------------------------------------------------- the page in headless Chromium, desktop and phone
_MEASURE = """() => {
  const r = e => { const b = e.getBoundingClientRect(); return [b.left, b.top, b.right, b.bottom]; };
  const px = t => { const m = t.getScreenCTM(); return parseFloat(getComputedStyle(t).fontSize) * Math.hypot(m.a, m.b); };
  const plots = [...document.querySelectorAll('svg.plot')].map(svg => ({
    svg: r(svg), title: r(svg.querySelector('.ptitle')), labels: [...svg.querySelectorAll('text.lab')].map(r),
    ticks: [...svg.querySelectorAll('text.tk')].map(r), markers: [...svg.querySelectorAll('.mk, .best')].map(r),
    smallest: Math.min(...[...svg.querySelectorAll('text')].map(px))}));
  const closed = document.querySelector('section table');
  const heads = [...closed.querySelectorAll('th')].map(th => th.textContent);
  const scores = [...closed.querySelectorAll('tr > :nth-child(3)')].map(r);
  return {plots, heads, scores, width: window.innerWidth, scrollWidth: document.documentElement.scrollWidth};
}"""


def _meet(a, b, slack=0.5):
    return a[0] < b[2] - slack and b[0] < a[2] - slack and a[1] < b[3] - slack and b[1] < a[3] - slack


def _shots_dir(tmp_path):
    if os.environ.get('TINYCOMP_SHOTS') == '1':
        out = Path('/tmp/leaderboard_shots')
        out.mkdir(exist_ok=True)
        return out
    return None


@pytest.mark.parametrize('width', [1280, 390])
def test_the_class_page_in_headless_chromium(class_page, tmp_path, chromium, width):
    from playwright.sync_api import sync_playwright
    _, page_html = class_page
    (tmp_path / 'page.html').write_text(page_html, encoding='utf-8')
    phone = width < 600
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=['--no-sandbox'] if os.geteuid() == 0 else [])
        try:
            page = browser.new_page(viewport={'width': width, 'height': 844 if phone else 900}, is_mobile=phone,
                                    has_touch=phone)
            page.goto((tmp_path / 'page.html').as_uri())
            shot = tmp_path / f'leaderboard-{width}.png'
            page.screenshot(path=str(shot), full_page=True)
            got = page.evaluate(_MEASURE)
            # the plots: labels apart from each other, the title, the ticks and the markers, inside the picture
            assert len(got['plots']) == 2
            for plot in got['plots']:
                labels, svg = plot['labels'], plot['svg']
                assert labels, 'no label on a plot'
                for i, a in enumerate(labels):
                    assert svg[0] <= a[0] and a[2] <= svg[2] and svg[1] <= a[1] and a[3] <= svg[3], (a, svg)
                    assert not _meet(a, plot['title']), (a, plot['title'])
                    for b in labels[i + 1:] + plot['ticks']: assert not _meet(a, b), (a, b)
                    for m in plot['markers']: assert not _meet(a, m, slack=1.0), (a, m)
                for t in plot['ticks']: assert svg[0] <= t[0] and t[2] <= svg[2], ('a tick label is cut', t, svg)
                if phone: assert plot['smallest'] >= 11, plot['smallest']
            assert got['scrollWidth'] <= got['width'], 'the page itself scrolls sideways'
            assert got['heads'][:3] == ['#', 'name', 'score 95% CI']
            if phone:
                assert all(0 <= s[0] and s[2] <= got['width'] for s in got['scores']), 'the score is off-screen'
                # the rank and the name stay in view when the table scrolls sideways
                page.evaluate("document.querySelector('.scroll').scrollLeft = 2000")
                name = page.evaluate("(() => { const b = document.querySelector('section table tbody td.nm')"
                                     ".getBoundingClientRect(); return [b.left, b.right]; })()")
                assert 0 <= name[0] and name[1] < 0.6 * got['width'], name
                # tapping a point without a label shows its name
                point = page.locator('svg.plot g.pt:has(text.tip)').last          # drawn on top
                tip = point.locator('text.tip')
                assert tip.evaluate('t => getComputedStyle(t).visibility') == 'hidden'
                point.locator('.mk, .best').tap()
                assert tip.evaluate('t => getComputedStyle(t).visibility') == 'visible'
                page.screenshot(path=str(tmp_path / f'leaderboard-{width}-tapped.png'))
        finally: browser.close()
    assert shot.stat().st_size > 20_000
    out = _shots_dir(tmp_path)
    if out:
        for f in tmp_path.glob('leaderboard-*.png'): shutil.copy(f, out / f.name)


def test_a_page_before_anything_is_measured(tmp_path):
    store = open_store(tmp_path / 'lb.db', create=True)
    store.init(rounds=2, calls=1, isolate=False)
    assert 'No ranked entries yet' in render_page(store) and '<svg class="plot"' not in render_page(store)
    store.issue_token('<i>Ana</i>')
    pid, task = store.query("SELECT id FROM participants")[0]['id'], store.task()
    with store.tx() as c:                                                 # a submission waiting for the worker
        c.execute("INSERT INTO files VALUES ('f', 1, x'00')")
        c.execute("INSERT INTO submissions (participant_id, task_id, sha256, created, status, file_bytes, unpacked_bytes, "
                  "params, flops, kind) VALUES (?, ?, 'f', ?, 'queued', 1, 1, 1, 1, 'float')", (pid, task['id'], time.time()))
    page = render_page(store)
    assert '&lt;i&gt;Ana&lt;/i&gt;: 1 submission' in page and 'queued' in page
    store.disconnect()
