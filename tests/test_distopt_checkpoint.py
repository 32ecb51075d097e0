"""Checkpoints of megatron's distributed optimizer at dp=2 (issue 18, item 3).

A dp=2 job with the distributed optimizer trains two steps, saves, and trains two more; a second
job builds a fresh model and optimizer (other weights), loads, and trains the same two steps. The
resumed steps must be bit-identical to the uninterrupted ones (losses and weights): Adam's moments,
step count, the fp32 master shards and the scheduler all come back. A resume that switches the
optimizer kind (distributed <-> plain) is refused naming the setting: the two lay out the
optimizer's common state differently.
"""

from __future__ import annotations

import pytest
import torch

from tests.test_checkpoint import _setup, _train_step

DISTOPT = {"use_distributed_optimizer": True}
OVERLAP = {**DISTOPT, "overlap_grad_reduce": True, "overlap_param_gather": True}


def _weights(chunks) -> dict[str, torch.Tensor]:
    from megatron.core import parallel_state as ps

    from verl_megatron.models.megatron_model import gather_updated_params
    from verl_megatron.models.sharding import gather_full_state

    gather_updated_params(chunks)
    weights = gather_full_state(chunks)
    return weights if ps.get_data_parallel_rank() == 0 else {}


def resume_job(root: str, optim: dict, load: bool, before: int = 2, after: int = 2) -> dict:
    """``load=False``: train ``before`` steps, save, train ``after`` more; ``load=True``: load, train ``after``."""
    from verl_megatron.checkpoint import load_checkpoint, save_checkpoint

    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=99 if load else 3, optim=optim)
    if load:
        step = load_checkpoint(
            root, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime
        )["step"]
    else:
        for step in range(before):
            _train_step(runtime, chunks, optimizer, scheduler, step)
        step = before
        save_checkpoint(
            root,
            step,
            chunks=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            extra_state={"step": step},
            runtime=runtime,
        )
    losses = [_train_step(runtime, chunks, optimizer, scheduler, step + i) for i in range(after)]
    return {"losses": losses, "weights": _weights(chunks), "lr": [g["lr"] for g in optimizer.param_groups]}


def _assert_bit_identical(got: list[dict], want: list[dict]) -> None:
    assert [r["losses"] for r in got] == [r["losses"] for r in want], (
        f"losses after resuming {[r['losses'] for r in got]} != uninterrupted {[r['losses'] for r in want]}"
    )
    assert got[0]["lr"] == want[0]["lr"]
    assert got[0]["weights"].keys() == want[0]["weights"].keys() and want[0]["weights"]
    for name, tensor in want[0]["weights"].items():
        diff = (got[0]["weights"][name] - tensor).abs().max().item()
        assert torch.equal(got[0]["weights"][name], tensor), f"weight {name} differs by up to {diff:.3e}"


@pytest.mark.parametrize("optim", [DISTOPT, OVERLAP], ids=["distopt", "distopt-overlap"])
def test_distributed_optimizer_resumes_bit_identically_at_dp2(pool2, tmp_path, optim):
    uninterrupted = pool2.run(f"{__name__}:resume_job", root=str(tmp_path), optim=optim, load=False)
    resumed = pool2.run(f"{__name__}:resume_job", root=str(tmp_path), optim=optim, load=True)
    _assert_bit_identical(resumed, uninterrupted)


def test_switching_the_optimizer_kind_on_resume_is_named(pool1, pool2, tmp_path):
    """Before anything is changed, one line naming the setting (megatron itself fails with a KeyError)."""
    pool2.run(f"{__name__}:resume_job", root=str(tmp_path), optim=DISTOPT, load=False, after=0)
    with pytest.raises(
        RuntimeError, match=r"CheckpointMismatchError: .*saved with use_distributed_optimizer=True"
    ):
        pool1.run(f"{__name__}:resume_job", root=str(tmp_path), optim={}, load=True, after=0)
