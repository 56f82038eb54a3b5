"""DFlash 2 speculative decoding, the reference implementation in pure PyTorch.

The public API, for programs and for other implementations' test suites (an oracle):

    pair = dflash2.load_pair()                                # embedded SmolLM2-135M + drafter; or dirs/hub ids
    ids = dflash2.encode_prompt(pair.tokenizer, "What is 7 * 8?")
    stops = dflash2.stop_token_ids(pair.target.model, pair.tokenizer)
    [res] = dflash2.generate(pair.target, pair.drafter, [ids], dflash2.DecodeSettings(max_new_tokens=64, stop_ids=stops))
    res.tokens, res.accepted, res.acceptance_length

Names are imported on first use, so `import dflash2` (and the CLI's --help) does not import torch.
"""

_API = {
    # checkpoint, drafter and selector (SPEC §1-4)
    "DFlash2Drafter": "model", "CandidateSelector": "model", "DynamicConv": "model",
    "DFlash2Config": "checkpoint", "CheckpointError": "checkpoint", "load_drafter": "model",
    # the loop and its math (SPEC §5)
    "generate": "spec_decode", "Result": "results", "Target": "target", "DecodeSettings": "settings", "draft": "proposers",
    "select_path": "proposers", "process_logits": "verify", "verify_greedy": "verify",
    "verify_sampled": "verify", "compile_core": "spec_decode",
    # a target and its drafter together
    "Pair": "pair", "load_pair": "pair", "check_pair": "pair", "load_target": "pair",
    "stop_token_ids": "pair", "encode_prompt": "prompts",
    # step traces: write, read, compare, replay
    "TRACE_FORMAT": "trace", "run": "trace", "read_trace": "trace", "compare_traces": "trace",
    "check_trace": "trace", "step_records": "trace",
    # names and checks that need no torch
    "METHODS": "settings", "DEFAULT_DRAFT": "settings", "DEFAULT_TARGET": "settings", "InputError": "settings",
    "LoadError": "settings", "check_sampling_params": "settings",
}
__all__ = sorted(_API)
__version__ = "0.2.0"


def __getattr__(name):
    if name not in _API:
        raise AttributeError(f"module 'dflash2' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{_API[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + __all__)
