"""The serving workload, shared by every engine that serves: seeded requests (lengths, arrival times,
shared prefix) as immutable `Request`s, and `RequestRecord`, one finished request as measured.

The scheduler that runs them on our own runtime is engine=native's (engine/engines/native/serving/);
vLLM runs the same requests with its own scheduler (engine/engines/vllm/).
"""
