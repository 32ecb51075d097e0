"""Bitwise rollout/training parity: the native engine's log-probs ARE the actor's old_log_probs.

A tiny Llama generates with the native engine on the actor's own (DDP-wrapped) chunks, with
sampling, EOS (so rows stop at different steps and the decoder compacts its batch) and n=2;
the actor then recomputes ``old_log_probs`` with ``compute_log_prob``. With
``rollout.bitwise_parity`` (``models/batch_invariant.py`` switched on) the two must be equal to
the last bit at tp=1, tp=2, pp=2 and with packed rows + dynamic micro-batches; without it they
differ by float rounding (the test shows that too). Also: the batch-invariant matmul really is
invariant (a row's result does not depend on the other rows, at several thread counts), and
an update with bypass (rollout log-probs as old_log_probs) gives the losses of the ordinary one.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch

VOCAB, PAD, EOS = 80, 0, 1
PROMPT_LENGTHS = [5, 2, 7, 3, 6, 4]
PROMPT_LENGTH, RESPONSE_LENGTH, N = 8, 10, 2
TEMPERATURE = 0.9

# Micro-batching of compute_log_prob: padded rows of 3, or packed rows under a token budget.
LAYOUTS = {
    "padded": {"use_remove_padding": False, "ppo_infer_micro_batch_size_per_gpu": 3},
    "packed_dynamic": {
        "use_remove_padding": True,
        "use_dynamic_bsz": True,
        "ppo_infer_max_token_len_per_gpu": 40,
    },
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = tmp_path_factory.mktemp("parity_llama")
    build_tiny_hf_model(
        path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=7, initializer_range=0.1, bos_token_id=None, eos_token_id=EOS,
        pad_token_id=PAD,
    )  # fmt: skip
    return str(path)


def _prompts(seed: int = 0):
    from verl_megatron.protocol import DataProto

    g = torch.Generator().manual_seed(seed)
    ids = torch.full((len(PROMPT_LENGTHS), PROMPT_LENGTH), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, PROMPT_LENGTH - n :] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[i, PROMPT_LENGTH - n :] = 1
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)},
        non_tensors={"uid": np.array([f"p{i}" for i in range(len(PROMPT_LENGTHS))], dtype=object)},
    )


def _actor(runtime, model_dir: str, layout: str, parity: bool):
    from tests.test_actor_update import build_model
    from verl_megatron.models import batch_invariant
    from verl_megatron.models.matmul_route import MatmulRoute
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import ActorConfig, OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    cfg = ActorConfig(
        ppo_mini_batch_size=3, ppo_micro_batch_size_per_gpu=2, rollout_n=N, ppo_max_token_len_per_gpu=40,
        optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0), **LAYOUTS[layout],
    )  # fmt: skip
    # The batch-invariant kernels run through the linears' matmul route (models/matmul_route.py).
    chunks = build_model(runtime, model_dir, route=MatmulRoute() if parity else None)
    invariance = batch_invariant.enable(chunks, PROMPT_LENGTH + RESPONSE_LENGTH) if parity else None
    optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
    return MegatronActor(
        runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim), batch_invariance=invariance
    )


def _rollout(runtime, actor, model_dir: str, parity: bool):
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.rollout import RolloutConfig, build_rollout

    config = RolloutConfig(
        prompt_length=PROMPT_LENGTH, response_length=RESPONSE_LENGTH, n=N, temperature=TEMPERATURE, seed=3,
        bitwise_parity=parity,
    )  # fmt: skip
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    return build_rollout(config, runtime, actor.chunks, tokenizer, load_hf_config(model_dir))


def parity_job(model_dir: str, tp: int, pp: int, layouts: list[str], parity: bool) -> dict:
    """Per layout: rollout log-probs, old_log_probs and the response mask of one generated batch."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=5)
    out = {}
    for layout in layouts:
        actor = _actor(runtime, model_dir, layout, parity)
        batch = _rollout(runtime, actor, model_dir, parity).generate_sequences(_prompts())
        batch.meta_info["temperature"] = TEMPERATURE
        old_log_probs, _ = actor.compute_log_prob(batch)
        out[layout] = {
            "rollout": batch.batch["rollout_log_probs"].clone(),
            "old": old_log_probs.clone(),
            "mask": batch.batch["response_mask"].clone(),
        }
    return out


