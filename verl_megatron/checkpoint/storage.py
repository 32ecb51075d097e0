"""The on-disk layout of checkpoints and the file operations that keep it safe.

Layout under a checkpoint root::

    root/
      latest_checkpointed_iteration.txt     step of the last committed save (verl's pointer file)
      global_step_20/
        checkpoint_complete.json            step marker: written before the directory appears
        actor/                              one "part" per saved model (actor, critic, ...)
          checkpoint_meta.json              part marker: layout, contents, file sizes and sha256
          common.pt, .metadata, *.distcp    megatron dist-checkpointing files
      .global_step_30.staging/              a save in progress (ignored by readers)

A save writes every part into the hidden staging directory, then the step
marker, fsyncs everything and renames the staging directory to
``global_step_N`` (one atomic rename), and only then rewrites the pointer file
(temporary file + ``os.replace``). A crash at any point leaves either the old
state or the new complete step: readers only trust directories with a marker,
and older checkpoints are pruned only after the new one is in place.

Loading checks every file's size and sha256 against the part marker, so bytes
changed in place (a bad disk, a botched copy) are named instead of loaded.

Everything here is plain file work done by one process (rank 0); the
distributed save in :mod:`verl_megatron.checkpoint.manager` calls it. The
checksums of a distributed save are taken by the ranks that write the files
(:mod:`verl_megatron.checkpoint.hashing`) and handed to :func:`publish_part`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from verl_megatron.errors import UserInputError

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
POINTER_FILE = "latest_checkpointed_iteration.txt"
STEP_MARKER = "checkpoint_complete.json"
PART_MARKER = "checkpoint_meta.json"
_STEP_RE = re.compile(r"^global_step_(\d+)$")
_STAGING_RE = re.compile(r"^\.global_step_(\d+)\.staging$")
_REPLACED_RE = re.compile(r"^\.global_step_(\d+)\.replaced-[0-9a-f]+$")
_TRASH_TAG = ".deleting-"


class CheckpointError(UserInputError, RuntimeError):
    """Base class: a checkpoint cannot be saved or loaded as asked."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No complete checkpoint at the given path."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint's files are missing, truncated or unreadable."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer it is loaded into."""


def step_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f"global_step_{int(step)}"


def staging_dir(root: str | os.PathLike, step: int) -> Path:
    return Path(root) / f".global_step_{int(step)}.staging"


def _fsync_path(path: Path) -> None:
    # Directories are fsynced too: a rename or a new file is only durable once
    # the directory entry that names it is.
    flags = os.O_RDONLY | (os.O_DIRECTORY if path.is_dir() else 0)
    fd = os.open(path, flags)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: Path) -> None:
    """fsync every file and directory under ``path`` (and ``path`` itself)."""
    for dirpath, _, filenames in os.walk(path):
        for filename in filenames:
            _fsync_path(Path(dirpath) / filename)
        _fsync_path(Path(dirpath))


