"""rollout.asynchronous (fastgrpo/rollout/async_worker.py, docs/ASYNC.md): a generation worker process samples the
next steps' batches while the trainer updates. On the embedded tiny model (CPU); each run spawns one worker.

What is checked: the schedule and its staleness bound (logged as rollout/staleness), the version and the weights a
batch was sampled with (a planted worker that skips a weight update fails), the truncated importance weights on
stale batches, the worker's death or hang (a one-line error, a checkpoint, a resume), a SIGTERM resume that matches
the uninterrupted run, the configurations refused, and the worker's cleanup."""

import dataclasses
import json
import signal
import time
import uuid
from pathlib import Path

import pytest
import torch

from _launch import assert_same_weights, run_cli
from fastgrpo.algorithms import grpo as grpo_algorithm
from fastgrpo.config import load_config
from fastgrpo.rollout.async_worker import (FAULT_ENV, RolloutWorkerError, StaleRolloutError, split_threads,
                                           trained_parameters, weight_fingerprint)
from fastgrpo.runtime.errors import Preempted
from fastgrpo.trainers.grpo import Trainer

# The toy task of test_trainer; seed 2 has a reward signal at the first step, so the weights change from step 1 on.
ASYNC = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu", "seed=2",
         "rollout.max_completion_length=4", "grpo.prompts_per_step=8", "grpo.num_generations=8",
         "optim.lr=1e-2", "data.system_prompt=''", "optim.warmup_steps=0", "optim.schedule=constant",
         "eval.every=-1", "log.progress=false", "checkpoint.export_hf=false", "log.completions_per_step=0",
         "rollout.asynchronous=true", "rollout.importance_sampling_cap=2.0", "rollout.async_threads=1"]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def _cfg(tmp_path: Path, name: str, *extra: str):
    return load_config(None, ASYNC + [f"output_dir={tmp_path}", f"name={name}", *extra])


def _run_to_error(cfg, error: type[Exception]) -> str:
    """Run a trainer that must stop with ``error``; the worker is cleaned up either way. Returns the message."""
    trainer = Trainer(cfg)
    try:
        with pytest.raises(error) as e:
            trainer.run()
    finally:
        trainer.close()
    return str(e.value)


@pytest.mark.parametrize("staleness", [1, 2])
def test_schedule_staleness_versions_and_importance_weights(tmp_path, monkeypatch, staleness):
    """Step k's batch is sampled from the weights of step max(0, k - max_staleness), as logged; where those differ
    from the trainer's, the truncated importance weights differ from 1, and where they are the same, they are 1."""
    trainer = Trainer(_cfg(tmp_path, "run", "max_steps=5", f"rollout.max_staleness={staleness}"))
    seen: list[tuple[int, int, torch.Tensor]] = []  # (sampled version's fingerprint, trainer's, IS weights)
    real = grpo_algorithm.importance_weights

    def spy(old, sampler, **kw):
        w = real(old, sampler, **kw)
        version = trainer._async_batch.version
        current = weight_fingerprint([p for _, p in trained_parameters(trainer.model)])
        seen.append((trainer.async_rollout.fingerprints[version], current, w.detach().clone()))
        return w

    monkeypatch.setattr(grpo_algorithm, "importance_weights", spy)
    try:
        trainer.run()
        process = trainer.async_rollout.process
    finally:
        trainer.close()
    rows = _records(tmp_path / "run")
    want = [max(0, k - staleness) for k in range(5)]
    assert [r["rollout/version"] for r in rows] == want
    assert [r["rollout/staleness"] for r in rows] == [k - v for k, v in enumerate(want)]
    assert max(r["rollout/staleness"] for r in rows) == staleness
    assert len(seen) == 5
    stale = [(w - 1).abs().max().item() for fp, now, w in seen if fp != now]
    fresh = [(w - 1).abs().max().item() for fp, now, w in seen if fp == now]
    assert len(stale) >= 2 and fresh, (stale, fresh)  # both kinds occur (the weights changed after step 1)
    assert min(stale) > 1e-3, stale
    assert max(fresh) < 1e-4, fresh
    assert process is None  # the worker was stopped with the run


@pytest.mark.parametrize("fault,message", [("stale@1", "max_staleness is 1"),
                                           ("lie@1", "but the worker's weights were not those")])
