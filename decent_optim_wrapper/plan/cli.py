"""``python -m decent_optim_wrapper.plan``: predicted step times before renting a cluster.

``python -m decent_optim_wrapper.plan --model-bytes 500M --compute-ms 100 --bandwidth 25gbit
--latency 10us --nodes 64`` simulates DDP and every topology's gossip (uncompressed, and compressed
in the formats ``--compression`` names: bf16 and int8 by default) on that cluster and prints each
one's mean step time, its ratio to training without communication, and the bytes a rank sends per
step; ``--sync-every 8`` adds low-communication gossip (a round every 8 steps, ``--sync-delay`` steps
to arrive) and ``--measure-rounds`` charges each round the processor time its wire format takes
on this machine (:mod:`.round_cost`). ``--factors 2 2 1 1`` makes an uneven fleet (rank ``r``'s step
takes ``factors[r]`` times ``--compute-ms``) and ``--pacing`` adds each low-communication method with
paced rounds (``ring~h8d1p``: each rank takes as many steps per round as its speed allows), timed by
the fleet's throughput. ``python -m decent_optim_wrapper.plan bytes NAME -n N`` prints a
topology's bytes per parameter (:mod:`.traffic`); ``python -m decent_optim_wrapper.plan recommend
--model-bytes 4G --compute-ms 1000 --bandwidth 100mbit --nodes 16`` the setting that sends the most per
step while the exchange stays hidden (:mod:`.recommend`). The assumptions are those of :mod:`.costs` and
:mod:`.simulator`.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Sequence
from functools import cache

from decent_optim_wrapper.engine.wire.compression import GossipCompression, parse_compression
from decent_optim_wrapper.plan.compute import JITTERS, UNEVEN, ComputeTimes
from decent_optim_wrapper.plan.costs import HostCopy, Link, Network
from decent_optim_wrapper.plan.predict import predict
from decent_optim_wrapper.plan.recommend import recommend
from decent_optim_wrapper.plan.round_cost import RoundCost, measure_round_cost
from decent_optim_wrapper.plan.traffic import bytes_main

__all__ = ["main", "parse_quantity", "recommend_main"]

_UNITS = {
    "bytes": {
        "": 1,
        "b": 1,
        "k": 1e3,
        "kb": 1e3,
        "m": 1e6,
        "mb": 1e6,
        "g": 1e9,
        "gb": 1e9,
        "t": 1e12,
        "tb": 1e12,
    },
    "bandwidth": {"": 1, "bit": 1, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12},
    "latency": {"": 1, "s": 1, "ms": 1e-3, "us": 1e-6, "ns": 1e-9},
}


def parse_quantity(text: str, kind: str) -> float:
    """``"500M"`` bytes, ``"25gbit"`` bit/s, ``"10us"`` seconds -> a float in bytes, bit/s or seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    units = _UNITS[kind]
    if match is None or match.group(2) not in units:
        raise ValueError(
            f"{text!r} is not a {kind}; write a number with one of the units "
            f"{', '.join(u for u in units if u)} (e.g. 500M, 25gbit, 10us)"
        )
    return float(match.group(1)) * units[match.group(2)]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m decent_optim_wrapper.plan",
        description="Predict the step time of DDP and of gossip on every topology (with and without "
        "compression) by simulating the step dependency graph; 'bytes NAME -n N' prints a topology's "
        "bytes per parameter instead, 'recommend ...' the setting that hides the exchange.",
    )
    _cluster_arguments(parser)
    parser.add_argument("--forward-fraction", type=float, default=1 / 3, help="forward's share of compute")
    parser.add_argument(
        "--jitter",
        choices=(*JITTERS, UNEVEN),
        default=None,
        help="compute-time scenario (default: none, uneven with --factors)",
    )
    parser.add_argument("--sigma", type=float, default=0.3, help="lognormal jitter's shape (default 0.3)")
    parser.add_argument("--slow-factor", type=float, default=1.5, help="straggler's slowdown (rank 0)")
    parser.add_argument(
        "--factors",
        type=float,
        nargs="+",
        default=[],
        metavar="F",
        help="uneven fleet: rank r's step takes F_r times --compute-ms (ranks beyond the list: 1), e.g. "
        "2 2 2 2 1 1 1 1; implies --jitter uneven",
    )
    parser.add_argument(
        "--topologies", nargs="+", default=None, help="default: every registered one that fits"
    )
    parser.add_argument(
        "--tree-latency", action="store_true", help="all-reduces pay log2(k) latencies (NCCL)"
    )
    parser.add_argument("--steps", type=int, default=40, help="simulated steps (the first 10 are warm-up)")
    parser.add_argument(
        "--compression",
        nargs="+",
        default=["bf16", "int8"],
        metavar="FORMAT",
        help="wire formats to simulate besides uncompressed: bf16, fp16, int8, int4, int2 or a sparse "
        "format such as topk:0.01:int2 (default: bf16 int8)",
    )
    parser.add_argument(
        "--sync-every",
        type=int,
        nargs="+",
        default=[],
        metavar="H",
        help="also simulate low-communication gossip with a round every H steps (named ring~h8d1)",
    )
    parser.add_argument(
        "--sync-delay", type=int, default=1, help="steps a low-communication round may take (default 1)"
    )
    parser.add_argument(
        "--pacing",
        action="store_true",
        help="also simulate each low-communication method with paced rounds (named ring~h8d1p): each rank "
        "takes as many steps per round as its speed allows; its ms/step is the fleet's, ranks over steps "
        "per second (needs --sync-every)",
    )
    parser.add_argument(
        "--measure-rounds",
        action="store_true",
        help="time a round's encoding and decoding on this machine's CPU for every format and charge it "
        "to the steps that launch and fold rounds (default: rounds cost no processor time)",
    )
    return parser


