"""MoE routing replay: the native rollout records each token's experts, training replays them.

The layout code is checked by hand-made cases (stored "routes" that are the tokens' own ids
must land where the router sees those tokens). The end-to-end jobs generate with a tiny MoE
model, keep the routes on the recording ranks, and run the actor's forwards:

- before any update, training's own top-k equals the recorded one for every recorded
  (token, layer) route (hit rate 1.0, every route checked once), under pp=2 and ep=2 as in one
  process, and a pp stage records exactly one process's routes of its global layers;
- after an update, training's own routes differ from the recorded ones (hit rate < 1: the
  check can fail) and the replayed forward's log-probs are closer to the rollout's.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

VOCAB, EXPERTS, TOPK, LAYERS = 96, 4, 2, 2
PROMPT_LENGTHS = [6, 3, 5, 2]
PROMPT_LEN, RESPONSE_LEN, N = 6, 8, 2
LR = 3e-4  # one Adam step that moves a few routes (hit rate ~0.99), not most of them


# ---------------------------------------------------------------------------- layout by hand


def _micro_batch(pack: bool, align: int = 1):
    """Two rows of 3+2 and 1+2 tokens (left-padded prompts, right-padded responses)."""
    from verl_megatron.workers.batching import build_micro_batches

    ids = torch.tensor([[11, 12, 13, 21, 22], [0, 0, 14, 23, 24]])
    mask = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 0]])
    batch = {"input_ids": ids, "attention_mask": mask, "responses": ids[:, 3:]}
    return build_micro_batches(batch, [[0, 1]], pack=pack, align=align)[0], ids, mask


def _id_routes(ids, mask) -> list[torch.Tensor]:
    """'Routes' [n_i, L=2, k=2] holding each attended token's id (layer 1: id + 100)."""
    out = []
    for row, m in zip(ids, mask):
        tokens = row[m.bool()].to(torch.uint8)
        out.append(torch.stack([tokens, tokens + 100], dim=1)[:, :, None].expand(-1, 2, 2).clone())
    return out


@pytest.mark.parametrize("pack", [False, True])
def test_routes_land_where_the_router_sees_their_token(pack):
    from verl_megatron.models.routing import router_token_targets

    mb, ids, mask = _micro_batch(pack)
    targets = router_token_targets(_id_routes(ids, mask), mb.inputs)
    # The router sees the model input transposed to [S, b] and flattened.
    seen = mb.inputs.input_ids.t().reshape(-1)
    real = targets[0, :, 0] >= 0
    assert int(real.sum()) == int(mask.sum())
    assert torch.equal(targets[0, real, 0], seen[real]), (targets[0, :, 0], seen)
    assert torch.equal(targets[1, real, 1], seen[real] + 100)
    assert bool((targets[:, ~real] == -1).all())


def test_sequence_parallel_ranks_get_their_slice_and_unrecorded_tokens_are_free():
    from verl_megatron.models.routing import router_token_targets

    mb, ids, mask = _micro_batch(pack=True, align=2)
    routes = _id_routes(ids, mask)
    routes[1][-1] = 255  # the row's last token: the rollout never fed it
    whole = router_token_targets(routes, mb.inputs)
    halves = [router_token_targets(routes, mb.inputs, sp_rank=r, sp_size=2) for r in (0, 1)]
    assert torch.equal(torch.cat(halves, dim=1), whole)
    assert halves[0].shape[1] == mb.inputs.input_ids.numel() // 2
    assert int((whole[0, :, 0] >= 0).sum()) == int(mask.sum()) - 1


def test_hook_replays_recorded_rows_and_counts_agreement():
    from verl_megatron.models.routing import RouteHook

    scores = torch.tensor([[0.9, 0.1, 0.5, 0.0], [0.0, 0.8, 0.1, 0.7], [0.3, 0.2, 0.1, 0.0]])

    def topk(s, k, num_groups=None, group_topk=None):
        return torch.topk(s, k=k, dim=1)

    hook = RouteHook(0, 0, 4, 2)
    # Row 0 recorded as computed (other order), row 1 recorded differently, row 2 not recorded.
    hook.mode, hook.target = "replay", torch.tensor([[2, 0], [0, 2], [-1, -1]])
    values, chosen = hook.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert chosen.tolist() == [[2, 0], [0, 2], [0, 1]]
    assert torch.equal(values, scores.gather(1, chosen))
    assert hook.counts.tolist() == [2.0, 1.0]  # two recorded rows, one agrees
    hook.mode = "observe"
    _, computed = hook.get_replay_topk(scores, 2, default_compute_topk=topk)
    assert computed.tolist() == [[0, 2], [1, 3], [0, 1]]


