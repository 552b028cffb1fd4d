"""GGUF files for engine=llamacpp: our checkpoints converted once to a float GGUF, then quantized by
llama.cpp's own `llama_model_quantize`; every file is cached under `<cache>/gguf/` by content hash.

Conversion reads the safetensors tensors directly (no HF model is built) and writes one of two llama.cpp
architectures (any other model_type is refused before launch, engine/engines/llamacpp/__init__.py):
- `llama`: its tensor names, and Q/K rows permuted from HF's rotate-half RoPE layout (first half / second
  half of each head) back to the interleaved pairs of llama.cpp's LLAMA rope (what llama.cpp's
  convert_hf_to_gguf.py `LlamaModel.permute` does).
- `gemma3` (HF `gemma3_text`), laid out as the Gemma 3 270M GGUF that ships in its packages: no Q/K
  permutation (llama.cpp runs Gemma's rope in NEOX = rotate-half order), every RMSNorm weight stored as
  (1 + w) (Gemma's norm multiplies by 1 + w, llama.cpp's by w), q/k norms and the post-attention /
  post-FFN norms, the sliding window with its own RoPE base, the embedding unscaled (llama.cpp multiplies
  by sqrt(hidden) itself), the LM head tied. What llama.cpp's gemma3 loader fixes rather than reads (the
  1/sqrt(head_dim) score scale) is checked against the checkpoint and refused where they differ.

Tokenizer metadata: a prepared model copies the `tokenizer.*` keys of the GGUF it shipped as (the file
stays usable by other llama.cpp tools); any other model gets llama.cpp's `none` vocabulary of the right
size, which is enough because the engine feeds token ids and never asks llama.cpp to tokenize.

Weight types (the quant axis): `none` writes `model.dtype` (F32 / F16 / BF16; 1-D norm weights stay F32,
as llama.cpp's converter keeps them); `gguf-q8_0`, `gguf-q4_0`, `gguf-q4_k_m` are quantized from the F32
file. Q4_K needs rows of 256 weights: llama.cpp falls back to another type for tensors whose rows are not
(SmolLM2's 576-wide rows), as its own quantize tool does.
"""
from __future__ import annotations

import ctypes
import dataclasses
import hashlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Callable, Optional

import numpy as np
import torch

from ...config import EngineError, ModelConfig
from ...model_facts import read_config_json
from ...models import (
    PREPARED_SCHEME,
    TINY_SCHEME,
    _sha256,
    cache_root,
    prepare_model,
    prepared_dir,
    source_gguf,
    tiny_checkpoint,
)

log = logging.getLogger(__name__)

SHIPPED = "gguf-shipped"  # quant.level: the prepared model's own GGUF, not converted (engine/engines/llamacpp)
EXPORT_VERSION = 2  # bump when the written file changes for the same source (2: BF16 tensors had half their shape)
# quant level -> (llama_ftype name in llama_cpp, file suffix)
GGUF_QUANT_FTYPES = {
    "gguf-q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", "Q8_0"),
    "gguf-q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "Q4_0"),
    "gguf-q4_k_m": ("LLAMA_FTYPE_MOSTLY_Q4_K_M", "Q4_K_M"),
}
FLOAT_TYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16"}

# HF Llama tensor name (after `model.layers.N.`) -> llama.cpp's (after `blk.N.`)
_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


@dataclasses.dataclass(frozen=True)
class Source:
    """A checkpoint directory and what identifies its content."""

    path: Path
    identity: dict
    tokenizer_gguf: Optional[Path] = None  # a GGUF whose tokenizer.* keys to copy


