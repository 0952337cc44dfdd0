"""Checkpoints: sharded, atomic save and resume with torch.distributed.checkpoint (DCP); Hugging Face export.

Layout of a run folder::

    runs/<name>/checkpoints/step_000010/      a complete checkpoint (only complete ones carry this name)
        model_optim/                          DCP: model + optimizer, sharded, reshardable on load
        critic_model_optim/                   PPO: the critic and its optimizer, the same way (one per extra model)
        trainer_state.pt                      step, schedulers, data sampler (rank 0)
        rng_rank{r}.pt                        each rank's RNG state
    runs/<name>/checkpoints/.tmp_step_000010/ a save in progress; never read, removed on the next save
    runs/<name>/final/                        Hugging Face export (safetensors, config, tokenizer); with LoRA a
                                              peft adapter folder (PeftModel.from_pretrained(base, final))
    runs/<name>/final_merged/                 with LoRA and checkpoint.export_merged: adapters merged into the base

With LoRA (``fastgrpo.models.lora``) checkpoints hold the adapters and their optimizer state only: the frozen base is
reloaded from model.name_or_path on resume (``StateDictOptions(ignore_frozen_params=True)``).

Atomicity: everything is written under a temporary name and renamed once every rank has finished (rename is atomic
on POSIX filesystems), so a run killed at any instant leaves either the previous checkpoint or the new one, never a
half-written one. Resuming on a different world size works: DCP reshards the model and optimizer; RNG states of
ranks that did not exist before are left as seeded.
"""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from fastgrpo.runtime.errors import DiskFullError, is_disk_full
from fastgrpo.models.policy_state import clean_param_name, is_lora, iter_policy_tensors

_STEP_RE = re.compile(r"^step_(\d{6,})$")


def _rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(ckpt_dir: Path) -> list[tuple[int, Path]]:
    """Complete checkpoints as (step, path), oldest first."""
    if not ckpt_dir.is_dir():
        return []
    found = []
    for p in ckpt_dir.iterdir():
        m = _STEP_RE.match(p.name)
        if m and p.is_dir():
            found.append((int(m.group(1)), p))
    return sorted(found)


def rng_state() -> dict[str, Any]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _disk_full(what: str, path: Path, intact: str) -> DiskFullError:
    usage = shutil.disk_usage(path.parent if not path.exists() else path)
    return DiskFullError(f"no space left on the device while writing {what} to {path} "
                         f"({usage.free / 2**20:.0f} MiB free); {intact}. Free some space (or point output_dir "
                         "elsewhere) and run the same command again")
def _options(model: torch.nn.Module, **kwargs: Any) -> StateDictOptions:
    """State-dict options: a LoRA model's frozen base is not part of its checkpoints or adapter export."""
    return StateDictOptions(ignore_frozen_params=is_lora(model), **kwargs)


