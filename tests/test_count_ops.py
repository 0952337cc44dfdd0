"""The update's host syncs, counted on the trainer that ships (benchmarks/count_ops.py): a fixed few per optimizer
step from the update's own modules, whatever the number of micro-batches."""

from benchmarks import peer_work
from benchmarks.count_ops import count_fastgrpo

# the update layer (op_counter names a site by its last two path parts: "<folder>/<file>.py:<line>"): the update
# and algorithm packages, the metrics and the packing; syncs elsewhere (attention, the CPU head kernels) are counted,
# not asserted here
UPDATE_MODULES = ("update/", "algorithms/", "runtime/metrics.py", "models/packing.py")


def _own_syncs(result: dict) -> dict[str, float]:
    return {site: n for site, n in result["sync_sites"]["update"].items()
            if any(f" at {m}" in site for m in UPDATE_MODULES)}


def test_update_syncs_do_not_grow_with_the_micro_batch_count(tmp_path):
    model_dir = peer_work.build_model_folder("tiny", tmp_path / "model", seed=0)
    prompts = tmp_path / "prompts.jsonl"
    P = peer_work.write_prompts(model_dir, prompts, count=4, seed=0)
    work = peer_work.Work(model="tiny", prompts_per_step=1, generations=2, max_completion_length=4, steps=1)
    spec = peer_work.make_spec(work, model_dir=model_dir, prompts_file=prompts, prompt_len=P,
                               run_dir=str(tmp_path / "run"))
    (tmp_path / "run").mkdir()
    one, two = (count_fastgrpo(spec, budget) for budget in (2 * (P + 4), P + 4))  # both sequences in one row, or not
    assert (one["micro_batches"], two["micro_batches"]) == (1, 2)
    assert one["per_step"]["update"]["ops"] > 0 and one["generated_tokens"] == 2 * 4
    assert _own_syncs(one) == _own_syncs(two)
    # the plan's read of the step totals, the guard's finiteness test, the metrics' one read at the end of the step
    assert sum(_own_syncs(one).values()) == 3, _own_syncs(one)
