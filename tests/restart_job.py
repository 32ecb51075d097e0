"""Helpers of the torchrun restart and two-"node" tests: launch torchrun on the quickstart, find a
rank's worker process, wait for a checkpoint, compare two runs' metrics (every key but timings)."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")

# Slows every reward call down (the score is unchanged) so a kill lands mid-run.
SLOW_SCORER = """
import time

from verl_megatron.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, delay=0.0):
    time.sleep(delay)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""

# The e2e tests' tiny job (tests/test_e2e.py TINY) at 2 processes: 4 prompts x 4 samples a rank.
# No validation: what these tests compare is training (metrics, checkpoints, restarts), and each
# validation pass generates for the whole validation set.
TINY2 = [
    "quickstart.num_digits=2",
    "data.train_batch_size=8",
    "data.max_response_length=3",
    "rollout.n=4",
    "actor.ppo_mini_batch_size=4",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.export_hf=false",
    "trainer.logger=[console]",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def env() -> dict[str, str]:
    out = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": ROOT}
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT", "MASTER_ADDR"):
        out.pop(key, None)
    return out


def job_overrides(
    out_dir: str | os.PathLike, scorer: str | os.PathLike, delay: float | None, steps: int
) -> list[str]:
    """The tiny job scored by ``scorer``, with ``reward_kwargs.delay`` unless ``delay`` is None (a
    scorer that takes no delay)."""
    delay_kwarg = [] if delay is None else [f"custom_reward_function.reward_kwargs.delay={delay}"]
    return [
        *TINY2,
        f"trainer.default_local_dir={out_dir}",
        f"trainer.total_training_steps={steps}",
        "trainer.save_freq=2",
        f"custom_reward_function.path={scorer}",
        *delay_kwarg,
    ]


def torchrun(launcher_args: list[str], overrides: list[str]) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", *launcher_args,
        "-m", "verl_megatron.train", "--config", QUICKSTART, *overrides,
    ]  # fmt: skip


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher and every process under it (torchrun starts each worker in a session of
    its own: killing the launcher's process group would leave the workers running)."""
    import psutil

    try:
        family = [*psutil.Process(proc.pid).children(recursive=True), psutil.Process(proc.pid)]
    except psutil.NoSuchProcess:
        family = []
    for member in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            member.kill()
    proc.communicate()


def two_nodes(port: int, overrides: list[str], node: int, restarts: int = 0) -> subprocess.Popen:
    """Node ``node`` of a two-"node" job on this machine: its own torchrun agent (c10d rendezvous
    on localhost), one process."""
    launcher = [
        "--nnodes=2", f"--node-rank={node}", "--nproc-per-node=1", "--rdzv-backend=c10d",
        f"--rdzv-endpoint=localhost:{port}", "--rdzv-id=two-nodes", f"--max-restarts={restarts}",
    ]  # fmt: skip
    return subprocess.Popen(
        torchrun(launcher, overrides), cwd=ROOT, env=env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip


def finish(procs: list[subprocess.Popen], timeout: float) -> list[str]:
    """Wait for launchers; any still running after ``timeout`` goes with its workers."""
    try:
        return [proc.communicate(timeout=timeout)[0] for proc in procs]
    finally:
        stop(procs)


def stop(procs: list[subprocess.Popen]) -> None:
    """Kill, with their workers, the launchers still running."""
    for proc in procs:
        if proc.poll() is None:
            kill_tree(proc)


def worker(launcher: subprocess.Popen, rank: int | None, deadline_s: float = 300.0) -> int:
    """The pid of the training process of global ``rank`` (None: any) started by this torchrun."""
    import psutil

    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for child in psutil.Process(launcher.pid).children():  # torchrun's workers, not their children
            try:
                environ = child.environ()
            except psutil.Error:
                continue
            if rank in (None, int(environ.get("RANK", -1))) and "verl_megatron.train" in " ".join(
                child.cmdline()
            ):
                return child.pid
        time.sleep(0.05)
    raise AssertionError(f"no rank {rank} worker under torchrun pid {launcher.pid} within {deadline_s} s")


def wait_for_checkpoint(
    out: Path, step: int, launchers: list[subprocess.Popen], deadline_s: float = 600
) -> None:
    """Return once ``global_step_<step>`` is published under ``out``; fail if a launcher ended first."""
    from verl_megatron.checkpoint import find_latest_checkpoint

    end = time.monotonic() + deadline_s
    while True:
        latest = find_latest_checkpoint(out)
        if latest is not None and int(latest.name.rsplit("_", 1)[1]) >= step:
            return
        for proc in launchers:
            assert proc.poll() is None, (
                f"the run ended before checkpoint {step}:\n{proc.stdout.read()[-3000:]}"
            )
        assert time.monotonic() < end, f"no checkpoint {step} within {deadline_s} s"
        time.sleep(0.02)


def comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}


def assert_same_metrics(rows: list[dict], reference: list[dict]) -> None:
    """Every step's metrics equal (timings aside); the message names the first differing step and key."""
    assert [r["step"] for r in rows] == [r["step"] for r in reference], (
        f"steps {[r['step'] for r in rows]} vs reference {[r['step'] for r in reference]}"
    )
    for row, ref in zip(rows, reference):
        got, want = comparable(row), comparable(ref)
        diff = {k: (got.get(k), want.get(k)) for k in set(got) | set(want) if got.get(k) != want.get(k)}
        assert not diff, f"step {row['step']}: (run, reference) differ at {sorted(diff.items())[:6]}"
