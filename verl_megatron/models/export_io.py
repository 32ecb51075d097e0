"""Putting an exported folder in place: written beside its destination, then renamed."""

from __future__ import annotations

import os
import shutil


def publish_folder(tmp_dir: str, out_dir: str) -> None:
    """Move the finished folder into place; a previous ``out_dir`` is replaced, never half-written."""
    if os.path.exists(out_dir):
        old = f"{out_dir}.old-{os.getpid()}"
        os.rename(out_dir, old)
        os.rename(tmp_dir, out_dir)
        shutil.rmtree(old)
    else:
        os.rename(tmp_dir, out_dir)
