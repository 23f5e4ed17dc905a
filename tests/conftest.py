"""Shared test switches and markers. Tests that need an OS capability may skip only on a machine without it: the sandboxed grader
(bubblewrap, and cgroups for the memory-limit tests), QEMU's user-mode emulator (ONNX Runtime on an emulated
AVX2-only CPU), an x86 CPU with AVX2 (the tiled float kernel) and Chromium (the leaderboard page in a headless browser); with TINYCOMP_REQUIRE_SANDBOX=1 (set by CI,
which installs them) a missing one is a failure. And `writes_only`: a command writes nothing outside its `--out`."""
import os
import re

import pytest


def _need(what, available, problem):
    if available: return
    if os.environ.get('TINYCOMP_REQUIRE_SANDBOX') == '1':
        pytest.fail(f"{what} is required here (TINYCOMP_REQUIRE_SANDBOX=1) but unavailable: {problem}")
    pytest.skip(f"{what} unavailable on this machine: {problem}")


@pytest.fixture
def sandbox():
    "Skip (or, in CI, fail) unless learner code can run in the OS sandbox here."
    from tinycomp.course.sandbox import bwrap_path, sandbox_problem
    _need('the OS sandbox (bubblewrap)', bwrap_path(), sandbox_problem())


@pytest.fixture
def tree_limit(sandbox):
    "Skip (or, in CI, fail) unless a cgroup can limit a whole process tree here."
    from tinycomp.course.sandbox import sandbox_status
    _need('a cgroup memory limit for a process tree', sandbox_status()['tree_limit'], 'needs root or a delegated cgroup')


@pytest.fixture
def float_tiles():
    "Skip (or, in CI, fail) unless this CPU runs module 02's register-tiled float kernel (x86 with AVX2 and FMA)."
    from tinycomp.tiles import FLOAT_LANES
    _need('the register-tiled float kernel', FLOAT_LANES, 'needs an x86 CPU with AVX2 and FMA, or AVX-512')


@pytest.fixture
def qemu_x86():
    "Skip (or, in CI, fail) unless QEMU's user-mode x86-64 emulator can run this Python on an emulated CPU."
    import platform, shutil
    _need("QEMU's user-mode emulator (apt-get install qemu-user)", shutil.which('qemu-x86_64') and platform.machine() == 'x86_64',
          'qemu-x86_64 not found, or not an x86-64 machine')


@pytest.fixture
def chromium():
    "The path of the system's Chromium (Debian: apt-get install chromium); skip (or, in CI, fail) where there is none."
    import shutil
    path = os.environ.get('TINYCOMP_CHROMIUM') or shutil.which('chromium') or shutil.which('chromium-browser')
    _need('headless Chromium (apt-get install chromium)', path, 'no chromium on PATH (or set TINYCOMP_CHROMIUM)')
    return path


class WritesOnly:
    "What a command writes in an empty current folder: see the fixture `writes_only`."
    def __init__(self, cwd):
        self.cwd, self.before = cwd, set()

    def files(self) -> set:
        return {p.relative_to(self.cwd).as_posix() for p in self.cwd.rglob('*') if not p.is_dir()}

    def start(self):
        "Forget what is there now (inputs a test put in the folder)."
        self.before = self.files()

    def check(self, stdout, *outs) -> list:
        """Assert that every file written since `start` is inside `outs` (the command's `--out` folders, or the single
        files it was asked for, relative to the current folder) and that the paths printed in `stdout` are exactly the
        files written; returns them."""
        written = sorted(self.files() - self.before)
        assert written, 'the command wrote nothing'
        inside = lambda f, o: f == o or f.startswith(o.rstrip('/') + '/')
        outside = [f for f in written if not any(inside(f, o) for o in outs)]
        assert not outside, f"written outside {outs}: {outside}"
        printed = set()
        for o in outs:
            tail = r'/[\w.\-]*[\w\-]' if (self.cwd / o).is_dir() else ''
            printed |= set(re.findall(rf"(?<![\w/.\-]){re.escape(o.rstrip('/'))}{tail}(?![\w/\-])", stdout))
        assert printed == set(written), f"printed {sorted(printed)}, wrote {written}"
        self.start()
        return written


@pytest.fixture(scope='session')
def task(tmp_path_factory):
    "A small leaderboard task: task.npz with the first 64 digits of the test split, and digits_cnn as baseline.npz."
    import numpy as np
    from tinycomp import io as tio
    from tinycomp.data import load_digits
    from tinycomp.models import load_pretrained
    d = tmp_path_factory.mktemp('task')
    X, y = load_digits('test')
    np.savez(d / 'task.npz', X=X[:64], y=y[:64])
    tio.save(load_pretrained('digits_cnn'), d / 'baseline.npz')
    return d


@pytest.fixture
def writes_only(tmp_path, monkeypatch):
    """An empty current folder for a command (`tmp_path / 'cwd'`); `writes_only.check(stdout, 'tinycomp_x')` then asserts
    that the command wrote only inside its `--out` folder and printed exactly the paths of the files it wrote."""
    cwd = tmp_path / 'cwd'
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return WritesOnly(cwd)


def pytest_collection_modifyitems(config, items):
    """Markers that follow from what a test uses: Chromium makes it `browser`, QEMU `emulated`, the sandbox `grader`,
    and each of these `slow`; a test parametrised by a learner module's `key` belongs to that module. The first-hour
    test is `slow` too: it runs the learner's install, which has no pytest, so it cannot import a marker itself."""
    for item in items:
        if item.path.name == 'test_first_hour.py': item.add_marker('slow')
        uses = set(getattr(item, 'fixturenames', ()))
        if 'chromium' in uses: item.add_marker('browser')
        if 'qemu_x86' in uses: item.add_marker('emulated')
        if uses & {'sandbox', 'tree_limit'}: item.add_marker('grader')
        key = getattr(getattr(item, 'callspec', None), 'params', {}).get('key')
        if isinstance(key, str) and key.isdigit(): item.add_marker(f'module{key}')
        if any(item.get_closest_marker(m) for m in ('browser', 'emulated', 'grader')): item.add_marker('slow')
