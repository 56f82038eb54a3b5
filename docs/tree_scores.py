"""How good a tree each path score builds, measured offline on the embedded pair (docs/BENCHMARKS.md, "Tree scores").

Greedy: the target's own greedy continuation is fixed, so the drafter's block at an anchor depends only on
the anchor's position. This script drafts at every position of the ar continuation once, builds each
score's tree, and counts the drafts it would accept; then it replays decoding (anchor -> anchor +
accepted + 1) to get τ as `bench` reports it, without a verify forward per step.

Sampled (--temperature > 0): along an ar sampled continuation, for every anchor, the expected number
of accepted drafts of each fixed tree, exactly: the sum over its nodes of the product of P along the
node's path (one target forward over the tree); and the chain's, as the mean over --chain-walks
sampled walks of the sum over d of the product of min(1, P/q) over its first d drafts. The figure is
1 + that mean over every anchor (all positions weigh the same, as the replay does not).

Calibrated (greedy, --scores calibrated --fit TASK:FIRST:NUM,...): how often the selector's law is right
at each depth, given the target's own path so far, on the --fit slices (a reliability table), then a
logistic model per depth of P(candidate = the target's token | the parent is the target's) from the law's
row (the candidate's log weight and rank, the row's mass and best weight), fitted there; its log
probabilities are the calibrated tree's path scores on the evaluated slices.

    python docs/tree_scores.py --tasks gsm8k,chat-heldout --num-prompts 10 --budgets 8,32
    python docs/tree_scores.py --tasks gsm8k --temperature 1 --top-p 0.95 --budgets 8
    python docs/tree_scores.py --tasks gsm8k --budgets 8,32 --scores selector,calibrated --fit gsm8k:32:48
"""

import argparse
import math
from types import SimpleNamespace

import torch
from tqdm import tqdm

from dflash2.bench import format_prompt, load_tasks
from dflash2.model import DraftContext
from dflash2.pair import load_pair, stop_token_ids
from dflash2.prompts import encode_prompt
from dflash2.proposers import draft
from dflash2.spec_decode import generate, tree_mask
from dflash2.verify import build_tree, marginal_log_weights, process_logits, selector_log_weights

# The scores compared: the selector's (this project's default), the walk's own law (softmax over the K
# candidates only: the selector score before 2026-12-05), and DDTree's per-slot marginals; also
# selector:T (e.g. --scores selector,selector:0.7), the selector's law sharpened or flattened by T; mix:λ, the
# selector's law mixed with DDTree's marginal (λ on the selector's, both read at the K candidates); walkmix:λ, a
# log-linear blend of the selector's law (weight λ) and the walk's; processed (sampling only), the selector's law
# put through the target's processing (temperature, top-k, top-p) before it is read at the candidates;
# calibrated (greedy only), the selector's law through the per-depth model fitted on the --fit slices.
SCORES = ("selector", "walk", "marginal")
FAMILIES = SCORES + ("processed", "mix", "walkmix", "calibrated")


def tree_logw(name, sel, h, U, anchor, budget, args):
    """(candidate ids, log weights) of the score `name` (see SCORES and the list above it)."""
    if name == "marginal":
        return marginal_log_weights(U, budget)
    cand, _ = sel.candidates(U, sel.top_k)
    S, U = sel.edge_scores(h, U, cand, anchor).float(), U.float()
    kind, _, value = name.partition(":")
    x = float(value) if value else 1.0
    if kind == "walk":
        return cand, torch.log_softmax(S, -1)
    if kind == "selector":  # selector:T: S and U divided by T
        return cand, selector_log_weights(S / x, U / x, cand)
    if kind == "processed":  # the selector's whole-vocabulary law processed as the target's (T, top-k, top-p)
        b, n, K, _ = S.shape
        full = U[:, :, None, :].expand(b, n, K, U.shape[-1]).clone()
        full.scatter_(-1, cand[:, :, None, :].expand(b, n, K, K), S)
        P = process_logits(full, args.temperature, args.top_k, args.top_p)
        return cand, P.gather(-1, cand[:, :, None, :].expand(b, n, K, K)).log()
    law = selector_log_weights(S, U, cand)
    if kind == "mix":  # x on the selector's law, 1 - x on DDTree's marginal
        marginal = torch.log_softmax(U, -1).gather(-1, cand)[:, :, None, :].expand_as(law)
        return cand, torch.logaddexp(law + math.log(x), marginal + math.log1p(-x))
    if kind == "walkmix":
        return cand, x * law + (1 - x) * torch.log_softmax(S, -1)
    if kind == "calibrated":
        return cand, calibrated_logw(law, args.calibration)
    raise SystemExit(f"error: unknown score {name!r}")


