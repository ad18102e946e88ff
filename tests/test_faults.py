"""Faults in real ``shardflow train --nproc 2`` runs (tiny model, gloo, short --timeout), injected with the test hook
``SHARDFLOW_FAULT`` of tests/faults.py (through shardflow.train.hooks): a rank SIGKILLed in the middle of a step or
during a checkpoint save, a rank that stalls outside communication, a second run into the directory of a running
one, SIGTERM to the launcher; and the launcher's rendezvous store and gloo's sockets listen on loopback only. Every
run is bounded (a watchdog kills it); exit times are measured from the moment the fault struck (the line the faulty
rank prints just before) to the launcher's exit."""

import fcntl
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import faults
import pytest
from conftest import children_of, patience

from shardflow.train import checkpoint

WORKER = str(Path(__file__).with_name("fault_worker.py"))
FAULTS = str(Path(__file__).with_name("faults.py"))
LIMIT = 120  # seconds a run may take on an idle machine to reach what a test waits for before the watchdog kills it
# (a hang is a failure, never a stuck suite); scaled by conftest.patience to the machine's load when a wait starts, and
# counted from each wait's start, so a start-up slowed by a busy machine does not eat into the wait for what follows
# (a SIGTERM's effect)


def alive(pid: int) -> bool:
    """Whether any thread of process ``pid`` still runs (its main thread may be a zombie while others finish)."""
    states = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
        except OSError:
            pass
    return any(state != "Z" for state in states)


class Run:
    """``shardflow train`` in the background; ``wait`` polls the rank logs for marker lines and records when each
    first appeared, and the exit time. The watchdog kills the run (and fails the test) when one ``wait`` lasts
    ``patience(LIMIT)`` seconds."""

    def __init__(self, argv: list[str], run: Path, fault: str | None = None):
        self.run = run
        env = {k: v for k, v in os.environ.items() if k != "SHARDFLOW_FAULT"}
        if fault:
            env["SHARDFLOW_FAULT"] = fault
        run.parent.mkdir(parents=True, exist_ok=True)
        self.out_path, self.err_path = run.parent / f"{run.name}.out", run.parent / f"{run.name}.err"
        with open(self.out_path, "w") as out, open(self.err_path, "w") as err:
            self.p = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        self.t0 = time.monotonic()
        self.seen: dict[str, float] = {}
        self.ranks: set[int] = set()

    def wait(self, marks: dict[str, tuple[str, str]] | None = None, until: str | None = None) -> None:
        """Poll until the process exits (or, with ``until``, until that mark is seen). ``marks``: name → (log file,
        text)."""
        marks = marks or {}
        began, limit = time.monotonic(), patience(LIMIT)
        while True:
            now = time.monotonic()
            self.ranks.update(children_of(self.p.pid))
            for name, (log, text) in marks.items():
                if name not in self.seen:
                    try:
                        if text in (self.run / log).read_text(errors="replace"):
                            self.seen[name] = now
                    except OSError:
                        pass
            if (until and until in self.seen) or self.p.poll() is not None:
                break
            if now - began > limit:
                self.p.kill()
                pytest.fail(f"run {self.run} still going after {limit:.0f} s of waiting; logs: {self.logs()}")
            time.sleep(0.05)
        if self.p.poll() is not None:
            self.end = time.monotonic()

    @property
    def stderr(self) -> str:
        return self.err_path.read_text()

    @property
    def stdout(self) -> str:
        return self.out_path.read_text()

    def logs(self) -> str:
        return "".join(f"--- {p.name}\n{p.read_text(errors='replace')[-2000:]}" for p in sorted(self.run.glob("*.log")))

    def since(self, mark: str) -> float:
        return self.end - self.seen[mark]

    def kill(self) -> None:
        if self.p.poll() is None:
            self.p.kill()
            self.p.wait()


