"""Custom and verifiers harnesses are contained by default (reward/agents/contained.py).

Through ``build_harness`` a custom harness (``file.py:make``) runs each trajectory's ``run`` in a
worker process of its own, talking to the trainer's endpoint over HTTP: a conversation there
gives the same tokens, rewards and mask as in-process (``isolation: none``), and its endpoint
time is the client's, not the environment's; ``os._exit`` is ``error`` (the exit code in the
warning), a hang ``timeout`` at the batch's deadline, garbage ``invalid``, a raised TimeoutError
``timeout``. No episode runs in the trainer's pid and no worker outlives the rollout.
"""

from __future__ import annotations

import json
import os
import time

import psutil
import pytest

from tests.test_agent_endpoint import ScriptedEngine, _config, _ids, _prompts, char_tokenizer  # noqa: F401
from verl_megatron.errors import ConfigError
from verl_megatron.rollout.agent import AgentRollout
from verl_megatron.rollout.config import AgentConfig

HARNESS = """
import json, os, time
from verl_megatron.rollout.agent import AgentOutcome

class Agent:
    def __init__(self, log):
        self.log = log

    def run(self, task, client):
        kind = task.messages[0]["content"]
        with open(self.log, "a") as f:
            f.write(json.dumps([task.trajectory_id, os.getpid()]) + "\\n")
        reply = client.chat(list(task.messages))
        if kind == "2":
            os._exit(3)
        if kind == "3":
            time.sleep(3600)
        if kind == "4":
            return "not an outcome"
        if kind == "5":
            raise TimeoutError("the environment's own limit")
        messages = [*task.messages, reply["choices"][0]["message"], {"role": "user", "content": "1"}]
        client.chat(messages)
        return AgentOutcome(reward=0.5, turn_rewards=[0.25, 0.75], info={"pid": os.getpid()})

def make(log):
    return Agent(log)
"""
# Long enough that the env's own time (the worker's start on a loaded machine included: 0.53 s
# was seen under a full suite) stays well under the two calls that must not count as env time.
SECONDS_PER_CALL = 0.6


class SlowEngine(ScriptedEngine):
    """Each engine call takes SECONDS_PER_CALL: time the clients wait on the endpoint."""

    def generate_sequences(self, prompts):
        time.sleep(SECONDS_PER_CALL)
        return super().generate_sequences(prompts)


def _build(tmp_path, log, **kwargs):
    from verl_megatron.reward.agents import build_harness

    path = tmp_path / "my_agent.py"
    path.write_text(HARNESS)
    return build_harness(AgentConfig(enable=True, harness=f"{path}:make", kwargs={"log": str(log), **kwargs}))


def _rollout(harness, tok, contents, deadline_s):
    engine = SlowEngine(lambda p: [*_ids(tok, "5"), tok.eos_token_id], [tok.eos_token_id])
    rollout = AgentRollout(
        engine, _config(deadline_s=deadline_s, failure_score=-1.0), tok, harness, [tok.eos_token_id]
    )
    rollout.wake_up()
    try:
        start = time.monotonic()
        out = rollout.generate_sequences(_prompts(tok, contents))
        return out, time.monotonic() - start
    finally:
        rollout.sleep()


def test_custom_harness_runs_each_trajectory_in_a_worker_process(char_tokenizer, tmp_path):  # noqa: F811
    from verl_megatron.reward.agents.contained import ContainedHarness

    tok, log = char_tokenizer, tmp_path / "pids.jsonl"
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    harness = _build(tmp_path, log)
    assert isinstance(harness, ContainedHarness)
    with pytest.warns(UserWarning, match=r"harness's worker process died in run\(\) \(exit code 3\)"):
        out, elapsed = _rollout(harness, tok, ["1", "2", "3", "4", "5"], deadline_s=3.0)
    cols = out.non_tensor_batch
    failures = list(cols["agent_failure"])
    assert failures == ["", "error", "timeout", "invalid", "timeout"], failures
    assert list(cols["agent_reward"]) == [0.5, -1.0, -1.0, -1.0, -1.0]
    assert list(cols["agent_turns"]) == [2, 1, 1, 1, 1]
    assert 3.0 <= elapsed < 60.0, elapsed  # the hang ended at the deadline (3 s), not after 3600 s
    # Two engine calls of SECONDS_PER_CALL were the client's time (counted by the worker's copy).
    assert 0.0 <= cols["agent_env_seconds"][0] < 2 * SECONDS_PER_CALL - 0.05, cols["agent_env_seconds"]
    mask = out.batch["response_mask"].sum(-1).tolist()
    assert mask[0] > 0 and mask[1:] == [0] * 4, mask

    trusted = _build(tmp_path, log, isolation="none")  # the factory never sees ``isolation``
    assert not isinstance(trusted, ContainedHarness)
    same, _ = _rollout(trusted, tok, ["1"], deadline_s=30.0)
    for key in ("responses", "response_mask", "input_ids", "rollout_log_probs"):
        diff = (out.batch[key][:1].double() - same.batch[key].double()).abs().max().item()
        assert diff == 0.0, f"{key}: max |contained - in-process| = {diff}"
    for key in ("agent_reward", "agent_turn_rewards", "agent_turn_ends", "agent_turns"):
        assert list(out.non_tensor_batch[key][:1]) == list(same.non_tensor_batch[key]), key

    with open(log) as f:
        runs = [json.loads(line) for line in f]
    workers = {pid for tid, pid in runs[:5]}
    assert len(runs) == 6 and runs[5][1] == os.getpid(), runs  # only the isolation: none run was here
    assert len(workers) == 5 and os.getpid() not in workers, runs
    until = time.monotonic() + 10.0  # the hung one is killed by its thread at the deadline
    while [p for p in workers if psutil.pid_exists(p)] and time.monotonic() < until:
        time.sleep(0.02)
    assert not [p for p in workers if psutil.pid_exists(p)], workers
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


def test_isolation_key_is_checked(tmp_path):
    with pytest.raises(
        ConfigError,
        match=r"rollout\.agent\.kwargs\.isolation must be one of \('process', 'none'\), got 'thread'",
    ):
        _build(tmp_path, tmp_path / "log", isolation="thread")
