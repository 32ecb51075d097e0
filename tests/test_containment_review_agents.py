"""Agent harness containment: a deadline kill of a contained harness's worker ends what the
harness started (its process group); a harness that calls sys.exit() in the trainer's thread
ends its trajectory at once as an error naming SystemExit, not at the deadline as a timeout."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid

import psutil
import pytest

from tests.test_agent_endpoint import ScriptedEngine, _config, _ids, _prompts, char_tokenizer  # noqa: F401
from verl_megatron.rollout.agent import AgentRollout


def _run(harness, tok, deadline_s: float):
    engine = ScriptedEngine(lambda ids: [*_ids(tok, "ab"), tok.eos_token_id], [tok.eos_token_id])
    rollout = AgentRollout(engine, _config(deadline_s=deadline_s), tok, harness, [tok.eos_token_id])
    rollout.wake_up()
    try:
        start = time.monotonic()
        out = rollout.generate_sequences(_prompts(tok, ["q"]))
        return out, time.monotonic() - start
    finally:
        rollout.sleep()


def _with_marker(marker: str) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        if marker in (proc.info["cmdline"] or ()):
            found.append(proc)
    return found


class _StartsAServerThenHangs:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def run(self, task, client):
        client.chat(task.messages)
        subprocess.Popen(["sleep", self.marker])  # e.g. a tool server the harness starts
        time.sleep(100)  # then hangs past the deadline


def test_deadline_kill_ends_what_the_contained_harness_started(char_tokenizer):  # noqa: F811
    from verl_megatron.reward.agents.contained import ContainedHarness

    marker = f"4242.{uuid.uuid4().int % 10**9}"  # a unique `sleep` argument
    try:
        out, _ = _run(ContainedHarness(_StartsAServerThenHangs(marker)), char_tokenizer, deadline_s=2.0)
        assert list(out.non_tensor_batch["agent_failure"]) == ["timeout"]
        end = time.monotonic() + 5.0  # SIGKILLed with the worker's group: reaped by init at once
        while _with_marker(marker) and time.monotonic() < end:
            time.sleep(0.05)
        left = [(p.pid, p.cmdline()) for p in _with_marker(marker)]
        assert not left, f"the harness's subprocess outlived its worker's kill: {left}"
    finally:
        for proc in _with_marker(marker):
            proc.kill()


class _Exits:
    def run(self, task, client):
        client.chat(task.messages)
        sys.exit("scorer called sys.exit")  # e.g. argparse or a score function in user code


def test_sys_exit_in_an_in_process_harness_is_an_error_at_once(char_tokenizer):  # noqa: F811
    with pytest.warns(UserWarning, match=r"a harness raised SystemExit: scorer called sys\.exit"):
        out, _ = _run(_Exits(), char_tokenizer, deadline_s=10.0)
    # A slot never marked done is booked "timeout" at the deadline: "error" is the raise's.
    assert list(out.non_tensor_batch["agent_failure"]) == ["error"]


SCORE = """import os
def score(answer, row, calls):
    with open(os.path.join(os.path.dirname(__file__), "pids.txt"), "a") as f:
        f.write(f"{os.getpid()}\\n")
    return float(len(answer or ""))
"""


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_tools_harness_score_is_contained_by_default(char_tokenizer, tmp_path, isolation):  # noqa: F811
    from verl_megatron.reward import sandbox
    from verl_megatron.reward.agents import build_harness
    from verl_megatron.reward.agents.contained import ContainedHarness
    from verl_megatron.rollout.config import AgentConfig

    (tmp_path / "my_score.py").write_text(SCORE)
    tool = {"function": "verl_megatron.data.lookup_task:lookup_value", "parameters": ["key"]}
    kwargs = {"tools": {"lookup": tool}, "score": f"{tmp_path}/my_score.py:score"}
    if isolation == "none":
        kwargs["isolation"] = "none"
    children = {p.pid for p in psutil.Process().children(recursive=True)}
    harness = build_harness(AgentConfig(enable=True, harness="tools", kwargs=kwargs))
    assert isinstance(harness, ContainedHarness) == (isolation == "process")
    if isolation == "process":  # probed before the workers fork, not once in each
        assert sandbox.detect_isolation.cache_info().currsize == 1
    out, _ = _run(harness, char_tokenizer, deadline_s=30.0)
    assert list(out.non_tensor_batch["agent_failure"]) == [""]
    assert list(out.non_tensor_batch["agent_reward"]) == [2.0]  # len("ab"): the same either way
    (pid,) = [int(line) for line in (tmp_path / "pids.txt").read_text().split()]
    assert (pid != os.getpid()) == (isolation == "process"), (pid, os.getpid())
    assert not psutil.pid_exists(pid) or pid == os.getpid(), f"worker {pid} left"
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children
