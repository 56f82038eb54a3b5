"""Regenerate the golden vectors in tests/golden/: a tiny seeded target + drafter and their expected traces.

    python tests/make_golden.py

Run it only when the math is meant to change; the diff of the .jsonl files shows what moved.
"""
import dataclasses
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]

import dflash2_ref  # noqa: E402
from dflash2.pair import encode_prompt, load_pair  # noqa: E402
from dflash2.trace import run  # noqa: E402
from dflash2 import model  # noqa: E402
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
    from dflash2.train import default_gamma, drafter_loss, make_batch, position_weights

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


def main():
    torch.set_num_threads(1)
    dflash2_ref.quiet_libraries()
    write_models(GOLDEN)
    root = GOLDEN.parent.parent
    # Ids relative to the repository root, so the traces do not name this machine's paths.
    target_id, draft_id = (str((GOLDEN / n).relative_to(root)) for n in ("target", "draft"))
    pair = load_pair(str(GOLDEN / "target"), str(GOLDEN / "draft"), torch.device("cpu"), torch.float32)
    pair.target_id, pair.draft_id = target_id, draft_id
    prompts = [encode_prompt(pair.tokenizer, p) for p in PROMPTS]
    stops = model.stop_token_ids(pair.model, pair.tokenizer)
    for name, settings in TRACES.items():
        settings = dict(dict(max_new_tokens=24, top_k=0, top_p=1.0, seed=0, stop_ids=stops,
                             block_size=pair.drafter.config.block_size), **settings)
        run_pair = pair
        if settings["method"] == "ar":  # no drafter: the trace records draft null and block size null
            settings["block_size"] = None
            run_pair = dataclasses.replace(pair, drafter=None, draft_id=None, draft_dir=None)
        path = GOLDEN / f"{name}.jsonl"
        run(run_pair, prompts, settings, trace_path=path)
        print(f"wrote {path.relative_to(root)}")


if __name__ == "__main__":
    main()
