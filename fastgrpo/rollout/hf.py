"""Rollout with the live training model: a plain KV-cached decode loop on transformers' forward.

Why not ``model.generate``: (1) the sampler's log-probs would need ``output_logits`` — a [L, N, V] tensor
kept for the whole rollout, which the project forbids; here each step keeps one float per sequence;
(2) generate applies the generation_config's defaults (``top_k=50``, repetition penalties, ...) that the
trainer's log-probs would not know about; (3) it cannot take a ``torch.Generator``, so seeding it would
reset the trainer's global RNG stream. The loop here does temperature, top-k and top-p and nothing else; the
log-prob it reports is the drawn token's under that truncated, renormalised distribution (rollout.truncation).

Padding: prompts of a chunk are left-padded to the same length with an attention mask, and position ids
count real tokens only (``cumsum(mask) - 1``), so a padded prompt sees exactly the positions it would see
alone (as the trainer's packed forward will). RoPE attention depends only on position differences, so the
mask is what keeps padded and unpadded generation equal; the padded-vs-alone test checks it token for token.

Prefill: the G samples of a prompt share it. Each prompt of a chunk runs through the prefill once, and its KV cache,
positions and last logits are copied out to its samples' rows (a chunk may hold part of a prompt's samples).

A step: one forward of the new tokens against a KV cache allocated once for the chunk
(``kv_cache.preallocated_kv_cache``; transformers' DynamicCache concatenates the whole cache at every token), with
the attention mask a view of one ``[N, P + max_tokens]`` mask, then one uniform number per row to draw the next
token (``sample_rows``). The host learns whether all rows finished (the one host sync of the loop) every
:func:`finish_check_every` steps: every 8 on an accelerator, where a finished chunk then runs at most 7 padded steps
more instead of stalling the device every token; every step on a CPU, where the answer costs nothing and a padded
step does (checking every 8 made the demo's rollout 20-25% slower, side by side).

Decode step (``rollout.hf.decode``): the prompt always runs through transformers' forward; the per-token steps,
where transformers' per-call overhead dominates on small models, run through ``lean_decode.LeanDecoder`` (the same
arithmetic on the model's own parameters, continuing the same cache) when the model is a plain Qwen2/Llama
(``"auto"``, the default; ``"lean"`` raises where it cannot), or always through transformers (``"transformers"``).
On CUDA the lean step runs with static shapes (attention over the whole chunk's cache, unwritten slots masked),
captured once per chunk in a CUDA graph and replayed per token (``rollout.hf.cuda_graph``; ``GraphedStep``).

Seeding: one ``torch.Generator`` per chunk, seeded from (seed, chunk index), so a seed reproduces a call exactly
for the same prompts, n and batch_size (changing batch_size changes which draws each sequence gets), whatever the
finish check's interval or the decode step.

Legend: N sequences in a chunk (prompts x n), P longest prompt in the chunk, T decode steps so far,
V vocabulary size.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
from copy import deepcopy
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch import nn

from fastgrpo.config import HFRolloutConfig, check_section
from fastgrpo.config.loader import check, section_check
from fastgrpo.models.attention import decoding_attn_implementation
from fastgrpo.models.policy_state import is_lora
from fastgrpo.rollout.base import Completion, EngineSetup, RolloutEngine, SamplingParams, register_engine
from fastgrpo.rollout.kv_cache import preallocated_kv_cache
from fastgrpo.rollout.lean_decode import GraphedStep, LeanDecoder, lean_unsupported_reason
from fastgrpo.rollout.truncation import kept_probs
from fastgrpo.runtime.errors import ContextError, NonFiniteError

__all__ = ["HFEngine", "sample_next", "sample_rows"]

def finish_check_every(device: torch.device) -> int:
    """Decode steps between two checks of whether every row finished (see the module docstring)."""
    return 1 if device.type == "cpu" else 8

def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _reshard(model: nn.Module) -> None:
    """Free FSDP2's gathered parameters (the root keeps them after a forward): the sharded DTensors are the
    weights, so a copy into a gathered parameter would be lost, and rollout memory should be released."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2: nothing can be sharded
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def decode_copy(model: nn.Module, autocast_dtype: torch.dtype | None
                ) -> tuple[nn.Module, list[torch.Tensor], list[torch.Tensor]] | None:
    """For a policy with float32 masters that computes under autocast in ``autocast_dtype`` (one plain GPU): a copy
    of it in that dtype to decode with, and the (copy, policy) parameter lists that :meth:`HFEngine.sync_from`
    refreshes it from; None when the engine decodes with the policy itself (no autocast: CPU, FSDP2, bf16 weights;
    LoRA).

    Decoding reads every weight once per token, so float32 weights would double its memory traffic and rule out
    the bf16 CUDA-graph step; the copy costs 2 bytes per parameter. Buffers (rotary frequencies) are shared, and
    tied weights stay tied (``deepcopy``'s memo maps each parameter once). The policy is a plain module (what the
    trainer adds lives in its runner, fastgrpo.distributed.runner), so the copy is the module as it is."""
    params = list(model.parameters())
    if autocast_dtype is None or is_lora(model) or not params or all(p.dtype == autocast_dtype for p in params):
        return None
    with torch.no_grad():
        memo = {id(p): nn.Parameter(p.detach().to(autocast_dtype) if p.is_floating_point() else p.detach().clone(),
                                    requires_grad=False) for p in params}
        memo.update({id(b): b for b in model.buffers()})
        copy = deepcopy(model, memo)
    copy.eval()
    return copy, [memo[id(p)] for p in params], params


