"""The embedded BAPO trainer: one process, one machine (CPU or one GPU), read top to bottom
(docs/embedded.md, "What a run does"). `train(config, output_dir, resume) -> summary dict`:

1. `_set_up`: tokenizer, model, tasks, every config problem at once, tracker; resume if asked;
2. `_warm_up`: supervised fine-tuning on reference solutions, cached in <output_dir>/warmup;
3. RL steps: `rl_step`, then `_record_step` (metrics, held-out eval, checkpoints); a signal ends the step;
4. `_finish`: hf_final, summary, plot. Every ending marks the MLflow run (FINISHED, KILLED or FAILED).
"""

from __future__ import annotations

import json
import logging
import random
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from bapo_nemo.embedded.config.run_config import RunConfig, run_params
from bapo_nemo.embedded.data.tasks import Task, TaskStream
from bapo_nemo.embedded.loop import warmup as warmup_io
from bapo_nemo.embedded.loop.evaluation import evaluate
from bapo_nemo.embedded.loop.rl_step import Learner, StepOutcome, rl_step
from bapo_nemo.embedded.loop.step_metrics import (
    ZERO_SPREAD_TAG,
    NoLearningSignalError,
    ZeroSpreadWatch,
    finite,
    from_scratch_stop,
    sample_rows,
    step_metrics,
)
from bapo_nemo.embedded.model.policy import DTYPES, ModelLoadError, load_policy, prepare_policy
from bapo_nemo.embedded.output import checkpoint as ckpt_io
from bapo_nemo.embedded.output.run_log import LOGGER, MetricsLog, progress_postfix, run_log, step_line
from bapo_nemo.embedded.run.interrupts import StopFlag
from bapo_nemo.embedded.run.prompt_format import final_model_card, run_example, training_template
from bapo_nemo.embedded.run.resume import (
    checkpoint_to_resume,
    remember_store,
    run_to_continue,
    tracking_uri_for,
)
from bapo_nemo.embedded.run.startup_problems import StartupError, check_paths
from bapo_nemo.embedded.run.task_source import rollout_reward, task_source, tokenizer_free_problems
from bapo_nemo.rollout import PartialRolloutManager, ReplayBuffer
from bapo_nemo.tracking.mlflow_tracker import MlflowTracker
from bapo_nemo.tracking.redact import redact_nested, redact_text
from bapo_nemo.tracking.tags import config_hash, default_tags

MODEL_NAME = "bapo-embedded-qwen2-tiny"
log = logging.getLogger(LOGGER)  # <output_dir>/train.log (and stderr without a progress bar) during train()


