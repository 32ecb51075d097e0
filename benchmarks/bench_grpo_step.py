"""A whole GRPO step (rollout + reward + log-probs + update): our trainer vs TRL's GRPOTrainer.

Both sides start from the same tiny HF checkpoint built on the spot, get the same prompts (one
token per character, all exactly ``prompt_len`` long), sample ``group`` responses per prompt of up
to ``response_len`` tokens at temperature 1, score them with the same Python reward function, and
take one optimizer step over the whole batch in micro-batches of ``micro_batch``. The result is
seconds per step and the ratio ours / TRL (below 1 means ours is faster).

Run alone: ``python benchmarks/bench_grpo_step.py [--quick]``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import io
import json
import os
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from common import (
    FLOPS_MODEL_SPENT_NOTE,
    MFU_MODEL,
    MFU_SPENT,
    QUICK_SHAPE,
    REPO_ROOT,
    SHARED_HEAP_NOTE,
    ModelShape,
    Section,
    best_peak,
    build_assets,
    error_text,
    forward_flops,
    generation_flops,
    measure_matmul_peak,
    mfu_columns,
    ratio,
    run_alone,
    shape_text,
    single_process_env,
    train_flops_per_token,
)


@dataclass(frozen=True)
class GRPOBenchConfig:
    """One GRPO step's sizes; ``prompts * group`` sequences per step."""

    shape: ModelShape
    prompts: int = 8
    group: int = 8
    """responses sampled per prompt"""
    prompt_len: int = 64
    response_len: int = 128
    """response tokens, always all of them (EOS ignored)"""
    micro_batch: int = 16
    lr: float = 1e-6
    steps: int = 2
    """timed steps"""
    warmup: int = 1
    """untimed steps first (lazy init, allocator); 0 in quick mode, where timing is not the point"""
    rounds: int = 3
    """each side runs this many times, the sides alternating (A, B, C, A, B, C), so that a change
    of the machine's load hits all alike; the best timed step over all rounds is the headline"""

    @property
    def total_steps(self) -> int:
        return self.warmup + self.steps

    seed: int = 0
    recompute_old_log_prob: bool = True
    """ours: a separate old-log-prob pass (verl's way); false: the on-policy update's own log-probs"""


FULL = GRPOBenchConfig(
    shape=ModelShape(
        vocab_size=8192, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, intermediate_size=704
    )
)
QUICK = GRPOBenchConfig(
    QUICK_SHAPE, prompts=2, group=2, prompt_len=8, response_len=8, micro_batch=2, steps=1, warmup=0, rounds=1
)


# The character tokenizer's chat template wraps a user turn as <|user|> text <|endoftext|> and
# appends <|assistant|>: three tokens around the text.
CHAT_TOKENS = 3


