"""No process a test starts outlives its module (tests/conftest.py's ``reap_processes``): a rank whose launcher
died, stopped with SIGSTOP in its own session, is adopted by the test process and killed and reaped; nor a suite
interrupted mid-test (``pytest_sessionfinish``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import adopt_orphans, children_of, patience, proc_state, reap_children

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
    launcher = subprocess.run(
        [sys.executable, "-c", LAUNCHER], capture_output=True, text=True, timeout=patience(60), check=True
    )
    rank = int(launcher.stdout)
    deadline = time.monotonic() + patience(60)
    while proc_state(rank) != "T" and time.monotonic() < deadline:  # it stops itself
        time.sleep(0.02)
    assert proc_state(rank) == "T"
    assert rank in children_of(os.getpid())  # its launcher is gone: the rank is this process's now, not init's
    assert rank in reap_children()
    assert proc_state(rank) is None  # killed and reaped: not even a zombie
    assert not children_of(os.getpid())


# a test that starts a process in its own session (Ctrl-C at a terminal does not reach it), says its pid, and waits
STUCK = """
import os, subprocess, sys, time

def test_stuck():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"], start_new_session=True)
    with open(os.environ["CHILD_PID"], "w") as f:
        f.write(str(child.pid))
    time.sleep(3600)
"""


def _default_sigint() -> None:
    """SIGINT's default action in the child, as at a terminal: a process started in the background by a
    non-interactive shell (``cmd &``, as a CI script may start the suite) ignores SIGINT, and an ignored signal
    stays ignored across exec — Python then installs no KeyboardInterrupt for it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.parametrize("workers", [[], ["-n", "1"]], ids=["in-process", "xdist"])
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_suite_interrupted_mid_test_reaps_what_the_test_started(tmp_path, sig, workers):
    """Ctrl-C (SIGINT) or a CI job's SIGTERM to pytest while a test runs: the module's teardown never runs, but the
    session's end (tests/conftest.py's ``pytest_sessionfinish``) kills and reaps the process the test started."""
    (tmp_path / "test_stuck.py").write_text(STUCK)
    said = tmp_path / "child.pid"
    path = os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])
    env = dict(os.environ, PYTHONPATH=path, CHILD_PID=str(said))
    pytest_ = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "conftest",
            "-p",
            "no:cacheprovider",
            *workers,
            "--basetemp",
            str(tmp_path / "base"),
            str(tmp_path / "test_stuck.py"),
        ],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=_default_sigint,
    )
    deadline = time.monotonic() + patience(120)
    while not said.exists() and pytest_.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert said.exists(), pytest_.communicate(timeout=patience(60))[0]
    child = int(said.read_text())
    assert proc_state(child) not in (None, "Z")
    pytest_.send_signal(sig)
    out = pytest_.communicate(timeout=patience(60))[0]
    assert "KeyboardInterrupt" in out, out
    assert proc_state(child) is None, f"pid {child} outlived pytest: {out}"
