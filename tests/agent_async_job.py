"""The 2-process torchrun job behind tests/test_agent_async.py (rank 0 trains, rank 1 generates).

    torchrun --nproc_per_node=2 tests/agent_async_job.py OUT_DIR

configs/quickstart_agent.yaml at rollout.placement=separate for 2 steps, one-step off-policy
with partial rollout. The tools harness runs on the rollout rank behind a client that logs every
reply (prompt and sampled ids, log-probs, weight version) and the outcome, and orders step 2's
conversations around the weight update: its even samples call first, and the trainer sends
weights version 1 only once each of them has its first reply (each harness runs in a worker
process of its own, started one after another); its odd samples call only after that send. The
trainer saves each batch it receives.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
import time
from typing import Any

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECIPE = os.path.join(ROOT, "configs", "quickstart_agent.yaml")
_WRITE = threading.Lock()


def _wait_for(path: str, timeout: float = 400.0) -> None:  # a loaded machine: minutes
    until = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > until:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.01)


def _append(path: str, row: dict[str, Any]) -> None:
    with _WRITE, open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


class _GatedClient:
    """The harness's client: step 2's odd samples wait for weights version 1; every reply is logged."""

    def __init__(self, client: Any, out: str, trajectory_id: str) -> None:
        self.client, self.out, self.trajectory_id = client, out, trajectory_id
        batch, sample = (int(x) for x in re.fullmatch(r"b(\d+)-(\d+)", trajectory_id).groups())
        self.step, self.sample = batch + 1, sample
        self.seconds = 0.0

    def chat(self, messages: list[dict], tools: list[dict] | None = None, **params: Any) -> dict:
        if self.step == 2 and self.sample % 2 == 1:
            _wait_for(os.path.join(self.out, "weights-1"))
        reply = self.client.chat(messages, tools=tools, **{**params, "logprobs": True})
        choice = reply["choices"][0]
        _append(os.path.join(self.out, "calls.jsonl"), {
            "trajectory": self.trajectory_id, "step": self.step, "sample": self.sample,
            "prompt_ids": reply["prompt_token_ids"], "token_ids": choice["token_ids"],
            "log_probs": [p["logprob"] for p in choice["logprobs"]["content"]],
            "version": reply["weight_version"],
        })  # fmt: skip
        if self.step == 2 and self.sample % 2 == 0:
            open(os.path.join(self.out, f"replied-{self.sample}"), "w").close()
        return reply


class GatedTools:
    """The tools harness (``reward/agents/tools.py``) behind :class:`_GatedClient`."""

    def __init__(self, out: str, **kwargs: Any) -> None:
        from verl_megatron.reward.agents.tools import ToolHarness
        from verl_megatron.rollout.config import AgentConfig

        self.out, self.inner = out, ToolHarness(AgentConfig(), **kwargs)

    def run(self, task: Any, client: Any) -> Any:
        outcome = self.inner.run(task, _GatedClient(client, self.out, task.trajectory_id))
        _append(
            os.path.join(self.out, "outcomes.jsonl"),
            {"trajectory": task.trajectory_id, "reward": outcome.reward},
        )
        return outcome


def gated_tools(**kwargs: Any) -> GatedTools:
    return GatedTools(**kwargs)


def main(out: str) -> None:
    from verl_megatron.train import run
    from verl_megatron.trainer.async_trainer import AsyncRolloutLink

    next_batch, after_update = AsyncRolloutLink.next_batch, AsyncRolloutLink.after_update

    def saving_next_batch(self, step, timing):
        batch, metrics = next_batch(self, step, timing)
        keys = (
            "responses",
            "response_mask",
            "rollout_log_probs",
            "rollout_versions",
            "weight_version",
            "input_ids",
        )
        saved = {k: batch.batch[k].clone() for k in keys}
        saved.update({k: list(batch.non_tensor_batch[k]) for k in ("agent_reward", "agent_failure")})
        torch.save(saved, os.path.join(out, f"batch-{step}.pt"))
        return batch, metrics

    def ordered_after_update(self, step, timing):
        if step == 1:  # weights version 1 only once each of step 2's early conversations has replied
            for sample in (0, 2, 4, 6):
                _wait_for(os.path.join(out, f"replied-{sample}"))
        after_update(self, step, timing)
        if step == 1:
            open(os.path.join(out, "weights-1"), "w").close()

    AsyncRolloutLink.next_batch, AsyncRolloutLink.after_update = saving_next_batch, ordered_after_update
    try:  # a pool rank (tests/separate_in_pool.py) runs later jobs with the class as it was
        _run(run, out)
    finally:
        AsyncRolloutLink.next_batch, AsyncRolloutLink.after_update = next_batch, after_update


def _run(run: Any, out: str) -> None:
    run(RECIPE, [
        f"trainer.default_local_dir={out}/run", f"quickstart.assets_dir={out}/assets",
        "trainer.total_training_steps=2", "data.train_batch_size=2", "rollout.n=4",
        "actor.ppo_mini_batch_size=2", "trainer.val_before_train=false", "trainer.test_freq=-1",
        "trainer.logger=[jsonl]", "rollout.placement=separate", "rollout.world_size=1",
        "async_training.max_staleness=1", "async_training.partial_rollout=true",
        "async_training.partial_rollout_segment=4", "algorithm.rollout_correction.rollout_is=token",
        "rollout.agent.harness=tests.agent_async_job:gated_tools", f"rollout.agent.kwargs.out={out}",
        "rollout.agent.deadline_s=550",  # step 2's odd samples wait for the trainer's step 1
    ])  # fmt: skip


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    main(sys.argv[1])
