"""Data: Countdown generation and solving, splits, file/hub loading and validation, sampling, templates."""

from __future__ import annotations

import json
import re
import random
from pathlib import Path

import pytest

from fastgrpo.config import SEEDS_SYSTEM_PROMPT, DataConfig
from fastgrpo.data import PromptSampler, build_datasets, problem_key, render_prompt, solve
from fastgrpo.data.countdown import countdown_splits, generate_problems
from fastgrpo.data.files import file_splits, load_source_rows
from fastgrpo.data.toy import toy_prompts
from fastgrpo.rewards import countdown_reward, format_reward, toy_digit_reward

DATA = Path(__file__).parent / "data"


@pytest.fixture(scope="module")
def countdown_data():
    seed = random.randrange(2**31)
    cfg = DataConfig(num_train=300, num_eval=40, seed=seed)
    return cfg, build_datasets(cfg)


# ---------------------------------------------------------------------------------------------------------
# Countdown generator and solver


def test_countdown_generation_is_deterministic_given_seed(countdown_data):
    cfg, (train, eval_rows, _) = countdown_data
    again_train, again_eval, _ = build_datasets(cfg)
    assert (again_train, again_eval) == (train, eval_rows)
    other_train, _, _ = build_datasets(DataConfig(num_train=300, num_eval=40, seed=cfg.seed + 1))
    assert other_train != train


def test_countdown_rows_respect_config_ranges(countdown_data):
    cfg, (train, eval_rows, info) = countdown_data
    assert len(train) == cfg.num_train and len(eval_rows) == cfg.num_eval
    assert info["num_train"] == cfg.num_train and info["task"] == "countdown"
    for row in train + eval_rows:
        assert set(row) == {"nums", "target", "task"} and row["task"] == "countdown"
        assert cfg.min_numbers <= len(row["nums"]) <= cfg.max_numbers
        assert all(type(n) is int and 1 <= n <= cfg.max_value for n in row["nums"])
        assert type(row["target"]) is int and 1 <= row["target"] <= 100
    # Both sizes of problem actually occur.
    assert {len(r["nums"]) for r in train} == {3, 4}


def test_every_generated_problem_is_solvable_and_the_solution_scores_one(countdown_data):
    _, (train, eval_rows, _) = countdown_data
    rows = train[:150] + eval_rows
    solutions = [solve(r["nums"], r["target"]) for r in rows]
    assert all(s is not None for s in solutions)
    completions = [f"<think>found it</think><answer>{s}</answer>" for s in solutions]
    scores = countdown_reward(completions, nums=[r["nums"] for r in rows], target=[r["target"] for r in rows])
    assert scores == [1.0] * len(rows)


def test_solver_needs_fractions_and_reports_unsolvable():
    expr = solve([3, 3, 8, 8], 24)  # only 8 / (3 - 8 / 3) works: needs a fractional intermediate
    assert expr is not None
    assert countdown_reward([f"<answer>{expr}</answer>"], nums=[[3, 3, 8, 8]], target=[24]) == [1.0]
    assert solve([1, 1, 1], 97) is None
    assert solve([2, 3], 7) is None


def test_train_and_eval_never_overlap_even_in_a_crowded_space():
    # With 3 numbers from 1..6 the space is small, so the train stream keeps drawing eval problems.
    train, eval_rows = countdown_splits(num_train=120, num_eval=30, seed=random.randrange(2**31),
                                        min_numbers=3, max_numbers=3, max_value=6)
    train_keys = [problem_key(r) for r in train]
    assert len(set(train_keys)) == len(train_keys)
    assert not set(train_keys) & {problem_key(r) for r in eval_rows}
    # The same problem in another order is the same key.
    assert problem_key({"nums": [3, 1, 2], "target": 6}) == problem_key({"nums": [2, 3, 1], "target": 6})


def test_eval_split_does_not_depend_on_num_train():
    a = countdown_splits(num_train=50, num_eval=10, seed=3)[1]
    b = countdown_splits(num_train=200, num_eval=10, seed=3)[1]
    assert a == b


def test_too_small_problem_space_raises():
    with pytest.raises(ValueError, match="distinct problems"):
        generate_problems(500, seed=0, min_numbers=2, max_numbers=2, max_value=2)


# ---------------------------------------------------------------------------------------------------------
# Toy task


def test_toy_prompts_distinct_and_split():
    prompts = toy_prompts()
    assert len(prompts) >= 24 and len(set(prompts)) == len(prompts)
    train, eval_rows, info = build_datasets(DataConfig(source="toy", num_eval=64, seed=1))
    assert info["task"] == "toy" and len(train) + len(eval_rows) == len(prompts)
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in eval_rows}
    assert all(set(r) == {"prompt", "task"} and r["task"] == "toy" for r in train)
    assert toy_digit_reward(["12", "twelve"]) == [1.0, 0.0]


