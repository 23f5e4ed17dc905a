"""The course website (`tinycomp site`, tinycomp.course.site): built once from the instructor notebooks, then read in
headless Chromium with every request that leaves the site's folder blocked and recorded. Every learner page shows its
code, every module at least one figure that loaded, the exercise stubs and no solution; the navigation of the landing
page reaches every part; the offline search finds a function defined on one page only; MathJax renders without a
network. Screenshots of the landing page and of module 04a's page go to a folder the test prints (and to
/tmp/site_shots with TINYCOMP_SHOTS=1)."""
import json
import os
import re
import shutil
import subprocess
import sys
import time
from html.parser import HTMLParser
from pathlib import Path

import pytest

from tinycomp.cli import main as cli_main
from tinycomp.course import site as site_mod
from tinycomp.course.notebooks import cell_source, find_exercises, learner_modules, make_notebook, read_notebook

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
MODULES = learner_modules(ROOT / 'nbs')
PARTS = {p.stem: key for key, m in MODULES.items() for p in m.parts}


@pytest.fixture(scope='module')
def site(tmp_path_factory):
    "The site as `tinycomp site --out DIR` builds it (two notebooks at a time, as on this two-core machine)."
    site_mod.require_site()
    cwd = tmp_path_factory.mktemp('site')
    start = time.monotonic()
    r = subprocess.run([sys.executable, '-m', 'tinycomp.cli', 'site', '--out', 'tinycomp_site', '--jobs', '2'],
                       cwd=cwd, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    took = time.monotonic() - start
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    print(f"\n`tinycomp site` built the course website in {took:.0f} s ({os.cpu_count()} cores, --jobs 2)")
    return cwd / 'tinycomp_site', r.stdout


class Loads(HTMLParser):
    "The URLs a page loads by itself: scripts, stylesheets, icons and fonts, images, frames (not the links one follows)."
    def __init__(self):
        super().__init__()
        self.urls = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        if tag in ('script', 'img', 'iframe', 'source', 'audio', 'video', 'embed') and a.get('src'): self.urls.append(a['src'])
        if tag == 'link' and a.get('href') and a.get('rel') != 'canonical': self.urls.append(a['href'])
        if tag == 'object' and a.get('data'): self.urls.append(a['data'])


def solution_lines(path) -> dict:
    "`{exercise name: substantial lines of its solution}` of an instructor notebook, whitespace normalised."
    nb = read_notebook(path)
    out = {}
    for ex in find_exercises(nb):
        lines = cell_source(nb['cells'][ex.cell]).splitlines()[ex.begin + 1:ex.end]
        out[ex.name] = [n for n in (' '.join(l.split()) for l in lines) if len(n) >= 24 and not n.startswith('#')]
    return out


def test_the_site_has_a_page_per_notebook_and_loads_nothing_from_outside(site):
    out, stdout = site
    pages = ['index'] + list(PARTS)
    for name in pages:
        assert (out / f"{name}.html").is_file(), name
        assert str(Path('tinycomp_site') / f"{name}.html") in stdout, name          # each page is printed
    external = []
    for html in out.rglob('*.html'):
        parser = Loads()
        parser.feed(html.read_text(encoding='utf-8'))
        external += [(html.name, u) for u in parser.urls if re.match(r'(https?:)?//', u)]
    assert not external, external[:10]
    for css in out.rglob('*.css'):                                  # fonts and imports come from the site's folder too
        found = re.findall(r'(?:url\(|@import)\s*["\']?((?:https?:)?//[^"\')\s]+)', css.read_text(encoding='utf-8'))
        assert not found, (css.name, found[:3])
    assert (out / 'searchindex.js').is_file()                        # the search index is a static file


def test_a_failing_notebook_stops_the_build_naming_it_and_its_cell(tmp_path):
    root = tmp_path / 'course'
    (root / 'nbs').mkdir(parents=True)
    shutil.copy(ROOT / 'settings.ini', root / 'settings.ini')
    (root / 'nbs' / 'index.ipynb').write_text(json.dumps(make_notebook([('markdown', '# Home')])))
    (root / 'nbs' / '01a_demo.ipynb').write_text(json.dumps(make_notebook(
        [('markdown', '# 01a Demo'), ('code', 'x = 1'), ('code', "#| slow\nraise ValueError('never run')"),
         ('code', "values = {}\nvalues['missing']")])))
    with pytest.raises(site_mod.SiteError, match=r"nbs/01a_demo\.ipynb, cell 3 \(`values = \{\}`\) raised KeyError: 'missing'"):
        site_mod.build_site(tmp_path / 'out', root=root, jobs=2, timeout=120, log=lambda s: None)
    assert not (tmp_path / 'out').exists()


def test_without_the_site_extra_the_command_says_what_to_install(monkeypatch, tmp_path, capsys):
    find_spec = site_mod.find_spec
    monkeypatch.setattr(site_mod, 'find_spec', lambda m: None if m == 'sphinx_book_theme' else find_spec(m))
    assert cli_main(['site', '--out', str(tmp_path / 'out')]) == 2
    err = capsys.readouterr().err
    assert "sphinx_book_theme not installed" in err and "pip install -e '.[site]'" in err and 'Traceback' not in err
    assert not (tmp_path / 'out').exists()


# ---------------------------------------------------------------- in headless Chromium
def browse(chromium, p):
    "A browser whose every request outside file:// is blocked and recorded (the list `blocked`), and a page of it."
    args = ['--no-sandbox'] if os.geteuid() == 0 else []             # Chromium refuses root without it
    browser = p.chromium.launch(executable_path=chromium, args=args + ['--host-resolver-rules=MAP * ~NOTFOUND'])
    blocked = []
    context = browser.new_context(viewport={'width': 1280, 'height': 900})

    def route(r):
        if r.request.url.startswith('file://'): r.continue_()
        else: blocked.append(r.request.url); r.abort()
    context.route('**/*', route)
    context.on('request', lambda req: None if req.url.startswith(('file://', 'data:', 'blob:')) else blocked.append(req.url))
    return browser, context.new_page(), blocked


def page_url(out, name) -> str: return (out / f"{name}.html").resolve().as_uri()


def test_every_module_page_in_headless_chromium(site, chromium, tmp_path):
    from playwright.sync_api import sync_playwright
    out, _ = site
    shots = tmp_path / 'screenshots'
    shots.mkdir()
    figures = {key: 0 for key in MODULES}
    with sync_playwright() as p:
        browser, page, blocked = browse(chromium, p)
        try:
            assert page.goto(page_url(out, 'index')).ok
            page.wait_for_load_state('networkidle')
            assert 'tinycomp test 01' in page.inner_text('main') and 'pip install -e ".[learn]"' in page.inner_text('main')
            nav = page.inner_text('nav.bd-docs-nav')
            for mod in MODULES.values(): assert site_mod.module_title(mod) in nav, (mod.key, nav)
            links = page.eval_on_selector_all('a[href]', 'as => as.map(a => a.href)')
            targets = {u.split('#')[0] for u in links}
            page.screenshot(path=str(shots / 'landing.png'), full_page=True)
            for name, key in PARTS.items():
                url = page_url(out, name)
                assert url in targets, f"the landing page has no link to {name}"     # reached from the landing page
                assert page.goto(url).ok
                page.wait_for_load_state('networkidle')
                main = page.inner_text('main')
                assert page.locator('div.cell_input').count() > 3, name            # the code
                for ex_name, number in stubs(name):                              # the exercises, as the learner sees them
                    assert f'raise NotImplementedError("Exercise {key}.{number} {ex_name}: not done yet.' in \
                        ' '.join(main.split()), (name, ex_name)
                code = ' '.join(' '.join(page.eval_on_selector_all('div.cell_input', 'es => es.map(e => e.innerText)')).split())
                assert 'BEGIN SOLUTION' not in main and 'END SOLUTION' not in main, name
                for ex_name, lines in solution_lines(ROOT / 'nbs' / f"{name}.ipynb").items():
                    shown = [l for l in lines if l in code]
                    assert 2 * len(shown) < len(lines) or not lines, (name, ex_name, shown)
                imgs = page.eval_on_selector_all('.cell_output img', 'is => is.map(i => [i.complete, i.naturalWidth])')
                assert all(ok and w > 0 for ok, w in imgs), (name, imgs)            # every figure loaded
                figures[key] += len(imgs) + page.locator('.cell_output svg').count()
                if '$' in ''.join(cell_source(c) for c in read_notebook(ROOT / 'nbs' / f"{name}.ipynb")['cells']
                                  if c.get('cell_type') == 'markdown'):
                    page.wait_for_selector('mjx-container', state='attached', timeout=15_000)      # MathJax rendered, offline
                if name == '04a_quantization': page.screenshot(path=str(shots / '04a_quantization.png'), full_page=True)
            page.goto(page_url(out, 'index'))                                  # a click through the navigation
            page.click('nav.bd-docs-nav >> text=part a: the numbers')
            page.wait_for_url(page_url(out, '04a_quantization'))
        finally: browser.close()
    assert all(figures.values()), f"modules without a figure: {[k for k, n in figures.items() if not n]}"
    assert blocked == [], f"requests that left the site: {blocked[:10]}"
    for png in ('landing.png', '04a_quantization.png'): assert (shots / png).stat().st_size > 20_000
    if os.environ.get('TINYCOMP_SHOTS'):
        dest = Path('/tmp/site_shots'); dest.mkdir(exist_ok=True)
        for png in shots.iterdir(): shutil.copy(png, dest / png.name)
    print(f"\nscreenshots: {shots}" + (" (and /tmp/site_shots)" if os.environ.get('TINYCOMP_SHOTS') else ''))


_STUBS = {}

def stubs(name) -> list:
    "`[(exercise name, number)]` of part `name`, numbered across its module as the student notebooks number them."
    if not _STUBS:
        for key, mod in MODULES.items():
            n = 0
            for p in mod.parts:
                exs = find_exercises(read_notebook(p), first=n + 1)
                _STUBS[p.stem] = [(e.name, e.number) for e in exs]
                n += len(exs)
    return _STUBS[name]


def defined_on_one_page(out) -> tuple:
    "`(function name, page)`: a function defined in a part whose name appears on no other page."
    text = {h.stem: h.read_text(encoding='utf-8') for h in out.glob('*.html') if h.stem in PARTS}
    for name in sorted(PARTS):
        for fn in sorted(set(re.findall(r'\bdef ([a-z][a-z0-9]*_[a-z0-9_]{6,})\(', ' '.join(
                cell_source(c) for c in read_notebook(ROOT / 'nbs' / f"{name}.ipynb")['cells'])))):
            if fn in text[name] and not any(fn in t for n, t in text.items() if n != name): return fn, name
    raise AssertionError('no function name appears on one page only')


def test_the_offline_search_finds_a_function_on_its_page(site, chromium):
    from playwright.sync_api import sync_playwright
    out, _ = site
    word, where = defined_on_one_page(out)
    with sync_playwright() as p:
        browser, page, blocked = browse(chromium, p)
        try:
            assert page.goto(page_url(out, 'search') + f"?q={word}").ok
            page.wait_for_selector('#search-results ul.search li a', timeout=30_000)
            hits = page.eval_on_selector_all('#search-results ul.search li a', 'as => as.map(a => a.href)')
            assert hits and {h.split('#')[0].split('?')[0] for h in hits} == {page_url(out, where)}, (word, hits)
            page.click('#search-results ul.search li a')
            page.wait_for_load_state('load')
            assert page.url.split('?')[0].split('#')[0] == page_url(out, where) and word in page.inner_text('main')
        finally: browser.close()
    assert blocked == [], blocked
    print(f"\nsearch: {word!r} -> {where}.html")
