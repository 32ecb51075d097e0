"""Tiny tokenizers and models built on the spot, for tests, benchmarks and the offline quickstart.

Nothing here touches a model hub: every asset is created from code, saved with ``save_pretrained``
and reloads with the ``Auto*`` classes from its folder.

- ``build_char_tokenizer``: one token per character, so digits decode back exactly; works beside
  any model family except ``qwen2`` (transformers always rebuilds a BPE ``Qwen2Tokenizer`` there).
- ``build_bpe_tokenizer``: byte-level BPE with Qwen2's pre-tokenizer split, safe beside ``qwen2``.
- ``build_tiny_hf_model``: a random-init llama / qwen2 / qwen3 / mistral causal LM.
- ``build_tiny_reward_model``: the same families as a one-label ``*ForSequenceClassification``.
"""

from __future__ import annotations

import os
import string
from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
    PreTrainedTokenizerFast,
)

__all__ = [
    "BPE_CHAT_TEMPLATE",
    "CHAR_CHAT_TEMPLATE",
    "DEFAULT_ALPHABET",
    "MODEL_FAMILIES",
    "MOE_FAMILIES",
    "build_bpe_tokenizer",
    "build_char_tokenizer",
    "build_tiny_hf_model",
    "build_tiny_reward_model",
]

DEFAULT_ALPHABET = string.digits + string.ascii_letters + string.punctuation + " \n"

# One marker per role; every turn ends with the eos token, so a model that learns to close its
# answer with eos stops generating at the end of its turn.
CHAR_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{%- endif -%}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + '<|endoftext|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

# ChatML as used by Qwen2: turns end with <|im_end|>, which is also the eos token.
BPE_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|im_start|>assistant\\n' }}{%- endif -%}"
)

# The split rule of Qwen2's tokenizer (transformers' Qwen2Tokenizer.PRETOKENIZE_REGEX): letters
# stay together, every digit is its own piece, punctuation runs and whitespace are split apart.
QWEN2_PRETOKENIZE_REGEX = r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""

MODEL_FAMILIES = ("llama", "qwen2", "qwen3", "mistral")
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral")