def test_planted_stale_worker_fails(tmp_path, monkeypatch, fault, message):
    """A worker that skips loading version 1: reporting the version it holds is refused by the staleness bound,
    claiming version 1 by the weights' fingerprint. Never trained on; the run saves and stops."""
    monkeypatch.setenv(FAULT_ENV, fault)
    text = _run_to_error(_cfg(tmp_path, "run", "max_steps=4"), StaleRolloutError)
    assert message in text and "step 3" in text and "\n" not in text, text
    assert "run the same command again to resume" in text
    assert [r["step"] for r in _records(tmp_path / "run")] == [1, 2]  # step 3 was never trained
    assert (tmp_path / "run" / "checkpoints" / "step_000002").is_dir()


def test_worker_death_is_a_resumable_stop(tmp_path, monkeypatch):
    """The worker exits while generating step 3's batch: a one-line error, a checkpoint of step 2, and the same
    command resumes; the lost batch is generated again from the resumed weights (staleness 0), the next one as
    scheduled."""
    monkeypatch.setenv(FAULT_ENV, "die@2")
    text = _run_to_error(_cfg(tmp_path, "run", "max_steps=4"), RolloutWorkerError)
    assert "exited with code 3" in text and "step 3" in text and "saved step 2" in text and "\n" not in text, text
    state = torch.load(tmp_path / "run" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert [(b["batch"], b["completions"]) for b in state["async_rollout"]] == [(2, None)]  # saved as lost

    monkeypatch.delenv(FAULT_ENV)
    resumed = Trainer(_cfg(tmp_path, "run", "max_steps=4"))
    try:
        resumed.run()
    finally:
        resumed.close()
    rows = _records(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["rollout/version"] for r in rows[2:]] == [2, 2]
    assert [r["rollout/staleness"] for r in rows[2:]] == [0, 1]


def test_lora_sends_the_adapters_only(tmp_path, monkeypatch):
    """A LoRA policy: the slots hold the adapters alone (the worker loads the frozen base itself, checked by its
    fingerprint at start), and the batches still come back from the version they name."""
    trainer = Trainer(_cfg(tmp_path, "run", "max_steps=3", "model.lora.rank=4"))
    try:
        names, sync_bytes = trainer.async_rollout.names, trainer.async_rollout.sync_bytes
        total = sum(p.numel() * p.element_size() for p in trainer.model.parameters())
        trainer.run()
    finally:
        trainer.close()
    assert names and all("lora_" in n for n in names), names
    assert sync_bytes < total / 4, (sync_bytes, total)
    assert [r["rollout/version"] for r in _records(tmp_path / "run")] == [0, 0, 1]


def test_worker_hang_times_out(tmp_path, monkeypatch):
    monkeypatch.setenv(FAULT_ENV, "hang@1")
    trainer = Trainer(_cfg(tmp_path, "run", "max_steps=3", "rollout.async_timeout_s=2"))
    try:
        with pytest.raises(RolloutWorkerError, match=r"sent nothing for 2 s while generating the batch of step 2"):
            trainer.run()
        assert trainer.async_rollout.process is None  # stopped
    finally:
        trainer.close()
    assert (tmp_path / "run" / "checkpoints" / "step_000001").is_dir()


@pytest.mark.parametrize("when,dynamic", [("after_step", False), ("after_step", True), ("dropped_step", False)])
def test_sigterm_resume_matches_the_uninterrupted_run(tmp_path, when, dynamic):
    """The promise of docs/ASYNC.md: a checkpoint waits for the batches in flight and saves them, so a run stopped
    by SIGTERM after step 2 and resumed trains on the same batches and ends with the same weights. With dynamic
    sampling the batches requested after the resume are sized from the saved share of kept groups. A step dropped
    because SIGTERM cut its reward calls short (step 3 here) keeps its batch for the resume."""
    common = ["max_steps=4", "checkpoint.export_hf=true", f"grpo.dynamic_sampling={str(dynamic).lower()}"]
    straight = Trainer(_cfg(tmp_path, "straight", *common))
    try:
        straight.run()
    finally:
        straight.close()

    stopped = Trainer(_cfg(tmp_path, "stopped", *common))
    step, rollout = stopped.train_step, stopped.rollout

    def step_then_sigterm():
        out = step()
        if stopped.step == 2:
            stopped._on_sigterm()
        return out

    def rollout_cut_short(metrics=None):  # as if SIGTERM came during step 3's reward calls
        ep = rollout(metrics)
        if stopped.step == 2:
            stopped._on_sigterm()
            ep = dataclasses.replace(ep, interrupted=True)
        return ep

    if when == "after_step":
        stopped.train_step = step_then_sigterm
    else:
        stopped.rollout = rollout_cut_short
    try:
        with pytest.raises(Preempted, match="after step 2" if when == "after_step" else "dropped that step"):
            stopped.run()
    finally:
        stopped.close()
    state = torch.load(tmp_path / "stopped" / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    saved = state["async_rollout"]
    want = [(2, 1)] if when == "after_step" else [(2, 1), (3, 2)]
    assert [(b["batch"], b["version"]) for b in saved] == want
    assert all(b["completions"] is not None for b in saved)

    resumed = Trainer(_cfg(tmp_path, "stopped", *common))
    try:
        resumed.run()
    finally:
        resumed.close()
    a, b = _records(tmp_path / "straight"), _records(tmp_path / "stopped")
    keys = ("step", "reward/mean", "rollout/version", "rollout/staleness", "is/weight_mean", "completion/len_mean",
            "rollout/async_prompts")
    assert [[r[k] for k in keys] for r in a] == [[r[k] for k in keys] for r in b]
    if dynamic:  # the toy task keeps few groups: later batches ask for more prompts, and no extra round is needed
        assert [r["rollout/async_prompts"] for r in a][:2] == [8, 8] and a[3]["rollout/async_prompts"] > 8, a
    assert_same_weights(tmp_path / "straight" / "final", tmp_path / "stopped" / "final")


def _processes_with(marker: str) -> list[int]:
    """Processes whose environment holds ``marker`` (a test's own children, orphaned or not)."""
    pids = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                pids.append(int(env.parent.name))
        except OSError:
            pass
    return pids


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc (Linux)")
def test_sigkill_then_resume_matches_and_leaves_no_worker(tmp_path):
    """A crash (SIGKILL in step 4) after the checkpoint of step 2: that checkpoint holds the batch in flight, so the
    resumed run ends with the uninterrupted run's weights; the orphaned worker stops by itself."""
    common = ASYNC + [f"output_dir={tmp_path}", "max_steps=4", "checkpoint.every=2", "checkpoint.export_hf=true"]
    straight = run_cli("fastgrpo.train", common + ["name=straight"])
    assert straight.returncode == 0, straight.stderr[-2000:]
    marker = f"FASTGRPO_TEST_MARK={uuid.uuid4().hex}"
    killed = run_cli("fastgrpo.train", common + ["name=killed"],
                     {"FASTGRPO_FAULT_KILL_AT_STEP": "4", marker.split("=")[0]: marker.split("=")[1]})
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    deadline = time.monotonic() + 20
    while _processes_with(marker) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert _processes_with(marker) == []
    resumed = run_cli("fastgrpo.train", common + ["name=killed"])
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "resumed from" in resumed.stdout
    assert_same_weights(tmp_path / "straight" / "final", tmp_path / "killed" / "final")


@pytest.mark.parametrize("override,field", [
    ("rollout.engine=vllm", "rollout.engine"),
    ("rollout.importance_sampling_cap=null", "rollout.importance_sampling_cap"),
    ("algorithm=ppo", "algorithm"),
    ("rollout.max_staleness=0", "rollout.max_staleness"),
    ("rollout.async_threads=0", "rollout.async_threads"),
])
def test_unsupported_combinations_are_refused(tmp_path, override, field):
    with pytest.raises(ValueError, match=field.replace(".", r"\.")):
        _cfg(tmp_path, "run", override)


def test_multi_turn_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"rollout\.env"):
        _cfg(tmp_path, "run", "rollout.env.name=tools", "rollout.env.tools=[calculator]", "rollout.max_turns=2")


def test_split_threads():
    assert split_threads(None, total=2) == (1, 1)
    assert split_threads(None, total=16) == (8, 8)
    assert split_threads(3, total=4) == (3, 1)
    assert split_threads(None, total=1) == (1, 1)  # both sides keep a thread
    assert split_threads(8, total=4) == (8, 1)


def test_fingerprint_is_exact_and_thread_independent():
    t = torch.randn(1000, 37)
    fp = weight_fingerprint([t])
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert weight_fingerprint([t.clone()]) == fp
    finally:
        torch.set_num_threads(before)
    u = t.clone()
    u[500, 3] = torch.nextafter(u[500, 3], torch.tensor(10.0))  # one ulp
    assert weight_fingerprint([u]) != fp
    assert weight_fingerprint([t, u]) != weight_fingerprint([u, t])
