"""Our own GEMV kernels on CPU: fused dequantize-GEMV for weight-only INT8 / INT4 (issue 28), a GEMV of the same
kind for full-precision fp32 / bf16 weights (`quant.kernel=gemv-all`), and integer dot products (issue 36): W8A8
for `int8-dynamic` (the activation row quantized per token, int8 x int8 -> int32: AVX-512 VNNI `vpdpbusd`, AVX2
`vpmaddubsw`) and INT4 x Q8_0 (the activation quantized per block of 32, llama.cpp's Q4_0 x Q8_0).

At batch-1 decode a linear layer is a GEMV bound by reading its weights. The kernels read each weight once and
accumulate in fp32 (or int32): y[r, o] = s[o] * sum_k x[r, k] * q[o, k]  (INT4: a scale per group of 32 inputs).

Sources are sources: the C++ lives in engine/kernels/ (gemv.h: the row kernels, one definition shared with the
native engine's C++ decode step; gemv.cpp: the entry points this module calls through ctypes -- their signatures
are read from the source, declared nowhere else). `build()` compiles a library once per machine and target: its
build key hashes the sources, the compiler, and the ISA flags, which are chosen from the CPU's flags at run time
(`target_isa()`: avx512-vnni, avx512, avx2 or scalar; never -march=native, so a cache directory shared by nodes of
different CPUs never loads another CPU's build). Output rows are split over OpenMP threads of the runtime torch
itself loaded (torch's libgomp), `engine.threads` of them like every other op. If the build fails (no compiler, an
unsupported flag), `load()` returns None, `load_error()` says why (kept beside the build as FAILED.txt), `isa()`
says "torch fallback (<why>)" in a trial's info, and callers run the portable torch path (dequantize, then
`F.linear`; torch's own int8 matmul for W8A8), which computes the same function.

Environment: INFERSWEEP_NO_CPP_KERNELS=1 skips the build (the torch path); INFERSWEEP_KERNEL_ISA=avx2|scalar|...
builds for a lower tier than the CPU's (tests of every code path on one machine; a tier the CPU lacks is refused);
INFERSWEEP_KERNEL_FORCE_ERROR=1 makes the compile fail (the fallback's test); CXX names the compiler (g++).
"""
from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import os
import re
import subprocess
from pathlib import Path

import torch
import torch.nn.functional as F

INT4_GROUP = 32  # inputs per INT4 scale; one group = 16 bytes = one 128-bit load
# A weight smaller than this per thread runs on fewer threads (threads_for in gemv.cpp)
MIN_BYTES_PER_THREAD = int(os.environ.get("INFERSWEEP_GEMV_MIN_BYTES", 1 << 20))
KERNEL_DIR = Path(__file__).resolve().parent / "kernels"
ISA_ENV, FORCE_ERROR_ENV, NO_KERNELS_ENV = "INFERSWEEP_KERNEL_ISA", "INFERSWEEP_KERNEL_FORCE_ERROR", "INFERSWEEP_NO_CPP_KERNELS"

