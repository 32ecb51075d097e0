"""One-GPU check of the GPU paths: bf16 model, native GRPO step, log-prob accuracy, distributed
optimizer, offload round trip; prints tokens/s and the actor's MFU.

Needs only PyTorch plus megatron-core and this project (wheels; no internet, no checkpoint):
the model is a random-init Qwen2-shaped ~0.5B built on the spot. Runs in one process::

    python benchmarks/gpu/gpu_check.py                      # GPU, 0.5B, about 2-5 minutes
    python benchmarks/gpu/gpu_check.py --size tiny --device cpu   # CPU fallback (seconds)
    torchrun --standalone --nproc_per_node=2 benchmarks/gpu/gpu_check.py   # 2 GPUs: dp=2

What it does, in order (each stage's numbers go into the printed JSON summary):

1. layer spec: Transformer Engine when installed, else megatron's local spec (an explicit,
   printed choice: ``model.use_te=false``); parameters in bfloat16;
2. actor with megatron's distributed optimizer and fp32 master weights: dp=1 in one process
   (one shard), dp=N under ``torchrun --nproc_per_node=N`` (each rank owns 1/N of the state);
3. a GRPO step with the native engine: generate ``prompts x group`` responses, a synthetic
   reward, GRPO advantages, old log-probs, one policy update; tokens/s of generation and update,
   and the update's MFU against the devices' peak bf16 FLOP/s, twice: on the FLOPs the update
   spends (each shared prompt once, the LM head at response positions only) and on the usual
   model FLOPs (every sequence whole, the head everywhere), which read 1.3-1.6x higher; the
   generation's MFU the same two ways (model: 2 x params per generated token; spent: each prompt
   prefilled once for its group, then one-token steps);
4. log-probs of the bf16 model against the same checkpoint in float32 (max and mean |diff|);
5. offload round trip: ``torch.cuda.memory_allocated`` before, while offloaded, after reload,
   and the weights bit-identical after the round trip.

Exit status 0 when every check passes, 1 otherwise (the JSON says which failed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

# Qwen2.5-0.5B's shape (random weights); "tiny" is for the CPU fallback and tests.
SIZES: dict[str, dict[str, int]] = {
    "0.5b": dict(vocab_size=151_936, hidden_size=896, num_layers=24, num_heads=14, num_kv_heads=2,
                 intermediate_size=4864),
    "tiny": dict(vocab_size=1000, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
}  # fmt: skip
# bf16 log-probs of a random-init model against float32: mean |diff| well under this.
LOGPROB_MEAN_TOL = 0.05


class CheckError(ValueError):
    """Bad command-line arguments."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--size", choices=sorted(SIZES), default=None, help="default: 0.5b on GPU, tiny on CPU"
    )
    parser.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=4, help="responses per prompt")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--response-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak (default: by GPU name)")
    parser.add_argument(
        "--workdir", default=None, help="where the random checkpoint goes (default: a temp dir)"
    )
    parser.add_argument("--out", default=None, help="also write the JSON summary here")
    args = parser.parse_args(argv)
    for name in ("prompts", "group", "prompt_len", "response_len", "micro_batch"):
        if getattr(args, name) < 1:
            raise CheckError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if (args.prompts * args.group) % args.micro_batch:
        raise CheckError(
            f"--micro-batch {args.micro_batch} must divide prompts x group = {args.prompts * args.group}"
        )
    # Under torchrun every rank is a data-parallel rank: each generates prompts / N and updates on
    # micro-batches of its 1/N share (micro-batches of whole rows, as in the trainer).
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.prompts % world or (args.prompts * args.group) % (args.micro_batch * world):
        raise CheckError(
            f"dp={world} ranks must divide --prompts {args.prompts} and, in micro-batches of "
            f"{args.micro_batch}, prompts x group = {args.prompts * args.group}"
        )
    args.device = resolve_device(args.device)
    args.size = args.size or ("0.5b" if args.device == "cuda" else "tiny")
    if args.device == "cpu" and args.size != "tiny":
        raise CheckError(f"--size {args.size} on CPU would take hours: use --size tiny, or run on a GPU")
    return args


