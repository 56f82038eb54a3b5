"""Run the serving engines' config reading, vLLM's selector scoring and both engines' end-of-budget trim,
unchanged, on a CPU beside this reference (docs/PORTS.md, vLLM and SGLang sections).

The functions below are taken from the unzipped wheels by name (Python's ast) and executed as written, with
their own file names and line numbers; only their imports are supplied here (transformers' classes, a few
stubs for names that the cases never reach). Nothing is imported from the vllm or sglang packages, which
need CUDA. Parts:

  A. window and causality of a `sliding_attention` layer. The config.json is loaded as both loaders load a
     `model_type: qwen3` drafter: transformers' AutoConfig, so Qwen3Config (vLLM
     `transformers_utils/config.py:445-451`, then wrapped in its EAGLEConfig, `config/speculative.py:1513-1531`;
     SGLang `srt/utils/hf_transformers/config.py:228`). Then vLLM's `_resolve_layer_attention`
     (`model_executor/models/qwen3_dflash.py:96-156`) and SGLang's `_get_dflash_layer_attention_params`
     (`srt/models/dflash.py:166-191`) read it. Qwen3Config sets `sliding_window = None` unless
     `use_sliding_window` is true, so both engines raise where the authors and this reference run the layer
     with no window; only vLLM's own `dflash_config.swa_window_size` brings a window back.
  B. vLLM's selector scores: `LogitsProcessor.get_top_k_tokens` (`model_executor/layers/logits_processor.py:253-318`)
     returns float32 values (`:311`), and `_score_edges` (`model_executor/models/qwen3_dflash2.py:290-310`) adds
     the bf16 bilinear term to them, so S is float32, as ours.
  C. the end of the budget: neither engine shrinks the block; both trim the verified run at the budget. vLLM's
     `Scheduler._update_request_with_output` (`v1/core/sched/scheduler.py:2744-2770`) with `check_stop`
     (`v1/core/sched/utils.py:98-140`), SGLang's `Req.update_finish_state` (`srt/managers/schedule_batch.py:2007-2047`)
     and `output_ids_through_stop` (`:1509-1513`).

    pip download --no-deps vllm==0.33.0 sglang==0.5.23
    python -m zipfile -e vllm-0.33.0-*.whl vl && python -m zipfile -e sglang-0.5.23-*.whl sgl
    python docs/serving_config_check.py --vllm vl/vllm --sglang sgl/sglang > docs/results/serving_config_check.txt
"""
import __future__
import argparse
import ast
import enum
import inspect
import json
import os
import sys
import tempfile
import types
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import AutoConfig, DeepseekV2Config, PreTrainedConfig, Qwen3Config

from dflash2.checkpoint import DFlash2Config
from dflash2.model import CandidateSelector, DFlash2Drafter


def pull(path, names, namespace, cls=None):
    """Execute the top-level definitions `names` of `path` (of class `cls` if given) in `namespace`, as
    written, compiled with the file's own name and line numbers. Returns the namespace."""
    tree = ast.parse(Path(path).read_text())
    body = tree.body
    if cls is not None:
        body = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == cls).body

    def name_of(node):
        if isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            return next((t.id for t in targets if isinstance(t, ast.Name)), None)
        return getattr(node, "name", None)
    nodes = [n for n in body if name_of(n) in names]
    missing = set(names) - {name_of(n) for n in nodes}
    if missing:
        raise SystemExit(f"{path}: not found: {sorted(missing)}")
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace


def base_config(**edits):
    """The golden drafter's config.json (tests/golden/draft), two sliding layers, W = 16, with edits (None deletes)."""
    d = json.loads((Path(__file__).resolve().parents[1] / "tests" / "golden" / "draft" / "config.json").read_text())
    for key, value in edits.items():
        where = d["dflash_config"] if key == "swa_window_size" else d
        if value is None:
            where.pop(key, None)
        else:
            where[key] = value
    return d


def load_qwen3(d):
    """The config object both loaders build for model_type qwen3: AutoConfig.from_pretrained on the directory."""
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "config.json").write_text(json.dumps(d))
        return AutoConfig.from_pretrained(tmp)


def outcome(fn):
    try:
        return repr(fn())
    except Exception as e:  # the engines' own errors are the result here
        return f"raises {type(e).__name__}: {e}"


