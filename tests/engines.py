"""vLLM 0.33.0's and SGLang 0.5.23's own code for reading a drafter directory, run on a CPU.

The wheels are downloaded once (`pip download --no-deps`) into ~/.cache/dflash2-ref/wheels and the few source
files used here unzipped beside them. Functions are taken from those files by name (Python's ast) and executed
as written, with their own file names and line numbers; only their imports are supplied (transformers' classes,
stubs for names the drafters here never reach). Nothing is imported from the vllm or sglang packages, which need
CUDA. `read(directory)` returns what each engine makes of a drafter: the method vLLM guesses from the path, the
architecture it resolves, each layer's (window, causal), the target layers it captures, the draft-token counts,
and the checkpoint tensor names that match no attribute of the engine's modules.
"""
import __future__
import ast
import collections.abc
import json
import logging
import numbers
import os
import re
import subprocess
import sys
import types
import typing
import zipfile
from pathlib import Path

import pytest

WHEELS = {"vllm": "vllm==0.33.0", "sglang": "sglang==0.5.23"}
CACHE = Path(os.environ.get("DFLASH2_WHEELS", Path.home() / ".cache" / "dflash2-ref" / "wheels"))
FILES = {
    "vllm": ["config/speculative.py", "model_executor/models/registry.py", "model_executor/models/qwen3_dflash.py",
             "model_executor/models/qwen3_dflash2.py", "model_executor/models/qwen3_dspark.py",
             "model_executor/models/qwen2.py", "model_executor/models/qwen3.py",
             "transformers_utils/configs/eagle.py", "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py"],
    "sglang": ["srt/speculative/dflash_utils.py", "srt/speculative/dspark_components/dspark_config.py",
               "srt/models/dflash.py", "srt/models/dspark.py", "srt/models/llama.py", "srt/models/qwen2.py"],
}


def sources():
    """{engine: its unzipped package directory}, downloading the wheels on first use; skips when offline."""
    out = {}
    for engine, spec in WHEELS.items():
        root = CACHE / spec.replace("==", "-")
        if not all((root / engine / f).is_file() for f in FILES[engine]):
            wheel = next(CACHE.glob(f"{spec.replace('==', '-')}-*.whl"), None)
            if wheel is None:
                CACHE.mkdir(parents=True, exist_ok=True)
                cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "--retries", "1", "--timeout", "15",
                       "-d", str(CACHE), spec]
                run = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
                wheel = next(CACHE.glob(f"{spec.replace('==', '-')}-*.whl"), None)
                if wheel is None:
                    pytest.skip(f"cannot download the {spec} wheel (offline?): {run.stderr.strip()[-300:]}")
            with zipfile.ZipFile(wheel) as z:
                for f in FILES[engine]:
                    z.extract(f"{engine}/{f}", root)
        out[engine] = root / engine
    return out


def pull(path, names, namespace, cls=None, method=None):
    """Execute the top-level definitions `names` of `path` (of class `cls` if given) in `namespace`, as written,
    compiled with the file's own name and line numbers. Returns the namespace."""
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
    assert not missing, f"{path}: not found: {sorted(missing)}"
    code = compile(ast.Module(body=nodes, type_ignores=[]), str(path), "exec",
                   flags=__future__.annotations.compiler_flag, dont_inherit=True)
    exec(code, namespace)
    return namespace


def vllm_method_guess(vl):
    """vLLM's `Automatically detect the method` if-chain from SpeculativeConfig.__post_init__, as written, wrapped
    in a function of (self, using_transformers_mtp) that returns self.method."""
    path = vl / "config/speculative.py"
    tree = ast.parse(path.read_text())
    chain = next(n for n in ast.walk(tree) if isinstance(n, ast.If) and "'dspark'" in ast.unparse(n.test)
                 and "self.method in" in ast.unparse(n.test) and isinstance(n.body[0], ast.Pass))
    fn = ast.FunctionDef(name="guess", args=ast.arguments(posonlyargs=[], args=[ast.arg("self"),
                         ast.arg("using_transformers_mtp")], kwonlyargs=[], kw_defaults=[], defaults=[]),
                         body=[chain, ast.Return(ast.parse("self.method").body[0].value)], decorator_list=[],
                         returns=None, type_params=[])
    ns = {"get_args": typing.get_args, "Literal": typing.Literal, "logger": logging.getLogger("vllm")}
    pull(path, ["MTPModelTypes", "_QWEN3_OMNI_DSPARK_ARCHITECTURE", "_MUSE_SPARK_DSPARK_ARCHITECTURE"], ns)
    exec(compile(ast.fix_missing_locations(ast.Module(body=[fn], type_ignores=[])), str(path), "exec",
                 flags=__future__.annotations.compiler_flag, dont_inherit=True), ns)
    return ns["guess"]


