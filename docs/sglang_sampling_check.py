"""Run SGLang's DFlash 2 sampling kernels, unchanged, in Triton's CPU interpreter beside this reference
(docs/PORTS.md, SGLang section).

SGLang 0.5.23 draws a DFlash 2 block with `_selector_walk_kernel` (`sglang/kernels/ops/speculative/dflash.py`)
and verifies it with `speculative_sampling_classic_kernel` (`.../speculative/reject_sampling.py`), both
Triton. Both files import only torch and triton, so with TRITON_INTERPRET=1 they run on a CPU: the
kernels' own arithmetic, with numpy's reductions standing in for the GPU's (`tl.sum` is numpy's pairwise
sum, `tl.cumsum` a left-to-right scan). Cases:

  1. walk: q over K = 4 candidates, two of them exp-underflowed to 0, u = 1 - 2^-24 (the largest float32
     below 1): the kernel's index min(#{j: u >= cumsum_j}, K - 1) can land on a candidate whose own q is 0;
  2. verify, q(d) = 0 < P(d): the kernel rejects (0 < q <= 1 is required); SPEC §5 accepts (alpha = 1);
  3. verify, P = q and a draft with q(d) = P(d) = 0: the residual max(P - q, 0) is 0 everywhere and the
     kernel emits token V - 1, which P gives 0; ours draws from P;
  4. bonus draw, P = [1, a, a, a, 0, 0, 0, 0] with a = 2^-24, u = 1 - 2^-24: pass 1 sums the row with
     tl.sum, pass 2 scans it with tl.cumsum; the two round differently, no scan value exceeds u * sum,
     and the kernel emits V - 1 (P = 0); ours emits token 3.

    pip download --no-deps sglang==0.5.23 && python -m zipfile -e sglang-0.5.23-*.whl sgl
    pip install triton   # any recent version; nothing runs on a GPU
    python docs/sglang_sampling_check.py --sglang sgl/sglang > docs/results/sglang_sampling_check.txt
"""
import argparse
import importlib.util
import os
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

from dflash2 import verify  # noqa: E402

BELOW_ONE = 1 - 2.0**-24  # the largest float32 below 1


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def their_verify(rs, drafts, p, q, u_accept, u_final):
    """SGLang's chain_speculative_sampling_triton on one request: drafts [n], p [n+1, V], q [n, V].
    Returns (num_accepted, the emitted token)."""
    n = len(drafts)
    candidates = torch.tensor([[0] + list(drafts)])  # slot 0 is the anchor; its id is never read
    predicts = torch.full((n + 1,), -1, dtype=torch.int32)
    accept_index = torch.full((1, n + 1), -1, dtype=torch.int32)
    accept_num = torch.zeros(1, dtype=torch.int32)
    rs.chain_speculative_sampling_triton(
        predicts=predicts, accept_index=accept_index, accept_token_num=accept_num, candidates=candidates,
        retrive_index=torch.arange(n + 1)[None], retrive_next_token=None, retrive_next_sibling=None,
        uniform_samples=torch.tensor([list(u_accept) or [0.0]]), uniform_samples_for_final_sampling=torch.tensor([u_final]),
        target_probs=p[None].float(), draft_probs=q.view(1, n, p.shape[-1]).float(), threshold_single=1.0,
        threshold_acc=1.0, deterministic=True)
    a = int(accept_num[0])
    return a, int(predicts[accept_index[0, a]])


def our_verify(drafts, p, q, u_accept, u_final):
    n = len(drafts)
    a, out = verify.verify_sampled(torch.tensor([list(drafts)]).view(1, n), q.view(1, n, p.shape[-1]).float(), p[None].float(),
                                   torch.tensor([list(u_accept)]).view(1, n), torch.tensor([u_final]))
    return int(a[0]), int(out[0, int(a[0])])