def part_a(vl, sg):
    v = {"Qwen3Config": Qwen3Config, "get_current_vllm_config": lambda: types.SimpleNamespace(use_v2_model_runner=True)}
    pull(vl / "model_executor/models/qwen3_dflash.py",
         ["_SLIDING_ATTENTION", "_dflash_layer_causal", "_resolve_layer_attention"], v)
    e = {"AutoConfig": AutoConfig, "DeepseekV2Config": DeepseekV2Config, "PreTrainedConfig": PreTrainedConfig, "os": os,
         "without_trust_remote_code": lambda kwargs: kwargs}
    pull(vl / "transformers_utils/configs/eagle.py", ["EAGLEConfig"], e)
    s = {"Sequence": __import__("collections.abc").abc.Sequence, "Any": object,
         "AttentionType": types.SimpleNamespace(DECODER="DECODER (causal)",
                                                ENCODER_ONLY="ENCODER_ONLY (bidirectional)")}
    pull(sg / "srt/speculative/dflash_utils.py", ["_cfg_get", "_get_text_config", "_get_dflash_config",
                                                   "is_nemotron_35_draft_config", "get_dflash_layer_types",
                                                   "get_dflash_attention_sliding_window_size"], s)
    pull(sg / "srt/models/dflash.py", ["_get_dflash_attention_type", "_get_dflash_layer_attention_params"], s)

    post_init = inspect.getsource(Qwen3Config.__post_init__).splitlines()
    line = next(x.strip() for x in post_init if "self.sliding_window =" in x)
    print(f"A. transformers {transformers.__version__}, Qwen3Config.__post_init__: {line}")
    print("   (vLLM 0.33.0 requires transformers>=5.16.1,<5.21.0 and SGLang 0.5.23 pins 5.19.0; the same line is in")
    print("   5.16.1, 5.19.0 and 5.20.0: configuration_qwen3.py:87)")
    cases = {
        "published: use_sliding_window true, sliding_window 16": base_config(),
        "use_sliding_window false, sliding_window 16": base_config(use_sliding_window=False),
        "use_sliding_window absent, sliding_window 16": base_config(use_sliding_window=None),
        "use_sliding_window false, is_causal absent": base_config(use_sliding_window=False, is_causal=None),
        "use_sliding_window false, dflash_config.swa_window_size 8":
            base_config(use_sliding_window=False, swa_window_size=8),
    }
    for name, d in cases.items():
        hf = load_qwen3(d)
        eagle = e["EAGLEConfig"](hf, method="dflash", model_type="eagle")
        ours = DFlash2Config.from_dict(d)
        print(f"   {name}:")
        print(f"     Qwen3Config: sliding_window {hf.sliding_window!r}, layer_types {hf.layer_types}; "
              f"vLLM's EAGLEConfig: sliding_window {eagle.sliding_window!r}, architectures {eagle.architectures}")
        print(f"     ours (window, causal) of layer 0: {(ours.layer_window(0), ours.layer_causal(0))!r}")
        print(f"     vLLM _resolve_layer_attention(config, 0) -> (window, causal): "
              f"{outcome(lambda: v['_resolve_layer_attention'](eagle, 0))}")
        print(f"     SGLang _get_dflash_layer_attention_params(config, 0) -> (window_left, type): "
              f"{outcome(lambda: s['_get_dflash_layer_attention_params'](hf, 0))}")


