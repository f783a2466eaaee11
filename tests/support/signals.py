"""A clean SIGUSR1 state around each stop-signal test: the handler and the stop module's flags as before."""

from __future__ import annotations

import signal

import pytest

from bapo_nemo.nemo import stop_signal


@pytest.fixture
def fresh_signal_state():
    previous = signal.getsignal(signal.SIGUSR1)
    stop_signal._requested.clear()
    stop_signal._early_stop.clear()
    yield
    stop_signal._requested.clear()
    stop_signal._early_stop.clear()
    signal.signal(signal.SIGUSR1, previous)
