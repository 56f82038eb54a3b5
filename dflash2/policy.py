"""The speculation policy: how wide each step's verify forward is, from what this machine pays for a width
and what the drafter expects to be accepted. Never slower than plain decoding, and lossless.

Costs: a verify forward over w tokens costs V(w), and a draft (drafter + selector) costs D, both measured
once per machine, target and dtype (measure_costs, cached on disk) in units of a one-token forward V(1).

Each step, for each row:
1. Draft or not (before drafting, from earlier steps only): a row drafts while its drafted steps have
   made more tokens per unit cost than plain decoding does (1 per V(1)); after a drafted step that did
   not pay, it decodes plainly for 2, 4, 8, ... (at most 64) steps before it tries again. A try is judged
   mostly on its own: the rate it updates starts from at least TRY_RATE. Each drafted step after which the
   rate still pays halves the wait (down to 2), so one lucky try after many failures does not make tries
   frequent again at once.
2. How far (after drafting): the chain verifies draft k while the selector's law expects it accepted
   with a probability worth its extra cost: c_1 * .. * c_k >= rho * (V(k + 1) - V(k)), with c_j the
   law's largest probability at slot j (given draft j-1: never draft j itself) and rho the row's rate so
   far. The first slot that fails ends the block. The decision to verify d_k reads d_1..d_{k-1} and the
   laws only: a stopping rule, lossless at every temperature (SPEC §10). A tree takes the node budget
   with the most expected tokens per unit cost, sum of exp(path score) over its nodes; a tree is fixed
   before the target's draws, so any budget is lossless (SPEC §9).
In a batch each row is cut on its own and the forward is as wide as the widest row (a tree's budget is
the batch's: the one the row that wants the most nodes chooses).
"""
import bisect
import functools
import hashlib
import itertools
import json
import time
from dataclasses import dataclass

import torch

from .machine import machine
from .proposers import drafter_proposer
from .settings import AUTO_TREE_CAP, cache_dir
from .target import text_config
from .verify import Sampling

COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)  # measured; the rest interpolated
COST_CONTEXT = 256  # context length the costs are measured at
TREE_BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32)  # the auto tree's choices (and its cap)
TRY_RATE = 0.9  # a try after a plain run resumes drafting if it makes >= 1.23 tokens per unit cost (forget 0.7)
STEADY = 0.25  # two measurements of the costs agree when each cost differs by at most this share (of 1 for drafts):
# a quiet machine's differ by up to 0.2 (at the widest verifies), a busy one's by 0.3 to 1 (BENCHMARKS)
MAX_PASSES = 3  # measurements of the costs before giving up on two that agree


@dataclass
class Costs:
    """V(w) for w = 1..len(verify), D for the chain's and the tree's draft, in units of V(1)."""

    verify: list  # verify[w - 1] = V(w) / V(1)
    draft: float
    draft_tree: float
    key: str = ""
    ms_per_token: float = 0.0  # V(1) in ms, for --profile
    steady: bool = True  # False: no two measurements agreed (a busy machine); used for one process, never cached

    def V(self, w):
        return self.verify[min(w, len(self.verify)) - 1]


def interpolate(points, n):
    """[V(1) .. V(n)]: piecewise linear through the measured {width: cost}, straight on past the last point."""
    ws = sorted(points)

    def at(w):
        i = min(max(bisect.bisect_left(ws, w), 1), len(ws) - 1)  # the segment [ws[i - 1], ws[i]]
        a, b = ws[i - 1], ws[i]
        return points[a] + (points[b] - points[a]) * (w - a) / (b - a)

    return [points[w] if w in points else at(w) for w in range(1, n + 1)]


def cost_key(target, drafter):
    """What the costs depend on: machine, threads, device, target and drafter shapes and dtypes."""
    tc = text_config(target.model.config)
    parts = [machine().describe(), f"threads {torch.get_num_threads()}", str(target.device), type(target.model).__name__,
             f"{tc.hidden_size}x{tc.num_hidden_layers} v{target.vocab_size}", str(target.lm_head_weight.dtype),
             f"packed {target.prepacked}"]
    if drafter is not None:
        dc = drafter.config
        parts += [f"{type(drafter).__name__} {dc.hidden_size}x{dc.num_hidden_layers} B{dc.block_size} "
                  f"K{getattr(dc, 'selector_top_k', 0)}",
                  str(next(drafter.parameters()).dtype)]
    return " | ".join(parts)


_MEMO = {}


