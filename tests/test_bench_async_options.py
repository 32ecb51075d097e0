"""benchmarks/bench_async.py runs sync and async with the same product options, which the typed
config accepts on the quickstart, and states them in the section's config."""

from __future__ import annotations

from tests.test_bench_async_split import _bench_async as _bench


def test_both_modes_share_the_product_options_and_the_config_states_them():
    bench = _bench()
    from verl_megatron.trainer.config import load_config

    assert bench.AsyncBenchConfig().options == tuple(bench.SHARED)
    # the modes differ only in placement and its off-policy correction, never in batching
    assert not any(
        o.split("=")[0] in {s.split("=")[0] for s in bench.SHARED} for m in bench.MODES.values() for o in m
    )
    for mode in bench.MODES.values():
        cfg = load_config(str(bench.QUICKSTART), [*bench.SHARED, *mode, *bench.WORKLOADS["long-tail"]])
        assert (cfg.actor.use_dynamic_bsz, cfg.actor.group_by_length) == (True, True)
        assert cfg.actor.ppo_max_token_len_per_gpu == cfg.actor.ppo_infer_max_token_len_per_gpu == 2048


def test_ceiling_is_set_by_the_busier_role():
    bench = _bench()
    sync = {**bench.throughput_row("w", "sync", []), "step_s": 1.5, "trainer: gen_s": 0.5}
    asyn = {**bench.throughput_row("w", "async", []), "step_s": 1.0, "trainer: waits for batch_s": 0.5}
    asyn["rollout rank: gen_s"] = 0.75  # the rollout rank, not the trainer (0.5 s), bounds the step
    assert "cannot exceed 2.00x here however its generation overlaps" in bench._ceiling_note(
        "w", {"sync": sync, "async": asyn}
    )
