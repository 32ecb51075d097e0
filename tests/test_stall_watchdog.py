"""A stalled 2-process job ends on every rank, fast, saying where (issue 30, "Fail fast").

Each case starts the quickstart under torchrun (2 ranks, gloo) with
``trainer.stall_timeout_s=5`` (the default is 60; 5, the least the config accepts, keeps the test
short), waits until rank 1's
watchdog record in torchrun's store shows the stage of the case, then breaks the job:

- ``stop``: rank 1 is stopped with SIGSTOP after step 2 (alive but silent). Its scorer computes
  for 6 s once, in step 1: a step longer than the stall timeout, spent computing, is slow, not
  stalled (the deadline measures the absence of progress, not the length of a step), so steps 1
  and 2 finish and the stall is the one of step 3 (one job for both: a job costs ~7 s of CPU);
- ``kill_update`` / ``kill_gen`` / ``kill_save``: rank 1 is killed with SIGKILL while its
  published stage is the actor update, the generation, the checkpoint save. The test stops rank 1
  first and kills it only if its record still names the stage (a stage mark is published at once),
  so the kill lands inside the stage;
- ``async_stop``: ``rollout.placement=separate``, the rollout rank (1) stopped with SIGSTOP after
  two trained steps;
- ``async_kill_send``: ``rollout.placement=separate`` with 1 MB buckets, the trainer rank (0) killed
  with SIGKILL (stopped first, as above) while its published stage is the weight push to the
  rollout rank (``send_weights``, step >= 2): a weight transfer interrupted halfway, the rollout
  rank waiting for the rest;
- ``reward``: a user reward function (``isolation=none``: in-process) that never returns; rewards
  are scored on rank 0 only, so rank 0 blocks in it and rank 1 waits in the broadcast.

Every case must end the whole job (torchrun's exit status != 0, no worker left) within the stall
timeout plus a margin far below the process group's 30 minutes, print one ``stall:`` line naming
the rank, stage and step, and leave each live rank's stacks in ``<run dir>/stall/rank<k>.txt``.
The cases run side by side; the measured times are printed. The ranks are forked from a process
that imported the trainer once (tests/warm_workers.py), under a real torchrun: a fresh rank's
imports cost ~8 CPU s, 14 of them ~110 of this test's 130 CPU s.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta

import pytest
import torch.distributed as dist

from tests.warm_workers import SOCKET_VAR, zygote

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STALL_TIMEOUT_S = 5
# Slack over the stall timeout for the look interval, writing the stacks and torchrun's own exit on a
# loaded machine: a bound far below the 30-minute process-group timeout a stalled job used to wait.
EXIT_SLACK_S = 60
START_LIMIT_S = 240  # start-up of 7 jobs side by side on 2 shared cores
# The stop case's first scorer call computes for longer than the stall timeout: slow, not stalled.
SLOW_BUSY_S = 6  # above STALL_TIMEOUT_S: the step is longer than the timeout
KEY = "verl_megatron/watchdog/0/1/rank{}"  # first attempt, first watchdog session
SEND_CASES = ("async_kill_send",)  # the trainer rank (0) broken in its weight push
# torchrun's workers are forked from a warm process that imported the trainer once
# (tests/warm_workers.py): each runs ``python -m verl_megatron.train ARGS`` as its main, and the
# ranks' pids are what the test stops and kills.
TORCHRUN = (sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "tests.warm_workers")
_LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR")  # set by torchrun

SCORER = """
import time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    time.sleep(3600)  # a scorer that never returns
    return 0.0
"""


SLOW_SCORER = """
import time

_first = [True]

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if _first[0]:  # the first call computes for longer than the stall timeout: slow, not stalled
        _first[0] = False
        end = time.monotonic() + {busy_s}
        while time.monotonic() < end:
            sum(range(1000))
    return 0.0
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Outcome:
    name: str
    returncode: int
    exit_s: float  # from breaking the job to torchrun's exit
    output: str
    run_dir: str
    pids: list[int]
    stage: str
    step: int | None  # the broken rank's published step at the break


