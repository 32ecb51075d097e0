"""Image + text prompts through vLLM / SGLang (fakes of their Python APIs), dataset memory, token budgets.

The prompt batch comes from the trainer's dataset on the tiny Qwen2.5-VL (a row with one image, a
row with two, a text row). What each engine receives is asserted exactly:

- vLLM: ``LLM.generate([TokensPrompt(prompt_token_ids=ids, multi_modal_data={"image": [PIL]})...],
  sampling_params=[one per prompt])``; SGLang: ``Engine.generate(input_ids=[each prompt n times],
  image_data=[its images, or None], sampling_params, return_logprob)``;
- the ids hold ONE ``<|image_pad|>`` per image: they equal the chat template's text tokenized before
  the processor expands it (what vLLM's multimodal processor and SGLang's take); the fakes expand
  each placeholder as the engines do (``t*h*w / merge^2`` of the image processor's grid for that
  image) and must get the dataset's expanded prompt back, token for token;
- the images are the rows' images (pixels equal); the engines keep their tokenizer
  (``skip_tokenizer_init=False``), which their multimodal processors are built from.

The answers map back to their rows (responses and log-probs per prompt and sample), the output's
``position_ids`` [B*n, 3, T] equal the 3-D ids ``utils/mrope`` computes from the full, expanded
output ids, and the image columns are repeated per sample. The dataset holds no pixel values:
its rows keep the encoded image bytes, and pixel values are made per batch. A token budget counts
a row's image tokens.
"""

from __future__ import annotations

import io
import json
import sys
import types
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import saved_model
from tests.test_vl_data import _row
from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl, shape_image

N, TR, EOS, PAD = 2, 4, 1, 0
QUESTION = "What colour is the square?"


def _png(size, colour, shape="square") -> bytes:
    buffer = io.BytesIO()
    shape_image(size, colour, shape).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def vl_setup(tmp_path_factory):
    """(model folder, processor, dataset, prompt batch, the rows' image bytes)."""
    from verl_megatron.data.config import DataConfig
    from verl_megatron.data.dataset import RLHFDataset, collate_prompts
    from verl_megatron.data.multimodal import image_processor_for

    path = saved_model(tmp_path_factory, "tiny_qwen2_5_vl_engines", build_tiny_qwen2_5_vl)
    images = [[_png((56, 84), "red")], [_png((112, 84), "blue"), _png((56, 56), "green", "circle")], []]
    texts = ["<image>" + QUESTION, "<image>and<image>: which is round?", "What colour is a tomato?"]
    data = tmp_path_factory.mktemp("vl_engine_rows") / "rows.jsonl"
    rows = []  # jsonl holds no bytes: the images are files next to it (relative paths)
    for r, (imgs, text) in enumerate(zip(images, texts)):
        for k, b in enumerate(imgs):
            (data.parent / f"{r}_{k}.png").write_bytes(b)
        rows.append({**_row([], text), "images": [f"{r}_{k}.png" for k in range(len(imgs))]})
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    processor = image_processor_for(path)
    dataset = RLHFDataset([str(data)], processor.tokenizer, DataConfig(max_prompt_length=64), processor)
    batch = collate_prompts(dataset.items, PAD, 64, processor=processor)
    batch.meta_info["eos_token_id"] = EOS
    return SimpleNamespace(path=path, processor=processor, dataset=dataset, batch=batch, images=images)


def _unexpanded_ids(processor, text: str) -> list[int]:
    """The chat template's tokens before the processor expands the image placeholders."""
    from verl_megatron.data.multimodal import content_parts

    rendered = processor.tokenizer.apply_chat_template(
        content_parts([{"role": "user", "content": text}]),
        add_generation_prompt=True,
        tokenize=False,
        chat_template=processor.chat_template,
    )
    return processor.tokenizer(rendered, add_special_tokens=False)["input_ids"]


