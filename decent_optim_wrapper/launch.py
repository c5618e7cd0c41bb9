"""Start ``torch.distributed`` the same way under ``torchrun`` and under plain ``python``.

:func:`initialize_dist` reads the variables torchrun sets (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), checks that they agree with each other and
with the host's GPUs before any rendezvous (a bad variable fails at once, not as a hang), and
initializes the default process group: NCCL with one GPU per process on GPU hosts, gloo otherwise.
Without those variables the process is a world of one, so the same script runs unchanged on a
laptop.

:func:`init_elastic` (or ``initialize_dist(elastic=True)``) starts a job that workers may join while
it runs: the workers that start together form the default group as usual; a worker started later
with the same command finds the job running in the store, and its front-end (built with
``on_peer_failure="continue"``) joins it (:mod:`~decent_optim_wrapper.engine.fleet.admission`). With
``shards=k`` each node's ``k`` processes form the default group and shard a replica over it
(:func:`node_mesh`), and the engine gossips along the job's replicas over groups of its own
(:mod:`~decent_optim_wrapper.engine.fleet.replicas`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, Store, TCPStore  # type: ignore[attr-defined]
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from decent_optim_wrapper.checks import is_int
from decent_optim_wrapper.engine.fleet.jobs import JoinRejectedError, current_job, enter_job, job_running
from decent_optim_wrapper.engine.fleet.replicas import ReplicaWorld, form_group
from decent_optim_wrapper.engine.fleet.sealing import Seal, resolve_secret

__all__ = ["init_elastic", "initialize_dist", "node_mesh", "plan_node_backend"]


@dataclass(frozen=True)
class LaunchPlan:
    """How to join the process group, as read from the environment."""

    backend: str
    rank: int
    world_size: int
    device_index: int | None
    """The CUDA device this process uses (NCCL only)."""
    rendezvous: bool
    """``True``: ``env://`` (``MASTER_ADDR``/``MASTER_PORT``); ``False``: an in-process store."""


def _int_var(env: Mapping[str, str], name: str, least: int) -> int | None:
    raw = env.get(name)
    if raw is None:
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer; set it to an integer >= {least}.") from None
    if value < least:
        raise ValueError(f"{name}={value} must be >= {least}; fix the launcher's {name}.")
    return value


def plan_launch(env: Mapping[str, str], cuda_device_count: int) -> LaunchPlan:
    """Check the torchrun variables in ``env`` and say how to initialize; pure, initializes nothing.

    Args:
        env: The environment, e.g. ``os.environ``.
        cuda_device_count: GPUs this process sees; 0 means gloo.

    Returns:
        The backend, rank, world size, CUDA device and whether to rendezvous.

    Raises:
        ValueError: The variables are not integers or contradict each other or the GPUs; the message
            names the variable, its value and the fix.
    """
    rank = _int_var(env, "RANK", 0)
    world_size = _int_var(env, "WORLD_SIZE", 1)
    local_rank = _int_var(env, "LOCAL_RANK", 0)
    local_world_size = _int_var(env, "LOCAL_WORLD_SIZE", 1)
    if (rank is None) != (world_size is None):
        have, missing = ("RANK", "WORLD_SIZE") if world_size is None else ("WORLD_SIZE", "RANK")
        raise ValueError(
            f"{have}={env[have]} is set but {missing} is not; launch with torchrun, or set both "
            "(with MASTER_ADDR and MASTER_PORT), or neither for a world of one."
        )
    if rank is None or world_size is None:
        rank, world_size = 0, 1
    if rank >= world_size:
        raise ValueError(f"RANK={rank} must be < WORLD_SIZE={world_size}; ranks run from 0 to WORLD_SIZE-1.")
    if local_world_size is not None:
        if local_world_size > world_size:
            raise ValueError(
                f"LOCAL_WORLD_SIZE={local_world_size} exceeds WORLD_SIZE={world_size}; it counts the "
                "processes on this node, a part of the world."
            )
        if local_rank is not None and local_rank >= local_world_size:
            raise ValueError(
                f"LOCAL_RANK={local_rank} must be < LOCAL_WORLD_SIZE={local_world_size}; local ranks run "
                "from 0 to LOCAL_WORLD_SIZE-1."
            )
    rendezvous = world_size > 1  # a world of one needs no peers, hence no address or port
    if rendezvous:
        for name in ("MASTER_ADDR", "MASTER_PORT"):
            if not env.get(name):
                raise ValueError(
                    f"{name} is not set but WORLD_SIZE={world_size}; set MASTER_ADDR and MASTER_PORT to "
                    "rank 0's address and a free port (torchrun sets them)."
                )
        _int_var(env, "MASTER_PORT", 1)

    if cuda_device_count == 0:
        return LaunchPlan("gloo", rank, world_size, None, rendezvous)
    if local_rank is None:
        if world_size > 1:
            raise ValueError(
                f"LOCAL_RANK is not set but WORLD_SIZE={world_size} on a host with {cuda_device_count} "
                "GPU(s); set LOCAL_RANK to this process's index on the node (torchrun sets it), "
                "which picks its GPU."
            )
        local_rank = 0
    # Check the node's process count too: otherwise the ranks with a GPU would wait forever for
    # the ones that failed.
    for name, needed in (("LOCAL_RANK", local_rank + 1), ("LOCAL_WORLD_SIZE", local_world_size or 0)):
        if needed > cuda_device_count:
            raise ValueError(
                f"{name}={env.get(name, '0')} needs {needed} GPUs but this process sees "
                f"{cuda_device_count}; one process per GPU: start at most {cuda_device_count} per node "
                "(torchrun --nproc-per-node), or check CUDA_VISIBLE_DEVICES."
            )
    return LaunchPlan("nccl", rank, world_size, local_rank, rendezvous)


