"""Signals, a closed output and crash-resume (issue 15, items 5 and 5b, and the crash test).

Real parts throughout: the real CLI in real processes, real signals (SIGINT, SIGTERM, SIGKILL and
pairs and triples of them), real pipes whose reader is gone, the tiny random Llama and real
Parquet parts. The only injected pieces are markers and a slow (or stuck) model call, patched
into the child process by the test, never into the library.

The crash test forks its runs from a *fork server*: a process that has imported torch,
transformers and coalescence once, so that each of the many killed runs starts in about a second
instead of five; every run is still a separate process, killed by real signals, that loads the
model, opens the archive, takes its ``flock`` lock and runs the unmodified ``main()``.
"""

from __future__ import annotations

import fcntl
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import anyio
import pytest

from coalescence._interrupts import STOPPED, Interrupts, Stopped, exit_code, is_broken_pipe
from coalescence.archive import read_manifest, read_rows
from coalescence.cli import main

USER = (
    "The Eiffel Tower was completed in 1889. Big Ben was finished in 1859. The Colosseum opened in 80. "
    "The Opera House opened in 1973. The bridge opened in 1937. Lisbon has sardines. Paris has a tower."
)
CONVERSATION = {
    "messages": [
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": USER},
        {"role": "assistant", "content": "It was completed in 1889."},
    ]
}
N = 8  # players with --unit sentence: 256 coalitions
TOL = 1e-4  # nats: fp32, batches of other composition after a resume
BOUND = 10.0  # seconds: any sequence of signals ends the process within this (issue 15, 5b)

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}

# Patched into a child process: markers written to file descriptor MARKS ("PID loading", "PID scored
# ROWS", "PID appended", "PID stuck"), a slow model call (DELAY s), and call number STUCK (1-based,
# 0 = none) sleeping for a minute. The CLI itself is unmodified.
PATCH = """
import os, sys, time, faulthandler, signal
faulthandler.register(signal.SIGUSR1, all_threads=True)
import torch
torch.set_num_threads(1)
from coalescence import cli
from coalescence.app import explain as explain_run, replay as replay_run
from coalescence.archive.writer import RunArchive
from coalescence.backends.hf import HFBackend

def mark(text):
    os.write(MARKS, f"{os.getpid()} {text}\\n".encode())

_score, _load, _append = HFBackend.score, explain_run.load_model, RunArchive.append
calls = [0]

def score(self, requests):
    calls[0] += 1
    if calls[0] == STUCK:
        mark("stuck")
        time.sleep(60)
    time.sleep(DELAY)
    out = _score(self, requests)
    mark(f"scored {len(requests)}")
    return out

def load(settings, source, **loaded):
    mark("loading")
    return _load(settings, source, **loaded)

def append(self, row):
    added = _append(self, row)
    if added:
        mark("appended")
    return added

HFBackend.score, RunArchive.append = score, append
explain_run.load_model = replay_run.load_model = load  # the name each run calls
"""


def child_script(*, marks: str, delay: float, stuck: int = 0) -> str:
    """A ``python -c`` script: PATCH, then the CLI's ``main()`` as the program (``argv`` None)."""
    return (
        f"import os\nMARKS, DELAY, STUCK = {marks}, {delay}, {stuck}\n{PATCH}\n"
        'sys.argv = ["coalescence", *sys.argv[1:]]\nsys.exit(cli.main())\n'
    )


# The fork server: reads one JSON command per line on stdin ({"argv", "out", "err", "delay"}),
# forks a child that runs main() with PATCH applied (its stdout and stderr into the files "out"
# and "err", its markers on the server's stdout), and answers on stdout "started PID", then
# "exited PID CODE" while the child is still a zombie (so that no signal can reach a reused pid),
# and reaps it when told "reap".
FORK_SERVER = """
import json, os, sys, traceback
MARKS, DELAY, STUCK = 1, 0.0, 0
exec(compile(PATCH, "patch", "exec"))
import coalescence.engine, coalescence.attribution.estimators, pyarrow.parquet
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM, PreTrainedTokenizerFast
for line in sys.stdin:
    command = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            DELAY = command["delay"]
            MARKS = os.dup(1)
            os.dup2(os.open(command["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 1)
            os.dup2(os.open(command["err"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
            sys.argv = ["coalescence", *command["argv"]]
            code = cli.main()
            sys.stdout.flush()
            sys.stderr.flush()
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
        os._exit(code)
    print("started", pid, flush=True)
    info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)
    code = info.si_status if info.si_code == os.CLD_EXITED else -info.si_status
    print("exited", pid, code, flush=True)
    assert sys.stdin.readline().strip() == "reap"
    os.waitpid(pid, 0)
"""


