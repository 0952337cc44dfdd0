import subprocess
import sys

import pytest

from fastgrpo.config import ConfigError, describe, load_config


def test_shipped_configs_load():
    for name in ("tiny", "tiny-toy", "qwen2.5-1.5b-instruct-gsm8k", "qwen2.5-3b-instruct-countdown",
                 "qwen2.5-3b-base-countdown", "qwen2.5-coder-0.5b-countdown", "smollm2", "smollm2-countdown"):
        cfg = load_config(f"configs/{name}.yaml")
        assert cfg.name


def test_the_qwen_countdown_recipes_hold_their_published_settings():
    inst = load_config("configs/qwen2.5-3b-instruct-countdown.yaml")
    assert inst.model.name_or_path == "Qwen/Qwen2.5-3B-Instruct"
    assert (inst.optim.lr, inst.grpo.beta, inst.grpo.num_generations) == (5e-7, 0.001, 8)
    assert inst.rollout.max_completion_length == 1024 and inst.rollout.temperature == 1.0
    assert inst.rewards.funcs == ["format", "countdown"]
    base = load_config("configs/qwen2.5-3b-base-countdown.yaml")
    assert base.data.template == "base" and base.grpo.loss_type == "dr_grpo" and base.grpo.beta == 0


def test_overrides_are_typed():
    cfg = load_config("configs/tiny.yaml", ["optim.lr=3e-4", "grpo.delta=null", "rewards.funcs=[countdown]",
                                            "log.progress=false", "max_steps=7"])
    assert cfg.optim.lr == 3e-4 and cfg.grpo.delta is None and cfg.rewards.funcs == ["countdown"]
    assert cfg.log.progress is False and cfg.max_steps == 7


@pytest.mark.parametrize("override,needle", [
    ("optim.lrr=1", "did you mean 'optim.lr'"),
    ("grpo.num_generation=4", "did you mean 'grpo.num_generations'"),
    ("rollout.max_completion_lenght=4", "did you mean 'rollout.max_completion_length'"),
])
def test_unknown_key_names_closest(override, needle):
    with pytest.raises(ConfigError, match=needle):
        load_config("configs/tiny.yaml", [override])


@pytest.mark.parametrize("override,field", [
    ("grpo.num_generations=1", "grpo.num_generations"),
    ("optim.lr=0", "optim.lr"),
    ("optim.lr=-1e-5", "optim.lr"),
    ("rollout.max_completion_length=0", "rollout.max_completion_length"),
    ("rewards.weights=[1.0,2.0,3.0]", "rewards.weights"),
    ("grpo.loss_type=ppo", "grpo.loss_type"),
    ("rollout.hf.decode=fast", "rollout.hf.decode"),
    ("max_steps=2.5", "max_steps"),
    ("grpo.num_generations=abc", "grpo.num_generations"),
])
def test_impossible_values_name_the_field(override, field):
    with pytest.raises(ConfigError, match=field.replace(".", r"\.")):
        load_config("configs/tiny.yaml", [override])


def test_missing_config_file():
    with pytest.raises(ConfigError, match="does not exist"):
        load_config("configs/nope.yaml")


def test_describe_lists_every_key_with_doc():
    text = describe()
    assert "grpo.loss_type" in text and "normalised over the global batch" in text


def test_bad_config_cli_exits_nonzero_and_writes_nothing(tmp_path):
    out = tmp_path / "runs"
    proc = subprocess.run([sys.executable, "-m", "fastgrpo.train", "--config", "configs/tiny.yaml",
                           f"output_dir={out}", "grpo.num_generations=1"], capture_output=True, text=True)
    assert proc.returncode != 0
    assert "grpo.num_generations" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("override,missing,needle", [
    ("rollout.engine=vllm", "vllm", "pip install fastgrpo[vllm]"),
    ("log.report_to=[jsonl,wandb]", "wandb", "pip install 'fastgrpo[wandb]'"),
])
def test_missing_optional_extra_is_one_clear_line(monkeypatch, capsys, tmp_path, override, missing, needle):
    import builtins
    import importlib.util

    from fastgrpo import train

    real_find_spec, real_import = importlib.util.find_spec, builtins.__import__

    def find_spec(name, *a, **k):
        return None if name == missing else real_find_spec(name, *a, **k)

    def fake_import(name, *a, **k):
        if name == missing:
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *a, **k)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)
    monkeypatch.setattr(builtins, "__import__", fake_import)
    rc = train.main(["--config", "configs/tiny.yaml", f"output_dir={tmp_path}", override])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize("override,needle", [
    ("model.name_or_path=/nonexistent/model", "model.name_or_path"),
    ("data.source=/nonexistent/rows.jsonl", "data.source"),
    ("rewards.funcs=[countdwn]", "did you mean 'countdown'"),
])
def test_bad_paths_and_names_fail_cleanly_before_training(capsys, tmp_path, override, needle):
    from fastgrpo import train

    rc = train.main(["--config", "configs/tiny.yaml", f"output_dir={tmp_path}", override])
    err = capsys.readouterr().err
    assert rc == 2 and needle in err and "Traceback" not in err
    assert not any(tmp_path.iterdir())


