"""What a deeper drafter costs per step, at the embedded drafter's own acceptance.

Builds drafters of 2..5 layers from the embedded 2-layer one by depth up-scaling: the new layers copy the last
layer with their attention and MLP output projections zeroed, so every residual stream, draft and path is the
embedded drafter's (checked below: identical drafts and tau), and only the cost of the extra layers changes. Then
runs bench.py's protocol with --profile on each, in one process per size, and prints the per-step split and the
tau each size must reach to match the 2-layer drafter's end-to-end speed (speedup ~ tau / step cost).

    python docs/results/drafter_size.py --data-dir ../shared/data --out docs/results/drafter_size.json
"""
import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from dflash2.model import DFlash2Drafter
from dflash2.pair import DEFAULT_DRAFT


def upscale(src, layers: int, out: Path) -> Path:
    """A `layers`-deep copy of the drafter at src whose extra layers are identities (zeroed output projections)."""
    raw = json.loads((Path(src) / "config.json").read_text())
    raw["num_hidden_layers"] = layers
    raw["layer_types"] = [raw["layer_types"][-1]] * layers
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(raw, indent=2))
    from safetensors.torch import load_file, save_file

    sd = load_file(str(Path(src) / "model.safetensors"))
    last = json.loads((Path(src) / "config.json").read_text())["num_hidden_layers"] - 1
    for i in range(last + 1, layers):
        for k, v in list(sd.items()):
            if k.startswith(f"layers.{last}."):
                new = k.replace(f"layers.{last}.", f"layers.{i}.", 1)
                sd[new] = torch.zeros_like(v) if k.endswith(("o_proj.weight", "down_proj.weight")) else v.clone()
    save_file(sd, str(out / "model.safetensors"))
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default="../shared/data")
    ap.add_argument("--layers", default="2,3,4,5")
    ap.add_argument("--tasks", default="mt-bench,gsm8k")
    ap.add_argument("--num-prompts", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--out", default="drafter_size.json")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="dflash2_size_"))
    rows = []
    for n in [int(x) for x in args.layers.split(",")]:
        d = upscale(DEFAULT_DRAFT, n, tmp / f"L{n}")
        params = sum(p.numel() for p in DFlash2Drafter.from_pretrained(d).parameters())
        res = tmp / f"L{n}.json"
        subprocess.run([sys.executable, "-m", "dflash2.bench", "--draft", str(d), "--tasks", args.tasks,
                        "--methods", "ar,dflash2", "--concurrency", "1", "--num-prompts", str(args.num_prompts),
                        "--max-new-tokens", str(args.max_new_tokens), "--data-dir", args.data_dir, "--profile",
                        "--out", str(res)], check=True)
        for r in json.loads(res.read_text())["results"]:
            rows.append(dict(r, layers=n, params_m=params / 1e6, bf16_mb=2 * params / 1e6))
    Path(args.out).write_text(json.dumps(rows, indent=1))
    for r in rows:  # the extra layers are identities: every size must accept exactly what the 2-layer drafter does
        b = next(x for x in rows if x["layers"] == 2 and x["task"] == r["task"] and x["method"] == r["method"])
        if r["acceptance_length"] != b["acceptance_length"]:
            raise SystemExit(f"{r['layers']} layers accept {r['acceptance_length']} on {r['task']}, 2 layers "
                             f"{b['acceptance_length']}: the up-scaling is not an identity")
    base = {(r["task"], r["method"]): r for r in rows if r["layers"] == 2}
    print("| layers | params (M) | bf16 MB | task | tau | drafter ms | step ms | ar step ms | step / ar step | "
          "tau to match 2 layers |")
    print("|---" * 10 + "|")
    for r in rows:
        if r["method"] != "dflash2":
            continue
        ar = next(x for x in rows if x["layers"] == r["layers"] and x["task"] == r["task"] and x["method"] == "ar")
        step = sum(r["step_ms"].values())
        ar_step = sum(ar["step_ms"].values())
        b = base[(r["task"], "dflash2")]
        b_ar = next(x for x in rows if x["layers"] == 2 and x["task"] == r["task"] and x["method"] == "ar")
        cost, b_cost = step / ar_step, sum(b["step_ms"].values()) / sum(b_ar["step_ms"].values())
        print(f"| {r['layers']} | {r['params_m']:.2f} | {r['bf16_mb']:.1f} | {r['task']} | {r['acceptance_length']:.2f} | "
              f"{r['step_ms'].get('drafter', 0):.1f} | {step:.1f} | {ar_step:.1f} | {cost:.2f} | "
              f"{b['acceptance_length'] * cost / b_cost:.2f} |")


if __name__ == "__main__":
    main()
