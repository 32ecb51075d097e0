"""The 2-process torchrun job behind tests/test_restart_async.py (rank 0 trains, rank 1 generates).

    torchrun --nproc_per_node=2 tests/restart_async_job.py OUT_DIR

One-step off-policy (max_staleness=1, whole responses: the weight version of every batch is fixed
by the step), 3 steps, a checkpoint every 2 (the fewest that resume from a checkpoint before the
last step and run a step after it). Runs in the same processes:
1. ``resumed``: the trainer fails at the start of step 3, after the rollout generated ahead;
2. ``resumed`` again, from its checkpoint of step 2, to the end;
3. ``extended``: a run of 2 steps (its checkpoint of step 2 is its last step's), then the same
   directory continued to 3 steps;
4. ``straight``: the same run uninterrupted.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

ONE_STEP_OFF = ["trainer.total_training_steps=3", "trainer.save_freq=2", "async_training.max_staleness=1"]


def run_interrupted(out: str, step: int) -> None:
    """The ``resumed`` run, its trainer stopped when step ``step`` starts (the rollout rank's
    transfer group is shut down under it: its error is expected too)."""
    from tests.async_job import QUICKSTART, Interrupted, common
    from verl_megatron.train import run
    from verl_megatron.trainer.ppo_trainer import PPOTrainer

    original = PPOTrainer.train_step

    def stop_at(self: PPOTrainer, at: int) -> dict[str, float]:
        if at == step:
            raise Interrupted(f"stopped at step {at}")
        return original(self, at)

    PPOTrainer.train_step = stop_at
    try:
        run(QUICKSTART, [*common(out, "resumed"), *ONE_STEP_OFF])
    except (Interrupted, RuntimeError) as err:
        if not isinstance(err, Interrupted) and "Connection" not in str(err):
            raise
    else:
        raise AssertionError("the interrupted run finished")
    finally:
        PPOTrainer.train_step = original


def main(out: str) -> None:
    import faulthandler

    from tests.async_job import QUICKSTART, common
    from verl_megatron.train import run

    faulthandler.dump_traceback_later(540, exit=True)  # a hang shows its stacks, then the test fails

    run_interrupted(out, 3)
    run(QUICKSTART, [*common(out, "extended"), *ONE_STEP_OFF, "trainer.total_training_steps=2"])
    for name in ("resumed", "extended", "straight"):
        run(QUICKSTART, [*common(out, name), *ONE_STEP_OFF])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
