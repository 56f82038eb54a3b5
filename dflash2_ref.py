"""Command line for DFlash 2 speculative decoding, its step trace, and the trace checker.

    python dflash2_ref.py --prompt "What is 7 * 8?"                             # embedded default pair
    python dflash2_ref.py --prompt "..." --baseline --json                      # speed vs plain decoding
    python dflash2_ref.py --prompt "..." --trace run.jsonl                      # record every step
    python dflash2_ref.py --check-trace run.jsonl                               # replay, report divergence

Exit codes: 0 ok, 1 a failure (cannot load, trace diverges), 2 a bad command line or input.
Arguments are parsed and checked before torch is imported, so --help and usage errors answer at once.
The trace format is documented in docs/TRACE.md.
"""
import argparse
import dataclasses
import json
import os
import sys
import traceback
import warnings
from pathlib import Path

from dflash2.settings import (DEFAULT_DRAFT, DEFAULT_DSPARK_DRAFT, DEFAULT_TARGET, DTYPE_NAMES, METHODS, TREE_SCORES,
                              DecodeSettings, HelpFormatter, InputError, LoadError, SettingError, WALKS, drafter_block_size, one_line)


def auto_or_int(text):
    """A width flag: "auto" (the speculation policy chooses) or a number."""
    if text == "auto":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected auto or a whole number, got {text!r}") from None


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr from main(), not argparse's usage dump
        raise InputError(message)


def build_parser():
    p = Parser(description="DFlash 2 speculative decoding (reference implementation).",
               formatter_class=HelpFormatter,
               epilog="Exit codes: 0 ok, 1 failure, 2 bad command line or input. Trace format: docs/TRACE.md.")
    p.add_argument("--prompt", help="user message (sent through the target's chat template)")
    p.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--no-chat-template", action="store_true", help="raw completion of the prompt text")
    p.add_argument("--target", default=DEFAULT_TARGET,
                   help="target model: directory or hub id (default: the embedded SmolLM2-135M-Instruct, %(default)s)")
    p.add_argument("--draft", default=None, help=f"drafter: directory or hub id (default: the embedded {DEFAULT_DRAFT.name}, "
                                                  f"or {DEFAULT_DSPARK_DRAFT.name} with --method dspark)")
    p.add_argument("--method", choices=METHODS, default="dflash2",
                   help="dflash2: selector walk; dflash: per-slot argmax (v1); ar: plain decoding; dflash2-tree: "
                        "verify a tree of the top-K candidates (docs/SPEC.md §9)")
    p.add_argument("--tree-budget", type=auto_or_int, default="auto",
                   help="dflash2-tree: nodes per tree; auto: chosen each step from this machine's measured costs and "
                        "the drafter's law, up to 32 (policy.py)")
    p.add_argument("--tree-scores", choices=TREE_SCORES, default="selector",
                   help="dflash2-tree path scores: selector (the walk's conditional law) or marginal (DDTree's)")
    p.add_argument("--max-new-tokens", type=int, default=256, help="stop after this many new tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1 = off)")
    p.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    p.add_argument("--seed", type=int, default=0, help="seed of every random draw (sampling only)")
    p.add_argument("--walk", choices=WALKS, default="sample",
                   help="at T > 0: sample each draft from the selector's law (the authors' walk), or take its argmax "
                        "with a one-hot q (vLLM's default proposal; also lossless)")
    p.add_argument("--block-size", type=auto_or_int, default="auto",
                   help="anchor + drafts per step, 2..the drafter's (a number fixes every step); auto, the default "
                        "here, in generate and in the bench: each step verifies the drafts the drafter's law expects "
                        "accepted where this machine's measured costs say they pay, up to the drafter's block, or "
                        "decodes plainly when drafting does not pay (policy.py)")
    p.add_argument("--dspark-threshold", type=float, default=0.0,
                   help="--method dspark: verify each row's drafts before the first slot whose confidence head says "
                        "sigma(c_k) < X (DeepSpec's cut; 0 = off, its default); the block is then fixed")
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    p.add_argument("--dtype", choices=DTYPE_NAMES, help="the target's (default: float32 on CPU, bfloat16 elsewhere)")
    p.add_argument("--draft-dtype", choices=DTYPE_NAMES,
                   help="the drafter's (default: its checkpoint's, bfloat16 for the embedded one); it changes "
                        "drafts, hence speed, never the output")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target forward, the drafter and the walk, with static shapes (first call "
                        "compiles); every step then verifies the whole block or tree (--block-size/--tree-budget auto "
                        "would compile one graph per width)")
    p.add_argument("--attn-backend", choices=["sdpa", "flex", "flash"],
                   help="the drafter's attention kernel (default: FA4 on sm90/sm100 when installed, FlexAttention "
                        "on other GPUs, SDPA on CPU)")
    p.add_argument("--no-prepack", action="store_true",
                   help="CPU: keep aten's linears instead of oneDNN with pre-packed weights "
                        "(same results up to rounding, slower verification)")
    p.add_argument("--baseline", action="store_true", help="also decode autoregressively and report the speedup")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    p.add_argument("--trace", metavar="FILE", help="write a JSON Lines trace of every verification step")
    p.add_argument("--check-trace", metavar="FILE", help="replay a trace and report its first divergence")
    p.add_argument("--atol", type=float, default=1e-4, help="--check-trace tolerance for logits, q, uniforms")
    p.add_argument("--debug", action="store_true", help="show tracebacks")
    return p


