"""Each option of :class:`~.config.GossipConfig` described once, and put into every docstring that offers it.

A front-end's docstring holds the line ``{gossip_options}`` among its arguments; :func:`document_options`
replaces it with one entry per option, indented as the line was, so the engine, both front-ends and the
integrations describe an option in the same words.
"""

from __future__ import annotations

import textwrap
from typing import Any, TypeVar

__all__ = ["OPTION_DOCS", "PLACEHOLDER", "document_options"]

#: What a docstring writes where the options' entries go.
PLACEHOLDER = "{gossip_options}"

#: Each keyword's description, in the order of :meth:`~decent_optim_wrapper.GossipConfig.keywords`.
OPTION_DOCS: dict[str, str] = {
    "topology": (
        'who averages with whom: a registered name ("ring", "complete", "one-peer-exp", ...; see '
        ":class:`~decent_optim_wrapper.topo.TopologyFactory`), a "
        ":class:`~decent_optim_wrapper.topo.Topology` subclass, or an instance."
    ),
    "rank": "this process's rank in the gossip world; default: the job's (or the group's) own.",
    "world_size": "number of processes in the gossip world; default: the job's (or the group's) size.",
    "local_world_size": (
        "processes per node along the gossip world; default ``$LOCAL_WORLD_SIZE`` (torchrun), else 1 "
        "(an integration takes its framework's processes per node)."
    ),
    "device_mesh": (
        'gossip along one group instead of the whole job: a 1-D device mesh (e.g. ``mesh["replicate"]`` '
        'when the model is sharded with FSDP2\'s ``fully_shard`` over ``mesh["shard"]``: decentralized '
        "HSDP; buckets then hold the local shards of DTensor parameters). ``rank``, ``world_size`` and the "
        "topology are the group's. See the big models page of the docs."
    ),
    "process_group": "the gossip group as a process group instead of ``device_mesh`` (pass one of them).",
    "bucket_cap_mb": "largest bucket in MiB (default 25); larger buckets mean fewer, bigger messages.",
    "timeout": (
        "how long gossip and global averaging wait for a peer (dead or hung) before raising "
        ":class:`~decent_optim_wrapper.GossipError` or ``GlobalAverageError``; default ten minutes."
    ),
    "compression": (
        '``"bf16"``, ``"fp16"``, ``"int8"``, a sparse format such as ``"topk:0.01:int2"``, or a '
        ":class:`~decent_optim_wrapper.GossipCompression`: each round sends the compressed difference to a "
        "reference the group shares (global averaging stays exact). None (default) gossips exactly."
    ),
    "host_staging": (
        "None (default): gossip rounds of buckets on a GPU travel through pinned host buffers when the "
        "gossip groups are gloo's (overlapped; the GPU fleets page); True also for CPU buckets (the same "
        "path, for comparison); False: device tensors go to the backend."
    ),
    "gradient_tracking": (
        "for data that differs between workers: gossip a tracker of the average gradient beside the "
        "parameters and step with it instead of the local gradient (DSGT); twice the bytes. An "
        "optimizer's ``step()`` then needs final gradients: no ``closure``, and under a GradScaler "
        "``scaler.unscale_(optimizer)`` first. Off at world size 1."
    ),
    "sync_every": (
        "inner steps per round of low-communication gossip (``H``; default 1, gossip after every step): "
        "every ``H`` steps each rank takes an outer step on its anchor and gossips the anchors "
        "(:mod:`~decent_optim_wrapper.engine.rules.local_steps`, the low-communication page)."
    ),
    "outer_optimizer": (
        "a function from the anchors (one tensor per parameter) to the outer ``torch.optim.Optimizer`` "
        "over them, e.g. ``lambda p: torch.optim.SGD(p, lr=0.7, momentum=0.9, nesterov=True)`` "
        "(DiLoCo's); None (default): periodic gossip of the parameters."
    ),
    "sync_delay": (
        "inner steps a round's exchange may run behind (``D``, ``0 <= D <= H``): 0 blocks at the end of "
        "the round; None (default) gives it a whole round. ``sync_every=1, sync_delay=0`` is per-step "
        "gossip that blocks: the next gradient is taken at the mixed point (the Adam page)."
    ),
    "pacing": (
        '``"measured"`` or a :class:`~decent_optim_wrapper.Pacing`: for uneven fleets, each rank takes as '
        "many inner steps per round as its measured speed allows, so nobody waits for a slower neighbour; "
        "ranks then stand at different steps, so loops count rounds (``round_count``). None (default): "
        "every round takes ``sync_every`` steps (the uneven fleets page)."
    ),
    "nonfinite_guard": (
        "guarded mixing (default True): values that are not finite never enter a replica through gossip; a "
        "rank whose own are withholds them and heals from its peers. False skips this rank's checks of what "
        "it sends and of the sums it receives (two reads of every bucket per round); the flags still "
        "travel, so ranks may differ in it (the bad workers page)."
    ),
    "clipped_gossip": (
        "against a neighbour that sends finite but wrong values (opt-in): True or a "
        ":class:`~decent_optim_wrapper.ClippedGossip`; each neighbour's difference is clipped to a radius "
        "from the recent ones, and every round gathers the members' values. None (default): plain mixing "
        "(the bad workers page)."
    ),
    "on_peer_failure": (
        '``"raise"`` (default): a dead or silent peer raises :class:`~decent_optim_wrapper.GossipError` on '
        'the others. ``"continue"`` (gloo): the survivors agree on who is gone and go on (``world_size`` '
        "and ``rank`` then report the new group); in a job started with "
        ":func:`~decent_optim_wrapper.init_elastic`, workers may also join (the failures and joining pages)."
    ),
    "store": (
        'with ``"continue"``, the store the survivors meet in; default: the elastic job\'s, else a client '
        "of ``MASTER_ADDR:MASTER_PORT``."
    ),
    "second_moment": (
        '``"average"`` (default): an Adam, AdamW or AccumAdam(W) optimizer normalises by an estimate of the '
        "second moment of the *average* gradient over the ranks, as under all-reduce, from this rank's "
        'gradients alone (the Adam under gossip page). ``"local"``: the optimizer\'s own (the rule of '
        "decent-optim-wrapper 0.1.1 and decent-dp). Other optimizers are unchanged."
    ),
}