def plan_node_backend(
    backend: object, shards: int | None, env: Mapping[str, str], cuda_device_count: int
) -> tuple[str, int | None]:
    """The backend of a node's group in :func:`init_elastic` and the CUDA device this process takes;
    pure, initializes nothing.

    With ``shards=k`` the node's processes form the default group: NCCL when they hold GPUs (one per
    process, ``LOCAL_RANK``, default: the process's index in the node), else gloo; ``backend`` chooses.
    With one process per node (``shards=None``) the default group is the job's, which survival and
    joins re-form on gloo: only gloo is accepted there (the model may still live on a GPU).

    Raises:
        ValueError: an unknown backend, NCCL without GPUs or without ``shards``, or a ``LOCAL_RANK``
            beyond the GPUs; the message names the value and the fix.
    """
    if backend not in (None, "gloo", "nccl"):
        raise ValueError(f'backend must be None (follow the device), "gloo" or "nccl", got {backend!r}.')
    if shards is None:
        if backend == "nccl":
            raise ValueError(
                'backend="nccl" names the backend of a node\'s group, which init_elastic forms with '
                "shards=k; with one process per node the default group is the job's, and survival and "
                "joins re-form it on gloo. Pass shards=k (NCCL inside the node, gloo between nodes), or "
                "backend=None: the model may live on a GPU either way."
            )
        return "gloo", None
    if backend is None:
        backend = "nccl" if cuda_device_count > 0 else "gloo"
    if backend == "gloo":
        return "gloo", None
    if cuda_device_count == 0:
        raise ValueError(
            'backend="nccl" needs a GPU per process, but this process sees none; pass backend="gloo" '
            "(or None) on CPU nodes, or check CUDA_VISIBLE_DEVICES."
        )
    local_rank = _int_var(env, "LOCAL_RANK", 0)
    device = local_rank if local_rank is not None else 0
    if device >= cuda_device_count:
        raise ValueError(
            f"LOCAL_RANK={device} needs {device + 1} GPUs but this process sees {cuda_device_count}; one "
            "process per GPU: start at most that many per node, or check CUDA_VISIBLE_DEVICES."
        )
    return "nccl", device


