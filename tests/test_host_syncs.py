"""Host syncs of an actor update do not grow with the number of micro-batches (issue 18, item 10).

Every ``Tensor.item`` / ``tolist`` / ``float()`` / ``int()`` / ``bool()`` during ``update_policy``
is counted (on a GPU each waits for the device). The same mini-batches cut into 1-row or 2-row
micro-batches must count the same: the policy-loss metrics stay device tensors within the
Megatron loss path and reach the host once per mini-batch. verl's public policy-loss functions
still return float metrics.
"""

from __future__ import annotations

import contextlib
import sys
from collections import Counter
from types import SimpleNamespace

import pytest
import torch

from tests.test_actor_update import TEMPERATURE, build_actor, make_batch

_SYNCS = ("item", "tolist", "__float__", "__int__", "__bool__")
_HOST_SIDE = ("verl_megatron/workers/batching.py",)


def _host_side() -> bool:
    """Micro-batches are cut from the host copy of the batch (CPU tensors on a GPU run too)."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_filename.endswith(_HOST_SIDE):
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def counting_syncs(counts: Counter):
    """Count the syncs (``int(t)`` calling ``t.item()`` inside counts once) outside host-side code."""
    originals = {name: getattr(torch.Tensor, name) for name in _SYNCS}
    depth = [0]

    def counted(name):
        def call(self, *args, **kwargs):
            if depth[0] == 0 and not _host_side():
                counts[name] += 1
            depth[0] += 1
            try:
                return originals[name](self, *args, **kwargs)
            finally:
                depth[0] -= 1

        return call

    for name in _SYNCS:
        setattr(torch.Tensor, name, counted(name))
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


def sync_job(path: str, micro_batch_sizes: list[int]) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.protocol import DataProto
    from verl_megatron.workers.config import ActorConfig, OptimConfig

    runtime = init_runtime(ParallelLayout(), seed=5)
    out = {}
    for micro in micro_batch_sizes:
        cfg = ActorConfig(
            ppo_mini_batch_size=4,
            ppo_micro_batch_size_per_gpu=micro,
            entropy_coeff=0.01,
            use_kl_loss=True,
            kl_loss_coef=0.1,
            optim=OptimConfig(lr=1e-2, weight_decay=0.0, clip_grad=1.0),
        )
        _, actor = build_actor(runtime, path, cfg)
        data = DataProto.from_dict(make_batch(), meta_info={"temperature": TEMPERATURE})
        data.batch["old_log_probs"], _ = actor.compute_log_prob(data)
        data.batch["ref_log_prob"] = data.batch["old_log_probs"] - 0.3 * data.batch["response_mask"]
        counts: Counter = Counter()
        with counting_syncs(counts):
            metrics = actor.update_policy(data)
        out[micro] = {"counts": dict(counts), "metrics": metrics}
    return out


def test_actor_update_syncs_do_not_grow_with_micro_batches(pool1, model_path):
    runs = pool1.run(f"{__name__}:sync_job", path=model_path, micro_batch_sizes=[2, 1])[0]
    coarse, fine = runs[2]["counts"], runs[1]["counts"]
    # 8 rows, mini-batches of 4: 4 micro-batches of 2 rows against 8 of 1 row.
    assert sum(fine.values()) == sum(coarse.values()), f"2-row micro-batches {coarse}, 1-row {fine}"
    # The same update either way: the metrics agree to float32 summation order.
    for name in ("actor/pg_clipfrac", "actor/ppo_kl", "actor/pg_loss"):
        assert runs[1]["metrics"][name] == pytest.approx(runs[2]["metrics"][name], rel=1e-5, abs=1e-7), name


def test_public_policy_losses_still_return_float_metrics():
    from verl_megatron.algos.policy_losses import metrics_on_device
    from verl_megatron.trainer.ppo import core_algos

    g = torch.Generator().manual_seed(0)
    old, new, adv = (torch.randn(3, 4, generator=g) for _ in range(3))
    mask = torch.ones(3, 4)
    config = SimpleNamespace(clip_ratio=0.2, policy_loss=SimpleNamespace(dro_beta=1.0))
    modes = sorted(set(core_algos.POLICY_LOSS_REGISTRY) - {"bypass_mode"})  # bypass needs rollout log-probs
    assert len(modes) >= 10
    with_metrics = 0
    for mode in modes:
        fn = core_algos.get_policy_loss_fn(mode)
        _, metrics = fn(old, new, adv, mask, "token-mean", config)
        assert all(type(v) is float for v in metrics.values()), (mode, metrics)
        with metrics_on_device():
            _, on_device = fn(old, new, adv, mask, "token-mean", config)
        assert all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in on_device.values()), (
            mode,
            on_device,
        )
        assert {k: float(v) for k, v in on_device.items()} == metrics, mode
        with_metrics += bool(metrics)
    assert with_metrics >= 9  # gpg reports none, as in verl