# target tier -> (the CPU flags it needs, /proc/cpuinfo names; the compiler flags it builds with), best first
TIERS: dict[str, tuple[frozenset, tuple[str, ...]]] = {
    "avx512-vnni": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_vnni", "avx2", "fma", "f16c"}),
                    ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512vnni", "-mavx2", "-mfma", "-mf16c")),
    "avx512": (frozenset({"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx2", "fma", "f16c"}),
               ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c")),
    "avx2": (frozenset({"avx2", "fma", "f16c"}), ("-mavx2", "-mfma", "-mf16c")),
    "scalar": (frozenset(), ()),
}
BASE_FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-fno-math-errno")


def cpu_tiers() -> list[str]:
    """The tiers this CPU runs, best first (from /proc/cpuinfo's flags; scalar everywhere). Read here, not through
    engine.measure.hardware, which imports the model loader (and so this module)."""
    flags: set[str] = set()
    try:
        with open("/proc/cpuinfo") as f:
            flags = next((set(ln.split(":", 1)[1].split()) for ln in f if ln.split(":")[0].strip() == "flags"), set())
    except OSError:
        pass
    return [t for t, (need, _) in TIERS.items() if need <= flags]


def target_isa() -> str:
    """The tier the kernels are built for here: the CPU's best, or INFERSWEEP_KERNEL_ISA (one the CPU runs)."""
    tiers = cpu_tiers()
    forced = os.environ.get(ISA_ENV, "").strip()
    if not forced:
        return tiers[0]
    if forced not in TIERS:
        raise ValueError(f"{ISA_ENV}={forced!r}: choose one of {', '.join(TIERS)}")
    if forced not in tiers:
        raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {', '.join(sorted(TIERS[forced][0] - set().union(*[TIERS[t][0] for t in tiers])))}")
    return forced


@dataclasses.dataclass
class Library:
    """A built library: its functions (ctypes, signatures read from the source), or why there is none."""

    name: str
    key: str  # the build key: sources + compiler + flags
    isa: str
    path: Path | None = None
    error: str | None = None
    lib: ctypes.CDLL | None = None

    def __getattr__(self, fn):
        if self.lib is None:
            raise AttributeError(fn)
        return getattr(self.lib, fn)


_CTYPES = {"int64_t": ctypes.c_int64, "int": ctypes.c_int, "float": ctypes.c_float, "double": ctypes.c_double,
           "void": None, "const char*": ctypes.c_char_p}
_SIG = re.compile(r"^([\w ]+?\*?)\s*\b(isw_\w+)\(([^)]*)\)\s*\{", re.M)


def exported(source: str) -> dict[str, tuple]:
    """{name: (restype, [argtypes])} of the `isw_*` functions a source defines (its extern "C" entry points):
    pointers become c_void_p, the scalar types their ctypes."""
    out = {}
    for ret, name, args in _SIG.findall(source):
        types = []
        for a in filter(None, (x.strip() for x in args.replace("\n", " ").split(","))):
            t = a.rsplit(" ", 1)[0].strip() if "*" not in a else "ptr"
            types.append(ctypes.c_void_p if t == "ptr" else _CTYPES[t])
        out[name] = (_CTYPES[ret.strip()], types)
    return out


def _compiler() -> tuple[str, str]:
    cxx = os.environ.get("CXX", "g++")
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, IndexError, subprocess.SubprocessError) as e:
        version = f"unavailable ({type(e).__name__})"
    return cxx, version


def build_key(sources: list[Path], include: list[Path], flags: tuple[str, ...], compiler: str) -> str:
    h = hashlib.sha256()
    for f in sorted(sources) + sorted(p for d in include for p in d.glob("*.h")):
        h.update(f.name.encode() + b"\0" + f.read_bytes())
    h.update(repr((flags, compiler)).encode())
    return h.hexdigest()[:16]


_BUILT: dict[Path, Library] = {}


def build(name: str, sources: list[Path], include: tuple[Path, ...] = (KERNEL_DIR,)) -> Library:
    """Compile `sources` into a shared library once per build key (cached under <cache>/kernels/build/, reused by
    every later process on a machine with the same key) and load it; a failed build returns a Library whose
    `error` says why (also written to FAILED.txt in its build directory). Memoized per process."""
    from .cachedir import cache_root

    try:
        isa = target_isa()
    except ValueError as e:
        return Library(name, "-", "?", error=str(e))
    flags = BASE_FLAGS + TIERS[isa][1] + (("-DINFERSWEEP_FORCE_COMPILE_ERROR",) if os.environ.get(FORCE_ERROR_ENV) else ())
    cxx, version = _compiler()
    key = build_key(list(sources), list(include), flags, version)
    out_dir = cache_root() / "kernels" / "build" / f"{name}-{isa}-{key}"
    if out_dir in _BUILT:
        return _BUILT[out_dir]
    so = out_dir / f"lib{name}.so"
    lib = Library(name, key, isa, path=so)
    if not so.is_file():
        out_dir.mkdir(parents=True, exist_ok=True)
        tmp = out_dir / f".lib{name}.{os.getpid()}.so"  # built aside, renamed: concurrent builders never see half a file
        torch_lib = Path(torch.__file__).parent / "lib"  # link torch's OpenMP runtime: one thread pool, not two
        cmd = [cxx, *flags, *(f"-I{d}" for d in include), *map(str, sources), "-o", str(tmp),
               f"-L{torch_lib}", f"-Wl,-rpath,{torch_lib}"]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as e:
            lib.error = f"{cxx} could not run: {type(e).__name__}: {e}"
        else:
            if r.returncode != 0:
                errs = [ln for ln in r.stderr.splitlines() if "error" in ln] or r.stderr.strip().splitlines()[-1:]
                lib.error = f"{cxx} failed ({isa}): {errs[0].strip() if errs else f'exit {r.returncode}'}"
                tmp.unlink(missing_ok=True)
            else:
                tmp.replace(so)
        if lib.error:
            (out_dir / "FAILED.txt").write_text(lib.error + "\n" + " ".join(cmd) + "\n")
            _BUILT[out_dir] = lib
            return lib
    try:
        lib.lib = ctypes.CDLL(str(so))
        for src in sources:
            for fn, (res, args) in exported(Path(src).read_text()).items():
                f = getattr(lib.lib, fn)
                f.restype, f.argtypes = res, args
    except (OSError, AttributeError, KeyError) as e:
        lib.lib, lib.error = None, f"loading {so.name} failed: {type(e).__name__}: {e}"
    _BUILT[out_dir] = lib
    return lib


