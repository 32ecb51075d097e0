"""Stall watchdog: when a rank dies or the job stops making progress, every rank ends within
``timeout_s`` with one line saying where, instead of waiting in a collective for the process
group's timeout (30 minutes by default) or for ever.

Each rank runs one daemon thread. Every ``interval_s`` it

- looks whether this rank made **progress** since its last look: a stage mark from the trainer
  (``Watchdog.mark``), CPU time spent by the watched thread (the one that called ``start``), or a
  change of that thread's Python stack. A thread blocked in a collective, a sleep, a lock or a pipe
  shows none of these; a long but healthy generation, update or checkpoint write shows all three.
  So the deadline measures the *absence* of progress, not the length of a step;
- publishes its record (a heartbeat counter, the progress counter, stage, step, host, pid and the
  innermost frame of the watched thread) under its rank's key in the job's key-value store. Under
  torchrun the launcher hosts that store, so it outlives a killed or stopped rank;
- reads the other ranks' records (ages are measured on this rank's own clock, from when a value
  last changed, so the hosts' clocks need not agree) and declares a stall when
  a rank's heartbeat did not change for ``timeout_s`` (stopped with SIGSTOP, swapped out, dead
  without its launcher noticing), or no rank's progress changed for ``timeout_s`` (one rank in code
  that never returns, the others waiting for it in a collective), or another rank declared one.

On a stall each rank writes the stacks of all its threads (faulthandler) to
``<run_dir>/stall/rank<k>.txt`` and ends with ``STALL_EXIT_CODE`` through ``os._exit``: its main
thread may be inside a collective that nothing can interrupt, and the interpreter's shutdown would
wait in it. The first rank to declare the stall prints the one line and leaves it in torchrun's
error file; a stopped rank on the same host is continued (so that it writes its stacks too) and
killed if it has not ended a few seconds later. SIGTERM (the launcher ending the job after a rank
failed) writes the stacks too, and the line when a peer is gone without ending its run.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import select
import signal
import socket
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.distributed.procfs import boot_id, cpu_by_process, proc_state, same_process, stat_fields
from verl_megatron.errors import is_user_error

__all__ = ["STALL_EXIT_CODE", "Watchdog", "WatchdogSettings", "start_watchdog"]

STALL_EXIT_CODE = 4
"""Exit status of a rank ended by the watchdog (2: user error, 3: divergence guard)."""
TERM_EXIT_CODE = 128 + signal.SIGTERM
# CPU time of the watched thread that counts as work between two looks: a thread blocked in a
# wait wakes now and then for microseconds, never for milliseconds a second.
_BUSY_CPU_S = 0.01
# CPU time of the process's other threads together (the watchdog's aside) that counts as work:
# a thread the watched one waits for (a blocking scorer, an in-process agent harness) works
# for a large share of a second, while housekeeping threads (a progress bar's refresh, ~10 ms a
# second; log writers) use far less, and must not hide a stall.
_BUSY_OTHER_THREADS_S = 0.1
# The key of the other threads' CPU seconds among the per-process ones (no pid is negative).
_OTHER_THREADS = -1
# How long the rank that declared a stall waits for a stopped peer it continued to end by itself.
_PEER_GRACE_S = 3.0
_POKE = b"\1"


@dataclass(frozen=True)
class WatchdogSettings:
    """timeout_s: seconds without a heartbeat or without progress before the job ends;
    run_dir: where ``stall/rank<k>.txt`` goes; interval_s: seconds between two looks."""

    timeout_s: float
    run_dir: str
    interval_s: float = 1.0
    timeout_key: str = "trainer.stall_timeout_s"


@dataclass
class _Seen:
    """What this rank knows of one rank: its last record and when (own clock) values changed."""

    record: dict[str, Any] | None
    beat_at: float
    progress_at: float
    cpu: str = ""
    """utime + stime of its process (same machine only), when its heartbeat is late."""


def _first_sentence(error: BaseException) -> str:
    """The error's first sentence on one line, without gloo's ``[file.cc:553]`` source prefix."""
    text = " ".join(str(error).split())
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". ")[0][:160]


def _ranks(ranks: list[int]) -> str:
    """``rank 3`` / ``ranks 0-2,5``."""
    parts: list[tuple[int, int]] = []
    for r in sorted(ranks):
        if parts and parts[-1][1] == r - 1:
            parts[-1] = (parts[-1][0], r)
        else:
            parts.append((r, r))
    text = ",".join(str(a) if a == b else f"{a}-{b}" for a, b in parts)
    return f"rank{'s' if len(ranks) > 1 else ''} {text}"


def _where(record: dict[str, Any]) -> str:
    step = "" if record.get("step") is None else f" at step {record['step']}"
    frame = f" in {record['frame']}" if record.get("frame") else ""
    return f"stage {record.get('stage') or 'start'}{step}{frame}"


class Watchdog:
    """One rank's watchdog over ``world_size`` ranks that publish to ``store`` (see the module
    docstring). ``start`` from the thread to watch; ``mark`` from it at every stage; ``stop`` (joins
    the thread, restores the signal handling) when the run ends, normally or by an exception."""

    def __init__(self, settings: WatchdogSettings, rank: int, world_size: int, store: dist.Store) -> None:
        self.settings = settings
        self.rank, self.world_size = rank, world_size
        self._store = store
        self._stage, self._step, self._marks = "start", None, 0
        self._progress, self._beat = 0, 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._watched = 0
        self._watched_clock: int | None = None
        self._last_sample: tuple[int, dict[int, float], Any] = (-1, {}, None)
        self._seen: dict[int, _Seen] = {}
        self._wake: tuple[socket.socket, socket.socket] | None = None
        self._previous: tuple[Any, int] | None = None
        self._identity = {"host": socket.gethostname(), "boot": boot_id(), "pid": os.getpid()}
        self._identity["started"] = (proc_state(os.getpid()) or ("", ""))[1]
        self._store_failing_since: float | None = None
        self._error: BaseException | None = None
        self._ending = threading.Lock()
        self._warned = False

    # ------------------------------------------------------------------ the watched thread

    def mark(self, stage: str, step: int | None = None) -> None:
        """The watched thread entered ``stage`` (of ``step``): progress, and what the line names.
        The watchdog thread publishes it at once (one byte through a socket; no store call here)."""
        self._stage, self._step = stage, step
        self._marks += 1
        if self._wake is not None:
            # OSError: buffer full, the thread has bytes to read and will publish anyway.
            with contextlib.suppress(OSError):
                self._wake[1].send(_POKE)

    def alive(self) -> None:
        """The watched thread waits within a bound of its own (an agent rollout's deadline):
        progress, the stage unchanged. Counted at the next look; nothing published now."""
        self._marks += 1

    def start(self) -> Watchdog:
        now = time.monotonic()
        self._watched = threading.get_ident()
        # Taken here, in the watched thread: the clock names its thread id, readable from the
        # watchdog's thread (and failing, not lying, once the thread has ended).
        self._watched_clock = time.pthread_getcpuclockid(self._watched)
        self._seen = {r: _Seen(None, now, now) for r in range(self.world_size)}
        self._publish("running")
        self._wake = socket.socketpair()
        for sock in self._wake:
            sock.setblocking(False)
        if threading.current_thread() is threading.main_thread():
            self._catch_sigterm()
        self._thread = threading.Thread(target=self._run, name="verl-megatron-watchdog", daemon=True)
        self._thread.start()
        return self

    def stop(self, error: BaseException | None = None) -> None:
        """End the thread, say this rank ended its run (a peer waiting for it is not stalled by a
        rank that is merely slow to leave), restore SIGTERM.

        ``error``: the exception that ends the run, if any. When it comes from a peer that is gone
        (a collective failing with "connection closed" after a rank was killed) this rank ends as
        on a stall, with the line naming that peer and ``error`` in its stacks file, before its
        launcher's SIGTERM could end it silently.
        """
        if self._thread is None:
            return
        if error is not None and not is_user_error(error):
            cause = f"rank {self.rank} failed with {type(error).__name__}: {_first_sentence(error)}"
            # A peer's sockets close before its process is gone: give it the time a heartbeat takes.
            deadline = time.monotonic() + 2 * self.settings.interval_s + 1.5
            while time.monotonic() < deadline:
                line, first = self._peer_failure(cause)
                if line is not None:
                    self._error = error
                    self._end(line, report=first, code=STALL_EXIT_CODE)
                time.sleep(0.2)
        self._stop.set()
        with contextlib.suppress(OSError):
            self._wake[1].send(b"\0")
        self._thread.join()
        self._thread = None
        if self._previous is not None:
            handler, fd = self._previous
            signal.set_wakeup_fd(fd)
            signal.signal(signal.SIGTERM, handler)
            self._previous = None
        if self._wake is not None:
            for sock in self._wake:
                sock.close()
            self._wake = None
        with contextlib.suppress(RuntimeError, OSError):  # the store's host is gone: nobody to tell
            self._publish("exited")

    def _catch_sigterm(self) -> None:
        # The C-level handler writes the signal number to the wakeup socket even while the main
        # thread sits in a collective (where a Python-level handler would never run); the
        # watchdog thread reads it.
        previous = signal.signal(signal.SIGTERM, lambda *_: None)
        self._previous = (previous, signal.set_wakeup_fd(self._wake[1].fileno()))

    # ------------------------------------------------------------------ the watchdog thread

    def _run(self) -> None:
        reader = self._wake[0]
        next_look = time.monotonic() + self.settings.interval_s
        while not self._stop.is_set():
            if select.select([reader], [], [], max(0.0, next_look - time.monotonic()))[0]:
                data = reader.recv(4096)
                if self._stop.is_set():
                    return
                if signal.SIGTERM in data:
                    self._on_sigterm()
                if _POKE[0] in data:  # a stage mark: publish it now, look at the others later
                    with contextlib.suppress(RuntimeError, OSError):
                        self._publish("running")
            if time.monotonic() >= next_look:
                # A watchdog that died would stop the heartbeat and get a healthy job ended by its
                # peers: an error of its own is said once, and it keeps beating.
                try:
                    self._tick()
                except Exception as err:
                    if not self._warned:
                        print(
                            f"warning: stall watchdog: {type(err).__name__}: {err}",
                            file=sys.stderr,
                            flush=True,
                        )
                        self._warned = True
                next_look = time.monotonic() + self.settings.interval_s

    def _tick(self) -> None:
        self._sample()
        try:
            self._publish("running")
            abort = self._get("abort")
            if abort is not None:
                self._end(abort, report=False, code=STALL_EXIT_CODE)
            self._read_peers()
            self._store_failing_since = None
        except (RuntimeError, OSError) as err:  # DistStoreError is a RuntimeError
            now = time.monotonic()
            since = self._store_failing_since = self._store_failing_since or now
            if now - since > self.settings.timeout_s:
                self._declare(
                    f"the job's key-value store stopped answering for {now - since:.1f} s ({err}): "
                    "the launcher or the rank hosting it is gone",
                    claim=False,
                )
            return
        verdict = self._verdict(time.monotonic())
        if verdict is not None:
            self._declare(verdict, claim=True)

    def _sample(self) -> None:
        """Bump the progress counter when this rank worked since the last look: a stage mark, CPU
        time of the watched thread or of a process this one started (a scorer worker, a compiler),
        sustained CPU time of the process's other threads, or a change of the watched thread's
        Python stack."""
        cpu = cpu_by_process(os.getpid(), time.thread_time())
        watched = self._watched_cpu()
        cpu[_OTHER_THREADS], cpu[os.getpid()] = cpu[os.getpid()] - watched, watched
        frame, stack = sys._current_frames().get(self._watched), []
        while frame is not None:
            stack.append((id(frame.f_code), frame.f_lasti))
            frame = frame.f_back
        last_marks, last_cpu, last_stack = self._last_sample
        gained = {pid: max(0.0, t - last_cpu.get(pid, 0.0)) for pid, t in cpu.items()}
        others = gained.pop(_OTHER_THREADS)
        worked = sum(gained.values()) >= _BUSY_CPU_S or others >= _BUSY_OTHER_THREADS_S
        if self._marks != last_marks or worked or stack != last_stack:
            self._progress += 1
        self._last_sample = (self._marks, cpu, stack)

    def _watched_cpu(self) -> float:
        """CPU seconds of the watched thread; the last look's once it has ended (no more work)."""
        with contextlib.suppress(OSError):
            return time.clock_gettime(self._watched_clock)
        return self._last_sample[1].get(os.getpid(), 0.0)

    def _own(self) -> dict[str, Any]:
        return {"stage": self._stage, "step": self._step, "frame": self._frame()}

    def _frame(self) -> str:
        frame = sys._current_frames().get(self._watched)
        while frame is not None and frame.f_code.co_filename == __file__:  # mark() itself
            frame = frame.f_back
        if frame is None:
            return ""
        return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno} {frame.f_code.co_name}"

    def _publish(self, state: str) -> None:
        self._beat += 1
        record = {
            **self._identity,
            **self._own(),
            "beat": self._beat,
            "progress": self._progress,
            "state": state,
        }
        self._store.set(f"rank{self.rank}", json.dumps(record))

    def _get(self, key: str) -> str | None:
        if not self._store.check([key]):
            return None
        return self._store.get(key).decode()

    def _watched_ranks(self) -> list[int]:
        """Rank 0 watches every rank; the others watch rank 0 (and learn the rest from the abort
        key): the store serves O(ranks) reads a look, not O(ranks^2)."""
        return list(self._seen) if self.rank == 0 else [0]

    def _read_peers(self, ranks: list[int] | None = None) -> None:
        now = time.monotonic()
        ranks = self._watched_ranks() if ranks is None else ranks
        keys = [f"rank{r}" for r in ranks]
        if self._store.check(keys):  # all there: one round trip
            raws: list[str | None] = [raw.decode() for raw in self._store.multi_get(keys)]
        else:
            raws = [self._get(key) for key in keys]
        for r, raw in zip(ranks, raws):
            if raw is None:
                continue
            seen, record = self._seen[r], json.loads(raw)
            if seen.record is None or record["beat"] != seen.record["beat"]:
                seen.beat_at = now
            if seen.record is None or record["progress"] != seen.record["progress"]:
                seen.progress_at = now
            seen.record = record
            if now - seen.beat_at > 2 * self.settings.interval_s and record["boot"] == self._identity["boot"]:
                self._look_at_process(seen, now)

    @staticmethod
    def _look_at_process(seen: _Seen, now: float) -> None:
        """A late heartbeat of a process of this machine that still burns CPU is a rank starved of
        CPU or of the interpreter lock (a long C call, an overloaded machine), not a stopped one:
        alive and working."""
        record = seen.record or {}
        fields = stat_fields(record["pid"])
        if fields is None or fields[19] != record["started"]:
            return
        cpu = f"{fields[11]}+{fields[12]}"
        if seen.cpu and cpu != seen.cpu:
            seen.beat_at = seen.progress_at = now
        seen.cpu = cpu

    # ------------------------------------------------------------------ deciding and ending

    def _verdict(self, now: float) -> str | None:
        """The stall line, or None while the job is healthy."""
        timeout = self.settings.timeout_s
        silent = [
            (now - self._seen[r].beat_at, r)
            for r in self._watched_ranks()
            if r != self.rank and (self._seen[r].record is None or self._seen[r].record["state"] == "running")
        ]
        if silent and max(silent)[0] > timeout:
            waited, r = max(silent)
            record = self._seen[r].record
            if record is None:
                return f"rank {r} did not start its watchdog within {waited:.1f} s"
            return (
                f"rank {r} (pid {record['pid']} on {record['host']}) sent no heartbeat for {waited:.1f} s "
                f"(stopped or dead), last seen in {_where(record)}"
            )
        waited = now - max(s.progress_at for s in self._seen.values())
        if self.rank != 0 or waited <= timeout:  # only rank 0 sees every rank's progress
            return None
        groups: dict[str, list[int]] = {}
        for r, s in self._seen.items():
            groups.setdefault(_where(s.record or {}), []).append(r)
        # The odd one out first: the rank in user code, not the ones waiting for it.
        ordered = sorted(groups.items(), key=lambda item: (len(item[1]), item[1]))
        hosts = {r: (s.record or {}).get("host", "?") for r, s in self._seen.items()}
        states = "; ".join(
            f"{_ranks(ranks)} ({','.join(sorted({hosts[r] for r in ranks}))}) in {where}"
            for where, ranks in ordered
        )
        return f"no rank made progress for {waited:.1f} s: {states}"

    def _line(self, reason: str) -> str:
        stall_dir = os.path.join(self.settings.run_dir, "stall")
        return (
            f"stall: {reason} ({self.settings.timeout_key}={self.settings.timeout_s:g}); "
            f"every rank stopped; stacks in {stall_dir}/rank<k>.txt"
        )

    def _declare(self, reason: str, claim: bool) -> None:
        line, first = self._line(reason), True
        if claim:
            with contextlib.suppress(RuntimeError, OSError):
                line, first = self._claim(line)
        self._end(line, report=first, code=STALL_EXIT_CODE, wake_peers=True)

    def _claim(self, line: str) -> tuple[str, bool]:
        """(the job's line, whether this rank says it): the first rank to claim it says its own;
        another one (two ranks may see a failure at once) repeats the first one's in its files."""
        if self._store.add("reported", 1) == 1:
            self._store.set("abort", line)
            return line, True
        for _ in range(20):
            abort = self._get("abort")
            if abort is not None:
                return abort, False
            time.sleep(0.05)
        return line, False

    def _on_sigterm(self) -> None:
        """The launcher ends this rank (another rank failed): stacks, and the line when a peer is
        gone without ending its run (killed, crashed) and nobody said so yet."""
        line, first = self._peer_failure(f"the launcher stopped rank {self.rank} (SIGTERM)")
        self._end(line or "stopped by SIGTERM", report=first, code=TERM_EXIT_CODE)

    def _peer_failure(self, cause: str) -> tuple[str | None, bool]:
        """(the job's failure line, whether this rank is the first to say it) when a peer is gone
        without ending its run or a rank declared a stall; (None, False) while every peer runs."""
        try:
            self._publish("terminated")
            abort = self._get("abort")
            if abort is not None:
                return abort, False
            self._read_peers(list(self._seen))
            gone = [r for r, s in self._seen.items() if r != self.rank and self._gone(s)]
            if not gone:
                return None, False
            record = self._seen[gone[0]].record or {}
            age = time.monotonic() - self._seen[gone[0]].beat_at
            line = self._line(
                f"rank {gone[0]} (pid {record['pid']} on {record['host']}) ended without finishing its "
                f"run (killed or crashed; last heartbeat {age:.1f} s ago) in {_where(record)}; {cause} "
                f"in {_where(self._own())}"
            )
            return self._claim(line)
        except (RuntimeError, OSError):
            return None, False

    def _gone(self, seen: _Seen) -> bool:
        record = seen.record
        if record is None or record["state"] not in ("running", "stalled"):
            return False
        if record["boot"] == self._identity["boot"]:
            return not same_process(record["pid"], record["started"])
        return time.monotonic() - seen.beat_at > 2 * self.settings.interval_s + 1

    def _end(self, line: str, report: bool, code: int, wake_peers: bool = False) -> None:
        self._ending.acquire()  # the main thread (stop) and the watchdog's: one ends the process
        try:
            with contextlib.suppress(RuntimeError, OSError):
                self._publish("stalled")
            if report:
                print(line, file=sys.stderr, flush=True)
            with contextlib.suppress(OSError):
                _record_for_launcher(line)
            self._dump(line)
            if wake_peers:
                self._end_stopped_peers()
        finally:  # whatever failed above (a full disk), the rank ends
            os._exit(code)

    def _dump(self, line: str) -> None:
        stall_dir = os.path.join(self.settings.run_dir, "stall")
        os.makedirs(stall_dir, exist_ok=True)
        with open(os.path.join(stall_dir, f"rank{self.rank}.txt"), "w") as f:
            f.write(
                f"{line}\nrank {self.rank} (pid {os.getpid()} on {self._identity['host']}) "
                f"in {_where(self._own())}\n\n"
            )
            if self._error is not None:
                f.write("".join(traceback.format_exception(self._error)) + "\n")
            f.flush()
            faulthandler.dump_traceback(file=f, all_threads=True)

    def _end_stopped_peers(self) -> None:
        """Continue a silent peer of this machine (it then writes its stacks and ends), and kill it
        if it has not ended after ``_PEER_GRACE_S``: a stopped process ignores its launcher's SIGTERM."""
        now, records = (
            time.monotonic(),
            [(self._seen[r].beat_at, self._seen[r].record) for r in self._watched_ranks()],
        )
        stopped = [
            record["pid"]
            for beat_at, record in records
            if record is not None
            and record["pid"] != os.getpid()
            and now - beat_at > 2 * self.settings.interval_s + 1
            and record["boot"] == self._identity["boot"]
            and record["state"] == "running"
            and same_process(record["pid"], record["started"])
        ]
        for pid in stopped:
            os.kill(pid, signal.SIGCONT)
        deadline = time.monotonic() + _PEER_GRACE_S
        while stopped and time.monotonic() < deadline:
            time.sleep(0.1)
            stopped = [pid for pid in stopped if (proc_state(pid) or ("Z",))[0] != "Z"]
        for pid in stopped:
            os.kill(pid, signal.SIGKILL)


