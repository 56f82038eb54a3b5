"""Benchmark ar / dflash / dflash2 side by side with the model card's protocol (SPEC §8).

    python -m dflash2.bench                                               # embedded SmolLM2 pair, greedy, 16 prompts/task
    python -m dflash2.bench --temperature 1.0 --top-p 0.95 --max-new-tokens 4096 --num-prompts 128   # the card's sampling
    python -m dflash2.bench --tasks gsm8k,mbpp --concurrency 1,8 --out results.json --plot results.png
    python -m dflash2.bench --protocol --num-prompts 16 --max-new-tokens 256 --out card.json   # ar, dflash2, dspark
    python -m dflash2.bench --report card.json                              # its tables again, from the file

Every method decodes the same prompts in the same process, so the speedups are ratios measured in
one run. Acceptance length tau = per-request mean of completion tokens / verification steps;
throughput = total output tokens / end-to-end wall time (prefill included), with `concurrency`
requests in flight, batched by our loop: a finished request's row takes the next waiting prompt at
once (continuous batching, as a serving engine's maximum concurrency does). With --rounds N the methods
of a cell take turns N times (the first one rotating, and each cell starting from the next method), so the
machine's drift falls on all of them; with --interleave they take turns wave by wave (`concurrency` prompts a
batch), and with --lockstep they decode at once (a cell's prompts, or a wave with --interleave), taking turns step
by step, so a machine whose speed moves within a decode slows all of them alike. At T > 0 each method draws its
own outputs, of other lengths: --ignore-eos makes every request decode --max-new-tokens tokens, so every method
does the same work.
"""
import argparse
import dataclasses
import importlib.util
import json
import sys
import time
from contextlib import contextmanager
from pathlib import Path

import torch
from tqdm import tqdm

from . import machine, policy, proposers, report, spec_decode
from .kernels import check_attn_backend, prepack_linears
from .dspark import DSparkDrafter
from .model import DFlash2Drafter
from .pair import load_target, stop_token_ids
from .policy import COST_BATCHES, COST_WIDTHS
from .prompts import ALL_TASKS, TASKS, encode_prompt, format_prompt, load_tasks
from .settings import DEFAULT_DRAFT, DEFAULT_DSPARK_DRAFT, METHODS, TREE_SCORES, DecodeSettings, HelpFormatter
from .results import Result, mean_tau, width_shares
from .spec_decode import compile_core, decode_steps, generate
from .target import Target



# Random-weight pairs of realistic shapes, to time steps where no checkpoint is at hand (the GPU check
# of docs/BENCHMARKS.md "Compiled core"): with random weights tau means nothing, the per-step split does.
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
    print(report.alternate_table(rows, vars(args)))
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
    bar = progress_bar(len(prompts), desc)
    with metered(meter, bar, target.device) as clock:
        results = generate(target, drafter, prompts, method_settings(method, args, stop_ids, max_batch=concurrency),
                           on_emit=ticker(bar, len(prompts), args.max_new_tokens, stop_ids))
    return results, clock["wall"]


def in_lockstep(run, args, methods, c, batch, desc):
    """--lockstep: the methods decode `batch` at once, c requests in flight each, taking turns step by step
    (spec_decode.decode_steps), each timed over its own steps only, so a machine whose speed moves within a decode
    slows all of them alike. Returns {method: (results, wall seconds, None)}."""
    bar = progress_bar(len(batch) * len(methods), desc)
    steps, books, walls = {}, {}, dict.fromkeys(methods, 0.0)
    for m in methods:
        settings = method_settings(m, args, run.stop_ids, max_batch=c)
        steps[m] = decode_steps(run.target, draft_for(run, m), batch, settings,
                                on_emit=ticker(bar, len(batch), args.max_new_tokens, run.stop_ids))
    live = list(methods)
    while live:
        for m in list(live):
            start = time.perf_counter()
            try:
                books[m] = next(steps[m])
            except StopIteration:
                live.remove(m)
            if run.target.device.type == "cuda":
                torch.cuda.synchronize()
            walls[m] += time.perf_counter() - start
    bar.close()
    return {m: (books[m].results, walls[m], None) for m in methods}