def _state_dicts(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """(model, optimizer) state dicts to save or load into; a LoRA model's hold its adapters only.

    ``ignore_frozen_params`` drops the frozen base, but a tied lm_head comes back under its second name (torch
    2.13), so the model's dict is also cut to the trainable parameters' names."""
    model_sd, optim_sd = get_state_dict(model, optimizer, options=_options(model))
    if is_lora(model):
        keep = {clean_param_name(n) for n, p in model.named_parameters() if p.requires_grad}
        model_sd = {k: v for k, v in model_sd.items() if k in keep}
    return model_sd, optim_sd


Extra = tuple[torch.nn.Module, torch.optim.Optimizer, Any]
"""A further model saved and restored with the policy (PPO's critic): (model, optimizer, LR scheduler)."""


def save_checkpoint(ckpt_dir: Path, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    trainer_state: dict[str, Any], keep_last: int, extras: dict[str, Extra] | None = None) -> Path:
    """Save atomically as ``ckpt_dir/step_{step}``; keep the newest ``keep_last``. Collective: call on every rank.

    ``extras``: name -> (model, optimizer, scheduler) of further models, each in its own ``<name>_model_optim``
    folder (its scheduler in the trainer state), inside the same atomic rename.
    A full disk is a DiskFullError (the half-written save is removed; earlier checkpoints are intact).
    """
    try:
        return _save_checkpoint(ckpt_dir, step, model=model, optimizer=optimizer, trainer_state=trainer_state,
                                keep_last=keep_last, extras=extras or {})
    except BaseException as e:  # torch's CheckpointException (what a failed DCP write raises) is a BaseException
        if isinstance(e, (KeyboardInterrupt, SystemExit)) or not is_disk_full(e):
            raise
        shutil.rmtree(ckpt_dir / f".tmp_step_{step:06d}", ignore_errors=True)
        found = list_checkpoints(ckpt_dir)
        intact = f"the checkpoint of step {found[-1][0]} is intact" if found else "no checkpoint was written"
        raise _disk_full(f"the checkpoint of step {step}", ckpt_dir, intact) from None


def _save_checkpoint(ckpt_dir: Path, step: int, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                     trainer_state: dict[str, Any], keep_last: int, extras: dict[str, Extra]) -> Path:
    final = ckpt_dir / f"step_{step:06d}"
    tmp = ckpt_dir / f".tmp_step_{step:06d}"
    if _rank() == 0:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # a save that a killed run left half-written
        tmp.mkdir()
    _barrier()
    model_sd, optim_sd = _state_dicts(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=str(tmp / "model_optim"))
    for name, (m, opt, _) in extras.items():
        m_sd, o_sd = _state_dicts(m, opt)
        dcp.save({"model": m_sd, "optim": o_sd}, checkpoint_id=str(tmp / f"{name}_model_optim"))
    torch.save(rng_state(), tmp / f"rng_rank{_rank()}.pt")
    if _rank() == 0:
        schedulers = {name: sched.state_dict() for name, (_, _, sched) in extras.items()}
        torch.save({**trainer_state, **({"extra_schedulers": schedulers} if extras else {})},
                   tmp / "trainer_state.pt")
    _barrier()
    if _rank() == 0:
        for f in tmp.rglob("*"):
            if f.is_file():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        if final.exists():  # re-saving a step (resumed from it): move the old copy aside first, so that a kill
            aside = ckpt_dir / f".old_step_{step:06d}"  # between the two renames still leaves a checkpoint
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside, ignore_errors=True)
        else:
            os.replace(tmp, final)
        _fsync_dir(ckpt_dir)
        _prune(ckpt_dir, step, keep_last)
    _barrier()
    return final


def _prune(ckpt_dir: Path, step: int, keep_last: int) -> None:
    """Keep ``step`` and the newest ``keep_last - 1`` before it; drop leftovers of killed saves.

    Checkpoints *after* ``step`` belong to a run that was resumed from an earlier checkpoint: they are another
    history, and ``resume: auto`` must not pick them up, so they go too.
    """
    found = list_checkpoints(ckpt_dir)
    older = [p for s, p in found if s < step]
    for s, p in found:
        if s > step:
            print(f"[fastgrpo] removing {p.name}: this run continued from an earlier checkpoint", flush=True)
            shutil.rmtree(p, ignore_errors=True)
    for p in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(p, ignore_errors=True)
    for p in ckpt_dir.glob(".tmp_step_*"):
        if p.name != f".tmp_step_{step:06d}":
            shutil.rmtree(p, ignore_errors=True)


def resolve_resume(resume: str, ckpt_dir: Path) -> Path | None:
    """'auto' -> newest complete checkpoint (or None); 'never' -> None; otherwise an explicit checkpoint folder."""
    if resume == "never":
        return None
    if resume == "auto":
        found = list_checkpoints(ckpt_dir)
        return found[-1][1] if found else None
    path = Path(resume)
    if not (path / "trainer_state.pt").is_file():
        raise ValueError(f"checkpoint.resume: {resume!r} is not a checkpoint folder (no trainer_state.pt)")
    return path


def check_same_model(path: Path, model_sd: dict[str, Any], folder: str = "model_optim") -> None:
    """ValueError naming the first difference when the checkpoint at ``path`` holds another model's weights
    (another size or architecture): read from DCP's metadata (of its ``folder``), before any tensor is loaded."""
    saved = {k[len("model."):]: getattr(v, "size", None)
             for k, v in dcp.FileSystemReader(str(path / folder)).read_metadata().state_dict_metadata.items()
             if k.startswith("model.")}
    here = {k: tuple(v.shape) for k, v in model_sd.items()}
    hint = "; resume it with the model it was trained from, or use another run name"
    for k, shape in here.items():
        if k not in saved:
            raise ValueError(f"checkpoint {path} holds another model: it has no {k!r}{hint}")
        if saved[k] is not None and tuple(saved[k]) != shape:
            raise ValueError(f"checkpoint {path} holds another model: {k} is {list(saved[k])} there and "
                             f"{list(shape)} here{hint}")
    extra = sorted(set(saved) - set(here))
    if extra:
        raise ValueError(f"checkpoint {path} holds another model: it has {extra[0]!r}, which this model lacks{hint}")


