"""An OpenEnv environment (a real ``openenv`` Environment subclass, defined here) as the rollout
and reward source (reward/agents/openenv_env.py).

``EchoTwiceEnv``: reset(seed) shows a two-digit key; step 1 pays 0.25 for saying the key, step 2
pays 0.75 for saying it reversed and ends the episode. A scripted engine pins the tokens (the
policy's replies trained, the observations' turns masked out) and the per-turn rewards in text
and tool mode; one GRPO step of configs/quickstart_agent.yaml runs on it with
``rollout.agent.harness: openenv``. Each episode runs in a worker process (the default
``isolation: process``); one case runs in this process (``isolation: none``) with the same numbers.
A step that hangs past ``env_timeout_s`` ends its trajectory as ``timeout``, one that kills its
worker as ``error``; no worker process outlives the rollout.
"""

from __future__ import annotations

import contextlib
import json
import os

import numpy as np
import pytest
import torch
import yaml

from tests.test_agent_endpoint import ScriptedEngine
from verl_megatron.errors import ConfigError
from verl_megatron.protocol import DataProto
from verl_megatron.rollout.config import AgentConfig, RolloutConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = "tests.openenv_echo_env:EchoTwiceEnv"  # imported by the tests only (openenv imports gradio: ~4 s)
FACTORY = "tests.openenv_echo_env:make_echo_env"  # a function returning an EchoTwiceEnv


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    from verl_megatron.data.lookup_task import AGENT_CHAT_TEMPLATE, TOOL_TOKENS
    from verl_megatron.utils.local_assets import build_char_tokenizer

    return build_char_tokenizer(
        tmp_path_factory.mktemp("openenv_tok"), alphabet="0123456789",
        extra_tokens=TOOL_TOKENS, chat_template=AGENT_CHAT_TEMPLATE,
    )  # fmt: skip


def _harness(**kwargs):
    from verl_megatron.reward.agents import build_harness

    return build_harness(AgentConfig(enable=True, harness="openenv", kwargs=kwargs))


def test_named_errors_for_bad_environments(tmp_path):
    cases = [
        ({}, r"harness=openenv needs rollout\.agent\.kwargs\.env"),
        ({"env": str(tmp_path / "missing.py:Env")}, r"rollout\.agent\.kwargs\.env=.*file not found"),
        ({"env": "tests.no_such_module:Env"}, r"rollout\.agent\.kwargs\.env=.*cannot import module"),
        ({"env": "builtins:dict"}, r"dict is not an openenv Environment subclass"),
        (
            {"env": "tests.openenv_echo_env:ResetFailsEnv"},
            r"env=.*ResetFailsEnv.*reset\(\) raised RuntimeError: the server is down$",
        ),
        ({"env": ENV, "env_kwargs": {"size": 2}}, r"env_kwargs: .*unexpected keyword argument 'size'"),
        # A factory that is not a class: the same errors from a worker (default) or from here.
        ({"env": FACTORY, "env_kwargs": {"size": 2}}, r"env_kwargs: .*unexpected keyword argument 'size'"),
        (
            {"env": FACTORY, "env_kwargs": {"size": 2}, "isolation": "none"},
            r"env_kwargs: .*keyword argument 'size'",
        ),
        (
            {"env": "tests.openenv_echo_env:make_a_dict"},
            r"make_a_dict' made a dict, not an openenv Environment$",
        ),
        ({"env": "tests.openenv_echo_env:make_a_dict", "isolation": "none"}, r"made a dict, not an openenv"),
        (
            {"env": "tests.openenv_echo_env:make_fails"},
            r"make_fails\(\) raised RuntimeError: no license server$",
        ),
        # A TypeError of the factory's own body is its error, not one of env_kwargs (it has none).
        (
            {"env": "tests.openenv_echo_env:make_type_error"},
            r"make_type_error\(\) raised TypeError: .*positional",
        ),
        (
            {"env": "tests.openenv_echo_env:make_type_error", "isolation": "none"},
            r"make_type_error\(\) raised TypeError: .*positional",
        ),
        ({"env": ENV, "action_field": "text"}, r"action_field='text'.*DigitsAction.*\['digits'\]"),
        ({"env": ENV, "action": "builtins:str"}, r"name the openenv Action class"),
        ({"env": ENV, "isolation": "thread"}, r"kwargs\.isolation must be one of \('process', 'none'\)"),
        ({"env": ENV, "env_timeout_s": 0}, r"kwargs\.env_timeout_s must be a positive number"),
    ]
    for kwargs, match in cases:
        with pytest.raises(ConfigError, match=match) as caught:
            _harness(**kwargs)
        assert "\n" not in str(caught.value), str(caught.value)


