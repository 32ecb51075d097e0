"""No state hung on tensors or on other libraries' objects (the style guide's "patterns to retire").

A feature's state belongs to an object of ours that is passed explicitly (the offloader's
weak-keyed bookkeeping, the LoRA container registered as a child module), not to attributes
written on a parameter, a tensor, an optimizer or a megatron module from outside. This check
reads ``verl_megatron/`` with ``ast`` (nothing is imported or run) and flags:

- every ``setattr(...)`` / ``delattr(...)`` call;
- every assignment or deletion ``x.name = ...`` / ``del x.name`` where ``x`` is not ``self`` or
  ``cls`` and ``name`` is not an attribute a class of the SAME file declares (a field, a class
  attribute, or ``self.name = ...`` in a method): a name written on an object of another library,
  or on an object of ours from outside the file that defines it. Whether a site is flagged thus
  depends on its own file only: an edit elsewhere can neither flag it nor hide it (a rule over
  every class of the package let one class's new method name, ``_forward_impl``, silently hide
  another file's method swap on megatron's layers);
- regardless of declared names, any attribute written on an object named like a tensor,
  parameter, buffer or optimizer (``param``, ``p``, ``tensor``, ``weight``, ``mask``, ...).

Not flagged: torch's own settable tensor fields (``.data``, ``.grad``, ``.requires_grad``), an
autograd Function's ``ctx`` (torch's documented place for its state) and a function's standard
metadata (``__name__``, ``__doc__``, ``__wrapped__``, ...).

Each remaining site is on ``_ALLOWLIST`` with its one-line reason, keyed by file (under
``verl_megatron/``) and a glob over the site's text (``cuda.*``, ``setattr(ps, *``), so that
moving lines does not break it. "pending" marks sites that other work is removing; "debt"
marks avoidable sites still to be replaced by explicit state; "ours" marks a declared field of
one of our own objects written from another file. An entry that matches no flagged site is stale.
"""

from __future__ import annotations

import ast
import fnmatch
import functools
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "verl_megatron"

