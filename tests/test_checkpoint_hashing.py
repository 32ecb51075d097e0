"""The checksums of a part's marker are taken by the ranks that write its files, as they write them.

A 2-rank (tp=2) save counts the bytes each rank feeds to sha256: rank 1 hashes exactly its own
shard files, rank 0 exactly the rest, so together they hash the checkpoint once and rank 0 no
longer reads every file back. The marker's checksums equal sha256 of the files on disk, the
checkpoint loads exactly, and a flipped byte is still refused by name.
"""

from __future__ import annotations

import hashlib
import json
import threading
from pathlib import Path

import pytest

from tests.test_checkpoint import _assert_identical, _merge, _setup, _snapshot, _train_step
from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.storage import CheckpointCorruptError, CheckpointError

_REAL_SHA256, _REAL_NEW = hashlib.sha256, hashlib.new


class _CountingSha256:
    """hashlib.sha256 that adds the bytes it hashes to ``total`` (torch's writer threads share it)."""

    total = 0
    lock = threading.Lock()

    def __init__(self, data=b"") -> None:
        self._inner = _REAL_SHA256()
        self.update(data)

    def update(self, data) -> None:
        with self.lock:
            type(self).total += memoryview(data).nbytes
        self._inner.update(data)

    def hexdigest(self) -> str:
        return self._inner.hexdigest()


def _counting_new(name: str, *args, **kwargs):
    # hashlib.file_digest(f, "sha256") builds its hash through hashlib.new.
    return _CountingSha256(*args) if name.lower() == "sha256" else _REAL_NEW(name, *args, **kwargs)


def counted_save_job(root: str, tp: int) -> dict:
    """Train one step, then save while counting the bytes this rank hashes."""
    import torch.distributed as dist

    from verl_megatron.checkpoint import save_checkpoint

    runtime, chunks, optimizer, scheduler = _setup(tp, 1, None, init_seed=3)
    _train_step(runtime, chunks, optimizer, scheduler, 0)
    extra = {"global_steps": 1}
    _CountingSha256.total = 0
    hashlib.sha256, hashlib.new = _CountingSha256, _counting_new
    try:
        save_checkpoint(
            root,
            1,
            chunks=chunks,
            optimizer=optimizer,
            scheduler=scheduler,
            extra_state=extra,
            runtime=runtime,
        )
    finally:
        hashlib.sha256, hashlib.new = _REAL_SHA256, _REAL_NEW
    return {
        "rank": dist.get_rank(),
        "hashed": _CountingSha256.total,
        "saved": _snapshot(chunks, optimizer, scheduler),
    }


def _disk_checksums(part: Path) -> tuple[dict[str, str], dict[str, int]]:
    marker = json.loads((part / storage.PART_MARKER).read_text())
    on_disk = {rel: _REAL_SHA256((part / rel).read_bytes()).hexdigest() for rel in marker["files"]}
    assert marker["sha256"] == on_disk
    assert marker["files"] == {rel: (part / rel).stat().st_size for rel in on_disk}
    return marker["sha256"], marker["files"]


def test_each_rank_hashes_the_files_it_wrote_and_the_checkpoint_still_checks(pool2, tmp_path):
    saved = pool2.run(f"{__name__}:counted_save_job", root=str(tmp_path), tp=2)
    part = tmp_path / "global_step_1" / "model"
    checksums, sizes = _disk_checksums(part)
    rank1 = sum(size for rel, size in sizes.items() if rel.startswith("__1_"))
    total = sum(sizes.values())
    hashed = [r["hashed"] for r in sorted(saved, key=lambda r: r["rank"])]
    print(f"bytes hashed per rank: {hashed}, checkpoint {total} bytes")
    # Rank 1's shards are hashed by rank 1 only; rank 0 hashes its own files, none of rank 1's.
    assert rank1 > 0 and hashed == [total - rank1, rank1]

    loaded = pool2.run("tests.test_checkpoint:load_job", root=str(tmp_path), tp=2, pp=1, vpp=None)
    _assert_identical(_merge(loaded, "loaded"), _merge(saved, "saved"))

    damaged = min(rel for rel in checksums if rel.startswith("__1_"))
    data = bytearray((part / damaged).read_bytes())
    data[len(data) // 2] ^= 0x01
    (part / damaged).write_bytes(bytes(data))
    with pytest.raises(CheckpointCorruptError, match=f"{damaged} does not hold the bytes that were written"):
        storage.read_part_meta(part)
    with pytest.raises(RuntimeError, match="CheckpointCorruptError") as failed:
        pool2.run("tests.test_checkpoint:load_job", root=str(tmp_path), tp=2, pp=1, vpp=None)
    assert damaged in str(failed.value)


def test_a_single_process_save_hashes_every_file_once(pool1, tmp_path):
    saved = pool1.run(f"{__name__}:counted_save_job", root=str(tmp_path), tp=1)
    _, sizes = _disk_checksums(tmp_path / "global_step_1" / "model")
    assert saved[0]["hashed"] == sum(sizes.values())


def _staged_part(root: Path) -> Path:
    tmp = storage.start_part(root, 1, "actor")
    (tmp / "__0_0.distcp").write_bytes(b"rank zero")
    (tmp / "__1_0.distcp").write_bytes(b"rank one")
    return tmp


def _sha(data: bytes) -> str:
    return _REAL_SHA256(data).hexdigest()


def test_the_marker_holds_the_checksums_the_ranks_reported(tmp_path):
    _staged_part(tmp_path)
    written = [{"__0_0.distcp": _sha(b"rank zero")}, {"__1_0.distcp": _sha(b"rank one")}]
    part = storage.publish_part(tmp_path, 1, "actor", {}, written)
    marker = json.loads((part / storage.PART_MARKER).read_text())
    assert marker["sha256"] == {"__0_0.distcp": _sha(b"rank zero"), "__1_0.distcp": _sha(b"rank one")}
    assert marker["files"] == {"__0_0.distcp": 9, "__1_0.distcp": 8}


@pytest.mark.parametrize(
    ("written", "problem"),
    [
        ([{"__0_0.distcp": "a"}, {}], "__1_0.distcp is in the part but no rank reported writing it"),
        (
            [{"__0_0.distcp": "a"}, {"__1_0.distcp": "b", "__1_1.distcp": "c"}],
            "__1_1.distcp was written by rank 1 but is not in the part",
        ),
        (
            [{"__0_0.distcp": "a", "__1_0.distcp": "b"}, {"__1_0.distcp": "b"}],
            "__1_0.distcp was reported by rank 0 and rank 1",
        ),
    ],
    ids=["written-by-nobody", "missing", "twice"],
)
def test_files_and_reports_that_disagree_are_named_and_nothing_is_published(tmp_path, written, problem):
    tmp = _staged_part(tmp_path)
    with pytest.raises(CheckpointError, match=problem):
        storage.publish_part(tmp_path, 1, "actor", {}, written)
    assert not (tmp / storage.PART_MARKER).exists()
    assert not (storage.staging_dir(tmp_path, 1) / "actor").exists()
