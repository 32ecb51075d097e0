"""torchrun --max-restarts restarts a killed 2-process job by itself, and the run ends as if
never interrupted (issue 30).

Rank 1 is SIGKILLed while step 3 runs (checkpoint 2 published); torchrun stops rank 0 and
starts both again. The new group forms (it used to read the dead group's addresses from
torchrun's store and never formed), resumes from checkpoint 2 with no user action (the run was
started with ``trainer.resume_mode=disable``), and its metrics.jsonl equals an uninterrupted
run's, timings aside. The uninterrupted run is a two-"node" job (two torchrun agents, c10d
rendezvous, one process each): the same numbers also show that two nodes train like one.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests import restart_job as job

# Holds the run in the step after a checkpoint so that a kill lands there: the first reward call
# made once a checkpoint is out under ``checkpoints`` leaves a marker file beside that folder (the
# test kills on seeing it) and sleeps (no CPU); later calls, on any rank or restarted attempt, find
# the marker and do not. The sleep is shorter than the 30 s per-call limit of scorers. Every score
# is the default scorer's.
HOLDING_SCORER = """
import os
import time

from verl_megatron.checkpoint import find_latest_checkpoint
from verl_megatron.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, checkpoints=None):
    if checkpoints is not None and find_latest_checkpoint(checkpoints) is not None:
        try:
            os.close(os.open(f"{checkpoints}.held", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass
        else:
            time.sleep(20)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def test_torchrun_restarts_a_killed_rank_and_the_run_resumes_exactly(tmp_path):
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    scorer = tmp_path / "holding_scorer.py"
    scorer.write_text(HOLDING_SCORER)
    # The fewest steps that show it: checkpoint 2 published, the kill in step 3, and the resumed
    # attempt's step 3 equal to the uninterrupted run's (weights, optimizer, data and RNG restored).
    steps, port = 3, job.free_port()
    nodes = [
        job.two_nodes(port, job.job_overrides(tmp_path / "two_nodes", scorer, None, steps), n) for n in (0, 1)
    ]
    outputs = job.finish(nodes, timeout=600)
    assert [proc.returncode for proc in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    reference = read_jsonl_metrics(tmp_path / "two_nodes" / "metrics.jsonl")
    assert [r["step"] for r in reference] == list(range(1, steps + 1))  # no validation row

    out = tmp_path / "restarted"
    launcher_args = ["--nproc_per_node=2", "--max-restarts=1", f"--master-port={job.free_port()}"]
    # Step 3, the last, is held 20 s by its first reward call (the scorer): a window the 0.02 s
    # poll of the marker and the kill reach on a loaded machine, while the other steps run at full
    # speed.
    held = [
        *job.job_overrides(out, scorer, None, steps), f"custom_reward_function.reward_kwargs.checkpoints={out}",
        "trainer.resume_mode=disable",
    ]  # fmt: skip
    proc = subprocess.Popen(
        job.torchrun(launcher_args, held), cwd=job.ROOT, env=job.env(), stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        rank1 = job.worker(proc, rank=1)
        job.wait_for_checkpoint(out, 2, [proc])
        wait_for_hold(out, proc)
        os.kill(rank1, signal.SIGKILL)  # step 3 is running (held by the scorer)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=600)
    finally:
        job.stop([proc])
    took = time.monotonic() - killed
    assert proc.returncode == 0, output[-4000:]
    # One restart, and it resumed from the checkpoint published before the kill.
    assert output.count("verl-megatron train: model") == 2, output[-4000:]
    assert "torchrun restart 1 of 1: resuming from the newest intact checkpoint" in output, output[-4000:]
    assert "resumed from step 2" in output, output[-4000:]
    job.assert_same_metrics(read_jsonl_metrics(out / "metrics.jsonl"), reference)
    print(f"rank 1 killed -> restarted run finished after {took:.1f} s")


def wait_for_hold(out: Path, launcher: subprocess.Popen, deadline_s: float = 300) -> None:
    """Return once the scorer holds the run (its marker beside ``out``); fail if it ended first."""
    end = time.monotonic() + deadline_s
    while not Path(f"{out}.held").exists():
        assert launcher.poll() is None, f"the run ended before the hold:\n{launcher.stdout.read()[-3000:]}"
        assert time.monotonic() < end, f"no hold within {deadline_s} s"
        time.sleep(0.02)


def test_a_restart_after_the_guard_stopped_the_run_stops_too(tmp_path, monkeypatch):
    """The resume is exact: an attempt after a divergence would diverge again at the same step
    (each restart replayed the steps since the checkpoint). It raises the guard's error instead,
    unless the marker predates this job's launcher (a run the user started again)."""
    import json

    from verl_megatron.trainer.config import default_config_path, load_config
    from verl_megatron.trainer.guard import TrainingDivergedError
    from verl_megatron.trainer.trainer_checkpoint import restarted

    config = load_config(default_config_path(), [f"trainer.default_local_dir={tmp_path}"])
    marker = tmp_path / "diverged.json"
    marker.write_text(json.dumps({"step": 7, "error": "training diverged at step 7: NaN"}))
    assert restarted(config, rank=0) == (config, None)  # a first attempt starts whatever is there
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "2")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "3")
    with pytest.raises(TrainingDivergedError) as err:
        restarted(config, rank=1)
    assert str(err.value) == (
        "training diverged at step 7: NaN; torchrun restart 2 of 3 does not resume: it would diverge "
        "again at step 7"
    )
    os.utime(marker, (1e9, 1e9))  # left by an earlier launch: this job starts over
    assert restarted(config, rank=0)[1] == "torchrun restart 2 of 3: no checkpoint yet, starting over"


def test_a_restart_before_the_first_checkpoint_starts_over(tmp_path, monkeypatch):
    """No checkpoint yet: the attempt starts over, dropping only a metrics.jsonl this job wrote
    (newer than its launcher); with a checkpoint it resumes, even from resume_mode=disable."""
    from verl_megatron.trainer.config import default_config_path, load_config
    from verl_megatron.trainer.trainer_checkpoint import restarted

    config = load_config(
        default_config_path(), [f"trainer.default_local_dir={tmp_path}", "trainer.resume_mode=disable"]
    )
    assert restarted(config, rank=0) == (config, None)  # the first attempt
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "2")
    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 0}\n')
    os.utime(metrics, (1e9, 1e9))  # written before this process's launcher started: another run's
    assert restarted(config, rank=0)[1] == "torchrun restart 1 of 2: no checkpoint yet, starting over"
    assert metrics.exists()
    os.utime(metrics)  # written now: this job's own
    restarted(config, rank=1)
    assert metrics.exists()  # rank 0 alone drops it
    restarted(config, rank=0)
    assert not metrics.exists()

    step = tmp_path / "global_step_2"
    step.mkdir()
    (step / "checkpoint_complete.json").write_text('{"format_version": 1, "step": 2, "parts": []}')
    resumed, line = restarted(config, rank=0)
    from verl_megatron.checkpoint import find_latest_checkpoint

    assert find_latest_checkpoint(tmp_path) == step, "the fake checkpoint should count as complete"
    assert line == "torchrun restart 1 of 2: resuming from the newest intact checkpoint"
    assert resumed.trainer.resume_mode == "auto" and config.trainer.resume_mode == "disable"