# ---------------------------------------------------------------------------- start-up errors


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["actor.megatron.router_replay.mode=R3"], "set rollout.enable_rollout_routing_replay=true"),
        (
            ["rollout.enable_rollout_routing_replay=true", "rollout.name=vllm"],
            "rollout.name='vllm' cannot record MoE routes",
        ),
        (
            ["rollout.enable_rollout_routing_replay=true", "rollout.name=sglang"],
            "rollout.name='sglang' cannot record MoE routes",
        ),
        (["rollout.enable_rollout_routing_replay=true"], "the quickstart model is dense"),
        (["ref.megatron.router_replay.mode=R3"], "only the actor replays routes"),
        (["actor.megatron.router_replay.mode=R2"], "R2 is verl's old-log-prob replay, not implemented"),
    ],
)
def test_replay_without_a_recording_engine_or_moe_model_is_refused(overrides, message):
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import default_config_path, load_config, validate_config

    with pytest.raises(ConfigError) as err:
        validate_config(load_config(default_config_path(), overrides), world_size=1)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_dense_checkpoint_is_refused(tmp_path):
    from verl_megatron.errors import ConfigError
    from verl_megatron.trainer.config import default_config_path, load_config, validate_config
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(tmp_path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=64, seed=1)  # fmt: skip
    overrides = [
        "rollout.enable_rollout_routing_replay=true",
        f"model.path={tmp_path}",
        "quickstart.enable=false",
    ]
    with pytest.raises(ConfigError, match=r"needs a mixture-of-experts model; model.path=.* is dense"):
        validate_config(load_config(default_config_path(), overrides), world_size=1)


# ---------------------------------------------------------------------------- end to end


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory) -> str:
    """A tiny random Qwen3-MoE checkpoint: 2 layers, 4 experts, top-2."""
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    path = tmp_path_factory.mktemp("replay_moe")
    build_tiny_hf_model(
        path, "qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
        intermediate_size=64, seed=3, initializer_range=0.3, bos_token_id=None, eos_token_id=1, pad_token_id=0,
    )  # fmt: skip
    return str(path)


def _moe_chunks(runtime, path: str, route=None):
    """The checkpoint as our builder makes it: megatron MoE chunks of ``runtime``'s layout, DDP-wrapped
    (``route``: the linears' matmul route, ``models/matmul_route.py``)."""
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.megatron_model import wrap_ddp

    model_cfg = ModelConfig(path=path, dtype="float32", use_te=False)
    chunks = build_gpt_chunks(load_hf_config(path), runtime, model_cfg, route=route)
    load_hf_weights(chunks, path, runtime, model_cfg)
    return wrap_ddp(chunks)


def _prompts():
    from verl_megatron.protocol import DataProto

    g = torch.Generator().manual_seed(0)
    ids = torch.zeros(len(PROMPT_LENGTHS), PROMPT_LEN, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, n in enumerate(PROMPT_LENGTHS):
        ids[i, PROMPT_LEN - n :] = torch.randint(2, VOCAB, (n,), generator=g)
        mask[i, PROMPT_LEN - n :] = 1
    return DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp(min=0)}
    )


def _abs_diff(a: torch.Tensor, b: torch.Tensor, mask: torch.Tensor) -> float:
    return float(((a - b).abs() * mask).sum())


