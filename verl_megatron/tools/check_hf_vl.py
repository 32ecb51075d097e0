"""``check-hf`` for vision-language checkpoints (Qwen2.5-VL): logits on image + text prompts.

The prompts are built here, with images drawn by PIL (coloured shapes on a plain background, of
different sizes so that window attention has whole and cut windows), through the checkpoint's own
tokenizer, chat template and image processor (``data.multimodal``). megatron's 3-D rotary ids come
from ``utils/mrope.py``; transformers computes its own from the token types, so the check covers
them too.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import torch

from verl_megatron.data.multimodal import encode_multimodal_prompt, load_image_text_processor
from verl_megatron.distributed import state
from verl_megatron.distributed.collective import max_over_ranks
from verl_megatron.distributed.parallel import Runtime
from verl_megatron.errors import ModelConfigError
from verl_megatron.models.builder import build_gpt_chunks, model_info
from verl_megatron.models.config import ModelConfig
from verl_megatron.models.convert import load_hf_weights
from verl_megatron.tools.check_common import max_abs_diff, verdict
from verl_megatron.utils.local_vl_assets import shape_image
from verl_megatron.utils.mrope import mrope_position_ids

__all__ = [
    "VLSample",
    "hf_vl_logits",
    "megatron_vl_logits",
    "run_vl_check",
    "vl_check_samples",
]


@dataclass
class VLSample:
    """One prompt as model inputs: ``input_ids`` [T], ``position_ids`` [3, T], the images' patches."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    pixel_values: torch.Tensor
    image_grid_thw: torch.Tensor


def vl_check_samples(path: str, hf_config) -> list[VLSample]:
    """Two prompts: one image (112 x 84: cut windows) and two images (56 x 56, 84 x 140) with text."""
    processor = load_image_text_processor(path)
    prompts = [
        ([{"role": "user", "content": "<image>What colour is the square?"}], [shape_image((112, 84), "red")]),
        (
            [{"role": "user", "content": "Compare <image> with <image>. Which one is a circle?"}],
            [shape_image((56, 56), "blue", "circle"), shape_image((84, 140), "green")],
        ),
    ]
    samples = []
    for messages, images in prompts:
        encoded = encode_multimodal_prompt(messages, images, processor)
        ids = torch.tensor(encoded.input_ids)
        positions = mrope_position_ids(
            ids,
            encoded.image_grid_thw,
            image_token_id=int(hf_config.image_token_id),
            spatial_merge_size=int(hf_config.vision_config.spatial_merge_size),
        )
        samples.append(VLSample(ids, positions, encoded.pixel_values, encoded.image_grid_thw))
    return samples


@torch.no_grad()
def megatron_vl_logits(
    chunks: list[torch.nn.Module], runtime: Runtime, samples: list[VLSample]
) -> list[torch.Tensor] | None:
    """Logits [T_i, V] (float32, CPU) of each sample, one micro-batch each; None off the last stage."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    vocab = model_info(chunks).vocab_size
    for chunk in chunks:
        chunk.eval()

    def forward_step(data_iterator, model):
        sample = next(data_iterator)
        device = runtime.device
        output = model(
            sample.input_ids.unsqueeze(0).to(device),
            sample.position_ids.unsqueeze(1).to(device),
            None,
            pixel_values=sample.pixel_values.to(device),
            image_grid_thw=sample.image_grid_thw,
            runtime_gather_output=True,
        )

        def collect(logits):
            return logits.new_zeros(()), {"logits": logits[0, :, :vocab].float().cpu()}

        return output, collect

    results = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(samples),
        model=chunks[0],
        num_microbatches=len(samples),
        seq_length=max(len(s.input_ids) for s in samples),
        micro_batch_size=1,
        forward_only=True,
    )
    if not state.is_pp_last_rank():
        return None
    return [r["logits"] for r in results]


@torch.no_grad()
def hf_vl_logits(path: str, samples: list[VLSample], image_token_id: int) -> list[torch.Tensor]:
    """transformers' float32 logits [T_i, V]; its own 3-D positions (from the token types)."""
    from transformers import AutoModelForImageTextToText

    model = AutoModelForImageTextToText.from_pretrained(
        path, dtype=torch.float32, local_files_only=True
    ).eval()
    out = []
    for sample in samples:
        ids = sample.input_ids.unsqueeze(0)
        logits = model(
            input_ids=ids,
            pixel_values=sample.pixel_values,
            image_grid_thw=sample.image_grid_thw,
            mm_token_type_ids=(ids == image_token_id).int(),
        ).logits
        out.append(logits[0].float())
    return out


def run_vl_check(args: argparse.Namespace, runtime: Runtime, hf_config, tolerance: float) -> int:
    """check-hf's comparison for a vision-language checkpoint (collective; same status everywhere)."""
    if (args.vpp or 1) > 1:
        raise ModelConfigError("check-hf: --vpp is not supported for vision-language checkpoints yet")
    chunks = build_gpt_chunks(hf_config, runtime, ModelConfig(path=args.path, dtype=args.dtype))
    load_hf_weights(chunks, args.path, runtime)
    samples = vl_check_samples(args.path, hf_config)
    logits = megatron_vl_logits(chunks, runtime, samples)
    reporter = logits is not None and runtime.tp_rank == 0 and runtime.dp_rank == 0
    local_diff = 0.0
    if reporter:
        reference = hf_vl_logits(args.path, samples, int(hf_config.image_token_id))
        local_diff = max_abs_diff(zip(logits, reference))
    max_diff = max_over_ranks(local_diff, runtime.device)
    head = f"check-hf {args.path} tp={args.tp} pp={args.pp} dtype={args.dtype} (image + text)"
    return verdict(max_diff, tolerance, reporter=reporter, head=head, quantity="logit", prompts=len(samples))
