"""The speculation policy: how wide each step's verify forward is, from what this machine pays for a forward of
b rows by w tokens and what the drafter expects to be accepted. Never slower than plain decoding, and lossless.
It is the default everywhere (generate, the CLI, the bench: policy="auto"); policy="fixed" verifies whole blocks.

Costs, in units of V(1, 1) (one row, one token), measured once per machine, target and dtype (measure_costs,
cached on disk): V(w, b) one verify forward of b rows by w tokens, D(b) one draft of b rows (the chain's, or
the tree's). In a batch the forward is as wide as its widest row and costs what its b * w tokens cost, not what
w tokens cost; the rows share that cost (SPEC §10 "Batches").

Each step, for the batch of b rows in the forward (finished rows leave it; continuous batching admits new ones):
1. Draft or not (before drafting, from earlier steps only). Never where no width could pay even if every
   draft were accepted (W tokens a row for D(b) + V(W, b) against 1 for V(1, b): a compute-bound forward of
   many rows). Each row keeps its rate: the tokens it made on drafted steps per unit cost, in units of plain
   decoding's 1 per V(1, b) (a forgetting average). A batch's first drafted step sets its rows' rates on its
   own, and a request that joins later starts from the batch's mean rate (its last one, if no row in flight has
   a rate: requests that all end together leave the next ones what was learned, as the waits below). The batch
   drafts while its live rows' mean rate is at least PAY (a little over 1), i.e. while its drafted steps beat
   plain decoding's b tokens per V(1, b) by more than the costs' error.
   After a drafted step that did not pay, it decodes plainly for 2, 4, 8, ... (at most 64) steps before it
   tries again, and for at least as many as make that step's loss EXPLORE of them (a try costs more where
   drafting is dear: a batch of many rows waits longer), so failed tries cost at most EXPLORE of the time. The
   loss is the try's cost less its slowest row's tokens: rows that accepted more run ahead, and their lead pays
   only where they end and are refilled out of step (a row held empty, or a prefill forward of its own:
   results.Requests.hold), so this bounds a try's cost to a batch (at one row, its cost less its tokens). A try
   is judged mostly on its own: the rates it updates start from at least TRY_RATE. Each drafted step after which
   the rate still pays halves the wait (down to 2). A drafted step's cost counts its draft DRAFT_SLACK times
   D(b): a draft timed alone misses part of what it costs a step.
2. How wide (after drafting): one width W for the whole batch; every live row verifies up to W - 1 drafts
   (capped by what it may still make): a row's slots cost the same filled with drafts or with padding. The
   draft is paid by then, so a step is worth E(W) - rho * V(W, b), where E(W) = sum over live rows of
   1 + sum_{k < W} c_1 * .. * c_k (the tokens the law expects), c_k the law's largest probability at slot k
   (given draft k-1: never draft k itself), and rho the batch's rate, tokens per unit cost (plain decoding's
   b / V(1, b) at least): by renewal reward the long-run tokens per unit cost is largest when every step
   maximises expected tokens minus rho times its cost (Dinkelbach). Slot k widens the forward while the
   rows' expected tokens there, sum_r c_1 .. c_k, pay for the wider forward, rho * (V(k + 1, b) - V(k, b));
   the first slot that does not ends it. The decision to verify slot k reads every row's drafts before k
   and the laws only: a stopping rule, lossless at every temperature (SPEC §10). It is the exact maximum of
   E(W) - rho * V(W, b) when V(., b) is convex (E is concave: each row's products shrink), and the first local
   maximum otherwise (a stopping rule cannot read the laws of later slots). At b = 1 this is the one-row rule
   (rate >= PAY, c_1 .. c_k >= rho * (V(k + 1) - V(k))).
   A tree takes the node budget N with the most expected tokens per unit cost over the batch, sum over live
   rows of (1 + the sum of exp(path score) over its best N nodes), against D_tree(b) + V(N + 1, b); a tree is
   fixed before the target's draws, so any budget is lossless (SPEC §9).
"""
import bisect
import functools
import hashlib
import itertools
import json
import math
import time
from dataclasses import dataclass

import torch

