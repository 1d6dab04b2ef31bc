"""Ordering across streams for calls that share scratch memory (an executor's buckets, a workspace).

Calls on one stream are ordered by the stream. A call on another stream than the last one that used the
scratch first makes its stream wait, on the GPU, for everything enqueued on that last stream so far (an
event recorded there now), and the host side of calls is serialized by a lock: two threads calling the
same prepared weights on two streams get the single-stream results, and the common case (one stream)
costs a lock and a pointer comparison. Inside a CUDA-graph capture nothing is waited on or remembered:
the capture orders its own work, and torch.cuda.graph synchronizes the device before it starts.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from ..capture import capturing


class StreamOrder:
    """The ordering of one piece of shared scratch on one device (see the module docstring)."""

    def __init__(self, device: torch.device) -> None:
        self.index = device.index if device.index is not None else torch.cuda.current_device()
        self._lock = threading.RLock()
        self._last: int | None = None  # raw handle of the stream of the last eager call
        self._last_stream: torch.cuda.Stream | None = None
        self._event: torch.cuda.Event | None = None

    @contextlib.contextmanager
    def use(self) -> Iterator[None]:
        """Hold the scratch for one call on torch's current stream (reentrant)."""
        with self._lock:
            stream = torch._C._cuda_getCurrentRawStream(self.index)
            if stream != self._last and not capturing():
                current = torch.cuda.current_stream(self.index)
                if self._last_stream is not None:
                    if self._event is None:
                        self._event = torch.cuda.Event()
                    self._event.record(self._last_stream)
                    current.wait_event(self._event)
                self._last, self._last_stream = stream, current
            yield
