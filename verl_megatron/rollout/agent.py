"""Agentic rollouts: a harness per sample drives its conversation through the endpoint.

For a prompt batch [B, Tp] the :class:`AgentRollout` runs B*n conversations, each a
:class:`Harness` call in its own thread with an :class:`AgentTask` (the row's chat messages and
fields, a ``base_url`` that files its requests under its trajectory id) and a
:class:`ChatClient` (any OpenAI client pointed at ``task.base_url`` works as well). Meanwhile
the calling thread owns the engine and answers the endpoint's requests in batches
(``endpoint.py``). The harness returns an :class:`AgentOutcome`: the trajectory's reward and
optional per-turn rewards. Each sample is then assembled from the engine's own ids
(``trajectory.py``): ``response_mask`` 1 on the policy's tokens, 0 on the environment's.

Limits: ``rollout.agent.max_turns`` model calls and ``rollout.response_length`` tokens after
the first prompt per trajectory (further requests are refused: the trajectory is truncated), and
``rollout.agent.deadline_s`` for the batch. A harness that raises (``error``), outlives the
deadline (``timeout``, its thread is abandoned) or returns something that is not an
AgentOutcome with a finite reward (``invalid``) scores ``rollout.agent.failure_score``, and its
tokens are masked out (the environment failed, not the policy); every cause is counted in the
output's ``agent_failure`` column (``reward/agent/*`` metrics through the ``agent`` reward
manager). A harness that raises TimeoutError (a per-call limit of its environment) counts as
``timeout``. The endpoint runs between ``wake_up`` and ``sleep``: the trainer's rollout phase.
User code is contained by default: ``build_harness`` (``reward/agents``) wraps a verifiers or
custom harness so that each call runs in a worker process of its own (``contained.py``: the
client crosses as the trajectory's HTTP client, the outcome comes back as plain data, the worker
is killed at the deadline), and an OpenEnv environment's instances live in worker processes.

On the rollout rank of ``rollout.placement=separate`` (``async_worker.py``) the rollout gets the
engine's :class:`~verl_megatron.rollout.endpoint.WeightVersions`: newer weights may load between
two engine calls (partial rollout), and the output carries ``rollout_versions`` [B*n, Tr] (each
policy token's weight version, -1 on the environment's tokens and padding) and ``weight_version``
[B*n] (the version of a trajectory's first turn; the batch's starting one when it made no call),
as plain async rollouts do (``partial.py``); the trainer checks them against the staleness bound.
"""

from __future__ import annotations

import itertools
import json
import math
import threading
import time
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from verl_megatron.protocol import DataProto
from verl_megatron.rollout.base import (
    RolloutEngine,
    pad_token_id,
    prompt_tensors,
)
from verl_megatron.rollout.config import RolloutConfig
from verl_megatron.rollout.endpoint import EndpointSettings, PolicyEndpoint, WeightVersions
from verl_megatron.rollout.multiturn import conversation_output
from verl_megatron.rollout.sampling import resolve_sampling
from verl_megatron.rollout.trajectory import Trajectory
from verl_megatron.rollout.wrapped import WrappedRollout

__all__ = ["AgentOutcome", "AgentRollout", "AgentTask", "ChatClient", "EndpointError", "Harness"]

# Output columns (non-tensor, one per sample) the agent reward manager and metrics read.
AGENT_COLUMNS = (
    "agent_reward",
    "agent_turn_rewards",
    "agent_turn_ends",
    "agent_failure",
    "agent_truncated",
    "agent_turns",
    "agent_tool_calls",
    "agent_env_seconds",
    "agent_context_resets",
)


@dataclass
class AgentTask:
    """One conversation to run.

    Attributes:
        trajectory_id: files every request of this conversation (already in ``base_url``).
        messages: the row's chat prompt (``raw_prompt``).
        row: the row's other fields (``reward_model``, ``extra_info``, ``data_source``, ...).
        base_url: OpenAI ``base_url`` of the endpoint for this trajectory.
        sample: which of the prompt's n samples this is.
        validate: a validation rollout (the endpoint decodes greedily).
        deadline: ``time.monotonic()`` after which requests are refused.
    """

    trajectory_id: str
    messages: list[dict[str, Any]]
    row: dict[str, Any]
    base_url: str
    sample: int = 0
    validate: bool = False
    deadline: float = math.inf


