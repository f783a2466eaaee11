"""The embedded BAPO trainer: one process, a tiny Qwen2, the bundled arithmetic tasks, read top to bottom.

    train(config, output_dir, resume) -> summary dict

1. set-up: tokenizer, tasks, model, tracker; resume from the newest complete checkpoint if asked
2. warm-up: supervised fine-tuning on reference solutions (cached in <output_dir>/warmup)
3. RL steps: partial rollouts -> rewards -> GRPO advantages -> `updates_per_batch` BAPO updates
   (+ replayed groups), held-out avg@k/pass@k every `eval.every` steps, checkpoints every
   `checkpoint.every` steps; SIGTERM/SIGUSR1 finish the step, checkpoint and return
4. HF save in <output_dir>/hf_final
"""

from __future__ import annotations

import json
import math
import random
import signal
import threading
import time
from pathlib import Path
from typing import Any

import torch
from tqdm.auto import tqdm

from bapo_nemo.embedded import checkpoint as ckpt_io
from bapo_nemo.embedded import warmup as warmup_io
from bapo_nemo.embedded.config import RunConfig, config_differences
from bapo_nemo.embedded.evaluation import decode_response, encode_prompt, evaluate
from bapo_nemo.embedded.generation import sample_continuations
from bapo_nemo.embedded.grpo import build_batch, forward_logprobs, policy_update
from bapo_nemo.embedded.model import build_model
from bapo_nemo.embedded.tasks import TaskGenerator, TaskStream, load_jsonl_tasks, reward
from bapo_nemo.embedded.tokenizer import load_tokenizer, save_tokenizer
from bapo_nemo.rollout import (
    GenerationChunk,
    PartialRolloutManager,
    PromptItem,
    ReplayBuffer,
    split_minibatches,
)
from bapo_nemo.tracking.mlflow_tracker import MlflowTracker
from bapo_nemo.tracking.tags import config_hash, default_tags

MODEL_NAME = "bapo-embedded-qwen2-tiny"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class ResumeError(RuntimeError):
    """The output directory cannot be resumed (or would be overwritten); the message says what to do."""