def progress_bar(total, desc):
    """A bar of requests done, on a terminal only."""
    return tqdm(total=total, desc=desc, file=sys.stderr, leave=False, disable=not sys.stderr.isatty())


def ticker(bar, n, max_new_tokens, stop_ids):
    """generate's on_emit that advances the bar when one of its n requests ends (generate's stop rule)."""
    emitted = [0] * n

    def on_emit(req, tokens):
        emitted[req] += len(tokens)
        if tokens[-1] in stop_ids or emitted[req] >= max_new_tokens:
            bar.update(1)
    return on_emit


# --- peers: what a user would run instead, on the same target object, prompts and stop tokens ---

PEERS = ("hf", "hf-pld", "zlab")
# Prompt lookup's settings: tied best (with 10:3, within 1%) of a --pld-sweep on GSM8K and HumanEval (013e2f8:docs/BENCHMARKS.md).
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


def step_ms(results, timings):
    """Milliseconds per request-step by phase: a batched step's time shared among its rows, so at
    concurrency 1 the time of a decode step (the prefill, its own phase, is left out)."""
    steps = sum(r.verify_steps - 1 for r in results)  # decode steps: the prefill counts as step 1
    return {k: 1000 * v / max(steps, 1) for k, v in timings.items() if k != "prefill"}


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
    data = {"config": dict(vars(args), torch=torch.__version__), "pld_sweep": rows}
    print(report.pld_table(rows, data["config"]))
    means = report.pld_means(rows, data["config"])
    data["best"] = list(max(means, key=means.get))
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    return data


CONCURRENCY = (1, 8, 32)  # --concurrency's default: the model card's


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
    ap.add_argument("--concurrency", type=_ints, default=CONCURRENCY,
                    help="requests in flight (with --report: only these of the run's columns, all if not given)")
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
                    help="time wave by wave, every method on a wave in turn (rotating order), so a drifting machine "
                         "hits each method alike; a wave is --concurrency prompts decoded as one batch that shrinks "
                         "as its requests end (one prompt at concurrency 1); adds each wave's speedup over ar")
    ap.add_argument("--lockstep", action="store_true",
                    help="our methods decode a cell's prompts at once (a wave at a time with --interleave), taking "
                         "turns step by step, each timed over its own steps (peers still take their turns whole): "
                         "the machine's speed, which moves within a decode, falls on every method alike")
    ap.add_argument("--ignore-eos", action="store_true",
                    help="every request decodes --max-new-tokens tokens, its stop tokens ignored (serving benchmarks' "
                         "practice): at T > 0 the methods draw different outputs, whose lengths would change the work "
                         "and a batch's occupancy; this gives every method the same tokens to make")
    ap.add_argument("--rounds", type=int, default=None, metavar="N",
                    help="decode every cell N times, its methods taking turns with the first one rotating each round "
                         "and each cell (wave by wave with --interleave), and pool the tokens and walls (default: 1, "
                         "2 with --protocol)")
    ap.add_argument("--protocol", action="store_true",
                    help="the model card's protocol: --methods ar,dflash2,dspark on the six tasks (the card's five and "
                         "chat-heldout) at --concurrency (1,8,32 by default), greedy and at T = 1 / top-p 0.95, in one "
                         "run")
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
    ap.add_argument("--report", metavar="FILE", default=None,
                    help="decode nothing: print the tables of a results JSON this bench wrote (what that run printed)")
    ap.add_argument("--sections", type=_names(report.SECTIONS), default=list(report.SECTIONS),
                    help=f"with --report: which tables, of {','.join(report.SECTIONS)}")
    ap.add_argument("--plot", default=None, help="also draw tau and throughput to this image (needs matplotlib)")
    return ap


SIX_TASKS = TASKS + ("chat-heldout",)  # the card's five and our held-out chat prompts
CARD_SAMPLINGS = [[0.0, 1.0], [1.0, 0.95]]  # (temperature, top_p): greedy, and the card's sampling


