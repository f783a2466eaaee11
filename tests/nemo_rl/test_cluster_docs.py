"""docs/cluster.md's table of the hub datasets NeMo-RL loads, read back from the installed NeMo-RL's own
dataset classes (the rest of the doc's figures: tests/unit/test_cluster_docs.py)."""

from __future__ import annotations

from bapo_nemo.plan.rules.hub_assets import DATASETS


def test_hub_assets_are_what_nemo_rl_loads():
    """Our table of NeMo-RL's datasets is read back from v0.7.0's own classes: each is built with
    `load_dataset` replaced by a recorder (the hub is the boundary this machine cannot reach)."""
    from tests.support.nemo_rl_source import run_with_nemo_rl

    recorded = run_with_nemo_rl(
        "from nemo_rl.data.datasets import response_datasets\nimport datasets",
        f"""
        import nemo_rl.data.datasets.response_datasets.aime as aime
        import nemo_rl.data.datasets.response_datasets.dapo_math as dapo_math
        calls = []
        row = {{"problem": "p", "question": "q", "answer": "1", "prompt": [{{"role": "user", "content": "c"}}],
               "reward_model": {{"ground_truth": "1"}}}}
        def recording_load_dataset(path, name=None, split=None, **kwargs):
            calls.append([path, name, split])
            return datasets.Dataset.from_list([row])
        aime.load_dataset = dapo_math.load_dataset = recording_load_dataset
        out = {{}}
        for dataset_name in {sorted(DATASETS)!r}:
            calls.clear()
            response_datasets.DATASET_REGISTRY[dataset_name]()
            out[dataset_name] = list(calls)
        print(json.dumps(out))
        """,
    )
    assert recorded == {name: [list(call) for call in calls] for name, calls in DATASETS.items()}
