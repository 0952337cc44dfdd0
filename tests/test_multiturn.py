"""Multi-turn rollouts on the embedded tiny model: trajectories, their environment tokens in the update, truncation
at rollout.max_turns, and the trainer's step with an environment (fastgrpo.environments.trajectory)."""

import pytest
import torch

from benchmarks.bench_rollout import TurnCap
from fastgrpo.config import GRPOConfig, ModelConfig, ParallelConfig, RolloutConfig, load_config
from fastgrpo.environments import Environment
from fastgrpo.environments.trajectory import ObservationRenderer, run_trajectories
from fastgrpo.runtime.metrics import StepMetrics
from fastgrpo.models.loading import load_model, load_tokenizer
from fastgrpo.distributed.parallelize import parallelize_model
from fastgrpo.distributed.runner import ModelRunner
from fastgrpo.rollout import Completion, RolloutEngine, SamplingParams
from fastgrpo.rollout.hf import HFEngine
from fastgrpo.algorithms.sampling import concat_episodes, select_groups
from fastgrpo.trainers.grpo import Trainer
from fastgrpo.algorithms.grpo import GRPOBatch, grpo_update
from fastgrpo.update.step import packed_logprobs, plan_packed


class CountingEnv(Environment):
    """Answers every turn with 'turn k' and a reward of k / 10; done after ``done_after`` turns (never if 0)."""

    def __init__(self, done_after: int = 0) -> None:
        self.k, self.done_after = 0, done_after

    def step(self, text):
        self.k += 1
        return f"turn {self.k}", self.k / 10, self.done_after and self.k >= self.done_after


@pytest.fixture(scope="module")
def tiny():
    cfg = ModelConfig(name_or_path="tiny")
    tok = load_tokenizer(cfg)
    model = parallelize_model(load_model(cfg, device="cpu"), ParallelConfig(), device="cpu", world_size=1)
    return model, tok


