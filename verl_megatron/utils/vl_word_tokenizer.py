"""A word-level tokenizer for small vision-language tasks, built on the spot (no hub).

Each word of a fixed list is one token, so a task whose answer is one word (a colour) has it as a
single token among a few dozen: a random-init policy samples it often enough for RL to start
(``data/shapes_task.py``). The vision markers are Qwen2-VL's, and the chat template renders
``{"type": "image"}`` parts as ``<|vision_start|><|image_pad|><|vision_end|>``, so the Qwen2.5-VL
processor path (``data/multimodal.py``) encodes prompts as it does for the real checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

__all__ = ["WORD_VL_CHAT_TEMPLATE", "build_vl_word_tokenizer"]

# One marker per role; a turn ends with the eos token (a policy learns to stop after its answer).
WORD_VL_CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{ '<|' + message['role'] + '|>' }}"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' -%}{{ '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}"
    "{{ '<|endoftext|>' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<|assistant|>' }}{%- endif -%}"
)

_SPECIALS = ["<pad>", "<|endoftext|>", "<unk>", "<|system|>", "<|user|>", "<|assistant|>"]
_VISION = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def build_vl_word_tokenizer(out_dir: str | os.PathLike, words: Sequence[str]) -> Any:
    """Ids: ``<pad>`` 0, ``<|endoftext|>`` 1 (eos), ``<unk>`` 2, the role markers, Qwen2-VL's vision
    markers (all special), then one id per entry of ``words`` (lower-case words or punctuation).
    Text is lower-cased and split at whitespace and punctuation; unknown words encode to ``<unk>``;
    decoding joins words with spaces. Saved to ``out_dir`` and returned as reloaded from there."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    specials = _SPECIALS + _VISION
    if len(set(words)) != len(words) or set(words) & set(specials):
        raise ValueError(f"build_vl_word_tokenizer: words must be unique and not special, got {list(words)}")
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate([*specials, *words])}, unk_token="<unk>"))
    tok.normalizer = normalizers.Lowercase()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.WhitespaceSplit(), pre_tokenizers.Punctuation()]
    )
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=True)  # words joined by spaces, "red ?" -> "red?"
    tok.add_special_tokens(specials)
    roles = dict(zip(("pad_token", "eos_token", "unk_token"), specials))
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        additional_special_tokens=specials[3:],
        clean_up_tokenization_spaces=False,
        **roles,
    )
    tokenizer.chat_template = WORD_VL_CHAT_TEMPLATE
    os.makedirs(out_dir, exist_ok=True)
    tokenizer.save_pretrained(out_dir)
    return AutoTokenizer.from_pretrained(os.fspath(out_dir), local_files_only=True)