def parity_report(result: dict) -> tuple[float, str]:
    """(max |rollout - old| over response tokens, where it is and how many tokens differ)."""
    mask = result["mask"].bool()
    diff = torch.where(mask, (result["rollout"] - result["old"]).abs(), torch.zeros(()))
    worst = float(diff.max())
    row, col = (int(i) for i in torch.unravel_index(diff.argmax(), diff.shape))
    where = (
        f"max |rollout_log_probs - old_log_probs| = {worst:.3g} at [{row}, {col}] "
        f"(rollout {float(result['rollout'][row, col]):.9g}, old {float(result['old'][row, col]):.9g}); "
        f"{int((diff > 0).sum())} of {int(mask.sum())} response tokens differ"
    )
    return worst, where


# ------------------------------------------------------------------ the trainer: metrics and bypass

QUICKSTART_PARITY = [
    "quickstart.num_digits=2",
    "data.train_batch_size=4",
    "data.max_response_length=3",
    "rollout.n=4",
    "rollout.bitwise_parity=true",
    "actor.ppo_mini_batch_size=2",  # two optimizer steps per training step
    "actor.ppo_micro_batch_size_per_gpu=4",
    "actor.use_remove_padding=true",
    "actor.use_dynamic_bsz=true",
    "actor.ppo_max_token_len_per_gpu=24",
    "actor.ppo_infer_max_token_len_per_gpu=24",
    "trainer.total_training_steps=2",
    "trainer.val_before_train=false",
    "trainer.test_freq=-1",
    "trainer.save_freq=-1",
    "trainer.export_hf=false",
    "trainer.resume_mode=disable",
    "trainer.logger=[console]",
]


def trainer_job(out_dir: str, overrides: list[str]) -> dict:
    """A short quickstart run (on every rank of a pool); its metrics and how often the actor
    recomputed log-probs (rank 0)."""
    import os

    import torch.distributed as dist

    from tests.test_e2e import QUICKSTART
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics
    from verl_megatron.workers.actor import MegatronActor

    calls = []
    original = MegatronActor.compute_log_prob

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    MegatronActor.compute_log_prob = counted
    try:
        run(QUICKSTART, [f"trainer.default_local_dir={out_dir}", *QUICKSTART_PARITY, *overrides])
    finally:
        MegatronActor.compute_log_prob = original
    if dist.get_rank() != 0:
        return {}
    rows = read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))
    return {"rows": [r for r in rows if r.get("step", 0) > 0], "log_prob_calls": len(calls)}


# ------------------------------------------------------------------ the kernels


@pytest.mark.parametrize("threads", [1, 2, 4])
def test_tiled_matmul_and_attention_rows_do_not_depend_on_the_batch(threads):
    from verl_megatron.models import batch_invariant as bi

    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        g = torch.Generator().manual_seed(threads)
        x, weight = torch.randn(300, 64, generator=g), torch.randn(96, 64, generator=g)
        whole = bi.linear(x, weight)
        # Plain GEMM: the same row differs with the number of rows (the reason for all this).
        assert (
            max(float((x[s : s + 1] @ weight.t() - (x @ weight.t())[s]).abs().max()) for s in range(40)) > 0
        )
        for rows in (1, 2, 3, 7, 16, 17, 100):
            for start in (0, 1, 13, 150):
                part = bi.linear(x[start : start + rows], weight)
                assert torch.equal(part, whole[start : start + rows]), (threads, rows, start)
        # The per-row operations left as they are: RMSNorm, the activation, log-softmax.
        norm = torch.nn.RMSNorm(64, eps=1e-5)
        torch.nn.init.normal_(norm.weight, generator=g)
        for op in (norm, torch.nn.functional.silu, lambda t: torch.log_softmax(t, dim=-1)):
            with torch.no_grad():
                rows_all = op(x)
                for rows in (1, 3, 17):
                    assert torch.equal(op(x[5 : 5 + rows]), rows_all[5 : 5 + rows]), (threads, op, rows)
        # Attention: one query against a row's keys gives the same bits as the same query among many.
        q, k, v = (torch.randn(5, 4, 12, 16, generator=g) for _ in range(3))
        keys, values = k[:, :2], v[:, :2]  # 2 key/value groups for 4 heads
        allowed = (
            (torch.arange(12)[None, :] <= torch.arange(12)[:, None]).view(1, 1, 12, 12).expand(5, 1, 12, 12)
        )
        full = bi.attention(q, keys, values, allowed, 0.25)
        for row, step in ((0, 0), (3, 5), (4, 11)):
            one = bi.attention(q[row : row + 1, :, step : step + 1], keys[row : row + 1], values[row : row + 1],
                               allowed[row : row + 1, :, step : step + 1], 0.25)  # fmt: skip
            assert torch.equal(one[0, :, 0], full[row, :, step]), (threads, row, step)
    finally:
        torch.set_num_threads(before)


