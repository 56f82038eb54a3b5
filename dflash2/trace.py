"""Step traces: one JSON Lines record per request and verification step, written by any
implementation and checked against this reference by replaying it (schema: docs/TRACE.md)."""
import hashlib
import json
import sys
import time
from pathlib import Path

import torch

from . import spec_decode as sd
from .machine import machine
from .pair import DTYPES, load_pair
from .policy import ReplayPolicy
from .settings import DecodeSettings, InputError, one_line

# /2: a block shrinks to what is left of the budget (per-slot lists are that long), and results carry
# acceptance_length on the authors' definition. /1 traces drafted full blocks to the end.
TRACE_FORMAT = "dflash2-trace/2"


def run(pair, prompts, settings, on_emit=None, trace_path=None):
    """Decode prompts (lists of ids) in one batch under settings (a DecodeSettings, resolved here so that a
    trace records what ran). Returns (results, seconds, seconds to first token)."""
    first = []
    try:
        settings = settings.resolved(pair.device.type, pair.drafter.config.block_size if pair.drafter else None)
    except ValueError as e:
        raise InputError(one_line(e)) from e

    def emit(request, tokens):
        if not first:
            first.append(time.perf_counter())
        if on_emit is not None:
            on_emit(request, tokens)

    trace_file = open(trace_path, "w") if trace_path else None
    try:
        trace = None
        if trace_file is not None:
            write_line(trace_file, config_record(pair, prompts, settings))

            def trace(rec):
                for r in step_records(rec):
                    write_line(trace_file, r)
        start = time.perf_counter()
        try:
            results = sd.generate(pair.target, pair.drafter, prompts, settings, on_emit=emit, trace=trace)
        except ValueError as e:  # generate checks its inputs first: prompt too long, bad block size
            raise InputError(one_line(e)) from e
        seconds = time.perf_counter() - start
        if trace_file is not None:
            for i, res in enumerate(results):
                write_line(trace_file, result_record(i, res))
    finally:
        if trace_file is not None:
            trace_file.close()
    return results, seconds, (first[0] - start if first else seconds)


def write_line(f, record):
    f.write(json.dumps(record) + "\n")


def sha256_files(directory):
    """sha256 of the config and weight files of a checkpoint directory (what decides its numbers)."""
    names = sorted(p.name for p in Path(directory).iterdir()
                   if p.name == "config.json" or p.name.endswith((".safetensors", ".safetensors.index.json")))
    out = {}
    for name in names:
        h = hashlib.sha256()
        with open(Path(directory) / name, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 22), b""):
                h.update(chunk)
        out[name] = h.hexdigest()
    return out


def config_record(pair, prompts, settings):
    draft = None if pair.draft_dir is None else dict(id=pair.draft_id, sha256=sha256_files(pair.draft_dir))
    target = dict(id=pair.target_id, sha256=sha256_files(pair.target_dir))
    return dict(type="config", format=TRACE_FORMAT, target=target, draft=draft,
                dtype=str(pair.dtype).removeprefix("torch."), device=str(pair.device),
                draft_dtype=None if pair.drafter is None else str(next(pair.drafter.parameters()).dtype).removeprefix("torch."),
                draft_dtype_reason=pair.draft_dtype_reason, machine=machine().asdict(),
                prepacked=pair.target.prepacked, **settings.asdict(),
                prompts=[list(p) for p in prompts])


def floats(t):
    """Nested lists of a float tensor, 9 significant digits: enough to round-trip float32 exactly."""
    return [floats(x) for x in t] if t.dim() else float(f"{t.item():.9g}")


def step_record(request, step, anchor_pos, anchor, drafts, candidates, cand_logits, q, q_draft, target_argmax,
                u_accept, u_emit, num_accepted, out):
    """One step record of the trace schema (docs/TRACE.md); floats as lists of 9-digit numbers."""
    return dict(type="step", request=request, step=step, anchor_pos=anchor_pos,
                context_len=anchor_pos,  # the drafter attends to every position before its anchor
                anchor=anchor, drafts=drafts, candidates=candidates, cand_logits=cand_logits, q=q, q_draft=q_draft,
                target_argmax=target_argmax, u_accept=u_accept, u_emit=u_emit, num_accepted=num_accepted, out=out)