def train(config: RunConfig, output_dir: str | Path, resume: bool = False,
          warmup_sources: list[str | Path] = ()) -> dict[str, Any]:
    """Run (or resume) a training run; returns a summary (steps, held-out accuracy at the start of RL and
    at the end, MLflow run id, paths). Returns early, after a checkpoint, on SIGTERM/SIGUSR1/SIGINT/SIGHUP.
    A warm-up made from the same inputs by a run in `warmup_sources`, or in a sibling of `output_dir`, is
    reused."""
    cfg = config
    output_dir = Path(output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    stop = StopFlag()
    with run_log(output_dir, to_stderr=not cfg.runtime.progress), stop.installed():
        run = _set_up(cfg, output_dir, resume, stop, [Path(p) for p in warmup_sources])
        try:
            if run.resumed_from is None:  # a checkpoint already holds the warmed-up model
                _warm_up(run)
            bar = tqdm(total=cfg.grpo.max_num_steps, initial=run.step, desc="BAPO RL",
                       disable=not cfg.runtime.progress)
            while run.step < cfg.grpo.max_num_steps and not run.stop.requested:
                outcome = rl_step(run.learner)
                run.step += 1
                metrics = _record_step(run, outcome)
                bar.update(1)
                bar.set_postfix(progress_postfix(metrics, run.history["eval"][-1], cfg.eval.k))
            bar.close()
            return _finish(run)
        except KeyboardInterrupt:
            log.info(f"aborted by a second Ctrl-C at step {run.step}: no checkpoint of the current step")
            _mark_run(run.tracker, "KILLED")
            raise
        except BaseException as exc:
            log.info(f"failed at step {run.step}: {type(exc).__name__}: {exc}")
            _mark_run(run.tracker, "FAILED")
            raise


def _mark_run(tracker: MlflowTracker, status: str) -> None:
    try:
        tracker.finish(status)
    except Exception as exc:  # noqa: BLE001 - the run's own error is the one to report
        print(f"could not mark the MLflow run {status} ({type(exc).__name__}: {redact_text(str(exc))})",
              file=sys.stderr)


# ---- 1. set-up and resume --------------------------------------------------------------------------------
@dataclass
class _Run:
    """A run's state around the RL step: what set-up made, what bookkeeping writes to."""

    cfg: RunConfig
    output_dir: Path
    config_dict: dict
    device: torch.device
    learner: Learner
    eval_tasks: list[Task]
    score: Callable[[str, Task], float]  # reward of a response text
    warmup_stream: TaskStream
    step: int
    history: dict
    resumed_from: Path | None
    tracker: MlflowTracker
    run_id: str
    tracking_uri: str
    metrics_log: MetricsLog
    groups_log: MetricsLog
    stop: StopFlag
    warmup_sources: list[Path]  # runs whose warm-up this one may reuse (besides its siblings)
    spread_watch: ZeroSpreadWatch = field(default_factory=ZeroSpreadWatch)


def _set_up(cfg: RunConfig, output_dir: Path, resume: bool, stop: StopFlag, warmup_sources: list[Path]) -> _Run:
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.runtime.num_threads)
    device = torch.device(cfg.runtime.device)
    config_dict = cfg.to_dict()
    random.seed(cfg.grpo.seed)
    torch.manual_seed(cfg.grpo.seed)

    ckpt = checkpoint_to_resume(output_dir, config_dict, resume)
    model, tokenizer, context_window = _load_checked_policy(cfg, device)
    encode, eval_tasks, pool, score = task_source(cfg, tokenizer, context_window)
    held_out = {t.question for t in eval_tasks}
    stream = TaskStream(cfg.grpo.seed, cfg.task, held_out, pool)
    warmup_stream = TaskStream(
        cfg.grpo.seed + 7919,
        cfg.task,
        held_out,
        pool,
        cfg.warmup.step_error_rate,
        cfg.warmup.loop_rate,
        cfg.partial_rollouts.max_response_tokens,
    )

    learner = Learner(
        cfg,
        model,
        _optimizer(cfg, model),
        tokenizer,
        stream,
        PartialRolloutManager(cfg.partial_rollouts, cfg.grpo.num_generations_per_prompt),
        ReplayBuffer(cfg.replay.capacity, cfg.replay.max_staleness),
        sample_gen=torch.Generator(device=device).manual_seed(cfg.grpo.seed + 1),  # sampling: on the device
        shuffle_gen=torch.Generator().manual_seed(cfg.grpo.seed + 2),
        encode=encode,
        reward=lambda rollout: rollout_reward(tokenizer, score, rollout),
    )
    step, history = 0, {"eval": [], "warmup": None}
    if ckpt is not None:
        step, history = _restore(learner, ckpt, device)
    tracking_uri = tracking_uri_for(cfg.logger.mlflow.tracking_uri, output_dir)
    run_id = run_to_continue(output_dir, ckpt, resume, tracking_uri)
    tracker = MlflowTracker(
        tracking_uri,
        cfg.logger.mlflow.experiment_name,
        cfg.logger.mlflow.run_name or output_dir.name,
        run_id=run_id,
        buffer_dir=output_dir / "mlflow_buffer",
    )
    params = run_params(config_dict)
    run_id = tracker.start(params, {**default_tags(params), "bapo.runtime": "embedded"})
    (output_dir / "mlflow_run_id").write_text(run_id + "\n")
    remember_store(output_dir, tracking_uri)
    keep_up_to = step if ckpt is not None else -1
    return _Run(
        cfg,
        output_dir,
        config_dict,
        device,
        learner,
        eval_tasks,
        score,
        warmup_stream,
        step,
        history,
        ckpt,
        tracker,
        run_id,
        tracking_uri,
        MetricsLog(output_dir / "metrics.jsonl", keep_up_to),
        # Which prompt groups each step trained on, with their segment counts: the audit trail showing that
        # responses in flight at a checkpoint are finished after a resume, not dropped.
        MetricsLog(output_dir / "trained_groups.jsonl", keep_up_to),
        stop,
        warmup_sources,
    )