def explain_args(input_path: Path, model: Path, run_dir: Path, *extra: str) -> list[str]:
    return [
        "explain", str(input_path), "--model", str(model), "--unit", "sentence", "--method", "exact",
        "--batch-size", "4", "--flush-rows", "8", "--archive", str(run_dir), "--no-progress", *extra,
    ]  # fmt: skip


@pytest.fixture(scope="module")
def conversation(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("input") / "conversation.json"
    path.write_text(json.dumps(CONVERSATION), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def reference(tmp_path_factory, conversation, tiny_model_dir):
    """An uninterrupted run: its values (nats) and its utilities by coalition key."""
    tmp = tmp_path_factory.mktemp("reference")
    out = tmp / "out.json"
    assert main(explain_args(conversation, tiny_model_dir, tmp / "run", "--out", str(out))) == 0
    rows = read_rows(tmp / "run")
    utilities = dict(zip(rows["coalition_key"].to_pylist(), rows["utility"].to_pylist(), strict=True))
    assert len(utilities) == 2**N
    return values(json.loads(out.read_text())), utilities


def values(doc: dict) -> list[float]:
    return [p["value"] for p in doc["players"]]


def lock_is_free(run_dir: Path) -> bool:
    """Whether this process can take the run's ``flock`` lock now (nobody, alive, holds it)."""
    with open(run_dir / ".lock", "a+") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False
        fcntl.flock(fh, fcntl.LOCK_UN)
        return True


def status(run_dir: Path) -> str:
    return read_manifest(run_dir)["runs"][0]["status"]


def assert_archive_matches(run_dir: Path, reference, why: str = "") -> float:
    """Every coalition exactly once, each utility equal to the uninterrupted run's."""
    rows = read_rows(run_dir, dedupe=False)
    keys = rows["coalition_key"].to_pylist()
    assert len(keys) == len(set(keys)) == 2**N, why
    got = dict(zip(keys, rows["utility"].to_pylist(), strict=True))
    assert got.keys() == reference[1].keys(), why
    worst = max(abs(got[k] - reference[1][k]) for k in got)
    assert worst <= TOL, f"{why}: utilities differ by up to {worst} nats"
    return worst


# -- the mechanism, in-process, on real asyncio and trio loops ------------------------------------
@pytest.mark.anyio
async def test_a_signal_cancels_the_run_inside_the_loop_after_the_shielded_call(anyio_backend):
    interrupts = Interrupts()
    assert interrupts.install()
    finished = []

    def model_call() -> None:  # the collator's worker-thread call, signalled while it runs
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.2)
        finished.append(True)

    async def run() -> str:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(model_call)
        await anyio.sleep(30)  # cancelled here, by the watcher, not by an exception from the handler
        return "not cancelled"

    try:
        with interrupts.deferred():
            result = await interrupts.run(run)
    finally:
        interrupts.restore()
    assert result is STOPPED
    assert finished == [True]
    assert interrupts.signum == signal.SIGTERM and exit_code(interrupts.signum) == 143


@pytest.mark.anyio
async def test_a_run_error_comes_out_unwrapped(anyio_backend):
    interrupts = Interrupts()

    async def run() -> None:
        raise ValueError("the run's own error")

    with pytest.raises(ValueError, match="the run's own error"):
        await interrupts.run(run)


def test_outside_a_run_the_first_signal_raises_at_once():
    before = signal.getsignal(signal.SIGINT)  # Python's default handler, or SIG_IGN in a background job
    interrupts = Interrupts()
    assert interrupts.install()
    try:
        with pytest.raises(Stopped) as caught:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)  # the handler raises at the next bytecode
        assert caught.value.signum == signal.SIGINT and exit_code(caught.value.signum) == 130
    finally:
        interrupts.restore()
    assert signal.getsignal(signal.SIGINT) is before


def test_broken_pipes_are_found_inside_exception_groups():
    assert is_broken_pipe(BrokenPipeError())
    assert is_broken_pipe(ExceptionGroup("run", [ValueError(), ExceptionGroup("inner", [BrokenPipeError()])]))
    assert not is_broken_pipe(ExceptionGroup("run", [OSError(5, "EIO")]))