@pytest.mark.parametrize("isolation", ["process", "none"])
def test_a_factory_function_runs_only_where_the_instances_live(tmp_path, monkeypatch, isolation):
    """The Action class and the concurrency flag come from what the factory makes; it is called
    once to see that and once for the start-up reset, in workers (never this process) by default."""
    from tests.openenv_echo_env import LOG_VAR, DigitsAction, read_log

    log = tmp_path / "pids.jsonl"
    monkeypatch.setenv(LOG_VAR, str(log))
    harness = _harness(env=FACTORY, isolation=isolation)
    assert harness.action is DigitsAction and harness.action_field == "digits"
    assert isinstance(harness._lock, contextlib.nullcontext)  # EchoTwiceEnv supports concurrent sessions
    entries = read_log(str(log))
    assert [e[0] for e in entries] == ["made", "made", "probe"], entries
    pids = [e[3] for e in entries]
    if isolation == "none":
        assert set(pids) == {os.getpid()}, pids
    else:  # one worker to see what it makes, one for the reset
        assert os.getpid() not in pids and pids[0] != pids[1] == pids[2], pids


def test_a_factory_in_a_user_file_gives_its_action_class_from_a_worker(tmp_path):
    env_file = tmp_path / "word_env.py"
    env_file.write_text(
        "from openenv.core.env_server.interfaces import Environment\n"
        "from openenv.core.env_server.types import Action, Observation, State\n"
        "class WordAction(Action):\n    word: str\n"
        "class WordEnv(Environment[WordAction, Observation, State]):\n"
        "    def reset(self, seed=None, episode_id=None, **kw):\n        return Observation()\n"
        "    def step(self, action, timeout_s=None, **kw):\n        return Observation(done=True)\n"
        "    @property\n    def state(self):\n        return State()\n"
        "def make():\n    return WordEnv()\n"
    )
    harness = _harness(env=f"{env_file}:make")
    assert harness.action.__name__ == "WordAction" and harness.action_field == "word"
    assert not isinstance(harness._lock, contextlib.nullcontext)  # no SUPPORTS_CONCURRENT_SESSIONS


