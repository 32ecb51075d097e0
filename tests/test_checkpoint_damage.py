"""A checkpoint save that runs out of room names the cause (the OSError, not torch's writer
error), and a newest checkpoint whose part marker is gone is named in the same warning as the
other damage before the previous one is resumed. The whole runs that show both are in
tests/test_durability.py, which shares its finished two-step run with them."""

from __future__ import annotations

import resource
import signal

import pytest

from tests.test_checkpoint_storage import _save
from verl_megatron.checkpoint import storage
from verl_megatron.checkpoint.collectives import describe_failure
from verl_megatron.checkpoint.resume import load_newest_intact
from verl_megatron.checkpoint.storage import CheckpointNotFoundError


def test_torch_writer_error_names_its_os_cause(tmp_path):
    import torch

    _limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, _limit[1]))
    try:
        with open(tmp_path / "x.pt", "wb") as f, pytest.raises(RuntimeError) as caught:
            torch.save({"a": torch.zeros(10_000)}, f)
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, _limit)
        signal.signal(signal.SIGXFSZ, old)
    line = describe_failure(caught.value)
    assert line.startswith("RuntimeError: [enforce fail at inline_container.cc"), line
    assert line.endswith("(caused by OSError: [Errno 27] File too large)"), line
    assert describe_failure(OSError(28, "No space left on device")) == (
        "OSError: [Errno 28] No space left on device"
    )


def test_a_newest_step_without_its_part_marker_is_named_when_skipped(tmp_path):
    _save(tmp_path, 1)
    _save(tmp_path, 2, names=("actor", "critic"))
    (tmp_path / "global_step_2" / "critic" / storage.PART_MARKER).unlink()
    (tmp_path / "global_step_3" / "actor").mkdir(parents=True)  # interrupted copy: no step marker
    said: list[str] = []
    path, loaded = load_newest_intact(tmp_path, lambda p: p.name, said.append)
    assert (path, loaded) == (tmp_path / "global_step_1", "global_step_1")
    assert said == [
        f"warning: damaged checkpoint(s) skipped: global_step_2 (checkpoint {tmp_path / 'global_step_2'} "
        f"is damaged: critic/{storage.PART_MARKER} is missing); resuming from {tmp_path / 'global_step_1'} instead"
    ]
    # The only committed step damaged: an error, not a silent fresh start.
    (tmp_path / "global_step_1" / "actor" / storage.PART_MARKER).unlink()
    with pytest.raises(
        CheckpointNotFoundError, match=r"no intact checkpoint under .*: global_step_2 \(.*global_step_1 \("
    ):
        load_newest_intact(tmp_path, lambda p: p.name, said.append)
    assert storage.damaged_steps(tmp_path / "nothing") == {}