def literal(path, name, cls=None):
    """The literal value assigned to `name` (at top level, in class `cls`, or anywhere as a keyword argument)."""
    tree = ast.parse(Path(path).read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
        if isinstance(node, ast.keyword) and node.arg == name:
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path}: no literal {name}")


def attributes(*paths):
    """Every `self.<name> = ...` attribute the classes of these files set: the engine's module and parameter names."""
    names = set()
    for path in paths:
        for node in ast.walk(ast.parse(Path(path).read_text())):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
            names |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                      and t.value.id == "self"}
    return names


def unmapped(names, stacked, attrs):
    """Tensor names with a component that is no attribute of the engine's modules, after its stacked renames
    (q_proj -> qkv_proj, ...); layer indices and the parameters' own weight/bias are not components."""
    bad = []
    for name in names:
        for old, new in stacked:
            name = name.replace(old, new)
        parts = [p for p in name.split(".")[:-1] if not p.isdigit()]
        if not all(p in attrs for p in parts):
            bad.append(name)
    return bad


class Struct:
    """msgspec.Struct's keyword constructor, for SGLang's config records (msgspec needs no install here)."""

    def __init_subclass__(cls, **kwargs):
        pass

    def __init__(self, **kw):
        self.__dict__.update(kw)


def load_engines():
    """The engines' functions, pulled once per process."""
    from transformers import AutoConfig, DeepseekV2Config, PreTrainedConfig, Qwen3Config

    src = sources()
    vl, sg = src["vllm"], src["sglang"]
    v = {"Qwen3Config": Qwen3Config, "get_current_vllm_config": lambda: types.SimpleNamespace(use_v2_model_runner=True)}
    pull(vl / "model_executor/models/qwen3_dflash.py", ["_SLIDING_ATTENTION", "_dflash_layer_causal",
                                                         "_resolve_layer_attention"], v)
    pull(vl / "v1/worker/gpu/spec_decode/eagle/eagle3_utils.py", ["get_eagle3_aux_layers_from_config"], v)
    e = {"AutoConfig": AutoConfig, "DeepseekV2Config": DeepseekV2Config, "PreTrainedConfig": PreTrainedConfig, "os": os,
         "without_trust_remote_code": lambda kwargs: kwargs}
    pull(vl / "transformers_utils/configs/eagle.py", ["EAGLEConfig"], e)
    stacked_v = literal(vl / "model_executor/models/qwen3_dflash.py", "orig_to_new_stacked")
    models = vl / "model_executor/models"
    s = {"Sequence": collections.abc.Sequence, "Integral": numbers.Integral, "Any": object, "Optional": typing.Optional, "List": list,
         "Tuple": tuple, "dataclass": __import__("dataclasses").dataclass, "msgspec": types.SimpleNamespace(Struct=Struct),
         "AttentionType": types.SimpleNamespace(DECODER="causal", ENCODER_ONLY="bidirectional"),
         "logger": logging.getLogger("sglang")}
    pull(sg / "srt/speculative/dflash_utils.py", [
        "DEFAULT_DFLASH_MASK_TOKEN", "_cfg_get", "_get_text_config", "_get_dflash_config", "is_nemotron_35_draft_config",
        "get_dflash_layer_types", "get_dflash_attention_sliding_window_size", "_parse_optional_int",
        "build_target_layer_ids", "DFlashDraftConfig", "parse_dflash_draft_config"], s)
    pull(sg / "srt/models/dflash.py", ["_get_dflash_attention_type", "_get_dflash_layer_attention_params"], s)
    d = dict(s, parse_dflash_draft_config=s["parse_dflash_draft_config"])
    pull(sg / "srt/speculative/dspark_components/dspark_config.py", [
        "SUPPORTED_DSPARK_MARKOV_HEAD_TYPES", "dspark_gamma_from_num_draft_tokens", "DSparkDraftConfig",
        "DSparkRuntimeConfig", "resolve_runtime_config", "_cfg_get", "_get_text_config", "_get_nested_config",
        "_get_dspark_config", "parse_dspark_draft_config"], d)
    capture = pull(sg / "srt/models/llama.py", ["set_dflash_layers_to_capture"], {}, cls="LlamaForCausalLM")
    stacked_s = [(f".{w}.", f".{p}.") for p, w, _ in literal(sg / "srt/models/dflash.py", "stacked_params_mapping")]
    return types.SimpleNamespace(
        guess=vllm_method_guess(vl), v=v, e=e, s=s, d=d, capture=capture["set_dflash_layers_to_capture"],
        registry=literal(models / "registry.py", "_SPECULATIVE_DECODING_MODELS"),
        stacked_v=[(old + ".", new + ".") for old, (new, _) in stacked_v.items()], stacked_s=stacked_s,
        attrs={("vllm", "dflash"): attributes(*(models / f for f in ("qwen3_dflash.py", "qwen3_dflash2.py", "qwen2.py",
                                                                      "qwen3.py"))),
               ("vllm", "dspark"): attributes(*(models / f for f in ("qwen3_dflash.py", "qwen3_dspark.py", "qwen2.py",
                                                                      "qwen3.py"))),
               ("sglang", "dflash"): attributes(sg / "srt/models/dflash.py", sg / "srt/models/qwen2.py"),
               ("sglang", "dspark"): attributes(sg / "srt/models/dflash.py", sg / "srt/models/dspark.py",
                                                sg / "srt/models/qwen2.py")})


