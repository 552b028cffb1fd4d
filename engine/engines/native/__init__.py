"""Backend `native`: a compact Llama-family runtime (gpt-fast / nano-vllm style).

One concept per file:
  rope.py           rotary position embedding, incl. the checkpoint's rope scaling
  support.py        which models it can run, from their config alone (shared with validation)
  model.py          the decoder (RMSNorm, GQA attention block, SwiGLU), weights shared with the HF model
  attention.py      attention kernels: eager | sdpa | flash, with transient-memory accounting
  block_manager.py  pure-Python ref-counted block allocator (paged KV cache, later prefix caching)
  kv_cache.py       KV cache layouts: contiguous (static per sequence) and paged (block pool + block table)
  backend.py        NativeBackend / NativeSession: the engine's Backend protocol on top of the above
"""