@dataclass
class AgentOutcome:
    """What a harness returns: the trajectory's ``reward`` (added at its last token) and optional
    ``turn_rewards`` (one per model call, added at that turn's last token)."""

    reward: float
    turn_rewards: list[float] = field(default_factory=list)
    info: dict[str, Any] = field(default_factory=dict)


class Harness(Protocol):
    """Runs one conversation through the endpoint and scores it."""

    def run(self, task: AgentTask, client: ChatClient) -> AgentOutcome: ...


class EndpointError(RuntimeError):
    """The endpoint refused a request (``code``: ``max_turns``, ``token_budget``, ...)."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(f"{status} {code}: {message}")
        self.status, self.code = status, code


class ChatClient:
    """A minimal OpenAI client for one trajectory (stdlib HTTP); ``seconds`` accumulates the time
    spent waiting on the endpoint (the rest of a harness's time is the environment's)."""

    def __init__(self, base_url: str, timeout: float = 600.0) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.seconds = 0.0

    def chat(
        self, messages: list[dict[str, Any]], tools: list[dict] | None = None, **params: Any
    ) -> dict[str, Any]:
        """POST /chat/completions; returns the response JSON (``choices[i].message``, ``token_ids``)."""
        return self._post(
            "/chat/completions", {"messages": messages, **({"tools": tools} if tools else {}), **params}
        )

    def complete(self, prompt: str | list[int], **params: Any) -> dict[str, Any]:
        """POST /completions (``prompt``: text or token ids)."""
        return self._post("/completions", {"prompt": prompt, **params})

    def _post(self, route: str, body: dict[str, Any]) -> dict[str, Any]:
        request = urllib.request.Request(
            self.base_url + route,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        start = time.monotonic()
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                return json.loads(response.read())
        except urllib.error.HTTPError as err:
            error = json.loads(err.read() or b"{}").get("error", {})
            raise EndpointError(err.code, str(error.get("code")), str(error.get("message"))) from None
        finally:
            self.seconds += time.monotonic() - start


@dataclass
class _Slot:
    """One conversation's thread and result."""

    task: AgentTask
    done: bool = False
    outcome: Any = None
    failure: str = ""
    env_seconds: float = 0.0
    started: float = 0.0  # when the harness began (0: not yet)
    client: Any = None  # its ChatClient, whose ``seconds`` is time spent on the endpoint


def _env_seconds(slot: _Slot) -> float:
    """A finished harness's environment time; one abandoned at the deadline counts its time so
    far, less its finished endpoint requests (a hung environment's time is environment time)."""
    if slot.done or not slot.started:
        return slot.env_seconds
    return time.monotonic() - slot.started - slot.client.seconds


