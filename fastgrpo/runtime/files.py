"""Atomic file writes: every file a run writes (config.json, the logs' rewrites, caches) appears whole or not at all;
and the checks that say whether a cached model folder is whole (:func:`folder_problem`).

A write cut short (a full disk, a kill) must not leave a truncated file under the real name: a ``config.json`` cut
at 4,096 bytes is as lost as a half-written checkpoint, and the next run would refuse to resume with nothing to
restore. So the bytes go to a temporary file in the same folder, are flushed to the disk, and the temporary file is
renamed over the real one (``os.replace`` is atomic on POSIX filesystems). On failure the temporary file is removed
and the old file, if any, is untouched.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["folder_problem", "publish_folder", "safetensors_problem", "tensor_digest", "write_atomic"]


def write_atomic(path: Path | str, data: str | bytes, *, encoding: str = "utf-8") -> None:
    """Write ``data`` to ``path`` atomically (see the module docstring); any OSError goes on after cleaning up."""
    path = Path(path)
    raw = data.encode(encoding) if isinstance(data, str) else data
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def safetensors_problem(path: Path) -> str | None:
    """Why the safetensors file ``path`` is unusable, or None: its header (8 bytes of length, then JSON naming each
    tensor's byte range) says how long the whole file is, so a truncated copy is found without reading the
    tensors."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                return f"{path.name} is truncated ({size} bytes)"
            n = int.from_bytes(head, "little")
            if n > size - 8:
                return f"{path.name} is truncated ({size} bytes, its header alone needs {8 + n})"
            header = json.loads(f.read(n))
    except (OSError, ValueError) as e:
        return f"{path.name} cannot be read ({e})"
    ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__" and isinstance(v, dict)]
    need = 8 + n + max(ends, default=0)
    return None if size >= need else f"{path.name} is truncated ({size} of its {need} bytes)"


def tensor_digest(path: Path) -> str | None:
    """A hash of what the safetensors file ``path`` holds (each tensor's name, dtype and shape, from its header, not
    its data), or None when the header cannot be read: a file with other tensors has another digest."""
    try:
        with open(path, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
    except (OSError, ValueError):
        return None
    tensors = {k: [v.get("dtype"), v.get("shape")] for k, v in header.items()
               if k != "__metadata__" and isinstance(v, dict)}
    return hashlib.sha256(json.dumps(tensors, sort_keys=True).encode()).hexdigest()


def folder_problem(folder: Path, required: tuple[str, ...]) -> str | None:
    """Why a cached model folder is not complete, or None: one of the ``required`` files is missing, or one of its
    safetensors files is truncated (:func:`safetensors_problem`). A folder missing is a problem too."""
    if not folder.is_dir():
        return f"{folder} does not exist"
    for name in required:
        if not (folder / name).is_file():
            return f"{folder} has no {name}"
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            return f"{folder}: {problem}"
    return None


def publish_folder(tmp: Path, final: Path, required: tuple[str, ...]) -> bool:
    """Rename the finished folder ``tmp`` to ``final``; False (``tmp`` left for the caller to remove) when a complete
    ``final`` is there already (a concurrent builder renamed first: theirs stays, as others may be reading it). An
    incomplete ``final`` (see :func:`folder_problem`) is moved aside first and removed after: renaming onto a
    non-empty folder fails (ENOTEMPTY), which would make every later build fail the same way."""
    if final.exists():
        if folder_problem(final, required) is None:
            return False
        aside = final.with_name(f".{final.name}.stale-{os.getpid()}")
        shutil.rmtree(aside, ignore_errors=True)
        try:
            os.rename(final, aside)
        except FileNotFoundError:  # someone else moved it
            pass
        shutil.rmtree(aside, ignore_errors=True)
    try:
        os.rename(tmp, final)
    except OSError:
        if folder_problem(final, required) is not None:  # a real failure, not a lost race
            raise
        return False
    return True