def _load_checked_policy(cfg: RunConfig, device: torch.device):
    """`load_policy` after `check_paths`; when either fails, the dataset's problems that need no tokenizer
    are said in the same message (one attempt shows every problem)."""
    try:
        check_paths(cfg)  # every path that names nothing, before anything loads
        return load_policy(cfg, device)
    except StartupError as exc:
        raise StartupError(exc.problems + tokenizer_free_problems(cfg)) from None
    except ModelLoadError as exc:
        raise StartupError([str(exc), *tokenizer_free_problems(cfg)]) from None


def _load_model(cfg: RunConfig, like, path: Path, device: torch.device):
    """A saved copy of the policy (checkpoint, warm-up cache), prepared like the original."""
    return prepare_policy(cfg, type(like).from_pretrained(str(path), dtype=DTYPES[cfg.model.dtype]), device)


def _optimizer(cfg: RunConfig, model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(
        model.parameters(),
        lr=cfg.policy.optimizer.kwargs.lr,
        betas=cfg.policy.optimizer.kwargs.betas,
        weight_decay=cfg.policy.optimizer.kwargs.weight_decay,
    )


def _restore(learner: Learner, ckpt: Path, device: torch.device) -> tuple[int, dict]:
    """Load a checkpoint into `learner` (model, optimizer, random streams, task stream, rollouts in flight,
    replay buffer, policy version). Returns the checkpoint's step and history."""
    learner.model = _load_model(learner.cfg, learner.model, ckpt / "model", device)
    learner.optimizer = _optimizer(learner.cfg, learner.model)
    state = ckpt_io.load_trainer_state(ckpt)
    learner.optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])
    learner.sample_gen.set_state(state["rng"]["sample"])
    learner.shuffle_gen.set_state(state["rng"]["shuffle"])
    learner.stream.set_state(state["task_stream"])
    learner.version = state["policy_version"]
    rollout_state = ckpt_io.load_rollout_state(ckpt)
    learner.manager.load_state_dict(rollout_state["manager"])
    learner.replay.load_state_dict(rollout_state["replay"])
    return state["step"], state["history"]


# ---- 2. warm-up ------------------------------------------------------------------------------------------
def _warm_up(run: _Run) -> None:
    """Supervised warm-up (or its cached result), the held-out evaluation at step 0, checkpoint 0."""
    cfg, learner = run.cfg, run.learner
    key = warmup_io.cache_key(run.config_dict)
    # no warm-up, nothing to cache (a copy of the pretrained model would be all it held)
    cached, reused_from = warmup_io.find_cached(run.output_dir, key, run.warmup_sources) if cfg.warmup.steps else (
        None, None)
    if cached is not None:
        learner.model = _load_model(cfg, learner.model, cached[0], run.device)
        learner.optimizer = _optimizer(cfg, learner.model)
        warm_metrics = cached[1]
    else:
        warm_metrics = warmup_io.run_warmup(
            learner.model, learner.tokenizer, run.warmup_stream, cfg.warmup, run.device, cfg.runtime.progress,
            should_stop=lambda: run.stop.requested,
        )
    run.history["warmup"] = warm_metrics
    if _warm_up_cut_short(run):
        return  # no cache, no checkpoint: a rerun starts the warm-up again
    if cached is None and cfg.warmup.steps:
        warmup_io.save_cache(run.output_dir, key, learner.model, warm_metrics)
    log.info(warmup_io.outcome_line(cfg.warmup.steps, cached, reused_from))
    start_eval = _run_eval(run, 0)
    run.tracker.log_metrics({**finite(warm_metrics), **start_eval}, step=0)
    run.metrics_log.write({"step": 0, **warm_metrics, **start_eval})
    _save(run, 0)


