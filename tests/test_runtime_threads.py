"""init_runtime rebuilt many times in a pool worker keeps its OS threads and process groups flat.

Every gloo process group owns worker threads. Megatron's ``destroy_model_parallel``
only drops its references to its groups, so a worker that switched layouts for every
test used to accumulate them: ~2,000 threads per worker over the suite. The job here
switches between five layouts (including pipeline, virtual pipeline and expert groups)
two rounds over (ten rebuilds: a leak of even one thread a rebuild passes the bound of
4) and counts the OS threads in /proc/self/task (which, unlike ``threading.active_count``,
sees the threads gloo starts in C++). Asking for the layout already built reuses its groups.
"""

from __future__ import annotations

import os

LAYOUTS = [{}, {"tp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}, {"ep": 2}]
ROUNDS = 2  # each layout rebuilt twice after its first build: growth with rebuilds shows


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


def held_groups_job(rounds: int) -> dict:
    """As ``threads_job``, with each layout's groups held in a reference cycle (a model and its
    optimizer make one) and the cyclic collector off, as it mostly is for long-lived objects: a
    destroyed group's threads end only when its object goes, and a leftover gloo loop whose peer
    closed its side spins (in a full suite the pool workers held ~250 such threads, ~790 s of
    system CPU)."""
    import gc

    from megatron.core import parallel_state as ps

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    class Model:
        pass

    gc.disable()
    try:
        for kwargs in LAYOUTS:
            init_runtime(ParallelLayout(**kwargs))
        start = os_threads()
        threads = []
        for _ in range(rounds):
            for kwargs in LAYOUTS:
                init_runtime(ParallelLayout(**kwargs))
                model = Model()
                model.groups = [ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()]
                model.optimizer = {"model": model}  # the cycle
                del model
                threads.append(os_threads())
    finally:
        gc.enable()
    init_runtime(ParallelLayout())
    return {"start": start, "threads": threads}


def test_groups_held_in_cycles_are_freed_when_the_layout_changes(pool2):
    for rank, r in enumerate(pool2.run(f"{__name__}:held_groups_job", rounds=2)):
        grew = max(r["threads"]) - r["start"]
        assert grew <= 4, f"rank {rank}: OS threads {r['start']} -> {r['threads']} (+{grew})"


def failed_init_job() -> dict:
    """In a fresh process: init_runtime with a layout that does not fit, then with one that fails
    after the process group started (its groups fail to build), then with a good layout."""
    import torch.distributed as dist

    import verl_megatron.distributed.parallel as parallel
    from verl_megatron.distributed.parallel import ParallelConfigError, ParallelLayout, init_runtime

    started = []
    real_init = dist.init_process_group
    dist.init_process_group = lambda *a, **k: started.append(1) or real_init(*a, **k)
    out = {}
    try:
        init_runtime(ParallelLayout(tp=2))
    except ParallelConfigError as e:
        out["layout"] = {"error": str(e), "groups_started": len(started), "left": dist.is_initialized()}
    real_build, parallel.build_megatron_groups = parallel.build_megatron_groups, None  # fails when called
    try:
        init_runtime(ParallelLayout())
    except TypeError:
        out["build"] = {"groups_started": len(started), "left": dist.is_initialized()}
    parallel.build_megatron_groups = real_build
    runtime = init_runtime(ParallelLayout())
    out["next"] = {"owns": runtime._owns_process_group, "world": runtime.world_size}
    parallel.shutdown(runtime)
    return out


def test_a_failed_init_runtime_leaves_no_process_group_behind():
    """A layout error used to be found after the process group had started, and nothing destroyed
    it: the next init_runtime found a group it did not own (train's shutdown never ran)."""
    import json
    import subprocess
    import sys

    env = {
        k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT")
    }
    code = f"import json; from {__name__} import failed_init_job; print(json.dumps(failed_init_job()))"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # The layout is checked against WORLD_SIZE before any group starts.
    assert out["layout"] == {
        "error": "tp*pp*cp = 2*1*1 = 2 does not divide the world size 1",
        "groups_started": 0,
        "left": False,
    }
    # A failure after the group started destroys the group this call created.
    assert out["build"] == {"groups_started": 1, "left": False}
    assert out["next"] == {"owns": True, "world": 1}