def source_of(spec: ModelConfig, say: Callable[[str], None]) -> Source:
    """The safetensors checkpoint behind `spec` (tiny:// and prepared:// are materialized first)."""
    if spec.path.startswith(TINY_SCHEME):
        return Source(tiny_checkpoint(spec.tiny), {"tiny": dataclasses.asdict(spec.tiny)})
    if spec.path.startswith(PREPARED_SCHEME):
        name = spec.path[len(PREPARED_SCHEME):]
        path = prepare_model(name, progress=say)
        marker = json.loads((prepared_dir(name) / "infersweep-prepared.json").read_text())
        return Source(path, {"prepared": name, "gguf_sha256": marker["gguf_sha256"]},
                      tokenizer_gguf=source_gguf(name, say))
    path = Path(spec.path)
    if not path.is_dir():
        try:  # a hub id: only what is already in the local HF cache (no downloads from a trial)
            from huggingface_hub import snapshot_download

            path = Path(snapshot_download(spec.path, revision=spec.revision, local_files_only=True))
        except Exception as e:
            raise EngineError(f"model.path {spec.path!r}: engine=llamacpp converts a local checkpoint directory; "
                              f"not found locally ({e})") from e
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise EngineError(f"model.path {spec.path!r}: no *.safetensors files to convert to GGUF")
    # a local directory has no name that pins its content: hash the bytes
    ident = {"config": (path / "config.json").read_text(), "files": {f.name: _sha256(f) for f in files}}
    return Source(path, ident)


def _cache_dir(identity: dict) -> Path:
    key = hashlib.sha256(json.dumps({"v": EXPORT_VERSION, "source": identity}, sort_keys=True).encode()).hexdigest()
    return cache_root() / "gguf" / key[:16]


