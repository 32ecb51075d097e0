"""An agent rollout whose conversations all wait on slow tools is a bounded wait, not a stall.

While every harness sleeps (a slow tool, an external API) the trainer's thread only polls the
endpoint's queue: no CPU, no stage mark, no change of stack. The rollout calls its ``progress``
(the stall watchdog's ``alive``) about once a second until ``rollout.agent.deadline_s``, so a
wait longer than ``trainer.stall_timeout_s`` but within the deadline no longer ends the job
(before: a stall, exit status 4), and a conversation past the deadline still fails as ``timeout``.
"""

from __future__ import annotations

import itertools
import json
import time

import pytest
import torch.distributed as dist

from tests.helpers import run_forked
from tests.test_agent_endpoint import ScriptedEngine, _config, _ids, _prompts
from verl_megatron.rollout.agent import AgentOutcome, AgentRollout


def _char_tokenizer(path: str):
    from verl_megatron.data.lookup_task import AGENT_CHAT_TEMPLATE, TOOL_TOKENS
    from verl_megatron.utils.local_assets import build_char_tokenizer

    return build_char_tokenizer(path, extra_tokens=TOOL_TOKENS, chat_template=AGENT_CHAT_TEMPLATE)


@pytest.fixture
def char_tokenizer(tmp_path):
    return _char_tokenizer(str(tmp_path / "tok"))


class SlowTool:
    """One model call, then a tool that sleeps the prompt's number of seconds (no CPU)."""

    def run(self, task, client):
        client.chat(task.messages)
        time.sleep(float(task.messages[0]["content"]))
        return AgentOutcome(reward=1.0)


def _rollout(tokenizer, deadline_s: float, progress=None) -> AgentRollout:
    eos = tokenizer.eos_token_id
    engine = ScriptedEngine(lambda p: [*_ids(tokenizer, "5"), eos], [eos])
    config = _config(deadline_s=deadline_s, failure_score=-1.0)
    return AgentRollout(engine, config, tokenizer, SlowTool(), [eos], progress=progress)


def test_progress_is_called_once_a_second_until_the_deadline(char_tokenizer):
    calls: list[float] = []
    rollout = _rollout(char_tokenizer, 3.0, progress=lambda: calls.append(time.monotonic()))
    start = time.monotonic()
    out = rollout.generate_sequences(_prompts(char_tokenizer, ["0", "30"]))
    end = time.monotonic()
    assert list(out.non_tensor_batch["agent_failure"]) == ["", "timeout"]
    assert list(out.non_tensor_batch["agent_reward"]) == [1.0, -1.0]
    # At 0, 1 and 2 s (on a loaded machine the third may miss the deadline), never after it.
    assert 2 <= len(calls) <= 3, [c - start for c in calls]
    assert all(b - a >= 1.0 for a, b in itertools.pairwise(calls)), [c - start for c in calls]
    assert calls[0] - start < 0.5 and calls[-1] < start + 3.0 <= end, [c - start for c in calls]


# One rank over an in-process store with a 2 s stall timeout, twice in one process: first with the
# watchdog's ``alive`` as the rollout's progress, the conversations sleeping 3 s (done within the
# 5 s deadline) and 600 s (failed as timeout at the deadline), which prints the failures; then the
# same wait without it, which is a stall (the endpoint's idle polling costs ~4 ms CPU/s, under the
# watchdog's 10 ms a look) and ends the process inside generate_sequences. The process is a fork
# of the test's own, which imported the rollout (megatron's included, ~6 CPU s) already.
TIMEOUT_S, SLEEP_S, DEADLINE_S = 2, 3, 5


def _slow_tools(out_dir: str) -> None:
    from verl_megatron.distributed.watchdog import Watchdog, WatchdogSettings

    tokenizer = _char_tokenizer(out_dir + "/tok")
    for alive in (True, False):
        run_dir = f"{out_dir}/{'alive' if alive else 'silent'}"
        watchdog = Watchdog(WatchdogSettings(TIMEOUT_S, run_dir), 0, 1, dist.HashStore()).start()
        watchdog.mark("gen", 1)
        start = time.monotonic()
        rollout = _rollout(tokenizer, DEADLINE_S, progress=watchdog.alive if alive else None)
        out = rollout.generate_sequences(_prompts(tokenizer, [str(SLEEP_S), "600"]))
        elapsed = time.monotonic() - start
        watchdog.stop()
        cols = out.non_tensor_batch
        print(
            json.dumps([alive, list(cols["agent_failure"]), list(cols["agent_reward"]), elapsed]), flush=True
        )


@pytest.fixture(scope="module")
def slow_tools(tmp_path_factory):
    """(the finished process, its output directory): both waits, with and without ``alive``."""
    out = tmp_path_factory.mktemp("slow_tools")
    return run_forked(_slow_tools, str(out)), out


def test_conversations_waiting_longer_than_the_stall_timeout_are_not_a_stall(slow_tools):
    done, out = slow_tools
    printed = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    assert len(printed) == 1, (done.returncode, done.stdout, done.stderr[-2000:])
    alive, failures, rewards, elapsed = printed[0]
    assert alive is True and not (out / "alive" / "stall").exists()
    assert failures == ["", "timeout"] and rewards == [1.0, -1.0], (failures, rewards)
    assert DEADLINE_S <= elapsed < 60, elapsed  # the deadline ended the 600 s sleep


def test_the_same_wait_without_progress_is_a_stall(slow_tools):
    """What every such wait did before: the job ended within the deadline."""
    done, out = slow_tools
    lines = [line for line in done.stderr.splitlines() if line.startswith("stall: ")]
    assert done.returncode == 4 and len(lines) == 1, (done.returncode, done.stderr[-2000:])
    assert "no rank made progress" in lines[0] and "in stage gen" in lines[0], lines[0]
    assert f"(trainer.stall_timeout_s={TIMEOUT_S})" in lines[0], lines[0]
    assert (out / "silent" / "stall" / "rank0.txt").read_text().startswith(lines[0])
    # ended inside the second generate_sequences: the first wait's line only
    assert [json.loads(line)[0] for line in done.stdout.splitlines() if line.startswith("[")] == [True]