from .machine import machine
from .proposers import drafter_proposer
from .settings import AUTO_TREE_CAP, cache_dir
from .target import text_config
from .verify import Sampling

COST_BATCHES = (1, 8, 32)  # rows measured: the model card's concurrencies; between them linear in b, an upper bound
# where a forward's cost grows convexly in its rows (flat while weight reads dominate, then linear), so the policy
# errs toward plain steps; in proportion past 32
COST_WIDTHS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)  # tokens per row measured; the rest interpolated
COST_BATCH_WIDTHS = (1, 2, 4, 8)  # past one row, the widths measured of these up to COST_TOKENS tokens in all
COST_TOKENS = 32  # (at least the first two): a batch verifies a few drafts per row at most, and past a few dozen
# tokens a forward's cost grows about linearly (straight on); this keeps a first measurement to a few seconds
COST_CONTEXT = 256  # context length the costs are measured at
COST_FORMAT = 4  # in the cost key: a cache of another format is measured again, never misread
TREE_BUDGETS = (2, 4, 6, 8, 12, 16, 24, 32)  # the auto tree's choices (and its cap)
DRAFT_SLACK = 1.5  # what a draft costs a step, in D's: D is timed alone at its fastest, and on this project's CPU a
# drafted step of 8 rows took 0.3 to 0.4 plain steps longer than D(8) + V(W, 8) said, of one row 0.1 to 0.2 longer
# than D(1) + V(W, 1): 1.4 to 1.9 D's in all, the same share at both
EXPLORE = 0.01  # the share of steps that tries which do not pay may cost (Policy.end): at 8 rows on this project's
# CPU a failed try on chat lost 0.4 to 0.7 plain steps, and at 0.02 (its wait then capped at 64) such tries cost
# chat 1.6 % (5 plain steps in 314, the costs' own account of a 32-prompt run), half the 3 % a bench cell resolves
MAX_WAIT = 64  # the most plain steps the doubling waits between tries (the loss's floor may wait longer)
PAY = 1.05  # the rate a batch's drafted steps must keep to go on drafting: plain decoding's and a margin for the costs'
# error (a drafted step of 8 rows timed in the loop came within a few percent of the model; two cached measurements
# may differ by more), so drafting the model calls break-even is left to plain steps
TRY_RATE = 0.9  # a try after a plain run resumes drafting if it makes >= 1.4 tokens per unit cost (forget 0.7, PAY)
STEADY = 0.25  # two measurements of the costs agree when each cost differs by at most this share (of 1 for drafts):
# a quiet machine's differ by up to 0.2 (at the widest verifies), a busy one's by 0.3 to 1 (BENCHMARKS)
MAX_PASSES = 3  # measurements of the costs before giving up on two that agree
DRAFT_LEAST_S = 0.1  # a draft is timed until this long is spent (the fastest call counts): a draft costs a fraction of
# a verify forward, and the fastest of two calls misjudged one by a third on a shared machine


def cost_widths(b, max_width):
    """The widths measured at b rows: COST_WIDTHS up to max_width at one row, else those of COST_BATCH_WIDTHS of at
    most COST_TOKENS tokens in all (always the first two)."""
    if b == 1:
        return [w for w in COST_WIDTHS if w <= max_width]
    return [w for i, w in enumerate(COST_BATCH_WIDTHS) if w <= max_width and (i < 2 or b * w <= COST_TOKENS)]


@dataclass
class Costs:
    """V(w, b) for w = 1..n at the measured batch sizes, and D(b), in units of V(1, 1): piecewise linear in b
    between the measured batch sizes, and past the largest in proportion to b (as many rows again cost as much
    again once a forward is compute-bound; it keeps V monotone in w and b); at a width past n, V(n, b)."""

    batches: list  # the measured batch sizes, ascending
    verify: list  # verify[i][w - 1] = V(w, batches[i]), w = 1..n
    drafts: list  # drafts[i] = D(batches[i]), the chain's draft (DSpark's: its walk and confidences)
    tree_drafts: list  # the tree's draft at the largest budget
    key: str = ""
    ms_per_token: float = 0.0  # V(1, 1) in ms, for --profile
    steady: bool = True  # False: no two measurements agreed (a busy machine); used for one process, never cached

    def V(self, w, b=1):
        """One verify forward of b rows by w tokens."""
        w = min(w, len(self.verify[0]))
        return self.at_batch([v[w - 1] for v in self.verify], b)

    def D(self, b=1, tree=False):
        """One draft of b rows (tree: the tree's)."""
        return self.at_batch(self.tree_drafts if tree else self.drafts, b)

    def at_batch(self, values, b):
        """A cost at b rows from its values at the measured batch sizes."""
        last = self.batches[-1]
        return values[-1] * b / last if b > last else piecewise(dict(zip(self.batches, values)), b)

    @property
    def draft(self):
        """One row's draft, D(1) (the costs line)."""
        return self.D(1)

    @property
    def draft_tree(self):
        """One row's tree draft (the costs line)."""
        return self.D(1, tree=True)


