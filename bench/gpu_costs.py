"""Measure, on a GPU, the pass costs that ``viasd replay`` prices recorded traces with.

Prepared for a machine with PyTorch and transformers, a GPU, no network and no model weights: it
imports nothing else of viasd_hf (it loads ``viasd_hf/bench/pass_costs.py`` by path), builds each
traced model from the config a traces folder holds, with random weights, and times the passes the
traces ran. Then, anywhere::

    python bench/gpu_costs.py TRACES --device cuda --out costs_cuda.json     # on the GPU machine
    viasd replay TRACES --costs costs_cuda.json                                # projected tokens/s per method

``--device cpu`` is the same measurement on the CPU (``viasd replay TRACES --measure-costs``),
which the self-check compares with the speeds the traces recorded.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PASS_COSTS = HERE.parent / "viasd_hf" / "bench" / "pass_costs.py"


def load_pass_costs():
    spec = importlib.util.spec_from_file_location("viasd_pass_costs", PASS_COSTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", help="a folder written by `viasd bench --traces`")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True, help="the costs file to write")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per cost (the median is kept)")
    args = parser.parse_args(argv)
    pass_costs = load_pass_costs()
    models, needs = pass_costs.traced_needs(args.traces)
    costs = pass_costs.measure_costs(models, needs, args.device, args.repeats)
    pass_costs.write_costs(costs, args.out)
    print(f"wrote {args.out} ({costs['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