@pytest.fixture
def start(train_argv):
    """``start(run, *flags, fault=None)``: ``python tests/faults.py train`` (tiny model, tp=2) in the background
    with the fault ``SHARDFLOW_FAULT=fault``."""

    def start_run(run: Path, *flags: str, fault: str | None = None) -> Run:
        return Run(train_argv(run, "--strategy", "tp", "--nproc", "2", *flags, entry=(FAULTS,)), run, fault)

    return start_run


def first_line(text: str) -> str:
    return text.splitlines()[0] if text else ""


# (a) ---------------------------------------------------------------------------------------------------------


def test_rank_killed_mid_step_takes_every_rank_down(tmp_path, start, read_metrics):
    timeout = 10
    r = start(tmp_path / "run", "--steps", "8", "--timeout", str(timeout), fault="kill:rank=1:step=3")
    try:
        r.wait(
            {
                "kill": ("rank1.log", "kills itself (SIGKILL) in the middle of step 3"),
                "peer": ("rank0.log", "rank 0 waited on token"),
            }
        )
    finally:
        r.kill()
    assert r.p.returncode == 1, r.stderr
    took = r.since("kill")
    print(f"\n(a) SIGKILL mid-step: launcher exited {took:.2f} s after the kill (timeout {timeout} s)")
    line = first_line(r.stderr)
    assert line.startswith("shardflow train: error: rank 1 was killed by signal 9 (SIGKILL) (others: rank 0: 4)"), (
        r.stderr
    )
    assert f"its log {r.run / 'rank1.log'} ends with:" in line
    assert "peer" in r.seen  # rank 0 failed on its pending communication, naming it, in one paragraph (status 4)
    peer = (r.run / "rank0.log").read_text()
    assert "a member left (Connection " in peer and "Traceback" not in peer, peer  # closed or reset by peer
    assert r.ranks and not any(alive(pid) for pid in r.ranks), r.ranks
    steps = [m["step"] for m in read_metrics(r.run)]
    assert steps == [1, 2], steps  # step 3 never completed


# (b) ---------------------------------------------------------------------------------------------------------


def test_rank_killed_during_a_save_leaves_the_last_complete_checkpoint_and_resume_matches(
    tmp_path, start, read_metrics
):
    common = ["--steps", "6", "--checkpoint-every", "2", "--timeout", "10"]
    root = tmp_path / "bad" / "checkpoints"
    ref = start(tmp_path / "ref", *common)
    bad = start(tmp_path / "bad", *common, fault="kill_in_save:rank=1:step=4")
    try:
        bad.wait({"kill": ("rank1.log", "while saving the checkpoint of step 4")})
        ref.wait()
    finally:
        bad.kill()
        ref.kill()
    assert ref.p.returncode == 0, ref.stderr + ref.logs()
    assert bad.p.returncode == 1, bad.stderr
    print(f"\n(b) SIGKILL during the save of step 4: launcher exited {bad.since('kill'):.2f} s after the kill")
    assert first_line(bad.stderr).startswith("shardflow train: error: rank 1 was killed by signal 9 (SIGKILL)")
    # rank 0 lost its peer in the middle of the save: a peer failure, not its disk's ("free space ...")
    peer = (bad.run / "rank0.log").read_text().splitlines()[-1]
    assert (
        peer.startswith(
            f"shardflow train: error: rank 0 saving {root / 'step_4.tmp'} (the complete checkpoints "
            f"before it stay): a member left (Connection"
        )
        and "free space" not in peer
    ), peer
    assert sorted(p.name for p in root.iterdir()) == ["step_2", "step_4.tmp"]
    assert not (root / "step_4.tmp" / checkpoint.MARKER).exists()
    ck = checkpoint.read(root / "step_2")  # every file checked against its recorded size and sha256
    assert ck.step == 2 and checkpoint.newest(root) == root / "step_2"

    res = start(bad.run, *common, "--resume")
    try:
        res.wait()
    finally:
        res.kill()
    assert res.p.returncode == 0, res.stderr + res.logs()
    assert f"resumed from {root / 'step_2'}" in res.stdout
    got, want = read_metrics(bad.run), read_metrics(ref.run)
    assert [m["step"] for m in got] == [1, 2, 3, 4, 5, 6]
    for a, b in zip(got, want):
        # same strategy and executor, state restored bit for bit, same batches: float32 rounding at most
        assert abs(a["loss"] - b["loss"]) < 1e-5, (a, b)
    assert abs(got[-1]["val_loss"] - want[-1]["val_loss"]) < 1e-5
    assert [n for n, _ in checkpoint.complete_steps(root)] == [2, 4, 6]
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]  # the next save removed the leftover