def _record_for_launcher(line: str) -> None:
    """Leave the line in torchrun's per-worker error file: its failure report shows it."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    record = {
        "message": {
            "message": line,
            "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))},
        }
    }
    with open(path, "w") as f:
        json.dump(record, f)


def _client_store(timeout_s: float) -> dist.Store:
    """A connection of its own to the job's store (torchrun's, or rank 0's): the watchdog's reads
    time out quickly and never queue behind the main thread's."""
    return dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def start_watchdog(settings: WatchdogSettings, group: dist.ProcessGroup | None = None) -> Watchdog | None:
    """Start this rank's watchdog over the ranks of ``group`` (default: the whole job, through
    torch.distributed's default group; else a gloo group of its own, such as the transfer group of
    ``rollout.placement=separate``, numbered by global rank), or None when ``settings.timeout_s``
    <= 0 or there is one process. A collective of ``group``: every rank calls it at the same point;
    each call gets store keys of its own."""
    if settings.timeout_s <= 0 or not dist.is_initialized():
        return None
    rank, world = (dist.get_rank(), dist.get_world_size()) if group is None else (group.rank(), group.size())
    if world == 1:
        return None
    store = _client_store(max(2 * settings.interval_s, 5.0))
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    session = store.add(f"verl_megatron/watchdog/{attempt}/sessions", 1) if rank == 0 else 0
    if group is None:  # NCCL or gloo: the object broadcast picks the device
        agreed = [session]
        dist.broadcast_object_list(agreed, src=0)
        session = agreed[0]
    else:
        value = torch.tensor([session], dtype=torch.int64)
        group.broadcast(value, 0).wait()
        session = int(value.item())
    prefix = f"verl_megatron/watchdog/{attempt}/{session}"
    return Watchdog(settings, rank, world, dist.PrefixStore(prefix, store)).start()
