"""Multi-turn rollouts: the model and an environment take turns; one token sequence per trajectory.

Legend: B prompts, G trajectories per prompt, S = B*G trajectories (row s is prompt s // G), L_s tokens after the
prompt in trajectory s (model and environment tokens), N = sum_s L_s.

A trajectory is its prompt followed by every turn's tokens, back to back, as the model saw them:

    prompt | model turn 1 (ends with EOS) | environment tokens | model turn 2 | ... | last model turn

- **Model tokens** are kept exactly as sampled (never re-tokenized), with the sampler's log-prob of each.
- **Environment tokens** are the chat template's rendering of the environment's messages plus the opening of the
  next assistant turn (:class:`ObservationRenderer`). They are attended in the update like any token, but their
  token weight is 0 (``model_mask`` 0): no log-prob loss, no KL, no gradient, and the loss normaliser counts model
  tokens only.
- The engine is called once per turn with the conversation so far as the prompt tokens (``RolloutEngine.generate``;
  the first turn samples G per prompt, later turns one per trajectory; a later turn whose trajectories have
  different room left may take a few calls, see ``_sample_turns``), so every engine works unchanged; each call has
  its own seed derived from the step's, so a step's rollout is reproduced exactly on resume.

A trajectory ends (``finish_reason``) with 'stop' when its environment says done (the tools environment: a turn
without a tool call), or 'length' when a model turn hits the token budget (``rollout.max_completion_length``: the
whole trajectory after the prompt), when the next environment message would leave no room for a model token, or
when the model still acts after ``rollout.max_turns`` turns. 'length' is truncation, so
``grpo.mask_truncated_completions`` applies.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from fastgrpo.environments.base import (ENV_REWARDS_COLUMN, Environment, EnvironmentFactory, call_plugin, clean_text,
                                        show, step_result)
from fastgrpo.rewards.calls import own_copy
from fastgrpo.runtime.errors import ContextError, PluginError
from fastgrpo.algorithms.episodes import Episodes, score_episodes
from fastgrpo.rewards import RewardRunner
from fastgrpo.rollout import Completion, RolloutEngine, SamplingParams

__all__ = ["ObservationRenderer", "ToolsTemplate", "Trajectory", "TrajectoryCompletion", "TrajectoryEngine",
           "collect_trajectories", "reset_environments", "run_trajectories", "turn_seed"]


@dataclass
class Trajectory:
    """One trajectory after its prompt."""

    ids: list[int] = field(default_factory=list)
    """[L] model and environment tokens after the prompt, in order."""
    model_mask: list[int] = field(default_factory=list)
    """[L] 1 for a model token, 0 for an environment token."""
    logprobs: list[float] | None = field(default_factory=list)
    """[L] the sampler's log-prob of each model token (0.0 at environment tokens); None when not asked for."""
    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation after the prompt: assistant turns (their text) and the environment's messages."""
    env_rewards: list[float] = field(default_factory=list)
    """The rewards the environment gave, one per turn that had one."""
    turns: int = 0
    """Model turns so far."""
    finish_reason: str = ""
    """'' while running, then 'stop' or 'length'."""

    def add(self, ids: list[int], logprobs: list[float] | None, *, model: bool) -> None:
        self.ids += ids
        self.model_mask += [int(model)] * len(ids)
        if self.logprobs is not None:
            self.logprobs = None if (model and logprobs is None) else self.logprobs + (
                list(logprobs) if model else [0.0] * len(ids))


