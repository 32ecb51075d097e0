"""A verifiers 0.4 taskset (defined here, no hub) as the rollout and reward source of a GRPO step.

The taskset asks the policy to repeat two digits; its ``@vf.reward`` scores the reply. Its rows
are written by ``write_verifiers_dataset``, and one step of configs/quickstart_agent.yaml runs
with ``rollout.agent.harness: verifiers``: every sample is answered through the endpoint and
scored by verifiers' own ``Task.score``, each sample in a worker process of its own (the default).
"""

from __future__ import annotations

import json
import os

import pytest
import yaml

from verl_megatron.errors import ConfigError
from verl_megatron.rollout.config import AgentConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TASKSET = """
import verifiers.v1 as vf


class RepeatData(vf.TaskData):
    answer: str = ""


class RepeatTask(vf.Task[RepeatData]):
    @vf.reward(weight=0.5)
    async def first_digit(self, task, trace) -> float:
        return float(trace.last_reply[:1] == task.answer[:1])

    @vf.reward(weight=0.5)
    async def exact(self, task, trace) -> float:
        return float(trace.last_reply == task.answer)


class RepeatTaskset(vf.Taskset[RepeatTask]):
    def load(self):
        for i in range(10):
            digits = f"{(7 * i) % 10}{(3 * i + 1) % 10}"
            yield RepeatTask(RepeatData(prompt=digits, answer=digits))


def load_taskset():
    return RepeatTaskset(vf.TasksetConfig(id="repeat"))
"""


@pytest.fixture(scope="module")
def taskset_file(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("vf_env") / "repeat_env.py"
    path.write_text(TASKSET)
    return str(path)


def test_harness_scores_with_the_tasks_own_rewards(taskset_file, tmp_path):
    import pandas as pd

    from verl_megatron.reward.agents import build_harness
    from verl_megatron.reward.agents.verifiers_env import write_verifiers_dataset
    from verl_megatron.rollout.agent import AgentTask
    from verl_megatron.utils.import_utils import load_object

    train, val = write_verifiers_dataset(load_object(f"{taskset_file}:load_taskset", "t")(), tmp_path)
    rows = pd.read_parquet(train)
    assert len(rows) == 8 and len(pd.read_parquet(val)) == 2
    assert list(rows["prompt"][0]) == [{"role": "user", "content": "01"}]

    class Reply:  # the endpoint's answer, scripted
        def __init__(self, text):
            self.text, self.seen = text, []

        def chat(self, messages, **params):
            assert messages == [{"role": "user", "content": "74"}], messages  # else: the run raises
            self.seen.append(messages)
            return {"choices": [{"message": {"role": "assistant", "content": self.text}}]}

    task = AgentTask("t", [], {"extra_info": {"index": 1}}, "http://unused")
    # By default each run is in a worker process, on its copy of the client (this one sees no call).
    for isolation, calls in (("process", 0), ("none", 1)):
        kwargs = {"taskset": f"{taskset_file}:load_taskset", "isolation": isolation}
        harness = build_harness(AgentConfig(enable=True, harness="verifiers", kwargs=kwargs))
        for text, reward in (("74", 1.0), ("79", 0.5), ("x", 0.0)):
            client = Reply(text)
            outcome = harness.run(task, client)
            assert outcome.reward == reward and len(client.seen) == calls, (isolation, text, outcome)
        assert outcome.info["rewards"] == {"first_digit": 0.0, "exact": 0.0}
    with pytest.raises(ConfigError, match=r"rollout\.agent\.harness=openenv"):
        build_harness(AgentConfig(enable=True, harness="openenv"))
    with pytest.raises(ConfigError, match=r"not a verifiers Taskset"):
        build_harness(AgentConfig(enable=True, harness="verifiers", kwargs={"taskset": "builtins:dict"}))


def verifiers_step_job(config_path: str, out_dir: str) -> list[dict]:
    from verl_megatron.train import run
    from verl_megatron.trainer.tracking import read_jsonl_metrics

    run(config_path, [f"trainer.default_local_dir={out_dir}"])
    return read_jsonl_metrics(os.path.join(out_dir, "metrics.jsonl"))


def test_verifiers_taskset_drives_a_grpo_step(pool1, taskset_file, tmp_path):
    from verl_megatron.reward.agents.verifiers_env import write_verifiers_dataset
    from verl_megatron.utils.import_utils import load_object

    train, val = write_verifiers_dataset(
        load_object(f"{taskset_file}:load_taskset", "t")(), tmp_path / "data"
    )
    with open(os.path.join(ROOT, "configs", "quickstart_agent.yaml")) as f:
        config = yaml.safe_load(f)
    config["data"].update(train_files=[train], val_files=[val], train_batch_size=4, max_response_length=8)
    config["actor"]["ppo_mini_batch_size"] = 4
    config["rollout"]["n"] = 4
    config["rollout"]["agent"].update(harness="verifiers", tool_call_format="none",
                                      kwargs={"taskset": f"{taskset_file}:load_taskset", "sampling": {"max_tokens": 4}})  # fmt: skip
    config["trainer"].update(total_training_steps=1, val_before_train=False)
    path = tmp_path / "verifiers_step.yaml"
    path.write_text(yaml.safe_dump(config))
    (rows,) = pool1.run(
        f"{__name__}:verifiers_step_job", config_path=str(path), out_dir=str(tmp_path / "run")
    )
    step = {k: v for row in rows if row["step"] == 1 for k, v in row.items()}
    assert step["reward/agent/trajectories_count"] == 16 and step["val/reward/agent/trajectories_count"] == 2
    assert sum(v for k, v in step.items() if k.startswith("reward/agent/failure_")) == 0, json.dumps(step)
    assert step["reward/agent/turns_count"] == 16 and 0.0 <= step["critic/score/mean"] <= 1.0
    assert "val/test_score/verifiers/repeat" in step
