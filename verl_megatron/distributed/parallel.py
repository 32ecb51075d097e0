"""Parallel layout and the distributed runtime, created once and passed in.

``ParallelLayout`` is the user's choice of tp/pp/vpp/cp/ep; ``dp`` follows from
the world size. ``init_runtime`` starts torch.distributed from torchrun's
environment (NCCL with CUDA, gloo without), installs the CPU compatibility
layer when there is no GPU, builds megatron's parallel state and seeds every
RNG. Everything downstream receives the returned :class:`Runtime`.
"""

from __future__ import annotations

import datetime
import functools
import gc
import os
import random
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, cast

import numpy as np
import torch
import torch.distributed as dist

from verl_megatron.distributed import state
from verl_megatron.errors import ParallelConfigError


@dataclass(frozen=True)
class ParallelLayout:
    """How one model is split over the processes of a job.

    Attributes:
        tp: tensor-parallel size (attention heads and MLP columns are split).
        pp: pipeline-parallel size (transformer layers are split into stages).
        vpp: virtual pipeline stages per pipeline rank (None or 1: no interleaving).
        cp: context-parallel size (sequence split; needs Transformer Engine, GPU only).
        ep: expert-parallel size for MoE layers (routed experts are split over ep ranks).
        etp: expert tensor-parallel size: each routed expert's weights are split over etp
            ranks (None: the same as tp, megatron's default). ``ep * etp`` must divide
            ``dp * cp * tp``: the expert layers reuse the ranks of one pipeline stage.
        dp: data-parallel size; derived as world_size // (tp * pp * cp) when None.
    """

    tp: int = 1
    pp: int = 1
    vpp: int | None = None
    cp: int = 1
    ep: int = 1
    dp: int | None = None
    etp: int | None = None

    def resolve(self, world_size: int) -> ParallelLayout:
        """Return a copy with ``dp`` filled in, or raise ParallelConfigError."""
        for name in ("tp", "pp", "cp", "ep"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ParallelConfigError(f"parallel.{name} must be a positive integer, got {value!r}")
        if self.etp is not None and (not isinstance(self.etp, int) or self.etp < 1):
            raise ParallelConfigError(f"parallel.etp must be a positive integer or null, got {self.etp!r}")
        if self.vpp is not None and (not isinstance(self.vpp, int) or self.vpp < 1):
            raise ParallelConfigError(f"parallel.vpp must be a positive integer or null, got {self.vpp!r}")
        if self.vpp is not None and self.vpp > 1 and self.pp == 1:
            raise ParallelConfigError(
                "parallel.vpp > 1 needs parallel.pp > 1 (interleaving splits pipeline stages)"
            )
        model_parallel = self.tp * self.pp * self.cp
        if world_size % model_parallel != 0:
            raise ParallelConfigError(
                f"tp*pp*cp = {self.tp}*{self.pp}*{self.cp} = {model_parallel} does not divide "
                f"the world size {world_size}"
            )
        dp = world_size // model_parallel
        if self.dp is not None and self.dp != dp:
            raise ParallelConfigError(
                f"parallel.dp={self.dp} but world size {world_size} / (tp*pp*cp={model_parallel}) = {dp}"
            )
        expert_ranks = self.ep * self.expert_tp
        if (dp * self.cp * self.tp) % expert_ranks != 0:
            what = f"parallel.ep={self.ep}"
            if self.expert_tp > 1:
                default = " (etp defaults to tp)" if self.etp is None else ""
                what = f"parallel.ep*etp = {self.ep}*{self.expert_tp} = {expert_ranks}{default}"
            raise ParallelConfigError(
                f"{what} must divide dp*cp*tp = {dp * self.cp * self.tp} "
                "(experts are spread over the data/context/tensor-parallel ranks of a pipeline stage)"
            )
        return ParallelLayout(
            tp=self.tp, pp=self.pp, vpp=self.vpp, cp=self.cp, ep=self.ep, dp=dp, etp=self.etp
        )

    @property
    def expert_tp(self) -> int:
        """The expert tensor-parallel size in effect (``etp``, or tp when unset)."""
        return self.tp if self.etp is None else self.etp

    @property
    def virtual_stages(self) -> int:
        return self.vpp or 1

    def megatron_sizes(self) -> dict[str, int | None]:
        """The sizes as megatron's ``initialize_model_parallel`` and ``TransformerConfig`` take them.

        The expert tensor-parallel size is not among them: megatron's default (tp) is used unless
        the caller passes ``expert_tensor_parallel_size``.
        """
        return {
            "tensor_model_parallel_size": self.tp,
            "pipeline_model_parallel_size": self.pp,
            "virtual_pipeline_model_parallel_size": self.vpp if self.virtual_stages > 1 else None,
            "context_parallel_size": self.cp,
            "expert_model_parallel_size": self.ep,
        }

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_query_groups: int | None = None,
        num_experts: int | None = None,
    ) -> None:
        """Raise ParallelConfigError when the model cannot be split this way."""
        groups = num_query_groups or num_attention_heads
        if num_attention_heads % self.tp != 0:
            raise ParallelConfigError(
                f"num_attention_heads={num_attention_heads} is not divisible by tp={self.tp}"
            )
        if groups % self.tp != 0:
            raise ParallelConfigError(
                f"num_key_value_heads={groups} is not divisible by tp={self.tp} "
                "(each tensor-parallel rank needs whole key/value heads)"
            )
        stages = self.pp * self.virtual_stages
        if num_layers % stages != 0:
            raise ParallelConfigError(
                f"num_layers={num_layers} is not divisible by pp*vpp = {self.pp}*{self.virtual_stages} = {stages}"
            )
        if num_experts and num_experts % self.ep != 0:
            raise ParallelConfigError(f"num_experts={num_experts} is not divisible by ep={self.ep}")
        if self.ep > 1 and not num_experts:
            raise ParallelConfigError(
                f"ep={self.ep} needs a mixture-of-experts model (num_experts is not set)"
            )


