"""Rollout settings (verl's ``actor_rollout_ref.rollout``), with verl's field names and defaults.

``RolloutConfig.name`` picks the engine (``verl_megatron.rollout.build_rollout``): ``native``
generates with the actor's megatron chunks (CPU and GPU), ``vllm`` / ``sglang`` run those
engines colocated with the trainer (GPU). Fields that only one kind of engine reads say so.
Bad values raise ``RolloutConfigError`` naming the field; nothing is silently rewritten.
"""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass, field
from typing import Any

from verl_megatron.errors import RolloutConfigError
from verl_megatron.utils.call_worker import ISOLATION_MODES

__all__ = [
    "ENGINE_NAMES",
    "ENGINE_PACKAGES",
    "AgentConfig",
    "MultiTurnConfig",
    "RolloutConfig",
    "RolloutConfigError",
    "SamplingConfig",
    "check_engine_installed",
    "old_log_prob_micro_batch_size",
]

ENGINE_NAMES = ("native", "vllm", "sglang")
# engine -> (pip package, verl-megatron extra that installs it); the native engine needs none
ENGINE_PACKAGES = {"vllm": ("vllm", "gpu"), "sglang": ("sglang", "sglang")}


@dataclass
class SamplingConfig:
    """How tokens are drawn (verl's ``rollout.val_kwargs``).

    The defaults are verl's validation settings: greedy, one sample per prompt.
    """

    temperature: float = 0.0
    """Softmax temperature; 0 means greedy."""
    top_k: int = -1
    """Keep only the k most likely tokens; -1 (or 0) keeps all."""
    top_p: float = 1.0
    """Keep the smallest set of most likely tokens whose probability reaches top_p; 1.0 keeps all."""
    do_sample: bool = False
    """False: greedy decoding whatever the temperature."""
    n: int = 1
    """Samples per prompt."""


@dataclass
class MultiTurnConfig:
    """Multi-turn generation with tool / environment turns (see ``verl_megatron.rollout.multiturn``)."""

    enable: bool = False
    """Run conversations of several turns instead of one response per prompt."""
    max_assistant_turns: int | None = None
    """Most policy turns per conversation; None: until the environment ends it or the budget is spent."""
    max_user_turns: int | None = None
    """Most environment (user / tool) turns per conversation; None: no limit."""
    max_tool_response_length: int = 256
    """Environment replies longer than this many tokens are truncated."""
    tool_response_truncate_side: str = "middle"
    """Which part of an over-long environment reply is dropped: ``left``, ``right`` or ``middle``."""
    environment: str = ""
    """The environment answering each policy turn: ``pkg.module:name`` or ``/path/file.py:name``,
    naming a callable ``(Conversation, last_turn_text) -> EnvironmentReply``
    (see ``verl_megatron.rollout.multiturn``). Required when ``enable``."""
    isolation: str = "process"
    """Where the environment runs: ``process`` (a worker process per rollout call; a call that
    raises, hangs or kills it ends only its conversation) or ``none`` (in the trainer, trusted
    code: an exception stops the step)."""
    env_timeout_s: float = 30.0
    """Wall-clock seconds one environment call may take (``isolation: process``); past it the
    worker is killed and the conversation ends with cause ``env_timeout``. Below
    ``trainer.stall_timeout_s`` (60 by default): the trainer waits for the call without progress."""

    def __post_init__(self) -> None:
        if self.isolation not in ISOLATION_MODES:
            raise RolloutConfigError(
                f"rollout.multi_turn.isolation must be one of {list(ISOLATION_MODES)}, got {self.isolation!r}"
            )
        timeout = self.env_timeout_s
        if isinstance(timeout, bool) or not isinstance(timeout, int | float) or not 0 < timeout < math.inf:
            raise RolloutConfigError(
                f"rollout.multi_turn.env_timeout_s must be a number of seconds > 0, got {timeout!r}"
            )


