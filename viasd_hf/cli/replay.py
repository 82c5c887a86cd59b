"""``viasd replay``: a bench run's recorded passes priced with another device's pass costs."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from viasd_hf.cli.args import CommandError, UsageError, check_output_file, first_line, positive_int


def add_replay_command(subparsers: argparse._SubParsersAction) -> None:
    """Register ``viasd replay``."""
    replay = subparsers.add_parser(
        "replay", help="project each method's speed from recorded traces and measured pass costs (a GPU's, say)",
        description="Price every pass of `viasd bench --traces DIR` with the costs of another device and "
                    "project each method's tokens/s; with costs measured where the traces were recorded, "
                    "the projection must come within 10 % of the measured speeds (the self-check).",
    )
    replay.add_argument("traces", help="a folder written by `viasd bench --traces`")
    replay.add_argument("--costs", help="a costs file (`--measure-costs`, or bench/gpu_costs.py on a GPU)")
    replay.add_argument("--measure-costs", metavar="FILE",
                        help="instead: measure the costs of the traced passes here, on --device, into FILE")
    replay.add_argument("--device", default="cpu", help="where --measure-costs measures (cpu, cuda, cuda:1, ...)")
    replay.add_argument("--loop", action="store_true",
                        help="with --measure-costs: also run each traced method here on random-weight models and "
                             "keep its loop's seconds per target pass (the replay then uses them, not the recorded)")
    replay.add_argument("--repeats", type=positive_int, default=3, help="timed passes per cost (the median is kept)")
    replay.add_argument("--check", action="store_true",
                        help="exit 1 where a projection misses the measured speed by more than 10 %% "
                             "(for costs measured on the machine that recorded the traces)")
    replay.set_defaults(handler=run_replay_command)


def run_replay_command(args: argparse.Namespace) -> int:
    from viasd_hf.bench import pass_costs
    from viasd_hf.bench.replay import median_pass_error, replay, replay_markdown, self_check
    from viasd_hf.bench.traces import read_traces

    if bool(args.costs) == bool(args.measure_costs):
        raise UsageError("give either --costs FILE (to project) or --measure-costs FILE (to measure), not both")
    if args.loop and not args.measure_costs:
        raise UsageError("--loop is measured with --measure-costs FILE")
    try:
        models, calls = read_traces(args.traces)
    except (OSError, ValueError, KeyError, TypeError) as error:
        raise UsageError(f"{args.traces}: {first_line(error)}") from None
    if args.measure_costs:
        check_output_file(args.measure_costs, "--measure-costs")
        try:
            costs = pass_costs.measure_costs(models, pass_costs.traced_needs(args.traces)[1], args.device, args.repeats)
            if args.loop:
                from viasd_hf.bench.loop_costs import measure_loop

                costs["loop"] = measure_loop(args.traces, args.device)
        except (RuntimeError, ValueError, ImportError) as error:
            raise CommandError(f"--measure-costs on {args.device}: {first_line(error)}") from error
        pass_costs.write_costs(costs, args.measure_costs)
        print(f"wrote {args.measure_costs}")
        return 0
    try:
        costs = json.loads(Path(args.costs).read_text())
        methods = replay(calls, costs)
    except (OSError, ValueError, KeyError) as error:
        raise UsageError(f"--costs {args.costs}: {first_line(error)}") from None
    print(replay_markdown(methods, costs))
    print("\nPriced ÷ recorded seconds per pass (median; 1.00 where the costs are this machine's):")
    for key, ratio in median_pass_error(calls, costs).items():
        print(f"  {key}: {ratio:.2f}")
    missed = self_check(methods)
    if args.check and missed:
        print("self-check failed (over 10 %): " + "; ".join(missed), file=sys.stderr)
        return 1
    return 0