def init_elastic(
    store: Store,
    rank: int,
    world_size: int,
    *,
    job: str | None = None,
    timeout: timedelta = timedelta(minutes=10),
    shards: int | None = None,
    backend: str | None = None,
    secret: str | bytes | None = None,
) -> bool:
    """Start a worker of a job that grows and shrinks: form the default group, or prepare to join.

    If no live job named ``job`` is in ``store``, this worker is one of the ``world_size`` that start
    the job: the default (gloo) process group is formed with them as with ``init_process_group``.
    If the job is already running (this worker replaces a lost one, restarts, or adds one), the
    process starts in a world of its own and returns True: build the model and the front-end
    (``on_peer_failure="continue"``) as every worker does, and the front-end's constructor joins the
    job, taking a member's replica; its ``rank``, ``world_size`` and ``step_count`` then say where
    it stands (``world_size`` given here is ignored, and ``rank`` too unless ``shards`` is given).

    Args:
        store: a store hosted outside the workers (a launcher's ``TCPStore``), reachable by all,
            that outlives any worker.
        rank, world_size: this worker's place among the workers that start the job.
        job: the job's name in the store; default ``$TORCHELASTIC_RUN_ID``, else ``"default"``.
        timeout: the default group's timeout.
        shards: decentralized HSDP: processes per node, each replica sharded over one node's
            (ranks ``node * shards`` to ``node * shards + shards - 1``). The default group is then
            the node (build the mesh to shard over with :func:`node_mesh`), and the front-end gossips
            each shard along the replicas (rank ``s`` of every node) without ``device_mesh``. A node
            joins such a job whole: its ``shards`` processes start with this ``shards`` and ranks
            ``node * shards + s`` (any ``node``, the same for all of them, e.g. torchrun's ``RANK`` on
            the node brought back); its rank ``s`` takes shard ``s`` from a donor node's rank ``s``.
        backend: the backend of the node's group with ``shards``: None (default) NCCL when the
            processes hold GPUs (process ``LOCAL_RANK`` takes GPU ``LOCAL_RANK``,
            ``torch.cuda.set_device``), else gloo; or ``"gloo"``/``"nccl"``. The groups between nodes
            (gossip, survival, joins, pace messages) are the engine's own, on gloo, whatever it is.
            Without ``shards`` only gloo (the default group is the job's; the model may be on a GPU).
        secret: the job secret (at least 16 bytes), the same on every worker; default
            ``$DECENT_JOB_SECRET``, else none. With it, the job's entries in the store (applications,
            verdicts, the survivors' reports and decisions) and the replicas handed to joiners are
            authenticated (HMAC-SHA256): a worker without it, or with another job's, is refused, and
            entries forged in the store are ignored. It never enters the store or the network. See
            the bad workers page of the docs for what it does not protect.

    Returns:
        True if this worker joins a running job, False if it starts the job.

    .. warning:: When the job starts, this is a collective: all ``world_size`` workers must call it.
    """
    if not isinstance(store, Store):
        raise TypeError(
            f"store must be a torch.distributed.Store (a launcher's TCPStore client), got {store!r}."
        )
    name = job if job is not None else os.environ.get("TORCHELASTIC_RUN_ID") or "default"
    if not isinstance(name, str) or not name:
        raise ValueError(f"job must be a non-empty string naming the job in the store, got {job!r}.")
    if dist.is_initialized():
        raise RuntimeError(
            "init_elastic() forms the default process group itself, but one exists already; call it "
            "instead of init_process_group()."
        )
    if shards is not None and (not is_int(shards) or shards < 1):
        raise ValueError(f"shards must be an int >= 1 (processes per node), got {shards!r}.")
    node_backend, device_index = plan_node_backend(
        backend, shards, os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0
    )
    device = None
    if device_index is not None:
        device = torch.device("cuda", device_index)
        torch.cuda.set_device(device)
    seal = Seal(resolve_secret(secret))
    found = job_running(store, name, seal)
    joining = found is not None
    if found is not None and found.shards != (shards or 1):
        raise JoinRejectedError(
            f"job {name!r} is running with {found.shards} process(es) per replica, but this worker was "
            f"started with shards={shards}; start it as the job's workers were "
            f"(shards={found.shards if found.shards > 1 else None})."
        )
    if joining and shards is not None and (not is_int(rank) or rank < 0):
        raise ValueError(f"rank must be an int >= 0 (node * shards + this process's index), got {rank!r}.")
    if not joining:
        for arg, value, least in (("world_size", world_size, 1), ("rank", rank, 0)):
            if not is_int(value) or value < least:
                raise ValueError(f"{arg} must be an int >= {least}, got {value!r}.")
        if rank >= world_size:
            raise ValueError(
                f"rank={rank} must be < world_size={world_size}: no job {name!r} is running in the store, so "
                "this worker is one of the world_size workers that start it (ranks 0 to world_size-1)."
            )
        if shards is not None and world_size % shards:
            raise ValueError(
                f"world_size={world_size} must be a multiple of shards={shards}: the job is made of "
                "nodes of shards processes each."
            )
    replicas, node_key = None, None
    if joining and shards is not None:
        # A node joining a job of nodes: its processes (rank // shards names the node) form the node,
        # and a shard world of one node until the members admit it, under keys of this start of the node.
        node, shard = divmod(rank, shards)
        attempt = int(store.add(f"decent-optim-wrapper/jobs/{name}/joining/{node}/shard/{shard}", 1)) - 1
        node_key = f"decent-optim-wrapper/jobs/{name}/joining/{node}/{attempt}"
        keys = PrefixStore(node_key, store)
        node_keys = PrefixStore("node", keys)
        dist.init_process_group(
            node_backend, store=node_keys, rank=shard, world_size=shards, timeout=timeout, device_id=device
        )
        token = f"jobs-{name}-joining-{node}-{attempt}"  # the job's own once admitted
        node_group = form_group(node_keys, "engine", shard, shards, timeout)
        replicas = ReplicaWorld.form(
            PrefixStore("alone", keys), shards, shard, 0, 1, timeout, token, node_group
        )
    elif joining:
        # A world of its own until the members admit it: the model and front-end build locally.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # type: ignore[attr-defined]
    else:
        # Each start of the job forms its group under keys of its own: the store may hold an earlier
        # start's (a job run again on a store that stays up), whose addresses are stale.
        launch = (int(store.add(f"decent-optim-wrapper/jobs/{name}/starts", 1)) - 1) // world_size
        keys = PrefixStore(f"decent-optim-wrapper/jobs/{name}/start/{launch}", store)
        if shards is None:
            dist.init_process_group("gloo", store=keys, rank=rank, world_size=world_size, timeout=timeout)
        else:  # the node is the default group; the shard worlds are the engine's (engine/fleet/replicas.py)
            node, shard = divmod(rank, shards)
            node_keys = PrefixStore(f"node/{node}", keys)
            dist.init_process_group(
                node_backend,
                store=node_keys,
                rank=shard,
                world_size=shards,
                timeout=timeout,
                device_id=device,
            )
            node_group = form_group(node_keys, "engine", shard, shards, timeout)
            shard_keys = PrefixStore(f"shard/{shard}", keys)
            token = f"jobs-{name}-{launch}"  # the start's: every rank of every shard world shares it
            replicas = ReplicaWorld.form(
                shard_keys, shards, shard, node, world_size // shards, timeout, token, node_group
            )
    enter_job(store, name, found, replicas, node_key, seal)
    return joining


