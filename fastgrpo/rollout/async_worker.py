"""Asynchronous rollout (``rollout.asynchronous``): a generation worker process that samples the next steps'
batches while the trainer updates on this one.

The worker is a spawned process (``torch.multiprocessing``, spawn) with its own copy of the policy, the 'hf' engine
and its own torch thread count. It talks to the trainer through two queues and a ring of weight slots:

- **Weights.** ``max_staleness`` slots, each a set of shared-memory tensors shaped like the policy's *trained*
  parameters (a LoRA policy: the adapters only; the frozen base is loaded by the worker from the same files, and a
  fingerprint of it is compared once at start). The trainer copies version ``v`` (the policy after ``v`` training
  steps) into slot ``v % max_staleness``; a request names the version and slot it must sample with, and the worker
  copies the slot into its own parameters before it starts that request. The trainer only overwrites a slot whose
  last reader has already returned its batch (see :class:`AsyncRollout`).
- **Versions.** Every batch comes back with the version it was sampled with and a fingerprint of the weights the
  worker actually held (:func:`weight_fingerprint`: an exact integer sum of the tensors' bit patterns, the same
  whatever the thread count). The trainer compares it with the fingerprint it recorded when it pushed that
  version, and refuses a batch older than ``max_staleness`` steps: a worker that skipped an update is an error,
  never a silently stale batch.
- **Failures.** A worker that exits, raises, or sends nothing within ``rollout.async_timeout_s`` is a
  :class:`RolloutWorkerError` (one line); the trainer's loop saves a checkpoint and stops, and the same command
  resumes. The worker is stopped (terminated, then killed) on every exit path.

Test hook: ``FASTGRPO_ASYNC_FAULT`` in the trainer's environment when the worker starts (the worker reads it) plants
a faulty worker: ``die@B`` (exits on the request for batch B), ``hang@B`` (never answers it), ``stale@V`` (skips
loading version V and reports the version it holds), ``lie@V`` (skips loading version V but reports V).
"""

from __future__ import annotations

import os
import queue
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from fastgrpo.config import HFRolloutConfig, LoraConfig, ModelConfig
from fastgrpo.models.policy_state import clean_param_name
from fastgrpo.rollout.base import Completion, SamplingParams
from fastgrpo.runtime.errors import RunError

__all__ = ["AsyncRollout", "Batch", "RolloutWorkerError", "StaleRolloutError", "split_threads", "trained_parameters",
           "weight_fingerprint"]

FAULT_ENV = "FASTGRPO_ASYNC_FAULT"
STARTUP_S = 300.0
"""The least time the worker's start (imports, model load, first message) is given, whatever the timeout."""


class RolloutWorkerError(RunError):
    """The generation worker died, hung or failed: the run saves a checkpoint and stops (resumable)."""


class StaleRolloutError(RolloutWorkerError):
    """A batch came back older than ``rollout.max_staleness``, or not sampled with the weights it names."""


def cpu_count() -> int:
    """The cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def split_threads(worker_threads: int | None, total: int | None = None) -> tuple[int, int]:
    """(worker, trainer) torch threads: ``worker_threads`` (None: half the cores) for the worker, the rest (at least
    1) for the trainer."""
    total = cpu_count() if total is None else total
    worker = max(1, total // 2) if worker_threads is None else worker_threads
    return worker, max(1, total - worker)


def trained_parameters(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The parameters the optimizer changes (a LoRA policy: the adapters, and modules_to_save): what a weight
    sync sends."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def frozen_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Parameters that do not train, and buffers: loaded by the worker from the files, never sent."""
    return [p for p in model.parameters() if not p.requires_grad] + list(model.buffers())


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@torch.no_grad()
def weight_fingerprint(tensors: list[torch.Tensor]) -> int:
    """An exact fingerprint of the tensors' values: per tensor, the integer sum of its elements' bit patterns
    (order-independent, so the same for any thread count), mixed with the tensor's position. Any changed element
    changes it (barring an exact cancellation)."""
    total = 0
    for i, t in enumerate(tensors):
        t = t.detach()
        bits = t.contiguous().view(_INT_VIEW[t.element_size()]) if t.is_floating_point() else t
        total = (total * 1_000_003 + int(bits.sum(dtype=torch.int64)) + i) % (1 << 61)  # no int64 copy
    return total


