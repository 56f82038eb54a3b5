"""Benchmark ar / dflash / dflash2 side by side with the model card's protocol (SPEC §8).

    python -m dflash2.bench                                               # embedded SmolLM2 pair, greedy, 16 prompts/task
    python -m dflash2.bench --temperature 1.0 --top-p 0.95 --max-new-tokens 4096 --num-prompts 128   # the card's sampling
    python -m dflash2.bench --tasks gsm8k,mbpp --concurrency 1,8 --out results.json --plot results.png

Every method decodes the same prompts in the same process, so the speedups are ratios measured in
one run. Acceptance length tau = per-request mean of completion tokens / verification steps;
throughput = total output tokens / end-to-end wall time (prefill included), with `concurrency`
requests in flight, batched by our loop: a finished request's row takes the next waiting prompt at
once (continuous batching, as a serving engine's maximum concurrency does).
"""
import argparse
import dataclasses
import importlib.util
import json
import statistics
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from . import machine, policy, proposers, spec_decode
from .kernels import check_attn_backend, prepack_linears
from .dspark import DSparkDrafter
from .model import DFlash2Drafter
from .pair import load_target, stop_token_ids
from .prompts import ALL_TASKS, TASKS, encode_prompt, format_prompt, load_tasks
from .settings import DEFAULT_DRAFT, DEFAULT_DSPARK_DRAFT, METHODS, TREE_SCORES, DecodeSettings, HelpFormatter
from .results import Result, mean_tau, width_shares
from .spec_decode import compile_core, generate
from .target import Target



# Random-weight pairs of realistic shapes, to time steps where no checkpoint is at hand (the GPU check
# of docs/BENCHMARKS.md "Compiled core and attention kernels"): with random weights tau means nothing, the per-step split does.
SYNTHETIC = {
    # MiniMax-M3's text layout (SPEC §7: 3 dense layers, then MSA attention + MoE with 128 experts, top-4,
    # a shared expert; per-head QK norm, RoPE over 64 of 128 dims) with MiniMax-M2's published widths
    # (hidden 3072, 48 query / 8 KV heads, expert width 1536), since M3.1-Flash's config is not public.
    "minimax-m3": dict(hidden_size=3072, num_attention_heads=48, num_key_value_heads=8, head_dim=128,
                       rotary_dim=64, vocab_size=200064, intermediate_size=1536, dense_intermediate_size=8192,
                       shared_intermediate_size=1536, num_local_experts=128, num_experts_per_tok=4,
                       index_n_heads=4, index_head_dim=128, index_block_size=128, index_topk_blocks=16,
                       dense_layers=3, layers=8),
    "tiny": dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16, rotary_dim=8,
                 vocab_size=256, intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32,
                 num_local_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=8, index_block_size=4,
                 index_topk_blocks=2, dense_layers=1, layers=4),
}


