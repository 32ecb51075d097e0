"""The 2-process torchrun job behind tests/test_async_training.py (rank 0 trains, rank 1 generates).

    torchrun --nproc_per_node=2 tests/async_job.py OUT_DIR

Three quickstart runs in the same processes (imports paid once), with rollout.placement=separate:
1. one-step off-policy with partial rollout, 4 steps, checkpoint at step 2; the trainer fails
   at the start of step 3, while the rollout has already generated ahead;
2. the same directory (``resumed``) resumed to the end;
3. ``straight``: the same run uninterrupted.
All three with ``async_training.old_log_probs_on_rollout`` (the rollout rank computes old log-probs
between weight versions). ``resumed`` adds ``actor.old_log_probs_from_first_update``: the rollout
computes every row after the first mini-batch and the trainer's update takes them when it reaches
them; ``straight`` waits for its share before the update.
"""

from __future__ import annotations

import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")


class Interrupted(Exception):
    """Raised by the patched trainer at the start of the step it should die in."""


def common(out: str, name: str) -> list[str]:
    return [
        f"trainer.default_local_dir={out}/{name}", f"quickstart.assets_dir={out}/assets",
        "quickstart.hidden_size=32", "quickstart.intermediate_size=64",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=2",
        "actor.ppo_micro_batch_size_per_gpu=8", "actor.optim.lr=0.01",
        "trainer.val_before_train=false", "trainer.test_freq=-1", "trainer.export_hf=false",
        "trainer.logger=[jsonl]", "rollout.placement=separate", "rollout.world_size=1",
        "algorithm.rollout_correction.rollout_is=token",
    ]  # fmt: skip


OFF_POLICY = [
    "trainer.total_training_steps=4", "trainer.save_freq=2", "async_training.max_staleness=1",
    "async_training.partial_rollout=true", "async_training.partial_rollout_segment=2",
    "async_training.old_log_probs_on_rollout=true",  # the rollout rank computes half of them
]  # fmt: skip
# The first mini-batch's from its update forward; every later row's from the rollout rank, which the
# update takes when it cuts its second mini-batch.
LATE = ["actor.old_log_probs_from_first_update=true"]


def main(out: str) -> None:
    from verl_megatron.train import run
    from verl_megatron.trainer.ppo_trainer import PPOTrainer  # the trainer ranks run its loop

    train_step = PPOTrainer.train_step

    def dies_at_step_3(self, step: int):
        if step == 3:
            raise Interrupted(f"interrupted at step {step}")
        return train_step(self, step)

    PPOTrainer.train_step = dies_at_step_3
    try:
        run(QUICKSTART, [*common(out, "resumed"), *OFF_POLICY, *LATE])
        raise AssertionError("the interrupted run finished")
    except Interrupted:
        pass  # the trainer rank
    except RuntimeError as err:  # the rollout rank: its peer shut the transfer group down
        if "Connection closed by peer" not in str(err) and "Connection reset" not in str(err):
            raise
    PPOTrainer.train_step = train_step
    run(QUICKSTART, [*common(out, "resumed"), *OFF_POLICY, *LATE])
    run(QUICKSTART, [*common(out, "straight"), *OFF_POLICY])


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
