"""The rollout's data-parallel split (rollout/layout.py) over many training and rollout layouts.

Ground truth for the training layout is megatron's own ``RankGenerator`` (the rank order
``initialize_model_parallel`` uses); for the engine, vLLM's external launcher's tensor-parallel
groups of consecutive global ranks.
"""

from __future__ import annotations

import itertools
from types import SimpleNamespace

import pytest
from megatron.core.parallel_state import RankGenerator

from verl_megatron.rollout.layout import (
    RolloutShard,
    external_shard,
    native_shard,
    order_replica_outputs,
)

ORDER = "tp-cp-ep-dp-pp"  # megatron-core's default order


def _training_coords(world: int, tp: int, pp: int, cp: int) -> dict[int, dict[str, int]]:
    """rank -> its tp/cp/dp/pp rank, from megatron's rank generator."""
    dp = world // (tp * pp * cp)
    gen = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=ORDER)
    coords: dict[int, dict[str, int]] = {r: {} for r in range(world)}
    for name in ("tp", "cp", "dp", "pp"):
        for group in gen.get_ranks(name):
            for index, rank in enumerate(group):
                coords[rank][name] = index
    return coords


def _layouts():
    for world in (1, 2, 4, 8, 16):
        for tp, pp, cp in itertools.product((1, 2, 4), (1, 2), (1, 2)):
            if world % (tp * pp * cp) == 0:
                for rollout_tp in (1, 2, 4, 8):
                    if world % rollout_tp == 0:
                        yield world, tp, pp, cp, rollout_tp


LAYOUTS = list(_layouts())


def test_enough_layouts_are_covered():
    assert len(LAYOUTS) > 100
    # The shipped defaults (training tp=1, rollout tp=2) and training tp*cp > rollout tp are in.
    assert (4, 1, 1, 1, 2) in LAYOUTS and (8, 4, 1, 2, 2) in LAYOUTS


