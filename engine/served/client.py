"""Drive a serving workload's requests through an OpenAI-compatible `/v1/completions` API, streaming, and
measure each request as `vllm bench serve` does -- so our numbers compare with its on the same server:

- a request is *sent* at its arrival time (`Request.arrival_s` after the run starts), or, under a client-side
  concurrency cap (`max_concurrency`), when a slot frees; `sent_s` is when it really left;
- each streamed chunk that carries text is one token time (vLLM's ITL is per chunk: a chunk carrying several
  tokens -- speculative decoding -- is one gap); TTFT = first such chunk - sent;
- the output length is the server's `usage.completion_tokens` where the stream reports it, else the number of
  tokens the model's tokenizer makes of the generated text (vLLM's fallback); TPOT = (e2e - TTFT) / (n - 1);
- the prompt is the request's token ids decoded to text (the OpenAI API takes text; the server tokenizes it
  again, so its prompt may differ from ours by a token at the seams -- `prompt_len` is ours).

Generation runs exactly `max_new_tokens` tokens (EOS is not a stop) through the server's own option for it
(`exact_length`: vLLM's `ignore_eos`, llama-cpp-python's `min_tokens`), so every engine serves the same work.
The HTTP layer is httpx's (async, one connection per request in flight); nothing here knows which server runs.
"""
from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..config import EngineError
from ..serving.requests import Request, RequestRecord


@dataclass(frozen=True)
class Api:
    """Where and how to send: the server's base URL, the model name it serves, the request body's fixed part
    (sampling, the exact-length option), the tokenizer (prompt text, output length) and a per-request limit."""

    url: str
    model: str
    body: dict[str, Any]
    tokenizer: Any
    exact_length_key: str = ""  # ignore_eos (vLLM): True; min_tokens (llama-cpp-python): max_tokens
    timeout_s: float = 600.0


@dataclass(frozen=True)
class Streamed:
    """One request as the stream showed it: chunk times (s since the run started), the text, the server's
    completion token count (None where it did not say), why it finished."""

    times: tuple[float, ...]
    text: str
    usage_tokens: Optional[int]
    finish_reason: Optional[str]


