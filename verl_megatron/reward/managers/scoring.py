"""Calling user scorers safely: contained exceptions, validated results and a
hard per-call time limit enforced by killable worker processes.

A scorer may raise, return NaN or a string, or never return (a ``while True``
in C, a ``time.sleep``). None of these may stop or hang training: each call
ends as a :class:`ScoreOutcome` whose ``status`` says what happened, and a
failed call scores 0.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import signal
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from verl_megatron.utils.call_worker import die_with_parent

OK, TIMEOUT, ERROR, INVALID = "ok", "timeout", "error", "invalid"

# Worker start-up (fork: milliseconds; spawn: an interpreter plus imports)
# does not count against a call's time limit, but a worker that cannot start
# at all is a configuration error.
_WORKER_START_TIMEOUT_S = 120.0
_WORKER_STOP_TIMEOUT_S = 5.0
# A call is treated as possibly hung, and stops holding up the calls behind it, once it
# runs _STALL_FACTOR times longer than the median of recent calls, clamped to
# [_MIN_STALL_S, min(_MAX_STALL_S, timeout / 10)]. Hung calls are found one after another
# on a worker slot, so this threshold, not the timeout, is what each costs the batch.
_STALL_FACTOR = 20.0
_MIN_STALL_S = 0.05
_MAX_STALL_S = 1.0
# Stalled calls waited on at once, beyond ``num_workers``: each is an idle forked process.
DEFAULT_MAX_STALLED = 64
# The per-call limit when none is configured (verl: None, i.e. none at all, which lets
# one sleeping scorer hang training for ever).
DEFAULT_TIMEOUT_S = 30.0


@dataclass
class ScoreOutcome:
    """Result of one scorer call: the reward, the dict it came in (if any),
    and ``status`` in {"ok", "timeout", "error", "invalid"} with a message."""

    score: float = 0.0
    info: dict[str, Any] | None = None
    status: str = OK
    message: str = ""
    raw: Any = None  # the scorer's return value, when the caller checks it itself


@dataclass
class ScoreTask:
    """Keyword arguments of one scorer call."""

    kwargs: dict[str, Any] = field(default_factory=dict)


def coerce_result(result: Any) -> ScoreOutcome:
    """Check a scorer's return value: a finite real number, or a dict whose
    ``"score"`` is one. Anything else is ``invalid`` and scores 0."""
    info = None
    value = result
    if isinstance(result, dict):
        info = result
        if "score" not in result:
            return ScoreOutcome(
                0.0, info, INVALID, f"dict result has no 'score' key (keys: {sorted(result)})"
            )
        value = result["score"]
    if hasattr(value, "item") and getattr(value, "ndim", None) == 0:
        value = value.item()  # a 0-d numpy array / torch tensor
    if not isinstance(value, numbers.Real):
        return ScoreOutcome(
            0.0, info, INVALID, f"score is a {type(value).__name__} ({value!r:.80}), not a number"
        )
    value = float(value)
    if not math.isfinite(value):
        return ScoreOutcome(0.0, info, INVALID, f"score is {value}")
    return ScoreOutcome(value, info, OK)


def call_contained(
    fn: Callable[..., Any], kwargs: dict[str, Any], coerce: Callable[[Any], ScoreOutcome] = coerce_result
) -> ScoreOutcome:
    """Call ``fn(**kwargs)`` in this process; an exception becomes ``error``."""
    try:
        result = fn(**kwargs)
    except Exception as err:
        return ScoreOutcome(0.0, None, ERROR, f"{type(err).__name__}: {err}")
    return coerce(result)


def _run_one(fn: Callable[..., Any], task_id: int, kwargs: dict[str, Any]) -> tuple[int, str, Any, float]:
    start = time.perf_counter()
    try:
        result = fn(**kwargs)
    except BaseException as err:  # SystemExit from user code must not end the worker either
        return task_id, ERROR, f"{type(err).__name__}: {err}", time.perf_counter() - start
    return task_id, OK, result, time.perf_counter() - start


def _worker_main(conn: multiprocessing.connection.Connection, fn: Callable[..., Any]) -> None:
    # Ctrl-C goes to the whole process group; the trainer handles it and our
    # pipe closing ends this loop, so the worker itself ignores it.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    die_with_parent()
    conn.send(("ready", None, None))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return  # parent went away
        if chunk is None:
            return
        for task_id, kwargs in chunk:
            # One message per result, sent as soon as it is known: the parent
            # times each call from the previous result and, on a kill, knows
            # exactly which call hung.
            message = _run_one(fn, task_id, kwargs)
            try:
                conn.send(message)
            except Exception as err:  # pickling fails before any byte is written
                message = f"scorer result cannot be sent between processes: {err}"
                conn.send((task_id, ERROR, message, 0.0))


class _Worker:
    def __init__(self, ctx: Any, fn: Callable[..., Any]) -> None:
        self.conn, child_conn = ctx.Pipe(duplex=True)
        self.process = ctx.Process(target=_worker_main, args=(child_conn, fn), daemon=True)
        try:
            self.process.start()
        except Exception as err:  # spawn/forkserver pickle the scorer here
            self.conn.close()
            raise RuntimeError(
                f"cannot start a {ctx.get_start_method()!r} reward scorer worker for {fn!r}: "
                f"{type(err).__name__}: {err}. Use a module-level function or the 'fork' start method."
            ) from err
        finally:
            child_conn.close()
        self.in_flight: deque[int] = deque()  # task ids sent, in the order they run
        self.started = math.inf  # when the call at in_flight[0] started
        self.deadline = math.inf
        # Set once the running call is slower than the stall threshold: the calls queued
        # behind it went back to the pool, so this worker must not run them (it is stopped
        # as soon as its call ends) and no longer counts towards ``num_workers``.
        self.stalled = False
        self.reclaimed = False

    def wait_ready(self) -> None:
        if not self.conn.poll(_WORKER_START_TIMEOUT_S):
            self.kill()
            raise RuntimeError(f"reward scorer worker did not start within {_WORKER_START_TIMEOUT_S:.0f} s")
        try:
            self.conn.recv()
        except (EOFError, OSError) as err:
            code = self.process.exitcode
            self.kill()
            raise RuntimeError(
                f"reward scorer worker died while starting (exit code {code}); with the 'spawn' start "
                "method the scorer must be importable/picklable in a fresh interpreter"
            ) from err

    def restart_clock(self, timeout: float | None) -> None:
        self.started = time.monotonic()
        self.deadline = self.started + timeout if timeout else math.inf

    def kill(self, wait: bool = True) -> None:
        """SIGKILL; ``wait=False`` leaves the reaping to :meth:`reap` (tearing down a
        forked copy of a big trainer process takes the kernel ~0.1 s)."""
        if self.process.is_alive():
            self.process.kill()
        self.conn.close()
        if wait:
            self.reap()

    def reap(self) -> None:
        self.process.join(_WORKER_STOP_TIMEOUT_S)


class ScorerPool:
    """Worker processes that run ``fn(**kwargs)`` with a hard time limit.

    A call still running ``timeout`` seconds after it started is ended by
    killing its worker (SIGKILL: works for C loops and sleeps). Tasks go to
    workers in chunks (one pipe message per chunk, one per result) because a
    cheap scorer costs less than a message round trip. Workers start on
    first use and are reused until :meth:`close`.

    Hung calls are cut off in parallel, not one after another: a call that
    runs past ``stall_s`` (20x the median call, within 0.05 s and a tenth of
    the timeout or 1 s) stops counting towards ``num_workers``; the calls queued behind it go back to
    the pool and a fresh worker takes them. So a batch in which k calls hang
    costs about one ``timeout``, not k of them, as long as at most
    ``max_stalled`` calls are stalled at once (more wait for a free slot).

    ``start_method``: "fork" (default where available) starts a worker in
    milliseconds and inherits the scorer as loaded, closures included; the
    worker only runs Python scoring code, never torch/CUDA, so the parent's
    torch threads and CUDA context are not a hazard there. "spawn" or
    "forkserver" start clean interpreters; the scorer must then pickle.
    """

    def __init__(
        self,
        fn: Callable[..., Any],
        num_workers: int = 1,
        timeout: float | None = None,
        start_method: str | None = None,
        max_chunk: int = 32,
        max_stalled: int = DEFAULT_MAX_STALLED,
    ) -> None:
        if num_workers < 1:
            raise ValueError(f"ScorerPool: num_workers must be >= 1, got {num_workers}")
        if timeout is not None and not timeout > 0:
            raise ValueError(
                f"ScorerPool: timeout must be a positive number of seconds or None, got {timeout}"
            )
        if start_method is None:
            methods = multiprocessing.get_all_start_methods()
            start_method = "fork" if "fork" in methods else "spawn"
        self.fn = fn
        self.num_workers = num_workers
        self.timeout = timeout
        self.max_chunk = max_chunk
        self.max_stalled = max_stalled
        self.max_stall_s = min(_MAX_STALL_S, timeout / 10) if timeout else _MAX_STALL_S
        self._durations: deque[float] = deque(maxlen=256)  # seconds of recent calls
        self.ctx = multiprocessing.get_context(start_method)
        self._workers: list[_Worker] = []
        self._killed: list[_Worker] = []  # killed during a map, reaped at its end

    @property
    def stall_s(self) -> float:
        """Seconds after which a running call stops holding up others (see _STALL_FACTOR)."""
        if not self._durations:
            return self.max_stall_s
        typical = statistics.median(self._durations)
        return min(self.max_stall_s, max(_MIN_STALL_S, _STALL_FACTOR * typical))

    def _ensure_workers(self, count: int) -> None:
        fresh = [_Worker(self.ctx, self.fn) for _ in range(count - len(self._workers))]
        for worker in fresh:
            worker.wait_ready()
        self._workers.extend(fresh)

    def _retire(self, worker: _Worker, pending: deque[int]) -> None:
        """Kill ``worker``; its queued (not yet started) calls go back to ``pending``."""
        pending.extendleft(reversed(worker.in_flight))
        worker.kill(wait=False)
        self._workers.remove(worker)
        self._killed.append(worker)

    @staticmethod
    def _stall(worker: _Worker, pending: deque[int]) -> None:
        """``worker``'s call is slow: hand the calls queued behind it to other workers."""
        running = worker.in_flight.popleft()
        pending.extendleft(reversed(worker.in_flight))
        worker.reclaimed = bool(worker.in_flight)
        worker.in_flight = deque([running])
        worker.stalled = True

    def map(
        self, tasks: Sequence[ScoreTask], coerce: Callable[[Any], ScoreOutcome] = coerce_result
    ) -> list[ScoreOutcome]:
        """Run every task; outcomes come back in task order. ``coerce`` turns a
        returned value into an outcome (default: check it is a valid score)."""
        if not tasks:
            return []
        outcomes: list[ScoreOutcome] = [ScoreOutcome()] * len(tasks)
        keep = max(len(self._workers), min(self.num_workers, len(tasks)))
        self._ensure_workers(min(self.num_workers, len(tasks)))
        # Several chunks per worker keep the load balanced when call costs vary.
        chunk = max(1, min(self.max_chunk, len(tasks) // (4 * len(self._workers))))
        pending = deque(range(len(tasks)))
        idle = list(self._workers)
        busy: dict[Any, _Worker] = {}
        stalls = 0
        while pending or busy:
            # Hung calls are found one after another on a slot; once some have been, more
            # slots (up to the CPU count) find the rest side by side.
            active = max(self.num_workers, min(os.cpu_count() or 1, self.num_workers + stalls))
            self._dispatch(tasks, pending, idle, busy, chunk, active)
            stall_s = self.stall_s
            now = time.monotonic()
            wake = [w.deadline for w in busy.values()]
            # A call that stalls while others wait (queued behind it or in the pool) frees its slot.
            wake += [w.started + stall_s for w in busy.values() if self._may_stall(w, pending)]
            wait_s = min(wake) - now
            ready = multiprocessing.connection.wait(
                list(busy), timeout=None if wait_s == math.inf else max(wait_s, 0)
            )
            for conn in ready:
                worker = busy[conn]
                alive = self._drain(worker, outcomes, coerce)
                if not alive or worker.reclaimed:
                    del busy[conn]  # dead, or would now run calls that were handed out again
                    self._retire(worker, pending)
                elif not worker.in_flight:
                    del busy[conn]
                    worker.stalled = False
                    idle.append(worker)
            now = time.monotonic()
            for conn, worker in list(busy.items()):
                if worker.deadline <= now:
                    del busy[conn]
                    message = f"scorer did not return within {self.timeout:g} s (worker process killed)"
                    outcomes[worker.in_flight.popleft()] = ScoreOutcome(0.0, None, TIMEOUT, message)
                    self._retire(worker, pending)
                elif self._may_stall(worker, pending) and now - worker.started >= stall_s:
                    self._stall(worker, pending)
                    stalls += 1
        # Back to ``keep`` workers, all idle: extras started past stalled calls stop,
        # killed ones are replaced now rather than at the start of the next batch.
        for worker in self._workers[keep:]:
            worker.kill(wait=False)
        self._killed += self._workers[keep:]
        del self._workers[keep:]
        self._ensure_workers(keep)
        for worker in self._killed:
            worker.reap()
        self._killed = []
        return outcomes

    @staticmethod
    def _may_stall(worker: _Worker, pending: deque[int]) -> bool:
        return not worker.stalled and (bool(pending) or len(worker.in_flight) > 1)

    def _dispatch(
        self,
        tasks: Sequence[ScoreTask],
        pending: deque[int],
        idle: list[_Worker],
        busy: dict[Any, _Worker],
        chunk: int,
        active: int,
    ) -> None:
        """Hand queued calls to idle workers; start workers while fewer than ``active`` calls
        run that have not stalled."""
        stalled = sum(w.stalled for w in busy.values())
        while pending:
            if not idle:
                full = len(busy) - stalled >= active
                if full or len(self._workers) >= self.num_workers + self.max_stalled:
                    return
                self._ensure_workers(len(self._workers) + 1)
                idle.append(self._workers[-1])
            worker = idle.pop()
            worker.in_flight = deque(pending.popleft() for _ in range(min(chunk, len(pending))))
            try:
                worker.conn.send([(task_id, tasks[task_id].kwargs) for task_id in worker.in_flight])
            except OSError:  # the worker died while idle (killed from outside): use another
                self._retire(worker, pending)
                continue
            worker.restart_clock(self.timeout)
            busy[worker.conn] = worker

    def _drain(
        self, worker: _Worker, outcomes: list[ScoreOutcome], coerce: Callable[[Any], ScoreOutcome]
    ) -> bool:
        """Record every result ``worker`` has sent; False if it died (the call
        it was running is then recorded as an error)."""
        while worker.in_flight:
            try:
                task_id, status, payload, seconds = worker.conn.recv()
            except (EOFError, OSError):
                worker.process.join(_WORKER_STOP_TIMEOUT_S)
                message = f"scorer process died (exit code {worker.process.exitcode})"
                outcomes[worker.in_flight.popleft()] = ScoreOutcome(0.0, None, ERROR, message)
                return False
            worker.in_flight.popleft()  # results arrive in the order the calls were sent
            self._durations.append(seconds)
            outcomes[task_id] = (
                ScoreOutcome(0.0, None, ERROR, payload) if status == ERROR else coerce(payload)
            )
            worker.restart_clock(self.timeout)
            if not worker.conn.poll():
                break
        return True

    def close(self) -> None:
        """Stop every worker (politely, then by force)."""
        for worker in self._workers:
            with contextlib.suppress(OSError, ValueError):
                worker.conn.send(None)
        for worker in self._workers:
            worker.process.join(_WORKER_STOP_TIMEOUT_S)
            worker.kill()
        for worker in self._killed:  # left by a map that raised
            worker.reap()
        self._workers, self._killed = [], []

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.close()