def check_args(args):
    """Every check of the flags, before anything is loaded; --protocol and --tree-budget expand the methods."""
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        raise SystemExit("--plot needs matplotlib: pip install matplotlib (or pip install -e '.[plot]')")
    if args.num_prompts < 1:
        raise SystemExit(f"--num-prompts must be >= 1, got {args.num_prompts}")
    if args.alternate < 0 or (args.alternate and not args.compile):
        raise SystemExit("--alternate N needs N >= 1 and --compile (it alternates eager and compiled runs)")
    if args.protocol:
        args.tasks, args.methods = list(SIX_TASKS), ["ar", "dflash2", "dspark"]
    args.samplings = CARD_SAMPLINGS if args.protocol else [[args.temperature, args.top_p]]
    args.concurrency = list(args.concurrency)
    if args.rounds is None:
        args.rounds = 2 if args.protocol else 1
    if args.pld_sweep:
        args.methods, args.concurrency = ["hf-pld"], [1]
    if args.lockstep and (args.profile or args.alternate):
        raise SystemExit("--lockstep times each method's steps as a whole: not with --profile (whose phase timers "
                         "would see every method's calls) or --alternate")
    if args.interleave and args.alternate:
        raise SystemExit("--interleave takes turns wave by wave between methods; --alternate between eager and "
                         "compiled: choose one")
    if args.rounds < 1 or (args.rounds > 1 and (args.alternate or args.pld_sweep)):
        raise SystemExit("--rounds N needs N >= 1 (and neither --alternate nor --pld-sweep)")
    if args.tree_budget and "dflash2-tree" in args.methods:  # one method per budget, side by side
        i = args.methods.index("dflash2-tree")
        args.methods[i : i + 1] = [f"dflash2-tree@{n}" for n in args.tree_budget]
    peers = [m for m in args.methods if m in PEERS]
    if peers and (args.synthetic or args.alternate or args.compile or args.ignore_eos):
        raise SystemExit(f"--methods {','.join(peers)}: peers run on a real pair, eager, to their stop tokens (not "
                         "with --synthetic, --compile, --alternate or --ignore-eos)")
    if args.pld_num_tokens < 1 or args.pld_ngram < 1:
        raise SystemExit("--pld-num-tokens and --pld-ngram must be >= 1")
    try:
        args.attn_backend = check_attn_backend(args.attn_backend, args.device, compiled=args.compile)
    except ValueError as e:
        raise SystemExit(f"--attn-backend: {e}") from None


