"""Backend `hf`: the transformers model's own forward, driven by our decode loop so each token is timed.

KV cache `contiguous` uses transformers' `DynamicCache` (one growing tensor per layer); `off` recomputes
the whole sequence every step (the O(n^2) baseline). Paged caches are the native backend's.
"""
from __future__ import annotations

import torch

from ...config import EngineError, TrialConfig
from ...models import LoadedModel, weights_bytes

SUPPORTED_KV = ("off", "contiguous")


def cache_kwarg(model) -> str:
    """The name under which `model.forward` takes its KV cache: `cache` in current transformers (5.25 renamed it
    and warns -- a FutureWarning, removal in 5.40 -- on the old name), `past_key_values` in the earlier 5.x
    releases the project's pin allows. Asked of the signature, so neither name is passed where it would be
    swallowed by `**kwargs` and silently ignored (the model would then decode with an empty cache)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _additive(allowed: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[N, N] bool -> [1, 1, N, N] additive mask in the model's dtype (eager attention adds it to the scores)."""
    zero = torch.zeros((), dtype=dtype, device=allowed.device)
    return torch.where(allowed, zero, torch.finfo(dtype).min)[None, None]


def tree_attention_mask(config, pack, dtype: torch.dtype):
    """The attention mask of a tree row for a transformers model: one [1, 1, N, N] mask, or one per layer type
    where the config has sliding-window layers (`layer_types`: Gemma 3); a model whose every layer slides
    (Mistral's `sliding_window` without layer types) gets the window in its one mask. transformers returns a
    custom 4-D mask as given, so the window is ours to apply."""
    window = getattr(config, "sliding_window", None)
    if window and pack.longest_span() <= window:
        window = None  # no query looks back that far
    types = set(getattr(config, "layer_types", None) or ())
    if window and "sliding_attention" in types:
        return {t: _additive(pack.mask(window if t == "sliding_attention" else None), dtype) for t in types}
    if window and not types:
        return _additive(pack.mask(window), dtype)
    return _additive(pack.mask(None), dtype)  # no window, or layer types that are all full attention


class HFSession:
    def __init__(self, model, batch_size: int, max_len: int, use_cache: bool):
        self._model = model
        self._use_cache = use_cache
        self._max_len = max_len
        self._batch_size = batch_size
        self._tokens: torch.Tensor | None = None  # [B, L] every token so far (needed when cache is off)
        self._cache = None
        if use_cache:
            from transformers import DynamicCache

            self._cache = DynamicCache(config=model.config)
            self._cache_kwarg = cache_kwarg(model)

    @property
    def length(self) -> int:
        return 0 if self._tokens is None else int(self._tokens.shape[1])

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        assert tokens.dim() == 2 and tokens.shape[0] == self._batch_size, tokens.shape
        start = self.length
        if start + tokens.shape[1] > self._max_len:
            raise EngineError(f"sequence would exceed the session's max_len {self._max_len}")
        self._tokens = tokens if self._tokens is None else torch.cat([self._tokens, tokens], dim=1)
        n_new = tokens.shape[1]
        with torch.inference_mode():
            if self._use_cache:
                pos = torch.arange(start, start + n_new, device=tokens.device)
                out = self._model(
                    input_ids=tokens,
                    **{self._cache_kwarg: self._cache},
                    use_cache=True,
                    cache_position=pos,
                    position_ids=pos.unsqueeze(0).expand(tokens.shape[0], -1),
                )
                return out.logits.float()
            out = self._model(input_ids=self._tokens, use_cache=False, logits_to_keep=n_new)
            return out.logits.float()

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.forward(tokens)[:, -1]

    def rollback(self, num_tokens: int) -> None:
        if num_tokens <= 0:
            return
        assert self._tokens is not None and num_tokens <= self.length
        self._tokens = self._tokens[:, : self.length - num_tokens]
        if self._cache is not None:
            self._cache.crop(-num_tokens)  # transformers 5: a negative value removes that many tokens

    def kv_cache_bytes(self) -> tuple[int, int]:
        if self._cache is None:
            return (0, 0)
        total = 0
        for layer in getattr(self._cache, "layers", []):
            for t in (getattr(layer, "keys", None), getattr(layer, "values", None)):
                if isinstance(t, torch.Tensor):
                    total += t.numel() * t.element_size()
        return (total, total)


class HFBackend:
    name = "hf"

    def __init__(self, loaded: LoadedModel, trial: TrialConfig):
        if trial.kv_cache.mode not in SUPPORTED_KV:
            raise EngineError(
                f"backend hf supports kv_cache {SUPPORTED_KV}, not {trial.kv_cache.mode!r} (use engine.backend=native)"
            )
        self.loaded = loaded
        self.trial = trial
        self._model = loaded.model
        if trial.engine.compile:
            self._model.forward = torch.compile(self._model.forward, dynamic=True)

    def new_session(self, batch_size: int, max_len: int) -> HFSession:
        return HFSession(self._model, batch_size, max_len, use_cache=self.trial.kv_cache.mode != "off")

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        with torch.inference_mode():
            return self._model(input_ids=input_ids, use_cache=False).logits.float()

    @property
    def scores_trees(self) -> bool:
        """A custom 4-D mask reaches eager and sdpa attention as given; flash-attention kernels take none."""
        return self._model.config._attn_implementation in ("eager", "sdpa")

    def score_tree(self, pack) -> torch.Tensor:
        """One row of context-shared trees (engine/engines/packing.py) through the model's own forward: an
        additive 4-D mask (per layer type where the model has sliding-window layers: `sliding_window_masks`),
        the row's positions, and logits only at `pack.rows` (transformers' logits_to_keep)."""
        with torch.inference_mode():
            out = self._model(input_ids=pack.ids[None], position_ids=pack.positions[None],
                              attention_mask=tree_attention_mask(self._model.config, pack, self._model.dtype),
                              logits_to_keep=pack.rows, use_cache=False)
            return out.logits[0].float()

    def weights_bytes(self) -> int:
        return weights_bytes(self._model)
