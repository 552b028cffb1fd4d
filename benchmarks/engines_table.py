"""The engines side-by-side table for BENCHMARKS.md, from `infersweep report engines` (reports/engines/trials.csv).

    infersweep sweep experiment=engines && infersweep report engines && python benchmarks/engines_table.py

Rows: workloads (batch x context); columns: engine variants (the `engine_variant` a trial ran). Cells are
decode tok/s (generated tokens after the first / decode time: the phase where the engines differ most) with
output tok/s, TTFT, peak memory, weight bytes and ppl in the second table. The last columns are native's decode tok/s as a
ratio of llama.cpp's and vLLM's at equal weight bytes (all three fp32: 538 MB for SmolLM2-135M), measured in
the same sweep.
"""
from __future__ import annotations

import argparse
import csv
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ORDER = ("hf-fp32", "native-fp32", "llamacpp-f32", "vllm-fp32", "hf-half", "native-half", "llamacpp-f16", "vllm-half",
         "hf-int8", "native-int8", "llamacpp-q8_0")


def variant(optimizations: str) -> str:
    """The engine variant a trial ran, from its optimization settings (a reproduced run keeps the config but
    not the sweep's run name)."""
    d = dict(p.split("=", 1) for p in optimizations.split() if "=" in p)
    engine, dtype, quant = d.get("engine", "hf"), d.get("model.dtype", "float32"), d.get("quant", "none")
    if quant != "none":
        return f"{engine}-" + {"int8-weight": "int8", "gguf-q8_0": "q8_0"}.get(quant, quant)
    if engine == "llamacpp":
        return {"float32": "llamacpp-f32", "float16": "llamacpp-f16"}.get(dtype, "llamacpp-bf16")
    return f"{engine}-" + ("fp32" if dtype == "float32" else "half")


def num(x: str) -> float | None:
    return float(x) if x not in ("", None) else None


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--csv", default=str(ROOT / "reports" / "engines" / "trials.csv"))
    a = ap.parse_args(argv)
    rows = [r for r in csv.DictReader(open(a.csv)) if r["status"] == "FINISHED"]
    cells: dict[tuple[str, str], dict] = {(r["workload"], variant(r["optimizations"])): r for r in rows}

    def key(w: str) -> tuple[int, int]:
        d = dict(p.split("=", 1) for p in w.split())
        return int(d["workload.batch_size"]), int(d["workload.context_len"])

    workloads = sorted({r["workload"] for r in rows}, key=key)
    variants = [v for v in ORDER if any((w, v) in cells for w in workloads)]
    label = {w: "batch {} ctx {}".format(*key(w)) for w in workloads}
    out = ["| workload | " + " | ".join(variants) + " | native / llama.cpp (f32) | native / vLLM (fp32) |",
           "|" + "---|" * (len(variants) + 3)]
    for w in workloads:
        dec = {v: num(cells[(w, v)]["decode_tok_s"]) for v in variants if (w, v) in cells}
        line = [label[w]] + [f"{dec[v]:.1f}" if dec.get(v) else "-" for v in variants]
        nat = dec.get("native-fp32")
        for other in ("llamacpp-f32", "vllm-fp32"):
            line.append(f"x{nat / dec[other]:.2f}" if nat and dec.get(other) else "-")
        out.append("| " + " | ".join(line) + " |")
    print("Decode tok/s (batch x tokens after the first / decode time):\n")
    print("\n".join(out))
    out = ["| workload | variant | output tok/s | x hf-fp32 | ttft ms p50 | peak MB | weights MB | ppl |",
           "|---|---|---|---|---|---|---|---|"]
    for w in workloads:
        base = num(cells[(w, "hf-fp32")]["output_tok_s"]) if (w, "hf-fp32") in cells else None
        for v in variants:
            r = cells.get((w, v))
            if r is None:
                continue
            o = num(r["output_tok_s"])
            out.append(f"| {label[w]} | {v} | {o:.1f} | " + (f"x{o / base:.2f}" if base else "-")
                       + f" | {num(r['ttft_ms_p50']):.0f} | {num(r['peak_mem_bytes']) / 1e6:.0f}"
                       + f" | {num(r['weights_bytes']) / 1e6:.0f} | {num(r['ppl']):.3f} |")
    print("\nEnd to end (prefill + 32 tokens), memory and accuracy:\n")
    print("\n".join(out))


if __name__ == "__main__":
    main()
