"""This machine, as the verdicts measured on it are keyed, and where those verdicts are kept.

Which kernel is fastest, and whether it is batch-invariant, depends on the CPU's instruction set,
the thread count and the library versions, so such facts are measured here, never hard-coded, and
cached as JSON under ``$VIASD_HOME/quantization``: another machine, or an upgrade, measures anew.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import platform
from pathlib import Path
from typing import Any

import torch

from viasd_hf.hub.files import viasd_home

_CPU_FLAGS = (
    "avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_bf16", "amx_fp16", "amx_int8",
    "asimd", "asimdhp", "sve", "bf16", "fphp",
)  # fmt: skip
_NATIVE_FP16 = ("avx512_fp16", "amx_fp16", "asimdhp")
# oneDNN's cap on the instructions it may use (its documented variable, and the older name); bf16 matrix
# products stay native only under a cap that includes AVX512-BF16 or AMX
_ONEDNN_CAP_VARIABLES = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA")
_ONEDNN_BF16_CAPS = ("ALL", "DEFAULT", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX", "AVX512_CORE_AMX_FP16",
                     "AVX10_1_512", "AVX10_1_512_AMX", "AVX10_1_512_AMX_FP16", "AVX10_2_512", "AVX10_2_512_AMX_2")
LIBRARIES = ("torch", "transformers", "bitsandbytes", "torchao")


def cpu_identity() -> dict[str, Any]:
    """The CPU model and the instruction-set extensions quantised and half-precision kernels dispatch on."""
    info: dict[str, str] = {}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    flags = set(info.get("flags", info.get("Features", "")).split())
    model = info.get("model name") or platform.processor() or platform.machine()
    ids = [info.get(k) for k in ("cpu family", "model", "stepping")]
    return {"model": model, "id": "/".join(i for i in ids if i), "flags": sorted(flags.intersection(_CPU_FLAGS)),
            "cpus": os.cpu_count()}  # fmt: skip


def kernel_caps() -> dict[str, str | None]:
    """What this process lets the kernels use, which the CPU flags do not say: ATen's vector level
    (``$ATEN_CPU_CAPABILITY`` can lower it) and oneDNN's instruction cap (``$ONEDNN_MAX_CPU_ISA``)."""
    onednn = next((os.environ[name] for name in _ONEDNN_CAP_VARIABLES if os.environ.get(name)), None)
    return {"aten": torch.backends.cpu.get_cpu_capability(), "onednn": onednn.upper() if onednn else None}


def native_bf16() -> bool:
    """Whether the CPU multiplies bf16 matrices itself (AVX512-BF16 or AMX) and oneDNN may use it; elsewhere
    bf16 products are emulated."""
    onednn = kernel_caps()["onednn"]
    allowed = onednn is None or onednn in _ONEDNN_BF16_CAPS
    return allowed and bool({"avx512_bf16", "amx_bf16"} & set(cpu_identity()["flags"]))


def emulated_bf16(model: torch.nn.Module) -> bool:
    """Whether ``model`` runs bf16 matrix products that this CPU emulates: a pass over k new tokens then costs about k
    one-token passes, so verifying a draft saves nothing, while a float32 model verifies several tokens natively."""
    return model.dtype == torch.bfloat16 and model.device.type == "cpu" and not native_bf16()


def native_fp16() -> bool:
    """Whether the CPU computes in float16 itself; elsewhere fp16 matmuls convert to float32 and are slow."""
    return any(flag in cpu_identity()["flags"] for flag in _NATIVE_FP16)


def library_version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine_key() -> dict[str, Any]:
    """The CPU, the kernels' caps, torch's thread count and the library versions: what a kernel's behaviour may
    depend on."""
    return {"cpu": cpu_identity(), "kernels": kernel_caps(), "threads": torch.get_num_threads(),
            "versions": {p: library_version(p) for p in LIBRARIES}}  # fmt: skip


def record_path(key: dict[str, Any], stem: str) -> Path:
    """``$VIASD_HOME/quantization/<stem>-<hash of key>.json``."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    safe = "".join(c if c.isalnum() or c in "-._" else "_" for c in stem)
    return viasd_home() / "quantization" / f"{safe}-{digest}.json"


def read_record(path: Path) -> dict[str, Any] | None:
    """The JSON object at ``path``; None when there is none or it cannot be read (cut short, edited by hand),
    so the caller measures again instead of failing."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) else None


def write_record(path: Path, record: dict[str, Any]) -> None:
    """Written whole or not at all (a partial file, then a rename), so a concurrent reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(f".partial-{os.getpid()}")
    partial.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(partial, path)
