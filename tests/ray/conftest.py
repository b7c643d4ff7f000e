"""Ray's own clocks, widened for a busy machine: Ray Serve marks its HTTP proxy dead after three health
checks of 10 s (and a readiness check of 5 s) go unanswered, which two CPU-bound processes beside the
suite on 2 vCPUs made happen (issue 59's proof run: every test_ray_serve test errored at serve.start).
Set before any Ray process starts, so the head, its workers and their actors all read them."""

import os

for name, seconds in (("RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S", "60"), ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "60"),
                      ("RAY_SERVE_PROXY_HEALTH_CHECK_PERIOD_S", "20")):
    os.environ.setdefault(name, seconds)
