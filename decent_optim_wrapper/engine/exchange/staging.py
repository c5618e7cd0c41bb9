r"""Host-staged rounds: a device bucket's payload crosses a gloo group through pinned host buffers.

gloo moves host memory. For a bucket on a GPU, a round launched at step ``t`` goes:

1. **copy out** -- on a side stream that first waits for what the compute stream has queued (the
   local step that wrote the bucket, and the staging that scaled or encoded it), the payload is
   copied into a pinned host buffer kept per bucket (``non_blocking``: the host does not wait);
2. **launch** -- a launcher thread waits for that copy (polling its event), then starts the gloo
   collective on the host buffers;
3. **copy back** -- when the round is waited for, the received host buffer is copied into the
   device buffer on the compute stream, which the mix then reads (stream order: no host sync).

The training thread never synchronizes with the device: it queues the copy and returns, and the copy
and the network overlap the next forward and backward as the gossip itself does. Waiting for a round
blocks the training thread until the bytes have arrived (as on CPU), not until the GPU is idle.

**Order.** Collectives on one process group must start in the same order on every member. Every
staged round goes through the one launcher thread in the order the training thread launched it, so
the order is that of the unstaged path. A collective the training thread issues itself (global
averaging, pace messages) never shares a group with staged rounds (the engine gives gossip groups of
their own when it stages, :class:`~decent_optim_wrapper.engine.fleet.comm.ProcessGroups`).

**One host buffer per bucket is enough.** The copy out of round ``t + 1`` is queued only after round
``t`` was mixed, i.e. after its collective completed and its copy back was queued on the compute
stream; the side stream waits for the compute stream before copying, so the next copy into a host
buffer never overtakes the previous copy out of it, and no collective still reads it. (A second
buffer would let the copy out of ``t + 1`` start before round ``t`` is mixed, which no front-end's
step order needs.)

On CPU tensors (``host_staging=True``, for tests and for comparison) the same path runs with plain
host buffers and synchronous copies; it is bitwise equal to the direct path: the collective sums the
same values in the same order, only from other memory.
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, cast

import torch
import torch.distributed as dist

__all__ = ["HostStaging", "StagedWork", "host_buffer"]

#: Polling the copy's event: first pause and longest pause, in seconds. A device-to-host copy of a
#: bucket takes about a millisecond per 25 MB at PCIe rates, so the launch lags the copy by at most
#: about 10% of it; ``Event.synchronize`` would block without polling, but counts as a host sync
#: under ``torch.cuda.set_sync_debug_mode``.
_FIRST_PAUSE_S, _LONGEST_PAUSE_S = 2e-5, 5e-4


def host_buffer(like: torch.Tensor) -> torch.Tensor:
    """An uninitialized host tensor shaped like ``like``: pinned when ``like`` lives on an accelerator
    (asynchronous copies need page-locked memory), plain for CPU tensors."""
    pinned = like.device.type != "cpu"
    return torch.empty(like.shape, dtype=like.dtype, device="cpu", pin_memory=pinned)


class StagedWork:
    """A staged round, waited for like a ``torch.distributed.Work``.

    ``wait`` returns once the collective has completed and its result has been queued for the copy
    back (``False`` if ``timeout`` passed first); ``is_completed`` does not block.
    """

    def __init__(self, copy_back: Callable[[], None] | None) -> None:
        self._launched = threading.Event()
        self._work: dist.Work | None = None
        self._error: BaseException | None = None
        self._copy_back = copy_back

    # -- the launcher's side --------------------------------------------------------------------------
    def _started(self, work: dist.Work | None, error: BaseException | None) -> None:
        self._work, self._error = work, error
        self._launched.set()

    # -- the training thread's side --------------------------------------------------------------------
    def is_completed(self) -> bool:
        if not self._launched.is_set():
            return False
        if self._error is not None:
            return True  # wait() raises it
        assert self._work is not None
        return bool(self._work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the launch and the collective (each within ``timeout``), then queue the copy back.

        Raises:
            RuntimeError: the launch or the collective failed (e.g. a peer was lost).
        """
        if not self._launched.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self._error is not None:
            raise RuntimeError(f"the staged round could not start: {self._error}") from self._error
        assert self._work is not None
        done = self._work.wait(timeout) if timeout is not None else self._work.wait()
        if done is False:
            return False
        if self._copy_back is not None:
            copy_back, self._copy_back = self._copy_back, None  # once, however often it is waited for
            copy_back()
        return True


