"""Checks that need no model, run first so that a mistake costs no model load: the launch, the run folder (its
paths, its lock against a second run, a resume's config against the one it continues) and the input files; and
the data's fit to the model's positions (from the model folder's config.json).

Each failure is a ValueError with one line that names the setting or the path and says what to do.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import resource
import shutil
import socket
from pathlib import Path
from typing import Any

import torch

from fastgrpo.config import TrainConfig, not_a_file, run_defining_changes, run_kind_of
from fastgrpo.config.loader import too_deep
from fastgrpo.distributed import checkpoint as ckpt
from fastgrpo.distributed.parallelize import check_parallel
from fastgrpo.models.attention import choose_attn_implementation, use_shared_prefix
from fastgrpo.runtime.errors import DiskFullError, is_disk_full
from fastgrpo.runtime.files import safetensors_problem, write_atomic

LOGS = ("metrics.jsonl", "completions.jsonl")
"""The run folder's append-only logs."""


def check_launch(cfg: TrainConfig, world_size: int, device: torch.device | str) -> None:
    """The parallel settings fit the launch (``world_size`` processes on ``device``), and the attention they run
    can share a prompt prefix where ``grpo.shared_prefix`` is true."""
    check_parallel(cfg.parallel, device, world_size)  # what parallelize_model would refuse after the load
    check_shared_prefix(cfg, device)
    if not cfg.parallel.fsdp and world_size > 1:
        # Without FSDP nothing would synchronise the ranks' gradients: each would train its own copy of the model
        # and rank 0's would be exported. FSDP2 is the one data-parallel path (it also shards and reshards the
        # checkpoints); a second, DDP-style one would duplicate that for no measured gain.
        raise ValueError(f"parallel.fsdp=false with {world_size} processes would train {world_size} unsynchronised "
                         "copies of the model; set parallel.fsdp=true (FSDP2 synchronises gradients) or run one "
                         "process")


def check_shared_prefix(cfg: TrainConfig, device: torch.device | str) -> None:
    """grpo.shared_prefix=true with an attention that cannot express a shared prefix (or compiled / graphed blocks):
    ValueError naming both keys, before the model loads. (A model's sliding-window layers are found at its load.)"""
    grpo = getattr(cfg, "grpo", None)  # a GRPO-family run's section (an SFT run has none)
    if grpo is None or grpo.shared_prefix != "true":
        return
    try:
        impl = choose_attn_implementation(cfg.model.attn_implementation, torch.device(device).type)
    except (ImportError, ValueError):  # the model loader names what is missing
        return
    use_shared_prefix("true", impl=impl, static_shapes=cfg.parallel.compile or cfg.parallel.cuda_graphs,
                      requested=cfg.model.attn_implementation)


def check_run_dir(cfg: TrainConfig) -> None:
    """Every output path is usable (a folder where a folder goes, a file where a file goes, writable), and the
    resume setting does not silently discard an existing run."""
    out, run = Path(cfg.output_dir), cfg.run_dir
    for path, what in ((out, "output_dir"), (run, "the run folder (output_dir/name)"),
                       (run / "checkpoints", "the checkpoint folder"), (run / "final", "the export folder")):
        if path.exists() and not path.is_dir():
            raise ValueError(f"{what} {str(path)!r} is a file, not a folder; move it or choose another "
                             f"{'output_dir' if path == out else 'name'}")
    for name in (*LOGS, "config.json"):
        if (run / name).is_dir():
            raise ValueError(f"{str(run / name)!r} is a folder; the run writes a file there: move it away")
    existing = next(p for p in (run, *run.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{str(existing)!r} is a file, so the run folder {str(run)!r} cannot be created under it; "
                         "choose another output_dir")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"cannot write to {str(existing)!r} (permission denied), so the run folder {str(run)!r} "
                         "cannot be created; choose another output_dir")
    if cfg.checkpoint.resume == "never" and not cfg.checkpoint.overwrite and holds_run(run):
        raise ValueError(f"{str(run)!r} already holds a run and checkpoint.resume=never would overwrite it; use "
                         "another name, resume it (checkpoint.resume=auto), or set checkpoint.overwrite=true to "
                         "delete it and start over")
    if cfg.checkpoint.resume not in ("auto", "never"):
        ckpt.resolve_resume(cfg.checkpoint.resume, run / "checkpoints")  # an explicit path must be a checkpoint