# ---------------------------------------------------------------------------------------------------------
# Files and hub


@pytest.fixture()
def cache(tmp_path):
    return str(tmp_path / "hf_cache")


def _jsonl_rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_jsonl_and_parquet_load_the_same_rows(tmp_path, cache):
    import pyarrow as pa
    import pyarrow.parquet as pq

    expected = _jsonl_rows(DATA / "countdown_small.jsonl")
    parquet = tmp_path / "countdown_small.parquet"
    pq.write_table(pa.Table.from_pylist(expected), parquet)
    assert load_source_rows(str(DATA / "countdown_small.jsonl"), split="train", cache_dir=cache) == expected
    assert load_source_rows(str(parquet), split="train", cache_dir=cache) == expected


def test_file_source_carves_eval_and_drops_duplicates_of_it(tmp_path, cache):
    # Rows 0 and 5 of the fixture are one problem in two orders; hold out every row but one to force it.
    rows = _jsonl_rows(DATA / "countdown_small.jsonl")
    train, eval_rows, info = build_datasets(
        DataConfig(source=str(DATA / "countdown_small.jsonl"), num_eval=4, seed=0), cache_dir=cache
    )
    assert info["task"] == "countdown" and info["skipped_invalid_rows"] == 0
    assert len(train) + len(eval_rows) + info["removed_eval_overlap"] == len(rows)
    assert not {problem_key(r) for r in train} & {problem_key(r) for r in eval_rows}
    assert all(r["task"] == "countdown" for r in train + eval_rows)
    # Find a seed whose held-out set contains exactly one copy of the duplicate: its twin must leave train.
    dup = problem_key(rows[0])
    for seed in range(50):
        train, eval_rows, info = file_splits(str(DATA / "countdown_small.jsonl"), split="train", eval_split=None,
                                             num_eval=4, seed=seed, skip_invalid_rows=False, cache_dir=cache)
        if sum(problem_key(r) == dup for r in eval_rows) == 1:
            assert info["removed_eval_overlap"] == 1
            assert all(problem_key(r) != dup for r in train)
            break
    else:
        pytest.fail("no seed held out exactly one copy of the duplicate")


def test_invalid_row_error_names_row_and_field(cache):
    cfg = DataConfig(source=str(DATA / "countdown_invalid.jsonl"), num_eval=1)
    with pytest.raises(ValueError, match=r"row 1 \(line 2\): field 'target' must be an integer, got 'sixty-four'"):
        build_datasets(cfg, cache_dir=cache)


def test_invalid_rows_skipped_and_counted(cache):
    cfg = DataConfig(source=str(DATA / "countdown_invalid.jsonl"), num_eval=1, skip_invalid_rows=True)
    train, eval_rows, info = build_datasets(cfg, cache_dir=cache)
    assert info["skipped_invalid_rows"] == 2  # row 1 (bad target) and row 3 (no nums)
    assert len(train) + len(eval_rows) == 3


def test_missing_field_is_named(tmp_path, cache):
    path = tmp_path / "missing.jsonl"
    path.write_text('{"nums": [1, 2], "target": 3}\n{"nums": [1, 2], "target": 3}\n{"target": 5}\n')
    with pytest.raises(ValueError, match=r"row 2 \(line 3\): field 'nums' is missing"):
        file_splits(str(path), split="train", eval_split=None, num_eval=1, seed=0, skip_invalid_rows=False,
                    cache_dir=cache)
    path.write_text('{"nums": [1, "two"], "target": 3}\n')
    with pytest.raises(ValueError, match=r"row 0 \(line 1\): field 'nums' must be a list of integers"):
        file_splits(str(path), split="train", eval_split=None, num_eval=0, seed=0, skip_invalid_rows=False,
                    cache_dir=cache)


def test_gsm8k_like_file_is_recognised_and_rendered(cache):
    train, eval_rows, info = build_datasets(
        DataConfig(source=str(DATA / "gsm8k_small.jsonl"), num_eval=1, template="base"), cache_dir=cache
    )
    assert info["task"] == "gsm8k" and len(train) == 3 and len(eval_rows) == 1
    prompt = render_prompt(train[0], template="base")
    assert train[0]["question"] in prompt and prompt.endswith("<think>")


def test_unknown_columns_and_missing_file_are_clear(tmp_path, cache):
    path = tmp_path / "other.jsonl"
    path.write_text('{"text": "hello"}\n')
    with pytest.raises(ValueError, match=r"match no known task.*nums"):
        build_datasets(DataConfig(source=str(path)), cache_dir=cache)
    with pytest.raises(ValueError, match="does not exist"):
        build_datasets(DataConfig(source=str(tmp_path / "nope.parquet")), cache_dir=cache)


