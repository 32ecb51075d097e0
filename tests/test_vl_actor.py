"""Qwen2.5-VL through MegatronActor: image + text rows give the one-process update under every layout.

Four rows (verl's layout: left-padded prompts, right-padded responses, ``position_ids`` [B, 3, T],
``non_tensor_batch["multi_modal_inputs"]``): the ``check-hf`` prompts with one and with two images,
a text-only prompt, and the two-image prompt again with another response. Each variant runs
compute_log_prob and one update_policy (one mini-batch of 4 rows: one optimizer step, the
KL-loss settings of ``test_actor_update``) on the tiny Qwen2.5-VL. Micro-batches of 2 rows in
padded rows are the reference; micro-batches of 1 and token-budget micro-batches of packed rows
must give its numbers, and so must tp=2, pp=2 and dp=2 (each rank takes its rows' images). As in
``test_family_qwen3_next_actor``, the optimizer is SGD at learning rate 1 with clipping at 1.0, so
weight differences are gradient differences: log-probs within 1e-5 (float32 sums in another
order; log-probs about 5; measured 9.5e-7), metrics within 1e-6 + 1e-4 relative, weights
(language model and vision tower) within WEIGHT_ATOL (measured 1.2e-7).

``model.freeze_vision_tower``: Adam keeps no state for the vision tower (its parameters are not in
the optimizer), the tower's weights are unchanged bit for bit, the language model's move.
The log-prob stage runs the LM head on the response positions only (no full-vocabulary logits for
image or prompt positions): the head's input rows are counted.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.closeness import assert_close_report
from tests.helpers import saved_model
from tests.test_actor_update import KL_SHIFT, TEMPERATURE, full_weights, kl_actor_config
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl

TR = 5
WEIGHT_ATOL = 1e-5
RESPONSES = [[5, 17, 33, 8, 2], [40, 9, 11, 0, 0], [7, 7, 21, 60, 0], [12, 3, 90, 44, 6]]
TEXT_PROMPT = [15, 27, 39, 51, 63, 75]


@pytest.fixture(scope="module")
def vl_path(tmp_path_factory) -> str:
    return saved_model(tmp_path_factory, "tiny_qwen2_5_vl_actor", build_tiny_qwen2_5_vl)


def collated_prompts(path: str, hf_config, order: list[int]) -> tuple[dict[str, torch.Tensor], list]:
    """``collate_multimodal_prompts`` of the prompts ``order`` picks from (one image, two images,
    text only): (left-padded prompt tensors, per-row multi_modal_inputs)."""
    from verl_megatron.data.multimodal import MultimodalPrompt, collate_multimodal_prompts
    from verl_megatron.tools.check_hf_vl import vl_check_samples

    one, two = (
        MultimodalPrompt(s.input_ids.tolist(), s.pixel_values, s.image_grid_thw)
        for s in vl_check_samples(path, hf_config)
    )
    text = MultimodalPrompt(TEXT_PROMPT, torch.zeros(0, 0), torch.zeros(0, 3, dtype=torch.long))
    prompts = [(one, two, text)[i] for i in order]
    return collate_multimodal_prompts(
        prompts,
        pad_token_id=0,
        max_prompt_length=max(len(p.input_ids) for p in prompts),
        image_token_id=int(hf_config.image_token_id),
        spatial_merge_size=2,
    )


def vl_batch(path: str, hf_config) -> tuple[dict[str, torch.Tensor], np.ndarray]:
    """(tensors, multi_modal_inputs) of the four rows, as the trainer will assemble them: prompts
    collated by ``collate_multimodal_prompts``, responses appended, 3-D ids continued by
    ``with_response_positions``; advantages drawn from a fixed seed."""
    from verl_megatron.workers.vl_inputs import with_response_positions

    prompt, images = collated_prompts(path, hf_config, [0, 1, 2, 1])
    responses = torch.tensor(RESPONSES)
    response_mask = (responses != 0).float()
    advantages = torch.randn(len(images), TR, generator=torch.Generator().manual_seed(3)) * response_mask
    tensors = {
        "input_ids": torch.cat([prompt["input_ids"], responses], dim=1),
        "attention_mask": torch.cat([prompt["attention_mask"], response_mask.long()], dim=1),
        "responses": responses,
        "response_mask": response_mask,
        "advantages": advantages,
        "position_ids": with_response_positions(prompt["position_ids"], TR),  # [B, 3, T], verl's layout
    }
    column = np.empty(len(images), dtype=object)
    column[:] = images
    return tensors, column


VARIANTS = {
    "mb2": {},
    "mb1": {"ppo_micro_batch_size_per_gpu": 1},
    "packed": {"use_remove_padding": True},
    "dynamic": {"use_remove_padding": True, "use_dynamic_bsz": True},
}


def _head_rows(chunks) -> list[int]:
    """Rows the LM head sees per call (appended by a forward hook on the last stage's output layer)."""
    from verl_megatron.distributed.modules import unwrap

    rows: list[int] = []
    model = unwrap(chunks[-1])
    if model.post_process:
        model.output_layer.register_forward_hook(
            lambda m, args, out: rows.append(args[0].shape[0] * args[0].shape[1])
        )
    return rows


def vl_actor_job(path: str, layout: dict, variants: list[str], freeze: bool = False) -> dict:
    """Per variant: log-probs, metrics and updated weights (rank 0), the LM head's rows in the
    log-prob pass; with ``freeze``: Adam, and which parameters the optimizer holds state for."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    runtime = init_runtime(ParallelLayout(**layout), seed=5)
    hf_config = load_hf_config(path)
    tensors, images = vl_batch(path, hf_config)
    budget = int(tensors["attention_mask"].sum(-1).max()) + 8  # two rows never fit: several micro-batches
    optim = (
        OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0)
        if freeze
        else OptimConfig(optimizer="sgd", lr=1.0, weight_decay=0.0, clip_grad=1.0)
    )
    out = {}
    for variant in variants:
        settings = {"ppo_micro_batch_size_per_gpu": 2, "optim": optim, **VARIANTS[variant]}
        cfg = kl_actor_config(
            ppo_max_token_len_per_gpu=budget, ppo_infer_max_token_len_per_gpu=budget, **settings
        )
        model_cfg = ModelConfig(path=path, dtype="float32", use_te=False, freeze_vision_tower=freeze)
        chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
        load_hf_weights(chunks, path, runtime, model_cfg)
        chunks = wrap_ddp(chunks)
        optimizer = build_optimizer(chunks, optim_settings(cfg.optim))
        actor = MegatronActor(runtime, cfg, chunks, optimizer, build_lr_scheduler(optimizer, cfg.optim))
        record = {"before": full_weights(chunks, runtime), "head_rows": _head_rows(chunks)}
        data = DataProto.from_dict(tensors, {"multi_modal_inputs": images}, {"temperature": TEMPERATURE})
        record["old_log_probs"] = actor.compute_log_prob(data)[0]
        record["head_rows"] = list(record["head_rows"])  # the log-prob pass's calls only
        data.batch["old_log_probs"] = record["old_log_probs"]
        data.batch["ref_log_prob"] = record["old_log_probs"] - KL_SHIFT * data.batch["response_mask"]
        record.update(metrics=actor.update_policy(data), weights=full_weights(chunks, runtime))
        if freeze:
            subs = getattr(optimizer, "chained_optimizers", None) or [optimizer]
            held = {id(p) for sub in subs for group in sub.optimizer.param_groups for p in group["params"]}
            state = {id(p) for sub in subs for p in sub.optimizer.state}
            names = {id(p): n for c in chunks for n, p in c.named_parameters()}
            record["optimizer_params"] = sorted(names[i] for i in held if i in names)
            record["state_params"] = sorted(names[i] for i in state if i in names)
        out[variant] = record
    return out


def _assert_same_update(run: dict, ref: dict, what: str) -> None:
    assert_close_report(
        run["old_log_probs"], ref["old_log_probs"], rtol=0, atol=1e-5, what=f"{what} log-probs"
    )
    assert_close_report(run["metrics"], ref["metrics"], rtol=1e-4, atol=1e-6, what=f"{what} metrics")
    assert_close_report(
        run["weights"], ref["weights"], rtol=0, atol=WEIGHT_ATOL, what=f"{what} weights after SGD"
    )


@pytest.fixture(scope="module")
def reference(pool1, vl_path) -> dict:
    (single,) = pool1.run(
        f"{__name__}:vl_actor_job", path=vl_path, layout={}, variants=["mb2", "mb1", "dynamic"]
    )
    return single


def test_micro_batch_splits_and_packing_give_the_same_update(reference):
    ref = reference["mb2"]
    assert ref["old_log_probs"].abs().max() > 1.0 and ref["metrics"]["actor/pg_loss"][0] != 0.0
    vision = [n for n in ref["weights"] if n.startswith("visual.")]
    assert len(vision) > 10  # the tower trains: its weights moved
    assert max(float((ref["weights"][n] - ref["before"][n]).abs().max()) for n in vision) > 1e-3
    # LM head rows in the log-prob pass: response positions only (4 rows x 5 in all, at most one
    # micro-batch's 2 x 5 per call; a head deferred out of the model call adds calls of 0 rows).
    for variant, most in (("mb2", 2 * TR), ("mb1", TR), ("dynamic", 2 * TR)):
        rows = reference[variant]["head_rows"]
        assert sum(rows) == 4 * TR and max(rows) <= most, (variant, rows)
    assert ref["head_rows"].count(2 * TR) == 2 and reference["mb1"]["head_rows"].count(TR) == 4
    assert len([r for r in reference["dynamic"]["head_rows"] if r]) >= 3  # the token budget splits the rows
    for variant in ("mb1", "dynamic"):
        _assert_same_update(reference[variant], ref, variant)


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), {}], ids=["tp2", "pp2", "dp2"])
def test_layouts_match_single_process(pool2, vl_path, reference, layout):
    # tp=2 also packs token-budget micro-batches (one row, block-causal mask, per-token 3-D ids).
    variants = ["mb2", "dynamic"] if layout.get("tp") == 2 else ["mb2"]
    ranks = pool2.run(f"{__name__}:vl_actor_job", path=vl_path, layout=layout, variants=variants)
    for variant in variants:
        _assert_same_update(ranks[0][variant], reference["mb2"], f"{layout} {variant} rank 0")
        assert_close_report(
            ranks[1][variant]["old_log_probs"],
            reference["mb2"]["old_log_probs"],
            rtol=0,
            atol=1e-5,
            what=f"{variant} rank 1 log-probs",
        )
    if layout.get("tp") == 2:
        assert len(ranks[0]["dynamic"]["head_rows"]) >= 3  # the budget made several packed micro-batches


def test_freeze_vision_tower_keeps_it_out_of_the_optimizer(pool1, vl_path):
    (run,) = pool1.run(f"{__name__}:vl_actor_job", path=vl_path, layout={}, variants=["mb2"], freeze=True)
    record = run["mb2"]
    assert record["state_params"] and not [n for n in record["optimizer_params"] if "vision." in n]
    assert not [n for n in record["state_params"] if "vision." in n]
    assert "module.embedding.word_embeddings.weight" in record["optimizer_params"] or any(
        n.endswith("embedding.word_embeddings.weight") for n in record["optimizer_params"]
    )
    for name, weight in record["weights"].items():
        moved = float((weight - record["before"][name]).abs().max())
        assert (moved == 0.0) == name.startswith("visual."), f"{name} moved by {moved:.3e}"


def test_malformed_image_rows_and_thd_are_refused_by_name():
    from verl_megatron.errors import ParallelConfigError
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.batching import build_micro_batches
    from verl_megatron.workers.vl_inputs import ROW_IMAGES, row_images

    ids = torch.tensor([[3, 4, 5, 6]])
    tensors = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "responses": ids[:, 2:]}
    image = {"pixel_values": torch.zeros(16, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(KeyError, match=r"need batch\['position_ids'\] \[B, 3, T\] = \[1, 3, 4\]"):
        row_images(DataProto.from_dict(tensors, {"multi_modal_inputs": [image]}), "where")
    tensors["position_ids"] = torch.arange(4).expand(1, 3, 4)
    bad = {"pixel_values": torch.zeros(15, 8), "image_grid_thw": torch.tensor([[1, 4, 4]])}
    with pytest.raises(ValueError, match=r"row 0: image_grid_thw \(1, 3\) \(t\*h\*w summing to 16\)"):
        row_images(DataProto.from_dict(tensors, {"multi_modal_inputs": [bad]}), "where")
    assert row_images(DataProto.from_dict(tensors, {"multi_modal_inputs": [None]}), "where") == {}
    batch = {**tensors, **row_images(DataProto.from_dict(tensors, {"multi_modal_inputs": [image]}), "w")}
    assert batch[ROW_IMAGES].image_grid_thw[0].tolist() == [[1, 4, 4]]
    # verl's [B, 4, T] (a text-position row, then the 3-D ids): the last three rows are used.
    tensors["position_ids"] = torch.cat([torch.full((1, 1, 4), 9), torch.arange(12).view(1, 3, 4)], dim=1)
    four = row_images(DataProto.from_dict(tensors, {"multi_modal_inputs": [image]}), "w")[ROW_IMAGES]
    assert torch.equal(four.position_ids, torch.arange(12).view(1, 3, 4))
    with pytest.raises(ParallelConfigError, match="cannot be packed as THD sequences"):
        build_micro_batches(batch, [[0]], pack=True, thd=True)


def vl_ref_job(path: str) -> torch.Tensor:
    """MegatronRef (frozen, unwrapped chunks) log-probs of the four rows, token-budget micro-batches."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.actor import MegatronRef
    from verl_megatron.workers.config import RefConfig

    runtime = init_runtime(ParallelLayout(), seed=5)
    hf_config = load_hf_config(path)
    model_cfg = ModelConfig(path=path, dtype="float32", use_te=False)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, path, runtime, model_cfg)
    tensors, images = vl_batch(path, hf_config)
    budget = int(tensors["attention_mask"].sum(-1).max()) + 8
    ref = MegatronRef(
        runtime, RefConfig(log_prob_use_dynamic_bsz=True, log_prob_max_token_len_per_gpu=budget), chunks
    )
    data = DataProto.from_dict(tensors, {"multi_modal_inputs": images}, {"temperature": TEMPERATURE})
    return ref.compute_log_prob(data)[0]