class _AxisRank:
    """``runtime.<axis>_rank``: this process's rank along one parallel axis (megatron's state)."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.axis = cast(state.Axis, name.removesuffix("_rank"))

    def __get__(self, runtime: object, owner: type | None = None) -> int:
        return state.rank(self.axis)


class _AxisGroup:
    """``runtime.<axis>_group(with_cp=False)``: this process's group along one parallel axis."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.axis = cast(state.Axis, name.removesuffix("_group"))

    def __get__(self, runtime: object, owner: type | None = None) -> Callable[..., dist.ProcessGroup]:
        return functools.partial(state.group, self.axis)


@dataclass
class Runtime:
    """The process's place in the job; created once by :func:`init_runtime`."""

    layout: ParallelLayout
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str
    seed: int
    cpu_compat: bool = False
    _owns_process_group: bool = field(default=False, repr=False)

    # Megatron parallel state is global to the process; these accessors (over
    # distributed/state.py) keep call sites from reaching into it directly.
    tp_rank = _AxisRank()
    pp_rank = _AxisRank()
    dp_rank = _AxisRank()
    cp_rank = _AxisRank()
    tp_group = _AxisGroup()
    pp_group = _AxisGroup()
    dp_group = _AxisGroup()  # dp_group(with_cp=True): the data x context-parallel group
    cp_group = _AxisGroup()

    def mp_group(self) -> dist.ProcessGroup:
        return state.model_parallel_group()

    def expert_group(self) -> dist.ProcessGroup:
        """The ranks that meet in the MoE layers: expert tensor x expert parallel."""
        return state.expert_group()

    def tp_src_rank(self) -> int:
        """Global rank of tp rank 0 of this rank's tensor-parallel group."""
        return state.tp_src_rank()

    def pp_peer_rank(self, which: Literal["last", "next", "prev"]) -> int:
        """Global rank of this pipeline's last stage, or of the next / previous stage."""
        return state.pp_peer_rank(which)

    @property
    def is_pp_first(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_pp_last(self) -> bool:
        return self.pp_rank == self.layout.pp - 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def seed_everything(seed: int) -> None:
    """Seed Python, NumPy and torch (and the megatron TP RNG tracker if initialised)."""
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    if state.is_initialized():
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(seed, force_reset_rng=True)


def attempt_prefix() -> str:
    """Store key prefix of this torchrun attempt (``--max-restarts``: one per restart).

    torchrun's agent hosts the store its workers meet in and keeps it across restarts, while
    torch's ``env://`` set-up writes its keys without a per-attempt prefix: a restarted group read
    the dead group's addresses and failed (gloo ``connectFullMesh ... Connection refused``) or
    waited for ever. Every worker of one attempt shares its restart count, so the count as a key
    prefix gives each attempt a clean namespace.
    """
    return f"verl_megatron/attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/"


def _attempt_store(timeout: datetime.timedelta) -> dist.Store | None:
    """This attempt's view of torchrun's agent store (None: not under the agent store)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), int(os.environ["WORLD_SIZE"]),
        is_master=False, timeout=timeout,
    )  # fmt: skip
    return dist.PrefixStore(attempt_prefix(), store)


def init_process_group(timeout_minutes: float = 30) -> tuple[int, int, int, str]:
    """Start torch.distributed from torchrun's variables (or as a lone process).

    Returns (rank, world_size, local_rank, backend).
    """
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        if "MASTER_PORT" not in os.environ:
            if int(os.environ.get("WORLD_SIZE", "1")) > 1:
                raise RuntimeError(
                    "WORLD_SIZE > 1 but MASTER_PORT is unset: start multi-process jobs with torchrun"
                )
            os.environ["MASTER_PORT"] = str(_free_port())
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        os.environ.setdefault("LOCAL_RANK", "0")
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        timeout = datetime.timedelta(minutes=timeout_minutes)
        store = _attempt_store(timeout)
        if store is None:
            dist.init_process_group(backend=backend, timeout=timeout)
        else:
            rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
            dist.init_process_group(
                backend=backend, timeout=timeout, store=store, rank=rank, world_size=world
            )
    backend = dist.get_backend()
    return dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", "0")), backend


# Process groups created by megatron's initialize_model_parallel in this process, owned
# here: megatron's destroy_model_parallel only forgets them, and each gloo group keeps
# its threads and sockets until it is destroyed.
_megatron_groups: list[dist.ProcessGroup] = []
# (layout, timeout) those groups were built for: the same request reuses them.
_megatron_groups_key: tuple[ParallelLayout, float] | None = None


def _registered_groups() -> set:
    # torch keeps no public list of live groups; its registry is the one complete source
    # (megatron also creates groups it stores nowhere).
    return set(dist.distributed_c10d._world.pg_map)


def destroy_megatron_groups() -> None:
    """Tear down megatron's parallel state and destroy every process group it created."""
    global _megatron_groups_key
    # A process that never loaded megatron's parallel state has none to tear down: importing
    # megatron (seconds) only to find that out made closing an idle worker pool take 12-16 s.
    ps = sys.modules.get("megatron.core.parallel_state")
    if ps is not None and ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
    live = _registered_groups() if dist.is_initialized() else set()
    real = False  # a group with threads and sockets (the planner's "fake" ones have none)
    for group in _megatron_groups:
        if group in live:
            real = real or dist.get_backend(group) != "fake"
            dist.destroy_process_group(group)
    _megatron_groups.clear()
    _megatron_groups_key = None
    # The destroyed groups' threads end only when their objects go, and the job's models and
    # optimizers hold them in reference cycles; a gloo loop left over after its peer closed its
    # side spins (a full suite's pool workers held ~250 of them). Free them now, on every rank.
    # Not for fake groups: the planner rebuilds them per layout, and a collection each time
    # made `plan` several times slower.
    if real:
        gc.collect()


def build_megatron_groups(layout: ParallelLayout, timeout_minutes: float = 30) -> None:
    """(Re)build megatron's parallel state for a resolved ``layout`` on the current process group.

    The same layout as the previous call reuses its groups (creating them is a collective
    of every rank, ~0.1 s per layout on CPU); another layout destroys them first, so
    rebuilding any number of times (a test pool switching layouts) keeps the process's
    threads and groups flat.
    """
    from megatron.core import parallel_state as ps

    global _megatron_groups_key
    key = (layout, timeout_minutes)
    intact = ps.model_parallel_is_initialized() and set(_megatron_groups) <= _registered_groups()
    if key == _megatron_groups_key and intact:
        if ps.get_virtual_pipeline_model_parallel_world_size() is not None:
            ps.set_virtual_pipeline_model_parallel_rank(0)  # as a fresh build leaves it
        return
    destroy_megatron_groups()
    before = _registered_groups()
    ps.initialize_model_parallel(
        **layout.megatron_sizes(),
        expert_tensor_parallel_size=layout.expert_tp,
        distributed_timeout_minutes=timeout_minutes,
    )
    _megatron_groups.extend(g for g in _registered_groups() if g not in before)
    _megatron_groups_key = key


def _resolve_for_this_machine(layout: ParallelLayout, world_size: int) -> ParallelLayout:
    resolved = layout.resolve(world_size)
    if resolved.cp > 1 and not torch.cuda.is_available():
        raise ParallelConfigError(
            "parallel.cp > 1 needs Transformer Engine attention, which needs CUDA; this machine has no GPU"
        )
    return resolved


def init_runtime(layout: ParallelLayout, seed: int = 1234, timeout_minutes: float = 30) -> Runtime:
    """Create the job's distributed runtime; call once per process.

    Raises ParallelConfigError before the process group starts when the layout
    does not fit the world size; any failure destroys a process group this call
    started. Calling it again (e.g. in tests) rebuilds megatron's parallel state
    for a new layout on the same process group, destroying the old groups (see
    :func:`build_megatron_groups`).
    """
    from verl_megatron.distributed import cpu_compat
    from verl_megatron.utils.cpu_heap import keep_freed_memory

    compat = cpu_compat.install()
    owns = not dist.is_initialized()
    if owns:  # the group will have torchrun's WORLD_SIZE: a layout that cannot fit starts nothing
        _resolve_for_this_machine(layout, int(os.environ.get("WORLD_SIZE", "1")))
    rank, world_size, local_rank, backend = init_process_group(timeout_minutes)
    try:
        layout = _resolve_for_this_machine(layout, world_size)
        build_megatron_groups(layout, timeout_minutes)
    except BaseException:
        # The caller gets no Runtime to shut down (train's finally has None), so a group this
        # call started would outlive it, and the next init_runtime would find it and not own it.
        if owns:
            shutdown()
        raise
    seed_everything(seed)
    device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
    if device.type == "cpu":
        keep_freed_memory()  # utils/cpu_heap.py: no page faults for each step's tensors
    return Runtime(
        layout=layout,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        device=device,
        backend=backend,
        seed=seed,
        cpu_compat=compat,
        _owns_process_group=owns,
    )


def shutdown(runtime: Runtime | None = None) -> None:
    """Tear down megatron's parallel state, its groups and the process group."""
    destroy_megatron_groups()
    if dist.is_initialized():
        dist.destroy_process_group()
    # A destroyed group's threads (gloo: 3 per group) end only when its last Python reference
    # goes, and models / optimizers / trainers of the job hold them in reference cycles: a
    # process that builds trainer after trainer (benchmarks, notebooks) kept 48 idle threads
    # and the dead trainers' memory per trainer until the cyclic collector happened to run.
    gc.collect()
