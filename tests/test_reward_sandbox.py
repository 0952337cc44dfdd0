"""The reward sandbox: plugins that hang, raise, exit, die or return garbage never reach the trainer's rewards."""

from __future__ import annotations

import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from fastgrpo.runtime.errors import RewardError
from fastgrpo.rewards import REWARDS, RewardRunner
from fastgrpo.rewards.calls import CallFailure, to_values

PLUGIN = textwrap.dedent('''
    import asyncio, math, os, sys, time

    def ok(completions, **kw):
        print("a plugin may print")
        return [float(len(c)) for c in completions]

    def hang(completions, **kw):
        time.sleep(600)

    def neg_inf(completions, **kw):
        return [-math.inf] + [1.0] * (len(completions) - 1)

    def nan(completions, **kw):
        return [1.0] * (len(completions) - 1) + [math.nan]

    def boom(completions, **kw):
        raise KeyError("boom")

    def exits(completions, **kw):
        sys.exit(3)

    def dies(completions, **kw):
        os._exit(7)

    def one_float(completions, **kw):
        return 0.5

    def generator(completions, **kw):
        return (1.0 for _ in completions)

    def strings(completions, **kw):
        return ["1"] * len(completions)

    def short(completions, **kw):
        return [1.0]

    def columns(completions, prompts, target, **kw):
        return [float(t) for t in target]

    async def sleepy_a(completions, **kw):
        await asyncio.sleep(1.0)
        return [1.0] * len(completions)

    async def sleepy_b(completions, **kw):
        await asyncio.sleep(1.0)
        return [2.0] * len(completions)

    async def sleepy_c(completions, **kw):
        await asyncio.sleep(1.0)
        return [3.0] * len(completions)

    async def async_hang(completions, **kw):
        await asyncio.sleep(600)
''')

COMPLETIONS = ["1ab", "xy", "7"]
COLUMNS = {"prompts": ["p"] * 3, "target": [4, 5, 6]}


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "rewards_under_test.py"
    path.write_text(PLUGIN)
    return str(path)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by a parent that is gone) counts as dead
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def test_every_kind_of_failure_scores_on_error_value_is_counted_and_logged_once(plugin, caplog):
    names = ["ok", "hang", "neg_inf", "nan", "boom", "exits", "dies", "one_float", "generator", "strings", "short",
             "columns"]
    runner = RewardRunner([f"{plugin}:{n}" for n in names] + ["toy_digit"], num_workers=4, timeout_s=1.5,
                          on_error_value=-0.5)
    try:
        runner.wait_ready()
        assert "rewards_under_test" not in " ".join(sys.modules)  # the trainer process never imports a plugin
        with caplog.at_level(logging.WARNING, logger="fastgrpo.rewards"):
            t0 = time.monotonic()
            scores = runner(COMPLETIONS, COLUMNS)
            first_s = time.monotonic() - t0
            first_logs = [r.getMessage() for r in caplog.records]
            caplog.clear()
            again = runner(COMPLETIONS, COLUMNS)
            second_logs = [r.getMessage() for r in caplog.records]
        col = {n: scores.per_func[:, j].tolist() for j, n in enumerate(runner.names)}
        err = {n: scores.errors[j].item() for j, n in enumerate(runner.names)}
        assert col["ok"] == [3.0, 2.0, 1.0] and err["ok"] == 0
        assert col["columns"] == [4.0, 5.0, 6.0] and err["columns"] == 0  # dataset columns reach the worker
        assert col["toy_digit"] == [1.0, 0.0, 1.0]  # a bounded built-in, scored in this process
        assert col["neg_inf"] == [-0.5, 1.0, 1.0] and err["neg_inf"] == 1  # only the bad entry is replaced
        assert col["nan"] == [1.0, 1.0, -0.5] and err["nan"] == 1
        for n in ("hang", "boom", "exits", "dies", "one_float", "generator", "strings", "short"):
            assert col[n] == [-0.5] * 3 and err[n] == 3, n
        assert all(math.isfinite(v) for v in scores.total.tolist())
        assert first_s < 10, first_s  # the hanging call was cut at 1.5 s
        # the first failure of each kind, once, with what happened; the second step logs nothing new
        for n, needle in [("hang", "did not finish within rewards.timeout_s=1.5 s"), ("neg_inf", "-inf"),
                          ("boom", "KeyError: 'boom'"), ("exits", "SystemExit: 3"), ("dies", "exit code 7"),
                          ("one_float", "float 0.5"), ("generator", "a generator"), ("strings", "str '1'"),
                          ("short", "1 values for 3 completions")]:
            assert sum(f"reward '{n}' " in m and needle in m for m in first_logs) == 1, (n, first_logs)
        assert "Traceback" in next(m for m in first_logs if "'boom'" in m)
        assert second_logs == []
        assert again.per_func.tolist() == scores.per_func.tolist()
        assert runner.pool.restarts >= 4  # hang and dies, on both calls: each worker was replaced
        pids = runner.pool.pids()
    finally:
        runner.close()
    time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_async_rewards_are_awaited_concurrently_and_time_out_alone(plugin):
    runner = RewardRunner([f"{plugin}:sleepy_a", f"{plugin}:sleepy_b", f"{plugin}:sleepy_c", f"{plugin}:async_hang"],
                          num_workers=1, timeout_s=1.5)
    try:
        runner.wait_ready()
        t0 = time.monotonic()
        scores = runner(COMPLETIONS, COLUMNS)
        elapsed = time.monotonic() - t0
    finally:
        runner.close()
    # three 1 s sleeps and a hang on one worker: awaited together, the call lasts the hang's 1.5 s bound; one after
    # the other it would last 3 s + 1.5 s
    assert elapsed < 3.5, elapsed
    assert scores.per_func[0].tolist() == [1.0, 2.0, 3.0, 0.0]
    assert scores.errors.tolist() == [0.0, 0.0, 0.0, 3.0]