class AgentRollout(WrappedRollout):
    """Conversations of a harness over ``engine`` (module docstring).

    Args:
        engine: the rollout engine the endpoint serves (native, vLLM or SGLang).
        config: ``rollout`` settings (``agent``, ``response_length``, ``prompt_length``, ``n``).
        tokenizer: chat template and token ids.
        harness: runs each conversation.
        stop_ids: the ids that end a turn (EOS and ``rollout.stop_token_ids``).
        versions: the engine's weight versions on a separate rollout rank (module docstring);
            None when colocated (no version columns).
        progress: called about once a second while the conversations run within the deadline
            (the stall watchdog's ``alive``: harnesses waiting on slow tools leave this thread
            polling, which the watchdog would take for a hang); None: nobody to tell.
    """

    def __init__(
        self,
        engine: RolloutEngine,
        config: RolloutConfig,
        tokenizer: Any,
        harness: Harness,
        stop_ids: list[int],
        versions: WeightVersions | None = None,
        progress: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.config = config
        self.tokenizer = tokenizer
        self.harness = harness
        agent = config.agent
        limits = (config.prompt_length, config.response_length, agent.max_turns, agent.tool_call_format)
        settings = EndpointSettings(*limits, agent.host, agent.port, agent.batch_wait_s)
        self.endpoint = PolicyEndpoint(engine, tokenizer, settings, stop_ids, versions)
        self.versions, self.progress = versions, progress
        self._batches = itertools.count()
        self._warned = False  # the first harness exception of the run is shown, then counted only

    def wake_up(self) -> None:
        """The engine awake, then the endpoint listening (the rollout phase begins)."""
        self.engine.wake_up()
        self.endpoint.start()

    def sleep(self) -> None:
        """The endpoint's socket and thread gone, then the engine asleep (the phase ends)."""
        self.endpoint.stop()
        self.engine.sleep()

    def generate_sequences(self, prompts: DataProto) -> DataProto:
        """B*n conversations for a [B, Tp] prompt batch -> the engine's keys, plus the agent
        columns (``AGENT_COLUMNS``) in ``non_tensor_batch``."""
        if "raw_prompt" not in prompts.non_tensor_batch:
            raise ValueError(
                "rollout.agent needs the chat messages of each row: set data.return_raw_chat=true"
            )
        validate = bool(prompts.meta_info.get("validate", False))
        n = 1 if validate else resolve_sampling(self.config, prompts.meta_info).n
        started_here = not self.endpoint.running
        self.endpoint.start()
        start_version = self.versions.current() if self.versions is not None else -1
        try:
            slots = self._run(prompts, n, validate)
        finally:
            if started_here:
                self.endpoint.stop()
        return self._assemble(prompts, slots, n, start_version)

    def _run(self, prompts: DataProto, n: int, validate: bool) -> list[_Slot]:
        """Every conversation's slot, finished or abandoned at the deadline."""
        batch = next(self._batches)
        deadline = time.monotonic() + self.config.agent.deadline_s
        fields = {k: v for k, v in prompts.non_tensor_batch.items() if k != "raw_prompt"}
        slots = []
        for i in range(len(prompts) * n):
            row, tid = i // n, f"b{batch}-{i}"
            task = AgentTask(
                trajectory_id=tid,
                messages=list(prompts.non_tensor_batch["raw_prompt"][row]),
                row={k: v[row] for k, v in fields.items()},
                base_url=self.endpoint.url_for(tid),
                sample=i % n,
                validate=validate,
                deadline=deadline,
            )
            slots.append(_Slot(task))
        self.endpoint.accept_until(deadline)
        gate = threading.Semaphore(self.config.agent.max_concurrency)
        lock = threading.Lock()
        threads = [
            threading.Thread(
                target=self._converse, args=(s, gate, lock), daemon=True, name=f"agent-{s.task.trajectory_id}"
            )
            for s in slots
        ]
        for thread in threads:
            thread.start()

        def live() -> int:
            with lock:
                return min(sum(not s.done for s in slots), self.config.agent.max_concurrency)

        greedy = (True, 1.0, 1.0, -1) if validate else None
        version = prompts.meta_info.get("weights_version")  # the trainer's, for the whole call
        self.endpoint.serve(
            lambda: live() == 0, live, deadline, sampling=greedy, weights_version=version, alive=self.progress
        )
        with lock:  # a thread that ends from now on writes into a copy nobody reads
            finished = [_Slot(s.task, s.done, s.outcome, s.failure, _env_seconds(s)) for s in slots]
        for slot in finished:
            if not slot.done:
                slot.failure = "timeout"
        return finished

    def _converse(self, slot: _Slot, gate: threading.Semaphore, lock: threading.Lock) -> None:
        """Run the harness on one task (in its thread); file the outcome or the failure's cause."""
        with gate:
            client = ChatClient(
                slot.task.base_url, timeout=max(1.0, slot.task.deadline - time.monotonic() + 5.0)
            )
            start = time.monotonic()
            with lock:
                slot.started, slot.client = start, client
            outcome, failure = None, ""
            try:
                outcome = self.harness.run(slot.task, client)
                if not _valid(outcome):
                    failure = "invalid"
            except TimeoutError:  # a per-call limit of the environment (e.g. openenv's env_timeout_s)
                failure = "timeout"
            except (Exception, SystemExit) as err:  # the harness's failure (sys.exit too), not the step's
                failure = "error"
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"rollout.agent: a harness raised {type(err).__name__}: {err}", stacklevel=1
                    )
            with lock:
                slot.outcome, slot.failure = outcome, failure
                slot.env_seconds = time.monotonic() - start - client.seconds
                slot.done = True

    def _assemble(self, prompts: DataProto, slots: list[_Slot], n: int, start_version: int) -> DataProto:
        """The output batch: each trajectory's first prompt (left-padded to Tp) and its tokens."""
        input_ids, mask, _ = prompt_tensors(prompts)
        width, budget = input_ids.shape[1], self.config.response_length
        pad = pad_token_id(prompts.meta_info, self.tokenizer)
        ledger = self.endpoint.ledger
        columns: dict[str, list[Any]] = {key: [] for key in AGENT_COLUMNS}
        rows: list[list[int]] = []
        trajectories: list[Trajectory] = []
        for i, slot in enumerate(slots):
            own_prompt = input_ids[i // n][mask[i // n].bool()].tolist()
            trajectory = ledger.assemble(slot.task.trajectory_id) or Trajectory(prompt_ids=own_prompt)
            truncated = ledger.truncation(slot.task.trajectory_id) or ""
            if len(trajectory.prompt_ids) > width:  # refused by the endpoint already; kept safe
                trajectory, truncated = Trajectory(prompt_ids=own_prompt), "prompt_too_long"
            failure = slot.failure if not (slot.failure == "error" and truncated) else truncated
            if truncated == "prompt_too_long" and not failure and not any(trajectory.response_mask):
                failure = truncated  # none of the policy's tokens: no reward on an empty response
            if failure in ("error", "timeout", "invalid"):  # the environment's fault: not trained on
                trajectory.response_mask = [0] * len(trajectory.response_ids)
            rows.append(trajectory.prompt_ids)
            trajectories.append(trajectory)
            outcome = slot.outcome if not failure else None
            columns["agent_reward"].append(
                float(outcome.reward) if outcome else self.config.agent.failure_score
            )
            turn_rewards = [float(r) for r in outcome.turn_rewards] if outcome else []
            # By model call: a turn left out of the sample (context reset) leaves its reward out.
            kept = [turn_rewards[c] for c in trajectory.turn_calls if 0 <= c < len(turn_rewards)]
            columns["agent_turn_rewards"].append(kept)
            columns["agent_turn_ends"].append([e for e in trajectory.turn_ends if e < budget])
            columns["agent_failure"].append(failure)
            columns["agent_truncated"].append(truncated)
            columns["agent_turns"].append(trajectory.turns)
            columns["agent_tool_calls"].append(trajectory.tool_calls)
            columns["agent_env_seconds"].append(max(0.0, slot.env_seconds))
            columns["agent_context_resets"].append(trajectory.resets)
        ledger.clear()
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        attention = torch.zeros(len(rows), width, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row, dtype=torch.long)
            attention[i, width - len(row) :] = 1
        non_tensors = {k: np.repeat(v, n, axis=0) for k, v in prompts.non_tensor_batch.items()}
        non_tensors.update({k: _objects(v) for k, v in columns.items()})
        flat = DataProto.from_dict(
            {"input_ids": ids, "attention_mask": attention},
            non_tensors=non_tensors,
            meta_info=dict(prompts.meta_info),
        )
        out = conversation_output(flat, trajectories, budget, pad, 1)
        if self.versions is not None:
            out.batch["rollout_versions"] = _versions(trajectories, budget)
            first = [next((v for v in t.versions if v >= 0), start_version) for t in trajectories]
            out.batch["weight_version"] = torch.tensor(first, dtype=torch.long)
        return out


def _valid(outcome: Any) -> bool:
    if not isinstance(outcome, AgentOutcome):
        return False
    try:
        values = [float(outcome.reward), *(float(r) for r in outcome.turn_rewards)]
    except (TypeError, ValueError):
        return False
    return all(math.isfinite(v) for v in values)


def _versions(trajectories: list[Trajectory], budget: int) -> torch.Tensor:
    """[B*n, budget] each response token's weight version; -1 on the environment's and padding."""
    out = torch.full((len(trajectories), budget), -1, dtype=torch.long)
    for i, trajectory in enumerate(trajectories):
        versions = trajectory.versions[:budget]
        out[i, : len(versions)] = torch.tensor(versions, dtype=torch.long)
    return out


def _objects(values: list[Any]) -> np.ndarray:
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out