def _cluster_arguments(parser: argparse.ArgumentParser) -> None:
    """The model and the cluster, as both commands take them."""
    parser.add_argument("--model-bytes", required=True, help="bytes of the fp32 parameters: 500M, 4G, ...")
    parser.add_argument("--compute-ms", type=float, required=True, help="forward + backward per step (ms)")
    parser.add_argument("--bandwidth", required=True, help="per node and direction: 25gbit, 1gbit, 200mbit")
    parser.add_argument("--latency", default="0", help="per message between nodes: 10us, 50ms (default 0)")
    parser.add_argument(
        "--message-bytes",
        default="0",
        help="bytes each message between nodes costs beyond its payload, --bandwidth being the link's "
        "goodput: headers, acknowledgements, the collective's control traffic (gloo over TCP: 700 to "
        "900; default 0). Small rounds, such as sparse formats', pay more for it than for their payload",
    )
    parser.add_argument("--nodes", type=int, required=True, help="number of nodes")
    parser.add_argument("--workers-per-node", type=int, default=1, help="ranks per node (default 1)")
    parser.add_argument(
        "--intra-bandwidth", default="100gbit", help="between ranks of a node (default 100gbit)"
    )
    parser.add_argument(
        "--overhead-ms", type=float, default=0.0, help="CPU/GPU work per step besides compute"
    )
    parser.add_argument(
        "--host-copy",
        default=None,
        metavar="BYTES",
        help="a model on GPUs gossiping over gloo: its rounds are staged through pinned host memory at "
        "BYTES per second each way, e.g. 25G (PCIe 4.0 x16); DDP is taken to run on NCCL (default: none)",
    )


