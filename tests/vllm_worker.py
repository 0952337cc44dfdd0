"""One rank of the colocated-vLLM check, run by ``tests/test_rollout_vllm.py`` under 2 gloo processes.

Each rank: FSDP2-shards the tiny policy, changes its weights (the same change on every rank), builds its own
vLLM engine (``external_launcher``), syncs the gathered full tensors into it, generates for its own prompt and
compares the sampler's log-probs with the sharded policy's. Rank 0 writes every rank's results to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from fastgrpo.rollout.base import SamplingParams  # noqa: E402
from fastgrpo.rollout.vllm import VLLMEngine  # noqa: E402
from fastgrpo.models.policy_state import iter_full_tensors  # noqa: E402
from fastgrpo.models.tiny import build_tiny  # noqa: E402

TEMPERATURE = 0.9


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cache-dir", default=None)
    args = ap.parse_args()

    t0 = time.perf_counter()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = build_tiny(seed=0, cache_dir=args.cache_dir)

    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    policy = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    for block in policy.model.layers:
        fully_shard(block)
    fully_shard(policy)
    from torch.distributed.tensor import DTensor

    sharded = all(isinstance(p, DTensor) for p in policy.parameters())
    with torch.no_grad():  # a large, deterministic change, identical on both ranks
        for p in policy.parameters():
            p.add_(0.3 * torch.sign(p))

    engine = VLLMEngine(path, seed=0, rank=rank, world_size=world, dtype="float32", max_model_len=128,
                        enforce_eager=True, sleep_level=0)
    t_build = time.perf_counter() - t0
    engine.update_weights(iter_full_tensors(policy))

    prompt = [1, 60 + rank, 61, 62]
    done = engine.generate([prompt], 2, SamplingParams(max_tokens=8, temperature=TEMPERATURE, logprobs=True))[0]
    max_diff = 0.0
    for c in done:  # the same number of (collective) FSDP forwards on every rank
        ids = torch.tensor([prompt + c.token_ids])
        with torch.no_grad():
            logits = policy(ids).logits[0, len(prompt) - 1:-1].float() / TEMPERATURE  # [L, V]
        ref = torch.log_softmax(logits, -1).gather(-1, torch.tensor(c.token_ids)[:, None])[:, 0]  # [L]
        max_diff = max(max_diff, (ref - torch.tensor(c.logprobs)).abs().max().item())

    result = {"rank": rank, "tokens": [c.token_ids for c in done], "max_logprob_diff": max_diff,
              "sync_bytes": engine.last_sync_bytes, "sharded": sharded,
              "seconds_to_engine": t_build, "seconds_total": time.perf_counter() - t0}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, result)
    if rank == 0:
        Path(args.out).write_text(json.dumps(gathered))
    dist.barrier()
    engine.close()  # vLLM's teardown also destroys the default process group


if __name__ == "__main__":
    main()
