"""The built-in tool harness: the model calls tools, each call runs in the code sandbox.

``rollout.agent.harness: tools`` with ``rollout.agent.kwargs``::

    tools:                        # name -> the Python function behind it
      lookup: {function: verl_megatron.data.lookup_task:lookup_value,
               parameters: [key], kwargs: {seed: 0, num_digits: 2}}
    score: verl_megatron.reward.agents.tools:lookup_score   # (answer, row, calls) -> reward
    system_prompt: null           # prepended to the row's messages when set

Each turn asks the endpoint for the next assistant message; its tool calls run one by one, each
in its own sandbox (``reward/sandbox.py``: no network, own filesystem root, CPU / wall / memory
limits from ``rollout.agent.tool_*``): the function's file is the only project file the sandbox
sees, so a tool imports only the standard library. A tool that fails, hangs or prints no JSON
answers ``tool error: <cause>`` to the model (the conversation goes on). The conversation ends
at an answer without tool calls, or when the endpoint refuses a turn (``max_turns``, token
budget); the scorer then gets the final answer (None when there is none).
"""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from dataclasses import dataclass, field
from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.reward import sandbox
from verl_megatron.rollout.agent import AgentOutcome, AgentTask, ChatClient, EndpointError
from verl_megatron.rollout.config import AgentConfig
from verl_megatron.utils.import_utils import load_object

__all__ = ["SandboxedTool", "ToolCallLog", "ToolHarness", "lookup_score"]

# Loads the tool's file by path and calls the function with the JSON object on stdin.
_BOOT = (
    "import importlib.util, json, sys\n"
    "spec = importlib.util.spec_from_file_location('tool', sys.argv[1])\n"
    "module = importlib.util.module_from_spec(spec)\n"
    "spec.loader.exec_module(module)\n"
    "print(json.dumps(getattr(module, sys.argv[2])(**json.loads(sys.stdin.read()))))\n"
)


@dataclass(frozen=True)
class ToolCallLog:
    """One tool call of a conversation: its turn (0-based model call), name, arguments, result."""

    turn: int
    name: str
    arguments: dict[str, Any]
    result: str
    ok: bool


@dataclass
class SandboxedTool:
    """A Python function run in the sandbox per call.

    Attributes:
        name: the tool's name in the request's ``tools``.
        path, function: the file and the function in it.
        parameters: the string parameters the model fills (in the ``tools`` spec's order).
        kwargs: fixed keyword arguments added to every call.
    """

    name: str
    path: str
    function: str
    parameters: list[str]
    kwargs: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_spec(cls, name: str, spec: dict[str, Any]) -> SandboxedTool:
        where = f"rollout.agent.kwargs.tools.{name}"
        target = str(spec.get("function", ""))
        module, _, function = target.rpartition(":")
        path = module if module.endswith(".py") else _module_file(module, where)
        if not function or not os.path.isfile(path):
            raise ConfigError(
                f"{where}.function must be 'pkg.module:function' or '/path/file.py:function', got {target!r}"
            )
        parameters = [str(p) for p in spec.get("parameters", ["input"])]
        return cls(name, os.path.abspath(path), function, parameters, dict(spec.get("kwargs", {})))

    def spec(self) -> dict[str, Any]:
        """The OpenAI ``tools`` entry."""
        properties = {p: {"type": "string"} for p in self.parameters}
        parameters = {"type": "object", "properties": properties, "required": self.parameters}
        return {"type": "function", "function": {"name": self.name, "parameters": parameters}}

    def call(
        self, arguments: dict[str, Any], limits: sandbox.SandboxLimits, isolation: str
    ) -> tuple[str, bool]:
        """(the result as text, whether the call succeeded)."""
        argv = [sys.executable, "-I", "-c", _BOOT, self.path, self.function]
        stdin = json.dumps({**arguments, **self.kwargs}).encode()
        run = sandbox.run_sandboxed(argv, stdin, limits, isolation, expose=[self.path])
        if run.cause != sandbox.EXITED or run.returncode != 0:
            return (
                f"tool error: {run.cause if run.cause != sandbox.EXITED else 'exit ' + str(run.returncode)}",
                False,
            )
        try:
            result = json.loads(run.stdout.decode(errors="replace").strip().splitlines()[-1])
        except (ValueError, IndexError):
            return "tool error: no result", False
        return result if isinstance(result, str) else json.dumps(result), True