def _expand(ids: list[int], images, processor) -> list[int]:
    """What vLLM / SGLang do with one placeholder per image: each becomes its image's tokens."""
    pad = processor.image_token_id
    if not images:
        return list(ids)
    grids = processor.image_processor(images=images, return_tensors="pt")["image_grid_thw"]
    counts = iter(int(g.prod()) // processor.merge_size**2 for g in grids)
    out: list[int] = []
    for t in ids:
        out.extend([pad] * next(counts) if t == pad else [t])
    assert next(counts, None) is None, "more images than placeholders"
    return out


def _answer(i: int, j: int) -> tuple[list[int], list[float]]:
    """Prompt i, sample j: tokens and log-probs that say which request they answer."""
    tokens = [100 + 10 * i + j] * (1 + (i + j) % 3) + [EOS]
    return tokens, [-0.01 * (10 * i + j + 1)] * len(tokens)


class _Recorder:
    """Fake ``vllm.LLM`` / ``sglang.Engine`` that expands the placeholders as the engines do."""

    calls: list = []

    def __init__(self, *args, **kwargs) -> None:
        self.kwargs = kwargs
        _Recorder.calls.append(("init", kwargs))


class FakeLLM(_Recorder):
    processor = None

    def generate(self, prompts, sampling_params=None, use_tqdm=True):
        _Recorder.calls.append(("generate", prompts, sampling_params))
        out = []
        for i, prompt in enumerate(prompts):
            images = prompt.get("multi_modal_data", {}).get("image")
            _Recorder.calls.append(("expanded", _expand(prompt["prompt_token_ids"], images, self.processor)))
            completions = []
            for j in range(sampling_params[i].kwargs["n"]):
                tokens, logps = _answer(i, j)
                steps = [{t: SimpleNamespace(logprob=lp)} for t, lp in zip(tokens, logps)]
                completions.append(SimpleNamespace(token_ids=tokens, logprobs=steps))
            out.append(SimpleNamespace(outputs=completions))
        return out


class FakeEngine(_Recorder):
    processor = None

    def generate(self, input_ids, sampling_params=None, return_logprob=False, image_data=None):
        _Recorder.calls.append(("generate", input_ids, image_data, sampling_params, return_logprob))
        assert image_data is None or len(image_data) == len(input_ids)
        out = []
        for k, ids in enumerate(input_ids):
            _Recorder.calls.append(
                ("expanded", _expand(ids, (image_data or [None] * len(ids))[k], self.processor))
            )
            tokens, logps = _answer(k // N, k % N)
            out.append(
                {
                    "output_ids": tokens,
                    "meta_info": {"output_token_logprobs": [(lp, t, None) for t, lp in zip(tokens, logps)]},
                }
            )
        return out


class FakeSamplingParams:
    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs


@pytest.fixture
def fake_engines(monkeypatch, vl_setup):
    vllm = types.ModuleType("vllm")
    vllm.LLM, vllm.SamplingParams = FakeLLM, FakeSamplingParams
    vllm_inputs = types.ModuleType("vllm.inputs")
    vllm_inputs.TokensPrompt = dict  # a TypedDict: calling it builds the dict
    sglang = types.ModuleType("sglang")
    sglang.Engine = FakeEngine
    for name, module in (("vllm", vllm), ("vllm.inputs", vllm_inputs), ("sglang", sglang)):
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(FakeLLM, "processor", vl_setup.processor)
    monkeypatch.setattr(FakeEngine, "processor", vl_setup.processor)
    monkeypatch.delenv("VLLM_ENABLE_V1_MULTIPROCESSING", raising=False)
    _Recorder.calls = []
    yield _Recorder.calls


def test_engine_prompt_ids_cut_each_image_run_to_one_placeholder():
    from verl_megatron.rollout.external import engine_prompt_ids

    assert engine_prompt_ids([5, 7, 9, 9, 9, 8, 7, 9, 9, 8, 3], 9, 2, "p") == [5, 7, 9, 8, 7, 9, 8, 3]
    assert engine_prompt_ids([9, 9, 4], 9, 1, "p") == [9, 4]
    with pytest.raises(ValueError, match="p: 1 runs of image token 9 for 2 images"):
        engine_prompt_ids([7, 9, 9, 9, 8], 9, 2, "p")


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_engines_get_one_placeholder_per_image_and_answers_map_back(fake_engines, vl_setup, engine):
    from transformers import AutoConfig

    from verl_megatron.data.multimodal import load_image
    from verl_megatron.rollout import RolloutConfig
    from verl_megatron.rollout.external import GenerationRequest
    from verl_megatron.rollout.sglang_engine import SGLangRollout, sglang_sampling_params
    from verl_megatron.rollout.vllm_engine import VLLMRollout, vllm_sampling_kwargs
    from verl_megatron.utils.mrope import mrope_position_ids_batch

    setup, processor = vl_setup, vl_setup.processor
    hf_config = AutoConfig.from_pretrained(setup.path)
    config = RolloutConfig(
        name=engine, n=N, response_length=TR, calculate_log_probs=True, seed=4, tensor_model_parallel_size=1
    )
    runtime = SimpleNamespace(world_size=1, seed=0, dp_rank=0, local_rank=0, rank=0)
    tokenizer = SimpleNamespace(pad_token_id=PAD, eos_token_id=EOS)
    rollout_cls = VLLMRollout if engine == "vllm" else SGLangRollout
    rollout = rollout_cls(config, runtime, [], tokenizer, hf_config)
    out = rollout.generate_sequences(setup.batch)

    init = next(c[1] for c in fake_engines if c[0] == "init")
    assert init["skip_tokenizer_init"] is False  # the engine's image processor needs the tokenizer
    (call,) = [c for c in fake_engines if c[0] == "generate"]
    expanded = [c[1] for c in fake_engines if c[0] == "expanded"]
    texts = ["<image>" + QUESTION, "<image>and<image>: which is round?", "What colour is a tomato?"]
    unexpanded = [_unexpanded_ids(processor, t) for t in texts]
    assert [u.count(processor.image_token_id) for u in unexpanded] == [1, 2, 0]
    mask = setup.batch.batch["attention_mask"].bool()
    prompt_rows = [row[keep].tolist() for row, keep in zip(setup.batch.batch["input_ids"], mask)]
    if engine == "vllm":
        _, prompts, params = call
        assert [p["prompt_token_ids"] for p in prompts] == unexpanded
        sent = [p.get("multi_modal_data", {}).get("image", []) for p in prompts]
        assert "multi_modal_data" not in prompts[2]
        request = rollout_request(params, config)
        assert [p.kwargs for p in params] == [vllm_sampling_kwargs(request, p.kwargs["seed"]) for p in params]
        assert expanded == prompt_rows  # the engine's expansion is the trainer's prompt, token for token
    else:
        _, input_ids, image_data, params, return_logprob = call
        assert input_ids == [u for u in unexpanded for _ in range(N)] and return_logprob is True
        assert image_data[4] is None and image_data[5] is None
        sent = [image_data[i * N] or [] for i in range(3)]
        assert all(image_data[i * N + 1] == image_data[i * N] for i in range(3))
        request = GenerationRequest(
            params=rollout_request_params(config), max_tokens=TR, stop_token_ids=(EOS,), ignore_eos=False,
            seed=0, logprobs=True,
        )  # fmt: skip
        assert params == sglang_sampling_params(request)
        assert expanded == [r for r in prompt_rows for _ in range(N)]
    for row, images in enumerate(setup.images):
        assert len(sent[row]) == len(images)
        for got, raw in zip(sent[row], images):
            assert torch.equal(_pixels(got), _pixels(load_image(raw, "expected")))

    # Answers map back to their rows: row i*N + j holds prompt i's sample j.
    for i in range(3):
        for j in range(N):
            tokens, logps = _answer(i, j)
            row = i * N + j
            got = out.batch["responses"][row]
            assert got[: len(tokens)].tolist() == tokens[:TR] and (got[len(tokens) :] == PAD).all()
            assert torch.allclose(
                out.batch["rollout_log_probs"][row, : len(tokens)], torch.tensor(logps[:TR])
            )
            assert torch.equal(out.batch["prompts"][row], setup.batch.batch["input_ids"][i])
    # 3-D ids of the whole output: computed from the full expanded ids, they are what the actor gets.
    grids = [None if e is None else e["image_grid_thw"] for e in out.non_tensor_batch["multi_modal_inputs"]]
    expected = mrope_position_ids_batch(
        out.batch["input_ids"], out.batch["attention_mask"], grids,
        image_token_id=processor.image_token_id, spatial_merge_size=processor.merge_size,
    ).transpose(0, 1)  # fmt: skip
    valid = out.batch["attention_mask"].bool()
    assert torch.equal(out.batch["position_ids"].transpose(1, 2)[valid], expected.transpose(1, 2)[valid])
    assert [len(g) if g is not None else 0 for g in grids] == [1, 1, 2, 2, 0, 0]


def rollout_request_params(config):
    from verl_megatron.rollout.sampling import resolve_sampling

    return resolve_sampling(config, {})


def rollout_request(params, config):
    from verl_megatron.rollout.external import GenerationRequest

    return GenerationRequest(
        params=rollout_request_params(config), max_tokens=TR, stop_token_ids=(EOS,), ignore_eos=False,
        seed=0, logprobs=True,
    )  # fmt: skip


def _pixels(image) -> torch.Tensor:
    import numpy as np

    return torch.from_numpy(np.asarray(image.convert("RGB")).copy())


def test_dataset_keeps_images_encoded_and_budgets_count_image_tokens(vl_setup):
    """No pixel values in the dataset (encoded bytes only, pixel values made per batch); a token
    budget that would fit two rows without their image tokens splits them."""
    from verl_megatron.workers.batching import balanced_token_partition

    items = vl_setup.dataset.items
    batch = vl_setup.batch
    held = 0
    for item in items:
        for value in vars(item).values():
            if isinstance(value, torch.Tensor):
                assert value.numel() <= 3 * len(item.input_ids), (item.index, tuple(value.shape))
                held += value.numel() * value.element_size()
        held += sum(len(b) for b in item.images or ())
    pixel_bytes = sum(
        e["pixel_values"].numel() * e["pixel_values"].element_size()
        for e in batch.non_tensor_batch["multi_modal_inputs"]
        if e is not None
    )
    assert items[0].images == (vl_setup.images[0][0],) and items[2].images is None
    assert [e["image"] if e else None for e in batch.non_tensor_batch["multi_modal_data"]] == [
        vl_setup.images[0], vl_setup.images[1], None,
    ]  # fmt: skip
    # 3 images of 56x84, 112x84 and 56x56 pixels: 24+48+16 patches of 1176 float32 = 414 KB.
    assert pixel_bytes == (24 + 48 + 16) * 1176 * 4
    assert held * 10 < pixel_bytes, (held, pixel_bytes)

    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    image_tokens = (batch.batch["input_ids"] == vl_setup.processor.image_token_id).sum(-1).tolist()
    assert image_tokens == [6, 16, 0]  # 24/4 and (48+16)/4 merged patches
    budget = lengths[1] + lengths[2] - 1  # fits both rows only if row 1's image tokens were left out
    assert lengths[1] - image_tokens[1] + lengths[2] <= budget
    assert sorted(map(sorted, balanced_token_partition([lengths[1], lengths[2]], budget))) == [[0], [1]]
