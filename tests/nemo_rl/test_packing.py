"""FP8 packing with `fuse_loss` (bapo_nemo/nemo/packing.py): the installed NeMo-RL's own packing and
fused-loss input code on the 32B config's shapes, with and without the guard's widening."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from bapo_nemo.nemo.packing import (
    fused_loss_width,
)
from bapo_nemo.plan.rules.config_io import load_nemo_config
from tests.support.hang_guard import HANG_GUARD_S

REPO = Path(__file__).resolve().parents[2]


# NeMo-RL v0.7.0's packing (megatron/data.py) and fused-loss input (algorithms/loss/utils.py) on the 32B
# config's shapes: a bin of a 20,000- and a 15,000-token sequence, the batch's longest being 20,000 tokens.
# Runs in its own interpreter: the CPU shim it needs for megatron-core 0.16.1 patches torch process-wide.
_PACK = """
import json, sys, torch
from tests.support.nemo_rl_shim import megatron_cpu
megatron_cpu.install()
from nemo_rl.algorithms.loss.utils import _pack_input_ids
from nemo_rl.models.megatron.data import _get_pack_sequence_parameters_for_megatron, _pack_sequences_for_megatron
from bapo_nemo.nemo.packing import pad_sequence_dim
policy = json.loads(sys.argv[1])
width = int(sys.argv[2])
lengths = torch.tensor([20000, 15000])
unpadded = 20032  # the batch's width: its longest sequence rounded to make_sequence_length_divisible_by
out = {}
for name, w in (("as_batched", unpadded), ("widened", width)):
    batch = pad_sequence_dim({"input_ids": torch.randint(1, 100, (2, unpadded))}, w)
    args = _get_pack_sequence_parameters_for_megatron(policy["megatron_cfg"], policy["make_sequence_length_divisible_by"], w)
    for cp_rank in range(policy["megatron_cfg"]["context_parallel_size"]):
        _, _, params, _, _ = _pack_sequences_for_megatron(batch["input_ids"], lengths, *args, cp_rank=cp_rank,
                                                          cp_size=policy["megatron_cfg"]["context_parallel_size"])
        try:
            _pack_input_ids(batch["input_ids"], params.cu_seqlens_q, params.cu_seqlens_q_padded, cp_rank=cp_rank,
                            cp_size=policy["megatron_cfg"]["context_parallel_size"], roll_shift=-1)
            out[name] = "ok"
        except RuntimeError as exc:
            out[name] = str(exc)
            break
    out[name + "_padded_lengths"] = params.cu_seqlens_q_padded.diff().tolist()
from bapo_nemo.nemo.installed import packed_loss_needs_full_width
out["probe_needs_full_width"] = packed_loss_needs_full_width()
print(json.dumps(out))
"""


def test_nemo_rls_fused_loss_input_on_the_32b_shapes_and_the_guard_decision():
    """v0.7.0's fused loss input fails on the 32B shapes unless the batch is widened; main's copies the real
    tokens (#3182). The driver's probe (installed.packed_loss_needs_full_width, on upstream's own function
    with a 1 x 4 batch) says which of the two the installed NeMo-RL is, so the guard is installed exactly
    where the 32B shapes fail."""
    policy = load_nemo_config(REPO / "configs" / "bapo_32b.yaml")["policy"]
    done = subprocess.run(
        [sys.executable, "-c", _PACK, json.dumps(policy), str(fused_loss_width(policy))],
        cwd=REPO, capture_output=True, text=True, timeout=HANG_GUARD_S, check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    # FP8 grows the bin to 40,960 tokens through its last sequence: 15,000 -> 20,928 > 20,032 columns
    assert out["as_batched_padded_lengths"] == [20032, 20928]
    overflow = "The expanded size of the tensor (20928) must match the existing size (20032)"
    if out["probe_needs_full_width"]:
        assert overflow in out["as_batched"]
    else:
        assert out["as_batched"] == "ok"
    assert out["widened"] == "ok"
