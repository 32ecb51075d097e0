"""Loading Hugging Face tokenizers (with verl's eos/pad corrections) and processors, and reading
token ids out of whatever a tokenizer call returned."""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase

__all__ = ["hf_processor", "hf_tokenizer", "normalize_token_ids", "set_pad_token_id"]

# gemma-2-2b-it declares <eos> as its eos token, but its chat turns end with <end_of_turn>; a policy
# that stops on <eos> keeps generating past the turn, which hurts RL. verl switches eos to the turn
# marker, which has id 107 in that vocabulary.
GEMMA2_EOS_TOKEN = "<end_of_turn>"
GEMMA2_EOS_TOKEN_ID = 107

# A folder holding none of these cannot be a tokenizer (transformers reports that obscurely).
_TOKENIZER_FILES = ("tokenizer_config.json", "tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt")


def set_pad_token_id(tokenizer: PreTrainedTokenizerBase) -> None:
    """Use the eos token for padding when the tokenizer has no pad token (in place, with warnings)."""
    if tokenizer.pad_token_id is None:
        if tokenizer.eos_token_id is None:
            raise ValueError(
                f"{type(tokenizer).__name__} has neither a pad token nor an eos token; set one of them explicitly"
            )
        tokenizer.pad_token_id = tokenizer.eos_token_id
        warnings.warn(f"tokenizer.pad_token_id is None. Now set to {tokenizer.eos_token_id}", stacklevel=2)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
        warnings.warn(f"tokenizer.pad_token is None. Now set to {tokenizer.eos_token}", stacklevel=2)


def _looks_like_path(name: str) -> bool:
    """True for names that can only be a filesystem path, never a hub id like ``org/model``."""
    return os.path.isabs(name) or name.startswith(("./", "../", "~", ".\\", "..\\")) or name in (".", "..")


def _local_name(name_or_path: str | os.PathLike, kwargs: dict[str, Any], what: str) -> str:
    """The expanded name; a local directory gets ``local_files_only`` so nothing touches the network.

    A name that can only be a path but does not exist, or is a file, raises naming it.
    """
    name = os.path.expanduser(os.fspath(name_or_path))
    if os.path.isdir(name):
        kwargs.setdefault("local_files_only", True)
    elif os.path.exists(name):
        raise NotADirectoryError(f"{what} path '{name}' is a file; pass the directory that holds its files")
    elif _looks_like_path(name):
        raise FileNotFoundError(f"{what} directory '{name}' does not exist")
    return name


def hf_tokenizer(
    name_or_path: str | os.PathLike,
    correct_pad_token: bool = True,
    correct_gemma2: bool = True,
    **kwargs: Any,
) -> PreTrainedTokenizerBase:
    """Load a tokenizer with ``AutoTokenizer.from_pretrained`` and fix eos/pad like verl.

    - ``correct_gemma2``: when the path contains ``gemma-2-2b-it``, eos becomes ``<end_of_turn>``
      (id 107 in gemma's vocabulary), with a warning.
    - ``correct_pad_token``: a missing pad token falls back to the eos token (see ``set_pad_token_id``).

    A local directory loads with ``local_files_only=True`` so nothing touches the network; a name
    that is a path but does not exist raises FileNotFoundError naming it. Other names are treated as
    hub ids and passed to transformers unchanged. Extra ``kwargs`` go to ``from_pretrained``.
    """
    name = _local_name(name_or_path, kwargs, "tokenizer")
    if os.path.isdir(name) and not any(os.path.exists(os.path.join(name, f)) for f in _TOKENIZER_FILES):
        raise FileNotFoundError(f"tokenizer directory '{name}' holds none of {list(_TOKENIZER_FILES)}")

    gemma2 = correct_gemma2 and "gemma-2-2b-it" in name
    if gemma2:
        warnings.warn(
            f"Found gemma-2-2b-it tokenizer. Set eos_token and eos_token_id to {GEMMA2_EOS_TOKEN} "
            f"and {GEMMA2_EOS_TOKEN_ID}.",
            stacklevel=2,
        )

    try:
        tokenizer = AutoTokenizer.from_pretrained(name, **kwargs)
    except OSError as err:
        where = "local directory" if os.path.isdir(name) else "hub id (not a local directory)"
        raise OSError(f"could not load a tokenizer from '{name}' as a {where}: {err}") from err

    if gemma2:
        _set_gemma2_eos(tokenizer, name)
    if correct_pad_token:
        set_pad_token_id(tokenizer)
    return tokenizer


