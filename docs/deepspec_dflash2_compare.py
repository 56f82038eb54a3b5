"""Compare xlm-research/DeepSpec's DFlash 2 modules with this reference (docs/PORTS.md).

DeepSpec is not on PyPI, so this is a script, not a test. It loads DeepSpec's
`deepspec/modeling/dflash2/common.py` (the dynamic convolution and the candidate selector; it imports
torch only) from a path, gives it the weights of the embedded drafter, and compares, on the embedded
SmolLM2-135M target's own features:

  1. the convolution, both sides of every sublayer, on full blocks and on a block cut short;
  2. the candidates C_t (as sets: DeepSpec's top-K is unsorted) and every edge score S_t(a, b);
  3. the greedy walk's path;
  4. the sampled walk's proposal rows q (both walks forced to take the argmax of their softmax row,
     so they follow one path), and how each draws (its RNG calls);
  5. the candidate order and how greedy ties break in it.

The backbone (`qwen3_8/modeling.py`) builds on `deepspec.modeling.dspark` and is not run here.

    python docs/deepspec_dflash2_compare.py --common /path/to/DeepSpec/deepspec/modeling/dflash2/common.py \\
        --commit <sha> > docs/results/deepspec_dflash2_compare.txt
"""
import argparse
import contextlib
import importlib.util
import sys

import torch

from dflash2 import model as ours_model
from dflash2.model import CandidateSelector
from dflash2.pair import load_pair
from dflash2.prompts import encode_prompt

PROMPT = ("Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
          "How many clips did she sell?")


