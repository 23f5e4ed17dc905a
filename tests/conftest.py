"""Shared test switches and markers. Tests that need an OS capability may skip only on a machine without it: the sandboxed grader
(bubblewrap, and cgroups for the memory-limit tests), QEMU's user-mode emulator (ONNX Runtime on an emulated
AVX2-only CPU) and Chromium (the leaderboard page in a headless browser); with TINYCOMP_REQUIRE_SANDBOX=1 (set by CI,
which installs them) a missing one is a failure."""
import os

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


def pytest_collection_modifyitems(config, items):
    """Markers that follow from what a test uses: Chromium makes it `browser`, QEMU `emulated`, the sandbox `grader`,
    and each of these `slow`; a test parametrised by a learner module's `key` belongs to that module."""
    for item in items:
        uses = set(getattr(item, 'fixturenames', ()))
        if 'chromium' in uses: item.add_marker('browser')
        if 'qemu_x86' in uses: item.add_marker('emulated')
        if uses & {'sandbox', 'tree_limit'}: item.add_marker('grader')
        key = getattr(getattr(item, 'callspec', None), 'params', {}).get('key')
        if isinstance(key, str) and key.isdigit(): item.add_marker(f'module{key}')
        if any(item.get_closest_marker(m) for m in ('browser', 'emulated', 'grader')): item.add_marker('slow')
