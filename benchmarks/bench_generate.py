"""Generation throughput: the native rollout engine vs Hugging Face ``generate`` on the same weights.

One random-init llama checkpoint is built on the spot (full size: 4 layers, hidden 512, GQA 8/2,
vocabulary 32k); Hugging Face loads it with ``AutoModelForCausalLM`` and the native engine with
the megatron builder and converter (tp=1, one process). Both generate ``new_tokens`` tokens for
the same ``batch`` left-padded prompts (lengths prompt_len/2..prompt_len, random tokens), sampling
at temperature 1 over the whole vocabulary (verl's defaults: no top-k / top-p), EOS ignored so
every row runs to full length, float32, 2 torch threads (``--threads``). tokens/s counts generated
tokens (batch x new_tokens) over the whole call, prefill included.

Before timing, a short greedy run checks that both sides produce the same tokens (the same model,
not just the same sizes). The two sides then run interleaved (A, B, A, B); the headline is the
fastest repeat, the median is reported beside it.

The weights do not change during the benchmark, so every native call names one weights version
and the engine reuses its packed weights (panels / oneDNN) from the warm-up on (as the trainer's calls
between two updates do: validation, several calls of n samples, multi-turn turns). A cold call,
at a new version and so packing every weight, is timed once after the interleaved repeats and
reported beside them (``extra['native_cold_s']``): the first rollout after each update pays it.
With ``large_batch`` both sides also run once at that batch on the same models (generating
``large_new_tokens`` per row where set).

    python benchmarks/bench_generate.py                  # full size
    python benchmarks/bench_generate.py --quick          # smoke sizes (numbers mean nothing)
    python benchmarks/bench_generate.py --out FILE.json  # also write the result (default: print only)
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

import torch
from common import (
    FLOPS_MODEL_SPENT_NOTE,
    HEADLINE_THREADS,
    MEDIUM_SHAPE,
    MFU_MODEL,
    MFU_SPENT,
    QUICK_SHAPE,
    SHARED_HEAP_NOTE,
    ModelShape,
    Section,
    Timing,
    best_peak,
    build_assets,
    error_text,
    generation_flops,
    machine_info,
    measure_matmul_peak,
    mfu_columns,
    ratio,
    shape_text,
    time_interleaved,
    time_once,
)

NATIVE, HF = "verl-megatron native engine", "HF generate"
HF_STATIC = "HF generate, static cache"
HF_COMPILED = "HF generate, static cache + torch.compile"
NATIVE_COLD = f"{NATIVE}, cold call (packs every weight)"


def at_batch(impl: str, batch: int) -> str:
    """The row name of ``impl``'s call at the larger batch (``GenerateBenchConfig.large_batch``)."""
    return f"{impl}, batch {batch}"


@dataclass(frozen=True)
class GreedyCheck:
    """The check before timing: ``rows`` prompts decoded greedily for ``tokens`` tokens on both
    sides must agree token for token (the same model, not just the same sizes)."""

    rows: int = 4
    tokens: int = 16


@dataclass(frozen=True)
class GenerateBenchConfig:
    """Sizes of the benchmarked generation, and the greedy check that both sides run the same model."""

    shape: ModelShape
    check: GreedyCheck = GreedyCheck()
    batch: int = 64
    prompt_len: int = 64
    """the longest prompt; prompt lengths run from prompt_len / 2 (left-padded)"""
    new_tokens: int = 128
    """tokens generated per row (EOS ignored)"""
    repeats: int = 3
    seed: int = 0
    static_cache: bool = True
    """also time HF with a static KV cache, eager and under torch.compile (inductor on CPU)"""
    large_batch: int | None = None
    """also time one call per side at this batch (same models and prompt lengths)"""
    large_new_tokens: int | None = None
    """tokens generated per row in the large-batch call (default ``new_tokens``)"""

    @property
    def large_call(self) -> GenerateBenchConfig | None:
        """The large-batch call's sizes, or None without one."""
        if not self.large_batch:
            return None
        return replace(self, batch=self.large_batch, new_tokens=self.large_new_tokens or self.new_tokens)


FULL = GenerateBenchConfig(replace(MEDIUM_SHAPE, intermediate_size=1376))
# static_cache off: compiling takes minutes, the full run only.
QUICK = GenerateBenchConfig(
    QUICK_SHAPE, batch=4, prompt_len=8, new_tokens=8, repeats=1, check=GreedyCheck(2, 4), static_cache=False
)


