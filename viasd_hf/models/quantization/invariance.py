"""Whether a scheme is batch-invariant on this machine: measured once on one small layer, then cached.

Lossless VIA-SD scores a block of drafts in one pass of the target where plain decoding runs one
token per pass, so it equals plain decoding when a token's logits do not depend on how many tokens
share its pass. A quantised format can break that by design (LLM.int8() picks its outlier columns
per pass, ``torch.ao`` one activation scale per pass) or through the path its kernel takes on this
CPU for one row and for several (a fused one-row kernel, a dequantise-then-matmul one), which
differs between CPUs and library releases. So it is measured: the MLP of a one-layer model loaded
in the scheme runs a block of rows and each row alone. The scheme is batch-invariant when its rows
move with the block no more than those of the unquantised layer in the same dtype (not at all,
where those kernels are batch-invariant): then quantising adds no batch dependence of its own.
Verdicts are cached per CPU, thread count and library versions (:mod:`viasd_hf.models.machine`).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

from viasd_hf.models.machine import machine_key, read_record, record_path, write_record
from viasd_hf.models.quantization.probe import probe_checkpoint, probe_mlp
from viasd_hf.models.quantization.schemes import get_scheme, load_in

FORMAT = 1
# multiples of 128, like real models (torchao's int4 groups, whole bitsandbytes blocks); small enough to load in a second
PROBE = {"hidden_size": 512, "intermediate_size": 1024}
BLOCKS = range(2, 18)  # every block a verifying pass holds: up to 16 drafts after the last committed token
ACTIVATION_SCALE = 3.0  # some features of every row past LLM.int8()'s outlier threshold (6), different ones per row


@dataclass(frozen=True)
class Invariance:
    """``drift``: the largest change of an output when its row shares a pass with others, relative to the largest
    output; ``unquantised_drift``: the same for the unquantised layer in the scheme's dtype."""

    drift: float
    unquantised_drift: float

    @property
    def batch_invariant(self) -> bool:
        return self.drift <= self.unquantised_drift


@torch.no_grad()
def row_drift(mlp: nn.Module, dtype: torch.dtype) -> float:
    """How far a row's output moves when it shares a pass with others, relative to the largest output."""
    generator = torch.Generator().manual_seed(0)
    rows = torch.randn(1, max(BLOCKS), PROBE["hidden_size"], generator=generator) * ACTIVATION_SCALE
    rows = rows.to(dtype)
    alone = torch.cat([mlp(rows[:, i : i + 1]) for i in range(rows.shape[1])], dim=1).float()
    drift = max(float((mlp(rows[:, :n]).float() - alone[:, :n]).abs().max()) for n in BLOCKS)
    return drift / float(alone.abs().max())


def measure_invariance(scheme_name: str) -> Invariance:
    """The scheme's drift and the unquantised layer's, on the same rows."""
    scheme = get_scheme(scheme_name)
    with probe_checkpoint(**PROBE) as folder:
        drifts = [row_drift(probe_mlp(load_in(folder, form, scheme.dtype)), scheme.dtype) for form in (scheme, None)]
    return Invariance(*drifts)


def _cache_path() -> Path:
    return record_path({"format": FORMAT, "probe": PROBE, "blocks": list(BLOCKS), **machine_key()}, "batch-invariance")


def invariance(scheme_name: str, refresh: bool = False) -> Invariance:
    """:func:`measure_invariance`, read from the cache when this machine measured it before."""
    name = get_scheme(scheme_name).name
    path = _cache_path()
    record = read_record(path) or {}
    verdicts = record.get("schemes") if isinstance(record.get("schemes"), dict) else {}
    entry = verdicts.get(name)
    if not refresh and isinstance(entry, dict) and set(entry) == {"drift", "unquantised_drift"}:
        if all(isinstance(value, float) for value in entry.values()):
            return Invariance(**entry)
    measured = measure_invariance(name)  # not measured here yet, or an entry that cannot be read
    write_record(path, {"key": machine_key(), "schemes": verdicts | {name: asdict(measured)}})
    return measured


def batch_invariant(scheme_name: str) -> bool:
    """Whether a token's logits in ``scheme_name`` do not depend on the other tokens of its pass, on this machine,
    any more than unquantised ones do."""
    return invariance(scheme_name).batch_invariant
