"""When the training GPUs are not a whole number of model replicas (TP x PP x CP): which parallel size to
change and to what. The finding names the size the user changed (an override on the command line), else
each size that can be fixed alone, with the values that fit the GPUs and the other rules (the model's
heads for TP; `make_sequence_length_divisible_by` a multiple of 2*CP x TP with sequence parallel), and the
node counts that fit the sizes as set."""

from __future__ import annotations

from dataclasses import dataclass, replace

from bapo_nemo.plan.rules.findings import Finding
from bapo_nemo.plan.rules.models import ModelShape

MEGATRON_KEYS = {
    "tp": "policy.megatron_cfg.tensor_model_parallel_size",
    "pp": "policy.megatron_cfg.pipeline_model_parallel_size",
    "cp": "policy.megatron_cfg.context_parallel_size",
}
DTENSOR_KEYS = {"tp": "policy.dtensor_cfg.tensor_parallel_size", "cp": "policy.dtensor_cfg.context_parallel_size"}


@dataclass(frozen=True)
class Layout:
    megatron: bool
    tp: int
    pp: int
    cp: int
    sequence_parallel: bool
    divisible_by: int  # policy.make_sequence_length_divisible_by

    @property
    def size(self) -> int:
        return self.tp * self.pp * self.cp

    def key(self, name: str) -> str:
        return (MEGATRON_KEYS if self.megatron else DTENSOR_KEYS)[name]

    @property
    def names(self) -> tuple[str, ...]:
        return ("tp", "pp", "cp") if self.megatron else ("tp", "cp")


def allowed(layout: Layout, model: ModelShape | None) -> bool:
    """The rules of checks.py a layout must also pass (other than the GPU count)."""
    if layout.megatron:
        factor = (2 * layout.cp if layout.cp > 1 else 1) * (layout.tp if layout.tp > 1 and layout.sequence_parallel else 1)
        if layout.divisible_by % factor:
            return False
    if model is not None:
        kv = model.num_key_value_heads
        if model.num_attention_heads % layout.tp or (kv % layout.tp and layout.tp % kv):
            return False
    return True


def fitting(layout: Layout, name: str, train_gpus: int, model: ModelShape | None) -> list[int]:
    """Values of one size that, with the others as set, make the training GPUs whole replicas."""
    others = layout.size // getattr(layout, name)
    if train_gpus % others:
        return []
    rest = train_gpus // others
    return [v for v in range(1, rest + 1) if rest % v == 0 and allowed(replace(layout, **{name: v}), model)]


def _listed(values: list[int]) -> str:
    return ", ".join(map(str, values[:-1])) + f" or {values[-1]}" if len(values) > 1 else str(values[0])


def node_counts(layout: Layout, nodes: int, gpus_per_node: int, generation_gpus: int) -> list[int]:
    """The node counts nearest below and above `nodes` whose training GPUs are whole replicas."""
    fits = [n for n in range(1, 4 * nodes + layout.size + 1)
            if n * gpus_per_node > generation_gpus and (n * gpus_per_node - generation_gpus) % layout.size == 0]
    below, above = [n for n in fits if n < nodes], [n for n in fits if n > nodes]
    return ([below[-1]] if below else []) + ([above[0]] if above else [])


def layout_findings(layout: Layout, train_gpus: int, model: ModelShape | None, changed: set[str],
                    nodes: int, gpus_per_node: int, generation_gpus: int) -> list[Finding]:
    """One error per size to change (module docstring)."""
    sizes = f"TP*PP*CP = {layout.tp}*{layout.pp}*{layout.cp} = {layout.size}"
    counts = node_counts(layout, nodes, gpus_per_node, generation_gpus) if allowed(layout, model) else []
    nodes_fix = f"; or run on {' or '.join(map(str, counts))} nodes with these sizes" if counts else ""
    named = [n for n in layout.names if layout.key(n) in changed] or [n for n in layout.names if fitting(layout, n, train_gpus, model)]
    out = []
    for name in named or [layout.names[0]]:
        values = fitting(layout, name, train_gpus, model)
        fix = (f"with the other sizes as set, {name.upper()} can be {_listed(values)}" if values
               else f"no {name.upper()} fits with the other sizes as set")
        out.append(Finding("error", layout.key(name), (
            f"{getattr(layout, name)}: {train_gpus} training GPUs are not a multiple of {sizes}: {fix} "
            f"({_rules(layout, train_gpus, model)}){nodes_fix}")))
    return out


def _rules(layout: Layout, train_gpus: int, model: ModelShape | None) -> str:
    rules = [f"whole replicas on {train_gpus} GPUs"]
    if layout.megatron:
        rules.append(f"make_sequence_length_divisible_by={layout.divisible_by} a multiple of 2*CP x TP")
    if model is not None:
        rules.append(f"TP dividing the {model.num_attention_heads} attention heads")
    return ", ".join(rules)
