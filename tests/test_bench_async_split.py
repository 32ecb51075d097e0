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
    assert bench.median_steps([80, None]) is None  # the median is a seed that never reached it
    assert bench.median_steps([80, None, 95]) == 95.0  # one such seed counts as the latest, not as no number
    assert bench.median_steps([]) is None
    # async computes half of the old log-probs on its rollout rank, a throughput option only
    assert "async_training.old_log_probs_on_rollout=true" in bench.MODES["async"]


def test_throughput_repeats_alternate_and_report_medians():
    bench = _bench_async()
    assert bench.FULL.repeats >= 3 and bench.QUICK.repeats == 1
    assert bench.run_order(4) == [("sync", "async"), ("async", "sync"), ("sync", "async"), ("async", "sync")]

    def row(mode, steps_min, step_s):
        return {**bench.throughput_row("w", mode, []), "steps/min": steps_min, "step_s": step_s}

    runs = {
        "sync": [row("sync", 100.0, 0.6), row("sync", 130.0, 0.46), row("sync", 120.0, 0.5)],
        "async": [row("async", 150.0, 0.4), row("async", 156.0, 0.385), row("async", 160.0, 0.375)],
    }
    # the median run is a real run's row (its step_s goes with its steps/min), not a mix
    assert bench.median_run(runs["sync"])["step_s"] == 0.5
    assert bench.median_run(runs["sync"][:2])["step_s"] == 0.6  # even count: the lower middle
    pairs = bench.paired_ratios(runs)
    assert pairs == [1.5, 1.2, 160.0 / 120.0]
    # the ratio is the median of the pairs (1.333), not the ratio of the medians (156 / 120 = 1.3)
    assert bench.median_or_none(pairs) == 160.0 / 120.0
    assert bench.median_or_none([1.2, None]) is None
    note = bench._repeats_note("long-tail", runs, pairs)
    assert "3 runs of each mode" in note and "sync 100.0-130.0" in note and "1.500, 1.200, 1.333" in note


def test_repeats_from_the_command_line():
    bench = _bench_async()
    args = bench.parser().parse_args(["--no-learning", "--repeats", "5"])
    assert bench.config_from_args(args).repeats == 5
    assert bench.config_from_args(bench.parser().parse_args(["--quick"])).repeats == 1
    try:
        bench.config_from_args(bench.parser().parse_args(["--repeats", "0"]))
    except ValueError as e:
        assert "--repeats must be >= 1, got 0" in str(e)
    else:
        raise AssertionError("--repeats 0 was accepted")
