"""``actor.old_log_probs_from_first_update``: the first mini-batch's old log-probs are its own update
forward's, detached; the old-log-prob pass computes only the later mini-batches' rows.

Before the first optimizer step of an update call the weights are the pass's, so the option changes
the first mini-batch's old log-probs only by the float32 rounding of another batching. The actor
test (tests/test_actor_update.py's batch: 8 rows, two mini-batches of 4, token-budget micro-batches
of 16 tokens in the update and one micro-batch in the pass) updates two actors from the same
checkpoint, one given every row's old log-probs, one given NaN in rows 0..3 and the option: the
option's first step has a ratio of exactly 1 (ppo_kl and clip fraction 0), the plain one's differs
from 1 by at most exp(2 eps) - 1, eps = the pass's largest error against a float64 transformers
forward (c = 2: the pass and the update forward are two float32 evaluations of the same sums, each
within eps of it); the first loss differs by at most max|A| times that; the update forward itself
(entropy, KL loss) is bit-identical; the second step and the weights after both steps agree to the
float32 bounds of tests/test_actor_update.py. With bitwise parity (the pass and the update forward
give the same bits) a 2-step quickstart run with the option trains bit for bit like one without,
while the pass sees half the rows. Refusals are named at start-up.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from tests.closeness import assert_adam_weights_close, assert_close_report
from tests.test_actor_update import (
    LR,
    TEMPERATURE,
    TP_LEN,
    _hf_log_probs,
    build_actor,
    full_weights,
    make_batch,
)
from tests.test_e2e import QUICKSTART
from tests.test_rollout_parity import QUICKSTART_PARITY

SETTINGS = {"use_remove_padding": True, "use_dynamic_bsz": True, "ppo_max_token_len_per_gpu": 16}
FIRST = 4  # rows of the first mini-batch (ppo_mini_batch_size of kl_actor_config)
OPTION = "actor.old_log_probs_from_first_update=true"
IS = {"rollout_is": "token", "rollout_is_threshold": 2.0}  # truncated importance weights (TIS)


def arriving_rows(chunks, runtime, arrived: dict, seen: list):
    """``LateRows`` of rows FIRST.. giving ``arrived``; the weights when it is made and when it is
    fetched go to ``seen``."""
    from verl_megatron.workers.batching import LateRows

    def snapshot() -> dict[str, torch.Tensor]:
        return {name: t.clone() for name, t in full_weights(chunks, runtime).items()}

    def fetch() -> dict:
        seen.append(snapshot())
        return arrived

    seen.append(snapshot())
    return LateRows(FIRST, fetch)


def update_job(path: str) -> dict:
    from tests.test_actor_update import kl_actor_config
    from verl_megatron.algos.rollout_corr_helper import compute_rollout_correction_weights
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.actor import FIRST_UPDATE_IS

    runtime = init_runtime(ParallelLayout(), seed=5)
    out: dict = {}
    for own in (False, True, "late"):
        chunks, actor = build_actor(
            runtime, path, kl_actor_config(old_log_probs_from_first_update=bool(own), **SETTINGS)
        )
        data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
        old, _ = actor.compute_log_prob(data)
        data.batch["ref_log_prob"] = old - 0.3 * data.batch["response_mask"]
        mask = data.batch["response_mask"]
        g = torch.Generator().manual_seed(3)
        data.batch["rollout_log_probs"] = old + 0.5 * torch.randn(old.shape, generator=g) * mask
        weights, _ = compute_rollout_correction_weights(old - data.batch["rollout_log_probs"], mask, **IS)
        given = old.clone()
        if own:  # as the trainer leaves them: never read
            given[:FIRST] = weights[:FIRST] = float("nan")
            data.meta_info[FIRST_UPDATE_IS] = IS
        data.batch["old_log_probs"], data.batch["rollout_is_weights"] = given, weights
        late, seen = None, []
        if own == "late":  # rows 4..7 arrive once the first mini-batch has updated
            arrived = {"old_log_probs": given[FIRST:].clone(), "rollout_is_weights": weights[FIRST:].clone()}
            given[FIRST:] = weights[FIRST:] = float("nan")
            late = arriving_rows(chunks, runtime, arrived, seen)
        out[own] = {
            "old": old,
            "metrics": actor.update_policy(data, late),
            "weights": full_weights(chunks, runtime),
            "seen": seen,
        }
    return out


@pytest.fixture(scope="module")
def updates(pool1, model_path) -> dict:
    return pool1.run(f"{__name__}:update_job", path=model_path)[0]


def test_first_mini_batch_ratio_is_one_and_the_update_matches(updates, model_path):
    plain, own = updates[False], updates[True]
    hf64, _ = _hf_log_probs(model_path, torch.float64)
    valid = make_batch()["attention_mask"][:, TP_LEN:].bool()
    eps = float((plain["old"].double() - hf64).abs()[valid].max())
    assert 0 < eps < 1e-4, eps
    first = {k: v[0] for k, v in own["metrics"].items() if isinstance(v, list)}
    # The ratio of the first mini-batch is exactly 1.
    assert first["actor/ppo_kl"] == 0.0 and first["actor/pg_clipfrac"] == 0.0, first
    assert own["metrics"]["actor/skipped_steps"] == 0.0
    # The plain run's first ratio: within exp(2 eps) - 1 of 1 (its ppo_kl within 2 eps of 0).
    plain_first = {k: v[0] for k, v in plain["metrics"].items() if isinstance(v, list)}
    assert abs(plain_first["actor/ppo_kl"]) <= 2 * eps, (plain_first["actor/ppo_kl"], eps)
    advantages = make_batch()["advantages"][:FIRST].abs().max().item()
    # token-mean of -A * w * ratio: the ratio and the IS weight w (<= 2) each within exp(+-2 eps) of
    # the plain run's, times max|A| * 2, plus float32 rounding of the sum.
    loss_bound = advantages * 2 * (math.expm1(4 * eps) + 64 * 2.0**-24)
    loss_diff = abs(first["actor/pg_loss"] - plain_first["actor/pg_loss"])
    assert loss_diff <= loss_bound, (
        f"first pg_loss differs by {loss_diff:.3g} > {loss_bound:.3g} (eps {eps:.3g})"
    )
    # The update forward itself is the same computation in both runs.
    for key in ("actor/entropy", "actor/kl_loss"):
        assert first[key] == plain_first[key], (key, first[key], plain_first[key])
    second = {k: v[1:] for k, v in own["metrics"].items() if isinstance(v, list)}
    plain_second = {k: v[1:] for k, v in plain["metrics"].items() if isinstance(v, list)}
    assert_close_report(second, plain_second, rtol=1e-4, atol=1e-6, what="second mini-batch's metrics")
    assert_close_report(
        own["metrics"]["actor/grad_norm"][0],
        plain_first["actor/grad_norm"],
        rtol=1e-4,
        atol=1e-6,
        what="grad_norm",
    )
    assert_adam_weights_close(
        own["weights"], plain["weights"], lr=LR, steps=2, what="weights after both steps"
    )


def test_rows_that_arrive_during_the_update_train_bit_for_bit_the_same(updates):
    # An async run's rollout rows: NaN when the update starts, fetched when mini-batch 2 is cut.
    own, late = updates[True], updates["late"]
    before, at_fetch = late["seen"]  # fetched once, after the first optimizer step and before the second
    assert any(not torch.equal(before[n], at_fetch[n]) for n in before), "fetched before the first step"
    assert any(not torch.equal(at_fetch[n], late["weights"][n]) for n in before), (
        "fetched after the last step"
    )
    differ = {k: (v, late["metrics"][k]) for k, v in own["metrics"].items() if v != late["metrics"][k]}
    assert not differ, f"metrics differ: {differ}"
    bad = [n for n in own["weights"] if not torch.equal(own["weights"][n], late["weights"][n])]
    assert not bad, f"weights differ in {bad[:4]}"


def parity_job(out_dir: str, overrides: list[str]) -> dict:
    """A 2-step parity quickstart run; its metrics and the rows of each old-log-prob pass (rank 0)."""
    import os

    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics
    from verl_megatron.workers.actor import MegatronActor

    rows: list[int] = []
    original = MegatronActor.compute_log_prob

    def counted(self, data, *args, **kwargs):
        rows.append(len(data))
        return original(self, data, *args, **kwargs)

    MegatronActor.compute_log_prob = counted
    try:
        run(QUICKSTART, [f"trainer.default_local_dir={out_dir}", *QUICKSTART_PARITY, *overrides])
    finally:
        MegatronActor.compute_log_prob = original
    metrics = read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return {"rows": [r for r in metrics if r.get("step", 0) > 0], "pass_rows": rows}


def test_parity_run_trains_bit_for_bit_the_same_with_half_the_pass(pool1, tmp_path):
    tis = "algorithm.rollout_correction.rollout_is=token"  # the first rows' weights from the update
    plain = pool1.run(f"{__name__}:parity_job", out_dir=str(tmp_path / "plain"), overrides=[tis])[0]
    own = pool1.run(f"{__name__}:parity_job", out_dir=str(tmp_path / "own"), overrides=[tis, OPTION])[0]
    # 4 prompts x 4 samples, mini-batches of 2 x 4: the pass takes rows 8..15 only.
    assert plain["pass_rows"] == [16, 16] and own["pass_rows"] == [8, 8], (
        plain["pass_rows"],
        own["pass_rows"],
    )
    assert plain["rows"][1]["actor/grad_norm"] > 0  # a real update
    assert len(plain["rows"]) == len(own["rows"]) == 2
    trained = ("actor/", "response_length/", "critic/score")
    pairs = {
        (row["step"], key): (value, other.get(key))
        for row, other in zip(plain["rows"], own["rows"])
        for key, value in row.items()
        if key.startswith(trained)
    }
    differ = {where: values for where, values in pairs.items() if values[0] != values[1]}
    assert len(pairs) > 20 and not differ, f"{len(differ)} of {len(pairs)} metrics differ: {differ}"


@pytest.mark.parametrize(
    ("override", "named"),
    [
        ("actor.recompute_old_log_prob=false", r"needs no actor\.recompute_old_log_prob=false"),
        ("actor.ppo_epochs=2", r"needs no actor\.ppo_epochs=2"),
        ("actor.shuffle=true", r"needs no actor\.shuffle=true"),
        ("algorithm.use_kl_in_reward=true", r"exist only in its update, but algorithm\.use_kl_in_reward"),
        (
            "algorithm.rollout_correction.rollout_rs=token_k2 algorithm.rollout_correction.rollout_rs_threshold=0.5",
            r"but algorithm\.rollout_correction\.rollout_rs rejects",
        ),
        (
            "algorithm.rollout_correction.rollout_is=token algorithm.rollout_correction.rollout_is_batch_normalize=true",
            r"but algorithm\.rollout_correction\.rollout_is_batch_normalize",
        ),
    ],
)
def test_refused_where_the_first_rows_are_read_before_the_update(override, named):
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import load_config, validate_config

    overrides = [*QUICKSTART_PARITY, OPTION]
    validate_config(load_config(QUICKSTART, overrides), 1)
    with pytest.raises(ConfigError, match=r"actor\.old_log_probs_from_first_update=true.*" + named):
        validate_config(load_config(QUICKSTART, [*overrides, *override.split()]), 1)


def test_async_split_of_the_later_rows():
    from verl_megatron.protocol import DataProto
    from verl_megatron.rollout.async_worker import old_log_prob_split
    from verl_megatron.trainer.async_config import AsyncTrainingConfig
    from verl_megatron.trainer.async_trainer import rollout_log_prob_share
    from verl_megatron.trainer.first_mini_batch import first_rows_skipped

    on = AsyncTrainingConfig(old_log_probs_on_rollout=True)
    all_later = AsyncTrainingConfig(old_log_probs_on_rollout=True, old_log_probs_rollout_share=1.0)
    half = dataclasses.replace(on, old_log_probs_rollout_share=0.5)
    # (rows, first mini-batch, the rollout's first row with half of the later rows)
    for rows, own, split in ((16, 8, 12), (16, 4, 10), (12, 4, 8), (512, 256, 384)):
        share = rollout_log_prob_share(half, 1, 1, own=own / rows)
        assert old_log_prob_split(rows, share) == split, (rows, own, share)
        for chosen in (on, all_later):  # by default, or chosen: every later row on the rollout
            for dp, ranks in ((1, 1), (2, 1), (1, 3)):
                share = rollout_log_prob_share(chosen, dp, ranks, own=own / rows)
                assert old_log_prob_split(rows, share) == own, (rows, own, dp, ranks, share)
    assert rollout_log_prob_share(on, 1, 1) == 0.5  # without the option: one share per replica
    assert rollout_log_prob_share(AsyncTrainingConfig(), 1, 1, own=0.5) == 0.0  # off: the trainer's pass
    batch = DataProto.from_dict({"responses": torch.arange(48).reshape(16, 3)}, meta_info={})
    calls: list[int] = []

    def compute(data: DataProto) -> torch.Tensor:
        calls.append(len(data))
        return data.batch["responses"].float()

    skipped = first_rows_skipped(8, compute)
    assert torch.isnan(skipped(batch.slice(0, 8))).all() and calls == []  # the trainer's share: none
    mine = skipped(batch.slice(0, 12))  # the trainer's share: the rows between the two
    assert calls == [4] and torch.isnan(mine[:8]).all()
    whole = skipped(batch)
    assert calls == [4, 8] and torch.isnan(whole[:8]).all()
    assert torch.equal(whole[8:], batch.batch["responses"][8:].float())
    assert torch.equal(mine[8:], whole[8:12])


def test_late_rows_get_the_stages_own_correction_and_metrics():
    # An async run's rows that arrive during the update: once taken, the batch holds the same old
    # log-probs, IS weights and metrics as the stage computes when every row is there at once.
    from verl_megatron.protocol import DataProto
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.first_mini_batch import LateOldLogProbs, pass_diff_metrics, rollout_correction
    from verl_megatron.trainer.rollout_source import ArrivingOldLogProbs

    config = load_config(
        QUICKSTART,
        [*QUICKSTART_PARITY, OPTION, *(f"algorithm.rollout_correction.{k}={v}" for k, v in IS.items())],
    )
    g = torch.Generator().manual_seed(0)
    rows, width, own, first = 16, 3, 8, 12  # the first mini-batch's own rows; the rollout's from row 12
    old = torch.randn(rows, width, generator=g, dtype=torch.float64).float()
    old[:own] = float("nan")
    tensors = {
        "old_log_probs": old,
        "rollout_log_probs": old.nan_to_num() + 0.3 * torch.randn(rows, width, generator=g),
        "response_mask": (torch.rand(rows, width, generator=g) > 0.2).float(),
        "responses": torch.zeros(rows, width, dtype=torch.long),
    }
    whole = DataProto.from_dict({k: v.clone() for k, v in tensors.items()}, meta_info={})
    expected = pass_diff_metrics(whole, own)
    expected.update(rollout_correction(whole, config))
    batch = DataProto.from_dict({k: v.clone() for k, v in tensors.items()}, meta_info={})
    batch.batch["old_log_probs"][first:] = float("nan")  # the rollout's rows, on their way
    timing: dict[str, float] = {}
    marks: list[tuple[str, int | None]] = []

    class Stages:  # the stall watchdog's marks
        def mark(self, stage: str, step: int | None = None) -> None:
            marks.append((stage, step))

    arriving = ArrivingOldLogProbs(first, lambda: old[first:].clone())
    late = LateOldLogProbs(batch, config, arriving, timing, Stages(), step=7)
    assert torch.isnan(batch.batch["rollout_is_weights"]).all()  # no weight before the rows are there
    fetched = late.rows().fetch()
    assert marks == [("wait_old_log_probs", 7), ("update_actor", 7)]  # a stalled rollout is named
    assert late.finish() == expected and "wait_old_log_probs" in timing
    assert late.rows().first_row == own and sorted(fetched) == ["old_log_probs", "rollout_is_weights"]
    for key in ("old_log_probs", "rollout_is_weights"):
        assert torch.equal(fetched[key], whole.batch[key][own:]), key
        assert torch.equal(batch.batch[key][own:], whole.batch[key][own:]), key
    assert batch.meta_info == whole.meta_info  # the IS settings for the first rows' own weights