def piecewise(points, x):
    """The piecewise linear function through {x: y} at x, straight on past the first and the last point."""
    xs = sorted(points)
    if x in points or len(xs) == 1:
        return points.get(x, points[xs[0]])
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)  # the segment [xs[i - 1], xs[i]]
    a, b = xs[i - 1], xs[i]
    return points[a] + (points[b] - points[a]) * (x - a) / (b - a)


def interpolate(points, n):
    """[V(1) .. V(n)]: piecewise linear through the measured {width: cost}, straight on past the last point."""
    return [piecewise(points, w) for w in range(1, n + 1)]


def grid_costs(verify, drafts, tree_drafts, n, key="", ms_per_token=0.0):
    """Costs from measurements: verify {b: {w: V(w, b)}}, drafts and tree_drafts {b: D(b)}. Each b's widths are
    interpolated to 1..n; then costs never fall with more tokens or more rows (a running maximum over w, then
    over b): a timing below its neighbour's is noise, and a cheaper wider forward would invite waste."""
    batches = sorted(verify)
    rows, prev = [], [0.0] * n
    for b in batches:
        prev = [max(p, v) for p, v in zip(prev, itertools.accumulate(interpolate(verify[b], n), max))]
        rows.append(prev)
    return Costs(batches, rows, list(itertools.accumulate((drafts[b] for b in batches), max)),
                 list(itertools.accumulate((tree_drafts[b] for b in batches), max)), key, ms_per_token)


def cost_key(target, drafter):
    """What the costs depend on: their format, machine, threads, device, target and drafter shapes and dtypes."""
    tc = text_config(target.model.config)
    parts = [f"costs v{COST_FORMAT}", machine().describe(), f"threads {torch.get_num_threads()}", str(target.device),
             type(target.model).__name__, f"{tc.hidden_size}x{tc.num_hidden_layers} v{target.vocab_size}",
             str(target.lm_head_weight.dtype), f"packed {target.prepacked}"]
    if drafter is not None:
        dc = drafter.config
        parts += [f"{type(drafter).__name__} {dc.hidden_size}x{dc.num_hidden_layers} B{dc.block_size} "
                  f"K{getattr(dc, 'selector_top_k', 0)}",
                  str(next(drafter.parameters()).dtype)]
    return " | ".join(parts)


_MEMO = {}


def costs_for(target, drafter, measure, cache_file=None):
    """This machine's costs for the pair: from memory, else from the cache file, else measured (measure(target,
    drafter) is measure_costs, a few seconds) and stored. A busy machine times some widths in a quiet
    moment and others not: measured costs are stored only when two measurements in a row agree (steady);
    otherwise (MAX_PASSES without) their median serves this process, marked unsteady, and the next process
    measures again."""
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
    costs = None
    if digest in stored and stored[digest].get("key") == key:
        try:
            costs = Costs(**stored[digest])
        except TypeError:  # a hand-edited entry: measure again
            costs = None
    if costs is None:
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
    """Whether two measurements of the costs agree: at every measured batch size, every V(w, b) within STEADY of
    the larger, the drafts within STEADY of the larger or of one plain step (a draft may cost a fraction of one)."""
    pairs = [(a.V(w, n), b.V(w, n)) for n in a.batches for w in COST_WIDTHS]
    pairs += [(a.D(n, tree), b.D(n, tree)) for n in a.batches for tree in (False, True)]
    return all(abs(x - y) <= STEADY * max(x, y, 1.0) for x, y in pairs)


