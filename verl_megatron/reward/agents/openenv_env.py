"""An OpenEnv environment (``openenv-core`` 0.3, in-process) as the rollout and reward source.

``rollout.agent.harness: openenv`` with ``rollout.agent.kwargs``::

    env: my_env.py:MyEnv            # an openenv Environment subclass ('pkg.module:Class' works too),
                                    # or a factory returning an Environment instance
    env_kwargs: {}                  # passed to it, once per trajectory
    action: null                    # the Action class; null: the env's Environment[Action, ...] parameter
    action_field: null              # text mode: the Action field the reply fills (null: its only one)
    action_as_tool: false           # true: the Action's schema is offered as a tool; its call is the action
    observation_field: null         # the Observation field shown to the model (null: all but done/reward/metadata)
    reset_kwargs: {}                # extra reset() arguments (the row's extra_info.reset_kwargs are added)
    system_prompt: null
    sampling: {max_tokens: 64}      # per model call
    isolation: process              # none: the instances run in the trainer process (trusted code)
    env_timeout_s: 30.0             # wall-clock limit of each reset/step/close call (isolation: process)

Each trajectory gets its own environment instance. By default it lives in a worker process of
its own (``openenv_session.py`` on ``worker.py``, killable like the reward scorers'), so what
the environment runs (often the model's code) never runs in the trainer; reset/step are calls
to it with the per-call limit, actions and observations cross as plain dicts. A call that raises
or kills the worker ends the trajectory as ``error``, one past ``env_timeout_s`` (or the batch's
``rollout.agent.deadline_s``) as ``timeout``; the worker is killed and reaped when the
trajectory ends. ``isolation: none`` makes the instance in the trainer process instead, where
without ``SUPPORTS_CONCURRENT_SESSIONS`` the instances' reset/step/close calls take turns under
one lock. ``reset(seed=extra_info.seed or extra_info.index, episode_id=trajectory id)`` starts an
episode; the conversation opens with the row's messages, then the reset observation's text as a
user message (unless the row's last message already says it). Each policy reply becomes one
Action (text mode: ``Action(**{action_field: reply text})``; tool mode: the tool call's arguments)
and one ``step``; the observation's text answers as the next user message (a ``tool`` message
in tool mode). An action that does not validate answers ``invalid action: ...`` without a step.
The episode ends at ``done``, at a tool-mode reply without a tool call, or when the endpoint
refuses a turn (``max_turns``, token budget). Every model call's reward is its step's
``Observation.reward`` (None: 0; one per turn, ``AgentOutcome.turn_rewards``); the reset
observation's reward is the trajectory reward. A reset or step that raises counts as the
trajectory's failure (``error``). Build time checks the class and runs one reset, in a worker
unless ``isolation: none`` (named errors); a factory that is not a class is called once there too
(``openenv_session.factory_made``), to see what it makes: the user's code runs in the trainer only
with ``isolation: none``.
"""

from __future__ import annotations

import inspect
import json
import os
import threading
from collections.abc import Callable
from contextlib import nullcontext
from typing import Any

from verl_megatron.errors import ConfigError
from verl_megatron.reward.agents.openenv_session import (
    EnvCallError,
    EnvMade,
    InProcessSession,
    WorkerSession,
    class_made,
    factory_made,
)
from verl_megatron.reward.agents.worker import check_isolation
from verl_megatron.rollout.agent import AgentOutcome, AgentTask, ChatClient, EndpointError
from verl_megatron.rollout.config import AgentConfig
from verl_megatron.utils.import_utils import load_object

__all__ = ["OpenEnvHarness", "observation_text", "write_openenv_dataset"]

_KEY = "rollout.agent.kwargs.env"
_BASE_FIELDS = ("done", "reward", "metadata")


