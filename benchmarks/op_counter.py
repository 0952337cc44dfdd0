"""Counting dispatched aten ops (a proxy for GPU kernel launches) and host syncs, per named phase.

``OpCounter`` is a ``TorchDispatchMode`` (every aten op that reaches the Python dispatch key: forward, backward and
optimizer ops alike; ops that a composite op runs inside itself are not seen, as they are not separate calls)
paired with a ``TorchFunctionMode`` (for the host reads that dispatch nothing on a CPU tensor). Ops are counted
under the phases open when they run (``with counter.phase("update"): ...``); queries sum over nested phases.
Backward ops are counted under the phases open when ``backward()`` runs, plus ``"backward"``, plus the phases
their autograd node was created in: the backward of an op run inside ``phase("attention")`` counts as attention.

What counts as a host sync: an op that makes the host wait for the device on CUDA, because its result is a Python
value or its output size depends on the data:

- ``_local_scalar_dense``: ``.item()``, ``bool()`` / ``int()`` / ``float()`` of a tensor, Python ``if tensor``;
- ``equal`` (returns a Python bool);
- ``nonzero``, ``masked_select``, ``unique`` (all variants), ``bincount``: output size read back;
- ``index`` / ``index_put_`` with a boolean mask (``x[mask]``, ``x[mask] = v``): a ``nonzero`` inside;
- ``repeat_interleave`` with tensor repeats and no ``output_size``: the total is read back;
- ``.tolist()`` and ``.numpy()`` (function level: on a CPU tensor they dispatch nothing);
- on a CUDA run, a copy from the device to the host (``_to_copy`` / ``copy_``).

On a CPU run the CPU stands in for the device (``cpu_is_device=True``): every tensor is treated as if it lived on
the GPU, so the count is an upper bound; tensors that stay on the host in a GPU run too are declared with
``host_tensors`` (e.g. the optimizer's step counters, :func:`optimizer_host_tensors`), and ops on them only are
counted as host ops, not as launches or syncs. ``.cpu()`` / ``.to("cpu")`` alone are not counted on the CPU (the
read that follows is). Views (ops whose output aliases an input: ``view``, ``t``, ``slice``, ``detach``...) are
dispatched but launch nothing; ``launches`` leaves them out, ``ops`` counts every dispatched op.
"""

from __future__ import annotations

import contextlib
import os
import traceback
from collections import Counter
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

_ALWAYS_SYNC = {aten._local_scalar_dense.default, aten.equal.default, aten.masked_select.default,
                aten.bincount.default, aten._unique.default, aten._unique2.default, aten.unique_dim.default,
                aten.unique_consecutive.default, aten.nonzero.default}
_MASK_INDEX = {aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default}
_REPEAT = {aten.repeat_interleave.Tensor, aten.repeat_interleave.self_Tensor}
_COPIES = {aten._to_copy.default, aten.copy_.default}
_NO_LAUNCH = {aten.empty.memory_format, aten.empty_strided.default, aten.lift_fresh.default,
              aten._local_scalar_dense.default}
"""Dispatched ops that launch no kernel besides views: allocations, wrapping a new host tensor, the scalar read
(its copy is the sync, counted apart)."""

ROOT = "all"
_PHASES_KEY = "op_counter_phases"


def _name(func) -> str:
    return func.name().removeprefix("aten::")


def _is_mask(t: Any) -> bool:
    return isinstance(t, torch.Tensor) and t.dtype in (torch.bool, torch.uint8)


