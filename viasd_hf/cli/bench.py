"""``viasd bench``: load the pair, pick the prompts, run the methods, print and save what was measured."""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from viasd_hf.bench.load import LOADS, Load
from viasd_hf.bench.methods import (
    ABLATIONS,
    FLOAT32_TARGET_SUFFIX,
    HYBRID_SUFFIX,
    KNOWN_METHODS,
    METHODS,
    OTHER_TOKENIZER_METHODS,
    STEERED_REFERENCE,
    UNQUANTIZED_REFERENCE,
    MethodName,
    MethodSettings,
    MethodTable,
    is_method,
)
from viasd_hf.bench.report import (
    environment,
    markdown,
    per_task_markdown,
    plots,
    slim_tier_markdown,
    time_markdown,
    verdict_lines,
)
from viasd_hf.cli.args import (
    DTYPES,
    CommandError,
    UsageError,
    check_model,
    check_output_dir,
    check_output_file,
    first_line,
    known_mask,
    load_model,
    mask_from,
    positive_float,
    positive_int,
    positive_ints,
    probability,
    quantize_spec,
    tokens_or_none,
)
from viasd_hf.config import ViaSDConfig
from viasd_hf.data.tasks import DATASETS, Example, load_examples, load_jsonl
from viasd_hf.drafters import precision as drafting_precision
from viasd_hf.drafters.precision import drafting_copy
from viasd_hf.extras import require
from viasd_hf.masks.routing_mask import RoutingMask, RoutingMaskError
from viasd_hf.models.quantization import (
    QuantizationChoice,
    QuantizationUnavailableError,
    resolve_drafting_form,
    resolve_quantization,
)

# base decoders (MethodName.base) that draft with the drafter model / need a routing mask for the pair
DRAFTER_METHODS = frozenset({"hf_assisted", "cascade", "two_tier", "viasd", "viasd_lossless",
                             UNQUANTIZED_REFERENCE, STEERED_REFERENCE})
MASK_METHODS = frozenset({"viasd", "viasd_lossless"})


def _bases(names: list[str]) -> set[str]:
    return {MethodName.parse(name).base for name in names}


def _in_float32(name: str) -> bool:
    """Whether the method runs on the target's float32 copy (``FLOAT32_TARGET_SUFFIX``)."""
    return FLOAT32_TARGET_SUFFIX in MethodName.parse(name).ablations


