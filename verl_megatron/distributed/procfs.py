"""What /proc says about processes of this machine: their state, CPU time and children (the stall
watchdog's view of its own rank and of ranks on the same machine). Linux only."""

from __future__ import annotations

import os
import resource
import socket

__all__ = ["boot_id", "children", "cpu_by_process", "proc_state", "same_process", "stat_fields"]


def boot_id() -> str:
    """This machine's running kernel (the same for every process of the machine)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def proc_state(pid: int) -> tuple[str, str] | None:
    """(state letter, start time) of a process of this machine, None when there is none."""
    fields = stat_fields(pid)
    return None if fields is None else (fields[0], fields[19])


def stat_fields(pid: int) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (state, ppid, ...), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def children(pid: int) -> list[int]:
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return []
    children: list[int] = []
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(c) for c in f.read().split()]
        except FileNotFoundError:  # no CONFIG_PROC_CHILDREN (or the thread just ended): scan /proc
            pids = [int(p) for p in os.listdir("/proc") if p.isdigit()]
            return [p for p in pids if (stat_fields(p) or ["", ""])[1] == str(pid)]
        except OSError:
            continue
    return children


def cpu_by_process(pid: int, own_thread_s: float) -> dict[int, float]:
    """CPU seconds of process ``pid`` (less ``own_thread_s``, the calling thread's) and of each of
    its live descendants, read from /proc."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    cpu = {pid: usage.ru_utime + usage.ru_stime - own_thread_s}
    tick = os.sysconf("SC_CLK_TCK")
    parents = [pid]
    while parents:
        for child in children(parents.pop()):
            fields = stat_fields(child)
            if fields is not None:
                cpu[child] = (int(fields[11]) + int(fields[12])) / tick
                parents.append(child)
    return cpu


def same_process(pid: int, started: str) -> bool:
    """Whether process ``pid``, started at ``started`` (proc_state's), still runs on this machine
    (a zombie has ended)."""
    state = proc_state(pid)
    return state is not None and state[0] != "Z" and state[1] == started
