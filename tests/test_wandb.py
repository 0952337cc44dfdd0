"""``log.report_to: [wandb]`` with the real wandb, offline (no key, no network): what a run leaves in the folder wandb
writes, a resumed run continuing the same wandb run, and wandb failures that never stop training.

The offline run folder (``<run>/wandb/offline-run-*/run-<id>.wandb``) is what ``wandb sync`` uploads: a log of
protobuf records (wandb's ``Record`` messages) in LevelDB's log framing, read here by :func:`wandb_records`.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fastgrpo import train

wandb = pytest.importorskip("wandb")
from wandb.proto import wandb_internal_pb2  # noqa: E402

TOY = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
       "rollout.max_completion_length=3", "grpo.prompts_per_step=2", "grpo.num_generations=2", "optim.lr=1e-2",
       "data.system_prompt=''", "eval.every=-1", "log.progress=false", "checkpoint.export_hf=false",
       "checkpoint.every=1", "log.report_to=[jsonl,wandb]", "log.wandb_project=fastgrpo-test"]
"""A GRPO run of seconds on the embedded tiny model, logging to jsonl and wandb."""

_BLOCK = 32768  # LevelDB log: records never straddle a 32 KiB block's 7-byte header


def wandb_records(path: Path) -> list[wandb_internal_pb2.Record]:
    """The records of a ``.wandb`` file: a 7-byte file header (``:W&B``, magic, version), then chunks of
    (crc32 u32, length u16, type u8, payload), a record's chunks typed full (1) or first / middle / last (2-4)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", path
    records, pos, parts = [], 7, b""
    while pos + 7 <= len(data):
        if _BLOCK - pos % _BLOCK < 7:  # a block's tail too short for a chunk header is padding
            pos += _BLOCK - pos % _BLOCK
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        parts += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def _key(item) -> str:
    """A metric's name: wandb writes ``reward/mean`` as the nested key ('reward', 'mean')."""
    return item.key or "/".join(item.nested_key)


def offline_runs(run: Path) -> list[dict]:
    """Each offline wandb run folder under ``run``, in the order they started: its run id, config and history rows
    (folder names tell the time to the second only)."""
    out = []
    for folder in (run / "wandb").glob("offline-run-*"):
        (log,) = folder.glob("run-*.wandb")
        found: dict = {"history": []}
        for record in wandb_records(log):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                found["id"], found["start"] = record.run.run_id, record.run.start_time.ToNanoseconds()
                found["config"] = {_key(i): json.loads(i.value_json) for i in record.run.config.update}
            elif kind == "history":
                found["history"].append({_key(i): json.loads(i.value_json) for i in record.history.item})
        out.append(found)
    return sorted(out, key=lambda found: found["start"])


@pytest.fixture
def offline(monkeypatch, tmp_path):
    """wandb with no key and no network: its settings and caches in the test's folder."""
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_CONSOLE", "off")
    for key, sub in (("WANDB_CONFIG_DIR", "config"), ("WANDB_CACHE_DIR", "cache"), ("WANDB_DATA_DIR", "data")):
        monkeypatch.setenv(key, str(tmp_path / "wandb-home" / sub))
    wandb.teardown()  # wandb keeps its settings for the process: each test reads its own environment
    yield
    wandb.teardown()


def _main(tmp_path: Path, *overrides: str) -> int:
    return train.main([*TOY, f"output_dir={tmp_path}", "name=run", *overrides])


def _jsonl(run: Path) -> list[dict]:
    return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]


def test_the_offline_run_holds_every_step_and_the_config_a_resume_continues_it_a_fresh_start_does_not(tmp_path, offline):
    run = tmp_path / "run"
    assert _main(tmp_path, "max_steps=2") == 0
    (first,) = offline_runs(run)
    assert [h["_step"] for h in first["history"]] == [1, 2]
    for row, record in zip(first["history"], _jsonl(run)):  # every metric of every step, as metrics.jsonl has it
        metrics = {k: v for k, v in record.items() if k != "step" and v is not None}
        assert {k: row[k] for k in metrics} == pytest.approx(metrics), record["step"]
    assert first["config"]["max_steps"] == 2 and first["config"]["run_kind"] == "grpo"
    assert first["config"]["grpo"]["num_generations"] == 2

    assert _main(tmp_path, "max_steps=3") == 0  # resumes from step 2's checkpoint
    first_again, resumed = offline_runs(run)
    assert resumed["id"] == first["id"] == (run / "wandb_run_id").read_text().strip()
    assert [h["_step"] for h in resumed["history"]] == [3] and resumed["config"]["max_steps"] == 3

    # a fresh run in the same folder is a new wandb run
    assert _main(tmp_path, "max_steps=1", "checkpoint.resume=never", "checkpoint.overwrite=true") == 0
    fresh = offline_runs(run)[-1]
    assert fresh["id"] != first["id"] and [h["_step"] for h in fresh["history"]] == [1]


def test_wandb_that_cannot_start_never_stops_training(tmp_path, offline, monkeypatch, capsys):
    monkeypatch.setenv("WANDB_MODE", "online")  # and no API key: wandb.init raises UsageError at once
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # should it try the network, nothing answers
    assert _main(tmp_path, "max_steps=2") == 0
    assert [r["step"] for r in _jsonl(tmp_path / "run")] == [1, 2]
    out = capsys.readouterr().out
    assert "wandb could not start (UsageError" in out and "training goes on without wandb" in out


def test_a_wandb_log_call_that_fails_never_stops_training(tmp_path, offline, monkeypatch, capsys):
    calls = []

    def failing_log(self, data, step=None, **kwargs):
        calls.append(step)
        raise OSError("wandb's service went away")

    monkeypatch.setattr(wandb.sdk.wandb_run.Run, "log", failing_log)
    assert _main(tmp_path, "max_steps=2") == 0
    assert [r["step"] for r in _jsonl(tmp_path / "run")] == [1, 2]
    assert calls == [1]  # said once, then the sink is off
    assert "wandb failed to log step 1 (OSError: wandb's service went away)" in capsys.readouterr().out