@dataclass
class AgentConfig:
    """Agentic rollouts: a harness drives each conversation through an OpenAI-compatible endpoint
    over the engine (see ``verl_megatron.rollout.agent``, ``verl_megatron.rollout.endpoint``)."""

    enable: bool = False
    """Run one harness conversation per sample instead of one engine call per prompt."""
    harness: str = ""
    """The harness: ``verifiers``, ``openenv``, ``tools`` (built-in tool loop), or a
    ``pkg.module:name`` / ``/path/file.py:name`` factory ``(**kwargs) -> Harness``. Required when
    ``enable``."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the harness factory (e.g. the verifiers environment to load), and
    ``isolation``: ``process`` (default: a verifiers / custom harness's ``run`` and each OpenEnv
    instance in a worker process per trajectory) or ``none`` (in the trainer; trusted code)."""
    max_turns: int = 8
    """Most model calls per trajectory; further requests are refused (finish ``max_turns``)."""
    deadline_s: float = 300.0
    """Wall-clock seconds for one batch of conversations; unfinished ones score a failure
    (cause ``timeout``): their worker processes are killed (in-process harnesses: threads abandoned)."""
    tool_call_format: str = "hermes"
    """How the model writes tool calls: ``hermes`` (``<tool_call>{"name":..,"arguments":..}</tool_call>``,
    Qwen2.5/Qwen3/Hermes templates), ``bare`` (``<tool_call>ARG</tool_call>``: the request's
    first tool, its first parameter) or ``none`` (text only)."""
    max_concurrency: int = 64
    """Conversations run at once (one thread each)."""
    host: str = "127.0.0.1"
    """Address the endpoint listens on."""
    port: int = 0
    """Port of the endpoint; 0 picks a free one. A fixed port allows one generating rank per node."""
    failure_score: float = 0.0
    """Reward of a trajectory whose environment raised, hung, returned garbage or never ended."""
    batch_wait_s: float = 0.02
    """After a request arrives, how long the engine waits for the other live conversations'
    requests before generating (one engine call serves them all)."""
    tool_cpu_s: float = 5.0
    """Sandboxed tools: CPU seconds per call."""
    tool_wall_s: float = 10.0
    """Sandboxed tools: wall-clock seconds per call."""
    tool_memory_mb: int = 512
    """Sandboxed tools: address space per call, MiB."""
    tool_isolation: str = "auto"
    """Sandboxed tools: ``auto``, ``namespaces`` or ``basic`` (``verl_megatron.reward.sandbox``)."""