def law_features(law):
    """Features of the calibration model for every entry of a parent's row: law [..., K] -> [..., K, 6]:
    the log weight, rank 0, rank 1, the row's log mass on C_t, the row's best log weight, log weight x mass."""
    x = law.float().clamp(min=-30.0)
    rank = x.argsort(-1, descending=True).argsort(-1)
    mass = x.logsumexp(-1, keepdim=True).expand_as(x)
    best = x.max(-1, keepdim=True).values.expand_as(x)
    return torch.stack([x, (rank == 0).float(), (rank == 1).float(), mass, best, x * mass], -1)


def calibrated_logw(law, model):
    """law [b, n, K, K] -> log P(candidate = the target's token | parent on the target's path), per slot's model."""
    w, bias = model  # [n, 6], [n]
    z = (law_features(law) * w[None, :, None, None, :]).sum(-1) + bias[None, :, None, None]
    return torch.nn.functional.logsigmoid(z)


def target_rows(law, cand, ref, max_depth):
    """The law along the target's own path: at each depth, the row after the target's previous token
    (the anchor's at depth 1), which candidate is the target's next token, and whether the depth counts
    (every earlier target token is among its slot's candidates, and depth <= max_depth).
    law [A, n, K, K], cand [A, n, K], ref [A, n] -> rows [A, n, K], hit [A, n, K] bool, counts [A, n] bool."""
    A, n, K = cand.shape
    hit = cand == ref[:, :, None]
    g = hit.long().argmax(-1)  # the target's candidate index (0 where it is not a candidate; counts is false then)
    parent = torch.cat([torch.zeros(A, 1, dtype=torch.long), g[:, :-1]], 1)
    rows = law.gather(2, parent[:, :, None, None].expand(A, n, 1, K)).squeeze(2)
    reached = torch.cat([torch.ones(A, 1, dtype=torch.bool), hit[:, :-1].any(-1).cumprod(1).bool()], 1)
    return rows, hit, reached & (torch.arange(1, n + 1)[None] <= max_depth[:, None])


def logistic_fit(X, y, l2=1e-4, steps=30):
    """Logistic regression by Newton's method (float64): X [m, F], y [m] in {0, 1} -> (w [F], bias)."""
    X = torch.cat([X.double(), torch.ones(len(X), 1, dtype=torch.float64)], 1)
    y, theta = y.double(), torch.zeros(X.shape[1], dtype=torch.float64)
    reg = torch.full((X.shape[1],), l2 * len(X), dtype=torch.float64)
    reg[-1] = 0.0
    for _ in range(steps):
        p = torch.sigmoid(X @ theta)
        grad = X.T @ (p - y) + reg * theta
        hess = (X * (p * (1 - p))[:, None]).T @ X + torch.diag(reg)
        theta = theta - torch.linalg.solve(hess, grad)
    return theta[:-1].float(), theta[-1].float()


