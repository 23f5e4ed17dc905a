"""Shared test switches. Tests of the sandboxed grader may skip only on a machine without bubblewrap (or without
cgroups, for the memory-limit tests); with TINYCOMP_REQUIRE_SANDBOX=1 (set by CI) a missing sandbox is a failure."""
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