@dataclass(kw_only=True)
class WorkerSpec:
    """What the worker builds its copy of the policy from."""

    model: ModelConfig
    """name_or_path: the resolved local folder."""
    lora: LoraConfig | None
    """The policy's adapters (None: a full fine-tune)."""
    hf: HFRolloutConfig
    seed: int
    threads: int
    names: list[str]
    """The trained parameters' names, in the order of the slots' tensors."""
    fault: str = ""


@dataclass(kw_only=True)
class Request:
    batch: int
    version: int
    slot: int
    prompts: list[list[int]]
    n: int
    sampling: SamplingParams


@dataclass(kw_only=True)
class Batch:
    """One step's generation on the worker: what was asked (the prompts' row indices, the seed), the version it
    was asked for, and, once back, the completions and the fingerprint of the weights it was sampled with."""

    batch: int
    """The training step (0-based) this batch is for."""
    indices: list[int]
    """The prompts' training rows."""
    seed: int
    version: int
    """The weights (training steps done) it was requested with; once back, the ones it says it sampled with."""
    completions: list[list[Completion]] | None = None
    fingerprint: int | None = None
    generate_s: float = 0.0
    restored: bool = False
    """Taken from a checkpoint (received and checked by the run that saved it)."""

    def state(self) -> dict[str, Any]:
        """A checkpoint's record (plain data)."""
        comps = None if self.completions is None else [[vars(c) for c in g] for g in self.completions]
        return {"batch": self.batch, "indices": list(self.indices), "seed": self.seed, "version": self.version,
                "completions": comps, "fingerprint": self.fingerprint, "generate_s": self.generate_s}

    @classmethod
    def from_state(cls, d: dict[str, Any]) -> "Batch":
        comps = None if d["completions"] is None else [[Completion(**c) for c in g] for g in d["completions"]]
        return cls(batch=d["batch"], indices=list(d["indices"]), seed=d["seed"], version=d["version"],
                   completions=comps, fingerprint=d["fingerprint"], generate_s=d.get("generate_s", 0.0),
                   restored=comps is not None)


def _fault(spec: WorkerSpec, kind: str) -> int | None:
    """The batch or version a planted fault of ``kind`` applies to (the test hook of the module docstring)."""
    name, _, at = spec.fault.partition("@")
    return int(at) if name == kind and at else None


def _worker_main(spec: WorkerSpec, slots: list[list[torch.Tensor]], requests, results) -> None:
    """The worker process: build the policy copy and the engine, then serve requests in order until None."""
    # SIGTERM and Ctrl-C reach the whole process group: the trainer handles them (it saves, then stops this worker)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    try:
        torch.set_num_threads(spec.threads)
        from fastgrpo.models.loading import load_model, load_tokenizer
        from fastgrpo.models.lora import apply_lora
        from fastgrpo.rollout.hf import HFEngine

        torch.manual_seed(spec.seed)
        model = load_model(spec.model, device="cpu", seed=spec.seed)
        if spec.lora is not None:
            model = apply_lora(model, spec.lora)
        model.requires_grad_(False)
        named = dict(model.named_parameters())
        missing = [n for n in spec.names if n not in named]
        if missing:
            raise RuntimeError(f"the worker's policy has no parameter {missing[0]!r}")
        params = [named[n] for n in spec.names]
        trained = set(spec.names)
        frozen = [p for n, p in model.named_parameters() if n not in trained] + list(model.buffers())
        engine = HFEngine(model, load_tokenizer(spec.model, seed=spec.seed), spec.hf)
        results.put(("ready", weight_fingerprint(frozen)))
        version = None
        while True:
            try:
                req = requests.get(timeout=2.0)
            except queue.Empty:
                if os.getppid() != parent:  # the trainer was killed (SIGKILL): nobody will stop this worker
                    return
                continue
            if req is None:
                return
            if _fault(spec, "die") == req.batch:
                os._exit(3)
            if _fault(spec, "hang") == req.batch:
                time.sleep(1e9)
            reported = req.version
            if req.version != version:
                if req.version in (_fault(spec, "stale"), _fault(spec, "lie")):
                    reported = version if _fault(spec, "stale") is not None else req.version  # planted faults
                else:
                    with torch.no_grad():
                        torch._foreach_copy_(params, slots[req.slot])
                    version = req.version
            fingerprint = weight_fingerprint(params)
            start = time.perf_counter()
            comps = engine.generate(req.prompts, req.n, req.sampling)
            results.put(("batch", req.batch, reported, fingerprint, comps, time.perf_counter() - start))
    except BaseException:  # noqa: BLE001 (reported to the trainer, which stops the run)
        results.put(("error", traceback.format_exc()))


