"""Accuracy of a (possibly optimized) model: teacher-forced perplexity over the evaluation text, and
fidelity against the unoptimized reference of the same model (KL divergence, top-1 agreement)."""
from __future__ import annotations

import hashlib
import io
import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Protocol, Union

import torch

log = logging.getLogger(__name__)


class Backend(Protocol):
    """Anything that scores windows by full logits: `score(input_ids [B, T]) -> logits [B, T, V]`."""

    def score(self, input_ids: torch.Tensor) -> torch.Tensor: ...


@dataclass
class TopkScores:
    """Window scores an engine gives only as top-k log-probabilities (vLLM's prompt logprobs):
    idx/logp [W, T-1, k] of the next token at each position, target_logp [W, T-1] of the actual one."""

    idx: torch.Tensor
    logp: torch.Tensor
    target_logp: torch.Tensor


WindowScores = Union[Backend, TopkScores]


def window_nll(backend: Backend, window: torch.Tensor) -> tuple[float, int]:
    """Sum of next-token NLL over one window [T] and the number of predicted tokens (T-1)."""
    logits = backend.score(window[None])[0, :-1]  # [T-1, V]
    logp = torch.log_softmax(logits.float(), dim=-1)
    nll = -logp.gather(-1, window[1:, None]).squeeze(-1)
    return float(nll.sum()), int(nll.numel())


def perplexity(backend: Backend, windows: torch.Tensor) -> dict[str, float]:
    """windows [W, T] -> {'ppl', 'nll_mean'}; windows are scored one at a time to bound memory."""
    total, count = 0.0, 0
    for w in windows:
        s, n = window_nll(backend, w)
        total += s
        count += n
    nll = total / count
    return {"ppl": math.exp(nll), "nll_mean": nll}


def perplexity_of(scores: WindowScores, windows: torch.Tensor) -> dict[str, float]:
    """`perplexity` from either kind of window scores."""
    if isinstance(scores, TopkScores):
        nll = float((-scores.target_logp.double()).mean())
        return {"ppl": math.exp(nll), "nll_mean": nll}
    return perplexity(scores, windows)


def fidelity_of(scores: WindowScores, windows: torch.Tensor, ref: "ReferenceStats",
                top1: Optional[list] = None) -> dict[str, float]:
    """`fidelity` from either kind of window scores (top-k ones through `fidelity_from_topk`); `top1`, where
    given, receives each window's argmax token per position ([T-1] int64 tensors)."""
    if isinstance(scores, TopkScores):
        return fidelity_from_topk(scores.idx, scores.logp, scores.target_logp, ref, top1)
    return fidelity(scores, windows, ref, top1)


# --- fidelity against the unoptimized reference (llama.cpp's KL-divergence style) ----------------------
#
# The reference's full distributions are too big to keep (T x 49152 floats per window), so it keeps the
# top-K log-probs per position and the rest of the mass as one "tail" bucket. KL over those K+1 buckets
# is a lower bound of the full KL (merging outcomes never increases KL) and is exact (0) when both
# distributions are identical; with K=256 the tail holds a negligible share of the mass.

FIDELITY_VERSION = 1


@dataclass
class ReferenceStats:
    topk_logp: torch.Tensor  # [W, T-1, K] float32, reference log-probs of its top-K tokens, descending
    topk_idx: torch.Tensor  # [W, T-1, K] int32, those tokens
    target_nll: torch.Tensor  # [W, T-1] float32, reference NLL of the actual next tokens

    @property
    def ppl(self) -> float:
        return math.exp(float(self.target_nll.double().mean()))


def compute_reference(backend: Backend, windows: torch.Tensor, topk: int) -> ReferenceStats:
    """windows [W, T] -> the reference's top-K next-token log-probs at every position."""
    logps, idxs, nlls = [], [], []
    for w in windows:
        logp = torch.log_softmax(backend.score(w[None])[0, :-1].float(), dim=-1)  # [T-1, V]
        top = torch.topk(logp, min(topk, logp.shape[-1]), dim=-1)
        logps.append(top.values)
        idxs.append(top.indices.to(torch.int32))
        nlls.append(-logp.gather(-1, w[1:, None]).squeeze(-1))
    return ReferenceStats(torch.stack(logps), torch.stack(idxs), torch.stack(nlls))


def _tail(logp_topk: torch.Tensor) -> torch.Tensor:
    """log of the probability mass outside the top-K buckets, [..., 1] (clamped away from log 0)."""
    mass = (1.0 - logp_topk.double().exp().sum(-1, keepdim=True)).clamp(min=1e-12)
    return mass.log()


