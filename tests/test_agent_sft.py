"""The agent quickstart's SFT transcripts (data/agent_sft.py) are the tokens the agent rollout makes.

An SFT row of the lookup task, tokenized by the SFT dataset, is replayed through the real
endpoint and tool harness (the lookup tool run in the sandbox) by an engine that samples
exactly the row's assistant turns: the rollout's ids equal the SFT row's ids, its trained mask
(``response_mask``) equals the SFT loss mask, and the harness scores the conversation 1.0. So
SFT trains the same ids GRPO later samples, and the tool's reply is masked out in both.
"""

from __future__ import annotations

import numpy as np
import torch

from tests.test_agent_endpoint import ScriptedEngine
from verl_megatron.data.config import DataConfig
from verl_megatron.data.sft_config import SFTConfig
from verl_megatron.protocol import DataProto
from verl_megatron.rollout.agent import AgentRollout
from verl_megatron.rollout.config import AgentConfig, RolloutConfig


def _segments(ids: list[int], mask: list[int]) -> list[list[int]]:
    """The runs of trained (mask 1) ids, in order: one per assistant turn."""
    runs: list[list[int]] = []
    for k, (token, trained) in enumerate(zip(ids, mask)):
        if trained:
            if k == 0 or not mask[k - 1]:
                runs.append([])
            runs[-1].append(token)
    return runs


def test_sft_transcripts_are_the_ids_the_agent_rollout_trains_on(tmp_path):
    from verl_megatron.data.agent_sft import lookup_sft_rows
    from verl_megatron.data.lookup_task import AGENT_CHAT_TEMPLATE, TOOL_TOKENS, lookup_value
    from verl_megatron.data.sft_dataset import SFTDataset
    from verl_megatron.data.synthetic import write_parquet
    from verl_megatron.reward.agents.tools import ToolHarness
    from verl_megatron.utils.local_assets import build_char_tokenizer

    tok = build_char_tokenizer(
        tmp_path / "tok", alphabet="0123456789", extra_tokens=TOOL_TOKENS, chat_template=AGENT_CHAT_TEMPLATE
    )
    key = "37"
    rl_row = {
        "data_source": "agent/lookup",
        "prompt": [{"role": "user", "content": key}],
        "reward_model": {"style": "rule", "ground_truth": lookup_value(key, 0, 2)},
        "extra_info": {"key": key},
    }
    (sft_row,) = lookup_sft_rows([rl_row])
    write_parquet([sft_row], str(tmp_path / "sft.parquet"))
    (item,) = SFTDataset([str(tmp_path / "sft.parquet")], tok, SFTConfig(max_length=24), DataConfig()).items
    call, answer = _segments(item.input_ids, item.loss_mask)
    assert tok.decode(call) == f"<tool_call>{key}</tool_call><|endoftext|>", tok.decode(call)

    eos, tool_marker = tok.eos_token_id, tok.convert_tokens_to_ids("<|tool|>")
    engine = ScriptedEngine(lambda prompt: answer if tool_marker in prompt else call, [eos])
    agent = AgentConfig(enable=True, harness="tools", max_turns=3, deadline_s=60.0, tool_call_format="bare")
    lookup = {"function": "verl_megatron.data.lookup_task:lookup_value", "parameters": ["key"]}
    harness = ToolHarness(
        agent, {"lookup": {**lookup, "kwargs": {"seed": 0, "num_digits": 2}}},
        "verl_megatron.reward.agents.tools:lookup_score", sampling={"max_tokens": 6},
    )  # fmt: skip
    config = RolloutConfig(n=1, prompt_length=8, response_length=16, agent=agent)
    prompt = tok.encode(tok.apply_chat_template(rl_row["prompt"], add_generation_prompt=True, tokenize=False))
    width = config.prompt_length
    columns = {"raw_prompt": rl_row["prompt"], "reward_model": rl_row["reward_model"]}
    columns["extra_info"] = rl_row["extra_info"]
    non_tensors = {k: np.empty(1, dtype=object) for k in columns}
    for k, v in columns.items():
        non_tensors[k][0] = v
    batch = DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0] * (width - len(prompt)) + prompt]),
            "attention_mask": torch.tensor([[0] * (width - len(prompt)) + [1] * len(prompt)]),
        },
        non_tensors=non_tensors,
    )
    out = AgentRollout(engine, config, tok, harness, [eos]).generate_sequences(batch)

    cols = out.non_tensor_batch
    assert cols["agent_failure"][0] == "" and cols["agent_tool_calls"][0] == 1, dict(cols)
    assert cols["agent_reward"][0] + sum(cols["agent_turn_rewards"][0]) == 1.0, dict(cols)
    n = len(item.input_ids) - len(prompt)
    rollout_ids = prompt + out.batch["responses"][0, :n].tolist()
    assert rollout_ids == item.input_ids, (tok.decode(rollout_ids), tok.decode(item.input_ids))
    assert out.batch["response_mask"][0, :n].tolist() == item.loss_mask[len(prompt) :]
    assert item.loss_mask[: len(prompt)] == [0] * len(prompt) and not out.batch["response_mask"][0, n:].any()