def _openenv() -> Any:
    try:
        from openenv.core.env_server import interfaces, types
    except ImportError as err:
        raise ConfigError(
            f"rollout.agent.harness=openenv needs openenv-core 0.3 ({err}): pip install 'verl-megatron[agents]'"
        ) from None
    return interfaces.Environment, types.Action, types.Observation


def _load(spec: str, where: str) -> Any:
    try:
        return load_object(spec, where)
    except (ValueError, OSError, ImportError, AttributeError, RuntimeError) as err:
        raise ConfigError(str(err).splitlines()[0]) from None


def _first_line(err: BaseException) -> str:
    return f"{type(err).__name__}: {(str(err).splitlines() or [''])[0]}"


def observation_text(observation: Any, field: str | None = None) -> str:
    """The text of an observation (a model or its JSON-mode dict) shown to the model: ``field``'s
    value, else its own fields (all but done/reward/metadata): one field's value as is, several
    as a JSON object."""
    values = observation if isinstance(observation, dict) else observation.model_dump(mode="json")
    if field is None:
        own = {k: v for k, v in values.items() if k not in _BASE_FIELDS}
        if len(own) != 1:
            return json.dumps(own)
        (value,) = own.values()
    else:
        value = values[field]
    return value if isinstance(value, str) else json.dumps(value)