_ENGINES = None


def engines():
    global _ENGINES
    if _ENGINES is None:
        _ENGINES = load_engines()
    return _ENGINES


def read(directory, target_layers, target_vocab, method=None):
    """What vLLM and SGLang make of the drafter at directory, served beside a target with target_layers layers and
    target_vocab tokens. method: what the command names (None: vLLM guesses it from the path). Raises what the
    engines raise."""
    from safetensors import safe_open
    from transformers import AutoConfig

    eng = engines()
    directory = Path(directory).resolve()
    raw = json.loads((directory / "config.json").read_text())
    with safe_open(directory / "model.safetensors", "pt") as f:
        names = sorted(f.keys())
    hf = AutoConfig.from_pretrained(directory)  # both engines' reading of a model_type qwen3 draft
    draft = types.SimpleNamespace(model=str(directory), architectures=list(hf.architectures), hf_config=hf)
    chosen = eng.guess(types.SimpleNamespace(method=method, draft_model_config=draft), False)
    out = {"vllm_method": chosen}
    if chosen in ("eagle", "eagle3", "dflash"):  # config/speculative.py:1514-1531
        hf = eng.e["EAGLEConfig"](hf, method=chosen, model_type="eagle")
    arch = hf.architectures[0]
    if arch not in eng.registry:
        raise ValueError(f"vLLM: architecture {arch!r} (method {chosen!r}) is not a registered speculative model")
    out["vllm_arch"] = (arch, eng.registry[arch])
    n = raw["num_hidden_layers"]
    out["vllm_layers"] = [eng.v["_resolve_layer_attention"](hf, i) for i in range(n)]
    spec = types.SimpleNamespace(draft_model_config=types.SimpleNamespace(hf_config=hf))
    out["vllm_capture"] = list(eng.v["get_eagle3_aux_layers_from_config"](spec))

    sg_hf = AutoConfig.from_pretrained(directory)
    out["sglang_layers"] = [eng.s["_get_dflash_layer_attention_params"](sg_hf, i) for i in range(n)]
    captured = types.SimpleNamespace(pp_group=types.SimpleNamespace(is_last_rank=True), model=types.SimpleNamespace())
    if raw["architectures"] == ["Qwen3DSparkModel"]:
        parsed = eng.d["parse_dspark_draft_config"](draft_hf_config=sg_hf)
        runtime = eng.d["resolve_runtime_config"](draft_hf_config=sg_hf, speculative_num_draft_tokens=None,
                                                  target_vocab_size=target_vocab)
        out["sglang_draft_tokens"] = runtime.verify_num_draft_tokens  # what --speculative-num-draft-tokens must say
        taps, kind = parsed.target_layer_ids, "dspark"
        out["vllm_num_speculative_tokens"] = getattr(hf, "block_size", None)  # config/speculative.py:1593-1601
    else:
        parsed = eng.s["parse_dflash_draft_config"](draft_hf_config=sg_hf)
        out["sglang_draft_tokens"] = parsed.resolve_block_size(default=16)  # dflash_worker_v2.py:507-520
        taps, kind = parsed.resolve_target_layer_ids(target_num_layers=target_layers), "dflash"
        out["vllm_num_speculative_tokens"] = out["sglang_draft_tokens"] - 1  # 1 + drafts per request (v1/spec_decode/dflash.py:126)
        if parsed.mask_token_id is not None and not 0 <= parsed.mask_token_id < target_vocab:
            raise ValueError(f"SGLang: mask_token_id {parsed.mask_token_id} outside the target vocabulary")
    eng.capture(captured, taps)
    out["sglang_capture"] = captured.model.layers_to_capture
    out["unmapped"] = {e: unmapped(names, eng.stacked_v if e == "vllm" else eng.stacked_s, eng.attrs[(e, kind)])
                       for e in ("vllm", "sglang")}
    return out