def tree_step_records(rec):
    """Per-request dicts of one dflash2-tree step: the tree's valid nodes (entry i + 1 of [anchor, nodes]:
    parent entry, token, depth, path score), the accepted path's entries, the target's argmax or draw
    y at each entry from the anchor down the path, its uniforms there (sampling), num_accepted and out."""
    tree, n_acc = rec["tree"], rec["num_accepted"].tolist()
    valid = tree.valid.sum(-1).tolist()
    parents, tokens, depth = tree.parents.tolist(), tree.tokens.tolist(), tree.depth.tolist()
    scores, path, out = tree.scores.float().cpu(), rec["path"].tolist(), rec["out"].tolist()
    walked = torch.cat([torch.zeros_like(rec["path"][:, :1]), rec["path"].clamp(min=0)], 1)  # entries, anchor first
    y = rec["y"].gather(1, walked).tolist()
    u = None if rec["u_tree"] is None else rec["u_tree"].gather(1, walked).cpu()
    anchor_pos, anchor = rec["anchor_pos"].tolist(), rec["anchor"].tolist()
    records = []
    for r, request in enumerate(rec["requests"]):
        k, a = valid[r], n_acc[r]
        records.append(dict(
            type="tree_step", request=request, step=rec["steps"][r], anchor_pos=anchor_pos[r],
            context_len=anchor_pos[r], anchor=anchor[r], tree_parents=parents[r][:k], tree_tokens=tokens[r][:k],
            tree_depth=depth[r][:k], tree_scores=floats(scores[r, :k]), path=path[r][:a], target_y=y[r][: a + 1],
            u_tree=None if u is None else floats(u[r, : a + 1]), num_accepted=a, out=out[r][: a + 1]))
    return records


def step_records(rec):
    """Split one generate() trace record (tensors batched over the live rows) into per-request dicts. A step
    whose width the auto policy chose records it (width: the row's verified block with its anchor, 1 for a plain
    step; for a tree, budget + 1)."""
    records = tree_step_records(rec) if "tree" in rec else chain_step_records(rec)
    if rec.get("widths") is not None:
        records = [dict(r, width=w) for r, w in zip(records, rec["widths"])]
    return records


def chain_step_records(rec):
    """Per-request dicts of one chain step (drafts, candidates, laws and draws per slot)."""
    n_acc = rec["num_accepted"].tolist()
    drafts = rec["drafts"].cpu()
    cands = None if rec["candidates"] is None else [t.cpu() for t in rec["candidates"]]
    sampled = rec["u_accept"] is not None
    q = rec["q"].float().cpu() if sampled else None
    argmax, out = rec["target_argmax"].tolist(), rec["out"].tolist()
    anchor_pos, anchor, sizes = rec["anchor_pos"].tolist(), rec["anchor"].tolist(), rec["sizes"].tolist()
    records = []
    for r, request in enumerate(rec["requests"]):
        n = sizes[r] - 1  # this step's draft slots: the block may be cut short at the end of the budget
        records.append(step_record(
            request=request, step=rec["steps"][r], anchor_pos=anchor_pos[r], anchor=anchor[r],
            drafts=drafts[r, :n].tolist(),
            candidates=None if cands is None else cands[0][r, :n].tolist(),
            cand_logits=None if cands is None else floats(cands[1][r, :n].float()),
            q=None if q is None or cands is None else floats(q[r, :n].gather(-1, cands[0][r, :n])),
            q_draft=None if q is None else floats(q[r, :n].gather(-1, drafts[r, :n, None]).squeeze(-1)),
            target_argmax=argmax[r][: n + 1],
            u_accept=floats(rec["u_accept"][r, :n].cpu()) if sampled else None,
            u_emit=floats(rec["u_emit"][r].cpu()) if sampled else None,
            num_accepted=n_acc[r], out=out[r][: n_acc[r] + 1]))
    return records


def result_record(request, res):
    return dict(type="result", request=request, tokens=res.tokens, verify_steps=res.verify_steps,
                finished_by_stop=res.finished_by_stop, acceptance_length=res.acceptance_length)


# --- check: replay a trace through this reference and find where they part ---

FLOAT_FIELDS = ("cand_logits", "q", "q_draft", "u_accept", "u_emit", "tree_scores", "u_tree")
SLOT_FIELDS = ("drafts", "candidates", "cand_logits", "q", "q_draft", "u_accept")  # index j is draft slot j+1
STEP_TYPES = ("step", "tree_step")
NODE_FIELDS = ("tree_parents", "tree_tokens", "tree_depth", "tree_scores")  # index i is tree entry i+1
# The order fields are compared in: the first divergence in data-flow order. Fields not named here
# (another implementation's extras) are compared after these, so no recorded field goes unchecked.
STEP_FIELDS = ("anchor_pos", "context_len", "anchor", "width", "candidates", "cand_logits", "drafts", "q", "q_draft",
               "tree_parents", "tree_tokens", "tree_depth", "tree_scores", "target_argmax", "target_y", "u_accept",
               "u_emit", "u_tree", "path", "num_accepted", "out")


def read_trace(path):
    try:
        lines = Path(path).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise InputError(f"trace {path}: not a readable JSON Lines trace ({one_line(e)})") from e
    if not records or records[0].get("type") != "config" or records[0].get("format") != TRACE_FORMAT:
        found = records[0].get("format") if records and isinstance(records[0], dict) else None
        raise InputError(f"trace {path}: the first line is not a {TRACE_FORMAT} config record"
                         + (f" (it is {found}; regenerate the trace)" if found else ""))
    return records