def parse_args(argv=None):
    args = build_parser().parse_args(argv)
    if args.draft is None:  # each method's embedded drafter
        args.draft = DEFAULT_DSPARK_DRAFT.name if args.method == "dspark" else DEFAULT_DRAFT.name
    return args


# DecodeSettings field -> the flag that sets it (an error names the flag the user typed)
FLAGS = {"method": "--method", "max_new_tokens": "--max-new-tokens", "temperature": "--temperature",
         "top_k": "--top-k", "top_p": "--top-p", "seed": "--seed", "block_size": "--block-size",
         "tree_budget": "--tree-budget", "tree_scores": "--tree-scores", "walk": "--walk",
         "dspark_threshold": "--dspark-threshold"}


def settings_of(args, stop_ids=()):
    """The run's DecodeSettings from the command line, checked (before torch is imported)."""
    tree = args.method == "dflash2-tree"
    # a number fixes every step's width; so does --compile (each width would be one more compiled graph), and
    # DSpark's threshold, a cut of its own
    fixed = (args.tree_budget if tree else args.block_size) != "auto" or args.compile or args.dspark_threshold > 0
    settings = DecodeSettings(method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                              top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=stop_ids,
                              block_size=None if args.block_size == "auto" else args.block_size,
                              tree_budget=None if args.tree_budget == "auto" else args.tree_budget,
                              tree_scores=args.tree_scores, policy="fixed" if fixed else "auto", walk=args.walk,
                              dspark_threshold=args.dspark_threshold)
    return settings.validate()


def as_input_error(e):
    """A SettingError in the flags' words."""
    return InputError(f"{FLAGS.get(e.field, e.field)} {e.message}")


def check_args(args):
    """Reject bad settings with plain Python, before torch is imported or anything is loaded."""
    try:
        settings = settings_of(args)
        if not args.atol >= 0:
            raise InputError(f"--atol must be >= 0, got {args.atol}")
        if args.trace is not None and not os.access(Path(args.trace).resolve().parent, os.W_OK):
            raise InputError(f"--trace {args.trace}: its folder does not exist or is not writable")
        if args.check_trace is None and settings.method != "ar":
            # config.json only; a hub id's is checked after loading
            settings.resolved("cpu", drafter_block_size(args.draft))
    except SettingError as e:
        raise as_input_error(e) from e


def read_prompt(args):
    if args.prompt is not None and args.prompt_file is not None:
        raise InputError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text()
        except OSError as e:
            raise InputError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from e
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise InputError("--prompt (or --prompt-file) is required")
    if not text.strip():
        raise InputError("the prompt is empty")
    return text


def torch_settings(args):
    """(device, dtype) once torch is imported: the device must be usable here."""
    import torch

    from dflash2.kernels import check_attn_backend
    from dflash2.pair import DTYPES

    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except Exception as e:
        raise InputError(f"--device {args.device!r} is not usable here: {one_line(e)}") from e
    if args.attn_backend is not None:
        try:
            check_attn_backend(args.attn_backend, device, compiled=args.compile)
        except ValueError as e:
            raise InputError(f"--attn-backend: {e}") from e
    dtype = DTYPES[args.dtype] if args.dtype else torch.float32 if device.type == "cpu" else torch.bfloat16
    return device, dtype


