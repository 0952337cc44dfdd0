"""Any dataset: a prompt column (string or chat messages), every other column to the rewards, presets, and the
columns a reward needs checked before any model loads. The shipped example (examples/own_task) trains."""

import json
from pathlib import Path

import pytest

from fastgrpo.config import DataConfig
from fastgrpo.data import build_datasets, render_prompt
from fastgrpo.algorithms.episodes import reward_columns
from fastgrpo.rewards import check_reward_columns, configure_rewards, load_reward_funcs, required_columns

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "own_task"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]


class _ChatTok:
    """Just enough tokenizer for render_prompt: a chat template that shows roles and contents."""

    chat_template = "yes"

    def apply_chat_template(self, messages, tokenize, add_generation_prompt):
        assert not tokenize and add_generation_prompt
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + "<assistant>"


def _write(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_message_and_string_prompts_render_and_other_columns_reach_rewards(tmp_path):
    rows = [{"prompt": MESSAGES, "answer": "5", "level": 1},
            {"prompt": "Say 7.", "answer": "7", "level": 2},
            {"prompt": [{"role": "user", "content": "What is 1 + 1?"}], "answer": "2", "level": 3}]
    cfg = DataConfig(source=_write(tmp_path / "d.jsonl", rows), num_eval=0, system_prompt="SYS")
    train, _, info = build_datasets(cfg, cache_dir=str(tmp_path / "c"))
    assert info["task"] == "prompt" and len(train) == 3
    by_answer = {r["answer"]: r for r in train}
    tok = _ChatTok()
    # messages: rendered as given (no system prompt added); a string: the user message after the system prompt
    assert render_prompt(by_answer["5"], template="chat", system_prompt="SYS", tokenizer=tok) == \
        "<system>Be brief.<user>What is 2 + 3?<assistant>"
    assert render_prompt(by_answer["7"], template="chat", system_prompt="SYS", tokenizer=tok) == \
        "<system>SYS<user>Say 7.<assistant>"
    cols = reward_columns([by_answer["5"], by_answer["7"]], 2, ["p5", "p7"], [[1], [2], [3], [4]])
    assert cols["answer"] == ["5", "5", "7", "7"] and cols["level"] == [1, 1, 2, 2]
    assert cols["prompts"] == ["p5", "p5", "p7", "p7"] and "prompt" not in cols


def test_custom_prompt_column_bad_prompts_and_base_template(tmp_path):
    path = _write(tmp_path / "q.jsonl", [{"query": "Hi?", "gold": "x"}, {"query": "Yo?", "gold": "y"}])
    train, eval_rows, info = build_datasets(DataConfig(source=path, prompt_column="query", num_eval=1),
                                            cache_dir=str(tmp_path / "c"))
    assert info["task"] == "prompt" and len(train) + len(eval_rows) == 2
    cols = reward_columns(train, 1, ["p"], [[1]], prompt_column="query")
    assert "query" not in cols and cols["gold"] == [train[0]["gold"]]
    with pytest.raises(ValueError, match="no prompt column 'prompt'"):
        build_datasets(DataConfig(source=path, num_eval=1), cache_dir=str(tmp_path / "c"))
    bad = _write(tmp_path / "bad.jsonl", [{"prompt": "ok"}, {"prompt": [{"role": "user"}]}])
    with pytest.raises(ValueError, match=r"row 1 \(line 2\): field 'prompt' must be a string or a list of chat messages"):
        build_datasets(DataConfig(source=bad, num_eval=0), cache_dir=str(tmp_path / "c"))
    msgs = _write(tmp_path / "m.jsonl", [{"prompt": MESSAGES}, {"prompt": MESSAGES[1:]}])
    with pytest.raises(ValueError, match="data.template='base' needs string prompts"):
        build_datasets(DataConfig(source=msgs, num_eval=0, template="base"), cache_dir=str(tmp_path / "c"))


def test_math_preset_derives_answer_from_the_boxed_solution(tmp_path):
    rows = [{"problem": "Compute 1/2 + 1/2.", "solution": "We add: $\\boxed{1}$."},
            {"problem": "Compute x.", "solution": "So x = \\boxed{\\frac{1}{2}}"}]
    train, _, info = build_datasets(DataConfig(source=_write(tmp_path / "m.jsonl", rows), num_eval=0),
                                    cache_dir=str(tmp_path / "c"))
    assert info["task"] == "math"
    assert sorted(r["answer"] for r in train) == ["1", "\\frac{1}{2}"]
    prompt = render_prompt(train[0], template="base")
    assert train[0]["problem"] in prompt and prompt.endswith("<think>")


def _plugin(tmp_path: Path) -> str:
    (tmp_path / "plug.py").write_text(
        "def needs_gold(completions, gold, **kw):\n    return [0.0] * len(completions)\n"
        "def scaled(completions, scale=1.0, max_completion_length=None, **kw):\n"
        "    return [scale * max_completion_length] * len(completions)\n")
    return str(tmp_path / "plug.py")


def test_required_columns_from_attributes_and_signatures(tmp_path):
    plug = _plugin(tmp_path)
    funcs = dict(load_reward_funcs(["countdown", "gsm8k", "format", "cosine", f"{plug}:needs_gold"]))
    assert required_columns(funcs["countdown"]) == ("nums", "target")
    assert required_columns(funcs["gsm8k"]) == ("answer",)
    assert required_columns(funcs["format"]) == ()
    assert required_columns(funcs["needs_gold"]) == ("gold",)
    assert required_columns(funcs["cosine"]) == ("answer",)  # its accuracy reward's ('math')
    bound = configure_rewards([("cosine", funcs["cosine"])], {"cosine": {"accuracy": "countdown"}})
    assert required_columns(bound[0][1]) == ("nums", "target")
    with pytest.raises(ValueError, match=r"reward 'needs_gold' needs the dataset column\(s\) \['gold'\].*'d.jsonl'"):
        check_reward_columns([("needs_gold", funcs["needs_gold"])], ["answer", "task"], source="d.jsonl")
    check_reward_columns([("needs_gold", funcs["needs_gold"])], ["gold"], source="d.jsonl")


def test_reward_kwargs_bind_parameters_and_the_length_limit(tmp_path):
    plug = _plugin(tmp_path)
    spec = f"{plug}:scaled"
    funcs = configure_rewards(load_reward_funcs([spec]), {"scaled": {"scale": 2.0}}, max_completion_length=7,
                              specs=[spec])
    assert funcs[0][1](completions=["a", "b"]) == [14.0, 14.0]
    with pytest.raises(ValueError, match=r"rewards.kwargs.scaled.sclae: reward 'scaled' has no parameter 'sclae'"):
        configure_rewards(load_reward_funcs([spec]), {"scaled": {"sclae": 2.0}}, specs=[spec])
    with pytest.raises(ValueError, match=r"rewards.kwargs.cosin: no reward of that name"):
        configure_rewards(load_reward_funcs(["cosine"]), {"cosin": {}})


def test_missing_reward_column_fails_before_any_model_loads(tmp_path, monkeypatch, capsys):
    import fastgrpo.trainers.grpo as trainer_mod
    from fastgrpo.train import main

    def no_model(*a, **k):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(trainer_mod, "load_model", no_model)
    monkeypatch.setattr(trainer_mod, "load_tokenizer", no_model)
    data = _write(tmp_path / "noanswer.jsonl", [{"prompt": f"Say {i}.", "level": i} for i in range(12)])
    rc = main(["--config", str(EXAMPLE / "config.yaml"), f"data.source={data}", f"output_dir={tmp_path}",
               f"rewards.funcs=[{EXAMPLE}/reward.py:exact_answer]", "rewards.weights=null", "rewards.kwargs={}"])
    err = capsys.readouterr().err
    assert rc == 2 and "reward 'exact_answer' needs the dataset column(s) ['answer']" in err and data in err
    assert not (tmp_path / "own-task").exists()


def test_the_own_task_example_trains_through_fastgrpo_train(tmp_path, monkeypatch):
    """A jsonl with `prompt` (messages) and `answer` columns, a plugin reward that reads `answer`: it trains."""
    from fastgrpo.train import main

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository root
    assert main(["--config", "examples/own_task/config.yaml", f"output_dir={tmp_path}", "max_steps=2",
                 "eval.every=-1"]) == 0
    records = [json.loads(x) for x in (tmp_path / "own-task" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2]
    assert {"reward/exact_answer/mean", "reward/brevity/mean", "reward/repetition/mean"} <= set(records[-1])
    data = {json.dumps(json.loads(x)["prompt"][1]["content"]): json.loads(x)["answer"]
            for x in (EXAMPLE / "data.jsonl").read_text().splitlines()}
    comps = [json.loads(x) for x in (tmp_path / "own-task" / "completions.jsonl").read_text().splitlines()]
    import re
    for c in comps:  # the plugin scored each completion against its own row's answer
        question = next(q for q in data if json.loads(q) in c["prompt"])
        nums = re.findall(r"-?\d+", c["completion"])
        assert c["rewards"]["exact_answer"] == float(bool(nums) and nums[-1] == data[question])
        assert "Answer with a single number." in c["prompt"]  # the data's own system message, not the seeds'
