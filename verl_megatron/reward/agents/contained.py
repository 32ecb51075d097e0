"""A harness contained in worker processes: each trajectory's ``run`` outside the trainer.

``rollout.agent.harness: verifiers`` and custom harnesses (``my_agent.py:make``) are wrapped in
:class:`ContainedHarness` unless ``rollout.agent.kwargs.isolation: none`` (trusted code, run in
the rollout's thread). Its ``run(task, client)`` forks a worker process for the trajectory
(``worker.py``: killed with the trainer, inherited file descriptors closed, so a harness opens
its files and connections in ``run``) that calls the wrapped harness's ``run(task, client)`` on
its copies of both: the client is the trajectory's HTTP :class:`ChatClient` of the endpoint, so
the worker's requests reach the trainer's engine as the thread's would. The outcome comes back
as plain data (``reward``, ``turn_rewards``, ``info``) and the time the client waited on the
endpoint is added to the caller's client. The run's wall limit is the batch's deadline
(``rollout.agent.deadline_s``): past it the worker is killed and ``run`` raises TimeoutError
(``timeout``); a harness that raises, or kills its worker (``os._exit``, a crash), raises
RuntimeError (``error``; one that raised TimeoutError: TimeoutError); a result that is not an
AgentOutcome, or does not cross processes, returns None (``invalid``). The worker is killed and
reaped before ``run`` returns or raises.
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from typing import Any

from verl_megatron.rollout.agent import AgentOutcome, AgentTask, ChatClient
from verl_megatron.utils.call_worker import CallWorker

__all__ = ["ContainedHarness"]

_FIELDS = tuple(f.name for f in dataclasses.fields(AgentOutcome))


def _plain(outcome: Any) -> dict[str, Any] | None:
    """An AgentOutcome's fields as a dict that pickles; None for anything else (``invalid``)."""
    if not isinstance(outcome, AgentOutcome):
        return None
    fields = {name: getattr(outcome, name) for name in _FIELDS}
    try:
        pickle.dumps(fields)
    except Exception:  # e.g. an info value holding a lock or a lambda
        return None
    return fields


class _RunServer:
    """Runs in the worker: the harness's ``run`` on the trajectory's task and client."""

    def __init__(self, harness: Any, task: AgentTask, client: Any) -> None:
        self.harness, self.task, self.client = harness, task, client

    def __call__(self, op: str, args: Any) -> dict[str, Any]:
        reply: dict[str, Any] = {"outcome": None, "raised": "", "timeout": False}
        waited = getattr(self.client, "seconds", 0.0)
        try:
            reply["outcome"] = _plain(self.harness.run(self.task, self.client))
        except BaseException as err:  # SystemExit from the harness is its failure too
            reply.update(raised=f"{type(err).__name__}: {err}", timeout=isinstance(err, TimeoutError))
        reply["seconds"] = float(getattr(self.client, "seconds", 0.0) - waited)  # on the endpoint
        return reply


class ContainedHarness:
    """``harness.run`` per trajectory in a worker process of its own (module docstring)."""

    def __init__(self, harness: Any) -> None:
        self.harness = harness

    def run(self, task: AgentTask, client: ChatClient) -> AgentOutcome | None:
        if task.deadline <= time.monotonic():
            raise TimeoutError("rollout.agent.deadline_s passed before the harness started")
        worker = CallWorker(_RunServer(self.harness, task, client), "harness", "rollout.agent.deadline_s")
        try:
            reply = worker.call("run", None, task.deadline - time.monotonic())
        finally:
            worker.kill()
        if hasattr(client, "seconds"):
            client.seconds += reply["seconds"]
        if reply["raised"]:
            message = f"the harness's run() raised {reply['raised']}"
            raise TimeoutError(message) if reply["timeout"] else RuntimeError(message)
        return None if reply["outcome"] is None else AgentOutcome(**reply["outcome"])
