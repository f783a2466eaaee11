"""MLflow tracking for both runtimes (embedded trainer and NeMo-RL), and the experiment report.

- `mlflow_tracker.MlflowTracker`: one run, written through an fsync'd local journal (`journal.Journal`), outage-proof;
  `store`: which tracking URIs are accepted, a sqlite store's file and creation lock, a server's HTTP settings.
- `tags.default_tags` / `tags.config_hash`: reproducibility tags (git, config hash, image, Slurm, host).
- `nemo_rl.prepare_logger_config` / `nemo_rl.after_setup` / `nemo_rl.finish_nemo_tracking`: NeMo-RL's
  MLflowLogger through the journal; a step is sent once a checkpoint covers it.
- `report` / `report_cli`: `bapo-nemo report`, the training-dynamics panels of several runs.
"""

from bapo_nemo.tracking.mlflow_tracker import MlflowTracker
from bapo_nemo.tracking.store import TrackingConfigError, TrackingUnavailableError, check_tracking_uri
from bapo_nemo.tracking.tags import config_hash, default_tags

__all__ = ["MlflowTracker", "TrackingConfigError", "TrackingUnavailableError", "check_tracking_uri",
           "config_hash", "default_tags"]