class OpCounter(TorchDispatchMode):
    """Counts dispatched ops, launches and host syncs by op name and phase. Use ``with counter.active():``."""

    def __init__(self, *, cpu_is_device: bool = True, host_tensors: Iterable[torch.Tensor] = ()) -> None:
        super().__init__()
        self.cpu_is_device = cpu_is_device
        self._host: dict[int, torch.Tensor] = {}  # id -> tensor (kept alive so that its id is not reused)
        self.declare_host(host_tensors)
        self._path: tuple[str, ...] = (ROOT,)
        self._paused = False
        self.ops: dict[tuple[str, ...], Counter] = {}  # phase path -> op name -> dispatched calls
        self.launches: dict[tuple[str, ...], Counter] = {}  # ... -> calls that launch a kernel on the device
        self.host_ops: dict[tuple[str, ...], Counter] = {}  # ... -> calls on declared host tensors only
        self.syncs: dict[tuple[str, ...], Counter] = {}  # ... -> host syncs
        self.sync_sites: dict[tuple[str, ...], Counter] = {}  # ... -> "op at file:line (function)"

    def declare_host(self, tensors: Iterable[torch.Tensor]) -> None:
        """Tensors that live on the host in a GPU run too: ops on them alone are host ops, never syncs."""
        self._host.update({id(t): t for t in tensors})

    # -- phases -------------------------------------------------------------------------------------------------

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Count what runs inside under ``name`` (nested in the phases already open)."""
        self.enter(name)
        try:
            yield
        finally:
            self.leave(name)

    def enter(self, name: str) -> None:
        self._path = (*self._path, name)

    def leave(self, name: str) -> None:
        if self._path[-1] != name:
            raise RuntimeError(f"leaving phase {name!r} but the innermost open phase is {self._path[-1]!r}")
        self._path = self._path[:-1]

    def current(self) -> str:
        return self._path[-1]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Count nothing inside (the measuring code's own reads)."""
        was, self._paused = self._paused, True
        try:
            yield
        finally:
            self._paused = was

    @contextlib.contextmanager
    def active(self) -> Iterator["OpCounter"]:
        """Count while inside (the dispatch mode and the function mode for ``.tolist()`` / ``.numpy()``)."""
        with _FunctionLevel(self), self:
            yield self

    # -- queries ------------------------------------------------------------------------------------------------

    def total(self, phase: str = ROOT, kind: str = "ops", *, without: tuple[str, ...] = ()) -> int:
        """Calls of ``kind`` (ops, launches, host_ops, syncs) inside ``phase``, less those inside ``without``."""
        return sum(self.by_name(phase, kind, without=without).values())

    def by_name(self, phase: str = ROOT, kind: str = "ops", *, without: tuple[str, ...] = ()) -> Counter:
        out: Counter = Counter()
        for path, c in getattr(self, kind).items():
            if phase in path and not any(w in path for w in without):
                out.update(c)
        return out

    # -- counting -----------------------------------------------------------------------------------------------

    def _count(self, store: dict, name: str) -> None:
        path = self._path
        node = torch._C._current_autograd_node()  # set while the autograd engine runs a backward node
        if node is not None:
            made_in = node.metadata.get(_PHASES_KEY, ())
            path = (*path, "backward", *(p for p in made_in if p not in path))
        c = store.get(path)
        if c is None:
            c = store[path] = Counter()
        c[name] += 1

    def tag(self, out: Any) -> None:
        """Remember the open phases on the autograd nodes of ``out`` (their backward counts there too)."""
        if len(self._path) > 1 and not self._paused:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                    t.grad_fn.metadata[_PHASES_KEY] = self._path

    def _on_device(self, t: torch.Tensor) -> bool:
        if id(t) in self._host:
            return False
        return t.device.type != "cpu" or self.cpu_is_device

    def _count_sync(self, what: str) -> None:
        self._count(self.syncs, what)
        self._count(self.sync_sites, f"{what} at {_caller()}")

    def count_host_read(self, t: torch.Tensor, what: str) -> None:
        if not self._paused and self._on_device(t):
            self._count_sync(what)

    def _sync_kind(self, func, args, kwargs) -> str | None:
        if func in _ALWAYS_SYNC:
            return _name(func)
        if func in _MASK_INDEX and any(_is_mask(i) for i in (args[1] if len(args) > 1 else ())):
            return _name(func) + "[bool mask]"
        if func in _REPEAT and kwargs.get("output_size") is None:
            return _name(func) + "[no output_size]"
        if func in _COPIES and not self.cpu_is_device:  # device -> host copies of a GPU run
            src = args[1] if func is aten.copy_.default else args[0]
            dst_cpu = (args[0].device.type == "cpu" if func is aten.copy_.default
                       else torch.device(kwargs.get("device") or src.device).type == "cpu")
            if src.device.type != "cpu" and dst_cpu:
                return _name(func) + "[device to host]"
        return None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self._paused:
            return func(*args, **kwargs)
        name = _name(func)
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self._count(self.ops, name)
        device = [t for t in tensors if self._on_device(t)]
        if tensors and not device:
            self._count(self.host_ops, name)
        else:
            if not (func.is_view or func in _NO_LAUNCH):
                self._count(self.launches, name)
            kind = self._sync_kind(func, args, kwargs)
            if kind is not None:
                self._count_sync(kind)
        return func(*args, **kwargs)


_SKIP_FRAMES = (f"{os.sep}torch{os.sep}", __file__, "contextlib.py")


def _caller() -> str:
    """The innermost frame outside torch and this file: where a sync was asked for."""
    for frame in reversed(traceback.extract_stack()):
        if not any(s in frame.filename for s in _SKIP_FRAMES):
            parts = Path(frame.filename).parts
            return f"{'/'.join(parts[-2:])}:{frame.lineno} ({frame.name})"
    return "?"


class _FunctionLevel(TorchFunctionMode):
    """``.tolist()`` / ``.numpy()``: host reads that dispatch nothing on a CPU tensor (on CUDA the copy is seen);
    and the phases of the autograd nodes each call creates."""

    _READS = {torch.Tensor.tolist: "tolist", torch.Tensor.numpy: "numpy"}

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        what = self._READS.get(func)
        if what is not None and args and isinstance(args[0], torch.Tensor) and args[0].device.type == "cpu":
            self.counter.count_host_read(args[0], what)
        out = func(*args, **(kwargs or {}))
        self.counter.tag(out)
        return out


def optimizer_host_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The optimizer state that torch keeps on the host even when the parameters are on a GPU: Adam's (and
    others') ``step`` counters, unless the optimizer is fused or capturable (then they follow the parameters).
    Call after a first step (the state is created lazily)."""
    out = []
    for group in optimizer.param_groups:
        if group.get("fused") or group.get("capturable"):
            continue
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device.type == "cpu":
                out.append(step)
    return out
