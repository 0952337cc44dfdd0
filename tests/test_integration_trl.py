"""fastgrpo.integrations.trl.GRPOTrainer against TRL's own GRPOTrainer.compute_loss, on the embedded tiny model.

One trainer holds both losses: the drop-in's ``compute_loss`` and TRL's (``trl.GRPOTrainer.compute_loss``, which
takes TRL's own fused head through the same patched forward), on the same model, inputs and settings. Each case
sets the trainer's options as GRPOConfig would and compares the loss, every parameter's gradient (float32, 1e-4 of
the largest entry) and the metrics TRL logs. Old log-probs are the current ones moved far enough that clipping
binds. Skipped when TRL is not installed (it is an optional extra, pinned in requirements/cpu.txt for CI).
"""

import subprocess
import sys

import pytest
import torch

trl = pytest.importorskip("trl")

from fastgrpo.integrations.trl import GRPOTrainer  # noqa: E402
from fastgrpo.models.tiny import build_tiny  # noqa: E402

B, P, C = 4, 3, 6


def _config(tmp_path, **overrides):
    opts = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, num_generations=4, max_completion_length=C,
                report_to=[], use_cpu=True, bf16=False, model_init_kwargs={"dtype": "float32"}, beta=0.0,
                save_strategy="no", logging_steps=1, max_steps=2, disable_dropout=True)
    opts.update(overrides)
    return trl.GRPOConfig(**opts)


def _trainer(tmp_path, preset="llama", peft_config=None, **overrides):
    import datasets
    from transformers import AutoTokenizer

    folder = build_tiny(preset=preset)
    return GRPOTrainer(model=str(folder), reward_funcs=_length_reward, args=_config(tmp_path, **overrides),
                       train_dataset=datasets.Dataset.from_dict({"prompt": ["12+3=", "7*8=", "9-4=", "2+2="] * 2}),
                       processing_class=AutoTokenizer.from_pretrained(folder), peft_config=peft_config)


def _length_reward(completions, **kwargs):
    return [float(len(c) % 5) for c in completions]


@pytest.fixture(scope="module")
def trainer(tmp_path_factory):
    return _trainer(tmp_path_factory.mktemp("trl"))


def _inputs(trainer, seed, *, old_shift=0.6):
    """One micro-batch as TRL's ``_prepare_inputs`` hands it over: left-padded prompts, right-padded ragged
    completions, old / reference / sampler log-probs near the current ones."""
    g = torch.Generator().manual_seed(seed)
    v = trainer.model.config.vocab_size
    prompt_mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 0, 1], [1, 1, 1]])
    lengths = torch.tensor([C, 2, 5, 3])
    completion_mask = (torch.arange(C)[None] < lengths[:, None]).long()
    inputs = dict(prompt_ids=torch.randint(0, v, (B, P), generator=g), prompt_mask=prompt_mask,
                  completion_ids=torch.randint(0, v, (B, C), generator=g), completion_mask=completion_mask,
                  advantages=torch.tensor([1.0, -0.6, 0.4, -1.1]), num_items_in_batch=lengths.sum().float() * 2)
    dev = trainer.model.device
    with torch.no_grad():
        logp, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, torch.cat([inputs["prompt_ids"], inputs["completion_ids"]], 1).to(dev),
            torch.cat([prompt_mask, completion_mask], 1).to(dev), C)
    logp = logp.cpu()
    noise = lambda scale: scale * torch.randn(B, C, generator=g)  # noqa: E731
    shift = torch.tensor([[-0.4], [0.4], [0.0], [0.3]])  # so that the sequence-level ratio clips too
    inputs["old_per_token_logps"] = (logp + old_shift * (shift + noise(1.0))) * completion_mask
    inputs["ref_per_token_logps"] = (logp + noise(0.3)) * completion_mask
    inputs["sampling_per_token_logps"] = (logp + noise(0.4)) * completion_mask
    inputs["importance_sampling_ratio"] = (torch.rand(B, C, generator=g) + 0.5) * completion_mask
    return {k: v.to(dev) for k, v in inputs.items()}


