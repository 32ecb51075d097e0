"""Assets for a self-contained run: a character tokenizer, a random-init model, synthetic data.

Used when ``quickstart.enable`` is set and ``model.path`` / ``data.train_files`` are
empty. Rank 0 writes everything under ``quickstart.assets_dir`` (default
``<trainer.default_local_dir>/assets``); the other ranks wait at a barrier and
then read the same files. The returned config has ``model.path`` and the data
files pointing at them; nothing else changes.
"""

from __future__ import annotations

import dataclasses
import os

import torch.distributed as dist

from verl_megatron.trainer.config import PPOConfig

__all__ = ["DIGITS", "prepare_quickstart_assets"]

# The tokenizer knows only digits (plus its specials), so every wrong token costs reward
# through the scorer's length normalisation, and the policy learns to stop with EOS.
DIGITS = "0123456789"


def _build(config: PPOConfig, assets_dir: str, need_model: bool, need_data: bool) -> None:
    from verl_megatron.data.synthetic import write_synthetic_dataset
    from verl_megatron.utils.local_assets import MOE_FAMILIES, build_char_tokenizer, build_tiny_hf_model

    qs = config.quickstart
    if qs.task == "shapes":  # the vision-language quickstart (configs/quickstart_vl.yaml)
        return _build_shapes(config, assets_dir, need_model, need_data)
    if need_model:
        model_dir = os.path.join(assets_dir, "model")
        tokenizer = build_char_tokenizer(
            os.path.join(assets_dir, "tokenizer"), alphabet=DIGITS, **_agent_chat(qs.task)
        )
        # MoE: transformers trains with the load-balancing loss only with output_router_logits.
        moe = {"output_router_logits": True} if qs.family in MOE_FAMILIES else {}
        build_tiny_hf_model(
            model_dir,
            qs.family,
            hidden_size=qs.hidden_size,
            num_layers=qs.num_layers,
            num_heads=qs.num_heads,
            num_kv_heads=qs.num_kv_heads,
            intermediate_size=qs.intermediate_size,
            seed=config.trainer.seed,
            tokenizer=tokenizer,
            **moe,
        )
    if need_data and qs.task == "lookup":
        from verl_megatron.data.lookup_task import write_lookup_dataset

        write_lookup_dataset(os.path.join(assets_dir, "data"), num_digits=qs.num_digits)
    elif need_data:
        write_synthetic_dataset(
            os.path.join(assets_dir, "data"), task=qs.task, num_digits=qs.num_digits, seed=config.trainer.seed
        )


def _build_shapes(config: PPOConfig, assets_dir: str, need_model: bool, need_data: bool) -> None:
    """A tiny random Qwen2.5-VL with a word tokenizer of the shapes task's words, and its data."""
    from verl_megatron.data.shapes_task import WORDS, write_shapes_dataset
    from verl_megatron.utils.local_vl_assets import build_tiny_qwen2_5_vl
    from verl_megatron.utils.vl_word_tokenizer import build_vl_word_tokenizer

    qs = config.quickstart
    if need_model:
        model_dir = os.path.join(assets_dir, "model")
        tokenizer = build_vl_word_tokenizer(os.path.join(assets_dir, "tokenizer"), WORDS)
        text = dict(
            hidden_size=qs.hidden_size, num_hidden_layers=qs.num_layers, num_attention_heads=qs.num_heads,
            num_key_value_heads=qs.num_kv_heads, intermediate_size=qs.intermediate_size,
        )  # fmt: skip
        build_tiny_qwen2_5_vl(model_dir, seed=config.trainer.seed, text=text, tokenizer=tokenizer)
    if need_data:
        write_shapes_dataset(os.path.join(assets_dir, "data"), seed=config.trainer.seed)


def _agent_chat(task: str) -> dict:
    """The lookup task's tokenizer also knows the tool tokens and renders tool calls."""
    if task != "lookup":
        return {}
    from verl_megatron.data.lookup_task import AGENT_CHAT_TEMPLATE, TOOL_TOKENS

    return {"extra_tokens": TOOL_TOKENS, "chat_template": AGENT_CHAT_TEMPLATE}


def prepare_quickstart_assets(config: PPOConfig, rank: int) -> PPOConfig:
    """Build the missing tokenizer/model/data (on rank 0) and return the config pointing at them."""
    qs = config.quickstart
    need_model, need_data = not config.model.path, not config.data.train_files
    if not qs.enable or not (need_model or need_data):
        return config
    assets_dir = qs.assets_dir or os.path.join(config.trainer.default_local_dir, "assets")
    if rank == 0:
        _build(config, assets_dir, need_model, need_data)
    if dist.is_initialized():
        dist.barrier()
    model = config.model
    if need_model:
        model = dataclasses.replace(model, path=os.path.join(assets_dir, "model"))
    data = config.data
    if need_data:
        data_dir = os.path.join(assets_dir, "data")
        data = dataclasses.replace(
            data,
            train_files=[os.path.join(data_dir, "train.parquet")],
            val_files=[os.path.join(data_dir, "val.parquet")],
        )
    return dataclasses.replace(config, model=model, data=data)
