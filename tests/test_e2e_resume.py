"""Resume: a run killed with SIGKILL and restarted with trainer.resume_mode=auto continues from
its latest complete checkpoint and logs exactly the metrics of an uninterrupted run.

Only the killed run is a process of its own (the SIGKILL is the subject); the uninterrupted and
the resumed runs run in a pool worker, sparing each an interpreter that imports megatron."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.test_e2e import QUICKSTART, TINY, _by_step

# Slows every reward call down (it does not change the score) so the kill lands mid-run.
SLOW_SCORER = """
import time

from verl_megatron.utils.reward_score import default_compute_score


def compute_score(data_source, solution_str, ground_truth, extra_info=None, delay=0.0):
    time.sleep(delay)
    return default_compute_score(data_source, solution_str, ground_truth, extra_info)
"""


def _overrides(out_dir: str, scorer: str, delay: float, resume_mode: str) -> list[str]:
    return [
        *TINY,
        f"trainer.default_local_dir={out_dir}",
        "trainer.total_training_steps=4",
        "trainer.save_freq=2",
        "trainer.export_hf=false",
        f"trainer.resume_mode={resume_mode}",
        f"custom_reward_function.path={scorer}",
        f"custom_reward_function.reward_kwargs.delay={delay}",
    ]


def reference_job(overrides: list[str]) -> tuple[list[dict], int]:
    """The run's metrics rows, and how many child processes (scorer workers) outlived it."""
    import multiprocessing

    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    run(QUICKSTART, overrides)
    out_dir = next(o.split("=", 1)[1] for o in overrides if o.startswith("trainer.default_local_dir="))
    return read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl")), len(multiprocessing.active_children())


def _command(overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "verl_megatron.train", "--config", QUICKSTART, *overrides]


def _env() -> dict[str, str]:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": root}


def _comparable(row: dict) -> dict:
    return {k: v for k, v in row.items() if not k.startswith(("timing_s/", "timing_per_token_ms/", "perf/"))}


def test_sigkilled_run_resumes_to_the_uninterrupted_metrics(pool1, tmp_path):
    from verl_megatron.checkpoint import find_latest_checkpoint

    scorer = tmp_path / "slow_scorer.py"
    scorer.write_text(SLOW_SCORER)
    reference, leftover_children = pool1.run(
        "tests.test_e2e_resume:reference_job",
        overrides=_overrides(str(tmp_path / "reference"), str(scorer), 0.0, "disable"),
    )[0]
    # The custom scorer ran in worker processes; the finished run closed them.
    assert leftover_children == 0, f"{leftover_children} scorer worker(s) outlived the run"

    out = tmp_path / "killed"
    proc = subprocess.Popen(
        _command(_overrides(str(out), str(scorer), 0.02, "auto")),
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    while find_latest_checkpoint(out) is None:
        assert proc.poll() is None, (
            f"the run ended before its first checkpoint:\n{proc.stderr.read()[-3000:]}"
        )
        assert time.monotonic() < deadline, "no checkpoint within 300 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    saved = int(find_latest_checkpoint(out).name.rsplit("_", 1)[1])
    assert saved == 2, "the kill should land before the last checkpoint"

    (resumed,) = pool1.run(
        "tests.helpers:cli_train_job",
        argv=["--config", QUICKSTART, *_overrides(str(out), str(scorer), 0.0, "auto")],
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from step {saved}" in resumed.stdout

    from verl_megatron.trainer.tracking import read_jsonl_metrics

    rows = read_jsonl_metrics(out / "metrics.jsonl")
    # One line per step (validation shares its step's line): the file is one history.
    assert [r["step"] for r in rows] == [r["step"] for r in reference] == [0, 1, 2, 3, 4]
    ref_steps, steps = _by_step(reference), _by_step(rows)
    assert "val/test_score/synthetic/reverse" in steps[3]  # validated (test_freq=3) after the resume
    for step in range(saved + 1, 5):
        assert _comparable(steps[step]) == _comparable(ref_steps[step]), step
    assert {"global_step_2", "global_step_4"} <= set(os.listdir(out))