def test_moe_router_gating_rows_do_not_depend_on_the_batch():
    """The router's gating matmul (switched by ``enable``) is tiled like the linears; megatron's
    own ``router_gating_linear`` is not, at a router of realistic width."""
    from megatron.core.transformer.moe.moe_utils import router_gating_linear

    from verl_megatron.models import batch_invariant as bi
    from verl_megatron.models.moe import install_router_fallback

    install_router_fallback()
    g = torch.Generator().manual_seed(0)
    x, weight = torch.randn(300, 256, generator=g), torch.randn(64, 256, generator=g)
    router = SimpleNamespace(config=SimpleNamespace(moe_router_dtype="fp32"), weight=weight, bias=None)
    whole, plain = bi.router_gating(router, x), router_gating_linear(x, weight, None, torch.float32)
    gaps = [float((router_gating_linear(x[s : s + 1], weight, None, torch.float32)[0] - plain[s]).abs().max())
            for s in range(40)]  # fmt: skip
    assert max(gaps) > 0, "megatron's gating is row-stable here: the check below proves nothing"
    for rows in (1, 3, 17, 100):
        for start in (0, 13, 150):
            assert torch.equal(bi.router_gating(router, x[start : start + rows]), whole[start : start + rows])


def test_packed_segments_attend_like_padded_rows():
    """Training's self-attention: a packed row (block-causal mask) gives each token exactly the
    output of the same sequence in its own padded row."""
    from verl_megatron.models import batch_invariant as bi

    g = torch.Generator().manual_seed(0)
    lengths = [5, 3, 6]
    q, k, v = (torch.randn(14, 1, 4, 8, generator=g) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    segment = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    hidden = ~((segment[:, None] == segment[None, :]) & torch.ones(14, 14, dtype=torch.bool).tril())
    packed = bi.self_attention(q, k, v, hidden.view(1, 1, 14, 14), key_length=16, scale=0.3)
    start = 0
    for n in lengths:
        alone = bi.self_attention(
            q[start : start + n], k[start : start + n], v[start : start + n], None, 16, 0.3
        )
        assert torch.equal(packed[start : start + n], alone)
        start += n
    with pytest.raises(ValueError, match="exceeds the fixed key length"):
        bi.self_attention(q, k, v, None, key_length=8, scale=0.3)


# ------------------------------------------------------------------ rollout vs compute_log_prob


def _assert_exact(results: dict, what: str) -> None:
    for layout, result in results.items():
        worst, where = parity_report(result)
        assert result["mask"].sum() > 0 and (result["mask"] == 0).any()  # EOS stopped some rows early
        assert worst == 0.0, f"{what}, {layout}: {where}"


@pytest.fixture(scope="module")
def tp1_results(pool1, model_dir) -> dict:
    job = f"{__name__}:parity_job"
    return {
        parity: pool1.run(job, model_dir=model_dir, tp=1, pp=1, layouts=list(LAYOUTS), parity=parity)[0]
        for parity in (False, True)
    }


def test_parity_mode_tp1_rollout_log_probs_equal_old_log_probs(tp1_results):
    _assert_exact(tp1_results[True], "tp=1")


def test_without_parity_mode_log_probs_differ_by_rounding(tp1_results):
    for layout, result in tp1_results[False].items():
        worst, where = parity_report(result)
        assert 0.0 < worst < 1e-4, f"{layout}: {where}"


@pytest.mark.multiproc
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (1, 1)], ids=["tp2", "pp2", "dp2"])
def test_parity_mode_tp2_pp2_dp2_rollout_log_probs_equal_old_log_probs(pool2, model_dir, tp1_results, tp, pp):
    results = pool2.run(f"{__name__}:parity_job", model_dir=model_dir, tp=tp, pp=pp, layouts=list(LAYOUTS),
                        parity=True)  # fmt: skip
    for rank_result in results:
        _assert_exact(rank_result, f"tp={tp} pp={pp}")
    if tp == 1:
        # Pipeline stages split the layers and dp ranks the rows, not the arithmetic: one
        # process's numbers exactly.
        for layout in LAYOUTS:
            assert torch.equal(results[0][layout]["old"], tp1_results[True][layout]["old"]), layout


# ------------------------------------------------------------------ metrics, bypass, config


