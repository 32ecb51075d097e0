"""Token pieces a chat template puts around messages (verl's ``utils.tokenizer.chat_template``).

A multi-turn agent loop builds its token sequence turn by turn: the model's reply (ending at
its stop token, e.g. ``<|im_end|>``), then the next tool/user message rendered alone with the
template's system prompt cut off. Two template pieces get lost that way and are found here by
rendering small probe conversations and comparing them:

- the system prompt a template adds on its own (`initialize_system_prompt`): one empty user
  turn minus what a second identical turn adds;
- the turn separator (`initialize_turn_separator`): what the template writes after a turn's
  closing token (ChatML's ``"\\n"``). The model stops at the closing token, so without it
  every turn boundary is one token short of the full conversation's rendering.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from verl_megatron.utils.tokenizer import normalize_token_ids

__all__ = [
    "apply_chat_template",
    "extract_system_prompt_and_generation",
    "initialize_system_prompt",
    "initialize_turn_separator",
]


def _render(
    tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool, **kwargs: Any
) -> list[int]:
    ids = tokenizer.apply_chat_template(
        messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
    )
    return normalize_token_ids(ids)


def initialize_system_prompt(tokenizer: Any, **apply_chat_template_kwargs: Any) -> list[int]:
    """Ids the template emits before the first message when no system message is given
    (empty when it adds none)."""
    return extract_system_prompt_and_generation(tokenizer, **apply_chat_template_kwargs)[0]


def extract_system_prompt_and_generation(
    tokenizer: Any, **apply_chat_template_kwargs: Any
) -> tuple[list[int], list[int]]:
    """(default system prompt ids, generation prompt ids such as ``<|im_start|>assistant\\n``)."""
    user = {"role": "user", "content": ""}
    one = _render(tokenizer, [user], False, **apply_chat_template_kwargs)
    two = _render(tokenizer, [user, user], False, **apply_chat_template_kwargs)
    turn = len(two) - len(one)  # the ids of one empty user turn
    system = one[: len(one) - turn]
    with_prompt = _render(tokenizer, [user], True, **apply_chat_template_kwargs)
    return system, with_prompt[len(one) :]


def _eos_ids(tokenizer: Any) -> set[int]:
    """The tokenizer's eos id(s); a processor keeps them on its wrapped tokenizer, and some
    tokenizers (Llama 3) hold a list."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(getattr(tokenizer, "tokenizer", None), "eos_token_id", None)
    if eos is None:
        return set()
    return {eos} if isinstance(eos, int) else set(eos)


def _user_turn_probes(tokenizer: Any, **kwargs: Any) -> tuple[list[int], list[int]] | None:
    """One user turn rendered with empty and with non-empty text, as plain strings or, for
    processors that take only typed parts, as ``[{"type": "text", ...}]``; None if neither works."""
    for empty, filled in (("", "x"), ([{"type": "text", "text": ""}], [{"type": "text", "text": "x"}])):
        try:
            return (
                _render(tokenizer, [{"role": "user", "content": empty}], False, **kwargs),
                _render(tokenizer, [{"role": "user", "content": filled}], False, **kwargs),
            )
        except Exception:  # a processor rejecting this content form: try the other one
            continue
    return None


def _common_suffix(a: Sequence[int], b: Sequence[int]) -> list[int]:
    n = 0
    while n < min(len(a), len(b)) and a[len(a) - 1 - n] == b[len(b) - 1 - n]:
        n += 1
    return list(a[len(a) - n :])


def initialize_turn_separator(tokenizer: Any, **apply_chat_template_kwargs: Any) -> list[int]:
    """Ids the template writes after a message's closing token (ChatML: the ``"\\n"`` id);
    empty when there are none or the template cannot be probed.

    Two renderings of one user turn that differ only in its text share their tail: the
    closing token(s) and the separator. The separator is what follows the last eos id in that
    tail (or, without an eos id in it, everything after its first token). A user turn is
    probed, not an assistant one, because thinking templates wrap assistant text in
    ``<think></think>`` scaffolding that is no separator.
    """
    probes = _user_turn_probes(tokenizer, **apply_chat_template_kwargs)
    if probes is None:
        return []
    tail = _common_suffix(*probes)
    if not tail:
        return []
    eos = _eos_ids(tokenizer)
    closes = [i for i, token in enumerate(tail) if token in eos]
    return tail[closes[-1] + 1 :] if closes else tail[1:]


def apply_chat_template(
    processor: Any,
    messages: list[dict[str, Any]],
    *,
    tokenize: bool = True,
    add_generation_prompt: bool = True,
    tools: list[dict[str, Any]] | None = None,
    return_dict: bool = False,
    **kwargs: Any,
) -> Any:
    """``processor.apply_chat_template``, also for templates that refuse a conversation
    without a user message (Qwen3.5): then an empty user turn is rendered in front and its
    ids (or text) are cut off again."""
    options = {"tokenize": tokenize, "tools": tools, "return_dict": return_dict, **kwargs}
    try:
        return processor.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **options)
    except Exception:  # retried below with the user turn these templates insist on
        pass
    dummy = [{"role": "user", "content": [{"type": "text", "text": ""}]}]
    prefix = processor.apply_chat_template(dummy, add_generation_prompt=False, **options)
    output = processor.apply_chat_template(
        dummy + messages, add_generation_prompt=add_generation_prompt, **options
    )
    if not tokenize:
        return output[len(prefix) :]
    if not return_dict:
        if output and isinstance(output[0], list):  # transformers 5 returns one row per conversation
            output, prefix = output[0], prefix[0]
        return output[len(prefix) :]
    cut = dict(prefix)["input_ids"].shape[1]
    output = dict(output)
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        if key in output:
            output[key] = output[key][:, cut:]
    return output
