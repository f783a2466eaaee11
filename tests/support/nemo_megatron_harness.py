"""Eight gloo ranks (TP 2 x CP 2 x DP 2) driving the CPU Megatron policy worker's upstream `train` directly,
without Ray: the negative controls of tests/nemo_rl/test_megatron_rehearsal.py.

    python -m tests.support.nemo_megatron_harness SPEC.json

SPEC: {"policy": <policy config>, "loss_fn": <loss_fn config>, "batch": <path of a torch-saved global
batch>, "out": <directory>, "scenarios": ["as_shipped", "tensor_parallel_group", "no_cp_normalization"]}.
The global batch is sharded by NeMo-RL's own `shard_by_batch_size` with the policy's packing arguments
(as `Policy.train` does), and every rank runs `train` once per scenario on its shard, from the same
weights, with the recorder writing under out/<scenario>/ (tests/support/nemo_megatron_standins.py). A scenario
other than `as_shipped` plants one defect in that rank's process before training:
- `tensor_parallel_group`: BAPO's statistics are summed over the tensor-parallel group instead of the
  data-parallel one (the loss then searches on its own DP rank's tokens only);
- `no_cp_normalization`: NeMo-RL's LossPostProcessor without its division by the CP size.
Runs in its own process (not the test's): the CPU shims it installs patch torch process-wide.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
import torch.multiprocessing as mp


def plant(scenario: str) -> None:
    """Put one defect in place in this rank's process (see the module docstring)."""
    if scenario == "as_shipped":
        return
    if scenario == "tensor_parallel_group":
        from megatron.core import parallel_state

        from bapo_nemo.nemo import groups

        groups._megatron_dp_group = parallel_state.get_tensor_model_parallel_group
        return
    if scenario == "no_cp_normalization":
        from nemo_rl.models.policy.workers import megatron_policy_worker

        post_processor = megatron_policy_worker.LossPostProcessor

        def without_cp_normalization(*args, **kwargs):
            return post_processor(*args, cp_normalize=False, **kwargs)

        megatron_policy_worker.LossPostProcessor = without_cp_normalization
        return
    raise ValueError(f"unknown scenario {scenario!r}")


def _rank(rank: int, world: int, spec: dict, shards: list) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world))
    # A file rendezvous: no port to choose, so none another process can take first. The worker then
    # finds the process group initialized and uses it.
    rendezvous = Path(spec["out"]) / "rendezvous"
    torch.distributed.init_process_group("gloo", init_method=f"file://{rendezvous}", rank=rank, world_size=world)
    import numpy as np
    from megatron.core import parallel_state
    from nemo_rl.distributed.named_sharding import NamedSharding
    from transformers import AutoTokenizer

    from bapo_nemo.nemo.loss import BAPOLossFn
    from tests.support.nemo_faults import RECORD_DIR_ENV
    from tests.support.nemo_megatron_standins import CPUMegatronPolicyWorkerImpl, Recorder
    from tests.support.nemo_vllm_standins import load_weights

    policy = spec["policy"]
    mcfg = policy["megatron_cfg"]
    tp, cp = mcfg["tensor_model_parallel_size"], mcfg["context_parallel_size"]
    layout = np.arange(world).reshape(1, -1, cp, tp)  # lm_policy.Policy's [PP, DP, CP, TP]
    sharding = NamedSharding(layout=layout, names=["pipeline_parallel", "data_parallel", "context_parallel", "tensor_parallel"])
    tokenizer = AutoTokenizer.from_pretrained(policy["tokenizer"]["name"])
    worker = CPUMegatronPolicyWorkerImpl(
        policy, tokenizer, init_reference_model=False, worker_sharding_annotations=sharding
    )
    full = load_weights(policy["model_name"])
    shard = shards[parallel_state.get_data_parallel_rank()]
    for scenario in spec["scenarios"]:
        os.environ[RECORD_DIR_ENV] = str(Path(spec["out"]) / scenario)
        worker.recorder = Recorder.from_env(worker)
        worker.model.module.load_full(full)  # every scenario trains from the same weights
        restore = _snapshot(scenario)
        plant(scenario)
        try:
            worker.prepare_for_training()
            worker.train(shard, BAPOLossFn(spec["loss_fn"]), gbs=spec["gbs"])
        finally:
            restore()
    torch.distributed.barrier()


def _snapshot(scenario: str):
    """Undo `plant(scenario)` afterwards (the next scenario starts from upstream's code)."""
    from nemo_rl.models.policy.workers import megatron_policy_worker

    from bapo_nemo.nemo import groups

    dp_group, post_processor = groups._megatron_dp_group, megatron_policy_worker.LossPostProcessor

    def restore():
        groups._megatron_dp_group = dp_group
        megatron_policy_worker.LossPostProcessor = post_processor

    return restore


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    # Import once here: the forked ranks inherit it (8 imports of NeMo-RL's Megatron worker would take
    # minutes on two cores).
    from nemo_rl.distributed.batched_data_dict import BatchedDataDict

    from tests.support.nemo_megatron_standins import CPUMegatronPolicyWorkerImpl  # noqa: F401

    policy = spec["policy"]
    batch = BatchedDataDict(torch.load(spec["batch"]))
    packing = policy["sequence_packing"]
    dp = spec["world"] // (policy["megatron_cfg"]["tensor_model_parallel_size"] * policy["megatron_cfg"]["context_parallel_size"])
    shards, _ = batch.shard_by_batch_size(
        dp,
        batch_size=spec["gbs"],
        sequence_packing_args={
            "algorithm": packing["algorithm"],
            "input_key": "input_ids",
            "input_lengths_key": "input_lengths",
            "sequence_length_pad_multiple": policy["make_sequence_length_divisible_by"],
            "max_tokens_per_microbatch": packing["train_mb_tokens"],
        },
    )
    Path(spec["out"]).mkdir(parents=True, exist_ok=True)
    (Path(spec["out"]) / "rendezvous").unlink(missing_ok=True)  # a file store must start empty
    mp.start_processes(_rank, args=(spec["world"], spec, shards), nprocs=spec["world"], start_method="fork")


if __name__ == "__main__":
    main(sys.argv[1])
