"""Model-based rewards in the trainer: the reward model and the judge, combined with the rule reward.

:class:`ModelRewards` runs on every rank after the rule reward (computed on rank 0 and
broadcast): the reward model scores every row (a collective forward), the judge answers
(the native engine on every rank; an external server from rank 0, its verdicts broadcast),
and ``reward_model.combine`` turns ``rule``, ``rm`` and ``judge`` into one score per response,
placed at its last valid token. Per-sample ``rm_score`` / ``judge_score`` go to the extra info
(so to ``non_tensor_batch``), and judge failures to ``reward/judge/<cause>_count``.

:func:`check_model_rewards` (``reward/model_rewards_check.py``) is the start-up check.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from verl_megatron.protocol import DataProto
from verl_megatron.reward.combine import compile_formula, place_at_last_token
from verl_megatron.reward.judge import CAUSES, RewardJudge
from verl_megatron.reward.model_rewards_check import formula_text

__all__ = ["ModelRewards", "build_model_rewards", "judge_count_key"]


def judge_count_key(cause: str) -> str:
    return f"reward/judge/{cause}_count"


class ModelRewards:
    """The reward model and judge of a run; :meth:`apply` turns a rule reward into the final one."""

    def __init__(
        self, section: Any, runtime: Any, tokenizer: Any, reward_model: Any = None, judge: Any = None
    ) -> None:
        self.section = section
        self.runtime = runtime
        self.tokenizer = tokenizer
        self.formula = compile_formula(formula_text(section))
        self.reward_model = reward_model
        if judge is None and section.judge.enable:
            judge = RewardJudge(section.judge, tokenizer)
        self.judge = judge

    @property
    def uses_rule(self) -> bool:
        """Whether the formula reads the rule reward (else the reward manager need not run)."""
        return "rule" in self.formula.names

    def bind_generate(self, generate: Callable[[DataProto], DataProto]) -> None:
        """The trainer's generate function, for the native judge of the actor (a separate judge
        model keeps its own)."""
        if self.judge is not None and self.judge.generate is None:
            self.judge.generate = generate

    def apply(
        self, batch: DataProto, rule: tuple[torch.Tensor, dict[str, list[Any]]] | None
    ) -> tuple[torch.Tensor, dict[str, list[Any]]]:
        """(reward [B, Tr], extra info) from the rule result (None when the formula has no ``rule``)."""
        response_mask = _response_mask(batch)
        extra: dict[str, list[Any]] = dict(rule[1]) if rule is not None else {}
        values: dict[str, torch.Tensor] = {}
        if rule is not None:
            values["rule"] = rule[0].sum(-1)
        if self.reward_model is not None:
            scores = self.reward_model.compute_rm_score(batch)
            values["rm"] = scores
            extra["rm_score"] = [float(s) for s in scores]
        if self.judge is not None:
            verdicts = self._judge(batch)
            values["judge"] = torch.tensor([v.score for v in verdicts], dtype=torch.float64)
            extra["judge_score"] = [v.score for v in verdicts]
            for cause in CAUSES:
                extra[judge_count_key(cause)] = [int(v.cause == cause) for v in verdicts]
        combined = self.formula(**{k: v for k, v in values.items() if k in self.formula.names})
        combined = combined.expand(len(batch)) if combined.dim() == 0 else combined
        return place_at_last_token(combined, response_mask), extra

    def _judge(self, batch: DataProto) -> list[Any]:
        messages = judge_messages(batch, self.tokenizer, self.section.judge.prompt_template)
        if self.section.judge.backend == "native" or self.runtime is None or self.runtime.world_size == 1:
            return self.judge.judge(messages)
        # One rank asks the server; every rank gets the same verdicts.
        payload: list[Any] = [self.judge.judge(messages) if self.runtime.is_main else None]
        dist.broadcast_object_list(payload, src=0)
        return payload[0]

    def close(self) -> None:
        if self.reward_model is not None:
            self.reward_model.close()


def _response_mask(batch: DataProto) -> torch.Tensor:
    if "response_mask" in batch.batch.keys():  # noqa: SIM118 (TensorDict has no __contains__)
        return batch.batch["response_mask"]
    width = batch.batch["responses"].shape[1]
    return batch.batch["attention_mask"][:, -width:]


def judge_messages(batch: DataProto, tokenizer: Any, template: str) -> list[str]:
    """The judge's user message of each row: the question (the last user turn of ``raw_prompt``,
    else the decoded prompt), the decoded response and the ground truth, in ``template``."""
    from verl_megatron.reward.judge import render_prompt

    tensors, non_tensors = batch.batch, batch.non_tensor_batch
    responses = tensors["responses"]
    width = responses.shape[1]
    mask = tensors["attention_mask"]
    messages = []
    for i in range(responses.shape[0]):
        response = tokenizer.decode(responses[i][mask[i, -width:].bool()].tolist(), skip_special_tokens=True)
        if "raw_prompt" in non_tensors:
            turns = [m for m in non_tensors["raw_prompt"][i] if m.get("role") == "user"]
            prompt = str(turns[-1]["content"]) if turns else ""
        else:
            prompt_ids = tensors["input_ids"][i, :-width][mask[i, :-width].bool()]
            prompt = tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        info = non_tensors["reward_model"][i] if "reward_model" in non_tensors else None
        truth = info.get("ground_truth", "") if isinstance(info, dict) else ""
        messages.append(render_prompt(template, prompt, response, truth))
    return messages


def build_model_rewards(config: Any, runtime: Any, tokenizer: Any) -> ModelRewards | None:
    """ModelRewards when the reward model or the judge is enabled (collective: builds the model)."""
    section = config.reward_model
    if not section.enable and not section.judge.enable:
        return None
    reward_model = None
    if section.enable:
        from verl_megatron.reward.model import MegatronRewardModel

        reward_model = MegatronRewardModel(runtime, section)
    judge = None
    if section.judge.enable and section.judge.backend == "native" and section.judge.model_path:
        from verl_megatron.reward.judge_model import build_judge_model

        generate, judge_tokenizer = build_judge_model(config, runtime)
        judge = RewardJudge(section.judge, judge_tokenizer, generate)
    return ModelRewards(section, runtime, tokenizer, reward_model, judge)
