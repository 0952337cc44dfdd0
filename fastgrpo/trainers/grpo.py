"""The GRPO loop: rollout -> rewards -> advantages -> packed policy update -> weight sync -> logs/eval/checkpoint.

Legend: S sequences on this rank, N completion tokens on this rank (flat layout), H hidden size, V vocab.

A "step" is one rollout batch. With ``grpo.num_iterations = mu > 1`` the batch is reused for mu optimizer updates
(the PPO-style inner loop of GRPO); the old log-probs are then computed once, before the first update.
"""

from __future__ import annotations

import dataclasses
import math

import torch

from fastgrpo.algorithms.interface import ModelSetup, StepInputs
from fastgrpo.algorithms.registry import ALGORITHMS
from fastgrpo.config import TrainConfig
from fastgrpo.data import build_datasets, render_prompt
from fastgrpo.data.sampler import PromptSampler
from fastgrpo.distributed import groups as fdist
from fastgrpo.distributed.parallelize import autocast_dtype, uses_fsdp
from fastgrpo.distributed.runner import AdapterDisabled, prepare_model
from fastgrpo.environments import ENV_REWARDS_COLUMN, build_environment
from fastgrpo.environments.trajectory import (ObservationRenderer, ToolsTemplate, TrajectoryEngine,
                                              collect_trajectories)
from fastgrpo.algorithms.episodes import Episodes, collect_episodes, record_metrics
from fastgrpo.trainers import preflight
from fastgrpo.trainers.evaluate import evaluate
from fastgrpo.trainers.loop import TrainingLoop, build_scheduler, closes_on_error  # noqa: F401 (public here too)
from fastgrpo.runtime.errors import NonFiniteError
from fastgrpo.runtime.metrics import StepMetrics, Timer, add_throughput, add_update_flops
from fastgrpo.runtime.peaks import device_peak_flops
from fastgrpo.runtime.step_cost import UpdateCost
from fastgrpo.update.bundle import TrainedModel
from fastgrpo.update.microbatch import auto_microbatch_tokens
from fastgrpo.models.loading import load_model, load_tokenizer, resolve_model_path
from fastgrpo.rewards import RewardRunner, check_reward_columns
from fastgrpo.rollout import EngineSetup, RolloutEngine, SamplingParams, build_engine
from fastgrpo.rollout.async_worker import AsyncRollout, Batch, RolloutWorkerError, split_threads, trained_parameters
from fastgrpo.algorithms.sampling import dynamic_sample