def costs_for(target, drafter, measure, cache_file=None):
    """This machine's costs for the pair: from memory, else from the cache file, else measured (measure(target,
    drafter) is measure_costs, 1-3 s) and stored. A busy machine times some widths in a quiet moment
    and others not: measured costs are stored only when two measurements in a row agree (steady); otherwise
    (MAX_PASSES without) their median serves this process, marked unsteady, and the next process measures again."""
    key = cost_key(target, drafter)
    if key in _MEMO:
        return _MEMO[key]
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    stored = {}
    if cache_file is not None and cache_file.is_file():
        try:
            stored = json.loads(cache_file.read_text())
        except (OSError, json.JSONDecodeError):
            stored = {}
    if digest in stored and stored[digest].get("key") == key:
        costs = Costs(**stored[digest])
    else:
        costs = measure_steadily(target, drafter, measure)
        if cache_file is not None and costs.steady:
            stored[digest] = costs.__dict__
            try:
                cache_file.parent.mkdir(parents=True, exist_ok=True)
                cache_file.write_text(json.dumps(stored, indent=1))
            except OSError:
                pass  # a read-only cache: measure again next time
    _MEMO[key] = costs
    return costs


def agree(a, b):
    """Whether two measurements of the costs agree: every V(w) within STEADY of the larger, the drafts within
    STEADY of one plain step (a draft costs a fraction of one)."""
    pairs = [(a.V(w), b.V(w)) for w in COST_WIDTHS] + [(a.draft, b.draft), (a.draft_tree, b.draft_tree)]
    return all(abs(x - y) <= STEADY * max(x, y, 1.0) for x, y in pairs)


def combine(passes, steady):
    """The element-wise median of measurements of the costs (the mean of two)."""
    def mid(xs):
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2

    return Costs([mid(v) for v in zip(*(c.verify for c in passes))], mid([c.draft for c in passes]),
                 mid([c.draft_tree for c in passes]), passes[-1].key, mid([c.ms_per_token for c in passes]), steady)


def measure_steadily(target, drafter, measure):
    """Measure until two measurements in a row agree (at most MAX_PASSES): their mean, steady; else the median
    of all, unsteady."""
    passes = [measure(target, drafter)]
    while len(passes) < MAX_PASSES:
        passes.append(measure(target, drafter))
        if agree(passes[-2], passes[-1]):
            return combine(passes[-2:], True)
    return combine(passes, False)


@dataclass
class RequestState:
    """One request's history, on the host: its rate on drafted steps (tokens per unit cost, an average that
    forgets), and how many plain steps it takes before it drafts again."""

    rate: float = 1.3  # a new request drafts first, and stops after two steps that do not pay
    plain_left: int = 0
    backoff: int = 2
    after_plain: bool = False  # the next drafted step is a try after a plain run


