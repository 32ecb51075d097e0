"""LoRA adapters on a Hugging Face model loaded into megatron: PEFT export, merged export, rollout.

A tiny grouped-query Llama (two key/value groups per tp rank) runs at tp=2 with non-zero
adapters on every projection but k_proj (so fused qkv mixes adapted and plain components):

- the exported PEFT folder, loaded by ``peft`` onto the transformers model, gives megatron's
  logits within 1e-4, and the merged export (``export_hf_weights``) loaded by transformers too;
- the native rollout's log-probs (KV-cached decoding through the chunks' own modules) equal
  the training forward's log-probs of the same tokens, and differ from the base model's.
"""

from __future__ import annotations

import json
import os
from types import SimpleNamespace

import pytest
import torch

from tests.closeness import assert_close_report
from tests.helpers import save_tiny_llama

VOCAB, HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 96, 64, 2, 8, 4, 96
TARGETS = ("q_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
RANK, ALPHA = 4, 8.0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("lora_llama")
    save_tiny_llama(
        path, vocab=VOCAB, hidden=HIDDEN, layers=LAYERS, heads=HEADS, kv_heads=KV_HEADS, ffn=FFN, init_std=0.2
    )
    return str(path)


def _sequences() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(2, VOCAB, (n,), generator=g) for n in (9, 5)]


def lora_chunks(model_dir: str, tp: int, pp: int):
    """Chunks of the model with adapters on TARGETS, set to non-zero values by global name."""
    from transformers import AutoConfig

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime
    from verl_megatron.models.builder import build_gpt_chunks
    from verl_megatron.models.config import ModelConfig
    from verl_megatron.models.convert import load_hf_weights
    from verl_megatron.models.lora import LoraSettings, apply_lora
    from verl_megatron.models.sharding import named_global_parameters, seeded_tensor, shard_tp, whole_shape

    runtime = init_runtime(ParallelLayout(tp=tp, pp=pp), seed=11)
    hf_config = AutoConfig.from_pretrained(model_dir)
    model_cfg = ModelConfig(path=model_dir, dtype="float32")
    chunks = build_gpt_chunks(hf_config, runtime, model_cfg)
    load_hf_weights(chunks, model_dir, runtime, model_cfg)
    apply_lora(chunks, LoraSettings(RANK, ALPHA, TARGETS), seed=runtime.seed)
    with torch.no_grad():
        for name, param in named_global_parameters(chunks):
            if name.startswith("lora_adapters."):
                whole = seeded_tensor(name, whole_shape(param, tp), seed=4, std=0.15)
                param.copy_(shard_tp(whole, param, runtime.tp_rank, tp))
    return runtime, chunks, hf_config


def export_job(model_dir: str, out_dir: str, tp: int, pp: int) -> dict:
    from verl_megatron.models.convert import export_hf_weights
    from verl_megatron.models.lora_export import export_peft_adapter
    from verl_megatron.tools.check_hf import megatron_logits

    runtime, chunks, hf_config = lora_chunks(model_dir, tp, pp)
    export_peft_adapter(chunks, runtime, os.path.join(out_dir, "adapter"), base_model=model_dir)
    export_hf_weights(chunks, runtime, os.path.join(out_dir, "merged"), hf_config)
    with torch.no_grad():
        logits = megatron_logits(chunks, runtime, _sequences())
    return {"logits": logits}


