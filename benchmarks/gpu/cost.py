"""PREDICTED cost of one attention call of the kernel on an H200, phase by phase, against the unmodified model's
attention (issue 51 item 4, issue 49 item 1): nothing here has run on a GPU; the GPU run checks it.

    python benchmarks/gpu/cost.py inductor    # .venv-cuda only: Inductor's byte counts of the kernel's phases and of
                                              # the fused form's two flex calls -> results/gpu_cost_inductor.json
    python benchmarks/gpu/cost.py decode-counts   # .venv-cuda only: the decode steps' kernels, launches and bytes
                                              # for sm_90 and gfx942 -> that JSON's decode_steps (issue 57)
    python benchmarks/gpu/cost.py report      # results/gpu_cost.md and the section of docs/gpu-internals.md, from that JSON
    python benchmarks/gpu/cost.py report --check   # exit 1 if either file differs from what it would write

Shapes: Llama-3.1-8B (`LLAMA_8B`): L = 32 layers, H = 32 query heads, h = 8 KV heads, g = H / h,
d = 128, bf16 (e = 2 bytes; the kernel's fp32 work f = 4 bytes), batch 1, the kernel's window w = 32
(`settings.DEFAULT_WINDOW`), the rule snapkv. A prefill is one call of n tokens on an empty cache of S = B slots; a
decode step is one token over S = B full slots. Per layer (the tables multiply by L):

Unmodified model (SDPA flash; Q, K, V, O each moved once):
    prefill  FLOPs = 4 n^2 d H / 2 (causal)            bytes = (2 H + 2 h) n d e
    decode   FLOPs = 4 N d H (N cached tokens)          bytes = 2 h N d e + 2 H d e

Today's measure phase (`kernel/measure.py`, `key_scan.fold_scan`): fp32 throughout (Q, K, V cast; cuBLAS fp32
matmuls, no TF32). The query block is `settings.auto_block` on CUDA (R = 1024 / 256 / 64 at 8K / 32K / 128K), c =
`key_scan.tile_blocks(R, nb)` blocks per key tile, nb' = `padded_blocks`, N' = nb' R, `nb' / 2` scan steps of
T = nb' / c + 1 tiles. Score elements E = H N' (N' + c R) / 2 (the folded triangle) plus the window-max block
E_w = H w n (the last w queries attended once more); one block (a decode step): E = H n (S + n).
    FLOPs  = (4 d + 11) (E + E_w)   [QK 2d, PV 2d, three column sums 6, mask/max/exp/sum 5 per element]
    bytes  = 20 E + 24 E_w          [fp32 scores materialized per block: written by the QK matmul, read by the row
                                     max, read and written by exp (row sum fused), read by PV, read by the column
                                     sums: 5 passes; the window block one more read for its max]
           + steps T (2 h c R d + H R d) 12        [each step gathers its tiles' K, V and queries: read, written,
                                                    read by the matmul]
           + steps T H R d 8 + steps h 3 N' 4 4    [the tiles' partial outputs; the per-key sums carried over
                                                    the steps: the carry and the step's sums read, the carry written,
                                                    the step's sums written]
           + (2 h + H) n d (e + f) + (2 h + H) N' d 2 f + H n d (f + e)   [casts to fp32, the padded block-major
                                                                           copies, the output back to bf16]
           + 40 h C + 2 h n d e + 2 H n d f        [signals written: 8 fp32 + 1 int64 per candidate, C = S + n;
                                                    key/value norms read the new K/V; wov_norm's product]
    decode: no scan; bytes = 20 E + 2 h S d (e + 2 f) (the slots' fp32 copy written and read) + signals.
Rule region (snapkv): reads window_attn and the positions, writes the score: bytes = 16 h C, FLOPs ~ 10 h C.
Evict (`kernel/evict.py`): the order key (score, position -> int64), a top-k of the n dropped (decode: an argmin),
the freed/kept pairing over S and n, t = min(n, S) K/V rows written, the slots' metadata refilled:
    bytes = h (20 C + 8 C + 8 n + 8 (S + n) + 16 t) + 2 h t d e 2 + 48 h S           FLOPs ~ 0

Fused form (`kernel/flex_measure.py`, issue 49), bf16 inputs with fp32 accumulation (as flash); the queries folded
per KV head (each query head's n rows padded to whole 128-blocks: the formulas count the n real rows):
    forward flex over slots + new, with its LSE:  FLOPs = 4 d H (n S + n^2 / 2)
                                                   bytes = 2 H n d e + 2 h (S + n) d e + 4 H n
    transposed flex (keys as queries, the folded queries as keys, score - LSE_q; its LSE per key is the key's
    column sum); V' = zeros of head dim d' = `flex_measure.VALUE_DIM` (written, then read; the output discarded):
                                                   FLOPs = (2 d + 2 d') H (n S + n^2 / 2)
                                                   bytes = h (S + n) d e + H n d e + 2 H n d' e + 4 H n
                                                           + h (S + n) d' e + 4 h (S + n)
    window block: w queries x C candidates per query head, fp32 scores written and read once:
                                                   FLOPs = (2 d + 10) H w C,  bytes = 8 H w C + h C d e + H w d e
    signals as today (40 h C + 2 h n d e + 2 H n d f).

Time per phase (PREDICTED) = max(FLOPs / (peak x efficiency), bytes / (bandwidth x efficiency)), summed over the
phases and the L layers; `H200` and `EFFICIENCY` say which numbers and why.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from functools import partial
from pathlib import Path

HERE = Path(__file__).resolve().parent  # benchmarks/gpu
ROOT = HERE.parent.parent
sys.path.insert(0, str(ROOT))
from fxbudget.kernel.flex_measure import VALUE_DIM  # noqa: E402  (d' of the transposed call's values)
INDUCTOR_JSON = HERE.parent / "results" / "gpu_cost_inductor.json"
REPORT = HERE.parent / "results" / "gpu_cost.md"
DOCS = ROOT / "docs" / "gpu-internals.md"
BEGIN, END = "<!-- gpu_cost: begin (python benchmarks/gpu/cost.py report) -->", "<!-- gpu_cost: end -->"

# H200 SXM (NVIDIA's datasheet): dense bf16 tensor-core peak, fp32 without tensor cores (same SMs as the H100 SXM),
# HBM3e bandwidth.
H200 = {"bf16_flops": 989e12, "fp32_flops": 67e12, "hbm_bytes": 4.8e12}
# The fraction of each peak assumed achievable, and why.
EFFICIENCY = {
    "flash": (0.35, "SDPA's flash backend is FlashAttention-2, which reaches 35% of an H100's bf16 peak "
                    "(FlashAttention-3 paper, arXiv 2407.08608, abstract)"),
    "flex": (0.315, "FlexAttention's forward runs at ~90% of FlashAttention-2's (PyTorch's FlexAttention blog): "
                    "0.9 x 0.35"),
    "fp32": (0.75, "cuBLAS fp32 GEMMs without TF32 (torch's default) on large shapes"),
    "gemm": (0.70, "cuBLAS bf16 GEMMs of the model's projections and MLP (whole-model column only)"),
    "hbm": (0.80, "streaming kernels reach ~80% of HBM bandwidth"),
}
LENGTHS = (8192, 32768, 131072)
BUDGETS = (1024, 4096)
DECODE_CACHES = (32768, 131072)
DECODE_BATCHES = (1, 8)  # the decode step's batch sizes (left-padded rows: the same graph)
DECODE_INTERVALS = (1, 64)  # interval 1: every step evicts; 64: one evicting step, 63 appending ones
PREFILL_BUDGET = 1024  # S of a prefill row (the measure phase of a prefill on an empty cache does not read it)
FIT_LENGTHS = (2048, 4096, 8192)  # Inductor's prefill counts fitted as a n^2 + b n + c through these
# Inductor cases: the fit lengths, then 32K and 128K lowered directly (the fit's check), then the decode steps.
INDUCTOR_CASES = [("prefill", n, PREFILL_BUDGET) for n in (*FIT_LENGTHS, 32768, 131072)] + \
                 [("decode", 1, B) for B in BUDGETS]
# The fused form's two flex calls lowered at these lengths (their block masks are built on the CPU from n x g n
# mask entries: 8K ran out of memory on the 24 GB development machine)
FUSED_LENGTHS = (1024, 2048, 4096)
LAUNCH_S = 2e-6  # the floor of one small kernel launched from a CUDA graph (assumed; the GPU run checks it)
FLASH_LAUNCHES = 2  # the unmodified attention per layer: the K/V cache append and SDPA's flash kernel
MODEL_LAUNCHES = 10  # the rest of a compiled layer (norms, projections, RoPE, MLP, residuals): whole-model column


# Llama-3.1-8B's config.json (meta-llama/Llama-3.1-8B; benchmarks/configs/ holds the whole file): what this needs.
LLAMA_8B = dict(num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_size=4096,
                intermediate_size=14336, vocab_size=128256)


def shapes() -> dict:
    cfg = LLAMA_8B
    H, h = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // H
    hid, inter = cfg["hidden_size"], cfg["intermediate_size"]
    # Parameters of one layer's projections and MLP (no biases in Llama), for the whole-model column.
    layer_params = hid * (H * d) * 2 + hid * (h * d) * 2 + 3 * hid * inter
    return dict(L=cfg["num_hidden_layers"], H=H, h=h, d=d, w=32, layer_params=layer_params,
                embed_params=cfg["vocab_size"] * hid)


def _blocking(n: int, H: int) -> tuple[int, int, int, int]:
    """(R, c, nb', steps) of a call of n tokens on CUDA, as `measure` picks them (batch 1)."""
    import torch

    from fxbudget.kernel.key_scan import padded_blocks, tile_blocks
    from fxbudget.kernel.settings import auto_block

    R = min(auto_block(H, n, torch.device("cuda")), n)
    nb = -(-n // R)
    c = tile_blocks(R, nb)
    nb2 = padded_blocks(nb, c)
    return R, c, nb2, (nb2 // 2 if n > R else 0)


def flash(kind: str, n: int, s: dict) -> dict:
    H, h, d = s["H"], s["h"], s["d"]
    if kind == "prefill":
        return dict(flops=2 * n * n * d * H, bytes=(2 * H + 2 * h) * n * d * 2, unit="flash")
    return dict(flops=4 * n * d * H, bytes=2 * h * n * d * 2 + 2 * H * d * 2, unit="flash")


def today_measure(kind: str, n: int, S: int, s: dict) -> dict:
    H, h, d, e, f = s["H"], s["h"], s["d"], 2, 4
    w = min(s["w"], n)
    live = 0 if kind == "prefill" else S
    C = S + n
    R, c, nb2, steps = _blocking(n, H)
    signals = 40 * h * C + 2 * h * n * d * e + 2 * H * n * d * f
    if steps:
        N2, T = nb2 * R, nb2 // c + 1
        E, Ew = H * steps * T * R * c * R, H * w * (live + n)
        by = (20 * E + 24 * Ew + steps * T * (2 * h * c * R * d + H * R * d) * 12 + steps * T * H * R * d * 8
              + steps * h * 3 * N2 * 4 * 4 + (2 * h + H) * n * d * (e + f) + (2 * h + H) * N2 * d * 2 * f
              + H * n * d * (f + e) + signals)
    else:
        E, Ew = H * n * (live + n), 0
        by = 20 * E + 2 * h * (live + n) * d * (e + 2 * f) + H * n * d * (e + f) * 2 + signals
    return dict(flops=(4 * d + 11) * (E + Ew), bytes=by, unit="fp32", E=E)


def fused_measure(kind: str, n: int, S: int, s: dict, dp: int = VALUE_DIM) -> dict:
    H, h, d, e, f = s["H"], s["h"], s["d"], 2, 4
    w = min(s["w"], n)
    live = 0 if kind == "prefill" else S
    C, vis = live + n, n * live + n * n / 2  # visible (query, key) pairs per query head
    fwd_f, fwd_b = 4 * d * H * vis, 2 * H * n * d * e + 2 * h * C * d * e + 4 * H * n
    tr_f = (2 * d + 2 * dp) * H * vis
    tr_b = h * C * d * e + H * n * d * e + 2 * H * n * dp * e + 4 * H * n + h * C * dp * e + 4 * h * C
    win_f, win_b = (2 * d + 10) * H * w * C, 8 * H * w * C + h * C * d * e + H * w * d * e
    signals = 40 * h * (S + n) + 2 * h * n * d * e + 2 * H * n * d * f
    return dict(flops=fwd_f + tr_f + win_f, bytes=fwd_b + tr_b + win_b + signals, unit="flex",
                parts=dict(forward=(fwd_f, fwd_b), transposed=(tr_f, tr_b), window=(win_f, win_b)))


def rule_phase(n: int, S: int, s: dict) -> dict:
    C = S + n
    return dict(flops=10 * s["h"] * C, bytes=16 * s["h"] * C, unit="fp32")


def evict_phase(n: int, S: int, s: dict) -> dict:
    h, d = s["h"], s["d"]
    C, t = S + n, min(n, S)
    return dict(flops=0, bytes=h * (20 * C + 8 * C + 8 * n + 8 * (S + n) + 16 * t) + 2 * h * t * d * 2 * 2
                + 48 * h * S, unit="fp32")


def seconds(cost: dict, layers: int) -> float:
    """PREDICTED seconds of `cost` (one layer) over `layers` layers: the larger of its compute and memory times."""
    peak = {"flash": H200["bf16_flops"] * EFFICIENCY["flash"][0], "flex": H200["bf16_flops"] * EFFICIENCY["flex"][0],
            "fp32": H200["fp32_flops"] * EFFICIENCY["fp32"][0]}[cost["unit"]]
    return layers * max(cost["flops"] / peak, cost["bytes"] / (H200["hbm_bytes"] * EFFICIENCY["hbm"][0]))


def model_rest(kind: str, n: int, s: dict) -> float:
    """PREDICTED seconds of everything but attention (projections and MLP; the LM head not counted): compute-bound
    GEMMs in a prefill, the weights read once in a decode step."""
    p = s["L"] * s["layer_params"]
    if kind == "prefill":
        return 2 * p * n / (H200["bf16_flops"] * EFFICIENCY["gemm"][0])
    return (p + s["embed_params"]) * 2 / (H200["hbm_bytes"] * EFFICIENCY["hbm"][0])


def paper_rows(s: dict) -> list[dict]:
    """Every predicted row: prefill at each length, decode at each budget against each full cache."""
    rows = []
    calls = [("prefill", n, PREFILL_BUDGET, n) for n in LENGTHS] + \
            [("decode", 1, B, N) for N in DECODE_CACHES for B in BUDGETS]
    for kind, n, S, ref in calls:
        base = flash(kind, ref, s)
        phases = {"today": {"measure": today_measure(kind, n, S, s), "rule": rule_phase(n, S, s),
                            "evict": evict_phase(n, S, s)},
                  "fused": {"measure": fused_measure(kind, n, S, s), "rule": rule_phase(n, S, s),
                            "evict": evict_phase(n, S, s)}}
        t_base = seconds(base, s["L"])
        row = dict(kind=kind, n=n, S=S, ref=ref, base=base, t_base=t_base, rest=model_rest(kind, n, s))
        for form, ph in phases.items():
            row[form] = {k: dict(v, t=seconds(v, s["L"])) for k, v in ph.items()}
            row[f"t_{form}"] = sum(v["t"] for v in row[form].values())
        rows.append(row)
    return rows


# --- Inductor's counts -----------------------------------------------------------------------------------------

def load_inductor(path: Path = INDUCTOR_JSON) -> dict:
    return json.loads(path.read_text())


def fit_quadratic(points: list[tuple[int, float]]):
    """a n^2 + b n + c through three points (exact), as a function."""
    (x1, y1), (x2, y2), (x3, y3) = points
    den = (x1 - x2) * (x1 - x3) * (x2 - x3)
    a = (x3 * (y2 - y1) + x2 * (y1 - y3) + x1 * (y3 - y2)) / den
    b = (x3 ** 2 * (y1 - y2) + x2 ** 2 * (y3 - y1) + x1 ** 2 * (y2 - y3)) / den
    c = (x2 * x3 * (x2 - x3) * y1 + x3 * x1 * (x3 - x1) * y2 + x1 * x2 * (x1 - x2) * y3) / den
    return (lambda n: a * n * n + b * n + c), (a, b, c)


def inductor_table(ind: dict, s: dict) -> tuple[list[dict], dict]:
    """Per case and phase: Inductor's bytes (one layer) beside the by-hand bytes; the prefill fits."""
    cases = {(c["kind"], c["n"], c["S"]): c for c in ind["cases"]}
    fits = {}
    for phase in ("measure", "rule", "evict"):
        pts = [(n, cases[("prefill", n, PREFILL_BUDGET)]["phases"][phase]["bytes"]) for n in FIT_LENGTHS]
        fits[phase] = fit_quadratic(pts)
    out = []
    for (kind, n, S), c in cases.items():
        hand = {"measure": today_measure(kind, n, S, s), "rule": rule_phase(n, S, s), "evict": evict_phase(n, S, s)}
        for phase, v in c["phases"].items():
            body = [g for g in v["graphs"] if g["trip"] > 1]
            launches = sum(len(g["nodes"]) * g["trip"] for g in v["graphs"])
            loop = sum(len(g["nodes"]) * g["trip"] for g in body)
            out.append(dict(kind=kind, n=n, S=S, phase=phase, inductor=v["bytes"], hand=hand[phase]["bytes"],
                            fit=fits[phase][0](n) if kind == "prefill" else None, kernels=v["kernels"],
                            launches=launches, loop_launches=loop, fallbacks=v["fallbacks"], block=c["block"],
                            steps=c["steps"],
                            body_nodes=body[0]["nodes"] if body else None))
    return out, {p: f[1] for p, f in fits.items()}


def combined(rows: list[dict], itab: list[dict], s: dict) -> list[dict]:
    """The by-hand rows with today's bytes replaced by Inductor's and a launch floor added to every form."""
    L = s["L"]
    by = {(r["kind"], r["n"], r["S"], r["phase"]): r for r in itab}
    out = []
    for pr in rows:
        ind = {ph: by[(pr["kind"], pr["n"], pr["S"], ph)] for ph in ("measure", "rule", "evict")
               if (pr["kind"], pr["n"], pr["S"], ph) in by}
        if len(ind) < 3:
            continue
        launches = sum(r["launches"] for r in ind.values())
        loop = ind["measure"]["loop_launches"]
        # Evict by hand: Inductor charges its indexed reads and writes with whole buffers (see the docs).
        t_today = sum(seconds(dict(pr["today"][ph], bytes=ind[ph]["inductor"]), L) for ph in ("measure", "rule"))
        t_today += pr["today"]["evict"]["t"]
        out.append(dict(pr, launch_today=launches, launch_fused=launches - loop + 3,
                        rest_l=pr["rest"] + L * MODEL_LAUNCHES * LAUNCH_S,
                        t_today_i=t_today + L * launches * LAUNCH_S,
                        t_fused_l=pr["t_fused"] + L * (launches - loop + 3) * LAUNCH_S,
                        t_base_l=pr["t_base"] + L * FLASH_LAUNCHES * LAUNCH_S))
    return out


# --- The whole-model decode step from the decode steps' counts (issue 57) -------------------------------------------

def decode_step_rows(ind: dict, arch: str = "sm_90") -> dict:
    """The JSON's decode steps of `arch`, keyed (step, B, batch)."""
    return {(r["step"], r["B"], r["batch"]): r for r in ind["decode_steps"]["rows"] if r["arch"] == arch}


def step_seconds(r: dict, s: dict) -> float:
    """PREDICTED seconds of one counted decode step through the L layers: the larger of its fp32 arithmetic (the
    measure phase's (4 d + 11) per score element, H (S + 1) elements a row) and Inductor's bytes at the hbm
    fraction, plus the launch floor for each of its launches."""
    flops = (4 * s["d"] + 11) * s["H"] * (r["S"] + 1) * r["batch"]
    return s["L"] * (max(flops / (H200["fp32_flops"] * EFFICIENCY["fp32"][0]),
                         r["bytes"] / (H200["hbm_bytes"] * EFFICIENCY["hbm"][0])) + r["launches"] * LAUNCH_S)


def flash_step_seconds(N: int, batch: int, s: dict) -> float:
    """PREDICTED seconds of the unmodified attention's decode step over N cached tokens (flash, by hand) through the
    L layers, with its launches (the K/V append and flash)."""
    f = flash("decode", N, s)
    return seconds(dict(f, flops=f["flops"] * batch, bytes=f["bytes"] * batch), s["L"]) + \
        s["L"] * FLASH_LAUNCHES * LAUNCH_S


def decode_predictions(ind: dict, s: dict) -> list[dict]:
    """Per budget, full cache, batch and interval: the attention's step time for fxbudget (an interval's k steps
    averaged: one evicting, k - 1 appending) and the unmodified model, and the whole model's (the weights read once
    and the rest's launches added to both)."""
    steps = decode_step_rows(ind)
    rest = model_rest("decode", 1, s) + s["L"] * MODEL_LAUNCHES * LAUNCH_S
    out = []
    for B in BUDGETS:
        for N in DECODE_CACHES:
            for batch in DECODE_BATCHES:
                static_b = flash_step_seconds(B, batch, s)
                for k in DECODE_INTERVALS:
                    ev = steps[("evicting" if k == 1 else "interval-evicting", B, batch)]
                    ap = steps[("appending", B, batch)]
                    t_fx = (step_seconds(ev, s) + (k - 1) * step_seconds(ap, s)) / k
                    t_full = flash_step_seconds(N, batch, s)
                    out.append(dict(B=B, N=N, batch=batch, k=k, launches_evict=ev["launches"],
                                    launches_append=ap["launches"], t_fx=t_fx, t_full=t_full,
                                    whole_fx=t_fx + rest, whole_full=t_full + rest,
                                    append_vs_static=step_seconds(ap, s) / static_b))
    return out


def decode_section(ind: dict, s: dict) -> str:
    rows = decode_step_rows(ind)
    lines = ["## The whole-model decode step (issue 57, PREDICTED)", "",
             f"Llama-3.1-8B ({s['L']} layers), bf16, on the H200 figures above. fxbudget's step: Inductor's count of "
             "the decode step lowered for the fake sm_90 (`python benchmarks/gpu/cost.py decode-counts`: the three "
             "phases as one graph, one layer; its bytes charge indexed writes with whole buffers, so they bound the "
             "traffic from above), the larger of its bytes at the hbm fraction and its fp32 arithmetic, plus "
             f"{LAUNCH_S * 1e6:g} us per launch; at interval k the average of one evicting step (B + k - 1 slots "
             "back to B) and k - 1 appending ones. The unmodified model: flash over the full cache by hand plus "
             f"{FLASH_LAUNCHES} launches a layer. Whole model: the 16 GB of weights read once and "
             f"{MODEL_LAUNCHES} launches a layer added to both. StaticCache over B: flash over B entries.", "",
             "Counts per layer (sm_90; gfx942's are in the JSON):", "",
             "| step | B | batch | slots | Triton kernels | launches | Inductor MB |", "|---|---|---|---|---|---|---|"]
    for (step, B, batch), r in sorted(rows.items()):
        lines.append(f"| {step} | {B} | {batch} | {r['S']} | {r['kernels']} | {r['launches']} "
                     f"| {r['bytes'] / 1e6:.1f} |")
    lines += ["", "| B | full cache | batch | interval | launches a layer (evicting / appending) | attention: fxbudget "
              "/ full | whole model: fxbudget / full | full / fxbudget (whole model) | appending step / StaticCache "
              "over B |", "|---|---|---|---|---|---|---|---|---|"]
    for r in decode_predictions(ind, s):
        lines.append(f"| {r['B']} | {r['N'] // 1024}K | {r['batch']} | {r['k']} | {r['launches_evict']} / "
                     f"{r['launches_append']} | {_t(r['t_fx'])} / {_t(r['t_full'])} | {_t(r['whole_fx'])} / "
                     f"{_t(r['whole_full'])} | **{r['whole_full'] / r['whole_fx']:.2f}x** "
                     f"| {r['append_vs_static']:.2f}x |")
    return "\n".join(lines)


# --- Report ----------------------------------------------------------------------------------------------------

def _gb(x: float) -> str:
    return f"{x / 1e9:,.0f}" if x >= 1e11 else f"{x / 1e9:.1f}" if x >= 1e9 else f"{x / 1e9:.3f}"


def _poly(a: float, b: float, c: float) -> str:
    return f"{a:.4g} n^2 {'-' if b < 0 else '+'} {abs(b):.4g} n {'-' if c < 0 else '+'} {abs(c):.4g}"


def _t(x: float) -> str:
    return f"{x * 1e3:,.1f} ms" if x < 10 else f"{x:,.1f} s"


def _label(r: dict) -> str:
    if r["kind"] == "prefill":
        return f"prefill {r['n'] // 1024}K"
    return f"decode B={r['S']} vs {r['ref'] // 1024}K"


def tables(s: dict, ind: dict | None) -> str:
    rows = paper_rows(s)
    L = s["L"]
    lines = ["PREDICTED (nothing here ran on a GPU). One call through all 32 layers of Llama-3.1-8B, bf16, batch 1. "
             f"H200: {H200['bf16_flops'] / 1e12:.0f} TFLOP/s bf16 dense, {H200['fp32_flops'] / 1e12:.0f} TFLOP/s "
             f"fp32 (no tensor cores), {H200['hbm_bytes'] / 1e12:.1f} TB/s; achievable fractions: "
             + "; ".join(f"{k} {v[0]:g} ({v[1]})" for k, v in EFFICIENCY.items()) + ". Time per phase = "
             "max(FLOPs / achievable peak, bytes / achievable bandwidth). Prefill: one call of n tokens on an empty "
             f"cache of {PREFILL_BUDGET} slots; decode: one token over B slots, against the unmodified model's "
             "decode over the full cache. The fused form's transposed call takes values of head dim "
             f"{VALUE_DIM} (zeros, `flex_measure.VALUE_DIM`: its output is discarded).", "",
             "**By hand** (formulas: `benchmarks/gpu/cost.py`'s docstring), all layers:", "",
             "| call | unmodified (flash) TFLOP / GB / time | today: measure TFLOP / GB / time | rule + evict GB "
             "| today / unmodified | fused: measure TFLOP / GB / time | fused / unmodified "
             "| whole model: today / fused |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        b, tm, fm = r["base"], r["today"]["measure"], r["fused"]["measure"]
        re_gb = L * (r["today"]["rule"]["bytes"] + r["today"]["evict"]["bytes"])
        whole = lambda t: (t + r["rest"]) / (r["t_base"] + r["rest"])  # noqa: E731
        lines.append(
            f"| {_label(r)} | {L * b['flops'] / 1e12:,.1f} / {_gb(L * b['bytes'])} / {_t(r['t_base'])} "
            f"| {L * tm['flops'] / 1e12:,.1f} / {_gb(L * tm['bytes'])} / {_t(tm['t'])} | {_gb(re_gb)} "
            f"| **{r['t_today'] / r['t_base']:.2f}x** | {L * fm['flops'] / 1e12:,.1f} / {_gb(L * fm['bytes'])} / "
            f"{_t(fm['t'])} | **{r['t_fused'] / r['t_base']:.2f}x** | {whole(r['t_today']):.2f}x / "
            f"{whole(r['t_fused']):.2f}x |")
    lines += ["", "Whole model: the ratio with the projections and MLP added to both sides (prefill: their GEMMs "
              "at the gemm fraction; decode: the 16 GB of weights read once at the hbm fraction; the LM head's "
              "GEMM not counted in a prefill)."]
    if ind:
        itab, fits = inductor_table(ind, s)
        lines += ["", f"**Inductor's count** (torch {ind['torch']}, Triton {ind['triton']}, lowered for a fake "
                  "sm_90 through `tests/fake_cuda.py`; `GraphLowering.count_bytes()` per phase, the scan's loop "
                  "body times its trip count), one layer, against the by-hand bytes; prefill fitted as "
                  f"a n^2 + b n + c through n = {', '.join(str(n) for n in FIT_LENGTHS)} and checked against "
                  "the lowering at 32K and 128K:", "",
                  "| call | block R / scan steps | phase | Inductor GB | by hand GB | Inductor / by hand "
                  "| fit GB (fit / lowered) | Triton kernels (launches per layer) | ATen fallbacks |",
                  "|---|---|---|---|---|---|---|---|---|"]
        for r in itab:
            call = f"prefill {r['n']}" if r["kind"] == "prefill" else f"decode B={r['S']}"
            fit = "-" if r["fit"] is None else f"{_gb(r['fit'])} ({r['fit'] / r['inductor']:.2f})"
            lines.append(f"| {call} | {r['block']} / {r['steps']} | {r['phase']} | {_gb(r['inductor'])} "
                         f"| {_gb(r['hand'])} | {r['inductor'] / r['hand']:.2f} | {fit} | {r['kernels']} "
                         f"({r['launches']}) | {', '.join(r['fallbacks']) or 'none'} |")
        lines += ["", "Fits (bytes, one layer): " + "; ".join(
            f"{p}: {_poly(a, b, c)}" for p, (a, b, c) in fits.items()) + "."]
        if ind.get("fused"):
            fz = {r["n"]: r for r in ind["fused"]}
            fit, (a, b, c) = fit_quadratic([(n, fz[n]["bytes"]) for n in FUSED_LENGTHS[-3:]])
            lines += ["", "**Inductor's count of the fused form**: the two flex_attention calls of a one-call "
                      "prefill (the forward over the queries folded per KV head, with its LSE; the transposed call "
                      "over each KV head's keys and its folded queries, values of head dim "
                      f"{ind['fused'][0]['value_dim']}, zeros allocated in the graph), captured by "
                      "Dynamo and lowered for the fake sm_90 (their block masks are built on the CPU, so the "
                      f"lowering stops at {max(fz) // 1024}K), one layer, against the by-hand bytes of the same "
                      f"two calls; fit a n^2 + b n + c through n = {', '.join(str(n) for n in FUSED_LENGTHS[-3:])}: "
                      f"{_poly(a, b, c)} (the n^2 term: the block masks' indices):", "",
                      "| n | Inductor GB | by hand GB | Inductor / by hand | Triton kernels | outside Triton |",
                      "|---|---|---|---|---|---|"]
            for n in (*sorted(fz), *LENGTHS):
                parts = fused_measure("prefill", n, PREFILL_BUDGET, s, dp=ind["fused"][0]["value_dim"])["parts"]
                hand = parts["forward"][1] + parts["transposed"][1]
                if n in fz:
                    r = fz[n]
                    lines.append(f"| {n} | {_gb(r['bytes'])} | {_gb(hand)} | {r['bytes'] / hand:.2f} "
                                 f"| {r['kernels']} | {', '.join(r['fallbacks'] + r['externs']) or 'none'} |")
                elif n not in fz:
                    lines.append(f"| {n} (fit) | {_gb(fit(n))} | {_gb(hand)} | {fit(n) / hand:.2f} | - | - |")
        lines += ["", f"**PREDICTED time, both counts together**: today's form with Inductor's bytes for the "
                  f"measure phase and the rule region (evict by hand: Inductor charges its indexed accesses with "
                  f"whole buffers; compute as by hand) plus a floor of {LAUNCH_S * 1e6:g} us per kernel launch "
                  "(Inductor's "
                  "scheduled kernels per layer, the loop body's times its trip count; an assumption the GPU run "
                  "checks: small kernels replayed from a CUDA graph); the fused form by hand plus today's "
                  "launches outside the scan and 3 more (two flex templates, the window block); the unmodified "
                  f"attention by hand plus {FLASH_LAUNCHES} launches per layer (the K/V append and flash); the "
                  f"whole model adds the projections and MLP as above and {MODEL_LAUNCHES} launches per layer to "
                  "both sides:", "",
                  "| call | unmodified | today (launches) | today / unmodified | fused (launches) "
                  "| fused / unmodified | whole model: today / fused |", "|---|---|---|---|---|---|---|"]
        for pr in combined(rows, itab, s):
            whole = lambda t: (t + pr["rest_l"]) / (pr["t_base_l"] + pr["rest_l"])  # noqa: E731
            lines.append(f"| {_label(pr)} | {_t(pr['t_base_l'])} | {_t(pr['t_today_i'])} ({pr['launch_today']}) "
                         f"| **{pr['t_today_i'] / pr['t_base_l']:.2f}x** | {_t(pr['t_fused_l'])} "
                         f"({pr['launch_fused']}) | **{pr['t_fused_l'] / pr['t_base_l']:.2f}x** "
                         f"| {whole(pr['t_today_i']):.2f}x / {whole(pr['t_fused_l']):.2f}x |")
    return "\n".join(lines)


def decision(s: dict, ind: dict | None) -> str:
    """Issue 49's decision input, in numbers: the prefill at 32K, and the decode step's two forms."""
    rows = paper_rows(s)
    comb = {(r["kind"], r["n"], r["S"], r["ref"]): r for r in combined(rows, inductor_table(ind, s)[0], s)} \
        if ind else {}
    L, bw = s["L"], H200["hbm_bytes"] * EFFICIENCY["hbm"][0]
    p32 = next(r for r in rows if r["kind"] == "prefill" and r["n"] == 32768)
    m = p32["today"]["measure"]
    t_flop = L * m["flops"] / (H200["fp32_flops"] * EFFICIENCY["fp32"][0])
    t_byte = L * m["bytes"] / bw
    whole = lambda t, r: (t + r["rest"]) / (r["t_base"] + r["rest"])  # noqa: E731
    out = [f"Decision input (PREDICTED). Prefill at 32K: today's form {p32['t_today'] / p32['t_base']:.1f}x the "
           f"unmodified attention ({whole(p32['t_today'], p32):.1f}x the whole model's prefill), the fused form "
           f"{p32['t_fused'] / p32['t_base']:.1f}x ({whole(p32['t_fused'], p32):.2f}x the whole model): "
           f"{p32['t_today'] / p32['t_fused']:.1f}x less time than today's. Today's measure phase is bound by its "
           f"fp32 matmuls ({_t(t_flop)} of arithmetic without tensor cores against {_t(t_byte)} of memory "
           f"traffic by hand); either alone is {min(t_flop, t_byte) / p32['t_base']:.1f}x or more the unmodified "
           f"attention. Issue 49's goal (<= 1.3x the model's prefill at 32K) is "
           f"{'met' if whole(p32['t_fused'], p32) <= 1.3 else 'not met'} by the fused form as predicted here."]
    if ind and ind.get("fused"):
        itab = {(r["kind"], r["n"], r["phase"]): r for r in inductor_table(ind, s)[0]}
        fit = fit_quadratic([(r["n"], r["bytes"]) for r in ind["fused"]][-3:])[0]
        today32 = itab[("prefill", 32768, "measure")]["inductor"]
        out[0] += (f" Inductor's counts agree on the gap in bytes: at 32K today's measure phase moves "
                   f"{_gb(today32)} GB a layer, the fused form's two calls {_gb(fit(32768))} GB (fitted), "
                   f"{today32 / fit(32768):,.0f}x less.")
    for N in DECODE_CACHES:
        for B in BUDGETS:
            r = next(x for x in rows if x["kind"] == "decode" and x["S"] == B and x["ref"] == N)
            c = comb.get(("decode", 1, B, N))
            tm, fm = r["today"]["measure"], r["fused"]["measure"]
            line = (f"Decode, B = {B} against the full cache at {N // 1024}K: the unmodified step's attention reads "
                    f"{_gb(L * r['base']['bytes'])} GB; today's measure phase {_gb(L * tm['bytes'])} GB (the slots "
                    f"read through an fp32 copy), the fused form's {_gb(L * fm['bytes'])} GB")
            if c:
                line += (f"; with the launch floor today's step is {_t(c['t_today_i'])} "
                         f"({c['launch_today']} launches a layer, {_t(L * c['launch_today'] * LAUNCH_S)} of them), "
                         f"the fused form's {_t(c['t_fused_l'])}, the unmodified attention's {_t(c['t_base_l'])}")
            out.append(line + ".")
    dec = [c for c in comb.values() if c["kind"] == "decode"]
    if dec:
        gap = max(abs(c["t_today_i"] - c["t_fused_l"]) for c in dec)
        floor = min(L * c["launch_today"] * LAUNCH_S for c in dec)
        out.append(f"Decode keeps today's form: in every decode row the two forms differ by at most {_t(gap)}, "
                   f"nearly all of it the slots' fp32 copy (which the single block can drop by reading bf16 slots with "
                   f"fp32 accumulation), while the launch floor ({_t(floor)} or more a step) dominates both; the "
                   f"fused form would add a second attention call and a block mask per step for no byte it "
                   f"alone can save.")
    return "\n\n".join(out)


# --- The signal set (issue 56): the flex form without its transposed call -------------------------------------

def flex_without_transposed(kind: str, n: int, S: int, s: dict, dp: int = VALUE_DIM) -> dict:
    """The fused form's measure phase of a run whose signal set holds neither `attn` nor `acc_attn`: the forward
    call and the window block, no transposed call. The forward's LSE is still counted (flex's kernel writes it
    whether or not it is asked for), and the signals written as today's (an upper bound: a smaller set writes
    fewer)."""
    m = fused_measure(kind, n, S, s, dp)
    tr_f, tr_b = m["parts"]["transposed"]
    return dict(m, flops=m["flops"] - tr_f, bytes=m["bytes"] - tr_b,
                parts={k: v for k, v in m["parts"].items() if k != "transposed"})


def signal_set_rows(s: dict, ind: dict | None) -> list[dict]:
    """Per prefill length: the unmodified attention, the flex form with the transposed call (a run reading `attn`
    or `acc_attn`: h2o) and without it (snapkv, and every rule that reads neither), each with the rule region
    and evict; with Inductor's launch counts, each plus the launch floor (one launch fewer without the call)."""
    L = s["L"]
    comb = {r["n"]: r for r in combined(paper_rows(s), inductor_table(ind, s)[0], s) if r["kind"] == "prefill"} \
        if ind else {}
    out = []
    for n in LENGTHS:
        S = PREFILL_BUDGET
        rest = {k: dict(v, t=seconds(v, L)) for k, v in (("rule", rule_phase(n, S, s)),
                                                         ("evict", evict_phase(n, S, s)))}
        base = flash("prefill", n, s)
        t_base = seconds(base, L)
        t_rest = sum(v["t"] for v in rest.values())
        with_t = seconds(fused_measure("prefill", n, S, s), L) + t_rest
        without_t = seconds(flex_without_transposed("prefill", n, S, s), L) + t_rest
        row = dict(n=n, t_base=t_base, t_with=with_t, t_without=without_t, rest=model_rest("prefill", n, s))
        c = comb.get(n)
        if c:
            row.update(launch_with=c["launch_fused"], launch_without=c["launch_fused"] - 1,
                       t_base_l=c["t_base_l"], rest_l=c["rest_l"], t_with_l=with_t + L * c["launch_fused"] * LAUNCH_S,
                       t_without_l=without_t + L * (c["launch_fused"] - 1) * LAUNCH_S)
        out.append(row)
    return out


def signal_set_section(s: dict, ind: dict | None) -> str:
    """The prefill predicted with and without the flex form's transposed call (issue 56): results/gpu_cost.md only
    (docs/gpu.md's section is the lead's)."""
    rows = signal_set_rows(s, ind)
    floor = bool(rows and "t_with_l" in rows[0])
    lines = ["## The signal set: the flex form without its transposed call (issue 56, PREDICTED)", "",
             "A run measures what its rules read (`fxbudget.kernel.signal_set`). Without `attn` and `acc_attn` in "
             "the set (snapkv, tova, knorm, pyramidkv and every rule but h2o, observed_attention and `weighted` with "
             "a weight on them) the flex form runs its forward call alone (no log-sum-exp asked; its bytes still counted) and the "
             "window block; with them (h2o), the transposed call too. One-call prefill of n tokens on an empty cache, all "
             f"{s['L']} layers, by hand as above" + ("; the last columns add the launch floor of the combined "
                                                     "table (one launch fewer without the call)" if floor else "")
             + ". Whole model: the projections and MLP added to both sides.", "",
             "| prefill | unmodified | with the transposed call (h2o) | / unmodified | whole model "
             "| without it (snapkv) | / unmodified | whole model"
             + (" | with launches: h2o / snapkv, whole model |" if floor else " |"),
             "|---|---|---|---|---|---|---|---|" + ("---|" if floor else "")]
    for r in rows:
        whole = lambda t: (t + r["rest"]) / (r["t_base"] + r["rest"])  # noqa: E731
        line = (f"| {r['n'] // 1024}K | {_t(r['t_base'])} | {_t(r['t_with'])} | **{r['t_with'] / r['t_base']:.2f}x** "
                f"| {whole(r['t_with']):.2f}x | {_t(r['t_without'])} | **{r['t_without'] / r['t_base']:.2f}x** "
                f"| {whole(r['t_without']):.2f}x |")
        if floor:
            wl = lambda t: (t + r["rest_l"]) / (r["t_base_l"] + r["rest_l"])  # noqa: E731
            line += f" {wl(r['t_with_l']):.2f}x / {wl(r['t_without_l']):.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def _sections(s: dict, ind: dict | None) -> str:
    """Every prediction, in the order both files show them: the phases, the decision, the decode steps (issue 57),
    the prefill with and without the transposed call (issue 56)."""
    return (tables(s, ind) + "\n\n" + decision(s, ind)
            + ("\n\n" + decode_section(ind, s) if ind and "decode_steps" in ind else "")
            + "\n\n" + signal_set_section(s, ind)
            + ("\n\n" + slots_section(ind, s) if ind and "decode_slots" in ind else ""))


def slots_section(ind: dict, s: dict) -> str:
    """The evicting decode step per slot storage (issue 58): Inductor's launches and bytes, and the step's
    PREDICTED time through the L layers as `step_seconds` charges it."""
    rows = [r for r in ind["decode_slots"]["rows"] if r["arch"] == "sm_90"]
    model = {r["B"]: r for r in rows if r["slot_dtype"] == "model"}
    other = {r["arch"]: r["other_calls"] for r in ind["decode_slots"]["rows"] if r["slot_dtype"] == "model"}
    new = sorted({c for r in ind["decode_slots"]["rows"] for c in r["other_calls"]} - {c for v in other.values()
                                                                                      for c in v})
    counts = {a: sorted((r["B"], r["slot_dtype"], r["launches"], r["bytes"]) for r in ind["decode_slots"]["rows"]
                        if r["arch"] == a) for a in {r["arch"] for r in ind["decode_slots"]["rows"]}}
    same = "gfx942 gives the same counts" if counts.get("gfx942") == counts["sm_90"] else "gfx942's differ: the JSON"
    lines = ["## The decode step with quantized slots (issue 58, PREDICTED)", "",
             f"The evicting step (batch 1, snapkv) of one Llama-3.1-8B layer whose slots store keys and values as "
             f"`kernel/slot_storage.py` lays them out, lowered as one graph for the fake sm_90 ({same}: "
             "`python benchmarks/gpu/cost.py decode-counts --slots`); time as the decode steps above, "
             f"{s['L']} layers. Calls outside Triton beyond the bf16 step's, on either target: "
             f"{', '.join(new) or 'none'}.", "",
             "| B | slots | launches | bytes (MB) | vs bf16 bytes | step, 32 layers |", "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["B"], r["slot_dtype"] != "model", r["slot_dtype"])):
        lines.append(f"| {r['B']} | {r['slot_dtype']} | {r['launches']} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['bytes'] / model[r['B']]['bytes']:.2f}x | {step_seconds(r, s) * 1e3:.2f} ms |")
    return "\n".join(lines)


def report_md(s: dict, ind: dict | None) -> str:
    return ("# Predicted cost on an H200 (PREDICTED, not measured)\n\n"
            "Written by `python benchmarks/gpu/cost.py report` from the formulas in its docstring and from "
            "`results/gpu_cost_inductor.json` (written by `python benchmarks/gpu/cost.py inductor` in `.venv-cuda`). "
            "The GPU run (`benchmarks/gpu/run.sh`) checks these numbers.\n\n" + _sections(s, ind) + "\n")


def docs_section(s: dict, ind: dict | None) -> str:
    return f"{BEGIN}\n{_sections(s, ind)}\n{END}"


def updated_docs(text: str, section: str) -> str:
    if BEGIN not in text or END not in text:
        raise SystemExit(f"docs/gpu-internals.md has no {BEGIN!r} ... {END!r} block to replace")
    head, rest = text.split(BEGIN, 1)
    return head + section + rest.split(END, 1)[1]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ap_i = sub.add_parser("inductor", help="lower the phases for a fake sm_90 (.venv-cuda) and write the JSON")
    ap_i.add_argument("--out", type=Path, default=INDUCTOR_JSON)
    ap_d = sub.add_parser("decode-counts", help="lower the decode steps for a fake sm_90 and gfx942 (.venv-cuda): "
                          "kernels, launches and bytes per phase -> the JSON's decode_steps")
    ap_d.add_argument("--out", type=Path, default=INDUCTOR_JSON)
    ap_d.add_argument("--slots", action="store_true", help="the evicting step per slot storage instead (model, "
                      "float8_e4m3fn, int8) -> the JSON's decode_slots (issue 58)")
    ap_r = sub.add_parser("report", help="write results/gpu_cost.md and docs/gpu-internals.md's section")
    ap_r.add_argument("--check", action="store_true", help="exit 1 if a file differs from what would be written")
    args = ap.parse_args(argv)
    s = shapes()
    if args.cmd == "inductor":
        sys.path.insert(0, str(HERE))
        import cost_inductor as gpu_cost_inductor

        gpu_cost_inductor.run(INDUCTOR_CASES, {k: s[k] for k in ("H", "h", "d")}, s["w"], "snapkv", args.out,
                              fused=FUSED_LENGTHS, value_dim=VALUE_DIM)
        return 0
    if args.cmd == "decode-counts":
        sys.path.insert(0, str(HERE))
        import cost_inductor as gpu_cost_inductor

        run = gpu_cost_inductor.run_slots if args.slots else partial(gpu_cost_inductor.run_decode,
                                                                     batches=DECODE_BATCHES)
        run(BUDGETS, shp={k: s[k] for k in ("H", "h", "d")}, window=s["w"], rule="snapkv", out=args.out)
        return 0
    ind = load_inductor() if INDUCTOR_JSON.exists() else None
    want = {REPORT: report_md(s, ind), DOCS: updated_docs(DOCS.read_text(), docs_section(s, ind))}
    stale = [p for p, t in want.items() if not p.exists() or p.read_text() != t]
    if args.check:
        for p in stale:
            print(f"{p.relative_to(ROOT)} differs from `python benchmarks/gpu/cost.py report`")
        return 1 if stale else 0
    for p in stale:
        p.write_text(want[p])
        print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
