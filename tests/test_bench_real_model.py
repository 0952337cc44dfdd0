"""The side-by-side benchmark's real-model work (benchmarks/peer_work.py, work 'smollm2'): the named source resolves to
its converted folder, and the no-EOS edit holds on a pretrained model, whose residual stream is far larger than a
random model's (the edit without the final norm's gain left EOS a probability of 0.9)."""

import copy
import json

import torch

from benchmarks import peer_work


def test_the_real_model_work_names_a_source_that_resolves_to_its_folder(smollm2_path):
    assert peer_work.WORKS["smollm2"].model == "smollm2-135m-instruct"
    assert peer_work.model_source("smollm2-135m-instruct") == smollm2_path


def test_suppress_eos_holds_on_the_pretrained_model_only_with_the_norm_gain(smollm2):
    model, tok = smollm2
    eos = [tok.eos_token_id]
    text = tok.apply_chat_template([{"role": "user", "content": "What is 29 * 8? Answer with just the number."}],
                                   tokenize=False, add_generation_prompt=True)
    ids = torch.tensor([tok(text)["input_ids"] + tok("232", add_special_tokens=False)["input_ids"]])  # [1, T]

    def eos_probability(edit):
        net = copy.deepcopy(model)  # the session's shared model stays as loaded
        with torch.no_grad():
            edit(net)
            probs = net(input_ids=ids).logits.softmax(-1)[0, :, eos]  # [T, len(eos)]
            # positions whose input is an EOS (the chat template's <|im_end|>) carry -margin: generation never feeds one
            return probs[~torch.isin(ids[0], torch.tensor(eos))].max().item()

    assert eos_probability(lambda net: None) > 0.1  # after the answer the model ends its turn
    assert eos_probability(lambda net: peer_work.suppress_eos(net, eos)) > 1e-3  # a random model's edit is not enough
    assert eos_probability(lambda net: peer_work.suppress_eos(
        net, eos, final_norm_gain=peer_work.PRETRAINED_NORM_GAIN)) < 1e-9


def test_learning_report_reads_start_end_and_step_times_from_metrics(tmp_path):
    from benchmarks import bench_real_model

    def write(name, records):
        (tmp_path / name).mkdir()
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))

    step = {"time/rollout_s": 2.0, "time/update_s": 4.0, "reward/mean": 0.1}
    write("seed0", [{"step": 0, "eval/greedy_acc": 0.25}, {"step": 1, **step},
                    {"step": 2, **step, "time/update_s": 8.0, "eval/greedy_acc": 0.5}])
    write("control", [{"step": 1, **step}, {"step": 2, **step, "eval/greedy_acc": 0.125}])  # no start evaluation
    results = {n: bench_real_model.summarize(tmp_path / n) for n in ("seed0", "control")}
    assert results["seed0"]["before"] == 0.25 and results["seed0"]["after"] == 0.5
    assert results["seed0"]["update_s"] == [6.0, 4.0, 8.0, 12.0]  # median, min, max, sum
    assert results["control"]["before"] is None and results["control"]["after"] == 0.125
    text = bench_real_model.table(results)
    assert "| seed0 | 25.0% | 50.0% | +25.0 | 2 |" in text
    assert results["seed0"]["curve"] == {0: 0.25, 2: 0.5} and text.splitlines()[2].endswith("| 0: 25.0, 2: 50.0 |")


def test_learning_report_gives_the_seeds_mean_at_every_evaluation_step(tmp_path):
    from benchmarks import bench_real_model

    for name, accs in (("seed0", [0.25, 0.5, 0.75]), ("seed1", [0.25, 0.25, 0.5])):
        (tmp_path / name).mkdir()
        records = [{"step": 0, "eval/greedy_acc": accs[0]}] + [
            {"step": k, "time/rollout_s": 1.0, "time/update_s": 1.0, "reward/mean": 0.0, "eval/greedy_acc": accs[k]}
            for k in (1, 2)]
        (tmp_path / name / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    text = bench_real_model.table({n: bench_real_model.summarize(tmp_path / n) for n in ("seed0", "seed1")})
    assert "seeds at step 1: 37.5% +- 17.7, change +12.5 points" in text
    assert "seeds at step 2: 62.5% +- 17.7, change +37.5 points" in text


def test_the_control_negates_every_reward_function_of_the_config():
    from benchmarks import bench_real_model
    from fastgrpo.config import load_config

    funcs = load_config(str(bench_real_model.CONFIG), []).rewards.funcs
    control = dict(bench_real_model.runs_of([3], True))["control"]
    assert control == ["seed=3", "rewards.weights=[" + ",".join(["-1.0"] * len(funcs)) + "]"]
    load_config(str(bench_real_model.CONFIG), control)  # a weight per function: the config accepts it


def test_the_countdown_recipe_negates_its_own_config_and_checks_the_sft_config_first(tmp_path, capsys):
    from benchmarks import bench_real_model
    from fastgrpo.config import load_config

    config = bench_real_model.ROOT / "configs" / "smollm2-countdown.yaml"
    funcs = load_config(str(config), []).rewards.funcs
    control = dict(bench_real_model.runs_of([0], True, config=config))["control"]
    assert control[1] == "rewards.weights=[" + ",".join(["-1.0"] * len(funcs)) + "]"
    assert funcs != load_config(str(bench_real_model.CONFIG), []).rewards.funcs  # the recipe's own, not smollm2.yaml's
    # a bad SFT config is one line naming the SFT run, before any run starts (nothing is written under --out)
    bad = tmp_path / "sft.yaml"
    bad.write_text(config.with_name("smollm2-countdown-sft.yaml").read_text().replace("batch_size: 16", "batch_size: 0"))
    rc = bench_real_model.main(["--config", str(config), "--sft", str(bad), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2
    assert "run 'sft'" in err and "sft.batch_size" in err and not (tmp_path / "out").exists()