def replay_job(
    path: str,
    tp: int = 1,
    pp: int = 1,
    ep: int = 1,
    lr: float = LR,
    eos: list[int] | None = None,
    parity: bool = False,
) -> dict:
    """Generate with recording, then the actor's forwards before and after one update.

    ``eos``: stop ids (None: ignore EOS, every row runs the whole response length). ``parity``:
    batch-invariant kernels (``rollout.bitwise_parity``) and every forward replays (R3)."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.megatron_model import build_optimizer
    from verl_megatron.protocol import DataProto
    from verl_megatron.rollout import RolloutConfig, build_rollout
    from verl_megatron.rollout.layout import gather_replicas, shard_for
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import ActorConfig, OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings
    from verl_megatron.workers.routes import RunRoutes

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp, ep=ep), seed=3)
    from verl_megatron.models.matmul_route import MatmulRoute

    chunks = _moe_chunks(runtime, path, MatmulRoute() if parity else None)
    invariance = None
    if parity:
        from verl_megatron.models import batch_invariant

        invariance = batch_invariant.enable(chunks, PROMPT_LEN + RESPONSE_LEN)
        routers = [m for m in chunks[0].modules() if type(m).__name__ == "RoutedTopKRouter"]
        assert routers and all(m.route.batch_invariant and "gating" not in vars(m) for m in routers)
    cfg = ActorConfig(ppo_mini_batch_size=len(PROMPT_LENGTHS), ppo_micro_batch_size_per_gpu=2, rollout_n=N,
                      shuffle=True, optim=OptimConfig(lr=lr, weight_decay=0.0))  # fmt: skip
    optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
    routes = RunRoutes(runtime, chunks, replay=False)
    actor = MegatronActor(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim),
                          route_replay=routes.training, batch_invariance=invariance)  # fmt: skip
    rollout_cfg = RolloutConfig(
        prompt_length=PROMPT_LEN,
        response_length=RESPONSE_LEN,
        n=N,
        seed=1,
        ignore_eos=eos is None,
        bitwise_parity=parity,
    )
    tokens = SimpleNamespace(pad_token_id=0, eos_token_id=1)
    rollout = build_rollout(rollout_cfg, runtime, chunks, tokens, SimpleNamespace(eos_token_id=None),
                            route_recorder=routes.recorder)  # fmt: skip

    # As the trainer: each dp replica generates its share, keeps its routes, gathers the rest.
    shard = shard_for("native", 1, runtime)
    local = _prompts().chunk(shard.replicas)[shard.replica]
    local.meta_info["prompt_offset"] = shard.replica * len(local)
    if eos is not None:
        local.meta_info["eos_token_id"] = eos
    out = rollout.generate_sequences(local)
    recorded = out.batch["routed_experts"].clone()
    local_out = {key: out.batch[key].clone() for key in ("responses", "response_mask", "attention_mask")}
    layer_numbers = list(out.meta_info["routed_experts_layers"])
    out = routes.keep(out, shard.replica, shard.replicas, validate=False)
    out.meta_info.pop("prompt_offset")
    batch = DataProto.concat(gather_replicas(out, shard, runtime.world_size))
    batch.meta_info["temperature"] = 1.0
    mask = batch.batch["response_mask"].float()
    rollout_lp = batch.batch["rollout_log_probs"]

    def forward(mode: str) -> tuple[torch.Tensor, dict]:
        routes.training.mode = mode
        log_probs, _ = actor.compute_log_prob(batch)
        metrics = routes.training.metrics()
        return log_probs, {"metrics": metrics, "seen": routes.training.last_counts["log_prob"]}

    before, before_stats = forward("replay" if parity else "observe")
    batch.batch["old_log_probs"] = before
    g = torch.Generator().manual_seed(1)
    batch.batch["advantages"] = torch.randn(mask.shape, generator=g) * mask
    routes.training.mode = "replay"
    actor.update_policy(batch)
    update_metrics = routes.training.metrics()
    after_own, after_stats = forward("observe")
    after_replayed, replayed_stats = forward("replay")
    result = {
        "recorded": recorded,
        "local": local_out,
        "decode_steps": rollout.stats["decode_steps"],
        "layer_numbers": layer_numbers,
        "replica": shard.replica,
        "stored_rows": len(routes.store.rows),
        "fetched_rows": len(routes.store.fetched),
        "before": before_stats,
        "update": update_metrics,
        "after": after_stats,
        "replayed": replayed_stats,
        "rollout_max_diff": float(((before - rollout_lp).abs() * mask).max()),
        "rollout_gap": _abs_diff(before, rollout_lp, mask),
        "own_gap": _abs_diff(after_own, rollout_lp, mask),
        "replayed_gap": _abs_diff(after_replayed, rollout_lp, mask),
        "attention_mask": batch.batch["attention_mask"],
    }
    routes.end_step()
    return result


def _check_run(run: dict, layers: int) -> None:
    rows = len(PROMPT_LENGTHS) * N
    hit = "actor/router_replay/hit_rate_log_prob"
    recorded = run["recorded"]
    assert recorded.dtype == torch.uint8 and recorded.shape[2:] == (layers, TOPK)
    assert run["before"]["metrics"]["actor/router_replay/bytes_per_token"] == layers * TOPK
    # Every attended token but each row's last (never fed to the model) has a route.
    attended = int(run["attention_mask"].sum())
    seen, hits = run["before"]["seen"]
    assert seen == hits, (
        f"before any update training routed {seen - hits} of {seen} recorded routes differently"
    )
    assert run["before"]["metrics"][hit] == 1.0
    expected = (attended - rows) * LAYERS  # summed over every rank: all stages, all rows
    assert seen == expected, f"{seen} routes checked, {expected} recorded"
    assert run["rollout_gap"] < 1e-3, run["rollout_gap"]
    assert (
        run["update"]["actor/router_replay/hit_rate_update"] == 1.0
    )  # the update forward ran before its step
    assert run["after"]["metrics"][hit] < 1.0, "an update changed no route: the check below proves nothing"
    assert run["replayed_gap"] < run["own_gap"], (run["replayed_gap"], run["own_gap"])


@pytest.fixture(scope="module")
def single(pool1, moe_model) -> dict:
    return pool1.run(f"{__name__}:replay_job", path=moe_model)[0]


def test_training_routes_equal_rollout_routes_until_an_update_and_replay_keeps_them(single):
    _check_run(single, LAYERS)
    assert single["layer_numbers"] == list(range(LAYERS))


def test_pp2_stages_record_and_replay_their_own_layers(pool2, moe_model, single):
    runs = pool2.run(f"{__name__}:replay_job", path=moe_model, pp=2)
    for stage, run in enumerate(runs):
        _check_run(run, LAYERS // 2)
        # A stage's local MoE layer i is global layer offset + i, and records what one process
        # records for that layer.
        assert run["layer_numbers"] == [stage]
        assert torch.equal(run["recorded"][:, :, 0], single["recorded"][:, :, stage]), f"stage {stage}"


def _stop_ends(responses: torch.Tensor, eos: set[int]) -> list[int]:
    """Each row's response length when it stops at the first of ``eos``."""
    return [next((i + 1 for i, t in enumerate(row.tolist()) if t in eos), RESPONSE_LEN) for row in responses]