# -- a closed output (item 5) ---------------------------------------------------------------------
def run_into_closed_pipe(args: list[str], *, stderr_closed_after: bytes | None = None, child: str | None = None):
    """Run the CLI with a stdout whose reader is gone before the first write.

    With ``stderr_closed_after``, stderr is a pipe too, read until that text appears, then closed.
    """
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone: every write to stdout fails with EPIPE
    command = [sys.executable, "-c", child, *args] if child else [sys.executable, "-m", "coalescence", *args]
    try:
        if stderr_closed_after is None:
            done = subprocess.run(command, stdout=write_end, stderr=subprocess.PIPE, env=ENV, timeout=120)
            return done.returncode, done.stderr.decode()
        proc = subprocess.Popen(command, stdout=write_end, stderr=subprocess.PIPE, env=ENV)
        seen = b""
        while stderr_closed_after not in seen:
            chunk = proc.stderr.read1(4096)
            assert chunk, f"the child ended before writing {stderr_closed_after!r}: {seen.decode()}"
            seen += chunk
        proc.stderr.close()  # the reader of stderr goes away mid-run
        proc.wait(timeout=120)
        return proc.returncode, seen.decode()
    finally:
        os.close(write_end)


def test_explain_into_a_closed_stdout_exits_141_with_the_archive_complete(tmp_path, conversation, tiny_model_dir, reference):
    run_dir = tmp_path / "run"
    code, err = run_into_closed_pipe(explain_args(conversation, tiny_model_dir, run_dir))
    assert code == 141, err
    assert err == ""  # no traceback, no message: quiet, like a process killed by SIGPIPE
    assert status(run_dir) == "complete" and lock_is_free(run_dir)
    assert_archive_matches(run_dir, reference)
    # a rerun resumes with nothing missing
    out = tmp_path / "out.json"
    assert main(explain_args(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == 0
    assert max(abs(a - b) for a, b in zip(values(doc), reference[0], strict=True)) <= TOL


@pytest.mark.parametrize(
    "command",
    [["archive", "info"], ["archive", "info", "--json"], ["archive", "compact"], ["replay", "--method", "exact,loo"]],
    ids=lambda c: " ".join(c),
)
def test_every_command_into_a_closed_stdout_exits_141_quietly(command, tmp_path, conversation, tiny_model_dir, reference):
    run_dir = tmp_path / "run"
    assert main(explain_args(conversation, tiny_model_dir, run_dir)) == 0
    args = [*command[:2], str(run_dir), *command[2:]] if command[0] == "archive" else [command[0], str(run_dir), *command[1:]]
    code, err = run_into_closed_pipe(args)
    assert code == 141, err
    assert err == ""
    assert lock_is_free(run_dir)
    assert_archive_matches(run_dir, reference)  # compact merged the parts; nothing lost or doubled


def test_a_progress_bar_on_a_stderr_closed_mid_run_stops_like_sigterm(tmp_path, conversation, tiny_model_dir, reference):
    run_dir = tmp_path / "run"
    # stderr is a pipe, not a terminal: plain progress lines, here as often as the run advances
    args = [a for a in explain_args(conversation, tiny_model_dir, run_dir) if a != "--no-progress"] + ["--progress-every", "0.001"]
    child = child_script(marks="os.open(os.devnull, os.O_WRONLY)", delay=0.03)
    code, err = run_into_closed_pipe(args, stderr_closed_after=b"coalescence: coalitions", child=child)
    assert code == 141, err
    assert "Traceback" not in err
    assert status(run_dir) == "interrupted" and lock_is_free(run_dir)  # closed as on SIGTERM
    on_disk = read_rows(run_dir).num_rows
    assert 0 < on_disk < 2**N
    out = tmp_path / "out.json"
    assert main(explain_args(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == 2**N - on_disk
    assert_archive_matches(run_dir, reference)
    assert max(abs(a - b) for a, b in zip(values(doc), reference[0], strict=True)) <= TOL


# -- a second signal while the first one's stop waits (item 5b) ------------------------------------
@pytest.mark.parametrize(
    ("signals", "code"),
    [((signal.SIGTERM, signal.SIGTERM), 143), ((signal.SIGINT, signal.SIGTERM, signal.SIGINT), 130)],
    ids=["TERM,TERM: the watchdog", "INT,TERM,INT: the third signal"],
)
def test_a_stuck_model_call_still_ends_within_the_bound(signals, code, tmp_path, conversation, tiny_model_dir, reference):
    """The orderly stop waits for the model call in flight; here it never ends, so only the
    escalation can end the process: the archive is left as after kill -9 and a resume completes."""
    run_dir = tmp_path / "run"
    read_marks, write_marks = os.pipe()
    child = child_script(marks=str(write_marks), delay=0.0, stuck=5)
    proc = subprocess.Popen(
        [sys.executable, "-c", child, *explain_args(conversation, tiny_model_dir, run_dir)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, pass_fds=(write_marks,),
    )  # fmt: skip
    os.close(write_marks)
    with os.fdopen(read_marks) as marks:
        for line in marks:
            if line.split()[1] == "stuck":
                break
        else:
            pytest.fail(f"the child ended early: {proc.stderr.read().decode()}")
        sent = time.monotonic()
        for signum in signals:
            proc.send_signal(signum)
            time.sleep(0.1)
        try:
            _, err = proc.communicate(timeout=BOUND)
        except subprocess.TimeoutExpired:
            proc.kill()
            pytest.fail(f"still running {BOUND} s after the first signal: {proc.communicate()[1].decode()}")
    assert time.monotonic() - sent <= BOUND
    err = err.decode()
    assert proc.returncode == code, err
    assert "Traceback" not in err and "exiting now" in err
    assert status(run_dir) == "running"  # as after kill -9: never closed...
    assert lock_is_free(run_dir)  # ...but the flock lock died with the process
    flushed = read_rows(run_dir).num_rows
    assert 0 < flushed < 2**N and flushed % 8 == 0  # complete parts only: the buffered rows are lost
    out = tmp_path / "out.json"
    assert main(explain_args(conversation, tiny_model_dir, run_dir, "--out", str(out))) == 0
    doc = json.loads(out.read_text())
    assert doc["n_evaluations"] == 2**N - flushed
    assert_archive_matches(run_dir, reference)


# -- the crash test ---------------------------------------------------------------------------------
class ForkServer:
    """A process that forks CLI runs on request (see FORK_SERVER); its output read by a thread."""

    def __init__(self, tmp: Path) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"PATCH = {PATCH!r}\n" + FORK_SERVER],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=open(tmp / "fork-server.err", "wb"),
            env=ENV, text=True, bufsize=1,
        )  # fmt: skip
        self.lines: queue.Queue[list[str]] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line.split())
        self.lines.put(["eof"])

    def send(self, text: str) -> None:
        self.proc.stdin.write(text + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=30)


class Run:
    """One forked CLI run: its pid, the markers it wrote so far and its exit code once it ended."""

    def __init__(self, server: ForkServer, command: dict) -> None:
        self.server = server
        server.send(json.dumps(command))
        words = server.lines.get(timeout=60)
        assert words[0] == "started", words
        self.pid = int(words[1])
        self.loading = False
        self.scored = self.scored_rows = self.appended = 0
        self.exited: int | None = None

    def take(self, timeout: float) -> bool:
        """Consume one line (a marker or the exit); ``False`` when none came within ``timeout``."""
        try:
            words = self.server.lines.get(timeout=max(0.0, timeout))
        except queue.Empty:
            return False
        assert words[0] != "eof", "the fork server died"
        if words[0] == "exited":
            self.exited = int(words[2])
        elif words[1] == "loading":
            self.loading = True
        elif words[1] == "scored":
            self.scored += 1
            self.scored_rows += int(words[2])
        elif words[1] == "appended":
            self.appended += 1
        return True

    def wait_for(self, ready, timeout: float = 120) -> None:
        end = time.monotonic() + timeout
        while self.exited is None and not ready() and time.monotonic() < end:
            self.take(end - time.monotonic())

    def sleep(self, seconds: float) -> None:
        """Sleep, reading markers meanwhile."""
        end = time.monotonic() + seconds
        while self.exited is None and time.monotonic() < end:
            self.take(end - time.monotonic())


SIGNALS = {"KILL": signal.SIGKILL, "TERM": signal.SIGTERM, "INT": signal.SIGINT}


def kill_plan(rng: random.Random) -> tuple[str, float, list[tuple[str, float]]]:
    """Where to strike (``load``: from the model load on; ``run``: after a first model call), how long
    after, and which signals with which gaps (single signals, pairs and triples; gaps of 0 to 1 s)."""
    phase = rng.choice(["load", "run", "run", "run"])
    delay = rng.uniform(0, 1.5) if phase == "load" else rng.uniform(0, 0.6)
    n = rng.choice([1, 1, 2, 2, 2, 3])
    names = [rng.choice(["KILL", "TERM", "TERM", "INT", "INT"]) for _ in range(n)]
    gaps = [rng.choice([0.0, rng.uniform(0, 0.05), rng.uniform(0, 0.3), rng.uniform(0, 1.0)]) for _ in range(n)]
    return phase, round(delay, 3), [(name, round(gap, 3)) for name, gap in zip(names, gaps, strict=True)]


def test_random_kills_and_signal_pairs_then_resume_equal_an_uninterrupted_run(tmp_path, conversation, tiny_model_dir, reference):
    """At least 24 kills at random moments (SIGKILL, SIGTERM, SIGINT, pairs and triples of them),
    each followed by a resume of the same archive. Every process ends within the bound, no lock
    outlives its process, no coalition is ever written twice, a graceful stop flushes every row the
    archive took, and every archive, once complete, holds each coalition once with the uninterrupted
    run's utilities and values (several archives: a fresh one when a run completes).

    ``COALESCENCE_CRASH_SEED`` replays a seed's plan; ``COALESCENCE_CRASH_KILLS`` sets the number of kills.
    """
    seed = int(os.environ.get("COALESCENCE_CRASH_SEED", random.randrange(2**32)))
    kills_wanted = int(os.environ.get("COALESCENCE_CRASH_KILLS", "24"))
    rng = random.Random(seed)
    server = ForkServer(tmp_path)
    completed, kills, history, worst_seen = 0, 0, [], 0.0
    run_dir = tmp_path / "run0"
    try:
        for cycle in range(10 * kills_wanted):
            plan = kill_plan(rng) if kills < kills_wanted else None
            why = f"crash test seed {seed} (COALESCENCE_CRASH_SEED={seed} replays it), run {cycle}, plan {plan}; before: {history[-5:]}"
            before = read_rows(run_dir).num_rows if (run_dir / "manifest.json").exists() else 0
            err_path, out_path = tmp_path / f"c{cycle}.err", tmp_path / f"c{cycle}.json"
            run = Run(server, {
                "argv": explain_args(conversation, tiny_model_dir, run_dir, "--out", str(out_path)),
                "out": str(tmp_path / f"c{cycle}.out"), "err": str(err_path), "delay": 0.03,
            })  # fmt: skip
            names, sent, first_sent, in_run = [], [], None, False
            if plan is not None:
                phase, delay, signals = plan
                run.wait_for(lambda: run.loading if phase == "load" else run.scored > 0)  # noqa: B023
                run.sleep(delay)
                for name, gap in signals:
                    if run.exited is not None:
                        break  # a zombie awaits its reaping: nothing more to send
                    in_run = in_run or run.scored > 0
                    os.kill(run.pid, SIGNALS[name])
                    names.append(name)
                    sent.append(time.monotonic())
                    first_sent = first_sent or sent[-1]
                    run.sleep(gap)
            deadline = (first_sent + BOUND) if first_sent else time.monotonic() + 120
            run.wait_for(lambda: False, deadline - time.monotonic())  # noqa: B023
            if run.exited is None:
                os.kill(run.pid, signal.SIGUSR1)  # faulthandler: every thread's stack into the stderr file
                time.sleep(1)
                os.kill(run.pid, signal.SIGKILL)
                run.wait_for(lambda: False, 30)  # noqa: B023
                pytest.fail(f"still running {BOUND} s after the first signal: {why}\n{err_path.read_text()}")
            server.send("reap")
            err, code = err_path.read_text(), run.exited
            history.append((cycle, names, code, f"{before} + {run.appended} rows taken ({run.scored_rows} scored)"))
            assert "Traceback" not in err, f"{why}\n{err}"
            if names and code != 0:
                kills += 1
                # the exit code is the first signal's; signals sent a few ms apart may land in
                # either order (the kernel hands each to any thread), so either one's code is right
                near = [name for name, at in zip(names, sent, strict=True) if at - sent[0] < 0.05]
                allowed = {exit_code(SIGNALS[name]) for name in near if name != "KILL"}
                if "KILL" in names:
                    allowed.add(-signal.SIGKILL)
                assert code in allowed, f"exit {code}, expected one of {allowed}: {why}\n{err}"
            else:
                assert code == 0, f"{why}\n{err}"  # not struck, or struck only once the output was out
            if (run_dir / "manifest.json").exists():
                assert lock_is_free(run_dir), f"the lock outlived its process: {why}"
                keys = read_rows(run_dir, dedupe=False)["coalition_key"].to_pylist()
                assert len(keys) == len(set(keys)), f"a coalition written twice: {why}"
                assert len(keys) >= before, f"flushed rows lost: {why}"
                if in_run and code in (0, 130, 143) and "exiting now" not in err:
                    # an orderly stop: every row the archive took is on disk, the run closed
                    assert status(run_dir) in ("interrupted", "complete"), why
                    assert len(keys) == before + run.appended, f"{len(keys)} rows on disk: {why}"
            if code == 0:
                assert status(run_dir) == "complete", why
                worst_seen = max(worst_seen, assert_archive_matches(run_dir, reference, why))
                doc = json.loads(out_path.read_text())
                worst = max(abs(a - b) for a, b in zip(values(doc), reference[0], strict=True))
                assert worst <= TOL, f"values differ by {worst} nats: {why}"
                worst_seen = max(worst_seen, worst)
                completed += 1
                if kills >= kills_wanted:
                    break
                run_dir = tmp_path / f"run{completed}"  # a fresh archive for the next kills
    finally:
        server.close()
    assert kills >= kills_wanted and completed >= 1, history
    print(
        f"crash test seed {seed}: {kills} kills in {len(history)} runs, {completed} archives completed and "
        f"checked, largest difference from the uninterrupted run {worst_seen:.2e} nats"
    )
    print("\n".join(map(str, history)))


# -- two quick signals: the first one's exit status, whatever the gap (issue 24, item 10) ----------
@pytest.mark.parametrize(
    "pair", [(signal.SIGINT, signal.SIGTERM), (signal.SIGINT, signal.SIGINT)], ids=["INT,TERM", "INT,INT"]
)
def test_two_quick_signals_exit_with_the_first_signals_code(pair, tmp_path, conversation, tiny_model_dir):
    """Once the orderly stop has started, a second signal may shorten it (docs/runs.md: 5 s more) but never
    changes the exit status: 130 for a first SIGINT, 143 for a first SIGTERM (128 + the first
    signal), never a death by the second signal's default action, and one stop line."""
    first, second = pair
    want = 128 + int(first)
    for attempt, gap in enumerate((0.0, 0.05, 0.15)):  # before, during and after the stop's end
        run_dir = tmp_path / f"run{attempt}"
        read_marks, write_marks = os.pipe()
        child = child_script(marks=str(write_marks), delay=0.02)
        proc = subprocess.Popen(
            [sys.executable, "-c", child, *explain_args(conversation, tiny_model_dir, run_dir)],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=ENV, pass_fds=(write_marks,),
        )  # fmt: skip
        os.close(write_marks)
        with os.fdopen(read_marks) as marks:
            for line in marks:
                if line.split()[1] == "scored":
                    break
            else:
                pytest.fail(f"the child ended early: {proc.stderr.read().decode()}")
            proc.send_signal(first)
            time.sleep(gap)
            proc.send_signal(second)
            try:
                _, err = proc.communicate(timeout=BOUND + 5)
            except subprocess.TimeoutExpired:
                proc.kill()
                pytest.fail(f"still running: {proc.communicate()[1].decode()}")
        err = err.decode()
        expected = want
        if gap == 0.0 and first != second:
            # Sent back to back, the two signals are pending together: the kernel may hand them to two
            # threads, whose C handlers then set Python's flags in either order, so the process may
            # see the second one sent first. Its exit status must then follow what it saw first, which
            # its 'a second signal (NAME)' line names.
            seen_second = re.search(r"a second signal \((SIG\w+)\)", err)
            if seen_second and seen_second.group(1) == first.name:
                expected = 128 + int(second)
        assert proc.returncode == expected, f"gap {gap} s: exit {proc.returncode}\n{err}"
        stops = [ln for ln in err.splitlines() if ln.startswith(("coalescence: interrupted", "coalescence: terminated"))]
        assert len(stops) <= 1 and "Traceback" not in err, err
        assert lock_is_free(run_dir)