# One site a line: file under verl_megatron/ and a glob over the site's text; its reason indented
# on the next line.
_ALLOWLIST = """
distributed/cpu_compat.py  *
    the CPU-compatibility layer (docs/architecture.md): megatron calls CUDA-only torch and megatron functions unconditionally; installed once, only without CUDA
distributed/fake_world.py  dist.new_group
    a fake world: megatron's group builder gets a group factory without gloo for one call, restored after
distributed/parallel_state_slot.py  setattr(ps, *
    megatron keeps its parallel state in module globals: a second layout swaps them in and back
distributed/wire.py  setattr(dist, *
    the wire check wraps torch.distributed's collectives process-wide, so no call site escapes it
distributed/wire.py  guarded._wire_guarded
    marks our own wrapper so wrapping is idempotent
workers/model_runner.py  setattr(config, *
    megatron's schedule reads these options only from the model's TransformerConfig (get_model_config): declared fields, set for one call and restored
models/megatron_model.py  config.*
    megatron's schedule takes its DDP hooks only from the model's TransformerConfig, as megatron's own training loop sets them
models/builder.py  param.sequence_parallel
    megatron's parameter-attribute protocol: finalize_model_grads all-reduces the grads of params marked sequence_parallel
models/families/qwen3_next_layers.py  self.weight.sequence_parallel
    megatron's parameter-attribute protocol: finalize_model_grads all-reduces the grads of params marked sequence_parallel
models/builder.py  rotary.inv_freq
    megatron's RotaryEmbedding takes no frequencies: its inv_freq buffer is replaced once at build
models/families/gpt_oss_layers.py  rotary.inv_freq
    megatron's RotaryEmbedding takes no frequencies: its inv_freq buffer is replaced once at build
models/builder.py  model.output_layer
    the value head replaces the GPTModel's output layer at build (a registered submodule)
models/families/qwen3_next_layers.py  sub.*
    megatron's layer specs are declarative dataclasses, filled in here before the build
models/families/qwen3_next_layers.py  block.*
    megatron's layer specs are declarative dataclasses, filled in here before the build
models/families/deepseek_layers.py  attention_spec.*
    megatron's layer specs are declarative dataclasses, filled in here before the build
models/families/deepseek_layers.py  multi_latent_attention.HAVE_TE
    megatron 0.16.1 without Transformer Engine leaves HAVE_TE true with a mock TELinear; corrected once
models/moe.py  moe_utils.te_general_gemm
    megatron 0.16.1 without Transformer Engine raises NameError; the missing global selects its torch branch
models/moe.py  TopKRouter._apply_expert_bias
    megatron's expert-bias update counts padding tokens: its method is replaced once, process-wide
models/moe.py  apply_expert_bias.__verl_fixed__
    marks our own replacement so it is installed once
checkpoint/optimizer_state.py  sub._set_main_param_and_optimizer_states
    megatron 0.16's distributed-optimizer load mishandles Adam's step: its method is shadowed for one load and deleted after
checkpoint/optimizer_state.py  scheduler.num_steps
    megatron's OptimizerParamScheduler.load_state_dict adds to its step count: its field is zeroed first
models/convert.py  config.*
    fields of a deep copy of the HF config, made here for the export
rollout/weight_sync.py  options.*
    torch's BroadcastOptions is an options struct filled in before the call
reward/scorers/code_harness.py  sys.std*
    inside the sandboxed program's own process: its stdin/stdout are the test case's input and output
utils/local_assets.py  tok.*
    a tokenizers.Tokenizer built here: the library takes its components as attributes
utils/local_assets.py  tokenizer.chat_template
    a transformers tokenizer built here from local files: its chat template is a documented settable field
utils/vl_word_tokenizer.py  tok.*
    a tokenizers.Tokenizer built here: the library takes its components as attributes
utils/vl_word_tokenizer.py  tokenizer.chat_template
    a transformers tokenizer built here from local files: its chat template is a documented settable field
utils/tokenizer/__init__.py  tokenizer.pad_token*
    verl's hf_tokenizer contract: a missing pad token is set to eos on the tokenizer it returns (warned)
models/builder.py  model.verl_model_info
    debt: the builder's ModelInfo written on the GPTModel and read back by its users; pass it explicitly
rollout/decode.py  *
    pending: being removed by this session's rollout decoding work
rollout/cpu/packed_linear.py  module._forward_impl
    pending: the native engine's packed matmul swaps megatron's linears' method for a call (the route object of models/matmul_route.py could carry it instead)
models/matmul_route.py  setattr(spec, *
    megatron's layer specs are declarative dataclasses: their linear fields are set to the routed classes before the build
models/matmul_route.py  spec.submodules
    megatron's layer specs are declarative dataclasses: their linear fields are set to the routed classes before the build
models/matmul_route.py  embedding.word_embeddings
    GPTModel builds its input embedding itself: replaced by the routed one at build (a registered submodule)
models/matmul_route.py  model.output_layer
    GPTModel builds its LM head itself: replaced by the routed one at build (a registered submodule)
models/matmul_route.py  new.*
    the routed embedding / head just built on the meta device take over the built layer's Parameters
models/builder.py  layer_spec.*
    megatron's layer specs are declarative dataclasses, filled in here before the build
models/families/gpt_oss_layers.py  layer_spec.*
    megatron's layer specs are declarative dataclasses, filled in here before the build
models/families/deepseek_layers.py  plain.rope_type
    a shallow copy of the TransformerConfig made here, so megatron's attention builds its plain rotary
models/routing.py  router.router_replay
    megatron's TopKRouter declares this slot for a top-k replacement: installing the replay hook is its purpose
algos/pf_ppo.py  resampled.*
    ours: a deep copy of the DataProto made here, its rows replaced by the resampled ones
algos/rollout_corr_helper.py  policy_loss_config.*
    verl's apply_bypass_mode contract: it sets the policy-loss config's two fields in place
planner/command.py  plan.savings
    ours: the MemoryPlan's savings field, filled in after the plan is made
reward/agents/contained.py  client.seconds
    ours: the trajectory's endpoint client counts the seconds spent in it; the worker's share is added back
reward/model_rewards.py  self.judge.generate
    ours: the native judge's generate slot, bound once to the trainer's generate
rollout/agent.py  trajectory.response_mask
    ours: a Trajectory of this call, masked out when its environment failed
rollout/async_worker.py  output.meta_info
    ours: the DataProto this call produced
rollout/endpoint.py  record.*
    ours: the per-call record this endpoint made, filled in as the reply is built
rollout/partial.py  batch.meta_info
    ours: the DataProto this call produced
trainer/ppo_trainer.py  self.actor.update_calls
    ours: resume restores the worker's declared update counter
trainer/ppo_trainer.py  self.critic.update_calls
    ours: resume restores the worker's declared update counter
trainer/ppo_trainer.py  self.kl_ctrl.value
    ours: resume restores the adaptive KL controller's coefficient
trainer/sft_trainer.py  self.actor.update_calls
    ours: resume restores the worker's declared update counter
trainer/validate.py  worker.ppo_micro_batch_size_per_gpu
    ours: a worker config's unset micro-batch size filled with its derived default at validation
workers/actor.py  loss_config.policy_loss
    ours: a shallow copy of the actor config made here for the loss (the user's object is left as it is)
workers/model_runner.py  mb.inputs
    ours: the runner's own micro-batches, their inputs replaced by this rank's context-parallel slice
"""