def _trajectories(model, tok, *, max_turns=3, budget=60, done_after=0, n=2, prompts=("3 5 4 -> 32", "9 1 -> 8")):
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompts]
    envs = [CountingEnv(done_after) for _ in range(len(prompt_ids) * n)]
    trajs = run_trajectories(TurnCap(HFEngine(model, tok, batch_size=8), 5), envs, prompt_ids, group_size=n,
                             sampling=SamplingParams(max_tokens=budget, seed=7, logprobs=True), max_turns=max_turns,
                             render=ObservationRenderer(tok), tokenizer=tok)
    return [prompt_ids[s // n] for s in range(len(trajs))], trajs


def test_trajectory_is_model_turns_and_rendered_environment_messages(tiny):
    model, tok = tiny
    _, trajs = _trajectories(model, tok, max_turns=3, done_after=2)
    render = ObservationRenderer(tok)
    for t in trajs:
        assert t.finish_reason == "stop" and t.turns == 2 and t.env_rewards == [0.1, 0.2]
        env = render([{"role": "user", "content": "turn 1"}])
        assert tok.decode(env) == "\n<|im_start|>user\nturn 1<|im_end|>\n<|im_start|>assistant\n"
        n1 = t.model_mask.index(0)  # the first turn's tokens (at most 5: TurnCap), then the environment's
        assert 1 <= n1 <= 5 and t.ids[n1:n1 + len(env)] == env
        assert t.model_mask == [1] * n1 + [0] * len(env) + [1] * (len(t.ids) - n1 - len(env))
        assert 1 <= len(t.ids) - n1 - len(env) <= 5
        assert [m["role"] for m in t.messages] == ["assistant", "user", "assistant"]
        assert t.logprobs[n1:n1 + len(env)] == [0.0] * len(env)


def test_max_turns_truncates_a_trajectory_that_still_acts(tiny):
    model, tok = tiny
    _, trajs = _trajectories(model, tok, max_turns=2)
    assert all(t.finish_reason == "length" and t.turns == 2 for t in trajs)
    assert all(t.model_mask[-1] == 1 for t in trajs)  # ends with the model's last turn, not the environment's
    _, trajs = _trajectories(model, tok, max_turns=9, budget=30)  # the token budget ends it first
    assert all(t.finish_reason == "length" and len(t.ids) <= 30 for t in trajs)


def test_model_token_logprobs_equal_one_forward_over_the_whole_conversation(tiny):
    """Sampler log-probs (turn by turn, KV-cached) and the trainer's packed log-probs both equal a plain forward
    over prompt + whole trajectory at the model's tokens."""
    model, tok = tiny
    prompts, trajs = _trajectories(model, tok, max_turns=3)
    mbs = plan_packed(prompts, [t.ids for t in trajs], 4096, device="cpu")
    packed = packed_logprobs(model, mbs, sum(len(t.ids) for t in trajs), temperature=1.0, backend="auto")
    start = 0
    with torch.no_grad():
        for p, t in zip(prompts, trajs):
            ids = torch.tensor([p + t.ids])
            lp = model(ids).logits[0].log_softmax(-1)[len(p) - 1:-1].gather(1, ids[0, len(p):, None])[:, 0]
            m = torch.tensor(t.model_mask, dtype=torch.bool)
            torch.testing.assert_close(torch.tensor(t.logprobs)[m], lp[m], rtol=0, atol=2e-4)
            torch.testing.assert_close(packed[start:start + len(t.ids)], lp, rtol=0, atol=2e-4)
            start += len(t.ids)


def _update(model, prompts, trajs, *, capture=None, advantages=None, loss_type="grpo"):
    """One GRPO update (the trainer's grpo_update, learning rate 0) on ``trajs``; returns the step's metrics.
    ``capture``: filled with the gradient of the head's input rows, in the flat layout."""
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    metrics = StepMetrics()
    batch = GRPOBatch(prompt_ids=prompts, completion_ids=[t.ids for t in trajs],
                      advantages=torch.linspace(-1, 1, len(trajs)) if advantages is None else advantages,
                      model_mask=torch.tensor([m for t in trajs for m in t.model_mask], dtype=torch.bool))
    runner = ModelRunner(model)
    forward = runner.packed_forward

    def hooked(mb, fn):
        def head(h, w):
            if capture is not None and h.requires_grad:
                h.register_hook(lambda g, mb=mb: capture.index_copy_(0, mb.flat_index, g.detach()))
            return fn(h, w)
        return forward(mb, head)

    runner.packed_forward = hooked
    grpo_update(runner, batch, grpo=GRPOConfig(loss_type=loss_type, beta=0.0), rollout=RolloutConfig(),
                optimizer=opt, max_grad_norm=0.0, metrics=metrics, device="cpu")
    return metrics.reduce()


def test_environment_tokens_get_exactly_zero_gradient(tiny):
    model, tok = tiny
    prompts, trajs = _trajectories(model, tok, max_turns=3)
    n = sum(len(t.ids) for t in trajs)
    grad_h = torch.full((n, model.config.hidden_size), float("nan"))
    _update(model, prompts, trajs, capture=grad_h)
    mask = torch.tensor([m for t in trajs for m in t.model_mask], dtype=torch.bool)
    assert (~mask).sum() > 0
    assert torch.equal(grad_h[~mask], torch.zeros_like(grad_h[~mask]))  # exactly zero, not small
    assert (grad_h[mask].abs().sum(-1) > 0).all()


def test_a_trajectory_packed_with_others_equals_it_alone(tiny):
    model, tok = tiny
    prompts, trajs = _trajectories(model, tok, max_turns=3)
    lengths = [len(t.ids) for t in trajs]
    mbs = plan_packed(prompts, [t.ids for t in trajs], 4096, device="cpu")
    assert len(mbs) == 1 and len(mbs[0].seq_indices) == len(trajs)  # all in one packed row
    together = packed_logprobs(model, mbs, sum(lengths), temperature=1.0, backend="auto")
    start = sum(lengths[:2])
    alone = packed_logprobs(model, plan_packed(prompts[2:3], [trajs[2].ids], 4096, device="cpu"), lengths[2],
                            temperature=1.0, backend="auto")
    torch.testing.assert_close(together[start:start + lengths[2]], alone, rtol=0, atol=1e-5)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_loss_normalisation_counts_model_tokens_only(tiny, loss_type):
    """At ratio 1 without KL each token's loss is -A, so with every advantage 1 the loss is -sum_t w_t: exactly -1
    when the weights of grpo (1 / (S * L_i)) and dapo (1 / sum_i L_i) count the model's tokens only (counting the
    environment's tokens too would give -(model tokens / all tokens))."""
    model, tok = tiny
    prompts, trajs = _trajectories(model, tok, max_turns=3)
    record = _update(model, prompts, trajs, advantages=torch.ones(len(trajs)), loss_type=loss_type)
    assert record["loss"] == pytest.approx(-1.0, abs=1e-6)


# ------------------------------------------------------------------------------------------------ the trainer

class ToolScript(RolloutEngine):
    """Turn 1 of every trajectory calls tool ``tools[j % len(tools)]``; turn 2 answers (or calls again with
    ``always_call``); each turn ends with EOS."""

    def __init__(self, tok, tools, always_call=False):
        self.tok, self.tools, self.always_call, self.calls = tok, tools, always_call, 0

    def generate(self, prompts, n, sampling):
        out = []
        for b, p in enumerate(prompts):
            group = []
            for j in range(n):
                first = self.tok.decode(p).count("<|im_start|>tool") == 0
                text = (f'<tool_call>{{"name": "{self.tools[(b + j) % len(self.tools)]}", "arguments": {{}}}}'
                        "</tool_call>" if first or self.always_call else "7")
                ids = self.tok(text, add_special_tokens=False)["input_ids"][:sampling.max_tokens - 1]
                group.append(Completion(token_ids=ids + [self.tok.eos_token_id], text=text, finish_reason="stop",
                                        logprobs=[-1.0] * (len(ids) + 1)))
            out.append(group)
        return out

    def update_weights(self, named_tensors):
        pass


TOOLS_FILE = '''
import time

def hang() -> str:
    """Never returns."""
    time.sleep(600)

def boom() -> str:
    """Raises."""
    raise RuntimeError("boom")

def chatty() -> str:
    """Prints 10 MB."""
    print("x" * 10_000_000)
    return "done"

def garbage():
    """Returns an object whose text cannot be had."""
    class Bad:
        def __str__(self):
            raise ValueError("no text")
    return Bad()
'''

TRAIN = ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
         "grpo.prompts_per_step=2", "grpo.num_generations=4", "eval.every=-1", "log.progress=false",
         "data.system_prompt=''", "checkpoint.resume=never", "checkpoint.export_hf=false", "max_steps=1",
         "rollout.max_completion_length=200", "rollout.env.name=tools", "rollout.env.timeout_s=1"]


def test_tools_that_hang_raise_print_10mb_or_return_garbage_never_stop_a_run(tmp_path):
    tools = tmp_path / "tools.py"
    tools.write_text(TOOLS_FILE)
    names = ["hang", "boom", "chatty", "garbage"]
    cfg = load_config(None, TRAIN + [f"output_dir={tmp_path}", "rollout.max_turns=2", "rollout.env.max_output_chars=64",
                                     f"rollout.env.tools=[{','.join(f'{tools}:{n}' for n in names)}]"])
    trainer = Trainer(cfg, engine=ToolScript(load_tokenizer(cfg.model), names))
    try:
        record, ep = trainer.train_step()
    finally:
        trainer.close()
    assert record["env/tool_calls"] == 8 and record["env/tool_failure_rate"] == pytest.approx(0.75)
    assert record["env/tool_failures/timeout"] == 2 and record["env/tool_failures/exception"] == 2
    assert record["env/tool_failures/bad_output"] == 2
    assert all(f == "stop" for f in ep.finish_reasons)
    assert record["reward/mean"] == 1.0  # every trajectory answered '7' after its tool call
    results = {ep.completion_texts[s].split("\n")[2]: s for s in range(len(ep.completion_texts))}
    assert any("did not finish within 1 s" in r for r in results)
    assert any(r.startswith("Error: RuntimeError: boom") for r in results)
    assert any(r.startswith("x" * 20) and r.endswith("[cut: 10000005 characters in all]") and len(r) == 64
               for r in results)  # 10 MB printed, then "done"
    assert any(r.startswith("Error: returned a value with no text") for r in results)


def test_max_turns_truncation_is_masked_when_asked(tmp_path):
    cfg = load_config(None, TRAIN + [f"output_dir={tmp_path}", "rollout.max_turns=2", "rollout.env.tools=[calculator]",
                                     "grpo.mask_truncated_completions=true"])
    trainer = Trainer(cfg, engine=ToolScript(load_tokenizer(cfg.model), ["calculator"], always_call=True))
    try:
        record, ep = trainer.train_step()
    finally:
        trainer.close()
    assert ep.finish_reasons == ["length"] * 8 and record["completion/truncated_frac"] == 1.0
    assert record["policy/masked_seq_frac"] == 1.0 and record["policy/grad_norm"] == 0.0
    assert record["env/turns_mean"] == 2.0
    assert ep.model_masks[0].count(0) > 0  # the tool messages' tokens
    # dynamic sampling keeps each sequence's mask with it
    assert select_groups(ep, [1], 4).model_masks == ep.model_masks[4:8]
    assert concat_episodes([ep, select_groups(ep, [0], 4)]).model_masks == ep.model_masks + ep.model_masks[:4]


ENV_FILE = '''
from fastgrpo.environments import Environment

class Counting(Environment):
    def __init__(self):
        self.k = 0

    def step(self, text):
        self.k += 1
        return f"turn {self.k}", None, self.k >= 2
'''


def _run_steps(tmp_path, name, max_steps, env_file):
    cfg = load_config(None, ["data.source=toy", "rewards.funcs=[toy_digit]", "model.name_or_path=tiny", "device=cpu",
                             "grpo.prompts_per_step=2", "grpo.num_generations=3", "eval.every=-1",
                             "log.progress=false", "data.system_prompt=''", "checkpoint.export_hf=false",
                             "checkpoint.every=1", "optim.lr=1e-2", "rollout.max_completion_length=64",
                             "rollout.max_turns=3", f"rollout.env.name={env_file}:Counting",
                             "rollout.importance_sampling_cap=2.0", f"output_dir={tmp_path}", f"name={name}",
                             f"max_steps={max_steps}"])
    trainer = Trainer(cfg)
    trainer.engine = TurnCap(trainer.engine, 4)  # turns that end (see TurnCap), so trajectories have several
    try:
        record = trainer.run()
        return record, {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    finally:
        trainer.close()


def test_resume_of_a_multi_turn_run_is_bit_exact(tmp_path):
    env_file = tmp_path / "env.py"
    env_file.write_text(ENV_FILE)
    straight, w_straight = _run_steps(tmp_path, "straight", 2, env_file)
    _run_steps(tmp_path, "resumed", 1, env_file)
    resumed, w_resumed = _run_steps(tmp_path, "resumed", 2, env_file)  # resumes from step 1's checkpoint
    assert straight["env/turns_mean"] > 1.0  # the steps were multi-turn
    for key in ("loss", "reward/mean", "completion/len_mean", "env/turns_mean", "policy/grad_norm"):
        assert resumed[key] == straight[key], key
    assert all(torch.equal(w_straight[k], w_resumed[k]) for k in w_straight)


class Uneven(RolloutEngine):
    """Model turns of a length fixed per prompt (``lengths`` by the prompt's first token), made of 'a' tokens: a call
    gives what the turn still lacks (the context's trailing 'a's are its part so far), or max_tokens of it with
    finish 'length'. Records every request's context + max_tokens, and how many continued a turn."""

    def __init__(self, lengths):
        self.lengths, self.requests, self.continued, self.calls = lengths, [], 0, []

    def generate(self, prompts, n, sampling):
        self.calls.append((len(prompts), n, sampling.max_tokens))
        out = []
        for p in prompts:
            self.requests.append(len(p) + sampling.max_tokens)
            done = next((i for i, x in enumerate(reversed(p)) if x != ord("a")), len(p))
            self.continued += done > 0
            want = self.lengths.get(p[0], 1) - done  # a filler prompt (another token): 1 token
            k = min(want, sampling.max_tokens)
            out.append([Completion(token_ids=[ord("a")] * k, text="a" * k, logprobs=[-0.5] * k,
                                   finish_reason="stop" if k == want else "length") for _ in range(n)])
        return out

    def update_weights(self, named_tensors):
        pass


def test_a_turn_never_asks_past_its_trajectorys_budget_and_a_capped_turn_continues(tiny):
    _, tok = tiny
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in ("b1", "c1234567", "x" * 13)]
    lengths = {ord("b"): 30, ord("c"): 45, ord("x"): 12}
    engine, budget = Uneven(lengths), 100
    trajs = run_trajectories(engine, [CountingEnv() for _ in range(6)], prompts, group_size=2,
                             sampling=SamplingParams(max_tokens=budget, seed=1, logprobs=True), max_turns=8,
                             render=ObservationRenderer(tok), tokenizer=tok)
    assert max(engine.requests) <= max(len(p) for p in prompts) + budget  # an engine's context holds no more
    assert engine.continued > 0  # some turns were capped by a shorter one's room, and continued
    for p, t in zip([p for p in prompts for _ in range(2)], trajs):
        assert len(t.ids) <= budget and len(t.logprobs) == len(t.ids) and t.finish_reason == "length"
        turns = [len(run) for run in "".join(map(str, t.model_mask)).split("0") if run]
        assert turns[:-1] == [lengths[p[0]]] * (len(turns) - 1) and 1 <= turns[-1] <= lengths[p[0]], turns


def test_ranks_make_the_same_generate_calls_and_padding_changes_no_trajectory(tiny):
    """Under torch.distributed the hf engine's decode is a collective: every rank must call generate as often, with
    as many sequences and the same max_tokens. Two 'ranks' (threads, the sync an all-reduce max through a barrier)
    with different work make identical calls, and each gets the trajectories it gets alone."""
    import threading

    _, tok = tiny
    lengths = {ord("b"): 30, ord("c"): 45, ord("x"): 12, ord("y"): 3}
    work = [["b1", "c1234567"], ["x" * 13, "y"]]
    barrier, slots = threading.Barrier(2, timeout=60), [None, None]  # a mismatch breaks the barrier, not hangs

    def sync_of(rank):
        def sync(values):
            slots[rank] = list(values)
            barrier.wait()
            out = [max(col) for col in zip(*slots)]
            barrier.wait()
            return out
        return sync

    def roll(rank, sync):
        engine = Uneven(lengths)
        prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in work[rank]]
        trajs = run_trajectories(engine, [CountingEnv(done_after=2 + rank * 3) for _ in range(4)], prompts,
                                 group_size=2, sampling=SamplingParams(max_tokens=100, seed=1), max_turns=8,
                                 render=ObservationRenderer(tok), tokenizer=tok, sync=sync)
        return engine.calls, [(t.ids, t.model_mask, t.finish_reason) for t in trajs]

    results = [None, None]
    threads = [threading.Thread(target=lambda r=r: results.__setitem__(r, roll(r, sync_of(r))), daemon=True)
               for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert results[0] is not None and results[1] is not None
    assert results[0][0] == results[1][0]  # the same calls: (sequences, n, max_tokens) each
    for rank in (0, 1):
        assert results[rank][1] == roll(rank, None)[1]
    assert len(roll(0, None)[0]) < len(results[0][0])  # rank 0 finished first and took part in rank 1's calls
