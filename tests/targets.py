"""Tiny random targets of the three architecture families the loop must serve, plus a matching drafter."""
import os
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM, MiniMaxM2Config, MiniMaxM2ForCausalLM
from transformers.models.minimax_m3_vl.configuration_minimax_m3_vl import MiniMaxM3VLTextConfig
from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import MiniMaxM3VLForCausalLM

from dflash2.checkpoint import DFlash2Config
from dflash2.model import DFlash2Drafter

ARCHS = ("llama", "minimax_m2", "minimax_m3")
TREE_ARCHS = ("llama", "minimax_m2", "minimax_m3_dense")  # dense attention: see test_tree_decode
# The benchmark data (the ../shared/data layout), for the tests that read it; an absolute value replaces the root.
DATA_DIR = Path(__file__).resolve().parents[1] / os.environ.get("DFLASH2_DATA_DIR", "../shared/data")


def tiny_glm_config(**overrides):
    """GLM-5.3-Flash-DFlash2 (SPEC §2) shrunk for tests: same structure (5 layers, 5 taps, sliding
    layers, GQA 4:1, block 8, mask id near the end of the vocab), tiny dims, float32."""
    base = dict(
        hidden_size=64, intermediate_size=192, num_hidden_layers=5, num_attention_heads=8,
        num_key_value_heads=2, head_dim=16, vocab_size=512, num_target_layers=9,
        target_layer_ids=[1, 3, 5, 6, 8], mask_token_id=488, rms_norm_eps=1e-5, rope_theta=1e4,
        max_position_embeddings=4096, layer_types=["sliding_attention"] * 5, sliding_window=16,
        use_sliding_window=True, dtype="float32", block_size=8, conv_kernel_size=2, conv_group_size=16,
        selector_rank=16, selector_top_k=4,
    )
    base.update(overrides)
    return DFlash2Config(**base).validate()


def tiny_target(arch, vocab=64, hidden=32, layers=3, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    common = dict(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, bos_token_id=None, eos_token_id=None,
                  pad_token_id=None)
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(intermediate_size=64, **common))
    elif arch == "minimax_m2":
        model = MiniMaxM2ForCausalLM(MiniMaxM2Config(intermediate_size=32, head_dim=16, rotary_dim=8,
                                                     num_local_experts=4, num_experts_per_tok=2, **common))
    elif arch in ("minimax_m3", "minimax_m3_dense"):
        # Deployment-shaped: partial RoPE via rotary_dim, dense first layer, sparse (MSA) layers with a
        # small index block so block selection is active on short sequences. minimax_m3_dense: the
        # same with dense attention in every layer (what tree verification needs; MoE kept).
        attn = "full_attention" if arch == "minimax_m3_dense" else "minimax_m3_sparse"
        model = MiniMaxM3VLForCausalLM(MiniMaxM3VLTextConfig(
            intermediate_size=32, dense_intermediate_size=64, shared_intermediate_size=32, head_dim=16,
            rotary_dim=8, num_local_experts=4, num_experts_per_tok=2, index_n_heads=2, index_head_dim=8,
            index_block_size=4, index_topk_blocks=2,
            layer_types=["full_attention"] + [attn] * (layers - 1),
            mlp_layer_types=["dense"] + ["sparse"] * (layers - 1), **common))
    else:
        raise ValueError(arch)
    # Random init gives near-uniform logits; sharpen them so greedy argmax gaps are far above rounding.
    with torch.no_grad():
        model.get_output_embeddings().weight.mul_(8.0)
    return model.to(dtype).eval()


def tiny_drafter(target_model, block_size=8, seed=1, top_k=4, layers=2, head_dim=8, dtype=torch.float32):
    cfg = target_model.config
    torch.manual_seed(seed)
    n_layers = cfg.num_hidden_layers
    config = tiny_glm_config(hidden_size=cfg.hidden_size, intermediate_size=64, num_hidden_layers=layers,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim, vocab_size=cfg.vocab_size,
                             num_target_layers=n_layers, target_layer_ids=list(range(n_layers))[:2],
                             mask_token_id=cfg.vocab_size - 1, layer_types=["sliding_attention"] * layers,
                             block_size=block_size, selector_top_k=top_k, conv_group_size=8, selector_rank=8)
    drafter = DFlash2Drafter(config).to(dtype).eval()
    with torch.no_grad():  # non-identity convolutions and a live selector, so every path is exercised
        for p in drafter.parameters():
            if p.abs().sum() == 0:
                p.normal_(0, 0.05)
    return drafter


@torch.no_grad()
def reference_greedy(model, prompt, n):
    """The target's own greedy continuation, recomputed from scratch each token (no cache at all)."""
    seq = list(prompt)
    for _ in range(n):
        logits = model(torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(prompt):]


def synthetic_costs(per_token=0.02, draft=0.2, draft_per_row=0.05, tree=None, batches=(1, 2, 4, 8, 16, 32), n=40):
    """policy.Costs of a machine whose forward grows linearly with its tokens, V(w, b) = 1 + per_token (b w - 1),
    and whose draft of b rows costs draft + draft_per_row (b - 1) (tree: the tree's draft at one row)."""
    from dflash2.policy import Costs

    tree = draft if tree is None else tree
    return Costs(list(batches), [[1 + per_token * (b * w - 1) for w in range(1, n + 1)] for b in batches],
                 [draft + draft_per_row * (b - 1) for b in batches], [tree + draft_per_row * (b - 1) for b in batches])