def _apply(trainer, opts):
    """Set options as the trainer's constructor would from a GRPOConfig (both losses read them per call)."""
    a = trainer.args
    trainer.loss_type = a.loss_type = opts.get("loss_type", "dapo")
    trainer.beta = a.beta = opts.get("beta", 0.0)
    a.use_bias_correction_kl = opts.get("use_bias_correction_kl", False)
    trainer.importance_sampling_level = a.importance_sampling_level = opts.get("importance_sampling_level", "token")
    trainer.epsilon_low = a.epsilon = opts.get("epsilon", 0.2)
    trainer.epsilon_high = a.epsilon_high = opts.get("epsilon_high", trainer.epsilon_low)
    a.delta = opts.get("delta")
    trainer.top_entropy_quantile = a.top_entropy_quantile = opts.get("top_entropy_quantile", 1.0)
    trainer.off_policy_mask_threshold = a.off_policy_mask_threshold = opts.get("off_policy_mask_threshold")
    trainer.use_vllm = opts.get("vllm_is_ratio", False)  # only the loss reads it here: no engine is started
    trainer.vllm_importance_sampling_correction = True
    a.sapo_temperature_pos, a.sapo_temperature_neg = opts.get("sapo_temperature_pos", 1.0), 1.05
    trainer.current_gradient_accumulation_steps = opts.get("accumulation", 1)
    a.steps_per_generation = opts.get("accumulation", 1)


def _loss_grads_metrics(trainer, compute_loss, batches, model=None):
    model = trainer.model if model is None else model  # the model TRL's training step hands over (maybe wrapped)
    model.train()
    model.zero_grad(set_to_none=True)
    trainer._metrics["train"].clear()
    losses = []
    for inputs in batches:
        loss = compute_loss(trainer, model, inputs)
        loss.backward()
        losses.append(loss.item())
    full = lambda g: g.full_tensor() if hasattr(g, "full_tensor") else g.clone()  # noqa: E731 (FSDP2: DTensor)
    grads = {n: full(p.grad) for n, p in trainer.model.named_parameters() if p.grad is not None}
    metrics = {k: list(v) for k, v in trainer._metrics["train"].items()}
    return losses, grads, metrics


def _assert_same(trainer, batches, grad_tol=1e-4, model=None):
    want = _loss_grads_metrics(trainer, trl.GRPOTrainer.compute_loss, batches, model)
    got = _loss_grads_metrics(trainer, GRPOTrainer.compute_loss, batches, model)
    assert got[0] == pytest.approx(want[0], rel=1e-4, abs=1e-6)
    assert got[1].keys() == want[1].keys() and len(want[1]) > 0
    for name, g in want[1].items():
        scale = g.float().abs().max().clamp(min=1e-8)
        assert (got[1][name].float() - g.float()).abs().max() <= grad_tol * scale, name
    assert got[2].keys() == want[2].keys()
    for key, values in want[2].items():
        assert got[2][key] == pytest.approx(values, rel=1e-4, abs=1e-6), key
    return want


