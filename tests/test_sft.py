"""SFT (fastgrpo.sft): the packed loss is the unpadded one, the loss falls, a killed run resumes exactly, and config
errors name the field (the warm model built by an SFT recipe: test_warm.py)."""

import json
import random

import pytest
import torch

from _launch import assert_same_weights, run_cli
from fastgrpo.config import ConfigError, load_config
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.config import ParallelConfig
from fastgrpo.sft import SFTConfig, SFTTrainer
from fastgrpo.algorithms.sft import sft_update

BASE = ["model.name_or_path=tiny", "device=cpu", "log.progress=false", "eval.every=-1", "checkpoint.export_hf=false"]


def _random_pairs(rng: random.Random, n: int, vocab: int = 250) -> tuple[list[list[int]], list[list[int]]]:
    prompts = [[rng.randrange(vocab) for _ in range(rng.randint(1, 9))] for _ in range(n)]
    completions = [[rng.randrange(vocab) for _ in range(rng.randint(1, 7))] for _ in range(n)]
    return prompts, completions


def _unpadded_loss(model, prompts, completions, normalization: str) -> torch.Tensor:
    """Each sequence alone through the plain HF forward with full logits: the reference SFT loss."""
    total_tokens = sum(len(c) for c in completions)
    loss = 0.0
    for p, c in zip(prompts, completions):
        ids = torch.tensor([p + c])
        logp = torch.log_softmax(model(input_ids=ids).logits[0].float(), -1)  # [T, V]
        nll = -logp[len(p) - 1:len(p) + len(c) - 1].gather(-1, torch.tensor(c)[:, None]).squeeze(-1)  # [L]
        w = 1.0 / total_tokens if normalization == "token" else 1.0 / (len(completions) * len(c))
        loss = loss + w * nll.sum()
    return loss


@pytest.mark.parametrize("normalization", ["token", "sequence"])
def test_packed_sft_gradient_equals_the_unpadded_per_sequence_one(normalization, rng):
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.tiny import build_tiny

    path = build_tiny(seed=3)
    packed = AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa")
    plain = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    packed = parallelize_model(packed, ParallelConfig(), device=torch.device("cpu"), world_size=1)
    prompts, completions = _random_pairs(rng, 7)
    metrics = StepMetrics()
    # lr 0: the update leaves the weights, and their .grad, as the loss made them; a small budget packs 7 sequences
    # into several micro-batches, each holding several sequences.
    sft_update(packed, prompts, completions, normalization=normalization, max_tokens_per_microbatch=24,
               head_backend="torch", optimizer=torch.optim.SGD(packed.parameters(), lr=0.0), max_grad_norm=0.0,
               metrics=metrics, device="cpu")
    loss = _unpadded_loss(plain, prompts, completions, normalization)
    loss.backward()
    assert metrics.reduce()["loss"] == pytest.approx(loss.item(), rel=1e-5)
    grads = dict(plain.named_parameters())
    for name, p in packed.named_parameters():
        torch.testing.assert_close(p.grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sft_loss_falls_on_a_tiny_data_set(tmp_path):
    rows = [{"prompt": f"{a} + {b} =", "completion": f" {a + b}"} for a in range(4) for b in range(4)]
    (tmp_path / "add.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = load_config(None, BASE + [f"data.source={tmp_path / 'add.jsonl'}", "data.num_eval=2", "sft.batch_size=14",
                                    "max_steps=30", "optim.lr=1e-2", f"output_dir={tmp_path}", "name=fall"],
                      cls=SFTConfig)
    SFTTrainer(cfg).run()
    nll = [json.loads(x)["sft/nll"] for x in (tmp_path / "fall" / "metrics.jsonl").read_text().splitlines()]
    assert len(nll) == 30
    assert sum(nll[-3:]) / 3 < 0.4 * sum(nll[:3]) / 3, nll


def test_killed_sft_run_resumes_to_the_weights_of_an_uninterrupted_one(tmp_path):
    common = BASE + ["data.source=countdown", "data.template=compact", "data.min_numbers=3", "data.max_numbers=3",
                     "data.max_value=9", "data.num_train=64", "data.num_eval=4", "sft.batch_size=8",
                     "sft.near_miss=0.5", "max_steps=4", "checkpoint.every=2", "checkpoint.export_hf=true",
                     "optim.lr=1e-3", f"output_dir={tmp_path}"]
    ref = run_cli("fastgrpo.sft", common + ["name=straight"])
    assert ref.returncode == 0, ref.stderr[-2000:]
    killed = run_cli("fastgrpo.sft", common + ["name=killed"], {"FASTGRPO_FAULT_KILL_AT_STEP": "4"})
    assert killed.returncode != 0 and not (tmp_path / "killed" / "final").exists()
    assert sorted(p.name for p in (tmp_path / "killed" / "checkpoints").iterdir())[-1] == "step_000002"
    resumed = run_cli("fastgrpo.sft", common + ["name=killed"])
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout, resumed.stderr[-2000:]
    assert_same_weights(tmp_path / "straight" / "final", tmp_path / "killed" / "final")
    steps = [json.loads(x)["step"] for x in (tmp_path / "killed" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_sft_config_errors_name_the_field():
    with pytest.raises(ConfigError, match="sft.normalizaton.*did you mean 'sft.normalization'"):
        load_config(None, ["sft.normalizaton=token"], cls=SFTConfig)
    with pytest.raises(ConfigError, match="sft.normalization: unknown 'tokens'"):
        load_config(None, ["sft.normalization=tokens"], cls=SFTConfig)
    with pytest.raises(ConfigError, match="sft.near_miss"):
        load_config(None, ["sft.near_miss=1.5"], cls=SFTConfig)
    with pytest.raises(ConfigError, match="sft.head_backend.*no backward"):  # its gradient is the GRPO loss's only
        load_config(None, ["sft.head_backend=cublas"], cls=SFTConfig)


def test_sft_resolves_a_differentiable_head_path(monkeypatch):
    """'auto' on CUDA picks cublas for the GRPO loss, whose log-probs have no backward: SFT must resolve as for
    log-probs (a recompute path). Checked through the resolver the update calls, with CUDA pretended."""
    import fastgrpo.algorithms.sft as update

    seen = []
    monkeypatch.setattr(update, "resolve_backend", lambda b, d, needs_grad, **kw: seen.append(needs_grad) or "torch")
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.tiny import build_tiny

    model = AutoModelForCausalLM.from_pretrained(build_tiny(seed=3), attn_implementation="sdpa")
    model = parallelize_model(model, ParallelConfig(), device="cpu", world_size=1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sft_update(model, [[1, 2, 3]], [[4, 5]], normalization="token", max_tokens_per_microbatch=64,
               head_backend="auto", optimizer=opt, max_grad_norm=1.0, metrics=StepMetrics(), device="cpu")
    assert seen == [False]