def _cluster(args: argparse.Namespace) -> tuple[float, Link, Link, HostCopy | None]:
    """The model's bytes, the links between and inside nodes and the host copy of
    :func:`_cluster_arguments`' values (a ValueError names a value that does not parse)."""
    model_bytes = parse_quantity(args.model_bytes, "bytes")
    inter = Link(
        parse_quantity(args.bandwidth, "bandwidth"),
        parse_quantity(args.latency, "latency"),
        parse_quantity(args.message_bytes, "bytes"),
    )
    intra = Link(parse_quantity(args.intra_bandwidth, "bandwidth"))
    host_copy = None if args.host_copy is None else HostCopy(parse_quantity(args.host_copy, "bytes"))
    return model_bytes, inter, intra, host_copy


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (argument errors exit with status 2)."""
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bytes"]:
        return bytes_main(argv[1:])
    if argv[:1] == ["recommend"]:
        return recommend_main(argv[1:])
    parser = _parser()
    args = parser.parse_args(argv)
    try:
        model_bytes, inter, intra, host_copy = _cluster(args)
        jitter = args.jitter or (UNEVEN if args.factors else "none")
        compute = ComputeTimes(
            args.compute_ms / 1e3,
            jitter,
            args.sigma,
            slow_factor=args.slow_factor,
            factors=tuple(args.factors),
        )
        for name in args.compression:
            parse_compression(name)
    except ValueError as err:
        parser.error(str(err))
    if args.nodes < 1 or args.workers_per_node < 1 or args.steps <= 10 or model_bytes < 4:
        parser.error(
            f"need --nodes >= 1, --workers-per-node >= 1, --steps > 10 and --model-bytes >= 4, got "
            f"{args.nodes}, {args.workers_per_node}, {args.steps} and {args.model_bytes}"
        )
    bad_every = [h for h in args.sync_every if h < 1 or not 0 <= args.sync_delay <= h]
    if bad_every:
        parser.error(
            f"--sync-every {bad_every[0]} with --sync-delay {args.sync_delay}: need sync_every >= 1 and "
            "0 <= sync_delay <= sync_every"
        )
    if args.pacing and not args.sync_every:
        parser.error(
            "--pacing paces low-communication rounds: add --sync-every H (e.g. --sync-every 8) to simulate "
            "a round every H steps, paced and not"
        )
    network = Network(inter, intra, args.workers_per_node, args.tree_latency)
    round_costs = None
    if args.measure_rounds:
        numel = max(1, int(model_bytes // 4))

        @cache
        def round_costs(compression: GossipCompression | None, group_size: int) -> RoundCost:
            return measure_round_cost(numel, group_size, compression)

    try:
        predictions = predict(
            model_bytes,
            compute,
            network,
            args.nodes,
            args.topologies,
            compressions=args.compression,
            steps=args.steps,
            overhead_s=args.overhead_ms / 1e3,
            forward_fraction=args.forward_fraction,
            local_steps=[(h, args.sync_delay) for h in args.sync_every],
            round_costs=round_costs,
            paced=args.pacing,
            host_copy=host_copy,
        )
    except ValueError as err:
        parser.error(str(err))
    ranks = args.nodes * args.workers_per_node
    print(
        f"{ranks} ranks ({args.nodes} nodes x {args.workers_per_node}); model {model_bytes / 1e6:.1f} MB; "
        f"compute {args.compute_ms:.1f} ms/step ({jitter} jitter); links "
        f"{inter.bandwidth / 1e9:g} Gbit/s, {inter.latency_s * 1e3:g} ms and {inter.message_bytes:g} bytes "
        "per message"
    )
    base = predictions[0].step_s
    print(f"{'method':<28}{'ms/step':>10}{'/ no-comm':>11}{'MB sent/step/rank':>19}")
    for p in predictions:
        print(f"{p.method:<28}{1e3 * p.step_s:>10.1f}{p.step_s / base:>11.3f}{p.sent_bytes / 1e6:>19.2f}")
    ddp = next(p for p in predictions if p.method == "ddp")
    best = min(predictions[1:], key=lambda p: p.step_s)
    print(f"fastest: {best.method} ({ddp.step_s / best.step_s:.2f}x faster than DDP)")
    if args.pacing:
        print("paced methods (p): ms/step of the fleet, ranks over the steps per second of all ranks")
    if host_copy is not None:
        print(f"gossip staged through host memory at {host_copy.bytes_per_s / 1e9:g} GB/s each way")
    return 0


def recommend_main(argv: Sequence[str]) -> int:
    """``recommend``: the setting that sends the most per step while the exchange stays hidden."""
    parser = argparse.ArgumentParser(
        prog="python -m decent_optim_wrapper.plan recommend",
        description="The gossip setting that sends the most per step while its predicted throughput stays "
        "at least --target of training without communication (see decent_optim_wrapper.plan.recommend).",
    )
    _cluster_arguments(parser)
    parser.add_argument("--topology", default="ring", help="a registered topology (default ring)")
    parser.add_argument(
        "--target", type=float, default=0.9, help="throughput against no communication (default 0.9)"
    )
    args = parser.parse_args(argv)
    try:
        model_bytes, inter, intra, host_copy = _cluster(args)
        if args.nodes < 1 or args.workers_per_node < 1 or model_bytes < 4 or args.compute_ms <= 0:
            raise ValueError(
                f"need --nodes >= 1, --workers-per-node >= 1, --model-bytes >= 4 and --compute-ms > 0, got "
                f"{args.nodes}, {args.workers_per_node}, {args.model_bytes} and {args.compute_ms}"
            )
        network = Network(inter, intra, args.workers_per_node)
        found = recommend(
            model_bytes,
            ComputeTimes(args.compute_ms / 1e3, "none"),
            network,
            args.nodes,
            args.topology,
            args.target,
            overhead_s=args.overhead_ms / 1e3,
            host_copy=host_copy,
        )
    except ValueError as err:
        parser.error(str(err))
    chosen = found.chosen
    print(
        f"{args.nodes * args.workers_per_node} ranks ({args.nodes} nodes x {args.workers_per_node}); model "
        f"{model_bytes / 1e6:.1f} MB; compute {args.compute_ms:.1f} ms/step; links "
        f"{inter.bandwidth / 1e9:g} Gbit/s, {inter.latency_s * 1e3:g} ms and {inter.message_bytes:g} bytes "
        "per message"
    )
    verdict = "hides the exchange" if found.hides else f"does NOT reach {found.target:g}: the fastest tried"
    print(
        f"recommended: {chosen.method} ({verdict}): {found.throughput:.3f} of no communication's speed, "
        f"{chosen.sent_bytes / 1e6:.3g} MB sent per rank and step; DDP {found.ddp_throughput:.3f}"
    )
    keywords = ", ".join(f"{key}={value!r}" for key, value in chosen.options().items())
    print(f"    DecentOptimWrapper(optimizer, {keywords})")
    if chosen.sync_every > 1:
        # What the slow-link runs found best: Muon on the matrices, no outer optimizer at every H and
        # worker count swept (docs/low-communication.md, "the outer optimizer, swept").
        print(
            "    (low-communication gossip: Muon as the inner optimizer for the hidden matrices, no outer "
            "optimizer; docs/low-communication.md)"
        )
    if found.ruled_out:
        print(
            f"{found.ruled_out} setting{'s' if found.ruled_out > 1 else ''} sending more ruled out "
            "unsimulated: their bytes alone take "
            f"longer than compute / {found.target:g} over a node's link"
        )
    print(f"simulated, most bytes first:\n{'method':<28}{'MB/step/rank':>14}{'/ no-comm':>11}")
    for candidate, throughput in found.tried:
        print(f"{candidate.method:<28}{candidate.sent_bytes / 1e6:>14.3g}{throughput:>11.3f}")
    return 0