CASES = {
    "grpo": dict(loss_type="grpo"),
    "bnpo": dict(loss_type="bnpo"),
    "dr_grpo": dict(loss_type="dr_grpo"),
    "dapo": dict(loss_type="dapo"),
    "cispo": dict(loss_type="cispo", epsilon_high=1.3),
    "sapo": dict(loss_type="sapo", sapo_temperature_pos=1.2),
    "luspo-sequence": dict(loss_type="luspo", importance_sampling_level="sequence"),
    "gspo": dict(loss_type="grpo", importance_sampling_level="sequence"),
    "beta": dict(beta=0.1),
    "beta-bias-correction": dict(beta=0.1, use_bias_correction_kl=True),
    "gspo-beta-bias-correction": dict(loss_type="grpo", importance_sampling_level="sequence", beta=0.1,
                                      use_bias_correction_kl=True),
    "asymmetric-epsilon-delta": dict(epsilon=0.1, epsilon_high=0.3, delta=1.4),
    "entropy-mask-beta": dict(top_entropy_quantile=0.4, beta=0.1),
    "entropy-mask-gspo": dict(loss_type="grpo", importance_sampling_level="sequence", top_entropy_quantile=0.5),
    "vllm-ratio-beta": dict(vllm_is_ratio=True, beta=0.1),
    "off-policy-mask": dict(off_policy_mask_threshold=0.05, beta=0.1),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_loss_gradients_and_metrics_equal_trl(trainer, case):
    _apply(trainer, CASES[case])
    want = _assert_same(trainer, [_inputs(trainer, seed=1)])
    if CASES[case].get("loss_type", "dapo") not in ("sapo", "cispo") and "beta" not in CASES[case]:
        clip = want[2]["clip_ratio/region_mean"][0]
        assert clip > 0, "the inputs must make clipping bind"


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_two_micro_batches_of_gradient_accumulation_equal_trl(trainer, loss_type):
    _apply(trainer, dict(loss_type=loss_type, accumulation=2, beta=0.1))
    _assert_same(trainer, [_inputs(trainer, seed=2), _inputs(trainer, seed=3)])


def test_peft_model_and_tied_head_equal_trl(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    trainer = _trainer(tmp_path, preset="default", loss_type="grpo", peft_config=lora)  # default: tied lm_head
    _apply(trainer, dict(loss_type="grpo"))
    _, grads, _ = _assert_same(trainer, [_inputs(trainer, seed=4)])
    assert all("lora_" in name for name in grads)


@pytest.mark.parametrize("wrap", ["ddp", "fsdp2"])
def test_wrapped_model_equals_trl(tmp_path, wrap):
    # one process (gloo): the wrapper's forward runs around the fused loss, and under FSDP2 the lm_head weight is
    # a DTensor (the untied llama preset, so the head is a parameter of the root's own group)
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    trainer = _trainer(tmp_path)  # before the process group: TRL's accelerator stays single-process
    _apply(trainer, dict(loss_type="dapo", beta=0.1))
    batches = [_inputs(trainer, seed=6)]
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        if wrap == "ddp":
            model = torch.nn.parallel.DistributedDataParallel(trainer.model)
        else:
            from torch.distributed.fsdp import fully_shard

            for layer in trainer.model.model.layers:
                fully_shard(layer)
            model = fully_shard(trainer.model)
            assert isinstance(trainer.model.lm_head.weight, DTensor)
        _assert_same(trainer, batches, model=model)
    finally:
        dist.destroy_process_group()


def test_bf16_model_with_cast_lm_head_to_fp32_equals_trl(tmp_path):
    # the head in float32 on a bf16 decoder under bf16 autocast: the loss is the float32 head's on the same hidden
    # states; gradients pass back through bf16 layers, hence their looser bound
    trainer = _trainer(tmp_path, model_init_kwargs={"dtype": "bfloat16"}, bf16=True, cast_lm_head_to_fp32=True)
    assert trainer.model.get_output_embeddings().weight.dtype == torch.float32
    assert trainer.model.model.layers[0].mlp.up_proj.weight.dtype == torch.bfloat16
    _apply(trainer, dict(loss_type="dapo", beta=0.1))
    _assert_same(trainer, [_inputs(trainer, seed=5)], grad_tol=2e-2)


@pytest.mark.parametrize("option, value, name", [
    ("loss_type", "vespo", "loss_type"),
    ("entropy_coef", 0.01, "entropy_coef"),
])
def test_unserved_options_fail_at_construction(tmp_path, option, value, name):
    with pytest.raises(ValueError, match=name):
        _trainer(tmp_path, **{option: value})


def test_peft_adapter_on_the_lm_head_fails_at_construction(tmp_path):
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "lm_head"], task_type="CAUSAL_LM")
    with pytest.raises(ValueError, match="lm_head"):
        _trainer(tmp_path, peft_config=lora)


def test_a_few_training_steps_with_the_drop_in(tmp_path):
    trainer = _trainer(tmp_path, loss_type="dapo", beta=0.05, num_iterations=2, max_steps=2)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    calls = []
    original = GRPOTrainer._fused_loss
    trainer._fused_loss = lambda *a, **k: calls.append(1) or original(trainer, *a, **k)
    trainer.train()
    assert len(calls) == 2  # every loss went through the fused head
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert logs and all(torch.isfinite(torch.tensor(h["loss"])) for h in logs)
    assert all(k in logs[0] for k in ("kl", "entropy", "clip_ratio/region_mean"))
    assert any(not torch.equal(before[n], p) for n, p in trainer.model.named_parameters())


def test_import_without_trl_says_what_to_install():
    code = ("import sys; sys.modules['trl'] = None\n"
            "try:\n    import fastgrpo.integrations.trl\nexcept ImportError as e:\n    print(e)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "pip install fastgrpo[trl]" in out.stdout, out.stderr[-2000:]