class Policy:
    """The widths of the loop's steps (module docstring). A step's contract, for every policy: begin (step 1:
    whether the drafter runs), then inside a drafted step cut_chain or cut_tree (step 2), then end with what the
    step verified and accepted. Nothing is carried from a cut to end but what the step returns."""

    def __init__(self, costs, cap, tree=False, forget=0.7):
        self.costs, self.cap, self.tree, self.forget = costs, cap, tree, forget
        self.state = {}  # request -> RequestState
        self.rows = []  # the states of this step's rows

    def begin(self, requests, steps, alive):
        """Step 1, from earlier steps only: whether the drafter runs this step (some live row wants it)."""
        self.rows = [self.state.setdefault(r, RequestState()) for r in requests]
        return any(a and s.plain_left == 0 for a, s in zip(alive, self.rows))

    def cut_chain(self, conf):
        """Step 2 of a chain: conf [b, n] the law's largest probability per slot. Returns the drafts each row
        verifies [b] and the forward's width, the widest row's block (host)."""
        rho = torch.tensor([max(1.0, s.rate) for s in self.rows], device=conf.device)
        keep = chain_keep(conf, rho, self.costs)
        return keep, int(keep.max()) + 1  # the host sync of the decision

    def cut_tree(self, tree):
        """Step 2 of a tree: the budget among TREE_BUDGETS (up to the cap) with the most expected tokens per
        unit cost, 1 + sum of exp(path score) over the budget's best nodes, for the row that wants the most."""
        mass = torch.where(tree.valid, tree.scores.float().exp(), 0.0).sort(-1, descending=True).values.cumsum(-1)
        budgets = [b for b in TREE_BUDGETS if b <= min(self.cap, mass.shape[1])] or [mass.shape[1]]
        rate = torch.stack([(1 + mass[:, b - 1]) / (self.costs.draft_tree + self.costs.V(b + 1)) for b in budgets], 1)
        return budgets[int(rate.argmax(-1).max())]

    def end(self, alive, accepted, drafted, width):
        """After a step: each live row's tokens (accepted + 1) for what the step cost, a draft and a verify
        forward `width` tokens wide."""
        cost = (self.costs.draft_tree if self.tree else self.costs.draft) + self.costs.V(width)
        for s, a, n in zip(self.rows, alive, accepted):
            if not a:
                continue
            if not drafted:
                s.plain_left, s.after_plain = max(0, s.plain_left - 1), True
                continue
            if s.after_plain:  # the plain run paid for the failures before it: a try starts from at least TRY_RATE
                s.rate, s.after_plain = max(s.rate, TRY_RATE), False
            s.rate = self.forget * s.rate + (1 - self.forget) * (n + 1) / cost
            if s.rate < 1.0:  # drafting did not pay: plain steps, twice as many each time it fails again
                s.plain_left, s.backoff = s.backoff, min(2 * s.backoff, 64)
            else:
                s.backoff = max(2, s.backoff // 2)


def chain_keep(conf, rho, costs):
    """Drafts each row verifies [b]: draft k while c_1 * .. * c_k >= rho * (V(k + 1) - V(k)) holds for every
    slot up to k. conf [b, n] (c_k reads the drafts before slot k only), rho [b] the rows' rates."""
    n = conf.shape[1]
    verify = torch.tensor([costs.V(w) for w in range(1, n + 2)], device=conf.device)
    return (conf.float().cumprod(-1) >= rho[:, None] * (verify[1:] - verify[:-1])).long().cumprod(-1).sum(-1)


class ConfidenceThreshold:
    """DSpark's own cut (DeepSpec's eval/dspark/draft_ops.py): every step drafts, and each row verifies the drafts
    before its first slot whose confidence sigma(c_k) < threshold. c_k reads the drafts before slot k only, so
    the cut is a stopping rule, lossless at every temperature (SPEC §10)."""

    def __init__(self, threshold):
        self.threshold = threshold

    def begin(self, requests, steps, alive):
        return True

    def cut_chain(self, conf):
        keep = (conf >= self.threshold).long().cumprod(-1).sum(-1)
        return keep, int(keep.max()) + 1

    def end(self, alive, accepted, drafted, width):
        pass


class ReplayPolicy:
    """The widths a trace recorded, step by step (check_trace replays a run of the auto policy with it)."""

    def __init__(self, recorded):
        self.recorded = recorded  # (request, step) -> that row's verified block (1: its anchor alone)
        self.widths = []

    def begin(self, requests, steps, alive):
        self.widths = [self.recorded.get((r, s), 1) for r, s in zip(requests, steps)]
        return max(self.widths) > 1

    def cut_chain(self, conf):
        return torch.tensor(self.widths, device=conf.device) - 1, max(self.widths)

    def cut_tree(self, tree):
        return max(self.widths) - 1

    def end(self, alive, accepted, drafted, width):
        pass


# --- this machine's costs, measured ---


def _best_time(fn, reps, least_s=0.02, warm=True):
    """The fastest of at least reps calls (more while they take under least_s in all), after a warm-up."""
    if warm:
        fn()  # first calls allocate
    best, spent, n = float("inf"), 0.0, 0
    while n < reps or spent < least_s:
        start = time.perf_counter()
        fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        took = time.perf_counter() - start
        best, spent, n = min(best, took), spent + took, n + 1
    return best


def machine_costs(target, drafter):
    """This machine's Costs for the pair: measured once (measure_costs) and cached in the cache dir."""
    return costs_for(target, drafter, measure_costs, cache_dir() / "costs.json")


@torch.inference_mode()
def measure_costs(target, drafter, max_width=AUTO_TREE_CAP + 1, reps=3):
    """This machine's Costs: a verify forward at COST_WIDTHS over a COST_CONTEXT-token context, and one draft of
    the drafter's proposer (proposers.drafter_proposer: its walk and confidences, and for a drafter that makes
    trees a tree at the largest budget), each timed as the loop runs it."""
    device, ctx, W = target.device, COST_CONTEXT, max_width
    ids = torch.randint(target.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(ctx, device=device)[None]
    cache = target.new_cache(ctx + W + 2)
    logits, feats = target.forward(ids, positions, cache, ctx)
    widths = [x for x in COST_WIDTHS if x <= W]
    calls = {w: functools.partial(target.forward, torch.zeros(1, w, dtype=torch.long, device=device),
                                  ctx + torch.arange(w, device=device)[None], cache, ctx + W) for w in widths}
    seconds = {w: float("inf") for w in widths}
    for i in range(reps):  # rounds over every width, so that a busy moment slows all widths alike
        for w in widths:
            seconds[w] = min(seconds[w], _best_time(calls[w], 1, warm=i == 0))
    one = seconds[1]
    draft_cost = tree_cost = 0.0
    if drafter is not None:
        proposer = drafter_proposer(target, drafter)
        context = proposer.context(1, ctx + W + 2, device, defer=True)
        context.write(feats, positions)
        anchor, pos = logits[:, -1].argmax(-1), torch.tensor([ctx], device=device)
        sizes = torch.full_like(pos, proposer.width)
        sampling = Sampling(0.0, 0, 1.0, torch.Generator(device=device))
        draft_cost = tree_cost = _best_time(
            lambda: proposer.draft(context, anchor, pos, sizes, ctx, sampling).confidence, reps) / one
        if proposer.trees:
            tree_cost = _best_time(lambda: proposer.tree(context, anchor, pos, sizes, ctx, "selector")(TREE_BUDGETS[-1]),
                                   reps) / one
    verify = list(itertools.accumulate(interpolate({w: t / one for w, t in seconds.items()}, W), max))  # never cheaper wider
    return Costs(verify, draft_cost, tree_cost, cost_key(target, drafter), one * 1000)