def _set_gemma2_eos(tokenizer: PreTrainedTokenizerBase, name: str) -> None:
    """Switch eos to ``<end_of_turn>``, by token string as verl does.

    Done after loading (rather than passing ``eos_token`` to ``from_pretrained``) so that a vocabulary
    lacking the token is reported instead of silently gaining a new, untrained token.
    """
    if GEMMA2_EOS_TOKEN not in tokenizer.get_vocab():
        raise ValueError(
            f"tokenizer at '{name}' is treated as gemma-2-2b-it but has no '{GEMMA2_EOS_TOKEN}' token; "
            "pass correct_gemma2=False if it is not a gemma-2 tokenizer"
        )
    # add_special_tokens (not a plain attribute set) also marks the token special, so that
    # decode(skip_special_tokens=True) drops it as it does for a tokenizer loaded with eos_token=...
    tokenizer.add_special_tokens({"eos_token": GEMMA2_EOS_TOKEN})
    if tokenizer.eos_token_id != GEMMA2_EOS_TOKEN_ID:
        warnings.warn(
            f"'{GEMMA2_EOS_TOKEN}' has id {tokenizer.eos_token_id} in '{name}', not {GEMMA2_EOS_TOKEN_ID} as in "
            "gemma-2-2b-it",
            stacklevel=3,
        )


def hf_processor(name_or_path: str | os.PathLike, **kwargs: Any) -> Any | None:
    """The multimodal processor of a model (``AutoProcessor``), or None for a text-only model.

    transformers falls back to the plain tokenizer (or fails for lack of a preprocessor config)
    when a model has no processor; both mean "text only" and give None, as in verl. Paths are
    checked like ``hf_tokenizer``'s. Extra ``kwargs`` go to ``from_pretrained``.
    """
    from transformers import AutoProcessor

    name = _local_name(name_or_path, kwargs, "processor")
    try:
        processor = AutoProcessor.from_pretrained(name, **kwargs)
    except (OSError, ValueError, KeyError, ImportError) as err:
        # A text-only checkpoint has no processor files; a missing checkpoint is reported by
        # hf_tokenizer / the model loader with a better message than AutoProcessor's. ImportError:
        # Qwen2-VL's processor also builds a video processor, which needs torchvision (as verl,
        # any failure means no processor; data.multimodal loads the image half without it).
        warnings.warn(
            f"no multimodal processor for '{name}' ({type(err).__name__}); using text only", stacklevel=2
        )
        return None
    if isinstance(processor, PreTrainedTokenizerBase) or "Processor" not in type(processor).__name__:
        return None
    return processor


def normalize_token_ids(tokenized_output: Any) -> list[int]:
    """The token ids of one sequence as a flat ``list[int]``.

    Accepts what tokenizers return across transformers 4 and 5: a list/tuple/array/tensor of ids,
    a mapping or ``BatchEncoding`` with ``input_ids``, or a batch holding exactly one sequence.
    Anything else (a string, several sequences, non-integer ids) raises TypeError naming it.
    """
    ids = tokenized_output
    if isinstance(ids, Mapping):
        ids = ids.get("input_ids", ids)
    elif not isinstance(ids, str | bytes) and hasattr(ids, "input_ids"):
        ids = ids.input_ids
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, tuple):
        ids = list(ids)
    if not isinstance(ids, list):
        raise TypeError(f"normalize_token_ids: expected token ids, got {type(ids).__name__}: {_preview(ids)}")
    if len(ids) == 1 and isinstance(ids[0], list | tuple):
        ids = list(ids[0])  # a batch of one sequence
    out = []
    for position, token in enumerate(ids):
        value = token.item() if hasattr(token, "item") else token
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(
                f"normalize_token_ids: token {position} is a {type(token).__name__} ({_preview(token)}), "
                "not an integer id; pass one sequence, not a batch"
            )
        out.append(int(value))
    return out


def _preview(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