def _chunk_generator(seed: int | None, chunk: int, device: torch.device) -> torch.Generator:
    """The random stream of chunk ``chunk`` of a call: from ``(seed, chunk)`` alone, so a chunk's draws do not
    depend on how many steps the chunks before it ran (which the finish check's interval decides); fresh entropy
    when ``seed`` is None. The global RNG is never touched."""
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        digest = hashlib.blake2b(f"{seed}:{chunk}".encode(), digest_size=8).digest()
        generator.manual_seed(int.from_bytes(digest, "little") >> 1)
    return generator


def _graphs_on(device: torch.device) -> bool:
    """Whether the lean step is captured in a CUDA graph on ``device`` (CUDA graphs exist on CUDA only)."""
    return device.type == "cuda"


def _eos_ids(model: nn.Module, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's EOS id(s) and the tokenizer's EOS."""
    ids: set[int] = set()
    gen_cfg = getattr(model, "generation_config", None)
    for source in (getattr(gen_cfg, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                   tokenizer.eos_token_id):
        if source is None:
            continue
        ids.update([source] if isinstance(source, int) else source)
    if not ids:
        raise ValueError("HFEngine: neither the model nor the tokenizer defines an EOS token")
    return sorted(ids)


def sample_next(logits: torch.Tensor, sampling: SamplingParams,
                generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick the next token of each row; return (tokens [N], sampler log-probs [N] float32).

    logits: [N, V]. temperature == 0 is greedy. Otherwise the token is drawn from ``softmax(logits / T)`` restricted
    to the kept set of ``top_k`` and ``top_p`` and renormalised (:mod:`fastgrpo.rollout.truncation`).

    Drawing: one uniform number per row, inverted through the cumulative distribution (``sample_rows``);
    ``torch.multinomial`` draws V exponential numbers per row, 0.7 s per step for 64 rows at V=152k on a CPU.

    Reported log-prob: ``log q(x)``, the log-prob of the chosen token under the distribution it was drawn from
    (renormalised over the kept set; vLLM's ``processed_logprobs``), so every engine reports the same number. For
    greedy (T == 0) it is ``log_softmax(logits)`` of the argmax, untruncated. Non-finite logits (NaN, +inf, or every
    token at -inf) make it non-finite; :meth:`HFEngine.generate` turns that into an error after the chunk.
    """
    logits = logits.float()
    if sampling.temperature == 0:
        logp = torch.log_softmax(logits, dim=-1)  # [N, V]
        tokens = logits.argmax(dim=-1)
        return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
    logp = torch.log_softmax(logits / sampling.temperature, dim=-1)  # [N, V]
    u = torch.rand(logp.shape[0], 1, generator=generator, device=logp.device)  # [N, 1]
    probs, order = kept_probs(logp, sampling.top_k, sampling.top_p)  # [N, K], [N, K] or None
    drawn = sample_rows(probs, u)  # [N]
    if order is None:
        return drawn, logp.gather(-1, drawn[:, None]).squeeze(-1)
    tokens = order.gather(-1, drawn[:, None]).squeeze(-1)  # [N]
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1) - probs.sum(dim=-1).log()


_SAMPLE_BLOCK = 512


