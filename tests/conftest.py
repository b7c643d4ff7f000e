"""Every test session remembers its own kernel-path probes (conveyor/model/probe_cache.py): a
machine's earlier runs must not decide which paths this run's engines take, and every engine of
the session (subprocesses and Ray workers inherit the variable) takes the same ones."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("CONVEYOR_PROBES_DIR", tempfile.mkdtemp(prefix="conveyor-test-probes-"))