class HostStaging:
    """Copies payloads between a device and pinned host buffers, and launches their collectives in order.

    One per engine (its gossip, trackers and anchors share it, so that their rounds keep the order
    they were launched in). The launcher thread starts lazily and is a daemon: it holds no state
    a process needs at exit.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Any, Callable[[], dist.Work | None], StagedWork] | None] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()

    def start(
        self,
        copies_out: list[tuple[torch.Tensor, torch.Tensor]],
        launch: Callable[[], dist.Work | None],
        copy_back: tuple[torch.Tensor, torch.Tensor] | None,
    ) -> dist.Work:
        """Copy each ``(host, device)`` pair of ``copies_out`` to the host, then ``launch()`` the collective
        on the host buffers from the launcher thread; ``copy_back`` ``(device, host)`` is copied when
        the round is waited for.

        ``launch`` runs on the launcher thread, after the copies, in the order ``start`` was called.
        Returns a :class:`StagedWork`, typed as the ``Work`` it stands in for (``is_completed``, ``wait``).
        """
        device = copies_out[0][1].device
        ready: Any = None
        if device.type == "cpu":
            for host, source in copies_out:
                host.copy_(source)
        else:
            ready = self._copy_out_async(device, copies_out)
        back = None
        if copy_back is not None:
            target, received = copy_back

            def back() -> None:
                target.copy_(received, non_blocking=target.device.type != "cpu")

        work = StagedWork(back)
        self._ensure_thread()
        self._queue.put((ready, launch, work))
        return cast(dist.Work, work)

    def _copy_out_async(
        self, device: torch.device, copies_out: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> Any:
        """Queue the device-to-host copies on the device's side stream after the compute stream's work;
        returns the event that marks them done."""
        module = getattr(torch, device.type)  # torch.cuda (or another accelerator with streams)
        side = self._streams.get(device)
        if side is None:
            side = self._streams[device] = module.Stream(device=device)
        side.wait_stream(module.current_stream(device))
        with module.stream(side):
            for host, source in copies_out:
                host.copy_(source, non_blocking=True)
                # The caching allocator may hand the source's memory to the compute stream once it is
                # freed; it must not be reused before the side stream has read it.
                source.record_stream(side)
            ready = module.Event()
            ready.record(side)
        return ready

    def drain(self, timeout: timedelta) -> None:
        """Return once every round started so far has been launched (the launcher's queue is empty)."""
        marker = StagedWork(None)
        self._ensure_thread()
        self._queue.put((None, lambda: cast(dist.Work, _NoWork()), marker))
        if not marker._launched.wait(timeout.total_seconds()):
            raise RuntimeError(f"staged rounds were not launched within {timeout}: a device copy is stuck.")

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=_launcher, args=(self._queue,), name="decent-optim-wrapper-staging", daemon=True
                )
                self._thread.start()

    def close(self) -> None:
        """Stop the launcher thread once it has launched what it was given."""
        with self._lock:
            if self._thread is not None and self._thread.is_alive():
                self._queue.put(None)
            self._thread = None

    def __del__(self) -> None:
        # At interpreter shutdown this may fail; the daemon thread ends with the process anyway.
        with contextlib.suppress(Exception):
            self.close()


class _NoWork:
    """A completed work (what :meth:`HostStaging.drain`'s marker launches)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def _launcher(jobs: queue.SimpleQueue[tuple[Any, Callable[[], dist.Work | None], StagedWork] | None]) -> None:
    """Launch each job's collective once its copy to the host is done, in the order given."""
    while True:
        job = jobs.get()
        if job is None:
            return
        ready, launch, work = job
        try:
            if ready is not None:
                pause = _FIRST_PAUSE_S
                while not ready.query():
                    time.sleep(pause)
                    pause = min(2 * pause, _LONGEST_PAUSE_S)
            started = launch()
            if started is None:
                raise RuntimeError("the collective returned no work to wait for (async_op must be True)")
        except BaseException as err:  # handed to the training thread, which waits for this round
            work._started(None, err)
        else:
            work._started(started, None)
