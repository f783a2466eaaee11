"""The train dataloader partial rollouts need: more prompt groups in flight than one step trains on."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bapo_nemo.nemo.partial_rollout import PartialRolloutHook


class PrefillDataloader:
    """Wraps grpo_train's StatefulDataLoader. Partial rollouts only carry responses over when more prompt
    groups are in flight than a step trains on; grpo_train hands the hook exactly one step's prompts, so
    before the first step this wrapper moves `prefill_batches` extra batches into the pool (once per run:
    the flag is checkpointed). Those batches are trained on through the pool, so the first epoch yields
    `prefill_batches` fewer steps, and `len()` says so during that epoch (grpo_train's last-step test,
    which triggers the final validation and checkpoint, compares with it). The pool then stays at
    (prefill_batches + 1) * num_prompts_per_step groups. Everything else (state_dict, load_state_dict,
    ...) is the wrapped loader's."""

    def __init__(self, dataloader: Any, hook: PartialRolloutHook):
        self.dataloader, self.hook = dataloader, hook

    def __iter__(self):
        iterator = iter(self.dataloader)
        hook = self.hook
        if not hook.prefilled:
            for _ in range(hook.prefill_batches):
                batch = next(iterator, None)
                if batch is None:
                    break
                hook.admit_batch(batch, stride=1)
                hook.prefilled_batches += 1
            hook.prefilled = True
        yield from iterator
        hook.prefilled_batches = 0  # the shortened epoch is over

    def __len__(self) -> int:
        return len(self.dataloader) - self.hook.prefilled_batches

    def __getattr__(self, name: str) -> Any:
        return getattr(self.dataloader, name)
