"""fastgrpo.models.loading.check_plain_head: models whose logits are not ``hidden @ lm_head.weight.T`` are refused on the
training path.

The fused lm_head kernels only see hidden states and the head weight. With Gemma-2's final logit softcapping (or
a logit scale, or an lm_head bias) the trainer would train on wrong log-probs with no error. The trainer therefore
runs ``check_plain_head`` right after loading the policy, before any rollout. The tests use a tiny Gemma-2 built
locally (transformers' Gemma2Config, the embedded tokenizer, no hub).
"""

import json
import shutil

import pytest
import torch

from fastgrpo.config import load_config
from fastgrpo.models.loading import check_plain_head, load_model
from fastgrpo.models.tiny import build_tiny
from fastgrpo.trainers.grpo import Trainer
from fastgrpo.update.step import packed_logprobs, plan_packed

pytest.importorskip("transformers.models.gemma2")

TOY = ["data.source=toy", "rewards.funcs=[toy_digit]", "device=cpu", "rollout.max_completion_length=4",
       "grpo.prompts_per_step=2", "grpo.num_generations=2", "data.system_prompt=''", "eval.every=-1",
       "log.progress=false", "checkpoint.export_hf=false", "max_steps=1"]


def tiny_gemma2(path, softcap):
    """A 2-layer Gemma-2 with the embedded tokenizer, saved in Hugging Face layout at ``path``."""
    from transformers import Gemma2Config, Gemma2ForCausalLM

    src = build_tiny()
    base = json.loads((src / "config.json").read_text())
    path.mkdir(parents=True)
    for f in src.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, path / f.name)
    cfg = Gemma2Config(vocab_size=base["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=64,
                       final_logit_softcapping=softcap, bos_token_id=base["bos_token_id"],
                       eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"])
    torch.manual_seed(0)
    model = Gemma2ForCausalLM(cfg)
    with torch.no_grad():  # logits of a few nats, as in a trained model, so that a softcap of 2 matters
        model.lm_head.weight.mul_(30.0)
    model.save_pretrained(path)
    return path


def trainer_cfg(path, tmp_path):
    return load_config(None, TOY + [f"model.name_or_path={path}", f"output_dir={tmp_path / 'run'}"])


@pytest.mark.parametrize("softcap", [2.0, 1.0], ids=["softcap-2", "softcap-1-is-not-harmless"])
def test_trainer_refuses_a_softcapped_gemma2_at_load(tmp_path, softcap, monkeypatch):
    path = tiny_gemma2(tmp_path / "gemma2", softcap)
    # The refusal comes at load, before any rollout or update.
    monkeypatch.setattr("fastgrpo.update.bundle.prepare_model",
                        lambda *a, **k: pytest.fail("the guard must run before the model is parallelized"))
    with pytest.raises(NotImplementedError, match=rf"final_logit_softcapping={softcap}"):
        Trainer(trainer_cfg(path, tmp_path))


def test_without_softcap_the_trainers_logprobs_are_the_models(tmp_path):
    # The control: the same Gemma-2 without the softcap trains, and the log-probs the trainer computes (packed,
    # fused kernels) equal log_softmax(model(ids).logits). With softcap 2 they differ by several nats, which is
    # what the guard prevents.
    path = tiny_gemma2(tmp_path / "gemma2", None)
    trainer = Trainer(trainer_cfg(path, tmp_path))
    prompt, completion = [5, 17, 42, 7], [9, 3, 11]
    mbs = plan_packed([prompt], [completion], 64, device="cpu")
    ours = packed_logprobs(trainer.model, mbs, len(completion), temperature=1.0, backend="torch")
    ids = torch.tensor([prompt + completion])
    with torch.no_grad():
        logits = trainer.model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()  # predicts the completion
        capped = 2.0 * torch.tanh(logits / 2.0)
    expected = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    torch.testing.assert_close(ours, expected, rtol=1e-5, atol=1e-5)
    wrong = torch.log_softmax(capped, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)
    assert (wrong - expected).abs().max() > 1.0  # the error a softcapped model would have trained with


def test_probe_catches_post_processing_the_config_does_not_name(tmp_path):
    model = load_model(load_config(None, ["model.name_or_path=tiny"]).model, device="cpu")
    check_plain_head(model)  # the embedded Qwen2-style model is plain
    forward = model.forward

    def scaled(*args, **kwargs):  # an architecture that rescales its logits in forward, under no known field
        out = forward(*args, **kwargs)
        out.logits = out.logits * 1.5
        return out

    model.forward = scaled
    with pytest.raises(NotImplementedError, match="not lm_head"):
        check_plain_head(model)
    model.forward = forward
    model.lm_head.bias = torch.nn.Parameter(torch.zeros(model.lm_head.weight.shape[0]))
    with pytest.raises(NotImplementedError, match="bias"):
        check_plain_head(model)


def test_the_probe_runs_a_packed_rows_only_attention_through_its_decoding_one():
    """model.attn_implementation=varlen_op (packed rows only; what parallel.compile and cuda_graphs run) failed the
    load-time probe's plain forward; the probe now runs with the implementation the backend decodes with and puts
    the training one back."""
    from transformers import AutoModelForCausalLM

    from fastgrpo.models.attention import register_with_transformers

    register_with_transformers()
    model = AutoModelForCausalLM.from_pretrained(build_tiny(), attn_implementation="varlen_op").train()
    check_plain_head(model)
    assert model.config._attn_implementation == "varlen_op" and model.training