def holds_run(run: Path) -> bool:
    """A checkpoint, a non-empty log or an export in the run folder."""
    return (bool(ckpt.list_checkpoints(run / "checkpoints")) or (run / "final").is_dir()
            or any((run / name).is_file() and (run / name).stat().st_size > 0 for name in LOGS))


def clear_run(run: Path) -> None:
    """Delete a run's checkpoints, logs and export (checkpoint.resume=never with checkpoint.overwrite=true)."""
    print(f"[fastgrpo] checkpoint.overwrite=true: deleting the run in {run}", flush=True)
    shutil.rmtree(run / "checkpoints", ignore_errors=True)
    shutil.rmtree(run / "final", ignore_errors=True)
    for name in LOGS:
        (run / name).unlink(missing_ok=True)


def check_inputs(cfg: Any) -> None:
    """Input files the config names (data.source, reward plugin files) that exist but are no regular file or
    folder (a FIFO, a device) are named as what they are, not as missing."""
    paths = [("data.source", cfg.data.source)]
    for spec in getattr(getattr(cfg, "rewards", None), "funcs", []):
        if ":" in spec and spec.rpartition(":")[0].endswith(".py"):
            paths.append((f"reward {spec!r}: plugin file", spec.rpartition(":")[0]))
    for what, name in paths:
        path = Path(name).expanduser()
        if path.exists() and not path.is_file() and not path.is_dir():
            raise ValueError(f"{what} {str(path)!r} {not_a_file(path)}")


# ------------------------------------------------------------------------------------------------ resume


def config_changes(cfg: Any) -> list[tuple[str, Any, Any]]:
    """What the checkpoint that ``checkpoint.resume`` picks was trained with, set against ``cfg``: the keys that
    define the run (``fastgrpo.config.runs.RESUMABLE_KEYS`` lists the others) and differ from the config.json of
    that checkpoint's run folder, as (key, saved, now). ValueError naming them, unless
    ``checkpoint.allow_config_change``. Empty when nothing is resumed."""
    path = ckpt.resolve_resume(cfg.checkpoint.resume, cfg.run_dir / "checkpoints")
    saved_file = path.parent.parent / "config.json" if path is not None else None
    if saved_file is None or not saved_file.is_file():
        return []
    saved = _read_config(saved_file)
    check_run_kind(cfg, saved, saved_file)
    changes = run_defining_changes(saved, cfg)
    if changes and not cfg.checkpoint.allow_config_change:
        diff = "; ".join(f"{k}: {old!r} -> {new!r}" for k, old, new in changes)
        raise ValueError(f"checkpoint {str(path)!r} was trained with another config ({diff}): resuming it would "
                         "continue it as a different run. Use another name, or set "
                         "checkpoint.allow_config_change=true to continue it anyway (its config.json is kept as "
                         "config.until_step_<N>.json)")
    return changes


def _read_config(saved_file: Path) -> dict:
    try:
        saved = json.loads(saved_file.read_text(encoding="utf-8"))
    except ValueError:
        saved = None
    if not isinstance(saved, dict):
        raise ValueError(f"{str(saved_file)!r} is not valid JSON (a run's config), so this resume cannot be compared "
                         "with the run it continues; restore it, or delete it to resume without the comparison")
    return saved


def check_run_kind(cfg: Any, saved: dict, saved_file: Path) -> None:
    """ValueError when ``saved`` (the config.json at ``saved_file``) is another kind of run than ``cfg`` (an SFT
    run's folder given to a GRPO run, or the reverse): its checkpoint would be resumed as if it were this run's,
    and only the remaining steps trained. No setting allows it."""
    kind, theirs = type(cfg).run_kind, run_kind_of(saved)
    if kind and theirs and kind != theirs:
        raise ValueError(f"{str(saved_file.parent)!r} holds a {theirs} run (its config.json), and this is a {kind} "
                         f"run: it would resume the other's checkpoint as its own. Use another name or output_dir")


