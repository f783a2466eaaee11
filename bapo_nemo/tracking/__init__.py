"""MLflow tracking for both runtimes (embedded trainer and NeMo-RL), and the experiment report.

- `mlflow_tracker.MlflowTracker`: one run, written through an fsync'd journal (`journal`), outage-proof;
  `store`: accepted tracking URIs; `tags`: reproducibility tags and the config hash.
- `nemo_rl`: NeMo-RL's MLflowLogger through the journal; a step is sent once a checkpoint covers it.
- `report` / `report_cli`: `bapo-nemo report`, the training-dynamics panels of several runs.
"""

from bapo_nemo.tracking.mlflow_tracker import MlflowTracker
from bapo_nemo.tracking.store import TrackingConfigError, TrackingUnavailableError, check_tracking_uri
from bapo_nemo.tracking.tags import config_hash, default_tags

__all__ = ["MlflowTracker", "TrackingConfigError", "TrackingUnavailableError", "check_tracking_uri",
           "config_hash", "default_tags"]
