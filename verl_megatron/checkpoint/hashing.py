"""sha256 of checkpoint files taken from the bytes on their way to disk, on the rank that writes them.

A part's marker records every file's sha256 (:func:`storage.finish_part`). Hashing there, on the
one publishing rank after every rank has written, read the whole checkpoint back on that rank
(a 7B actor with Adam state: about 60 s while the other ranks wait). Here each rank hashes the
files it writes as it writes them, from the buffers it already holds, so the work is split
over the ranks and no file is read back; the publisher gathers the digests.

torch.distributed.checkpoint writes through a ``FileSystem`` object: :class:`HashingFileSystem`
is that object with every output stream hashed. torch only appends to these streams (its
per-item stream wrapper has no ``seek``), so the running hash is the file's; a ``seek`` on a
hashed stream fails loudly rather than record a wrong digest.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch.distributed.checkpoint.filesystem import FileSystem

from verl_megatron.checkpoint.storage import file_sha256

__all__ = ["HashingFileSystem", "HashingStream", "WrittenFiles"]


class WrittenFiles:
    """Relative path -> sha256 of every file this process wrote into one part directory."""

    def __init__(self, part: str | os.PathLike) -> None:
        self.part = Path(part)
        self._digests: dict[str, str] = {}
        self._lock = threading.Lock()  # torch's writer threads record concurrently

    def _relative(self, path: str | os.PathLike) -> str:
        return str(Path(path).relative_to(self.part))

    def record(self, path: str | os.PathLike, digest: str) -> None:
        with self._lock:
            self._digests[self._relative(path)] = digest

    def renamed(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        with self._lock:
            digest = self._digests.pop(self._relative(path), None)
            if digest is not None:
                self._digests[self._relative(new_path)] = digest

    def removed(self, path: str | os.PathLike) -> None:
        with self._lock:
            self._digests.pop(self._relative(path), None)

    def hash_from_disk(self, rel: str) -> None:
        """Record ``rel`` by reading it: for a file written by code that does not go through
        :class:`HashingFileSystem` (megatron's small common files). Absent files are skipped."""
        path = self.part / rel
        if path.is_file():
            self.record(path, file_sha256(path))

    def digests(self) -> dict[str, str]:
        with self._lock:
            return dict(self._digests)


class HashingStream:
    """A binary output file that hashes every byte written to it (append only: no ``seek``)."""

    def __init__(self, raw) -> None:
        self.raw = raw
        self.sha256 = hashlib.sha256()

    def write(self, data) -> int:
        self.sha256.update(data)
        return self.raw.write(data)

    def tell(self) -> int:
        return self.raw.tell()

    def flush(self) -> None:
        self.raw.flush()

    def fileno(self) -> int:
        return self.raw.fileno()

    def close(self) -> None:
        self.raw.close()


class HashingFileSystem(FileSystem):
    """torch.distributed.checkpoint's local file system, recording the sha256 of each file written
    (and following the coordinator's rename of its metadata file) in ``written``."""

    def __init__(self, written: WrittenFiles) -> None:
        super().__init__()
        self.written = written

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator:
        if mode == "rb":
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        if mode != "wb":
            raise ValueError(
                f"checkpoint files are written whole ('wb'), not opened with mode {mode!r}: {path}"
            )
        with super().create_stream(path, mode) as raw:
            stream = HashingStream(raw)
            yield stream
        self.written.record(path, stream.sha256.hexdigest())

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        self.written.renamed(path, new_path)

    def rm_file(self, path: str | os.PathLike) -> None:
        super().rm_file(path)
        self.written.removed(path)
