"""Multi-turn rollouts with a scripted environment on a tiny model with a character tokenizer.

The policy's turns end on any letter (stop tokens), the environment answers "#1#", "#2#" and
ends the conversation at its third call. The final log-probs of every policy token must equal a
full forward over the whole conversation, which holds only if each turn was generated with the
earlier environment replies in its context.
"""

from __future__ import annotations

import string

import numpy as np
import pytest
import torch

from verl_megatron.rollout.multiturn import ENV_FAILURES, Conversation, EnvironmentReply, truncate_reply

BUDGET = 24
PROMPTS = ["12+3=", "7*8=?", "9"]


@pytest.fixture(scope="module")
def assets(tmp_path_factory) -> str:
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    path = tmp_path_factory.mktemp("multiturn_llama")
    tokenizer = build_char_tokenizer(path)
    build_tiny_hf_model(path, "llama", hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                        intermediate_size=128, seed=5, initializer_range=0.3, tokenizer=tokenizer)  # fmt: skip
    return str(path)


class ScriptedEnvironment:
    """Replies "#k#" to the k-th policy turn of a conversation; ends it at the third."""

    def __init__(self) -> None:
        self.seen: dict[int, list[str]] = {}

    def __call__(self, conversation: Conversation, text: str) -> EnvironmentReply:
        turns = self.seen.setdefault(conversation.index, [])
        turns.append(text)
        if len(turns) == 3:
            return EnvironmentReply(done=True)
        return EnvironmentReply(text=f"#{len(turns)}#")