def _module_file(module: str, where: str) -> str:
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.origin:
        raise ConfigError(f"{where}.function: module {module!r} is not importable")
    return spec.origin


class ToolHarness:
    """The tool loop of the module docstring."""

    def __init__(
        self,
        agent: AgentConfig,
        tools: dict[str, dict[str, Any]],
        score: str,
        system_prompt: str | None = None,
        sampling: dict[str, Any] | None = None,
    ) -> None:
        if not tools:
            raise ConfigError("rollout.agent.kwargs.tools: the tools harness needs at least one tool")
        self.tools = {name: SandboxedTool.from_spec(name, dict(spec)) for name, spec in tools.items()}
        self.score = load_object(score, "rollout.agent.kwargs.score")
        self.system_prompt = system_prompt
        self.sampling = dict(sampling or {})
        self.limits = sandbox.SandboxLimits(
            cpu_s=agent.tool_cpu_s, wall_s=agent.tool_wall_s, memory_mb=agent.tool_memory_mb
        )
        self.isolation = agent.tool_isolation

    def run(self, task: AgentTask, client: ChatClient) -> AgentOutcome:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages = system + list(task.messages)
        specs = [tool.spec() for tool in self.tools.values()]
        calls: list[ToolCallLog] = []
        answer = None
        for turn in range(10**6):  # the endpoint's max_turns / token budget end it
            try:
                message = client.chat(messages, tools=specs, **self.sampling)["choices"][0]["message"]
            except EndpointError as err:
                if err.code in ("max_turns", "token_budget"):
                    break
                raise
            messages.append(message)
            if not message.get("tool_calls"):
                answer = message.get("content") or ""
                break
            for call in message["tool_calls"]:
                messages.append(
                    {"role": "tool", "tool_call_id": call.get("id"), "content": self._run(call, turn, calls)}
                )
        scored = self.score(answer, task.row, calls)
        reward, turn_rewards = scored if isinstance(scored, tuple) else (scored, [])
        return AgentOutcome(reward=reward, turn_rewards=list(turn_rewards), info={"tool_calls": len(calls)})

    def _run(self, call: dict[str, Any], turn: int, calls: list[ToolCallLog]) -> str:
        function = call.get("function", {})
        name = str(function.get("name"))
        try:
            arguments = json.loads(function.get("arguments") or "{}")
        except json.JSONDecodeError:
            arguments = None
        tool = self.tools.get(name)
        if tool is None or not isinstance(arguments, dict) or set(arguments) - set(tool.parameters):
            result, ok = f"tool error: no tool {name!r} with arguments {function.get('arguments')!r}", False
        else:
            result, ok = tool.call(arguments, self.limits, self.isolation)
        calls.append(ToolCallLog(turn, name, arguments if isinstance(arguments, dict) else {}, result, ok))
        return result


def lookup_score(
    answer: str | None, row: dict[str, Any], calls: list[ToolCallLog]
) -> tuple[float, list[float]]:
    """The lookup task's reward: 0.75 x the fraction of the answer's digits in place, and on the
    first turn 0.1 for calling ``lookup`` + 0.15 x the fraction of the key's digits in place.
    Partial credit and an added (not multiplied) tool reward let a random policy start learning:
    an exact-match reward is never earned by chance."""
    key = str((row.get("extra_info") or {}).get("key"))
    truth = str((row.get("reward_model") or {}).get("ground_truth"))
    first = [c for c in calls if c.turn == 0 and c.name == "lookup"]
    used = 0.1 + 0.15 * _in_place(str(first[0].arguments.get("key", "")), key) if first else 0.0
    return 0.75 * (_in_place(answer.strip(), truth) if answer is not None else 0.0), [used]


def _in_place(text: str, target: str) -> float:
    """Characters equal at the same position, over the longer length (1.0: equal)."""
    return sum(a == b for a, b in zip(text, target)) / max(len(text), len(target), 1)