def load(args):
    """What a run decodes: the target (and its Target), the drafters its methods need, the prompts per task and
    the stop tokens; or a random-weight pair and random prompts (--synthetic). Records in args what ran."""
    dtype = getattr(torch, args.dtype)
    draft_dtype = getattr(torch, args.draft_dtype) if args.draft_dtype else None
    run = argparse.Namespace(dspark=None, zlab=None, zlab_missing=None)
    if args.synthetic:
        run.model, run.drafter = synthetic_pair(args.synthetic, args.synthetic_layers, args.device, dtype, draft_dtype,
                                                args.attn_backend, prepack=not args.no_prepack, seed=args.seed)
        g = torch.Generator().manual_seed(args.seed)
        vocab = run.model.config.vocab_size - 1  # the last id is the drafter's mask token
        args.tasks = ["synthetic"]
        run.prompts = {"synthetic": [torch.randint(vocab, (args.synthetic_prompt_len,), generator=g).tolist()
                                     for _ in range(args.num_prompts)]}
        run.stop_ids = []  # random weights: every request runs to max_new_tokens
    else:
        texts = load_tasks(args.tasks, args.data_dir, args.num_prompts)
        run.model, tokenizer = load_target(args.target, device=args.device, dtype=dtype, prepack=not args.no_prepack)
        kinds = {method_settings(m, args).method for m in args.methods if m not in PEERS}
        run.drafter = None
        if kinds & {"dflash2", "dflash", "dflash2-tree"}:
            run.drafter = bench_drafter(DFlash2Drafter, args.draft, args, draft_dtype)
        if "dspark" in kinds:  # its own drafter (--dspark-draft), on the same target
            run.dspark = bench_drafter(DSparkDrafter, args.dspark_draft, args, draft_dtype)
            if run.drafter is not None and run.drafter.config.target_layer_ids != run.dspark.config.target_layer_ids:
                raise SystemExit(f"--draft and --dspark-draft tap different target layers "
                                 f"({run.drafter.config.target_layer_ids} vs {run.dspark.config.target_layer_ids})")
        run.stop_ids = [] if args.ignore_eos else stop_token_ids(run.model, tokenizer)
        run.prompts = {task: [encode_prompt(tokenizer, format_prompt(task, t)) for t in ts] for task, ts in texts.items()}
    if run.drafter is not None:  # record what ran
        args.draft_dtype = str(next(run.drafter.parameters()).dtype).removeprefix("torch.")
        args.attn_backend = run.drafter.attn_backend
    args.machine = machine.machine().describe()
    tapping = run.drafter if run.drafter is not None else run.dspark
    run.target = Target(run.model, tapping.config.target_layer_ids if tapping is not None else ())
    if "zlab" in args.methods:
        run.zlab, run.zlab_missing = load_zlab(args.draft, run.model, not args.no_prepack)
        if run.zlab_missing:
            print(f"zlab {run.zlab_missing}", flush=True)
    return run


def draft_for(run, m):
    """The drafter a method label runs with."""
    return run.dspark if m.partition("@")[0] == "dspark" else run.drafter


def costs_record(costs):
    """A policy.Costs as the results JSON keeps it (report.costs_lines prints it)."""
    return dict(verify={w: round(costs.V(w), 3) for w in COST_WIDTHS}, draft=round(costs.draft, 3),
                draft_tree=round(costs.draft_tree, 3), one_token_forward_ms=round(costs.ms_per_token, 2),
                steady=costs.steady,
                batches={b: dict(verify={w: round(costs.V(w, b), 3) for w in (1, 2, 4, 8)}, draft=round(costs.D(b), 3))
                         for b in COST_BATCHES if b > 1})


def warm_up(run, args):
    """This machine's costs for each drafter under --policy auto, measured (or read) and printed before any
    timing; then an untimed decode by every method at each concurrency (a peer: of one prompt), so one-time costs
    (allocator, kernels, compilation) are billed to no one. Compiled runs warm up at the real length: static cache
    shapes depend on it."""
    if args.policy == "auto":
        drafters = {"dflash2": run.drafter, "dspark": run.dspark}
        args.costs = {name: costs_record(policy.machine_costs(run.target, d))
                      for name, d in drafters.items() if d is not None}
        for line in report.costs_lines(vars(args)):
            print(line, flush=True)
    prompts = next(iter(run.prompts.values()))
    for m in args.methods:
        if m in PEERS:
            if not (m == "zlab" and run.zlab is None):
                run_peer(run.model, m, prompts[:1], args, run.stop_ids, f"warm-up {m}", zlab=run.zlab,
                         max_new_tokens=8)
            continue
        for c in args.concurrency:  # a batch of each size: the first one's memory is not billed to a cell's first turn
            generate(run.target, draft_for(run, m), prompts[:c],
                     method_settings(m, args, max_new_tokens=args.max_new_tokens if args.compile else 8, max_batch=c))


def measure(run, args, m, c, batch, desc):
    """One method's decode of `batch` at concurrency c: (results, wall seconds, phase timings with --profile)."""
    timings = {} if args.profile else None
    if m in PEERS:
        results, wall = run_peer(run.model, m, batch, args, run.stop_ids, desc, timings, run.zlab)
    else:
        results, wall = run_method(run.target, draft_for(run, m), batch, m, c, args, run.stop_ids, desc, timings)
    return results, wall, timings


