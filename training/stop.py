"""SIGTERM / SIGUSR1 (what SLURM sends before the end of an allocation) ask the run to stop cleanly.

Imports nothing heavy, so that ``train.py`` installs the handler before importing torch: a
signal at any time of start-up (imports, data checks, process-group init, checkpoint
loading) leads to a clean stop rather than killing the job.
"""
from __future__ import annotations

import signal
from typing import Optional

SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class StopFlag:
    """Records the first stop signal received; ``restore()`` puts the previous handlers back."""

    def __init__(self):
        self.signal: Optional[str] = None
        self._previous = {sig: signal.signal(sig, self._handle) for sig in SIGNALS}

    def _handle(self, signum, frame) -> None:
        if self.signal is None:  # no printing here: a handler may interrupt a print in progress
            self.signal = signal.Signals(signum).name

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