@dataclass
class RolloutConfig:
    """verl's rollout section. Sampling fields apply to training rollouts; ``val_kwargs`` to validation."""

    name: str = "native"
    """Engine: ``native`` (megatron chunks, CPU/GPU), ``vllm`` or ``sglang`` (GPU, ``pip install verl-megatron[gpu]``)."""
    mode: str = "sync"
    """``sync``: the trainer calls generate_sequences on every rank (the only mode implemented)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts; 0 means greedy."""
    top_k: int = -1
    """Top-k filter for training rollouts; -1 (or 0) disables it."""
    top_p: float = 1.0
    """Nucleus (top-p) filter for training rollouts; 1.0 disables it."""
    do_sample: bool = True
    """False: greedy training rollouts (n is then 1)."""
    n: int = 1
    """Responses per prompt; a prompt's n responses are adjacent rows of the output."""
    seed: int | None = None
    """Sampling seed; None uses the runtime's seed. Same seed, same calls: same tokens."""
    prompt_length: int = 512
    """Longest prompt (tokens); vllm/sglang size their context as prompt_length + response_length."""
    response_length: int = 512
    """Most new tokens per response; responses are right-padded to exactly this length."""
    dtype: str = "bfloat16"
    """vllm/sglang: weight dtype inside the engine. The native engine uses the actor's dtype."""
    gpu_memory_utilization: float = 0.5
    """vllm/sglang: fraction of GPU memory the engine may take (weights + KV cache)."""
    ignore_eos: bool = False
    """Keep generating after EOS until response_length (``stop_token_ids`` still stop)."""
    enforce_eager: bool = True
    """vllm: no CUDA graphs."""
    free_cache_engine: bool = True
    """vllm/sglang: release the KV cache (sleep) after each generation so training has the memory."""
    tensor_model_parallel_size: int = 2
    """vllm/sglang: tensor-parallel size inside the engine. The native engine uses the actor's layout."""
    max_num_batched_tokens: int = 8192
    """vllm/sglang: most tokens in one engine step."""
    max_model_len: int | None = None
    """vllm/sglang: longest sequence; None means prompt_length + response_length."""
    max_num_seqs: int = 1024
    """vllm/sglang: most sequences in flight."""
    val_kwargs: SamplingConfig = field(default_factory=SamplingConfig)
    """Sampling for validation batches (``meta_info['validate']``)."""
    log_prob_micro_batch_size: int | None = None
    """Deprecated in verl; must stay null (set log_prob_micro_batch_size_per_gpu)."""
    log_prob_micro_batch_size_per_gpu: int | None = None
    """Sequences per micro-batch on one rank when the actor recomputes the rollouts' log-probs
    (``old_log_probs``), as in verl; the actor's ``ppo_infer_micro_batch_size_per_gpu`` says
    the same, so set one of them (null: the actor's value)."""
    log_prob_use_dynamic_bsz: bool = False
    """Token-budget micro-batches when recomputing log-probs; the actor's ``use_dynamic_bsz``
    decides, so true here needs ``actor.use_dynamic_bsz=true``."""
    log_prob_max_token_len_per_gpu: int = 16384
    """Token budget per micro-batch with dynamic batching; the actor reads its own
    ``ppo_infer_max_token_len_per_gpu``, so another value here must equal it."""
    disable_log_stats: bool = True
    """vllm: no periodic engine statistics in the log."""
    enable_chunked_prefill: bool = True
    """vllm: split long prefills into max_num_batched_tokens chunks."""
    enable_prefix_caching: bool = True
    """vllm/sglang: reuse the KV cache of shared prompt prefixes."""
    load_format: str = "dummy"
    """vllm/sglang: ``dummy`` starts from random weights, which the first sync_weights replaces."""
    enable_rollout_routing_replay: bool = False
    """MoE models: record each token's experts during generation, for the actor's routing replay
    (``actor.megatron.router_replay.mode=R3``) or its hit-rate metrics; native engine only."""
    engine_kwargs: dict[str, Any] = field(default_factory=dict)
    """vllm/sglang: extra keyword arguments for the engine's constructor."""
    calculate_log_probs: bool = False
    """vllm/sglang: also return rollout_log_probs (the native engine always returns them)."""
    update_weights_bucket_megabytes: int = 512
    """vllm/sglang: weights stream into the engine in buckets of at most this many MB."""
    layer_name_map: dict[str, str] = field(default_factory=dict)
    """vllm/sglang: rename weights before loading, {HF name prefix: engine name prefix}."""
    bitwise_parity: bool = False
    """native only: make every sampled token's rollout log-prob equal the actor's old_log_probs bit
    for bit (float32 and bfloat16), at any tp/pp/dp layout, packing and dynamic batch size. The
    decoder and the actor's forward and backward then use batch-invariant kernels
    (``models/batch_invariant.py``: tiled GEMMs, attention over a fixed key length of
    prompt_length + response_length), about 1.5-2x the CPU time of generation and of the update;
    needs megatron's local layer spec (model.use_te=false); MoE models too (router gating tiled
    as well; exact with routing replay R3, at ep > 1 as well), but not with multi_turn or a gated
    shared expert (qwen2_moe).
    Off: the two differ by float rounding (~1e-6 in float32, ~1e-3 in bfloat16)."""
    keep_packed_weights: bool = True
    """native engine on CPU (float32): keep the linears' packed weight copies (16-column panels for
    products of up to 64 rows, oneDNN's layout for larger ones: cpu/packed_linear.py) from one
    generate call to the next while the caller's weights version (the trainer's count of actor
    updates) stays the same, instead of re-packing them every call (about 0.5 s of CPU per call
    at 0.5B parameters); validation, calls of several samples, multi-turn and agent turns and
    partial-rollout segments reuse them, and a new version rewrites the panels in place. Memory:
    each layout in use is another float32 copy of every linear weight (about as large as the
    model; both layouts when a call's prefill has more than 64 rows and its decoding at most 64),
    held from a call until the next call of another version, i.e. through the training update in
    between; false frees them at the end of every call."""
    parity_probe_interval: int = 10
    """With algorithm.rollout_correction.bypass_mode (which trusts bitwise parity and so skips the
    log-prob diff): every this many steps the actor recomputes one micro-batch's log-probs and
    logs ``rollout/parity_probe/max_diff``; a nonzero diff stops the run (``ParityProbeError``,
    trainer/parity_probe.py). 0 switches the probe off."""
    lora_sync: str = "merged"
    """vllm/sglang with LoRA (model.lora_rank > 0): what a weight sync sends, ``merged`` (base +
    adapters, every sync) or ``adapter`` (vllm only: the base once, then the adapters as a PEFT
    folder loaded through a vLLM LoRARequest); see rollout/lora_sync.py."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a response like EOS (kept in the response with mask 1)."""
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    """Multi-turn generation settings."""
    agent: AgentConfig = field(default_factory=AgentConfig)
    """Agentic rollouts through the OpenAI-compatible endpoint (a harness per conversation)."""
    placement: str = "colocated"
    """``colocated``: every rank trains and generates in turn. ``separate``: the last
    ``world_size`` ranks only generate (their own copy of the model), the others only train and
    send the weights after each update (see ``rollout/placement.py``, ``async_training``)."""
    world_size: int = 0
    """Ranks that generate with ``placement=separate`` (>= 1, fewer than the job's); 0 otherwise."""

    def __post_init__(self) -> None:
        if self.name not in ENGINE_NAMES:
            raise RolloutConfigError(f"rollout.name must be one of {list(ENGINE_NAMES)}, got {self.name!r}")
        if self.mode not in ("sync", "async"):
            raise RolloutConfigError(f"rollout.mode must be 'sync' or 'async', got {self.mode!r}")
        _check_sampling("rollout", self.temperature, self.top_k, self.top_p, self.n)
        _check_sampling("rollout.val_kwargs", **_sampling_fields(self.val_kwargs))
        for key in ("prompt_length", "response_length", "update_weights_bucket_megabytes", "max_num_seqs"):
            if getattr(self, key) < 1:
                raise RolloutConfigError(f"rollout.{key} must be >= 1, got {getattr(self, key)}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise RolloutConfigError(
                f"rollout.gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}"
            )
        if self.placement not in ("colocated", "separate"):
            raise RolloutConfigError(
                f"rollout.placement must be 'colocated' or 'separate', got {self.placement!r}"
            )
        if self.multi_turn.tool_response_truncate_side not in ("left", "right", "middle"):
            raise RolloutConfigError(
                "rollout.multi_turn.tool_response_truncate_side must be 'left', 'right' or 'middle', "
                f"got {self.multi_turn.tool_response_truncate_side!r}"
            )
        if self.multi_turn.enable and not self.multi_turn.environment:
            raise RolloutConfigError(
                "rollout.multi_turn.enable=true needs rollout.multi_turn.environment "
                "('pkg.module:name' or '/path/file.py:name' of the environment callable)"
            )
        _check_agent(self)
        if self.log_prob_micro_batch_size is not None:
            raise RolloutConfigError(
                "rollout.log_prob_micro_batch_size is deprecated (as in verl); "
                "set rollout.log_prob_micro_batch_size_per_gpu"
            )
        if self.log_prob_micro_batch_size_per_gpu is not None and self.log_prob_micro_batch_size_per_gpu < 1:
            raise RolloutConfigError(
                f"rollout.log_prob_micro_batch_size_per_gpu must be >= 1 or null, "
                f"got {self.log_prob_micro_batch_size_per_gpu}"
            )
        if not isinstance(self.parity_probe_interval, int) or self.parity_probe_interval < 0:
            raise RolloutConfigError(
                f"rollout.parity_probe_interval must be an integer >= 0 (0: off), got {self.parity_probe_interval!r}"
            )
        if self.bitwise_parity and self.name != "native":
            raise RolloutConfigError(
                f"rollout.bitwise_parity=true needs rollout.name=native (the {self.name} engine computes "
                "log-probs with its own kernels); correct for the gap with rollout correction instead"
            )
        if self.bitwise_parity and self.multi_turn.enable:
            # A turn's calls decode rows past prompt_length + response_length (then drop those
            # tokens); the fixed key length of the batch-invariant attention cannot hold them.
            raise RolloutConfigError("rollout.bitwise_parity=true does not support rollout.multi_turn yet")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise RolloutConfigError(
                f"rollout.stop_token_ids must be token ids >= 0, got {self.stop_token_ids}"
            )


