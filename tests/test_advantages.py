import torch

from fastgrpo.algorithms.advantages import compute_advantages


def test_group_centring_and_scaling():
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 2.0, 2.0, 2.0, 2.0])
    res = compute_advantages(r, 4, scale="group")
    g0 = torch.tensor([1.0, 0.0, 0.0, 0.0])
    expect0 = (g0 - g0.mean()) / (g0.std() + 1e-4)
    assert torch.allclose(res.advantages[:4], expect0)
    assert torch.all(res.advantages[4:] == 0)
    assert res.zero_std_mask.tolist() == [False, True]


def test_no_scaling_is_pure_centring():
    r = torch.randn(12)
    res = compute_advantages(r, 3, scale="none")
    assert torch.allclose(res.advantages.view(4, 3).sum(1), torch.zeros(4), atol=1e-6)
    assert torch.allclose(res.advantages, (r.view(4, 3) - r.view(4, 3).mean(1, keepdim=True)).reshape(-1))


def test_batch_scaling_uses_batch_std():
    r = torch.randn(10)
    res = compute_advantages(r, 5, scale="batch")
    centred = (r.view(2, 5) - r.view(2, 5).mean(1, keepdim=True)).reshape(-1)
    assert torch.allclose(res.advantages, centred / (r.std() + 1e-4))


def test_rejects_ragged_rewards():
    import pytest

    with pytest.raises(ValueError, match="G=4"):
        compute_advantages(torch.zeros(6), 4)


def test_batch_std_is_the_global_batch_std_across_ranks():
    """Two 'ranks' holding halves of the batch get the advantages the whole batch would give."""
    r = torch.randn(16)
    whole = compute_advantages(r, 4, scale="batch").advantages
    halves = [r[:8], r[8:]]

    def all_reduce(t):  # what torch.distributed would return: the elementwise sum over both ranks
        return sum(torch.stack([h.sum(), (h * h).sum(), torch.tensor(8.0)]) for h in halves)

    split = torch.cat([compute_advantages(h, 4, scale="batch", all_reduce=all_reduce).advantages for h in halves])
    assert torch.allclose(split, whole, atol=1e-6)
    local = torch.cat([compute_advantages(h, 4, scale="batch").advantages for h in halves])
    assert not torch.allclose(local, whole, atol=1e-3)  # per-rank std would differ
