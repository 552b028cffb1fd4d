"""The serving workload, shared by every engine that serves: seeded requests (lengths, arrival times,
shared prefix) as immutable `Request`s, and `RequestRecord`, one finished request as measured.

The scheduler that runs them on our own runtime is engine=native's (engine/engines/native/serving/);
vLLM runs the same requests with its own scheduler (engine/engines/vllm/).

  requests.py       the requests of workload.kind=serving, and `RequestRecord`
  conversations.py  workload.kind=multi-turn: conversations whose turns carry the answers before them
  capacity.py       the capacity search (the highest rate within the SLO) over a "run one probe" callable
"""
