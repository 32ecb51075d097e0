"""Locally built tokenizers and tiny models: exact ids, text round trips, and identical logits after reload."""

import os

import pytest
import torch
from jinja2 import TemplateError
from transformers import AutoModelForCausalLM, AutoTokenizer

from verl_megatron.utils.local_assets import (
    MODEL_FAMILIES,
    build_bpe_tokenizer,
    build_char_tokenizer,
    build_tiny_hf_model,
)
from verl_megatron.utils.tokenizer import hf_tokenizer

MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "12+3?"}]


@pytest.fixture(scope="module")
def char_tok(tmp_path_factory):
    return build_char_tokenizer(tmp_path_factory.mktemp("char"))


@pytest.fixture(scope="module")
def bpe_tok(tmp_path_factory):
    return build_bpe_tokenizer(tmp_path_factory.mktemp("bpe"))


def test_char_tokenizer_layout_and_digit_round_trip(char_tok):
    # specials 0..5 (<pad>, <|endoftext|>, <unk>, <|system|>, <|user|>, <|assistant|>), then "0" at 6
    assert (char_tok.pad_token_id, char_tok.eos_token_id, char_tok.unk_token_id) == (0, 1, 2)
    assert char_tok.bos_token_id is None
    assert char_tok.convert_tokens_to_ids(["<|system|>", "<|user|>", "<|assistant|>"]) == [3, 4, 5]
    assert char_tok("4702")["input_ids"] == [10, 13, 6, 8]
    assert len(char_tok) == 6 + 10 + 52 + 32 + 2
    # generated digits followed by eos and padding decode to exactly the digits, no spaces inserted
    assert char_tok.decode([10, 13, 6, 8, 1, 0, 0], skip_special_tokens=True) == "4702"
    for text in ["12 + 35 = 47", "a . b\nc", "  x  "]:
        assert char_tok.decode(char_tok(text)["input_ids"]) == text
    assert char_tok("é1")["input_ids"] == [2, 7]  # outside the alphabet -> <unk>


def test_char_tokenizer_chat_template(char_tok):
    text = char_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert text == "<|system|>Be brief.<|endoftext|><|user|>12+3?<|endoftext|><|assistant|>"
    ids = char_tok.apply_chat_template(MESSAGES[1:], add_generation_prompt=True, tokenize=True)["input_ids"]
    plus, question = char_tok.convert_tokens_to_ids(["+", "?"])
    assert ids == [4, 7, 8, plus, 9, question, 1, 5]
    with pytest.raises(TemplateError, match="unsupported chat role: tool"):
        char_tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_char_tokenizer_reloads_with_auto_and_hf_tokenizer(char_tok):
    folder = char_tok.name_or_path
    for reloaded in (AutoTokenizer.from_pretrained(folder), hf_tokenizer(folder)):
        assert reloaded("x = 42\n")["input_ids"] == char_tok("x = 42\n")["input_ids"]
        assert reloaded.decode(reloaded("x = 42\n")["input_ids"]) == "x = 42\n"
        assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 1)
        assert reloaded.chat_template == char_tok.chat_template


def test_char_tokenizer_options(tmp_path):
    tok = build_char_tokenizer(tmp_path, alphabet="0123456789+=", extra_tokens=["<think>"], with_bos=True)
    assert (tok.bos_token, tok.bos_token_id) == ("<bos>", 3)
    assert tok.convert_tokens_to_ids(["<|system|>", "<think>", "0", "="]) == [4, 7, 8, 19]
    assert len(tok) == 20
    assert tok("<think>1+1=2")["input_ids"] == [7, 9, 18, 9, 19, 10]
    assert tok.decode([7, 9, 18, 9, 19, 10], skip_special_tokens=True) == "1+1=2"
    with pytest.raises(ValueError, match=r"duplicate alphabet characters: \['1'\]"):
        build_char_tokenizer(tmp_path / "dup", alphabet="0121")
    with pytest.raises(ValueError, match=r"duplicate special tokens: \['<pad>'\]"):
        build_char_tokenizer(tmp_path / "dup2", extra_tokens=["<pad>"])


def test_bpe_tokenizer_round_trip_and_specials(bpe_tok):
    assert bpe_tok.convert_ids_to_tokens([0, 1, 2]) == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    assert (bpe_tok.pad_token_id, bpe_tok.eos_token_id) == (0, 2)
    assert 3 + 256 < len(bpe_tok) <= 512
    # Qwen2's split puts every digit in its own piece, so "2024" is four tokens
    digits = bpe_tok("2024")["input_ids"]
    assert bpe_tok.convert_ids_to_tokens(digits) == ["2", "0", "2", "4"]
    for text in ["What is 12 + 35? The answer is 47.", "héllo wörld 😀\n\ttabs", "  two  spaces"]:
        assert bpe_tok.decode(bpe_tok(text)["input_ids"]) == text
    assert bpe_tok.decode([*digits, 2, 0], skip_special_tokens=True) == "2024"
    text = bpe_tok.apply_chat_template(MESSAGES[1:], add_generation_prompt=True, tokenize=False)
    assert text == "<|im_start|>user\n12+3?<|im_end|>\n<|im_start|>assistant\n"
    with pytest.raises(ValueError, match="vocab_size 100 must exceed 259"):
        build_bpe_tokenizer("unused", vocab_size=100)


