"""Data paths in a NeMo-RL config are checked where NeMo-RL will open them: relative prompt files against
the job's working directory (v0.7.0's `TaskDataSpec.__post_init__` raises FileNotFoundError for a missing
one right after `init_ray()`), absolute ones as they are."""

from __future__ import annotations

from bapo_nemo.plan.registry import check_config
from tests.support.nemo_rl_source import run_with_nemo_rl


def test_the_rule_agrees_with_nemo_rl_task_data_spec(tmp_path):
    """For each path, NeMo-RL v0.7.0's own TaskDataSpec (run in `tmp_path` as working directory) raises
    exactly when our rule reports an error."""
    (tmp_path / "here.txt").write_text("Q: {}")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "p.txt").write_text("{}")
    paths = ["here.txt", "sub/p.txt", "missing.txt", "sub/missing.txt", str(tmp_path / "here.txt"),
             str(tmp_path / "gone.txt")]
    raised = run_with_nemo_rl(
        "from nemo_rl.data.interfaces import TaskDataSpec",
        f"""
        out = {{}}
        for path in {paths!r}:
            try:
                TaskDataSpec(task_name="t", prompt_file=path)
                out[path] = False
            except FileNotFoundError:
                out[path] = True
        print(json.dumps(out))
        """,
        cwd=tmp_path,
    )
    for path in paths:
        config = {"data": {"default": {"prompt_file": path}}}
        findings = check_config(config, None, None, check_paths=True, workdir=tmp_path)
        ours = any(f.level == "error" and f.key == "data.default.prompt_file" for f in findings)
        assert ours == raised[path], (path, ours, raised[path])
    assert raised == {p: ("missing" in p or "gone" in p) for p in paths}