# (c) ---------------------------------------------------------------------------------------------------------


def test_a_second_run_into_a_running_runs_directory_is_refused_and_sigterm_stops_every_rank(
    tmp_path, start, train_here
):
    # a communication timeout beyond the watchdog's limit: waiting one out would fail the test
    r = start(
        tmp_path / "run", "--steps", "100000", "--eval-every", "100000", "--timeout", str(round(2 * patience(LIMIT)))
    )
    try:
        r.wait({"running": ("rank0.log", "step     3/")}, until="running")
        assert r.p.poll() is None, r.stderr + r.logs()
        r.ranks.update(children_of(r.p.pid))
        assert len(r.ranks) == 2, r.ranks
        # the launcher holds the run directory's lock (its ranks inherited it): a second run into it (here, in the
        # test's process) is refused
        second = train_here(r.run, "--strategy", "single", "--nproc", "1", "--steps", "2")
        assert second.returncode == 2 and second.stderr == (
            f"shardflow train: error: run directory {r.run} is in use by another shardflow train (PID {r.p.pid} on "
            f"{socket.gethostname()} holds {r.run / '.lock'}); wait for that run to end or stop it, or pass another "
            f"--run-dir\n"
        ), second.stderr
        assert r.p.poll() is None  # the first run goes on
        r.p.send_signal(signal.SIGTERM)
        r.seen["sigterm"] = time.monotonic()
        r.wait()
    finally:
        r.kill()
    took = r.since("sigterm")
    print(f"\n(c) SIGTERM to the launcher: exited {took:.2f} s later")
    assert r.p.returncode == 130, r.stderr
    err = r.stderr
    assert err.startswith("shardflow train: interrupted (SIGTERM); every rank stopped; ") and err.count("\n") == 1, err
    assert "Traceback" not in err
    assert not any(alive(pid) for pid in r.ranks), r.ranks
    for rank in (0, 1):
        assert f"rank {rank}: interrupted" in (r.run / f"rank{rank}.log").read_text()


def test_ranks_stop_when_the_launcher_is_killed_and_free_the_run_directory(tmp_path, start):
    """SIGKILL to the launcher (which can forward nothing): the kernel sends each rank SIGTERM (prctl's parent-death
    signal), so no rank trains on orphaned; the run directory's lock, which the ranks inherited, is free once they
    are gone, and only complete checkpoints are left beside at most a ``.tmp``."""
    # no log line after the first step: a rank writes nothing to the dead launcher's pipes (which would end it)
    limit = patience(LIMIT)
    r = start(
        tmp_path / "run",
        "--steps",
        "100000",
        "--eval-every",
        "100000",
        "--log-every",
        "100000",
        "--timeout",
        str(round(2 * limit)),  # beyond the waits below: only the parent-death signal can stop the ranks within them
        "--checkpoint-every",
        "2",
    )
    root = r.run / "checkpoints"
    try:
        while not (root / "step_2").is_dir() and r.p.poll() is None and time.monotonic() - r.t0 < limit:
            time.sleep(0.05)
        r.ranks.update(children_of(r.p.pid))
        assert len(r.ranks) == 2, r.ranks
        r.p.kill()
        r.p.wait()
        killed, freed = time.monotonic(), False
        with open(r.run / ".lock") as f:
            while not freed and time.monotonic() - killed < limit:
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)  # BlockingIOError while any rank holds it
                    freed = True
                except BlockingIOError:
                    time.sleep(0.05)
        took = time.monotonic() - killed
        while any(alive(pid) for pid in r.ranks) and time.monotonic() - killed < limit:
            time.sleep(0.05)  # a rank that has let the lock go may still be finishing its exit
        stopped = not any(alive(pid) for pid in r.ranks)
    finally:
        for pid in r.ranks:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    print(f"\n(c) SIGKILL to the launcher: the run directory's lock free {took:.2f} s later")
    assert freed  # the ranks stopped (they would train on for ever: 100000 steps, no peer lost)
    assert stopped
    done = [p for p in root.iterdir() if not p.name.endswith(".tmp")]
    assert done and all(checkpoint.read(p).step == int(p.name.removeprefix("step_")) for p in done), done