def fidelity(backend: Backend, windows: torch.Tensor, ref: ReferenceStats,
             top1: Optional[list] = None) -> dict[str, float]:
    """KL(reference || candidate) per position, top-1 agreement and perplexity of the candidate; `top1`, where
    given, receives the candidate's argmax per position of each window (what compares two candidates directly:
    optimize's fidelity pre-screen)."""
    kls, diffs, agree, nll_sum, count = [], [], 0, 0.0, 0
    for i, w in enumerate(windows):
        logq = torch.log_softmax(backend.score(w[None])[0, :-1].float(), dim=-1)  # [T-1, V]
        logp_k = ref.topk_logp[i].double()  # [T-1, K]
        logq_k = logq.gather(-1, ref.topk_idx[i].long()).double()
        kl = (logp_k.exp() * (logp_k - logq_k)).sum(-1)
        p_tail, q_tail = _tail(ref.topk_logp[i]), _tail(logq_k.float())
        kl = kl + (p_tail.exp() * (p_tail - q_tail)).squeeze(-1)
        kls.append(kl.clamp(min=0.0))
        arg = logq.argmax(-1)
        agree += int((arg == ref.topk_idx[i, :, 0].long()).sum())
        if top1 is not None:
            top1.append(arg.cpu())
        nll = -logq.gather(-1, w[1:, None]).squeeze(-1)
        nll_sum += float(nll.double().sum())
        count += nll.numel()
        diffs.append(nll.double() - ref.target_nll[i].double())
    return _summary(kls, agree, nll_sum, count, ref, diffs)


def mean_stderr(x: torch.Tensor) -> float:
    """Standard error of the mean of the samples `x`, as llama.cpp's `mean_and_uncertainty`: the sample
    standard deviation / sqrt(n) (= sqrt(population variance / (n - 1))); 0 for fewer than 2 samples."""
    n = x.numel()
    if n < 2:
        return 0.0
    x = x.double()
    return math.sqrt(float(((x - x.mean()) ** 2).sum()) / (n - 1) / n)


