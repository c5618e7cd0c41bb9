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

__all__ = ["HostStaging", "HostStagingError", "StagedWork", "host_buffer"]

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


class HostStagingError(Exception):
    """This rank could not launch a staged round: its copy to the host did not complete in time, or the
    collective could not start. A local failure, not a lost peer (so not a ``RuntimeError``, which
    the waits turn into one): it reaches the training loop as it is."""


#: A staged round for the launcher: the copy's event (None: copied already), the device to poll it
#: on, the collective to start, and the work that reports it.
_Job = tuple[Any, "torch.device | None", Callable[[], "dist.Work | None"], "StagedWork"]


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
    def started(self, work: dist.Work | None, error: BaseException | None) -> None:
        """The launcher started the collective (``work``) or could not (``error``)."""
        self._work, self._error = work, error
        self._launched.set()

    def wait_launched(self, timeout: timedelta) -> bool:
        """Wait until the launcher took this round (launched or failed); False if ``timeout`` passed."""
        return self._launched.wait(timeout.total_seconds())

    # -- the training thread's side --------------------------------------------------------------------
    def is_completed(self) -> bool:
        if not self._launched.is_set():
            return False
        if self._error is not None:
            return True  # wait() raises it
        assert self._work is not None
        return bool(self._work.is_completed())

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the launch and the collective (both within ``timeout``), then queue the copy back.

        Raises:
            HostStagingError: this rank could not launch the round.
            RuntimeError: the collective failed (e.g. a peer was lost).
        """
        deadline = None if timeout is None else time.monotonic() + timeout.total_seconds()
        if not self._launched.wait(None if timeout is None else timeout.total_seconds()):
            return False
        if self._error is not None:
            if isinstance(self._error, HostStagingError):
                raise self._error
            raise HostStagingError(f"the staged round could not start: {self._error}") from self._error
        assert self._work is not None
        if deadline is None:
            done = self._work.wait()
        else:
            done = self._work.wait(timedelta(seconds=max(0.0, deadline - time.monotonic())))
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
    a process needs at exit. A copy to the host that does not complete within ``timeout`` fails its
    round (and every round after it) with :class:`HostStagingError`.
    """

    def __init__(self, timeout: timedelta | None = None) -> None:
        self._queue: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._streams: dict[torch.device, Any] = {}
        self._lock = threading.Lock()
        self._copy_timeout_s = None if timeout is None else timeout.total_seconds()

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
        self._queue.put((ready, None if ready is None else device, launch, work))
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
        """Return once every round started so far has been launched (the launcher's queue is empty).

        Called before the process groups change (a recovery, a join): no launch may then reach a
        group that is being shut down.
        """
        marker = StagedWork(None)
        self._ensure_thread()
        self._queue.put((None, None, lambda: cast(dist.Work, _NoWork()), marker))
        if not marker.wait_launched(timeout):
            raise HostStagingError(
                f"staged rounds were not launched within {timeout}: a copy to the host is stuck."
            )

    def _ensure_thread(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=_launcher,
                    args=(self._queue, self._copy_timeout_s),
                    name="decent-optim-wrapper-staging",
                    daemon=True,
                )
                self._thread.start()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the launcher thread once it has launched what it was given (waiting ``timeout_s``)."""
        with self._lock:
            thread, self._thread = self._thread, None
            if thread is None or not thread.is_alive():
                return
            self._queue.put(None)
        if thread is not threading.current_thread():
            thread.join(timeout_s)

    def __del__(self) -> None:
        # At interpreter shutdown this may fail; the daemon thread ends with the process anyway.
        with contextlib.suppress(Exception):
            self.close(timeout_s=0.0)


class _NoWork:
    """A completed work (what :meth:`HostStaging.drain`'s marker launches)."""

    def is_completed(self) -> bool:
        return True

    def wait(self, timeout: timedelta | None = None) -> bool:
        return True


def _launcher(jobs: queue.SimpleQueue[_Job | None], copy_timeout_s: float | None) -> None:
    """Launch each job's collective once its copy to the host is done, in the order given."""
    stuck: HostStagingError | None = None  # once a copy is stuck, every later round fails too
    while True:
        job = jobs.get()
        if job is None:
            return
        stuck = _launch_one(job, copy_timeout_s, stuck)
        # Nothing of the job outlives its launch here: its collective holds the process group, which
        # a recovery retires and must be able to release.
        del job


def _launch_one(
    job: _Job, copy_timeout_s: float | None, stuck: HostStagingError | None
) -> HostStagingError | None:
    """Launch one job; returns the error that fails every later job (a copy that got stuck), if any."""
    ready, device, launch, work = job
    if stuck is not None:
        work.started(None, stuck)
        return stuck
    if ready is not None:
        try:
            _wait_for_copy(ready, device, copy_timeout_s)
        except HostStagingError as err:
            work.started(None, err)
            return err
    try:
        started = launch()
        if started is None:
            raise HostStagingError("the collective returned no work to wait for (async_op must be True)")
    except BaseException as err:  # handed to the training thread, which waits for this round
        work.started(None, err)
    else:
        work.started(started, None)
    return None


def _wait_for_copy(ready: Any, device: torch.device | None, timeout_s: float | None) -> None:
    """Poll the copy's event (a blocking ``Event.synchronize`` would count as a host sync under
    ``torch.cuda.set_sync_debug_mode``), on the copy's device (a fresh thread's first CUDA call would
    otherwise make a context on device 0)."""
    if device is not None and device.type == "cuda" and torch.cuda.current_device() != device.index:
        torch.cuda.set_device(device)
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    pause = _FIRST_PAUSE_S
    while not ready.query():
        if deadline is not None and time.monotonic() > deadline:
            raise HostStagingError(
                f"a copy to the host did not complete within {timeout_s:.0f} s: the device is stuck or "
                "far behind; this rank stops gossiping (restart it, or check the GPU)."
            )
        time.sleep(pause)
        pause = min(2 * pause, _LONGEST_PAUSE_S)