def _record(store: dist.Store, rank: int) -> dict | None:
    key = KEY.format(rank)
    return json.loads(store.get(key)) if store.check([key]) else None


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie has ended)."""
    with contextlib.suppress(OSError), open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    return False


def _break_at(
    store: dist.Store, stage: str, min_step: int, deadline: float, kill: bool, rank: int = 1
) -> tuple[dict, dict]:
    """Stop ``rank`` when its record names ``stage`` (step >= min_step); kill it when ``kill`` and the
    record still names the stage once it is stopped. Returns its record and the other rank's."""
    while time.monotonic() < deadline:
        record = _record(store, rank)
        if record and record["stage"] == stage and (record["step"] or 0) >= min_step:
            os.kill(record["pid"], signal.SIGSTOP)
            time.sleep(0.3)  # a mark published just before the stop arrives by now
            after = _record(store, rank)
            if not kill:
                return after, _record(store, 1 - rank)
            if after["stage"] == stage and after["step"] == record["step"]:
                os.kill(record["pid"], signal.SIGKILL)
                return after, _record(store, 1 - rank)
            os.kill(record["pid"], signal.SIGCONT)
        time.sleep(0.01)
    raise AssertionError(f"rank {rank} never reached stage {stage} at step >= {min_step}")


def _overrides(name: str, tmp: str, run_dir: str) -> list[str]:
    overrides = [
        f"trainer.default_local_dir={run_dir}",
        f"trainer.stall_timeout_s={STALL_TIMEOUT_S}",
        "trainer.total_training_steps=60",
        "trainer.test_freq=-1",
        "trainer.val_before_train=false",
        "trainer.export_hf=false",
    ]
    if name == "kill_save":
        overrides.append("trainer.save_freq=1")
    if name in SEND_CASES:  # several buckets: the push is a transfer with a middle
        overrides.append("rollout.update_weights_bucket_megabytes=1")
    if name.startswith("async"):  # rank 0 trains, rank 1 generates (the README's async command)
        overrides += [
            "rollout.placement=separate",
            "rollout.world_size=1",
            "async_training.max_staleness=1",
            "algorithm.rollout_correction.rollout_is=token",
        ]
    if name in ("reward", "stop"):
        scorer = os.path.join(tmp, f"{name}_scorer.py")
        with open(scorer, "w") as f:
            f.write(SCORER if name == "reward" else SLOW_SCORER.replace("{busy_s}", str(SLOW_BUSY_S)))
        overrides += [f"custom_reward_function.path={scorer}", "reward_model.reward_kwargs.isolation=none"]
    return overrides


def _connect(proc: subprocess.Popen, port: int, deadline: float) -> dist.Store:
    """A client of torchrun's store, once it listens (a plain socket first: quiet while it does not)."""
    while True:
        assert proc.poll() is None and time.monotonic() < deadline, "the job did not start"
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
        except (RuntimeError, OSError):
            time.sleep(0.5)