def test_on_error_raise_stops_with_one_line_naming_the_function(plugin):
    runner = RewardRunner([f"{plugin}:neg_inf"], on_error="raise", timeout_s=5)
    try:
        with pytest.raises(RewardError, match=r"reward 'neg_inf' returned -inf for completion 0"):
            runner(COMPLETIONS, COLUMNS)
    finally:
        runner.close()


@pytest.mark.parametrize("source, needle", [
    ("raise SystemExit(4)\n", "SystemExit(4)"),
    ("import no_such_module_xyz\n", "No module named 'no_such_module_xyz'"),
    ("def other(completions, **kw):\n    return []\n", "defines no 'f'; its callables: ['other']"),
])
def test_plugin_import_failures_are_one_line_errors_at_start(tmp_path, source, needle):
    path = tmp_path / "bad_plugin.py"
    path.write_text(source)
    runner = RewardRunner([f"{path}:f"], timeout_s=5)
    with pytest.raises(ValueError, match=r"reward '.*bad_plugin.py:f'") as info:
        runner.wait_ready()
    assert needle in str(info.value) and "\n" not in str(info.value)


def test_interrupt_abandons_a_hanging_call_at_once(plugin):
    runner = RewardRunner([f"{plugin}:hang", "toy_digit"], timeout_s=60)
    try:
        runner.wait_ready()
        threading.Timer(0.3, runner.interrupt).start()  # what the trainer's SIGTERM handler does
        t0 = time.monotonic()
        scores = runner(COMPLETIONS, COLUMNS)
        assert time.monotonic() - t0 < 3
        assert scores.interrupted
    finally:
        runner.close()


def test_workers_die_with_a_killed_trainer(plugin, tmp_path):
    script = tmp_path / "owner.py"
    script.write_text(textwrap.dedent(f'''
        import sys, time
        from fastgrpo.rewards import RewardRunner
        runner = RewardRunner([{plugin + ":hang"!r}, {plugin + ":ok"!r}], num_workers=2, timeout_s=600)
        runner.wait_ready()
        print(*runner.pool.pids(), flush=True)
        runner(["a"], {{}})  # hangs in a worker
    '''))
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    pids = [int(p) for p in proc.stdout.readline().split()]
    assert len(pids) == 2 and all(_alive(p) for p in pids)
    time.sleep(0.5)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids)


def test_a_pool_nobody_closed_kills_its_workers_when_collected(plugin):
    import gc

    runner = RewardRunner([f"{plugin}:ok"], timeout_s=5)  # e.g. a Trainer whose construction failed later on
    runner.wait_ready()
    pids = runner.pool.pids()
    del runner
    gc.collect()
    time.sleep(0.1)
    assert pids and not any(_alive(p) for p in pids)