def check_run_folder_kind(cfg: Any) -> None:
    """The run folder's own config.json, when it has one, is of this kind of run (see :func:`check_run_kind`)."""
    saved_file = cfg.run_dir / "config.json"
    if cfg.checkpoint.resume == "never" and cfg.checkpoint.overwrite:  # the run in it is deleted: any kind
        return
    if saved_file.is_file():
        try:
            saved = json.loads(saved_file.read_text(encoding="utf-8"))
        except ValueError:  # config_changes names an unreadable one where it matters (a resume)
            return
        if isinstance(saved, dict):
            check_run_kind(cfg, saved, saved_file)


def keep_config(run: Path, step: int) -> None:
    """Keep the config a run had until ``step`` (config.json, before the run rewrites it), written atomically."""
    old = run / "config.json"
    if old.is_file():
        write_atomic(run / f"config.until_step_{step:06d}.json", old.read_bytes())


# ------------------------------------------------------------------------------------------------ data


def context_length(model_path: str) -> int | None:
    """The positions a model has (``max_position_embeddings``), read from a local folder's config.json without
    loading the model; None for a hub id or a config without the field."""
    cfg_file = Path(model_path) / "config.json"
    if not cfg_file.is_file():
        return None
    cfg = json.loads(cfg_file.read_text(encoding="utf-8"))
    n = cfg.get("text_config", cfg).get("max_position_embeddings")
    return int(n) if n else None


def check_model_files(model_path: str) -> None:
    """A local model folder's safetensors files are whole (each as long as its header says): a copy or download cut
    short is a one-line error naming the file, not a SafetensorError from deep inside the loader."""
    folder = Path(model_path)
    if not folder.is_dir():
        return
    for weights in sorted(folder.glob("*.safetensors")):
        problem = safetensors_problem(weights)
        if problem is not None:
            raise ValueError(f"model.name_or_path: {problem} in {str(folder)!r}: the copy is incomplete; copy or "
                             "download it again")


def check_fits(split: str, index: int, prompt: Any, prompt_tokens: int, completion_tokens: int, completion: str,
               limit: int, fix: str = "", limit_name: str = "") -> None:
    """ValueError naming row ``index`` of ``split`` (and the start of its ``prompt``) when its prompt plus
    ``completion_tokens`` (``completion`` says what they are) exceed ``limit`` positions: the model's
    (max_position_embeddings), or what ``limit_name`` names (e.g. 'rollout.vllm.max_model_len'); ``fix``: a further
    way out, after 'shorten or drop that row'."""
    if prompt_tokens + completion_tokens <= limit:
        return
    what = f"{limit_name}={limit}" if limit_name else f"the model's {limit} (max_position_embeddings)"
    raise ValueError(f"{split} row {index} ({repr(prompt)[:50]}...) needs {prompt_tokens} prompt tokens + "
                     f"{completion_tokens} {completion} = {prompt_tokens + completion_tokens} positions, more than "
                     f"{what}: shorten or drop that row{fix}")


def engine_context(cfg: Any) -> int | None:
    """The rollout engine's own context limit when the config sets one (``rollout.vllm.max_model_len``): every
    prompt plus the completion budget must fit it, checked with the data before any model loads (the engine would
    refuse the first batch only after its start-up)."""
    rollout = cfg.rollout
    return rollout.vllm.max_model_len if rollout.engine == "vllm" else None


def nested_data(source: str) -> contextlib.AbstractContextManager:
    """Data nested deeper than Python's recursion limit (a JSON value of 100k brackets) is a ValueError."""
    return too_deep(f"data.source {source!r}", "flatten it or drop that row", ValueError)


