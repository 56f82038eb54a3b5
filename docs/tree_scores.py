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

    python docs/tree_scores.py --tasks gsm8k,chat-heldout --num-prompts 10 --budgets 8,32
    python docs/tree_scores.py --tasks gsm8k --temperature 1 --top-p 0.95 --budgets 8
"""

import argparse
import math

import torch
from tqdm import tqdm

from dflash2.bench import format_prompt, load_tasks
from dflash2.model import DraftContext
from dflash2.pair import load_pair, stop_token_ids
from dflash2.prompts import chat_ids
from dflash2.spec_decode import draft, generate, tree_mask
from dflash2.verify import build_tree, marginal_log_weights, process_logits, selector_log_weights

# The scores compared: the selector's (this project's default), the walk's own law (softmax over the K
# candidates only: the selector score before 2026-12-05), and DDTree's per-slot marginals; also
# selector:T (e.g. --scores selector,selector:0.7), the selector's law sharpened or flattened by T; mix:λ, the
# selector's law mixed with DDTree's marginal (λ on the selector's, both read at the K candidates); walkmix:λ, a
# log-linear blend of the selector's law (weight λ) and the walk's; processed (sampling only), the selector's law
# put through the target's processing (temperature, top-k, top-p) before it is read at the candidates.
SCORES = ("selector", "walk", "marginal")


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
    raise SystemExit(f"error: unknown score {name!r}")


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
    args = ap.parse_args(argv)
    budgets, scores = [int(b) for b in args.budgets.split(",")], args.scores.split(",")
    unknown = [s for s in scores if s.partition(":")[0] not in SCORES + ("processed", "mix", "walkmix")]
    if unknown:
        ap.error(f"unknown --scores {', '.join(unknown)}: choose from selector[:T], walk, marginal, mix:λ, "
                 "walkmix:λ, processed")
    if "processed" in scores and args.temperature == 0:
        ap.error("--scores processed needs --temperature > 0 (it processes the law as the target's sampling does)")
    pair = load_pair()
    target, drafter, tok = pair.target, pair.drafter, pair.tokenizer
    sel, B = drafter.candidate_selector, drafter.config.block_size
    stop = stop_token_ids(target.model, tok)
    texts = load_tasks(args.tasks.split(","), args.data_dir, args.first_prompt + args.num_prompts)
    gen = torch.Generator().manual_seed(0)
    sampled = args.temperature > 0
    for task, prompts in texts.items():
        tally = {}  # column -> [(tokens after the first, steps)] per prompt (greedy) or per-anchor expectations
        for i, text in enumerate(tqdm(prompts[args.first_prompt:], desc=task, leave=False)):
            ids = chat_ids(tok, format_prompt(task, text))
            y = generate(target, drafter, [ids], method="ar", max_new_tokens=args.max_new_tokens, stop_ids=stop,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=i)[0].tokens
            R = len(y) - 1  # anchors y[0 .. R-1]; the last token needs no step
            if R <= 0:
                continue
            full, L = torch.tensor(ids + y)[None], len(ids)
            T = full.shape[1]
            max_len = T + max(budgets + [B]) + 2
            cache = target.new_cache(max_len)
            _, feats = target.forward(full, torch.arange(T)[None], cache, T)
            ctx = DraftContext(drafter, 1, max_len, "cpu")
            ctx.write(feats, torch.arange(T)[None])
            ypad = torch.tensor(y + [-1] * B)
            per_anchor = {}
            for s in range(0, R, args.chunk):
                idx = torch.arange(s, min(R, s + args.chunk))
                shared = DraftContext.__new__(DraftContext)  # every anchor reads the same context K/V
                shared.drafter, shared.kv = drafter, [(k.expand(len(idx), -1, -1, -1), v.expand(len(idx), -1, -1, -1))
                                                     for k, v in ctx.kv]
                anchor, pos = torch.tensor(y)[idx], L + idx
                h, U = draft(drafter, target, shared, anchor, pos, T, B)
                max_depth = (len(y) - 1 - idx).clamp(max=B - 1)
                if sampled:
                    per_anchor.setdefault("chain", []).append(
                        expected_chain(target, drafter, cache, h, U, anchor, pos, max_depth, max_len, args, gen))
                else:
                    ref = torch.stack([ypad[j + 1: j + B] for j in idx.tolist()])
                    cand, _ = sel.candidates(U, sel.top_k)
                    path, _ = sel.walk(sel.edge_scores(h, U, cand, anchor), cand)
                    run = (path == ref).long().cumprod(1).sum(1)
                    per_anchor.setdefault("chain", []).append(torch.minimum(run, max_depth))
                for name in scores:
                    for N in budgets:
                        cand, logw = tree_logw(name, sel, h, U, anchor, N, args)
                        tree = build_tree(logw, cand, N, max_depth)
                        col = f"{name}@{N}"
                        if sampled:
                            p = tree_target_law(target, cache, tree, anchor, pos, max_len, args)
                            per_anchor.setdefault(col, []).append(expected_tree(tree, p, max_depth))
                        else:
                            per_anchor.setdefault(col, []).append(greedy_accepted(tree, ref, max_depth))
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
        print(f"{task}: " + ("E[τ] per anchor" if sampled else "τ"), flush=True)
        for col, v in tally.items():
            tau = 1 + sum(v) / len(v) if sampled else sum(a for a, _ in v) / sum(s for _, s in v)
            sem = (f" ± {torch.tensor(v).std().item() / math.sqrt(len(v)):.3f}" if sampled else "")
            print(f"  {col:14s} {tau:.3f}{sem}", flush=True)


if __name__ == "__main__":
    main()