def _warm_up_cut_short(run: _Run) -> bool:
    """A stop signal ended the warm-up before its last step (a resumed run's warm-up is always whole)."""
    return run.history["warmup"] is not None and run.history["warmup"]["warmup/steps"] < run.cfg.warmup.steps


# ---- 3. bookkeeping after each RL step -------------------------------------------------------------------
def _record_step(run: _Run, outcome: StepOutcome) -> dict[str, float]:
    """Metrics of the step just taken (to MLflow and metrics.jsonl), the trained groups, samples, held-out
    evaluation and checkpoint when due. Returns the step's metrics."""
    cfg, step = run.cfg, run.step
    metrics = step_metrics(outcome, run.learner.version)
    if step % cfg.grpo.val_period == 0 or step == cfg.grpo.max_num_steps:
        metrics.update(_run_eval(run, step))
    run.tracker.log_metrics(finite(metrics), step=step)
    run.metrics_log.write({"step": step, **metrics})
    log.info(step_line(step, cfg.grpo.max_num_steps, metrics, cfg.eval.k))
    warning = run.spread_watch.update(step, metrics["frac_reward_zero_std"], metrics["reward/mean"])
    from_scratch = cfg.policy.model_name is None and cfg.warmup.steps == 0
    stop = from_scratch_stop(step, run.spread_watch.leading_zero_steps, from_scratch)
    if stop:
        run.tracker.log_tags({ZERO_SPREAD_TAG: stop})
        raise NoLearningSignalError(stop)
    if warning:  # console, train.log and the MLflow run
        log.warning(warning)
        run.tracker.log_tags({ZERO_SPREAD_TAG: warning})
    run.groups_log.write(
        {
            "step": step,
            "groups": [
                {"prompt_id": g.prompt_id, "segments": [r.num_segments for r in g.rollouts]}
                for g in outcome.groups
            ],
            "replayed": [g.prompt_id for g in outcome.replayed],
        }
    )
    if step % cfg.tracking.samples_every == 0:
        run.tracker.log_table(
            sample_rows(
                run.learner.tokenizer, outcome.groups, outcome.rewards, step, cfg.tracking.num_samples
            ),
            f"samples/step_{step:06d}.json",
        )
    if step % cfg.checkpointing.save_period == 0 or step == cfg.grpo.max_num_steps or run.stop.requested:
        _save(run, step)
    return metrics


def _run_eval(run: _Run, at_step: int) -> dict[str, float]:
    cfg = run.cfg
    result = evaluate(
        run.learner.model,
        run.learner.tokenizer,
        run.eval_tasks,
        cfg.eval.k,
        cfg.partial_rollouts.max_response_tokens,
        seed=cfg.task.eval_seed,
        temperature=cfg.policy.generation.temperature,
        encode=run.learner.encode,
        score=run.score,
    )
    run.history["eval"].append({"step": at_step, **result})
    return result


def _save(run: _Run, at_step: int) -> Path:
    learner, history = run.learner, run.history
    trainer_state = {
        "step": at_step,
        "policy_version": learner.version,
        "history": history,
        "optimizer": learner.optimizer.state_dict(),
        "rng": {
            "torch": torch.get_rng_state(),
            "sample": learner.sample_gen.get_state(),
            "shuffle": learner.shuffle_gen.get_state(),
        },
        "task_stream": learner.stream.state(),
    }
    info = {
        "step": at_step,
        "policy_version": learner.version,
        "mlflow_run_id": run.run_id,
        "mlflow_tracking_uri": run.tracking_uri,
        "config_hash": config_hash(run_params(run.config_dict)),
        "bapo": run.cfg.loss_fn.bapo.model_dump(mode="json"),
        "model_name": run.cfg.policy.model_name or MODEL_NAME,
        "last_eval": history["eval"][-1] if history["eval"] else None,
        "example": _example(run),  # for the exported model's card
    }
    rollout_state = {"manager": learner.manager.state_dict(), "replay": learner.replay.state_dict()}
    return ckpt_io.save_checkpoint(
        run.output_dir,
        at_step,
        learner.model,
        learner.tokenizer,
        trainer_state,
        rollout_state,
        run.config_dict,
        info,
        run.cfg.checkpointing.keep_top_k,
    )