def warn_batch_above_data(what: str, per_rank: int, world_size: int, num_rows: int) -> None:
    """A step that takes more rows than the training split has repeats rows within the step: say so up front
    (rank 0), since such a step can run for minutes before its first output."""
    if per_rank * world_size > num_rows:
        print(f"[fastgrpo] warning: {what}={per_rank}{f' x {world_size} ranks' if world_size > 1 else ''} is more "
              f"than the {num_rows} training rows: every step repeats rows (about "
              f"{per_rank * world_size / max(num_rows, 1):.0f} times each)", flush=True)


def check_async_slots(max_staleness: int, tensors: int, nbytes: int, shm: Path = Path("/dev/shm")) -> None:
    """rollout.asynchronous keeps ``max_staleness`` copies of the trained weights (``tensors`` tensors, ``nbytes``
    bytes) in shared memory, one open file per tensor and copy: ValueError naming rollout.max_staleness when they
    would take more than half of this process's open-file limit or of the free shared memory (the rest is for
    everything else a run opens), instead of 'Too many open files' from the middle of the worker's start."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    files = max_staleness * tensors
    if soft != resource.RLIM_INFINITY and files > soft // 2:
        raise ValueError(f"rollout.max_staleness={max_staleness} keeps {max_staleness} copies of the {tensors} "
                         f"trained tensors in shared memory: {files} open files, more than half of this process's "
                         f"limit of {soft} (ulimit -n); lower rollout.max_staleness (the batches in flight: 1 or 2 "
                         "keeps the worker busy)")
    free = shutil.disk_usage(shm).free if shm.is_dir() else None
    if free is not None and max_staleness * nbytes > free // 2:
        raise ValueError(f"rollout.max_staleness={max_staleness} keeps {max_staleness} copies of the trained weights "
                         f"({nbytes / 2**20:.0f} MiB each) in shared memory, more than half of the "
                         f"{free / 2**30:.1f} GiB free in {shm}; lower rollout.max_staleness")


# ------------------------------------------------------------------------------------------------ lock


LOCK = ".lock"
"""The run folder's lock file: it holds the pid and host of the run that holds the lock."""


class RunLock:
    """An exclusive lock on a run folder (``flock`` on ``<run>/.lock``), so that two runs never write one folder at
    once. :meth:`release` deletes the lock file, and the folders the lock created if they are still empty (a run
    that failed before writing anything leaves nothing); the kernel releases the lock when the process ends,
    however it ends (SIGKILL too), leaving the file."""

    def __init__(self, run: Path) -> None:
        self.run = run
        self.fd: int | None = None
        self.created = [p for p in (run, *run.parents) if not p.exists()]  # deepest first
        run.mkdir(parents=True, exist_ok=True)
        path = run / LOCK
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                os.close(fd)
                if e.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):  # a filesystem without locks
                    print(f"[fastgrpo] warning: cannot lock {path} ({e.strerror}): nothing stops a second run from "
                          "writing this run folder at the same time", flush=True)
                    return
                if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                    raise
                raise ValueError(lock_holder_message(run)) from None
            try:  # the file may have been deleted by its holder's release() between our open and our lock
                if os.stat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()} {socket.gethostname()}\n".encode())
        except OSError as e:
            os.close(fd)
            if not is_disk_full(e):
                raise
            raise DiskFullError(f"no space left on the device while writing {path} (the run folder's lock; nothing "
                                "else was written); free some space and run the same command again") from None
        self.fd = fd

    def release(self) -> None:
        if self.fd is None:
            return
        (self.run / LOCK).unlink(missing_ok=True)  # while still holding it: see the inode check above
        os.close(self.fd)
        self.fd = None
        for folder in self.created:
            try:
                folder.rmdir()
            except OSError:  # not empty: the run wrote something
                break


def lock_holder_message(run: Path) -> str:
    """The error of a run that finds ``run`` locked, naming the holder's pid (and host) from the lock file."""
    try:
        pid, _, host = (run / LOCK).read_text().strip().partition(" ")
    except OSError:
        pid = host = ""
    holder = f"pid {pid}{f' on {host}' if host and host != socket.gethostname() else ''}" if pid else "pid unknown"
    return (f"another run ({holder}) is using the run folder {str(run)!r}; wait for it to end or stop it, or use "
            "another name")
