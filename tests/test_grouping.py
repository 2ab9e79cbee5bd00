"""The README's test command (`-n 2 --dist loadgroup`) runs the multi-process tests one at a time on
one worker (tests/conftest.py). That rests on pytest-xdist seeing the `xdist_group` marker the
conftest adds, which broke silently once (pytest 9.2 with pytest-xdist 3.8: both workers ran
multi-process jobs at once, and their deadlines were missed)."""

from __future__ import annotations

import pytest


@pytest.mark.slow
def test_a_multiprocess_test_runs_in_the_processes_group(request):
    # On a worker xdist sets option.loadgroup (its `dist` there is "no"); without xdist neither is set.
    if not getattr(request.config.option, "loadgroup", False):
        pytest.skip("not run with --dist loadgroup")
    assert request.node.nodeid.endswith("@processes"), request.node.nodeid
