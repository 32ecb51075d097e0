"""A ``verifiers`` (0.4, ``verifiers.v1``) taskset as the rollout and reward source.

``rollout.agent.harness: verifiers`` with ``rollout.agent.kwargs``::

    taskset: my_env.py:load_taskset   # () -> a verifiers.v1 Taskset (any Task type)
    sampling: {max_tokens: 64}        # per model call (optional)

The training rows come from the same taskset (:func:`write_verifiers_dataset` writes them in
verl's format, ``extra_info.index`` = the task's position). Each sample's conversation goes
through the endpoint: the task's system prompt and prompt, then the policy's reply; the reply is
scored by the task's own ``@vf.reward`` functions (``Task.score`` on a trace holding the reply,
no runtime: rewards that need a runtime box are skipped, as verifiers does offline) and the
trajectory's reward is their weighted sum. verifiers' harness programs (its ``uv``-launched
agents, MCP toolsets, sandboxes) are not run: the policy answers through this endpoint.
``build_harness`` runs each sample's :meth:`VerifiersHarness.run` (the reply and the task's
reward functions) in a worker process of its own unless ``isolation: none`` (``contained.py``).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.rollout.agent import AgentOutcome, AgentTask, ChatClient
from verl_megatron.rollout.config import AgentConfig
from verl_megatron.utils.import_utils import load_object

__all__ = ["VerifiersHarness", "task_messages", "write_verifiers_dataset"]


def _verifiers() -> Any:
    try:
        import verifiers.v1 as vf
    except ImportError as err:
        raise ConfigError(
            f"rollout.agent.harness=verifiers needs verifiers 0.4 ({err}): pip install 'verl-megatron[agents]'"
        ) from None
    return vf


def task_messages(task: Any) -> list[dict[str, str]]:
    """A verifiers task's opening chat: its system prompt, then its prompt (text or messages)."""
    data = task.data
    messages = [{"role": "system", "content": data.system_prompt}] if data.system_prompt else []
    if isinstance(data.prompt, str):
        return [*messages, {"role": "user", "content": data.prompt}]
    for message in data.prompt or []:
        wire = message.model_dump() if hasattr(message, "model_dump") else dict(message)
        content = wire.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        messages.append({"role": str(wire["role"]), "content": content or ""})
    return messages


def write_verifiers_dataset(taskset: Any, out_dir: str | os.PathLike, val_every: int = 5) -> tuple[str, str]:
    """verl rows (``train.parquet``, ``val.parquet``: every ``val_every``-th task) of a taskset."""
    from verl_megatron.data.synthetic import write_parquet

    rows: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    name = getattr(getattr(taskset, "config", None), "id", None) or type(taskset).__name__
    for index, task in enumerate(taskset):
        split = "val" if index % val_every == val_every - 1 else "train"
        rows[split].append(
            {
                "data_source": f"verifiers/{name}",
                "prompt": task_messages(task),
                "ability": "agent",
                "reward_model": {"style": "verifiers", "ground_truth": ""},
                "extra_info": {"split": split, "index": index},
            }
        )
    paths = []
    for split in ("train", "val"):
        path = os.path.join(os.fspath(out_dir), f"{split}.parquet")
        write_parquet(rows[split], path)
        paths.append(path)
    return paths[0], paths[1]


class VerifiersHarness:
    """One chat turn per sample through the endpoint, scored by the verifiers task (module docstring)."""

    def __init__(self, agent: AgentConfig, taskset: str = "", sampling: dict[str, Any] | None = None) -> None:
        vf = _verifiers()
        if not taskset:
            raise ConfigError(
                "rollout.agent.kwargs.taskset: name the verifiers taskset factory ('file.py:name')"
            )
        made = load_object(taskset, "rollout.agent.kwargs.taskset")()
        if not isinstance(made, vf.Taskset):
            raise ConfigError(
                f"rollout.agent.kwargs.taskset={taskset!r} returned {type(made).__name__}, not a verifiers Taskset"
            )
        self.tasks = list(made)
        self.sampling = dict(sampling or {})
        self._vf = vf

    def run(self, task: AgentTask, client: ChatClient) -> AgentOutcome:
        from verifiers.v1.trace import AgentInfo, Trace, TraceTask

        index = int((task.row.get("extra_info") or {})["index"])
        vtask = self.tasks[index]
        reply = client.chat(task_messages(vtask), **self.sampling)["choices"][0]["message"]
        trace = Trace(
            task=TraceTask(type=type(vtask).__name__, data=vtask.data),
            agent=AgentInfo(config=self._vf.AgentConfig()),
            root_reply=reply.get("content") or "",
        )
        asyncio.run(vtask.score(trace))
        scores = {name: r.score for name, r in trace.rewards.items() if r is not None}
        return AgentOutcome(reward=float(trace.reward), info={"rewards": scores})
