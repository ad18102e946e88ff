"""No process a test starts outlives its module (tests/conftest.py's ``reap_processes``): a rank whose launcher
died, stopped with SIGSTOP in its own session, is adopted by the test process and killed and reaped."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from conftest import adopt_orphans, children_of, proc_state, reap_children

# a launcher that starts a rank in its own session and exits; the rank stops itself (as a SIGSTOPped rank of a failed
# fault test was left behind, re-parented to init) and would sleep for an hour
LAUNCHER = """
import subprocess, sys
rank = subprocess.Popen([sys.executable, "-c", "import os, signal, time; os.kill(os.getpid(), signal.SIGSTOP); "
                         "time.sleep(3600)"], start_new_session=True, stdout=subprocess.DEVNULL,
                        stderr=subprocess.DEVNULL)
print(rank.pid, flush=True)
"""


def test_an_orphaned_stopped_rank_is_adopted_killed_and_reaped():
    adopt_orphans()
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=60, check=True)
    rank = int(launcher.stdout)
    deadline = time.monotonic() + 60
    while proc_state(rank) != "T" and time.monotonic() < deadline:  # it stops itself
        time.sleep(0.02)
    assert proc_state(rank) == "T"
    assert rank in children_of(os.getpid())  # its launcher is gone: the rank is this process's now, not init's
    assert rank in reap_children()
    assert proc_state(rank) is None  # killed and reaped: not even a zombie
    assert not children_of(os.getpid())
