"""engine=native's serving runtime: requests scheduled onto the native model (nano-vllm's shape).

One concept per file, one owner for each piece of mutable state:
  sequence.py      `Sequence`: one request's generation state (tokens, computed count, status);
                   mutated only by the scheduler
  block_space.py   per-sequence block tables over the BlockManager, prefix-cache lookup/publish;
                   the only owner of block tables
  scheduler.py     static and continuous (iteration-level) scheduling: admission and preemption, no torch
  model_runner.py  the only place that turns a scheduled batch into tensors; owns the KV pool
  sampler.py       per-request seeded sampling (its generators are the only RNG state)
  llm_engine.py    the loop: arrivals on the wall clock, schedule -> run -> sample -> postprocess
  serve.py         what every timed run of one trial shares (KV pool, model runner), warm-up requests
The requests themselves are the shared serving workload (engine/serving/requests.py).
"""