def _uneven_eos(responses: torch.Tensor) -> tuple[list[int], list[int]]:
    """Stop ids that end every row of one dp half before the other half's last row, and the ends."""
    half = responses.shape[0] // 2
    for position in range(RESPONSE_LEN - 1):
        for early in (0, 1):
            eos = set(responses[early * half : (early + 1) * half, position].tolist())
            ends = _stop_ends(responses, eos)
            if max(ends[early * half : (early + 1) * half]) < max(
                ends[(1 - early) * half : (2 - early) * half]
            ):
                return sorted(eos), ends
    raise AssertionError("no stop ids make the two halves end at different steps")


@pytest.mark.parametrize("ep", [1, 2])
def test_dp2_ranks_keep_their_rows_and_fetch_the_rows_they_train_on(pool2, moe_model, single, ep):
    # EOS on, with stop ids that end one replica's rows steps before the other's: at ep=2 the
    # replicas meet in every step's all-to-all, so the one done first must keep stepping.
    eos, ends = _uneven_eos(single["local"]["responses"])
    runs = pool2.run(f"{__name__}:replay_job", path=moe_model, ep=ep, eos=eos)
    rows = len(PROMPT_LENGTHS) * N
    for rank, run in enumerate(runs):
        _check_run(run, LAYERS)
        # Each rank stores only the rows its replica generated (one process's rows of that share);
        # shuffled mini-batches made the ranks fetch rows from each other.
        assert run["stored_rows"] == rows // 2
        assert run["fetched_rows"] > 0
        # Its tokens are one process's tokens up to each row's stop id, pad after.
        own = slice(rank * rows // 2, (rank + 1) * rows // 2)
        expected_mask = torch.tensor([[int(i < end) for i in range(RESPONSE_LEN)] for end in ends[own]])
        assert torch.equal(run["local"]["response_mask"], expected_mask), (rank, ends)
        got = run["local"]["responses"] * expected_mask
        assert torch.equal(got, single["local"]["responses"][own] * expected_mask), rank
        # The routes of every token fed to the model are the ones one process recorded.
        attended = run["local"]["attention_mask"].bool()
        fed = attended[:, :-1] & attended[:, 1:]
        assert torch.equal(run["recorded"][:, :-1][fed], single["recorded"][own][:, :-1][fed]), rank
        assert run["decode_steps"] == (max(ends) - 1 if ep > 1 else max(ends[own]) - 1), (ep, rank, ends)


@pytest.mark.parametrize("ep", [1, 2])
def test_bitwise_parity_moe_rollout_log_probs_equal_replayed_old_log_probs(
    pool1, pool2, moe_model, single, ep
):
    # Batch-invariant kernels (router gating and experts included) plus R3 replay: the trainer's
    # old_log_probs are the rollout's bit for bit, in one process and with the experts split
    # (there with EOS on, so one replica may idle-step for the other).
    pool, eos = (pool1, None) if ep == 1 else (pool2, _uneven_eos(single["local"]["responses"])[0])
    runs = pool.run(f"{__name__}:replay_job", path=moe_model, ep=ep, parity=True, eos=eos)
    for rank, run in enumerate(runs):
        _check_run(run, LAYERS)
        assert run["rollout_max_diff"] == 0.0, (
            f"ep={ep} rank {rank}: old_log_probs differ from the rollout's by up to {run['rollout_max_diff']:.3g}"
        )
        # After the update, the replayed forward applied every recorded route (and only those).
        assert run["replayed"]["seen"][0] == run["before"]["seen"][0], (ep, rank, run["replayed"]["seen"])


# ---------------------------------------------------------------------------- the trainer


def trainer_job(out_dir: str, model_dir: str) -> dict:
    """One GRPO step (and validation) of the quickstart task on a tiny Qwen3-MoE model, replay on."""
    from verl_megatron.train import run
    from verl_megatron.trainer.config import default_config_path
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    run(default_config_path(), [
        f"trainer.default_local_dir={out_dir}", f"model.path={model_dir}", "quickstart.num_digits=2",
        "data.train_batch_size=4", "rollout.n=2", "actor.ppo_mini_batch_size=2", "actor.ppo_micro_batch_size_per_gpu=4",
        "trainer.total_training_steps=1", "trainer.test_freq=1", "trainer.save_freq=0", "trainer.logger=[console]",
        "trainer.resume_mode=disable", "rollout.enable_rollout_routing_replay=true",
        "actor.megatron.router_replay.mode=R3",
    ])  # fmt: skip
    import os

    return {"rows": read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))}


