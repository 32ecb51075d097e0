"""Agent rollouts on the rollout rank of ``rollout.placement=separate`` (async training).

In-process: a conversation whose two turns straddle a weight update records both versions,
token by token (scripted engine and versions). Two processes (tests/agent_async_job.py, written
for torchrun, on the ``pool2`` ranks: tests/separate_in_pool.py):
two async GRPO steps of the agent quickstart with the tools harness, the endpoint served by the
rollout rank's engine. The engine's calls are grouped by the harness threads' timing, so the run
is not compared with a colocated one token for token; instead every sample the trainer received
is checked exactly against the replies the harness got: ids, log-probs, mask and per-token
weight version.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.test_agent_endpoint import ScriptedEngine, _config, _ids, _prompts, char_tokenizer  # noqa: F401
from tests.test_async_training import _rows
from verl_megatron.rollout.agent import AgentOutcome, AgentRollout
from verl_megatron.rollout.endpoint import WeightVersions


def test_turns_across_a_weight_update_record_both_versions(char_tokenizer):  # noqa: F811
    """Weights 4 answer turn 1 (a tool call); version 5 arrives before turn 2 (the answer):
    rollout_versions is 4 on the call, -1 on the tool's tokens and padding, 5 on the answer."""
    tok = char_tokenizer
    eos = tok.eos_token_id
    call, answer = [*_ids(tok, "<tool_call>42</tool_call>"), eos], [*_ids(tok, "7"), eos]
    engine = ScriptedEngine(lambda p: answer if tok.convert_tokens_to_ids("<|tool|>") in p else call, [eos])
    loaded = {"version": 4, "refreshes": 0}

    def refresh() -> None:  # version 5 is there from the second engine call on
        loaded["refreshes"] += 1
        loaded["version"] = 4 if not engine.metas else 5

    replied = []

    class TwoTurns:
        def run(self, task, client):
            messages = list(task.messages)
            for content in ("v42", None):
                reply = client.chat(messages, tools=[{"type": "function", "function": {"name": "lookup"}}])
                replied.append(reply["weight_version"])
                messages += [reply["choices"][0]["message"], {"role": "tool", "content": content}]
            return AgentOutcome(reward=1.0)

    versions = WeightVersions(lambda: loaded["version"], refresh)
    out = AgentRollout(engine, _config(), tok, TwoTurns(), [eos], versions).generate_sequences(
        _prompts(tok, ["12"])
    )
    env = [*_ids(tok, "<|tool|>v42"), eos, *_ids(tok, "<|assistant|>")]
    n = len(call) + len(env) + len(answer)
    assert out.batch["responses"][0, :n].tolist() == call + env + answer
    expected = [4] * len(call) + [-1] * len(env) + [5] * len(answer) + [-1] * (24 - n)
    assert out.batch["rollout_versions"][0].tolist() == expected
    assert out.batch["weight_version"].tolist() == [4] and replied == [4, 5] and loaded["refreshes"] == 2
    policy = out.batch["response_mask"][0].bool()
    assert (out.batch["rollout_versions"][0][policy] >= 0).all() and (
        out.batch["rollout_versions"][0][~policy] == -1
    ).all()

    # colocated (no versions): no version columns, no weight_version in the replies
    class OneTurn:
        def run(self, task, client):
            replied.append(client.chat(task.messages))
            return AgentOutcome(reward=0.0)

    plain = AgentRollout(ScriptedEngine(lambda p: answer, [eos]), _config(), tok, OneTurn(), [eos])
    out = plain.generate_sequences(_prompts(tok, ["3"]))
    assert "rollout_versions" not in out.batch.keys() and "weight_version" not in replied[-1]  # noqa: SIM118


# ------------------------------------------------------------------ the torchrun job


@pytest.fixture(scope="module")
def job(tmp_path_factory, pool2) -> str:
    out = str(tmp_path_factory.mktemp("agent_async"))
    pool2.run("tests.separate_in_pool:run_main", timeout_s=600, module="tests.agent_async_job", out=out)
    return out


def _expected(calls: list[dict], width: int) -> tuple[list[int], list[int], list[float], list[int]]:
    """(response ids, mask, log-probs, versions) of one trajectory from its replies, cut to ``width``."""
    root = len(calls[0]["prompt_ids"])
    final = calls[-1]["prompt_ids"] + calls[-1]["token_ids"]
    ids, mask = final[root:], [0] * (len(final) - root)
    log_probs, versions = [0.0] * len(mask), [-1] * len(mask)
    for call in calls:
        begin = len(call["prompt_ids"]) - root
        assert (
            final[: len(call["prompt_ids"]) + len(call["token_ids"])]
            == call["prompt_ids"] + call["token_ids"]
        )
        for k, log_prob in enumerate(call["log_probs"]):
            mask[begin + k], log_probs[begin + k], versions[begin + k] = 1, log_prob, call["version"]
    return ids[:width], mask[:width], log_probs[:width], versions[:width]


def test_async_agent_steps_train_on_the_rollout_ranks_tokens_and_versions(job) -> None:
    calls, outcomes = _rows(os.path.join(job, "calls.jsonl")), _rows(os.path.join(job, "outcomes.jsonl"))
    metrics = {r["step"]: r for r in _rows(os.path.join(job, "run", "metrics.jsonl"))}
    spanning = 0
    for step in (1, 2):
        batch = torch.load(os.path.join(job, f"batch-{step}.pt"))
        width = batch["responses"].shape[1]
        assert batch["agent_failure"] == [""] * 8
        for row in range(8):
            trajectory = f"b{step - 1}-{row}"
            mine = [c for c in calls if c["trajectory"] == trajectory]
            ids, mask, log_probs, versions = _expected(mine, width)
            where = f"step {step} row {row}"
            assert (
                batch["input_ids"][row, -len(mine[0]["prompt_ids"]) - width : -width].tolist()
                == mine[0]["prompt_ids"]
            ), where
            assert batch["responses"][row, : len(ids)].tolist() == ids, where  # the engine's ids
            assert batch["response_mask"][row].tolist() == mask + [0] * (width - len(mask)), where
            policy = torch.tensor(mask, dtype=torch.bool)
            got = batch["rollout_log_probs"][row, : len(mask)][policy]
            assert torch.equal(got, torch.tensor(log_probs, dtype=torch.float32)[policy]), where
            assert batch["rollout_versions"][row].tolist() == versions + [-1] * (width - len(versions)), where
            assert int(batch["weight_version"][row]) == mine[0]["version"], where
            rewards = [o["reward"] for o in outcomes if o["trajectory"] == trajectory]
            assert batch["agent_reward"][row] == pytest.approx(rewards[0]), where
            # step 1: the start weights; step 2: even samples before the update, odd ones after
            assert mine[0]["version"] == (0 if step == 1 or row % 2 == 0 else 1), (where, mine[0]["version"])
            spanning += len({c["version"] for c in mine}) > 1
    assert [metrics[s]["async/staleness_max"] for s in (1, 2)] == [0.0, 1.0]
    assert metrics[2]["async/staleness_mean"] == 0.5  # half the samples one version old
    assert metrics[2]["async/partial_fraction"] == spanning / 8
