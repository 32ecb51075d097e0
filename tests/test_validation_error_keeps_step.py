"""An error in validation at a step that saves a checkpoint keeps what the step trained.

Validation runs before the step's checkpoint is written, so a validation that failed (out of
memory generating the validation set, a judge that died) ended the run with every step since the
previous checkpoint lost, the run's last step included. Now the step's checkpoint is written and
published with its training metrics logged, then the error is raised.
"""

from __future__ import annotations

import math
import os

from tests.test_e2e import QUICKSTART, TINY


def failing_validation_job(out_dir: str) -> dict:
    from verl_megatron.train import run
    from verl_megatron.trainer.ppo_trainer import PPOTrainer
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    validate = PPOTrainer._validate

    def fails_at_step_2(self: PPOTrainer, step: int) -> dict[str, float]:
        if step == 2:
            raise MemoryError("validation ran out of memory")
        return validate(self, step)

    PPOTrainer._validate = fails_at_step_2
    overrides = [
        "trainer.total_training_steps=3", "trainer.test_freq=2", "trainer.save_freq=2",
        "trainer.val_before_train=false", "trainer.export_hf=false",
    ]  # fmt: skip
    try:
        run(QUICKSTART, [f"trainer.default_local_dir={out_dir}", *TINY, *overrides])
        error = None
    except MemoryError as err:
        error = str(err)
    finally:
        PPOTrainer._validate = validate
    return {"error": error, "rows": read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))}


def test_a_validation_error_at_a_save_step_publishes_the_step_first(pool1, tmp_path) -> None:
    out = pool1.run(f"{__name__}:failing_validation_job", out_dir=str(tmp_path))[0]
    assert out["error"] == "validation ran out of memory"
    step_dir = tmp_path / "global_step_2"
    assert (step_dir / "checkpoint_complete.json").is_file(), sorted(os.listdir(tmp_path))
    logged = {r["step"]: r for r in out["rows"]}
    assert sorted(logged) == [1, 2]  # step 2 logged (its training metrics), step 3 never ran
    assert math.isfinite(logged[2]["actor/pg_loss"])
    assert not any(k.startswith("val/") for k in logged[2])