def test_trainer_replays_and_reports_hit_rates(pool1, tmp_path):
    from verl_megatron.trainer.quickstart import DIGITS
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    model_dir = tmp_path / "model"
    tokenizer = build_char_tokenizer(str(tmp_path / "tokenizer"), alphabet=DIGITS)
    build_tiny_hf_model(model_dir, "qwen3_moe", hidden_size=32, num_layers=LAYERS, num_heads=4, num_kv_heads=2,
                        intermediate_size=64, seed=1, tokenizer=tokenizer)  # fmt: skip
    (result,) = pool1.run(f"{__name__}:trainer_job", out_dir=str(tmp_path / "run"), model_dir=str(model_dir))
    steps = {}
    for row in result["rows"]:
        steps.setdefault(row["step"], {}).update(row)
    metrics = steps[1]
    # The old-log-prob forward runs on the rollout's weights: every recorded route agrees.
    assert metrics["actor/router_replay/hit_rate_log_prob"] == 1.0, metrics
    assert metrics["actor/router_replay/bytes_per_token"] == LAYERS * TOPK
    # Two mini-batches: the second update forward runs after the first optimizer step.
    assert 0.0 < metrics["actor/router_replay/hit_rate_update"] <= 1.0
    assert any(key.startswith("val") for key in metrics), "the validation rollout (routes dropped) ran"