def node_mesh(device_type: str = "cpu") -> DeviceMesh:
    """The 1-D device mesh over this node's processes (dimension ``"shard"``), to shard a replica over
    in a job started with ``init_elastic(..., shards=k)``: ``fully_shard(module, mesh=node_mesh())``.

    .. warning:: A collective of the node: its ``k`` processes must call it.
    """
    job = current_job()
    if job is None or job.replicas is None:
        raise RuntimeError(
            "node_mesh() needs a job started with init_elastic(..., shards=k), whose default process group "
            "is the node; otherwise build the mesh with torch.distributed.device_mesh.init_device_mesh."
        )
    return init_device_mesh(device_type, (job.replicas.shards,), mesh_dim_names=("shard",))


def initialize_dist(*, elastic: bool = False) -> tuple[int, int]:
    """Initialize the default process group from the environment; return ``(rank, world_size)``.

    With ``elastic=True`` the job may grow while it runs (:func:`init_elastic`, the store a client of
    ``MASTER_ADDR:MASTER_PORT``); a worker that joins a running job gets ``(0, 1)`` here and its
    place from its front-end once built. The job's group is then gloo's even on GPU hosts (survival
    and joins re-form it); the process still takes GPU ``LOCAL_RANK`` for its model.

    Under torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT`` set) the ranks meet at
    ``env://``. Under plain ``python`` (none of them set) the process is a world of one, on an
    in-process store, and collectives work as usual. On a host with GPUs the backend is NCCL and
    the process takes GPU ``LOCAL_RANK`` (``torch.cuda.set_device``); otherwise gloo. If the
    default group exists already, it is left alone and its rank and size are returned.

    .. warning:: With more than one process this is a collective: all ranks must call it.

    Returns:
        ``(rank, world_size)`` of the default process group.

    Raises:
        ValueError: Inconsistent launch variables (e.g. ``RANK`` without ``WORLD_SIZE``, ``LOCAL_RANK``
            beyond the GPUs); the message names the variable and the fix.
        RuntimeError: ``torch.distributed`` is not available in this build of torch.
    """
    if not dist.is_available():
        raise RuntimeError("this build of torch has no torch.distributed; install a build that has it.")
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    plan = plan_launch(os.environ, torch.cuda.device_count() if torch.cuda.is_available() else 0)
    if elastic:
        if not plan.rendezvous:
            raise ValueError(
                "initialize_dist(elastic=True) needs a job of more than one worker, with "
                "MASTER_ADDR/MASTER_PORT naming a store hosted outside the workers; got "
                f"WORLD_SIZE={plan.world_size}."
            )
        if plan.device_index is not None:  # a GPU host: the model on GPU LOCAL_RANK, the job's group gloo
            torch.cuda.set_device(torch.device("cuda", plan.device_index))
        client = TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False)
        init_elastic(client, plan.rank, plan.world_size)
        return dist.get_rank(), dist.get_world_size()
    device = None
    if plan.device_index is not None:
        device = torch.device("cuda", plan.device_index)
        torch.cuda.set_device(device)
    if plan.rendezvous:
        dist.init_process_group(
            plan.backend, init_method="env://", rank=plan.rank, world_size=plan.world_size, device_id=device
        )
    else:
        # An in-process store: no port to find, no file to clean up. torch.distributed exports
        # HashStore everywhere but Windows (this library targets Linux); its type stubs omit it.
        store = dist.HashStore()  # type: ignore[attr-defined]
        dist.init_process_group(plan.backend, store=store, rank=0, world_size=1, device_id=device)
    return dist.get_rank(), dist.get_world_size()
