"""The host's side of a run: each request's Result, and the bookkeeping of the rows in flight (which request a
row serves, its position, whether it still decodes, the requests waiting for a row). No device work here."""
import statistics
from dataclasses import dataclass, field

import torch

HOLD = 1.0  # a prefill forward's own cost, in plain decode steps of the batch: a finished row may wait for rows about
# to finish so that their requests are prefilled in one forward (Requests.hold). On this project's CPU a prompt
# prefilled alone cost 46 ms more than in a forward of eight (0.96 s against 0.64 s for 8 mbpp prompts); one plain
# step of 8 rows costs 56 ms, and a slot left empty for a step wastes an eighth of it

@dataclass
class Result:
    """One request's output and its statistics."""

    tokens: list = field(default_factory=list)
    verify_steps: int = 0  # target forwards: the prefill, then one per decode step
    accepted: list = field(default_factory=list)  # drafts accepted at each decode step
    widths: list = field(default_factory=list)  # each decode step's verified block, anchor included (1: plain)
    finished_by_stop: bool = False

    @property
    def acceptance_length(self):
        """tau = mean over decode steps of the tokens each commits, the prefill's token excluded (the
        authors' benchmark definition, which the model card reports); 1 <= tau <= block size.
        None when the request ended at its prefill token."""
        steps = self.verify_steps - 1
        return (len(self.tokens) - 1) / steps if steps > 0 else None


def width_shares(results):
    """{verified block (anchor included; 1 = a plain step): share of the decode steps}, over all results."""
    widths = [w for r in results for w in r.widths]
    return {w: round(widths.count(w) / len(widths), 3) for w in sorted(set(widths))} if widths else {}


class Requests:
    """The host's side of the rows in flight: which request each row serves, its anchor's position (kept
    on the host, so no device read sizes a step), whether it still decodes, the requests waiting for a
    row, and every request's Result."""

    def __init__(self, prompts, settings, on_emit):
        self.prompts, self.settings, self.on_emit = prompts, settings, on_emit
        self.results = [Result() for _ in prompts]
        self.waiting = list(range(len(prompts)))
        self.request, self.alive = [], []  # per row
        self.pos = torch.zeros(0, dtype=torch.long)

    def take(self, n):
        """The next n waiting requests (fewer if fewer wait)."""
        reqs, self.waiting = self.waiting[:n], self.waiting[n:]
        return reqs

    def free_rows(self):
        """Finished rows that waiting requests take now: none while they wait for rows about to finish (hold)."""
        free = [r for r, a in enumerate(self.alive) if not a][: len(self.waiting)]
        return [] if free and self.hold(len(free)) else free

    def hold(self, free):
        """Whether `free` finished rows wait, empty, for the next rows to finish, so that one prefill forward admits
        them all: while the slot-steps they would idle (free rows times the plain steps until the soonest live row
        reaches max_new_tokens, a bound: drafts and stop tokens end rows sooner) are at most the forwards saved
        (the rows finishing then that a waiting request would take) times HOLD plain steps of b rows. Rows that
        finish out of step (a stop token, or drafts accepted unevenly) would otherwise be refilled one prefill
        forward each."""
        left = [self.settings.max_new_tokens - len(self.results[q].tokens)
                for q, a in zip(self.request, self.alive) if a]
        if not left:
            return False
        soonest = min(left)
        saved = min(left.count(soonest), len(self.waiting) - free)
        return saved > 0 and free * soonest <= HOLD * len(self.alive) * saved

    def admit(self, rows, reqs, first_tokens):
        """Requests reqs now decode in rows (a row index past the end appends one), their prefill token emitted."""
        for row, req, token in zip(rows, reqs, first_tokens):
            if row == len(self.request):
                self.request.append(req)
                self.alive.append(False)
                self.pos = torch.cat([self.pos, self.pos.new_zeros(1)])
            self.request[row], self.pos[row] = req, len(self.prompts[req])
            self.results[req].verify_steps = 1  # the prefill is a request's first verification step
            self.alive[row] = self.emit(req, [token])

    def compact(self):
        """Drop finished rows; returns the rows kept, or None when every row is alive or a request waits for a
        row (a held row is refilled, not dropped)."""
        if all(self.alive) or self.waiting:
            return None
        keep = [r for r, a in enumerate(self.alive) if a]
        self.request, self.pos, self.alive = [self.request[r] for r in keep], self.pos[keep], [True] * len(keep)
        return keep

    def commit(self, host, widths):
        """A step's host copy [b, 1 + B] (num_accepted, then out) and each row's verify width into the live rows'
        Results. Returns whether a row finished (its anchor and position then freeze)."""
        finished = False
        for r, req in enumerate(self.request):
            if self.alive[r]:
                a = int(host[r, 0])
                res = self.results[req]
                res.verify_steps += 1
                res.accepted.append(a)
                res.widths.append(widths[r])
                self.pos[r] += a + 1
                self.alive[r] = self.emit(req, host[r, 1 : a + 2].tolist())
                finished |= not self.alive[r]
        return finished

    def steps(self):
        """Each row's verification step number (a trace's step field)."""
        return [self.results[r].verify_steps for r in self.request]

    def emit(self, req, tokens):
        """Append tokens up to a stop token (kept) or max_new_tokens; returns whether the request goes on."""
        res, s, out = self.results[req], self.settings, []
        for t in tokens:
            if len(res.tokens) + len(out) >= s.max_new_tokens:
                break
            out.append(t)
            if t in s.stop_ids:
                res.finished_by_stop = True
                break
        res.tokens.extend(out)
        if self.on_emit is not None and out:
            self.on_emit(req, out)
        return not res.finished_by_stop and len(res.tokens) < s.max_new_tokens


def mean_tau(results):
    """Mean acceptance length over requests that made a decode step (None if none did)."""
    taus = [r.acceptance_length for r in results if r.acceptance_length is not None]
    return statistics.mean(taus) if taus else None
