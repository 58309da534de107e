"""serving/shares.py: the budgets glmvit-serve's HTTP workers hold together (pixels and bodies in flight), one
row of counts a worker in a file they all map, changed under its flock."""

import os
import signal
import subprocess
import sys
import threading

import pytest

fcntl = pytest.importorskip("fcntl", reason="flock is POSIX's (glmvit-serve's HTTP workers run on Linux and macOS)")

from glmvit_cupy.serving import shares  # noqa: E402
from glmvit_cupy.serving.shares import Shares, SharedBudget  # noqa: E402


def test_workers_budgets_add_up_to_one_server_wide_total(tmp_path, rng):
    path = str(tmp_path / "shares")
    shares.create(path, 3)
    total = int(rng.integers(1_000, 10_000))
    with Shares(path) as a, Shares(path) as b:  # two open files: two flocks, as in two processes
        pa, pb = SharedBudget(a, 0, "pixels", total), SharedBudget(b, 2, "pixels", total)
        ba = SharedBudget(a, 0, "bodies", 5)
        first = int(rng.integers(1, total))
        assert pa.take(first) and pa.used == pb.used == first and pa.own == first and pb.own == 0
        assert not pb.take(total - first + 1)  # one more than the server has left
        assert pb.take(total - first) and pa.used == total and pb.own == total - first
        assert not pa.take(1) and not pb.take(1)
        assert ba.take(5) and ba.used == 5 and not ba.take(1)  # a column of its own
        pa.give(first)
        assert pb.used == total - first and pb.take(first) and not pa.take(1)
        shares.clear(path, 2)  # the worker in slot 2 ended: what it held is free
        assert pa.used == 0 and pb.own == 0 and ba.used == 5 and pa.take(total)


def test_a_worker_killed_holding_the_lock_does_not_wedge_the_others(tmp_path):
    """The kernel drops a dead process's flock: a take waits while another process holds the lock, then goes on
    once that process is killed outright."""
    path = str(tmp_path / "shares")
    shares.create(path, 2)
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, os, sys, time\n"
                               f"fd = os.open({path!r}, os.O_RDWR)\nfcntl.flock(fd, fcntl.LOCK_EX)\n"
                               "print('held', flush=True)\ntime.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with Shares(path) as held:
            budget = SharedBudget(held, 1, "pixels", 10)
            got = []
            t = threading.Thread(target=lambda: got.append(budget.take(4)), daemon=True)
            t.start()
            t.join(0.3)
            assert t.is_alive() and not got  # the lock is the other process's
            os.kill(holder.pid, signal.SIGKILL)
            t.join(10)
            assert got == [True] and budget.used == 4
    finally:
        holder.kill()
        holder.wait()
