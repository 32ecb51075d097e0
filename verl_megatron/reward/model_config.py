"""Config of model-based rewards: a discriminative reward model and a generative judge.

These fields join verl's ``reward_model`` section (``trainer.config.RewardModelConfig`` derives
from :class:`ModelRewardSettings`), with verl's names where verl has them: ``enable``,
``model.path``, ``model.input_tokenizer``, ``micro_batch_size_per_gpu``, ``max_length``,
``use_dynamic_bsz``, ``forward_max_token_len_per_gpu``. What verl does not have:
``parallel`` (the reward model's own megatron layout), ``combine`` (how its score meets the
rule reward) and ``judge``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from verl_megatron.distributed.parallel import ParallelLayout
from verl_megatron.models.config import ModelConfig

__all__ = [
    "JUDGE_BACKENDS",
    "TRUNCATION_MODES",
    "JudgeConfig",
    "ModelRewardSettings",
    "RewardModelModelConfig",
]

TRUNCATION_MODES = ("left", "right", "error")
JUDGE_BACKENDS = ("native", "openai")

DEFAULT_JUDGE_TEMPLATE = (
    "Rate the response to the question from 0 to 10.\n"
    "Question: {prompt}\nResponse: {response}\n"
    "Reply with 'Score: <number>'."
)


@dataclass
class RewardModelModelConfig(ModelConfig):
    """The reward model's checkpoint: an HF ``*ForSequenceClassification`` folder with one label.

    Every ``model`` setting applies (dtype, use_te, sequence_parallel, ...), plus
    ``input_tokenizer``.
    """

    path: str = ""
    """Local folder of the ``*ForSequenceClassification`` checkpoint (config.json with
    ``num_labels: 1``, safetensors with ``score.weight``) and its tokenizer."""
    dtype: str = "float32"
    """Parameter dtype of the reward model (forward only, so float32 costs only memory)."""
    input_tokenizer: str | None = None
    """verl's switch for re-templating: the tokenizer the actor's token ids come from (usually
    ``model.path``). Set: each response is decoded with it and the conversation (``raw_prompt``,
    needs ``data.return_raw_chat``) is re-written with the reward model's own tokenizer and chat
    template. Null: the reward model reads the actor's token ids as they are (same vocabulary)."""


@dataclass
class JudgeConfig:
    """A generative judge: a prompt sent to a chat model, a number parsed from its answer.

    Failures (unparsable answer, timeout, refused connection, HTTP error) score
    ``failure_score`` and are counted as ``reward/judge/<cause>_count``; the run goes on.
    """

    enable: bool = False
    """Score each response with the judge (its score is ``judge`` in ``reward_model.combine``)."""
    backend: str = "native"
    """"native": the actor's own rollout engine generates the verdicts (greedy); "openai": an
    external OpenAI-compatible server (``url``)."""
    model_path: str | None = None
    """native backend: a separate causal-LM checkpoint that judges, built beside the actor under its
    layout with the actor's ``model.dtype`` and its own tokenizer and chat template (null: the actor)."""
    url: str | None = None
    """openai backend: ``http(s)://host:port`` (``/v1/chat/completions`` is appended), a base
    ending in ``/v1``, or the full ``.../chat/completions`` endpoint."""
    model: str = "judge"
    """openai backend: the ``model`` field of each request."""
    api_key_env: str | None = None
    """openai backend: name of an environment variable holding the API key (sent as a bearer token)."""
    prompt_template: str = DEFAULT_JUDGE_TEMPLATE
    """The user message; ``{prompt}``, ``{response}`` and ``{ground_truth}`` are filled in."""
    verdict_pattern: str = r"(?i)score\s*[:=]?\s*(-?\d+(?:\.\d+)?)"
    """Regular expression searched in the answer; its first group (or the whole match) is the verdict."""
    verdict_map: dict[str, float] = field(default_factory=dict)
    """Verdict word -> score, case-insensitive (e.g. ``{yes: 1.0, no: 0.0}``); a verdict not in the
    map must be a number."""
    scale: float = 1.0
    """Parsed verdicts are multiplied by this (e.g. 0.1 for a 0-10 scale)."""
    failure_score: float = 0.0
    """Score of a response whose verdict could not be obtained or parsed."""
    max_tokens: int = 32
    """Longest answer generated (native) or requested (openai)."""
    temperature: float = 0.0
    """openai backend: sampling temperature of the request (native: always greedy)."""
    timeout_s: float = 30.0
    """openai backend: seconds per request before it counts as a timeout."""
    max_concurrency: int = 8
    """openai backend: requests in flight at once."""


@dataclass
class ModelRewardSettings:
    """The model-based fields of verl's ``reward_model`` section (see the module docstring)."""

    enable: bool = False
    """Score every response with the discriminative reward model ``model.path``."""
    model: RewardModelModelConfig = field(default_factory=RewardModelModelConfig)
    """The reward model's checkpoint and build settings."""
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    """The reward model's own tp/pp (dp is what the world size leaves); independent of ``parallel``."""
    micro_batch_size_per_gpu: int = 4
    """Sequences per forward micro-batch on each dp rank (when ``use_dynamic_bsz`` is false)."""
    use_dynamic_bsz: bool = False
    """Form micro-batches by token count (``forward_max_token_len_per_gpu``) instead."""
    forward_max_token_len_per_gpu: int = 32768
    """Token budget of a dynamic micro-batch."""
    use_remove_padding: bool = True
    """Pack each micro-batch's sequences into one row (needed with Transformer Engine attention)."""
    max_length: int | None = None
    """Longest scored sequence in tokens; null: no limit."""
    truncation: str = "left"
    """Longer sequences: "left" drops their first tokens (the score is read at the last token, so
    the response's end stays), "right" drops their last tokens, "error" stops the run."""
    combine: str | None = None
    """The token-level score: an expression over ``rule`` (the reward manager's score), ``rm``
    and ``judge`` with numbers, ``+ - * /``, ``min``, ``max``, ``abs``, ``clip(x, lo, hi)``,
    ``sigmoid``, ``tanh`` (e.g. ``rule + 0.5 * rm``). Null: the sum of the enabled model scores,
    which replace the rule reward (verl: the reward model's score replaces the rule reward)."""
    judge: JudgeConfig = field(default_factory=JudgeConfig)
    """The generative judge."""
