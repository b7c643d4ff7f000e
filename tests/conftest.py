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
    preemption mode, the other weight path) keep CI near its time budget; CONVEYOR_HEAVY_TESTS=1 runs them.
    CONVEYOR_HYPOTHESIS_SCALE=N runs N times each property test's examples, fresh (no example database)."""
    scale = float(os.environ.get("CONVEYOR_HYPOTHESIS_SCALE", "1"))
    if scale != 1:
        for item in items:
            _scale_examples(item, scale)
    if os.environ.get("CONVEYOR_HEAVY_TESTS") == "1":
        return
    skip = pytest.mark.skip(reason="heavy: run with CONVEYOR_HEAVY_TESTS=1")
    for item in items:
        if "heavy" in item.keywords:
            item.add_marker(skip)


def _scale_examples(item, scale: float) -> None:
    """A long search for the rare schedules that CI's default example counts miss (the scheduler's
    property tests found two such bugs at 12-170x). Hypothesis keeps a test's settings on the test
    function (@given tests) or on a state machine's TestCase class."""
    from hypothesis import settings

    fn = getattr(item, "obj", None)
    owner = getattr(item, "cls", None)
    if fn is not None and hasattr(fn, "hypothesis"):
        target, attr = getattr(fn, "__func__", fn), "_hypothesis_internal_use_settings"
    elif owner is not None and isinstance(getattr(owner, "settings", None), settings):
        target, attr = owner, "settings"
    else:
        return
    old = getattr(target, attr, None) or settings()
    if getattr(target, "_conveyor_scaled", False):
        return
    setattr(target, attr, settings(old, max_examples=max(1, int(old.max_examples * scale)), database=None))
    target._conveyor_scaled = True