def write_text_atomic(path: Path, text: str) -> None:
    """Replace ``path`` with ``text`` so readers see the old or the new content, never a mix."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            data = json.load(f)
    except FileNotFoundError:
        raise
    except (OSError, ValueError) as exc:
        raise CheckpointCorruptError(f"{what} {path} is unreadable: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointCorruptError(f"{what} {path} does not hold a JSON object")
    return data


def _manifest(part: Path) -> dict[str, int]:
    """Relative path -> size of every file of a part (its marker excluded)."""
    sizes = {}
    for dirpath, _, filenames in os.walk(part):
        for filename in filenames:
            full = Path(dirpath) / filename
            rel = str(full.relative_to(part))
            if rel != PART_MARKER:
                sizes[rel] = full.stat().st_size
    return sizes


def file_sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def reported_checksums(part: Path, files: dict[str, int], written: list[dict[str, str]]) -> dict[str, str]:
    """The sha256 of every file of ``part`` from ``written`` (one dict relative path -> sha256 per
    rank, in rank order: what each rank wrote). Raises CheckpointError naming a file that no rank
    reported writing, that a rank reported but is not in ``part``, or that two ranks reported."""
    checksums: dict[str, str] = {}
    writer: dict[str, int] = {}
    problems = []
    for rank, digests in enumerate(written):
        for rel, digest in sorted(digests.items()):
            if rel in writer:
                problems.append(f"{rel} was reported by rank {writer[rel]} and rank {rank}")
            elif rel not in files:
                problems.append(f"{rel} was written by rank {rank} but is not in the part")
            checksums[rel], writer[rel] = digest, rank
    problems += [
        f"{rel} is in the part but no rank reported writing it" for rel in sorted(files) if rel not in writer
    ]
    if problems:
        raise CheckpointError(f"cannot finish checkpoint part {part}: " + "; ".join(problems[:5]))
    return checksums


def finish_part(part: Path, meta: dict[str, Any], written: list[dict[str, str]] | None = None) -> None:
    """Write the part marker (contents, file sizes and checksums) after fsyncing the part's files.

    ``written``: the checksums each rank took of the files it wrote (see :func:`reported_checksums`);
    None: hash every file here."""
    fsync_tree(part)
    files = _manifest(part)
    if written is None:
        # sha256 runs at ~1.5 GB/s a core (hardware SHA): fine for a part one process writes.
        checksums = {rel: file_sha256(part / rel) for rel in files}
    else:
        checksums = reported_checksums(part, files, written)
    record = {"format_version": FORMAT_VERSION, **meta, "files": files, "sha256": checksums}
    write_text_atomic(part / PART_MARKER, json.dumps(record, indent=1, sort_keys=True))


def start_part(root: str | os.PathLike, step: int, name: str) -> Path:
    """An empty directory to write part ``name`` of ``step`` into (inside the step's staging directory)."""
    tmp = staging_dir(root, step) / f".{name}.tmp"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir(parents=True)
    return tmp


def publish_part(
    root: str | os.PathLike,
    step: int,
    name: str,
    meta: dict[str, Any],
    written: list[dict[str, str]] | None = None,
) -> Path:
    """Finish the part written into :func:`start_part`'s directory and give it its name in staging.

    ``written``: see :func:`finish_part`."""
    staged = staging_dir(root, step)
    tmp, part = staged / f".{name}.tmp", staged / name
    finish_part(tmp, meta, written)
    if part.exists():
        # A leftover of an interrupted save of this same step: it was never published.
        shutil.rmtree(part)
    os.replace(tmp, part)
    _fsync_path(staged)
    return part


def read_part_meta(part: Path, share: tuple[int, int] | None = (0, 1)) -> dict[str, Any]:
    """The part marker, after checking that every listed file is present with its size and checksum.

    ``share`` = (i, n): check the contents of every n-th file starting at the i-th
    (ranks split the reading); None checks sizes only. Markers written before
    checksums existed are checked by size.

    Raises CheckpointNotFoundError when ``part`` holds no finished part and
    CheckpointCorruptError when a file is missing, has the wrong size
    (truncated copy, interrupted transfer) or other bytes than were written.
    """
    marker = part / PART_MARKER
    try:
        meta = _read_json(marker, "checkpoint marker")
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{part} is not a finished checkpoint (no {PART_MARKER}; the save may have been interrupted)"
        ) from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{marker}: format_version {meta.get('format_version')!r}, this code reads {FORMAT_VERSION}"
        )
    problems = []
    for rel, size in sorted(meta.get("files", {}).items()):
        path = part / rel
        if not path.is_file():
            problems.append(f"{rel} is missing")
        elif path.stat().st_size != size:
            problems.append(f"{rel} has {path.stat().st_size} bytes, {size} were written")
    if not problems and share is not None:
        index, count = share
        checksums = meta.get("sha256", {})
        for rel in sorted(checksums)[index::count]:
            if file_sha256(part / rel) != checksums[rel]:
                problems.append(f"{rel} does not hold the bytes that were written (sha256 differs)")
    if problems:
        raise CheckpointCorruptError(f"checkpoint {part} is damaged: " + "; ".join(problems[:5]))
    return meta


def _is_complete(directory: Path) -> bool:
    marker = directory / STEP_MARKER
    if not marker.is_file():
        return False
    try:
        parts = _read_json(marker, "step marker").get("parts", [])
    except CheckpointCorruptError:
        return False
    return all((directory / name / PART_MARKER).is_file() for name in parts)


def complete_steps(root: str | os.PathLike) -> dict[int, Path]:
    """Step -> directory of every complete checkpoint under ``root``."""
    root = Path(root)
    if not root.is_dir():
        return {}
    found = {}
    for entry in root.iterdir():
        match = _STEP_RE.match(entry.name)
        if match and entry.is_dir() and _is_complete(entry):
            found[int(match.group(1))] = entry
    return found


