"""The checkpoint directory protocol: markers, atomic commit, crash safety, pruning, bad paths.

No model here: parts are a file or two, written through the same staging
functions the distributed save uses. A crash is simulated by making the k-th
rename or fsync raise, for every k; the commit has no cleanup handlers, so
the disk is left exactly as a killed process would leave it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.storage import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointNotFoundError,
    find_latest_checkpoint,
    read_latest_pointer,
)


def _save(root: Path, step: int, names=("actor",), keep: int | None = None, commit: bool = True) -> None:
    for name in names:
        tmp = storage.start_part(root, step, name)
        (tmp / "weights.bin").write_bytes(f"{name}@{step}".encode() * 10)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "extra.json").write_text(json.dumps({"step": step}))
        storage.publish_part(root, step, name, {"step": step, "name": name})
    if commit:
        storage.commit_step(root, step, keep)


def _payload(step_directory: Path, name: str = "actor") -> bytes:
    storage.read_part_meta(step_directory / name)
    return (step_directory / name / "weights.bin").read_bytes()


def test_commit_publishes_parts_marker_and_pointer(tmp_path):
    _save(tmp_path, 3, names=("actor", "critic"))
    final = tmp_path / "global_step_3"
    assert find_latest_checkpoint(tmp_path) == final
    assert read_latest_pointer(tmp_path) == 3
    assert (tmp_path / storage.POINTER_FILE).read_text() == "3"
    marker = json.loads((final / storage.STEP_MARKER).read_text())
    assert marker["step"] == 3 and marker["parts"] == ["actor", "critic"]
    meta = storage.read_part_meta(final / "critic")
    assert meta["files"] == {"weights.bin": 80, os.path.join("sub", "extra.json"): 11}
    assert meta["name"] == "critic"
    assert storage.resolve_part(tmp_path, "critic") == final / "critic"
    assert storage.resolve_part(final, "actor") == final / "actor"
    assert storage.resolve_part(final / "actor", "ignored") == final / "actor"
    # Nothing else is left behind: no staging, no temporary files.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", storage.POINTER_FILE]


def test_commit_without_a_staged_part_is_refused(tmp_path):
    with pytest.raises(CheckpointError, match="nothing staged for step 4"):
        storage.commit_step(tmp_path, 4)
    _save(tmp_path, 4, commit=False)
    # An unfinished part (no marker yet) does not count either.
    storage.start_part(tmp_path, 5, "actor")
    with pytest.raises(CheckpointError, match="nothing staged for step 5"):
        storage.commit_step(tmp_path, 5)


class _Crash(Exception):
    pass


def _crash_on_call(monkeypatch, k: int) -> list[int]:
    """Make the k-th os.replace/os.fsync call (0-based, counted together) raise."""
    calls = [0]
    real_replace, real_fsync = os.replace, os.fsync

    def wrap(real):
        def inner(*args, **kwargs):
            calls[0] += 1
            if calls[0] - 1 == k:
                raise _Crash(f"simulated crash at file operation {k}")
            return real(*args, **kwargs)

        return inner

    monkeypatch.setattr(os, "replace", wrap(real_replace))
    monkeypatch.setattr(os, "fsync", wrap(real_fsync))
    return calls


def test_crash_at_any_file_operation_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    # Durability is not under test here (only what the disk holds after each
    # operation), and real fsyncs would make this loop slow.
    monkeypatch.setattr(os, "fsync", lambda fd: None)
    crashes = 0
    for k in range(200):
        root = tmp_path / f"run{k}"
        _save(root, 1)
        with pytest.MonkeyPatch.context() as patch:
            calls = _crash_on_call(patch, k)
            try:
                _save(root, 2, names=("actor", "critic"), keep=1)
                crashed = False
            except _Crash:
                crashed = True
        latest = find_latest_checkpoint(root)
        # Either the old checkpoint or the whole new one, never a broken one.
        assert latest in (root / "global_step_1", root / "global_step_2"), (k, latest)
        if latest.name == "global_step_1":
            assert _payload(latest) == b"actor@1" * 10
        else:
            assert _payload(latest, "critic") == b"critic@2" * 10
        # The pointer never names a step that is not complete.
        assert read_latest_pointer(root) in {1, 2} & set(storage.complete_steps(root))
        if not crashed:
            assert calls[0] == k, "every file operation before this one was already tried"
            break
        crashes += 1
        # The next save of the same step repairs everything: latest is 2, step 1 pruned, no leftovers.
        _save(root, 2, names=("actor", "critic"), keep=1)
        assert find_latest_checkpoint(root) == root / "global_step_2"
        assert sorted(p.name for p in root.iterdir()) == ["global_step_2", storage.POINTER_FILE], k
    assert crashes > 20  # the save really has that many steps where a crash was simulated


def test_prune_keeps_the_newest_and_never_deletes_newer_steps(tmp_path, caplog):
    for step in range(1, 6):
        _save(tmp_path, step, keep=2)
    assert sorted(storage.complete_steps(tmp_path)) == [4, 5]
    # Training resumed from step 4 in a new root that also holds steps 10 and 20 of an
    # earlier run: saving step 15 with keep=1 deletes only what is older than 15.
    other = tmp_path / "resumed"
    _save(other, 10)
    _save(other, 20)
    with caplog.at_level("WARNING"):
        _save(other, 15, keep=1)
    assert sorted(storage.complete_steps(other)) == [15, 20]
    assert "later steps [20]" in caplog.text
    assert read_latest_pointer(other) == 15
    assert find_latest_checkpoint(other) == other / "global_step_20"


def test_saving_an_existing_step_replaces_it(tmp_path):
    _save(tmp_path, 3)
    (tmp_path / ".global_step_1.staging").mkdir()  # leftover of an older interrupted save
    tmp = storage.start_part(tmp_path, 3, "actor")
    (tmp / "weights.bin").write_bytes(b"new")
    storage.publish_part(tmp_path, 3, "actor", {})
    storage.commit_step(tmp_path, 3)
    assert _payload(tmp_path / "global_step_3") == b"new"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step_3", storage.POINTER_FILE]


def test_unfinished_directories_are_skipped(tmp_path):
    _save(tmp_path, 1)
    # A half-copied step without its marker, a staged but uncommitted step, and a
    # step whose marker names a part that has no part marker.
    (tmp_path / "global_step_7" / "actor").mkdir(parents=True)
    _save(tmp_path, 8, commit=False)
    _save(tmp_path, 9)
    (tmp_path / "global_step_9" / "actor" / storage.PART_MARKER).unlink()
    assert find_latest_checkpoint(tmp_path) == tmp_path / "global_step_1"
    with pytest.raises(CheckpointNotFoundError, match=r"global_step_7 is not a complete checkpoint"):
        storage.resolve_part(tmp_path / "global_step_7", "actor")
    with pytest.raises(
        CheckpointNotFoundError, match=r"global_step_1 has no part 'critic'; it holds \['actor'\]"
    ):
        storage.resolve_part(tmp_path, "critic")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda p: None, "the path does not exist"),
        (lambda p: p.write_text("x"), "the path is a file"),
        (lambda p: p.mkdir(), "holds no global_step_"),
        (
            lambda p: _save(p, 8, commit=False) or (p / "global_step_9").mkdir(),
            "only unfinished saves: .global_step_8.staging, global_step_9",
        ),
    ],
    ids=["missing", "file", "empty", "unfinished"],
)
def test_no_checkpoint_error_names_the_path_and_what_is_there(tmp_path, setup, message):
    root = tmp_path / "ckpts"
    setup(root)
    with pytest.raises(CheckpointNotFoundError) as info:
        storage.resolve_part(root, "actor")
    assert str(root) in str(info.value) and message in str(info.value)


def test_damaged_parts_are_reported_with_the_file_at_fault(tmp_path):
    _save(tmp_path, 1)
    part = tmp_path / "global_step_1" / "actor"
    with open(part / "weights.bin", "r+b") as f:
        f.truncate(20)
    with pytest.raises(CheckpointCorruptError, match=r"damaged: weights.bin has 20 bytes, 70 were written"):
        storage.read_part_meta(part)
    (part / "sub" / "extra.json").unlink()
    with pytest.raises(CheckpointCorruptError, match=r"extra.json is missing"):
        storage.read_part_meta(part)
    (part / storage.PART_MARKER).write_text("{not json")
    with pytest.raises(
        CheckpointCorruptError, match=r"checkpoint marker .*checkpoint_meta.json is unreadable"
    ):
        storage.read_part_meta(part)


def test_bytes_changed_in_place_are_named_by_their_checksum(tmp_path):
    _save(tmp_path, 1)
    part = tmp_path / "global_step_1" / "actor"
    data = bytearray((part / "weights.bin").read_bytes())
    data[5] ^= 0x01  # one bit, same size
    (part / "weights.bin").write_bytes(bytes(data))
    with pytest.raises(
        CheckpointCorruptError, match=r"damaged: weights.bin does not hold the bytes that were written"
    ):
        storage.read_part_meta(part)
    # Ranks split the reading: exactly one of two shares finds it; a size-only check does not.
    found = []
    for index in range(2):
        try:
            storage.read_part_meta(part, share=(index, 2))
        except CheckpointCorruptError:
            found.append(index)
    assert len(found) == 1
    assert storage.read_part_meta(part, share=None)["name"] == "actor"


def test_a_marker_without_checksums_is_checked_by_size(tmp_path):
    _save(tmp_path, 1)
    part = tmp_path / "global_step_1" / "actor"
    marker = json.loads((part / storage.PART_MARKER).read_text())
    assert set(marker["sha256"]) == set(marker["files"])
    del marker["sha256"]  # as written before checksums existed
    (part / storage.PART_MARKER).write_text(json.dumps(marker))
    assert storage.read_part_meta(part)["name"] == "actor"
