"""``python -m viasd_hf.models.quantization --model NAME``: measure the schemes on this machine and print the table."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

import torch

from viasd_hf.models.machine import cpu_identity, library_version
from viasd_hf.models.quantization.choice import (
    cache_key,
    cache_path,
    cached_measure,
    choose,
    choose_drafter,
    markdown_table,
    unquantized_candidates,
)
from viasd_hf.models.quantization.measure import MeasureOptions
from viasd_hf.models.quantization.schemes import FORMS, SCHEMES


def main(argv: Sequence[str] | None = None) -> None:
    """Measure the schemes on one model and print the table and the ``auto`` choice."""
    parser = argparse.ArgumentParser(prog="python -m viasd_hf.models.quantization", description=main.__doc__)
    parser.add_argument("--model", required=True, help="zoo name, local folder or Hub id")
    parser.add_argument("--schemes", nargs="+", default=None, choices=list(FORMS),
                        help="forms to measure besides bf16 (default: every scheme whose library is installed, and "
                             "with --draft-for the unquantised forms too)")
    parser.add_argument("--repeats", type=int, default=MeasureOptions.repeats)
    parser.add_argument("--context", type=int, default=MeasureOptions.context)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--draft-for", default=None, metavar="TARGET",
                        help="the model is a drafter for TARGET: judge agreement by TARGET and choose by its speed")
    parser.add_argument("--refresh", action="store_true", help="measure again even if cached")
    args = parser.parse_args(argv)
    available = [name for name, s in SCHEMES.items() if s.available]
    schemes = args.schemes or [*(unquantized_candidates() if args.draft_for else []), *available]
    options = MeasureOptions(context=args.context, repeats=args.repeats, threads=args.threads, judge=args.draft_for)
    measurements = cached_measure(args.model, schemes, options, refresh=args.refresh)
    cpu = cpu_identity()
    machine = f"{cpu['model']} ({cpu['id']}, {args.threads} threads, {', '.join(cpu['flags'])})"
    versions = ", ".join(f"{p} {library_version(p)}" for p in ("torch", "bitsandbytes", "torchao"))
    print(f"{args.model} on {machine}; {versions}\n")
    print(markdown_table(measurements))
    name, reason = choose_drafter(measurements) if args.draft_for else choose(measurements)
    print(f"\nauto → {name}: {reason}")
    print(f"cached in {cache_path(cache_key(args.model, schemes, options))}")


if __name__ == "__main__":
    main()