async def _stream(client, api: Api, req: Request, t0: float) -> tuple[float, Streamed]:
    body = dict(api.body, model=api.model, prompt=api.tokenizer.decode(list(req.prompt)), max_tokens=req.max_new_tokens,
                stream=True)
    if api.exact_length_key == "ignore_eos":
        body["ignore_eos"] = True
    elif api.exact_length_key:
        body[api.exact_length_key] = req.max_new_tokens
    sent = time.perf_counter() - t0
    times: list[float] = []
    text: list[str] = []
    usage = finish = None
    async with client.stream("POST", api.url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            detail = (await r.aread()).decode(errors="replace")[:500]
            raise EngineError(f"the server answered request {req.id} with HTTP {r.status_code}: {detail}")
        async for line in r.aiter_lines():
            if not line.startswith("data:"):
                continue
            data = line[5:].strip()
            if data == "[DONE]":
                break
            now = time.perf_counter() - t0
            obj = json.loads(data)
            if obj.get("usage"):
                usage = obj["usage"].get("completion_tokens")
            for ch in obj.get("choices") or []:
                if ch.get("text"):
                    times.append(now)
                    text.append(ch["text"])
                if ch.get("finish_reason"):
                    finish = ch["finish_reason"]
    if not times:
        raise EngineError(f"the server streamed no text for request {req.id} (finish_reason {finish!r})")
    return sent, Streamed(tuple(times), "".join(text), usage, finish)


def record_of(req: Request, sent: float, s: Streamed, tokenizer) -> RequestRecord:
    """The request's `RequestRecord`: output = the generated text's token ids, of the server's count where it
    gave one (vLLM bench serve's output length); token times = the chunk times; complete when the server says it
    stopped at the length asked (finish_reason "length": a request it cancelled or ended at EOS is not)."""
    ids = list(tokenizer.encode(s.text))
    n = s.usage_tokens if s.usage_tokens else len(ids)
    out = tuple(ids[:n]) + (0,) * max(0, n - len(ids))  # the count is the server's; the ids are for comparing
    return RequestRecord(req.id, req.prompt_len, out, sent, s.times, 0, None, complete=s.finish_reason == "length")


async def _drive(api: Api, requests: list[Request], follow_up, max_concurrency: int) -> tuple[list[RequestRecord], float]:
    import httpx

    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(api.timeout_s, connect=30.0)
    records: dict[int, RequestRecord] = {}
    gate = asyncio.Semaphore(max_concurrency) if max_concurrency > 0 else None
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        t0 = time.perf_counter()
        tasks: set[asyncio.Task] = set()

        async def one(req: Request) -> None:
            delay = req.arrival_s - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if gate is not None:
                async with gate:
                    sent, s = await _stream(client, api, req, t0)
            else:
                sent, s = await _stream(client, api, req, t0)
            rec = record_of(req, sent, s, api.tokenizer)
            records[req.id] = rec
            nxt = follow_up(req, list(rec.output), rec.token_times_s[-1]) if follow_up else None
            if nxt is not None:
                spawn(nxt)

        def spawn(req: Request) -> None:
            task = asyncio.ensure_future(one(req))
            tasks.add(task)

        for req in requests:
            spawn(req)
        try:
            while tasks:  # follow-ups join while it runs: wait until none is left
                done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                tasks -= done
                for d in done:
                    d.result()  # a failed request fails the run
        finally:
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.gather(*tasks, return_exceptions=True)
    recs = [records[k] for k in sorted(records)]
    return recs, max(r.token_times_s[-1] for r in recs)


def drive(api: Api, requests: list[Request], follow_up: Optional[Callable] = None,
          max_concurrency: int = 0) -> tuple[list[RequestRecord], float]:
    """Serve `requests` (and the follow-ups `follow_up(request, output ids, finished_s)` returns) through `api`;
    (records by request id, duration s = start -> last token)."""
    if not requests:
        raise EngineError("no requests to send")
    return asyncio.run(_drive(api, requests, follow_up, max_concurrency))


# --- accuracy through the API: what the server itself answers -------------------------------------------------

async def _post_all(api: Api, bodies: list[dict[str, Any]], concurrency: int) -> list[dict[str, Any]]:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    timeout = httpx.Timeout(api.timeout_s, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, trust_env=False) as client:
        async def one(i: int, body: dict[str, Any]) -> dict[str, Any]:
            async with gate:
                r = await client.post(api.url + "/v1/completions", json=dict(body, model=api.model))
            if r.status_code != 200:
                raise EngineError(f"the server answered scoring request {i} with HTTP {r.status_code}: {r.text[:500]}")
            return r.json()["choices"][0]

        return list(await asyncio.gather(*(one(i, b) for i, b in enumerate(bodies))))


def post_all(api: Api, bodies: list[dict[str, Any]], concurrency: int = 8) -> list[dict[str, Any]]:
    """POST every body to /v1/completions (not streamed, `concurrency` in flight); each answer's first choice."""
    return asyncio.run(_post_all(api, bodies, concurrency)) if bodies else []


def _logprob(entry: dict[str, Any], token: int) -> dict[str, Any]:
    got = entry.get(str(int(token)))
    if got is None:
        raise EngineError(f"the server's prompt log-probs leave out the prompt's own token {token}")
    return got


def api_loglikelihood(api: Api, pairs) -> list[tuple[float, bool]]:
    """(log P(continuation | context), whether every continuation token is the greedy one) for each (context ids,
    continuation ids), from the server's prompt log-probabilities of context + continuation (vLLM's
    `prompt_logprobs`: each prompt token's own log-prob and rank)."""
    bodies = [{"prompt": [int(t) for t in list(ctx) + list(cont)], "max_tokens": 1, "temperature": 0.0,
               "prompt_logprobs": 1} for ctx, cont in pairs]
    out = []
    for (ctx, cont), ch in zip(pairs, post_all(api, bodies)):
        plp = ch.get("prompt_logprobs")
        if not plp:
            raise EngineError("the server returned no prompt log-probs (it must support `prompt_logprobs`)")
        got = [_logprob(plp[len(ctx) + j], tok) for j, tok in enumerate(cont)]
        out.append((float(sum(g["logprob"] for g in got)), all(g.get("rank") == 1 for g in got)))
    return out


def api_greedy(api: Api, requests) -> list[list[int]]:
    """The server's greedy answer to each (prompt ids, max_new_tokens), as the token ids it generated (vLLM's
    `return_token_ids`), EOS included where it stopped there."""
    bodies = [{"prompt": [int(t) for t in p], "max_tokens": int(n), "temperature": 0.0, "return_token_ids": True}
              for p, n in requests]
    out = []
    for ch in post_all(api, bodies):
        if ch.get("token_ids") is None:
            raise EngineError("the server returned no token ids (it must support `return_token_ids`)")
        out.append([int(t) for t in ch["token_ids"]])
    return out


def api_topk_windows(api: Api, windows: list[list[int]], topk: int):
    """Each window's top-k next-token log-probs at every position and the actual next token's, from the server's
    prompt log-probabilities: a `TopkScores` (engine/measure/fidelity.py), as engine=vllm's worker gives."""
    import torch

    from ..measure.fidelity import TopkScores

    bodies = [{"prompt": [int(t) for t in w], "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": topk}
              for w in windows]
    all_idx, all_logp, all_target = [], [], []
    for w, ch in zip(windows, post_all(api, bodies)):
        plp = ch.get("prompt_logprobs")
        if not plp:
            raise EngineError("the server returned no prompt log-probs (it must support `prompt_logprobs`)")
        idx = torch.zeros(len(w) - 1, topk, dtype=torch.int32)
        logp = torch.full((len(w) - 1, topk), float("-inf"), dtype=torch.float32)
        target = torch.zeros(len(w) - 1, dtype=torch.float32)
        for t in range(1, len(w)):
            d = plp[t]
            target[t - 1] = _logprob(d, w[t])["logprob"]
            ranked = sorted((v["rank"], int(tok), v["logprob"]) for tok, v in d.items()
                            if v.get("rank") is not None and v["rank"] <= topk)
            for j, (_, tok, lp) in enumerate(ranked[:topk]):
                idx[t - 1, j], logp[t - 1, j] = tok, lp
        all_idx.append(idx)
        all_logp.append(logp)
        all_target.append(target)
    return TopkScores(torch.stack(all_idx), torch.stack(all_logp), torch.stack(all_target))
