"""Two commits of the package side by side in one process: tok/s of each method on the same prompts, taking turns.

    python docs/compare_commits.py --old 4348e5a --new HEAD --data-dir ../shared/data

Its use: show that a change to the loop keeps its speed (within the machine's noise) and its greedy outputs.

Each commit's `dflash2/` is extracted with `git archive` into a temporary folder and imported under its own name
(`dflash2_old`, `dflash2_new`; the package uses relative imports only). Both copies register the packed-linear
custom op, so the old copy's op namespace is renamed on extraction; nothing else is changed. Each copy loads its
own embedded pair. Rounds alternate which commit runs first; a cell is the fastest round (the least disturbed
by the machine). Greedy outputs must be identical between the commits, token for token.
"""
import argparse
import importlib
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def extract(commit, name, into):
    """Import the package as it is at `commit`, under the module name `name`."""
    dest = into / name
    dest.mkdir()
    archive = subprocess.run(["git", "archive", commit, "dflash2"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "--strip-components=1", "-C", str(dest)], input=archive, check=True)
    kernels = dest / "kernels.py"
    kernels.write_text(kernels.read_text().replace('"dflash2_ref::', f'"{name}::'))
    if str(into) not in sys.path:
        sys.path.insert(0, str(into))
    return importlib.import_module(name)


def prompts_of(data_dir, num):
    rows = [json.loads(line) for line in (Path(data_dir) / "gsm8k" / "test.jsonl").read_text().splitlines()[:num]]
    texts = [r["question"] + "\nPlease reason step by step, and put your final answer within \\boxed{}." for r in rows]
    rows = [json.loads(line) for line in (Path(data_dir) / "mt_bench" / "question.jsonl").read_text().splitlines()[:num]]
    return texts + [r["turns"][0] for r in rows]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--old", required=True, help="commit (or ref) of the first copy")
    ap.add_argument("--new", default="HEAD", help="commit (or ref) of the second copy")
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--num-prompts", type=int, default=2, help="GSM8K and MT-Bench prompts each")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--methods", default="ar,dflash2,dflash2-tree")
    ap.add_argument("--block-size", type=int, default=8, help="every step's block (tree: its node budget)")
    ap.add_argument("--target", default=None, help="target dir or hub id (default: the embedded one)")
    ap.add_argument("--draft", default=None, help="drafter dir or hub id (default: the embedded one)")
    args = ap.parse_args()
    import torch

    with tempfile.TemporaryDirectory() as tmp:
        copies = {"old": extract(args.old, "dflash2_old", Path(tmp)), "new": extract(args.new, "dflash2_new", Path(tmp))}
        pairs = {k: importlib.import_module(f"{m.__name__}.pair").load_pair(args.target, args.draft)
                 for k, m in copies.items()}
        loops = {k: importlib.import_module(f"{m.__name__}.spec_decode") for k, m in copies.items()}
        tok = pairs["new"].tokenizer
        prompts = [tok.apply_chat_template([{"role": "user", "content": t}], add_generation_prompt=True, tokenize=True)
                   for t in prompts_of(args.data_dir, args.num_prompts)]
        prompts = [list(p if isinstance(p, list) else p["input_ids"]) for p in prompts]
        best, outputs = {}, {}
        for rnd in range(args.rounds):
            for method in args.methods.split(","):
                for k in (("old", "new") if rnd % 2 == 0 else ("new", "old")):
                    kw = dict(method=method, max_new_tokens=args.max_new_tokens)
                    if method != "ar":
                        kw.update(block_size=args.block_size)
                    if method == "dflash2-tree":
                        kw.update(tree_budget=args.block_size)
                    if hasattr(importlib.import_module(f"{copies[k].__name__}.settings"), "DecodeSettings"):
                        kw.update(policy="fixed")  # the old loop has no policy: compare the loops at a fixed width
                    drafter = None if method == "ar" else pairs[k].drafter
                    torch.manual_seed(0)
                    start = time.perf_counter()
                    res = [loops[k].generate(pairs[k].target, drafter, [p], **kw)[0] for p in prompts]
                    seconds = time.perf_counter() - start
                    tokens = sum(len(r.tokens) for r in res)
                    best[method, k] = max(best.get((method, k), 0.0), tokens / seconds)
                    outputs[method, k] = [r.tokens for r in res]
                    print(f"round {rnd} {method:13s} {k}: {tokens / seconds:.2f} tok/s", file=sys.stderr, flush=True)
        print(f"| method | {args.old} tok/s | {args.new} tok/s | new / old | outputs identical |\n|---|---|---|---|---|")
        for method in args.methods.split(","):
            same = outputs[method, "old"] == outputs[method, "new"]
            print(f"| {method} | {best[method, 'old']:.2f} | {best[method, 'new']:.2f} | "
                  f"{best[method, 'new'] / best[method, 'old']:.3f} | {same} |")


if __name__ == "__main__":
    main()
