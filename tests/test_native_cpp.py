"""engine.compile_mode=cpp on engine=native: the decode step in C++ (engine/engines/native/cpp_step.py).

Correctness only (speed goes to benchmarks/bench_native_vs_llamacpp.py): greedy tokens of the C++ step equal the
eager native engine's on the tiny random Llama at every weight layout it reads (fp32, bf16 -- no bf16 units needed:
widened exactly, rounded where torch rounds --, int8-weight, int4-weight, int8-dynamic), and its logits match step by
step on every architecture the native engine runs (Llama variants, Qwen2's bias, Llama 3 rope scaling, Gemma 3 with
its sliding window beyond the window, softcapping); refusals before launch; a failed build named; config hashes.
"""
from __future__ import annotations

import pytest
import torch

from engine import quant_kernels as qk
from engine.config import ModelConfig, QuantConfig, SamplingConfig, WorkloadConfig, replace
from engine.engines import make_backend
from engine.engines.native.cpp_step import CppDecodeStep
from engine.generate import generate
from engine.models import load_model
from engine.validation import check_trial
from support import make_trial
from test_native import hf_tiny, incremental_logits

GREEDY = SamplingConfig(temperature=0.0)
NEW = 16
TINY = "tiny://llama"
# fp32: the same kernels, another order of the few sums outside them (norms, attention)
FP32_TOL = dict(atol=5e-5, rtol=1e-5)
# bf16 on the real model: the C++ step's logits may be this much further from the fp32 reference than the eager bf16
# engine's are (measured: C++ max 0.76 / median 0.34 from fp32, eager 0.90 / 0.36, logits span +-37)
BF16_ERROR_FACTOR = 1.25


def _trial(model: ModelConfig, mode: str = "cpp", compile: bool = True, attention: str = "sdpa", quant=None, **kw):
    t = make_trial(model, backend="native", attention=attention, kv_cache=kw.pop("kv_cache", "contiguous"),
                   compile=compile, **({"quant": quant} if quant else {}), **kw)
    return replace(t, "engine.compile_mode", mode)


def over_threads_and_sync(lib, run) -> dict:
    """run() at 1, 2 and 3 torch threads, with the phases' chunks (isw_set_sync(0), the default) and with the static
    split and OpenMP barriers (1): {(sync, threads): its result}; the library's mode and torch's threads restored."""
    threads0, out = torch.get_num_threads(), {}
    try:
        for sync in (0, 1):
            lib.isw_set_sync(sync)
            for n in (1, 2, 3):
                torch.set_num_threads(n)
                out[sync, n] = run()
    finally:
        lib.isw_set_sync(0)
        torch.set_num_threads(threads0)
    return out


def _greedy(backend, prompts, new=NEW):
    session = backend.new_session(int(prompts.shape[0]), int(prompts.shape[1]) + new)
    return torch.as_tensor(generate(session, prompts, new, GREEDY, seed=0, sync=lambda: None).tokens)