class Trainer(TrainingLoop):
    """Composes the components from a TrainConfig and runs the loop. ``run()`` returns the last metrics.

    ``engine``: a rollout engine to use instead of building ``rollout.engine`` (tests inject scripted ones).
    Preflight checks, resume, checkpoints and the step loop are :class:`fastgrpo.trainers.loop.TrainingLoop`'s.
    """

    progress_name = "grpo"
    resumable_errors = (RolloutWorkerError,)

    @closes_on_error
    def __init__(self, cfg: TrainConfig, engine: RolloutEngine | None = None) -> None:
        self._init_run(cfg)  # the launch and the run folder are checked there

        # Cheap checks first: data and rewards fail before any model loads.
        # plugin files are imported in a worker first (an exit or hang at import is a one-line error), then here;
        # rewards.kwargs are bound (and checked) here
        self.rewards = RewardRunner.from_config(cfg.rewards, max_completion_length=cfg.rollout.max_completion_length)
        with preflight.nested_data(cfg.data.source):
            self.train_rows, self.eval_rows, self.data_info = build_datasets(cfg.data)
        columns = {k for r in self.train_rows for k in r} - {cfg.data.prompt_column}
        if cfg.rollout.env.enabled:  # multi-turn: the environment's per-turn rewards are a column too
            columns.add(ENV_REWARDS_COLUMN)
        check_reward_columns(self.rewards.funcs, columns, source=cfg.data.source)
        self.rewards.wait_ready()
        # multi-turn: the environment's tools are imported (in a worker first) before any model loads
        self.env = build_environment(cfg.rollout.env) if cfg.rollout.env.enabled else None
        self.sampler = PromptSampler(len(self.train_rows), seed=cfg.data.seed, rank=self.rank,
                                     world_size=self.world_size)
        if self.is_main:
            preflight.warn_batch_above_data("grpo.prompts_per_step", cfg.grpo.prompts_per_step, self.world_size,
                                            len(self.train_rows))
        self._bounds: list[int] | None = None

        self.tokenizer = load_tokenizer(cfg.model, seed=cfg.seed)
        if preflight.engine_context(cfg):  # the engine's context, before the model and the engine load
            self.check_context(preflight.engine_context(cfg), "rollout.vllm.max_model_len")
        self.env_render = None if self.env is None else ObservationRenderer(self.tokenizer, self.env.tool_schemas)
        self.algorithm = ALGORITHMS[cfg.algorithm]  # what to build and how to update (the trainer has no branch)
        self._init_extras()  # before the policy: its resume restores them too
        self._init_model(total_updates=self.algorithm.policy_updates(cfg))
        self.ref_model = None
        if self.algorithm.needs_reference(cfg) and cfg.model.lora.enabled:  # the base: the same module, adapters off
            self.ref_model = AdapterDisabled(self.runner)
        elif self.algorithm.needs_reference(cfg):  # the frozen reference, sharded the same way, forward only
            ref = load_model(cfg.model, device=self.device, seed=cfg.seed).eval().requires_grad_(False)
            self.ref_model = prepare_model(ref, cfg.parallel, device=self.device, world_size=self.world_size)

        self.peak_flops = device_peak_flops(self.device)  # None off CUDA: no MFU, the FLOPs alone
        self.update_cost = UpdateCost.of(self.model)
        self._microbatch_tokens: int | None = None  # grpo.max_tokens_per_microbatch null on CUDA: sized at the 1st update

        self.prompt_cache: dict[int, tuple[str, list[int]]] = {}
        if engine is None:
            engine = build_engine(cfg.rollout.engine, EngineSetup(
                cfg=cfg.rollout, model=self.model, tokenizer=self.tokenizer, seed=cfg.seed, rank=self.rank,
                world_size=self.world_size, model_path=lambda: resolve_model_path(cfg.model, seed=cfg.seed),
                prompt_token_bound=self.prompt_token_bound, autocast_dtype=self.runner.autocast_dtype))
        self.engine = engine
        self.engine.sync_from(self.model)  # the policy may differ from the files the engine loaded (resume)
        self.async_rollout: AsyncRollout | None = None
        self._async_batch: Batch | None = None  # this step's batch from the worker (rollout.asynchronous)
        if cfg.rollout.asynchronous:
            self._start_async()

    def _init_extras(self) -> None:
        """The models the algorithm trains besides the policy (``Algorithm.extra_models``: PPO's critic), each with its
        own optimizer, schedule and guard; reachable as ``self.<name>`` and ``self.<name>_optimizer``."""
        setup = ModelSetup(cfg=self.cfg, device=self.device, world_size=self.world_size, dtype=self.master_dtype())
        self.extras: dict[str, TrainedModel] = {}
        for name, extra in self.algorithm.extra_models.items():
            self.extras[name] = bundle = extra.build(setup)
            setattr(self, name, bundle.model)
            setattr(self, f"{name}_optimizer", bundle.optimizer)

    def checkpoint_extras(self) -> dict:
        return {name: bundle.checkpoint_entry() for name, bundle in getattr(self, "extras", {}).items()}

    # ------------------------------------------------------------------------------------------------ async rollout

    def _start_async(self) -> None:
        """rollout.asynchronous: split the cores, start the generation worker, put back the batches a checkpoint
        saved, and request the first ones (docs/ASYNC.md has the schedule)."""
        r = self.cfg.rollout
        if self.world_size > 1:
            raise ValueError(f"rollout.asynchronous: one process only for now, this launch has {self.world_size} "
                             "ranks (set rollout.asynchronous=false)")
        if self.device.type != "cpu":
            raise ValueError(f"rollout.asynchronous runs on the CPU for now, the device is {self.device.type} "
                             "(docs/ASYNC.md has the GPU design); set device=cpu or rollout.asynchronous=false")
        trained = [p for _, p in trained_parameters(self.model)]  # what each of the max_staleness slots copies
        preflight.check_async_slots(r.max_staleness, len(trained), sum(p.numel() * p.element_size() for p in trained))
        worker_threads, trainer_threads = split_threads(r.async_threads)
        self._threads_before = torch.get_num_threads()
        torch.set_num_threads(trainer_threads)
        model_cfg = dataclasses.replace(self.cfg.model, name_or_path=resolve_model_path(self.cfg.model,
                                                                                        seed=self.cfg.seed),
                                        gguf_file=None)
        self.async_rollout = AsyncRollout(
            self.model, model_cfg=model_cfg, lora=self.cfg.model.lora if self.cfg.model.lora.enabled else None,
            hf=r.hf, seed=self.cfg.seed, threads=worker_threads, max_staleness=r.max_staleness,
            timeout_s=r.async_timeout_s)
        self._async_next = self.step  # the next batch to request
        self._async_kept = getattr(self, "_async_kept", None)  # dynamic sampling: last kept share (resumed)
        self.async_rollout.push(self.model, self.step)
        saved = [Batch.from_state(b) for b in getattr(self, "_async_saved", []) if b["batch"] >= self.step]
        for batch in saved:  # in step order, from self.step on
            if batch.batch != self._async_next:
                break
            if batch.completions is not None:  # came back before the checkpoint: trained on as it is
                self.async_rollout.restore(batch)
            else:  # lost (the worker failed): the same prompts and seed, from the weights of this resume
                self._async_submit(dataclasses.replace(batch, version=self.step))
            self._async_next += 1
        self._async_fill(self.step + r.max_staleness - 1)

    def _async_submit(self, batch: Batch) -> None:
        _, ids = self.prompts(batch.indices, self.train_rows)
        self.async_rollout.push(self.model, batch.version)
        self.async_rollout.submit(batch, ids, self.cfg.grpo.num_generations, self._sampling(batch.seed))

    def _async_fill(self, upto: int) -> None:
        """Request the batches of steps up to ``upto`` (below max_steps) not yet requested, from the weights of
        now: step k's batch is requested at the start of step k - max_staleness."""
        while self._async_next <= min(upto, self.cfg.max_steps - 1):
            k = self._async_next
            self._async_submit(Batch(batch=k, indices=self.sampler.next_batch(self._async_prompts()),
                                     seed=self._round_seed(k, 0), version=self.step))
            self._async_next += 1

    def _async_prompts(self) -> int:
        """Prompts of a batch requested now: grpo.prompts_per_step; with grpo.dynamic_sampling, enough that the
        groups with a reward signal fill the batch at the share kept in the last batch scored (+10%, at most 4x),
        so that extra rounds, generated here on the trainer's side, are rare."""
        g = self.cfg.grpo
        if not g.dynamic_sampling or self._async_kept is None:
            return g.prompts_per_step
        return min(4 * g.prompts_per_step, math.ceil(1.1 * g.prompts_per_step / max(self._async_kept, 0.25)))

    def _async_take(self, metrics: StepMetrics) -> None:
        """This step's batch from the worker (checked: version, weights, staleness), then the next request."""
        with Timer() as t:
            self._async_batch = self.async_rollout.take(self.step)
        self._async_fill(self.step + self.cfg.rollout.max_staleness)
        metrics.host("rollout/staleness", self.step - self._async_batch.version)
        metrics.host("rollout/version", self._async_batch.version)
        metrics.host("rollout/async_prompts", len(self._async_batch.indices))
        metrics.host("time/rollout_wait_s", t.seconds)
        metrics.host("time/generate_s", self._async_batch.generate_s)

    def extra_state(self, *, after_failure: bool) -> dict:
        """rollout.asynchronous: the batches in flight, received first (else saved as lost: the resume generates
        them again from its own weights)."""
        if self.async_rollout is None:
            return {}
        try:
            batches = self.async_rollout.checkpoint_state(wait=not after_failure)
        except RolloutWorkerError:  # the worker failed while the checkpoint waited: save what came back
            batches = self.async_rollout.checkpoint_state(wait=False)
        return {"async_rollout": batches, "async_kept": self._async_kept}

    def load_extra_state(self, state: dict) -> None:
        self._async_saved = list(state.get("async_rollout", []))
        self._async_kept = state.get("async_kept")

    # ------------------------------------------------------------------------------------------------ phases

    def _render(self, row: dict) -> str:
        tools = self.env.tool_schemas if self.env is not None else []  # the chat template shows the tools
        return render_prompt(row, template=self.cfg.data.template, system_prompt=self.cfg.data.system_prompt,
                             tokenizer=ToolsTemplate(self.tokenizer, tools) if tools else self.tokenizer,
                             task=row.get("task", "countdown"),
                             prompt_column=self.cfg.data.prompt_column)

    def _prompt_bounds(self) -> list[int]:
        """An upper bound on the token count of each prompt, training rows then held-out rows, without tokenizing
        them (that took 13 s for the 10k countdown rows, rendering 1 s): byte-level BPE and byte-fallback
        SentencePiece tokens each cover at least one UTF-8 byte of the text, plus one for SentencePiece's leading
        word marker. Loose (about 4 bytes per token in English)."""
        if self._bounds is None:
            self._bounds = [len(self._render(r).encode("utf-8")) + 1 for r in self.train_rows + self.eval_rows]
        return self._bounds

    def prompt_token_bound(self) -> int:
        """An upper bound on the token count of every prompt of both splits (the engine checks every request's true
        length anyway)."""
        return max(self._prompt_bounds(), default=1)

    def check_context(self, limit: int, limit_name: str = "") -> None:
        """Every prompt of both splits plus rollout.max_completion_length fits the model's ``limit`` positions
        (``limit_name``: another limit's key, see preflight.check_fits); only the prompts whose bound says they might
        not are tokenized."""
        completion = self.cfg.rollout.max_completion_length
        for k, bound in enumerate(self._prompt_bounds()):
            if bound + completion <= limit:
                continue
            split, rows, i = ("training", self.train_rows, k) if k < len(self.train_rows) else \
                ("held-out", self.eval_rows, k - len(self.train_rows))
            text = self._render(rows[i])
            preflight.check_fits(split, i, rows[i].get(self.cfg.data.prompt_column, rows[i]),
                                 len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]),
                                 completion,
                                 "(rollout.max_completion_length)", limit,
                                 fix=", or lower rollout.max_completion_length"
                                 + (f" or raise {limit_name}" if limit_name else ""), limit_name=limit_name)

    def prompts(self, indices: list[int], rows: list[dict]) -> tuple[list[str], list[list[int]]]:
        """Render and tokenize prompts of ``rows`` (the train or the eval split), cached per row."""
        texts, ids = [], []
        for i in indices:
            key = i if rows is self.train_rows else -1 - i
            if key not in self.prompt_cache:
                text = self._render(rows[i])
                self.prompt_cache[key] = (text, self.tokenizer(text, add_special_tokens=False)["input_ids"])
            texts.append(self.prompt_cache[key][0])
            ids.append(self.prompt_cache[key][1])
        return texts, ids

    def rollout(self, metrics: StepMetrics | None = None) -> Episodes:
        """This step's episodes: B prompts x G completions, scored, with advantages; with ``grpo.dynamic_sampling``,
        zero-variance groups are replaced by newly sampled ones (:func:`fastgrpo.algorithms.sampling.dynamic_sample`)."""
        g = self.cfg.grpo
        self.engine.wake()
        try:
            if not g.dynamic_sampling:
                return self._rollout_round(g.prompts_per_step, 0)
            return dynamic_sample(
                self._rollout_round, num_prompts=g.prompts_per_step, group_size=g.num_generations,
                max_rounds=g.dynamic_sampling_max_rounds, scale_rewards=g.scale_rewards,
                any_rank=lambda flag: fdist.all_reduce_int(int(flag), "max", device=self.device) > 0,
                all_reduce=self._sum_over_ranks, metrics=metrics if metrics is not None else StepMetrics())
        except NonFiniteError as e:  # the sampler met non-finite logits: the same one line as the update's guard
            raise NonFiniteError(f"step {self.step + 1}: {e}") from None
        finally:
            self.engine.sleep()

    def _rollout_round(self, num_prompts: int, round_index: int) -> Episodes:
        """Roll out and score the next ``num_prompts`` prompts of this rank's order (round > 0: dynamic sampling)."""
        g, r = self.cfg.grpo, self.cfg.rollout
        batch = self._async_batch if round_index == 0 else None  # rollout.asynchronous: the worker's batch
        idx = self.sampler.next_batch(num_prompts) if batch is None else batch.indices
        rows = [self.train_rows[i] for i in idx]
        texts, ids = self.prompts(idx, self.train_rows)
        seed = self._round_seed(self.step, round_index)
        sampling = self._sampling(seed)
        if self.env is not None:  # multi-turn: the environment answers between the model's turns
            return collect_trajectories(self.engine, self.env, rows, texts, ids, group_size=g.num_generations,
                                        sampling=sampling, max_turns=r.max_turns, render=self.env_render,
                                        rewards=self.rewards, scale_rewards=g.scale_rewards,
                                        all_reduce=self._sum_over_ranks, prompt_column=self.cfg.data.prompt_column,
                                        sync=self._max_over_ranks if self.world_size > 1 else None)
        engine = self.engine if batch is None else _Generated(batch, ids, g.num_generations)
        ep = collect_episodes(engine, rows, texts, ids, group_size=g.num_generations, sampling=sampling,
                              rewards=self.rewards,
                              scale_rewards=g.scale_rewards if self.algorithm.group_advantages else None,
                              all_reduce=self._sum_over_ranks, prompt_column=self.cfg.data.prompt_column)
        if batch is not None and ep.adv is not None:  # sizes the next requests (dynamic sampling)
            self._async_kept = 1.0 - float(ep.adv.zero_std_mask.float().mean())
        return ep

    def _round_seed(self, step: int, round_index: int) -> int:
        """The sampling seed of a step's rollout round."""
        return (self.cfg.seed * 1_000_003 + step * 7919 + self.rank + round_index * 104_729) % (2**31)

    def _sampling(self, seed: int) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(max_tokens=r.max_completion_length, temperature=r.temperature, top_p=r.top_p,
                              top_k=r.top_k, seed=seed, logprobs=r.importance_sampling_cap is not None)

    def _max_over_ranks(self, values: list[int]) -> list[int]:
        """Elementwise maximum of a few ints over ranks (multi-turn rollouts keep the ranks' generate calls in step)."""
        return fdist.all_reduce_(torch.tensor(values, dtype=torch.int64, device=self.device), "max").tolist()

    def _sum_over_ranks(self, t: torch.Tensor) -> torch.Tensor:
        """Sum a (CPU) tensor over ranks, on this rank's device (NCCL reduces CUDA tensors only)."""
        return fdist.all_reduce_(t.to(self.device), "sum").to(t.device)

    def policy_update(self, ep: Episodes, metrics: StepMetrics) -> None:
        """This step's optimizer updates: the algorithm's ``update`` (GRPO's
        :func:`fastgrpo.algorithms.grpo.grpo_update`, PPO's :func:`fastgrpo.algorithms.ppo.ppo_update`)."""
        policy = TrainedModel(runner=self.runner, optimizer=self.optimizer, scheduler=self.scheduler, guard=self.guard)
        self.algorithm.update(ep, StepInputs(
            cfg=self.cfg, policy=policy, extras=self.extras, ref_model=self.ref_model, metrics=metrics,
            device=self.device, step=self.step, pad_token_id=self.tokenizer.pad_token_id or 0,
            max_tokens_per_microbatch=self.microbatch_tokens()))

    def microbatch_tokens(self) -> int | None:
        """The update's micro-batch token budget when ``grpo.max_tokens_per_microbatch`` is null on CUDA: sized once,
        at the first update (the rollout engine and the reference model hold their memory by then), from the free
        GPU memory (:func:`fastgrpo.update.microbatch.auto_microbatch_tokens`), the smallest over ranks. None otherwise: the
        configured value, or the CPU default."""
        if self.cfg.grpo.max_tokens_per_microbatch is not None or self.device.type != "cuda":
            return None
        if self._microbatch_tokens is None:
            p = self.cfg.parallel
            bf16 = autocast_dtype(p, self.device, self.world_size) is not None or (
                uses_fsdp(p, self.device, self.world_size) and p.param_dtype != "float32")
            compute_bytes = 2 if bf16 else next(self.model.parameters()).element_size()
            sizing = auto_microbatch_tokens(self.model, self.optimizer, device=self.device,
                                            compute_bytes=compute_bytes, checkpointing=p.activation_checkpointing)
            self._microbatch_tokens = fdist.all_reduce_int(sizing.tokens, "min", device=self.device)
            if self.is_main:
                print(f"[fastgrpo] grpo.max_tokens_per_microbatch: null -> {self._microbatch_tokens} tokens per "
                      f"micro-batch (this rank: {sizing.describe()}; set it to fix the budget)", flush=True)
        return self._microbatch_tokens

    def sync_weights(self, metrics: StepMetrics) -> None:
        """Give the rollout engine the new policy weights (a no-op for an engine that shares the model)."""
        with Timer() as t:
            copied = self.engine.sync_from(self.model)
        if copied:
            metrics.host("time/sync_s", t.seconds)

    # ------------------------------------------------------------------------------------------------ loop

    def train_step(self) -> tuple[dict[str, float] | None, Episodes]:
        """One step: rollout -> policy update -> weight sync. Returns the step's record (metrics reduced over ranks,
        timings, throughput) and its episodes; the record is None when SIGTERM cut the reward calls short on some
        rank, and the step was dropped (the data position is back where it was before it)."""
        metrics = StepMetrics()
        self._async_batch = None
        with Timer() as t_roll:  # with rollout.asynchronous: the wait for the worker's batch, then its scoring
            if self.async_rollout is not None:
                self._async_take(metrics)
            data_position = self.sampler.state_dict()
            ep = self.rollout(metrics)
        self._fault_point()
        if fdist.all_reduce_int(int(ep.interrupted), "max", device=self.device):
            self.sampler.load_state_dict(data_position)
            if self._async_batch is not None:  # kept for the checkpoint: the resume trains on it
                self.async_rollout.put_back(self._async_batch)
            return None, ep
        with Timer() as t_upd:
            self.policy_update(ep, metrics)
        self.guard.end_step(self.step + 1, metrics, None if ep.adv is None else ep.adv.advantages, ep.rewards)
        for name, bundle in self.extras.items():
            bundle.guard.end_step(self.step + 1, metrics, role=name,
                                  cause=self.algorithm.extra_models[name].nonfinite_cause)
        self.sync_weights(metrics)
        self.step += 1
        return self._record(ep, metrics, t_roll.seconds, t_upd.seconds), ep

    def _record(self, ep: Episodes, metrics: StepMetrics, rollout_s: float, update_s: float) -> dict[str, float]:
        record_metrics(ep, metrics)
        for name, values in (self.env.take_counters() if self.env is not None else {}).items():
            if name.endswith(("_rate", "_mean")):  # tool failure rate, turns per trajectory, ...
                metrics.moments(torch.tensor(values), f"env/{name}")
            else:  # counts: tool calls, failures by kind
                metrics.total(f"env/{name}", torch.tensor(sum(values)))
        metrics.total("perf/rollout_tokens", ep.lengths.sum().float())
        metrics.host("time/rollout_s", rollout_s)
        metrics.host("time/update_s", update_s)
        record = {"step": self.step, **metrics.reduce()}
        add_throughput(record, rollout_s=rollout_s, update_s=update_s, num_iterations=self.cfg.grpo.num_iterations)
        # the update's FLOPs, and on CUDA its MFU on the tokens forwarded and on the sequences' tokens
        add_update_flops(record, self.update_cost, update_s=update_s, num_iterations=self.cfg.grpo.num_iterations,
                         peak_flops=self.peak_flops, world_size=self.world_size)
        record["data/skipped_rows"] = float(self.data_info.get("skipped_invalid_rows", 0))
        return record

    def run(self) -> dict[str, float]:
        """The step loop (:meth:`TrainingLoop.run`); the generation worker (rollout.asynchronous) stops with it."""
        try:
            return super().run()
        finally:
            if self.async_rollout is not None:
                self.async_rollout.close()

    def _on_sigterm(self, *_) -> None:
        """Preemption: stop after this step; reward calls in flight are abandoned at once (their step is dropped)."""
        super()._on_sigterm()
        self.rewards.interrupt()

    def close(self) -> None:
        """Release the reward workers, the rollout engine and the run folder (whatever a failed ``__init__`` got
        to). vLLM's teardown also ends torch.distributed's group: call this last."""
        for part in (getattr(self, "async_rollout", None), getattr(self, "rewards", None), getattr(self, "env", None),
                     getattr(self, "engine", None)):
            close = getattr(part, "close", None)
            if close is not None:
                close()
        if getattr(self, "_threads_before", None) is not None:
            torch.set_num_threads(self._threads_before)
            self._threads_before = None
        super().close()

    def has_eval_data(self) -> bool:
        return bool(self.eval_rows)

    def evaluate(self) -> dict[str, float]:
        e = self.cfg.eval
        # Each rank evaluates its own slice and results are averaged over ranks. Every rank takes the same number of
        # prompts: under FSDP a rank that generated fewer sequences would leave the others waiting in a collective.
        ws, n_rows = self.world_size, len(self.eval_rows)
        n = max(ws, min(e.num_prompts, n_rows) // ws * ws)
        idx = [i % n_rows for i in range(self.rank, n, ws)]
        texts, ids = self.prompts(idx, self.eval_rows)
        fn = self.rewards.reward_fn(len(self.rewards.names) - 1)  # sandboxed like the training rewards
        # Evaluation runs between a weight sync and the next rollout, so the engine stays awake for that rollout
        # (sleeping here would, at sleep_level 2, discard the weights just synced).
        self.engine.wake()
        rows = [self.eval_rows[i] for i in idx]
        engine = self.engine if self.env is None else TrajectoryEngine(  # multi-turn: whole trajectories
            self.engine, self.env, self.env_render, rows=rows, max_turns=self.cfg.rollout.max_turns,
            sync=self._max_over_ranks if self.world_size > 1 else None)
        res = evaluate(engine, rows, texts, ids, reward_fn=fn,
                       best_of_n=e.best_of_n, temperature=e.temperature,
                       max_tokens=self.cfg.rollout.max_completion_length, seed=self.cfg.seed + self.step,
                       prompt_column=self.cfg.data.prompt_column)
        if self.env is not None:
            self.env.take_counters()  # the evaluation's tool calls are not the next step's
        names = sorted(res)
        vals = fdist.all_reduce_(torch.tensor([res[k] for k in names], device=self.device), "avg")
        return {f"eval/{k}": float(v) for k, v in zip(names, vals.tolist())}

    def log_rows(self, ep: Episodes) -> list[dict]:
        """``log.completions_per_step`` completions spread over the batch, for completions.jsonl."""
        k = min(self.cfg.log.completions_per_step, ep.num_sequences)
        stride = max(1, ep.num_sequences // max(k, 1))
        return [{
            "step": self.step, "prompt": ep.prompt_texts[s], "completion": ep.completion_texts[s],
            "rewards": {n: float(ep.rewards_per_func[s, j]) for j, n in enumerate(ep.reward_names)},
            "reward": float(ep.rewards[s]), "finish_reason": ep.finish_reasons[s],
            **({} if ep.adv is None else {"advantage": float(ep.adv.advantages[s])}),
        } for s in range(0, stride * k, stride)]


class _Generated:
    """The worker's completions of a batch, served to :func:`collect_episodes` as an engine's would be."""

    def __init__(self, batch: Batch, prompts: list[list[int]], n: int) -> None:
        self.batch, self.prompts, self.n = batch, prompts, n

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list]:
        if prompts != self.prompts or n != self.n or len(self.batch.completions) != len(prompts):
            raise RuntimeError(f"async rollout: the batch of step {self.batch.batch + 1} was generated for other "
                               "prompts")
        return self.batch.completions