def step_of(directory: Path) -> int | None:
    """The step a complete step directory holds: its step marker's, else the ``global_step_N`` name."""
    try:
        return int(_read_json(directory / STEP_MARKER, "step marker")["step"])
    except (OSError, KeyError, TypeError, ValueError, CheckpointCorruptError):
        match = _STEP_RE.match(directory.name)
        return int(match.group(1)) if match else None


def damaged_steps(root: str | os.PathLike) -> dict[int, str]:
    """Step -> what is wrong, of every committed step (its step marker written) that is not complete:
    an unreadable step marker, or a part it lists without its part marker. Interrupted saves (no
    step marker) are not damage and are not listed."""
    root = Path(root)
    found: dict[int, str] = {}
    for entry in root.iterdir() if root.is_dir() else ():
        match = _STEP_RE.match(entry.name)
        if not (match and entry.is_dir() and (entry / STEP_MARKER).is_file()):
            continue
        try:
            parts = _read_json(entry / STEP_MARKER, "step marker").get("parts", [])
        except (FileNotFoundError, CheckpointCorruptError) as err:
            found[int(match.group(1))] = str(err)
            continue
        missing = [
            f"{name}/{PART_MARKER} is missing" for name in parts if not (entry / name / PART_MARKER).is_file()
        ]
        if missing:
            found[int(match.group(1))] = f"checkpoint {entry} is damaged: " + "; ".join(missing)
    return found


def find_latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """Directory of the complete checkpoint with the highest step under ``root``, or None.

    Staging directories and step directories without their marker (an
    interrupted save, a half-copied directory) are skipped. The pointer file is
    not trusted: a crash between the final rename and the pointer update leaves
    it one save behind.
    """
    steps = complete_steps(root)
    return steps[max(steps)] if steps else None


def read_latest_pointer(root: str | os.PathLike) -> int | None:
    """The step in verl's pointer file, or None when it is absent or unreadable."""
    try:
        return int((Path(root) / POINTER_FILE).read_text().strip())
    except (OSError, ValueError):
        return None


def write_room(path: Path) -> str:
    """Free space on ``path``'s filesystem and the process's file-size limit, for the message of a
    failed write (a failure reported by another rank arrives without its OSError)."""
    import resource

    probe = next((p for p in (path, *path.parents) if p.exists()), Path("/"))
    text = f"{shutil.disk_usage(probe).free / 2**20:.1f} MiB free on the filesystem of {probe}"
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    if soft != resource.RLIM_INFINITY:
        text += f"; file size limit (ulimit -f) {soft} bytes"
    return text


def describe_root(root: Path) -> str:
    """What a checkpoint root holds, for error messages."""
    if not root.exists():
        return "the path does not exist"
    if not root.is_dir():
        return "the path is a file, not a directory"
    entries = sorted(e.name for e in root.iterdir() if e.is_dir() and "global_step_" in e.name)
    if not entries:
        return "it holds no global_step_* directory"
    return "it holds only unfinished saves: " + ", ".join(entries[:5])


def _trash(path: Path) -> None:
    """Delete a directory so that a crash midway never leaves a half-deleted checkpoint behind.

    The rename comes first and is atomic: the name a reader trusts is gone
    before any file is removed.
    """
    doomed = path.with_name(f".{path.name}{_TRASH_TAG}{uuid.uuid4().hex[:8]}")
    os.replace(path, doomed)
    _fsync_path(path.parent)
    shutil.rmtree(doomed, ignore_errors=True)


