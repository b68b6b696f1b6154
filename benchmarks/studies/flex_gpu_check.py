"""The flex form's signals on a GPU against the block form on the same inputs (issue 49; the lease run of
2026-12-04 found `attn` wrong on an H200 while the output was right). Prints, per call shape: each signal's
largest error relative to its scale, and the raw log-sum-exps of the fused call against torch.logsumexp.

    python benchmarks/studies/flex_gpu_check.py [--device cuda] [--dtype float32]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))

from fxbudget.kernel import PER_HEAD, measure_phase  # noqa: E402
from fxbudget.kernel.flex_measure import fused_flex  # noqa: E402
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask  # noqa: E402
from test_blocks import _call, kernel_args  # noqa: E402


def signals(device, dtype, call, form):
    inp = {k: (v.to(dtype) if v.is_floating_point() else v).to(device) for k, v in _call(**call).items()}
    q, slots, new, const = kernel_args(inp)
    return measure_phase(PER_HEAD, q, slots, new, const, form=form, window=8, sliding=0, scale=None, block=64)


def raw_lse(device, dtype):
    """The compiled flex call's LSE against torch.logsumexp of the same scores (ratio ~1.4427 would be base 2)."""
    g = torch.Generator().manual_seed(0)
    B, H, N, D = 1, 2, 256, 64
    q, k, v = (torch.randn(B, H, N, D, generator=g).to(device, dtype) for _ in range(3))
    mask = create_block_mask(lambda b, h, i, j: i >= j, B, H, N, N, device=device)
    _, aux = fused_flex(torch.device(device))(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True))
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(N, N, dtype=torch.bool, device=device).tril(), float("-inf"))
    ref = torch.logsumexp(s, -1)
    got = aux.lse.double()
    print(f"raw lse: max |got - ref| {(got - ref).abs().max().item():.3g}; median got/ref "
          f"{(got / ref).median().item():.4f}", flush=True)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()
    dtype = getattr(torch, a.dtype)
    print(f"torch {torch.__version__} on {a.device}, {a.dtype}", flush=True)
    try:
        raw_lse(a.device, dtype)
    except Exception as exc:  # report and go on to the kernel's signals
        print(f"raw lse: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    calls = {"prefill": dict(b=1, h=2, g=7, S=0, held=0, n=300, d=64, left_pads=(0,)),
             "prefill-padded": dict(b=2, h=2, g=7, S=0, held=0, n=300, d=64, left_pads=(0, 37)),
             "chunk": dict(b=1, h=2, g=7, S=200, held=150, n=260, d=64, left_pads=(0,))}
    for name, call in calls.items():
        try:
            (o1, t1, s1), (o2, t2, s2) = (signals(a.device, dtype, call, f) for f in ("blocks", "flex"))
            errs = {}
            for key, x, y in [("out", o1, o2), *((k, s1[k], s2[k]) for k in s1)]:
                if x.is_floating_point() and x.shape == y.shape and x.numel():
                    x, y = x.double().nan_to_num(), y.double().nan_to_num()
                    errs[key] = (x - y).abs().max().item() / max(x.abs().max().item(), 1e-30)
            bad = {k: f"{v:.2g}" for k, v in errs.items() if v > 1e-4}
            ratio = (s2["attn"].double().sum() / s1["attn"].double().sum()).item()
            print(f"{name}: signals off by > 1e-4 of their scale: {bad or 'none'}; sum(attn) flex/blocks "
                  f"{ratio:.4f}", flush=True)
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