def part_b(vl):
    ns = {"torch": torch, "_flashinfer_topk": lambda: None, "tensor_model_parallel_all_gather": None}
    pull(vl / "model_executor/layers/logits_processor.py", ["_topk"], ns)
    pull(vl / "model_executor/layers/logits_processor.py", ["get_top_k_tokens"], ns, cls="LogitsProcessor")
    pull(vl / "model_executor/models/qwen3_dflash2.py", ["_score_edges"], ns)
    get_top_k_tokens, score_edges = ns["get_top_k_tokens"], ns["_score_edges"]

    def vllm_scores(W_head, h, wh_weight, A, Bc, anchors, K, multiplier, softcap):
        """vLLM's compute_candidates (qwen3_dflash2.py:408-413) and CandidateSelector.forward (:342-358)."""
        processor = types.SimpleNamespace(scale=multiplier, soft_cap=softcap,
                                          _apply_head=lambda lm_head, x, bias: F.linear(x, lm_head.weight))
        lm_head = types.SimpleNamespace(weight=W_head, tp_size=1, shard_indices=types.SimpleNamespace(
            num_org_vocab_padding=0, org_vocab_start_index=0))
        b, n, _ = h.shape
        ids, unary = get_top_k_tokens(processor, lm_head, h.flatten(0, 1), K)
        ids, unary = ids.view(b, n, K), unary.view(b, n, K)
        return ids, unary, score_edges(A, Bc, ids, unary, F.linear(h, wh_weight), anchors, K)

    def our_scores(W_head, h, wh_weight, A, Bc, anchors, K, multiplier, softcap):
        V, H = W_head.shape
        cfg = types.SimpleNamespace(output_multiplier=multiplier, final_logit_softcapping=softcap)
        U = DFlash2Drafter.draft_logits(types.SimpleNamespace(config=cfg), h, W_head)
        sel = CandidateSelector(types.SimpleNamespace(selector_top_k=K, hidden_size=H, selector_rank=A.shape[1],
                                                      vocab_size=V)).to(torch.bfloat16)
        with torch.no_grad():
            sel.hidden_projection.weight.copy_(wh_weight)
            sel.predecessor_codebook.copy_(A)
            sel.successor_codebook.copy_(Bc)
            ids, values = sel.candidates(U, K)
            return ids, values, sel.edge_scores(h, U, ids, anchors)

    bf = torch.bfloat16
    print("B. vLLM's selector scores, its get_top_k_tokens and _score_edges on bf16 parameters (CPU):")
    # minimal input: U = [16.0, 15.9375] (both exact in bf16), bilinear [0, 0.1]; in bf16 16.0375 rounds to 16.0
    W_head, h = torch.tensor([[16.0], [15.9375]], dtype=bf), torch.ones(1, 1, 1, dtype=bf)
    A, Bc = torch.ones(2, 1, dtype=bf), torch.tensor([[0.0], [0.1]], dtype=bf)
    ids, unary, S = vllm_scores(W_head, h, torch.ones(1, 1, dtype=bf), A, Bc, torch.tensor([0]), 2, 1.0, None)
    print(f"   unary_logits dtype {unary.dtype}, S dtype {S.dtype}")
    print(f"   minimal input U = [16.0, 15.9375], bilinear [0, 0.1]: vLLM S = {S[0, 0, 0].tolist()} -> greedy picks "
          f"token {ids[0, 0, S[0, 0, 0].argmax()].item()}; in bf16 the sum is {S[0, 0, 0].to(bf).tolist()} (a tie: "
          f"argmax takes token {ids[0, 0, S[0, 0, 0].to(bf).argmax()].item()})")
    _, _, S_ours = our_scores(W_head, h, torch.ones(1, 1, dtype=bf), A, Bc, torch.tensor([0]), 2, 1.0, None)
    print(f"   ours on the same input: S = {S_ours[0, 0, 0].tolist()}")
    g = torch.Generator().manual_seed(0)
    V, H, r, K, b, n = 512, 64, 32, 16, 8, 7
    worst, same_ids, same_walk = 0.0, True, 0
    for multiplier, softcap in ((1.0, None), (0.19611613513818404, 20.0)):
        W_head = (torch.randn(V, H, generator=g) * 0.5).to(bf)
        h = torch.randn(b, n, H, generator=g).to(bf)
        wh, A, Bc = ((torch.randn(*s, generator=g) * 0.2).to(bf) for s in ((r, H), (V, r), (V, r)))
        anchors = torch.randint(V, (b,), generator=g)
        theirs = vllm_scores(W_head, h, wh, A, Bc, anchors, K, multiplier, softcap)
        ours = our_scores(W_head, h, wh, A, Bc, anchors, K, multiplier, softcap)
        same_ids &= torch.equal(theirs[0], ours[0]) and torch.equal(theirs[1], ours[1])
        worst = max(worst, (theirs[2] - ours[2]).abs().max().item())
        same_walk += int((theirs[2].argmax(-1) == ours[2].argmax(-1)).sum())
    print(f"   random bf16 drafter (V {V}, H {H}, r {r}, K {K}), 2 x {b} rows x {n} slots, multiplier/softcap off and "
          f"0.196/20: candidates and unary values equal: {same_ids}; max |S_vLLM - S_ours| = {worst:.3g} (both sides "
          f"round the bilinear term to bf16 and add it to float32 U); argmax per predecessor row "
          f"equal in {same_walk} of {2 * b * n * K}")


