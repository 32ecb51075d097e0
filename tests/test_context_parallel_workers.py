"""Actor and critic at cp=2 (token-wise model) equal one process with padded rows."""

from __future__ import annotations

from tests.closeness import assert_close_report
from tests.test_actor_update import _assert_same_update, kl_actor_config, kl_update, make_batch
from tests.test_context_parallel import _runtime, _tokenwise_gpt
from tests.test_critic_update import RETURN_SHIFT
from tests.test_critic_update import _assert_same_update as _same_critic


def _build(runtime, value_head):
    from verl_megatron.models.builder import ValueHead
    from verl_megatron.models.megatron_model import build_chunks, wrap_ddp
    from verl_megatron.models.sharding import load_full_state, seeded_tensor

    def make(pre, post, vp):
        m = _tokenwise_gpt(pre, post, vp)
        if value_head and post:
            m.output_layer = ValueHead(m.config.hidden_size, m.config, 0, runtime.device)
        return m

    chunks = build_chunks(runtime, make)
    load_full_state(chunks, lambda name, shape: seeded_tensor(name, shape, seed=4, std=0.3))
    return wrap_ddp(chunks)


def job(cp: int) -> dict:
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.models.sharding import gather_full_state
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers import model_runner as engine
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import CriticConfig, OptimConfig
    from verl_megatron.workers.critic import MegatronCritic
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = _runtime(cp)
    saved = engine.cp_attention_available, engine.uses_transformer_engine
    if cp > 1:
        engine.cp_attention_available = engine.uses_transformer_engine = lambda chunks: True
    try:
        optim = OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0)
        cfg = kl_actor_config(
            ppo_micro_batch_size_per_gpu=3, loss_agg_mode="seq-mean-token-mean", use_remove_padding=cp > 1
        )
        chunks = _build(runtime, False)
        opt = build_optimizer(chunks, optim_settings(optim))
        actor = MegatronActor(runtime, cfg, chunks, opt, build_lr_scheduler(opt, optim))
        old, ent, metrics = kl_update(actor)
        w = gather_full_state(chunks)
        out = {"actor": {"old_log_probs": old, "entropy": ent, "metrics": metrics, "weights": w}}
        ccfg = CriticConfig(
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=3,
            shuffle=False,
            use_remove_padding=cp > 1,
            optim=optim,
        )
        cchunks = _build(runtime, True)
        copt = build_optimizer(cchunks, optim_settings(optim))
        critic = MegatronCritic(runtime, ccfg, cchunks, copt, build_lr_scheduler(copt, optim))
        data = DataProto.from_dict(make_batch())
        values = critic.compute_values(data)
        data.batch["values"] = values
        data.batch["returns"] = values + RETURN_SHIFT * data.batch["response_mask"]
        cm = critic.update_critic(data)
        out["critic"] = {"values": values, "metrics": cm, "weights": gather_full_state(cchunks)}
    finally:
        engine.cp_attention_available, engine.uses_transformer_engine = saved
    return out


def test_actor_and_critic_at_cp2_match_one_process(pool1, pool2):
    ref = pool1.run(f"{__name__}:job", cp=1)[0]
    for r in pool2.run(f"{__name__}:job", cp=2):
        _assert_same_update(r["actor"], ref["actor"])
        assert_close_report(
            r["actor"]["entropy"], ref["actor"]["entropy"], rtol=1e-5, atol=1e-6, what="entropy"
        )
        _same_critic(r["critic"], ref["critic"])
        assert (
            ref["actor"]["metrics"]["actor/grad_norm"][0] > 0
            and ref["critic"]["metrics"]["critic/grad_norm"][0] > 0
        )
