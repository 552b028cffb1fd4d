"""Served trials: the engine's own server started as a separate process, driven through its OpenAI-compatible
HTTP API with the serving workloads' requests, and ended on every exit path.

  process.py  launch, readiness, teardown, and the records that let the next run end a dead owner's server
  client.py   the streaming request driver (httpx), timings as `vllm bench serve` defines them
  session.py  `ServedEngine` / `ServedSession`: the trial contract over a server (docs/serving.md)
"""
