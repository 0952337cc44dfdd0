"""Checkpoint folder bookkeeping: atomic names, pruning, leftovers of killed saves."""

import torch

from fastgrpo.distributed.checkpoint import list_checkpoints, load_checkpoint, resolve_resume, save_checkpoint


def _save(tmp_path, step, keep_last=2, value=0.0):
    model = torch.nn.Linear(2, 2)
    torch.nn.init.constant_(model.weight, value)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    _save.last_model = model
    return save_checkpoint(tmp_path, step, model=model, optimizer=opt, trainer_state={"step": step},
                           keep_last=keep_last)


def test_keeps_the_last_k_and_never_the_one_it_just_wrote_goes(tmp_path):
    for s in (10, 20, 30):
        _save(tmp_path, s)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [20, 30]
    # resumed from 20 explicitly: 30 is another history and must not win `resume: auto` later
    path = _save(tmp_path, 25, keep_last=1)
    assert path.is_dir()
    assert [s for s, _ in list_checkpoints(tmp_path)] == [25]
    assert resolve_resume("auto", tmp_path) == path


def test_leftover_of_a_killed_save_is_ignored_and_cleaned(tmp_path):
    _save(tmp_path, 1)
    (tmp_path / ".tmp_step_000002" / "model_optim").mkdir(parents=True)  # a save killed half-way
    assert resolve_resume("auto", tmp_path).name == "step_000001"
    _save(tmp_path, 3)
    assert not (tmp_path / ".tmp_step_000002").exists()


def test_round_trip_restores_weights_and_optimizer(tmp_path):
    path = _save(tmp_path, 5, value=0.25)
    saved = _save.last_model
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    state = load_checkpoint(path, model=model, optimizer=opt)
    assert state["step"] == 5
    assert torch.equal(model.weight, saved.weight) and torch.equal(model.bias, saved.bias)
    assert opt.state[model.weight]["step"].item() == 1  # Adam's moments came back too


def test_resuming_another_models_checkpoint_is_a_clear_error(tmp_path):
    import pytest

    path = _save(tmp_path, 1)
    other = torch.nn.Linear(2, 3)
    with pytest.raises(ValueError, match=r"holds another model: weight is \[2, 2\] there and \[3, 2\] here"):
        load_checkpoint(path, model=other, optimizer=torch.optim.AdamW(other.parameters()))
    renamed = torch.nn.Sequential(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match=r"holds another model: it has no '0.weight'"):
        load_checkpoint(path, model=renamed, optimizer=torch.optim.AdamW(renamed.parameters()))


def test_a_full_disk_is_a_clear_error_and_leaves_the_last_checkpoint(tmp_path, monkeypatch):
    import errno

    import pytest

    from fastgrpo.runtime.errors import DiskFullError

    _save(tmp_path, 1)
    real_save = torch.save

    def full(obj, f, *a, **k):
        if "rng_rank" in str(f):
            raise OSError(errno.ENOSPC, "No space left on device", str(f))
        return real_save(obj, f, *a, **k)

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(DiskFullError, match=r"no space left on the device while writing the checkpoint of step 2"
                                            r".*the checkpoint of step 1 is intact"):
        _save(tmp_path, 2)
    assert [s for s, _ in list_checkpoints(tmp_path)] == [1]
    assert not (tmp_path / ".tmp_step_000002").exists()


def test_resume_keeps_this_runs_adamw_implementation_and_steps_the_same(tmp_path):
    """A foreach run resumed as fused (optim.implementation is resumable) steps fused, with the saved moments."""
    import pytest

    def trained(fused: bool):
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 3)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=not fused, fused=fused)
        return model, opt

    def one_step(model, opt, seed):
        torch.manual_seed(seed)
        model(torch.randn(5, 4)).pow(2).sum().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    model, opt = trained(fused=False)
    for s in range(3):
        one_step(model, opt, s)
    path = save_checkpoint(tmp_path, 3, model=model, optimizer=opt, trainer_state={"step": 3}, keep_last=1)
    one_step(model, opt, 3)  # the uninterrupted run's 4th step, foreach

    resumed, ropt = trained(fused=True)
    load_checkpoint(path, model=resumed, optimizer=ropt)
    assert ropt.param_groups[0]["fused"] is True and not ropt.param_groups[0]["foreach"]
    assert ropt.state[resumed.weight]["step"].dtype == torch.float32
    one_step(resumed, ropt, 3)
    assert ropt.state[resumed.weight]["step"].item() == 4
    for a, b in zip(model.parameters(), resumed.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-6)
    back, bopt = trained(fused=False)  # and fused -> foreach the other way round
    path = save_checkpoint(tmp_path, 4, model=resumed, optimizer=ropt, trainer_state={"step": 4}, keep_last=1)
    load_checkpoint(path, model=back, optimizer=bopt)
    assert bopt.param_groups[0]["foreach"] is True and not bopt.param_groups[0]["fused"]
    assert bopt.state[back.weight]["step"].device.type == "cpu"
    assert bopt.state[back.weight]["exp_avg"] == pytest.approx(ropt.state[resumed.weight]["exp_avg"])