def commit_step(
    root: str | os.PathLike,
    step: int,
    max_ckpt_to_keep: int | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """Publish the staged checkpoint of ``step``: marker, fsync, rename, pointer, then prune.

    ``files``: name -> text of small files written into the step directory with it.
    Returns the final step directory. Raises CheckpointError when nothing was
    staged for ``step``.
    """
    root = Path(root)
    staged, final = staging_dir(root, step), step_dir(root, step)
    parts = []
    if staged.is_dir():
        # ".name.tmp" directories are parts whose save did not finish.
        parts = sorted(
            p.name for p in staged.iterdir() if not p.name.startswith(".") and (p / PART_MARKER).is_file()
        )
    if not parts:
        raise CheckpointError(f"nothing staged for step {step} under {root}: save a part before committing")
    for leftover in staged.glob(f".{STEP_MARKER}.tmp-*"):
        leftover.unlink()  # from an earlier attempt at this commit that crashed
    for name, text in (files or {}).items():
        write_text_atomic(staged / name, text)
    marker = {
        "format_version": FORMAT_VERSION,
        "step": int(step),
        "parts": parts,
        "committed_at": time.time(),
    }
    write_text_atomic(staged / STEP_MARKER, json.dumps(marker, indent=1))
    fsync_tree(staged)
    if final.exists():
        # Saving a step that already exists (training resumed from an earlier
        # step and came back here): the new save replaces it. The old one is
        # renamed away first so the final rename below stays atomic.
        # A crash between the two renames leaves the old one under its
        # ".replaced-" name, where prune() keeps it until a new step N is complete.
        replaced = final.with_name(f".{final.name}.replaced-{uuid.uuid4().hex[:8]}")
        os.replace(final, replaced)
        os.replace(staged, final)
        _fsync_path(root)
        shutil.rmtree(replaced, ignore_errors=True)
    else:
        os.replace(staged, final)
        _fsync_path(root)
    write_text_atomic(root / POINTER_FILE, str(int(step)))
    newer = [s for s in complete_steps(root) if s > step]
    if newer:
        logger.warning(
            "checkpoint step %d saved under %s, which also holds later steps %s from an earlier run; "
            "find_latest_checkpoint returns the highest step",
            step,
            root,
            sorted(newer),
        )
    prune(root, step, max_ckpt_to_keep)
    return final


def prune(root: Path, newest_step: int, max_ckpt_to_keep: int | None) -> list[int]:
    """Delete complete checkpoints older than ``newest_step`` beyond the newest ``max_ckpt_to_keep``.

    Only steps below ``newest_step`` (which must be complete) are candidates,
    so nothing newer than the checkpoint just written is ever removed. Leftovers
    of interrupted saves of older steps and of interrupted deletions go too.
    Returns the deleted steps. ``max_ckpt_to_keep`` None or <= 0 keeps everything.
    """
    deleted: list[int] = []
    for leftover in root.glob(f".{POINTER_FILE}.tmp-*"):
        leftover.unlink()  # a pointer update that crashed before its rename
    for entry in root.iterdir():
        staging = _STAGING_RE.match(entry.name)
        replaced = _REPLACED_RE.match(entry.name)
        if (
            _TRASH_TAG in entry.name
            or (staging and int(staging.group(1)) < newest_step)
            # A step replaced by a newer save of the same step, once that save is in place.
            or (replaced and _is_complete(step_dir(root, int(replaced.group(1)))))
        ):
            shutil.rmtree(entry, ignore_errors=True)
    if not max_ckpt_to_keep or max_ckpt_to_keep <= 0:
        return deleted
    steps = complete_steps(root)
    if newest_step not in steps:
        raise CheckpointError(f"refusing to prune {root}: step {newest_step} is not complete")
    older = sorted((s for s in steps if s < newest_step), reverse=True)
    for s in older[max_ckpt_to_keep - 1 :]:
        _trash(steps[s])
        deleted.append(s)
    if deleted:
        logger.info(
            "removed checkpoints %s under %s (max_ckpt_to_keep=%d)", sorted(deleted), root, max_ckpt_to_keep
        )
    return deleted


def resolve_part(path: str | os.PathLike, name: str) -> Path:
    """The directory of part ``name`` for a root, a step directory or a part directory.

    A root resolves to its latest complete step. Raises CheckpointNotFoundError
    naming the path and what it holds instead.
    """
    path = Path(path)
    if (path / PART_MARKER).is_file():
        return path
    if (path / STEP_MARKER).is_file():
        step = path
    elif _STEP_RE.match(path.name) and path.is_dir():
        raise CheckpointNotFoundError(
            f"{path} is not a complete checkpoint (no {STEP_MARKER}: the save was interrupted or the copy is partial)"
        )
    else:
        latest = find_latest_checkpoint(path)
        if latest is None:
            raise CheckpointNotFoundError(f"no complete checkpoint under {path}: {describe_root(path)}")
        step = latest
    part = step / name
    if not part.is_dir():
        held = sorted(p.name for p in step.iterdir() if p.is_dir() and not p.name.startswith("."))
        raise CheckpointNotFoundError(f"checkpoint {step} has no part {name!r}; it holds {held}")
    return part