class OpenEnvHarness:
    """The OpenEnv episode loop of the module docstring."""

    def __init__(
        self,
        agent: AgentConfig,
        env: str = "",
        env_kwargs: dict[str, Any] | None = None,
        action: str | None = None,
        action_field: str | None = None,
        action_as_tool: bool = False,
        observation_field: str | None = None,
        reset_kwargs: dict[str, Any] | None = None,
        system_prompt: str | None = None,
        sampling: dict[str, Any] | None = None,
        isolation: str = "process",
        env_timeout_s: float = 30.0,
    ) -> None:
        if isinstance(env_timeout_s, bool) or not (
            isinstance(env_timeout_s, (int, float)) and env_timeout_s > 0
        ):
            raise ConfigError(f"rollout.agent.kwargs.env_timeout_s must be a positive number of seconds, got {env_timeout_s!r}")  # fmt: skip
        self.isolation, self.env_timeout_s = check_isolation(isolation), float(env_timeout_s)
        if not env:
            raise ConfigError(
                "rollout.agent.harness=openenv needs rollout.agent.kwargs.env: the Environment class "
                "('my_env.py:MyEnv' or 'pkg.module:MyEnv')"
            )
        environment, action_base, _ = _openenv()
        self.spec, self.env_kwargs = env, dict(env_kwargs or {})
        self.factory = _load(env, _KEY)
        if isinstance(self.factory, type) and not issubclass(self.factory, environment):
            raise ConfigError(
                f"{_KEY}={env!r}: {self.factory.__name__} is not an openenv Environment subclass"
            )
        made = self._what_it_makes(environment, action_base)
        self._lock = nullcontext() if made.concurrent else threading.Lock()
        self.action = _load(action, "rollout.agent.kwargs.action") if action else made.action
        if not (isinstance(self.action, type) and issubclass(self.action, action_base)):
            raise ConfigError(
                f"rollout.agent.kwargs.action: name the openenv Action class of {env!r} (got {self.action!r})"
            )
        self.action_field = self._field(action_field, action_as_tool)
        first, kind = self._probe_reset(dict(reset_kwargs or {}))
        if observation_field is not None and observation_field not in first:
            raise ConfigError(f"rollout.agent.kwargs.observation_field={observation_field!r}: no such field of {kind}")  # fmt: skip
        self.observation_field = observation_field
        self.tools = [self._tool_spec()] if action_as_tool else None
        self.reset_kwargs = dict(reset_kwargs or {})
        self.system_prompt = system_prompt
        self.sampling = dict(sampling or {})

    def _what_it_makes(self, environment: type, action_base: type) -> EnvMade:
        """What the factory makes. A class answers for itself (its arguments are checked against
        its signature); any other factory is called once where ``isolation`` puts the instances
        (a worker by default), so the user's code runs only there."""
        if isinstance(self.factory, type):
            try:
                inspect.signature(self.factory).bind(**self.env_kwargs)
            except TypeError as err:
                raise self._bad_kwargs(str(err)) from None
            except ValueError:  # no signature to read: the first reset will tell
                pass
            return class_made(self.factory, action_base)
        args = (self.factory, self.env_kwargs, environment, action_base, self.isolation, self.env_timeout_s)
        made = self._user_call(
            f"{getattr(self.factory, '__name__', 'factory')}()", lambda: factory_made(*args)
        )
        if made.kwargs_error:
            raise self._bad_kwargs(made.kwargs_error)
        if not made.is_environment:
            raise ConfigError(f"{_KEY}={self.spec!r} made a {made.type_name}, not an openenv Environment")
        return made

    def _bad_kwargs(self, problem: str) -> ConfigError:
        return ConfigError(f"{_KEY}={self.spec!r} with rollout.agent.kwargs.env_kwargs: {problem}")

    def _user_call(self, what: str, call: Callable[[], Any]) -> Any:
        """``call()`` of the user's environment code (here or in a worker): whatever it raises is
        a one-line ConfigError naming ``what`` raised it."""
        try:
            return call()
        except Exception as err:
            problem = err.detail.splitlines()[0] if isinstance(err, EnvCallError) else _first_line(err)
            raise ConfigError(f"{_KEY}={self.spec!r}: {what} raised {problem}") from None

    def session(self, deadline: float = float("inf")) -> WorkerSession | InProcessSession:
        """A fresh environment instance for one trajectory, where ``isolation`` puts it."""
        if self.isolation == "none":
            return InProcessSession(self.factory, self.env_kwargs, self._lock)
        return WorkerSession(self.factory, self.env_kwargs, self.action, self.env_timeout_s, deadline)

    def _probe_reset(self, reset_kwargs: dict[str, Any]) -> tuple[dict[str, Any], str]:
        """One reset of a fresh instance (a worker's, by default): a failure is a ConfigError."""
        session = self.session()
        try:
            return self._user_call(
                "reset()", lambda: session.reset(seed=0, episode_id="probe", **reset_kwargs)
            )
        finally:
            session.close()

    def _field(self, name: str | None, as_tool: bool) -> str | None:
        own = [k for k in self.action.model_fields if k != "metadata"]
        if as_tool:
            return None
        if name is None:
            required = [k for k in own if self.action.model_fields[k].is_required()]
            name = required[0] if len(required) == 1 else own[0] if len(own) == 1 else None
        if name not in own:
            raise ConfigError(
                f"rollout.agent.kwargs.action_field={name!r}: name the field of {self.action.__name__} "
                f"the reply fills (one of {own})"
            )
        return name

    def _tool_spec(self) -> dict[str, Any]:
        schema = self.action.model_json_schema()
        schema.get("properties", {}).pop("metadata", None)
        schema.pop("title", None)
        function = {"name": self.action.__name__, "description": (self.action.__doc__ or "").strip()}
        return {"type": "function", "function": {**function, "parameters": schema}}

    def opening(self, task: AgentTask, observation: Any) -> list[dict[str, Any]]:
        """The first request's messages: system prompt, the row's messages, the reset text."""
        messages = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        messages += list(task.messages)
        text = observation_text(observation, self.observation_field)
        last = messages[-1] if messages else {}
        if text and not (last.get("role") == "user" and last.get("content") == text):
            messages.append({"role": "user", "content": text})
        return messages

    def _to_action(self, message: dict[str, Any]) -> tuple[Any, str | None, str]:
        """(the Action or None, the tool call's id, why it is not an action)."""
        from pydantic import ValidationError

        call_id = None
        if self.tools is None:
            arguments: Any = {self.action_field: message.get("content") or ""}
        elif not message.get("tool_calls"):
            return None, None, ""
        else:
            call = message["tool_calls"][0]
            call_id = call.get("id")
            try:
                arguments = json.loads(call.get("function", {}).get("arguments") or "{}")
            except json.JSONDecodeError as err:
                return None, call_id, f"invalid action: arguments are not JSON ({err.msg})"
        try:
            return self.action.model_validate(arguments), call_id, ""
        except ValidationError as err:
            return None, call_id, f"invalid action: {_first_line(err)}"

    def run(self, task: AgentTask, client: ChatClient) -> AgentOutcome:
        extra = task.row.get("extra_info") or {}
        seed = extra.get("seed", extra.get("index"))
        reset = {**self.reset_kwargs, **dict(extra.get("reset_kwargs") or {})}
        env = self.session(task.deadline)
        try:
            observation, _ = env.reset(
                seed=None if seed is None else int(seed), episode_id=task.trajectory_id, **reset
            )
            return self._episode(task, client, env, observation)
        finally:
            env.close()

    def _episode(
        self, task: AgentTask, client: ChatClient, env: Any, observation: dict[str, Any]
    ) -> AgentOutcome:
        messages = self.opening(task, observation)
        start_reward, turn_rewards, steps = observation.get("reward"), [], 0
        tools = {"tools": self.tools} if self.tools else {}
        while not observation.get("done"):
            try:
                message = client.chat(messages, **tools, **self.sampling)["choices"][0]["message"]
            except EndpointError as err:
                if err.code in ("max_turns", "token_budget"):
                    break
                raise
            messages.append(message)
            action, call_id, problem = self._to_action(message)
            if action is None:
                turn_rewards.append(0.0)
                if not problem:
                    break  # tool mode: an answer without a tool call ends the episode
                text = problem
            else:
                observation = env.step(action)
                steps += 1
                turn_rewards.append(observation.get("reward"))
                text = observation_text(observation, self.observation_field)
            messages.append(
                {"role": "tool", "tool_call_id": call_id, "content": text}
                if self.tools
                else {"role": "user", "content": text}
            )
        rewards = [0.0 if r is None else r for r in turn_rewards]
        info = {"steps": steps, "done": bool(observation.get("done"))}
        return AgentOutcome(
            reward=0.0 if start_reward is None else start_reward, turn_rewards=rewards, info=info
        )