ORPHAN = """
import os, signal, subprocess, sys, time
from shardflow.runtime.launch import LAUNCHER_PID, stop_with_launcher
if sys.argv[1] == "launcher":  # start a rank, tell the test its pid, then wait to be killed
    env = dict(os.environ, **{LAUNCHER_PID: str(os.getpid())})
    rank = subprocess.Popen([sys.executable, "-c", sys.argv[2], "rank"], env=env)
    time.sleep(60)
else:
    signal.signal(signal.SIGTERM, lambda *_: (print("rank: SIGTERM", flush=True), os._exit(0)))
    stop_with_launcher()
    print("rank: running", flush=True)
    time.sleep(60)
    print("rank: still running after 60 s", flush=True)
"""


def test_stop_with_launcher_asks_the_kernel_for_sigterm_when_the_launcher_dies(tmp_path):
    """The mechanism under the test above, alone: a rank that called stop_with_launcher gets SIGTERM the moment its
    launcher is SIGKILLed (prctl's parent-death signal) — not at its next write to a closed pipe."""
    out = tmp_path / "out.txt"
    with open(out, "w") as f:
        launcher = subprocess.Popen([sys.executable, "-c", ORPHAN, "launcher", ORPHAN], stdout=f, stderr=f)
    try:
        t0 = time.monotonic()
        while "rank: running" not in out.read_text() and time.monotonic() - t0 < patience(LIMIT):
            time.sleep(0.05)
        launcher.kill()
        launcher.wait()
        killed = time.monotonic()
        while "rank: SIGTERM" not in out.read_text() and time.monotonic() - killed < 30:
            time.sleep(0.02)
    finally:
        launcher.kill()
    # the rank sleeps 60 s: SIGTERM within the 30 s waited is the kernel's, at the launcher's death
    assert out.read_text() == "rank: running\nrank: SIGTERM\n", out.read_text()


# (d) ---------------------------------------------------------------------------------------------------------


def test_a_stalled_rank_is_named_not_the_peer_that_timed_out_waiting_on_it(tmp_path, start):
    timeout, stall = 5, 9  # the stalled rank wakes after its peer has given up, and fails at once too
    r = start(tmp_path / "run", "--steps", "6", "--timeout", str(timeout), fault=f"stall:rank=1:step=2:seconds={stall}")
    try:
        r.wait(
            {"stall": ("rank1.log", "stalls for 9 s before step 2"), "timeout": ("rank0.log", "rank 0 waited on token")}
        )
    finally:
        r.kill()
    assert r.p.returncode == 1, r.stderr
    waited = r.seen["timeout"] - r.seen["stall"]
    print(
        f"\n(d) stall: rank 0's timeout {waited:.2f} s into the stall (timeout {timeout} s); launcher exited "
        f"{r.since('stall'):.2f} s into it"
    )
    err = r.stderr
    # the first line names rank 1, which stopped answering, not rank 0, which gave up waiting on it (status 3); rank
    # 1 woke to find rank 0 gone (status 4)
    assert first_line(err).startswith(
        "shardflow train: error: rank 1 stopped answering: rank 0 gave up waiting on it "
        "after the communication timeout, then rank 1 exited with status 4 (others: "
        "rank 0: 3)"
    ), err
    # and quotes rank 0's last line: the timeout names rank, token, operation, shape and group
    assert (
        "rank 0's log ends with: shardflow train: error: rank 0 waited on token 0 (all_reduce of float32[8, 16, "
        "16], group [0, 1]): no answer within the timeout"
    ) in err, err
    assert "Traceback" not in err
    assert not any(alive(pid) for pid in r.ranks), r.ranks