@pytest.mark.parametrize(("world", "tp", "pp", "cp", "rollout_tp"), LAYOUTS)
def test_external_engine_groups_get_identical_prompts_and_each_prompt_once(world, tp, pp, cp, rollout_tp):
    shards = [external_shard(rank, world, rollout_tp) for rank in range(world)]
    # Every vLLM tensor-parallel group (consecutive ranks) submits the same share.
    for start in range(0, world, rollout_tp):
        group = shards[start : start + rollout_tp]
        assert len({s.replica for s in group}) == 1, f"vLLM group at rank {start} mixes shares: {group}"
        assert [s.leader for s in group] == [True] + [False] * (rollout_tp - 1)
    # Shares partition the batch: every replica exists once, nobody generates a share twice.
    assert {s.replicas for s in shards} == {world // rollout_tp}
    leaders = sorted(s.replica for s in shards if s.leader)
    assert leaders == list(range(world // rollout_tp))


@pytest.mark.parametrize(("world", "tp", "pp", "cp", "rollout_tp"), LAYOUTS)
def test_native_engine_replicas_are_training_dp_ranks_with_one_leader(world, tp, pp, cp, rollout_tp):
    coords = _training_coords(world, tp, pp, cp)
    dp = world // (tp * pp * cp)
    shards = [native_shard(dp, c["dp"], c["tp"], c["cp"], c["pp"]) for c in coords.values()]
    assert sorted(s.replica for s in shards if s.leader) == list(range(dp))
    # A model-parallel group (same dp rank) runs one engine: one share.
    for rank, c in coords.items():
        assert shards[rank].replica == c["dp"]


def test_old_split_breaks_the_shipped_default():
    """Training tp=1, rollout tp=2 on 2 ranks: the dp split sent ranks 0 and 1 different prompts."""
    coords = _training_coords(2, 1, 1, 1)
    assert coords[0]["dp"] != coords[1]["dp"]
    assert external_shard(0, 2, 2).replica == external_shard(1, 2, 2).replica == 0


def test_gather_orders_by_replica_and_catches_mismatches():
    parts = [(1, "b"), None, (0, "a"), None]
    assert order_replica_outputs(parts, 2) == ["a", "b"]
    with pytest.raises(RuntimeError, match="replica 0 was returned by two ranks"):
        order_replica_outputs([(0, "a"), (0, "a")], 1)
    with pytest.raises(RuntimeError, match=r"expected replicas 0..2, got \[0, 2\]"):
        order_replica_outputs([(0, "a"), (2, "c")], 3)
    with pytest.raises(ValueError, match="must divide the world size 6"):
        external_shard(0, 6, 4)
    assert external_shard(5, 8, 4) == RolloutShard(replicas=2, replica=1, leader=False)


def generate_job(data_path: str, tok_dir: str, engine: str, rollout_tp: int) -> dict:
    """PPOTrainer._generate on 2 ranks (training tp=1: dp=2) with a scripted engine named ``engine``."""
    import torch.distributed as dist

    from tests.test_trainer import PAD, QUICKSTART, VARIED, ScriptedRollout, score_first_token
    from verl_megatron.data import PromptLoader, RLHFDataset
    from verl_megatron.distributed.parallel import ParallelLayout
    from verl_megatron.trainer.components import Components
    from verl_megatron.trainer.config import load_config
    from verl_megatron.trainer.ppo_trainer import PPOTrainer
    from verl_megatron.utils.tokenizer import hf_tokenizer

    rank = dist.get_rank()
    overrides = [
        f"data.train_files=[{data_path}]", "data.max_prompt_length=6", "data.max_response_length=2",
        "data.train_batch_size=4", "rollout.n=2", f"rollout.name={engine}",
        f"rollout.tensor_model_parallel_size={rollout_tp}",
    ]  # fmt: skip
    config = load_config(QUICKSTART, overrides)
    tokenizer = hf_tokenizer(tok_dir)
    dataset = RLHFDataset(config.data.train_files, tokenizer, config.data)
    runtime = SimpleNamespace(
        layout=ParallelLayout().resolve(2),
        dp_rank=rank,
        world_size=2,
        rank=rank,
        is_main=rank == 0,
        seed=1,
        tp_rank=0,
        cp_rank=0,
        pp_rank=0,
    )
    rollout = ScriptedRollout([[VARIED] * 4])
    seen: list = []
    generate = rollout.generate_sequences
    rollout.generate_sequences = lambda prompts: (
        seen.append(prompts.batch["input_ids"].tolist()) or generate(prompts)
    )
    components = Components(
        tokenizer=SimpleNamespace(eos_token_id=1, pad_token_id=PAD), hf_config=None, actor=None, ref=None,
        critic=None, rollout=rollout, reward_fn=score_first_token, val_reward_fn=score_first_token,
        train_loader=PromptLoader(dataset, 4, shuffle=False, seed=0, pad_token_id=PAD), val_loader=None,
    )  # fmt: skip
    trainer = PPOTrainer(config, runtime, components)
    prompts = trainer.train_loader.next_batch()
    output = trainer._generate(prompts, validate=False)
    return {
        "all": prompts.batch["input_ids"].tolist(),
        "seen": seen[0],
        "out": output.batch["prompts"].tolist(),
    }


@pytest.fixture(scope="module")
def prompt_data(tmp_path_factory):
    import json

    from verl_megatron.utils.local_assets import build_char_tokenizer

    root = tmp_path_factory.mktemp("layout")
    build_char_tokenizer(root / "tok", alphabet="0123456789")
    rows = [
        {
            "data_source": "s",
            "prompt": [{"role": "user", "content": str(i)}],
            "reward_model": {"ground_truth": "1"},
        }
        for i in range(4)
    ]
    (root / "d.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    return str(root / "d.jsonl"), str(root / "tok")


@pytest.mark.parametrize(("engine", "rollout_tp"), [("vllm", 2), ("vllm", 1), ("native", 2)])
def test_trainer_sends_each_engine_group_one_share_and_gets_every_prompt_once(
    pool2, prompt_data, engine, rollout_tp
):
    data_path, tok_dir = prompt_data
    results = pool2.run(f"{__name__}:generate_job", data_path=data_path, tok_dir=tok_dir, engine=engine,
                        rollout_tp=rollout_tp)  # fmt: skip
    everything = results[0]["all"]
    expected = [row for row in everything for _ in range(2)]  # n=2, prompt-major
    for result in results:
        assert result["out"] == expected
    if rollout_tp == 2 and engine == "vllm":
        # One vLLM group of ranks 0-1: both submit the whole batch.
        assert results[0]["seen"] == results[1]["seen"] == everything
    else:
        # Two replicas (vLLM tp=1 or native dp=2): disjoint halves.
        assert results[0]["seen"] == everything[:2] and results[1]["seen"] == everything[2:]