def part_c(vl, sg):
    v = {"RepetitionDetectionParams": object, "Request": object, "check_sequence_repetition": lambda *a: False,
         "enum": enum}
    pull(vl / "v1/request.py", ["RequestStatus"], v)
    pull(vl / "v1/core/sched/utils.py", ["check_stop"], v)
    pull(vl / "v1/core/sched/scheduler.py", ["_update_request_with_output"], v, cls="Scheduler")

    class VllmRequest:
        def __init__(self, prompt, output, max_tokens):
            self.prompt_token_ids, self.output_token_ids, self.max_tokens = list(prompt), list(output), max_tokens
            self.sampling_params = types.SimpleNamespace(eos_token_id=None, stop_token_ids=[], min_tokens=0,
                                                         repetition_detection=None)
            self.pooling_params, self.status, self.num_output_placeholders = None, v["RequestStatus"].RUNNING, 0
            self.num_computed_tokens = len(prompt) + len(output)

        num_output_tokens = property(lambda self: len(self.output_token_ids))
        num_tokens = property(lambda self: len(self.prompt_token_ids) + len(self.output_token_ids))

        def append_output_token_ids(self, token):
            self.output_token_ids.append(token)

    print("C. the end of the budget: a request with 8 of max 10 tokens made verifies a full block; the target")
    print("   accepts 5 drafts and adds its own token, so the step returns 6 tokens [100..105]:")
    req = VllmRequest(range(4), range(8), 10)
    scheduler = types.SimpleNamespace(max_model_len=4096)
    kept, stopped = v["_update_request_with_output"](scheduler, req, list(range(100, 106)))
    print(f"   vLLM _update_request_with_output: keeps {kept}, stopped {stopped}, status {req.status}, "
          f"output length {req.num_output_tokens}")

    s = {"List": list, "Optional": object}
    pull(sg / "srt/managers/schedule_batch.py", ["BaseFinishReason", "FINISH_MATCHED_TOKEN", "FINISH_MATCHED_STR",
                                                 "FINISHED_MATCHED_REGEX", "FINISH_LENGTH"], s)
    methods = pull(sg / "srt/managers/schedule_batch.py", ["finished", "output_ids_through_stop", "update_finish_state",
                                                           "_check_vocab_boundary_finish", "_check_str_based_finish",
                                                           "_check_token_based_finish",
                                                           "_cap_finished_len_at_max_new_tokens"], dict(s), cls="Req")
    Req = type("Req", (), {k: methods[k] for k in ("finished", "output_ids_through_stop", "update_finish_state",
                                                   "_check_vocab_boundary_finish", "_check_str_based_finish",
                                                   "_check_token_based_finish", "_cap_finished_len_at_max_new_tokens")})
    req = Req()
    req.output_ids, req.to_finish, req.finished_reason, req.finished_len = list(range(8)), None, None, None
    req.vocab_size, req.eos_token_ids, req.tokenizer = 4096, set(), None
    req.sampling_params = types.SimpleNamespace(max_new_tokens=10, ignore_eos=False, stop_token_ids=set(), stop_strs=[],
                                                stop_regex_strs=[])
    accepted = list(range(100, 106))
    req.output_ids.extend(accepted)  # batch_result_processor.py:1045-1049
    req.update_finish_state(len(accepted))
    print(f"   SGLang update_finish_state: output_ids holds {len(req.output_ids)}, finished_len {req.finished_len}, "
          f"reason {type(req.finished_reason).__name__}, "
          f"output_ids_through_stop ends {list(req.output_ids_through_stop)[-3:]}")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vllm", required=True, type=Path, help="the vllm package directory (from the wheel)")
    ap.add_argument("--sglang", required=True, type=Path, help="the sglang package directory (from the wheel)")
    args = ap.parse_args()
    print(f"vLLM from {args.vllm.name}/ (0.33.0 wheel), SGLang from {args.sglang.name}/ (0.5.23 wheel), "
          f"torch {torch.__version__}")
    part_a(args.vllm, args.sglang)
    part_b(args.vllm)
    part_c(args.vllm, args.sglang)
    return 0


if __name__ == "__main__":
    sys.exit(main())