def _batch(tok, rows: list[tuple[str, dict]], width: int = 8) -> DataProto:
    ids = [tok.encode(tok.apply_chat_template([{"role": "user", "content": c}], add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False) for c, _ in rows]  # fmt: skip
    columns = {
        "raw_prompt": [[{"role": "user", "content": c}] for c, _ in rows],
        "extra_info": [e for _, e in rows],
    }
    non_tensors = {}
    for key, values in columns.items():
        non_tensors[key] = np.empty(len(rows), dtype=object)
        non_tensors[key][:] = values
    return DataProto.from_dict(
        {
            "input_ids": torch.tensor([[0] * (width - len(i)) + i for i in ids]),
            "attention_mask": torch.tensor([[0] * (width - len(i)) + [1] * len(i) for i in ids]),
        },
        non_tensors=non_tensors,
    )


@pytest.mark.parametrize(
    "as_tool,isolation", [(False, "process"), (True, "process"), (False, "none")], ids=["text", "tool", "text-in-process"]
)  # fmt: skip
def test_episode_tokens_and_turn_rewards_are_exact(tok, as_tool, isolation):
    """Seed 3 (key "30"): the policy says "30" (0.25), then "03" in text mode (0.75) or "12" in
    tool mode (0); a row with seed -1 fails its reset (cause ``error``, nothing trained)."""
    from verl_megatron.rollout.agent import AgentRollout

    eos, assistant = tok.eos_token_id, tok.convert_tokens_to_ids("<|assistant|>")

    def say(text: str) -> list[int]:
        wrapped = f"<tool_call>{text}</tool_call>" if as_tool else text
        return [*tok.encode(wrapped, add_special_tokens=False), eos]

    first, second = say("30"), say("12" if as_tool else "03")
    engine = ScriptedEngine(lambda p: first if p.count(assistant) == 1 else second, [eos])
    fmt = "bare" if as_tool else "none"
    agent = AgentConfig(enable=True, harness="openenv", max_turns=3, deadline_s=60.0, tool_call_format=fmt)
    harness = _harness(env=ENV, action_as_tool=as_tool, sampling={"max_tokens": 16}, isolation=isolation)
    config = RolloutConfig(n=1, prompt_length=8, response_length=40, agent=agent)
    batch = _batch(tok, [("30", {"index": 3}), ("30", {"seed": -1})])
    with pytest.warns(UserWarning, match="no key for a negative seed"):
        out = AgentRollout(engine, config, tok, harness, [eos]).generate_sequences(batch)

    role = "<|tool|>" if as_tool else "<|user|>"
    env = [*tok.encode(f"{role}03", add_special_tokens=False), eos, assistant]
    expected = first + env + second
    n = len(expected)
    assert out.batch["responses"][0, :n].tolist() == expected, tok.decode(out.batch["responses"][0])
    mask = [1] * len(first) + [0] * len(env) + [1] * len(second) + [0] * (40 - n)
    assert out.batch["response_mask"][0].tolist() == mask
    assert not out.batch["response_mask"][1].any()
    cols = out.non_tensor_batch
    assert list(cols["agent_failure"]) == ["", "error"] and cols["agent_turns"][0] == 2
    assert (
        cols["agent_turn_rewards"][0] == [0.25, 0.0 if as_tool else 0.75] and cols["agent_reward"][0] == 0.0
    )
    assert cols["agent_turn_ends"][0] == [len(first) - 1, n - 1]
    assert cols["agent_tool_calls"][0] == (2 if as_tool else 0)


def test_episode_ends_at_max_turns_or_a_reply_without_a_tool_call(tok):
    """Tool mode, max_turns=1: key "30" calls the tool (0.25), its next turn is refused (truncated
    ``max_turns``); key "43" answers without a tool call: no step, the episode ends (reward 0)."""
    from verl_megatron.rollout.agent import AgentRollout

    eos = tok.eos_token_id
    call, plain = [*tok.encode("<tool_call>30</tool_call>", add_special_tokens=False), eos], tok.encode("43")
    engine = ScriptedEngine(lambda p: [*plain, eos] if "43" in tok.decode(p) else call, [eos])
    agent = AgentConfig(enable=True, harness="openenv", max_turns=1, deadline_s=60.0, tool_call_format="bare")
    config = RolloutConfig(n=1, prompt_length=8, response_length=40, agent=agent)
    harness = _harness(env=ENV, action_as_tool=True)
    out = AgentRollout(engine, config, tok, harness, [eos]).generate_sequences(
        _batch(tok, [("30", {"index": 3}), ("43", {"index": 4})])
    )
    cols = out.non_tensor_batch
    assert list(cols["agent_truncated"]) == ["max_turns", ""] and list(cols["agent_failure"]) == ["", ""]
    assert list(cols["agent_turns"]) == [1, 1] and list(cols["agent_turn_rewards"]) == [[0.25], [0.0]]
    assert out.batch["response_mask"][0, : len(call)].tolist() == [1] * len(call)
    assert out.batch["response_mask"][1].sum().item() == len(plain) + 1


def test_a_hung_or_crashing_step_ends_its_trajectory_and_its_worker(tok, tmp_path, monkeypatch):
    """Key "30" with a step that sleeps for an hour (env_timeout_s=0.5: ``timeout``, the batch's
    60 s deadline far away) or calls os._exit(3) (``error``, the exit code in the warning). Every
    reset ran in a worker process (not this one), and none of them is left afterwards."""
    import psutil

    from tests.openenv_echo_env import LOG_VAR, read_log
    from verl_megatron.rollout.agent import AgentRollout

    log = tmp_path / "pids.jsonl"
    monkeypatch.setenv(LOG_VAR, str(log))
    eos, children = tok.eos_token_id, {p.pid for p in psutil.Process().children(recursive=True)}
    engine = ScriptedEngine(lambda p: [*tok.encode("30", add_special_tokens=False), eos], [eos])
    agent = AgentConfig(enable=True, harness="openenv", max_turns=3, deadline_s=60.0, tool_call_format="none")
    config = RolloutConfig(n=1, prompt_length=8, response_length=40, agent=agent)
    failures, env_seconds = [], []
    for name in ("StepHangsEnv", "StepExitsEnv"):
        # The hang is cut at 0.5 s; the exit gets 10 s, so a loaded machine's slow step never
        # turns the crash into a timeout (seen once in a full suite at load ~20).
        limit = 0.5 if "Hangs" in name else 10.0
        harness = _harness(
            env=f"tests.openenv_echo_env:{name}", env_timeout_s=limit, sampling={"max_tokens": 4}
        )
        rollout = AgentRollout(engine, config, tok, harness, [eos])
        crash = pytest.warns(UserWarning, match=r"died in step\(\) \(exit code 3\)")
        with crash if "Exits" in name else contextlib.nullcontext():
            out = rollout.generate_sequences(_batch(tok, [("30", {"index": 3})]))
        failures += list(out.non_tensor_batch["agent_failure"])
        env_seconds += list(out.non_tensor_batch["agent_env_seconds"])
        assert not out.batch["response_mask"].any()
    assert failures == ["timeout", "error"], failures
    assert 0.5 <= env_seconds[0] < 60.0, env_seconds  # cut at the limit, not at the deadline
    episodes = read_log(str(log))
    # Per env: the start-up probe's reset and close (one worker), the trajectory's reset (killed).
    assert [e[0] for e in episodes] == ["probe", "probe", "b0-0"] * 2, episodes
    pids = {e[3] for e in episodes}
    assert len(pids) == 4 and os.getpid() not in pids, pids
    assert not [pid for pid in pids if psutil.pid_exists(pid)], pids
    assert {p.pid for p in psutil.Process().children(recursive=True)} <= children


def openenv_step_job(config_path: str, out_dir: str) -> tuple[list[dict], list]:
    from tests.openenv_echo_env import LOG_VAR, read_log
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    log = os.path.join(out_dir, "episodes.jsonl")
    os.makedirs(out_dir, exist_ok=True)
    os.environ[LOG_VAR] = log
    try:
        run(config_path, [f"trainer.default_local_dir={out_dir}"])
    finally:
        del os.environ[LOG_VAR]
    episodes = [e for e in read_log(log) if e[0] != "probe"]
    assert os.getpid() not in {e[3] for e in episodes}  # every episode ran in a worker process
    return read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl")), [e[:3] for e in episodes]


def test_openenv_environment_drives_a_grpo_step(pool1, tmp_path):
    from verl_megatron.reward.agents.openenv_env import write_openenv_dataset

    train, val = write_openenv_dataset({"env": ENV}, tmp_path / "data", count=10)
    with open(os.path.join(ROOT, "configs", "quickstart_agent.yaml")) as f:
        config = yaml.safe_load(f)
    overrides = {
        "data.train_files": [train], "data.val_files": [val], "data.train_batch_size": 4,
        "data.max_response_length": 12, "actor.ppo_mini_batch_size": 4, "rollout.n": 4,
        "rollout.agent.harness": "openenv", "rollout.agent.tool_call_format": "none",
        "rollout.agent.kwargs": {"env": ENV, "sampling": {"max_tokens": 3}},
        "trainer.total_training_steps": 1, "trainer.val_before_train": False,
    }  # fmt: skip
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = config
        for part in parents:
            node = node[part]
        node[leaf] = value
    path = tmp_path / "openenv_step.yaml"
    path.write_text(yaml.safe_dump(config))
    rows, episodes = pool1.run(
        f"{__name__}:openenv_step_job", config_path=str(path), out_dir=str(tmp_path / "run")
    )[0]
    step = {k: v for row in rows if row["step"] == 1 for k, v in row.items()}
    trained = [e for e in episodes if e[0].startswith("b0-")]
    assert len(trained) == 16 and step["reward/agent/trajectories_count"] == 16, json.dumps(step)
    assert sum(v for k, v in step.items() if k.startswith("reward/agent/failure_")) == 0, json.dumps(step)
    # Every model call was one env step, and the trained score is the env's rewards, summed.
    assert step["reward/agent/turns_count"] == sum(len(actions) for _, actions, _ in trained)
    # Text mode: no tool calls; the env's reset/step time is logged (a sum over 16 episodes).
    assert step["reward/agent/tool_calls_count"] == 0 and step["reward/agent/env_seconds_count"] > 0, step
    mean = sum(sum(rewards) for _, _, rewards in trained) / 16
    assert abs(step["critic/score/mean"] - mean) < 1e-6, (step["critic/score/mean"], trained)
    assert step["val/reward/agent/trajectories_count"] == 2 and "val/test_score/openenv/EchoTwiceEnv" in step
