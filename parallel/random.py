"""Dropout randomness under tensor parallelism (Megatron's RNG tracker, SPEC §2).

Two streams:

* ``default`` -- the device's default generator, seeded identically on every TP
  rank of a stage, for dropout on activations that are replicated across TP
  (embedding and residual dropout without sequence parallelism): masks agree.
* ``tp`` -- a per-TP-rank stream, used inside ``tracker.fork()``, for dropout on
  activations that are split across TP (attention probabilities, whose heads are
  split; residual dropout under sequence parallelism, whose sequence is split).

``fork()`` swaps the tp state into the default generator for the region and
back out afterwards, so ordinary ops (SDPA's dropout, F.dropout) draw from it.
torch's activation checkpointing restores the default generator before
recomputing; ``checkpoint_contexts`` additionally restores the tp stream, so the
recomputed forward replays exactly the same masks.
"""
from __future__ import annotations

import contextlib
import hashlib
from typing import Dict, Iterator, Tuple

import torch


def derive_seed(*parts) -> int:
    """A stable 63-bit seed from any printable parts (Python's hash() is salted per process)."""
    digest = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class RNGTracker:
    def __init__(self, device: torch.device, seed: int, pp_rank: int, dp_rank: int, tp_rank: int):
        self.device = device
        torch.manual_seed(derive_seed(seed, "dropout", pp_rank, dp_rank))
        saved = self._get()
        torch.manual_seed(derive_seed(seed, "dropout-tp", pp_rank, dp_rank, tp_rank))
        self.tp_state = self._get()
        self._set(saved)

    def _get(self) -> torch.Tensor:
        if self.device.type == "cuda":
            return torch.cuda.get_rng_state(self.device)
        return torch.get_rng_state()

    def _set(self, state: torch.Tensor) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_rng_state(state, self.device)
        else:
            torch.set_rng_state(state)

    @contextlib.contextmanager
    def fork(self) -> Iterator[None]:
        """Run the region with the per-TP-rank stream."""
        saved = self._get()
        self._set(self.tp_state)
        try:
            yield
        finally:
            self.tp_state = self._get()
            self._set(saved)

    def checkpoint_contexts(self) -> Tuple[contextlib.AbstractContextManager, contextlib.AbstractContextManager]:
        """``context_fn`` for torch.utils.checkpoint: the recompute sees the tp stream as the forward did."""
        snapshot = self.tp_state.clone()

        @contextlib.contextmanager
        def recompute() -> Iterator[None]:
            current = self.tp_state
            self.tp_state = snapshot.clone()
            try:
                yield
            finally:
                self.tp_state = current

        return contextlib.nullcontext(), recompute()

    def state_dict(self) -> Dict[str, torch.Tensor]:
        return {"default": self._get(), "tp": self.tp_state.clone(), "cpu": torch.get_rng_state()}

    def load_state_dict(self, state: Dict[str, torch.Tensor]) -> bool:
        """Restore the streams; False (the dropout streams keep this run's seeding) when they were saved by
        another kind of device: a CUDA generator's state (16 bytes, Philox) means nothing to the CPU's
        (Mersenne Twister, 5056 bytes) and the other way round, so a GPU checkpoint resumed on CPU continues
        with fresh, still per-rank-distinct dropout streams. The CPU stream is restored either way."""
        torch.set_rng_state(state["cpu"])
        if state["default"].numel() != self._get().numel() or state["tp"].numel() != self.tp_state.numel():
            return False
        self._set(state["default"])
        self.tp_state = state["tp"].clone()
        return True
