"""init_runtime rebuilt many times in a pool worker keeps its OS threads and process groups flat.

Every gloo process group owns worker threads. Megatron's ``destroy_model_parallel``
only drops its references to its groups, so a worker that switched layouts for every
test used to accumulate them: ~2,000 threads per worker over the suite. The job here
switches between five layouts (including pipeline, virtual pipeline and expert groups)
several rounds over and counts the OS threads in /proc/self/task (which, unlike
``threading.active_count``, sees the threads gloo starts in C++). Asking for the layout
already built reuses its groups.
"""

from __future__ import annotations

import os

LAYOUTS = [{}, {"tp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}, {"ep": 2}]
ROUNDS = 4


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def threads_job(rounds: int) -> dict:
    import torch.distributed as dist

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    def process_groups() -> int:
        return len(dist.distributed_c10d._world.pg_map)

    # One pass first: a layout's first use may start threads that stay (e.g. torch's pools).
    for kwargs in LAYOUTS:
        init_runtime(ParallelLayout(**kwargs))
    start = {"threads": os_threads(), "groups": process_groups()}
    threads, groups = [], []
    for _ in range(rounds):
        for kwargs in LAYOUTS:
            init_runtime(ParallelLayout(**kwargs))
            threads.append(os_threads())
            groups.append(process_groups())
    from megatron.core import parallel_state as ps

    first = ps.get_tensor_model_parallel_group()
    init_runtime(ParallelLayout(**LAYOUTS[-1]))
    reused = ps.get_tensor_model_parallel_group() is first
    init_runtime(ParallelLayout())
    return {"start": start, "threads": threads, "groups": groups, "reused": reused}


def test_switching_layouts_leaks_no_threads_or_groups(pool2):
    for rank, r in enumerate(pool2.run(f"{__name__}:threads_job", rounds=ROUNDS)):
        start = r["start"]
        # The last layout of the warm-up pass is the last of every round: same groups.
        assert r["groups"][len(LAYOUTS) - 1 :: len(LAYOUTS)] == [start["groups"]] * ROUNDS, (rank, r)
        assert max(r["groups"]) - start["groups"] <= 40, (rank, r)
        # Bounded by one layout's groups, not growing with the number of rebuilds.
        assert max(r["threads"]) - start["threads"] <= 4, f"rank {rank}: OS threads {start} -> {r['threads']}"
        assert r["reused"], "the same layout twice built new groups"