def _check_agent(rollout: RolloutConfig) -> None:
    agent = rollout.agent
    if not agent.enable:
        return
    if not agent.harness:
        raise RolloutConfigError(
            "rollout.agent.enable=true needs rollout.agent.harness (verifiers, openenv, tools, or "
            "'pkg.module:name' / '/path/file.py:name' of a harness factory)"
        )
    if rollout.multi_turn.enable or rollout.bitwise_parity:
        raise RolloutConfigError(
            "rollout.agent.enable=true does not combine with rollout.multi_turn or rollout.bitwise_parity "
            "(the harness drives the turns; bitwise parity's fixed key length cannot hold later turns)"
        )
    if rollout.name != "native" and rollout.tensor_model_parallel_size != 1:
        # Every rank runs its own endpoint and harnesses: the ranks of one engine would diverge.
        raise RolloutConfigError(
            f"rollout.agent.enable=true with rollout.name={rollout.name!r} needs "
            f"rollout.tensor_model_parallel_size=1, got {rollout.tensor_model_parallel_size}"
        )
    if agent.tool_call_format not in ("hermes", "bare", "none"):
        raise RolloutConfigError(
            f"rollout.agent.tool_call_format must be 'hermes', 'bare' or 'none', got {agent.tool_call_format!r}"
        )
    for key in ("max_turns", "deadline_s", "max_concurrency", "tool_cpu_s", "tool_wall_s", "tool_memory_mb"):
        if not getattr(agent, key) > 0:
            raise RolloutConfigError(f"rollout.agent.{key} must be > 0, got {getattr(agent, key)}")
    if agent.batch_wait_s < 0 or not 0 <= agent.port < 65536:
        raise RolloutConfigError(
            f"rollout.agent.batch_wait_s must be >= 0 and rollout.agent.port in [0, 65535], "
            f"got {agent.batch_wait_s}, {agent.port}"
        )
    if agent.tool_isolation not in ("auto", "namespaces", "basic"):
        raise RolloutConfigError(
            f"rollout.agent.tool_isolation must be 'auto', 'namespaces' or 'basic', got {agent.tool_isolation!r}"
        )