_WIDTH = 108  # the line length the package's docstrings keep to

_T = TypeVar("_T")


def _entries(indent: str, names: dict[str, str]) -> str:
    lines = [
        textwrap.fill(
            f"{label}: {OPTION_DOCS[name]}",
            width=_WIDTH,
            initial_indent=indent,
            subsequent_indent=indent + "    ",
            break_on_hyphens=False,
            break_long_words=False,
        )
        for name, label in names.items()
    ]
    return "\n".join(lines)


def document_options(
    obj: _T | None = None, *, renamed: dict[str, str] | None = None, leave_out: tuple[str, ...] = ()
) -> Any:
    """Replace the line ``{gossip_options}`` in ``obj``'s docstring by every option's entry.

    ``renamed`` maps a keyword to the name this front-end gives it (the module front-end's
    ``bucket_size_in_mb``, decent-dp's spelling); ``leave_out`` names options it does not offer. Returns
    ``obj``; without it, a decorator that does this.
    """
    if obj is None:
        return lambda target: document_options(target, renamed=renamed, leave_out=leave_out)
    doc = obj.__doc__
    if doc is None or PLACEHOLDER not in doc:
        raise ValueError(f"{obj!r}'s docstring has no {PLACEHOLDER} line to put the options in.")
    labels = {name: (renamed or {}).get(name, name) for name in OPTION_DOCS if name not in leave_out}
    lines = doc.splitlines()
    out = []
    for line in lines:
        if line.strip() == PLACEHOLDER:
            out.append(_entries(line[: len(line) - len(line.lstrip())], labels))
        else:
            out.append(line)
    obj.__doc__ = "\n".join(out)
    return obj
