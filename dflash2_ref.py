"""Command line for DFlash 2 speculative decoding, its step trace, and the trace checker.

    python dflash2_ref.py --prompt "How many clips did Natalia sell?"          # embedded default pair
    python dflash2_ref.py --prompt "..." --baseline --json                      # speed vs plain decoding
    python dflash2_ref.py --prompt "..." --trace run.jsonl                      # record every step
    python dflash2_ref.py --check-trace run.jsonl                               # replay, report divergence

Exit codes: 0 ok, 1 a failure (cannot load, trace diverges), 2 a bad command line or input.
The trace format is documented in docs/TRACE.md.
"""
import argparse
import hashlib
import json
import sys
import time
import traceback
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

import model
import spec_decode as sd
from kernels import prepack_linears

TRACE_FORMAT = "dflash2-trace/1"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class UsageError(Exception):
    """The command line or the input is wrong: exit 2."""
    code = 2


class Failure(Exception):
    """Something could not be loaded or run: exit 1."""
    code = 1


class Parser(argparse.ArgumentParser):
    def error(self, message):  # one line on stderr from main(), not argparse's usage dump
        raise UsageError(message)


def parse_args(argv=None):
    p = Parser(description="DFlash 2 speculative decoding (reference implementation).",
               epilog="Exit codes: 0 ok, 1 failure, 2 bad command line or input. Trace format: docs/TRACE.md.")
    p.add_argument("--prompt", help="user message (sent through the target's chat template)")
    p.add_argument("--prompt-file", help="read the prompt from this file ('-' for stdin)")
    p.add_argument("--system", help="system message for the chat template")
    p.add_argument("--no-chat-template", action="store_true", help="raw completion of the prompt text")
    p.add_argument("--target", help="target model: directory or hub id (default: embedded SmolLM2-135M-Instruct)")
    p.add_argument("--draft", help=f"drafter: directory or hub id (default: {model.DEFAULT_DRAFT.name})")
    p.add_argument("--method", choices=sd.METHODS, default="dflash2")
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0, help="0 = off")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, help="anchor + drafts per step, <= the drafter's (default: the drafter's)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=DTYPES, help="the target's: default float32 on CPU, bfloat16 elsewhere")
    p.add_argument("--draft-dtype", choices=DTYPES,
                   help="the drafter's (default: its checkpoint's, bfloat16 for the embedded one); it changes "
                        "drafts, hence speed, never the output")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the target forward, the drafter and the walk, with static shapes (first call compiles)")
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
    return p.parse_args(argv)


def check_args(args):
    """Reject bad settings before anything is loaded; returns (device, dtype)."""
    try:
        sd.check_sampling_params(args.temperature, args.top_p, args.top_k)
    except ValueError as e:
        raise UsageError(str(e).replace("temperature", "--temperature").replace("top_p", "--top-p")
                         .replace("top_k", "--top-k")) from e
    if args.max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.block_size is not None and args.block_size < 2:
        raise UsageError(f"--block-size must be >= 2 (anchor + at least one draft), got {args.block_size}")
    if not args.atol >= 0:
        raise UsageError(f"--atol must be >= 0, got {args.atol}")
    try:
        device = torch.device(args.device)
        torch.empty(0, device=device)
    except Exception as e:
        raise UsageError(f"--device {args.device!r} is not usable here: {one_line(e)}") from e
    if getattr(args, "attn_backend", None) is not None:
        try:
            model.check_attn_backend(args.attn_backend, device, compiled=args.compile)
        except ValueError as e:
            raise UsageError(f"--attn-backend: {e}") from e
    dtype = DTYPES[args.dtype] if args.dtype else torch.float32 if device.type == "cpu" else torch.bfloat16
    return device, dtype


def read_prompt(args):
    if args.prompt is not None and args.prompt_file is not None:
        raise UsageError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        try:
            text = sys.stdin.read() if args.prompt_file == "-" else Path(args.prompt_file).read_text()
        except OSError as e:
            raise UsageError(f"--prompt-file {args.prompt_file}: {e.strerror or e}") from e
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise UsageError("--prompt (or --prompt-file) is required")
    if not text.strip():
        raise UsageError("the prompt is empty")
    return text


# --- loading: the target, its tokenizer, the drafter, and where their files are ---


