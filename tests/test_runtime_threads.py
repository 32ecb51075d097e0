"""init_runtime rebuilt many times in a pool worker keeps its OS threads and process groups flat.

Every gloo process group owns worker threads. Megatron's ``destroy_model_parallel``
only drops its references to its groups, so a worker that switched layouts for every
test used to accumulate them: ~2,000 threads per worker over the suite. One pool job (shared by
the two tests below through a module fixture) builds five layouts (including pipeline, virtual
pipeline and expert groups) once to warm up, then rebuilds each of them once with the groups
dropped (five rebuilds) and once more with each layout's groups held in a reference cycle (five
more), counting the OS threads in /proc/self/task (which, unlike ``threading.active_count``,
sees the threads gloo starts in C++) after each. A gloo group has 3 threads and every layout
several groups, so a leak of even one thread a rebuild passes the bound of 4 within the five
rebuilds of either part. Asking for the layout already built reuses its groups.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.helpers import run_forked

LAYOUTS = [{}, {"tp": 2}, {"pp": 2}, {"pp": 2, "vpp": 2}, {"ep": 2}]


def os_threads() -> int:
    return len(os.listdir("/proc/self/task"))


def process_groups() -> int:
    import torch.distributed as dist

    return len(dist.distributed_c10d._world.pg_map)


def _rebuild_each_layout(hold_in_cycle: bool) -> tuple[list[int], list[int]]:
    """init_runtime for every layout in turn; the OS threads and process groups after each.
    ``hold_in_cycle``: each layout's groups are then held in a reference cycle (a model and its
    optimizer make one) and the cyclic collector is off, as it mostly is for long-lived objects: a
    destroyed group's threads end only when its object goes, and a leftover gloo loop whose peer
    closed its side spins (in a full suite the pool workers held ~250 such threads, ~790 s of
    system CPU)."""
    from megatron.core import parallel_state as ps

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    class Model:
        pass

    threads, groups = [], []
    for kwargs in LAYOUTS:
        init_runtime(ParallelLayout(**kwargs))
        if hold_in_cycle:
            model = Model()
            model.groups = [ps.get_tensor_model_parallel_group(), ps.get_data_parallel_group()]
            model.optimizer = {"model": model}  # the cycle
            del model
        threads.append(os_threads())
        groups.append(process_groups())
    return threads, groups


def switching_job() -> dict:
    import gc

    from megatron.core import parallel_state as ps

    from verl_megatron.distributed.parallel import ParallelLayout, init_runtime

    # One pass first: a layout's first use may start threads that stay (e.g. torch's pools).
    _rebuild_each_layout(hold_in_cycle=False)
    start = {"threads": os_threads(), "groups": process_groups()}
    threads, groups = _rebuild_each_layout(hold_in_cycle=False)
    first = ps.get_tensor_model_parallel_group()
    init_runtime(ParallelLayout(**LAYOUTS[-1]))
    reused = ps.get_tensor_model_parallel_group() is first
    plain = {"start": start, "threads": threads, "groups": groups, "reused": reused}
    gc.disable()
    try:
        held = {"start": os_threads(), "threads": _rebuild_each_layout(hold_in_cycle=True)[0]}
    finally:
        gc.enable()
    init_runtime(ParallelLayout())
    return {"plain": plain, "held": held}


@pytest.fixture(scope="module")
def switching(pool2) -> list[dict]:
    return pool2.run(f"{__name__}:switching_job")


def test_switching_layouts_leaks_no_threads_or_groups(switching):
    for rank, both in enumerate(switching):
        r = both["plain"]
        start = r["start"]
        # The last layout of the warm-up pass is the last of the rebuilds: same groups.
        assert r["groups"][-1] == start["groups"], (rank, r)
        assert max(r["groups"]) - start["groups"] <= 40, (rank, r)
        # Bounded by one layout's groups, not growing with the number of rebuilds.
        assert max(r["threads"]) - start["threads"] <= 4, f"rank {rank}: OS threads {start} -> {r['threads']}"
        assert r["reused"], "the same layout twice built new groups"


def test_groups_held_in_cycles_are_freed_when_the_layout_changes(switching):
    for rank, both in enumerate(switching):
        r = both["held"]
        grew = max(r["threads"]) - r["start"]
        assert grew <= 4, f"rank {rank}: OS threads {r['start']} -> {r['threads']} (+{grew})"


def failed_init_job() -> dict:
    """In a process without a process group: init_runtime with a layout that does not fit, then with one that fails
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


def _print_failed_init(out_dir: str) -> None:
    """failed_init_job's result on stdout, as a fresh interpreter without a process group runs it
    (tests build theirs in pool workers)."""
    for key in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_PORT"):
        os.environ.pop(key, None)
    print(json.dumps(failed_init_job()))


def test_a_failed_init_runtime_leaves_no_process_group_behind(tmp_path):
    """A layout error used to be found after the process group had started, and nothing destroyed
    it: the next init_runtime found a group it did not own (train's shutdown never ran)."""
    import torch.distributed as dist

    import verl_megatron.distributed.parallel  # noqa: F401  imported once, here, for the child

    assert not dist.is_initialized(), "the test process holds a process group: the child would inherit it"
    done = run_forked(_print_failed_init, str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.splitlines()[-1])
    # The layout is checked against WORLD_SIZE before any group starts.
    assert out["layout"] == {
        "error": "tp*pp*cp = 2*1*1 = 2 does not divide the world size 1",
        "groups_started": 0,
        "left": False,
    }
    # A failure after the group started destroys the group this call created.
    assert out["build"] == {"groups_started": 1, "left": False}
    assert out["next"] == {"owns": True, "world": 1}