def test_yaml_errors_are_config_errors(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("optim: {lr: [\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config("configs/tiny.yaml", ["optim.lr=["])


def test_head_backend_is_checked_before_anything_loads():
    with pytest.raises(ConfigError, match="grpo.head_backend.*auto, cublas, triton, torch"):
        load_config("configs/tiny.yaml", ["grpo.head_backend=fast"])
    with pytest.raises(ConfigError, match="grpo.head_backend.*needs CUDA"):
        load_config("configs/tiny.yaml", ["grpo.head_backend=cublas", "device=cpu"])
    assert load_config("configs/tiny.yaml", ["grpo.head_backend=torch"]).grpo.head_backend == "torch"


def test_head_backend_auto_resolves_per_device():
    from fastgrpo.kernels import resolve_backend

    assert resolve_backend("auto", "cpu", needs_grad=True) == "torch"
    assert resolve_backend("triton", "cuda", needs_grad=True) == "triton"
    has_triton = __import__("importlib").util.find_spec("triton") is not None
    assert resolve_backend("auto", "cuda", needs_grad=True) == ("cublas" if has_triton else "torch")
    assert resolve_backend("auto", "cuda", needs_grad=False) == ("triton" if has_triton else "torch")


def _float_fields(cls=None, prefix=""):
    import dataclasses
    import typing

    from fastgrpo.config import TrainConfig

    cls = cls or TrainConfig
    for f in dataclasses.fields(cls):
        tp = typing.get_type_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            yield from _float_fields(tp, f"{prefix}{f.name}.")
        elif float in (tp, *typing.get_args(tp)) or list[float] in (tp, *typing.get_args(tp)):
            yield f"{prefix}{f.name}", tp


def test_every_float_field_rejects_nan_and_inf():
    fields = list(_float_fields())
    assert {"optim.weight_decay", "rewards.weights", "rewards.on_error_value", "grpo.delta"} <= {k for k, _ in fields}
    for key, tp in fields:
        for bad in ("inf", "-inf", "nan", ".inf"):
            value = f"[{bad}]" if "list" in str(tp) else bad
            with pytest.raises(ConfigError, match=rf"{key.replace('.', '[.]')}(\[0\])?: must be a finite number"):
                load_config("configs/tiny.yaml", [f"{key}={value}", "rewards.funcs=[format,countdown]"])


@pytest.mark.parametrize("name", ["..", ".", "../escape", "a/b", "/abs", "a\\b", ""])
def test_run_name_cannot_leave_output_dir(name):
    with pytest.raises(ConfigError, match="name: must be a plain folder name"):
        load_config("configs/tiny.yaml", [f"name={name}"])


def test_device_cuda_without_cuda_is_a_config_error():
    import torch

    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    with pytest.raises(ConfigError, match="device: is 'cuda' but no CUDA device is available"):
        load_config("configs/tiny.yaml", ["device=cuda"])


def test_every_resumable_key_names_a_key_or_a_section_of_a_run_config():
    """A key renamed without its entry in RESUMABLE_KEYS would turn a harmless change on resume into an error."""
    from fastgrpo.config import RESUMABLE_KEYS, SFTConfig, TrainConfig, to_dict

    def dotted(tree: dict, prefix: str = "") -> set[str]:
        out = set()
        for k, v in tree.items():
            out |= {f"{prefix}{k}."} | dotted(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}"}
        return out

    known = dotted(to_dict(TrainConfig())) | dotted(to_dict(SFTConfig()))
    assert [k for k in RESUMABLE_KEYS if k not in known] == []


def test_components_check_their_sections_with_only_the_config_imported():
    """config imports no component and names none of their checks: validating a run config imports the components
    its choice fields name, which register their checks (section_check), so a caller that imported config alone
    still meets every one: the engines', the environments', PPO's and the algorithm's."""
    code = """
import sys
from fastgrpo.config import ConfigError, load_config
components = ("fastgrpo.algorithms", "fastgrpo.rollout", "fastgrpo.environments")
assert not [m for m in sys.modules if m.startswith(components)]
for overrides in (["rollout.hf.batch_size=0"], ["rollout.vllm.sync_bucket_mb=0"], ["rollout.env.name=tools"],
                  ["rollout.env.kwargs={a: 1}"], ["ppo.gamma=2"], ["algorithm=ppo", "grpo.num_iterations=2"],
                  ["rollout.asynchronous=true"], ["rollout.engine=vllm", "rollout.vllm.max_model_len=8",
                                                  "rollout.max_completion_length=8"]):
    try:
        load_config(None, overrides)
        print("accepted", overrides)
    except ConfigError as e:
        print(str(e).split(":")[0])
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split() == ["rollout.hf.batch_size", "rollout.vllm.sync_bucket_mb", "rollout.env.tools",
                                   "rollout.env.kwargs", "ppo.gamma", "grpo.num_iterations",
                                   "rollout.importance_sampling_cap", "rollout.max_completion_length"]


def test_a_section_built_directly_meets_its_components_checks():
    from fastgrpo.config import EnvConfig, HFRolloutConfig, check_section
    import fastgrpo.environments  # noqa: F401  (registers the environments' checks)
    import fastgrpo.rollout  # noqa: F401  (registers the engines' checks)

    with pytest.raises(ConfigError, match=r"rollout\.hf\.batch_size: must be >= 1"):
        check_section(HFRolloutConfig(batch_size=0), "rollout.hf")
    with pytest.raises(ConfigError, match=r"rollout\.env\.tools: the 'tools' environment needs at least one tool"):
        check_section(EnvConfig(name="tools"), "rollout.env")