@dataclass
class Pair:
    model: object  # the transformers causal LM
    tokenizer: object
    drafter: model.DFlash2Drafter | None
    target: sd.Target
    target_id: str
    target_dir: Path
    draft_id: str | None
    draft_dir: Path | None
    dtype: torch.dtype
    device: torch.device
    prepacked: bool = False


def resolve_target(name):
    """(id as recorded in traces, local directory) of the embedded default, a directory or a hub id."""
    if name in (None, model.DEFAULT_TARGET):
        try:
            return model.DEFAULT_TARGET, model._smollm2_safetensors()
        except Exception as e:
            raise Failure(f"cannot prepare the embedded target: {one_line(e)}") from e
    path = Path(name).expanduser()
    if path.is_dir():
        return name, path
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise Failure(f"--target {name}: no such model directory (and not a hub id)")
    try:
        from huggingface_hub import snapshot_download

        patterns = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt"]
        return name, Path(snapshot_download(name, allow_patterns=patterns))
    except Exception as e:
        raise Failure(f"--target {name}: cannot fetch from the Hugging Face Hub (offline, or not a repo?): "
                      f"{one_line(e)}") from e


def resolve_draft(name):
    """(id as recorded in traces, local directory) of the embedded drafter, a directory or a hub id."""
    if name in (None, model.DEFAULT_DRAFT.name):
        if not model.DEFAULT_DRAFT.is_dir():
            raise Failure(f"no embedded drafter yet ({model.DEFAULT_DRAFT} does not exist): "
                          "pass --draft PATH|HUB_ID, or --method ar")
        return model.DEFAULT_DRAFT.name, model.DEFAULT_DRAFT
    try:
        return name, model._resolve_checkpoint(name)
    except (OSError, FileNotFoundError) as e:
        raise Failure(f"--draft: {one_line(e)}") from e


def load_pair(target_name, draft_name, device, dtype, needs_draft=True, draft_dtype=None, prepack=True,
              attn_backend=None):
    """Load the target (+ tokenizer) and, unless decoding autoregressively, the drafter; check they fit."""
    # Resolve both before loading either, so a missing drafter fails before the slow target load.
    draft_id, draft_dir = resolve_draft(draft_name) if needs_draft else (None, None)
    target_id, target_dir = resolve_target(target_name)
    try:
        lm, tok = model.load_target(str(target_dir), device, dtype, prepack=prepack)
    except Exception as e:
        raise Failure(f"cannot load target {target_id}: {one_line(e)}") from e
    drafter = None
    if needs_draft:
        try:
            drafter = model.DFlash2Drafter.from_pretrained(draft_dir, device=device, dtype=draft_dtype,
                                                           attn_backend=attn_backend)
        except Exception as e:  # CheckpointError, bad JSON, unreadable safetensors
            raise Failure(f"cannot load drafter {draft_id}: {one_line(e)}") from e
        check_pair(lm, drafter)
        if prepack:
            prepack_linears(drafter)
    target = sd.Target(lm, drafter.config.target_layer_ids if drafter is not None else ())
    return Pair(lm, tok, drafter, target, target_id, target_dir, draft_id, draft_dir, dtype, device, target.prepacked)


def check_pair(lm, drafter):
    """The drafter reuses the target's embedding and LM head and reads its layers: shapes must agree."""
    cfg = getattr(lm.config, "text_config", lm.config)
    dc = drafter.config
    rows = lm.get_output_embeddings().weight.shape[0]
    if dc.hidden_size != cfg.hidden_size:
        raise UsageError(f"drafter hidden_size {dc.hidden_size} does not match the target's {cfg.hidden_size}")
    if dc.vocab_size != rows:
        raise UsageError(f"drafter vocab_size {dc.vocab_size} does not match the target's LM head ({rows} rows)")
    bad = [i for i in dc.target_layer_ids if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise UsageError(f"drafter target_layer_ids {bad} do not exist in a target with "
                         f"{cfg.num_hidden_layers} layers")


def encode_prompt(tok, text, system=None, chat=True):
    """Token ids of one user turn through the chat template with the generation prompt, or of raw text."""
    if not chat:
        return tok(text)["input_ids"]
    if not tok.chat_template:
        raise UsageError("the target's tokenizer has no chat template; pass --no-chat-template")
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": text}]
    rendered = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return tok(rendered, add_special_tokens=False)["input_ids"]


def decode_settings(args, pair, stops):
    """generate() keyword arguments; the block size resolved so that traces record what actually ran."""
    block = None
    if args.method != "ar":
        block = args.block_size or pair.drafter.config.block_size
        if block > pair.drafter.config.block_size:
            raise UsageError(f"--block-size {block} is larger than the drafter's block size "
                             f"{pair.drafter.config.block_size}")
    return dict(method=args.method, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                top_k=args.top_k, top_p=args.top_p, seed=args.seed, stop_ids=stops, block_size=block)


# --- decoding, streaming and the trace ---


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


def run(pair, prompts, settings, on_emit=None, trace_path=None):
    """Decode prompts (lists of ids) in one batch. Returns (results, seconds, seconds to first token)."""
    first = []

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
            results = sd.generate(pair.target, pair.drafter, prompts, on_emit=emit, trace=trace, **settings)
        except ValueError as e:  # generate checks its inputs first: prompt too long, bad block size
            raise UsageError(one_line(e)) from e
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
                prepacked=pair.prepacked, **settings,
                prompts=[list(p) for p in prompts])