def _load_model_optim(path: Path, folder: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model_sd, optim_sd = _state_dicts(model, optimizer)
    check_same_model(path, model_sd, folder)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(path / folder))
    # How the optimizer steps (foreach / fused) is this run's choice (optim.implementation may change on resume),
    # but loading a state dict copies the saving run's param-group flags over it
    flags = [{k: g[k] for k in _IMPL_FLAGS if k in g} for g in optimizer.param_groups]
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                   options=_options(model, strict=not is_lora(model)))
    for group, own in zip(optimizer.param_groups, flags):
        group.update(own)
        # fused and capturable steps keep each step count on the parameter's device, the others on the host
        on_device = bool(group.get("fused") or group.get("capturable"))
        for p in group["params"]:
            st = optimizer.state.get(p, {})
            if torch.is_tensor(st.get("step")):
                st["step"] = st["step"].to(device=p.device if on_device else "cpu", dtype=torch.float32)


_IMPL_FLAGS = ("foreach", "fused", "capturable")


def load_checkpoint(path: Path, *, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    extras: dict[str, Extra] | None = None) -> dict[str, Any]:
    """Restore model, optimizer, the ``extras`` (as saved by :func:`save_checkpoint`: models, optimizers and
    schedulers) and this rank's RNG in place; return the trainer state (step, scheduler, data)."""
    trainer_state = torch.load(path / "trainer_state.pt", weights_only=False)
    for name in extras or {}:
        if not (path / f"{name}_model_optim").is_dir() or name not in trainer_state.get("extra_schedulers", {}):
            raise ValueError(f"checkpoint {path} has no {name} (it was saved by a run without one); resume it with "
                             "the config it was trained with, or use another run name")
    _load_model_optim(path, "model_optim", model, optimizer)
    for name, (m, opt, sched) in (extras or {}).items():
        _load_model_optim(path, f"{name}_model_optim", m, opt)
        sched.load_state_dict(trainer_state["extra_schedulers"][name])
    rng_file = path / f"rng_rank{_rank()}.pt"
    if rng_file.is_file():
        set_rng_state(torch.load(rng_file, weights_only=False))
    return trainer_state


def export_hf(out_dir: Path, *, model: torch.nn.Module, tokenizer: Any) -> Path | None:
    """Write a Hugging Face folder (safetensors, config, tokenizer) that from_pretrained and vLLM load.

    Gathers the full (unsharded) state dict onto rank 0's CPU; written under a temporary name and renamed. A LoRA
    model writes a peft adapter folder instead (adapter_config.json, adapter_model.safetensors, tokenizer), which
    ``PeftModel.from_pretrained(base, out_dir)`` loads; :func:`export_merged` writes the merged model.
    """
    full_sd = get_model_state_dict(model, options=_options(model, full_state_dict=True, cpu_offload=True))
    return _write_folder(out_dir, lambda tmp: model.save_pretrained(tmp, state_dict=full_sd, safe_serialization=True),
                         tokenizer)


def export_merged(out_dir: Path, *, model: torch.nn.Module, tokenizer: Any) -> Path | None:
    """Write a LoRA model as a plain Hugging Face folder with the adapters merged into the base weights.

    The merged weights stream one layer at a time (``policy_state.iter_policy_tensors``, a collective under FSDP)
    onto rank 0's CPU; the policy's own weights are not touched."""

    if not is_lora(model):
        raise ValueError("checkpoint.export_merged needs a LoRA model (model.lora.rank > 0)")
    merged = {}
    for name, t in iter_policy_tensors(model):  # every rank iterates (collective); rank 0 keeps a CPU copy
        if _rank() == 0:
            merged[name] = t.detach().to("cpu", copy=True)
    base = model.get_base_model()  # the *ForCausalLM under peft's wrapper: its config and save logic
    return _write_folder(out_dir, lambda tmp: base.save_pretrained(tmp, state_dict=merged, safe_serialization=True),
                         tokenizer)


def _write_folder(out_dir: Path, write: Any, tokenizer: Any) -> Path | None:
    """Rank 0 writes ``out_dir`` under a temporary name (``write(tmp)`` + the tokenizer), then renames it."""
    if _rank() == 0:
        tmp = out_dir.with_name(f".tmp_{out_dir.name}")
        if tmp.exists():
            shutil.rmtree(tmp)
        try:
            write(tmp)
            tokenizer.save_pretrained(tmp)
        except Exception as e:
            if not is_disk_full(e):
                raise
            shutil.rmtree(tmp, ignore_errors=True)
            raise _disk_full("the Hugging Face export", out_dir, "the checkpoints are intact; rerunning writes "
                             "the export") from None
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    _barrier()
    return out_dir if _rank() == 0 else None