def resolve_device(choice: str) -> str:
    if choice == "cuda" and not torch.cuda.is_available():
        raise CheckError("--device cuda: no CUDA device is visible (torch.cuda.is_available() is False)")
    if choice == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return choice


def _allocated_gib() -> float:
    return torch.cuda.memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0


def _use_te(device: str) -> bool:
    from verl_megatron.models.config import transformer_engine_available

    use_te = device == "cuda" and transformer_engine_available()
    if device == "cuda" and not use_te:
        print("transformer_engine is not installed: megatron's local spec (model.use_te=false), by choice")
    return use_te


def build_actor(model_dir: str, runtime: Any, args: argparse.Namespace, dtype: str, use_te: bool):
    """MegatronActor (tp=1) on the checkpoint; bf16 runs use the distributed optimizer."""
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig, load_hf_config
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.megatron_model import build_optimizer, wrap_ddp
    from verl_megatron.workers.actor import MegatronActor
    from verl_megatron.workers.config import ActorConfig, OptimConfig
    from verl_megatron.workers.lr_schedule import build_lr_scheduler, optim_settings

    chunks = build_gpt_chunks(
        load_hf_config(model_dir), runtime, ModelConfig(path=model_dir, dtype=dtype, use_te=use_te)
    )
    load_hf_weights(chunks, model_dir, runtime)
    optim = OptimConfig(lr=1e-6, clip_grad=1.0, use_distributed_optimizer=dtype == "bfloat16")
    settings = optim_settings(optim, bf16=dtype == "bfloat16")
    chunks = wrap_ddp(chunks, settings)
    optimizer = build_optimizer(chunks, settings)
    config = ActorConfig(
        ppo_mini_batch_size=args.prompts, ppo_micro_batch_size_per_gpu=args.micro_batch, rollout_n=args.group,
        use_remove_padding=use_te, optim=optim,
    )  # fmt: skip
    return MegatronActor(runtime, config, chunks, optimizer, build_lr_scheduler(optimizer, optim))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _generate(rollout: Any, prompts: Any, runtime: Any) -> Any:
    """Each dp rank generates its share of the prompts; every rank gets the whole batch back."""
    from verl_megatron.protocol import DataProto
    from verl_megatron.rollout.layout import gather_replicas, shard_for

    shard = shard_for("native", 1, runtime)
    local = prompts.chunk(shard.replicas)[shard.replica]
    local.meta_info["prompt_offset"] = shard.replica * len(local)  # per-prompt sampling seeds
    output = rollout.generate_sequences(local).to("cpu")
    output.meta_info.pop("prompt_offset", None)
    return DataProto.concat(gather_replicas(output, shard, runtime.world_size))


