"""Partial rollouts in NeMo-RL's synchronous GRPO loop (`grpo_train`), without a fork; see
docs/partial_rollouts.md.

`install_partial_rollouts(master_config)`, before `setup()`, sets `policy.generation.max_new_tokens` to the
`token_budget` and replaces `nemo_rl.algorithms.grpo.run_multi_turn_rollout` with a wrapper: it runs
segment iterations until a step's P prompt groups are complete and passes them, in grpo_train's batch
shape, through the original function with a replay generation backend. `hook.attach(train_calls,
checkpoint_hooks)` adds versions, checkpointed state and the ledger. nemo_rl is imported lazily.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from bapo_nemo.nemo.checkpoint_hooks import CheckpointHooks
from bapo_nemo.nemo.prefill import PrefillDataloader
from bapo_nemo.nemo.segment_io import (
    PartialRolloutSetupError,
    ReplayGeneration,
    check_prompt_blocks,
    chunks_from_generation_outputs,
    decode_rows,
    encode_row,
    exclude_stale_prefix,
    generation_engines,
    generation_inputs,
    prompt_token_ids,
)
from bapo_nemo.rollout import (
    GenerationChunk,
    PartialRolloutConfig,
    PartialRolloutManager,
    PromptItem,
    Rollout,
    RolloutGroup,
)
from bapo_nemo.rollout.balance import balanced_order
from bapo_nemo.rollout.config import check_partial_rollout_config
from bapo_nemo.rollout.config import config_get as _get
from bapo_nemo.rollout.ledger import LEDGER_FILE, GenerationLedger, iteration_counts

STATE_FILE = "partial_rollouts.json"
HOOK_STATE_FORMAT_VERSION = 1


# ---- the hook ---------------------------------------------------------------------------------------
class PartialRolloutHook:
    """Driver-side state of partial rollouts for one grpo_train run (see the module docstring)."""

    def __init__(
        self,
        config: PartialRolloutConfig,
        group_size: int,
        prompts_per_step: int,
        response_cap: int,
        max_seq_len: int = 2**31 - 1,
        prefill_batches: int = 1,
    ):
        self.config = config
        self.group_size = group_size
        self.prompts_per_step = prompts_per_step
        self.response_cap = response_cap
        self.max_seq_len = max_seq_len
        self.prefill_batches = prefill_batches
        self.prefilled = False
        self.prefilled_batches = 0  # batches prefilled in the current (first) epoch
        self.stop_token_ids: list[int] = []  # policy.generation.stop_token_ids (EOS is added per call)
        self.manager = PartialRolloutManager(config, group_size)
        self.train_calls: Any = None  # set by attach(): the driver's count of finished policy.train calls
        self._version_base = 0  # the policy version at this process's first train call
        self.batches_seen = 0
        self.stop_strings: list[str] = []
        self._in_validation = False
        self.checkpoints: CheckpointHooks | None = None  # set by attach(): its check runs before each rollout
        self.ledger: GenerationLedger | None = None  # with checkpoints: what each segment iteration generated
        self.resume_metrics: dict[str, float] = {}  # what a resume regenerates, logged with the first step
        self._restore: list[Callable[[], None]] = []

    @property
    def policy_version(self) -> int:
        """Optimizer updates so far: the version restored from the checkpoint plus the trains since."""
        return self._version_base + (self.train_calls.calls if self.train_calls is not None else 0)

    @policy_version.setter
    def policy_version(self, value: int) -> None:
        self._version_base = int(value) - (self.train_calls.calls if self.train_calls is not None else 0)

    # ---- the wrapped grpo names ------------------------------------------------------------------------
    def make_rollout_wrapper(self, original: Callable) -> Callable:
        """grpo's `run_multi_turn_rollout` with the hook in front. Its arguments are bound to the installed
        function's signature, so parameters a NeMo-RL release adds (main's `deduplicate_multimodal_data`)
        reach the original untouched."""
        signature = inspect.signature(original)

        def run_multi_turn_rollout(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            bound.apply_defaults()
            arguments = dict(bound.arguments)
            arguments.pop("max_rollout_turns", None)  # single-turn: the replay is one generation call
            rollout = self.validation_rollout if self._in_validation else self.training_rollout
            return rollout(original, **arguments)

        run_multi_turn_rollout.__wrapped__ = original  # type: ignore[attr-defined]
        run_multi_turn_rollout._partial_rollout_hook = True  # type: ignore[attr-defined]
        return run_multi_turn_rollout

    def make_validate_wrapper(self, original: Callable) -> Callable:
        def validate(*args, **kwargs):
            self._in_validation = True
            try:
                return original(*args, **kwargs)
            finally:
                self._in_validation = False

        validate.__wrapped__ = original  # type: ignore[attr-defined]
        validate._partial_rollout_hook = True  # type: ignore[attr-defined]
        return validate

    # ---- rollouts --------------------------------------------------------------------------------------
    def training_rollout(
        self, original, policy_generation, input_batch, tokenizer, task_to_env, max_seq_len, greedy=False,
        **passthrough,
    ):
        """One step's batch of complete groups; `passthrough` holds the installed function's other arguments."""
        if self.checkpoints is not None:
            self.checkpoints.check()  # the previous step's checkpoint, if any, is finalised by now
        num_prompts = check_prompt_blocks(input_batch, self.group_size)
        if not self.prefilled and self.prefill_batches > 0 and self.batches_seen == 0:
            warnings.warn(
                "partial rollouts: the train dataloader was not wrapped with hook.wrap_dataloader(...), so only "
                "one step's prompts are in flight and no response carries over to a later step",
                stacklevel=2,
            )
        self.admit_batch(input_batch, stride=self.group_size, max_seq_len=max_seq_len)

        generate_fn = self.segment_generate_fn(policy_generation, tokenizer, greedy)
        iterations = self._generate_until(num_prompts, generate_fn)
        groups = self.manager.take_completed(self.policy_version, max_groups=num_prompts)

        batch = self.rebuild_batch(groups, _batch_class())
        rollouts = [r for g in groups for r in g.rollouts]
        replay = ReplayGeneration(rollouts, tokenizer.pad_token_id, wrap=_batch_class())
        final_batch, metrics = original(
            policy_generation=replay,
            input_batch=batch,
            tokenizer=tokenizer,
            task_to_env=task_to_env,
            max_seq_len=max_seq_len,
            max_rollout_turns=1,
            greedy=greedy,
            **passthrough,
        )
        if self.config.stale_segments == "exclude":
            self.apply_exclusion(final_batch, rollouts)
        metrics.update(self.manager.stats(self.policy_version))
        metrics.update(self.resume_metrics)
        self.resume_metrics = {}
        metrics["rollout/segment_iterations"] = float(iterations)
        metrics["rollout/policy_version"] = float(self.policy_version)
        return final_batch, metrics

    def admit_batch(self, batch: Mapping, stride: int = 1, max_seq_len: int | None = None) -> int:
        """Queue the prompts of a dataloader batch (one every `stride` rows: stride G for grpo_train's
        repeated batch, 1 for a raw dataloader batch). Returns how many were queued."""
        max_seq_len = self.max_seq_len if max_seq_len is None else max_seq_len
        prompts = []
        for p, row in enumerate(range(0, len(batch["message_log"]), stride)):
            tokens = prompt_token_ids(batch["message_log"][row])
            prompts.append(
                PromptItem(
                    prompt_id=f"{self.batches_seen}:{p}",
                    token_ids=tokens,
                    meta={"row": encode_row(batch, row)},
                    max_response_tokens=self._cap_for(tokens, max_seq_len),
                )
            )
            self._remember_stop_strings(batch, row)
        self.batches_seen += 1
        self.manager.add_prompts(prompts)
        return len(prompts)

    def wrap_dataloader(self, dataloader: Any) -> PrefillDataloader:
        """The train dataloader for grpo_train: before the first step it moves `prefill_batches` batches
        into the pool, so that more prompt groups are in flight than one step trains on."""
        return PrefillDataloader(dataloader, self)

    def validation_rollout(
        self, original, policy_generation, input_batch, tokenizer, task_to_env, max_seq_len, greedy=False,
        **passthrough,
    ):
        """Validation answers are generated to completion (in budget-sized segments, one policy)."""
        budget = self.config.token_budget
        cfg = PartialRolloutConfig(
            token_budget=budget,
            max_resumptions=math.ceil(self.response_cap / budget),
            max_response_tokens=self.response_cap,
        )
        manager = PartialRolloutManager(cfg, group_size=1)
        logs = input_batch["message_log"]
        manager.add_prompts(
            [
                PromptItem(str(i), prompt_token_ids(m), {}, self._cap_for(prompt_token_ids(m), max_seq_len))
                for i, m in enumerate(logs)
            ]
        )
        generate_fn = self.segment_generate_fn(
            policy_generation, tokenizer, greedy, stop_strings=_stop_union(input_batch)
        )
        while manager.num_completed < len(logs):
            manager.run_iteration(generate_fn, self.policy_version, max_groups=0)
        groups = manager.take_completed(self.policy_version)  # admission order = row order
        rollouts = [g.rollouts[0] for g in groups]
        replay = ReplayGeneration(rollouts, tokenizer.pad_token_id, wrap=_batch_class())
        return original(
            policy_generation=replay,
            input_batch=input_batch,
            tokenizer=tokenizer,
            task_to_env=task_to_env,
            max_seq_len=max_seq_len,
            max_rollout_turns=1,
            greedy=greedy,
            **passthrough,
        )

    def _cap_for(self, prompt_tokens: list[int], max_seq_len: int) -> int:
        room = max_seq_len - len(prompt_tokens)
        if room < 1:
            raise PartialRolloutSetupError(
                f"a prompt of {len(prompt_tokens)} tokens leaves no room in policy.max_total_sequence_length="
                f"{max_seq_len}: raise it or filter long prompts"
            )
        return min(self.response_cap, room)

    def _remember_stop_strings(self, batch: Mapping, row: int) -> None:
        for s in (batch.get("stop_strings") or [None] * (row + 1))[row] or []:
            if s not in self.stop_strings:
                self.stop_strings.append(s)

    def _generate_until(self, num_groups: int, generate_fn) -> int:
        """One segment iteration per step (every in-flight response advances by at most token_budget
        tokens), then more iterations of the same policy version only while fewer than `num_groups`
        complete groups wait."""
        iterations = 0
        while iterations == 0 or self.manager.num_completed < num_groups:
            before = self.manager.stats(self.policy_version)
            self.manager.run_iteration(generate_fn, self.policy_version, max_groups=0)
            iterations += 1
            after = self.manager.stats(self.policy_version)
            if self.ledger is not None:  # the step this generates for: completed trains + 1
                counts = iteration_counts(before, after, self.group_size)
                self.ledger.record(self.policy_version + 1, self.policy_version, **counts)
            idle = after["rollout/sequences_last_iteration"] == 0
            if idle and self.manager.num_completed < num_groups:
                raise RuntimeError(
                    f"partial rollouts cannot complete {num_groups} prompt groups: nothing is left to generate "
                    f"({self.manager.num_completed} complete, {self.manager.num_in_flight} in flight, "
                    f"{self.manager.num_pending} queued); check partial_rollouts.max_in_flight_groups"
                )
        return iterations

    def segment_generate_fn(
        self, policy_generation, tokenizer, greedy: bool, stop_strings: list[str] | None = None
    ):
        """generate_fn(contexts, max_new_tokens) over the real generation backend (vLLM/Megatron): one
        `generate` call per segment iteration; the backend's max_new_tokens is the token budget."""
        pad = tokenizer.pad_token_id
        stops = stop_strings if stop_strings is not None else (list(self.stop_strings) or None)
        eos = getattr(tokenizer, "eos_token_id", None)
        stop_ids = tuple(self.stop_token_ids) + ((eos,) if isinstance(eos, int) else ())
        wrap = _batch_class()

        engines = generation_engines(policy_generation)

        def generate_fn(contexts: list[list[int]], max_new_tokens: int) -> list[GenerationChunk]:
            # The backend gives each engine a contiguous shard; the schedule lists the oldest (longest)
            # responses first, so the rows are dealt across the shards and the chunks put back in order.
            order = balanced_order([len(c) for c in contexts], engines)
            input_ids, input_lengths = generation_inputs([contexts[i] for i in order], pad)
            data = wrap(
                {
                    "input_ids": input_ids,
                    "input_lengths": input_lengths,
                    "stop_strings": [stops] * len(contexts),
                }
            )
            outputs = policy_generation.generate(data, greedy=greedy)
            chunks = chunks_from_generation_outputs(outputs, input_lengths.tolist(), max_new_tokens, stop_ids)
            in_order: list[GenerationChunk] = [chunks[0]] * len(contexts)
            for position, row in enumerate(order):
                in_order[row] = chunks[position]
            return in_order

        return generate_fn

    def rebuild_batch(self, groups: list[RolloutGroup], batch_cls: Callable[[dict], Any] = dict) -> Any:
        """grpo_train's batch shape: G rows per group, group g in rows [g*G, (g+1)*G), dataloader columns
        restored from the checkpointable row encoding (`batch_max_length` recomputed for the new rows)."""
        rows = [r.meta["row"] for g in groups for r in g.rollouts]
        columns = decode_rows(rows)
        if "batch_max_length" in columns and "length" in columns:
            columns["batch_max_length"] = torch.full_like(columns["length"], int(columns["length"].max()))
        return batch_cls(columns)

    def apply_exclusion(self, final_batch: Mapping, rollouts: list[Rollout]) -> None:
        """stale_segments=exclude: mask tokens sampled by policies older than the current one."""
        for i, r in enumerate(rollouts):
            num_stale = sum(1 for v in r.token_versions if v < self.policy_version)
            # the original run_multi_turn_rollout appends the response right after the prompt messages
            assistant_index = len(r.meta["row"]["message_log"]["value"])
            exclude_stale_prefix(final_batch["message_log"][i], assistant_index, num_stale)

    # ---- versions and checkpoints -----------------------------------------------------------------------
    def attach(self, train_calls: Any = None, checkpoints: CheckpointHooks | None = None) -> PartialRolloutHook:
        """Take the policy version from `train_calls` (the driver's `worker_watch.StepCounter`, which counts
        the finished `policy.train` calls); write the in-flight state into every checkpoint through
        `checkpoints` (and restore it from the newest one); keep the generation ledger next to the
        checkpoints and count what this resume generates again."""
        if train_calls is not None:
            version = self.policy_version
            self.train_calls = train_calls
            self.policy_version = version
        if checkpoints is not None:
            self.checkpoints = checkpoints
            checkpoints.add(STATE_FILE, lambda tmp_dir: bool(self.save(tmp_dir)))
            latest = checkpoints.checkpointer.get_latest_checkpoint_path()
            if latest is not None:
                if (Path(latest) / STATE_FILE).exists():
                    self.load(latest)
                else:
                    warnings.warn(
                        f"checkpoint {latest} has no {STATE_FILE}: partial rollouts start with nothing in flight",
                        stacklevel=2,
                    )
            self.ledger = GenerationLedger(checkpoints.checkpoint_dir / LEDGER_FILE)
            regenerated = self.ledger.resume(0 if latest is None else int(Path(latest).name.split("_")[1]))
            if regenerated is not None:
                print(regenerated.line(), flush=True)
                self.resume_metrics = regenerated.metrics()
        return self

    def state_dict(self) -> dict:
        return {
            "format_version": HOOK_STATE_FORMAT_VERSION,
            "policy_version": self.policy_version,
            "batches_seen": self.batches_seen,
            "prefilled": self.prefilled,
            "prefilled_batches": self.prefilled_batches,
            "stop_strings": list(self.stop_strings),
            "response_cap": self.response_cap,
            "manager": self.manager.state_dict(),
        }

    def load_state_dict(self, state: Mapping) -> None:
        if state.get("format_version") != HOOK_STATE_FORMAT_VERSION:
            raise ValueError(
                f"{STATE_FILE}: format_version {state.get('format_version')!r}, expected {HOOK_STATE_FORMAT_VERSION}"
            )
        if state.get("response_cap") != self.response_cap:
            raise ValueError(
                f"{STATE_FILE}: response_cap {state.get('response_cap')!r} differs from this run's {self.response_cap} "
                "(policy.generation.max_new_tokens or partial_rollouts.max_response_tokens changed): resume with the "
                "same value, or delete the file to drop the in-flight responses"
            )
        self.manager.load_state_dict(state["manager"])
        self.policy_version = int(state["policy_version"])
        self.batches_seen = int(state["batches_seen"])
        self.prefilled = bool(state.get("prefilled", False))
        self.prefilled_batches = int(state.get("prefilled_batches", 0))
        self.stop_strings = list(state.get("stop_strings", []))

    def save(self, checkpoint_dir: str | os.PathLike) -> Path:
        path = Path(checkpoint_dir) / STATE_FILE
        tmp = path.with_suffix(".json.tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        os.replace(tmp, path)
        return path

    def load(self, checkpoint_dir: str | os.PathLike) -> None:
        path = Path(checkpoint_dir) / STATE_FILE
        try:
            state = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read partial-rollout state {path}: {exc}") from None
        try:
            self.load_state_dict(state)
        except ValueError as exc:
            raise ValueError(f"{path}: {exc}") from None

    def uninstall(self) -> None:
        """Undo every patch (grpo module names, the generation config's max_new_tokens)."""
        while self._restore:
            self._restore.pop()()


def _batch_class() -> Callable[[dict], Any]:
    try:
        from nemo_rl.distributed.batched_data_dict import BatchedDataDict
    except ImportError:  # CPU tests of the glue: plain dicts shaped like BatchedDataDict's columns
        return dict
    return BatchedDataDict


def _stop_union(batch: Mapping) -> list[str] | None:
    stops: list[str] = []
    for row in batch.get("stop_strings") or []:
        for s in row or []:
            if s not in stops:
                stops.append(s)
    return stops or None


# ---- install ---------------------------------------------------------------------------------------
def install_partial_rollouts(
    master_config: Any, partial_config: PartialRolloutConfig | Mapping | None = None, patch_grpo: bool = True
) -> PartialRolloutHook:
    """Turn on partial rollouts for `nemo_rl.algorithms.grpo.grpo_train` (call BEFORE `grpo.setup`).

    `partial_config` defaults to the config's `partial_rollouts:` block. Sets
    `policy.generation.max_new_tokens` to `token_budget` (the old value becomes the total response cap
    unless `max_response_tokens` is given) and wraps `grpo.run_multi_turn_rollout` and `grpo.validate`.
    Then call `hook.attach(train_calls, checkpoint_hooks)` after setup. Raises PartialRolloutSetupError listing
    every incompatible setting.
    """
    partial_config, prefill_batches = _partial_config(master_config, partial_config)
    problems = check_partial_rollout_config(master_config, partial_config)
    if problems:
        raise PartialRolloutSetupError(
            "partial rollouts cannot run with this config:\n  " + "\n  ".join(problems)
        )

    grpo, policy = _get(master_config, "grpo"), _get(master_config, "policy")
    generation = _get(policy, "generation")
    original_max_new = int(generation["max_new_tokens"])
    response_cap = partial_config.max_response_tokens or original_max_new
    if partial_config.token_budget >= response_cap:
        warnings.warn(
            f"partial_rollouts.token_budget={partial_config.token_budget} >= the response cap {response_cap}: "
            "no response is ever cut, partial rollouts change nothing",
            stacklevel=2,
        )
    generation["max_new_tokens"] = partial_config.token_budget
    hook = PartialRolloutHook(
        partial_config,
        group_size=int(_get(grpo, "num_generations_per_prompt")),
        prompts_per_step=int(_get(grpo, "num_prompts_per_step")),
        response_cap=response_cap,
        max_seq_len=int(_get(policy, "max_total_sequence_length")),
        prefill_batches=prefill_batches,
    )
    hook.stop_token_ids = [int(t) for t in generation.get("stop_token_ids") or []]
    hook._restore.append(lambda: generation.__setitem__("max_new_tokens", original_max_new))
    if patch_grpo:
        _replace_grpo_names(hook)
    return hook


def _partial_config(
    master_config: Any, partial_config: PartialRolloutConfig | Mapping | None
) -> tuple[PartialRolloutConfig, int]:
    """The `partial_rollouts:` block (or `partial_config`) parsed, and its `prefill_batches`."""
    if partial_config is None:
        partial_config = _get(master_config, "partial_rollouts")
        if partial_config is None:
            raise PartialRolloutSetupError(
                "no partial_rollouts: block in the config (e.g. partial_rollouts: {token_budget: 2048})"
            )
    if isinstance(partial_config, PartialRolloutConfig):
        return partial_config, 1
    block = dict(partial_config)
    prefill_batches = block.pop("prefill_batches", 1)
    if not isinstance(prefill_batches, int) or prefill_batches < 0:
        raise PartialRolloutSetupError(
            f"partial_rollouts.prefill_batches must be an int >= 0 (extra dataloader batches in flight), "
            f"got {prefill_batches!r}"
        )
    return PartialRolloutConfig.parse(block), prefill_batches


def _replace_grpo_names(hook: PartialRolloutHook) -> None:
    """`grpo.run_multi_turn_rollout` and `grpo.validate` through the hook (undone by `hook.uninstall`)."""
    import nemo_rl.algorithms.grpo as grpo_module

    for name, make in (
        ("run_multi_turn_rollout", hook.make_rollout_wrapper),
        ("validate", hook.make_validate_wrapper),
    ):
        original = getattr(grpo_module, name)
        # A previous installation in this process (a second driver run) is replaced, not wrapped:
        # wrapping it would run two hooks on one batch.
        while getattr(original, "_partial_rollout_hook", False):
            original = original.__wrapped__
        setattr(grpo_module, name, make(original))
        hook._restore.append(lambda name=name, original=original: setattr(grpo_module, name, original))
