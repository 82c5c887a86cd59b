"""Measure, on a GPU, the pass costs that ``viasd replay`` prices recorded traces with.

Prepared for a machine with PyTorch and transformers, a GPU, no network and no model weights. It
builds each traced model from the config a traces folder holds, with random weights, and times the
passes the traces ran (``viasd_hf/bench/pass_costs.py``, loaded by path: nothing else of viasd_hf is
imported). Then, anywhere::

    python bench/gpu_costs.py TRACES --device cuda --out costs_cuda.json     # on the GPU machine
    viasd replay TRACES --costs costs_cuda.json                                # projected tokens/s per method

``--loop`` also runs each traced method there on those random-weight models and keeps the loop's
own seconds per target pass, which the replay then uses in place of the recorded ones (this needs
the viasd_hf source tree beside this script, and still only torch and transformers).
``--shapes CONFIG.json ...`` measures, for each model config, the cost c of a slim pass relative to
a full one at skip budgets of 15, 25, 35 and 45 % (docs/design.md, "The method": the slim tier pays
only where c + e < 1); no traces are needed for that.

``--device cpu`` is the same measurement on the CPU (``viasd replay TRACES --measure-costs``),
which the self-check compares with the speeds the traces recorded.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
PASS_COSTS = HERE.parent / "viasd_hf" / "bench" / "pass_costs.py"
SKIP_BUDGETS = (0.15, 0.25, 0.35, 0.45)
SLIM_WIDTHS = (1, 6)  # a one-token pass, and a verification of 5 drafted tokens
SLIM_CONTEXT = 300


def load_pass_costs():
    spec = importlib.util.spec_from_file_location("viasd_pass_costs", PASS_COSTS)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def slim_curves(pass_costs, configs: list[str], device: str, dtype: str, repeats: int) -> dict[str, list[dict]]:
    import torch

    timer = pass_costs.Timer(device, repeats)
    curves = {}
    for path in configs:
        print(f"slim passes of {Path(path).stem} on {device} ...", flush=True)
        model = pass_costs.build({"config": json.loads(Path(path).read_text()), "form": dtype}, device)
        curves[Path(path).stem] = pass_costs.slim_curve(model, SKIP_BUDGETS, SLIM_WIDTHS, SLIM_CONTEXT, timer, device)
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return curves


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", nargs="?", help="a folder written by `viasd bench --traces`")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", required=True, help="the costs file to write")
    parser.add_argument("--repeats", type=int, default=5, help="timed passes per cost (the median is kept)")
    parser.add_argument("--loop", action="store_true", help="also measure each traced method's loop here")
    parser.add_argument("--loop-traces", metavar="DIR",
                        help="with --loop: write the calls it timed here as traces (to check the replay on this device)")
    parser.add_argument("--shapes", nargs="+", default=[], metavar="CONFIG",
                        help="config.json files whose slim-pass cost to measure at each skip budget")
    parser.add_argument("--dtype", default="bfloat16", help="the form of the --shapes models")
    args = parser.parse_args(argv)
    if not args.traces and not args.shapes:
        parser.error("give a traces folder, --shapes, or both")
    pass_costs = load_pass_costs()
    costs = {"device": pass_costs.device_name(args.device), "torch": pass_costs.torch.__version__, "models": {}}
    if args.traces:
        models, needs = pass_costs.traced_needs(args.traces)
        costs = pass_costs.measure_costs(models, needs, args.device, args.repeats)
    if args.traces and args.loop:
        sys.path.insert(0, str(HERE.parent))
        from viasd_hf.bench.loop_costs import measure_loop

        costs["loop"] = measure_loop(args.traces, args.device, record=args.loop_traces)
    if args.shapes:
        costs["slim_curves"] = slim_curves(pass_costs, args.shapes, args.device, args.dtype, args.repeats)
    pass_costs.write_costs(costs, args.out)
    print(f"wrote {args.out} ({costs['device']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