def walk_case(dk):
    """Case 1 on a grid of scores [0, x, -200, -200]: rows whose drawn candidate has q = 0 in the kernel's own q."""
    xs = torch.linspace(-3.0, 0.0, 3001)
    rows = len(xs)
    scores = torch.full((rows, 1, 4, 4), -200.0)
    scores[:, 0, :, 0], scores[:, 0, :, 1] = 0.0, xs[:, None]
    candidate_ids = torch.arange(4).expand(rows, 1, 4).contiguous()
    tokens, q = dk.selector_walk_triton(candidate_ids=candidate_ids, scores=scores,
                                        uniforms=torch.full((rows, 1), BELOW_ONE), temperatures=torch.ones(rows),
                                        greedy_mask=torch.zeros(rows, dtype=torch.bool))
    q_drawn = q[:, 0].gather(-1, tokens)[:, 0]
    zero = (q_drawn == 0).nonzero().flatten().tolist()
    print(f"1. walk, scores [0, x, -200, -200] for {rows} values of x in [-3, 0], u = 1 - 2^-24:")
    print(f"   SGLang's walk drew a candidate with q = 0 in {len(zero)} rows", end="")
    if zero:
        r = zero[0]
        print(f"; first x = {xs[r].item():.6g}: q = {q[r, 0].tolist()}, drawn candidate {tokens[r, 0].item()}")
    else:
        print()
    ours = verify.sample_from(q[:, 0], torch.full((rows,), BELOW_ONE))
    print(f"   ours (sample_from on the kernel's q rows): candidates with q = 0 drawn in "
          f"{int((q[:, 0].gather(-1, ours[:, None]) == 0).sum())} rows")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sglang", required=True, type=Path, help="the sglang package directory (from the wheel)")
    args = ap.parse_args()
    ops = args.sglang / "kernels" / "ops" / "speculative"
    rs = load(ops / "reject_sampling.py", "sglang_reject_sampling")
    dk = load(ops / "dflash.py", "sglang_dflash_kernels")
    import triton

    version = load(args.sglang / "_version.py", "sglang_version").__version__
    print(f"SGLang {version} kernels from {ops.relative_to(args.sglang.parent)} in Triton {triton.__version__}'s interpreter (TRITON_INTERPRET=1), "
          f"torch {torch.__version__}")
    walk_case(dk)

    p = torch.tensor([[0.25] * 4, [0.25] * 4])
    q = torch.tensor([[0.5, 0.5, 0.0, 0.0]])
    print("2. verify, draft d = 2 with q(d) = 0, P(d) = 1/4, u_emit = 0.3: (num_accepted, emitted token)")
    for u in (0.0, 0.5, 0.99):
        print(f"   u_accept {u}: SGLang {their_verify(rs, [2], p, q, [u], 0.3)}, ours {our_verify([2], p, q, [u], 0.3)}")

    p = torch.tensor([[0.5, 0.5, 0.0, 0.0], [0.25] * 4])
    print("3. verify, P = q = [1/2, 1/2, 0, 0], draft d = 2 (q(d) = P(d) = 0), u_accept 0.5: (num_accepted, emitted)")
    for u in (0.0, 0.3, 0.9):
        print(f"   u_emit {u}: SGLang {their_verify(rs, [2], p, q, [0.5], u)}, ours {our_verify([2], p, q, [0.5], u)}"
              f"   (P of token 3: {p[0, 3].item()})")

    a = 2.0**-24
    p = torch.tensor([[1.0, a, a, a, 0.0, 0.0, 0.0, 0.0]])
    theirs = their_verify(rs, [], p, torch.zeros(0, 8), [], BELOW_ONE)
    ours = our_verify([], p, torch.zeros(0, 8), [], BELOW_ONE)
    print(f"4. bonus draw from P = [1, a, a, a, 0, 0, 0, 0], a = 2^-24, u_emit = 1 - 2^-24: SGLang emits {theirs[1]} "
          f"(P = {p[0, theirs[1]].item()}), ours {ours[1]} (P = {p[0, ours[1]].item():.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