# (e) ---------------------------------------------------------------------------------------------------------


def test_a_stopped_rank_and_a_silent_killed_rank_are_named(tmp_path, start):
    """From outside, once both runs train: rank 1 of one run SIGSTOPped (it never answers again: rank 0 waits out
    --timeout, the launcher kills rank 1 after its grace period), rank 1 of the other SIGKILLed (its log
    empty, or ending with its join's progress where joining took over 2 s). Each first line names rank 1."""
    timeout = 6  # the ranks also join within it: 4 processes at once on 2 busy cores take seconds
    runs = {
        how: start(tmp_path / how, "--steps", "100000", "--eval-every", "100000", "--timeout", str(timeout))
        for how in ("stop", "kill")
    }
    try:
        for how, r in runs.items():
            r.wait({"running": ("rank0.log", "step     2/")}, until="running")
            assert r.p.poll() is None, r.stderr + r.logs()
            ranks = sorted(children_of(r.p.pid))
            assert len(ranks) == 2, ranks
            os.kill(ranks[1], signal.SIGSTOP if how == "stop" else signal.SIGKILL)  # launched in rank order
            r.seen["fault"] = time.monotonic()
        for how in ("kill", "stop"):  # the killed run ends first
            runs[how].wait()
    finally:
        for r in runs.values():
            r.kill()
    stop, kill = runs["stop"], runs["kill"]
    print(
        f"\n(e) SIGSTOP: launcher exited {stop.since('fault'):.1f} s later (timeout {timeout} s, grace "
        f"{timeout + 10} s); SIGKILL: {kill.since('fault'):.1f} s later"
    )
    assert first_line(stop.stderr).startswith(
        "shardflow train: error: rank 1 stopped answering: rank 0 gave up waiting on it after the communication "
        "timeout, then rank 1 was still stuck when the launcher killed it (others: rank 0: 3)"
    ), stop.stderr
    # rank 0 exits 4 (a member left) when gloo sees rank 1's sockets close during the communication it waits on, and
    # 3 (waited out the timeout) when they closed before it began (gloo then reports a timeout: seen when the step's
    # first communication, the vocabulary-parallel embedding's all-reduce, starts right after the kill)
    # rank 1's log is empty, unless joining the process group took over 2 s (a busy machine): then its last line is
    # the join's progress, and the error shows it (found by the whole suite under load)
    line = first_line(kill.stderr)
    assert re.fullmatch(
        rf"shardflow train: error: rank 1 was killed by signal 9 \(SIGKILL\) \(others: rank 0: [34]\); its log "
        rf"{re.escape(str(kill.run / 'rank1.log'))} (is empty|ends with:)",
        line,
    ), kill.stderr
    if line.endswith("ends with:"):
        assert "waiting for the other processes to join the process group" in kill.stderr, kill.stderr


# safety --------------------------------------------------------------------------------------------------------


def test_rendezvous_store_and_gloo_listen_on_loopback_only(tmp_path):
    from shardflow.runtime.launch import describe_failure, launch

    res = launch([sys.executable, WORKER, str(tmp_path)], 2, tmp_path / "logs", grace_s=20, echo_rank0=False)
    assert res.ok, describe_failure(res, tmp_path / "logs")
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"listeners{rank}.json").read_text())
        assert seen["store"], seen  # the launcher's store listens on MASTER_PORT ...
        for kind, addresses in seen.items():  # ... and it, the launcher, and each rank's gloo, on loopback alone
            for a in addresses:
                assert a.startswith("127.") or a in ("::1", "::ffff:127.0.0.1"), (kind, a, seen)