def fit_calibration(pair, stop, args, spare):
    """Fit the per-depth calibration model on the --fit slices; print the law's reliability there."""
    sel, B = pair.drafter.candidate_selector, pair.drafter.config.block_size
    rows, hits, counts = [], [], []
    for spec in args.fit.split(","):
        task, first, num = spec.split(":")
        prompts = load_tasks([task], args.data_dir, int(first) + int(num))[task][int(first):]
        for i, text in enumerate(tqdm(prompts, desc=f"fit {spec}", leave=False)):
            for c in continuation_blocks(pair, stop, task, text, i, args, spare):
                cand, _ = sel.candidates(c.U, sel.top_k)
                law = selector_log_weights(sel.edge_scores(c.h, c.U, cand, c.anchor), c.U, cand)
                r, h, k = target_rows(law, cand, c.ref, c.max_depth)
                rows.append(r), hits.append(h), counts.append(k)
    rows, hits, counts = torch.cat(rows), torch.cat(hits), torch.cat(counts)
    print(f"reliability of the selector's law on {args.fit}, along the target's own path:")
    print("  depth  rows   best weight  best = target's  mass on C_t  target's in C_t")
    weights, biases = [], []
    for d in range(B - 1):
        r, h = rows[counts[:, d], d], hits[counts[:, d], d]
        best = r.argmax(-1, keepdim=True)
        print(f"  {d + 1:5d} {len(r):6d} {r.max(-1).values.exp().mean():12.3f} {h.gather(1, best).float().mean():16.3f}"
              f" {r.logsumexp(-1).exp().mean():12.3f} {h.any(-1).float().mean():16.3f}")
        w, b = logistic_fit(law_features(r).reshape(-1, 6), h.reshape(-1))
        weights.append(w), biases.append(b)
    return torch.stack(weights), torch.stack(biases)


def greedy_accepted(tree, ref, max_depth):
    """Drafts a tree accepts against the target's tokens ref [b, n] after the anchor."""
    b, N = tree.tokens.shape
    on_path = torch.zeros(b, N + 1, dtype=torch.bool)
    on_path[:, 0] = True
    accepted = torch.zeros(b, dtype=torch.long)
    for j in range(N):  # canonical order: a parent before its children
        d = tree.depth[:, j]
        want = ref.gather(1, (d - 1)[:, None]).squeeze(1)
        hit = (tree.valid[:, j] & on_path.gather(1, tree.parents[:, j:j + 1]).squeeze(1)
               & (tree.tokens[:, j] == want) & (d <= max_depth))
        on_path[:, j + 1] = hit
        accepted = torch.where(hit, torch.maximum(accepted, d), accepted)
    return accepted


def expected_tree(tree, p, max_depth):
    """E[accepted drafts] of a fixed tree under sampled verification: sum over nodes of P(path)."""
    b, N = tree.tokens.shape
    reach = torch.ones(b, N + 1)
    rows = torch.arange(b)
    for j in range(N):
        parent = tree.parents[:, j]
        ok = tree.valid[:, j] & (tree.depth[:, j] <= max_depth)
        reach[:, j + 1] = torch.where(ok, reach[rows, parent] * p[rows, parent, tree.tokens[:, j]], 0.0)
    return reach[:, 1:].sum(1)


def continuation_blocks(pair, stop, task, text, seed, args, spare):
    """The target's own continuation of one prompt (ar, sampled at --temperature > 0), then the drafter's
    block at each of its anchors, --chunk anchors per forward. Yields one namespace per chunk: h, U (the
    drafter's block), anchor, pos, max_depth (drafts left after the anchor, at most B - 1), ref [A, B - 1]
    (the target's tokens after each anchor, -1 past the end), R (anchors in the prompt), and the target's
    cache of the whole continuation with its length max_len (room for `spare` more slots)."""
    target, drafter, tok = pair.target, pair.drafter, pair.tokenizer
    B = drafter.config.block_size
    ids = encode_prompt(tok, format_prompt(task, text))
    y = generate(target, drafter, [ids], method="ar", max_new_tokens=args.max_new_tokens, stop_ids=stop,
                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=seed)[0].tokens
    R = len(y) - 1  # anchors y[0 .. R-1]; the last token needs no step
    if R <= 0:
        return
    full, L = torch.tensor(ids + y)[None], len(ids)
    T = full.shape[1]
    max_len = T + spare + 2
    cache = target.new_cache(max_len)
    _, feats = target.forward(full, torch.arange(T)[None], cache, T)
    ctx = DraftContext(drafter, 1, max_len, "cpu")
    ctx.write(feats, torch.arange(T)[None])
    ypad = torch.tensor(y + [-1] * B)
    for s in range(0, R, args.chunk):
        idx = torch.arange(s, min(R, s + args.chunk))
        shared = DraftContext.__new__(DraftContext)  # every anchor reads the same context K/V
        shared.drafter, shared.kv = drafter, [(k.expand(len(idx), -1, -1, -1), v.expand(len(idx), -1, -1, -1))
                                             for k, v in ctx.kv]
        anchor, pos = torch.tensor(y)[idx], L + idx
        h, U = draft(drafter, target, shared, anchor, pos, T, B)
        yield SimpleNamespace(h=h, U=U, anchor=anchor, pos=pos, max_depth=(len(y) - 1 - idx).clamp(max=B - 1),
                              ref=torch.stack([ypad[j + 1: j + B] for j in idx.tolist()]), R=R, cache=cache,
                              max_len=max_len)


