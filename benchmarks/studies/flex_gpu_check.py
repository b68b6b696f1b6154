"""The flex form's signals on a GPU against the block form on the same inputs (issue 49; the lease run of
2026-12-04 found `attn` wrong on an H200 while the output was right, with the form of 77df3c1). Prints, per case:
each signal's largest error relative to its scale and the flex/blocks ratio of `sum(attn)`; first, the log-sum-exps
of compiled flex calls (plain and `enable_gqa`, the earlier form's first call) against torch.logsumexp. In bfloat16
it also checks each form against the block form in float64 on the same (rounded) inputs, with the
bounds of tests/test_flex_measure.py: the attention signals within 1e-5 of their scale (fp32 sums of exact
products), the output within 2^-8 of its scale plus the values' (rounded twice, as flash attention's).

    python benchmarks/studies/flex_gpu_check.py [--device cuda] [--dtype float32|bfloat16]

On a CPU it runs flex's eager path (what tests/test_flex_measure.py checks): a dry run of this script.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from fxbudget.kernel import HEAD_POOL, PER_HEAD, measure_phase  # noqa: E402
from fxbudget.kernel.flex_measure import fused_flex  # noqa: E402
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask  # noqa: E402
from test_blocks import _call, kernel_args  # noqa: E402
from test_flex_measure import ATTN_SIGNALS, RTOL, bf16_output_bound  # noqa: E402

# case -> (test_blocks._call sizes, sliding window, head pool). Sizes past one flex block (128) in every direction.
CASES = {
    "prefill": (dict(b=1, h=2, g=7, S=0, held=0, n=300, d=64, left_pads=(0,)), 0, False),
    "prefill-padded": (dict(b=2, h=2, g=7, S=0, held=0, n=300, d=64, left_pads=(0, 37)), 0, False),
    "chunk": (dict(b=1, h=2, g=7, S=200, held=150, n=260, d=64, left_pads=(0,)), 0, False),
    "sliding": (dict(b=1, h=2, g=4, S=0, held=0, n=400, d=64, left_pads=(0,)), 100, False),
    "pool-chunk": (dict(b=1, h=2, g=4, S=300, held=150, n=260, d=64, left_pads=(0,)), 0, True),
}


def inputs(device, dtype, call, pooled, upcast=None):
    """The case's kernel inputs in `dtype` (then in `upcast`, exactly: the float64 reference of rounded inputs)."""
    inp = {k: (v.to(dtype).to(upcast or dtype) if v.is_floating_point() else v).to(device)
           for k, v in _call(**call).items()}
    q, slots, new, const = kernel_args(inp)
    if pooled:  # the slots spread over the heads by a random owner (some free), as the head pool holds them
        owner = torch.randint(-1, slots.pos.shape[1], slots.owner.shape, generator=torch.Generator().manual_seed(1),
                              dtype=torch.int32).to(device)
        slots = replace(slots, owner=owner, pos=torch.where(owner >= 0, slots.pos, -1))
    return q, slots, new, const


def raw_lse(device, dtype, hq, hkv):
    """The compiled flex call's LSE against torch.logsumexp of the same scores (ratio ~1.4427 would be base 2)."""
    g = torch.Generator().manual_seed(0)
    N, D = 300, 64
    q = torch.randn(1, hq, N, D, generator=g).to(device, dtype)
    k, v = (torch.randn(1, hkv, N, D, generator=g).to(device, dtype) for _ in range(2))
    mask = create_block_mask(lambda b, h, i, j: i >= j, 1, hq, N, N, device=device)
    _, aux = fused_flex(torch.device(device))(q, k, v, block_mask=mask, enable_gqa=hq != hkv,
                                              return_aux=AuxRequest(lse=True))
    kk = k.double().repeat_interleave(hq // hkv, dim=1)
    s = (q.double() @ kk.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=device).tril(), float("-inf"))
    ref = torch.logsumexp(s, -1)
    got = aux.lse.double()
    print(f"raw lse (q heads {hq}, kv heads {hkv}): max |got - ref| {(got - ref).abs().max().item():.3g}; "
          f"median got/ref {(got / ref).median().item():.4f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    # Every case compiled: past Dynamo's default limit (8) the calls would fall back to flex's eager math path.
    torch._dynamo.config.recompile_limit = 64
    print(f"torch {torch.__version__} on {a.device}, {a.dtype}", flush=True)
    for hq, hkv in ((2, 2), (14, 2)):
        try:
            raw_lse(a.device, dtype, hq, hkv)
        except Exception as exc:  # report and go on to the kernel's signals
            print(f"raw lse: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    worst, worst64 = 0.0, 0.0
    for name, (call, sliding, pooled) in CASES.items():
        try:
            args = inputs(a.device, dtype, call, pooled)
            run = lambda form, args: measure_phase(HEAD_POOL if pooled else PER_HEAD, *args, form=form,  # noqa: E731
                                                   window=8, sliding=sliding, scale=None, block=64)
            (o1, t1, s1), (o2, t2, s2) = run("blocks", args), run("flex", args)
            if dtype == torch.bfloat16:
                worst64 = max(worst64, against_float64(name, run("blocks", inputs(a.device, dtype, call, pooled,
                                                                                  torch.float64)),
                                                       {"blocks": (o1, s1), "flex": (o2, s2)}, args))
            errs = {}
            for key, x, y in [("out", o1, o2), *((k, s1[k], s2[k]) for k in s1)]:
                if x.is_floating_point() and x.shape == y.shape and x.numel():
                    x, y = x.double().nan_to_num(), y.double().nan_to_num()
                    errs[key] = (x - y).abs().max().item() / max(x.abs().max().item(), 1e-30)
            worst = max(worst, *errs.values())
            bad = {k: f"{v:.2g}" for k, v in errs.items() if v > 1e-4}
            ratio = (s2["attn"].double().sum() / s1["attn"].double().sum()).item()
            print(f"{name}: largest error {max(errs.values()):.2g} ({max(errs, key=errs.get)}); off by > 1e-4 of "
                  f"their scale: {bad or 'none'}; sum(attn) flex/blocks {ratio:.6f}", flush=True)
        except Exception as exc:
            worst = math.inf
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"worst relative error over the cases: {worst:.3g}", flush=True)
    if dtype == torch.bfloat16:
        print(f"against float64: worst error / its bound over the cases and forms: {worst64:.3g} "
              f"({'within' if worst64 <= 1 else 'OUTSIDE'} {a.dtype}'s bounds)", flush=True)


def against_float64(name, ref, got, args):
    """Each form's output and attention signals against the float64 block form; prints them, returns the largest
    error over its bound (<= 1: within)."""
    (ref_out, _, ref_sig), (_, slots, new, _) = ref, args
    bound = bf16_output_bound(ref_out, new, slots)
    worst, parts = 0.0, []
    for form, (out, sig) in got.items():
        ratios = {"out": (out.double() - ref_out).abs().max().item() / bound}
        for k in ATTN_SIGNALS:
            x, y = sig[k].double().nan_to_num(), ref_sig[k].nan_to_num()
            ratios[k] = (x - y).abs().max().item() / (RTOL * max(y.abs().max().item(), 1e-30))
        worst = max(worst, *ratios.values())
        parts.append(f"{form} out {ratios['out']:.2g}, signals {max(ratios[k] for k in ATTN_SIGNALS):.2g}")
    print(f"{name} against float64 (error / bound): {'; '.join(parts)}", flush=True)
    return worst


if __name__ == "__main__":
    main()
