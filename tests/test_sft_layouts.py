"""SFT under the layouts tests/test_sft.py does not cover: virtual pipeline stages (pp=2 x vpp=2,
a 4-layer Llama) and expert parallelism (ep=2 with dp=2, a tiny Qwen3-MoE without the aux loss, so
transformers' plain forward is the reference). Each runs one SGD step (lr=1) on test_sft's batch:
per-token log-probs, the loss, the gradients and the grad norm must match transformers in float64
within 3x the float32 error (``tests/test_sft.assert_matches_float64``), and the loss must equal
one process's. Context parallelism (GPU-only: Transformer Engine attention) stops with the RL
path's named error on this machine.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

from tests.helpers import saved_model
from tests.test_actor_update import VOCAB
from tests.test_sft import assert_matches_float64, hf_references

VARIANTS = ["packed", "dynamic"]


def build_llama4(path: str) -> None:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(path, "llama", vocab_size=VOCAB, hidden_size=32, num_layers=4, num_heads=4,
                        num_kv_heads=2, intermediate_size=64, seed=11)  # fmt: skip


def build_moe(path: str) -> None:
    from verl_megatron.utils.local_assets import build_tiny_hf_model

    build_tiny_hf_model(path, "qwen3_moe", vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4,
                        num_kv_heads=2, intermediate_size=64, seed=11, output_router_logits=False,
                        num_experts=4, num_experts_per_tok=2, initializer_range=0.1)  # fmt: skip


def per_expert(references: dict) -> dict:
    """transformers' fused expert gradients ([E, 2I, H] gate_up_proj, [E, H, I] down_proj) under the
    per-expert names the megatron export uses; each piece's float32 error is the fused tensor's."""
    out = {}
    for mode, (exact, error) in references.items():
        grads, errors = {}, {}
        for name, grad in exact["grads"].items():
            prefix, _, kind = name.rpartition(".")
            if kind not in ("gate_up_proj", "down_proj"):
                grads[name], errors[name] = grad, error["grads"][name]
                continue
            for expert, piece in enumerate(grad):
                pieces = piece.chunk(2, dim=0) if kind == "gate_up_proj" else (piece,)
                names = ("gate_proj", "up_proj") if kind == "gate_up_proj" else ("down_proj",)
                for part, value in zip(names, pieces):
                    key = f"{prefix}.{expert}.{part}.weight"
                    grads[key], errors[key] = value, error["grads"][name]
        out[mode] = ({**exact, "grads": grads}, {**error, "grads": errors})
    return out


@pytest.fixture(scope="module", params=["vpp", "ep"])
def case(request, tmp_path_factory, pool1) -> dict:
    """The model, its float64 references and the one-process run; the 2-process layout."""
    build, layout, load = {
        "vpp": (build_llama4, {"pp": 2, "vpp": 2}, {}),
        # transformers' grouped expert matmul takes no float64: its plain loop does
        "ep": (build_moe, {"ep": 2}, {"experts_implementation": "eager"}),
    }[request.param]
    path = saved_model(tmp_path_factory, f"sft_{request.param}", build)
    single = pool1.run("tests.test_sft:sft_job", path=path, variants=VARIANTS)[0]
    references = hf_references(path, ("token-mean",), **load)
    if request.param == "ep":
        references = per_expert(references)
    assert set(references["token-mean"][0]["grads"]) == set(single["packed"]["grads"])
    return {
        "path": path,
        "layout": layout,
        "single": single,
        "references": references,
    }


def test_sft_vpp_and_ep_equal_one_process(pool2, case):
    run = pool2.run("tests.test_sft:sft_job", path=case["path"], variants=VARIANTS, **case["layout"])[0]
    for variant in VARIANTS:
        assert_matches_float64(case["single"][variant], variant, case["references"])
        assert_matches_float64(run[variant], f"{variant} {case['layout']}", case["references"])
        single = case["single"][variant]["loss"]
        diff = abs(run[variant]["loss"] - single)
        assert diff <= 1e-6 * max(1.0, abs(single)), f"{variant} {case['layout']}: loss differs by {diff:.3g}"


class _Chunk(torch.nn.Linear):
    def no_sync(self):  # what the actor asks of a DDP-wrapped chunk
        return contextlib.nullcontext()


def test_sft_context_parallel_stops_like_rl_on_cpu():
    """The SFT actor builds the RL actor's runner, whose cp check names the key (test_context_parallel)."""
    from tests.test_sft import sgd_config
    from verl_megatron.distributed.parallel import ParallelLayout, Runtime
    from verl_megatron.errors import ParallelConfigError
    from verl_megatron.workers.sft import SFTActor

    runtime = Runtime(
        layout=ParallelLayout(cp=2, dp=1), rank=0, world_size=2, local_rank=0,
        device=torch.device("cpu"), backend="gloo", seed=0,
    )  # fmt: skip
    cfg = sgd_config(use_remove_padding=True, ppo_micro_batch_size_per_gpu=3)
    with pytest.raises(
        ParallelConfigError, match=r"context parallelism \(parallel.cp=2\) needs Transformer Engine"
    ):
        SFTActor(runtime, cfg, [_Chunk(1, 1)], None, None)