def _steps_logged(run_dir: str) -> int:
    path = os.path.join(run_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return sum(1 for _ in f)


def _break(
    name: str, store: dist.Store, proc: subprocess.Popen, deadline: float, run_dir: str
) -> tuple[dict, dict]:
    """Break the job as case ``name`` says; (rank 1's record, rank 0's) at that moment."""
    if name == "async_stop":  # the rollout rank marks no stages: stopped after 2 trained steps
        while _steps_logged(run_dir) < 2:
            assert proc.poll() is None and time.monotonic() < deadline, "no step 2"
            time.sleep(0.1)
        os.kill(_record(store, 1)["pid"], signal.SIGSTOP)
        return _record(store, 1), _record(store, 0)
    if name == "reward":
        while (_record(store, 0) or {}).get("stage") != "reward":
            assert proc.poll() is None and time.monotonic() < deadline, "no reward stage"
            time.sleep(0.05)
        return _record(store, 1), _record(store, 0)
    if name in SEND_CASES:  # the trainer rank, in the middle of pushing weights
        return _break_at(store, "send_weights", 2, deadline, kill=True, rank=0)
    stage = {"stop": "gen", "kill_update": "update_actor", "kill_gen": "gen", "kill_save": "save_checkpoint"}
    return _break_at(store, stage[name], 3 if name == "stop" else 2, deadline, kill=name != "stop")


def _env() -> dict[str, str]:
    """The jobs' environment. No compiled decode kernels: a job waiting for another process's
    compile of them (torch's file lock) makes no progress of its own, a stall of this test's making
    when the cache is cold."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_VARS}
    env.update(OMP_NUM_THREADS="1", VERL_MEGATRON_CPU_KERNELS="0")
    return env


def _run_case(name: str, tmp: str, socket_path: str) -> Outcome:
    run_dir = os.path.join(tmp, name)
    port = _free_port()
    env = {**_env(), "PET_MASTER_PORT": str(port), SOCKET_VAR: socket_path}
    log = open(os.path.join(tmp, f"{name}.log"), "w+")  # noqa: SIM115 (closed below, after the job)
    proc = subprocess.Popen(
        [*TORCHRUN, *_overrides(name, tmp, run_dir)],
        cwd=ROOT,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_LIMIT_S
        store = _connect(proc, port, deadline)
        records = _break(name, store, proc, deadline, run_dir)
        broken = time.monotonic()
        proc.wait(timeout=STALL_TIMEOUT_S + EXIT_SLACK_S + 60)
        exit_s = time.monotonic() - broken
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    log.seek(0)
    output = log.read()
    log.close()
    pids = [r["pid"] for r in records if r is not None]
    broken = records[0] or {}
    return Outcome(
        name, proc.returncode, exit_s, output, run_dir, pids, broken.get("stage", ""), broken.get("step")
    )


def test_a_stalled_job_ends_on_every_rank_with_one_line_and_the_stacks(tmp_path):
    names = ["stop", "kill_update", "kill_gen", "kill_save", "reward", "async_stop", *SEND_CASES]
    with zygote(_env(), ROOT) as socket_path, ThreadPoolExecutor(len(names)) as pool:
        outcomes = list(pool.map(lambda n: _run_case(n, str(tmp_path), socket_path), names))
    stop = outcomes[0]
    # A step longer than the stall timeout, spent computing, is no stall: steps 1, 2 (and any up to
    # the stop) finished; the stall line names the step rank 1 was stopped in (asserted below).
    # Only the steps before it count: rank 0's main thread may still finish the stopped step while
    # its watchdog continues rank 1 so that it writes its stacks (seen once: step 3 logged after
    # a stall declared in step 3).
    with open(os.path.join(stop.run_dir, "metrics.jsonl")) as f:
        steps = [json.loads(line)["training/global_step"] for line in f]
    assert stop.step >= 3 and steps[: stop.step - 1] == list(range(1, stop.step)), (
        steps,
        stop.output[-4000:],
    )
    with open(os.path.join(stop.run_dir, "metrics.jsonl")) as f:
        reward_s = json.loads(f.readline())["timing_s/reward"]
    assert reward_s > STALL_TIMEOUT_S, reward_s
    for o in outcomes:
        broken = 0 if o.name in SEND_CASES else 1
        print(
            f"{o.name}: every rank ended {o.exit_s:.1f} s after the break "
            f"(rank {broken} in {o.stage}), rc {o.returncode}"
        )
    for o in outcomes:
        where = f"{o.name} (output in {o.run_dir}):\n{o.output[-4000:]}"
        assert o.returncode != 0, where
        assert o.exit_s <= STALL_TIMEOUT_S + EXIT_SLACK_S, f"{o.exit_s:.1f} s; {where}"
        assert not [pid for pid in o.pids if _alive(pid)], where
        lines = [line for line in o.output.splitlines() if line.startswith("stall: ")]
        assert len(lines) == 1, where
        line = lines[0]
        if o.name == "reward":
            assert "no rank made progress for" in line and "rank 0 (" in line, line
            assert "in stage reward at step 1 in reward_scorer.py:" in line, line
        elif o.name == "stop":
            assert "rank 1 (pid" in line and "sent no heartbeat for" in line, line
            assert f"in stage gen at step {stop.step} " in line, line
        elif o.name == "async_stop":
            assert "rank 1 (pid" in line and "sent no heartbeat for" in line, line
        else:  # killed: rank 1, or the trainer rank 0 in its weight push
            broken = 0 if o.name in SEND_CASES else 1
            assert f"rank {broken} (pid" in line and "ended without finishing its run" in line, line
            assert f"in stage {o.stage} at step" in line, line
        if o.name in SEND_CASES:
            assert o.stage == "send_weights", o.stage
        live = [0] if o.name.startswith("kill") else [1] if o.name == "async_kill_send" else [0, 1]
        for rank in live:
            path = os.path.join(o.run_dir, "stall", f"rank{rank}.txt")
            with open(path) as f:
                stacks = f.read()
            assert stacks.startswith(line), stacks[:500]
            assert "(most recent call first):" in stacks and 'File "' in stacks, stacks
        if o.name == "reward":
            with open(os.path.join(o.run_dir, "stall", "rank0.txt")) as f:
                assert "reward_scorer.py" in f.read()


# A multi-turn environment (never imported by the config check) and the rate-limited manager.
MULTI_TURN = ["rollout.multi_turn.enable=true", "rollout.multi_turn.environment=tests/env.py:reply"]
RATE_LIMITED = (
    "reward_model.reward_manager=verl_megatron.reward.managers.rate_limited:RateLimitedRewardManager"
)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("trainer.stall_timeout_s=2", "trainer.stall_timeout_s must be >= 5 (or 0: off), got 2.0"),
        ("trainer.process_group_timeout_s=0", "trainer.process_group_timeout_s must be > 0, got 0.0"),
        # The default stall timeout, 60 s: a call waited for as long without progress is a stall.
        (
            "reward_model.reward_kwargs.compute_score_timeout=60",
            "reward_model.reward_kwargs.compute_score_timeout=60 must be below trainer.stall_timeout_s=60: "
            "a scorer call is waited for without progress, so the watchdog would end the job first",
        ),
        (
            [*MULTI_TURN, "rollout.multi_turn.env_timeout_s=60"],
            "rollout.multi_turn.env_timeout_s=60 must be below trainer.stall_timeout_s=60: "
            "an environment call is waited for without progress, so the watchdog would end the job first",
        ),
        (
            [*MULTI_TURN, "rollout.multi_turn.env_timeout_s=20", "trainer.stall_timeout_s=20"],
            "rollout.multi_turn.env_timeout_s=20 must be below trainer.stall_timeout_s=20: "
            "an environment call is waited for without progress, so the watchdog would end the job first",
        ),
        (  # the manager's own default timeout, 300 s
            [RATE_LIMITED],
            "reward_model.reward_kwargs.config.reward.timeout=300 must be below trainer.stall_timeout_s=60: "
            "an API-bound scorer call is waited for without progress, so the watchdog would end the job first",
        ),
        (
            [RATE_LIMITED, "reward_model.reward_kwargs.config.reward.timeout=60"],
            "reward_model.reward_kwargs.config.reward.timeout=60 must be below trainer.stall_timeout_s=60: "
            "an API-bound scorer call is waited for without progress, so the watchdog would end the job first",
        ),
    ],
)
def test_timeouts_that_cannot_work_are_named_at_start_up(override, message):
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import default_config_path, load_config, validate_config

    overrides = [override] if isinstance(override, str) else override
    with pytest.raises(ConfigError) as err:
        validate_config(load_config(default_config_path(), overrides), 1)
    assert str(err.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["reward_model.reward_kwargs.compute_score_timeout=59"],
        ["reward_model.reward_kwargs.compute_score_timeout=600", "trainer.stall_timeout_s=0"],  # off
        ["reward_model.reward_kwargs.compute_score_timeout=null"],  # no limit: nothing to compare
        MULTI_TURN,  # the default env_timeout_s, 30 s
        [*MULTI_TURN, "rollout.multi_turn.env_timeout_s=59"],
        [*MULTI_TURN, "rollout.multi_turn.env_timeout_s=600", "trainer.stall_timeout_s=0"],
        [
            *MULTI_TURN,
            "rollout.multi_turn.env_timeout_s=600",
            "rollout.multi_turn.isolation=none",
        ],  # in the trainer: no timeout applies
        [RATE_LIMITED, "reward_model.reward_kwargs.config.reward.timeout=59"],
        [RATE_LIMITED, "trainer.stall_timeout_s=0"],
    ],
)
def test_scorer_timeouts_the_watchdog_outlasts_are_accepted(overrides):
    from verl_megatron.trainer.config import default_config_path, load_config, validate_config

    config = load_config(default_config_path(), overrides)
    validate_config(config, 1)
    assert config.trainer.stall_timeout_s in (0, 60)


# One process (a fresh interpreter costs ~3 CPU s; both tests below read its run): rank 0 alone
# over an in-process store, one watchdog, two phases.
# 1. The main thread waits for a worker thread that computes for twice the timeout (a blocking
#    scorer, an in-process agent harness): sustained work of another thread is progress, so the
#    process goes on and prints "finished" (a watchdog blind to the thread ends it at ~3 s).
# 2. The main thread sleeps (a hang) while another thread works 4 ms every 0.2 s, ~20 ms a second,
#    as a progress bar's refresh thread does: no progress, so the watchdog ends the process.
THREADS_SCRIPT = """
import sys, threading, time
import torch.distributed as dist
from verl_megatron.distributed.watchdog import Watchdog, WatchdogSettings

def work():
    end = time.thread_time() + {work_s}
    while time.thread_time() < end:
        pass

def refresh():
    while True:
        end = time.thread_time() + 0.004
        while time.thread_time() < end:
            pass
        time.sleep(0.2)

Watchdog(WatchdogSettings({timeout_s}, sys.argv[1]), 0, 1, dist.HashStore()).start()
worker = threading.Thread(target=work, daemon=True)
worker.start()
worker.join()
print("finished", flush=True)
threading.Thread(target=refresh, daemon=True).start()
time.sleep({hang_s})
print("not stopped")
"""
THREADS_TIMEOUT_S, WORK_S, HANG_S = 2, 4, 30


@pytest.fixture(scope="module")
def threads_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, float, str]:
    """The two-phase process: its result, seconds from start to exit, and its run dir."""
    run_dir = str(tmp_path_factory.mktemp("watchdog_threads"))
    script = THREADS_SCRIPT.format(timeout_s=THREADS_TIMEOUT_S, work_s=WORK_S, hang_s=HANG_S)
    start = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-c", script, run_dir],
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=WORK_S * 10 + HANG_S + 60,
    )
    return done, time.monotonic() - start, run_dir


def test_a_thread_the_main_thread_waits_for_is_progress(threads_run):
    done, _, _ = threads_run
    assert done.stdout.splitlines()[:1] == ["finished"], (done.returncode, done.stderr[-2000:])


def test_a_busy_background_thread_does_not_hide_a_stall_of_the_main_thread(threads_run):
    done, elapsed, run_dir = threads_run
    print(f"stall declared {elapsed:.1f} s after the start (work {WORK_S} s, timeout {THREADS_TIMEOUT_S} s)")
    assert done.returncode == 4 and done.stdout.strip() == "finished", (
        done.returncode,
        done.stdout,
        done.stderr[-2000:],
    )
    lines = [line for line in done.stderr.splitlines() if line.startswith("stall: ")]
    assert len(lines) == 1 and "no rank made progress for" in lines[0], done.stderr[-2000:]
    assert "in stage start" in lines[0] and f"(trainer.stall_timeout_s={THREADS_TIMEOUT_S})" in lines[0], (
        lines[0]
    )
    assert elapsed < WORK_S + HANG_S, elapsed
    with open(os.path.join(run_dir, "stall", "rank0.txt")) as f:
        assert f.read().startswith(lines[0])
