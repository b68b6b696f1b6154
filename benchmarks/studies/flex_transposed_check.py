"""Which part of the flex form's transposed call goes wrong when compiled for a GPU (issue 49: on an H200, torch 2.11,
`attn` came out 1.48x too large on a 300-token prefill while the eager math path was exact). One prefill shape
(14 query heads over 2 KV heads, 300 tokens, causal, the folded layout of `flex_measure`), float32, each variant a
fresh static compile of `flex_attention`, its result against a float64 dense reference:

  first     the first call with the form's block mask: output and log-sum-exp
  ours      the transposed call: the form's block mask, score_mod subtracting the reference log-sum-exp
  torchmask the same with torch's own `create_block_mask` of the same mask_mod
  nomod     the form's block mask, no score_mod: the column log-sum-exp of the raw scores
  dense     no block mask: the mask inside the score_mod (every block visited)
  dynamic   "ours" under a dynamic-shape compile

    python benchmarks/studies/flex_transposed_check.py [--device cuda]   # --device cpu --backend eager: a dry run
"""

from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from fxbudget.kernel.flex_measure import FLEX_BLOCK, _block_mask, _visibility


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--n", type=int, default=300)
    p.add_argument("--backend", default="inductor", help="eager: the dry run on a CPU (flex's math path)")
    a = p.parse_args()
    dev = a.device
    gen = torch.Generator().manual_seed(0)
    b, h, g, n, d = 1, 2, 7, a.n, 64
    hq = h * g
    q = torch.randn(b, hq, n, d, generator=gen).to(dev)
    k = torch.randn(b, h, n, d, generator=gen).to(dev)
    v = torch.randn(b, h, n, d, generator=gen).to(dev)
    scale = 1 / math.sqrt(d)
    qpos = torch.arange(n, dtype=torch.int32, device=dev).view(1, n)
    kpos = qpos.view(1, 1, n).expand(b, h, n).contiguous()
    vis_blk, full_blk = _visibility(kpos, qpos, 0)
    nq = vis_blk.shape[2]
    n_pad = nq * FLEX_BLOCK
    L, C = g * n_pad, n
    qf = F.pad(q, (0, 0, 0, n_pad - n)).reshape(b, h, L, d)
    qpos_f = F.pad(qpos, (0, n_pad - n), value=-1).repeat(1, g)
    row_kv = torch.arange(h, device=dev).view(h, 1).expand(h, L).contiguous()

    def visible(bi, hi, ci, ri):
        kp, qp = kpos[bi, row_kv[hi, ri], ci], qpos_f[bi, ri]
        return (kp >= 0) & (kp <= qp)

    fold = lambda x: x.repeat_interleave(g, dim=1).reshape(b, h, g * nq, x.shape[-1])  # noqa: E731
    vis_f, full_f = fold(vis_blk), fold(full_blk)
    mask = _block_mask(vis_f, full_f, lambda bi, hi, ri, ci: visible(bi, hi, ci, ri), (L, C))
    mask_t = _block_mask(vis_f.transpose(-1, -2), full_f.transpose(-1, -2), visible, (C, L))

    # float64 dense reference
    s = (qf.double() @ k.double().transpose(-1, -2)) * scale  # [b, h, L, C]
    vis = (kpos.view(b, h, 1, C) <= qpos_f.view(b, 1, L, 1)) & (qpos_f.view(b, 1, L, 1) >= 0)
    s = s.masked_fill(~vis, float("-inf"))
    lse_ref = torch.logsumexp(s, -1)  # [b, h, L]: -inf on pad rows
    lse0 = lse_ref.masked_fill(lse_ref == float("-inf"), 0.0).float()
    out_ref = torch.softmax(s, -1).nan_to_num() @ v.double()
    col_ref = torch.logsumexp(s - lse0.double().unsqueeze(-1), dim=-2)  # [b, h, C]
    raw_ref = torch.logsumexp(s, dim=-2)

    def err(got, ref, rows=None):
        got, ref = got.double(), ref.double()
        fin = torch.isfinite(ref)
        e = (got - ref).abs().masked_fill(~fin, 0).max().item()
        same_inf = bool(torch.equal(fin, torch.isfinite(got)))
        ratio = (got.exp().nan_to_num().sum() / ref.exp().nan_to_num().sum()).item()
        return f"max |err| {e:.3g}, finite where the reference is: {same_inf}, sum(exp) ratio {ratio:.6f}"

    def compiled(dynamic=False):
        torch._dynamo.reset()
        return torch.compile(flex_attention, dynamic=dynamic, backend=a.backend)

    lse_c = lse0.clone()
    sub = lambda sc, bi, hi, ci, ri: sc - lse_c[bi, hi, ri]  # noqa: E731
    runs = {
        "first": lambda fx: fx(qf, k, v, block_mask=mask, scale=scale, return_aux=AuxRequest(lse=True)),
        "ours": lambda fx: fx(k, qf, qf, score_mod=sub, block_mask=mask_t, scale=scale,
                              return_aux=AuxRequest(lse=True)),
        "torchmask": lambda fx: fx(k, qf, qf, score_mod=sub, scale=scale, return_aux=AuxRequest(lse=True),
                                   block_mask=create_block_mask(visible, b, h, C, L, device=dev)),
        "nomod": lambda fx: fx(k, qf, qf, block_mask=mask_t, scale=scale, return_aux=AuxRequest(lse=True)),
        "dense": lambda fx: fx(k, qf, qf, scale=scale, return_aux=AuxRequest(lse=True),
                               score_mod=lambda sc, bi, hi, ci, ri: torch.where(visible(bi, hi, ci, ri),
                                                                               sc - lse_c[bi, hi, ri], -float("inf"))),
    }
    print(f"torch {torch.__version__} on {dev}; b {b}, q heads {hq}, kv heads {h}, n {n} (folded {L}), d {d}",
          flush=True)
    for name, fn in [*runs.items(), ("dynamic", runs["ours"])]:
        try:
            out, aux = fn(compiled(dynamic=name == "dynamic"))
            if name == "first":
                o = out.view(b, h, g, n_pad, d)[:, :, :, :n]
                r = out_ref.view(b, h, g, n_pad, d)[:, :, :, :n]
                print(f"first: output max |err| {(o.double() - r).abs().max().item():.3g}; lse "
                      f"{err(aux.lse.view(b, h, g, n_pad)[..., :n], lse_ref.view(b, h, g, n_pad)[..., :n])}",
                      flush=True)
            else:
                print(f"{name}: {err(aux.lse, raw_ref if name == 'nomod' else col_ref)}", flush=True)
        except Exception as exc:
            print(f"{name}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)


if __name__ == "__main__":
    main()