def first_difference(ref, got, tol, path=()):
    """(index path, ref value, trace value) of the first element that differs (numbers within tol), or None."""
    if isinstance(ref, list) and isinstance(got, list):
        for i, (a, b) in enumerate(zip(ref, got)):
            diff = first_difference(a, b, tol, path + (i,))
            if diff is not None:
                return diff
        if len(ref) != len(got):
            i = min(len(ref), len(got))
            return path + (i,), ref[i] if i < len(ref) else "absent", got[i] if i < len(got) else "absent"
        return None
    numbers = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (ref, got))
    if ref == got or (numbers and abs(ref - got) <= tol):
        return None
    return path, ref, got


def describe(request, step, field, path, ref, got, atol):
    where = f"request {request} step {step}"
    if path and field in SLOT_FIELDS:
        where += f" slot {path[0] + 1}"
        path = path[1:]
    elif path and field in NODE_FIELDS:
        where += f" node {path[0] + 1}"
        path = path[1:]
    index = "".join(f"[{i}]" for i in path)
    line = f"{where} field {field}{index}: reference {ref} vs trace {got}"
    if field in FLOAT_FIELDS and isinstance(ref, (int, float)) and isinstance(got, (int, float)):
        line += f" (|diff| {abs(ref - got):.3g} > atol {atol:g})"
    return line


def compare_traces(ref_records, trace_records, atol):
    """The first divergence between a replayed trace and a recorded one, as one line, or None."""
    ref_steps = {(r["request"], r["step"]): r for r in ref_records if r["type"] in STEP_TYPES}
    seen = set()
    for rec in trace_records:
        if rec.get("type") not in STEP_TYPES:
            continue
        key = (rec["request"], rec["step"])
        seen.add(key)
        if key not in ref_steps:
            return f"request {key[0]} step {key[1]}: the trace has this step, the reference finished before it"
        ref = ref_steps[key]
        extra = sorted((set(ref) | set(rec)) - set(STEP_FIELDS) - {"type", "request", "step"})
        for field in ("type",) + STEP_FIELDS + tuple(extra):
            tol = atol if field in FLOAT_FIELDS else 0
            diff = first_difference(ref.get(field), rec.get(field), tol)
            if diff is not None:
                return describe(*key, field, *diff, atol)
    for key in sorted(set(ref_steps) - seen):
        return f"request {key[0]} step {key[1]}: the reference has this step, the trace ends before it"
    ref_results = {r["request"]: r for r in ref_records if r["type"] == "result"}
    for rec in trace_records:
        if rec.get("type") == "result":
            for field in ("tokens", "verify_steps", "finished_by_stop", "acceptance_length"):
                tol = atol if field == "acceptance_length" else 0
                diff = first_difference(ref_results.get(rec["request"], {}).get(field), rec.get(field), tol)
                if diff is not None:
                    path, ref, got = diff
                    index = "".join(f"[{i}]" for i in path)
                    return f"request {rec['request']} result field {field}{index}: reference {ref} vs trace {got}"
    return None


def check_trace(path, target=None, draft=None, device="cpu", atol=1e-4, log=sys.stderr):
    """Replay the trace at path with its own settings. Returns (agree, one-line report)."""
    records = read_trace(path)
    cfg = records[0]
    pair = load_pair(target or cfg["target"]["id"], draft or (cfg["draft"] or {}).get("id"), torch.device(device),
                     DTYPES[cfg["dtype"]], needs_draft=cfg["method"] != "ar",
                     draft_dtype=DTYPES[cfg.get("draft_dtype") or cfg["dtype"]], prepack=cfg.get("prepacked", False))
    for role, directory, recorded in (("target", pair.target_dir, cfg["target"]),
                                      ("draft", pair.draft_dir, cfg["draft"])):
        if directory is not None and recorded and sha256_files(directory) != recorded["sha256"]:
            print(f"note: the {role} files differ from the trace's (sha256)", file=log)
    settings = DecodeSettings.from_record(cfg)
    policy = None
    if settings.policy == "auto":  # the widths the run chose, not this machine's choice
        policy = ReplayPolicy({(r["request"], r["step"]): r.get("width", 1) for r in records[1:]
                               if r.get("type") in STEP_TYPES})
    replay = []

    def trace(rec):
        replay.extend(step_records(rec))

    results = sd.generate(pair.target, pair.drafter, cfg["prompts"], settings, trace=trace, policy_override=policy)
    replay += [result_record(i, res) for i, res in enumerate(results)]
    divergence = compare_traces(replay, records[1:], atol)
    if divergence is not None:
        return False, f"divergence: {divergence}"
    steps = sum(r["type"] in STEP_TYPES for r in replay)
    return True, f"agree: {steps} steps of {len(results)} request(s) match (atol {atol:g})"
