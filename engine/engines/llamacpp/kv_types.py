"""llama.cpp's K/V cache element types (`kv_cache.dtype` on engine=llamacpp)."""

# bytes per element (ggml blocks: q8_0 34 B per 32 values, q4_0 18 B per 32)
KV_TYPE_BYTES = {"f32": 4.0, "f16": 2.0, "q8_0": 34 / 32, "q4_0": 18 / 32}
KV_GGML_TYPES = {"f32": "GGML_TYPE_F32", "f16": "GGML_TYPE_F16", "q8_0": "GGML_TYPE_Q8_0", "q4_0": "GGML_TYPE_Q4_0"}
DEFAULT_KV_TYPE = "f16"  # llama.cpp's own default (kv_cache.dtype=auto)
QUANTIZED_KV = ("q8_0", "q4_0")  # a quantized V cache needs flash attention
KV_CACHE_DTYPES = ("auto",) + tuple(KV_TYPE_BYTES)  # the kv_cache.dtype values engine=llamacpp honours


def kv_type(dtype: str) -> str:
    """The llama.cpp type that `kv_cache.dtype` names (auto: llama.cpp's default)."""
    return DEFAULT_KV_TYPE if dtype == "auto" else dtype
# the ggml type numbers llama-cpp-python's server takes for --type_k / --type_v (ggml's enum: part of its ABI)
KV_GGML_IDS = {"f32": 0, "f16": 1, "q4_0": 2, "q8_0": 8}