def take_turns(run, args, task, c, methods, first=0):
    """The methods' decodes of one task at concurrency c: --rounds rounds, the methods in turn with the first one
    rotating each round (with --interleave wave by wave, rotating from wave to wave too) from methods[first] (cells
    start from the next method each), so the machine's drift and any cost of going first fall on all of them.
    Returns {method: {results (each unit's first), tokens, walls (each unit's, summed over the rounds), timings}};
    a unit is the task's prompts (continuous batching), or with --interleave a wave: c of them decoded as one
    batch, which shrinks as its requests end. With --lockstep our methods decode a unit at once (in_lockstep)."""
    prompts = run.prompts[task]
    units = [prompts[i:i + c] for i in range(0, len(prompts), c)] if args.interleave else [prompts]
    done = {m: dict(results=[None] * len(units), tokens=[0] * len(units), walls=[0.0] * len(units),
                    timings={} if args.profile else None) for m in methods}
    for rnd in range(args.rounds if methods else 0):
        for i, batch in enumerate(units):
            k = (first + i + rnd) % len(methods)
            order = methods[k:] + methods[:k]
            where = f" wave {i + 1}" if args.interleave else ""
            ours = [m for m in order if m not in PEERS] if args.lockstep else []
            together = in_lockstep(run, args, ours, c, batch, f"{task} c={c} round {rnd + 1}{where}") if ours else {}
            for m in order:
                results, wall, timings = together.get(m) or measure(run, args, m, c, batch,
                                                                    f"{task} {m} c={c} round {rnd + 1}{where}")
                d = done[m]
                seen = d["results"][i]
                if seen is not None and args.temperature == 0 and [r.tokens for r in seen] != [r.tokens for r in results]:
                    raise SystemExit(f"{m} decoded {task}{where} differently in round {rnd + 1}")
                d["results"][i] = seen or results
                d["tokens"][i] += sum(len(r.tokens) for r in results)
                d["walls"][i] += wall
                for key, v in (timings or {}).items():
                    d["timings"][key] = d["timings"].get(key, 0.0) + v
    return done


def cells(run, args):
    """Every cell of the run, per sampling, task and concurrency, its methods taking turns (take_turns): the
    results JSON's rows, and each cell's outputs {(temperature, top_p, task, method, c): token lists}."""
    rows, outputs, turn = [], {}, 0
    for temperature, top_p in args.samplings:
        args.temperature, args.top_p = temperature, top_p  # what method_settings and run_peer read
        for task in args.tasks:
            for c in args.concurrency:
                group = []
                for m in args.methods:
                    why = (run.zlab_missing if m == "zlab" else None) or cannot_run(m, c)
                    rows.append(dict(task=task, method=m, concurrency=c, temperature=temperature, top_p=top_p,
                                     num_prompts=len(run.prompts[task]), acceptance_length=None, throughput_tok_s=None,
                                     speedup_vs_ar=None, speedup_vs_hf=None, completion_tokens=None, wall_s=None,
                                     identical_to_ar=None, cannot_run=why))
                    if why is None:
                        group.append(rows[-1])
                turns = take_turns(run, args, task, c, [r["method"] for r in group], first=turn)
                turn += 1
                for row in group:
                    d = turns[row["method"]]
                    results = [r for unit in d["results"] for r in unit]
                    tokens, wall = sum(d["tokens"]), sum(d["walls"])
                    outputs[cell_key(row)] = [r.tokens for r in results]
                    row.update(acceptance_length=mean_tau(results), throughput_tok_s=tokens / wall,
                               completion_tokens=sum(len(r.tokens) for r in results), wall_s=wall)
                    if args.rounds > 1 or args.interleave:
                        row["rounds"] = args.rounds
                    if args.lockstep:
                        row["lockstep"] = True
                    if args.interleave:
                        row["wave_tok_s"] = [t / w for t, w in zip(d["tokens"], d["walls"])]
                    if row["method"] not in PEERS and row["method"] != "ar":
                        row["widths"] = width_shares(results)
                    if d["timings"] is not None:
                        row["step_ms"] = step_ms(results, {k: v / args.rounds for k, v in d["timings"].items()})
    return rows, outputs