def train(config: RunConfig, output_dir: str | Path, resume: bool = False) -> dict[str, Any]:
    """Run (or resume) a training run; returns a summary (steps, held-out accuracy at the start of RL and
    at the end, MLflow run id, paths). Returns early, after a checkpoint, on SIGTERM/SIGUSR1."""
    cfg = config
    output_dir = Path(output_dir).resolve()
    output_dir.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(cfg.runtime.num_threads)
    device = torch.device(cfg.runtime.device)
    config_dict = cfg.to_dict()
    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)

    # ---- 1. set-up --------------------------------------------------------------------------------------
    ckpt = _checkpoint_to_resume(output_dir, config_dict, resume)
    tokenizer = load_tokenizer()
    eval_tasks = (
        load_jsonl_tasks(cfg.task.eval_file, cfg.task.max_bad_fraction)
        if cfg.task.eval_file
        else TaskGenerator(
            cfg.task.eval_seed,
            cfg.task.min_ops,
            cfg.task.max_ops,
            cfg.task.tail_alpha,
            cfg.task.max_value,
            cfg.task.max_operand,
            prefix="eval",
        ).sample(cfg.task.eval_size)
    )
    pool = load_jsonl_tasks(cfg.task.train_file, cfg.task.max_bad_fraction) if cfg.task.train_file else None
    held_out = {t.question for t in eval_tasks}
    stream = TaskStream(cfg.seed, cfg.task, held_out, pool)
    warmup_stream = TaskStream(cfg.seed + 7919, cfg.task, held_out, pool, cfg.warmup.step_error_rate)

    model = build_model(cfg.model, tokenizer, cfg.seed).to(device)
    optimizer = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.optim.lr,
        betas=(cfg.optim.beta1, cfg.optim.beta2),
        weight_decay=cfg.optim.weight_decay,
    )
    manager = PartialRolloutManager(cfg.rollout.partial, cfg.rollout.group_size)
    replay = ReplayBuffer(cfg.replay.capacity, cfg.replay.max_staleness)
    sample_gen = torch.Generator().manual_seed(cfg.seed + 1)  # generation
    shuffle_gen = torch.Generator().manual_seed(cfg.seed + 2)  # mini-batch split and replay sampling
    step, version, history = 0, 0, {"eval": [], "warmup": None}

    if ckpt is not None:
        model = type(model).from_pretrained(str(ckpt / "model")).to(device)
        optimizer = torch.optim.AdamW(
            model.parameters(),
            lr=cfg.optim.lr,
            betas=(cfg.optim.beta1, cfg.optim.beta2),
            weight_decay=cfg.optim.weight_decay,
        )
        state = ckpt_io.load_trainer_state(ckpt)
        optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"]["torch"])
        sample_gen.set_state(state["rng"]["sample"])
        shuffle_gen.set_state(state["rng"]["shuffle"])
        stream.set_state(state["task_stream"])
        step, version, history = state["step"], state["policy_version"], state["history"]
        rollout_state = ckpt_io.load_rollout_state(ckpt)
        manager.load_state_dict(rollout_state["manager"])
        replay.load_state_dict(rollout_state["replay"])
        run_id = ckpt_io.load_training_info(ckpt).get("mlflow_run_id")
    else:
        run_id = _saved_run_id(output_dir) if resume else None

    tracking_uri = cfg.tracking.tracking_uri or f"sqlite:///{output_dir / 'mlflow.db'}"
    tracker = MlflowTracker(
        tracking_uri,
        cfg.tracking.experiment_name,
        cfg.tracking.run_name or output_dir.name,
        run_id=run_id,
        buffer_dir=output_dir / "mlflow_buffer",
    )
    run_id = tracker.start(config_dict, {**default_tags(config_dict), "bapo.runtime": "embedded"})
    (output_dir / "mlflow_run_id").write_text(run_id + "\n")
    metrics_log = _MetricsLog(output_dir / "metrics.jsonl", keep_up_to=step if ckpt is not None else -1)
    # Which prompt groups each step trained on, with their segment counts: the audit trail showing that
    # responses in flight at a checkpoint are finished after a resume, not dropped.
    groups_log = _MetricsLog(output_dir / "trained_groups.jsonl", keep_up_to=step if ckpt is not None else -1)
    stop = _StopFlag()

    def save(at_step: int) -> Path:
        trainer_state = {
            "step": at_step,
            "policy_version": version,
            "history": history,
            "optimizer": optimizer.state_dict(),
            "rng": {
                "torch": torch.get_rng_state(),
                "sample": sample_gen.get_state(),
                "shuffle": shuffle_gen.get_state(),
            },
            "task_stream": stream.state(),
        }
        info = {
            "step": at_step,
            "policy_version": version,
            "mlflow_run_id": run_id,
            "mlflow_tracking_uri": tracking_uri,
            "config_hash": config_hash(config_dict),
            "bapo": cfg.loss.bapo.model_dump(mode="json"),
            "model_name": MODEL_NAME,
            "last_eval": history["eval"][-1] if history["eval"] else None,
        }
        rollout_state = {"manager": manager.state_dict(), "replay": replay.state_dict()}
        return ckpt_io.save_checkpoint(
            output_dir,
            at_step,
            model,
            tokenizer,
            trainer_state,
            rollout_state,
            config_dict,
            info,
            cfg.checkpoint.keep_last,
        )

    def run_eval(at_step: int) -> dict[str, float]:
        result = evaluate(
            model,
            tokenizer,
            eval_tasks,
            cfg.eval.k,
            cfg.rollout.partial.max_response_tokens,
            seed=cfg.task.eval_seed,
            temperature=cfg.rollout.temperature,
        )
        history["eval"].append({"step": at_step, **result})
        return result

    with stop.installed():
        # ---- 2. warm-up (skipped when resuming: the checkpoint already holds the warmed-up model) -------
        if ckpt is None:
            key = warmup_io.cache_key(config_dict)
            cached = warmup_io.load_cached(output_dir, key)
            if cached is not None:
                model = type(model).from_pretrained(str(cached[0])).to(device)
                optimizer = torch.optim.AdamW(
                    model.parameters(),
                    lr=cfg.optim.lr,
                    betas=(cfg.optim.beta1, cfg.optim.beta2),
                    weight_decay=cfg.optim.weight_decay,
                )
                warm_metrics = cached[1]
            else:
                warm_metrics = warmup_io.run_warmup(
                    model, tokenizer, warmup_stream, cfg.warmup, device, cfg.runtime.progress
                )
                warmup_io.save_cache(output_dir, key, model, warm_metrics)
            history["warmup"] = warm_metrics
            start_eval = run_eval(0)
            tracker.log_metrics({**_finite(warm_metrics), **start_eval}, step=0)
            metrics_log.write({"step": 0, **warm_metrics, **start_eval})
            save(0)

        # ---- 3. RL steps --------------------------------------------------------------------------------
        def generate_fn(contexts: list[list[int]], max_new_tokens: int) -> list[GenerationChunk]:
            outs = sample_continuations(
                model,
                contexts,
                max_new_tokens,
                tokenizer.eos_token_id,
                tokenizer.pad_token_id,
                sample_gen,
                cfg.rollout.temperature,
            )
            return [GenerationChunk(o.token_ids, o.logprobs, o.finished) for o in outs]

        in_flight_cap = cfg.rollout.partial.max_in_flight_groups or 2 * cfg.rollout.prompts_per_step
        bar = tqdm(total=cfg.train.max_steps, initial=step, desc="BAPO RL", disable=not cfg.runtime.progress)
        while step < cfg.train.max_steps and not stop.requested:
            t_start, cpu_start = time.perf_counter(), time.process_time()
            # rollouts: only complete groups leave the manager; unfinished responses stay in flight
            groups, generated = manager.take_completed(version, cfg.rollout.prompts_per_step), 0
            while len(groups) < cfg.rollout.prompts_per_step:
                queued = manager.num_pending + manager.num_in_flight + manager.num_completed
                if queued < in_flight_cap:
                    manager.add_prompts(
                        [
                            PromptItem(
                                t.prompt_id,
                                encode_prompt(tokenizer, t.question),
                                {"question": t.question, "answer": t.answer, **t.meta},
                            )
                            for t in stream.next(in_flight_cap - queued)
                        ]
                    )
                groups += manager.run_iteration(
                    generate_fn, version, cfg.rollout.prompts_per_step - len(groups)
                )
                generated += manager.stats(version)["rollout/tokens_last_iteration"]
            rollout_stats = manager.stats(version)
            t_generated = time.perf_counter()
            replayed = (
                replay.sample(cfg.replay.groups_per_step, version, shuffle_gen)
                if cfg.replay.groups_per_step
                else []
            )

            # rewards and GRPO advantages (a response cut off without EOS scores 0)
            batch_groups = groups + replayed
            rewards = [[_reward(tokenizer, r) for r in g.rollouts] for g in batch_groups]
            batch = build_batch(batch_groups, rewards, tokenizer.pad_token_id)

            # the ratio's reference: behaviour log-probs, or proximal ones recomputed now
            weights = batch.loss_weights
            if cfg.loss.ratio_reference == "proximal":
                old = forward_logprobs(model, batch, cfg.train.micro_batch_size)
                gap = torch.exp(torch.clamp(old - batch.behavior_logprobs, -20, 20))
                weights = weights * torch.clamp(gap, max=cfg.loss.behavior_weight_cap) * batch.mask
            else:
                old = batch.behavior_logprobs
            staleness = ((version - batch.token_versions) * batch.mask).sum() / batch.mask.sum().clamp_min(1)

            # updates_per_batch optimizer updates, each on one mini-batch of whole groups
            per_update = []
            n_updates = min(cfg.train.updates_per_batch, len(batch_groups))
            for rows in split_minibatches(len(batch), n_updates, cfg.rollout.group_size, shuffle_gen):
                mb = batch.select(rows)
                width = mb.mask.shape[1]
                per_update.append(
                    policy_update(
                        model,
                        optimizer,
                        mb,
                        old[rows][:, :width],
                        weights[rows][:, :width],
                        cfg.loss,
                        cfg.train.micro_batch_size,
                        cfg.optim.grad_clip,
                        cfg.train.step_search_graph_tokens,
                    )
                )
                version += 1
            replay.add(
                groups,
                min(
                    (min(r.token_versions, default=version) for g in groups for r in g.rollouts),
                    default=version,
                ),
            )
            step += 1
            t_end, cpu_end = time.perf_counter(), time.process_time()

            # metrics
            fresh = [x for rs in rewards[: len(groups)] for x in rs]
            lengths = [len(r.response_token_ids) for g in groups for r in g.rollouts]
            metrics = {key: sum(u[key] for u in per_update) / len(per_update) for key in per_update[0]}
            metrics.update(
                {
                    "reward/mean": sum(fresh) / len(fresh),
                    "train/accuracy": sum(1.0 for x in fresh if x > 0) / len(fresh),
                    "train/response_length_mean": sum(lengths) / len(lengths),
                    "train/response_length_max": float(max(lengths)),
                    "train/token_staleness_mean": float(staleness),
                    "train/replayed_groups": float(len(replayed)),
                    "train/policy_version": float(version),
                    "perf/generated_tokens": float(generated),
                    "perf/generation_tokens_per_s": generated / max(t_generated - t_start, 1e-9),
                    "perf/tokens_per_s": generated / max(t_end - t_start, 1e-9),
                    "perf/step_time_s": t_end - t_start,
                    "perf/step_cpu_s": cpu_end - cpu_start,  # = wall time alone on the machine (1 thread)
                    **{k: v for k, v in rollout_stats.items() if not k.startswith("rollout/segments_hist")},
                }
            )
            if step % cfg.eval.every == 0 or step == cfg.train.max_steps:
                metrics.update(run_eval(step))
            tracker.log_metrics(_finite(metrics), step=step)
            metrics_log.write({"step": step, **metrics})
            groups_log.write(
                {
                    "step": step,
                    "groups": [
                        {"prompt_id": g.prompt_id, "segments": [r.num_segments for r in g.rollouts]}
                        for g in groups
                    ],
                    "replayed": [g.prompt_id for g in replayed],
                }
            )
            if step % cfg.tracking.samples_every == 0:
                tracker.log_table(
                    _sample_rows(tokenizer, groups, rewards, step, cfg.tracking.num_samples),
                    f"samples/step_{step:06d}.json",
                )
            bar.update(1)
            bar.set_postfix(
                reward=f"{metrics['reward/mean']:.2f}",
                acc=f"{history['eval'][-1]['eval/avg_at_k']:.2f}",
                c_low=f"{metrics.get('bapo/c_low', 0):.2f}",
                c_high=f"{metrics.get('bapo/c_high', 0):.2f}",
            )
            if step % cfg.checkpoint.every == 0 or step == cfg.train.max_steps or stop.requested:
                save(step)
        bar.close()

    # ---- 4. finish: HF save (only when the run is done; a stopped run resumes later) ----------------------
    start_eval = next((e for e in history["eval"] if e["step"] == 0), None)
    summary = {
        "step": step,
        "max_steps": cfg.train.max_steps,
        "policy_version": version,
        "stopped_by_signal": stop.signal_name,
        "mlflow_run_id": run_id,
        "mlflow_tracking_uri": tracking_uri,
        "output_dir": str(output_dir),
        "warmup": history["warmup"],
        "eval_start": start_eval,
        "eval_end": history["eval"][-1] if history["eval"] else None,
        "eval_history": history["eval"],
    }
    if stop.requested:
        # A requeued job resumes from the checkpoint just written; `requeue=True` tells Slurm wrappers so.
        tracker.flush()
        return summary
    if step >= cfg.train.max_steps and not (output_dir / "hf_final" / "COMPLETE").is_file():
        final = output_dir / "hf_final"
        ckpt_io.save_model(model, final)
        save_tokenizer(tokenizer, final)
        (final / "COMPLETE").write_text(f"step {step}\n")
    summary["hf_final"] = str(output_dir / "hf_final")
    (output_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    tracker.log_artifact(output_dir / "summary.json")
    _log_training_plot(tracker, tracking_uri, run_id, output_dir / "plots")
    tracker.finish("FINISHED")
    return summary


# ---- helpers ------------------------------------------------------------------------------------------------
def _log_training_plot(tracker: MlflowTracker, tracking_uri: str, run_id: str, out_dir: Path) -> None:
    """The run's training-dynamics panels as a PNG artifact; a tracking outage only loses the plot."""
    from bapo_nemo.tracking.report import log_run_plot

    if tracker.flush():
        print("tracking server unreachable: metrics stay journaled; no training plot this time")
        return
    try:
        log_run_plot(tracking_uri, run_id, out_dir)
    except Exception as exc:  # the plot is a convenience; never fail a finished run for it
        print(f"could not log the training plot ({type(exc).__name__}: {exc})")


def _checkpoint_to_resume(output_dir: Path, config_dict: dict, resume: bool) -> Path | None:
    latest = ckpt_io.latest_checkpoint(output_dir)
    if latest is None:
        return None
    if not resume:
        raise ResumeError(
            f"{output_dir} already holds checkpoints (newest: {latest.name}); pass --resume to continue that run, "
            "or choose a new --output-dir (nothing was overwritten)"
        )
    diffs = config_differences(ckpt_io.load_config_dict(latest), config_dict)
    if diffs:
        raise ResumeError(
            f"cannot resume from {latest}: it was written with a different config. Differing keys:\n  "
            + "\n  ".join(diffs)
            + "\nResume with the checkpoint's values, or start a new run in another --output-dir."
        )
    return latest


def _saved_run_id(output_dir: Path) -> str | None:
    path = output_dir / "mlflow_run_id"
    return path.read_text().strip() or None if path.is_file() else None


def _reward(tokenizer, rollout) -> float:
    if rollout.truncated:
        return 0.0
    from bapo_nemo.embedded.tasks import Task

    task = Task(rollout.prompt_id, rollout.meta["question"], rollout.meta["answer"])
    return reward(decode_response(tokenizer, rollout.response_token_ids), task)


def _sample_rows(tokenizer, groups, rewards, step: int, n: int) -> list[dict]:
    rows = []
    for g, rs in zip(groups, rewards):
        r = g.rollouts[0]
        rows.append(
            {
                "step": step,
                "prompt": r.meta["question"],
                "answer": r.meta["answer"],
                "response": decode_response(tokenizer, r.response_token_ids),
                "reward": rs[0],
                "num_segments": r.num_segments,
                "length": len(r.response_token_ids),
            }
        )
        if len(rows) >= n:
            break
    return rows


def _finite(metrics: dict) -> dict[str, float]:
    return {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}


class _MetricsLog:
    """A JSONL file with one record per step (metrics.jsonl: the local copy of what goes to MLflow). On
    resume, records after the checkpoint's step (written by the interrupted process) are dropped."""

    def __init__(self, path: Path, keep_up_to: int):
        self.path = path
        if path.is_file():
            lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
            kept = [ln for ln in lines if keep_up_to >= 0 and json.loads(ln)["step"] <= keep_up_to]
            path.write_text("".join(ln + "\n" for ln in kept))

    def write(self, record: dict) -> None:
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class _StopFlag:
    """SIGTERM / SIGUSR1 (Slurm's pre-timeout signal) ask the loop to stop after the current step."""

    def __init__(self):
        self.signal_name: str | None = None

    @property
    def requested(self) -> bool:
        return self.signal_name is not None

    def _handle(self, signum, _frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def installed(self):
        flag = self

        class _Ctx:
            def __enter__(self):
                self.previous = {}
                if threading.current_thread() is threading.main_thread():
                    for sig in STOP_SIGNALS:
                        self.previous[sig] = signal.signal(sig, flag._handle)
                return flag

            def __exit__(self, *exc):
                for sig, handler in self.previous.items():
                    signal.signal(sig, handler)
                return False

        return _Ctx()
