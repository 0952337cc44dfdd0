"""The in-process (colocated) vLLM rollout engine: one ``vllm.LLM`` per rank, inside the trainer's process.

Legend: B prompts, G (= n) completions per prompt, L completion length.

Colocation as in TRL's colocate mode and verl: every rank builds its own engine (tensor parallel size 1; with
torchrun, vLLM's ``external_launcher`` backend joins the trainer's process group instead of spawning workers),
generates for its own prompts, and receives new weights from the policy through an in-process call, with no
copy through disk or sockets. The engine runs with ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` so that call really
is in-process.

Departures from a plain ``vllm.LLM``, each for a reason:

- Log-probs: ``logprobs_mode='processed_logprobs'``, i.e. after temperature, top-k and top-p, renormalised over the
  kept set: the distribution the token was actually drawn from, the definition every engine reports
  (:mod:`fastgrpo.rollout.truncation`; the hf engine computes the same). The trainer renormalises its own log-probs
  over its own kept set before the importance ratio (the ``raw_*`` modes are before temperature, so they could not
  give the untruncated log-prob at T != 1).
- Weight sync: layer-aligned buckets (:mod:`fastgrpo.rollout.weight_sync`), then the prefix cache is reset
  (its KV entries were computed with the old weights). On CPU each bucket goes through vLLM's
  ``reload_weights`` (it re-runs the CPU backend's weight repacking, which a bare ``load_weights`` skips); with
  tied embeddings the CPU backend's prepacked lm_head is rebuilt too, because vLLM only reloads the embedding.
- LoRA policies (``fastgrpo.models.lora``): by default the engine receives merged weights (``W + scale * B @ A``, one layer
  at a time, the policy untouched) and decodes a plain model. With ``lora_rank > 0`` (``rollout.vllm.lora_sync=adapter``)
  it runs vLLM's LoRA support instead: a sync writes the adapters (a few MB) to a folder of this rank and loads
  them as a new LoRA id; every generate() applies it.
- CPU: vLLM re-seeds the global torch RNG and replaces ``torch.set_num_threads`` while it builds; both are
  restored so the trainer in the same process is unaffected. Generation runs with one torch thread (vLLM's
  serving setting: on a small CPU two threads made decoding several times slower), then the trainer's count
  comes back.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from fastgrpo.config import RolloutConfig, TrainConfig, VLLMRolloutConfig, check_section
from fastgrpo.config.loader import check, section_check
from fastgrpo.models.policy_state import clean_param_name, is_lora, iter_full_tensors
from fastgrpo.rollout.base import Completion, EngineSetup, RolloutEngine, SamplingParams, register_engine
from fastgrpo.rollout.vllm_support import (WEIGHT_LOADERS, check_vllm_available, head_dim_of, import_vllm,
                                           preserve_process_state, read_hf_config, worker_refresh_tied_head)
from fastgrpo.rollout.weight_sync import bucket_by_layer, tensor_bytes

__all__ = ["VLLMEngine", "import_vllm"]

log = logging.getLogger(__name__)

_GIB = 1 << 30

_VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's accepted max_lora_rank values


@section_check(VLLMRolloutConfig)
def check_vllm_options(opt: VLLMRolloutConfig, p: str) -> None:
    check(0 < opt.gpu_memory_utilization < 1, f"{p}.gpu_memory_utilization",
          f"must be in (0, 1), got {opt.gpu_memory_utilization}")
    check(opt.max_model_len is None or opt.max_model_len >= 2, f"{p}.max_model_len",
          f"must be >= 2 or null, got {opt.max_model_len}")
    check(opt.sync_bucket_mb >= 1, f"{p}.sync_bucket_mb", f"must be >= 1, got {opt.sync_bucket_mb}")


@section_check(RolloutConfig)
def check_vllm_context(r: RolloutConfig, p: str) -> None:
    """With the vllm engine, the context holds the prompt and the completion."""
    check(r.engine != "vllm" or r.vllm.max_model_len is None or r.max_completion_length < r.vllm.max_model_len,
          f"{p}.max_completion_length",
          f"{r.max_completion_length} leaves no room for a prompt in {p}.vllm.max_model_len={r.vllm.max_model_len} "
          f"(the engine's context holds the prompt and the completion): raise {p}.vllm.max_model_len or leave it null")


@section_check(TrainConfig)
def check_vllm_lora_sync(cfg: TrainConfig, p: str) -> None:
    """lora_sync 'adapter' sends the adapters only: modules trained in full beside them would never reach vLLM."""
    check(not (cfg.model.lora.modules_to_save and cfg.rollout.engine == "vllm"
               and cfg.rollout.vllm.lora_sync == "adapter"), "rollout.vllm.lora_sync",
          "'adapter' sends the LoRA matrices only, not model.lora.modules_to_save: use 'merged'")


@register_engine("vllm")
class VLLMEngine(RolloutEngine):
    """Colocated vLLM engine (one per rank); see the module docstring.

    Args:
        model_path: local Hugging Face folder of the policy (config.json, weights, tokenizer).
        options: the ``rollout.vllm`` section (:class:`fastgrpo.config.VLLMRolloutConfig`: memory share, context
            length (None here = the model's maximum), prefix caching, sleep level (at 2 a full
            :meth:`update_weights` must come before :meth:`wake`), sync bucket size, eager mode); keyword
            ``values`` of the same names replace its fields. Checked by the section's own checks.
        tokenizer: tokenizer folder, or a tokenizer object (its ``name_or_path`` is used); default model_path.
        seed: base seed; the engine is seeded with ``seed + rank`` so ranks sample differently.
        dtype: engine dtype ('auto' = the checkpoint's, 'float32', 'bfloat16', ...); synced tensors are cast
            to it before they are sent.
        rank, world_size: this process's place under torchrun; world_size > 1 needs torchrun's environment
            and uses vLLM's ``external_launcher`` backend.
        weight_loader: 'auto' ('reload' on CPU, 'load' on CUDA), 'reload' (``reload_weights`` RPC) or 'load'
            (``model.load_weights`` on the worker, unquantized CUDA models).
        lora_rank: 0 = LoRA policies are synced merged; r > 0 = the engine serves one LoRA adapter of rank <= r
            and :meth:`sync_from` sends a LoRA policy's adapters only.

    Attributes:
        last_sync_seconds, last_sync_bytes: wall time and bytes of the latest :meth:`update_weights`.
        max_model_len: the engine's context length.
    """

    def __init__(self, model_path: str | Path, options: VLLMRolloutConfig | None = None, *, tokenizer: Any = None,
                 seed: int = 0, dtype: str = "auto", rank: int = 0, world_size: int = 1, weight_loader: str = "auto",
                 lora_rank: int = 0, **values):
        # 1. Arguments (cheap, before anything is imported or allocated).
        opt = check_section(dataclasses.replace(options or VLLMRolloutConfig(), **values), "rollout.vllm")
        gpu_memory_utilization = opt.gpu_memory_utilization
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if lora_rank < 0:
            raise ValueError(f"lora_rank: must be >= 0, got {lora_rank}")
        if weight_loader not in ("auto", *WEIGHT_LOADERS):
            raise ValueError(f"weight_loader: must be auto, reload or load, got {weight_loader!r}")
        if world_size > 1 and (os.environ.get("WORLD_SIZE") != str(world_size)
                               or os.environ.get("RANK") != str(rank)):
            raise ValueError(f"world_size={world_size} needs torchrun's environment (RANK={rank}, "
                             f"WORLD_SIZE={world_size}); got RANK={os.environ.get('RANK')}, "
                             f"WORLD_SIZE={os.environ.get('WORLD_SIZE')}")
        model_path = str(model_path)
        hf_cfg = read_hf_config(model_path)
        on_cuda = torch.cuda.is_available()
        head_dim = head_dim_of(hf_cfg)
        if not on_cuda and head_dim is not None and head_dim < 32:
            raise ValueError(f"rollout.engine=vllm: head_dim {head_dim} of {model_path!r} is below 32, which "
                             "vLLM's CPU attention backend does not support; use rollout.engine=hf")

        # 2. vLLM itself, and what it can run.
        vllm = import_vllm()
        from vllm.model_executor.models import ModelRegistry

        archs = hf_cfg.get("architectures") or []
        supported = set(ModelRegistry.get_supported_archs())
        if not any(a in supported for a in archs):
            raise ValueError(f"rollout.engine=vllm: vLLM {vllm.__version__} does not support the architecture "
                             f"{archs or '(none in config.json)'} of {model_path!r}; use rollout.engine=hf")
        if on_cuda:
            free, total = torch.cuda.mem_get_info()
            if gpu_memory_utilization * total > free:
                raise ValueError(
                    f"rollout.vllm.gpu_memory_utilization={gpu_memory_utilization}: the engine would take "
                    f"{gpu_memory_utilization * total / _GIB:.1f} GiB but only {free / _GIB:.1f} of "
                    f"{total / _GIB:.1f} GiB are free (the policy and optimizer are already on the GPU); "
                    f"lower it to at most {free / total:.2f}")

        if isinstance(tokenizer, (str, Path)):
            tokenizer_path = str(tokenizer)
        elif tokenizer is not None and Path(str(getattr(tokenizer, "name_or_path", ""))).is_dir():
            tokenizer_path = str(tokenizer.name_or_path)
        else:
            tokenizer_path = model_path

        from vllm.inputs import TokensPrompt

        self._vllm = vllm
        self._tokens_prompt = TokensPrompt
        self.on_cuda = on_cuda
        self.rank, self.world_size = rank, world_size
        self.sleep_level = opt.sleep_level
        self.sync_bucket_bytes = opt.sync_bucket_mb << 20
        self.tied_embeddings = bool(hf_cfg.get("tie_word_embeddings", False))
        self._load = WEIGHT_LOADERS[weight_loader if weight_loader != "auto" else ("load" if on_cuda else "reload")]
        self._refresh_head = self.tied_embeddings and not on_cuda
        self._sleeping: set[str] = set()
        self._synced_since_sleep = False
        self.last_sync_seconds = 0.0
        self.last_sync_bytes = 0

        # 3. The engine.
        kwargs: dict[str, Any] = dict(
            tokenizer=tokenizer_path, dtype=dtype, seed=seed + rank, tensor_parallel_size=1,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=opt.max_model_len,
            enable_prefix_caching=opt.enable_prefix_caching, logprobs_mode="processed_logprobs",
            enable_sleep_mode=on_cuda and opt.sleep_level > 0, enforce_eager=opt.enforce_eager,
        )
        if world_size > 1:
            kwargs["distributed_executor_backend"] = "external_launcher"
        self.lora_rank = lora_rank
        self._lora_request = None
        self._lora_dir: str | None = None
        if lora_rank:
            # vLLM sizes its LoRA buffers by max_lora_rank, which must be one of its supported ranks.
            kwargs.update(enable_lora=True, max_loras=1,
                          max_lora_rank=min((r for r in _VLLM_LORA_RANKS if r >= lora_rank), default=lora_rank))
        with preserve_process_state():
            self.llm = vllm.LLM(model_path, **kwargs)
        self.tokenizer = self.llm.get_tokenizer()
        self.max_model_len = int(self.llm.llm_engine.model_config.max_model_len)
        self.dtype = self.llm.llm_engine.model_config.dtype

    # -- lengths --------------------------------------------------------------------------------------------------

    @classmethod
    def check_available(cls) -> None:
        check_vllm_available()

    @classmethod
    def from_setup(cls, setup: EngineSetup) -> "VLLMEngine":
        r = setup.cfg
        model_path = setup.model_path()
        max_model_len = r.vllm.max_model_len
        if max_model_len is None:
            # A bound, not the exact longest prompt: finding that would tokenize every row of both splits at
            # start-up. A larger context costs vLLM nothing until it is used (KV blocks are allocated per
            # request); the model's own limit caps it, and generate() checks every request against it.
            text_cfg = read_hf_config(model_path)
            text_cfg = text_cfg.get("text_config", text_cfg)
            max_model_len = setup.prompt_token_bound() + r.max_completion_length
            if text_cfg.get("max_position_embeddings"):
                max_model_len = min(max_model_len, int(text_cfg["max_position_embeddings"]))

        lora_rank = 0
        if r.vllm.lora_sync == "adapter" and is_lora(setup.model):
            lora_rank = max(c.r for c in setup.model.peft_config.values())
        # The engine adds the rank to the seed itself (ranks sample differently): pass the run's seed.
        engine = cls(model_path, r.vllm, max_model_len=max_model_len, tokenizer=setup.tokenizer, seed=setup.seed,
                     lora_rank=lora_rank, rank=setup.rank, world_size=setup.world_size)
        engine.derived_context = r.vllm.max_model_len is None
        return engine

    derived_context = False
    """The context was derived at start-up (rollout.vllm.max_model_len null): the longest dataset prompt's bound +
    rollout.max_completion_length, at most the model's max_position_embeddings."""

    def check_lengths(self, prompt_len: int, max_completion_length: int) -> None:
        """Raise ValueError unless a ``prompt_len``-token prompt plus ``max_completion_length`` new tokens fit
        in the engine's context (every :meth:`generate` checks its longest prompt)."""
        if prompt_len + max_completion_length > self.max_model_len:
            need = (f"the longest prompt ({prompt_len} tokens) + rollout.max_completion_length "
                    f"({max_completion_length}) = {prompt_len + max_completion_length}")
            if self.derived_context:  # null already: the bound it was derived from is what this prompt exceeds
                raise ValueError(
                    f"the vLLM engine's context ({self.max_model_len} tokens, derived at start-up from the dataset's "
                    f"prompts since rollout.vllm.max_model_len is null, at most the model's max_position_embeddings) "
                    f"is shorter than {need} (a prompt made at run time, e.g. an environment's first message?); set "
                    "rollout.vllm.max_model_len to what it needs, within the model's positions, or shorten the prompt")
            raise ValueError(f"rollout.vllm.max_model_len={self.max_model_len} is shorter than {need}; raise "
                             "rollout.vllm.max_model_len (or leave it null)")

    # -- RolloutEngine --------------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        self.check_request(prompts, n, sampling)
        if not prompts:
            return []
        self.check_lengths(max(len(p) for p in prompts), sampling.max_tokens)
        if self._sleeping:
            raise RuntimeError("generate() on a sleeping engine: call wake() first")
        # vLLM gives sample j of a seeded request the seed `seed + j`; prompt b starts at `seed + b * n` so
        # that no two samples of one call share a seed.
        params = [self._vllm.SamplingParams(
            n=n, temperature=sampling.temperature, top_p=sampling.top_p, top_k=sampling.top_k,
            max_tokens=sampling.max_tokens,
            seed=None if sampling.seed is None else sampling.seed + b * n,
            logprobs=0 if sampling.logprobs else None,  # 0: only the sampled token's log-prob
            # Text is decoded here in one batch, as the transformers engine does: vLLM's incremental
            # detokenizer holds back a trailing incomplete UTF-8 character, so the two would disagree.
            detokenize=False,
        ) for b in range(len(prompts))]
        requests = [self._tokens_prompt(prompt_token_ids=list(p)) for p in prompts]
        with self._generation_threads():
            outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self._lora_request)
        samples = [c for out in outputs for c in sorted(out.outputs, key=lambda c: c.index)]  # [B * n]
        texts = self.tokenizer.batch_decode([list(c.token_ids) for c in samples], skip_special_tokens=True)
        flat = [self._completion(c, text, sampling.logprobs) for c, text in zip(samples, texts)]
        return [flat[b * n:(b + 1) * n] for b in range(len(prompts))]

    @staticmethod
    def _completion(c, text: str, want_logprobs: bool) -> Completion:
        if c.finish_reason not in ("stop", "length"):
            raise RuntimeError(f"vLLM finished a completion with reason {c.finish_reason!r}")
        token_ids = list(c.token_ids)
        logprobs = None
        if want_logprobs:
            # One dict per position holding at least the sampled token (logprobs=0 asks for nothing else).
            logprobs = [float(pos[tok].logprob) for pos, tok in zip(c.logprobs, token_ids)]
        return Completion(token_ids=token_ids, text=text, finish_reason=c.finish_reason, logprobs=logprobs)

    @contextlib.contextmanager
    def _generation_threads(self) -> Iterator[None]:
        if self.on_cuda:
            yield
            return
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def update_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Stream ``(hf_name, full_tensor)`` pairs into the engine, one layer-aligned bucket per call.

        Names may carry wrapper parts (activation checkpointing, compile); they are removed. With tied
        embeddings ``lm_head.weight`` is skipped (vLLM reads the embedding). Tensors are cast to the engine's
        dtype. Afterwards the prefix cache is reset, and ``last_sync_seconds`` / ``last_sync_bytes`` are set.
        A sleeping engine gets its weights back first (its KV cache stays released until :meth:`wake`).
        """
        start = time.perf_counter()
        if "weights" in self._sleeping:
            self._wake_up(["weights"])
            self._sleeping.discard("weights")
        sent = 0
        touched_embedding = False
        for bucket in bucket_by_layer(self._prepare(named_tensors), self.sync_bucket_bytes):
            self._load(self.llm, bucket)
            sent += sum(tensor_bytes(t) for _, t in bucket)
            touched_embedding |= any(name.endswith("embed_tokens.weight") for name, _ in bucket)
            del bucket  # drop this bucket's full tensors before the next one is gathered
        if self._refresh_head and touched_embedding:
            self.llm.collective_rpc(worker_refresh_tied_head)
        self.llm.reset_prefix_cache()
        self._synced_since_sleep = True
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_bytes = sent

    def sync_from(self, model: torch.nn.Module) -> bool:
        """Merged weights (the default), or with ``lora_rank > 0`` and a LoRA policy its adapters only."""
        if self.lora_rank and is_lora(model):
            self.update_adapter(model)
            return True
        return super().sync_from(model)

    def update_adapter(self, model: torch.nn.Module) -> None:
        """Send a LoRA policy's adapters: gather them (a collective under FSDP), write a peft folder of this rank,
        load it as a new LoRA id (the previous one is removed) and reset the prefix cache."""
        import tempfile

        start = time.perf_counter()
        if "weights" in self._sleeping:
            self._wake_up(["weights"])
            self._sleeping.discard("weights")
        adapters = {name: t for name, t in iter_full_tensors(model) if ".lora_" in name}
        if self._lora_dir is None:
            self._lora_dir = tempfile.mkdtemp(prefix=f"fastgrpo_lora_rank{self.rank}_")
        model.save_pretrained(self._lora_dir, state_dict=adapters, safe_serialization=True)
        from vllm.lora.request import LoRARequest

        old = self._lora_request
        new_id = 1 if old is None else old.lora_int_id + 1
        self._lora_request = LoRARequest(f"policy{new_id}", new_id, self._lora_dir)
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
        self.llm.llm_engine.add_lora(self._lora_request)  # loads now, so the load is part of the sync time
        self.llm.reset_prefix_cache()
        self._synced_since_sleep = True
        self.last_sync_seconds = time.perf_counter() - start
        self.last_sync_bytes = sum(tensor_bytes(t) for t in adapters.values())

    def _prepare(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        for name, t in named_tensors:
            name = clean_param_name(name)
            if self.tied_embeddings and name == "lm_head.weight":
                continue
            yield name, t.detach().to(self.dtype).contiguous()

    def sleep(self) -> None:
        """Release the engine's GPU memory for the policy update (vLLM sleep mode at ``sleep_level``)."""
        if not self._sleep_supported("sleep") or self._sleeping:
            return
        self.llm.sleep(level=self.sleep_level)
        self._sleeping = {"weights", "kv_cache"}
        self._synced_since_sleep = False

    def wake(self) -> None:
        """Re-acquire what :meth:`sleep` released; after level 2 the weights must have been synced since."""
        if not self._sleep_supported("wake") or not self._sleeping:
            return
        if self.sleep_level == 2 and not self._synced_since_sleep:
            raise RuntimeError("sleep_level=2 discarded the engine's weights: call update_weights() before wake()")
        self._wake_up(sorted(self._sleeping))
        self._sleeping.clear()

    def _wake_up(self, tags: list[str]) -> None:
        """vLLM's wake_up, after torch's allocator returned its cached blocks: the update's activations (their size
        is chosen while the engine sleeps, fastgrpo.update.microbatch) stay cached in torch otherwise, and the engine's
        weights and KV cache would not fit back."""
        if self.on_cuda:
            torch.cuda.empty_cache()
        self.llm.wake_up(tags=tags)

    def _sleep_supported(self, what: str) -> bool:
        if self.sleep_level == 0:
            return False
        if not self.on_cuda:
            if not getattr(self, "_logged_no_sleep", False):
                log.info("vLLM sleep mode is CUDA-only: %s() is a no-op on CPU", what)
                self._logged_no_sleep = True
            return False
        return True

    def close(self) -> None:
        """Shut the engine down. vLLM's teardown also destroys torch.distributed's default group, so under
        torchrun call this last."""
        llm = self.__dict__.pop("llm", None)
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()
        if getattr(self, "_lora_dir", None) is not None:
            import shutil

            shutil.rmtree(self._lora_dir, ignore_errors=True)