@pytest.fixture(scope="module")
def prompts():
    return torch.randint(3, 300, (1, 21), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("level,kernel", [("none", "gemv-all"), ("none", "dequant"), ("int8-weight", "gemv"),
                                          ("int4-weight", "gemv"), ("int4-weight", "gemv-q8"),
                                          ("int8-dynamic", "dequant")])
def test_cpp_step_greedy_tokens_equal_the_eager_native_engine(dtype, level, kernel, prompts):
    """Same weights, same cache; the eager engine's decode runs the same GEMV kernels through torch modules."""
    model = ModelConfig(name="tiny", path=TINY, dtype=dtype)
    spec = QuantConfig(level=level, kernel=kernel)
    loaded = load_model(model, attention="sdpa", quant=spec)
    cpp = make_backend(loaded, _trial(model, quant=spec))
    assert isinstance(cpp.decode_step, CppDecodeStep) and cpp.extra_info() == {"cpp_step_isa": qk.target_isa()}
    got = _greedy(cpp, prompts)
    again = _greedy(cpp, prompts)  # a second session: the step re-binds to the new cache
    eager = _greedy(make_backend(loaded, _trial(model, mode="dynamic", compile=False, quant=spec)), prompts)
    assert torch.equal(got, again) and torch.equal(got, eager)


@pytest.mark.parametrize("kind", ["llama", "llama-untied", "qwen2", "mistral", "llama3-rope", "gemma3", "gemma3-softcap"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cpp_step_logits_match_the_eager_engine_on_every_architecture(kind, attention):
    """Teacher-forced, one token per step after a 5-token prefill, 29 positions: past Gemma 3's window of 8 (its
    sliding layers drop keys), with its (1 + w) norms, q/k norms, post norms, GeGLU, two RoPE bases, softcapping;
    Qwen2's QKV bias. fp32 logits within float rounding; bf16 with eager attention bit for bit."""
    ids = torch.randint(3, 320, (1, 29), generator=torch.Generator().manual_seed(1))
    for dtype in ("float32", "bfloat16"):
        loaded = hf_tiny(kind, attn=attention)
        if dtype == "bfloat16":
            loaded.model.to(torch.bfloat16)
        out = {}
        for mode, compile in (("cpp", True), ("dynamic", False)):
            trial = replace(_trial(loaded.spec, mode=mode, compile=compile, attention=attention), "model.dtype", dtype)
            out[mode] = incremental_logits(make_backend(loaded, trial).new_session(1, 29), ids, 5)
        if dtype == "float32":
            torch.testing.assert_close(out["cpp"], out["dynamic"], **FP32_TOL)
        elif attention == "eager" and kind in ("llama", "mistral", "gemma3"):
            torch.testing.assert_close(out["cpp"], out["dynamic"], atol=0, rtol=0)
        else:  # sdpa's CPU kernel rounds its bf16 probabilities after an approximate exp: an ulp here and there
            assert (out["cpp"] - out["dynamic"]).abs().max() < 0.1
            # a random tiny model's logits are flat, so an ulp may swap near-tied tokens (seen: 2 of 29 positions
            # on an AVX2-only EPYC): every position whose greedy token differs is a near tie in the eager engine's
            # own logits (its top and the C++ step's pick within 0.2, two ulps at these magnitudes), none a real
            # disagreement
            ref = out["dynamic"].float().reshape(-1, out["dynamic"].shape[-1])
            pick = out["cpp"].float().reshape(-1, ref.shape[-1]).argmax(-1)
            gap = ref.max(-1).values - ref.gather(-1, pick[:, None])[:, 0]
            assert gap.max() < 0.2, f"the C++ step picks a token {gap.max():.3f} below the eager engine's top"


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("level", ["none", "int8-dynamic", "int4-weight"])
@pytest.mark.parametrize("batch", [1, 3])
def test_cpp_step_logits_do_not_depend_on_threads_or_how_they_meet(kind, level, batch):
    """The phases' chunks (rows of a GEMV, parts of a KV group's query heads) taken from counters, with futex waits,
    give the same logits as one thread and as the static split with OpenMP barriers (isw_set_sync(1)), at 2 threads
    and at 3 (more threads than this machine's cores: the descheduled-thread case the chunks exist for). Each row and
    head is computed by one thread whatever the split; fp32 sums inside a row may group differently at a chunk edge.
    One sequence, and 3 decoded together (isw_decode_batch's chunks over (sequence, KV group))."""
    from engine.quant import quantize_model

    ids = torch.randint(3, 320, (batch, 29), generator=torch.Generator().manual_seed(4))
    loaded = hf_tiny(kind)
    spec = QuantConfig(level=level, kernel="gemv" if level == "int4-weight" else "dequant")
    if level != "none":
        quantize_model(loaded.model, spec, loaded.model.config.num_hidden_layers)
    trial = _trial(loaded.spec, quant=spec)
    backend = make_backend(loaded, trial)
    out = over_threads_and_sync(backend.decode_step.lib, lambda: incremental_logits(backend.new_session(batch, 29), ids, 5))
    ref = out[1, 1]
    for key, got in out.items():
        torch.testing.assert_close(got, ref, **FP32_TOL, msg=lambda m: f"sync, threads {key}: {m}")
    assert torch.equal(out[0, 1], ref)  # one thread: one chunk a phase, the same arithmetic


@pytest.mark.parametrize("kind", ["llama", "gemma3"])
@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_cpp_step_split_attention_matches_the_eager_engine(kind, attention):
    """Flash-decoding (attention cut along the sequence, partial softmaxes combined in the next phase) switched on
    from 8 positions in blocks of 4 (isw_set_split; shipped: 256 and 64), so the tiny models' 29 positions split into
    2-6 blocks per KV group, past Gemma 3's window of 8. fp32 within float rounding of the eager engine; bf16 within
    its rounding (the probabilities are rounded relative to each block's max, not the row's)."""
    ids = torch.randint(3, 320, (1, 29), generator=torch.Generator().manual_seed(5))
    threads0 = torch.get_num_threads()
    for dtype in ("float32", "bfloat16"):
        loaded = hf_tiny(kind, attn=attention)
        if dtype == "bfloat16":
            loaded.model.to(torch.bfloat16)
        eager = incremental_logits(make_backend(loaded, replace(_trial(loaded.spec, mode="dynamic", compile=False,
                                                                       attention=attention), "model.dtype", dtype))
                                   .new_session(1, 29), ids, 5)
        backend = make_backend(loaded, replace(_trial(loaded.spec, attention=attention), "model.dtype", dtype))
        lib = backend.decode_step.lib
        try:
            lib.isw_set_split(8, 4)
            for n in (2, 3):
                torch.set_num_threads(n)
                got = incremental_logits(backend.new_session(1, 29), ids, 5)
                if dtype == "float32":
                    torch.testing.assert_close(got, eager, **FP32_TOL)
                else:
                    assert (got.float() - eager.float()).abs().max() < 0.1
        finally:
            lib.isw_set_split(256, 64)
            torch.set_num_threads(threads0)


def test_cpp_step_runs_speculative_decoding_with_the_same_tokens(prompts):
    """prompt-lookup drafts verify in torch (several tokens), decode steps run in C++, rejected tokens roll back."""
    from engine import run_engine_trial

    model = ModelConfig(name="tiny", path=TINY)
    wl = WorkloadConfig(context_len=100, max_new_tokens=12, warmup=0, repeats=1, prompt_style="repeat")
    runs = {}
    for mode, compile in (("cpp", True), ("dynamic", False)):
        t = replace(_trial(model, mode=mode, compile=compile, workload=wl), "speculative.method", "prompt-lookup")
        runs[mode] = run_engine_trial(t)
    assert runs["cpp"].token_ids == runs["dynamic"].token_ids


def _problems(trial, key=None):
    probs = check_trial(trial, gpu_available=False)
    return [m for k, m in probs if key is None or k == key]


def test_what_the_cpp_step_cannot_run_is_refused_before_launch(monkeypatch):
    tiny = ModelConfig(name="tiny", path=TINY)
    assert _problems(_trial(tiny)) == []
    assert _problems(_trial(tiny, workload=WorkloadConfig(batch_size=2))) == []  # B sequences: one call a step
    assert _problems(_trial(tiny, kv_cache="paged")) == []  # through the block tables
    assert any("contiguous" in m for m in _problems(_trial(tiny, kv_cache="off"), "kv_cache.mode"))
    assert any("float32 or bfloat16" in m for m in _problems(_trial(replace(tiny, "dtype", "float16")), "model.dtype"))
    assert any("quant levels" in m for m in _problems(_trial(tiny, quant=QuantConfig(level="bnb-nf4")), "quant.level"))
    assert any("engine.compile=true" in m for m in _problems(_trial(tiny, compile=False), "engine.compile_mode"))
    import engine.quant_kernels as q

    monkeypatch.setattr(q, "cpu_tiers", lambda: ["scalar"])
    assert any("AVX2" in m for m in _problems(_trial(tiny), "engine.compile_mode"))
    monkeypatch.undo()
    monkeypatch.setenv("CXX", "no-such-compiler-xyz")
    assert any("C++ compiler" in m for m in _problems(_trial(tiny), "engine.compile_mode"))


def test_the_cpp_step_refuses_an_architecture_it_does_not_run():
    from engine.engines.native.cpp_step import problems

    trial = _trial(ModelConfig(name="tiny", path=TINY))
    assert problems(trial, "llama") == [] and problems(trial, "gemma3_text") == []
    assert any("model_type 'phi3'" in m for _, m in problems(trial, "phi3"))


def test_a_failed_build_is_an_engine_error_with_its_reason(monkeypatch, tmp_path):
    from engine.config import EngineError

    monkeypatch.setenv("INFERSWEEP_CACHE", str(tmp_path))
    monkeypatch.setenv(qk.FORCE_ERROR_ENV, "1")
    loaded = load_model(ModelConfig(name="tiny", path=TINY))
    with pytest.raises(EngineError, match="did not build on this machine.*INFERSWEEP_FORCE_COMPILE_ERROR"):
        make_backend(loaded, _trial(loaded.spec))


def test_the_binding_checks_the_libraries_structs_and_codes_at_load(monkeypatch):
    """The structs and integer codes are written twice (ctypes, C++): the library reports its own sizes, offsets and
    codes (isw_step_layout), which match the binding's; a ctypes copy that lost a field, or a code changed on one
    side only, is an EngineError at load naming each difference -- not the wrong memory read silently."""
    import ctypes

    from engine.config import EngineError
    from engine.engines.native import cpp_step

    lib = qk.build("infersweep_decode_step", [cpp_step.SOURCE])
    assert lib.error is None and cpp_step.layout_problems(lib.isw_step_layout().decode()) == []
    loaded = load_model(ModelConfig(name="tiny", path=TINY))
    assert isinstance(make_backend(loaded, _trial(loaded.spec)).decode_step, CppDecodeStep)

    class Lin(ctypes.Structure):  # the binding's _Lin without its last field (bias)
        _fields_ = cpp_step._Lin._fields_[:-1]

    with monkeypatch.context() as m:
        m.setattr(cpp_step, "_Lin", Lin)
        with pytest.raises(EngineError, match=r"disagree: sizeof\(Lin\): C\+\+ 56, ctypes 48; Lin.bias: C\+\+ 48, "
                                              r"ctypes \(no such field\); change both together"):
            make_backend(loaded, _trial(loaded.spec))
    with monkeypatch.context() as m:
        m.setattr(cpp_step, "W4A8", 6)
        with pytest.raises(EngineError, match=r"disagree: W4A8: C\+\+ 5, ctypes 6;"):
            make_backend(loaded, _trial(loaded.spec))


def test_cpp_is_an_ordinary_axis_value_in_the_config_hash():
    """compile_mode=cpp hashes apart from the other modes; the default (dynamic) leaves the key out, so every hash
    recorded before the axis existed stands (experiments/hashing and tests/test_hash.py)."""
    from experiments.config.compose import expand

    trials = expand(["model=tiny-llama", "engine=native", "engine.compile=true", "engine.compile_mode=static,cpp"])
    assert len({t.config_hash for t in trials}) == 2


REAL_TEXT = "The quick brown fox jumps over the lazy dog. In 1969, the first humans landed on the Moon, and " * 3
REAL_LEVELS = [("float32", "none"), ("bfloat16", "none"), ("float32", "int8-weight"), ("float32", "int4-weight"),
               ("float32", "int8-dynamic")]


@pytest.mark.slow
@pytest.mark.parametrize("dtype,level", REAL_LEVELS)
def test_smollm2_cpp_step_greedy_tokens_equal_the_eager_engine(dtype, level):
    """The real SmolLM2-135M (prepared from its GGUF package on first use), 32 greedy tokens after a 64-token prompt.

    fp32: the same tokens. bf16 with sdpa: torch's CPU sdpa rounds its bf16 probabilities after an approximate exp
    (the architecture test above), so the two bf16 steps' logits differ by bf16 ulps (up to ~0.9 of logits spanning
    +-37) and greedy decoding may part at a near tie (seen once in CI at token 32). So, teacher-forced along the eager
    engine's tokens: the C++ step is no further from the fp32 reference than the eager bf16 engine is (max and
    median over the positions, within BF16_ERROR_FACTOR), every position where the two argmaxes differ is a near
    tie (the eager top-2 margin no larger than twice that position's difference), and the greedy tokens agree up
    to the first such tie.

    int8-dynamic (W8A8) rounds every activation row to int8 after fp32 sums whose order differs between the two
    steps (norms, attention: ~2e-5 of the logits, as at level none), so a value on a rounding boundary may land one
    int8 step apart; from that token on, the KV cache differs and the logits part by W8A8's own error (seen on an
    Intel Xeon with AMX: equal within FP32_TOL for 5 decode steps, then 1.2-3.4 apart, against 2-4 from the
    unquantized model for either step; on AMD EPYC the very tokens). So: greedy tokens equal up to the first
    position where the teacher-forced logits part, and the C++ step's W8A8 no worse than the eager engine's against
    the unquantized fp32 model (median and mean over the positions, within BF16_ERROR_FACTOR)."""
    from engine.models import prepare_model

    prepare_model("smollm2-135m-instruct")
    _real_model_cpp_step_against_the_eager_engine("smollm2-135m-instruct", dtype, level)


@pytest.mark.slow
@pytest.mark.parametrize("dtype,level", REAL_LEVELS)
def test_gemma3_cpp_step_greedy_tokens_equal_the_eager_engine(dtype, level):
    """The same on the real Gemma 3 270M (issue 36): its (1 + w) RMSNorms around both blocks, Q/K norms, GELU-tanh
    MLP, sqrt(hidden)-scaled tied embedding and the 262k-row LM head, interleaved sliding (512) and global layers.
    The tokenizer's own BOS first, as Gemma is trained; 16 greedy tokens after the 64-token prompt, inside the window
    (the window's edge is the tiny Gemma 3 architecture case above, at window 8), and half SmolLM2's 32: each step
    reads ~1.07 GB of fp32 weights, twice SmolLM2's, two thirds of it the LM head. The same rules: fp32 levels the
    very tokens (int8-dynamic: up to a rounding flip, then no worse W8A8), bf16 judged against the fp32 reference with
    the near-tie rule."""
    from conftest import need_prepared
    from engine.models import prepare_model

    need_prepared("gemma-3-270m")
    prepare_model("gemma-3-270m")
    _real_model_cpp_step_against_the_eager_engine("gemma-3-270m", dtype, level, new=16)


def _real_model_cpp_step_against_the_eager_engine(name: str, dtype: str, level: str, new: int = 32) -> None:
    text = REAL_TEXT
    spec = QuantConfig(level=level, kernel="gemv-all" if level in ("none", "int8-weight", "int4-weight") else "dequant")
    w8a8 = level == "int8-dynamic"

    def backends(dtype, spec=spec):
        model = ModelConfig(name=name, path=f"prepared://{name}", dtype=dtype)
        loaded = load_model(model, attention="sdpa", quant=spec)
        ids = loaded.tokenizer._tok(text, return_tensors="pt")["input_ids"][:, :64]
        # the tokenizer's own special tokens first (Gemma's BOS, none for SmolLM2), as lm-eval's requests have them
        assert ids.shape == (1, 64) and ids[0, :len(loaded.tokenizer.prefix_ids)].tolist() == loaded.tokenizer.prefix_ids
        return ids, {"cpp": make_backend(loaded, _trial(model, quant=spec)),
                     "eager": make_backend(loaded, _trial(model, mode="dynamic", compile=False, quant=spec))}

    ids, bs = backends(dtype)
    tokens = {k: _greedy(b, ids, new).reshape(-1) for k, b in bs.items()}
    if dtype == "float32" and not w8a8:
        assert torch.equal(tokens["cpp"], tokens["eager"])
        return
    seq = torch.cat([ids, tokens["eager"][None, :-1]], dim=1)
    p = ids.shape[1] - 1  # the logits that chose each generated token

    def forced(backend):
        return incremental_logits(backend.new_session(1, seq.shape[1]), seq, ids.shape[1])[0, p:].float()

    logits = {k: forced(b) for k, b in bs.items()}
    if w8a8:  # the tokens agree while the logits do; past a rounding flip, the C++ step's W8A8 error is eager's size
        close = torch.isclose(logits["cpp"], logits["eager"], **FP32_TOL).all(-1)
        apart = int((~close).nonzero()[0]) if not bool(close.all()) else len(close)
        assert torch.equal(tokens["cpp"][:apart], tokens["eager"][:apart]), (apart, tokens)
        if apart == len(close):
            return
    # bf16: the fp32 engine at the same level; W8A8: the unquantized fp32 model
    reference = forced(backends("float32", QuantConfig() if w8a8 else spec)[1]["eager"])
    err = {k: (v - reference).abs().amax(-1) for k, v in logits.items()}
    for stat in (torch.median, torch.mean) if w8a8 else (torch.max, torch.median):
        assert float(stat(err["cpp"])) <= BF16_ERROR_FACTOR * float(stat(err["eager"])), (stat, err)
    if w8a8:
        return
    diff = (logits["cpp"] - logits["eager"]).abs().amax(-1)
    top2 = logits["eager"].topk(2, dim=-1).values
    margin = top2[:, 0] - top2[:, 1]
    parted = logits["cpp"].argmax(-1) != logits["eager"].argmax(-1)
    assert bool((margin[parted] <= 2 * diff[parted]).all()), (margin[parted], diff[parted])
    got, want = tokens["cpp"], tokens["eager"]
    first = int((got != want).nonzero()[0]) if not torch.equal(got, want) else len(want)
    assert first == len(want) or bool(margin[first] <= 2 * diff[first]), (first, margin[first], diff[first])


def test_the_step_profile_accounts_for_each_steps_time(prompts):
    """The per-token profile (BENCHMARKS.md): every phase measured, summed over the steps run since the last read."""
    model = ModelConfig(name="tiny", path=TINY)
    backend = make_backend(load_model(model), _trial(model))
    backend.decode_step.profile()  # reset
    _greedy(backend, prompts, 5)
    prof = backend.decode_step.profile()
    assert prof.pop("steps") == 4  # 5 tokens: the first comes from prefill
    assert set(prof) == {"qkv", "attention", "o_proj", "gate_up", "down", "head", "outside"}
    assert all(v >= 0 for v in prof.values()) and prof["qkv"] > 0 and prof["head"] > 0
    assert backend.decode_step.profile()["steps"] == 0