def build_char_tokenizer(
    out_dir: str | os.PathLike,
    alphabet: str = DEFAULT_ALPHABET,
    extra_tokens: Sequence[str] = (),
    chat_template: str | None = CHAR_CHAT_TEMPLATE,
    with_bos: bool = False,
) -> PreTrainedTokenizerFast:
    """A character-level tokenizer saved to ``out_dir``; returns it as loaded from there.

    Ids: ``<pad>`` 0, ``<|endoftext|>`` 1 (eos), ``<unk>`` 2, then ``<bos>`` if ``with_bos``, the
    role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>``, each ``extra_tokens`` entry (all
    special), and finally one id per character of ``alphabet`` in order. Characters outside the
    alphabet encode to ``<unk>``. Decoding joins characters without inserted spaces, so
    ``decode(ids, skip_special_tokens=True)`` of digit tokens gives the digits back.
    """
    specials = ["<pad>", "<|endoftext|>", "<unk>"] + (["<bos>"] if with_bos else [])
    specials += ["<|system|>", "<|user|>", "<|assistant|>", *extra_tokens]
    _check_unique("special token", specials)
    if not alphabet:
        raise ValueError("build_char_tokenizer: alphabet is empty")
    _check_unique("alphabet character", list(alphabet))

    vocab = {token: i for i, token in enumerate([*specials, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # Every character is its own piece; [\s\S] also matches newlines, which "." would skip.
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    # Fuse concatenates the pieces as they are; the default decoder would join them with spaces.
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(specials)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<pad>",
        eos_token="<|endoftext|>",
        unk_token="<unk>",
        bos_token="<bos>" if with_bos else None,
        additional_special_tokens=specials[3 + with_bos :],
        # Transformers' clean-up would delete the space in e.g. "a ." -> "a."; keep text exact.
        clean_up_tokenization_spaces=False,
    )
    return _save_and_reload(tokenizer, out_dir, chat_template)


def _default_bpe_corpus() -> list[str]:
    """A small deterministic corpus: arithmetic Q&A, chat-formatted lines and plain English."""
    lines = [
        f"What is {a} + {b}? The answer is {a + b}." for a in range(0, 100, 7) for b in range(0, 100, 11)
    ]
    lines += [
        f"<|im_start|>user\nCompute {a} * {b}.<|im_end|>\n<|im_start|>assistant\n{a * b}<|im_end|>"
        for a in range(12)
        for b in range(12)
    ]
    lines += [
        "The quick brown fox jumps over the lazy dog.",
        "Reinforcement learning improves a policy with rewards from its own samples.",
        "Let's think step by step, then put the final answer after ####.",
        "Hello, world! How are you today? I'm fine, thanks.",
    ] * 8
    return lines


def build_bpe_tokenizer(
    out_dir: str | os.PathLike,
    vocab_size: int = 512,
    corpus: Sequence[str] | None = None,
    chat_template: str | None = BPE_CHAT_TEMPLATE,
) -> PreTrainedTokenizerFast:
    """A byte-level BPE trained on ``corpus`` (a built-in one by default), saved to ``out_dir``.

    Specials as in Qwen2: ``<|endoftext|>`` 0 (pad), ``<|im_start|>`` 1, ``<|im_end|>`` 2 (eos).
    The pre-tokenizer, normalizer and decoder are Qwen2's, so the files load identically with
    ``AutoTokenizer`` whether they sit alone or beside a ``qwen2`` model (which forces
    ``Qwen2Tokenizer``). Every byte is in the vocabulary, so any text round-trips.
    """
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    min_size = len(specials) + len(pre_tokenizers.ByteLevel.alphabet())
    if vocab_size <= min_size:
        raise ValueError(
            f"build_bpe_tokenizer: vocab_size {vocab_size} must exceed {min_size} (specials + 256 bytes)"
        )
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(list(corpus) if corpus is not None else _default_bpe_corpus(), trainer=trainer)

    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        pad_token="<|endoftext|>",
        eos_token="<|im_end|>",
        additional_special_tokens=["<|im_start|>"],
        clean_up_tokenization_spaces=False,
    )
    return _save_and_reload(tokenizer, out_dir, chat_template)


def _check_unique(kind: str, items: Sequence[str]) -> None:
    duplicates = sorted(item for item, count in Counter(items).items() if count > 1)
    if duplicates:
        raise ValueError(f"duplicate {kind}s: {duplicates}")


def _save_and_reload(
    tokenizer: PreTrainedTokenizerFast, out_dir: str | os.PathLike, chat_template: str | None
) -> PreTrainedTokenizerFast:
    """Save, then return the reloaded copy so callers use exactly what other code will load."""
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(os.fspath(out_dir), local_files_only=True)


def build_tiny_hf_model(
    out_dir: str | os.PathLike,
    family: str,
    *,
    vocab_size: int | None = None,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    tie_word_embeddings: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    tokenizer: PreTrainedTokenizerBase | None = None,
    **overrides: Any,
) -> PreTrainedModel:
    """A random-init causal LM of ``family`` saved as safetensors to ``out_dir`` (eval mode).

    ``family``: ``llama``; ``qwen2`` (bias on q/k/v); ``qwen3`` (RMSNorm on q and k per head);
    ``mistral`` (sliding window off, so attention is fully causal like the others); the MoE
    families ``qwen3_moe``, ``qwen2_moe`` and ``mixtral`` get 4 experts, top-2 routing, experts of
    ``intermediate_size // 2`` (mixtral: ``intermediate_size``) and, for qwen2_moe, a gated shared
    expert of ``intermediate_size``; ``deepseek_v3`` gets multi-latent attention and 8 sigmoid-routed
    experts of ``intermediate_size // 4`` with a shared one, layer 0 dense (``_TINY_DEEPSEEK_V3``)
    (``overrides`` change ``num_experts``, ``num_experts_per_tok``,
    ``moe_intermediate_size``, ``output_router_logits``, ... like any other field). Attention is
    grouped-query when ``num_kv_heads < num_heads``; ``head_dim = hidden_size // num_heads``.
    ``vocab_size`` defaults to ``len(tokenizer)``. The same ``seed`` gives the same weights, and the
    caller's torch RNG state is left untouched. ``overrides`` set any other config field (e.g.
    ``max_position_embeddings``, ``rope_theta``). When ``tokenizer`` is given its ids for
    bos/eos/pad go into the config and it is saved beside the model; it must reload unchanged there.
    """
    config = _tiny_config(
        family, vocab_size, hidden_size, num_layers, num_heads, num_kv_heads, intermediate_size,
        tie_word_embeddings, tokenizer, overrides,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        _check_tokenizer_reloads(tokenizer, out_dir, family)
    return model


def build_tiny_reward_model(
    out_dir: str | os.PathLike,
    family: str,
    *,
    tokenizer: PreTrainedTokenizerBase | None = None,
    vocab_size: int | None = None,
    seed: int = 0,
    score_std: float = 1.0,
    **kwargs: Any,
) -> PreTrainedModel:
    """A random-init one-label ``<Family>ForSequenceClassification`` (a reward model) saved to ``out_dir``.

    Arguments as :func:`build_tiny_hf_model`. The ``score`` head is drawn with std ``score_std``
    (transformers' 0.02 would make every reward almost 0, hiding errors in tests).
    """
    from transformers import AutoModelForSequenceClassification

    shape = {k: kwargs.pop(k) for k in list(kwargs) if k in _SHAPE_ARGS}
    config = _tiny_config(
        family, vocab_size, shape.get("hidden_size", 64), shape.get("num_layers", 2), shape.get("num_heads", 4),
        shape.get("num_kv_heads", 2), shape.get("intermediate_size", 128), False, tokenizer,
        {"num_labels": 1, **kwargs},
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32)
        with torch.no_grad():
            model.score.weight.normal_(0.0, score_std)
    model.eval()
    os.makedirs(out_dir, exist_ok=True)
    model.save_pretrained(out_dir)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
        _check_tokenizer_reloads(tokenizer, out_dir, family)
    return model


_SHAPE_ARGS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size")


def _tiny_config(
    family: str,
    vocab_size: int | None,
    hidden_size: int,
    num_layers: int,
    num_heads: int,
    num_kv_heads: int,
    intermediate_size: int,
    tie_word_embeddings: bool,
    tokenizer: PreTrainedTokenizerBase | None,
    overrides: dict[str, Any],
) -> Any:
    known = (*MODEL_FAMILIES, *MOE_FAMILIES, "deepseek_v3")
    if family not in known:
        raise ValueError(f"unknown model family '{family}'; expected one of {list(known)}")
    if hidden_size % num_heads != 0:
        raise ValueError(f"hidden_size {hidden_size} is not divisible by num_heads {num_heads}")
    if num_heads % num_kv_heads != 0:
        raise ValueError(f"num_heads {num_heads} is not divisible by num_kv_heads {num_kv_heads}")
    if vocab_size is None:
        if tokenizer is None:
            raise ValueError("build_tiny_hf_model: pass vocab_size or a tokenizer")
        vocab_size = len(tokenizer)
    if tokenizer is not None and len(tokenizer) > vocab_size:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the tokenizer's {len(tokenizer)} tokens")

    fields: dict[str, Any] = {
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": hidden_size // num_heads,
        "intermediate_size": intermediate_size,
        "tie_word_embeddings": tie_word_embeddings,
        "max_position_embeddings": 2048,
    }
    if family in ("mistral", "mixtral"):
        fields["sliding_window"] = None
    fields.update(_tiny_moe_fields(family, intermediate_size))
    if tokenizer is not None:
        fields.update(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
    fields.update(overrides)
    return AutoConfig.for_model(family, **fields)


def _tiny_moe_fields(family: str, intermediate_size: int) -> dict[str, Any]:
    """Router and expert fields of a tiny MoE config (empty for a dense family)."""
    if family == "mixtral":
        return {"num_local_experts": 4, "num_experts_per_tok": 2}
    if family == "deepseek_v3":
        return _TINY_DEEPSEEK_V3 | {"moe_intermediate_size": intermediate_size // 4}
    if family not in MOE_FAMILIES:
        return {}
    fields = {
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": intermediate_size // 2,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
    }
    if family == "qwen2_moe":
        fields["shared_expert_intermediate_size"] = intermediate_size
    return fields


# DeepSeek-V3 (multi-latent attention, sigmoid routing with expert bias): q/kv latents 48/32, nope 16
# + rope 8 per query/key head (head_dim is the rope part), value 16; 8 routed experts in 4 groups
# (2 kept), top-4, one shared expert, routing weights x 2.5, the first layer dense, no MTP layers.
_TINY_DEEPSEEK_V3 = {
    "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "head_dim": 8,
    "v_head_dim": 16, "n_routed_experts": 8, "n_group": 4, "topk_group": 2, "num_experts_per_tok": 4,
    "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "first_k_dense_replace": 1, "num_nextn_predict_layers": 0,
}  # fmt: skip


_PROBE_TEXT = "Q: 12 + 35 = ? A: 47\nHello, world!"


def _check_tokenizer_reloads(
    tokenizer: PreTrainedTokenizerBase, out_dir: str | os.PathLike, family: str
) -> None:
    """transformers may rebuild a tokenizer from its vocabulary by model type (qwen2 always gets a
    BPE Qwen2Tokenizer), which silently breaks other kinds of tokenizer; catch that here."""
    reloaded = AutoTokenizer.from_pretrained(os.fspath(out_dir), local_files_only=True)
    expected, got = tokenizer(_PROBE_TEXT)["input_ids"], reloaded(_PROBE_TEXT)["input_ids"]
    if expected != got:
        raise ValueError(
            f"the tokenizer saved beside the {family} model in '{out_dir}' reloads as "
            f"{type(reloaded).__name__} and encodes differently ({got[:8]}... vs {expected[:8]}...); "
            "for qwen2 use build_bpe_tokenizer"
        )
