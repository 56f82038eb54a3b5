"""Write tests/fixtures/dspark/: a tiny random DSpark drafter saved by DeepSpec itself, and what
DeepSpec's own eval code computes with it (hidden states, Markov logits, drafts, q, confidence).

DeepSpec is not on PyPI, so tests/test_dspark.py compares against these numbers. Regenerate with a
checkout of github.com/deepseek-ai/DeepSpec at the commit named below (CPU, any recent transformers):

    PYTHONPATH=/path/to/DeepSpec python tests/make_dspark_fixture.py
"""
import json
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import DynamicCache, Qwen3Config

from deepspec.eval.dspark.draft_ops import build_dspark_proposal, forward_dspark_draft_block
from deepspec.modeling.dspark.qwen3 import Qwen3DSparkModel
from deepspec.modeling.dspark.qwen3.config import build_draft_config
from deepspec.utils.config import ConfigNode

DEEPSPEC_COMMIT = "afdfa7c9382a3341a3e6f17756dd816da79f132c"
OUT = Path(__file__).resolve().parent / "fixtures" / "dspark"
V, H, TARGET_LAYERS, BLOCK = 64, 32, 4, 5
TEMPERATURE = 0.7
THRESHOLDS = (0.0, 0.3, 0.5, 0.7, 0.9)
CASES = ((6, 11), (9, 42))  # (context length = the anchor's position, anchor token)


def tiny_drafter():
    target = Qwen3Config(vocab_size=V, hidden_size=H, intermediate_size=48, num_hidden_layers=TARGET_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
                         rms_norm_eps=1e-6, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    args = ConfigNode(num_draft_layers=2, target_layer_ids=[0, 2], mask_token_id=V - 1, num_anchors=8,
                      block_size=BLOCK, markov_rank=8, markov_head_type="vanilla",
                      confidence_head_alpha=1.0, confidence_head_with_markov=True)
    model = Qwen3DSparkModel(build_draft_config(target, args))
    torch.manual_seed(0)
    with torch.no_grad():  # weights of order one, so every term moves the logits
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif "markov_w1" in name or "embed_tokens" in name:
                p.normal_(0, 1.0)
            else:
                p.normal_(0, 1.0 / p.shape[-1] ** 0.5)
    return model


class OneBlockCache(DynamicCache):
    """A fresh cache per block: DeepSpec's crop(start) afterwards only matters for the next block, and
    transformers >= 5.2x reads crop's argument differently from the 5.10 that DeepSpec pins."""

    def crop(self, max_length):
        pass


def run_case(model, ctx_len, anchor, generator_seed):
    """DeepSpec's Qwen3DSparkEvaluator._propose for one block (batch 1), greedy and sampled."""
    torch.manual_seed(1000 + ctx_len)
    n = len(model.target_layer_ids)
    target_hidden = torch.randn(1, ctx_len, n * H, dtype=torch.float64)
    ids = torch.full((1, BLOCK), model.mask_token_id, dtype=torch.long)
    ids[:, 0] = anchor
    positions = torch.arange(ctx_len + BLOCK + 1)[None]
    h = forward_dspark_draft_block(model, draft_input_ids=ids, position_ids=positions,
                                   past_key_values_draft=OneBlockCache(), target_hidden_states=target_hidden,
                                   start=ctx_len, block_size=BLOCK)
    out = {"target_hidden": target_hidden[0], "hidden": h[0]}
    greedy = build_dspark_proposal(model, draft_input_ids=ids, block_hidden=h, block_size=BLOCK,
                                   temperature=0.0, confidence_threshold=0.0)
    out["greedy_drafts"], out["greedy_q"] = greedy.verify_input_ids[0, 1:], greedy.draft_probs[0]
    out["greedy_confidence"] = greedy.confidence_logits[0]
    _, greedy_logits = model.sample_draft_tokens(model.compute_logits(h), first_prev_token_ids=ids[:, 0],
                                                 temperature=0.0, hidden_states=h)
    out["greedy_logits"] = greedy_logits[0]
    torch.manual_seed(generator_seed)
    sampled = build_dspark_proposal(model, draft_input_ids=ids, block_hidden=h, block_size=BLOCK,
                                    temperature=TEMPERATURE, confidence_threshold=0.0)
    out["sampled_drafts"], out["sampled_q"] = sampled.verify_input_ids[0, 1:], sampled.draft_probs[0]
    out["sampled_confidence"] = sampled.confidence_logits[0]
    cuts = []
    for threshold in THRESHOLDS:  # the confidence cut of DeepSpec's eval, greedy walk
        torch.manual_seed(0)
        cut = build_dspark_proposal(model, draft_input_ids=ids, block_hidden=h, block_size=BLOCK,
                                    temperature=0.0, confidence_threshold=threshold)
        cuts.append(cut.draft_token_count)
    out["greedy_cut"] = torch.tensor(cuts)
    return {k: v.detach().contiguous() for k, v in out.items()}


def main():
    model = tiny_drafter()
    with tempfile.TemporaryDirectory() as tmp:  # DeepSpec's own save and its evaluator's load
        model.save_pretrained(tmp)
        model = Qwen3DSparkModel.from_pretrained(tmp, dtype=torch.float64, attn_implementation="sdpa").eval()
        if OUT.exists():
            shutil.rmtree(OUT)
        OUT.mkdir(parents=True)
        for f in ("config.json", "model.safetensors"):
            shutil.copy(Path(tmp) / f, OUT / f)
    expected = {}
    with torch.no_grad():
        for i, (ctx_len, anchor) in enumerate(CASES):
            for k, v in run_case(model, ctx_len, anchor, generator_seed=7 + i).items():
                expected[f"case{i}.{k}"] = v
    save_file(expected, OUT / "expected.safetensors")
    (OUT / "meta.json").write_text(json.dumps({
        "deepspec_commit": DEEPSPEC_COMMIT, "temperature": TEMPERATURE, "thresholds": THRESHOLDS,
        "cases": [{"context_length": c, "anchor": a} for c, a in CASES], "block_size": BLOCK,
        "torch": torch.__version__}, indent=2) + "\n")
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