def grpo_step(actor: Any, model_dir: str, tokenizer: Any, hf_config: Any, args: argparse.Namespace) -> dict:
    """Native rollout -> reward -> GRPO advantages -> old log-probs -> update; timings and tokens."""
    from verl_megatron.algos import core_algos
    from verl_megatron.protocol import DataProto
    from verl_megatron.rollout.config import RolloutConfig
    from verl_megatron.rollout.native import NativeRollout

    rollout = NativeRollout(
        RolloutConfig(n=args.group, prompt_length=args.prompt_len, response_length=args.response_len,
                      ignore_eos=True, temperature=1.0, seed=0, tensor_model_parallel_size=1),
        actor.runtime, actor.chunks, tokenizer, hf_config,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(3, SIZES[args.size]["vocab_size"], (args.prompts, args.prompt_len), generator=gen)
    prompts = DataProto.from_dict(
        {"input_ids": ids, "attention_mask": torch.ones_like(ids)},
        non_tensors={"uid": np.array([str(i) for i in range(args.prompts)], dtype=object)},
        meta_info={"eos_token_id": -1, "pad_token_id": 0},
    )
    _sync()
    start = time.perf_counter()
    batch = _generate(rollout, prompts, actor.runtime)
    _sync()
    gen_s = time.perf_counter() - start
    responses, mask = batch.batch["responses"], batch.batch["response_mask"]
    # Synthetic reward: share of even token ids, at the last response token.
    rewards = torch.zeros(responses.shape, dtype=torch.float32)
    rewards[:, -1] = ((responses % 2 == 0).float() * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    batch.batch["advantages"], _ = core_algos.compute_grpo_outcome_advantage(
        rewards, mask, batch.non_tensor_batch["uid"]
    )
    batch.meta_info["temperature"] = 1.0
    batch.batch["old_log_probs"], _ = actor.compute_log_prob(batch)
    _sync()
    start = time.perf_counter()
    metrics = actor.update_policy(batch)
    _sync()
    update_s = time.perf_counter() - start
    lengths = batch.batch["attention_mask"].sum(-1).tolist()
    return {"batch": batch, "gen_s": gen_s, "update_s": update_s, "gen_tokens": int(mask.sum()),
            "update_tokens": int(sum(lengths)), "lengths": lengths, "metrics": metrics}  # fmt: skip


def _weights(actor: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for c in actor.chunks for p in c.parameters()]


def offload_round_trip(actor: Any) -> dict:
    """Offload parameters, gradients and optimizer state; reload; memory and exactness."""
    from verl_megatron.models import offload

    offloader = offload.Offloader()
    before = _weights(actor)
    _sync()
    allocated = [_allocated_gib()]
    reports = [
        offloader.offload_model(actor.chunks, grads=True),
        offloader.offload_optimizer(actor.optimizer),
    ]
    offload.empty_device_cache()
    _sync()
    allocated.append(_allocated_gib())
    reports += [offloader.load_model(actor.chunks), offloader.load_optimizer(actor.optimizer)]
    _sync()
    allocated.append(_allocated_gib())
    exact = all(torch.equal(a, b) for a, b in zip(before, _weights(actor)))
    return {
        "allocated_gib": {"before": allocated[0], "offloaded": allocated[1], "reloaded": allocated[2]},
        "moved_gib": sum(r.moved_bytes for r in reports[:2]) / 2**30,
        "skipped": [r.skipped for r in reports],
        "weights_exact": exact,
    }


def _unit_costs(sizes: dict[str, int]) -> tuple[float, float, float]:
    """(body FLOPs per token, LM head FLOPs per token, attention FLOPs per query-key pair) of one
    forward + backward, read off ``trainer.metrics.training_flops`` so both counts share its formula."""
    from verl_megatron.trainer.metrics import training_flops

    def flops(lengths: list[int], vocab: int) -> float:
        return training_flops(lengths, **{**sizes, "vocab_size": vocab})

    pair = (flops([2], 0) - 2 * flops([1], 0)) / 2  # attention: 2**2 - 2 * 1**2 = 2 pairs
    return flops([1], 0) - pair, flops([1], sizes["vocab_size"]) - flops([1], 0), pair


def update_flops(batch: Any, sizes: dict[str, int], micro_batch: int, shares_prompts: bool) -> dict:
    """FLOPs of the update's forward + backward over ``batch`` (rows grouped by ``uid``).

    ``model``: every sequence whole with the LM head at every position (``training_flops``, how
    MFU is usually quoted). ``spent``: what the actor's layout runs, micro-batch by micro-batch of
    ``micro_batch`` consecutive rows: where ``shares_prompts`` and the shared layout applies
    (``workers/shared_prefix.py``) a group's prompt P runs once and its attention scores P x P plus
    R x (P + R) per response; the LM head runs at the response positions only
    (``workers/output_rows.py``). Padding columns are not counted (this check has none).
    """
    from verl_megatron.trainer.metrics import training_flops
    from verl_megatron.workers.shared_prefix import shared_prefix_inputs

    body, head, pair = _unit_costs(sizes)
    tensors = batch.batch
    prompt_len = tensors["attention_mask"].sum(-1) - tensors["response_mask"].sum(-1)
    resp_len, uids = tensors["response_mask"].sum(-1), batch.non_tensor_batch["uid"]
    body_tokens = head_tokens = pairs = shared_micro_batches = 0
    for start in range(0, len(batch), micro_batch):
        rows = range(start, min(start + micro_batch, len(batch)))
        mask = tensors["attention_mask"][start : rows.stop]
        shared = shares_prompts and shared_prefix_inputs(
            tensors["input_ids"][start : rows.stop], mask, tensors["responses"][start : rows.stop],
            alternative_positions=len(rows) * int(mask.sum(-1).max()),
        ) is not None  # fmt: skip
        shared_micro_batches += shared
        groups: dict[Any, list[int]] = {}
        for i in rows:
            groups.setdefault(uids[i] if shared else i, []).append(i)
        for members in groups.values():
            p, rs = int(prompt_len[members[0]]), [int(resp_len[i]) for i in members]
            body_tokens += p + sum(rs)
            pairs += p * p + sum(r * (p + r) for r in rs) if shared else (p + rs[0]) ** 2
        head_tokens += sum(int(resp_len[i]) for i in rows)
    model = training_flops(tensors["attention_mask"].sum(-1).tolist(), **sizes)
    spent = body * body_tokens + head * head_tokens + pair * pairs
    return {"model": model, "spent": spent, "model_over_spent": model / spent,
            "shared_prompt_micro_batches": shared_micro_batches}  # fmt: skip


def generation_flops(sizes: dict[str, int], args: argparse.Namespace) -> dict:
    """Forward FLOPs of the native engine's generation of the whole batch (every response full
    length). ``model``: 2 x params per generated token (the LM head included), how decoding MFU
    is usually quoted. ``spent``: each prompt prefilled once (its cache then serves the group's
    ``--group`` rows) with the LM head at its last position, then ``response_len - 1`` one-token
    steps per row, each query against the prompt and the tokens before it.
    """
    body, head, pair = (cost / 3 for cost in _unit_costs(sizes))  # forward = a third of fwd + bwd
    p, r, rows = args.prompt_len, args.response_len, args.prompts * args.group
    steps = rows * (r - 1)
    pairs = args.prompts * p * p + rows * sum(p + k for k in range(1, r))
    return {
        "model": (body + head) * rows * r,
        "spent": body * (args.prompts * p + steps) + head * (args.prompts + steps) + pair * pairs,
    }


def _speed(step: dict, actor: Any, hf_config: Any, args: argparse.Namespace) -> dict:
    """tokens/s of generation and update (all ranks together) and their MFU, on spent and on
    model FLOPs, against ``world size x`` the device's peak."""
    from verl_megatron.models.config import read_hf_architecture
    from verl_megatron.trainer import metrics as M

    arch = read_hf_architecture(hf_config)
    sizes = {arg: getattr(arch, field) for arg, field in M._FLOPS_SIZES.items()}
    flops = update_flops(step["batch"], sizes, args.micro_batch, actor.runner.prefix_sharing is not None)
    gen = generation_flops(sizes, args)
    peak, devices = M.device_peak_flops(args.peak_tflops), actor.runtime.world_size
    return {
        "generation_tokens_per_s": step["gen_tokens"] / step["gen_s"],
        "update_tokens_per_s": step["update_tokens"] / step["update_s"],
        "generation_flops": gen,
        "generation_mfu": {
            kind: M.compute_mfu(gen[kind], step["gen_s"], devices, peak) for kind in ("spent", "model")
        },
        "update_flops": flops,
        "actor_mfu": {
            kind: M.compute_mfu(flops[kind], step["update_s"], devices, peak) for kind in ("spent", "model")
        },
    }


def run(args: argparse.Namespace) -> dict:
    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.config import load_hf_config
    from verl_megatron.utils.local_assets import build_char_tokenizer, build_tiny_hf_model

    # One random checkpoint per rank's own folder, written before the process group exists (a
    # save under torch.distributed writes on rank 0 only): same seed, same weights.
    workdir = (
        Path(args.workdir or tempfile.mkdtemp(prefix="gpu_check_")) / f"rank{os.environ.get('RANK', '0')}"
    )
    model_dir = workdir / f"qwen2_{args.size}"
    tokenizer = build_char_tokenizer(workdir / "tokenizer")
    build_tiny_hf_model(model_dir, "qwen2", tie_word_embeddings=True, seed=0,
                        max_position_embeddings=args.prompt_len + args.response_len, **SIZES[args.size])  # fmt: skip
    hf_config = load_hf_config(str(model_dir))
    runtime = init_runtime(ParallelLayout(), seed=0)
    use_te = _use_te(args.device)
    summary: dict[str, Any] = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                               "size": args.size, "spec": "transformer_engine" if use_te else "local",
                               "dp": runtime.layout.dp}  # fmt: skip
    actor = build_actor(str(model_dir), runtime, args, "bfloat16", use_te)
    subs = getattr(actor.optimizer, "chained_optimizers", None) or [actor.optimizer]
    summary["optimizer"] = sorted({type(o).__name__ for o in subs})
    step = grpo_step(actor, str(model_dir), tokenizer, hf_config, args)
    summary.update(_speed(step, actor, hf_config, args))
    grad_norm = step["metrics"].get("actor/grad_norm")
    summary["grad_norm"] = grad_norm[-1] if isinstance(grad_norm, list) else grad_norm
    # float32 reference from the same checkpoint, on the same batch (old log-probs predate the update).
    reference = build_actor(str(model_dir), runtime, args, "float32", use_te)
    ref_log_probs, _ = reference.compute_log_prob(step["batch"])
    del reference
    diff = (step["batch"].batch["old_log_probs"] - ref_log_probs).abs()[
        step["batch"].batch["response_mask"].bool()
    ]
    summary["logprob_vs_fp32"] = {"max_abs": float(diff.max()), "mean_abs": float(diff.mean())}
    summary["offload"] = offload_round_trip(actor)
    summary["checks"] = checks(summary, args.device)
    return summary


def checks(summary: dict, device: str) -> dict[str, bool]:
    off = summary["offload"]
    result = {
        "update_finite": summary["grad_norm"] is not None and bool(np.isfinite(summary["grad_norm"])),
        "logprobs_close_to_fp32": summary["logprob_vs_fp32"]["mean_abs"] < LOGPROB_MEAN_TOL,
        "distributed_optimizer": summary["optimizer"] == ["DistributedOptimizer"],
        "offload_weights_exact": off["weights_exact"],
    }
    if device == "cuda":
        gib = off["allocated_gib"]
        # Offloading frees at least 80% of what it moved; reloading brings it all back.
        result["offload_frees_memory"] = gib["before"] - gib["offloaded"] >= 0.8 * off["moved_gib"] > 0
        result["reload_restores_memory"] = abs(gib["reloaded"] - gib["before"]) < 0.05 * gib["before"] + 0.01
    return result


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse_args(argv)
    except CheckError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2
    if args.device == "cpu":
        print("no GPU: CPU fallback (tiny model; numbers only show that the path runs)")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from verl_megatron.distributed.parallel import shutdown

    owned = not torch.distributed.is_initialized()  # else a caller's group (tests): leave it up
    summary = run(args)
    rank = torch.distributed.get_rank()
    if owned:
        shutdown()
    if rank == 0:  # every rank checked its own shard; rank 0 reports
        text = json.dumps(summary, indent=2, default=float)
        print(text)
        if args.out:
            Path(args.out).write_text(text)
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