def test_reference_policy_takes_image_rows(pool1, vl_path, reference):
    (log_probs,) = pool1.run(f"{__name__}:vl_ref_job", path=vl_path)
    assert_close_report(log_probs, reference["mb2"]["old_log_probs"], rtol=0, atol=1e-5, what="ref log-probs")


@pytest.mark.parametrize(
    ("settings", "key"),
    [
        ({"cp": 2}, r"parallel\.cp=2"),
        ({"lora_rank": 8}, r"model\.lora_rank=8"),
    ],
)
def test_features_without_image_support_are_refused_by_name(settings, key):
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.models.families.qwen2_vl import check_vl_features

    args = {"lora_rank": 0, "bitwise_parity": False, "cp": 1, **settings}
    with pytest.raises(
        ModelConfigError, match=rf"^{key} is not supported for qwen2_5_vl \(vision-language\)"
    ):
        check_vl_features("qwen2_5_vl", **args)
    check_vl_features("qwen2", **args)  # text families: not this check's business


def test_response_positions_continue_the_prompts_like_the_whole_sequence():
    from verl_megatron.utils.mrope import mrope_position_ids_batch
    from verl_megatron.workers.vl_inputs import with_response_positions

    img = 99  # grids (1, 4, 4) -> 4 tokens, (1, 2, 6) -> 3 tokens, (1, 6, 2) -> 3 tokens (merge 2)
    prompts = [[5, img, img, img, img, 6, 7], [8, img, img, img, img, img, img], [9, 10, 11]]
    grids = [torch.tensor([[1, 4, 4]]), torch.tensor([[1, 2, 6], [1, 6, 2]]), None]
    tp, tr = 8, 4
    ids = torch.zeros(3, tp + tr, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, tp - len(prompt) : tp] = torch.tensor(prompt)
        mask[row, tp - len(prompt) :] = 1
    ids[:, tp:] = torch.tensor([20, 21, 22, 23])
    whole = mrope_position_ids_batch(ids, mask, grids, image_token_id=img, spatial_merge_size=2)
    prompt_only = mrope_position_ids_batch(
        ids[:, :tp], mask[:, :tp], grids, image_token_id=img, spatial_merge_size=2
    )
    got = with_response_positions(prompt_only.transpose(0, 1), tr)
    assert torch.equal(got, whole.transpose(0, 1)), (got - whole.transpose(0, 1)).abs().max()
    # After a tall image: its largest (height) id + 1 = 7, not the last token's temporal id + 1 = 5.
    assert got[1, :, tp].tolist() == [7, 7, 7] and int(whole[0, 1, tp - 1]) == 4
