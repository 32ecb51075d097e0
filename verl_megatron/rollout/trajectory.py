"""Every token the endpoint generated, filed by trajectory, and its assembly into one sample.

Each model call of a trajectory is a :class:`TurnRecord`: its prompt ids, the ids the engine
sampled and their log-probs. A trajectory's sample is its last turn's context (prompt + sampled
ids); the earlier turns whose context is a prefix of it are the policy's segments inside it
(``response_mask`` 1, their sampling log-probs), everything else after the first prompt is the
environment's (mask 0). Nothing is re-tokenized: the ids are the engine's. Each turn also records
the weight version that generated it (``rollout.placement=separate``: the rollout rank may load
newer weights between two turns), so a trajectory's tokens carry their version one by one.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Trajectory", "TrajectoryLedger", "TurnRecord"]


@dataclass
class TurnRecord:
    """One model call of a trajectory (one choice of it when ``n`` > 1)."""

    request_id: str
    prompt_ids: list[int]
    completion_ids: list[int]
    log_probs: list[float]
    finish_reason: str
    prompt_text: str | None = None  # chat requests: the rendered history
    message: dict[str, Any] | None = None  # chat requests: the assistant message returned
    tool_calls: int = 0
    version: int = -1  # the weight version that generated it (-1: not tracked, colocated)
    call: int = -1  # which model call of the trajectory it answered (0, 1, ...; set when filed)

    @property
    def context(self) -> list[int]:
        return self.prompt_ids + self.completion_ids


@dataclass
class Trajectory:
    """One trajectory as a sample: ``prompt_ids`` then ``response_ids`` (policy and environment
    tokens), ``response_mask`` 1 on the policy's, ``log_probs`` (0 on the environment's),
    ``versions`` each token's weight version (-1 on the environment's), ``turn_ends`` the
    response index of each policy turn's last token, ``turn_calls`` which model call of the
    trajectory each of those turns was (its ``turn_rewards`` index; turns left out are skipped)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    response_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    turn_ends: list[int] = field(default_factory=list)
    turn_calls: list[int] = field(default_factory=list)
    turns: int = 0
    tool_calls: int = 0
    resets: int = 0  # turns left out: the history was rewritten after them


class TrajectoryLedger:
    """Turn records by trajectory id, written by the endpoint's request threads."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._records: dict[str, list[TurnRecord]] = {}
        self._truncated: dict[str, str] = {}
        self._calls: dict[str, int] = {}

    def add(self, trajectory_id: str, *records: TurnRecord) -> None:
        """File the choices of one model call (numbering the call)."""
        with self._lock:
            call = self._calls.get(trajectory_id, 0)
            self._calls[trajectory_id] = call + 1
            for record in records:
                record.call = call
            self._records.setdefault(trajectory_id, []).extend(records)

    def records(self, trajectory_id: str) -> list[TurnRecord]:
        with self._lock:
            return list(self._records.get(trajectory_id, []))

    def mark_truncated(self, trajectory_id: str, cause: str) -> None:
        with self._lock:
            self._truncated.setdefault(trajectory_id, cause)

    def truncation(self, trajectory_id: str) -> str | None:
        """Why a request of this trajectory was refused (``max_turns``, ``token_budget``,
        ``prompt_too_long``), or None."""
        with self._lock:
            return self._truncated.get(trajectory_id)

    def clear(self) -> None:
        with self._lock:
            self._records.clear()
            self._truncated.clear()
            self._calls.clear()

    def budget(self, trajectory_id: str, prompt_ids: list[int]) -> tuple[int, int]:
        """(turns taken, response tokens already used before ``prompt_ids``'s end): the tokens
        after the trajectory's first prompt, when ``prompt_ids`` continues it."""
        records = self.records(trajectory_id)
        if not records:
            return 0, 0
        root = records[0].prompt_ids
        if prompt_ids[: len(root)] != root:
            return len(records), 0
        return len(records), len(prompt_ids) - len(root)

    def assemble(self, trajectory_id: str) -> Trajectory | None:
        """The trajectory's sample (module docstring); None when it made no model call."""
        records = self.records(trajectory_id)
        if not records:
            return None
        chain = [records[-1]]
        for record in reversed(records[:-1]):
            context = record.context
            if chain[0].prompt_ids[: len(context)] == context:
                chain.insert(0, record)
        final, root, first = chain[-1].context, records[0].prompt_ids, chain[0].prompt_ids
        # After a rewritten history the chain may start at a later turn: its prompt still extends
        # the first one (the endpoint counted what follows it as response tokens), so the sample
        # keeps the first prompt and the rest is the environment's.
        start = len(root) if first[: len(root)] == root else len(first)
        out = Trajectory(prompt_ids=list(first[:start]), resets=len(records) - len(chain))
        out.response_ids = final[start:]
        out.response_mask = [0] * len(out.response_ids)
        out.log_probs = [0.0] * len(out.response_ids)
        out.versions = [-1] * len(out.response_ids)
        for record in chain:
            begin = len(record.prompt_ids) - start
            for k, log_prob in enumerate(record.log_probs):
                out.response_mask[begin + k] = 1
                out.log_probs[begin + k] = float(log_prob)
                out.versions[begin + k] = record.version
            if record.completion_ids:
                out.turn_ends.append(begin + len(record.completion_ids) - 1)
                out.turn_calls.append(record.call)
            out.turns += 1
            out.tool_calls += record.tool_calls
        return out