def test_math_runs_in_the_sandbox_and_scores_like_the_function(tmp_path):
    runner = RewardRunner(["math", "gsm8k"], timeout_s=30)
    try:
        assert 0 in runner._remote and 1 in runner._local  # math (math-verify: unbounded) in a worker
        comps = ["<answer>18</answer>", "\\boxed{0.5}", "no answer"]
        cols = {"answer": ["#### 18", "1/2", "3"]}
        scores = runner(comps, cols)
    finally:
        runner.close()
    assert scores.per_func[:, 0].tolist() == REWARDS["math"](comps, **cols)
    assert scores.per_func[:, 1].tolist() == REWARDS["gsm8k"](comps, **cols)


def test_sandbox_off_runs_plugins_in_process_with_the_same_policy(plugin):
    runner = RewardRunner([f"{plugin}:boom", f"{plugin}:sleepy_a", f"{plugin}:ok"], sandbox=False)
    try:
        assert runner.pool is None
        scores = runner(COMPLETIONS, COLUMNS)
    finally:
        runner.close()
    assert scores.per_func.tolist() == [[0.0, 1.0, 3.0], [0.0, 1.0, 2.0], [0.0, 1.0, 1.0]]
    assert scores.errors.tolist() == [3.0, 0.0, 0.0]


@pytest.mark.parametrize("out, values, kinds", [
    ([1, None, 2.5], [1.0, math.nan, 2.5], []),
    ([True, 1e39, float("inf")], [1.0, math.nan, math.nan], ["non_finite", "non_finite"]),
    ([10 ** 400, "2", [1]], [math.nan] * 3, ["non_finite", "non_number", "non_number"]),
])
def test_values_are_checked_one_by_one(out, values, kinds):
    got, bad = to_values(out, 3)
    assert [(v if not math.isnan(v) else "nan") for v in got] == [(v if not math.isnan(v) else "nan") for v in values]
    assert [k for _, k, _ in bad] == kinds


@pytest.mark.parametrize("out", [None, 0.5, {"a": 1}, "abc", (x for x in [1, 2, 3]), [1.0, 2.0]])
def test_outputs_that_are_not_n_values_are_bad_output(out):
    with pytest.raises(CallFailure) as info:
        to_values(out, 3)
    assert info.value.kind == "bad_output"


def test_math_verify_has_a_real_time_bound_on_adversarial_answers():
    pytest.importorskip("math_verify")
    tower = "\\boxed{" + "2^{" * 60 + "2" + "}" * 60 + "}"  # 60-deep power tower: unbounded in a thread
    frac = "\\boxed{" + "\\frac{1}{" * 40 + "2" + "}" * 40 + "}"
    runner = RewardRunner(["math"], timeout_s=3)
    try:
        runner.wait_ready()
        runner(["\\boxed{1}"], {"answer": ["1"]})  # math-verify imports on first use: not part of the bound
        for text in (tower, frac):
            t0 = time.monotonic()
            scores = runner([text, "\\boxed{x(x+2)}"], {"answer": ["x^2+2x", "x^2 + 2x"]})
            assert time.monotonic() - t0 < 3 + 5  # the bound, plus replacing a killed worker on a busy machine
            assert scores.per_func[0, 0].item() == 0.0
            assert scores.per_func[1, 0].item() in (0.0, 1.0)  # 1, unless the whole call was cut by the bound
    finally:
        runner.close()


def test_reward_kwargs_reach_a_sandboxed_plugin_and_an_in_process_builtin(tmp_path):
    from types import SimpleNamespace

    path = tmp_path / "scaled.py"
    path.write_text("def scaled(completions, scale=1.0, **kw):\n    return [scale * len(c) for c in completions]\n")
    cfg = SimpleNamespace(funcs=[f"{path}:scaled", "toy_digit"], weights=None, sandbox=True, num_workers=1,
                          timeout_s=30.0, on_error="raise", on_error_value=0.0,
                          kwargs={"scaled": {"scale": 3.0}})
    runner = RewardRunner.from_config(cfg)
    try:
        assert 0 in runner._remote  # the plugin really runs in a worker
        scores = runner(["ab", "7xyz"], {"prompts": ["p", "p"], "completion_ids": [[1], [2]]})
        assert scores.per_func[:, 0].tolist() == [6.0, 12.0]
        assert scores.per_func[:, 1].tolist() == [0.0, 1.0]
    finally:
        runner.close()