def test_hub_source_goes_through_load_dataset_with_config_and_splits(monkeypatch, cache):
    import datasets

    calls = []
    rows = _jsonl_rows(DATA / "countdown_small.jsonl")

    def fake_load_dataset(name, config=None, *, split, cache_dir=None):
        calls.append((name, config, split))
        if name == "offline/missing":
            raise ConnectionError("no network")
        return datasets.Dataset.from_list(rows[:6] if split == "train" else rows[6:])

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    cfg = DataConfig(source="someone/countdown:main", split="train", eval_split="test")
    train, eval_rows, info = build_datasets(cfg, cache_dir=cache)
    assert calls == [("someone/countdown", "main", "train"), ("someone/countdown", "main", "test")]
    assert len(eval_rows) == 4 and len(train) == 6 - info["removed_eval_overlap"]
    with pytest.raises(ValueError, match="needs network"):
        build_datasets(DataConfig(source="offline/missing"), cache_dir=cache)


# ---------------------------------------------------------------------------------------------------------
# Sampler


def test_sampler_resume_continues_exactly():
    seed, n = random.randrange(2**31), random.randrange(5, 40)
    sizes = [random.randrange(1, 13) for _ in range(20)]
    full = PromptSampler(n, seed=seed)
    uninterrupted = [full.next_batch(k) for k in sizes]
    first = PromptSampler(n, seed=seed)
    got = [first.next_batch(k) for k in sizes[:7]]
    state = json.loads(json.dumps(first.state_dict()))  # survives a checkpoint's serialisation
    resumed = PromptSampler(n, seed=seed)
    resumed.load_state_dict(state)
    got += [resumed.next_batch(k) for k in sizes[7:]]
    assert got == uninterrupted


def test_sampler_epochs_are_permutations_that_change():
    s = PromptSampler(17, seed=5)
    e0, e1 = s.next_batch(17), s.next_batch(17)
    assert sorted(e0) == sorted(e1) == list(range(17))
    assert e0 != e1


def test_sampler_ranks_disjoint_and_cover_the_epoch():
    n, world = 23, 3
    per_rank = n // world
    shares = [PromptSampler(n, seed=9, rank=r, world_size=world).next_batch(2 * per_rank) for r in range(world)]
    for epoch in range(2):
        parts = [set(s[epoch * per_rank:(epoch + 1) * per_rank]) for s in shares]
        assert sum(len(p) for p in parts) == per_rank * world  # disjoint and duplicate-free
        assert len(set().union(*parts)) == per_rank * world


def test_sampler_refuses_incompatible_state():
    state = PromptSampler(10, seed=1).state_dict()
    with pytest.raises(ValueError, match="num_rows"):
        PromptSampler(11, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="rank"):
        PromptSampler(10, seed=1, rank=2, world_size=2)


# ---------------------------------------------------------------------------------------------------------
# Templates