def write_openenv_dataset(
    kwargs: dict[str, Any], out_dir: str | os.PathLike, count: int, val_every: int = 5
) -> tuple[str, str]:
    """verl rows for the harness ``kwargs`` name: row i's prompt is the text of ``reset(seed=i)``
    (``extra_info.index`` = i, the seed the rollout resets with); every ``val_every``-th row is
    in ``val.parquet``, the others in ``train.parquet``."""
    from verl_megatron.data.synthetic import write_parquet

    harness = OpenEnvHarness(AgentConfig(enable=True, harness="openenv"), **kwargs)
    name = f"openenv/{harness.factory.__name__}"
    splits: dict[str, list[dict[str, Any]]] = {"train": [], "val": []}
    for index in range(count):
        env = harness.session()
        try:
            observation, _ = env.reset(seed=index, episode_id=f"row-{index}")
        finally:
            env.close()
        text = observation_text(observation, harness.observation_field)
        split = "val" if index % val_every == val_every - 1 else "train"
        prompt = [{"role": "user", "content": text}]
        info = {"split": split, "index": index}
        splits[split].append({"data_source": name, "prompt": prompt, "ability": "agent",
                              "reward_model": {"style": "openenv", "ground_truth": ""}, "extra_info": info})  # fmt: skip
    paths = tuple(os.path.join(os.fspath(out_dir), f"{split}.parquet") for split in splits)
    for rows, path in zip(splits.values(), paths):
        write_parquet(rows, path)
    return paths[0], paths[1]
