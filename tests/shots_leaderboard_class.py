"""Screenshots of the leaderboard page of a class of 14 (not collected by pytest): made-up measurements written straight
into a store (near-identical entries, a model with random weights at about 10 %, long names, an implausibly fast one),
the page, and full-page screenshots in headless Chromium at desktop (1280 px) and phone (390 px) widths, for a person to
look at. Run from the repository: `python tests/shots_leaderboard_class.py [FOLDER]` (a few seconds); it prints the folder."""
import os
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_leaderboard_page import class_store  # noqa: E402
from tinycomp.leaderboard.page import render_page  # noqa: E402


def main(out):
    out.mkdir(parents=True, exist_ok=True)
    store = class_store(Path(tempfile.mkdtemp(prefix='tinycomp-class14-')) / 'lb.db')
    page = out / 'leaderboard.html'
    page.write_text(render_page(store), encoding='utf-8')
    from playwright.sync_api import sync_playwright
    chromium = os.environ.get('TINYCOMP_CHROMIUM') or shutil.which('chromium') or shutil.which('chromium-browser')
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=['--no-sandbox'] if os.geteuid() == 0 else [])
        try:
            for name, width, phone in (('desktop', 1280, False), ('phone', 390, True)):
                tab = browser.new_page(viewport={'width': width, 'height': 900}, is_mobile=phone, has_touch=phone)
                tab.goto(page.as_uri())
                tab.screenshot(path=str(out / f'leaderboard-{name}.png'), full_page=True)
                tab.locator('.plots').screenshot(path=str(out / f'leaderboard-{name}-plots.png'))
        finally: browser.close()
    store.disconnect()
    for f in sorted(out.iterdir()): print(f)
    return out


if __name__ == '__main__':
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(tempfile.mkdtemp(prefix='leaderboard-shots-')))
