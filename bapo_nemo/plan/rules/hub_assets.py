"""What a NeMo-RL config downloads from the Hugging Face Hub when its job starts (the policy's weights and
tokenizer, the datasets), and their pre-fetch into HF_HOME for compute nodes that cannot reach the hub
(docs/cluster.md, "Hub access"): `python -m bapo_nemo.plan.rules.hub_assets CONFIG [--dry-run]`.
Datasets are fetched with the very `datasets.load_dataset` call NeMo-RL v0.7.0 makes, so an offline job
(HF_HUB_OFFLINE=1) finds the files and the prepared dataset; models with `snapshot_download`.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass
from pathlib import Path

from bapo_nemo.plan.rules.config_io import ConfigLoadError, get, load_nemo_config

# NeMo-RL v0.7.0's `data.*.dataset_name` -> the load_dataset(repo, name, split=...) calls of its class
# (nemo_rl/data/datasets/response_datasets/dapo_math.py and aime.py).
DATASETS: dict[str, list[tuple[str, str | None, str]]] = {
    "DAPOMath17K": [("BytedTsinghua-SIA/DAPO-Math-17k", None, "train")],
    "DAPOMathAIME2024": [("BytedTsinghua-SIA/AIME-2024", None, "train")],
    "AIME2024": [("HuggingFaceH4/aime_2024", None, "train")],
    "AIME2025": [("opencompass/AIME2025", "AIME2025-I", "test"), ("opencompass/AIME2025", "AIME2025-II", "test")],
}


@dataclass(frozen=True)
class HubAsset:
    kind: str  # "model" or "dataset"
    repo_id: str
    name: str | None = None  # dataset config
    split: str | None = None

    def __str__(self) -> str:
        detail = "".join(f" {k}={v}" for k, v in (("name", self.name), ("split", self.split)) if v)
        return f"{self.kind} {self.repo_id}{detail}"


def hub_assets(config: dict) -> tuple[list[HubAsset], list[str]]:
    """(what the config loads from the hub, dataset names this module does not know: fetch those yourself)."""
    assets: list[HubAsset] = []
    for key in ("policy.model_name", "policy.tokenizer.name"):
        repo = get(config, key)
        if isinstance(repo, str) and not Path(repo).exists() and HubAsset("model", repo) not in assets:
            assets.append(HubAsset("model", repo))
    validation = get(config, "data.validation") or []
    names = [get(config, "data.train.dataset_name"), *(v.get("dataset_name") for v in validation)]
    unknown = []
    for name in filter(None, names):
        if name not in DATASETS:
            unknown.append(name)
            continue
        for repo, subset, split in DATASETS[name]:
            asset = HubAsset("dataset", repo, subset, split)
            if asset not in assets:
                assets.append(asset)
    return assets, unknown


def fetch(asset: HubAsset) -> None:
    if asset.kind == "model":
        from huggingface_hub import snapshot_download

        snapshot_download(repo_id=asset.repo_id)
    else:
        from datasets import load_dataset

        load_dataset(asset.repo_id, asset.name, split=asset.split)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bapo_nemo.plan.rules.hub_assets",
        description="Download what a NeMo-RL config loads from the Hugging Face Hub into HF_HOME, so that "
        "compute nodes without hub access can run it with HF_HUB_OFFLINE=1.",
        epilog="example: HF_HOME=/shared/hf_cache python -m bapo_nemo.plan.rules.hub_assets configs/bapo_32b.yaml",
    )
    parser.add_argument("config", help="NeMo-RL config YAML (e.g. configs/bapo_32b.yaml)")
    parser.add_argument("--dry-run", action="store_true", help="list what would be fetched, fetch nothing")
    args = parser.parse_args(argv)
    try:
        assets, unknown = hub_assets(load_nemo_config(args.config))
    except ConfigLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    cache = os.environ.get("HF_HOME") or "~/.cache/huggingface (HF_HOME is not set: the job must see it)"
    print(f"{'would fetch' if args.dry_run else 'fetching'} into {cache}:")
    for asset in assets:
        print(f"  {asset}", flush=True)
        if not args.dry_run:
            fetch(asset)
    for name in unknown:
        print(f"  not known here: dataset {name!r}: fetch what it loads yourself", file=sys.stderr)
    if not args.dry_run:
        print("done: submit with HF_HUB_OFFLINE=1 HF_HOME=... so compute nodes read only this cache")
    return 0


if __name__ == "__main__":
    sys.exit(main())
