"""Verify-step cost in isolation: our Target.forward of 8 tokens on a slot cache vs the HF model on a
DynamicCache cropped after each call (as the authors' loop does), 3 GSM8K prompts + 60 tokens of context.

    python docs/results/verify_cost.py ../shared/data > docs/results/verify_cost.jsonl
"""
import json, sys, time, torch
import dflash2
from dflash2 import spec_decode as sd
from dflash2.bench import format_prompt, load_tasks
from transformers import DynamicCache
torch.set_num_threads(2)
pair = dflash2.load_pair()
tok, lm, target = pair.tokenizer, pair.target.model, pair.target
texts = load_tasks(["gsm8k"], sys.argv[1] if len(sys.argv) > 1 else "../shared/data", 3)["gsm8k"]
def t(fn, n=30):
    for _ in range(5): fn()
    s = time.perf_counter()
    for _ in range(n): fn()
    return (time.perf_counter() - s) / n * 1000
for text in texts:
    ids = dflash2.encode_prompt(tok, format_prompt("gsm8k", text))
    P = len(ids) + 60  # as if 60 tokens were already generated
    seq = torch.tensor([ids + [ids[-1]] * 60 + list(range(100, 108))])
    with torch.no_grad():
        cache = target.new_cache(P + 128 + 8)
        target.forward(seq[:, :P], torch.arange(P)[None], cache, P)
        blk, pos = seq[:, P:P + 8], (P + torch.arange(8))[None]
        ours = t(lambda: target.forward(blk, pos, cache, P + 8))
        ours1 = t(lambda: target.forward(blk[:, :1], pos[:, :1], cache, P + 1))
        dc = DynamicCache()
        lm(input_ids=seq[:, :P], cache=dc, use_cache=True)
        def hf(k, hs):
            lm(input_ids=blk[:, :k], cache=dc, use_cache=True, output_hidden_states=hs); dc.crop(-k)
        hf8, hf8h, hf1 = t(lambda: hf(8, False)), t(lambda: hf(8, True)), t(lambda: hf(1, False))
    print(json.dumps(dict(prompt=len(ids), P=P, ours_8=round(ours, 1), ours_1=round(ours1, 1), hf_8=round(hf8, 1),
                          hf_8_hidden=round(hf8h, 1), hf_1=round(hf1, 1))), flush=True)