def combine(passes, steady):
    """The element-wise median of measurements of the costs (the mean of two)."""
    def mid(xs):
        xs = sorted(xs)
        return (xs[(len(xs) - 1) // 2] + xs[len(xs) // 2]) / 2

    verify = [[mid(v) for v in zip(*rows)] for rows in zip(*(c.verify for c in passes))]
    return Costs(passes[-1].batches, verify, [mid(d) for d in zip(*(c.drafts for c in passes))],
                 [mid(d) for d in zip(*(c.tree_drafts for c in passes))], passes[-1].key,
                 mid([c.ms_per_token for c in passes]), steady)


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
    """One request's history, on the host: its rate on drafted steps (tokens per unit cost in units of plain
    decoding's 1 per V(1, b), an average that forgets). None until the batch has drafted once: a request that
    joins a batch which has starts from the batch's rate (Policy.begin)."""

    rate: float | None = None


class Policy:
    """The widths of the loop's steps (module docstring). A step's contract, for every policy: begin (step 1:
    whether the drafter runs), then inside a drafted step cut_chain or cut_tree (step 2), then end with what the
    step verified and accepted. Nothing is carried from a cut to end but what the step returns."""

    def __init__(self, costs, cap, tree=False, forget=0.7):
        self.costs, self.cap, self.tree, self.forget = costs, cap, tree, forget
        self.state = {}  # request -> RequestState
        self.rows = []  # the states of this step's rows
        self.alive = []  # which of this step's rows decode (begin)
        self.plain_left, self.backoff = 0, 2  # plain steps before the batch tries drafting again, and the next wait
        self.after_plain = False  # the next drafted step is a try after a plain run
        self.ceiling = {}  # b -> whether a drafted step of b rows can pay at all (can_pay)
        self.last_rate = None  # the batch's rate after its last drafted step

    def begin(self, requests, steps, alive):
        """Step 1, from earlier steps only: whether the drafter runs this step (drafting can pay at this batch size
        at all, and the batch is not waiting out a plain run after drafting did not pay)."""
        self.rows = [self.state.setdefault(r, RequestState()) for r in requests]
        self.alive = list(alive)
        known = [s.rate for s, a in zip(self.rows, alive) if a and s.rate is not None]
        joined = sum(known) / len(known) if known else self.last_rate
        for s in self.rows:  # a request that joins: the batch's rate so far, this drafter on this machine (the rate
            if s.rate is None and joined is not None:  # it had last when no row in flight has one: a new wave)
                s.rate = joined
        return any(alive) and self.plain_left == 0 and self.can_pay(len(alive))

    def can_pay(self, b):
        """Whether a drafted step of b rows can beat plain decoding at all: with every draft accepted, some width W
        makes W tokens a row for D(b) + V(W, b), against 1 for V(1, b). Where the forward is compute-bound (many
        rows on a CPU), no width can, and the batch never pays for a try."""
        if b not in self.ceiling:
            # the widths a step may verify (a chain's W up to its block, DSpark's block + 1; a tree's budget + 1)
            widths = range(2, self.cap + 2) if not self.tree else [n + 1 for n in self.budgets(self.cap)]
            best = max(w / (self.draft_cost(b) + self.costs.V(w, b)) for w in widths)
            self.ceiling[b] = best > 1 / self.costs.V(1, b)
        return self.ceiling[b]

    def draft_cost(self, b):
        """What drafting adds to a step of b rows: DRAFT_SLACK times D(b) (the chain's, or the tree's)."""
        return DRAFT_SLACK * self.costs.D(b, self.tree)

    def rate(self):
        """The batch's rate: its live rows' mean rate, in units of plain decoding's (module docstring, step 1); 1
        before the batch has drafted."""
        live = [s.rate for s, a in zip(self.rows, self.alive) if a and s.rate is not None]
        return sum(live) / len(live) if live else 1.0

    def rho(self):
        """The batch's tokens per unit cost that a wider forward must beat: plain decoding's, b_live / V(1, b),
        or its drafted steps' when higher."""
        b = len(self.alive)
        return sum(self.alive) / self.costs.V(1, b) * max(1.0, self.rate())

    def cut_chain(self, conf, allowed):
        """Step 2 of a chain: conf [b, n] the law's largest probability per slot, allowed [b] the drafts each row
        may still verify. Returns the drafts each row verifies [b] and the forward's width W (host)."""
        allowed = allowed * torch.tensor(self.alive, device=allowed.device)
        width = chain_width(conf, allowed, self.rho(), self.costs)  # the host sync of the decision
        return allowed.clamp(max=width - 1), width

    def cut_tree(self, tree):
        """Step 2 of a tree: the budget among TREE_BUDGETS (up to the cap) with the most expected tokens per
        unit cost over the batch's live rows, 1 + sum of exp(path score) over each row's best nodes."""
        mass = torch.where(tree.valid, tree.scores.float().exp(), 0.0).sort(-1, descending=True).values.cumsum(-1)
        mass = mass[torch.tensor(self.alive, device=mass.device)]
        b, live = len(self.alive), sum(self.alive)
        budgets = self.budgets(min(self.cap, mass.shape[1]))
        rate = [(live + float(mass[:, n - 1].sum())) / (self.draft_cost(b) + self.costs.V(n + 1, b))
                for n in budgets]
        return budgets[rate.index(max(rate))]

    @staticmethod
    def budgets(most):
        """A tree's budgets to choose from: TREE_BUDGETS up to `most`, else `most` itself."""
        return [n for n in TREE_BUDGETS if n <= most] or [most]

    def end(self, alive, accepted, drafted, width):
        """After a step: each live row's tokens (accepted + 1) for what the step cost (a draft and a verify forward
        of b rows by `width` tokens), in plain steps' worth; then whether the batch decodes plainly for a while
        (module docstring, step 1)."""
        if not drafted:
            self.plain_left, self.after_plain = max(0, self.plain_left - 1), True
            return
        b = len(alive)
        cost = (self.draft_cost(b) + self.costs.V(width, b)) / self.costs.V(1, b)
        for s, a, n in zip(self.rows, alive, accepted):
            if a and s.rate is None:  # the batch's first drafted step is judged on its own
                s.rate = (n + 1) / cost
            elif a:
                if self.after_plain:  # the plain run paid for the failures before it: a try starts from TRY_RATE
                    s.rate = max(s.rate, TRY_RATE)
                s.rate = self.forget * s.rate + (1 - self.forget) * (n + 1) / cost
        self.after_plain = False
        self.last_rate = self.rate()
        if self.rate() < PAY:  # drafting did not pay: plain steps, twice as many each time it fails again, and
            # enough that this step's loss (its cost less the tokens of its slowest row, in plain steps) is at most
            # EXPLORE of them
            made = [n + 1 for n, a in zip(accepted, alive) if a]
            loss = cost - min(made, default=1)
            self.plain_left = max(self.backoff, math.ceil(loss / EXPLORE))
            self.backoff = min(2 * self.backoff, MAX_WAIT)
        else:
            self.backoff = max(2, self.backoff // 2)


def chain_width(conf, allowed, rho, costs):
    """The batch's verify width W (anchor included): slot k is verified while, for every slot j up to k, the
    rows that may verify slot j expect sum_r c_1 .. c_j tokens there, at least rho * (V(j + 1, b) - V(j, b)).
    conf [b, n]: c_k reads the drafts before slot k only (a stopping rule); allowed [b] the drafts each row may
    verify (0 for a row that does not decode); b the rows in the forward."""
    b, n = conf.shape
    verify = torch.tensor([costs.V(w, b) for w in range(1, n + 2)], device=conf.device)
    slots = torch.arange(1, n + 1, device=conf.device)
    expected = torch.where(slots <= allowed[:, None], conf.float().cumprod(-1), 0.0).sum(0)
    widen = (expected >= rho * (verify[1:] - verify[:-1])) & (slots <= allowed.max())
    return 1 + int(widen.long().cumprod(0).sum())


class ConfidenceThreshold:
    """DSpark's own cut (DeepSpec's eval/dspark/draft_ops.py): every step drafts, and each row verifies the drafts
    before its first slot whose confidence sigma(c_k) < threshold. c_k reads the drafts before slot k only, so
    the cut is a stopping rule, lossless at every temperature (SPEC §10)."""

    def __init__(self, threshold):
        self.threshold = threshold

    def begin(self, requests, steps, alive):
        return True

    def cut_chain(self, conf, allowed):
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

    def cut_chain(self, conf, allowed):
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
def measure_costs(target, drafter, max_width=AUTO_TREE_CAP + 1, reps=2):
    """This machine's Costs: a verify forward of b rows by w tokens over a COST_CONTEXT-token context at
    COST_BATCHES rows and cost_widths(b) tokens, and at each b one draft of the drafter's proposer
    (proposers.drafter_proposer: its walk and confidences; for a drafter that makes trees, a tree at the largest
    budget, timed at one row and scaled to b rows as the chain's draft), each timed as the loop runs it. The b
    rows are copies of one prefilled row."""
    device, ctx, W = target.device, COST_CONTEXT, max_width
    ids = torch.randint(target.vocab_size, (1, ctx), generator=torch.Generator().manual_seed(0)).to(device)
    positions = torch.arange(ctx, device=device)[None]
    cache = target.new_cache(ctx + W + 2)
    logits, feats = target.forward(ids, positions, cache, ctx)
    proposer = context = None
    if drafter is not None:
        proposer = drafter_proposer(target, drafter)
        context = proposer.context(1, ctx + W + 2, device, defer=True)
        context.write(feats, positions)
    anchor = logits[:, -1].argmax(-1)
    seconds, drafts, tree = {}, {b: 0.0 for b in COST_BATCHES}, 0.0
    rows = 1
    for b in sorted(COST_BATCHES, reverse=True):  # b copies of the row, then each smaller b a prefix of them
        index = torch.zeros(b, dtype=torch.long, device=device) if b > rows else torch.arange(b, device=device)
        cache.select_rows(index)
        if context is not None:
            context.select_rows(index)
        rows = b
        seconds[b] = time_verify(target, cache, b, cost_widths(b, W), ctx, W, reps)
        if proposer is not None:
            drafts[b], tree_b = time_draft(proposer, context, anchor.expand(b), ctx, reps, tree=b == 1)
            tree = tree_b if b == 1 else tree
    one = seconds[1][1]
    verify = {b: {w: t / one for w, t in by_width.items()} for b, by_width in seconds.items()}
    trees = {b: tree / one * (drafts[b] / drafts[1] if drafts[1] else 1.0) for b in COST_BATCHES}
    return grid_costs(verify, {b: t / one for b, t in drafts.items()}, trees, W, cost_key(target, drafter), one * 1000)


def time_verify(target, cache, b, widths, ctx, max_width, reps):
    """{w: seconds} of a verify forward of b rows by w tokens at positions ctx.. (the fastest of reps rounds over
    every width, so that a busy moment slows all widths alike)."""
    device = target.device
    calls = {w: functools.partial(target.forward, torch.zeros(b, w, dtype=torch.long, device=device),
                                  (ctx + torch.arange(w, device=device))[None].expand(b, w), cache, ctx + max_width)
             for w in widths}
    seconds = {w: float("inf") for w in widths}
    for i in range(reps):
        for w in widths:
            seconds[w] = min(seconds[w], _best_time(calls[w], 1, warm=i == 0))
    return seconds


def time_draft(proposer, context, anchor, ctx, reps, tree=True):
    """Seconds of one draft of anchor's b rows at position ctx: (its walk and confidences, and a tree at the
    largest budget when tree and the proposer makes trees, else the walk's time again)."""
    pos = torch.full_like(anchor, ctx)
    sizes = torch.full_like(pos, proposer.width)
    sampling = Sampling(0.0, 0, 1.0, torch.Generator(device=anchor.device))
    chain = _best_time(lambda: proposer.draft(context, anchor, pos, sizes, ctx, sampling).confidence, reps,
                       least_s=DRAFT_LEAST_S)
    if not (tree and proposer.trees):
        return chain, chain
    return chain, _best_time(lambda: proposer.tree(context, anchor, pos, sizes, ctx, "selector")(TREE_BUDGETS[-1]),
                             reps)