# ---- 4. finish: HF save (only when the run is done; a stopped run resumes later) --------------------------
def _finish(run: _Run) -> dict[str, Any]:
    cfg, step, history, output_dir = run.cfg, run.step, run.history, run.output_dir
    start_eval = next((e for e in history["eval"] if e["step"] == 0), None)
    ended = step >= cfg.grpo.max_num_steps and not _warm_up_cut_short(run)  # a signal now cannot stop it
    summary = {
        "step": step,
        "max_steps": cfg.grpo.max_num_steps,
        "policy_version": run.learner.version,
        "stopped_by_signal": None if ended else run.stop.signal_name,
        "mlflow_run_id": run.run_id,
        "mlflow_tracking_uri": run.tracking_uri,
        "mlflow_experiment_id": run.tracker.experiment_id,
        "output_dir": str(output_dir),
        "warmup": history["warmup"],
        "eval_start": start_eval,
        "eval_end": history["eval"][-1] if history["eval"] else None,
        "eval_history": history["eval"],
    }
    if run.stop.requested and not ended:
        # A requeued job resumes from the checkpoint just written (and marks the run RUNNING again).
        if _warm_up_cut_short(run):
            done = int(history["warmup"]["warmup/steps"])
            log.info(f"stopped by {run.stop.signal_name} during the warm-up ({done} of {cfg.warmup.steps} steps): "
                     "no checkpoint yet; the same command with --resume starts the warm-up again in the same "
                     "MLflow run")
        else:
            log.info(f"stopped by {run.stop.signal_name} at step {step} with a checkpoint; continue with --resume")
        run.tracker.finish("KILLED")
        return summary
    final = output_dir / "hf_final"
    trained_now = run.resumed_from is None or run.resumed_from.name != f"step_{step}"
    if trained_now or ckpt_io.final_model_step(final) != step:  # e.g. a resumed run that went further
        tokenizer, card = final_model_card(run.learner.tokenizer, run.config_dict, _example(run), step, run.run_id,
                                           cfg.policy.model_name or MODEL_NAME)
        ckpt_io.save_final_model(run.learner.model, tokenizer, final, step, card)
    summary["hf_final"] = str(final)
    summary["plot"] = _log_training_plot(run.tracker, run.tracking_uri, run.run_id, output_dir / "plots")
    (output_dir / "summary.json").write_text(json.dumps(redact_nested(summary), indent=2))
    run.tracker.log_artifact(output_dir / "summary.json")
    run.tracker.finish("FINISHED")
    if run.stop.requested:
        log.info(f"{run.stop.signal_name} arrived after the last step: the run was finished first")
    log.info(f"finished at step {step}: {final}")
    return summary


# ---- helpers ------------------------------------------------------------------------------------------------
def _log_training_plot(tracker: MlflowTracker, tracking_uri: str, run_id: str, out_dir: Path) -> str | None:
    """The run's training-dynamics panels as a PNG artifact (returns its path); a tracking outage only loses
    the plot."""
    from bapo_nemo.tracking.report import log_run_plot

    if tracker.flush():
        print("tracking server unreachable: metrics stay journaled; no training plot this time", file=sys.stderr)
        return None
    try:
        return str(log_run_plot(tracking_uri, run_id, out_dir))
    except Exception as exc:  # noqa: BLE001 (the plot is a convenience; never fail a finished run for it)
        print(f"could not log the training plot ({type(exc).__name__}: {redact_text(str(exc))})", file=sys.stderr)
        return None


def _example(run: _Run) -> dict:
    """A held-out task of the run, as the exported model's card shows it (how to prompt it)."""
    task = run.eval_tasks[0]
    return run_example(task.question, task.answer, task.solution, training_template(run.config_dict))