_load_error: str | None = None
_OPS: tuple | None = None  # the custom ops, once load() succeeded


@functools.lru_cache(maxsize=1)
def load():
    """The compiled kernels (a Library with the isw_* functions), or None with `load_error()` set."""
    global _load_error, _OPS
    if os.environ.get(NO_KERNELS_ENV):
        _load_error = f"{NO_KERNELS_ENV} is set"
        return None
    lib = build("infersweep_gemv", [KERNEL_DIR / "gemv.cpp"])
    if lib.error:
        _load_error = lib.error
        return None
    _OPS = _register_ops()
    return lib


def _ptr(t: torch.Tensor | None):
    return None if t is None else t.data_ptr()


def _dense(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor | None) -> torch.Tensor:
    """x fp32 [R, K] contiguous, w [N, K] fp32 / bf16 / int8 (then s fp32 [N]) -> y fp32 [R, N]"""
    wtype = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2}[w.dtype]
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    load().isw_dense_gemv(x.data_ptr(), x.shape[0], x.shape[1], w.data_ptr(), wtype, _ptr(s), y.data_ptr(),
                          w.shape[0], MIN_BYTES_PER_THREAD, torch.get_num_threads())
    return y


def _int4(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    y = torch.empty((x.shape[0], w.shape[0]), dtype=torch.float32)
    load().isw_int4_gemv(x.data_ptr(), x.shape[0], s.shape[1], w.data_ptr(), s.data_ptr(), y.data_ptr(), w.shape[0],
                         MIN_BYTES_PER_THREAD, torch.get_num_threads())
    return y


def _w8a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    r, k = x.shape
    y = torch.empty((r, w.shape[0]), dtype=torch.float32)
    xq, xs = torch.empty((r, k), dtype=torch.int8), torch.empty(r, dtype=torch.float32)
    load().isw_w8a8_gemv(x.data_ptr(), r, k, xq.data_ptr(), xs.data_ptr(), w.data_ptr(), s.data_ptr(), y.data_ptr(),
                         w.shape[0], MIN_BYTES_PER_THREAD, torch.get_num_threads())
    return y


def _w4a8(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    r, g = x.shape[0], s.shape[1]
    y = torch.empty((r, w.shape[0]), dtype=torch.float32)
    xq = torch.empty((r, g * 32), dtype=torch.int8)
    xs, xsum = torch.empty((r, g), dtype=torch.float32), torch.empty((r, g), dtype=torch.int32)
    load().isw_w4a8_gemv(x.data_ptr(), r, g, xq.data_ptr(), xs.data_ptr(), xsum.data_ptr(), w.data_ptr(), s.data_ptr(),
                         y.data_ptr(), w.shape[0], MIN_BYTES_PER_THREAD, torch.get_num_threads())
    return y


def _register_ops() -> tuple:
    """The kernels as torch custom ops (torch.ops.infersweep.*), so that torch.compile (engine.compile_mode=
    static, fullgraph) traces through them; eager calls go straight to the library (no dispatcher cost)."""

    @torch.library.custom_op("infersweep::int8_gemv", mutates_args=())
    def int8_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _dense(x, w, s)

    @torch.library.custom_op("infersweep::int4_gemv", mutates_args=())
    def int4_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _int4(x, w, s)

    @torch.library.custom_op("infersweep::dense_gemv", mutates_args=())
    def dense_op(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return _dense(x, w, None)

    @torch.library.custom_op("infersweep::w8a8_gemv", mutates_args=())
    def w8a8_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _w8a8(x, w, s)

    @torch.library.custom_op("infersweep::w4a8_gemv", mutates_args=())
    def w4a8_op(x: torch.Tensor, w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
        return _w4a8(x, w, s)

    for op in (int8_op, int4_op, w8a8_op, w4a8_op):
        op.register_fake(lambda x, w, s: x.new_empty((x.shape[0], w.shape[0])))
    dense_op.register_fake(lambda x, w: x.new_empty((x.shape[0], w.shape[0])))
    return int8_op, int4_op, dense_op, w8a8_op, w4a8_op


_EAGER = (lambda x, w, s: _dense(x, w, s), _int4, lambda x, w: _dense(x, w, None), _w8a8, _w4a8)


def _entry(i: int, device: torch.device):
    """Kernel i (0: int8, 1: int4, 2: dense fp32/bf16, 3: W8A8, 4: INT4 x Q8_0) for a tensor on `device`, or None
    (then the torch path runs). While torch.compile traces, only module globals are read (it cannot trace the
    loader) and the custom op is used."""
    if device.type != "cpu":
        return None
    if torch.compiler.is_compiling():
        return None if _OPS is None else _OPS[i]
    return None if load() is None else _EAGER[i]


def load_error() -> str | None:
    load()
    return _load_error


def isa() -> str:
    """Which code path the compiled kernels took on this CPU (avx512-vnni, avx512, avx2, scalar), or why there are none."""
    mod = load()
    return mod.isw_isa().decode() if mod is not None else f"torch fallback ({_load_error})"


def int8_gemv(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] (any float dtype) @ (q int8 [out, in] * scales [out])^T -> [rows, out] in x2's dtype."""
    fn = _entry(0, x2.device)
    if fn is None:
        return F.linear(x2, q.to(x2.dtype)) * scales.to(x2.dtype)
    return fn(x2.float().contiguous(), q, scales).to(x2.dtype)


def quantize_int4(w: torch.Tensor, group: int = INT4_GROUP) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric INT4 per group of `group` inputs: w [out, in] -> (packed uint8 [out, G*16], fp32 scales [out, G]),
    G = ceil(in / group); the inputs are zero-padded to G*group. As llama.cpp's Q4_0: the scale is the group's
    largest-magnitude weight / -8, so that weight lands exactly on -8 and all 16 levels are used (absmax / 7
    leaves -8 unused). Layout: engine/kernels/gemv.h."""
    if group != 32:
        raise ValueError("the INT4 kernel's layout is fixed at groups of 32 inputs")
    w = w.detach().float()
    out, k = w.shape
    g = -(-k // group)
    wp = F.pad(w, (0, g * group - k)).reshape(out, g, group)
    peak = wp.gather(2, wp.abs().argmax(dim=2, keepdim=True)).squeeze(2)  # signed
    scales = torch.where(peak == 0, torch.full_like(peak, 1e-8), peak / -8.0)
    q = torch.clamp(torch.round(wp / scales[..., None]), -8, 7).to(torch.int32) + 8  # [out, G, 32] in 0..15
    packed = (q[..., :16] | (q[..., 16:] << 4)).to(torch.uint8).reshape(out, g * 16)
    return packed.contiguous(), scales.contiguous()


def dequantize_int4(packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """The float32 weight [out, in] the INT4 kernel multiplies by (the reference for tests and the fallback)."""
    out, g = scales.shape
    b = packed.reshape(out, g, 16).to(torch.int32)
    q = torch.cat([b & 15, b >> 4], dim=2).float() - 8.0  # [out, G, 32]
    return (q * scales[..., None]).reshape(out, g * 32)[:, :in_features]


def dequantize_int4_as(packed: torch.Tensor, scales: torch.Tensor, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """`dequantize_int4(...).to(dtype)` -- the weight a many-row INT4 call multiplies by -- in one pass of our kernel
    where it runs (CPU, fp32 / bf16, not while torch.compile traces): the same values (bf16 rounded to nearest even),
    without torch's five [out, in] temporaries (as long as the matmul itself at 256 rows)."""
    lib = load() if (packed.device.type == "cpu" and dtype in (torch.float32, torch.bfloat16)
                     and not torch.compiler.is_compiling()) else None
    if lib is None:
        return dequantize_int4(packed, scales, in_features).to(dtype)
    out = torch.empty((scales.shape[0], in_features), dtype=dtype)
    lib.isw_int4_dequant(packed.contiguous().data_ptr(), scales.contiguous().data_ptr(), scales.shape[0],
                         scales.shape[1], in_features, out.data_ptr(), 0 if dtype == torch.float32 else 1,
                         MIN_BYTES_PER_THREAD, torch.get_num_threads())
    return out


def int4_gemv(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """x2 [rows, in] @ dequantize_int4(...)^T -> [rows, out] in x2's dtype."""
    fn = _entry(1, x2.device)
    if fn is None:
        return F.linear(x2, dequantize_int4(packed, scales, in_features).to(x2.dtype))
    xf = x2.float()
    pad = scales.shape[1] * 32 - in_features
    if pad:
        xf = F.pad(xf, (0, pad))
    return fn(xf.contiguous(), packed, scales).to(x2.dtype)


def dense_gemv(x2: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x2 [rows, in] @ w^T for a full-precision weight w [out, in] (fp32 or bf16; others take F.linear) -> [rows, out]
    in x2's dtype. Accumulates in fp32 (as torch's CPU bf16 GEMM does), rounds once at the end."""
    fn = _entry(2, x2.device) if w.dtype in (torch.float32, torch.bfloat16) else None
    if fn is None:
        return F.linear(x2, w)
    return fn(x2.float().contiguous(), w.contiguous()).to(x2.dtype)


def quantize_rows_int8(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W8A8's activation quantization, per row (token): x2 [rows, K] -> (int8 [rows, K], fp32 scales [rows, 1]);
    scale = max|x| / 127, q = round-half-even(x / scale). The C++ kernel computes exactly this."""
    xf = x2.float()
    xs = xf.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
    return torch.clamp(torch.round(xf / xs), -127, 127).to(torch.int8), xs


def quantize_q8_0(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """llama.cpp's Q8_0 activation quantization (INT4 x Q8_0): x2 [rows, G*32] -> (int8 [rows, G*32], fp32 scales
    [rows, G]); per block of 32, scale = max|x| / 127, q = round-half-even(x * (1 / scale)) (0 for an all-zero block)."""
    r, k = x2.shape
    xb = x2.float().reshape(r, k // 32, 32)
    sc = xb.abs().amax(dim=2) / 127.0
    inv = torch.where(sc > 0, 1.0 / sc, torch.zeros_like(sc))
    q = torch.clamp(torch.round(xb * inv[..., None]), -127, 127).to(torch.int8)
    return q.reshape(r, k), sc


def w8a8_gemv(x2: torch.Tensor, q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """W8A8: x2 [rows, in] quantized per row to int8, times q int8 [out, in] in int32, rescaled by both scales ->
    [rows, out] float32. The torch path (no kernels) computes the same integers (int32 matmul; torch._int_mm on CUDA)."""
    fn = _entry(3, x2.device)
    if fn is not None:
        return fn(x2.float().contiguous(), q, scales)
    xq, xs = quantize_rows_int8(x2)
    if x2.device.type == "cpu":
        acc = xq.to(torch.int32) @ q.to(torch.int32).t()
    else:  # torch._int_mm (cuBLASLt) needs more than 16 rows: pad (rows are independent)
        rows = xq.shape[0]
        acc = torch._int_mm(F.pad(xq, (0, 0, 0, max(0, 17 - rows))), q.t())[:rows]
    return acc.float() * xs * scales


def int4_q8_gemv(x2: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """INT4 x Q8_0: x2 [rows, in] quantized per block of 32 (Q8_0), times the INT4 weight (quantize_int4's layout)
    block by block in int32, each block's sum scaled by both blocks' scales -> [rows, out] float32."""
    pad = scales.shape[1] * 32 - in_features
    xf = F.pad(x2.float(), (0, pad)) if pad else x2.float()
    fn = _entry(4, x2.device)
    if fn is not None:
        return fn(xf.contiguous(), packed, scales)
    xq, xs = quantize_q8_0(xf)  # [R, G*32], [R, G]
    out, g = scales.shape
    b = packed.reshape(out, g, 16).to(torch.int32)
    wq = torch.cat([b & 15, b >> 4], dim=2) - 8  # [N, G, 32]
    d = torch.einsum("rgk,ngk->rng", xq.reshape(-1, g, 32).to(torch.int32), wq)  # exact block sums [R, N, G]
    return (d.float() * (xs[:, None, :] * scales[None])).sum(-1)