def cell_key(row, method=None):
    return row["temperature"], row["top_p"], row["task"], method or row["method"], row["concurrency"]


def compare(rows, outputs):
    """Each measured row's speedup over ar and over hf in its cell, and, greedy, whether its output is ar's:
    lossless drafting, ours or a peer's, must reproduce ar's output for the same prompts and concurrency."""
    measured = {cell_key(r): r for r in rows if r["cannot_run"] is None}
    for key, r in measured.items():
        ar, hf = measured.get(cell_key(r, "ar")), measured.get(cell_key(r, "hf"))
        if ar is not None:
            r["speedup_vs_ar"] = r["throughput_tok_s"] / ar["throughput_tok_s"]
            if "wave_tok_s" in r:  # --interleave: each wave's speedup, its method and ar timed seconds apart
                r["wave_speedups"] = [a / b for a, b in zip(r["wave_tok_s"], ar["wave_tok_s"])]
            if r["temperature"] == 0:
                r["identical_to_ar"] = outputs[key] == outputs[cell_key(r, "ar")]
        if hf is not None:
            r["speedup_vs_hf"] = r["throughput_tok_s"] / hf["throughput_tok_s"]


def eager_and_compiled(run, args, eager):
    """--alternate: the eager path warmed up too, then the rounds of alternate(); its rows, any difference said."""
    compiled = core_functions(run.target, run.drafter)
    for obj, name, fn in eager:
        setattr(obj, name, fn)
    first = next(iter(run.prompts.values()))[0]
    for m in args.methods:
        generate(run.target, run.drafter, [first], method_settings(m, args, max_new_tokens=8, static=False))
    rows = alternate(run.target, run.drafter, run.prompts, args, run.stop_ids, eager, compiled)
    for r in rows:
        if r["identical_to_ar"] is False:
            print(f"WARNING: round {r['round']} {r['mode']} {r['method']} output differs on {r['task']}", flush=True)
    return rows


def reported(args):
    """--report FILE: the results JSON (cut to --concurrency, if given) and the tables it prints."""
    try:
        data = json.loads(Path(args.report).read_text())
    except (OSError, ValueError) as e:
        raise SystemExit(f"--report {args.report}: not a readable results JSON ({e})") from None
    if args.concurrency is not CONCURRENCY:  # given on the command line
        data = report.only_concurrencies(data, args.concurrency, args.report)
    return data, report.text(data, args.sections)


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.report:
        data, text = reported(args)
        print(text)
        return data
    check_args(args)
    run = load(args)
    eager = core_functions(run.target, run.drafter)
    maybe_compile(run.target, run.drafter, args.compile)
    if args.pld_sweep:
        return pld_sweep(run.model, run.prompts, args, run.stop_ids)
    warm_up(run, args)
    config = dict(vars(args), torch=torch.__version__)
    if args.alternate:
        data = {"config": config, "alternate": eager_and_compiled(run, args, eager)}
        Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
        return data
    rows, outputs = cells(run, args)
    compare(rows, outputs)
    config.update(block_size=args.block_size or (run.drafter.config.block_size if run.drafter else 1))
    if run.zlab is not None:  # their loop needs the drafter in the target's dtype
        config["zlab_draft_dtype"] = str(next(run.zlab[0].parameters()).dtype).removeprefix("torch.")
    data = {"config": config, "results": rows}
    print(report.text(data))
    for r in rows:
        if r["identical_to_ar"] is False:
            print(f"WARNING: {r['method']} greedy output differs from ar on {r['task']} at concurrency "
                  f"{r['concurrency']}: decoding is NOT lossless here", flush=True)
    Path(args.out).write_text(json.dumps(data, indent=2) + "\n")
    if args.plot:
        report.plot(rows, args.tasks, args.methods, args.concurrency, args.plot)
    return data


if __name__ == "__main__":
    main()