def make_prompts(count: int, length: int, seed: int = 0) -> list[str]:
    """``count`` distinct arithmetic prompts, each exactly ``length`` characters (= tokens)."""
    import random

    rng = random.Random(seed)
    prompts = []
    for i in range(count):
        text = f"#{i} What is {rng.randint(10, 99)} + {rng.randint(10, 99)}? "
        text = (text * (length // len(text) + 1))[:length]
        prompts.append(text)
    return prompts


def digit_fraction(text: str) -> float:
    """The reward both trainers use: the fraction of characters that are digits (cheap, varied)."""
    return sum(c.isdigit() for c in text) / max(len(text), 1)


STAGES = ("gen", "reward", "old_log_prob", "adv", "update_actor")
STEP_CPU = "step CPU s (of the best step)"
TIMED_KEYS = ("step_seconds", "stage_seconds", "step_cpu_seconds", "stage_cpu_seconds")
OURS, OURS_ON_POLICY, TRL = "verl-megatron", "verl-megatron, on-policy", "TRL GRPOTrainer"


# ----------------------------------------------------------------------------- TRL (the peer)


class _StepClock:
    """A transformers TrainerCallback recording seconds (wall, and the process's CPU) from step
    begin to step end."""

    def __new__(cls):
        from transformers import TrainerCallback

        class Clock(TrainerCallback):
            def __init__(self) -> None:
                self.seconds: list[float] = []
                self.cpu_seconds: list[float] = []
                self._start = (0.0, 0.0)

            def on_step_begin(self, args, state, control, **kwargs):
                self._start = (time.perf_counter(), time.process_time())

            def on_step_end(self, args, state, control, **kwargs):
                self.seconds.append(time.perf_counter() - self._start[0])
                self.cpu_seconds.append(time.process_time() - self._start[1])

        return Clock()


def run_trl(model_dir: str, tokenizer, cfg: GRPOBenchConfig, out_dir: str) -> dict[str, Any]:
    """TRL GRPOTrainer for ``cfg.total_steps`` steps; seconds of each (warm-up steps first).

    Gradient accumulation equals steps_per_generation, so one generation round feeds one optimizer
    step, as in ours. beta=0 (no reference model), one iteration per generation: TRL then skips the
    separate old-log-prob forward pass (it reuses the detached current log-probs), a pass ours runs.
    """
    from datasets import Dataset
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    batch = cfg.prompts * cfg.group
    accumulation = batch // cfg.micro_batch
    args = GRPOConfig(
        output_dir=out_dir,
        use_cpu=True,
        per_device_train_batch_size=cfg.micro_batch,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        num_generations=cfg.group,
        max_completion_length=cfg.response_len,
        temperature=1.0,
        # EOS masked until the full length, as rollout.ignore_eos does on our side.
        generation_kwargs={"min_new_tokens": cfg.response_len},
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        loss_type="dapo",  # token-mean over the batch, like ours
        learning_rate=cfg.lr,
        optim="adamw_torch",
        weight_decay=0.01,
        max_grad_norm=1.0,
        max_steps=cfg.total_steps,
        gradient_checkpointing=False,
        bf16=False,
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_dropout=True,
        shuffle_dataset=False,
        seed=cfg.seed,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    # Chat-format prompts: TRL applies the tokenizer's chat template, as our dataset does.
    prompts = [
        [{"role": "user", "content": p}]
        for p in make_prompts(cfg.prompts, cfg.prompt_len - CHAT_TOKENS, cfg.seed)
    ]
    dataset = Dataset.from_dict({"prompt": prompts * cfg.total_steps})

    def reward(completions: list, **kwargs: Any) -> list[float]:
        # Chat-format completions arrive as [{"role": "assistant", "content": text}].
        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return [digit_fraction(text) for text in texts]

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    clock = _StepClock()
    threads = torch.get_num_threads()
    trainer = GRPOTrainer(
        model, reward, args=args, train_dataset=dataset, processing_class=tokenizer, callbacks=[clock]
    )
    with contextlib.redirect_stdout(io.StringIO()):  # TRL prints a log dict per step
        trainer.train()
    ddp = isinstance(getattr(trainer, "model_wrapped", None), DDP)
    torch.set_num_threads(threads)  # accelerate may touch the thread count
    lengths = [
        h.get("completions/mean_length") for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return {
        "step_seconds": clock.seconds,
        "step_cpu_seconds": clock.cpu_seconds,
        "mean_completion_length": lengths,
        "distributed_type": str(trainer.accelerator.distributed_type),
        "ddp_wrapped": ddp,
    }


# ----------------------------------------------------------------------------- ours


_REWARD_FILE = """
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    return sum(c.isdigit() for c in solution_str) / max(len(solution_str), 1)
"""


def _ours_config(model_dir: str, cfg: GRPOBenchConfig, out_dir: Path):
    """The trainer's config on top of configs/grpo.yaml: the benchmark's sizes, no KL (as TRL's
    beta=0), no validation or checkpoints, EOS ignored so responses are full length."""
    from verl_megatron.trainer.config import load_config

    rows = [
        {
            "data_source": "bench",
            "prompt": [{"role": "user", "content": p}],
            "reward_model": {"ground_truth": ""},
        }
        for p in make_prompts(cfg.prompts, cfg.prompt_len - CHAT_TOKENS, cfg.seed)
    ]
    data = out_dir / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    reward = out_dir / "reward.py"
    reward.write_text(_REWARD_FILE)
    overrides = {
        "model.path": model_dir,
        "model.dtype": "float32",
        "model.use_te": False,
        "data.train_files": f"[{data}]",
        "data.val_files": "[]",
        "data.max_prompt_length": cfg.prompt_len,
        "data.max_response_length": cfg.response_len,
        "data.train_batch_size": cfg.prompts,
        "data.shuffle": False,
        "rollout.n": cfg.group,
        "rollout.ignore_eos": True,
        "rollout.log_prob_micro_batch_size_per_gpu": cfg.micro_batch,
        "actor.ppo_mini_batch_size": cfg.prompts,
        "actor.ppo_micro_batch_size_per_gpu": cfg.micro_batch,
        "actor.use_kl_loss": False,
        "actor.use_remove_padding": False,
        "actor.recompute_old_log_prob": cfg.recompute_old_log_prob,
        "actor.optim.lr": cfg.lr,
        "custom_reward_function.path": str(reward),
        "trainer.total_training_steps": cfg.total_steps,
        "trainer.test_freq": -1,
        "trainer.save_freq": -1,
        "trainer.val_before_train": False,
        "trainer.resume_mode": "disable",
        "trainer.logger": "[]",
        "trainer.default_local_dir": str(out_dir / "run"),
        "trainer.seed": cfg.seed,
    }
    path = REPO_ROOT / "configs" / "grpo.yaml"
    return load_config(str(path), [f"{k}={v}" for k, v in overrides.items()])


class _StageCPU:
    """The trainer's stage marks (``trainer.stall.StageMarks``) as a CPU clock: process CPU
    seconds from each stage's start to the next stage's (the last one's until the step ends).
    The gaps between stages (small: batch bookkeeping) count to the stage before them."""

    def __init__(self) -> None:
        self._marks: list[tuple[str, float]] = []

    def mark(self, stage: str, step: int | None = None) -> None:
        self._marks.append((stage, time.process_time()))

    def take(self, end: float) -> dict[str, float]:
        """Each stage's CPU seconds since the last ``take``, the step ending at CPU time ``end``."""
        seconds: dict[str, float] = {}
        for (stage, start), stop in zip(self._marks, [m[1] for m in self._marks[1:]] + [end]):
            seconds[stage] = seconds.get(stage, 0.0) + stop - start
        self._marks.clear()
        return seconds


def run_ours(
    model_dir: str, tokenizer, cfg: GRPOBenchConfig, out_dir: str, world_size: int = 1
) -> dict[str, Any]:
    """Our trainer (``PPOTrainer.train_step``) for ``cfg.total_steps`` GRPO steps, one process
    (``world_size`` > 1: one of the processes of a torchrun job, data parallel).

    Returns the seconds of each step (the first is warm-up) and its stage times (verl's
    ``timing_s/*``: gen, reward, old_log_prob, adv, update_actor), and the same in process CPU
    seconds (``step_cpu_seconds``, ``stage_cpu_seconds``).
    """
    from verl_megatron.distributed.parallel import init_runtime, shutdown
    from verl_megatron.trainer.components import build_components
    from verl_megatron.trainer.config import validate_config
    from verl_megatron.trainer.ppo_trainer import PPOTrainer

    config = _ours_config(model_dir, cfg, Path(out_dir))
    validate_config(config, world_size)
    threads = torch.get_num_threads()
    runtime = init_runtime(config.parallel, seed=config.trainer.seed)
    torch.set_num_threads(threads)
    steps, stages, lengths, cpu_steps, cpu_stages = [], [], [], [], []
    clock = _StageCPU()
    try:
        config, components = build_components(config, runtime)
        trainer = PPOTrainer(config, runtime, components, stages=clock)
        for step in range(1, 1 + cfg.total_steps):
            start, cpu_start = time.perf_counter(), time.process_time()
            metrics = trainer.train_step(step)
            steps.append(time.perf_counter() - start)
            cpu_steps.append(time.process_time() - cpu_start)
            cpu_stages.append(clock.take(cpu_start + cpu_steps[-1]))
            stages.append(
                {
                    k.removeprefix("timing_s/"): v
                    for k, v in metrics.items()
                    if k.startswith("timing_s/") and k != "timing_s/step"
                }
            )
            lengths.append(metrics.get("response_length/mean"))
    finally:
        shutdown(runtime)
    return {
        "step_seconds": steps,
        "stage_seconds": stages,
        "step_cpu_seconds": cpu_steps,
        "stage_cpu_seconds": cpu_stages,
        "mean_completion_length": [x for x in lengths if x is not None],
    }


# ----------------------------------------------------------------------------- section


def _at_best(values: list, timed: list[float]) -> Any:
    """The entry of ``values`` (one per step, aligned to the last of them) at the fastest of the
    ``timed`` steps; None if there is none."""
    if not timed or len(values) < len(timed):
        return None
    return values[len(values) - len(timed) + min(range(len(timed)), key=timed.__getitem__)]


def best_step_stages(raw: dict[str, Any], key: str = "stage_seconds") -> dict[str, float]:
    """The stage times ``raw[key]`` (per step, warm-up dropped) of the fastest step; {} if none."""
    return _at_best(raw.get(key) or [], raw["step_seconds"]) or {}


def _row(impl: str, raw: dict[str, Any], warmup: int) -> dict[str, Any]:
    """Best and median of the timed steps (warm-up dropped), the best step's process CPU seconds
    and its stages where known."""
    timed = raw["step_seconds"][warmup:]
    lengths = raw.get("mean_completion_length") or []
    row = {
        "impl": impl,
        "step_s (best)": min(timed),
        "step_s (median)": sorted(timed)[len(timed) // 2],
        STEP_CPU: _at_best(raw.get("step_cpu_seconds") or [], timed),
        "timed steps": len(timed),
        "mean response tokens": sum(lengths) / len(lengths) if lengths else None,
    }
    if raw.get("stage_seconds"):
        best = _at_best(raw["stage_seconds"], timed) or {}
        row.update({stage: best.get(stage) for stage in STAGES})
    return row


def _ours_shares_prompts(cfg: GRPOBenchConfig) -> bool:
    """Whether our actor lays a micro-batch of this benchmark out with shared prompts (the
    workers.shared_prefix rule, asked on a micro-batch of the benchmark's grouping)."""
    from verl_megatron.workers.shared_prefix import shared_prefix_inputs

    rows, t = cfg.micro_batch, cfg.prompt_len + cfg.response_len
    ids = torch.arange(rows * t).view(rows, t) + 3
    ids[:, : cfg.prompt_len] = (torch.arange(rows) // cfg.group)[:, None] + 3  # one prompt per group
    mask = torch.ones_like(ids)
    return (
        shared_prefix_inputs(ids, mask, ids[:, cfg.prompt_len :], alternative_positions=rows * t) is not None
    )


def stage_flops(cfg: GRPOBenchConfig, impl: str) -> dict[str, dict[str, float]]:
    """Model and spent FLOPs of each part of one GRPO step of ``impl`` (every response full
    length), by our stage names: gen, old_log_prob (where the side runs that pass), update_actor.

    model: 2 x matmul params per generated token, a forward (old log-probs) and a forward +
    backward over every sequence whole. spent: ours prefills each prompt once and expands its
    cache to the group, runs a shared prompt once per micro-batch (when the layout applies) and
    the LM head at the response rows; TRL's generate prefills every row, its fused LM head runs
    at the completion positions.
    """
    shape, p, r, batch = cfg.shape, cfg.prompt_len, cfg.response_len, cfg.prompts * cfg.group
    t, ours = p + r, impl != TRL
    prefilled = cfg.prompts if ours else batch  # rows whose prompt runs through the prefill
    stages = {"gen": generation_flops(shape, batch, (prefilled * p, prefilled), p, r)}
    model_pass = batch * t * train_flops_per_token(shape, t) / 3  # one forward
    if ours and _ours_shares_prompts(cfg):
        # prompts run per micro-batch (micro-batches hold consecutive rows), times micro-batches
        groups = -(-cfg.micro_batch // cfg.group) * (batch // cfg.micro_batch)
        pass_flops = forward_flops(shape, groups * p + batch * r, batch * r, groups * p * p + batch * r * t)
    else:
        pass_flops = forward_flops(shape, batch * t, batch * r, batch * t * t)
    if impl == OURS and cfg.recompute_old_log_prob:
        stages["old_log_prob"] = {"model": model_pass, "spent": pass_flops}
    stages["update_actor"] = {"model": 3 * model_pass, "spent": 3 * pass_flops}  # forward + backward
    return stages


def step_flops(cfg: GRPOBenchConfig, impl: str) -> dict[str, float]:
    """Model and spent FLOPs of one GRPO step of ``impl``: the sum of :func:`stage_flops`."""
    stages = stage_flops(cfg, impl).values()
    return {kind: sum(part[kind] for part in stages) for kind in ("model", "spent")}


def _peak_shapes(cfg: GRPOBenchConfig) -> list[tuple[int, int, int]]:
    """The model's matmuls at a decoding step's rows and at a training micro-batch's."""
    rows = cfg.prompts * cfg.group
    return cfg.shape.gemm_shapes(rows) + cfg.shape.gemm_shapes(
        cfg.micro_batch * (cfg.prompt_len + cfg.response_len)
    )


def run(cfg: GRPOBenchConfig, workdir: Path) -> Section:
    """Both trainers on one checkpoint; a missing side is reported with its error text."""
    model_dir, tokenizer = build_assets(workdir / "grpo_model", cfg.shape, cfg.seed)
    return measure(cfg, model_dir, tokenizer, workdir)


def measure(
    cfg: GRPOBenchConfig,
    model_dir: str,
    tokenizer: Any,
    workdir: Path,
    impls: tuple[str, ...] = (OURS, OURS_ON_POLICY, TRL),
) -> Section:
    """The sides ``impls`` on ``model_dir``, alternating for ``cfg.rounds`` rounds; seconds per
    step, our stage times and both MFUs against the matmul peak at the model's shapes."""
    peak_before = measure_matmul_peak(_peak_shapes(cfg), repeats=3)
    section = Section(
        name="grpo_step",
        title="Whole GRPO step (rollout + reward + log-probs + update): verl-megatron vs TRL GRPOTrainer",
        columns=[
            "impl",
            "step_s (best)",
            "step_s (median)",
            STEP_CPU,
            "timed steps",
            "mean response tokens",
            *STAGES,
            MFU_MODEL,
            MFU_SPENT,
        ],
        config={
            "model": shape_text(cfg.shape),
            "prompts x group": f"{cfg.prompts} x {cfg.group}",
            "prompt_len": cfg.prompt_len,
            "response_len": cfg.response_len,
            "micro_batch": cfg.micro_batch,
            "threads": torch.get_num_threads(),
        },
    )
    results: dict[str, dict[str, Any]] = {}
    on_policy = dataclasses.replace(cfg, recompute_old_log_prob=False)
    sides = tuple(
        side
        for side in ((OURS, run_ours, cfg), (OURS_ON_POLICY, run_ours, on_policy), (TRL, run_trl, cfg))
        if side[0] in impls
    )
    for _ in range(cfg.rounds):
        for impl, fn, side_cfg in sides:
            if impl in section.errors:
                continue
            # Our runtime leaves RANK / WORLD_SIZE / LOCAL_RANK in the environment; from them
            # accelerate took TRL for a distributed run and wrapped its model in torch DDP with
            # find_unused_parameters=True (an extra autograd traversal per step). The peer runs as the
            # single process it is.
            env = single_process_env() if fn is run_trl else contextlib.nullcontext()
            try:
                with tempfile.TemporaryDirectory(dir=workdir) as tmp, env:
                    raw = fn(model_dir, tokenizer, side_cfg, tmp)
            except Exception as exc:  # report the peer's (or our) failure instead of dying
                section.errors[impl] = error_text(exc)
                results.pop(impl, None)
                continue
            # The finished side's trainer (model, optimizer, process groups and their threads) is
            # garbage in reference cycles: collect it now, not while the next side is timed.
            gc.collect()
            merged = results.setdefault(impl, {})
            for key, value in raw.items():
                if key in TIMED_KEYS:  # each run's timed steps (no warm-up)
                    merged.setdefault(key, []).extend(value[cfg.warmup :])
                elif key == "mean_completion_length":
                    merged.setdefault(key, []).extend(value)
                else:
                    merged[key] = value
    peak = best_peak(peak_before, measure_matmul_peak(_peak_shapes(cfg), repeats=3))
    for impl, _, _ in sides:
        if impl in results:
            row = _row(impl, results[impl], 0)
            section.rows.append(
                {**row, **mfu_columns(step_flops(cfg, impl), row["step_s (best)"], peak["peak_gflops"])}
            )
    by_impl = {row["impl"]: row for row in section.rows}
    trl_best = by_impl.get(TRL, {}).get("step_s (best)")
    section.ratios["step time ours / TRL (best; < 1 = ours faster)"] = ratio(
        by_impl.get(OURS, {}).get("step_s (best)"), trl_best
    )
    section.ratios["step time ours on-policy / TRL (best; same passes as TRL)"] = ratio(
        by_impl.get(OURS_ON_POLICY, {}).get("step_s (best)"), trl_best
    )
    section.notes.append(
        "TRL runs with beta=0 and one iteration per generation, so it skips the old-log-prob forward "
        "pass (reusing detached current log-probs). Ours recomputes old log-probs as verl does; "
        "'on-policy' is ours with actor.recompute_old_log_prob=false, which does what TRL does (the "
        "update's own log-probs, detached, are the old ones: the same gradient, one pass fewer)."
    )
    section.notes.append(
        "ours runs with its defaults, which include actor.share_prompt_prefix=true: the rows of a micro-batch "
        "that answer one prompt run that prompt once (verl_megatron/workers/shared_prefix.py; the same "
        "mathematics, equal to the padded layout to float32 rounding in tests/test_shared_prefix.py); "
        "TRL runs every row's prompt"
    )
    trl = results.get(TRL, {})
    if trl:
        section.notes.append(
            f"TRL ran as one process (accelerate: {trl.get('distributed_type')}, model wrapped in torch DDP: "
            f"{trl.get('ddp_wrapped')})"
        )
    section.notes.append(SHARED_HEAP_NOTE)
    section.notes.append(
        f"each side ran {cfg.rounds} time(s), the sides alternating; the first {cfg.warmup} step(s) of each run are "
        "warm-up and excluded; stage columns are ours (verl's timing_s/*), "
        "TRL does not time its stages"
    )
    section.notes.append(
        f"matmul peak {peak['peak_gflops']:.1f} GFLOP/s: best torch.matmul rate over the model's GEMM shapes at "
        "a decoding step's rows and a training micro-batch's, measured before and after the steps. "
        + FLOPS_MODEL_SPENT_NOTE
    )
    section.extra = {
        "raw": results,
        "config": asdict(cfg),
        "matmul_peak": peak,
        "flops": {impl: step_flops(cfg, impl) for impl in results},
        "stage_flops": {impl: stage_flops(cfg, impl) for impl in results},
    }
    return section


def main() -> None:
    run_alone(__doc__, run, FULL, QUICK)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