def test_bpe_tokenizer_reloads_beside_a_qwen2_model(bpe_tok, tmp_path):
    build_tiny_hf_model(tmp_path, "qwen2", tokenizer=bpe_tok)
    reloaded = AutoTokenizer.from_pretrained(tmp_path)
    assert type(reloaded).__name__ == "Qwen2Tokenizer"  # transformers rebuilds it for qwen2
    for text in ["What is 12 + 35? The answer is 47.", "héllo 😀\n", "<|im_start|>user\nhi<|im_end|>"]:
        assert reloaded(text)["input_ids"] == bpe_tok(text)["input_ids"]
    assert (reloaded.pad_token_id, reloaded.eos_token_id) == (0, 2)
    chat = reloaded.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    assert (
        chat == bpe_tok.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=True)["input_ids"]
    )
    assert hf_tokenizer(str(tmp_path))("a 1")["input_ids"] == bpe_tok("a 1")["input_ids"]


@pytest.mark.parametrize("family", MODEL_FAMILIES)
def test_tiny_model_reloads_with_identical_logits(family, char_tok, bpe_tok, tmp_path):
    tok = bpe_tok if family == "qwen2" else char_tok
    rng_before = torch.get_rng_state()
    model = build_tiny_hf_model(tmp_path, family, tokenizer=tok, seed=3)
    assert torch.equal(torch.get_rng_state(), rng_before)  # the caller's RNG is untouched
    assert "model.safetensors" in os.listdir(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    ids = torch.tensor([tok("12 + 35 = 47")["input_ids"]])
    with torch.no_grad():
        logits, logits_reloaded = model(ids).logits, reloaded(ids).logits
    assert logits.shape == (1, ids.shape[1], len(tok))
    assert torch.equal(logits, logits_reloaded)

    config = reloaded.config
    assert (config.model_type, config.hidden_size, config.num_hidden_layers) == (family, 64, 2)
    assert (config.eos_token_id, config.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    names = dict(reloaded.named_parameters())
    # GQA: 2 kv heads of head_dim 16 -> k_proj maps 64 -> 32
    assert names["model.layers.0.self_attn.k_proj.weight"].shape == (32, 64)
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (family == "qwen2")
    assert ("model.layers.0.self_attn.q_norm.weight" in names) == (family == "qwen3")


def test_tiny_model_seed_tie_dtype_and_overrides(tmp_path):
    a = build_tiny_hf_model(tmp_path / "a", "llama", vocab_size=32, seed=1)
    b = build_tiny_hf_model(tmp_path / "b", "llama", vocab_size=32, seed=1)
    c = build_tiny_hf_model(tmp_path / "c", "llama", vocab_size=32, seed=2)
    w = "model.layers.1.mlp.up_proj.weight"
    assert torch.equal(a.state_dict()[w], b.state_dict()[w])
    assert not torch.equal(a.state_dict()[w], c.state_dict()[w])

    tied = build_tiny_hf_model(
        tmp_path / "tied",
        "qwen3",
        vocab_size=40,
        tie_word_embeddings=True,
        dtype=torch.bfloat16,
        rope_theta=500.0,
    )
    assert tied.lm_head.weight.data_ptr() == tied.model.embed_tokens.weight.data_ptr()
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "tied")
    assert reloaded.lm_head.weight.dtype == torch.bfloat16
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert reloaded.config.rope_parameters["rope_theta"] == 500.0
    ids = torch.tensor([[1, 5, 39]])
    with torch.no_grad():
        assert torch.equal(tied(ids).logits, reloaded(ids).logits)


def test_tiny_model_rejects_bad_shapes(char_tok, tmp_path):
    with pytest.raises(ValueError, match="unknown model family 'gpt2'"):
        build_tiny_hf_model(tmp_path, "gpt2", vocab_size=32)
    with pytest.raises(ValueError, match="num_heads 4 is not divisible by num_kv_heads 3"):
        build_tiny_hf_model(tmp_path, "llama", vocab_size=32, num_kv_heads=3)
    with pytest.raises(ValueError, match="hidden_size 60 is not divisible by num_heads 8"):
        build_tiny_hf_model(tmp_path, "llama", vocab_size=32, hidden_size=60, num_heads=8, num_kv_heads=8)
    with pytest.raises(ValueError, match="vocab_size 32 is smaller than the tokenizer's 102 tokens"):
        build_tiny_hf_model(tmp_path, "llama", vocab_size=32, tokenizer=char_tok)
    with pytest.raises(ValueError, match="pass vocab_size or a tokenizer"):
        build_tiny_hf_model(tmp_path, "llama")
    with pytest.raises(ValueError, match="reloads as Qwen2Tokenizer and encodes differently"):
        build_tiny_hf_model(tmp_path / "q", "qwen2", tokenizer=char_tok)
