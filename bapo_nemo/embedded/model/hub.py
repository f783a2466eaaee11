"""Whether the Hugging Face hub can be reached, asked once with a short timeout: a hub id that cannot be
downloaded should fail in seconds with the ways to run offline, not after a minute of retries."""

from __future__ import annotations

import os
import socket
import threading
from urllib.parse import urlparse

PROBE_TIMEOUT_S = 3.0
BUNDLED_MODEL_HINT = "smollm2-135m-instruct"


def hub_offline_by_setting() -> bool:
    """HF_HUB_OFFLINE (or TRANSFORMERS_OFFLINE) set to a true value: the user asked for no network."""
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def hub_reachable(timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """One TCP connection to the hub's endpoint (HF_ENDPOINT, else huggingface.co) within `timeout_s`,
    name resolution included (run in a thread: getaddrinfo ignores socket timeouts)."""
    from huggingface_hub import constants

    url = urlparse(constants.ENDPOINT)
    port = url.port or (443 if url.scheme == "https" else 80)
    outcome: list[bool] = []

    def connect() -> None:
        try:
            socket.create_connection((url.hostname, port), timeout=timeout_s).close()
            outcome.append(True)
        except OSError:
            outcome.append(False)

    probe = threading.Thread(target=connect, daemon=True)
    probe.start()
    probe.join(timeout_s + 0.5)
    return bool(outcome and outcome[0])


def offline_fix(name: str) -> str:
    """The ways to run without the hub, for a hub id `name` that could not be loaded."""
    return (f"to run offline, use the bundled pretrained model (policy.model_name={BUNDLED_MODEL_HINT}), a local "
            f"directory written by save_pretrained (policy.model_name=path/to/model), or HF_HUB_OFFLINE=1 with "
            f"{name} already in the Hugging Face cache")