def make_prompts(cfg: GenerateBenchConfig, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(input_ids, attention_mask) [batch, prompt_len], left-padded, random tokens (never pad / eos)."""
    g = torch.Generator().manual_seed(cfg.seed)
    lengths = torch.randint(cfg.prompt_len // 2, cfg.prompt_len + 1, (cfg.batch,), generator=g)
    ids = torch.randint(3, cfg.shape.vocab_size, (cfg.batch, cfg.prompt_len), generator=g)
    mask = (torch.arange(cfg.prompt_len)[None, :] >= (cfg.prompt_len - lengths)[:, None]).long()
    return ids.masked_fill(mask == 0, pad_id), mask


def _sides(model_dir: str, tokenizer: Any):
    """(native engine, HF model) on the same checkpoint."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.rollout import RolloutConfig, build_rollout

    runtime = init_runtime(ParallelLayout(), seed=0)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(path=model_dir, dtype="float32")
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, model_dir, runtime, model_cfg)
    config = RolloutConfig(temperature=1.0, top_k=-1, top_p=1.0, ignore_eos=True, seed=0)
    engine = build_rollout(config, runtime, chunks, tokenizer, hf_config)
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None  # run every row to full length, like ignore_eos
    return engine, hf


def _native_call(
    engine, ids: torch.Tensor, mask: torch.Tensor, new_tokens: int, greedy: bool = False, version: int = 0
):
    """The engine's generate; ``version``: the weights version the call names (the weights never
    change here: a new one only to time a cold call, which packs every weight again)."""
    from verl_megatron.protocol import DataProto

    meta = {
        "response_length": new_tokens,
        "weights_version": version,
        **({"do_sample": False} if greedy else {}),
    }
    out = engine.generate_sequences(
        DataProto.from_dict({"input_ids": ids, "attention_mask": mask}, meta_info=meta)
    )
    return out.batch["responses"]


def _hf_call(
    hf,
    ids: torch.Tensor,
    mask: torch.Tensor,
    new_tokens: int,
    pad_id: int,
    greedy: bool = False,
    cache: str | None = None,
):
    """HF generate; ``cache``: None (dynamic cache), "static" or "compiled" (static cache and
    torch.compile of the forward, which transformers only does on CPU when asked to)."""
    # transformers' default top_k is 50: off, as on our side.
    sampling = (
        {"do_sample": False} if greedy else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
    )
    extra: dict[str, Any] = {}
    if cache is not None:
        from transformers import CompileConfig

        extra["cache_implementation"] = "static"
        if cache == "compiled":
            compile_config = CompileConfig()
            compile_config._compile_all_devices = True  # transformers compiles on GPUs only unless told
            extra["compile_config"] = compile_config
        else:
            extra["disable_compile"] = True
    with torch.no_grad():
        out = hf.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            pad_token_id=pad_id,
            **sampling,
            **extra,
        )
    return out[:, ids.shape[1] :]


def run(cfg: GenerateBenchConfig, workdir: Path) -> Section:
    """Build the checkpoint, then :func:`measure`.

    Runs with the caller's torch thread count (``main`` and ``run.py`` set it; headline: 2).
    """
    model_dir, tokenizer = build_assets(workdir, cfg.shape, seed=cfg.seed)
    return measure(cfg, model_dir, tokenizer)


def _gemms(cfg: GenerateBenchConfig) -> list[tuple[int, int, int]]:
    """The model's matmuls at a decoding step's rows and at the prefill's: the peak's shapes."""
    steps = cfg.shape.gemm_shapes(cfg.large_batch) if cfg.large_batch else []
    return cfg.shape.gemm_shapes(cfg.batch) + cfg.shape.gemm_shapes(cfg.batch * cfg.prompt_len) + steps


def side_flops(cfg: GenerateBenchConfig, mask: torch.Tensor) -> dict[str, dict[str, float]]:
    """Model and spent FLOPs per side: ours prefills the real prompt tokens only, HF every
    column of the left-padded prompts; both run the LM head at a prefill's last position."""
    b, p = cfg.batch, cfg.prompt_len
    flops = functools.partial(generation_flops, cfg.shape, b, cache_len=p, new_tokens=cfg.new_tokens)
    ours, theirs = flops(prefill=(int(mask.sum()), b)), flops(prefill=(b * p, b))
    return {NATIVE: ours, HF: theirs, HF_STATIC: theirs, HF_COMPILED: theirs}