def synthetic_pair(name, layers, device, dtype, draft_dtype, attn_backend, prepack, seed=0):
    """(target model, drafter) with random weights: a MiniMax-M3-layout target and a drafter shaped like
    the published DFlash 2 ones (5 layers, intermediate 3x hidden, head_dim 128 (16 for tiny), GQA 4:1,
    5 taps spread over the target, block 8, K 16, rank 256)."""
    from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
    from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

    from .checkpoint import DFlash2Config

    shape = dict(SYNTHETIC[name])
    dense, default_layers = shape.pop("dense_layers"), shape.pop("layers")
    layers = layers or default_layers
    if layers <= dense:
        raise SystemExit(f"--synthetic-layers must exceed the {dense} dense layers of {name}, got {layers}")
    torch.manual_seed(seed)
    cfg = MiniMaxM3VLTextConfig(num_hidden_layers=layers, max_position_embeddings=8192, bos_token_id=None,
                                eos_token_id=None, pad_token_id=None,
                                layer_types=["full_attention"] * dense + ["minimax_m3_sparse"] * (layers - dense),
                                mlp_layer_types=["dense"] * dense + ["sparse"] * (layers - dense), **shape)
    with torch.device(device):  # initialise where it runs: a full-width layer set is many GB
        model = MiniMaxM3VLForCausalLM(cfg).to(dtype).eval()
    H, hd = cfg.hidden_size, 16 if name == "tiny" else 128
    taps = sorted({round(i * (layers - 1) / 4) for i in range(5)})
    dcfg = DFlash2Config(hidden_size=H, intermediate_size=3 * H, num_hidden_layers=5, num_attention_heads=H // hd,
                         num_key_value_heads=max(1, H // hd // 4), head_dim=hd, vocab_size=cfg.vocab_size,
                         num_target_layers=layers, target_layer_ids=taps, mask_token_id=cfg.vocab_size - 1,
                         rms_norm_eps=1e-6, rope_theta=1e4, max_position_embeddings=8192,
                         layer_types=["sliding_attention"] * 5, sliding_window=2048, use_sliding_window=True,
                         block_size=8, selector_rank=256 if name != "tiny" else 16, selector_top_k=16,
                         dtype="bfloat16").validate()
    with torch.device(device):
        drafter = DFlash2Drafter(dcfg, attn_backend).to(machine.draft_dtype(device, torch.bfloat16, draft_dtype)[0])
    if prepack:
        prepack_linears(model)
        prepack_linears(drafter)
    return model, drafter.eval()


def maybe_compile(target, drafter, enabled):
    """--compile: the compiled core (target forward, drafter, walk), run with static shapes."""
    if enabled:
        compile_core(target, drafter)


def core_functions(target, drafter):
    """What compile_core replaces (spec_decode.core_functions), with the callables they hold now."""
    return [(obj, name, getattr(obj, name)) for obj, name in spec_decode.core_functions(target, drafter)]


def alternate(target, drafter, prompts, args, stop_ids, eager, compiled):
    """--alternate N: decode every task's prompts N times per method, eager and compiled in turn in one
    process, so the machine's drift hits both alike. Rows carry tok/s per (round, mode)."""
    rows, first = [], {}
    for rnd in range(args.alternate):
        for mode, funcs in (("eager", eager), ("compiled", compiled)):
            for obj, name, fn in funcs:
                setattr(obj, name, fn)
            args.compile = mode == "compiled"  # static shapes go with the compiled core
            for task in args.tasks:
                for c in args.concurrency:
                    for m in args.methods:
                        timings = {} if args.profile else None
                        results, wall = run_method(target, drafter, prompts[task], m, c, args, stop_ids,
                                                   f"round {rnd + 1} {mode} {task} {m} c={c}", timings)
                        out = [r.tokens for r in results]
                        ref = first.setdefault((task, c, "ar" if "ar" in args.methods else m), out)
                        tokens = sum(len(t) for t in out)
                        rows.append(dict(round=rnd + 1, mode=mode, task=task, method=m, concurrency=c,
                                         throughput_tok_s=tokens / wall, completion_tokens=tokens, wall_s=wall,
                                         identical_to_ar=out == ref if args.temperature == 0 else None))
                        if timings is not None:
                            rows[-1]["step_ms"] = step_ms(results, timings)
    args.compile = True
    lines = ["Eager vs compiled, alternating in one process: tok/s per round\n",
             "| task | method | c | " + " | ".join(f"eager {i + 1} | compiled {i + 1}" for i in range(args.alternate))
             + " | compiled / eager (mean) |", "|---" * (4 + 2 * args.alternate) + "|"]
    for task in args.tasks:
        for c in args.concurrency:
            for m in args.methods:
                mine = [r for r in rows if (r["task"], r["method"], r["concurrency"]) == (task, m, c)]
                tok = {mode: [r["throughput_tok_s"] for r in mine if r["mode"] == mode] for mode in ("eager", "compiled")}
                cells = [f"{e:.1f} | {k:.1f}" for e, k in zip(tok["eager"], tok["compiled"])]
                ratio = statistics.mean(tok["compiled"]) / statistics.mean(tok["eager"])
                lines.append(f"| {task} | {m} | {c} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    if args.profile:
        lines += ["", "Per-step time split by round, ms (--profile)\n",
                  "| round | mode | task | method | " + " | ".join(PHASES) + " |", "|---" * (4 + len(PHASES)) + "|"]
        for r in rows:
            t = r["step_ms"]
            lines.append(f"| {r['round']} | {r['mode']} | {r['task']} | {r['method']} | "
                         + " | ".join(f"{t[k]:.1f}" if k in t else "–" for k in PHASES) + " |")
    print("\n".join(lines))
    return rows


def method_settings(label, args, stop_ids=(), **fields):
    """The DecodeSettings of one of our method labels under the bench's flags: NAME@N runs every step at width N
    (dflash2@4: blocks of 4; dflash2-tree@16: trees of 16 nodes), NAME alone as --policy says; fields amend it."""
    name, _, width = label.partition("@")
    tree = name == "dflash2-tree"
    s = DecodeSettings(method=name, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                       top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=stop_ids,
                       block_size=int(width) if width and not tree else args.block_size, static=args.compile,
                       tree_budget=int(width) if width and tree else None, tree_scores=args.tree_scores,
                       policy="fixed" if width or args.compile else args.policy, walk=args.walk)
    return dataclasses.replace(s, **fields)



def bench_drafter(kind, path, args, draft_dtype):
    """A drafter of `kind` (DFlash2Drafter or DSparkDrafter) from `path`, in this machine's dtype, packed."""
    drafter = kind.from_pretrained(path, device=args.device, dtype=draft_dtype, attn_backend=args.attn_backend)
    drafter = drafter.to(machine.draft_dtype(args.device, next(drafter.parameters()).dtype, draft_dtype)[0])
    if not args.no_prepack:
        prepack_linears(drafter)
    return drafter


def run_method(target, drafter, prompts, method, concurrency, args, stop_ids, desc, timings=None):
    """Decode prompts with `concurrency` requests in flight (a finished request's row takes the next
    prompt at once); returns the Results and the wall time. With timings: seconds per phase (prefill,
    drafter, selector, verify = the target's decode forwards, bookkeeping = the rest of the wall time),
    measured by wrapping the loop's step functions."""
    meter = CallMeter(timings, target.device)
    if timings is not None:
        for module, name, phase in ((spec_decode, "_prefill", "prefill"), (proposers, "draft", "drafter"),
                                    (proposers, "select_path", "selector"),
                                    (proposers, "select_tree", "selector")):  # a tree's build counts as its selection
            meter.watch(module, name, phase)
        meter.watch(target, "forward", "verify")
    bar = tqdm(total=len(prompts), desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())
    emitted = [0] * len(prompts)

    def on_emit(req, tokens):  # advance the bar when a request ends (generate's stop rule)
        emitted[req] += len(tokens)
        if tokens[-1] in stop_ids or emitted[req] >= args.max_new_tokens:
            bar.update(1)

    with metered(meter, bar, target.device) as clock:
        results = generate(target, drafter, prompts, method_settings(method, args, stop_ids, max_batch=concurrency),
                           on_emit=on_emit)
    return results, clock["wall"]


# --- peers: what a user would run instead, on the same target object, prompts and stop tokens ---

PEERS = ("hf", "hf-pld", "zlab")
# Prompt lookup's settings: tied best (with 10:3, within 1%) of the sweep in docs/BENCHMARKS.md (--pld-sweep).
PLD_NUM_TOKENS, PLD_NGRAM = 5, 2
ZLAB_INSTALL = "pip install dflash==0.1.0 --no-deps"


def cannot_run(method, concurrency):
    """Why a peer does not run at this concurrency, in words (None: it runs). The text before " (" is
    what a table cell shows."""
    if method not in PEERS or concurrency == 1:
        return None
    return {"hf": "not run: batch 1 here (generate batches only statically, left-padded, no continuous batching)",
            "hf-pld": "cannot run: batch 1 only (transformers' assisted generation raises for batch_size > 1)",
            "zlab": "cannot run: batch 1 only (dflash_generate decodes one sequence)"}[method]


def load_zlab(draft, model, prepack):
    """The authors' loop and their DFlash2DraftModel holding our drafter checkpoint, in the target's dtype (their
    loop feeds the target's embeddings and features to the drafter and its hidden states to the target's LM head,
    uncast); (None, why) when the dflash package cannot be imported."""
    try:
        from dflash.model import DFlash2DraftModel, dflash_generate
    except ImportError as e:
        return None, f"skipped: the authors' dflash is not importable ({e}; {ZLAB_INSTALL})"
    from .pair import resolve_draft

    head = model.get_output_embeddings().weight
    zmodel = DFlash2DraftModel.from_pretrained(str(resolve_draft(draft)[1]), dtype=head.dtype).to(head.device).eval()
    if prepack:  # the same oneDNN kernels as our drafter and the target
        prepack_linears(zmodel)
    return (zmodel, dflash_generate), None


class CallMeter:
    """Counts the target's forwards (a peer's verification steps, the prefill first) and, with timings, adds
    the seconds spent in each watched callable to its phase; the target's first call of a request is its prefill.
    A watched call made inside another counts toward the outer one's phase (a prefill's target forward)."""

    def __init__(self, timings, device):
        self.timings, self.device, self.calls, self._undo, self._depth = timings, device, 0, [], 0

    def _now(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _add(self, phase, seconds):
        if self.timings is not None:
            self.timings[phase] = self.timings.get(phase, 0.0) + seconds

    def watch_target(self, model):
        started = []

        def pre(*_):
            started.append(self._now() if self.timings is not None else 0.0)

        def post(*_):
            self._add("prefill" if self.calls == 0 else "verify", self._now() - started.pop() if started else 0.0)
            self.calls += 1

        self._undo += [model.register_forward_pre_hook(pre).remove, model.register_forward_hook(post).remove]

    def watch(self, obj, name, phase):
        """Time obj.name, a method of a class or of one instance, until close()."""
        fn = getattr(obj, name)

        def timed(*args, **kwargs):
            if self._depth:
                return fn(*args, **kwargs)
            start = self._now()
            self._depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self._depth -= 1
                self._add(phase, self._now() - start)

        had = name in vars(obj)  # a class's own method (restored), or a bound method shadowed on the instance
        setattr(obj, name, timed)
        self._undo.append(lambda: setattr(obj, name, fn) if had else delattr(obj, name))

    def close(self):
        for undo in reversed(self._undo):
            undo()
        self._undo = []


@contextmanager
def metered(meter, bar, device):
    """Time the body (to the device's last kernel); then the meter's watches come off and its phases get
    bookkeeping = the wall time no watched call took. Yields a dict that holds "wall" afterwards."""
    clock = {}
    start = time.perf_counter()
    try:
        yield clock
        if device.type == "cuda":
            torch.cuda.synchronize()
        clock["wall"] = time.perf_counter() - start
    finally:
        meter.close()
        bar.close()
    if meter.timings is not None:
        meter.timings["bookkeeping"] = clock["wall"] - sum(meter.timings.values())


def run_peer(model, method, prompts, args, stop_ids, desc, timings=None, zlab=None, max_new_tokens=None):
    """Decode prompts one at a time with a peer on the target object `model`; returns Results and the wall
    time. With timings: seconds per phase (prefill, drafter = a draft forward or prompt lookup's search,
    selector, verify = the target's other forwards, bookkeeping = the rest of the wall time)."""
    max_new_tokens = max_new_tokens or args.max_new_tokens
    sampled = args.temperature > 0
    meter = CallMeter(timings, model.device)
    meter.watch_target(model)
    if method == "hf-pld" and timings is not None:
        from transformers.generation.candidate_generator import PromptLookupCandidateGenerator

        meter.watch(PromptLookupCandidateGenerator, "get_candidates", "drafter")
    if method == "zlab" and timings is not None:
        meter.watch(zlab[0], "forward", "drafter")
        meter.watch(zlab[0], "propose", "selector")
    hf = dict(max_new_tokens=max_new_tokens, do_sample=sampled, eos_token_id=list(stop_ids),
              pad_token_id=stop_ids[0] if stop_ids else None)
    if sampled:  # top_k 0 = off, as ours
        hf.update(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k)
    if method == "hf-pld":
        hf.update(prompt_lookup_num_tokens=args.pld_num_tokens, max_matching_ngram_size=args.pld_ngram)
    bar = tqdm(total=len(prompts), desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())
    results = []
    with metered(meter, bar, model.device) as clock:
        for i, prompt in enumerate(prompts):
            torch.manual_seed(args.seed + i)  # their sampling draws from torch's global generator
            ids = torch.tensor([prompt], device=model.device)
            meter.calls = 0
            if method == "zlab":
                zmodel, dflash_generate = zlab
                out = dflash_generate(zmodel, model, ids, max_new_tokens, list(stop_ids), temperature=args.temperature,
                                      top_p=args.top_p, top_k=args.top_k, block_size=args.block_size)
            else:
                out = model.generate(ids, attention_mask=torch.ones_like(ids), **hf)
            results.append(Result(out[0, len(prompt):].tolist(), meter.calls))
            bar.update(1)
    return results, clock["wall"]


PHASES = ["drafter", "selector", "verify", "bookkeeping"]  # the phases run_method's profile times in each step


def step_ms(results, timings):
    """Milliseconds per request-step by phase: a batched step's time shared among its rows, so at
    concurrency 1 the time of a decode step (the prefill, its own phase, is left out)."""
    steps = sum(r.verify_steps - 1 for r in results)  # decode steps: the prefill counts as step 1
    return {k: 1000 * v / max(steps, 1) for k, v in timings.items() if k != "prefill"}


def profile_table(rows):
    """Milliseconds per request-step by phase (see step_ms); the drafting overhead relative to verification;
    and what a step costs in ar steps at the same task and concurrency. That cost is the tau a method needs
    to break even there: its speedup over ar is about tau / cost (prefill aside)."""
    out = ["", "Per-step time split, ms per request-step: a batched step's time shared among its rows (overhead = "
           "drafter + selector + bookkeeping, as a share of verify; ar steps = this step's time / an ar step's at "
           "the same task and concurrency: the tau that breaks even)\n",
           "| task | concurrency | method | " + " | ".join(PHASES) + " | overhead | ar steps |",
           "|---" * (len(PHASES) + 5) + "|"]
    total = {(r["task"], r["concurrency"], r["method"]): sum(r["step_ms"].values()) for r in rows if "step_ms" in r}
    for r in rows:
        if "step_ms" not in r:
            continue
        t = r["step_ms"]
        if not t.get("verify"):  # every request ended at its prefill
            continue
        overhead = sum(t.get(k, 0.0) for k in ("drafter", "selector", "bookkeeping")) / t["verify"]
        ar = total.get((r["task"], r["concurrency"], "ar"))
        cost = f"{sum(t.values()) / ar:.2f}" if ar else "–"
        out.append(f"| {r['task']} | {r['concurrency']} | {r['method']} | "
                   + " | ".join(f"{t.get(k, 0.0):.1f}" for k in PHASES) + f" | {100 * overhead:.0f}% | {cost} |")
    return "\n".join(out) + "\n"


def _shown(r, text):
    """A table cell: the figure, or in words why the method did not run there."""
    return text if r.get("cannot_run") is None else r["cannot_run"].split(" (")[0]


def tables(rows, tasks, methods, concurrencies):
    """The model card's layout: tau per task, throughput per task x (concurrency, method), speedup ranges."""
    cell = {(r["task"], r["method"], r["concurrency"]): r for r in rows}
    drafts = [m for m in methods if m not in ("ar", "hf")]  # hf's tau is 1 by definition
    out = []
    if drafts:
        c = min(concurrencies)
        out.append(f"Acceptance length τ (concurrency {c})\n")
        out.append("| task | " + " | ".join(drafts) + " |")
        out.append("|---" * (len(drafts) + 1) + "|")
        for task in tasks:
            out.append(f"| {task} | " + " | ".join(_shown(cell[task, m, c], _fmt(cell[task, m, c]["acceptance_length"]))
                                                  for m in drafts) + " |")
        means = [[cell[t, m, c]["acceptance_length"] for t in tasks] for m in drafts]
        out.append("| mean | " + " | ".join(_fmt(statistics.mean(x) if None not in x else None) for x in means) + " |")
        out.append("")
    cols = [(c, m) for c in concurrencies for m in methods]
    out.append("Throughput tok/s (speedup vs ar)\n")
    out.append("| task | " + " | ".join(f"{m} c={c}" for c, m in cols) + " |")
    out.append("|---" * (len(cols) + 1) + "|")
    for task in tasks:
        cells = []
        for c, m in cols:
            r = cell[task, m, c]
            speedup = f" ({r['speedup_vs_ar']:.2f}×)" if m != "ar" and r["speedup_vs_ar"] is not None else ""
            cells.append(_shown(r, f"{r['throughput_tok_s']:.1f}{speedup}" if r["throughput_tok_s"] else ""))
        out.append(f"| {task} | " + " | ".join(cells) + " |")
    if any(m != "ar" for m in methods) and "ar" in methods:
        out.append("")
        out.append("Speedup over ar across tasks: min–max (mean)\n")
        out.append("| method | " + " | ".join(f"c={c}" for c in concurrencies) + " |")
        out.append("|---" * (len(concurrencies) + 1) + "|")
        for m in methods:
            if m == "ar":
                continue
            cells = []
            for c in concurrencies:
                s = [cell[t, m, c]["speedup_vs_ar"] for t in tasks]
                cells.append(f"{min(s):.2f}×–{max(s):.2f}× ({statistics.mean(s):.2f}×)" if None not in s
                             else _shown(cell[tasks[0], m, c], "–"))
            out.append(f"| {m} | " + " | ".join(cells) + " |")
    per_prompt = [r for r in rows if r.get("prompt_speedups") and r["method"] != "ar"]
    if per_prompt:  # --interleave
        out += ["", f"Each prompt's speedup over ar (--interleave: each method timed on the prompt in turn; pooled over "
                    f"{per_prompt[0]['rounds']} round(s)): lowest, median, prompts below 0.95× and below 1.0×\n",
                "| task | method | lowest | median | < 0.95× | < 1.0× |", "|---|---|---|---|---|---|"]
        for r in per_prompt:
            x = r["prompt_speedups"]
            out.append(f"| {r['task']} | {r['method']} | {min(x):.2f}× | {statistics.median(x):.2f}× | "
                       f"{sum(v < 0.95 for v in x)} of {len(x)} | {sum(v < 1.0 for v in x)} of {len(x)} |")
    reasons = sorted({r["cannot_run"] for r in rows if r.get("cannot_run")})
    if reasons:
        out += ["", "Not run:"] + [f"- {why}" for why in reasons]
    return "\n".join(out)


def _fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


GOALS = {"hf-pld": 1.8, "hf": 2.5}  # issue 22: dflash2's speedup over each peer at concurrency 1, on every task


def side_by_side(rows, tasks, methods):
    """Concurrency 1, every method on the same target object: tok/s (speedup vs hf), and dflash2's ratio to each
    peer against its goal. A cell whose greedy output differs from ar's says so."""
    cell = {(r["task"], r["method"]): r for r in rows if r["concurrency"] == 1}
    ratios = [p for p in GOALS if p in methods and "dflash2" in methods]
    out = ["Side by side at concurrency 1 on the same target object: tok/s (speedup vs hf); "
           "greedy outputs checked against ar's\n",
           "| task | " + " | ".join(methods) + "".join(f" | dflash2 / {p} (goal ≥ {GOALS[p]}×)" for p in ratios) + " |",
           "|---" * (len(methods) + len(ratios) + 1) + "|"]
    for task in tasks:
        cells = []
        for m in methods:
            r = cell[task, m]
            vs = f" ({r['speedup_vs_hf']:.2f}×)" if r.get("speedup_vs_hf") is not None and m != "hf" else ""
            differs = " DIFFERS from ar" if r["identical_to_ar"] is False else ""
            cells.append(_shown(r, f"{_fmt(r['throughput_tok_s'], '.1f')}{vs}{differs}"))
        for p in ratios:
            ours, peer = cell[task, "dflash2"]["throughput_tok_s"], cell[task, p]["throughput_tok_s"]
            if ours and peer:
                x = ours / peer
                cells.append(f"{x:.2f}× ({'met' if x >= GOALS[p] else 'not met'})")
            else:
                cells.append("–")
        out.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def plot(rows, tasks, methods, concurrencies, path):
    """Left: tau per task and drafting method (lowest concurrency); right: mean throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = {(r["task"], r["method"], r["concurrency"]): r for r in rows}
    drafts = [m for m in methods if m not in ("ar", "hf")]

    def value(task, m, c, key):  # a gap where the method did not run
        x = cell[task, m, c][key]
        return float("nan") if x is None else x

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(drafts), 1)
    for k, m in enumerate(drafts):
        ax1.bar([i + k * width for i in range(len(tasks))],
                [value(t, m, min(concurrencies), "acceptance_length") for t in tasks], width, label=m)
    ax1.set_xticks([i + width * (len(drafts) - 1) / 2 for i in range(len(tasks))], tasks)
    ax1.set_ylabel("acceptance length τ")
    ax1.legend()
    for m in methods:
        ax2.plot(concurrencies, [statistics.mean(value(t, m, c, "throughput_tok_s") for t in tasks)
                                 for c in concurrencies], marker="o", label=m)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("throughput tok/s (mean over tasks)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)


def _names(allowed):
    def parse(s):
        names = list(dict.fromkeys(x.strip() for x in s.split(",") if x.strip()))  # in order, once each
        # ours may name a fixed width: dflash2@4, dflash2-tree@16
        bad = [x for x in names if x not in allowed and not (x.partition("@")[0] in METHODS and x.partition("@")[2].isdigit())]
        if bad or not names:
            raise argparse.ArgumentTypeError(f"expected a comma-separated subset of {','.join(allowed)}, got {s!r}")
        return names
    return parse


def _pld_settings(s):
    try:
        pairs = [tuple(int(v) for v in x.split(":")) for x in s.split(",")]
    except ValueError:
        pairs = []
    if not pairs or any(len(p) != 2 or min(p) < 1 for p in pairs):
        raise argparse.ArgumentTypeError(f"expected NUM_TOKENS:NGRAM pairs of positive integers, e.g. 5:2,10:3, got {s!r}")
    return pairs


def pld_sweep(model, prompts, args, stop_ids):
    """--pld-sweep: hf-pld at each (prompt_lookup_num_tokens, max_matching_ngram_size), every setting in turn on
    each task at concurrency 1; prints tok/s and tau per task, the mean tok/s, and writes the rows to --out."""
    rows = []
    run_peer(model, "hf-pld", [next(iter(prompts.values()))[0]], args, stop_ids, "warm-up", max_new_tokens=8)
    for task in args.tasks:
        for n, g in args.pld_sweep:
            args.pld_num_tokens, args.pld_ngram = n, g
            results, wall = run_peer(model, "hf-pld", prompts[task], args, stop_ids, f"{task} hf-pld {n}:{g}")
            tokens = sum(len(r.tokens) for r in results)
            rows.append(dict(task=task, pld_num_tokens=n, pld_ngram=g, throughput_tok_s=tokens / wall,
                             acceptance_length=mean_tau(results), completion_tokens=tokens, wall_s=wall))
    cell = {(r["task"], r["pld_num_tokens"], r["pld_ngram"]): r for r in rows}
    mean = {(n, g): statistics.mean(cell[t, n, g]["throughput_tok_s"] for t in args.tasks) for n, g in args.pld_sweep}
    lines = ["hf-pld sweep at concurrency 1: tok/s (τ)\n",
             "| num_tokens | ngram | " + " | ".join(args.tasks) + " | mean tok/s |", "|---" * (len(args.tasks) + 3) + "|"]
    for n, g in args.pld_sweep:
        lines.append(f"| {n} | {g} | " + " | ".join(f"{cell[t, n, g]['throughput_tok_s']:.1f} "
                                                    f"({_fmt(cell[t, n, g]['acceptance_length'])})" for t in args.tasks)
                     + f" | {mean[n, g]:.1f} |")
    best = max(mean, key=mean.get)
    lines.append(f"\nbest: --pld-num-tokens {best[0]} --pld-ngram {best[1]}")
    print("\n".join(lines))
    report = {"config": dict(vars(args), torch=torch.__version__), "pld_sweep": rows, "best": list(best)}
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return report


def _ints(s):
    values = [int(x) for x in s.split(",")]
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected comma-separated positive integers, got {s!r}")
    return values


def build_parser():
    ap = argparse.ArgumentParser(prog="dflash2-bench", description=__doc__, formatter_class=HelpFormatter)
    ap.add_argument("--target", default=None, help="target dir or hub id (default: the embedded SmolLM2-135M-Instruct)")
    ap.add_argument("--draft", default=str(DEFAULT_DRAFT), help="drafter checkpoint dir or hub id")
    ap.add_argument("--dspark-draft", default=str(DEFAULT_DSPARK_DRAFT),
                    help="the DSpark drafter --methods dspark runs with (default: the embedded one)")
    ap.add_argument("--data-dir", default="../shared/data", help="local data (else the hub via `datasets`)")
    ap.add_argument("--tasks", type=_names(ALL_TASKS), default=list(TASKS),
                    help=f"comma-separated, of {','.join(ALL_TASKS)} (default: the five tasks of the model card)")
    ap.add_argument("--methods", type=_names(METHODS + PEERS), default=["ar", "dflash", "dflash2"],
                    help="ours (ar, dflash, dflash2, dflash2-tree) and peers on the same target object: hf (transformers "
                         "generate), hf-pld (its prompt lookup decoding), zlab (the authors' dflash_generate, "
                         "PyPI dflash==0.1.0); peers run at concurrency 1 only")
    ap.add_argument("--tree-budget", type=_ints, default=None,
                    help="dflash2-tree's node budgets, e.g. 4,8,16: one method dflash2-tree@N per budget "
                         "(default: the device's, settings.DEFAULT_TREE_BUDGET)")
    ap.add_argument("--tree-scores", choices=TREE_SCORES, default="selector",
                    help="dflash2-tree's path scores: the selector's conditional law, or DDTree's per-slot marginals")
    ap.add_argument("--concurrency", type=_ints, default=[1, 8, 32], help="requests in flight, e.g. 1,8,32")
    ap.add_argument("--num-prompts", type=int, default=16, help="the first N prompts of each task")
    ap.add_argument("--max-new-tokens", type=int, default=256, help="new tokens per request")
    ap.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (the card uses 1.0)")
    ap.add_argument("--top-p", type=float, default=1.0, help="the card uses 0.95")
    ap.add_argument("--top-k", type=int, default=0, help="0 = off")
    ap.add_argument("--seed", type=int, default=0, help="sampling seed (one per run)")
    ap.add_argument("--block-size", type=int, default=None, help="the block, or with --policy auto its cap (default: the drafter's)")
    ap.add_argument("--walk", choices=("sample", "greedy"), default="sample",
                    help="at T > 0: the selector walk samples its drafts (the authors'), or takes the argmax (vLLM's default)")
    ap.add_argument("--policy", choices=("auto", "fixed"), default="auto",
                    help="auto: each step's width from this machine's measured costs and the drafter's law (policy.py); "
                         "fixed: every step verifies the whole block or tree. A label NAME@N is always fixed at N")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="cuda when available, else cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"], help="the target's")
    ap.add_argument("--draft-dtype", default=None, choices=["float32", "bfloat16", "float16"],
                    help="the drafter's (default: its checkpoint's); changes speed and tau, never the output")
    ap.add_argument("--compile", action="store_true", help="compile the hot paths (see maybe_compile)")
    ap.add_argument("--alternate", type=int, default=0, metavar="N",
                    help="with --compile: decode N rounds, eager then compiled each round, in one process, and "
                         "print tok/s per round (a drifting machine hits both modes alike)")
    ap.add_argument("--interleave", action="store_true",
                    help="concurrency 1: time prompt by prompt, every method on a prompt in turn (rotating order), "
                         "so a drifting machine hits each method alike; adds each prompt's speedup over ar")
    ap.add_argument("--rounds", type=int, default=1, metavar="N",
                    help="with --interleave: N passes over the prompts, each prompt's speedup pooled over them")
    ap.add_argument("--no-prepack", action="store_true",
                    help="CPU: keep aten's linears instead of oneDNN with pre-packed weights")
    ap.add_argument("--profile", action="store_true",
                    help="also time each phase of a step (drafter, selector, verify, bookkeeping) at every concurrency")
    ap.add_argument("--attn-backend", choices=["sdpa", "flex", "flash"], default=None,
                    help="the drafter's attention kernel (default: FA4 on sm90/sm100 when installed, Flex on other "
                         "GPUs, SDPA on CPU)")
    ap.add_argument("--synthetic", choices=sorted(SYNTHETIC), default=None,
                    help="time a random-weight pair of this shape on random prompts instead of --target/--draft "
                         "and the tasks (tau is meaningless then; the per-step split with --profile is the point)")
    ap.add_argument("--synthetic-layers", type=int, default=None, help="target layers of --synthetic (default 8 / 4)")
    ap.add_argument("--synthetic-prompt-len", type=int, default=256, help="prompt length of --synthetic")
    ap.add_argument("--pld-num-tokens", type=int, default=PLD_NUM_TOKENS, help="hf-pld's prompt_lookup_num_tokens")
    ap.add_argument("--pld-ngram", type=int, default=PLD_NGRAM, help="hf-pld's max_matching_ngram_size")
    ap.add_argument("--pld-sweep", type=_pld_settings, default=None, metavar="N:G,...",
                    help="instead of the methods: time hf-pld at each prompt_lookup_num_tokens:max_matching_ngram_size "
                         "on the tasks at concurrency 1, in one process, and print the table")
    ap.add_argument("--out", default="results.json", help="write the config and every result row here as JSON")
    ap.add_argument("--plot", default=None, help="also draw tau and throughput to this image (needs matplotlib)")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    if args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.alternate < 0 or (args.alternate and not args.compile):
        raise SystemExit("--alternate N needs N >= 1 and --compile (it alternates eager and compiled runs)")
    if args.pld_sweep:
        args.methods, args.concurrency = ["hf-pld"], [1]
    if args.interleave and (args.concurrency != [1] or args.alternate):
        raise SystemExit("--interleave times one prompt at a time: it needs --concurrency 1 (and no --alternate)")
    if args.rounds < 1 or (args.rounds > 1 and not args.interleave):
        raise SystemExit("--rounds N needs N >= 1 and --interleave")
    if args.tree_budget and "dflash2-tree" in args.methods:  # one method per budget, side by side
        i = args.methods.index("dflash2-tree")
        args.methods[i : i + 1] = [f"dflash2-tree@{n}" for n in args.tree_budget]
    peers = [m for m in args.methods if m in PEERS]
    if peers and (args.synthetic or args.alternate or args.compile):
        raise SystemExit(f"--methods {','.join(peers)}: peers run on a real pair, eager (not with --synthetic, "
                         "--compile or --alternate)")
    if args.pld_num_tokens < 1 or args.pld_ngram < 1:
        raise SystemExit("--pld-num-tokens and --pld-ngram must be >= 1")

    try:  # before any slow load
        args.attn_backend = check_attn_backend(args.attn_backend, args.device, compiled=args.compile)
    except ValueError as e:
        raise SystemExit(f"--attn-backend: {e}") from None
    dtype = getattr(torch, args.dtype)
    draft_dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else None
    if args.synthetic:
        dspark = None
        model, drafter = synthetic_pair(args.synthetic, args.synthetic_layers, args.device, dtype, draft_dtype,
                                        args.attn_backend, prepack=not args.no_prepack, seed=args.seed)
        g = torch.Generator().manual_seed(args.seed)
        vocab = model.config.vocab_size - 1  # the last id is the drafter's mask token
        args.tasks = ["synthetic"]
        prompts = {"synthetic": [torch.randint(vocab, (args.synthetic_prompt_len,), generator=g).tolist()
                                 for _ in range(args.num_prompts)]}
        stop_ids = []  # random weights: every request runs to max_new_tokens
    else:
        texts = load_tasks(args.tasks, args.data_dir, args.num_prompts)
        model, tokenizer = load_target(args.target, device=args.device, dtype=dtype, prepack=not args.no_prepack)
        kinds = {method_settings(m, args).method for m in args.methods if m not in PEERS}
        drafter = dspark = None
        if kinds & {"dflash2", "dflash", "dflash2-tree"}:
            drafter = bench_drafter(DFlash2Drafter, args.draft, args, draft_dtype)
        if "dspark" in kinds:  # its own drafter (--dspark-draft), on the same target
            dspark = bench_drafter(DSparkDrafter, args.dspark_draft, args, draft_dtype)
            if drafter is not None and drafter.config.target_layer_ids != dspark.config.target_layer_ids:
                raise SystemExit(f"--draft and --dspark-draft tap different target layers "
                                 f"({drafter.config.target_layer_ids} vs {dspark.config.target_layer_ids})")
        stop_ids = stop_token_ids(model, tokenizer)
        prompts = {task: [encode_prompt(tokenizer, format_prompt(task, t)) for t in ts] for task, ts in texts.items()}
    if drafter is not None:  # record what ran
        args.draft_dtype = str(next(drafter.parameters()).dtype).removeprefix("torch.")
        args.attn_backend = drafter.attn_backend
    args.machine = machine.machine().describe()
    tapping = drafter if drafter is not None else dspark
    target = Target(model, tapping.config.target_layer_ids if tapping is not None else ())

    def draft_for(m):  # the drafter a method runs with
        return dspark if m not in PEERS and method_settings(m, args).method == "dspark" else drafter

    eager = core_functions(target, drafter)
    maybe_compile(target, drafter, args.compile)
    zlab, zlab_missing = load_zlab(args.draft, model, not args.no_prepack) if "zlab" in args.methods else (None, None)
    if zlab_missing:
        print(f"zlab {zlab_missing}", flush=True)
    if args.pld_sweep:
        return pld_sweep(model, prompts, args, stop_ids)

    # Untimed warm-up of every method, so one-time costs (allocator, kernels, compilation) are billed to no one.
    first = next(iter(prompts.values()))[0]
    if drafter is not None and args.policy == "auto":  # this machine's costs, measured once, before any timing
        costs = policy.machine_costs(target, drafter)
        args.costs = dict(verify={w: round(costs.V(w), 3) for w in (1, 2, 3, 4, 6, 8, 12, 16, 24, 33)},
                          draft=round(costs.draft, 3), draft_tree=round(costs.draft_tree, 3),
                          one_token_forward_ms=round(costs.ms_per_token, 2), steady=costs.steady)
        print("policy costs (units of a one-token forward): verify " +
              ", ".join(f"V({w}) {v}" for w, v in args.costs["verify"].items()) +
              f"; draft {args.costs['draft']}, tree draft {args.costs['draft_tree']}; "
              f"V(1) = {args.costs['one_token_forward_ms']} ms"
              + ("" if costs.steady else " (UNSTEADY: no two measurements agreed; not cached)"), flush=True)
    # Compiled runs warm up at the real length: static cache shapes depend on it.
    for m in args.methods:
        if m in PEERS:
            if not (m == "zlab" and zlab is None):
                run_peer(model, m, [first], args, stop_ids, f"warm-up {m}", zlab=zlab, max_new_tokens=8)
            continue
        generate(target, draft_for(m), [first],
                 method_settings(m, args, max_new_tokens=args.max_new_tokens if args.compile else 8))

    if args.alternate:
        compiled = core_functions(target, drafter)
        for obj, name, fn in eager:  # warm the eager path up too
            setattr(obj, name, fn)
        for m in args.methods:
            generate(target, drafter, [first], method_settings(m, args, max_new_tokens=8, static=False))
        rows = alternate(target, drafter, prompts, args, stop_ids, eager, compiled)
        for r in rows:
            if r["identical_to_ar"] is False:
                print(f"WARNING: round {r['round']} {r['mode']} {r['method']} output differs on {r['task']}", flush=True)
        report = {"config": dict(vars(args), torch=torch.__version__), "alternate": rows}
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        return report

    def measure(task, m, c, batch, desc):
        """One cell's decode of `batch` prompts: (results, wall seconds); with --profile its phase timings too."""
        timings = {} if args.profile else None
        if m in PEERS:
            results, wall = run_peer(model, m, batch, args, stop_ids, desc, timings, zlab)
        else:
            results, wall = run_method(target, draft_for(m), batch, m, c, args, stop_ids, desc, timings)
        return results, wall, timings

    rows, outputs = [], {}
    for task in args.tasks:  # every method in turn, ours and peers alike, so drift hits them alike
        for c in args.concurrency:
            cells = []
            for m in args.methods:
                row = dict(task=task, method=m, concurrency=c, num_prompts=len(prompts[task]), acceptance_length=None,
                           throughput_tok_s=None, speedup_vs_ar=None, speedup_vs_hf=None, completion_tokens=None,
                           wall_s=None, identical_to_ar=None, cannot_run=zlab_missing if m == "zlab" else None)
                row["cannot_run"] = row["cannot_run"] or cannot_run(m, c)
                rows.append(row)
                if not row["cannot_run"]:
                    cells.append(row)
            if args.interleave:  # prompt by prompt, every method on it in turn (the order rotates), --rounds times
                n = len(prompts[task])
                done = {r["method"]: ([None] * n, [0] * n, [0.0] * n, {} if args.profile else None) for r in cells}
                for rnd in range(args.rounds):
                    for i, prompt in enumerate(prompts[task]):
                        k = (i + rnd) % len(cells)
                        for r in cells[k:] + cells[:k]:
                            results, wall, timings = measure(task, r["method"], c, [prompt],
                                                             f"{task} round {rnd} prompt {i} {r['method']}")
                            first, counts, walls, total = done[r["method"]]
                            if first[i] is not None and first[i].tokens != results[0].tokens:
                                raise SystemExit(f"{r['method']} decoded {task} prompt {i} differently in round {rnd}")
                            first[i] = results[0]
                            counts[i] += len(results[0].tokens)
                            walls[i] += wall
                            for key, v in (timings or {}).items():
                                total[key] = total.get(key, 0.0) + v
            for row in cells:
                m = row["method"]
                if args.interleave:  # every round's tokens over every round's wall
                    results, counts, walls, timings = done[m]
                    wall, tokens = sum(walls), sum(counts)
                    row["prompt_tok_s"] = [t / w for t, w in zip(counts, walls)]
                    row["rounds"] = args.rounds
                    timings = None if timings is None else {k: v / args.rounds for k, v in timings.items()}
                else:
                    results, wall, timings = measure(task, m, c, prompts[task], f"{task} {m} c={c}")
                    tokens = sum(len(r.tokens) for r in results)
                outputs[task, m, c] = [r.tokens for r in results]
                row.update(acceptance_length=mean_tau(results), throughput_tok_s=tokens / wall,
                           completion_tokens=sum(len(r.tokens) for r in results), wall_s=wall)
                if m not in PEERS and m != "ar":
                    row["widths"] = width_shares(results)
                if timings is not None:
                    row["step_ms"] = step_ms(results, timings)

    greedy = args.temperature == 0
    measured = {(r["task"], r["method"], r["concurrency"]): r for r in rows if r["cannot_run"] is None}
    for r in measured.values():
        key = r["task"], "ar", r["concurrency"]
        if key in measured:
            r["speedup_vs_ar"] = r["throughput_tok_s"] / measured[key]["throughput_tok_s"]
            if "prompt_tok_s" in r:  # --interleave: each prompt's speedup, its method and ar timed seconds apart
                r["prompt_speedups"] = [a / b for a, b in zip(r["prompt_tok_s"], measured[key]["prompt_tok_s"])]
            # Lossless: greedy drafting, ours or a peer's, must reproduce ar's output for the same prompt
            # (at the same concurrency).
            if greedy:
                r["identical_to_ar"] = outputs[r["task"], r["method"], r["concurrency"]] == outputs[key]
        hf = r["task"], "hf", r["concurrency"]
        if hf in measured:
            r["speedup_vs_hf"] = r["throughput_tok_s"] / measured[hf]["throughput_tok_s"]

    print(tables(rows, args.tasks, args.methods, args.concurrency))
    if peers and 1 in args.concurrency:
        print("\n" + side_by_side(rows, args.tasks, args.methods))
    if args.profile:
        print(profile_table(rows))
    for r in rows:
        if r["identical_to_ar"] is False:
            print(f"WARNING: {r['method']} greedy output differs from ar on {r['task']} at concurrency "
                  f"{r['concurrency']}: decoding is NOT lossless here", flush=True)
    report = {"config": dict(vars(args), block_size=args.block_size or (drafter.config.block_size if drafter else 1),
                             torch=torch.__version__), "results": rows}
    if zlab is not None:  # their loop needs the drafter in the target's dtype
        report["config"]["zlab_draft_dtype"] = str(next(zlab[0].parameters()).dtype).removeprefix("torch.")
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    if args.plot:
        plot(rows, args.tasks, args.methods, args.concurrency, args.plot)
    return report


if __name__ == "__main__":
    main()
