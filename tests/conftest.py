"""Every test session remembers its own kernel-path probes (conveyor/model/probe_cache.py): a
machine's earlier runs must not decide which paths this run's engines take, and every engine of
the session (subprocesses and Ray workers inherit the variable) takes the same ones."""

from __future__ import annotations

import os
import tempfile

import pytest

os.environ.setdefault("CONVEYOR_PROBES_DIR", tempfile.mkdtemp(prefix="conveyor-test-probes-"))


def pytest_collection_modifyitems(config, items):
    """`heavy` tests (long variants of tests that run by default: more model families, the other
    preemption mode, the other weight path) keep CI near its time budget; CONVEYOR_HEAVY_TESTS=1 runs them."""
    if os.environ.get("CONVEYOR_HEAVY_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="heavy: run with CONVEYOR_HEAVY_TESTS=1")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)