def measure(cfg: GenerateBenchConfig, model_dir: str, tokenizer: Any) -> Section:
    """Check both sides agree greedily on ``model_dir``, then time them interleaved; tokens/s and
    MFU on model and on spent FLOPs against the matmul peak at the model's decoding shapes."""
    peak_before = measure_matmul_peak(_gemms(cfg), repeats=3)
    engine, hf = _sides(model_dir, tokenizer)
    pad = tokenizer.pad_token_id
    ids, mask = make_prompts(cfg, pad)

    rows = slice(0, cfg.check.rows)
    ours = _native_call(engine, ids[rows], mask[rows], cfg.check.tokens, greedy=True)
    theirs = _hf_call(hf, ids[rows], mask[rows], cfg.check.tokens, pad, greedy=True)
    agree = bool(torch.equal(ours, theirs))

    fns = {
        NATIVE: lambda: _native_call(engine, ids, mask, cfg.new_tokens),
        HF: lambda: _hf_call(hf, ids, mask, cfg.new_tokens, pad),
    }
    errors: dict[str, str] = {}
    if cfg.static_cache:
        for name, cache in ((HF_STATIC, "static"), (HF_COMPILED, "compiled")):
            fn = functools.partial(_hf_call, hf, ids, mask, cfg.new_tokens, pad, cache=cache)
            try:
                fn()  # the full shape once: the static cache's size, and compilation, are per shape
            except Exception as exc:  # inductor needs a C++ compiler; record why instead of failing
                errors[name] = error_text(exc)
                continue
            fns[name] = fn
    # One untimed call of the timed size per side first: the first call at a batch's size pays a
    # one-time cost. At Qwen2.5-0.5B's shape ours took 5.3-5.7 s against 4.7-4.9 s for the calls
    # after it, most of it in the prefill (2.0 s the first time, 1.35-1.47 s after, at any prompt
    # lengths), and a warm-up on a 2-row batch did not cover it (AMD EPYC, 2 threads).
    timings = time_interleaved(fns, repeats=cfg.repeats, warmup=1)
    flops = side_flops(cfg, mask)
    # A new weights version: the call packs every weight again, as the first after an update.
    packs = engine.packed.packs
    timings[NATIVE_COLD] = Timing(
        [time_once(lambda: _native_call(engine, ids, mask, cfg.new_tokens, version=1))[0]]
    )
    flops[NATIVE_COLD], cold_packs = flops[NATIVE], engine.packed.packs - packs
    # One call generating a single token: our prefill (and one draw) alone, for the profile note.
    prefill_s = time_once(lambda: _native_call(engine, ids, mask, 1, version=1))[0]
    if cfg.large_batch:
        _time_large_batch(cfg, engine, hf, pad, timings, flops)
    peak = best_peak(peak_before, measure_matmul_peak(_gemms(cfg), repeats=3))
    section = Section(
        name="generation",
        title="Generation throughput: native rollout engine vs Hugging Face generate (same weights)",
        columns=[
            "impl",
            "tokens/s (best)",
            "tokens/s (median)",
            "seconds (best)",
            "seconds (median)",
            MFU_MODEL,
            MFU_SPENT,
        ],
        config={
            "model": shape_text(cfg.shape),
            "batch": cfg.batch,
            "prompt_len": f"{cfg.prompt_len // 2}-{cfg.prompt_len} (left-padded)",
            "new_tokens": cfg.new_tokens,
            "sampling": "temperature 1, no top-k/top-p, EOS ignored",
            "dtype": "float32",
            "threads": torch.get_num_threads(),
            "repeats": cfg.repeats,
            **(
                {"large call": f"batch {cfg.large_batch}, {cfg.large_call.new_tokens} new tokens, once"}
                if cfg.large_batch
                else {}
            ),
        },
        extra={"settings": asdict(cfg), "timings": {k: t.as_dict() for k, t in timings.items()}},
    )
    large = {at_batch(impl, cfg.large_batch) for impl in (NATIVE, HF)} if cfg.large_batch else set()
    for name, timing in timings.items():
        call = cfg.large_call if name in large else cfg
        tokens = call.batch * call.new_tokens
        section.rows.append(
            {
                "impl": name,
                "tokens/s (best)": tokens / timing.best,
                "tokens/s (median)": tokens / timing.median,
                "seconds (best)": timing.best,
                "seconds (median)": timing.median,
                **mfu_columns(flops[name], timing.best, peak["peak_gflops"]),
            }
        )
    section.extra.update(
        matmul_peak=peak, flops={k: flops[k] for k in timings}, native_prefill_s=prefill_s,
        native_cold_s=timings[NATIVE_COLD].best, native_cold_packs=cold_packs,
    )  # fmt: skip
    by_name = {row["impl"]: row for row in section.rows}
    native, peer = by_name[NATIVE], by_name[HF]
    section.ratios["tokens/s native / HF generate (best)"] = ratio(
        native["tokens/s (best)"], peer["tokens/s (best)"]
    )
    section.ratios["tokens/s native / HF generate (median)"] = ratio(
        native["tokens/s (median)"], peer["tokens/s (median)"]
    )
    for name in (HF_STATIC, HF_COMPILED):
        if name in by_name:
            section.ratios[f"tokens/s native / {name} (best)"] = ratio(
                native["tokens/s (best)"], by_name[name]["tokens/s (best)"]
            )
    for kind, column in (("model", MFU_MODEL), ("spent", MFU_SPENT)):
        section.ratios[f"MFU native, {kind} FLOPs (fraction of matmul peak)"] = native[column] / 100
    section.ratios["seconds native cold call (packing included) / best warm call"] = ratio(
        by_name[NATIVE_COLD]["seconds (best)"], native["seconds (best)"]
    )
    if cfg.large_batch:
        big = {impl: by_name[at_batch(impl, cfg.large_batch)] for impl in (NATIVE, HF)}
        section.ratios[f"tokens/s native / HF generate at batch {cfg.large_batch} (one call each)"] = ratio(
            big[NATIVE]["tokens/s (best)"], big[HF]["tokens/s (best)"]
        )
        section.ratios[f"MFU native at batch {cfg.large_batch}, model FLOPs (fraction of matmul peak)"] = (
            big[NATIVE][MFU_MODEL] / 100
        )
    section.notes.append(
        f"matmul peak {peak['peak_gflops']:.1f} GFLOP/s: best torch.matmul rate over the model's GEMM shapes "
        f"at M = {cfg.batch} (a decoding step) and {cfg.batch * cfg.prompt_len} (the prefill), "
        f"{peak['threads']} threads, float32, measured before and after the timed calls. {FLOPS_MODEL_SPENT_NOTE}"
    )
    section.errors.update(errors)
    if not cfg.static_cache:
        section.notes.append(
            "HF with a static cache / torch.compile: full run only (compiling takes minutes)"
        )
    section.notes.append(SHARED_HEAP_NOTE)
    section.notes.append(
        f"greedy check ({cfg.check.rows} prompts x {cfg.check.tokens} tokens): "
        + ("identical tokens on both sides" if agree else "TOKENS DIFFER between the two sides")
    )
    section.extra["greedy_check_identical"] = agree
    return section


