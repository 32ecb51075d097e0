"""Checkpoints of a tiny megatron GPT: exact round trips, other layouts, interrupted saves, bad input.

A job trains a few steps (dropout on, so the RNG streams matter; an LR/WD
scheduler, so its state matters), saves, and reports what it holds as whole
tensors by global name. Loading jobs start from different weights and must
end with exactly the saved ones. Resharding is a pure copy, so even across
layouts weights and Adam moments must be bit-identical.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.tiny_gpt import make_gpt, run_schedule

VOCAB, SEQ, HIDDEN, LAYERS, HEADS, GROUPS, FFN = 64, 8, 32, 4, 4, 2, 48
BATCH, MICRO = 4, 2


def _make_gpt(pre: bool, post: bool, vp_stage, hidden: int = HIDDEN):
    return make_gpt(
        pre, post, vp_stage, vocab=VOCAB, seq=SEQ, hidden=hidden, layers=LAYERS, heads=HEADS,
        groups=GROUPS, ffn=FFN, dtype=torch.float32,
        # Dropout makes the next step depend on the restored RNG streams.
        hidden_dropout=0.1,
        # SwiGLU: fc1 is saved through a ShardedTensorFactory (gate and up halves).
        gated_linear_unit=True, activation_func=torch.nn.functional.silu, bias_activation_fusion=False,
    )  # fmt: skip


def _runtime(tp: int, pp: int, vpp: int | None):
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    return init_runtime(ParallelLayout(tp=tp, pp=pp, vpp=vpp), seed=11)


def _build(runtime, init_seed: int, hidden: int = HIDDEN, optim: dict | None = None):
    """Model chunks (weights from ``init_seed``), megatron optimizer and LR/WD scheduler.

    ``optim``: extra ``OptimSettings`` fields (e.g. the distributed optimizer).
    """
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    from verl_megatron.models.megatron_model import (
        OptimSettings,
        attach_schedule_hooks,
        build_chunks,
        build_optimizer,
        wrap_ddp,
    )
    from verl_megatron.models.sharding import load_full_state, seeded_tensor

    chunks = build_chunks(runtime, lambda pre, post, vp: _make_gpt(pre, post, vp, hidden))
    load_full_state(chunks, lambda name, shape: seeded_tensor(name, shape, seed=init_seed))
    settings = OptimSettings(lr=1e-2, weight_decay=0.05, clip_grad=1.0, **(optim or {}))
    chunks = wrap_ddp(chunks, settings)
    attach_schedule_hooks(chunks)
    optimizer = build_optimizer(chunks, settings)
    scheduler = OptimizerParamScheduler(
        optimizer,
        init_lr=0.0,
        max_lr=1e-2,
        min_lr=1e-3,
        lr_warmup_steps=2,
        lr_decay_steps=10,
        lr_decay_style="cosine",
        start_wd=0.0,
        end_wd=0.1,
        wd_incr_steps=10,
        wd_incr_style="linear",
    )
    return chunks, optimizer, scheduler


def _setup(
    tp: int, pp: int, vpp: int | None, init_seed: int, hidden: int = HIDDEN, optim: dict | None = None
):
    runtime = _runtime(tp, pp, vpp)
    return (runtime, *_build(runtime, init_seed, hidden, optim))


def _train_step(runtime, chunks, optimizer, scheduler, step: int) -> float:
    """One optimizer step on batch ``step``; returns the summed token loss over the whole job."""
    from megatron.core import parallel_state as ps

    from verl_megatron.models.megatron_model import zero_grads

    g = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=g)
    dp, dp_rank = runtime.layout.dp, ps.get_data_parallel_rank()
    rows = slice(dp_rank * BATCH // dp, (dp_rank + 1) * BATCH // dp)
    ids, labels = tokens[rows, :-1], tokens[rows, 1:]
    num_micro = ids.shape[0] // MICRO

    def micro_batches():
        for i in range(num_micro):
            yield ids[i * MICRO : (i + 1) * MICRO], labels[i * MICRO : (i + 1) * MICRO]

    def forward_step(data_iterator, model):
        x, y = next(data_iterator)
        positions = torch.arange(SEQ).unsqueeze(0).expand(x.shape[0], -1)
        out = model(x, positions, None, labels=y)
        return out, lambda per_token: (per_token.mean(), {"sum": per_token.sum().detach()})

    zero_grads(chunks, optimizer)
    out = run_schedule(chunks, micro_batches, forward_step, num_micro, seq=SEQ, micro_batch=MICRO)
    ok, _, _ = optimizer.step()
    assert ok
    scheduler.step(1)
    return float(sum(float(o["sum"]) for o in out)) if out else 0.0


def _torch_optimizers(optimizer):
    return [sub.optimizer for sub in optimizer.chained_optimizers]


def _gate_up_order(name: str, full: torch.Tensor, tp_size: int) -> torch.Tensor:
    """SwiGLU fc1 as [gate; up] whatever the tp size.

    Each tp rank holds [gate_r; up_r], so concatenating shards gives
    [gate_0; up_0; gate_1; up_1; ...]; the checkpoint stores gate and up apart.
    """
    if not name.endswith("linear_fc1.weight"):
        return full
    pieces = full.chunk(2 * tp_size, dim=0)
    return torch.cat(pieces[0::2] + pieces[1::2], dim=0)


def _snapshot(chunks, optimizer, scheduler) -> dict:
    """Whole weights and Adam moments by global name (dp rank 0 / tp rank 0), scheduler state."""
    from megatron.core import parallel_state as ps

    from verl_megatron.models.sharding import gather_full_state, gather_tp, named_global_parameters

    tp_group, tp_size = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
    state = {}
    for opt in _torch_optimizers(optimizer):
        state.update(opt.state)
    moments, steps = {}, set()
    for name, param in named_global_parameters(chunks):
        if state.get(param):
            steps.add(int(state[param]["step"]))
            for key in ("exp_avg", "exp_avg_sq"):
                full = gather_tp(state[param][key], param, tp_group, tp_size)
                moments[f"{name}:{key}"] = _gate_up_order(name, full, tp_size)
    weights = {name: _gate_up_order(name, w, tp_size) for name, w in gather_full_state(chunks).items()}
    keep = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    return {
        "weights": weights if keep else {},
        "moments": moments if keep else {},
        "adam_steps": sorted(steps),
        "scheduler": scheduler.state_dict(),
        "lr": [g["lr"] for g in optimizer.param_groups],
    }


def save_job(root: str, tp: int, pp: int, vpp: int | None, steps: int, then: int = 1) -> dict:
    """Train ``steps`` steps, save at ``steps``, report, then train ``then`` more steps and report again."""
    from verl_megatron.checkpoint import save_checkpoint

    runtime, chunks, optimizer, scheduler = _setup(tp, pp, vpp, init_seed=3)
    for step in range(steps):
        _train_step(runtime, chunks, optimizer, scheduler, step)
    extra = {"global_steps": steps, "dataloader": {"epoch": 1, "index": 7}, "kl_coef": 0.0125}
    save_checkpoint(
        root,
        steps,
        chunks=chunks,
        optimizer=optimizer,
        scheduler=scheduler,
        extra_state=extra,
        runtime=runtime,
    )
    saved = _snapshot(chunks, optimizer, scheduler)
    losses = [_train_step(runtime, chunks, optimizer, scheduler, steps + i) for i in range(then)]
    return {"saved": saved, "after": _snapshot(chunks, optimizer, scheduler), "losses": losses}


def load_job(root: str, tp: int, pp: int, vpp: int | None, then: int = 0, load_rng: bool = True) -> dict:
    """Fresh model (other weights), load, report, then train ``then`` steps and report again."""
    from verl_megatron.checkpoint import load_checkpoint

    runtime, chunks, optimizer, scheduler = _setup(tp, pp, vpp, init_seed=99)
    # Advance the RNGs so that restoring them is visible.
    torch.rand(5), random.random(), np.random.rand()
    extra = load_checkpoint(
        root, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime, load_rng=load_rng
    )
    loaded = _snapshot(chunks, optimizer, scheduler)
    step = extra["global_steps"]
    losses = [_train_step(runtime, chunks, optimizer, scheduler, step + i) for i in range(then)]
    return {
        "extra": extra,
        "loaded": loaded,
        "after": _snapshot(chunks, optimizer, scheduler),
        "losses": losses,
    }


def _merge(results: list[dict], key: str) -> dict:
    out = {"weights": {}, "moments": {}}
    for r in results:
        out["weights"].update(r[key]["weights"])
        out["moments"].update(r[key]["moments"])
    out["scheduler"] = results[0][key]["scheduler"]
    out["lr"] = results[0][key]["lr"]
    out["adam_steps"] = sorted({s for r in results for s in r[key]["adam_steps"]})
    return out


def _assert_identical(got: dict, want: dict) -> None:
    assert got["weights"].keys() == want["weights"].keys()
    assert got["moments"].keys() == want["moments"].keys()
    assert len(want["moments"]) == 2 * len(want["weights"])
    for name, tensor in want["weights"].items():
        assert torch.equal(got["weights"][name], tensor), f"weight {name} differs"
    for name, tensor in want["moments"].items():
        assert torch.equal(got["moments"][name], tensor), f"Adam moment {name} differs"
    assert got["scheduler"] == want["scheduler"]
    assert got["adam_steps"] == want["adam_steps"]


@pytest.fixture(scope="module")
def tp2_checkpoint(pool2, tmp_path_factory) -> tuple[Path, dict]:
    """A checkpoint saved at step 2 by a tp=2 job, and what that job held then and one step later."""
    root = tmp_path_factory.mktemp("ckpt_tp2")
    return root, pool2.run(f"{__name__}:save_job", root=str(root), tp=2, pp=1, vpp=None, steps=2)


def test_same_layout_round_trip_is_exact(pool2, tp2_checkpoint):
    root, saved = tp2_checkpoint
    loaded = pool2.run(f"{__name__}:load_job", root=str(root), tp=2, pp=1, vpp=None, then=1)
    want = _merge(saved, "saved")
    _assert_identical(_merge(loaded, "loaded"), want)
    # Two Adam steps were taken, the scheduler is past its 2 warmup steps.
    assert want["adam_steps"] == [2]
    assert want["scheduler"]["num_steps"] == 2
    assert want["lr"][0] == pytest.approx(1e-2)
    assert loaded[0]["extra"] == {
        "global_steps": 2,
        "dataloader": {"epoch": 1, "index": 7},
        "kl_coef": 0.0125,
    }
    # One more step after loading equals one more step without the save/load:
    # same loss (same dropout masks from the restored RNGs) and same state.
    assert [r["losses"] for r in loaded] == [r["losses"] for r in saved]
    _assert_identical(_merge(loaded, "after"), _merge(saved, "after"))
    # Without the RNG states the dropout masks differ: the check above has teeth.
    no_rng = pool2.run(f"{__name__}:load_job", root=str(root), tp=2, pp=1, vpp=None, then=1, load_rng=False)
    assert [r["losses"] for r in no_rng] != [r["losses"] for r in saved]


@pytest.mark.parametrize(("tp", "pp", "vpp"), [(1, 2, None), (1, 2, 2)], ids=["pp2", "pp2-vpp2"])
def test_tp2_checkpoint_loads_under_pipeline_layouts(pool2, tp2_checkpoint, tp, pp, vpp):
    root, saved = tp2_checkpoint
    loaded = pool2.run(f"{__name__}:load_job", root=str(root), tp=tp, pp=pp, vpp=vpp)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))


def test_tp2_checkpoint_loads_in_one_process(pool1, tp2_checkpoint):
    root, saved = tp2_checkpoint
    loaded = pool1.run(f"{__name__}:load_job", root=str(root), tp=1, pp=1, vpp=None)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))
    assert loaded[0]["extra"]["kl_coef"] == 0.0125


def test_dp2_save_is_split_over_replicas_and_loads_in_one_process(pool1, pool2, tmp_path):
    saved = pool2.run(f"{__name__}:save_job", root=str(tmp_path), tp=1, pp=1, vpp=None, steps=1, then=0)
    loaded = pool1.run(f"{__name__}:load_job", root=str(tmp_path), tp=1, pp=1, vpp=None)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))
    # The fully-parallel writer spreads the shards of the replicated model over both ranks.
    shard_files = sorted(p.name for p in (tmp_path / "global_step_1" / "model").glob("*.distcp"))
    assert {name.split("_")[2] for name in shard_files} == {"0", "1"}, shard_files


def _differences(before: dict, after: dict) -> list[str]:
    """Names of weights/moments/scheduler entries that are not bit-identical."""
    diffs = [f"weight {k}" for k, v in before["weights"].items() if not torch.equal(v, after["weights"][k])]
    diffs += [
        f"moment {k}"
        for k, v in before["moments"].items()
        if not torch.equal(v, after["moments"].get(k, v + 1))
    ]
    if before["moments"].keys() != after["moments"].keys():
        diffs.append("optimizer state keys")
    if before["scheduler"] != after["scheduler"] or before["lr"] != after["lr"]:
        diffs.append("scheduler")
    return diffs


def _damage(src: Path, dst: Path, how: str) -> Path:
    import shutil

    shutil.copytree(src, dst)
    part = dst / "global_step_1" / "model"
    if how == "truncate":
        shard = sorted(part.glob("*.distcp"))[0]
        shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    else:  # same size, other content: passes the size check, fails the checksum
        target = part / how
        target.write_bytes(bytes(reversed(target.read_bytes())))
    return dst


def bad_input_job(root: str) -> dict:
    """Every failed load names the problem, and leaves model, optimizer and scheduler as they were."""
    from verl_megatron.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
    from verl_megatron.checkpoint.optimizer_state import has_state as _has_state

    root = Path(root)
    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=3)
    _train_step(runtime, chunks, optimizer, scheduler, 0)
    save_checkpoint(
        root / "good", 1, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime
    )
    save_checkpoint(root / "weights_only", 1, chunks=chunks, runtime=runtime)
    _train_step(runtime, chunks, optimizer, scheduler, 1)
    damaged = {
        how: _damage(root / "good", root / how, how)
        for how in ("truncate", ".metadata", "common.pt", "__0_0.distcp")
    }

    def attempt(path, chunks, optimizer, scheduler, runtime) -> str:
        try:
            load_checkpoint(path, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime)
        except CheckpointError as exc:
            return f"{type(exc).__name__}: {exc}"
        return "no error"

    before = _snapshot(chunks, optimizer, scheduler)
    errors = {"missing": attempt(root / "nowhere", chunks, optimizer, scheduler, runtime)}
    errors["no_optimizer"] = attempt(root / "weights_only", chunks, optimizer, scheduler, runtime)
    for how, path in damaged.items():
        errors[how] = attempt(path, chunks, optimizer, scheduler, runtime)
    changed = _differences(before, _snapshot(chunks, optimizer, scheduler))

    # A fresh optimizer gets empty moments to read into; a failed read must take them away again.
    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=5)
    errors["fresh"] = attempt(damaged["__0_0.distcp"], chunks, optimizer, scheduler, runtime)
    fresh_has_state = _has_state(optimizer)

    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=5, hidden=48)
    before = _snapshot(chunks, optimizer, scheduler)
    errors["other_shape"] = attempt(root / "good", chunks, optimizer, scheduler, runtime)
    changed += _differences(before, _snapshot(chunks, optimizer, scheduler))
    return {"errors": errors, "changed": changed, "fresh_has_state": fresh_has_state}


def test_bad_checkpoints_raise_naming_path_and_problem_before_changing_anything(pool1, tmp_path):
    result = pool1.run(f"{__name__}:bad_input_job", root=str(tmp_path))[0]
    errors = result["errors"]
    assert errors["missing"].startswith("CheckpointNotFoundError")
    assert (
        f"no complete checkpoint under {tmp_path / 'nowhere'}: the path does not exist" in errors["missing"]
    )
    assert errors["no_optimizer"].startswith("CheckpointMismatchError")
    assert str(tmp_path / "weights_only") in errors["no_optimizer"]
    assert "saved without an optimizer" in errors["no_optimizer"]
    assert "saved without a scheduler" in errors["no_optimizer"]
    assert errors["truncate"].startswith("CheckpointCorruptError")
    assert str(tmp_path / "truncate" / "global_step_1" / "model") in errors["truncate"]
    assert "distcp has " in errors["truncate"] and " bytes, " in errors["truncate"]
    # Same size, other bytes: the checksums name the file before anything is read.
    for how in (".metadata", "common.pt", "__0_0.distcp"):
        part = tmp_path / how / "global_step_1" / "model"
        assert errors[how] == (
            f"CheckpointCorruptError: checkpoint {part} is damaged: "
            f"{how} does not hold the bytes that were written (sha256 differs)"
        ), errors[how]
    assert errors["fresh"] == errors["__0_0.distcp"]
    other = errors["other_shape"]
    assert other.startswith("CheckpointMismatchError") and str(tmp_path / "good") in other
    # hidden 48 instead of 32: e.g. the final norm, [32] saved, [48] wanted.
    assert "decoder.final_layernorm.weight: checkpoint [32], model [48]" in other
    assert result["changed"] == []
    assert result["fresh_has_state"] is False


def interrupted_save_job(root: str) -> dict:
    """A save that dies after writing its shards, and one never committed, hide nothing and break nothing."""
    import megatron.core.dist_checkpointing as mcore_dist_ckpt

    from verl_megatron.checkpoint import (
        CheckpointError,
        find_latest_checkpoint,
        load_checkpoint,
        read_latest_pointer,
        save_checkpoint,
    )

    root = Path(root)
    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=3)
    common = {"optimizer": optimizer, "scheduler": scheduler, "runtime": runtime}
    _train_step(runtime, chunks, optimizer, scheduler, 0)
    save_checkpoint(root, 1, chunks=chunks, extra_state={"global_steps": 1}, **common)
    at_step_1 = _snapshot(chunks, optimizer, scheduler)
    _train_step(runtime, chunks, optimizer, scheduler, 1)

    real_save = mcore_dist_ckpt.save

    def crashing_save(*args, **kwargs):
        real_save(*args, **kwargs)
        raise OSError("simulated crash after the shards were written")

    mcore_dist_ckpt.save = crashing_save
    try:
        save_checkpoint(root, 2, chunks=chunks, extra_state={"global_steps": 2}, max_ckpt_to_keep=1, **common)
        error = "no error"
    except CheckpointError as exc:
        error = str(exc)
    finally:
        mcore_dist_ckpt.save = real_save
    after_crash = (find_latest_checkpoint(root), read_latest_pointer(root), sorted(os.listdir(root)))
    save_checkpoint(root, 3, chunks=chunks, extra_state={"global_steps": 3}, commit=False, **common)
    after_uncommitted = find_latest_checkpoint(root)

    runtime, chunks, optimizer, scheduler = _setup(1, 1, None, init_seed=99)
    extra = load_checkpoint(root, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime)
    changed = _differences(at_step_1, _snapshot(chunks, optimizer, scheduler))
    # The next good save of step 2 replaces the debris of the crashed one and prunes step 1.
    save_checkpoint(
        root, 2, chunks=chunks, optimizer=optimizer, scheduler=scheduler, runtime=runtime, max_ckpt_to_keep=1
    )
    return {
        "error": error,
        "after_crash": after_crash,
        "after_uncommitted": after_uncommitted,
        "extra": extra,
        "changed": changed,
        "final": (find_latest_checkpoint(root), read_latest_pointer(root), sorted(os.listdir(root))),
    }


def test_interrupted_saves_never_replace_the_last_good_checkpoint(pool1, tmp_path):
    result = pool1.run(f"{__name__}:interrupted_save_job", root=str(tmp_path))[0]
    assert "simulated crash after the shards were written" in result["error"]
    assert result["after_crash"] == (
        tmp_path / "global_step_1",
        1,
        [".global_step_2.staging", "global_step_1", "latest_checkpointed_iteration.txt"],
    )
    assert result["after_uncommitted"] == tmp_path / "global_step_1"
    assert result["extra"] == {"global_steps": 1}
    assert result["changed"] == []
    assert result["final"] == (
        tmp_path / "global_step_2",
        2,
        [".global_step_3.staging", "global_step_2", "latest_checkpointed_iteration.txt"],
    )


def multi_part_job(root: str) -> dict:
    """Actor and critic saved into one step; the critic before its first optimizer step."""
    from verl_megatron.checkpoint import (
        commit_checkpoint,
        find_latest_checkpoint,
        load_checkpoint,
        save_checkpoint,
    )
    from verl_megatron.checkpoint.optimizer_state import has_state as _has_state

    runtime = _runtime(1, 1, None)
    actor, critic = _build(runtime, init_seed=3), _build(runtime, init_seed=4)
    _train_step(runtime, *actor, 0)
    for name, (chunks, optimizer, scheduler) in (("actor", actor), ("critic", critic)):
        save_checkpoint(
            root,
            5,
            name=name,
            chunks=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            runtime=runtime,
            commit=False,
        )
    visible_before_commit = find_latest_checkpoint(root)
    commit_checkpoint(root, 5)
    saved = {"actor": _snapshot(*actor), "critic": _snapshot(*critic)}

    new = {"actor": _build(runtime, init_seed=99), "critic": _build(runtime, init_seed=98)}
    # The new critic has Adam moments; the checkpoint has none, so loading drops them.
    _train_step(runtime, *new["critic"], 0)
    load_checkpoint(
        root,
        name="actor",
        chunks=new["actor"][0],
        optimizer=new["actor"][1],
        scheduler=new["actor"][2],
        runtime=runtime,
    )
    load_checkpoint(
        Path(root) / "global_step_5",
        name="critic",
        chunks=new["critic"][0],
        optimizer=new["critic"][1],
        scheduler=new["critic"][2],
        runtime=runtime,
    )
    return {
        "visible_before_commit": visible_before_commit,
        "changed": {k: _differences(saved[k], _snapshot(*new[k])) for k in saved},
        "critic_has_state": _has_state(new["critic"][1]),
        "actor_moments": len(saved["actor"]["moments"]),
    }


def test_actor_and_critic_share_a_step(pool1, tmp_path):
    result = pool1.run(f"{__name__}:multi_part_job", root=str(tmp_path))[0]
    assert result["visible_before_commit"] is None
    assert result["changed"] == {"actor": [], "critic": []}
    assert result["critic_has_state"] is False
    assert result["actor_moments"] > 0
    marker = (tmp_path / "global_step_5" / "checkpoint_complete.json").read_text()
    assert '"actor",' in marker and '"critic"' in marker