def load_common(path):
    spec = importlib.util.spec_from_file_location("deepspec_dflash2_common", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def drafts_on_the_embedded_pair(anchors):
    """Our drafter's h [n, B-1, H] and U [n, B-1, V] for blocks anchored at `anchors` of a chat prompt,
    float64 (the target's features from its own forward), plus the anchor ids and the pair."""
    pair = load_pair(None, None, "cpu", torch.float32, draft_dtype=torch.float32, prepack=False)
    drafter, lm = pair.drafter.double(), pair.target.model
    ids = torch.tensor([encode_prompt(pair.tokenizer, PROMPT)])
    with torch.no_grad():
        out = lm(input_ids=ids, output_hidden_states=True)
        feats = torch.cat([out.hidden_states[l + 1] for l in drafter.config.target_layer_ids], -1).double()
        embed = torch.nn.Embedding.from_pretrained(lm.get_input_embeddings().weight.double())
        head = lm.get_output_embeddings().weight.double()
        B, hs = drafter.config.block_size, []
        for p in anchors:
            kv = drafter.context_kv(feats[:, :p], torch.arange(p)[None])
            hs.append(drafter(drafter.embed_block(ids[:, p], embed), torch.arange(p, p + B)[None], kv,
                              torch.ones(1, p, dtype=torch.bool))[:, 1:])
        h = torch.cat(hs)
        U = drafter.draft_logits(h, head).double()
    return drafter, h, U, ids[0, anchors], ids


def their_selector(common, ours):
    cfg = ours.predecessor_codebook.shape
    theirs = common.CandidateSelector(vocab_size=cfg[0], hidden_size=ours.hidden_projection.weight.shape[1],
                                      rank=cfg[1], top_k=ours.top_k, initializer_range=0.02).double()
    theirs.load_state_dict(ours.state_dict())
    return theirs


@contextlib.contextmanager
def argmax_draws(common):
    """Both sampled walks take the argmax of their softmax row (torch.multinomial in theirs, our
    inverse-CDF sample_index), so they follow one path and q rows can be compared."""
    multinomial, sample_index = torch.multinomial, ours_model.sample_index
    torch.multinomial = lambda probs, n, **kw: probs.argmax(-1, keepdim=True)
    ours_model.sample_index = lambda probs, generator=None: probs.argmax(-1)
    try:
        yield
    finally:
        torch.multinomial, ours_model.sample_index = multinomial, sample_index


def compare_convolutions(common, drafter, log):
    g = torch.Generator().manual_seed(0)
    worst = {}
    for i, layer in enumerate(drafter.layers):
        for name in ("attention_conv", "mlp_conv"):
            ours = getattr(layer, name)
            theirs = common.GroupedDynamicCausalConv(ours.base_kernel.shape[2], ours.kernel_size, ours.group_size)
            theirs = theirs.double()
            theirs.load_state_dict(ours.state_dict())
            for T in (drafter.config.block_size, 3):  # a full block, then a block cut short to 3 slots
                u = torch.randn(2, T, ours.base_kernel.shape[2], generator=g, dtype=torch.float64)
                a = torch.randn(2, T, ours.base_kernel.shape[2], generator=g, dtype=torch.float64)
                with torch.no_grad():
                    ours_u, kappa = ours.prepare(u)
                    their_u, their_kappa = theirs.prepare(u, block_size=T)
                    diff = max((ours_u - their_u).abs().max().item(),
                               (ours.finish(a, kappa) - theirs.finish(a, their_kappa, block_size=T)).abs().max().item())
                worst[T] = max(worst.get(T, 0.0), diff)
    for T, d in worst.items():
        log(f"  convolution, 2 rows of {T}-slot blocks, every sublayer of both layers, prepare + finish: "
            f"max |ours - theirs| = {d:.2e}")
    return max(worst.values()) < 1e-12


def compare_selector(common, drafter, h, U, anchor, log):
    ours = drafter.candidate_selector
    theirs = their_selector(common, ours)
    K = ours.top_k
    ok = True
    with torch.no_grad():
        cand, _ = ours.candidates(U, K)
        path_theirs, cand_theirs, _ = theirs.select(hidden=h, logits=U, anchor_ids=anchor, temperature=0.0)
        same_sets = cand.sort(-1).values.equal(cand_theirs.sort(-1).values)
        ok &= same_sets
        log(f"  candidates: same sets at all {cand.shape[0] * cand.shape[1]} slots: {same_sets}; "
            f"theirs in descending order at {int((cand_theirs == cand).all(-1).sum())} of them (topk sorted=False)")
        # every edge score, teacher-forced: predecessor C_{t-1}[a] (the anchor at t = 1), in their candidate order
        S = ours.edge_scores(h, U, cand, anchor)
        prev = torch.cat([anchor[:, None, None].expand(-1, 1, K), cand[:, :-1]], 1)
        worst = 0.0
        for a in range(K):
            their_row = theirs.pair_scores(hidden=h, unary=U.gather(-1, cand_theirs), candidate_ids=cand_theirs,
                                           predecessor_ids=prev[:, :, a])
            ours_row = S[:, :, a].gather(-1, (cand[..., None, :] == cand_theirs[..., :, None]).float().argmax(-1))
            worst = max(worst, (their_row - ours_row).abs().max().item())
        ok &= worst < 1e-9
        log(f"  edge scores S_t(a, b), all {K}x{K} per slot: max |ours - theirs| = {worst:.2e}")
        path, _ = ours.walk(S, cand)
        ok &= path.equal(path_theirs)
        log(f"  greedy walk: same path in all {path.shape[0]} blocks: {path.equal(path_theirs)}")
        for temperature in (0.7, 1.0):
            with argmax_draws(common):
                path, q = ours.walk(S, cand, temperature)
                path_t, cand_t, q_rows = theirs.select(hidden=h, logits=U, anchor_ids=anchor, temperature=temperature)
            q_theirs = torch.zeros_like(q).scatter(-1, cand_t, q_rows.float())
            d = (q - q_theirs).abs().max().item()
            ok &= path.equal(path_t) and d < 1e-6
            log(f"  sampled walk at T={temperature} (argmax draws): same path {path.equal(path_t)}, "
                f"max |q_ours - q_theirs| = {d:.2e}")
    return ok


def compare_draws(common, log):
    """How each sampled walk draws: theirs calls torch.multinomial on the global RNG, ours one uniform per
    row from the run's generator. Same law, different streams: a seeded replay cannot reproduce theirs."""
    calls = []
    multinomial = torch.multinomial
    torch.multinomial = lambda *a, **kw: calls.append("multinomial") or multinomial(*a, **kw)
    try:
        V, H, K = 50, 8, 4
        theirs = common.CandidateSelector(vocab_size=V, hidden_size=H, rank=2, top_k=K, initializer_range=0.02)
        theirs.select(hidden=torch.randn(1, 3, H), logits=torch.randn(1, 3, V), anchor_ids=torch.zeros(1, dtype=torch.long),
                      temperature=1.0)
    finally:
        torch.multinomial = multinomial
    log(f"  sampled walk of 3 slots: theirs calls torch.multinomial {calls.count('multinomial')} times "
        "(global RNG); ours draws one uniform per slot from the run's torch.Generator (verify.sample_index)")
    return calls.count("multinomial") == 3  # one draw per slot, as ours: same law, another RNG stream


def ties(common, log):
    """Greedy ties: both take the first maximum in candidate order. Their order is topk(sorted=False)'s."""
    g = torch.Generator().manual_seed(1)
    same, n = 0, 300
    for _ in range(n):
        U = torch.randint(0, 4, (1, 2, 40), generator=g).double()  # four values: ties everywhere
        ours = CandidateSelector.__new__(CandidateSelector)
        torch.nn.Module.__init__(ours)
        ours.top_k = 8
        ours.hidden_projection = torch.nn.Linear(4, 2, bias=False).double()
        ours.predecessor_codebook = torch.nn.Parameter(torch.randn(40, 2, generator=g, dtype=torch.float64))
        ours.successor_codebook = torch.nn.Parameter(torch.zeros(40, 2, dtype=torch.float64))  # S = U: tied scores
        theirs = their_selector(common, ours)
        h, anchor = torch.randn(1, 2, 4, generator=g, dtype=torch.float64), torch.zeros(1, dtype=torch.long)
        with torch.no_grad():
            cand, _ = ours.candidates(U, 8)
            path, _ = ours.walk(ours.edge_scores(h, U, cand, anchor), cand)
            path_t, _, _ = theirs.select(hidden=h, logits=U, anchor_ids=anchor, temperature=0.0)
        same += path.equal(path_t)
    log(f"  greedy walk on tie-heavy logits (S = U, 4 distinct values, K = 8), CPU: same path in {same} of {n}")
    return same == n


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--common", required=True, help="DeepSpec's deepspec/modeling/dflash2/common.py")
    p.add_argument("--commit", required=True, help="the DeepSpec commit that file is from (printed)")
    args = p.parse_args(argv)
    common = load_common(args.common)
    lines = []

    def log(s):
        lines.append(s)
        print(s)

    log(f"DeepSpec {args.commit} deepspec/modeling/dflash2/common.py against dflash2-ref "
        f"(torch {torch.__version__}, CPU, float64)")
    drafter, h, U, anchor, ids = drafts_on_the_embedded_pair([6, 20, 40, 55])
    log(f"embedded drafter over embedded SmolLM2-135M, {ids.shape[1]}-token GSM8K prompt, blocks at 4 anchors:")
    results = dict(convolution=compare_convolutions(common, drafter, log),
                   selector=compare_selector(common, drafter, h, U, anchor, log),
                   draws=compare_draws(common, log), ties=ties(common, log))
    log("result: " + ", ".join(f"{k} {'agrees' if v else 'DIFFERS'}" for k, v in results.items()))
    return 0 if all(results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
