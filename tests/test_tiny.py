"""The embedded tiny model: a deterministic, self-consistent Hugging Face folder built without the hub."""

from __future__ import annotations

import json
import random
import string
import threading

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from fastgrpo.models import tiny
from fastgrpo.models.tiny import CHAT_TEMPLATE, EOS_TOKEN, PAD_TOKEN, REASONING_TOKENS, SPECIAL_TOKENS, build_tiny

PRESETS = sorted(tiny.PRESETS)


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """One cache folder for the whole session: every test module that builds the tiny model reuses it."""
    return tmp_path_factory.getbasetemp() / "fastgrpo-cache"


@pytest.fixture(scope="module", params=PRESETS)
def loaded(request, tiny_cache):
    path = build_tiny(cache_dir=tiny_cache, preset=request.param)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    return path, AutoTokenizer.from_pretrained(path), model, info


def _random_text(rng: random.Random, n: int) -> str:
    alphabet = string.printable + "é漢∑"  # ASCII incl. tabs/newlines, plus multi-byte characters
    return "".join(rng.choice(alphabet) for _ in range(n))


def test_same_seed_gives_identical_files_and_other_seed_other_weights(tmp_path):
    a = build_tiny(seed=3, cache_dir=tmp_path / "a")
    b = build_tiny(seed=3, cache_dir=tmp_path / "b")
    c = build_tiny(seed=4, cache_dir=tmp_path / "c")
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json", "config.json"):
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    assert (a / "model.safetensors").read_bytes() != (c / "model.safetensors").read_bytes()
    assert (a / "tokenizer.json").read_bytes() == (c / "tokenizer.json").read_bytes()


def test_build_does_not_touch_global_rng(tmp_path):
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny(seed=5, cache_dir=tmp_path)
    assert torch.equal(torch.rand(4), expected)


def test_folder_loads_without_missing_or_unexpected_weights(loaded):
    path, _, model, info = loaded
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    assert type(model).__name__ == arch
    # The Qwen2 presets tie the head to the embedding like Qwen2.5-0.5B..3B; llama keeps a separate head.
    tied = model.get_output_embeddings().weight.data_ptr() == model.get_input_embeddings().weight.data_ptr()
    assert tied == model.config.tie_word_embeddings == (not path.name.startswith("tiny-llama"))


def test_vocab_size_equals_tokenizer_length(loaded):
    _, tok, model, _ = loaded
    assert len(tok) == model.config.vocab_size == model.get_input_embeddings().weight.shape[0]
    assert max(tok.get_vocab().values()) == len(tok) - 1


def test_head_dim_is_at_least_32(loaded):
    _, _, model, _ = loaded
    cfg = model.config
    assert cfg.head_dim >= 32  # vLLM's CPU attention backend rejects smaller heads
    assert cfg.num_attention_heads * cfg.head_dim == model.model.layers[0].self_attn.q_proj.weight.shape[0]


def test_tokenizer_round_trips_random_text(loaded):
    _, tok, _, _ = loaded
    rng = random.Random()
    for _ in range(20):
        text = _random_text(rng, rng.randint(0, 80))
        ids = tok.encode(text, add_special_tokens=False)
        assert tok.decode(ids) == text
        assert tok.decode(ids, skip_special_tokens=True) == text


def test_tokenizer_json_alone_encodes_like_the_transformers_tokenizer(loaded):
    # transformers 5 rebuilds a Qwen2Tokenizer from vocab + merges; other loaders read tokenizer.json as is.
    from tokenizers import Tokenizer

    path, tok, _, _ = loaded
    raw = Tokenizer.from_file(str(path / "tokenizer.json"))
    rng = random.Random()
    for _ in range(10):
        text = _random_text(rng, 60) + rng.choice(SPECIAL_TOKENS + REASONING_TOKENS) + _random_text(rng, 5)
        assert raw.encode(text, add_special_tokens=False).ids == tok.encode(text, add_special_tokens=False)
    assert raw.get_vocab_size(with_added_tokens=True) == len(tok)


def test_ascii_is_one_token_per_character(loaded):
    _, tok, _, _ = loaded
    text = "".join(random.choice(string.printable) for _ in range(50))
    assert len(tok.encode(text, add_special_tokens=False)) == len(text)


def test_special_tokens_are_single_and_dropped_by_skip_special_tokens(loaded):
    _, tok, _, _ = loaded
    for t in SPECIAL_TOKENS + REASONING_TOKENS:
        assert len(tok.encode(t, add_special_tokens=False)) == 1, t
    text = "<|im_start|>assistant\n<think> a b </think><answer>7</answer><|im_end|><|endoftext|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == text
    # Reasoning tags are not special: rewards must still find them after skip_special_tokens.
    assert tok.decode(ids, skip_special_tokens=True) == "assistant\n<think> a b </think><answer>7</answer>"


def test_encode_adds_no_bos_or_eos(loaded):
    _, tok, _, _ = loaded
    assert tok("abc")["input_ids"] == tok.encode("abc", add_special_tokens=False)


def test_eos_and_pad_ids_agree_across_files(loaded):
    path, tok, model, _ = loaded
    gen = json.loads((path / "generation_config.json").read_text())
    assert tok.eos_token == EOS_TOKEN and tok.pad_token == PAD_TOKEN
    assert model.config.eos_token_id == tok.eos_token_id
    assert gen["eos_token_id"] == [tok.eos_token_id, tok.convert_tokens_to_ids(PAD_TOKEN)]
    assert model.config.pad_token_id == gen["pad_token_id"] == tok.pad_token_id


def test_chat_template_is_qwen_style(loaded):
    _, tok, _, _ = loaded
    assert tok.chat_template == CHAT_TEMPLATE
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "1 + 2 ?"}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n1 + 2 ?<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=False)
    assert text.startswith(plain) and not plain.endswith("assistant\n")


def test_forward_gives_finite_logits(loaded):
    _, tok, model, _ = loaded
    ids = torch.randint(0, len(tok), (2, 17))
    logits = model(ids).logits
    assert logits.shape == (2, 17, len(tok)) and torch.isfinite(logits).all()


def test_cached_folder_is_reused_without_rebuilding(tmp_path, monkeypatch):
    first = build_tiny(seed=1, cache_dir=tmp_path)
    stamp = (first / "model.safetensors").stat().st_mtime_ns

    def fail(*a, **k):
        raise AssertionError("rebuilt a cached folder")

    monkeypatch.setattr(tiny, "_write_folder", fail)
    assert build_tiny(seed=1, cache_dir=tmp_path) == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert first.name == "tiny-default-seed1-v1"


def test_cache_root_comes_from_env(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTGRPO_CACHE", str(tmp_path / "env"))
    assert tiny.tiny_cache_root() == tmp_path / "env"
    assert tiny.tiny_cache_root(tmp_path / "arg") == tmp_path / "arg"
    monkeypatch.delenv("FASTGRPO_CACHE")
    assert tiny.tiny_cache_root().parts[-2:] == (".cache", "fastgrpo")


def test_concurrent_builders_agree_and_leave_no_temp_folders(tmp_path):
    results, errors = [], []

    def worker():
        try:
            results.append(build_tiny(seed=2, cache_dir=tmp_path))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(set(results)) == 1
    assert [p.name for p in tmp_path.iterdir()] == ["tiny-default-seed2-v1"]
    AutoTokenizer.from_pretrained(results[0])  # complete, loadable folder


def test_unknown_preset_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="preset"):
        build_tiny(cache_dir=tmp_path, preset="gpt9")
