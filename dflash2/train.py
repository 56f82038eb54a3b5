"""Train a DFlash 2 (or DSpark) drafter for a target model by self-distillation.

    python -m dflash2.train data  --data-dir ../shared/data --out runs/smollm2      # target writes its own responses
    python -m dflash2.train train --out runs/smollm2 --steps 2000                   # fit the drafter on them
    python -m dflash2.train train --out runs/smollm2 --arch dspark --minutes 60     # a DSpark drafter, on a budget
    python -m dflash2.train run --minutes 10 --out runs/gpu --device cuda           # the whole recipe in 10 minutes

Data: the target answers training prompts, greedily or sampled (`data --temperature`); we keep the token ids and,
on a CPU, the target's tapped hidden states (the drafter's context features), so training never runs the target
again; without them (`data --no-features`, and `run`) training recomputes the features from the frozen target on
the fly, as a GPU does faster than it could read them. Loss (SPEC §6): position-decayed cross-entropy over the
draft slots plus the selector's cross-entropy over its K candidates; `--arch dspark` trains DSpark with DeepSpec's
loss instead (fit.dspark_loss, docs/DSPARK.md). The prompts come from prompts.py (`training_prompts`).
"""
import argparse
import itertools
import json
import os
import random
import time
from pathlib import Path

import torch

from .checkpoint import spread_target_layer_ids
from .distill import (check_device, ddp_teardown, generate_with_features, generation_dtype, make_data, make_prompts,
                      save_shard, self_instruct, usage_error)
from .dspark import DSparkDrafter
from .fit import train
from .model import DFlash2Drafter
from .pair import load_target, stop_token_ids
from .prompts import PROMPT_SOURCES, encode_prompt, format_prompt, load_tasks, training_prompts
from .settings import DEFAULT_TARGET, DTYPE_NAMES, HelpFormatter
from .results import mean_tau
from .spec_decode import generate
from .target import Target


RUN_PHASES = {"prompts": 0.10, "responses": 0.50, "train": 0.85, "tau": 1.00}  # each ends at this share (RUN_RULE)
RUN_RULE = """The budget is split by a fixed rule: self-instruct prompts until 10% of it has passed (loading included),
responses until 50%, training until 85%, tau in the rest; a phase that ends early (every prompt answered, say)
leaves its time to the next. Responses: the prompts shuffled, in batches taking turns greedy and T = 1 (top-p 0.95);
once every prompt is answered, a second pass with the other setting. On CUDA the target's features are computed at each
training step (no feature shards); the drafter is written every --save-minutes, so a run cut short leaves one."""


def measure_tau(model, tok, drafter, data_dir, deadline, max_new_tokens=128):
    """τ as bench.py measures it (greedy, one prompt at a time, mean over prompts of tokens per verify step) on
    chat-heldout and GSM8K, the two tasks taking turns until the deadline; at least one prompt each."""
    tasks = load_tasks(("chat-heldout", "gsm8k"), data_dir, 100)
    method = "dspark" if isinstance(drafter, DSparkDrafter) else "dflash2"
    target, stops = Target(model, drafter.config.target_layer_ids), stop_token_ids(model, tok)
    results, took = {task: [] for task in tasks}, 0.0
    for i, task in itertools.product(range(100), tasks):
        if i and time.monotonic() + took > deadline:  # the next prompt would end past the deadline
            break
        start = time.monotonic()
        ids = encode_prompt(tok, format_prompt(task, tasks[task][i]))
        results[task] += generate(target, drafter, [ids], method=method, max_new_tokens=max_new_tokens, stop_ids=stops)
        took = time.monotonic() - start
    return {t: {"tau": mean_tau(r), "prompts": len(r)} for t, r in results.items()}