def sample_rows(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Index [N] drawn from each row of ``weights [N, V]`` (>= 0, not necessarily normalised) by inverting its
    cumulative sum at ``u [N, 1]`` (uniform in [0, 1)): the first index whose cumulative weight exceeds
    ``u * total``, so a zero-weight index is never drawn.

    Two levels, so that no cumulative sum runs over the whole vocabulary: block sums ``[N, V / B]``, their cumulative
    sum picks a block, then the cumulative sum of that block alone picks the index. Each search is clamped below the
    level's total, so float rounding between the two levels cannot step past the last index of positive weight.
    """
    n, v = weights.shape
    nb = -(-v // _SAMPLE_BLOCK)
    if nb * _SAMPLE_BLOCK != v:
        weights = torch.nn.functional.pad(weights, (0, nb * _SAMPLE_BLOCK - v))  # zero weight: never drawn
    blocks = weights.view(n, nb, _SAMPLE_BLOCK)  # [N, nb, B]
    block_cum = blocks.sum(-1).cumsum(-1)  # [N, nb]
    target = _below(u * block_cum[:, -1:], block_cum[:, -1:])  # [N, 1]
    # [N, 1] block whose cumulative weight exceeds target; a row whose weights are NaN or sum to 0 or inf (non-finite
    # logits) searches past its last block: the clamps keep its index in the row (the draw is meaningless there, and
    # the caller sees the non-finite log-prob and raises)
    b = torch.searchsorted(block_cum, target, right=True).clamp_(max=nb - 1)
    before = torch.where(b > 0, block_cum.gather(1, (b - 1).clamp(min=0)), 0.0)  # [N, 1]
    # Indexing, not gather with an expanded index: the same values, 2-3x faster on a CPU.
    inner_cum = blocks[torch.arange(n, device=weights.device), b[:, 0]].cumsum(-1)  # [N, B]
    j = torch.searchsorted(inner_cum, _below(target - before, inner_cum[:, -1:]), right=True)  # [N, 1]
    return (b * _SAMPLE_BLOCK + j).squeeze(1).clamp_(max=v - 1)


def _below(x: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
    """``x`` clamped to [0, the largest float below ``total``]."""
    return torch.minimum(x.clamp(min=0.0), torch.nextafter(total, torch.zeros_like(total)))


@contextlib.contextmanager
def _decoding_attention(model: nn.Module) -> Iterator[None]:
    """Decode with the attention implementation the backend table names for decoding (sdpa for a model that
    trains with flex_attention), restoring the training one afterwards."""
    impl = getattr(model.config, "_attn_implementation", None)
    decode = decoding_attn_implementation(impl)
    if decode == impl or not hasattr(model, "set_attn_implementation"):
        yield
        return
    model.set_attn_implementation(decode)
    try:
        yield
    finally:
        model.set_attn_implementation(impl)


@section_check(HFRolloutConfig)
def check_hf_options(opt: HFRolloutConfig, p: str) -> None:
    check(opt.batch_size >= 1, f"{p}.batch_size", f"must be >= 1, got {opt.batch_size}")


@register_engine("hf")
class HFEngine(RolloutEngine):
    """Generates with the policy module itself (single process or FSDP2, no copy of the weights), or, on one plain
    GPU with float32 masters, with a bf16 copy refreshed by :meth:`sync_from` after each step (:func:`decode_copy`).

    Under torch.distributed every rank must call :meth:`generate` with the same number of sequences and the
    same max_tokens: the decode loop runs until *all* ranks are done, because an FSDP2-sharded forward is a
    collective. FSDP2's gathered parameters are freed after each call.
    """

    def __init__(self, model: nn.Module, tokenizer, options: HFRolloutConfig | None = None, *,
                 autocast_dtype: torch.dtype | None = None, **values):
        """``options``: the ``rollout.hf`` section; keyword ``values`` (``batch_size=8``, ``decode="lean"``) replace
        its fields. Checked by the section's own checks (ValueError naming ``rollout.hf.<field>``).
        ``autocast_dtype``: the dtype the policy computes in under autocast (its runner's, one plain GPU with
        float32 weights), None for none: the engine decodes with a copy in that dtype, or (LoRA) under autocast."""
        options = check_section(dataclasses.replace(options or HFRolloutConfig(), **values), "rollout.hf")
        self.decode = options.decode
        self.batch_size = options.batch_size
        self.cuda_graph = options.cuda_graph
        copy = decode_copy(model, autocast_dtype)  # one plain GPU with float32 masters: decode with a bf16 copy
        self.model = model if copy is None else copy[0]
        # a LoRA policy on one plain GPU decodes itself under autocast; a decode copy is already in that dtype
        self.autocast_dtype = autocast_dtype if copy is None else None
        self._copy_params, self._policy_params = (None, None) if copy is None else copy[1:]
        self.tokenizer = tokenizer
        self.eos_ids = _eos_ids(model, tokenizer)
        pad = tokenizer.pad_token_id
        self.pad_id = pad if pad is not None else self.eos_ids[0]  # any id works: pad positions are masked
        # Only the last position's logits are needed; skip the [N, P, V] prefill logits where supported.
        self._logits_to_keep = "logits_to_keep" in inspect.signature(model.forward).parameters
        text_config = model.config.get_text_config() if hasattr(model, "config") else None
        self.max_positions: int | None = getattr(text_config, "max_position_embeddings", None)
        """The model's positions: no request runs past them (transformers would only warn, on untrained
        positions). The trainer checks the dataset's prompts before the model loads; this catches the prompts
        that exist only at run time (an environment's first message, a long conversation)."""

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> "HFEngine":
        return cls(setup.model, setup.tokenizer, setup.cfg.hf, autocast_dtype=setup.autocast_dtype)

    def sync_from(self, model: nn.Module) -> bool:
        """Refresh the decode copy from the policy (one multi-tensor copy); False when the engine decodes with the
        policy module itself (nothing to copy)."""
        if self._copy_params is None:
            return False
        params = list(model.parameters())
        if len(params) != len(self._policy_params) or any(a is not b for a, b in zip(params, self._policy_params)):
            raise ValueError("HFEngine.sync_from: not the policy this engine's decode copy was made from")
        with torch.no_grad():
            torch._foreach_copy_(self._copy_params, params)
        return True

    # -- RolloutEngine ----------------------------------------------------------------------------------------

    def check_positions(self, prompts: list[list[int]], max_tokens: int) -> None:
        """ContextError unless the longest prompt + ``max_tokens`` fits the model's positions."""
        longest = max(map(len, prompts), default=0)
        if self.max_positions and longest + max_tokens > self.max_positions:
            raise ContextError(f"a prompt of {longest} tokens + {max_tokens} new tokens (rollout.max_completion_length"
                               f" or what a trajectory has left of it) = {longest + max_tokens} positions, more than "
                               f"the model's {self.max_positions} (max_position_embeddings)")

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        self.check_request(prompts, n, sampling)
        self.check_positions(prompts, sampling.max_tokens)
        seqs = [p for p in prompts for _ in range(n)]  # prompt-major: sequence b*n + j is sample j of prompt b
        device = self._device()
        was_training = self.model.training
        self.model.eval()
        lean = self.lean_decoder()
        flat: list[Completion] = []
        dtype = self.autocast_dtype
        amp = torch.autocast(device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
        try:
            with torch.no_grad(), amp, _decoding_attention(self.model):
                for chunk, start in enumerate(range(0, len(seqs), self.batch_size)):
                    generator = _chunk_generator(sampling.seed, chunk, device)
                    flat += self._generate_chunk(seqs[start:start + self.batch_size], sampling, generator, device,
                                                 lean, first_row=start, n=n)
        finally:
            self.model.train(was_training)
            _reshard(self.model)
        return [flat[b * n:(b + 1) * n] for b in range(len(prompts))]

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy the given tensors into the live model by Hugging Face name.

        The engine generates with the policy itself, so the trainer's own parameters need no copy (a tensor
        that *is* the model's storage is skipped); tensors from elsewhere (another model object, a checkpoint)
        are copied in place; into an FSDP2-sharded model each rank copies its shard of the full tensor.
        Unknown names and shape mismatches raise, naming the tensor.
        """
        _reshard(self.model)
        own = dict(self.model.named_parameters(remove_duplicate=False))
        own.update(self.model.named_buffers(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in named_tensors:
                if name not in own:
                    raise KeyError(f"update_weights: the model has no tensor named {name!r}")
                target = own[name]
                if tuple(target.shape) != tuple(tensor.shape):
                    raise ValueError(f"update_weights: {name} has shape {tuple(tensor.shape)}, "
                                     f"the model's is {tuple(target.shape)}")
                if tensor is target:
                    continue
                if _is_dtensor(target) and not _is_dtensor(tensor):
                    # FSDP2-sharded policy: every rank holds the full tensor and keeps its own shard of it.
                    # src_data_rank=None (torch >= 2.7) slices locally instead of scattering from rank 0.
                    from torch.distributed.tensor import distribute_tensor

                    local = {"src_data_rank": None} if "src_data_rank" in inspect.signature(
                        distribute_tensor).parameters else {}
                    tensor = distribute_tensor(tensor.to(target.device, target.dtype), target.device_mesh,
                                               target.placements, **local)
                    target.to_local().copy_(tensor.to_local())
                elif tensor.data_ptr() != target.data_ptr():
                    target.copy_(tensor)

    # -- decode loop ------------------------------------------------------------------------------------------

    def lean_decoder(self) -> LeanDecoder | None:
        """The lean decode step for this call, or None for transformers' forward (decided per call: the model may
        have been sharded or hooked since the last one)."""
        if self.decode == "transformers":
            return None
        reason = lean_unsupported_reason(self.model)
        if reason is not None and self.decode == "lean":
            raise ValueError(f"rollout.hf.decode=lean: {reason}; use 'auto' or 'transformers'")
        return None if reason is not None else LeanDecoder(self.model)

    def _device(self) -> torch.device:
        return next(self.model.parameters()).device

    def _forward_last(self, ids, mask, pos, cache):
        """One forward; returns (logits of the last position [N, V], cache)."""
        kwargs = {"logits_to_keep": 1} if self._logits_to_keep else {}
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache,
                         use_cache=True, **kwargs)
        return out.logits[:, -1], out.past_key_values

    def _generate_chunk(self, seqs: list[list[int]], sampling: SamplingParams, generator: torch.Generator,
                        device: torch.device, lean: LeanDecoder | None, *, first_row: int = 0,
                        n: int = 1) -> list[Completion]:
        """The completions of ``seqs`` (sequences ``first_row ...`` of a call with ``n`` samples per prompt).

        Each prompt of the chunk is prefilled once (U rows, U <= N) and its KV cache, positions and last logits are
        fanned out to its samples (:func:`_fan_out`); the decode steps then run on the N rows."""
        N, P = len(seqs), max(len(s) for s in seqs)
        firsts, fan_out = _fan_out(first_row, N, n)  # U first rows of the chunk's prompts; [N] row -> its prompt
        U = len(firsts)
        ids = torch.full((U, P), self.pad_id, dtype=torch.long)  # [U, P] left-padded
        mask = torch.zeros((U, P), dtype=torch.long)  # [U, P]
        for i, row in enumerate(firsts):
            s = seqs[row]
            ids[i, P - len(s):] = torch.tensor(s, dtype=torch.long)
            mask[i, P - len(s):] = 1
        max_len = P + sampling.max_tokens
        full_mask = torch.ones((N, max_len), dtype=torch.long)  # [N, P + max_tokens]: step t reads [:, :P + t]
        full_mask[:, :P] = mask[fan_out]
        ids, full_mask = ids.to(device), full_mask.to(device)
        pos = (full_mask[:, :P].cumsum(-1) - 1).clamp(min=0)  # [N, P] positions of real tokens start at 0
        eos = torch.tensor(self.eos_ids, device=device)
        check_every = finish_check_every(device)

        tokens, logps, peaks = [], [], []  # T tensors of [N]
        finished = torch.zeros(N, dtype=torch.bool, device=device)  # [N]
        cache = preallocated_kv_cache(self.model, max_len)  # None: transformers' default cache
        rows = torch.tensor(firsts, device=device)  # [U]
        logits, cache = self._forward_last(ids, full_mask[rows, :P], pos[rows], cache)  # [U, V]
        if U < N:
            index = fan_out.to(device)  # [N]
            logits = logits[index]  # [N, V]
            cache.batch_select_indices(index)  # [U, ...] -> [N, ...] per layer
        next_pos = pos[:, -1:] + 1  # [N, 1]
        graphed = None
        if lean is not None:
            static = self.cuda_graph and _graphs_on(device)
            lean.start(cache, full_mask, max_position=P + sampling.max_tokens, static=static)
            cache = None  # the lean step keeps its own copy of the keys: free transformers' key buffers
            if static:
                graphed = GraphedStep(lean, N, device)
                slots = torch.arange(P, max_len, device=device)  # [max_tokens]: step t writes slot P + t
        for step in range(sampling.max_tokens):
            peaks.append(logits.amax(dim=-1))  # [N] NaN, +inf or -inf exactly when the row's logits say which
            tok, logp = sample_next(logits, sampling, generator)  # [N], [N]
            tok = tok.masked_fill(finished, self.pad_id)  # rows already done emit padding, stripped below
            tokens.append(tok)
            logps.append(logp)
            finished |= torch.isin(tok, eos)
            if step + 1 == sampling.max_tokens or ((step + 1) % check_every == 0 and self._all_finished(finished)):
                break
            if graphed is not None:
                logits = graphed(tok, next_pos[:, 0], slots[step:step + 1])
            elif lean is not None:
                logits = lean.step(tok, next_pos[:, 0], slot=P + step)
            else:
                logits, cache = self._forward_last(tok[:, None], full_mask[:, :P + step + 1], next_pos, cache)
            next_pos = next_pos + 1
        tokens, logps = torch.stack(tokens, 1), torch.stack(logps, 1)  # [N, T] each
        completions, bad = self._to_completions(tokens, logps, eos, sampling.logprobs)
        if bad is not None:
            row, step = bad
            raise NonFiniteError(_non_finite_message(float(peaks[step][row]), step, first_row + row, n))
        return completions

    def _all_finished(self, finished: torch.Tensor) -> bool:
        """True when every sequence on every rank is done (FSDP2 forwards are collectives: stop together)."""
        done = finished.all().to(torch.int32)
        if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def _to_completions(self, tokens: torch.Tensor, logps: torch.Tensor, eos: torch.Tensor,
                        want_logprobs: bool) -> tuple[list[Completion], tuple[int, int] | None]:
        """tokens, logps: [N, T] -> completions cut after the first EOS (kept), padding dropped; and the (row, step)
        of the first token drawn from non-finite logits (its log-prob is not finite: a drawn token has probability >
        0), None when there is none. The check rides on the host read of the EOS positions (no sync of its own)."""
        is_eos = torch.isin(tokens, eos)  # [N, T]
        T = tokens.shape[1]
        first = torch.where(is_eos.any(-1), is_eos.int().argmax(-1), T)  # [N] index of the first EOS, or T
        live = torch.arange(T, device=tokens.device) <= first[:, None]  # [N, T] the tokens a completion keeps
        bad = ~torch.isfinite(logps) & live  # [N, T]
        bad_step = torch.where(bad.any(-1), bad.int().argmax(-1), -1)  # [N] first bad step of each row, or -1
        first, bad_step = torch.stack((first, bad_step)).tolist()
        tokens, logps = tokens.tolist(), logps.tolist()
        bad_rows = [i for i, t in enumerate(bad_step) if t >= 0]
        if bad_rows:
            row = min(bad_rows, key=lambda i: (bad_step[i], i))  # the earliest step, then the first row
            return [], (row, bad_step[row])
        kept = [row[:f + 1] for row, f in zip(tokens, first)]
        texts = self.tokenizer.batch_decode(kept, skip_special_tokens=True)
        return [
            Completion(token_ids=ids, text=text, finish_reason="stop" if f < T else "length",
                       logprobs=lp[:f + 1] if want_logprobs else None)
            for ids, text, f, lp in zip(kept, texts, first, logps)
        ], None


def _fan_out(first_row: int, num_rows: int, n: int) -> tuple[list[int], torch.Tensor]:
    """Rows ``first_row ... first_row + num_rows - 1`` of a call's prompt-major sequences (row r is sample ``r % n``
    of prompt ``r // n``): the chunk-local first row of each prompt in the chunk [U], and each row's prompt among
    those [num_rows] (a chunk may start or end inside a prompt's samples)."""
    prompt = torch.arange(first_row, first_row + num_rows) // n  # [N]
    index = prompt - prompt[0]  # [N] 0 .. U - 1, non-decreasing
    firsts = torch.searchsorted(index, torch.arange(int(index[-1]) + 1)).tolist()  # [U]
    return firsts, index


def _non_finite_message(peak: float, step: int, row: int, n: int) -> str:
    """The one-line error for a row whose logits at decode ``step`` had ``peak`` (their maximum) non-finite."""
    what = ("NaN" if peak != peak else "+inf" if peak == float("inf") else
            "-inf everywhere (every token masked)" if peak == float("-inf") else
            f"finite (the largest {peak:.3g}) but not once divided by the temperature")
    return (f"rollout: the policy's logits were not finite at decode step {step} of sequence {row} (prompt {row // n}, "
            f"sample {row % n}): {what}; the weights or the forward overflowed: lower optim.lr, keep "
            "optim.max_grad_norm > 0, or compute in float32 (model.dtype, parallel.param_dtype)")