def floats(t):
    """Nested lists of a float tensor, 9 significant digits: enough to round-trip float32 exactly."""
    return [floats(x) for x in t] if t.dim() else float(f"{t.item():.9g}")


def step_records(rec):
    """Split one generate() trace record (tensors batched over the live rows) into per-request dicts."""
    n_acc = rec["num_accepted"].tolist()
    drafts = rec["drafts"].cpu()
    cands = None if rec["candidates"] is None else [t.cpu() for t in rec["candidates"]]
    sampled = rec["u_accept"] is not None
    q = rec["q"].float().cpu() if sampled else None
    argmax, out = rec["target_argmax"].tolist(), rec["out"].tolist()
    records = []
    for r, request in enumerate(rec["requests"]):
        records.append(dict(
            type="step", request=request, step=rec["steps"][r], anchor_pos=rec["anchor_pos"][r],
            context_len=rec["anchor_pos"][r],  # the drafter attends to every position before its anchor
            anchor=rec["anchor"][r], drafts=drafts[r].tolist(),
            candidates=None if cands is None else cands[0][r].tolist(),
            cand_logits=None if cands is None else floats(cands[1][r].float()),
            q=None if q is None or cands is None else floats(q[r].gather(-1, cands[0][r])),
            q_draft=None if q is None else floats(q[r].gather(-1, drafts[r][:, None]).squeeze(-1)),
            target_argmax=argmax[r],
            u_accept=floats(rec["u_accept"][r].cpu()) if sampled else None,
            u_emit=floats(rec["u_emit"][r].cpu()) if sampled else None,
            num_accepted=n_acc[r], out=out[r][: n_acc[r] + 1]))
    return records


def result_record(request, res):
    return dict(type="result", request=request, tokens=res.tokens, verify_steps=res.verify_steps,
                finished_by_stop=res.finished_by_stop)


# --- check-trace: replay a trace through this reference and find where they part ---

FLOAT_FIELDS = ("cand_logits", "q", "q_draft", "u_accept", "u_emit")
SLOT_FIELDS = ("drafts", "candidates", "cand_logits", "q", "q_draft", "u_accept")  # index j is draft slot j+1
STEP_FIELDS = ("anchor_pos", "context_len", "anchor", "candidates", "cand_logits", "drafts", "q", "q_draft",
               "target_argmax", "u_accept", "u_emit", "num_accepted", "out")


def read_trace(path):
    try:
        lines = Path(path).read_text().splitlines()
        records = [json.loads(line) for line in lines if line.strip()]
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UsageError(f"--check-trace {path}: not a readable JSON Lines trace ({one_line(e)})") from e
    if not records or records[0].get("type") != "config" or records[0].get("format") != TRACE_FORMAT:
        raise UsageError(f"--check-trace {path}: the first line is not a {TRACE_FORMAT} config record")
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
    index = "".join(f"[{i}]" for i in path)
    line = f"{where} field {field}{index}: reference {ref} vs trace {got}"
    if field in FLOAT_FIELDS and isinstance(ref, (int, float)) and isinstance(got, (int, float)):
        line += f" (|diff| {abs(ref - got):.3g} > atol {atol:g})"
    return line