def run(args):
    """The whole recipe under a wall-clock budget: prompts, responses, training, tau (RUN_RULE)."""
    t0 = time.monotonic()
    end = {phase: t0 + share * args.minutes * 60 for phase, share in RUN_PHASES.items()}
    device = check_device(args.device)
    out = Path(args.out)
    if not args.minutes > 0:
        usage_error(f"--minutes must be > 0, got {args.minutes}")
    if any((out / "data").glob("shard_*")):
        usage_error(f"--out {out} already holds a run's data; name a new folder")
    if int(os.environ.get("WORLD_SIZE", 1)) > 1:
        usage_error("run is one process: under torchrun use `data` and `train`")
    (out / "data").mkdir(parents=True, exist_ok=True)
    report = {"minutes": args.minutes, "device": str(device), "target": args.target or DEFAULT_TARGET, "init": args.init,
              "arch": args.arch}
    kind = DSparkDrafter if args.arch == "dspark" else DFlash2Drafter

    def say(phase, text):
        left = max(0.0, end["tau"] - time.monotonic())
        report[phase] = text
        print(f"[run] {phase}: {text}; {int(left // 60)}m{left % 60:04.1f}s left", flush=True)

    torch.set_num_threads(args.threads)
    batch_size = args.batch_size or (512 if device.type == "cuda" else 16)
    model, tok = load_target(args.target, device=device, dtype=generation_dtype(None, device))
    n_layers = model.config.num_hidden_layers
    taps = (kind.from_pretrained(args.init).config.target_layer_ids if args.init
            else sorted(set(spread_target_layer_ids(n_layers, min(5, n_layers)))))
    say("load", f"target {report['target']} ({n_layers} layers) on {device}, taps {taps}")

    # 1. prompts: the sources, plus questions the target writes (evaluation text filtered out)
    prompts = training_prompts(args.data_dir, sources=[s for s in args.sources.split(",") if s], seed=args.seed)
    asked, usable, questions = self_instruct(model, tok, args.self_instruct, args.data_dir, batch_size, args.seed,
                                             deadline=end["prompts"])
    (out / "self_instruct.jsonl").write_text("".join(json.dumps({"prompt": q}) + "\n" for q in questions))
    prompts += questions
    random.Random(args.seed).shuffle(prompts)
    say("prompts", f"{len(prompts) - len(questions)} from {args.sources} + {len(questions)} self-instruct "
                   f"({asked} asked, {usable} usable)")

    # 2. responses: greedy and T = 1 batches in turn (RUN_RULE); features stored on a CPU, else recomputed in training
    features = args.features if args.features is not None else device.type == "cpu"
    last_hidden = features and args.arch == "dspark"  # the target's final hidden state: p in DSpark's loss
    encoded = [encode_prompt(tok, p) for p in prompts]
    stop, pad = set(stop_token_ids(model, tok)), tok.pad_token_id if tok.pad_token_id is not None else 0
    (out / "data" / "meta.json").write_text(json.dumps({"target": args.target, "taps": taps, "features": features,
                                                       "last_hidden": last_hidden, "max_new_tokens": args.max_new_tokens,
                                                       "top_p": 0.95}))
    batches = [range(i, min(i + batch_size, len(encoded))) for i in range(0, len(encoded), batch_size)]
    counts, tokens = {0.0: 0, 1.0: 0}, 0
    for k, (second, (j, idx)) in enumerate(itertools.product((0, 1), enumerate(batches))):
        if k and time.monotonic() > end["responses"]:
            break
        temperature = float((j + second) % 2)
        gen = torch.Generator(device).manual_seed(args.seed * 1_000_003 + k)
        rows = generate_with_features(model, [encoded[i] for i in idx], taps if features else [], args.max_new_tokens,
                                      stop, pad, temperature, 0.95 if temperature else 1.0, gen, end["responses"],
                                      last_hidden=last_hidden)
        save_shard(out / "data" / f"shard_{k:05d}.pt", rows, [len(encoded[i]) for i in idx])
        counts[temperature] += len(rows)
        tokens += sum(len(r[0]) - len(encoded[i]) for r, i in zip(rows, idx))
    say("responses", f"{sum(counts.values())} ({counts[0.0]} greedy, {counts[1.0]} at T = 1), {tokens} tokens")

    # 3. training; the drafter is written every --save-minutes and at the end
    targs = build_parser().parse_args(["train", "--out", str(out), "--arch", args.arch, "--seed", str(args.seed),
                                       "--threads", str(args.threads), "--warmup", "20", "--save-every", str(10**9),
                                       "--anchors", "16", "--batch-seqs",
                                       str(args.batch_seqs or (128 if device.type == "cuda" else 8))])
    targs.init, targs.device, targs.deadline, targs.save_minutes = args.init, str(device), end["train"], args.save_minutes
    _, history = train(targs, target=model)
    last = history[-50:]
    say("train", f"{len(history)} steps, last {len(last)}: draft CE {sum(h['ce'] for h in last) / len(last):.3f}, "
                 f"slot-1 accuracy {sum(h['acc'][0] for h in last) / len(last):.3f}; drafter in {out / 'drafter'}")

    # 4. tau of the written drafter, loaded back from its files
    drafter = kind.from_pretrained(out / "drafter", device=device, attn_backend="sdpa")
    tau = measure_tau(model, tok, drafter, args.data_dir, end["tau"])
    report["tau_by_task"] = tau
    say("tau", ", ".join(f"{t} {r['tau']:.2f} ({r['prompts']} prompts)" for t, r in tau.items()))
    report["wall_s"] = round(time.monotonic() - t0, 1)
    (out / "run.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def plot_history(history, path, window=50, before=()):
    """Loss and per-slot top-1 accuracy over training (moving averages), saved as an image.

    before: the histories of the runs this one continues (`train --init`), oldest first, drawn first;
    a dotted line marks where each later run begins.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def smooth(xs):
        return [sum(xs[max(0, i - window + 1) : i + 1]) / len(xs[max(0, i - window + 1) : i + 1]) for i in range(len(xs))]

    joined, starts = [], []
    for run in list(before) + [history]:
        offset = joined[-1]["step"] if joined else 0
        if joined:
            starts.append(offset)
        joined += [dict(h, step=h["step"] + offset) for h in run]
    history = joined
    steps = [h["step"] for h in history]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    ax1.plot(steps, smooth([h["ce"] for h in history]), label="draft CE (position-weighted)")
    for key, label in (("selector_ce", "selector CE"), ("l1", "L1(q, p)"), ("confidence_bce", "confidence BCE")):
        if key in history[0]:  # DFlash 2's selector, or DSpark's other terms
            ax1.plot(steps, smooth([h[key] for h in history]), label=label)
    ax1.set_xlabel("step")
    ax1.set_ylabel("loss")
    ax1.set_yscale("log")
    ax1.legend()
    for k in range(len(history[0]["acc"])):
        ax2.plot(steps, smooth([h["acc"][k] for h in history]), label=f"slot {k + 1}")
    if "selector_acc" in history[0]:
        ax2.plot(steps, smooth([h["selector_acc"] for h in history]), "k--", label="selector (gold in C_t)")
    ax2.set_xlabel("step")
    ax2.set_ylabel("top-1 accuracy")
    for start in starts:
        for ax in (ax1, ax2):
            ax.axvline(start, color="gray", linestyle=":", label="_nolegend_")
    ax2.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)


ARCHS = ("dflash2", "dspark")
ARCH_HELP = ("the drafter to train: dflash2, or dspark (DeepSpec's DSpark: the same backbone and batches, a Markov "
             "head and a confidence head, DeepSpec's loss; written without copies of the target's embedding and LM "
             "head; docs/DSPARK.md)")


def build_parser():
    ap = argparse.ArgumentParser(prog="dflash2-train", description=__doc__, formatter_class=HelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    target_help = "target model: directory or hub id (default: the embedded SmolLM2-135M-Instruct)"
    device_help = "torch device: cpu, or cuda (an error if this machine has none)"
    d = sub.add_parser("data", help="self-distil training data from the target", formatter_class=HelpFormatter)
    d.add_argument("--target", default=None, help=target_help)
    d.add_argument("--data-dir", default="../shared/data", help="local GSM8K/MBPP/... files the prompt sets read")
    d.add_argument("--out", default="runs/smollm2", help="run directory; shards go to OUT/data/")
    d.add_argument("--taps", default="1,8,14,21,27", help="target layers whose hidden states are stored")
    d.add_argument("--max-prompts", type=int, default=4000, help="answer at most this many prompts")
    d.add_argument("--sources", default="gsm8k,mbpp,chat",
                   help=f"prompt sets, comma separated, from {','.join(PROMPT_SOURCES)} (see dflash2/prompts.py)")
    d.add_argument("--prompts-file", action="append", default=[], metavar="JSONL",
                   help="also answer these prompts (from `dflash2.train prompts`); repeatable")
    d.add_argument("--exclude", action="append", default=[], metavar="DIR",
                   help="skip prompts already answered in this earlier data/ folder; repeatable")
    d.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each response")
    d.add_argument("--batch-size", type=int, default=32, help="prompts generated together; one shard each (a GPU: 512)")
    d.add_argument("--device", default="cpu", help=device_help + "; under torchrun each rank writes every n-th shard")
    d.add_argument("--features", action=argparse.BooleanOptionalAction, default=True,
                   help="store the tapped hidden states and the final one (7 KB a token for SmolLM2; the final one "
                        "gives `train --arch dspark` the target's distribution); --no-features keeps token ids "
                        "only and `train` recomputes the features from the target at each step (the GPU way)")
    d.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    d.add_argument("--seed", type=int, default=0, help="prompt shuffle and sampling seed")
    d.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                   help="target dtype for generation (default: bfloat16 where native, ~2x faster there; else float32)")
    d.add_argument("--temperature", type=float, default=0.0,
                   help="0: the target's greedy responses; > 0: sampled ones (e.g. 0.7 or 1.0, as users sample)")
    d.add_argument("--top-p", type=float, default=1.0, help="nucleus for sampled responses (the card uses 0.95)")
    pr = sub.add_parser("prompts", help="have the target write prompts (self-instruct) or follow-ups (multi-turn)",
                        formatter_class=HelpFormatter)
    pr.add_argument("--kind", choices=("self-instruct", "multi-turn"), required=True,
                    help="self-instruct: new user questions; multi-turn: first turn, answer, follow-up")
    pr.add_argument("--out", required=True, metavar="JSONL", help="write the prompts here")
    pr.add_argument("--num", type=int, default=1000, help="questions to ask for / first turns to answer")
    pr.add_argument("--first-turns", default=None, metavar="JSONL", help="multi-turn: first turns from this file")
    pr.add_argument("--answer-tokens", type=int, default=128, help="multi-turn: length cap of the first answer")
    pr.add_argument("--target", default=None, help=target_help)
    pr.add_argument("--data-dir", default="../shared/data", help="evaluation sets to filter generated prompts against")
    pr.add_argument("--batch-size", type=int, default=48, help="requests generated together (a GPU: 512)")
    pr.add_argument("--device", default="cpu", help=device_help)
    pr.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    pr.add_argument("--seed", type=int, default=0, help="topic/kind draw and sampling seed")
    pr.add_argument("--dtype", default=None, choices=DTYPE_NAMES,
                    help="target dtype for generation (default: bfloat16 where native, else float32)")
    t = sub.add_parser("train", help="fit a drafter on the self-distilled data", formatter_class=HelpFormatter)
    t.add_argument("--out", default="runs/smollm2", help="directory holding data/ (from `dflash2.train data`)")
    t.add_argument("--arch", choices=ARCHS, default="dflash2", help=ARCH_HELP)
    t.add_argument("--steps", type=int, default=2000,
                   help="optimizer steps (linear warmup, then cosine decay to lr/10); ignored with --minutes")
    t.add_argument("--minutes", type=float, default=None,
                   help="train for this wall-clock budget instead of --steps, counted from the first step (loading "
                        "excluded); the cosine schedule ends at the deadline, at the pace so far (as in `run`)")
    t.add_argument("--batch-seqs", type=int, default=8, help="sequences per step")
    t.add_argument("--anchors", type=int, default=32, help="random anchors (blocks) per sequence")
    t.add_argument("--block-size", type=int, default=None,
                   help="a new drafter's block: dflash2, anchor + drafts (default 8); dspark, slots that each propose "
                        "(default 7). Both defaults verify 7 drafts and the target's token a step")
    t.add_argument("--gamma", type=float, default=None,
                   help="position decay (default 4 for 7 drafts: DFlash 2's block 8, DSpark's block 7)")
    t.add_argument("--layers", type=int, default=2, help="drafter layers (a new drafter only)")
    t.add_argument("--intermediate-size", type=int, default=1536, help="drafter MLP width (a new drafter only)")
    t.add_argument("--rank", type=int, default=24,
                   help="dflash2: selector rank r; dspark: Markov head rank (2 x vocab x rank weights; DeepSpec's 256 "
                        "would be 25M on a 49152 vocab, more than the whole DFlash 2 drafter, so the same 24 here)")
    t.add_argument("--top-k", type=int, default=16, help="selector candidates K (dflash2)")
    t.add_argument("--mask-token-id", type=int, default=16, help="token id of the masked draft slots")
    t.add_argument("--lr", type=float, default=6e-4, help="AdamW peak learning rate")
    t.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW weight decay")
    t.add_argument("--clip", type=float, default=1.0, help="gradient norm clip")
    t.add_argument("--bf16", action=argparse.BooleanOptionalAction, default=None,
                   help="bf16 autocast matmuls (default: on where bf16 is native: CUDA, CPUs with AVX512-BF16/AMX)")
    t.add_argument("--save-every", type=int, default=100, help="write OUT/drafter and the resume state every N steps")
    t.add_argument("--snapshot-every", type=int, default=0, metavar="N",
                   help="also keep the drafter every N steps in OUT/snapshots/step_N (for a tau-vs-steps curve; 0 = off)")
    t.add_argument("--resume", action="store_true", help="continue from OUT's last saved state")
    t.add_argument("--init", default=None, metavar="DIR",
                   help="start from this published drafter checkpoint (fine-tuning); its config sets the shape")
    t.add_argument("--extra-data", action="append", default=[], metavar="DIR",
                   help="another `dflash2.train data` output (its data/ folder) to mix in; repeatable")
    t.add_argument("--extra-share", type=float, default=None,
                   help="fraction of each step's sequences drawn from --extra-data (default: by size)")
    t.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    t.add_argument("--seed", type=int, default=0, help="batch sampling and initialization seed")
    t.add_argument("--device", default="cpu",
                   help=device_help + "; under torchrun, data parallel (cuda:LOCAL_RANK with nccl, cpu with gloo)")
    r = sub.add_parser("run", help="the whole recipe under a wall-clock budget: prompts, responses, training, tau",
                       formatter_class=HelpFormatter, description=RUN_RULE)
    r.add_argument("--minutes", type=float, required=True, help="wall-clock budget, loading included")
    r.add_argument("--out", required=True, help="run directory: data/, drafter/ (published format), run.json")
    r.add_argument("--arch", choices=ARCHS, default="dflash2", help=ARCH_HELP + "; --init must be one")
    r.add_argument("--device", default="cpu", help=device_help)
    r.add_argument("--target", default=None, help=target_help + ", in bf16 where native, else float32")
    r.add_argument("--data-dir", default="../shared/data", help="GSM8K/MBPP/... files: prompt sources, eval filter, tau")
    r.add_argument("--init", default=None, metavar="DIR", help="fine-tune this published drafter (default: a new "
                                                                "2-layer one, 5 taps spread over the target's layers)")
    r.add_argument("--sources", default=",".join(PROMPT_SOURCES), help="prompt sets, comma separated (see `data`)")
    r.add_argument("--self-instruct", type=int, default=3296, metavar="N",
                   help="questions to ask the target for (the topic x kind grid, cycled), within the prompts' time")
    r.add_argument("--max-new-tokens", type=int, default=256, help="length cap of each response")
    r.add_argument("--batch-size", type=int, default=None, help="prompts generated together (default: 512 on CUDA, 16 on CPU)")
    r.add_argument("--batch-seqs", type=int, default=None,
                   help="sequences per training step, 16 blocks each (default: 128 on CUDA, 8 on CPU)")
    r.add_argument("--features", action=argparse.BooleanOptionalAction, default=None,
                   help="store the target's features while generating (default: on a CPU, where a forward pass costs "
                        "more than reading them); --no-features recomputes them at each training step (default on CUDA)")
    r.add_argument("--save-minutes", type=float, default=2.0, help="write OUT/drafter this often while training")
    r.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    r.add_argument("--seed", type=int, default=0, help="prompt shuffle, sampling and training seed")
    pl = sub.add_parser("plot", help="draw the loss and per-slot accuracy curves (needs matplotlib)",
                        formatter_class=HelpFormatter)
    pl.add_argument("--out", default="runs/smollm2", help="run directory holding history.json")
    pl.add_argument("--png", default="docs/training.png", help="image to write")
    pl.add_argument("--before", action="append", default=[], metavar="JSON",
                    help="history.json of a run this one continues (--init), drawn first; repeat, oldest first")
    return ap


def main(argv=None):
    args = build_parser().parse_args(argv)
    if args.cmd == "data":
        make_data(args)
    elif args.cmd == "prompts":
        make_prompts(args)
    elif args.cmd == "train":
        check_device(args.device)
        train(args)
    elif args.cmd == "run":
        run(args)
    else:
        before = [json.loads(Path(b).read_text()) for b in args.before]
        plot_history(json.loads((Path(args.out) / "history.json").read_text()), args.png, before=before)
    ddp_teardown()


if __name__ == "__main__":
    main()