def decode_settings(args, pair, stops):
    """The run's DecodeSettings, resolved for the loaded drafter and device (what the trace records)."""
    try:
        return settings_of(args, stops).resolved(pair.device.type,
                                                 pair.drafter.config.block_size if pair.drafter else None)
    except SettingError as e:
        raise as_input_error(e) from e


class Stream:
    """on_emit callback: print the new suffix of decode(all tokens) as tokens are committed.

    Decoding the whole list each time keeps multi-token characters and merges right; text is held
    back while it ends in an incomplete UTF-8 sequence or rewrites what was already printed.
    """

    def __init__(self, tok, out):
        self.tok, self.out, self.tokens, self.shown = tok, out, [], ""

    def __call__(self, request, tokens):
        self.tokens.extend(tokens)
        self.show(self.tok.decode(self.tokens, skip_special_tokens=True), final=False)

    def show(self, text, final):
        if text.startswith(self.shown) and (final or not text.endswith("\ufffd")):
            self.out.write(text[len(self.shown):])
            self.out.flush()
            self.shown = text


def quiet_libraries():
    """transformers and the hub warn and draw progress bars on stderr; the CLI keeps stderr for its own lines."""
    warnings.filterwarnings("ignore")
    import huggingface_hub
    import transformers

    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    huggingface_hub.utils.disable_progress_bars()


def decode_main(args):
    text = read_prompt(args)
    quiet_libraries()
    from tqdm import tqdm

    from dflash2 import spec_decode as sd
    from dflash2.machine import emulated, machine
    from dflash2.results import width_shares
    from dflash2.pair import DTYPES, load_pair, open_pair, stop_token_ids
    from dflash2.prompts import encode_prompt
    from dflash2.proposers import proposer_kind
    from dflash2.trace import run

    device, dtype = torch_settings(args)
    draft_dtype = DTYPES[args.draft_dtype] if args.draft_dtype else None
    # the drafter, the target's config.json and its tokenizer first: a bad drafter or a prompt too long for the
    # target is refused before the target's weights load, the slow part of start-up
    opened = open_pair(args.target, args.draft, needs_draft=args.method != "ar")
    prompt = encode_prompt(opened.tokenizer, text, args.system, chat=not args.no_chat_template)
    try:
        early = settings_of(args).resolved(device.type, opened.draft_config and opened.draft_config.block_size)
        sd.check_prompt_length([prompt], early, proposer_kind(early.method), opened.context_length)
    except SettingError as e:
        raise as_input_error(e) from e
    pair = load_pair(device=device, dtype=dtype, draft_dtype=draft_dtype, prepack=not args.no_prepack,
                     attn_backend=args.attn_backend, opened=opened)
    if not args.json and args.draft_dtype and emulated(device, draft_dtype):
        print(f"note: --draft-dtype {args.draft_dtype}: {pair.draft_dtype_reason}", file=sys.stderr)
    settings = decode_settings(args, pair, stop_token_ids(pair.target.model, pair.tokenizer))
    try:  # every input of generate (the prompt's length too) is checked before the costs are read or measured
        sd.check_generate_args(pair.target, pair.drafter, [prompt], settings, None)
    except SettingError as e:
        raise as_input_error(e) from e
    if args.compile:  # compile at the edge; the loop itself stays plain Python
        sd.compile_core(pair.target, pair.drafter)
        settings = dataclasses.replace(settings, static=True)

    if settings.policy == "auto":  # this machine's costs, measured once (cached), before anything is timed
        from dflash2.policy import cost_key, machine_costs
        from dflash2.settings import cache_dir

        if not args.json and cost_key(pair.target, pair.drafter) not in costs_file_keys(cache_dir() / "costs.json"):
            print("[policy] measuring this machine's verify and draft costs once (a few seconds; cached in "
                  f"{cache_dir() / 'costs.json'})", file=sys.stderr)
        costs = machine_costs(pair.target, pair.drafter)
        if not costs.steady and not args.json:
            print("[policy] note: this machine's timings were unsteady while measuring (is it busy?); the costs serve "
                  "this run only and are measured again next time", file=sys.stderr)
    stream = None if args.json else Stream(pair.tokenizer, sys.stdout)
    (res,), seconds, ttft = run(pair, [prompt], settings, on_emit=stream, trace_path=args.trace)
    text_out = pair.tokenizer.decode(res.tokens, skip_special_tokens=True)
    report = dict(text=text_out, method=args.method, completion_tokens=len(res.tokens),
                  verify_steps=res.verify_steps, acceptance_length=res.acceptance_length,
                  tokens_per_s=len(res.tokens) / seconds, prefill_ms=ttft * 1000,
                  target=pair.target_id, draft=pair.draft_id, dtype=dtype_name(pair.dtype),
                  draft_dtype=None if pair.drafter is None else dtype_name(next(pair.drafter.parameters()).dtype),
                  draft_dtype_reason=pair.draft_dtype_reason, machine=machine().describe(),
                  policy=settings.policy, widths=width_shares([res]))
    if stream is not None:
        stream.show(text_out, final=True)
        print(flush=True)
        print(stats_line(report), file=sys.stderr)

    if args.baseline:
        if stream is not None:  # --json keeps stderr silent
            print(f"[ar] decoding the same prompt autoregressively for the speedup (up to {args.max_new_tokens} "
                  "tokens) ...", file=sys.stderr)
        with tqdm(total=args.max_new_tokens, desc="ar baseline", unit="tok", file=sys.stderr, leave=False,
                  disable=stream is None or not sys.stderr.isatty()) as bar:  # a log gets the summary line only
            ar_settings = dataclasses.replace(settings, method="ar", block_size=None, tree_budget=None)
            (ar,), ar_seconds, _ = run(pair, [prompt], ar_settings,
                                       on_emit=lambda request, tokens: bar.update(len(tokens)))
        report.update(ar_text=pair.tokenizer.decode(ar.tokens, skip_special_tokens=True),
                      ar_tokens_per_s=len(ar.tokens) / ar_seconds,
                      speedup=(len(res.tokens) / seconds) / (len(ar.tokens) / ar_seconds),
                      identical=ar.tokens == res.tokens if args.temperature == 0 else None)
        if stream is not None:
            same = {True: "identical", False: "DIFFERENT", None: "not compared (sampling)"}[report["identical"]]
            print(f"[ar] {report['ar_tokens_per_s']:.1f} tok/s; speedup {report['speedup']:.2f}x; "
                  f"outputs {same}", file=sys.stderr)
    if args.json:
        print(json.dumps(report))
    return 0


