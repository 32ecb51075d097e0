"""Rows that share a prompt run it once (workers/shared_prefix.py, issue 19).

- layout: each response token is read from the column before it in its slot (the prompt's last
  column for the first), at its unshared rotary distance, and nothing is shared where it would
  not save positions;
- attention: in float64 the split attention equals SDPA over the layout's full mask, forward and
  gradients (float64 rounding, ~1e-14);
- actor: log-probs, entropy, loss, grad norm and the updated weights equal the padded and the
  packed layouts'. GRPO-style batch: 3 prompts x 4 responses, micro-batches of 6 rows, so one
  group is split between two micro-batches. Tolerances are those of the output-row test (float32
  summation order; closeness.py's Adam bounds); without the rotary re-indexing the log-probs
  differ by far more, so the comparison can fail;
- tp=2 with shared rows equals one process with shared rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.closeness import assert_adam_weights_close, assert_close_report
from tests.test_actor_update import (
    TEMPERATURE,
    VOCAB,
    build_hf_model,
    build_model,
    full_weights,
    padded_batch,
)

TP_LEN, TR_LEN, GROUPS, N = 6, 5, 3, 4


def grpo_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """3 left-padded prompts (6, 3, 5 tokens), each with 4 right-padded responses of 1-5 tokens."""
    g = torch.Generator().manual_seed(seed)
    prompt_lens = torch.tensor([6, 3, 5]).repeat_interleave(N)
    resp_lens = torch.tensor([5, 2, 4, 1, 3, 5, 1, 4, 2, 2, 5, 3])
    prompts = torch.randint(1, VOCAB, (GROUPS, TP_LEN), generator=g).repeat_interleave(N, dim=0)
    responses = torch.randint(1, VOCAB, (GROUPS * N, TR_LEN), generator=g)
    batch = padded_batch(prompts, responses, prompt_lens, resp_lens)
    batch["advantages"] = torch.randn(GROUPS * N, TR_LEN, generator=g) * batch["response_mask"]
    return batch


def test_layout_reads_each_token_from_its_slot():
    from verl_megatron.workers.batching import build_micro_batches

    batch = grpo_batch()
    mbs = build_micro_batches(batch, [list(range(6)), list(range(6, 12))], pack=False, share_prefix=True)
    # 2 prompts per micro-batch -> 2 model rows of the longer prompt + 4 slots of 5 columns
    for mb, prompt_width in zip(mbs, (6, 5)):
        inputs = mb.inputs
        layout = inputs.shared_prefix
        assert layout is not None and inputs.input_ids.shape == (2, prompt_width + 4 * 5), (
            inputs.input_ids.shape
        )
        flat_ids = inputs.input_ids.reshape(-1)
        flat_pos = inputs.position_ids.reshape(-1)
        s = inputs.input_ids.shape[1]
        rotary = layout.rotary_index
        for r, row in enumerate(mb.rows.tolist()):
            valid = batch["attention_mask"][row].bool()
            n_prompt = int(valid[:TP_LEN].sum())
            for j in range(int(valid[TP_LEN:].sum())):
                at = int(inputs.gather_index[r, j])
                # the column after the predicting one holds the token, at its unshared position
                token_col = at + 1 if j > 0 else None
                if token_col is not None:
                    assert int(flat_ids[token_col]) == int(batch["responses"][row, j])
                    assert int(flat_pos[token_col]) == n_prompt + j
                    # rotary distance to the prompt's last column = the unshared distance
                    last_prompt = (at // s) * s + layout.prompt_width - 1
                    assert int(rotary[token_col % s] - rotary[last_prompt % s]) == j + 1
                else:
                    assert at % s == layout.prompt_width - 1
                    assert int(flat_ids[at]) == int(batch["prompts"][row, -1])
    # Pipeline stages exchange one fixed shape (uniform): the padded layout is kept.
    for mb in build_micro_batches(
        batch, [list(range(6)), list(range(6, 12))], pack=False, uniform=True, share_prefix=True
    ):
        assert mb.inputs.shared_prefix is None and mb.inputs.input_ids.shape == (6, 11)
    # Distinct prompts: nothing to share, the padded layout is kept.
    plain = {k: v[[0, 4, 8]] for k, v in batch.items()}
    (mb,) = build_micro_batches(plain, [[0, 1, 2]], pack=False, share_prefix=True)
    assert mb.inputs.shared_prefix is None and mb.inputs.input_ids.shape == (3, 11)


def test_split_attention_equals_the_full_mask_in_float64():
    from verl_megatron.workers.shared_prefix import SharedPrefix, attend, full_mask

    g = torch.Generator().manual_seed(0)
    groups, slots, p, w, heads, kv, d = 2, 3, 5, 4, 4, 2, 8
    s = p + slots * w
    keys = torch.ones(groups, p, dtype=torch.bool)
    keys[0, :2] = False  # a shorter prompt, left-padded
    rotary = torch.cat((torch.arange(p), (p + torch.arange(w)).repeat(slots)))
    layout = SharedPrefix(p, slots, w, keys, rotary)
    q = torch.randn(s, groups, heads, d, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(s, groups, kv, d, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(s, groups, kv, d, generator=g, dtype=torch.float64, requires_grad=True)
    split = attend(q, k, v, layout, None, True)
    allowed = ~full_mask(layout)
    full = F.scaled_dot_product_attention(
        *(t.permute(1, 2, 0, 3) for t in (q, k, v)), attn_mask=allowed, enable_gqa=True
    ).permute(2, 0, 1, 3)
    # padding columns of the prompt attend to themselves only; compare the real positions
    real = torch.ones(s, groups, dtype=torch.bool)
    real[:2, 0] = False
    assert_close_report(split[real], full[real], rtol=0, atol=1e-13, what="split vs full-mask attention")
    grad = torch.randn(split.shape, generator=g, dtype=torch.float64) * real[:, :, None, None]
    a = torch.autograd.grad(split, (q, k, v), grad)
    b = torch.autograd.grad(full, (q, k, v), grad)
    assert_close_report(dict(zip("qkv", a)), dict(zip("qkv", b)), rtol=0, atol=1e-13, what="gradients")


def shared_job(path: str, tp: int, variants: list[str]) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers import shared_prefix
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import ActorConfig, OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(tp=tp), seed=3)
    out = {}
    for variant in variants:
        cfg = ActorConfig(
            ppo_mini_batch_size=12,
            ppo_micro_batch_size_per_gpu=6,
            use_remove_padding=variant == "packed",
            share_prompt_prefix=variant.startswith("shared"),
            entropy_coeff=0.01,
            optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        )
        chunks = build_model(runtime, path)
        optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
        actor = MegatronActor(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
        assert (actor.runner.prefix_sharing is not None) == variant.startswith("shared")
        if variant == "shared_no_rotary":  # the rotary re-indexing switched off: must fail the comparison
            actor.runner.prefix_sharing.rotary_index = lambda inputs: None
        shapes = []
        chunks[0].module.embedding.register_forward_hook(lambda m, a, o, s=shapes: s.append(tuple(o.shape)))
        data = DataProto.from_dict(grpo_batch(), meta_info={"temperature": TEMPERATURE})
        log_probs, entropy = actor.compute_log_prob(data, calculate_entropy=True)
        data.batch["old_log_probs"] = log_probs + 0.05 * data.batch["response_mask"]
        metrics = actor.update_policy(data)
        out[variant] = {
            "log_probs": log_probs,
            "entropy": entropy,
            "pg_loss": metrics["actor/pg_loss"][0],
            "grad_norm": metrics["actor/grad_norm"][0],
            "entropy_metric": metrics["actor/entropy"][0],
            "weights": full_weights(chunks, runtime),
            "embedded": shapes,  # [S, b, h] per forward
        }
    assert shared_prefix  # imported so a missing module fails here, inside the job
    return out


SCALARS = ("log_probs", "entropy", "pg_loss", "grad_norm", "entropy_metric")


def test_actor_with_shared_prompts_matches_padded_and_packed(pool1, tmp_path):
    build_hf_model(str(tmp_path))
    variants = ["shared", "padded", "packed", "shared_no_rotary"]
    runs = pool1.run(f"{__name__}:shared_job", path=str(tmp_path), tp=1, variants=variants)[0]
    shared = runs["shared"]
    # Micro-batch 1: prompt A with 4 responses + prompt B with 2 -> 2 model rows of 6 + 4 * 5 columns.
    assert shared["embedded"][0][:2] == (26, 2), shared["embedded"]
    assert runs["padded"]["embedded"][0][:2] == (11, 6), runs["padded"]["embedded"]
    for other in ("padded", "packed"):
        what = f"shared prompt rows vs {other} rows"
        assert_close_report(
            {k: shared[k] for k in SCALARS},
            {k: runs[other][k] for k in SCALARS},
            rtol=2e-6,
            atol=2e-6,
            what=what,
        )
        assert_adam_weights_close(shared["weights"], runs[other]["weights"], lr=1e-2, steps=1, what=what)
    wrong = runs["shared_no_rotary"]["log_probs"] - runs["padded"]["log_probs"]
    assert wrong.abs().max() > 1e-3, (
        f"without rotary re-indexing the log-probs moved only {wrong.abs().max()}"
    )


def test_tp2_with_shared_prompts_matches_one_process(pool1, pool2, tmp_path):
    build_hf_model(str(tmp_path))
    one = pool1.run(f"{__name__}:shared_job", path=str(tmp_path), tp=1, variants=["shared"])[0]["shared"]
    two = pool2.run(f"{__name__}:shared_job", path=str(tmp_path), tp=2, variants=["shared"])[0]["shared"]
    what = "tp=2 vs one process, shared prompt rows"
    assert_close_report(
        {k: two[k] for k in SCALARS}, {k: one[k] for k in SCALARS}, rtol=2e-6, atol=2e-6, what=what
    )
    assert_adam_weights_close(two["weights"], one["weights"], lr=1e-2, steps=1, what=what)


def critic_job(path: str) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.config import CriticConfig, OptimConfig
    from verl_megatron.workers.critic import MegatronCritic
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(), seed=5)
    out = {}
    for shared in (True, False):
        cfg = CriticConfig(
            ppo_mini_batch_size=12,
            ppo_micro_batch_size_per_gpu=6,
            use_remove_padding=False,
            share_prompt_prefix=shared,
            optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        )
        chunks = build_model(runtime, path, value_head=True)
        optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
        critic = MegatronCritic(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
        assert (critic.runner.prefix_sharing is not None) == shared
        data = DataProto.from_dict(grpo_batch())
        values = critic.compute_values(data)
        data.batch["values"] = values
        data.batch["returns"] = values + 0.5 * data.batch["response_mask"]
        metrics = critic.update_critic(data)
        out[shared] = {
            "values": values,
            "vf_loss": metrics["critic/vf_loss"][0],
            "grad_norm": metrics["critic/grad_norm"][0],
            "weights": full_weights(chunks, runtime),
        }
    return out


def test_critic_with_shared_prompts_matches_padded(pool1, tmp_path):
    build_hf_model(str(tmp_path))
    runs = pool1.run(f"{__name__}:critic_job", path=str(tmp_path))[0]
    shared, padded = runs[True], runs[False]
    what = "critic: shared prompt rows vs padded rows"
    keys = ("values", "vf_loss", "grad_norm")
    assert_close_report(
        {k: shared[k] for k in keys}, {k: padded[k] for k in keys}, rtol=2e-6, atol=2e-6, what=what
    )
    assert_adam_weights_close(shared["weights"], padded["weights"], lr=1e-2, steps=1, what=what)


def trainer_job(out_dir: str, share: bool) -> dict:
    """One PPO step (actor and critic) of the tiny quickstart; its metrics and how many micro-batches
    were laid out with shared prompts."""
    import os

    import torch.distributed as dist

    from tests.test_e2e import PPO, QUICKSTART, TINY
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics
    from verl_megatron.workers import shared_prefix

    shared = []
    original = shared_prefix.shared_prefix_inputs

    def counted(*args, **kwargs):
        inputs = original(*args, **kwargs)
        shared.append(inputs is not None)
        return inputs

    shared_prefix.shared_prefix_inputs = counted
    flag = str(share).lower()
    try:
        run(
            QUICKSTART,
            [
                f"trainer.default_local_dir={out_dir}",
                *TINY,
                *PPO,
                "trainer.total_training_steps=1",
                "trainer.save_freq=0",
                # the critic shuffles rows by default (as in verl), which splits groups across
                # micro-batches; in order, every micro-batch holds whole groups
                "critic.shuffle=false",
                f"actor.share_prompt_prefix={flag}",
                f"critic.share_prompt_prefix={flag}",
            ],
        )
    finally:
        shared_prefix.shared_prefix_inputs = original
    if dist.get_rank() != 0:
        return {}
    rows = read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return {"row": next(r for r in rows if r.get("step") == 1), "shared": shared}


def test_a_ppo_step_with_shared_prompts_matches_the_padded_one(pool1, tmp_path):
    """The trainer's own batches (8 prompts x 4 responses, micro-batches of 8 rows): every actor
    and critic micro-batch is laid out shared, and the step's actor / critic metrics equal the run
    without sharing to float32 rounding."""
    on = pool1.run(f"{__name__}:trainer_job", out_dir=str(tmp_path / "on"), share=True)[0]
    off = pool1.run(f"{__name__}:trainer_job", out_dir=str(tmp_path / "off"), share=False)[0]
    assert on["shared"] and all(on["shared"]), on["shared"]
    assert not off["shared"]
    keys = sorted(
        k for k in off["row"] if k.startswith(("actor/", "critic/")) and isinstance(off["row"][k], float)
    )
    assert len(keys) > 20, keys
    assert_close_report(
        {k: on["row"][k] for k in keys},
        {k: off["row"][k] for k in keys},
        rtol=1e-5,
        atol=1e-6,
        what="PPO step metrics, shared prompt rows vs padded rows",
    )


def one_group(prompt_len: int, resp_lens: list[int], width: int) -> dict[str, torch.Tensor]:
    """One prompt of ``prompt_len`` tokens with a response of each length (``width`` columns)."""
    g = torch.Generator().manual_seed(1)
    rows = len(resp_lens)
    prompts = torch.randint(1, VOCAB, (1, prompt_len), generator=g).repeat(rows, 1)
    responses = torch.randint(1, VOCAB, (rows, width), generator=g)
    return padded_batch(prompts, responses, torch.full((rows,), prompt_len), torch.tensor(resp_lens))


def test_sharing_is_weighed_against_the_layout_that_would_run():
    """Shared positions are compared with the packed row's length when packing is on. Long-tailed
    group (prompt 4, responses 20 + 7 x 1): shared 4 + 8 x 20 = 164 positions, padded 8 x 24 = 192,
    packed 8 x 4 + 27 = 59. Against the padded count sharing was taken with packing too (164 > 59)."""
    from verl_megatron.workers.batching import build_micro_batches

    batch = one_group(4, [20] + [1] * 7, 20)
    packed_len = int(batch["attention_mask"].sum())
    assert packed_len == 59
    (padded,) = build_micro_batches(batch, [list(range(8))], pack=False, share_prefix=True)
    assert padded.inputs.shared_prefix is not None and padded.inputs.input_ids.shape == (1, 164)
    (packed,) = build_micro_batches(batch, [list(range(8))], pack=True, share_prefix=True)
    assert packed.inputs.shared_prefix is None, packed.inputs.input_ids.shape
    assert packed.inputs.input_ids.numel() == packed_len
    # Long shared prompts (40 tokens, 4 responses of 5): shared 60 positions, packed 180.
    batch = one_group(40, [5] * 4, 5)
    (mb,) = build_micro_batches(batch, [list(range(4))], pack=True, share_prefix=True)
    assert mb.inputs.shared_prefix is not None and mb.inputs.input_ids.shape == (1, 60)
    assert int(batch["attention_mask"].sum()) == 180
