"""infermesh/supervisor.py: the restart policy wired to real (tiny) child processes, on a fake clock."""

from __future__ import annotations

import re
import signal
import threading

import psutil
import pytest

from infermesh.restart_policy import Restart
from infermesh.supervisor import SupervisedGroup, Supervisor, describe_exit, exit_message


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def group(tmp_path):
    group = SupervisedGroup(tmp_path / "logs")
    yield group
    group.stop(timeout_s=2)


def started(tmp_path, group: SupervisedGroup, clock: Clock) -> tuple[Supervisor, list[str]]:
    """``steady`` sleeps; ``flaky`` appends its env var to a file and exits 3."""
    group.spawn("steady", ["sleep", "60"])
    group.spawn("flaky", ["sh", "-c", f'echo "$FLAVOUR" >> {tmp_path / "runs"}; exit 3'], {"FLAVOUR": "mint"})
    lines: list[str] = []
    return Supervisor(group, lines.append, clock=clock), lines


def child(group: SupervisedGroup, name: str):
    (found,) = [c for c in group.children if c.name == name]
    return found


def test_a_dead_child_is_logged_then_restarted_when_its_delay_has_passed(tmp_path, group):
    clock = Clock()
    supervisor, lines = started(tmp_path, group, clock)
    first = child(group, "flaky")
    first.popen.wait(5)
    clock.now += 0.25
    supervisor.poll()
    assert lines[0] == "flaky died (exit code 3) after 0.2 s up; restart #1 in 0.5 s"
    assert "last lines of" in lines[1]
    supervisor.poll()
    assert child(group, "flaky") is first  # not before its delay
    clock.now += 0.5
    supervisor.poll()
    again = child(group, "flaky")
    assert again is not first and lines[-1] == f"flaky restarted (pid {again.popen.pid})"
    again.popen.wait(5)
    assert (tmp_path / "runs").read_text().split() == ["mint", "mint"]  # same argv and env the second time
    assert [c.name for c in group.children] == ["steady", "flaky"]  # its place (the stop order) kept
    assert "restarting flaky" in (group.log_dir / "flaky.log").read_text()  # one log, marked


def test_a_crash_loop_never_touches_the_healthy_process(tmp_path, group):
    clock = Clock()
    supervisor, lines = started(tmp_path, group, clock)
    steady_pid = child(group, "steady").popen.pid
    for _ in range(8):
        child(group, "flaky").popen.wait(5)
        supervisor.poll()  # seen dead
        clock.now = supervisor.policy.next_due()
        supervisor.poll()  # restarted
    deaths = [line for line in lines if " died " in line]
    assert [re.search(r"restart #\d+ in (\S+ s)", line).group(1) for line in deaths] == [
        "0.5 s", "1 s", "2 s", "4 s", "8 s", "16 s", "30 s", "30 s"]
    assert deaths[-1].endswith("crash-looping (8 quick exits in a row): retrying every 30 s until it stays up")
    assert sum("last lines of" in line for line in lines) == 2  # the first exit and when the loop began
    assert child(group, "steady").popen.pid == steady_pid and child(group, "steady").alive()


def test_after_stop_a_death_is_not_restarted(tmp_path, group):
    clock = Clock()
    supervisor, lines = started(tmp_path, group, clock)
    stop = threading.Event()
    stop.set()
    supervisor.run(stop)  # returns at once: Ctrl-C came
    child(group, "flaky").popen.wait(5)
    clock.now += 100
    supervisor.poll()
    assert lines == [] and len(group.children) == 2


def test_a_signal_killed_child_is_named_by_its_signal(tmp_path, group):
    clock = Clock()
    supervisor, lines = started(tmp_path, group, clock)
    steady = child(group, "steady")
    steady.popen.send_signal(signal.SIGKILL)
    steady.popen.wait(5)
    clock.now += 12.34
    supervisor.poll()
    assert "steady died (killed by SIGKILL) after 12.3 s up; restart #1 in 0.5 s" in lines


@pytest.mark.parametrize("code, text", [(0, "exit code 0"), (1, "exit code 1"), (-9, "killed by SIGKILL"),
                                        (-15, "killed by SIGTERM"), (-99, "killed by signal 99")])
def test_exits_are_described(code, text):
    assert describe_exit(code) == text


def test_the_exit_line_names_process_cause_count_and_delay():
    restart = Restart(name="worker-1", exit_code=-9, uptime_s=3.0, delay_s=30.0, at=0.0, restarts=12, streak=9,
                      crash_looping=True)
    assert exit_message(restart) == ("worker-1 died (killed by SIGKILL) after 3.0 s up; restart #12 in 30 s; "
                                     "crash-looping (9 quick exits in a row): retrying every 30 s until it stays up")


def test_a_restart_first_kills_what_the_dead_child_left_in_its_process_group(tmp_path, group):
    pid_file = tmp_path / "grandchild"
    group.spawn("leaky", ["sh", "-c", f"sleep 60 & echo $! > {pid_file}; exit 3"])  # as vLLM's engine core
    clock = Clock()
    supervisor = Supervisor(group, lambda _line: None, clock=clock)
    child(group, "leaky").popen.wait(5)
    grandchild = psutil.Process(int(pid_file.read_text()))
    supervisor.poll()
    assert grandchild.is_running()  # the child's death left it behind
    clock.now += 0.5
    supervisor.poll()  # restarted: the old one's sleep is killed first
    grandchild.wait(5)  # TimeoutExpired if it were left running
    assert not grandchild.is_running()
