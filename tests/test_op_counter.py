"""The op and sync counter of the benchmarks (benchmarks/op_counter.py) counts what a toy function does: a counter
that silently counted nothing would make every 'fewer syncs' claim of benchmarks/count_ops.py empty."""

import torch

from benchmarks.op_counter import OpCounter, optimizer_host_tensors


def _toy(x: torch.Tensor) -> None:
    y = x * 2  # mul
    y.sum().item()  # sum, _local_scalar_dense (sync)
    if y.max() > 0:  # max, gt, _local_scalar_dense (sync)
        pass
    (y > 0).nonzero()  # gt, nonzero (sync)
    x[x > 0]  # gt, index with a bool mask (sync)
    y.tolist()  # no dispatch on a CPU tensor; a host read (sync)
    torch.repeat_interleave(x, torch.tensor([1, 2, 3]), output_size=6)  # lift_fresh, repeat_interleave (no sync)
    y.view(3, 1)  # a view: dispatched, no launch


def test_counts_ops_and_syncs_of_a_toy_function():
    x = torch.tensor([1.0, -2.0, 3.0])
    counter = OpCounter()
    with counter.active():
        _toy(x)
    ops = counter.by_name()
    assert ops == {"mul.Tensor": 1, "sum": 1, "_local_scalar_dense": 2, "max": 1, "gt.Scalar": 3, "nonzero": 1,
                   "index.Tensor": 1, "lift_fresh": 1, "repeat_interleave.Tensor": 1, "index_select": 1,
                   "view": 1}, ops
    assert counter.by_name(kind="syncs") == {"_local_scalar_dense": 2, "nonzero": 1, "index.Tensor[bool mask]": 1,
                                             "tolist": 1}
    # no launch: the view, the two scalar reads, wrapping the host list
    assert counter.total(kind="launches") == counter.total() - 4


def test_repeat_interleave_without_output_size_is_a_sync():
    counter = OpCounter()
    with counter.active():
        torch.repeat_interleave(torch.ones(2), torch.tensor([1, 2]))
    assert counter.by_name(kind="syncs") == {"repeat_interleave.Tensor[no output_size]": 1}


def test_phases_nest_and_sum():
    counter = OpCounter()
    x = torch.ones(3)
    with counter.active():
        x + 1
        with counter.phase("update"):
            x * 2
            with counter.phase("microbatch"):
                x.sum().item()
    assert counter.total() == 4
    assert counter.total("update") == 3
    assert counter.total("update", without=("microbatch",)) == 1
    assert counter.total("microbatch", "syncs") == 1


def test_declared_host_tensors_are_neither_launches_nor_syncs():
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], foreach=False)
    p.grad = torch.ones(4)
    opt.step()  # creates the state
    steps = optimizer_host_tensors(opt)
    assert len(steps) == 1
    counter = OpCounter(host_tensors=steps)
    with counter.active():
        opt.step()  # single-tensor AdamW reads its host step counter with .item()
    assert counter.total(kind="syncs") == 0
    assert counter.total(kind="host_ops") >= 2  # the step's increment and its read
    assert counter.total(kind="launches") > 0
    plain = OpCounter()
    with plain.active():
        opt.step()
    assert plain.by_name(kind="syncs")["_local_scalar_dense"] >= 1


def test_backward_ops_count_in_the_phase_of_their_forward():
    counter = OpCounter()
    x = torch.randn(4, requires_grad=True)
    with counter.active():
        with counter.phase("update"):
            with counter.phase("attention"):
                y = x * 3  # backward: one mul
            loss = y.sum()  # backward: one expand
            loss.backward()
    assert counter.by_name("attention", without=("backward",)) == {"mul.Tensor": 1}
    assert counter.by_name("attention")["mul.Tensor"] == 2
    assert counter.by_name("backward")["mul.Tensor"] == 1
    assert counter.total("backward", without=("attention",)) >= 1  # sum's backward, the gradient's accumulation
