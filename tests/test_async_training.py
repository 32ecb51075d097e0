"""Asynchronous, off-policy training with the rollout on its own ranks (rollout.placement=separate):
start-up errors, the weight wire, partial rollout's per-token versions, and one 2-process job
(tests/async_job.py, a torchrun script run on the ranks of the ``pool2`` fixture:
tests/separate_in_pool.py) whose runs several tests read: staleness bound and metrics, rollout
correction of stale samples, weights arriving intact, and a resume that loses and repeats no
sample."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.base import RolloutEngine, assemble_output
from verl_megatron.trainer.config import load_config, validate_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.yaml")
SEPARATE = ["rollout.placement=separate", "rollout.world_size=1"]
PARTIAL = [
    "async_training.max_staleness=1", "algorithm.rollout_correction.rollout_is=token", "async_training.partial_rollout=true",
]  # fmt: skip


# ------------------------------------------------------------------ start-up errors


@pytest.mark.parametrize(
    ("overrides", "world_size", "message"),
    [
        (["async_training.max_staleness=-1"], 2, "async_training.max_staleness must be >= 0"),
        (
            ["rollout.placement=separate", "rollout.world_size=2"],
            2,
            "rollout.world_size=2 leaves no trainer rank among the 2 processes",
        ),
        (["rollout.placement=separate", "rollout.world_size=0"], 2, "needs rollout.world_size >= 1"),
        ([*SEPARATE, "rollout.name=vllm"], 2, "rollout.name='vllm' cannot receive"),
        ([*SEPARATE, "async_training.max_staleness=1"], 2, "set algorithm.rollout_correction.rollout_is"),
        (["async_training.max_staleness=1"], 2, "needs rollout.placement=separate"),
        (["rollout.placement=apart"], 2, "rollout.placement must be 'colocated' or 'separate'"),
        ([*SEPARATE, "algorithm.adv_estimator=remax"], 2, "does not support algorithm.adv_estimator=remax"),
        ([*SEPARATE, "rollout.bitwise_parity=true"], 2, "does not support rollout.bitwise_parity=true"),
        (
            ["async_training.old_log_probs_on_rollout=true"],
            2,
            "old_log_probs_on_rollout) needs rollout.placement",
        ),
        (
            [*SEPARATE, "async_training.old_log_probs_on_rollout=true", "model.lora_rank=4"],
            2,
            "does not support async_training.old_log_probs_on_rollout with model.lora_rank > 0",
        ),
        (
            [*SEPARATE, "async_training.old_log_probs_on_rollout=true", "actor.recompute_old_log_prob=false"],
            2,
            "old_log_probs_on_rollout with actor.recompute_old_log_prob=false (none to compute)",
        ),
        (
            [*SEPARATE, "async_training.partial_rollout=true"],
            2,
            "partial_rollout needs async_training.max_staleness >= 1",
        ),
        (
            [
                *SEPARATE,
                *PARTIAL,
                "async_training.partial_rollout_segment=1",
                "data.max_response_length=1025",
            ],
            2,
            "cuts responses of 1025 tokens into 1025 segments, more than the 1024 sampling calls",
        ),
        (
            [*SEPARATE, "async_training.old_log_probs_rollout_share=0.6"],
            2,
            "old_log_probs_rollout_share is set but async_training.old_log_probs_on_rollout is false",
        ),
        *[
            (
                [
                    *SEPARATE,
                    "async_training.old_log_probs_on_rollout=true",
                    f"async_training.old_log_probs_rollout_share={v}",
                ],
                2,
                f"async_training.old_log_probs_rollout_share must be in (0, 1] (the rollout ranks' fraction "
                f"of each batch's rows), got {v}",
            )
            for v in ("0.0", "1.5", "-0.25")
        ],
    ],
)
def test_bad_async_settings_are_named_at_start_up(overrides, world_size, message) -> None:
    from verl_megatron.errors import UserInputError

    with pytest.raises(UserInputError) as err:
        validate_config(load_config(QUICKSTART, overrides), world_size)
    text = str(err.value)
    assert message in text and "\n" not in text, text


def test_old_log_probs_all_from_the_rollout_stay_on_the_batchs_device() -> None:
    """share 1.0 without the first mini-batch's own rows: no row is the actor's, and the rollout's
    rows join the batch on its device (a GPU runtime's device is not the CPU batch's; "meta" stands in)."""
    from types import SimpleNamespace

    from verl_megatron.trainer.async_trainer import AsyncRolloutLink

    link = object.__new__(AsyncRolloutLink)
    link.log_prob_share, link.own_rows = 1.0, 0
    link.runtime = SimpleNamespace(device=torch.device("meta"))
    theirs = torch.arange(8.0).reshape(2, 4)
    link._rollout_rows = lambda step, first, shape: theirs if (first, shape) == (0, (2, 4)) else None
    batch = DataProto.from_dict({"responses": torch.zeros(2, 4, dtype=torch.long)})
    old, arriving = link.old_log_probs(3, batch, compute=lambda data: pytest.fail("the actor computed rows"))
    assert arriving is None and old.device == torch.device("cpu")
    assert torch.equal(old, theirs)


def test_an_error_before_async_training_closes_the_placement(monkeypatch, tmp_path) -> None:
    """The trainer rank fails after the placement's groups exist but before train_async (here in
    init_runtime): run() still closes them, so the rollout ranks are not left waiting on them."""
    from types import SimpleNamespace

    from verl_megatron import train
    from verl_megatron.distributed import parallel
    from verl_megatron.rollout import placement

    closed = []
    fake = SimpleNamespace(is_trainer=True, close=lambda: closed.append(True))
    monkeypatch.setattr(placement, "init_placement", lambda rollout, minutes: fake)

    def fails(*args, **kwargs):
        raise RuntimeError("init_runtime failed")

    monkeypatch.setattr(parallel, "init_runtime", fails)
    monkeypatch.setenv("WORLD_SIZE", "2")
    overrides = [
        *SEPARATE, f"trainer.default_local_dir={tmp_path}/run", f"quickstart.assets_dir={tmp_path}/assets",
    ]  # fmt: skip
    with pytest.raises(RuntimeError, match="init_runtime failed"):
        train.run(str(QUICKSTART), overrides)
    assert closed == [True]


def test_partial_rollout_over_an_nccl_broadcast_to_several_ranks_is_refused(monkeypatch) -> None:
    """On GPUs the weights reach 2+ rollout ranks by a broadcast every rank joins at a step's start:
    a segment could never take newer ones (on CPU each rank receives its own copy, between segments)."""
    from verl_megatron.errors import PlacementError
    from verl_megatron.trainer.placement_check import check_placement

    config = load_config(QUICKSTART, ["rollout.placement=separate", "rollout.world_size=2", *PARTIAL])
    assert check_placement(config, 3) == 1  # CPU: gloo sends to each rank
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(PlacementError, match=r"partial_rollout with rollout\.world_size=2 on GPUs"):
        check_placement(config, 3)


def test_separate_placement_resolves_the_layout_on_the_trainer_ranks() -> None:
    fits = ["actor.ppo_micro_batch_size_per_gpu=64"]
    rc = "algorithm.rollout_correction.rollout_is=token"
    config = load_config(QUICKSTART, [*SEPARATE, *fits, "async_training.max_staleness=1", rc])
    assert validate_config(config, 3).dp == 2  # 3 processes, 1 generates
    assert validate_config(load_config(QUICKSTART, fits), 2).dp == 2  # colocated: every rank trains


def test_rollout_share_of_old_log_probs_is_chosen_or_one_per_replica() -> None:
    from verl_megatron.rollout.async_worker import last_rows_log_probs
    from verl_megatron.trainer.async_config import AsyncTrainingConfig
    from verl_megatron.trainer.async_trainer import rollout_log_prob_share

    assert rollout_log_prob_share(AsyncTrainingConfig(), 1, 1) == 0.0  # off: the trainer computes every row
    on = AsyncTrainingConfig(old_log_probs_on_rollout=True)
    per_replica = [rollout_log_prob_share(on, dp, ranks) for dp, ranks in ((1, 1), (2, 1), (1, 3))]
    assert per_replica == [0.5, 1 / 3, 0.75]
    chosen = dataclasses.replace(on, old_log_probs_rollout_share=0.625)
    assert rollout_log_prob_share(chosen, 1, 1) == rollout_log_prob_share(chosen, 4, 2) == 0.625
    # The rollout's rows: the last round(B * share); none computed when that rounds to 0.
    batch = DataProto.from_dict({"responses": torch.arange(24).reshape(8, 3)})
    calls: list[int] = []
    pass_ = lambda data: calls.append(len(data)) or data.batch["responses"].float()  # noqa: E731
    first, log_probs = last_rows_log_probs(batch, 0.625, pass_)
    assert (first, calls) == (3, [5]) and torch.equal(log_probs, torch.arange(9, 24).reshape(5, 3).float())
    first, log_probs = last_rows_log_probs(batch, 0.05, pass_)
    assert (first, calls, tuple(log_probs.shape)) == (8, [5], (0, 3))


def test_batches_cross_in_narrow_integers_and_arrive_unchanged() -> None:
    import pickle

    import numpy as np

    from verl_megatron.rollout.async_worker import from_wire, to_wire

    tensors = {
        "responses": torch.tensor([[5, 151_000], [0, 9]]),  # token ids past int16: int32
        "response_mask": torch.tensor([[1, 1], [1, 0]]),  # 0/1: int8
        "rollout_versions": torch.tensor([[-1, 300], [2, -1]]),  # -1..300: int16
        "big": torch.tensor([[2**40, 0], [0, 0]]),  # needs int64: left as it is
        "log_probs": torch.tensor([[-0.5, -1.25], [0.0, -2.0]]),  # floats are not touched
        "done": torch.tensor([[True, False], [False, True]]),
    }
    batch = DataProto.from_dict(
        dict(tensors), {"index": np.array([3, 4], dtype=object)}, {"async": {"step": 2}}
    )
    wire = to_wire(batch)
    widths = {k: wire.batch[k].dtype for k in tensors}
    assert widths == {
        "responses": torch.int32, "response_mask": torch.int8, "rollout_versions": torch.int16,
        "big": torch.int64, "log_probs": torch.float32, "done": torch.bool,
    }  # fmt: skip
    assert all(batch.batch[k].dtype == v.dtype for k, v in tensors.items())  # the sender's batch unchanged
    nbytes = lambda data: sum(v.numel() * v.element_size() for v in data.batch.values())  # noqa: E731
    assert nbytes(batch) - nbytes(wire) == 4 * (8 - 4) + 4 * (8 - 1) + 4 * (8 - 2)
    back = from_wire(pickle.loads(pickle.dumps(wire)))
    for key, value in tensors.items():
        assert back.batch[key].dtype == value.dtype and torch.equal(back.batch[key], value), key
    assert back.meta_info == {"async": {"step": 2}} and back.non_tensor_batch["index"].tolist() == [3, 4]


# ------------------------------------------------------------------ the weight wire


def wire_job(broadcast: bool = False) -> dict:
    """Rank 0 sends two versions of mixed-dtype weights in 64-byte buckets to rank 1
    (``broadcast``: the payloads over a second group, as over NCCL on GPU; gloo stands in)."""
    import torch.distributed as dist

    from verl_megatron.rollout.weight_sync import WeightSender, isend_object, receive_weights, recv_object

    group = dist.new_group([0, 1])
    payloads = dist.new_group([0, 1]) if broadcast else None
    weights = [
        ("a", torch.arange(12, dtype=torch.float32).reshape(3, 4)),
        ("b", torch.tensor([1.5, -2.25], dtype=torch.bfloat16)),
        ("c", torch.arange(40, dtype=torch.float64)),  # 320 bytes: a bucket of its own
        ("d", torch.tensor([7], dtype=torch.int64)),
    ]
    out: dict = {}
    try:
        if dist.get_rank() == 0:
            sender = WeightSender(group, [1], 64 / 2**20, broadcast=payloads)
            out["stats"] = [sender.send(iter(weights), v).buckets for v in (3, 4)]
            for work, _ in isend_object(group, {"step": 2, "x": [1, 2]}, 1):
                work.wait()
            sender.wait()
        else:
            for _ in range(2):
                received: list = []
                version = receive_weights(group, 0, received.append, broadcast=payloads)
                out.setdefault("versions", []).append(version)
            out["buckets"] = [[(n, t.clone()) for n, t in bucket] for bucket in received]
            out["object"] = recv_object(group, 0)
    finally:
        dist.destroy_process_group(group)
        if payloads is not None:
            dist.destroy_process_group(payloads)
    return out


@pytest.mark.parametrize("broadcast", [False, True])
def test_weights_cross_bucketed_and_exact(pool2, broadcast) -> None:
    sender, receiver = pool2.run(f"{__name__}:wire_job", broadcast=broadcast)
    assert sender["stats"] == [3, 3]  # a+b (56 bytes), c alone, d
    assert receiver["versions"] == [3, 4] and receiver["object"] == {"step": 2, "x": [1, 2]}
    names = [[n for n, _ in bucket] for bucket in receiver["buckets"]]
    assert names == [["a", "b"], ["c"], ["d"]]
    got = dict(item for bucket in receiver["buckets"] for item in bucket)
    assert got["b"].dtype == torch.bfloat16 and got["b"].tolist() == [1.5, -2.25]
    assert torch.equal(got["a"], torch.arange(12, dtype=torch.float32).reshape(3, 4))
    assert torch.equal(got["c"], torch.arange(40, dtype=torch.float64)) and got["d"].item() == 7


# ------------------------------------------------------------------ partial rollout

EOS, PAD = 1, 0


class CountingEngine(RolloutEngine):
    """Each row's next token is 10 + (its tokens so far) + 100 * weight version; row 0 stops (EOS)
    after 3 tokens. Log-prob of a token: -version - 0.5."""

    def __init__(self, weights: dict) -> None:
        self.weights = weights
        self.calls: list[tuple[int, int]] = []

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        ids, mask = prompts.batch["input_ids"], prompts.batch["attention_mask"]
        n, width = int(prompts.meta_info.get("n", 1)), int(prompts.meta_info["response_length"])
        self.calls.append((ids.shape[0], width))
        rows = ids.repeat_interleave(n, 0)
        lengths = mask.repeat_interleave(n, 0).sum(-1)
        tokens = torch.full((rows.shape[0], width), PAD)
        resp_mask = torch.zeros(rows.shape[0], width, dtype=torch.long)
        for r in range(rows.shape[0]):
            first = bool((rows[r] == 5).any())  # rows of the prompt holding a 5
            for t in range(width):
                done = lengths[r] + t - 2  # tokens generated before this one (prompts are 2 long)
                token = EOS if first and done == 3 else 10 + int(done) + 100 * self.weights["version"]
                tokens[r, t], resp_mask[r, t] = token, 1
                if token == EOS:
                    break
        log_probs = torch.full(tokens.shape, -0.5 - self.weights["version"]) * resp_mask
        return assemble_output(prompts, tokens, resp_mask, log_probs, n)


def test_partial_rollout_continues_with_new_weights_and_records_versions() -> None:
    from verl_megatron.rollout.partial import generate_with_versions

    weights = {"version": 4}
    engine = CountingEngine(weights)
    prompts = DataProto.from_dict(
        {"input_ids": torch.tensor([[3, 5], [3, 6]]), "attention_mask": torch.ones(2, 2, dtype=torch.long)},
        meta_info={"n": 2},
    )

    def refresh() -> None:  # a new version arrives before the 2nd segment, none later
        weights["version"] = 5

    out = generate_with_versions(
        engine, prompts, response_length=6, segment=2, stops=[EOS], pad=PAD,
        version=lambda: weights["version"], refresh=refresh,
    )  # fmt: skip
    # rows 0-1 (prompt ..5) stop with EOS as their 4th token; rows 2-3 run to the length
    expected_row0 = [10 + 400, 11 + 400, 12 + 500, EOS, PAD, PAD]
    expected_row2 = [410, 411, 512, 513, 514, 515]
    assert out.batch["responses"][0].tolist() == expected_row0
    assert out.batch["responses"][2].tolist() == expected_row2
    assert out.batch["rollout_versions"][0].tolist() == [4, 4, 5, 5, -1, -1]
    assert out.batch["rollout_versions"][3].tolist() == [4, 4, 5, 5, 5, 5]
    assert out.batch["weight_version"].tolist() == [4, 4, 4, 4]
    torch.testing.assert_close(
        out.batch["rollout_log_probs"][2], torch.tensor([-4.5, -4.5, -5.5, -5.5, -5.5, -5.5])
    )
    assert out.batch["response_mask"][0].tolist() == [1, 1, 1, 1, 0, 0]
    # one call for the 2 prompts x 2 samples, then only the rows still running (4, 4, then 2)
    assert engine.calls == [(2, 2), (4, 2), (2, 2)]
    # the stitched sequence is the prompt followed by the response
    assert out.batch["input_ids"][2].tolist() == [3, 6, *expected_row2]


# ------------------------------------------------------------------ the 2-process job


def _rows(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="module")
def job(tmp_path_factory, pool2) -> str:
    out = str(tmp_path_factory.mktemp("async"))
    pool2.run("tests.separate_in_pool:run_main", timeout_s=600, module="tests.async_job", out=out)
    return out


def test_off_policy_batches_are_one_version_stale_and_corrected(job) -> None:
    rows = {r["step"]: r for r in _rows(os.path.join(job, "straight", "metrics.jsonl"))}
    assert sorted(rows) == [1, 2, 3, 4]
    # step 1 trains on the start weights; from step 2 on, each batch was generated (at least
    # its first tokens) one update behind: exactly max_staleness, never more
    assert [rows[s]["async/staleness_max"] for s in (1, 2, 3, 4)] == [0.0, 1.0, 1.0, 1.0]
    for step in (2, 3, 4):
        # the trained policy has moved since those tokens were sampled: IS weights differ from 1
        assert abs(rows[step]["rollout_corr/kl"]) > 1e-4, rows[step]["rollout_corr/kl"]
        assert rows[step]["rollout_corr/rollout_is_mean"] != 1.0
        for key in (
            "timing_s/wait_rollout",
            "timing_s/step",
            "async/rollout_wait_weights_s",
            "async/rollout_gen_s",
        ):
            assert rows[step][key] >= 0.0
    assert (
        "timing_s/send_weights" in rows[3] and "timing_s/send_weights" not in rows[4]
    )  # none after the last
    # old_log_probs_on_rollout: before generating batch s the rollout computed its share of batch s-1
    assert rows[1]["async/rollout_old_log_prob_s"] == 0.0
    assert all(rows[s]["async/rollout_old_log_prob_s"] > 0.0 for s in (2, 3, 4))
    # ... before the update (straight); with old_log_probs_from_first_update (resumed) the update
    # took them when it cut its second mini-batch, every step, through the resume too
    assert not any("timing_s/wait_old_log_probs" in rows[s] for s in (1, 2, 3, 4))
    resumed = {r["step"]: r for r in _rows(os.path.join(job, "resumed", "metrics.jsonl"))}
    assert all(resumed[s]["timing_s/wait_old_log_probs"] >= 0.0 for s in (1, 2, 3, 4))
    # a function reward: the rollout rank scored every batch (tests/test_async_rollout_scores.py)
    assert all(rows[s]["async/rollout_reward_s"] > 0.0 for s in (1, 2, 3, 4))
    samples = _rows(os.path.join(job, "straight", "samples.jsonl"))
    assert [r["weight_version"][0] for r in samples] == [0, 0, 1, 2]


def test_rollout_weights_equal_the_trainers_after_a_transfer(job) -> None:
    # step 1 (start weights, sent at start-up): the rollout's copy generated with exactly the
    # trainer's weights. (A resumed run regenerates its next batch with the version before the
    # checkpoint's, restored from the checkpoint: tests/test_restart_async.py holds it exact.)
    for name, step in (("straight", 1), ("resumed", 1)):
        row = next(r for r in _rows(os.path.join(job, name, "metrics.jsonl")) if r["step"] == step)
        assert row["async/staleness_max"] == 0.0
        assert abs(row["rollout_corr/kl"]) < 1e-6 and row["rollout_corr/rollout_is_mean"] == pytest.approx(
            1.0, abs=1e-5
        )


def test_resume_during_async_training_loses_and_repeats_no_sample(job) -> None:
    straight = _rows(os.path.join(job, "straight", "samples.jsonl"))
    resumed = _rows(os.path.join(job, "resumed", "samples.jsonl"))
    assert [r["step"] for r in resumed] == [1, 2, 3, 4]
    assert [r["samples"] for r in resumed] == [r["samples"] for r in straight]
    every = [sample for r in resumed for sample in r["samples"]]
    assert len(every) == len(set(every)) == 4 * 4 * 4  # 4 steps x 4 prompts x 4 samples
    # the interrupted run's checkpoint (step 2) was taken; its step 3 never trained
    logged = sorted(r["step"] for r in _rows(os.path.join(job, "resumed", "metrics.jsonl")))
    assert logged == [1, 2, 3, 4]
