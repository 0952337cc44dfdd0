"""Model loader: tiny resolution, dtype and attention backend choice, hub errors, trunk/head split."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file

from fastgrpo.models import attention as attention_lib
from fastgrpo.models.attention import choose_attn_implementation
from fastgrpo.config import ModelConfig
from fastgrpo.models.loading import (
    count_params,
    get_trunk_and_head,
    load_model,
    load_tokenizer,
    resolve_dtype,
    resolve_model_path,
)
from fastgrpo.models.tiny import build_tiny

CPU, CUDA = torch.device("cpu"), torch.device("cuda")  # constructing a cuda device needs no GPU


@pytest.fixture(scope="session")
def tiny_cache(tmp_path_factory):
    """Shared with the other test modules (same folder): each tiny preset/seed is built once per session."""
    return tmp_path_factory.getbasetemp() / "fastgrpo-cache"


@pytest.fixture
def cache_env(tiny_cache, monkeypatch):
    """Point 'tiny' resolution at the session cache instead of ~/.cache."""
    monkeypatch.setenv("FASTGRPO_CACHE", str(tiny_cache))
    return tiny_cache


@pytest.fixture(scope="module", params=["tiny", "tiny:llama"])
def loaded(request, tiny_cache):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FASTGRPO_CACHE", str(tiny_cache))
        cfg = ModelConfig(name_or_path=request.param)
        return load_model(cfg, device="cpu"), load_tokenizer(cfg)


# -- name resolution and loading ------------------------------------------------------------------------------


@pytest.mark.parametrize("name,preset", [("tiny", "default"), ("tiny:llama", "llama")])
def test_tiny_names_resolve_to_the_built_folder(cache_env, name, preset):
    path = resolve_model_path(ModelConfig(name_or_path=name), seed=7)
    assert path == str(build_tiny(seed=7, cache_dir=cache_env, preset=preset))


def test_unknown_tiny_preset_is_rejected(cache_env):
    with pytest.raises(ValueError, match="preset"):
        resolve_model_path(ModelConfig(name_or_path="tiny:gpt9"))


def test_load_model_gives_the_seeded_weights_in_float32_on_cpu(cache_env):
    model = load_model(ModelConfig(name_or_path="tiny"), device="cpu", seed=7)
    stored = load_file(build_tiny(seed=7, cache_dir=cache_env) / "model.safetensors")
    params = dict(model.named_parameters())
    assert stored and all(torch.equal(params[k], v) for k, v in stored.items())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert model.config._attn_implementation == "sdpa_varlen"
    other = load_model(ModelConfig(name_or_path="tiny"), device="cpu", seed=8)
    assert not torch.equal(other.get_input_embeddings().weight, model.get_input_embeddings().weight)


def test_dtype_argument_overrides_config(cache_env):
    model = load_model(ModelConfig(name_or_path="tiny", dtype="float32"), device="cpu", dtype="bfloat16")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


def test_local_folder_loads_like_tiny(cache_env):
    folder = build_tiny(cache_dir=cache_env)
    model = load_model(ModelConfig(name_or_path=str(folder)), device="cpu")
    tiny = load_model(ModelConfig(name_or_path="tiny"), device="cpu")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), tiny.parameters()))


def test_tokenizer_pads_left_and_falls_back_to_eos_for_padding(cache_env, tmp_path):
    tok = load_tokenizer(ModelConfig(name_or_path="tiny"))
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"

    # A tokenizer without a pad token (Qwen2Tokenizer would default one, so use the generic class).
    folder = tmp_path / "nopad"
    shutil.copytree(build_tiny(cache_dir=cache_env, preset="llama"), folder)
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        data = json.loads((folder / name).read_text())
        data.pop("pad_token")
        if name == "tokenizer_config.json":
            data["tokenizer_class"] = "PreTrainedTokenizerFast"
        (folder / name).write_text(json.dumps(data))
    from transformers import AutoTokenizer

    assert AutoTokenizer.from_pretrained(folder).pad_token is None
    tok = load_tokenizer(ModelConfig(name_or_path=str(folder)))
    assert tok.pad_token == tok.eos_token == "<|im_end|>"
    batch = tok(["ab", "abcd"], padding=True)
    assert batch["attention_mask"][0] == [0, 0, 1, 1]


def test_missing_local_folder_names_the_path(tmp_path):
    missing = str(tmp_path / "no" / "such" / "model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(ModelConfig(name_or_path=missing), device="cpu")


def test_hub_id_without_network_gives_actionable_error(monkeypatch):
    # Offline mode makes huggingface_hub fail at once, as a machine without network does after its retries.
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hub_id = f"fastgrpo-test/not-a-model-{torch.randint(10**9, ()).item()}"
    for call in (lambda cfg: load_model(cfg, device="cpu"), load_tokenizer):
        with pytest.raises(OSError) as err:
            call(ModelConfig(name_or_path=hub_id))
        assert hub_id in str(err.value) and "name_or_path=DIR" in str(err.value)


# -- dtype and attention backend ------------------------------------------------------------------------------


def test_auto_dtype_is_bf16_on_cuda_fp32_on_cpu():
    assert resolve_dtype("auto", CUDA) == torch.bfloat16
    assert resolve_dtype("auto", CPU) == torch.float32
    assert resolve_dtype("float32", CUDA) == torch.float32
    assert resolve_dtype(torch.float16, CPU) == torch.float16
    with pytest.raises(ValueError, match="model.dtype"):
        resolve_dtype("int8", CPU)


@pytest.mark.parametrize("flash,varlen,device,expected", [
    (True, True, CUDA, "flash_attention_2"),
    (False, True, CUDA, "torch_varlen"),  # never flex: compiled per shape, a new packed length compiles again
    (False, False, CUDA, "sdpa_varlen"),
    (True, True, CPU, "sdpa_varlen"),
    (False, False, CPU, "sdpa_varlen"),
])
def test_auto_attention_backend(monkeypatch, flash, varlen, device, expected):
    monkeypatch.setattr(attention_lib, "_flash_attn_installed", lambda: flash)
    monkeypatch.setattr(attention_lib, "_torch_varlen_available", lambda: varlen)
    assert choose_attn_implementation("auto", device) == expected


def test_torch_varlen_runs_on_cuda_only_and_says_what_it_needs(monkeypatch):
    monkeypatch.setattr(attention_lib, "_torch_varlen_available", lambda: True)
    with pytest.raises(ValueError, match="CUDA"):
        choose_attn_implementation("torch_varlen", CPU)
    monkeypatch.setattr(attention_lib, "_torch_varlen_available", lambda: False)
    with pytest.raises(ImportError, match="torch.nn.attention.varlen"):
        choose_attn_implementation("torch_varlen", CUDA)


def _packed_qkv(dtype, hq=4, hkv=2, d=8, lengths=(5, 1, 7)):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q, k, v = (torch.randn(1, h, t, d, generator=g).to(dtype) for h in (hq, hkv, hkv))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))


@pytest.mark.parametrize("new_signature", [True, False])
def test_torch_varlen_lays_out_a_packed_row_as_the_per_sequence_attention(monkeypatch, new_signature):
    """The kernel itself needs CUDA; here a stand-in with its contract ([T, H, d] tensors, cu_seq int32, causal by
    window_size=(-1, 0) in torch >= 2.12 or is_causal=True in 2.10-2.11, GQA native or repeated) checks the layout
    that _torch_varlen hands it, against sdpa per sequence."""
    import torch.nn.attention.varlen as varlen_mod

    seen = {}

    def reference(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, **causal):  # q [T, Hq, d], k/v [T, Hk, d]
        seen.update(causal, max_q=max_q, hk=k.shape[1])
        bounds = cu_q.tolist()
        gqa = q.shape[1] != k.shape[1]
        outs = [torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1).float(), k[a:b].transpose(0, 1).float(), v[a:b].transpose(0, 1).float(),
            is_causal=True, scale=scale, enable_gqa=gqa).transpose(0, 1) for a, b in zip(bounds, bounds[1:])]
        return torch.cat(outs).to(q.dtype)

    if new_signature:
        def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, *, scale=None, window_size=(-1, -1), enable_gqa=False):
            assert window_size == (-1, 0) and enable_gqa
            return reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, window_size=window_size)
    else:
        def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=False, *, scale=None):
            assert is_causal and k.shape[1] == q.shape[1]  # no native GQA: kv heads repeated
            return reference(q, k, v, cu_q, cu_k, max_q, max_k, scale=scale, is_causal=is_causal)
    monkeypatch.setattr(varlen_mod, "varlen_attn", stand_in)
    q, k, v, bounds = _packed_qkv(torch.bfloat16)
    got, _ = attention_lib._torch_varlen(None, q, k, v, None, scaling=0.3, **bounds)
    want, _ = attention_lib._sdpa_per_sequence(None, q.float(), k.float(), v.float(), None, scaling=0.3, **bounds)
    assert got.shape == want.shape == (1, q.shape[2], q.shape[1], q.shape[3]) and seen["max_q"] == 7
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=2e-2)


def test_torch_varlen_falls_back_to_sdpa_per_sequence_in_float32_and_without_boundaries(monkeypatch):
    import torch.nn.attention.varlen as varlen_mod

    monkeypatch.setattr(varlen_mod, "varlen_attn", lambda *a, **k: pytest.fail("FlashAttention has no float32"))
    q, k, v, bounds = _packed_qkv(torch.float32)
    got, _ = attention_lib._torch_varlen(None, q, k, v, None, **bounds)
    want, _ = attention_lib._sdpa_per_sequence(None, q, k, v, None, **bounds)
    assert torch.equal(got, want)
    got, _ = attention_lib._torch_varlen(None, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)  # one sequence
    want, _ = attention_lib._sdpa_per_sequence(None, q.bfloat16(), k.bfloat16(), v.bfloat16(), None)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", ["sdpa", "eager", "flex_attention", "sdpa_varlen"])
def test_explicit_attention_backend_is_kept(name):
    assert choose_attn_implementation(name, "cpu") == name


def test_flash_attention_without_flash_attn_says_how_to_install(monkeypatch):
    monkeypatch.setattr(attention_lib, "_flash_attn_installed", lambda: False)
    with pytest.raises(ImportError, match=r"pip install fastgrpo\[flash-attn\]"):
        choose_attn_implementation("flash_attention_2", CUDA)


def test_flash_attention_on_cpu_is_rejected(monkeypatch):
    monkeypatch.setattr(attention_lib, "_flash_attn_installed", lambda: True)
    with pytest.raises(ValueError, match="CUDA"):
        choose_attn_implementation("flash_attention_2", CPU)


def test_unknown_attention_backend_is_rejected():
    with pytest.raises(ValueError, match="attn_implementation"):
        choose_attn_implementation("paged", CPU)


# -- trunk / head -----------------------------------------------------------------------------------------------


def test_head_of_trunk_hidden_states_equals_model_logits(loaded):
    model, tok = loaded
    ids = torch.randint(0, len(tok), (3, 11))
    # Packed-style positions (restarting mid-row) must flow through the trunk exactly as through the model.
    pos = torch.cat([torch.arange(5), torch.arange(6)]).expand(3, -1)
    trunk, head = get_trunk_and_head(model)
    hidden = trunk(input_ids=ids, position_ids=pos).last_hidden_state  # [3, 11, H]
    assert hidden.shape == (3, 11, model.config.hidden_size)
    torch.testing.assert_close(head(hidden), model(input_ids=ids, position_ids=pos).logits)
    assert head.weight.shape == (len(tok), model.config.hidden_size)
    tied = head.weight is model.get_input_embeddings().weight
    assert tied == model.config.tie_word_embeddings


def test_trunk_and_head_reject_post_processed_logits(loaded, monkeypatch):
    model, _ = loaded
    monkeypatch.setattr(model.config, "final_logit_softcapping", 30.0, raising=False)
    with pytest.raises(NotImplementedError, match="final_logit_softcapping"):
        get_trunk_and_head(model)


def test_count_params_counts_tied_weights_once(loaded):
    model, _ = loaded
    unique = {p.data_ptr(): p.numel() for p in model.state_dict().values()}
    assert count_params(model) == sum(unique.values())
    emb = model.get_input_embeddings().weight
    emb.requires_grad_(False)
    try:
        assert count_params(model, trainable_only=True) == count_params(model) - emb.numel()
    finally:
        emb.requires_grad_(True)