def multiturn_job(path: str) -> dict:
    from transformers import AutoTokenizer

    from tests.test_rollout_native import _setup
    from verl_megatron.protocol import DataProto
    from verl_megatron.rollout import RolloutConfig, build_rollout
    from verl_megatron.rollout.config import MultiTurnConfig
    from verl_megatron.rollout.multiturn import MultiTurnRollout
    from verl_megatron.trainer.metrics import multi_turn_metrics

    tokenizer = AutoTokenizer.from_pretrained(path)
    runtime, chunks, hf_config = _setup(path)
    letters = [tokenizer.convert_tokens_to_ids(c) for c in string.ascii_letters]
    multi_turn = MultiTurnConfig(isolation="none")  # in this process: the test reads what it saw
    config = RolloutConfig(n=2, response_length=BUDGET, seed=3, stop_token_ids=letters, multi_turn=multi_turn)
    environment = ScriptedEnvironment()
    rollout = MultiTurnRollout(
        build_rollout(config, runtime, chunks, tokenizer, hf_config), config, tokenizer, environment
    )
    encoded = [tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    width = max(len(e) for e in encoded)
    ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(e)) + e for e in encoded])
    mask = torch.tensor([[0] * (width - len(e)) + [1] * len(e) for e in encoded])
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": mask},
        non_tensors={"uid": np.array(["a", "b", "c"], dtype=object)},
    )
    out = rollout.generate_sequences(prompts)
    # Full forward over each final conversation: log-probs of every response token.
    recomputed = torch.zeros(len(out), BUDGET)
    chunk = chunks[0].eval()
    with torch.no_grad():
        for row in range(len(out)):
            tokens = out.batch["input_ids"][row][out.batch["attention_mask"][row].bool()]
            logits = chunk(tokens[None], torch.arange(len(tokens))[None], None, runtime_gather_output=True)
            log_probs = torch.log_softmax(logits[0, :, : hf_config.vocab_size].float(), dim=-1)
            prompt_len = int(mask[row // 2].sum())
            length = len(tokens) - prompt_len
            recomputed[row, :length] = (
                log_probs[prompt_len - 1 : -1].gather(-1, tokens[prompt_len:, None]).squeeze(-1)
            )
    keys = ["responses", "response_mask", "attention_mask", "rollout_log_probs", "prompts"]
    columns = ("multi_turn_turns", "multi_turn_env_turns", "multi_turn_env_seconds", "multi_turn_truncated")
    return {
        **{k: out.batch[k].clone() for k in keys},
        **{k: list(out.non_tensor_batch[k]) for k in columns},
        "step_metrics": multi_turn_metrics(out.non_tensor_batch),
        "uid": list(out.non_tensor_batch["uid"]),
        "recomputed": recomputed,
        "seen": environment.seen,
        "letters": letters,
        "replies": {k: tokenizer.encode(f"#{k}#", add_special_tokens=False) for k in (1, 2)},
    }


def _segments(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) runs of a 0/1 list."""
    runs, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            runs.append((mask[start], start, i))
            start = i
    return runs


def test_multiturn_conversation_masks_and_log_probs(pool1, assets):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(assets)
    out = pool1.run(f"{__name__}:multiturn_job", path=assets)[0]
    width = out["prompts"].shape[1]
    assert out["uid"] == ["a", "a", "b", "b", "c", "c"]
    env_turns_seen = 0
    for row in range(6):
        length = int(out["attention_mask"][row, width:].sum())
        tokens = out["responses"][row, :length].tolist()
        runs = _segments(out["response_mask"][row, :length].tolist())
        policy = [tokens[s:e] for v, s, e in runs if v == 1]
        env = [tokens[s:e] for v, s, e in runs if v == 0]
        # Turns alternate, policy first; the environment replied "#k#" to the k-th policy turn.
        assert [v for v, _, _ in runs] == [1, 0] * len(env) + [1] * (len(policy) - len(env))
        assert env == [out["replies"][k + 1] for k in range(len(env))]
        env_turns_seen += len(env)
        # Every policy turn but possibly a budget-cut last one ends with a stop token (a letter).
        for turn in policy[:-1]:
            assert turn[-1] in out["letters"]
        # A conversation ends when the environment says so (at its third call) or the budget is spent.
        seen = out["seen"][row]
        ended_by_env = len(seen) == 3
        assert ended_by_env or length == BUDGET
        assert len(seen) == len(env) + ended_by_env and len(policy) == len(env) + 1
        # The per-sample metric columns: turns, environment turns and time, why it was cut.
        assert (out["multi_turn_turns"][row], out["multi_turn_env_turns"][row]) == (len(policy), len(env))
        assert out["multi_turn_truncated"][row] == ("" if ended_by_env else "token_budget")
        assert (out["multi_turn_env_seconds"][row] > 0) == bool(seen)  # time only if it was called
        # The environment saw the text of each policy turn it answered.
        assert seen == [tokenizer.decode(turn, skip_special_tokens=True) for turn in policy[: len(seen)]]
        # Padding past the conversation: masks 0, log-probs 0.
        assert (
            out["response_mask"][row, length:].sum() == 0
            and out["attention_mask"][row, width + length :].sum() == 0
        )
    assert env_turns_seen >= 4  # the scripted environment took part in most conversations
    assert out["step_metrics"] == {
        "multi_turn/turns_count": float(sum(out["multi_turn_turns"])),
        "multi_turn/env_turns_count": float(env_turns_seen),
        "multi_turn/env_seconds_count": float(sum(out["multi_turn_env_seconds"])),
        "multi_turn/truncated_count": float(sum(t != "" for t in out["multi_turn_truncated"])),
        **{f"multi_turn/{cause}_count": 0.0 for cause in ENV_FAILURES},
    }, out["step_metrics"]
    # Policy tokens: log-probs of a full forward over the final conversation; environment tokens: 0.
    policy_mask = out["response_mask"].bool()
    torch.testing.assert_close(
        out["rollout_log_probs"][policy_mask], out["recomputed"][policy_mask], rtol=0, atol=1e-4
    )
    assert out["rollout_log_probs"][~policy_mask].abs().sum() == 0


def test_truncate_reply_sides():
    tokens = list(range(7))
    assert truncate_reply(tokens, 4, "left") == [3, 4, 5, 6]
    assert truncate_reply(tokens, 4, "right") == [0, 1, 2, 3]
    assert truncate_reply(tokens, 4, "middle") == [0, 1, 5, 6]
    assert truncate_reply(tokens, 3, "middle") == [0, 1, 6]
    assert truncate_reply(tokens, 9, "middle") == tokens
    with pytest.raises(ValueError, match="side must be"):
        truncate_reply(tokens, 3, "top")