class ObservationRenderer:
    """Environment messages -> the tokens that follow a finished model turn: the chat template's rendering of the
    messages and the opening of the next assistant turn.

    As TRL does, found as a difference of two renderings: a short conversation that ends with an assistant turn,
    cut after its last end-of-turn token, and the same conversation with the messages added and the generation
    prompt. A model turn that stopped on EOS ends exactly where the cut is, so the model continues the
    conversation as the chat template would write it.
    """

    _HEAD = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]] | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("multi-turn rollouts need a tokenizer with a chat template (it writes the environment's "
                             "messages); this one has none")
        self.tokenizer, self.tools = tokenizer, tools or None
        head = self._render(self._HEAD, add_generation_prompt=False)
        eos = tokenizer.eos_token or ""
        self.head = head[:head.rindex(eos) + len(eos)] if eos and eos in head else head

    def _render(self, messages: list[dict[str, Any]], *, add_generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    def prompt(self, messages: list[dict[str, Any]]) -> str:
        """A conversation's opening as prompt text, the assistant turn opened."""
        return self._render(messages, add_generation_prompt=True)

    def __call__(self, messages: list[dict[str, Any]]) -> list[int]:
        full = self._render(self._HEAD + messages, add_generation_prompt=True)
        if not full.startswith(self.head):
            raise ValueError("the chat template renders a conversation's start differently once messages follow it; "
                             "multi-turn rollouts cannot find the environment's tokens")
        return self.tokenizer(full[len(self.head):], add_special_tokens=False)["input_ids"]


def turn_seed(seed: int | None, turn: int, call: int = 0) -> int | None:
    """The sampling seed of call ``call`` of turn ``turn`` (both 0-based) of a step whose rollout seed is ``seed``:
    the seed itself for the first turn (a one-turn rollout samples as a single-turn one), a hash of all three
    after."""
    if seed is None or (turn == 0 and call == 0):
        return seed
    digest = hashlib.blake2b(f"{seed}:turn{turn}:call{call}".encode(), digest_size=4).digest()
    return int.from_bytes(digest, "little") >> 1


@dataclass
class _Turn:
    """One model turn being sampled."""

    ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = field(default_factory=list)
    finish_reason: str = ""


Sync = Callable[[list[int]], list[int]]
"""``sync(values) -> their elementwise maximum over ranks`` (torch.distributed); None in one process."""

_NO_CAP = 1 << 40


def _sample_turns(engine: RolloutEngine, contexts: list[list[int]], rooms: list[int], sampling: SamplingParams,
                  turn: int, *, sync: Sync | None = None, filler: list[int] | None = None) -> list[_Turn]:
    """One model turn for each context, trajectory k with at most ``rooms[k]`` tokens. A call's ``max_tokens`` is
    the smallest room left among the turns it samples, so no request asks for more than its trajectory's budget (an
    engine's context holds the longest prompt + the budget, not more); a turn that reaches that cap with room left
    continues in the next call, on its conversation so far (sampling continues exactly as one call would).

    With ``sync`` every rank makes the same calls with as many sequences and the same max_tokens (the hf engine's
    decode under FSDP2 is a collective): a rank with fewer pads its call with ``filler`` prompts, whose samples are
    dropped, and takes part in calls while any rank has a turn to sample."""
    turns = [_Turn(logprobs=[] if sampling.logprobs else None) for _ in contexts]
    active, call = list(range(len(contexts))), 0
    while True:
        count, cap = len(active), min((rooms[k] - len(turns[k].ids) for k in active), default=_NO_CAP)
        if sync is not None:
            count, cap = sync([count, -cap])
            cap = -cap
        if count == 0:
            break
        params = SamplingParams(max_tokens=cap, temperature=sampling.temperature, top_p=sampling.top_p,
                                top_k=sampling.top_k, seed=turn_seed(sampling.seed, turn, call),
                                logprobs=sampling.logprobs)
        outs = engine.generate([contexts[k] + turns[k].ids for k in active] + [filler] * (count - len(active)), 1,
                               params)[:len(active)]
        still = []
        for k, (c,) in zip(active, outs):
            t = turns[k]
            t.ids += list(c.token_ids)
            t.logprobs = None if t.logprobs is None or c.logprobs is None else t.logprobs + list(c.logprobs)
            if c.finish_reason == "length" and len(t.ids) < rooms[k]:
                still.append(k)
            else:
                t.finish_reason = c.finish_reason
        active, call = still, call + 1
    return turns


def _take_turn(t: Trajectory, turn: _Turn | Completion, text: str) -> bool:
    """Append a model turn to its trajectory; returns whether that ended it (the turn hit the token budget)."""
    t.add(list(turn.token_ids if isinstance(turn, Completion) else turn.ids), turn.logprobs, model=True)
    t.messages.append({"role": "assistant", "content": text})
    t.turns += 1
    if turn.finish_reason == "length":
        t.finish_reason = "length"
    return bool(t.finish_reason)


def run_trajectories(engine: RolloutEngine, envs: list[Environment], prompt_ids: list[list[int]], *, group_size: int,
                     sampling: SamplingParams, max_turns: int, render: ObservationRenderer, tokenizer: Any,
                     sync: Sync | None = None) -> list[Trajectory]:
    """Roll out S = B*G trajectories: ``envs`` [S] (already reset; row s belongs to prompt s // G), ``prompt_ids``
    [B]; ``sampling.max_tokens`` is the token budget of a whole trajectory after its prompt. ``sync``: under
    torch.distributed, every rank makes the same generate calls (see :func:`_sample_turns`)."""
    filler = [tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id]
    if len(envs) != len(prompt_ids) * group_size:
        raise ValueError(f"{len(envs)} environments for {len(prompt_ids)} prompts x {group_size} trajectories")
    budget = sampling.max_tokens
    trajs = [Trajectory(logprobs=[] if sampling.logprobs else None) for _ in envs]
    # the first turn: G samples per prompt in one call (engines share the prompt's prefill among them)
    try:
        first = [c for g in engine.generate(prompt_ids, group_size, sampling) for c in g]  # [S]
    except ContextError as e:  # the dataset's prompts were checked before the model loaded: this one is the env's
        raise ContextError(f"environment {type(envs[0]).__name__}.reset: its first message makes a prompt too long: "
                           f"{e}; shorten that message or lower rollout.max_completion_length") from None
    acting = [s for s, c in enumerate(first) if not _take_turn(trajs[s], c, c.text)]
    turn = 1
    while (sync([int(bool(acting))])[0] if sync is not None else acting):  # a rank takes part while any acts
        by_class: dict[type, list[int]] = {}
        for s in acting:
            by_class.setdefault(type(envs[s]), []).append(s)
        waiting = []
        for cls, members in by_class.items():
            outs = call_plugin(f"{cls.__name__}.step", cls.step_many, [envs[s] for s in members],
                               [trajs[s].messages[-1]["content"] for s in members])
            if not isinstance(outs, (list, tuple)) or len(outs) != len(members):
                raise PluginError(f"environment {cls.__name__}.step_many returned {show(outs, 60)} for "
                                  f"{len(members)} trajectories; expected one (observation, reward, done) each")
            for s, out in zip(members, outs):
                t, res = trajs[s], step_result(out, envs[s])
                if res.reward is not None:
                    t.env_rewards.append(res.reward)
                if res.done:
                    t.finish_reason = "stop"
                elif t.turns >= max_turns:
                    t.finish_reason = "length"  # still acting after the last turn: truncated
                else:
                    env_ids = render(res.messages)
                    if len(t.ids) + len(env_ids) >= budget:  # no room left for a model token
                        t.finish_reason = "length"
                    else:
                        t.add(env_ids, None, model=False)
                        t.messages += res.messages
                        waiting.append(s)
        waiting.sort()
        turns = _sample_turns(engine, [prompt_ids[s // group_size] + trajs[s].ids for s in waiting],
                              [budget - len(trajs[s].ids) for s in waiting], sampling, turn, sync=sync, filler=filler)
        texts = tokenizer.batch_decode([t.ids for t in turns], skip_special_tokens=True) if turns else []
        acting = [s for s, t, text in zip(waiting, turns, texts) if not _take_turn(trajs[s], t, text)]
        turn += 1
    return trajs


class ToolsTemplate:
    """A tokenizer whose ``apply_chat_template`` also gets ``tools=``: the prompt renderers of :mod:`fastgrpo.data`
    then show the environment's tool schemas where the chat template puts them (a template that ignores ``tools``
    shows none: the model must know its tools otherwise, as the tiny demo's warm start does)."""

    def __init__(self, tokenizer: Any, tools: list[dict[str, Any]]) -> None:
        self._tokenizer, self._tools = tokenizer, tools

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._tokenizer(*args, **kwargs)

    def apply_chat_template(self, messages: Any, **kwargs: Any) -> Any:
        kwargs.setdefault("tools", self._tools or None)
        return self._tokenizer.apply_chat_template(messages, **kwargs)


def reset_environments(envs: list[Environment], rows: list[dict[str, Any]], group_size: int, prompt_texts: list[str],
                       prompt_ids: list[list[int]], render: ObservationRenderer) -> tuple[list[str], list[list[int]]]:
    """Reset ``envs`` [B*G] on their rows; the prompts [B], with the environment's first message (rendered by the
    chat template, with the tools) in place of the dataset's prompt where it gives one.

    Each environment gets its own copy of its row (rows are the dataset's own dicts: a ``reset`` that changed its
    row would change the data of every later step, and a resumed run would diverge from an uninterrupted one)."""
    prompt_texts, prompt_ids = list(prompt_texts), list(prompt_ids)
    for b, row in enumerate(rows):
        name = type(envs[b * group_size]).__name__
        firsts = [call_plugin(f"{name}.reset", envs[b * group_size + j].reset, own_copy(row))
                  for j in range(group_size)]
        if firsts[0] is not None and not isinstance(firsts[0], str):
            raise PluginError(f"environment {name}.reset returned {show(firsts[0], 60)}; expected the first user "
                              "message (a string) or None")
        if any(f != firsts[0] for f in firsts):
            raise PluginError(f"environment {name}.reset gave different first messages for one row; the "
                              "trajectories of a row share their prompt")
        if firsts[0] is not None:
            prompt_texts[b] = render.prompt([{"role": "user", "content": clean_text(firsts[0])}])
            prompt_ids[b] = render.tokenizer(prompt_texts[b], add_special_tokens=False)["input_ids"]
    return prompt_texts, prompt_ids


def collect_trajectories(engine: RolloutEngine, factory: EnvironmentFactory, rows: list[dict[str, Any]],
                         prompt_texts: list[str], prompt_ids: list[list[int]], *, group_size: int,
                         sampling: SamplingParams, max_turns: int, render: ObservationRenderer, rewards: RewardRunner,
                         scale_rewards: str, all_reduce: Callable | None = None, prompt_column: str = "prompt",
                         sync: Sync | None = None) -> Episodes:
    """The multi-turn counterpart of :func:`fastgrpo.algorithms.episodes.collect_episodes`: one environment per trajectory
    (reset on its row), :func:`run_trajectories`, then rewards and advantages. The reward functions get
    ``completions`` as message lists (TRL's convention: the assistant turns and the environment's messages after
    the prompt) and the environment's per-turn rewards as the ``env_rewards`` column."""
    envs = [factory.new() for _ in range(len(rows) * group_size)]  # [S]
    prompt_texts, prompt_ids = reset_environments(envs, rows, group_size, prompt_texts, prompt_ids, render)
    trajs = run_trajectories(engine, envs, prompt_ids, group_size=group_size, sampling=sampling, max_turns=max_turns,
                             render=render, tokenizer=render.tokenizer, sync=sync)
    for t in trajs:
        factory.count("turns_mean", t.turns)
        factory.count("model_token_frac_mean", sum(t.model_mask) / max(len(t.model_mask), 1))
    lps = [t.logprobs for t in trajs]
    sampler_lp = (torch.tensor([x for lp in lps for x in lp], dtype=torch.float32)
                  if all(lp is not None for lp in lps) else None)
    return score_episodes(
        rows, prompt_texts, prompt_ids, group_size=group_size, completion_ids=[t.ids for t in trajs],
        completion_texts=[render.tokenizer.decode(t.ids, skip_special_tokens=True) for t in trajs],
        finish_reasons=[t.finish_reason for t in trajs], sampler_logprobs=sampler_lp, rewards=rewards,
        scale_rewards=scale_rewards, all_reduce=all_reduce, prompt_column=prompt_column,
        completions=[t.messages for t in trajs], extra_columns={ENV_REWARDS_COLUMN: [t.env_rewards for t in trajs]},
        model_masks=[t.model_mask for t in trajs])


@dataclass(kw_only=True)
class TrajectoryCompletion(Completion):
    """A whole trajectory as a Completion, with what its reward functions get in training."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    """The conversation after the prompt (the reward functions' ``completions`` entry)."""
    env_rewards: list[float] = field(default_factory=list)
    """The environment's per-turn rewards (the ``env_rewards`` column)."""


class TrajectoryEngine(RolloutEngine):
    """An engine whose completions are whole trajectories, for code that samples through ``generate`` (held-out
    evaluation): each completion (a :class:`TrajectoryCompletion`) has the trajectory after the prompt as
    ``token_ids``, the last assistant turn as ``text``, and the conversation and per-turn rewards that the reward
    functions get in training, so an evaluation scores what training rewards. ``rows`` [B] are the rows of the
    prompts it will be asked for, in order (environments reset on them)."""

    def __init__(self, engine: RolloutEngine, factory: EnvironmentFactory, render: ObservationRenderer, *,
                 rows: list[dict[str, Any]], max_turns: int, sync: Sync | None = None) -> None:
        self.engine, self.factory, self.render, self.rows, self.max_turns = engine, factory, render, rows, max_turns
        self.sync = sync

    def generate(self, prompts: list[list[int]], n: int, sampling: SamplingParams) -> list[list[Completion]]:
        if len(prompts) != len(self.rows):
            raise ValueError(f"TrajectoryEngine: {len(prompts)} prompts for {len(self.rows)} rows")
        envs = [self.factory.new() for _ in range(len(prompts) * n)]  # fresh ones: eval never shares a trajectory
        _, prompts = reset_environments(envs, self.rows, n, [""] * len(prompts), prompts, self.render)
        trajs = run_trajectories(self.engine, envs, prompts, group_size=n, sampling=sampling,
                                 max_turns=self.max_turns, render=self.render, tokenizer=self.render.tokenizer,
                                 sync=self.sync)
        comps = [TrajectoryCompletion(token_ids=t.ids, text=t.messages[-1]["content"], finish_reason=t.finish_reason,
                                      logprobs=t.logprobs, messages=t.messages, env_rewards=t.env_rewards)
                 for t in trajs]
        return [comps[b * n:(b + 1) * n] for b in range(len(prompts))]

    def update_weights(self, named_tensors: Any) -> None:
        self.engine.update_weights(named_tensors)