@pytest.fixture(scope="module")
def chat_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"[UNK]": 0, "hi": 1}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]")
    fast.chat_template = (
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    return fast


ROW = {"nums": [25, 4, 7], "target": 93, "task": "countdown"}


def test_chat_template_renders_system_and_user(chat_tokenizer):
    text = render_prompt(ROW, template="chat", system_prompt=SEEDS_SYSTEM_PROMPT, tokenizer=chat_tokenizer)
    assert text.startswith(f"<|system|>{SEEDS_SYSTEM_PROMPT}<|end|>\n<|user|>")
    assert text.endswith("<|end|>\n<|assistant|>")
    user = text.split("<|user|>")[1]
    assert "[25, 4, 7]" in user and "93" in user and "<answer>" in user and "<think>" in user
    no_system = render_prompt(ROW, template="chat", system_prompt="", tokenizer=chat_tokenizer)
    assert no_system.startswith("<|user|>")


def test_chat_template_needs_a_chat_tokenizer(chat_tokenizer):
    from transformers import PreTrainedTokenizerFast

    no_template = PreTrainedTokenizerFast(tokenizer_object=chat_tokenizer.backend_tokenizer, unk_token="[UNK]")
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(ROW, template="chat", system_prompt="", tokenizer=no_template)
    with pytest.raises(ValueError, match="chat template"):
        render_prompt(ROW, template="chat", system_prompt="", tokenizer=None)


def test_base_template_ends_in_think_and_pairs_with_format_reward():
    prompt = render_prompt(ROW, template="base", system_prompt="ignored")
    assert prompt.endswith("<think>") and "[25, 4, 7]" in prompt and "93" in prompt
    completion = " 25 * 4 is 100, minus 7.</think>\n<answer>25 * 4 - 7</answer>"
    assert format_reward([completion], prompts=[prompt]) == [1.0]
    assert countdown_reward([completion], nums=[ROW["nums"]], target=[ROW["target"]]) == [1.0]


def test_toy_rows_render_their_prompt(chat_tokenizer):
    row = {"prompt": "Write a number:", "task": "toy"}
    assert render_prompt(row, template="chat", tokenizer=chat_tokenizer) == \
        "<|user|>Write a number:<|end|>\n<|assistant|>"


def test_render_rejects_unknown_task_and_template():
    with pytest.raises(ValueError, match="unknown task"):
        render_prompt({"task": "chess"}, template="base")
    with pytest.raises(ValueError, match="unknown template"):
        render_prompt(ROW, template="fancy")


# ---------------------------------------------------------------------------------------------------------
# Files are read as written: no conversion, and every problem named with its line


def _splits(path, **kw):
    return file_splits(str(path), split="train", eval_split=None, num_eval=0, seed=0, skip_invalid_rows=False,
                       cache_dir=None, **kw)


def test_big_integers_stay_exact_and_strings_or_floats_are_not_converted(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"nums": [1, 2, 3], "target": 6}\n{"nums": [4, 5, 6], "target": %d}\n' % 10 ** 29)
    train, _, _ = _splits(path)
    assert train[1]["target"] == 10 ** 29 and type(train[1]["target"]) is int  # Arrow would round it to a float
    for bad, needle in [('{"nums": ["1", "2", "3"], "target": 6}', "field 'nums' must be a list of integers"),
                        ('{"nums": [1, 2, 3], "target": "6"}', "field 'target' must be an integer, got '6'"),
                        ('{"nums": [1, 2, 3], "target": 6.0}', "field 'target' must be an integer, got 6.0")]:
        path.write_text('{"nums": [1, 2, 3], "target": 6}\n\n' + bad + "\n")
        with pytest.raises(ValueError, match=rf"row 1 \(line 3\): {needle}"):
            _splits(path)


@pytest.mark.parametrize("name, content, needle", [
    ("empty.jsonl", "", "has no rows"),
    ("blank.jsonl", "\n  \n", "has no rows"),
    ("broken.jsonl", '{"nums": [1, 2], "target": 3}\n{"nums": [1, 2], "tar\n', "line 2 is not valid JSON"),
    ("nan.jsonl", '{"nums": [1, 2], "target": NaN}\n', "line 1 is not valid JSON (NaN is not a JSON number)"),
    ("list.jsonl", '[1, 2]\n', "line 1 is a JSON list, expected an object"),
    ("array.json", '[{"nums": [1, 2], "target": 3}, 7]', "item 1 of the array is not a JSON object"),
    ("bad.json", '[{"nums": [1, 2], "target": 3},', "is not valid JSON at line 1"),
    ("latin1.jsonl", b'{"question": "caf\xe9", "answer": "1"}\n', "is not UTF-8 text"),
    ("garbage.parquet", "not parquet", "is not a readable parquet file"),
])
def test_unreadable_files_are_one_line_errors(tmp_path, name, content, needle):
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(ValueError, match=re.escape(needle)) as info:
        _splits(path)
    assert "\n" not in str(info.value)


def test_an_empty_parquet_file_is_a_one_line_error(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"nums": pa.array([], pa.list_(pa.int64())), "target": pa.array([], pa.int64())}), path)
    with pytest.raises(ValueError, match="has no rows"):
        _splits(path)


def test_a_reserved_column_name_is_an_error_unless_it_is_the_prompt_column(tmp_path, cache):
    path = tmp_path / "q.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "prompt": "x", "prompts": "y"}) + "\n" for i in range(4)))
    with pytest.raises(ValueError, match=r"column name\(s\) \['prompt', 'prompts'\] are reserved"):
        build_datasets(DataConfig(source=str(path), prompt_column="question", num_eval=1), cache_dir=cache)
    path.write_text("".join(json.dumps({"prompts": f"q{i}"}) + "\n" for i in range(4)))
    train, _, _ = build_datasets(DataConfig(source=str(path), prompt_column="prompts", num_eval=1), cache_dir=cache)
    assert len(train) == 3  # the prompt column may have a reserved name: it is consumed as the prompt


def test_no_training_rows_says_where_they_went(tmp_path, cache):
    path = tmp_path / "p.jsonl"
    path.write_text("".join(json.dumps({"prompt": "same"}) + "\n" for _ in range(3)))
    with pytest.raises(ValueError, match=r"3 valid row\(s\), 1 held out for evaluation \(data.num_eval=1\), 2 equal "
                                         r"to a held-out row; lower data.num_eval"):
        build_datasets(DataConfig(source=str(path), num_eval=1), cache_dir=cache)