class AsyncRollout:
    """The trainer's side: starts the worker, pushes weight versions, sends requests, receives and checks batches.

    Slots: version v lives in slot ``v % max_staleness``. The trainer pushes version k at the start of step k,
    after it took batch k, and requests batch ``k + max_staleness`` with it; the slot's previous version,
    ``k - max_staleness``, was last read for batch k, which is back. So no slot is overwritten while a request
    that needs it is still waiting.
    """

    def __init__(self, model: nn.Module, *, model_cfg: ModelConfig, lora: LoraConfig | None, hf: HFRolloutConfig,
                 seed: int, threads: int, max_staleness: int, timeout_s: float) -> None:
        import torch.multiprocessing as mp

        self.max_staleness, self.timeout_s = max_staleness, timeout_s
        named = trained_parameters(model)
        self.names = [clean_param_name(n) for n, _ in named]
        self.slots = [[torch.empty_like(p.detach(), device="cpu").share_memory_() for _, p in named]
                      for _ in range(max_staleness)]
        self.pushed: set[int] = set()
        """Versions in the slots (version v in slot ``v % max_staleness``)."""
        self.fingerprints: dict[int, int] = {}
        """Every version pushed -> its weights' fingerprint."""
        self.in_flight: list[Batch] = []
        """Requested batches in step order; the received ones carry their completions."""
        self._frozen = weight_fingerprint(frozen_tensors(model))
        self._ready = False
        ctx = mp.get_context("spawn")
        self.requests, self.results = ctx.Queue(), ctx.Queue()
        spec = WorkerSpec(model=model_cfg, lora=lora, hf=hf, seed=seed, threads=threads, names=self.names,
                          fault=os.environ.get(FAULT_ENV, ""))
        self.process = ctx.Process(target=_worker_main, args=(spec, self.slots, self.requests, self.results),
                                   name="fastgrpo-rollout", daemon=True)
        self.process.start()

    @property
    def sync_bytes(self) -> int:
        """Bytes one weight push copies."""
        return sum(t.numel() * t.element_size() for t in self.slots[0])

    # -- trainer side --------------------------------------------------------------------------------------------

    def push(self, model: nn.Module, version: int) -> None:
        """Copy the policy's trained parameters into version ``version``'s slot (a no-op if already there)."""
        if version in self.pushed:
            return
        slot = version % self.max_staleness
        params = [p.detach() for _, p in trained_parameters(model)]
        with torch.no_grad():
            torch._foreach_copy_(self.slots[slot], params)
        self.pushed = {v for v in self.pushed if v % self.max_staleness != slot} | {version}
        self.fingerprints[version] = weight_fingerprint(params)

    def submit(self, batch: Batch, prompts: list[list[int]], n: int, sampling: SamplingParams) -> None:
        """Ask for ``batch`` with its version's weights (pushed before)."""
        if batch.version not in self.pushed:
            raise RuntimeError(f"async rollout: version {batch.version} was not pushed")
        self.in_flight.append(batch)
        self.requests.put(Request(batch=batch.batch, version=batch.version, slot=batch.version % self.max_staleness,
                                  prompts=prompts, n=n, sampling=sampling))

    def restore(self, batch: Batch) -> None:
        """A batch received by an earlier run (from its checkpoint): taken as if it had come back."""
        self.in_flight.append(batch)

    def take(self, step: int) -> Batch:
        """Batch ``step``, waiting for it; checked: the version it sampled with is at most max_staleness steps old,
        and its weights are that version's."""
        if not self.in_flight or self.in_flight[0].batch != step:
            have = [b.batch for b in self.in_flight]
            raise RuntimeError(f"async rollout: the batch of step {step + 1} was never requested (in flight: {have})")
        while self.in_flight[0].completions is None:
            self._receive(f"the batch of step {step + 1}")
        batch = self.in_flight[0]
        try:
            self._check_staleness(step, batch.version)
        except StaleRolloutError:
            batch.completions = None  # never trained on: a checkpoint saves it as lost
            raise
        return self.in_flight.pop(0)

    def _check_staleness(self, step: int, version: int) -> None:
        staleness = step - version
        if staleness > self.max_staleness or staleness < 0:
            self.close()
            raise StaleRolloutError(
                f"async rollout: the batch of step {step + 1} was sampled with the weights of step {version} "
                f"({staleness} steps old), rollout.max_staleness is {self.max_staleness}: the worker missed a weight "
                "update")

    def put_back(self, batch: Batch) -> None:
        """A taken batch that was not trained on (its step was dropped): first in line again."""
        self.in_flight.insert(0, batch)

    def drain(self) -> None:
        """Wait until every requested batch is back (a checkpoint saves them)."""
        while any(b.completions is None for b in self.in_flight):
            pending = next(b for b in self.in_flight if b.completions is None)
            self._receive(f"the batch of step {pending.batch + 1}")

    def checkpoint_state(self, *, wait: bool) -> list[dict[str, Any]]:
        """The batches in flight for a checkpoint; ``wait``: first receive the ones still generating (else they
        are saved as lost: a resume generates them again, from its own weights)."""
        if wait:
            self.drain()
        return [b.state() for b in self.in_flight]

    def _receive(self, what: str) -> None:
        """One message from the worker, within the timeout; a dead or silent worker is a RolloutWorkerError."""
        # the worker's start (imports, model load) may take longer than one batch: at least STARTUP_S for it
        timeout = self.timeout_s if self._ready else max(self.timeout_s, STARTUP_S)
        deadline = time.monotonic() + timeout
        while True:
            try:
                msg = self.results.get(timeout=min(1.0, max(0.01, deadline - time.monotonic())))
                break
            except queue.Empty:
                pass
            if not self.process.is_alive():
                try:  # it may have sent its error just before exiting
                    msg = self.results.get(timeout=1.0)
                    break
                except queue.Empty:
                    pid, code = self.process.pid, self.process.exitcode
                    self.close()
                    raise RolloutWorkerError(f"the rollout worker (pid {pid}) exited with code {code} "
                                             f"while generating {what}") from None
            if time.monotonic() > deadline:
                self.close()
                raise RolloutWorkerError(f"the rollout worker sent nothing for {timeout:g} s while generating "
                                         f"{what} (rollout.async_timeout_s): stopped it") from None
        kind = msg[0]
        if kind == "error":
            self.close()
            last = [line for line in msg[1].strip().splitlines() if line.strip()][-1]
            raise RolloutWorkerError(f"the rollout worker failed while generating {what}: {last}")
        if kind == "ready":
            if msg[1] != self._frozen:
                self.close()
                raise RolloutWorkerError("the rollout worker's frozen weights differ from the policy's (it loads them "
                                         "from model.name_or_path)")
            self._ready = True
            return
        _, batch_index, version, fingerprint, comps, seconds = msg
        batch = next((b for b in self.in_flight if b.batch == batch_index and b.completions is None), None)
        if batch is None:
            raise RuntimeError(f"async rollout: got a batch for step {batch_index + 1}, which was not asked for")
        self._check_staleness(batch_index, version)
        if self.fingerprints.get(version) != fingerprint:
            self.close()
            raise StaleRolloutError(f"async rollout: the batch of step {batch_index + 1} says it was sampled with the "
                                    f"weights of step {version}, but the worker's weights were not those")
        batch.version, batch.fingerprint, batch.completions, batch.generate_s = version, fingerprint, comps, seconds

    def close(self) -> None:
        """Stop the worker (asked, then terminated, then killed) and release the queues. Idempotent."""
        process = getattr(self, "process", None)
        if process is None:
            return
        if process.is_alive():
            try:
                self.requests.put(None)
            except (OSError, ValueError):
                pass
            process.join(timeout=2.0)
        if process.is_alive():
            process.terminate()
            process.join(timeout=2.0)
        if process.is_alive():
            process.kill()
            process.join(timeout=2.0)
        for q in (self.requests, self.results):
            q.cancel_join_thread()
            q.close()
        self.process = None
