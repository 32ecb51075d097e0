"""Agent sample assembly defects found in review (rollout/agent.py, rollout/trajectory.py): a
chain of turns that starts after a rewritten history keeps the first prompt (its policy tokens
were dropped, the reward kept on an empty response), and turn rewards follow the model calls."""

from __future__ import annotations

import contextlib

from tests.test_agent_endpoint import ScriptedEngine, _config, _ids, _prompts, char_tokenizer  # noqa: F401
from verl_megatron.rollout.agent import AgentOutcome, AgentRollout, EndpointError
from verl_megatron.rollout.trajectory import TrajectoryLedger, TurnRecord


def _rewriting_harness(second_user: str, turn_rewards: list[float]):
    """Two calls; the second's history edits the first answer (a context reset)."""

    class Harness:
        def run(self, task, client):
            message = client.chat(task.messages)["choices"][0]["message"]
            edited = dict(message, content=message["content"] + " ")
            client.chat([*task.messages, edited, {"role": "user", "content": second_user}])
            return AgentOutcome(reward=1.0, turn_rewards=turn_rewards)

    return Harness()


def test_a_reset_chain_wider_than_the_prompt_keeps_the_first_prompt(char_tokenizer):  # noqa: F811
    tok = char_tokenizer
    eos = tok.eos_token_id
    engine = ScriptedEngine(lambda p: [*_ids(tok, "ab"), eos], [eos])
    rollout = AgentRollout(engine, _config(), tok, _rewriting_harness("cccccccc", [0.1, 0.2]), [eos])
    prompts = _prompts(tok, ["q"])
    out = rollout.generate_sequences(prompts)
    root = prompts.batch["input_ids"][0][prompts.batch["attention_mask"][0].bool()].tolist()
    history = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "ab "},
        {"role": "user", "content": "cccccccc"},
    ]
    second = _ids(tok, tok.apply_chat_template(history, add_generation_prompt=True, tokenize=False))
    assert len(second) > 16 and second[: len(root)] == root  # wider than the batch's prompts
    env = second[len(root) :]
    expected = [*env, *_ids(tok, "ab"), eos]
    cols = out.non_tensor_batch
    assert (cols["agent_failure"][0], cols["agent_reward"][0], cols["agent_context_resets"][0]) == (
        "",
        1.0,
        1,
    )
    assert out.batch["input_ids"][0, :16][out.batch["attention_mask"][0, :16].bool()].tolist() == root
    assert out.batch["responses"][0, : len(expected)].tolist() == expected
    assert out.batch["response_mask"][0].tolist() == [0] * len(env) + [1] * 3 + [0] * (24 - len(expected))
    # The kept turn is the second call: its reward (0.2), at its last token.
    assert cols["agent_turn_ends"][0] == [len(expected) - 1] and cols["agent_turn_rewards"][0] == [0.2]


def test_a_refused_prompt_with_nothing_generated_is_a_failure(char_tokenizer):  # noqa: F811
    """A harness that catches the prompt_too_long refusal and returns a reward: nothing of the
    policy's to train on, so it scores failure_score (it kept its reward on an empty response)."""
    tok = char_tokenizer
    eos = tok.eos_token_id
    engine = ScriptedEngine(lambda p: [*_ids(tok, "ab"), eos], [eos])

    class Harness:
        def run(self, task, client):
            with contextlib.suppress(EndpointError):
                client.chat([{"role": "user", "content": "2" * 40}])
            return AgentOutcome(reward=1.0)

    rollout = AgentRollout(engine, _config(failure_score=-1.0), tok, Harness(), [eos])
    cols = rollout.generate_sequences(_prompts(tok, ["q"])).non_tensor_batch
    assert (cols["agent_failure"][0], cols["agent_truncated"][0], cols["agent_reward"][0]) == (
        "prompt_too_long",
        "prompt_too_long",
        -1.0,
    )


def test_turn_rewards_follow_the_model_calls_kept(char_tokenizer):  # noqa: F811
    tok = char_tokenizer
    eos = tok.eos_token_id
    engine = ScriptedEngine(lambda p: [*_ids(tok, "ab"), eos], [eos])
    rollout = AgentRollout(engine, _config(), tok, _rewriting_harness("c", [0.1, 0.2]), [eos])
    cols = rollout.generate_sequences(_prompts(tok, ["q"])).non_tensor_batch
    assert cols["agent_context_resets"][0] == 1 and cols["agent_turns"][0] == 1
    assert cols["agent_turn_rewards"][0] == [0.2], cols["agent_turn_rewards"][0]  # was [0.1]
    # The choices of one call share its number.
    ledger = TrajectoryLedger()
    records = [TurnRecord(f"t/{k}", [1, 2], [3 + k], [0.0], "stop") for k in range(3)]
    ledger.add("t", records[0], records[1])
    ledger.add("t", records[2])
    assert [r.call for r in ledger.records("t")] == [0, 0, 1]
