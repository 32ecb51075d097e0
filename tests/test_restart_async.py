"""An async run (rollout.placement=separate) resumed from a checkpoint continues exactly (issue 30).

The batch of the first step after a resume from step c was regenerated with the checkpoint's
weights (staleness 0) where the uninterrupted run had used the version before (staleness 1), and
from there on the runs departed. The checkpoint now keeps the versions c-k..c-1 the rollout still
generates with; resumed and uninterrupted runs log the same metrics, timings aside. So does a run
continued with more steps from the checkpoint of its last step (which kept none before).
"""

from __future__ import annotations

from tests import restart_job as job

# Wall-clock times of the rollout rank, logged as async/* metrics.
TIMES = ("async/rollout_wait_weights_s", "async/rollout_gen_s", "async/rollout_reward_s")


def test_async_resume_regenerates_with_the_uninterrupted_runs_weights(tmp_path, pool2) -> None:
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    # The torchrun script tests/restart_async_job.py on the pool's 2 ranks (tests/separate_in_pool.py).
    ranks = pool2.run(
        "tests.separate_in_pool:run_main", timeout_s=600, module="tests.restart_async_job", out=str(tmp_path)
    )
    stdout = "".join(out for out, _ in ranks)
    assert "resumed from step 2" in stdout, stdout[-3000:]

    def rows(name: str) -> list[dict]:
        found = read_jsonl_metrics(tmp_path / name / "metrics.jsonl")
        return [{k: v for k, v in r.items() if k not in TIMES} for r in found]

    resumed, extended, straight = rows("resumed"), rows("extended"), rows("straight")
    # Every batch after step 1 was generated one version behind, the resumed step 3 too, and the
    # step 3 of a run continued from its last step's checkpoint (which keeps version 1 for it).
    assert [r["async/staleness_max"] for r in resumed] == [0.0, 1.0, 1.0]
    assert [r["async/staleness_max"] for r in extended] == [0.0, 1.0, 1.0]
    job.assert_same_metrics(resumed, straight)
    job.assert_same_metrics(extended, straight)
    print(
        "grad_norm resumed",
        [r["actor/grad_norm"] for r in resumed],
        "straight",
        [r["actor/grad_norm"] for r in straight],
    )