def _parse_allowlist(text: str) -> dict[tuple[str, str], str]:
    entries: dict[tuple[str, str], str] = {}
    lines = [line for line in text.splitlines() if line.strip()]
    for site, reason in zip(lines[::2], lines[1::2], strict=True):
        assert not site.startswith(" ") and reason.startswith("    "), (site, reason)
        file, pattern = site.split(maxsplit=1)
        entries[file, pattern] = reason.strip()
    return entries


ALLOWED = _parse_allowlist(_ALLOWLIST)

_TORCH_SETTABLE = {"data", "grad", "requires_grad"}
_FUNCTION_METADATA = {"__name__", "__qualname__", "__doc__", "__module__", "__wrapped__"}
_TENSOR_NAMES = {
    "param", "params", "p", "parameter", "tensor", "t", "weight", "bias", "mask", "grad",
    "buffer", "param_data", "grad_data", "optimizer", "opt",
}  # fmt: skip


def _scan(path: str, tree: ast.Module) -> list[tuple[str, int, str, bool]]:
    """(file, line, site text, flagged) of every ``setattr``/``delattr`` call and every attribute
    write but ``self.x`` in one file's ``tree``; one walk.

    Declared names (this file's only): fields and class attributes in a class body,
    ``self.name = ...`` anywhere.
    """
    declared: set[str] = set()
    calls: list[tuple[str, int, str, bool]] = []
    writes: list[tuple[str, int, ast.Attribute]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            declared.update(_class_body_names(node))
        elif _is_setattr(node):
            calls.append((path, node.lineno, f"{node.func.id}({ast.unparse(node.args[0])}, ...)", True))
        for target in _targets(node):
            if not isinstance(target, ast.Attribute):
                continue
            if isinstance(target.value, ast.Name) and target.value.id == "self":
                declared.add(target.attr)
            else:
                writes.append((path, node.lineno, target))
    return calls + [(path, line, ast.unparse(t), _is_flagged(t, declared)) for path, line, t in writes]


def _is_setattr(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id in ("setattr", "delattr")
        and bool(node.args)
    )


def _class_body_names(cls: ast.ClassDef) -> set[str]:
    names: set[str] = set()
    for stmt in cls.body:
        if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
            names.add(stmt.target.id)
        elif isinstance(stmt, ast.Assign):
            names.update(t.id for t in stmt.targets if isinstance(t, ast.Name))
        elif isinstance(stmt, ast.FunctionDef | ast.AsyncFunctionDef):
            names.add(stmt.name)  # properties with setters
    return names


def _targets(node: ast.AST) -> list[ast.AST]:
    if isinstance(node, ast.Assign | ast.Delete):
        targets = list(node.targets)
    elif isinstance(node, ast.AugAssign | ast.AnnAssign):
        targets = [node.target]
    else:
        return []
    flat: list[ast.AST] = []
    while targets:
        target = targets.pop()
        if isinstance(target, ast.Tuple | ast.List):
            targets.extend(target.elts)
        else:
            flat.append(target)
    return flat


def _base_name(node: ast.Attribute) -> str | None:
    """The last name of an attribute target's object: ``param`` in ``param.x``, ``weight`` in ``self.weight.x``."""
    value = node.value
    if isinstance(value, ast.Attribute):
        return value.attr
    return value.id if isinstance(value, ast.Name) else None


def _is_flagged(target: ast.Attribute, declared: set[str]) -> bool:
    if target.attr in _TORCH_SETTABLE or target.attr in _FUNCTION_METADATA:
        return False
    base = target.value
    if isinstance(base, ast.Name) and base.id in ("self", "cls", "ctx"):
        return False
    return _base_name(target) in _TENSOR_NAMES or target.attr not in declared


@functools.cache
def write_sites() -> tuple[tuple[str, int, str, bool], ...]:
    """(file under verl_megatron/, line, site text, flagged) of every write :func:`_scan` sees."""
    return tuple(
        site
        for path in sorted(PACKAGE.rglob("*.py"))
        for site in _scan(path.relative_to(PACKAGE).as_posix(), ast.parse(path.read_text(), str(path)))
    )


def _allowed(path: str, site: str) -> bool:
    return any(file == path and fnmatch.fnmatchcase(site, pattern) for file, pattern in ALLOWED)


def test_no_new_attributes_on_tensors_or_foreign_objects():
    unexplained = [
        f"verl_megatron/{path}:{line}: {site}"
        for path, line, site, flagged in write_sites()
        if flagged and not _allowed(path, site)
    ]
    assert not unexplained, (
        "attributes written on tensors or on other libraries' objects (keep the state in an object of "
        "ours passed explicitly, or add the site to _ALLOWLIST in this file with its reason):\n"
        + "\n".join(unexplained)
    )


def test_every_allowlist_entry_names_a_site_that_exists():
    # Whether a site is flagged depends on its own file only, so an entry matching no flagged
    # site is one to remove, not one that another file's edit may revive.
    flagged = [(path, site) for path, _, site, is_flagged in write_sites() if is_flagged]
    stale = [
        f"{file}: {pattern}"
        for file, pattern in ALLOWED
        if not any(path == file and fnmatch.fnmatchcase(site, pattern) for path, site in flagged)
        and not ALLOWED[file, pattern].startswith("pending")
    ]
    assert not stale, "_ALLOWLIST entries that match no site any more (remove them):\n" + "\n".join(stale)
    assert all(reason.strip() and "\n" not in reason for reason in ALLOWED.values())


def _flagged(source: str) -> list[str]:
    return [site.split("(")[0] for _, _, site, flagged in _scan("ours.py", ast.parse(source)) if flagged]


def test_the_check_catches_what_it_is_for():
    source = """
class Report:
    moved: int = 0
    def __init__(self):
        self.count = 0
        self.weight.sequence_parallel = True
def f(param, optimizer, module, report, mask, ctx):
    param._verl_home = 1          # a new attribute on a parameter
    optimizer.host_copies = []    # ... on an optimizer
    module._forward_impl = None   # ... on someone else's module
    mask.count = 3                # a tensor-named object, even with a declared name
    setattr(module, "x", 1)
    report.moved += 1             # our own class's field: fine
    report.count = 2
    param.data = param.data.cpu() # torch's settable fields: fine
    param.grad = None
    ctx.saved = 1                 # autograd context: fine
    f.__doc__ = "x"
"""
    assert sorted(_flagged(source)) == sorted([
        "self.weight.sequence_parallel", "setattr", "param._verl_home", "optimizer.host_copies",
        "module._forward_impl", "mask.count",
    ])  # fmt: skip


# ------------------------------------------------- the replaced sites keep their behaviour


def test_packed_params_move_as_a_copy_and_the_batch_keeps_its_own():
    """``_packed_params`` moves the THD boundaries to the model's device in a new PackedSeqParams
    (the meta device stands in for a GPU); the micro-batch's own object is not written."""
    from types import SimpleNamespace

    import torch
    from megatron.core.packed_seq_params import PackedSeqParams

    from verl_megatron.workers.model_runner import _packed_params

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    packed = PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=4, max_seqlen_kv=4
    )
    inputs = SimpleNamespace(shared_prefix=None, packed_seq_params=packed)
    moved = _packed_params(inputs, torch.device("meta"))
    assert moved is not packed and packed.cu_seqlens_q is cu and packed.cu_seqlens_kv is cu
    assert (moved.cu_seqlens_q.device.type, moved.cu_seqlens_kv.device.type) == ("meta", "meta")
    assert (moved.cu_seqlens_q_padded, moved.qkv_format, moved.max_seqlen_q) == (None, "thd", 4)
    assert _packed_params(inputs, torch.device("cpu")) is packed


def test_hf_config_overrides_reach_nested_sub_configs():
    from transformers import MixtralConfig, Qwen2VLConfig

    from verl_megatron.trainer.ppo.metric_utils import infer_moe_num_experts, update_model_config

    mixtral = MixtralConfig(num_local_experts=4)
    update_model_config(mixtral, {"num_local_experts": 6, "rope_theta": 5.0})
    assert (mixtral.num_local_experts, mixtral.rope_theta, infer_moe_num_experts(mixtral)) == (6, 5.0, 6)
    vl = Qwen2VLConfig()
    text_config = vl.text_config
    update_model_config(vl, {"text_config": {"num_experts": 5}})
    assert vl.text_config is text_config and text_config.num_experts == 5
    assert infer_moe_num_experts(vl) == 5