def rows_cache(target, cache, r, max_len):
    """r copies of a one-row slot cache (each row writes its own tree into its scratch slots)."""
    out = target.new_cache(max_len)
    for layer, src in zip(out.layers, cache.layers):
        layer.keys = src.keys.expand(r, -1, -1, -1).clone()
        layer.values = src.values.expand(r, -1, -1, -1).clone()
        layer.is_initialized = True
    return out


def tree_target_law(target, cache, tree, anchor, pos, max_len, args):
    """P at [anchor, nodes] from one target forward with the tree mask (as decode_tree_step builds it)."""
    r, N = tree.tokens.shape
    view_len = int(pos.max()) + N + 1
    slots, visible = tree_mask(pos, tree.parents, view_len)
    depth = torch.cat([torch.zeros_like(tree.depth[:, :1]), tree.depth], 1)
    logits, _ = target.forward(torch.cat([anchor[:, None], tree.tokens], 1), pos[:, None] + depth,
                               rows_cache(target, cache, r, max_len), view_len, slots=slots, visible=visible)
    return process_logits(logits, args.temperature, args.top_k, args.top_p)


def expected_chain(target, drafter, cache, h, U, anchor, pos, max_depth, max_len, args, gen):
    sel, B = drafter.candidate_selector, drafter.config.block_size
    cand, _ = sel.candidates(U, sel.top_k)
    S = sel.edge_scores(h, U, cand, anchor)
    total = torch.zeros(len(pos))
    for _ in range(args.chain_walks):
        drafts, q = sel.walk(S, cand, args.temperature, gen)
        logits, _ = target.forward(torch.cat([anchor[:, None], drafts], 1), pos[:, None] + torch.arange(B),
                                   rows_cache(target, cache, len(pos), max_len), int(pos.max()) + B)
        p = process_logits(logits, args.temperature, args.top_k, args.top_p)
        alpha = (p[:, :-1].gather(-1, drafts[..., None]) / q.gather(-1, drafts[..., None])).squeeze(-1)
        alpha = alpha.nan_to_num(nan=0.0).clamp(max=1.0) * (torch.arange(B - 1)[None] < max_depth[:, None])
        total += alpha.cumprod(1).sum(1)
    return total / args.chain_walks


