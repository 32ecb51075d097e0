"""Virtual pipeline stages (pp=2, vpp=2): the actor and critic match one process.

A tiny Llama with 4 layers (one per virtual stage) and the batch of
tests/test_actor_update.py. Each job runs compute_log_prob (compute_values) and one
update of two mini-batches (two optimizer steps); the interleaved 2 x 2 layout must
reproduce the single-process log-probs, metrics and new weights within the tolerances
of the other layout tests. The variants cover micro-batch counts megatron's interleaved
schedule does not take as they are: 3 micro-batches (not a multiple of pp=2) and 1
(fewer than pp: padded with a zero-loss micro-batch).

Also here: expert parallelism with a dense model stops at the layout check.
"""

from __future__ import annotations

import pytest

from tests.closeness import assert_close_report
from tests.test_actor_update import (
    LR,
    VOCAB,
    _assert_same_update,
    build_actor,
    build_model,
    full_weights,
    kl_actor_config,
    kl_update_record,
    make_batch,
    merge,
)
from tests.test_critic_update import RETURN_SHIFT
from tests.test_critic_update import _assert_same_update as _assert_same_critic_update

# Per variant: micro-batch sizes and layout. With 8 rows, mini-batches of 4 rows:
# "even" runs 4 inference / 2 training micro-batches, "uneven" 3 / 1.
VARIANTS = {
    "even": {"use_remove_padding": False, "ppo_micro_batch_size_per_gpu": 2},
    "uneven": {
        "use_remove_padding": True,
        "ppo_micro_batch_size_per_gpu": 4,
        "ppo_infer_micro_batch_size_per_gpu": 3,
    },
}


def actor_job(path: str, pp: int, vpp: int | None) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(pp=pp, vpp=vpp), seed=5)
    out = {}
    for variant, settings in VARIANTS.items():
        chunks, actor = build_actor(runtime, path, kl_actor_config(**settings))
        out[variant] = kl_update_record(runtime, chunks, actor)
    return out


def critic_job(path: str, pp: int, vpp: int | None) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.config import CriticConfig, OptimConfig
    from verl_megatron.workers.critic import MegatronCritic
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(pp=pp, vpp=vpp), seed=5)
    cfg = CriticConfig(
        ppo_mini_batch_size=4,
        shuffle=False,
        optim=OptimConfig(lr=LR, weight_decay=0.0, clip_grad=1.0),
        **VARIANTS["uneven"],
    )
    chunks = build_model(runtime, path, value_head=True)
    optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
    critic = MegatronCritic(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
    data = DataProto.from_dict(make_batch())
    values = critic.compute_values(data)
    data.batch["values"] = values
    data.batch["returns"] = values + RETURN_SHIFT * data.batch["response_mask"]
    metrics = critic.update_critic(data)
    return {"uneven": {"values": values, "metrics": metrics, "weights": full_weights(chunks, runtime)}}


def dense_ep_job(path: str) -> str:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.errors import ParallelConfigError

    runtime = init_runtime(ParallelLayout(ep=2), seed=5)
    try:
        build_model(runtime, path)
    except ParallelConfigError as err:
        return str(err)
    return "no error"


@pytest.fixture(scope="module")
def model_path(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = str(tmp_path_factory.mktemp("tiny_llama_4_layers"))
    build_tiny_hf_model(
        path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=11,
    )  # fmt: skip
    return path


def test_actor_pp2_vpp2_matches_single_process(pool1, pool2, model_path):
    reference = merge(pool1.run(f"{__name__}:actor_job", path=model_path, pp=1, vpp=None))
    run = merge(pool2.run(f"{__name__}:actor_job", path=model_path, pp=2, vpp=2))
    for variant in VARIANTS:
        _assert_same_update(run[variant], reference[variant])
        assert_close_report(
            run[variant]["entropy"], reference[variant]["entropy"], rtol=1e-5, atol=1e-5, what="entropy"
        )
    # Two optimizer steps each, and the second one saw weights moved by the first.
    for variant in VARIANTS:
        assert len(run[variant]["metrics"]["actor/grad_norm"]) == 2
        assert run[variant]["metrics"]["actor/ppo_kl"][1] != 0.0


def test_critic_pp2_vpp2_matches_single_process(pool1, pool2, model_path):
    reference = merge(pool1.run(f"{__name__}:critic_job", path=model_path, pp=1, vpp=None))
    run = merge(pool2.run(f"{__name__}:critic_job", path=model_path, pp=2, vpp=2))
    _assert_same_critic_update(run["uneven"], reference["uneven"])


def test_expert_parallel_with_a_dense_model_is_refused(pool2, model_path):
    for message in pool2.run(f"{__name__}:dense_ep_job", path=model_path):
        assert message == "ep=2 needs a mixture-of-experts model (num_experts is not set)"


@pytest.mark.parametrize(
    ("num_micro", "pp", "plan"),
    [
        (1, 2, (1, 2)),
        (2, 2, (0, 2)),
        (3, 2, (0, 3)),
        (5, 2, (0, 3)),
        (8, 4, (0, 4)),
        (5, 4, (0, 5)),
        (2, 4, (2, 4)),
    ],
)
def test_interleaving_plan_meets_megatrons_constraints(num_micro, pp, plan):
    from verl_megatron.workers.model_runner import _interleaving_plan

    # (padding, group): pp <= group <= M and the last group (M mod group) empty or >= pp.
    assert _interleaving_plan(num_micro, pp) == plan
    padding, group = plan
    total = num_micro + padding
    assert pp <= group <= total and (total % group == 0 or total % group >= pp)