def test_peft_and_merged_exports_give_megatrons_logits(pool2, model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = str(tmp_path)
    results = pool2.run(f"{__name__}:export_job", model_dir=model_dir, out_dir=out, tp=2, pp=1)
    logits = results[0]["logits"]
    with open(os.path.join(out, "adapter", "adapter_config.json")) as f:
        config = json.load(f)
    assert (config["r"], config["lora_alpha"], sorted(config["target_modules"])) == (
        RANK,
        ALPHA,
        sorted(TARGETS),
    )

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():  # before peft injects the adapters into it
        base_logits = [base(s[None]).logits[0] for s in _sequences()]
    peft_model = PeftModel.from_pretrained(base, os.path.join(out, "adapter")).eval()
    merged = AutoModelForCausalLM.from_pretrained(os.path.join(out, "merged"), dtype=torch.float32).eval()
    with torch.no_grad():
        peft_logits = [peft_model(s[None]).logits[0] for s in _sequences()]
        merged_logits = [merged(s[None]).logits[0] for s in _sequences()]
    logits, peft_logits, merged_logits = (dict(enumerate(x)) for x in (logits, peft_logits, merged_logits))
    assert_close_report(logits, peft_logits, rtol=0, atol=1e-4, what="megatron vs peft logits")
    assert_close_report(merged_logits, peft_logits, rtol=0, atol=1e-4, what="merged export vs peft logits")
    # The adapters matter: without them the logits are far away.
    assert max(float((a - b).abs().max()) for a, b in zip(peft_logits.values(), base_logits)) > 1e-2


def rollout_job(model_dir: str, tp: int) -> dict:
    from tests.test_rollout_native import prompt_batch
    from verl_megatron.rollout import RolloutConfig, build_rollout
    from verl_megatron.workers.actor import MegatronRef
    from verl_megatron.workers.config import RefConfig

    runtime, chunks, hf_config = lora_chunks(model_dir, tp, 1)
    config = RolloutConfig(
        prompt_length=8,
        response_length=6,
        temperature=0.8,
        n=2,
        seed=5,
        ignore_eos=True,
        calculate_log_probs=True,
    )
    engine = build_rollout(
        config, runtime, chunks, SimpleNamespace(pad_token_id=0, eos_token_id=1), hf_config
    )
    out = engine.generate_sequences(prompt_batch(lengths=[5, 3, 6]))
    out.meta_info["temperature"] = 0.8
    forward = MegatronRef(runtime, RefConfig(log_prob_micro_batch_size_per_gpu=2), chunks)
    trained, _ = forward.compute_log_prob(out)
    with torch.no_grad():  # the same forward without the adapters' contribution
        for _, param in ((n, p) for n, p in chunks[0].named_parameters() if n.endswith("lora_B")):
            param.zero_()
    base, _ = forward.compute_log_prob(out)
    mask = out.batch["response_mask"].bool()
    return {
        "rollout": out.batch["rollout_log_probs"][mask],
        "trained": trained[mask],
        "base": base[mask],
    }


def test_native_rollout_uses_the_adapters(pool2, model_dir):
    for run in pool2.run(f"{__name__}:rollout_job", model_dir=model_dir, tp=2):
        assert_close_report(
            run["rollout"], run["trained"], rtol=0, atol=1e-5, what="rollout vs training log-probs"
        )
        assert float((run["rollout"] - run["base"]).abs().max()) > 1e-2


def sync_job(model_dir: str, tp: int, pp: int, mode: str) -> dict:
    """Two weight syncs into a scripted vLLM backend under ``rollout.lora_sync=mode``."""
    from safetensors.torch import load_file

    from tests.test_rollout_engines import ScriptedBackend
    from verl_megatron.models.lora_export import gather_peft_adapters
    from verl_megatron.rollout.config import RolloutConfig
    from verl_megatron.rollout.vllm_engine import VLLMRollout

    class AdapterBackend(ScriptedBackend):
        def set_lora_adapter(self, folder):
            tensors = load_file(os.path.join(folder.path, "adapter_model.safetensors"))
            self.calls.append(("adapter", folder.name, folder.int_id, folder.path, tensors))

    runtime, chunks, hf_config = lora_chunks(model_dir, tp, pp)
    backend = AdapterBackend()
    config = RolloutConfig(name="vllm", dtype="float32", update_weights_bucket_megabytes=1, lora_sync=mode)
    engine = VLLMRollout(config, runtime, chunks, None, hf_config, backend=backend)
    engine.sync_weights()
    engine.sync_weights()
    calls = [c for c in backend.calls if c[0] in ("load", "adapter")]
    folders_left = [os.path.exists(c[3]) for c in calls if c[0] == "adapter"]
    return {"loaded": backend.loaded, "calls": calls, "folders_left": folders_left,
            "adapters": gather_peft_adapters(chunks, runtime)}  # fmt: skip


def test_weight_sync_sends_merged_weights_or_the_base_once_and_adapters(pool2, model_dir):
    from safetensors.torch import load_file

    base = load_file(os.path.join(model_dir, "model.safetensors"))
    for run in pool2.run(f"{__name__}:sync_job", model_dir=model_dir, tp=1, pp=2, mode="merged"):
        assert run["loaded"].keys() == base.keys()
        assert [c[0] for c in run["calls"]] == ["load", "load"]  # the whole model at every sync
        merged = dict(base)
        for name, a in run["adapters"].items():
            if ".lora_A." in name:
                hf = name.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
                b = run["adapters"][name.replace("lora_A", "lora_B")]
                merged[hf] = base[hf] + (ALPHA / RANK) * b @ a
        assert_close_report(run["loaded"], merged, rtol=0, atol=1e-6, what="merged weights")
        assert not torch.equal(
            run["loaded"]["model.layers.1.mlp.down_proj.weight"], base["model.layers.1.mlp.down_proj.weight"]
        )
    for run in pool2.run(f"{__name__}:sync_job", model_dir=model_dir, tp=1, pp=2, mode="adapter"):
        # The frozen base once (exactly the checkpoint), then one new adapter per sync.
        assert [c[0] for c in run["calls"]] == ["load", "adapter", "adapter"]
        assert all(torch.equal(run["loaded"][k], v) for k, v in base.items())
        (_, name1, id1, _, first), (_, name2, id2, _, second) = run["calls"][1:]
        assert (name1, id1, name2, id2) == ("actor_v1", 1, "actor_v2", 2)
        assert first.keys() == run["adapters"].keys() and len(first) == LAYERS * len(TARGETS) * 2
        assert all(torch.equal(first[k], v) and torch.equal(second[k], v) for k, v in run["adapters"].items())
        assert run["folders_left"] == [False, True]  # the previous adapter's folder is gone