def _time_large_batch(cfg: GenerateBenchConfig, engine, hf, pad: int, timings: dict, flops: dict) -> None:
    """One call per side (interleaved) at ``cfg.large_batch``, into ``timings`` / ``flops``."""
    big = cfg.large_call
    ids, mask = make_prompts(big, pad)
    fns = {
        NATIVE: lambda: _native_call(engine, ids, mask, big.new_tokens, version=1),
        HF: lambda: _hf_call(hf, ids, mask, big.new_tokens, pad),
    }
    big_flops = side_flops(big, mask)
    for impl, timing in time_interleaved(fns, repeats=1, warmup=0).items():
        timings[at_batch(impl, big.batch)], flops[at_batch(impl, big.batch)] = timing, big_flops[impl]


def run_section(quick: bool, workdir: Path) -> Section:
    """Entry point for ``benchmarks/run.py``."""
    return run(QUICK if quick else FULL, workdir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, one repeat: checks the script runs")
    parser.add_argument("--out", default=None, help="JSON result file (default: print only)")
    parser.add_argument("--threads", type=int, default=HEADLINE_THREADS, help="torch threads (headline: 2)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    machine = machine_info()
    with tempfile.TemporaryDirectory(prefix="bench_generate_") as tmp:
        section = run_section(args.quick, Path(tmp))
    machine = {**machine, "load_average_1m_end": machine_info()["load_average_1m"]}
    print(section.to_markdown())
    if args.out:  # benchmarks/results/ holds run.py's full run only
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(section.to_json(machine), indent=2, default=str) + "\n")
        out.with_suffix(".md").write_text(section.to_markdown())
        print(f"wrote {out} and {out.with_suffix('.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
