"""benchmarks/bench_async.py compares sync and async on the same cores: the thread budget split
over the run's processes in both modes, and a long-tailed workload whose lengths the policy decides
(EOS not ignored) next to the uniform one (EOS ignored)."""

from __future__ import annotations

from tests.bench_modules import bench_module


def _bench_async():
    return bench_module("bench_async")


def test_every_process_gets_its_share_of_the_cores():
    bench = _bench_async()
    assert bench.PROCESSES == 2
    assert [bench.threads_per_process(b) for b in (1, 2, 3, 4, 16)] == [1, 1, 1, 2, 8]
    assert bench.run_env(2)["OMP_NUM_THREADS"] == "1"
    assert bench.run_env(4)["OMP_NUM_THREADS"] == "2"
    # No mode pins its own thread count or micro-batch: both come from the split and the product.
    overrides = [o for mode in bench.MODES.values() for o in mode]
    assert not any("threads" in o or "micro_batch" in o for o in overrides)


def test_workloads_uniform_and_long_tailed():
    bench = _bench_async()
    assert set(bench.WORKLOADS) == {"quickstart", "long", "long-tail"}
    assert "rollout.ignore_eos=true" in bench.WORKLOADS["long"]
    assert bench.WORKLOADS["long-tail"] == ["data.max_response_length=128"]  # EOS where sampled


def test_ceiling_note_is_the_sync_step_over_the_trainers_busy_time():
    bench = _bench_async()
    sync = bench.throughput_row("w", "sync", [])
    sync.update({"step_s": 1.5, "trainer: gen_s": 0.5})
    asyn = bench.throughput_row("w", "async", [])
    asyn.update(
        {
            "step_s": 1.25,
            "trainer: waits for batch_s": 0.25,
            "trainer: old_log_prob_s": 0.25,
            "trainer: update_actor_s": 0.75,
            "rollout rank: gen_s": 0.375,
            "rollout rank: old_log_prob_s": 0.25,
            "rollout rank: reward_s": 0.125,
        }
    )
    note = bench._ceiling_note("w", {"sync": sync, "async": asyn})
    # trainer busy 1.0 s, rollout busy 0.75 s: the split can at best make both 0.875 s
    assert "busy 1.000 s" in note and note.endswith(
        "cannot exceed 1.50x here however its generation overlaps, and no split of this work between the "
        "two roles beyond 1.71x (both equally busy)"
    )


def test_learning_is_judged_on_the_median_of_several_seeds():
    bench = _bench_async()
    assert bench.FULL.test_freq == 5 and len(set(bench.FULL.seeds)) >= 2
    assert bench.median_steps([80, 95]) == 87.5
    assert bench.median_steps([80, 95, 120]) == 95.0
    assert bench.median_steps([80, None]) is None  # a seed that never reached the target: no number
    # async computes half of the old log-probs on its rollout rank, a throughput option only
    assert "async_training.old_log_probs_on_rollout=true" in bench.MODES["async"]