def check_agent_port(rollout: RolloutConfig, world_size: int, nnodes: int) -> None:
    """A fixed ``rollout.agent.port`` holds one endpoint per node: refuse a job that runs several
    on a node (each generating rank runs its own; the second to bind the port would fail at its
    first rollout)."""
    agent = rollout.agent
    if not agent.enable or agent.port == 0:
        return
    per_node = -(-world_size // max(1, nnodes))
    endpoints = min(rollout.world_size, per_node) if rollout.placement == "separate" else per_node
    if endpoints > 1:
        raise RolloutConfigError(
            f"rollout.agent.port={agent.port} is one port per node, but {endpoints} ranks of a node run an "
            "endpoint each; set rollout.agent.port=0 (each picks a free port)"
        )


def _sampling_fields(cfg: SamplingConfig) -> dict[str, Any]:
    return {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p, "n": cfg.n}


def _check_sampling(where: str, temperature: float, top_k: int, top_p: float, n: int) -> None:
    if temperature < 0:
        raise RolloutConfigError(f"{where}.temperature must be >= 0, got {temperature}")
    if top_k < -1:
        raise RolloutConfigError(f"{where}.top_k must be -1 (off) or >= 0, got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise RolloutConfigError(f"{where}.top_p must be in (0, 1], got {top_p}")
    if n < 1:
        raise RolloutConfigError(f"{where}.n must be >= 1, got {n}")


def check_engine_installed(name: str) -> None:
    """Raise RolloutConfigError when engine ``name`` needs a package this machine lacks.

    Looks the package up without importing it (importing vllm takes seconds), so the
    launching process can check before any worker starts.
    """
    if name not in ENGINE_PACKAGES:
        return
    package, extra = ENGINE_PACKAGES[name]
    if importlib.util.find_spec(package) is None:
        raise RolloutConfigError(
            f"rollout.name={name!r} needs the '{package}' package, which is not installed; "
            f"install it with pip install 'verl-megatron[{extra}]' (GPU only), or use rollout.name=native"
        )


_DEFAULT_LOG_PROB_MAX_TOKENS = 16384


def old_log_prob_micro_batch_size(rollout: RolloutConfig, actor: Any) -> int | None:
    """The micro-batch size the actor recomputes rollout log-probs with (its
    ``ppo_infer_micro_batch_size_per_gpu``), taking ``rollout.log_prob_*`` into account.

    verl reads ``rollout.log_prob_micro_batch_size_per_gpu`` at that point; here the actor
    does the recomputation with its own fields, so the rollout's value fills the actor's
    when the actor leaves it unset, and values that disagree are an error naming both keys.
    """
    mine, theirs = rollout.log_prob_micro_batch_size_per_gpu, actor.ppo_infer_micro_batch_size_per_gpu
    if mine is not None and theirs is not None and mine != theirs:
        raise RolloutConfigError(
            f"rollout.log_prob_micro_batch_size_per_gpu={mine} and actor.ppo_infer_micro_batch_size_per_gpu="
            f"{theirs} both set the micro-batch for recomputing log-probs; keep one"
        )
    if rollout.log_prob_use_dynamic_bsz and not actor.use_dynamic_bsz:
        raise RolloutConfigError(
            "rollout.log_prob_use_dynamic_bsz=true is not read: the actor recomputes log-probs with "
            "actor.use_dynamic_bsz (set that to true instead)"
        )
    max_tokens = rollout.log_prob_max_token_len_per_gpu
    if max_tokens != _DEFAULT_LOG_PROB_MAX_TOKENS and max_tokens != actor.ppo_infer_max_token_len_per_gpu:
        raise RolloutConfigError(
            f"rollout.log_prob_max_token_len_per_gpu={max_tokens} is not read: the actor recomputes "
            f"log-probs with actor.ppo_infer_max_token_len_per_gpu={actor.ppo_infer_max_token_len_per_gpu} "
            "(set that instead)"
        )
    return theirs if mine is None else mine