def _summary(kls: list[torch.Tensor], agree: int, nll_sum: float, count: int, ref: ReferenceStats,
             diffs: list[torch.Tensor]) -> dict[str, float]:
    """The fidelity metrics from per-window KL [T-1] tensors, top-1 matches, the candidate's summed NLL, the
    number of positions and the per-window differences candidate NLL - reference NLL of each actual next token
    [T-1] (= log p_ref - log p_cand). Errors as llama.cpp's `--kl-divergence` reports them: the KL's and the
    ln-ratio's standard error of the mean over positions, the same-top-1 rate's binomial sqrt(p(1-p)/(n-1)),
    and the ppl ratio's by the delta method, ratio x stderr(mean difference). Positions of one window are not
    independent, so these errors are lower bounds, as llama.cpp's are."""
    allkl = torch.cat(kls)
    cand_nll = nll_sum / count
    quarter = max(1, kls[0].numel() // 4)  # positions per quarter window (all windows have one length)
    top1 = agree / count
    ratio = math.exp(cand_nll) / ref.ppl
    return {
        "kl_div_mean": float(allkl.mean()),
        "kl_div_mean_stderr": mean_stderr(allkl),
        "kl_div_early": float(torch.cat([k[:quarter] for k in kls]).mean()),
        "kl_div_late": float(torch.cat([k[-quarter:] for k in kls]).mean()),
        "kl_div_p99": float(torch.quantile(allkl, 0.99)),
        "kl_div_p999": float(torch.quantile(allkl, 0.999)),
        "kl_div_max": float(allkl.max()),
        "top1_agreement": top1,
        "top1_agreement_stderr": math.sqrt(top1 * (1.0 - top1) / (count - 1)) if count > 1 else 0.0,
        "ppl": math.exp(cand_nll),
        "nll_mean": cand_nll,
        "ppl_ratio": ratio,
        "ppl_ratio_stderr": ratio * mean_stderr(torch.cat(diffs)),
    }


def fidelity_from_topk(cand_idx: torch.Tensor, cand_logp: torch.Tensor, cand_target_logp: torch.Tensor,
                       ref: ReferenceStats, top1: Optional[list] = None) -> dict[str, float]:
    """`fidelity` for a candidate seen only through its own top-k log-probs (engine=vllm: vLLM returns
    prompt log-probs, not logits). cand_idx / cand_logp [W, T-1, k] (descending), cand_target_logp [W, T-1]
    = the candidate's log-prob of each actual next token.

    Approximation: a reference top-K token absent from the candidate's top-k has no known candidate
    log-prob, so it joins the tail bucket. KL is then taken over a coarser partition -- the tokens in both
    top sets, one by one, plus one tail -- which is still a lower bound of the full KL and 0 when the
    distributions are identical, and equals `fidelity`'s K+1-bucket KL when the candidate's top-k contains
    the reference's top-K (asked with k = K, near-identical distributions share nearly all of it). ppl and
    top-1 agreement are exact."""
    kls, diffs, agree, nll_sum, count = [], [], 0, 0.0, 0
    for i in range(ref.topk_logp.shape[0]):
        ridx = ref.topk_idx[i].long()  # [T-1, K]
        logp_k = ref.topk_logp[i].double()
        cidx, clogp = cand_idx[i].long(), cand_logp[i].double()  # [T-1, k]
        hit = ridx[:, :, None] == cidx[:, None, :]  # [T-1, K, k]
        found = hit.any(-1)  # [T-1, K]
        logq_k = torch.where(hit, clogp[:, None, :], torch.zeros((), dtype=torch.float64)).sum(-1)
        p_in = torch.where(found, logp_k.exp(), torch.zeros((), dtype=torch.float64))
        q_in = torch.where(found, logq_k.exp(), torch.zeros((), dtype=torch.float64))
        kl = torch.where(found, p_in * (logp_k - logq_k), torch.zeros((), dtype=torch.float64)).sum(-1)
        p_tail = (1.0 - p_in.sum(-1)).clamp(min=1e-12)
        q_tail = (1.0 - q_in.sum(-1)).clamp(min=1e-12)
        kl = kl + p_tail * (p_tail.log() - q_tail.log())
        kls.append(kl.clamp(min=0.0))
        agree += int((cidx[:, 0] == ridx[:, 0]).sum())
        if top1 is not None:
            top1.append(cidx[:, 0].cpu())
        nll_sum += float(-cand_target_logp[i].double().sum())
        count += cand_target_logp[i].numel()
        diffs.append(-cand_target_logp[i].double() - ref.target_nll[i].double())
    return _summary(kls, agree, nll_sum, count, ref, diffs)


class ReferenceCache:
    """Reference stats on the worker's disk, keyed by content hash; corrupt entries are recomputed.

    Location: `<INFERSWEEP_CACHE or ~/.cache/infersweep>/fidelity/<key>.pt` with `<key>.sha256` beside it.
    `computations` and `hits` count what this process did (tests count instead of timing).
    """

    computations = 0
    hits = 0

    def __init__(self, root: Path):
        self.root = root

    @staticmethod
    def key(model_identity: dict, windows: torch.Tensor, topk: int) -> str:
        h = hashlib.sha256()
        h.update(json.dumps({"v": FIDELITY_VERSION, "model": model_identity, "topk": topk,
                             "shape": list(windows.shape)}, sort_keys=True).encode())
        h.update(windows.to(torch.int64).contiguous().numpy().tobytes())
        return h.hexdigest()

    def _paths(self, key: str) -> tuple[Path, Path]:
        return self.root / f"{key}.pt", self.root / f"{key}.sha256"

    def get(self, key: str) -> Optional[ReferenceStats]:
        data_path, sum_path = self._paths(key)
        try:
            blob = data_path.read_bytes()
            if hashlib.sha256(blob).hexdigest() != sum_path.read_text().strip():
                log.warning("fidelity cache entry %s is corrupt; recomputing", data_path)
                return None
            d = torch.load(io.BytesIO(blob), weights_only=True)
            stats = ReferenceStats(d["topk_logp"], d["topk_idx"], d["target_nll"])
        except FileNotFoundError:
            return None
        except Exception as e:  # unreadable despite a matching sum: treat as corrupt
            log.warning("fidelity cache entry %s unreadable (%s); recomputing", data_path, e)
            return None
        type(self).hits += 1
        return stats

    def put(self, key: str, stats: ReferenceStats) -> None:
        self.root.mkdir(parents=True, exist_ok=True)
        buf = io.BytesIO()
        torch.save({"topk_logp": stats.topk_logp, "topk_idx": stats.topk_idx, "target_nll": stats.target_nll}, buf)
        blob = buf.getvalue()
        data_path, sum_path = self._paths(key)
        tmp = data_path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_bytes(blob)
        tmp.replace(data_path)
        sum_path.write_text(hashlib.sha256(blob).hexdigest())

    def get_or_compute(self, key: str, compute) -> tuple[ReferenceStats, bool]:
        """(stats, was_cached)."""
        stats = self.get(key)
        if stats is not None:
            return stats, True
        stats = compute()
        type(self).computations += 1
        self.put(key, stats)
        return stats, False