@torch.inference_mode()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="gsm8k,chat-heldout")
    ap.add_argument("--num-prompts", type=int, default=10)
    ap.add_argument("--first-prompt", type=int, default=0, help="skip the task's first prompts (a held-out slice)")
    ap.add_argument("--budgets", default="8,32")
    ap.add_argument("--scores", default=",".join(SCORES))
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--top-k", type=int, default=0)
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--chain-walks", type=int, default=3, help="sampled walks per anchor for the chain's expectation")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--chunk", type=int, default=16, help="anchors drafted per forward")
    ap.add_argument("--fit", default="", help="TASK:FIRST:NUM,... the slices --scores calibrated is fitted on")
    args = ap.parse_args(argv)
    budgets, scores = [int(b) for b in args.budgets.split(",")], args.scores.split(",")
    unknown = [s for s in scores if s.partition(":")[0] not in FAMILIES]
    if unknown:
        ap.error(f"unknown --scores {', '.join(unknown)}: choose from selector[:T], walk, marginal, mix:λ, "
                 "walkmix:λ, processed, calibrated")
    if "processed" in scores and args.temperature == 0:
        ap.error("--scores processed needs --temperature > 0 (it processes the law as the target's sampling does)")
    if "calibrated" in scores and (args.temperature > 0 or not args.fit):
        ap.error("--scores calibrated is greedy only and needs --fit TASK:FIRST:NUM,... (the slices it is fitted on)")
    if args.fit and any(len(f.split(":")) != 3 or not all(x.isdigit() for x in f.split(":")[1:])
                        for f in args.fit.split(",")):
        ap.error(f"--fit {args.fit!r}: expected TASK:FIRST:NUM,... e.g. gsm8k:32:48")
    pair = load_pair()
    target, drafter, tok = pair.target, pair.drafter, pair.tokenizer
    sel, B = drafter.candidate_selector, drafter.config.block_size
    stop = stop_token_ids(target.model, tok)
    spare = max(budgets + [B])  # the largest tree's scratch slots after the continuation
    if args.fit:
        args.calibration = fit_calibration(pair, stop, args, spare)
    texts = load_tasks(args.tasks.split(","), args.data_dir, args.first_prompt + args.num_prompts)
    gen = torch.Generator().manual_seed(0)
    sampled = args.temperature > 0
    for task, prompts in texts.items():
        tally = {}  # column -> [(tokens after the first, steps)] per prompt (greedy) or per-anchor expectations
        for i, text in enumerate(tqdm(prompts[args.first_prompt:], desc=task, leave=False)):
            per_anchor, R = {}, 0
            for c in continuation_blocks(pair, stop, task, text, i, args, spare):
                h, U, anchor, pos, max_depth, R = c.h, c.U, c.anchor, c.pos, c.max_depth, c.R
                if sampled:
                    per_anchor.setdefault("chain", []).append(expected_chain(
                        target, drafter, c.cache, h, U, anchor, pos, max_depth, c.max_len, args, gen))
                else:
                    cand, _ = sel.candidates(U, sel.top_k)
                    path, _ = sel.walk(sel.edge_scores(h, U, cand, anchor), cand)
                    run = (path == c.ref).long().cumprod(1).sum(1)
                    per_anchor.setdefault("chain", []).append(torch.minimum(run, max_depth))
                for name in scores:
                    for N in budgets:
                        cand, logw = tree_logw(name, sel, h, U, anchor, N, args)
                        tree = build_tree(logw, cand, N, max_depth)
                        col = f"{name}@{N}"
                        if sampled:
                            p = tree_target_law(target, c.cache, tree, anchor, pos, c.max_len, args)
                            per_anchor.setdefault(col, []).append(expected_tree(tree, p, max_depth))
                        else:
                            per_anchor.setdefault(col, []).append(greedy_accepted(tree, c.ref, max_depth))
            for col, parts in per_anchor.items():
                acc = torch.cat(parts)
                if sampled:
                    tally.setdefault(col, []).extend(acc.tolist())
                    continue
                j = steps = 0
                while j < R:  # decode: the next anchor is accepted + 1 positions on
                    j += int(acc[j]) + 1
                    steps += 1
                tally.setdefault(col, []).append((R, steps))
        print(f"{task}: " + ("E[τ] per anchor" if sampled else "τ (all steps pooled; the bench's per-request mean)"),
              flush=True)
        for col, v in tally.items():
            if sampled:
                sem = torch.tensor(v).std().item() / math.sqrt(len(v))
                print(f"  {col:14s} {1 + sum(v) / len(v):.3f} ± {sem:.3f}", flush=True)
            else:
                per_request = sum(a / s for a, s in v) / len(v)
                print(f"  {col:14s} {sum(a for a, _ in v) / sum(s for _, s in v):.3f}  ({per_request:.3f})", flush=True)


if __name__ == "__main__":
    main()