def test_logprob_diff_metric_names_and_values():
    from verl_megatron.trainer.metrics import rollout_probs_diff_metrics

    rollout = torch.tensor([[-1.0, -2.0, -3.0, 0.0]])
    old = torch.tensor([[-1.0, -2.5, -3.0, -9.0]])
    metrics = rollout_probs_diff_metrics(rollout, old, torch.tensor([[1, 1, 1, 0]]))
    assert metrics["rollout/logprob_diff/max"] == 0.5
    assert metrics["rollout/logprob_diff/mean"] == pytest.approx(0.5 / 3)
    assert metrics["rollout/logprob_diff/frac_diff"] == pytest.approx(1 / 3)
    assert metrics["training/rollout_probs_diff_max"] == pytest.approx(np.exp(-2.0) - np.exp(-2.5))
    assert {"training/rollout_probs_diff_mean", "training/rollout_probs_diff_std"} <= set(metrics)


@pytest.fixture(scope="module")
def trainer_runs(pool1, tmp_path_factory) -> dict:
    return {
        bypass: pool1.run(
            f"{__name__}:trainer_job",
            out_dir=str(tmp_path_factory.mktemp("bypass") / "run"),
            overrides=[f"algorithm.rollout_correction.bypass_mode={str(bypass).lower()}"],
        )[0]
        for bypass in (False, True)
    }


def test_trainer_logs_zero_logprob_diff_with_parity_every_step(trainer_runs):
    rows = trainer_runs[False]["rows"]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["rollout/logprob_diff/max"] == 0.0, row
        assert row["rollout/logprob_diff/mean"] == 0.0 and row["rollout/logprob_diff/frac_diff"] == 0.0
        assert row["training/rollout_probs_diff_max"] == 0.0


def test_trainer_parity_holds_in_bfloat16_too(pool1, tmp_path):
    """The recipes' dtype: bf16 weights and activations, where the two paths otherwise differ by ~1e-3."""
    run = pool1.run(
        f"{__name__}:trainer_job", out_dir=str(tmp_path / "run"), overrides=["model.dtype=bfloat16"]
    )[0]
    for row in run["rows"]:
        assert row["rollout/logprob_diff/max"] == 0.0, row


def test_bypass_skips_the_old_log_prob_pass_and_trains_identically(trainer_runs):
    plain, bypass = trainer_runs[False], trainer_runs[True]
    assert plain["log_prob_calls"] == 2 and bypass["log_prob_calls"] == 0
    assert all("timing_s/old_log_prob" in r for r in plain["rows"])
    assert not any("timing_s/old_log_prob" in r or "rollout/logprob_diff/max" in r for r in bypass["rows"])
    # The second step trains on nonzero advantages: a real update, bit for bit the same.
    assert plain["rows"][1]["actor/grad_norm"] > 0
    for row_plain, row_bypass in zip(plain["rows"], bypass["rows"]):
        for key, value in row_plain.items():
            if key.startswith(("actor/", "critic/", "response_length/")):
                assert row_bypass[key] == value, (row_plain["step"], key, value, row_bypass[key])


def test_bypass_and_parity_refused_where_parity_cannot_hold(tmp_path):
    from tests.test_e2e import QUICKSTART
    from verl_megatron.errors import UserInputError
    from verl_megatron.trainer.config import load_config, validate_config

    bypass = "algorithm.rollout_correction.bypass_mode=true"
    with pytest.raises(UserInputError, match=r"bypass_mode=true .* rollout\.bitwise_parity=true"):
        validate_config(load_config(QUICKSTART, [bypass]), 1)
    validate_config(load_config(QUICKSTART, [bypass, "rollout.bitwise_parity=true"]), 1)
    # verl's bypass settings this trainer's bypass would not apply are named, not ignored
    rest = [bypass, "rollout.bitwise_parity=true", "algorithm.rollout_correction.loss_type=reinforce",
            "algorithm.rollout_correction.rollout_is=sequence"]  # fmt: skip
    with pytest.raises(UserInputError) as err:
        validate_config(load_config(QUICKSTART, rest), 1)
    assert (
        "would ignore algorithm.rollout_correction.loss_type='reinforce', algorithm.rollout_correction."
        "rollout_is='sequence': unset them" in str(err.value)
    )
    with pytest.raises(UserInputError, match=r"bitwise_parity=true needs rollout\.name=native"):
        load_config(QUICKSTART, ["rollout.name=vllm", "rollout.bitwise_parity=true"])
    with pytest.raises(UserInputError, match=r"bitwise_parity=true does not support rollout\.multi_turn"):
        load_config(QUICKSTART, ["rollout.bitwise_parity=true", "rollout.multi_turn.enable=true",
                                 "rollout.multi_turn.environment=pkg.mod:env"])  # fmt: skip