def stats_line(report):
    """The stderr summary; its names are the JSON report's keys."""
    tau = report["acceptance_length"]  # None when the prefill's token ended the request
    line = (f"[{report['method']}] completion_tokens {report['completion_tokens']}, "
            f"verify_steps {report['verify_steps']}, acceptance_length {'n/a' if tau is None else f'{tau:.2f}'}, "
            f"tokens_per_s {report['tokens_per_s']:.1f}, prefill_ms {report['prefill_ms']:.0f}")
    if report.get("draft_dtype"):
        line += f"\n[{report['method']}] draft_dtype {report['draft_dtype']} ({report['draft_dtype_reason']}); {report['machine']}"
    if report.get("policy") == "auto":
        shares = ", ".join(f"{w}: {s:.2f}" for w, s in report["widths"].items())
        line += f"\n[{report['method']}] policy auto; verified block per step (1 = plain), share of steps: {shares}"
    return line


def costs_file_keys(path):
    """The cost keys a costs cache file holds (none if it is missing or unreadable)."""
    try:
        return {v.get("key") for v in json.loads(path.read_text()).values()}
    except (OSError, ValueError, AttributeError):
        return set()


def dtype_name(dtype):
    return str(dtype).removeprefix("torch.")


def check_trace_main(args):
    quiet_libraries()
    from dflash2.trace import check_trace

    device, _ = torch_settings(args)
    agree, line = check_trace(args.check_trace, args.target if args.target != DEFAULT_TARGET else None,
                              args.draft if args.draft != DEFAULT_DRAFT.name else None, device, args.atol)
    print(line)
    return 0 if agree else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        args = parse_args(argv)
        check_args(args)
        return check_trace_main(args) if args.check_trace else decode_main(args)
    except (InputError, LoadError) as e:
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return 2 if isinstance(e, InputError) else 1
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(f"error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
