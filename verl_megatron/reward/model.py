"""A discriminative reward model on megatron: an HF ``*ForSequenceClassification`` checkpoint.

The model is megatron's GPT with the critic's one-output head (``builder.ValueHead``) filled
from the checkpoint's ``score.weight`` (the bias stays 0: Hugging Face's reward heads have
none). Like transformers, the reward is the head's output at each sequence's last token that
is not the pad token (``config.pad_token_id``; none: the last token).

What is scored: the prompt and the response, either the actor's token ids as they are
(``reward_model.model.input_tokenizer`` null) or re-templated: the response decoded with the
input tokenizer, appended to the chat (``raw_prompt``) as the assistant's turn and written
with the reward model's own tokenizer and chat template. ``max_length`` truncates.

It runs with its own tp/pp (``reward_model.parallel``) through a
:class:`~verl_megatron.distributed.parallel_state_slot.ParallelStateSlot` when that layout
differs from the actor's. Every rank passes the same batch and gets every score back.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from verl_megatron.distributed.parallel import Runtime
from verl_megatron.errors import UserInputError
from verl_megatron.protocol import DataProto
from verl_megatron.reward.model_config import ModelRewardSettings
from verl_megatron.workers.batching import MicroBatch
from verl_megatron.workers.model_runner import ModelRunner, StepResult, dp_share

__all__ = [
    "MegatronRewardModel",
    "RewardModelCheckpointError",
    "check_reward_checkpoint",
    "conversation_ids",
    "score_positions",
]


class RewardModelCheckpointError(UserInputError):
    """``reward_model.model.path`` is not a usable sequence-classification checkpoint."""


def check_reward_checkpoint(path: str, key: str = "reward_model.model.path") -> None:
    """config.json names a ``*ForSequenceClassification`` with one label and the weights hold
    ``score.weight``; raises RewardModelCheckpointError naming the key and the folder."""
    from verl_megatron.models.convert import SafetensorsCheckpoint

    where = f"{key}='{path}'"
    if not path:
        raise RewardModelCheckpointError(
            f"{key} is not set (reward_model.enable=true needs a checkpoint folder)"
        )
    full = os.path.expanduser(path)
    if not os.path.isdir(full):
        raise RewardModelCheckpointError(f"{where} does not exist")
    config_file = os.path.join(full, "config.json")
    if not os.path.isfile(config_file):
        raise RewardModelCheckpointError(f"{where} has no config.json")
    with open(config_file) as f:
        hf = json.load(f)
    archs = hf.get("architectures") or []
    if not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise RewardModelCheckpointError(
            f"{where} is not a sequence-classification checkpoint (architectures {archs}); "
            "a reward model is a *ForSequenceClassification with one label"
        )
    labels = len(hf["id2label"]) if isinstance(hf.get("id2label"), dict) else hf.get("num_labels", 2)
    if labels != 1:
        raise RewardModelCheckpointError(
            f"{where} has {labels} labels; a reward model has one (num_labels: 1)"
        )
    try:
        with SafetensorsCheckpoint(full) as ckpt:
            has_head = "score.weight" in ckpt
    except FileNotFoundError as err:
        raise RewardModelCheckpointError(f"{where}: {err}") from None
    if not has_head:
        raise RewardModelCheckpointError(f"{where}: the weights have no 'score.weight' (the reward head)")


# ------------------------------------------------------------------ inputs (pure)


def _truncate(ids: list[int], max_length: int | None, mode: str, row: int) -> list[int]:
    if max_length is None or len(ids) <= max_length:
        return ids
    if mode == "error":
        raise ValueError(
            f"reward model input of row {row} has {len(ids)} tokens > reward_model.max_length={max_length} "
            "(reward_model.truncation=error)"
        )
    return ids[-max_length:] if mode == "left" else ids[:max_length]


def score_positions(ids: Sequence[int], pad_token_id: int | None) -> int:
    """How many leading tokens matter: up to the last one that is not ``pad_token_id``.

    transformers reads a sequence-classification score at the rightmost non-pad token (at
    index 0 when every token is the pad token; the last token when there is no pad token);
    tokens after it cannot change it under the causal mask.
    """
    if pad_token_id is None:
        return len(ids)
    for i in range(len(ids) - 1, -1, -1):
        if ids[i] != pad_token_id:
            return i + 1
    return 1


def _valid_ids(row_ids: torch.Tensor, row_mask: torch.Tensor) -> list[int]:
    return row_ids[row_mask.bool()].tolist()


def conversation_ids(
    data: DataProto,
    rm_tokenizer: Any,
    input_tokenizer: Any | None,
    max_length: int | None = None,
    truncation: str = "left",
) -> list[list[int]]:
    """The reward model's token ids of each row's prompt + response.

    ``input_tokenizer`` None: the actor's ids (``input_ids`` where ``attention_mask`` is 1).
    Otherwise the response is decoded with it (special tokens dropped) and the chat
    ``raw_prompt`` + the assistant's response is written with ``rm_tokenizer``'s chat template.
    """
    tensors = data.batch
    if input_tokenizer is None:
        ids, mask = tensors["input_ids"], tensors["attention_mask"]
        rows = [_valid_ids(ids[i], mask[i]) for i in range(ids.shape[0])]
    else:
        if "raw_prompt" not in data.non_tensor_batch:
            raise KeyError(
                "reward_model.model.input_tokenizer re-templates the chat, which needs raw_prompt in "
                "the batch: set data.return_raw_chat=true"
            )
        responses = tensors["responses"]
        width = responses.shape[1]
        mask = tensors["attention_mask"][:, -width:]
        rows = []
        for i in range(responses.shape[0]):
            text = input_tokenizer.decode(_valid_ids(responses[i], mask[i]), skip_special_tokens=True)
            chat = [dict(m) for m in data.non_tensor_batch["raw_prompt"][i]]
            chat.append({"role": "assistant", "content": text})
            rendered = rm_tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=False)
            rows.append(list(rm_tokenizer(rendered, add_special_tokens=False)["input_ids"]))
    return [_truncate(r, max_length, truncation, i) for i, r in enumerate(rows)]


def _model_batch(sequences: list[list[int]], pad_token_id: int | None) -> dict[str, torch.Tensor]:
    """Left-padded rows ending in one placeholder "response" column.

    The model runner reads outputs at the position before each response token, so the
    placeholder makes it read the output at each sequence's scored (last) token; the
    placeholder's own position is computed and ignored (it cannot affect earlier positions).
    """
    kept = [seq[: score_positions(seq, pad_token_id)] for seq in sequences]
    if any(len(seq) == 0 for seq in kept):
        raise ValueError(f"reward model: row {[len(s) for s in kept].index(0)} has no tokens to score")
    width = max(len(seq) for seq in kept) + 1
    input_ids = torch.zeros((len(kept), width), dtype=torch.long)
    attention_mask = torch.zeros((len(kept), width), dtype=torch.long)
    for i, seq in enumerate(kept):
        input_ids[i, width - 1 - len(seq) : width - 1] = torch.tensor(seq, dtype=torch.long)
        attention_mask[i, width - 1 - len(seq) :] = 1
    placeholder = torch.zeros((len(kept), 1), dtype=torch.long)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "responses": placeholder,
        "response_mask": torch.ones_like(placeholder),
    }


# ------------------------------------------------------------------ the worker


class MegatronRewardModel:
    """Scores [B] of a batch; built on every rank with the same settings (collective)."""

    def __init__(self, runtime: Runtime, config: ModelRewardSettings) -> None:
        from verl_megatron.distributed.parallel_state_slot import ParallelStateSlot
        from verl_megatron.models.builder import build_gpt_chunks
        from verl_megatron.models.config import load_hf_config
        from verl_megatron.models.convert import load_hf_weights
        from verl_megatron.utils.tokenizer import hf_tokenizer

        check_reward_checkpoint(config.model.path)
        self.config = config
        layout = config.parallel.resolve(runtime.world_size)
        same = layout == runtime.layout
        self.slot = None if same else ParallelStateSlot(layout, runtime)
        self._runtime = runtime
        self.hf_config = load_hf_config(config.model.path)
        self.pad_token_id = getattr(self.hf_config, "pad_token_id", None)
        with self.scope() as rt:
            config.model.validate(rt.layout)
            chunks = build_gpt_chunks(self.hf_config, rt, config.model, value_head=True)
            load_hf_weights(chunks, config.model.path, rt, config.model)
            for chunk in chunks:
                chunk.requires_grad_(False)
            self.runner = ModelRunner(
                rt, chunks, use_remove_padding=config.use_remove_padding, merges_cp=True
            )
        self.chunks = chunks
        self.tokenizer = hf_tokenizer(config.model.path)
        path = config.model.input_tokenizer
        self.input_tokenizer = hf_tokenizer(path) if path else None

    @contextlib.contextmanager
    def scope(self) -> Iterator[Runtime]:
        """The reward model's parallel state (its own slot, or the actor's when the layouts agree)."""
        if self.slot is None:
            yield self._runtime
            return
        with self.slot.active() as rt:
            yield rt

    @staticmethod
    def _score_step(mb: MicroBatch, output: torch.Tensor) -> StepResult:
        if output.shape[-1] != 1:
            raise ValueError(
                f"the reward model must output one value per position, got {tuple(output.shape)}"
            )
        return StepResult(outputs={"score": mb.inputs.merge_cp(mb.inputs.gather(output)[..., 0].float())})

    def score_sequences(self, sequences: list[list[int]]) -> torch.Tensor:
        """Scores [B] float32 of token-id sequences (the reward model's vocabulary), on every rank."""
        cfg = self.config
        batch = _model_batch(sequences, self.pad_token_id)
        size = len(sequences)
        with self.scope() as rt:
            rows = dp_share(size, rt.layout.dp, rt.dp_rank)
            mbs = self.runner.split(
                {k: v[rows] for k, v in batch.items()},
                micro_batch_size=cfg.micro_batch_size_per_gpu,
                use_dynamic_bsz=cfg.use_dynamic_bsz,
                max_token_len=cfg.forward_max_token_len_per_gpu,
                tensor_keys=("response_mask",),
            )
            with torch.no_grad():
                results = self.runner.run(mbs, self._score_step, forward_only=True)
            local = self.runner.collect_outputs(results, mbs, "score", (len(rows), 1))
            return self.runner.gather_dp(local, size)[:, 0]

    def compute_rm_score(self, data: DataProto) -> torch.Tensor:
        """Scores [B] float32 of the batch's conversations (verl's ``compute_rm_score``, one per row)."""
        cfg = self.config
        sequences = conversation_ids(
            data, self.tokenizer, self.input_tokenizer, cfg.max_length, cfg.truncation
        )
        return self.score_sequences(sequences)

    def close(self) -> None:
        """Destroy the reward model's own process groups."""
        if self.slot is not None:
            self.slot.close()