FORKING_LAUNCHER = """
import json, os, sys
from pathlib import Path
from shardflow.runtime.launch import launch

out = Path(sys.argv[1])


def rank_main():
    r = int(os.environ["RANK"])
    print(f"rank {r} runs the entry", flush=True)
    seen = {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS", "SHARDFLOW_LAUNCHED")}
    seen.update(ppid=os.getppid(), session=os.getsid(0) == os.getpid())
    (out / f"rank{r}.json").write_text(json.dumps(seen))
    if r == 1:
        raise RuntimeError("rank 1 fails on purpose")
    return 0


nproc = os.cpu_count()  # one thread per rank: the launcher forks
res = launch([sys.executable, "-c", "raise SystemExit(7)"], nproc, out / "logs", grace_s=20, echo_rank0=False,
             rank_main=[rank_main])
print(json.dumps({"pid": os.getpid(), "codes": res.returncodes, "failed": res.failed}))
"""


def test_forked_ranks_run_the_entry_in_sessions_of_their_own_and_report_like_new_ones(tmp_path):
    """With one thread per rank, the launcher forks its ranks to run the entry it is given (not the command, which
    would exit 7): each in its own session, as a child of the launcher, with torchrun's environment, its output in its
    log; a rank's traceback is its status 1, named as the root cause."""
    p = subprocess.run(
        [sys.executable, "-c", FORKING_LAUNCHER, str(tmp_path)], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stderr
    got = json.loads(p.stdout.splitlines()[-1])
    nproc = os.cpu_count()
    assert got["codes"] == [0, 1] + [0] * (nproc - 2) and got["failed"] == [1, 1], got
    for r in range(nproc):
        seen = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert seen == dict(
            RANK=str(r),
            WORLD_SIZE=str(nproc),
            OMP_NUM_THREADS="1",
            SHARDFLOW_LAUNCHED="1",
            ppid=got["pid"],
            session=True,
        )
        log = (tmp_path / "logs" / f"rank{r}.log").read_text()
        assert log.startswith(f"rank {r} runs the entry\n"), log
    assert "RuntimeError: rank 1 fails on purpose" in (tmp_path / "logs" / "rank1.log").read_text()


def test_malformed_fault_hook_fails_before_any_process(capsys, tmp_path, train_argv, monkeypatch):
    monkeypatch.setenv("SHARDFLOW_FAULT", "explode:rank=1")
    run = tmp_path / "run"
    assert faults.main(train_argv(run, entry=(FAULTS,))[2:]) == 2  # [python, faults.py, train, ...]
    out, err = capsys.readouterr()
    assert not out and err == (
        "shardflow train: error: SHARDFLOW_FAULT='explode:rank=1': write kill:rank=R:step=N, "
        "stall:rank=R:step=N:seconds=S or kill_in_save:rank=R[:step=N] (a test hook; unset it "
        "for normal runs)\n"
    )
    assert not run.exists()


@pytest.mark.parametrize(
    "codes, seen, killed, root, waited_by",
    [
        ((-9, 4), {0: 1, 1: 1}, set(), (0, -9), None),  # killed by a signal (not the launcher's) before its peer
        ((4, 1), {0: 2, 1: 1}, set(), (1, 1), None),  # its own error (a traceback); its peer lost it
        ((3, 4), {0: 1, 1: 5}, set(), (1, 4), 0),  # rank 1 stalled; rank 0 waited out; rank 1 woke to find it gone
        ((3, -9), {0: 1, 1: 9}, {1}, (1, -9), 0),  # rank 1 stopped for good: the launcher killed it
        ((3, 3, 4, 3), {0: 1, 1: 2, 2: 4, 3: 1}, set(), (2, 4), 0),  # 4 ranks: the others waited out, some later
        ((3, 3), {0: 1, 1: 1}, set(), (0, 3), None),  # both waited out at once: no one else to blame
        ((0, 0), {0: 1, 1: 1}, set(), None, None),
    ],
)
def test_root_cause_from_statuses_and_exit_order(codes, seen, killed, root, waited_by):
    """The launcher's rule, without processes: statuses (3: waited out the timeout, 4: a peer left), the look at
    which each rank was seen exited, the ranks the launcher killed."""
    from shardflow.runtime.launch import root_cause

    assert root_cause(codes, seen, killed) == (root, waited_by)