def gguf_file(spec: ModelConfig, level: str, threads: int = 0, progress: Optional[Callable[[str], None]] = None,
              src: Optional[Source] = None) -> Path:
    """The GGUF of `spec` at weight type `level` (`none` = model.dtype, or a GGUF_QUANT_FTYPES key); made once.
    `src`: `source_of(spec)` when the caller has it already."""
    say = progress or (lambda msg: log.info(msg))
    if level == SHIPPED:
        if not spec.path.startswith(PREPARED_SCHEME):
            raise EngineError(f"quant.level {SHIPPED} runs a prepared model's own GGUF; {spec.path} is not prepared://")
        return source_gguf(spec.path[len(PREPARED_SCHEME):], say)
    if level != "none" and level not in GGUF_QUANT_FTYPES:
        raise EngineError(f"quant.level {level!r} is not a GGUF weight type; engine=llamacpp takes none, "
                          f"{', '.join(GGUF_QUANT_FTYPES)} or {SHIPPED}")
    src = src or source_of(spec, say)
    out_dir = _cache_dir(src.identity)
    base_type = FLOAT_TYPES["float32" if level != "none" else spec.dtype]
    base = out_dir / f"model-{base_type}.gguf"
    if not base.exists():
        say(f"converting {spec.name} to GGUF {base_type} ({out_dir})")
        t0 = time.perf_counter()
        _atomic(base, lambda tmp: convert(src, base_type, tmp))
        say(f"  wrote {base.name} ({base.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    if level == "none":
        return base
    from .library import lib

    ftype, suffix = GGUF_QUANT_FTYPES[level]
    # quantization is llama.cpp's code: another version may write other bytes
    out = out_dir / f"model-{suffix}-llamacpp{lib().__version__}.gguf"
    if not out.exists():
        say(f"quantizing {spec.name} to {suffix} with llama.cpp")
        t0 = time.perf_counter()
        _atomic(out, lambda tmp: quantize(base, tmp, ftype, threads))
        say(f"  wrote {out.name} ({out.stat().st_size / 1e6:.0f} MB) in {time.perf_counter() - t0:.1f} s")
    return out


def _atomic(path: Path, write: Callable[[Path], None]) -> None:
    """Concurrent trials may convert the same model: each writes its own temporary file, the rename wins."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def quantize(src: Path, out: Path, ftype: str, threads: int = 0) -> None:
    """llama.cpp's own quantizer (what its `llama-quantize` tool runs): `src` GGUF -> `out` at `ftype`."""
    from .library import lib

    cpp = lib()
    params = cpp.llama_model_quantize_default_params()
    params.ftype = getattr(cpp, ftype)
    params.nthread = threads if threads > 0 else torch.get_num_threads()
    rc = cpp.llama_model_quantize(str(src).encode(), str(out).encode(), ctypes.byref(params))
    if rc != 0:
        raise EngineError(f"llama.cpp failed to quantize {src.name} to {ftype} (code {rc})")


def _permute(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF rotate-half rows -> llama.cpp interleaved rows, per head."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# HF model_type -> the llama.cpp architecture it is written as
ARCHITECTURES = {"llama": "llama", "gemma3_text": "gemma3"}

# HF Gemma 3 tensor name (after `model.layers.N.`) -> llama.cpp's (after `blk.N.`); `*norm.weight` get 1 + w
_GEMMA3_LAYER_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "post_attention_norm.weight",
    "pre_feedforward_layernorm.weight": "ffn_norm.weight",
    "post_feedforward_layernorm.weight": "post_ffw_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def conversion_problem(cfg: dict) -> Optional[str]:
    """Why a checkpoint with this config.json cannot be converted (None: it can). Pure: validation asks it
    before launch."""
    try:
        _hparams(cfg)
    except EngineError as e:
        return str(e)
    return None


def _hparams(cfg: dict) -> dict:
    if cfg.get("model_type") not in ARCHITECTURES:
        raise EngineError(f"engine=llamacpp converts the Llama and Gemma 3 architectures only (model_type "
                          f"{' or '.join(map(repr, ARCHITECTURES))}); this one is {cfg.get('model_type')!r} "
                          f"(architectures {cfg.get('architectures')}). Use engine=hf or engine=native for it")
    if cfg["model_type"] == "gemma3_text":
        return _gemma3_hparams(cfg)
    rope = cfg.get("rope_parameters") or {}
    scaling = cfg.get("rope_scaling") or rope
    if scaling.get("rope_type", scaling.get("type", "default")) not in ("default", None):
        raise EngineError(f"engine=llamacpp: RoPE scaling {scaling.get('rope_type') or scaling.get('type')!r} is not "
                          "converted (plain RoPE only)")
    if cfg.get("attention_bias") or cfg.get("mlp_bias"):
        raise EngineError("engine=llamacpp: Llama checkpoints with attention/MLP biases are not converted")
    n_head = int(cfg["num_attention_heads"])
    return dict(
        n_layer=int(cfg["num_hidden_layers"]),
        n_embd=int(cfg["hidden_size"]),
        n_ff=int(cfg["intermediate_size"]),
        n_head=n_head,
        n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // n_head),
        n_ctx=int(cfg.get("max_position_embeddings") or 2048),
        rope_theta=float(cfg.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        rms_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", False)),
    )


def _gemma3_hparams(cfg: dict) -> dict:
    """Gemma 3's shape and what llama.cpp's gemma3 graph needs of it (config.json as transformers 4.5x
    writes it, `rope_theta` + `rope_local_base_freq`, or as 5.x does, `rope_parameters` per layer type)."""
    n_layer, n_head = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or 256)
    rope = cfg.get("rope_parameters") or {}
    if "full_attention" in rope:
        full, local = rope["full_attention"], rope.get("sliding_attention") or {}
    else:
        full = dict(rope or cfg.get("rope_scaling") or {}, rope_theta=cfg.get("rope_theta", 1e6))
        local = {"rope_type": "default", "rope_theta": cfg.get("rope_local_base_freq", 10000.0)}
    if local.get("rope_type", "default") != "default":
        raise EngineError(f"engine=llamacpp: RoPE scaling {local.get('rope_type')!r} on Gemma 3's sliding layers is "
                          "not converted (llama.cpp scales the global layers only)")
    kind = full.get("rope_type", full.get("type", "default")) or "default"
    if kind not in ("default", "linear"):
        raise EngineError(f"engine=llamacpp: Gemma 3 RoPE scaling {kind!r} is not converted (default or linear)")
    scalar = cfg.get("query_pre_attn_scalar") or head_dim
    if float(scalar) != float(head_dim):
        # llama.cpp's gemma3 graph scales scores by 1/sqrt(head_dim), 1/sqrt(hidden/heads) for the 62-layer 27B
        raise EngineError(f"engine=llamacpp: Gemma 3 with query_pre_attn_scalar={scalar} (scores scaled by "
                          f"{scalar}**-0.5): llama.cpp's gemma3 graph fixes the scale at head_dim**-0.5 ({head_dim})")
    if cfg.get("attn_logit_softcapping"):
        raise EngineError("engine=llamacpp: Gemma 3 with attn_logit_softcapping is not converted (llama.cpp's "
                          "gemma3 graph has none)")
    window = int(cfg.get("sliding_window") or 0)
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        == 0 else "sliding_attention" for i in range(n_layer)]
    types = list(types)[:n_layer]
    pattern = _swa_pattern(types) if window else 0
    if window and pattern is None:
        raise EngineError(f"engine=llamacpp: Gemma 3 layer_types {types} are not a repeating pattern of sliding "
                          "layers followed by one global layer, the only layout llama.cpp's gemma3 graph runs")
    return dict(
        arch="gemma3",
        n_layer=n_layer,
        n_embd=int(cfg["hidden_size"]),
        n_ff=int(cfg["intermediate_size"]),
        n_head=n_head,
        n_head_kv=int(cfg.get("num_key_value_heads") or n_head),
        head_dim=head_dim,
        n_ctx=int(cfg.get("max_position_embeddings") or 32768),
        rope_theta=float(full.get("rope_theta") or 1e6),
        rope_theta_swa=float(local.get("rope_theta") or 10000.0),
        rope_linear=float(full.get("factor", 1.0)) if kind == "linear" else None,
        rms_eps=float(cfg.get("rms_norm_eps") or 1e-6),
        vocab=int(cfg["vocab_size"]),
        tied=bool(cfg.get("tie_word_embeddings", True)),
        window=window,
        swa_pattern=pattern,
        softcap=float(cfg.get("final_logit_softcapping") or 0.0),
    )


def _swa_pattern(types: list) -> Optional[int]:
    """n where layer i is global iff i % n == n - 1 (llama.cpp's `set_swa_pattern(n)`); n = len + 1 when
    every layer is windowed (never global); None when `types` follow no such period."""
    for n in range(1, len(types) + 2):
        if all((t == "full_attention") == (i % n == n - 1) for i, t in enumerate(types)):
            return n
    return None


def _tensors(path: Path):
    """name -> a loader of that tensor, over every safetensors file of the checkpoint."""
    from safetensors import safe_open

    out = {}
    for f in sorted(path.glob("*.safetensors")):
        handle = safe_open(str(f), framework="pt")
        for name in handle.keys():
            out[name] = (lambda h, n: lambda: h.get_tensor(n))(handle, name)
    return out


def convert(src: Source, ftype: str, out: Path) -> None:
    """Write `src` as a GGUF of float type `ftype` (F32 | F16 | BF16) to `out`."""
    import gguf

    cfg = read_config_json(str(src.path))  # the one reader of config.json, its shape fields type-checked
    hp = _hparams(cfg)
    tensors = _tensors(src.path)
    gemma = hp.get("arch") == "gemma3"
    w = gguf.GGUFWriter(str(out), hp.get("arch", "llama"))
    w.add_name(src.path.name)
    w.add_context_length(hp["n_ctx"])
    w.add_embedding_length(hp["n_embd"])
    w.add_block_count(hp["n_layer"])
    w.add_feed_forward_length(hp["n_ff"])
    w.add_head_count(hp["n_head"])
    w.add_head_count_kv(hp["n_head_kv"])
    w.add_rope_freq_base(hp["rope_theta"])
    w.add_layer_norm_rms_eps(hp["rms_eps"])
    w.add_vocab_size(hp["vocab"])
    if gemma:  # keys as the shipped Gemma 3 GGUF has them, plus what a non-default config needs
        w.add_sliding_window(hp["window"])
        if hp["window"]:
            w.add_key_value(gguf.Keys.Attention.SLIDING_WINDOW_PATTERN.format(arch="gemma3"), hp["swa_pattern"],
                            gguf.GGUFValueType.UINT32)
            w.add_key_value(gguf.Keys.Rope.FREQ_BASE_SWA.format(arch="gemma3"), hp["rope_theta_swa"],
                            gguf.GGUFValueType.FLOAT32)
        if hp["rope_linear"]:
            w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            w.add_rope_scaling_factor(hp["rope_linear"])
        if hp["softcap"]:
            w.add_final_logit_softcapping(hp["softcap"])
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    else:
        w.add_rope_dimension_count(hp["head_dim"])
    if not gemma and hp["head_dim"] != hp["n_embd"] // hp["n_head"]:
        w.add_key_length(hp["head_dim"])
        w.add_value_length(hp["head_dim"])
    w.add_file_type({"F32": gguf.LlamaFileType.ALL_F32, "F16": gguf.LlamaFileType.MOSTLY_F16,
                     "BF16": gguf.LlamaFileType.MOSTLY_BF16}[ftype])
    _add_tokenizer(w, src, hp["vocab"])

    def add(name: str, t: torch.Tensor) -> None:
        a = t.detach().to(torch.float32).contiguous().numpy()
        if a.ndim == 1 or ftype == "F32":  # norms stay F32, as in llama.cpp's converter
            w.add_tensor(name, a)
        elif ftype == "F16":
            w.add_tensor(name, a.astype(np.float16))
        else:  # gguf-py packs BF16 as raw bytes (uint8, two per weight) and derives the shape from their byte
            # shape: passing the weights' own shape as raw_shape halved each row in the header (llama.cpp then
            # found every later tensor at twice its expected offset)
            w.add_tensor(name, gguf.quants.quantize(a, gguf.GGMLQuantizationType.BF16),
                         raw_dtype=gguf.GGMLQuantizationType.BF16)

    def get(name: str) -> torch.Tensor:
        if name not in tensors:
            raise EngineError(f"engine=llamacpp: tensor {name!r} missing from the checkpoint {src.path}")
        return tensors[name]()

    add("token_embd.weight", get("model.embed_tokens.weight"))
    if gemma:
        for i in range(hp["n_layer"]):
            for hf_name, cpp_name in _GEMMA3_LAYER_TENSORS.items():
                t = get(f"model.layers.{i}.{hf_name}")
                add(f"blk.{i}.{cpp_name}", t.float() + 1 if hf_name.endswith("norm.weight") else t)
        add("output_norm.weight", get("model.norm.weight").float() + 1)
        if not hp["tied"]:
            add("output.weight", get("lm_head.weight"))
        _finish(w)
        return
    for i in range(hp["n_layer"]):
        for hf_name, cpp_name in _LAYER_TENSORS.items():
            t = get(f"model.layers.{i}.{hf_name}")
            if hf_name == "self_attn.q_proj.weight":
                t = _permute(t, hp["n_head"])
            elif hf_name == "self_attn.k_proj.weight":
                t = _permute(t, hp["n_head_kv"])
            add(f"blk.{i}.{cpp_name}", t)
    add("output_norm.weight", get("model.norm.weight"))
    if not hp["tied"]:  # tied: llama.cpp reuses token_embd as the output projection
        add("output.weight", get("lm_head.weight"))
    _finish(w)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def _add_tokenizer(w, src: Source, vocab: int) -> None:
    import gguf

    if src.tokenizer_gguf is None:
        w.add_tokenizer_model("none")  # `vocab_size` dummy tokens: ids in, logits out
        return
    reader = gguf.GGUFReader(str(src.tokenizer_gguf))
    for key, field in reader.fields.items():
        if not key.startswith("tokenizer."):
            continue
        vtype = gguf.GGUFValueType(field.types[0])
        sub = gguf.GGUFValueType(field.types[1]) if vtype == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, field.contents(), vtype, sub)
    tokens = reader.fields.get("tokenizer.ggml.tokens")
    if tokens is not None and len(tokens.data) != vocab:
        raise EngineError(f"{src.tokenizer_gguf.name} has {len(tokens.data)} tokens, the checkpoint {vocab}")
