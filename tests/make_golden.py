"""Regenerate the golden vectors in tests/golden/: a tiny seeded target + drafter and their expected traces.

    python tests/make_golden.py
    python tests/make_golden.py --accept-change "why the acceptance counts move"

Run it only when the math is meant to change; the diff of the .jsonl files shows what moved.
Everything is built in a scratch directory first. If any trace's acceptance counts (num_accepted of
every step of every request) differ from the committed golden's, nothing is written unless
--accept-change gives the reason, which is appended with the changed traces to tests/golden/CHANGES.md:
a drafter or bookkeeping bug that keeps greedy output lossless would otherwise be blessed silently.
"""
import argparse
import dataclasses
import datetime
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import dflash2_ref  # noqa: E402
from dflash2.pair import load_pair, stop_token_ids  # noqa: E402
from dflash2.prompts import encode_prompt  # noqa: E402
from dflash2.settings import DecodeSettings  # noqa: E402
from dflash2.trace import run  # noqa: E402
from targets import reference_greedy, tiny_drafter, tiny_target  # noqa: E402

GOLDEN = HERE / "golden"
WORDS = ("the a of to and in is it that was for on are with as his they be at one have this from or had by "
         "but what some we can out other were all there when up use your how said an each she which do their "
         "time if will way about many then them write would like so these her long make thing see").split()
CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} {% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
PROMPTS = ["the time of day", "what is it that we can make", "long"]
# name -> generate settings; greedy and sampled for both drafting methods, plus plain AR.
TRACES = {
    "greedy_dflash2": dict(method="dflash2", temperature=0.0),
    "greedy_ar": dict(method="ar", temperature=0.0),
    "sampled_dflash2": dict(method="dflash2", temperature=0.5, top_p=0.9, seed=7),
    "sampled_dflash": dict(method="dflash", temperature=0.7, top_k=20, seed=3, block_size=5),
}


def tiny_tokenizer(vocab_size=64):
    """A whitespace WordLevel tokenizer with a chat template: self-contained, no download."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tokens = ["[UNK]", "<eos>", "<|system|>", "<|user|>", "<|assistant|>"] + WORDS
    tokens = tokens[:vocab_size]
    assert len(tokens) == vocab_size, len(tokens)
    tk = Tokenizer(models.WordLevel({t: i for i, t in enumerate(tokens)}, unk_token="[UNK]"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tk, unk_token="[UNK]", eos_token="<eos>",
                                   chat_template=CHAT_TEMPLATE)


@torch.no_grad()
def self_distilled(target, taps, n=32, length=40):
    """(ids, tapped features [L-1, n*H], prompt length) of the target's own greedy text from random prompts."""
    g = torch.Generator().manual_seed(0)
    seqs = []
    for _ in range(n):
        prompt = torch.randint(5, target.config.vocab_size - 1, (4,), generator=g).tolist()
        ids = prompt + reference_greedy(target, prompt, length)
        hidden = target(torch.tensor([ids]), output_hidden_states=True).hidden_states
        seqs.append((torch.tensor(ids), torch.cat([hidden[l + 1] for l in taps], -1)[0, :-1], len(prompt)))
    return seqs


def fit(target, drafter, steps=300):
    """A short run of the real training loss, so that greedy traces accept drafts too (a random drafter never does)."""
    from dflash2.fit import default_gamma, drafter_loss, make_batch, position_weights

    seqs = self_distilled(target, drafter.config.target_layer_ids)
    B = drafter.config.block_size
    weights, g = position_weights(B, default_gamma(B)), torch.Generator().manual_seed(0)
    opt = torch.optim.AdamW(drafter.parameters(), lr=3e-3)
    drafter.train()
    for _ in range(steps):
        batch = make_batch(seqs, B, 4, drafter.config.mask_token_id, g)
        loss = drafter_loss(drafter, target.get_input_embeddings(), target.get_output_embeddings().weight, batch,
                            weights)[0]
        opt.zero_grad()
        loss.backward()
        opt.step()
    return drafter.eval()


def write_models(directory):
    """Tiny Llama target (with tokenizer) and a matching drafter fitted to it, both seeded."""
    target = tiny_target("llama")
    target.config.max_position_embeddings = 512  # the golden pair's window: test_cli's too-long prompt exceeds it
    tiny_tokenizer(target.config.vocab_size).save_pretrained(directory / "target")
    target.save_pretrained(directory / "target")
    target.requires_grad_(False)
    fit(target, tiny_drafter(target, block_size=6)).save_pretrained(directory / "draft")


def write_traces(directory):
    """The models and every trace of TRACES into directory (ids name tests/golden, where they will live)."""
    write_models(directory)
    root = GOLDEN.parent.parent
    # Ids relative to the repository root, so the traces do not name this machine's paths.
    target_id, draft_id = (str((GOLDEN / n).relative_to(root)) for n in ("target", "draft"))
    pair = load_pair(str(directory / "target"), str(directory / "draft"), torch.device("cpu"), torch.float32)
    pair.target_id, pair.draft_id = target_id, draft_id
    prompts = [encode_prompt(pair.tokenizer, p) for p in PROMPTS]
    stops = stop_token_ids(pair.target.model, pair.tokenizer)
    for name, settings in TRACES.items():
        settings = dict(dict(max_new_tokens=24, top_k=0, top_p=1.0, seed=0, stop_ids=stops,
                             block_size=pair.drafter.config.block_size), **settings)
        run_pair = pair
        if settings["method"] == "ar":  # no drafter: the trace records draft null and block size null
            settings["block_size"] = None
            run_pair = dataclasses.replace(pair, drafter=None, draft_id=None, draft_dir=None)
        run(run_pair, prompts, DecodeSettings(**settings), trace_path=directory / f"{name}.jsonl")


# --- the guard: regenerated goldens must keep every acceptance count, or say why not ---


def acceptance_counts(path):
    """{request: [num_accepted of step 1, 2, ...]} of a trace file (steps in step order)."""
    steps = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        if rec.get("type") == "step":
            steps.setdefault(rec["request"], {})[rec["step"]] = rec["num_accepted"]
    return {req: [by_step[s] for s in sorted(by_step)] for req, by_step in sorted(steps.items())}


def acceptance_changes(old_dir, new_dir):
    """{trace name: what moved} for every trace whose acceptance counts differ between the two
    directories (a trace present in only one of them counts as changed)."""
    names = sorted({p.stem for p in Path(old_dir).glob("*.jsonl")} | {p.stem for p in Path(new_dir).glob("*.jsonl")})
    changes = {}
    for name in names:
        old, new = (Path(d) / f"{name}.jsonl" for d in (old_dir, new_dir))
        if not old.exists() or not new.exists():
            changes[name] = "new trace" if not old.exists() else "trace removed"
            continue
        a, b = acceptance_counts(old), acceptance_counts(new)
        if a != b:
            req = next(r for r in sorted(a.keys() | b.keys()) if a.get(r) != b.get(r))
            changes[name] = f"request {req} accepted {a.get(req)} -> {b.get(req)}"
    return changes


def install(staging, golden, reason, today=None):
    """Move staging's models and traces into golden if the acceptance counts are unchanged or a reason
    is given (then a dated line goes to golden/CHANGES.md). Returns (written, changes)."""
    changes = acceptance_changes(golden, staging)
    if changes and not reason:
        return False, changes
    for name in ("target", "draft"):
        shutil.rmtree(golden / name, ignore_errors=True)
        shutil.copytree(staging / name, golden / name)
    for path in Path(staging).glob("*.jsonl"):
        shutil.copyfile(path, golden / path.name)
    if changes:
        today = today or datetime.datetime.now(datetime.timezone.utc).date().isoformat()
        log = golden / "CHANGES.md"
        if not log.exists():
            log.write_text("# Golden trace changes\n\nEach line: the date, why the acceptance counts moved, and "
                           "the traces that changed (written by `tests/make_golden.py --accept-change`).\n\n")
        what = "; ".join(f"{n}: {c}" for n, c in changes.items())
        with open(log, "a") as f:
            f.write(f"- {today}: {reason} (changed: {what})\n")
    return True, changes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--accept-change", metavar="REASON", default=None,
                        help="write even if acceptance counts change, and log REASON in tests/golden/CHANGES.md")
    args = parser.parse_args(argv)
    if args.accept_change is not None and not args.accept_change.strip():
        parser.error("--accept-change needs a non-empty reason")
    torch.set_num_threads(1)
    dflash2_ref.quiet_libraries()
    with tempfile.TemporaryDirectory() as tmp:
        staging = Path(tmp)
        write_traces(staging)
        written, changes = install(staging, GOLDEN, args.accept_change)
    for name, change in changes.items():
        print(f"acceptance changed: {name}: {change}")
    if not written:
        print("refused: the acceptance counts above differ from the committed goldens; nothing written. If the "
              "change is meant, rerun with --accept-change \"REASON\".", file=sys.stderr)
        return 1
    print(f"wrote {GOLDEN.relative_to(GOLDEN.parent.parent)} ({'acceptance counts unchanged' if not changes else 'change logged in CHANGES.md'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