def compare_traces(ref_records, trace_records, atol):
    """The first divergence between a replayed trace and a recorded one, as one line, or None."""
    ref_steps = {(r["request"], r["step"]): r for r in ref_records if r["type"] == "step"}
    seen = set()
    for rec in trace_records:
        if rec.get("type") != "step":
            continue
        key = (rec["request"], rec["step"])
        seen.add(key)
        if key not in ref_steps:
            return f"request {key[0]} step {key[1]}: the trace has this step, the reference finished before it"
        for field in STEP_FIELDS:
            tol = atol if field in FLOAT_FIELDS else 0
            diff = first_difference(ref_steps[key].get(field), rec.get(field), tol)
            if diff is not None:
                return describe(*key, field, *diff, atol)
    for key in sorted(set(ref_steps) - seen):
        return f"request {key[0]} step {key[1]}: the reference has this step, the trace ends before it"
    ref_results = {r["request"]: r for r in ref_records if r["type"] == "result"}
    for rec in trace_records:
        if rec.get("type") == "result":
            for field in ("tokens", "verify_steps", "finished_by_stop"):
                diff = first_difference(ref_results.get(rec["request"], {}).get(field), rec.get(field), 0)
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
    settings = {k: cfg[k] for k in ("method", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
                                     "stop_ids", "block_size")}
    replay = []

    def trace(rec):
        replay.extend(step_records(rec))

    results = sd.generate(pair.target, pair.drafter, cfg["prompts"], trace=trace, **settings)
    replay += [result_record(i, res) for i, res in enumerate(results)]
    divergence = compare_traces(replay, records[1:], atol)
    if divergence is not None:
        return False, f"divergence: {divergence}"
    steps = sum(r["type"] == "step" for r in replay)
    return True, f"agree: {steps} steps of {len(results)} request(s) match (atol {atol:g})"


# --- main: parse -> load -> validate -> run -> report ---


def one_line(e):
    return " ".join(str(e).split()) or type(e).__name__


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
    device, dtype = check_args(args)
    pair = load_pair(args.target, args.draft, device, dtype, needs_draft=args.method != "ar",
                     draft_dtype=DTYPES[args.draft_dtype] if args.draft_dtype else None, prepack=not args.no_prepack,
                     attn_backend=args.attn_backend)
    prompt = encode_prompt(pair.tokenizer, text, args.system, chat=not args.no_chat_template)
    settings = decode_settings(args, pair, model.stop_token_ids(pair.model, pair.tokenizer))
    if args.compile:  # compile at the edge; the loop itself stays plain Python
        sd.compile_core(pair.target, pair.drafter)
        settings["static"] = True

    stream = None if args.json else Stream(pair.tokenizer, sys.stdout)
    (res,), seconds, ttft = run(pair, [prompt], settings, on_emit=stream, trace_path=args.trace)
    text_out = pair.tokenizer.decode(res.tokens, skip_special_tokens=True)
    report = dict(text=text_out, completion_tokens=len(res.tokens), verify_steps=res.verify_steps,
                  acceptance_length=res.acceptance_length, tokens_per_s=len(res.tokens) / seconds,
                  prefill_s=ttft, method=args.method, target=pair.target_id, draft=pair.draft_id)
    if stream is not None:
        stream.show(text_out, final=True)
        print(flush=True)
        print(f"[{args.method}] {len(res.tokens)} tokens, {res.verify_steps} verify steps, "
              f"tau {res.acceptance_length:.2f}, {report['tokens_per_s']:.1f} tok/s, "
              f"prefill {ttft * 1000:.0f} ms", file=sys.stderr)

    if args.baseline:
        (ar,), ar_seconds, _ = run(pair, [prompt], dict(settings, method="ar", block_size=None))
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


def check_trace_main(args):
    device, _ = check_args(args)
    agree, line = check_trace(args.check_trace, args.target, args.draft, device, args.atol)
    print(line)
    return 0 if agree else 1


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    debug = "--debug" in argv
    try:
        quiet_libraries()
        args = parse_args(argv)
        return check_trace_main(args) if args.check_trace else decode_main(args)
    except (UsageError, Failure) as e:
        if debug:
            traceback.print_exc()
        print(f"error: {one_line(e)}", file=sys.stderr)
        return e.code
    except Exception as e:
        if debug:
            traceback.print_exc()
        print(f"error: {type(e).__name__}: {one_line(e)}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