def add_bench_command(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register ``viasd bench``; scripts and CI rely on these flags and on the JSON layout (see the README)."""
    parser = subparsers.add_parser(
        "bench",
        help="every decoding method on the same prompts: speed-up over greedy, acceptance, quality, memory",
        description="Run greedy, HF assisted / prompt lookup, layer-skip self-speculation, a speculative cascade "
        "and VIA-SD side by side (interleaved, in one process) and report speed as ratios to greedy.",
    )
    parser.add_argument("--target", default="qwen2.5-coder-1.5b-instruct", help="zoo name, Hub id or local folder")
    parser.add_argument("--drafter", default="qwen2.5-coder-0.5b-instruct", help="assistant model sharing the tokenizer")
    parser.add_argument("--other-drafter",
                        help=f"assistant model of another tokenizer, for {', '.join(OTHER_TOKENIZER_METHODS)}")
    parser.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, greedy first; from {','.join(KNOWN_METHODS)}, "
                        f"{STEERED_REFERENCE} (HF assisted with our measured attention kernel); ours also with "
                        f"{HYBRID_SUFFIX} and/or the ablations {', '.join(ABLATIONS)} appended")
    parser.add_argument("--dataset", default="spec_bench", choices=DATASETS)
    parser.add_argument("--prompts", help="JSONL with 'prompt', optional 'reference' and 'task' (instead of --dataset)")
    parser.add_argument("--limit", type=positive_int, help="examples per task (default: all)")
    parser.add_argument("--max-new-tokens", type=positive_int, default=128)
    parser.add_argument("--repeats", type=positive_int, default=1, help="timed runs per prompt and method (the median is kept)")
    parser.add_argument("--temperature", type=positive_float, help="sample at this temperature (every method, seeded alike)")
    parser.add_argument("--dtype", default="auto", choices=DTYPES,
                        help="auto (default): each model in the faster of float32 and bf16 measured on this machine")
    parser.add_argument("--quantize", type=quantize_spec, default={}, metavar="drafter=SCHEME,target=SCHEME",
                        help="load the drafter and/or target quantised for every method (a scheme of viasd_hf.models."
                        f"quantization, int8, 4bit or auto); add {UNQUANTIZED_REFERENCE} to compare with HF on the bf16 pair")
    parser.add_argument("--threads", type=positive_int, help="torch threads (default: torch's choice)")
    parser.add_argument("--load", default="none", choices=LOADS, help="time the calls beside a CPU load the bench "
                        "starts: busy processes, steady or on and off on a fixed schedule (docs/benchmarking.md)")
    parser.add_argument("--load-workers", type=positive_int, metavar="N", help="busy processes of --load (default: 1)")
    parser.add_argument("--mask", help="VIA-SD routing mask (folder / JSON / Hub id; default: the mask known for the pair)")
    parser.add_argument("--self-draft-mask", help="self_spec's drafting mask (default: the target's known self mask)")
    parser.add_argument("--gamma", type=positive_int, default=5, help="draft tokens per block for every drafting method of ours")
    parser.add_argument("--draft-threshold", type=probability, default=0.4, help="stop drafting below this drafter confidence")
    parser.add_argument("--cascade-lenience", type=probability, default=0.3, help="α of the cascade baseline")
    parser.add_argument("--prompt-lookup-tokens", type=positive_int, default=10)
    parser.add_argument("--drafter-context", type=tokens_or_none, default=ViaSDConfig.drafter_context, metavar="N|none",
                        help="prompt tokens our assistant drafter reads (ViaSDConfig.drafter_context; default: %(default)s)")
    parser.add_argument("--batch-size", type=positive_ints, metavar="B[,B...]", help="instead of the methods: lossless "
                        "VIA-SD on left-padded batches of B prompts (a list sweeps, e.g. 1,2,4,8) against batched "
                        "greedy generate at the same B, HF assisted one prompt at a time and VIA-SD at batch size 1")
    parser.add_argument("--json", help="write every figure, the environment and the command here")
    parser.add_argument("--plots", help="folder for speedup_vs_quality.png and tier_fractions.png")
    parser.add_argument("--traces", metavar="DIR", help="record every timed call's passes here, for `viasd replay`")
    parser.set_defaults(handler=run_bench_command)
    return parser


def _dtypes(target: nn.Module, drafter: nn.Module) -> str:
    return f"target {str(target.dtype).removeprefix('torch.')}, drafter {str(drafter.dtype).removeprefix('torch.')}"


def _weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])


def _quantization(args: argparse.Namespace) -> dict[str, QuantizationChoice]:
    """What ``--quantize`` means for each role on this machine (``auto`` measures once, then reads its cache)."""
    try:
        return {role: resolve_quantization(getattr(args, role), scheme, draft_for=args.target if role == "drafter" else None)
                for role, scheme in args.quantize.items()}  # fmt: skip
    except QuantizationUnavailableError as error:
        raise CommandError(f"--quantize: {first_line(error)}") from None


def _load_role(args: argparse.Namespace, role: str, quantized: dict[str, QuantizationChoice]):
    """The target or drafter: in its chosen scheme, in the unquantised form ``auto`` chose (bf16 when no scheme was
    worth it), else ``--dtype``."""
    choice = quantized.get(role)
    if choice is None:
        return load_model(getattr(args, role), args.dtype, f"--{role}")
    if not choice.quantized:
        return load_model(getattr(args, role), str(choice.scheme.dtype).removeprefix("torch."), f"--{role}")
    return load_model(getattr(args, role), args.dtype, f"--{role}", choice.scheme.name)


def made_before_timing(drafter: nn.Module | None) -> None:
    """The drafter's drafting copy made now: the bench compares steady states, so VIA-SD's calls draft with the copy
    from the first timed one (a process's first calls draft with the drafter as given until making the copy pays:
    ``drafters.precision.making_pays``)."""
    if drafter is not None:
        drafting_precision.fastest_form(drafter, now=True)


def _examples(args: argparse.Namespace) -> list[Example]:
    try:
        examples = load_jsonl(args.prompts, args.limit) if args.prompts else load_examples(args.dataset, args.limit)
    except (OSError, ValueError, KeyError) as error:
        flag = f"--prompts {args.prompts}" if args.prompts else f"--dataset {args.dataset}"
        raise UsageError(f"{flag}: {first_line(error)}") from None
    if not examples:
        raise UsageError(f"--prompts {args.prompts}: no prompts in the file" if args.prompts
                         else f"--dataset {args.dataset}: no examples")
    return examples


def _method_names(text: str) -> list[str]:
    names = [name.strip() for name in text.split(",")]
    unknown = [name for name in names if not is_method(name)]
    if unknown:
        raise UsageError(f"--methods: unknown method(s) {', '.join(map(repr, unknown))}; "
                         f"choose from {', '.join(KNOWN_METHODS)}, {UNQUANTIZED_REFERENCE}, {STEERED_REFERENCE}, "
                         f"with {HYBRID_SUFFIX} and {', '.join(ABLATIONS)} on ours")
    if names[0] != "greedy":
        raise UsageError("--methods: the first method must be greedy: every speed-up and agreement is measured against it")
    if len(set(names)) != len(names):
        raise UsageError(f"--methods: a method is listed twice in {text!r}")
    return names


def _check_batch_args(args: argparse.Namespace) -> None:
    """What a batch sweep cannot do, refused with the fix (batched decoding is lossless greedy only)."""
    refused = {"--methods": args.methods != ",".join(METHODS), "--temperature": args.temperature is not None,
               "--plots": args.plots is not None, "--quantize": bool(args.quantize), "--traces": args.traces is not None}
    for flag, given in refused.items():
        if given:
            raise UsageError(f"--batch-size compares fixed methods (batched greedy, batched lossless VIA-SD, HF "
                             f"assisted one prompt at a time) greedily on unquantised models: leave out {flag}")


def check_bench_args(args: argparse.Namespace) -> tuple[list[str], list[Example], RoutingMask | None, RoutingMask | None]:
    """Everything that can be checked before the models load (minutes): methods, models, outputs, prompts, masks."""
    if args.load_workers and args.load == "none":
        raise UsageError("--load-workers: give the load they run, --load steady or --load bursty")
    if args.batch_size:
        _check_batch_args(args)
    names = _method_names(args.methods)
    if UNQUANTIZED_REFERENCE in names and not args.quantize:
        raise UsageError(f"--methods: {UNQUANTIZED_REFERENCE} compares with a quantised pair: add --quantize, "
                         "or use hf_assisted")
    check_model(args.target, "--target")
    check_model(args.drafter, "--drafter")
    if set(OTHER_TOKENIZER_METHODS) & _bases(names):
        if not args.other_drafter:
            raise UsageError(f"--methods: {' and '.join(OTHER_TOKENIZER_METHODS)} need --other-drafter")
        check_model(args.other_drafter, "--other-drafter")
    if args.json:
        check_output_file(args.json, "--json")
    if args.plots:
        check_output_dir(args.plots, "--plots")
        require("matplotlib", "bench", "viasd bench --plots")
    if args.traces:
        check_output_dir(args.traces, "--traces")
        if any(_in_float32(name) for name in names):
            raise UsageError(f"--traces records the passes of the models loaded, not of the target's float32 copy: "
                             f"leave the {FLOAT32_TARGET_SUFFIX} methods out of --methods")
    examples = _examples(args)
    mask = mask_from("--mask", args.mask, args.target) if args.mask else known_mask(args.target, (args.drafter,))
    if mask is None and MASK_METHODS & _bases(names):
        raise UsageError(
            f"no routing mask is known for ({args.target}, {args.drafter}): pass --mask, find one with "
            f"`viasd search --target {args.target} --drafter {args.drafter}`, or leave viasd and viasd_lossless "
            "out of --methods"
        )
    self_mask = (
        mask_from("--self-draft-mask", args.self_draft_mask, args.target) if args.self_draft_mask
        else known_mask(args.target, ("self-drafter", "self"))
    )
    if self_mask is None and "self_spec" in names:
        raise UsageError(
            "self_spec needs a self-drafting mask for this target: pass --self-draft-mask, or find one with "
            "`viasd search --drafter self --skip-ratio 0.45`, or leave self_spec out of --methods"
        )
    return names, examples, mask, self_mask


def run_bench_command(args: argparse.Namespace) -> int:
    """Check the arguments, load the pair, run every method on every prompt, then save and print the figures."""
    # Here, not at the top: the scorers the runner imports (rouge_score, sacrebleu) take about a second to load.
    from viasd_hf.bench.runner import encode, full_model_agreement, machine_bandwidth_gb_s, run_methods, summarise
    from viasd_hf.bench.traces import CallTracer, decoding_models

    names, examples, mask, self_mask = check_bench_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.batch_size:
        return run_batch_sweep_command(args, examples, mask)
    quantized = _quantization(args)
    target, tokenizer = _load_role(args, "target", quantized)
    drafter, _ = _load_role(args, "drafter", quantized)
    made_before_timing(drafter)
    unquantized = None
    if UNQUANTIZED_REFERENCE in names:
        unquantized = (load_model(args.target, "bfloat16", "--target")[0], load_model(args.drafter, "bfloat16", "--drafter")[0])
    float32_target = None
    if any(_in_float32(name) for name in names):
        float32_target = load_model(args.target, "float32", "--target")[0]
    for flag, known in (("--mask", mask), ("--self-draft-mask", self_mask)):
        try:
            if known is not None:
                known.validate_for(target)
        except RoutingMaskError as error:
            raise UsageError(f"{flag}: {first_line(error)}") from None
    settings = MethodSettings(args.gamma, args.draft_threshold, args.cascade_lenience, args.prompt_lookup_tokens,
                              args.drafter_context)
    other_drafter = None
    if set(OTHER_TOKENIZER_METHODS) & _bases(names):
        other, other_tokenizer = load_model(args.other_drafter, args.dtype, "--other-drafter")
        other_drafter = (other, tokenizer, other_tokenizer)
    methods = MethodTable(target, drafter, mask, self_mask, settings, unquantized, float32_target,
                          other_drafter).build(names)
    tracer = CallTracer(args.traces, lambda: decoding_models(target, drafter)) if args.traces else None
    load = Load(args.load, args.load_workers or 1)
    runs = run_methods(methods, tokenizer, examples, args.max_new_tokens, args.repeats, args.temperature, tracer,
                       load.running())
    if drafting_copy(drafter) is not None:  # reported beside --quantize's choices: what our lossless decoders drafted with
        quantized["drafter, as VIA-SD drafts (its fastest form here)"] = resolve_drafting_form(drafter)
    weights = {name: _weight_bytes(float32_target if _in_float32(name) else target)
               + (_weight_bytes(drafter) if _bases([name]) & DRAFTER_METHODS else 0)
               + (_weight_bytes(other_drafter[0]) if _bases([name]) & set(OTHER_TOKENIZER_METHODS) else 0)
               for name in names}
    if unquantized:
        weights[UNQUANTIZED_REFERENCE] = sum(map(_weight_bytes, unquantized))
    full_agreement = None
    if args.temperature is None and not target.config.is_encoder_decoder:  # sampled tokens have no greedy choice to match
        prompts = [encode(tokenizer, example.prompt) for example in examples]
        full_agreement = full_model_agreement(target, prompts, {name: [o.tokens for o in r.outcomes] for name, r in runs.items()})
    summary = summarise(runs, examples, lambda tokens: tokenizer.decode(tokens, skip_special_tokens=True), weights,
                        full_agreement)
    env = environment(machine_bandwidth_gb_s(), load.record())
    if args.json:  # first, so that nothing printed below can lose the run
        report = _report(args, summary, env, examples, mask, self_mask, runs, tokenizer, quantized)
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(markdown(summary))
    print()
    print("Speed-up over greedy per task:")
    print(per_task_markdown(summary))
    slim_table = slim_tier_markdown(summary)
    if slim_table.count("\n") > 1:
        print("\nPer task: slim tier's agreement with the full model · escalation rate:")
        print(slim_table)
    print("\nWhere the time goes (our decoders, from their own timers):")
    print(time_markdown(summary))
    verdicts = verdict_lines(summary)
    if verdicts:
        print("\nThe slim tier after each task's last prompt, and why:")
        print("\n".join(verdicts))
    for role, choice in quantized.items():
        print(f"{role} quantised: {choice.scheme.name} ({choice.reason})")
    print(f"\n{env['cpu']} · {env['torch_threads']} threads · {load} · torch {env['torch']} · "
          f"{_dtypes(target, drafter)} · machine copy bandwidth {env['machine_bandwidth_gb_s']:.1f} GB/s · {env['date']}")
    if args.json:
        print(f"wrote {args.json}")
    if args.plots:
        for path in plots(summary, args.plots):
            print(f"wrote {path}")
    return 0


def run_batch_sweep_command(args: argparse.Namespace, examples: list[Example], mask: RoutingMask | None) -> int:
    """``--batch-size``: the pair, unquantised, on batches of each size; a table and (``--json``) a report."""
    from viasd_hf.bench.batches import batch_markdown, batch_report, run_batch_sweep
    from viasd_hf.bench.runner import encode, machine_bandwidth_gb_s

    target, tokenizer = _load_role(args, "target", {})
    drafter, _ = _load_role(args, "drafter", {})
    made_before_timing(drafter)
    if mask is not None:
        try:
            mask.validate_for(target)
        except RoutingMaskError as error:
            raise UsageError(f"--mask: {first_line(error)}") from None
    settings = MethodSettings(args.gamma, args.draft_threshold, args.cascade_lenience, args.prompt_lookup_tokens,
                              args.drafter_context)
    config = ViaSDConfig.paper(mode="lossless", routing_mask=mask, **settings.drafting())
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    prompts = [encode(tokenizer, example.prompt) for example in examples]
    load = Load(args.load, args.load_workers or 1)
    rows = run_batch_sweep(target, drafter, config, prompts, args.batch_size, args.max_new_tokens, pad, args.repeats,
                           load.running())
    env = environment(machine_bandwidth_gb_s(), load.record())
    if args.json:
        report = _run_record(args, env, examples) | {"batches": batch_report(rows)}
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    print(batch_markdown(rows))
    print(f"\n{len(prompts)} prompts · {env['cpu']} · {env['torch_threads']} threads · {load} · "
          f"torch {env['torch']} · {_dtypes(target, drafter)} · {env['date']}")
    if args.json:
        print(f"wrote {args.json}")
    return 0


def _report(args: argparse.Namespace, summary: dict, env: dict, examples: list[Example], mask: RoutingMask | None,
            self_mask: RoutingMask | None, runs: dict, tokenizer: Any,
            quantized: dict[str, QuantizationChoice]) -> dict[str, Any]:
    """Everything needed to check or redo the run: command, environment, masks, figures and every output."""
    return _run_record(args, env, examples) | {
        "quantization": {role: {"requested": choice.requested, "scheme": choice.scheme.name, "reason": choice.reason}
                         for role, choice in quantized.items()},
        "masks": {"routing_mask": mask.to_dict() if mask else None,
                  "self_draft_mask": self_mask.to_dict() if self_mask else None},
        "methods": summary,
        "outputs": {
            name: [
                {"task": e.task, "tokens": len(o.tokens), "seconds": s, "text": tokenizer.decode(o.tokens, skip_special_tokens=True)}
                for e, o, s in zip(examples, method_runs.outcomes, method_runs.seconds)
            ]
            for name, method_runs in runs.items()
        },
    }


def _run_record(args: argparse.Namespace, env: dict, examples: list[Example]) -> dict[str, Any]:
    """What every report starts with: the command and options that redo it, the machine, the prompts per task."""
    options = {key: value for key, value in vars(args).items() if key not in ("handler", "command")}
    return {
        "command": shlex.join(["viasd", *sys.argv[1:]]) if sys.argv[1:2] == ["bench"] else None,
        "options": options,
        "environment": env,
        "tasks": {task: sum(e.task == task for e in examples) for task in dict.fromkeys(e.task for e in examples)},
    }
