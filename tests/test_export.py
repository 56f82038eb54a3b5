"""Serving-ready exports (dflash2-export): the shipped configs read and write back byte-identical, the writer refuses
(or faithfully rewrites) what an engine would misread, and the engines' own config readers and weight names
(tests/engines.py, marker `engines`) read the shipped and freshly trained drafters as we run them."""
import dataclasses
import json
from pathlib import Path

import pytest
import torch

import engines
from dflash2 import export
from dflash2.checkpoint import DFlash2Config
from dflash2.dspark import DSparkConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "dflash2" / "checkpoints").glob("*/config.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_configs_write_back_byte_identical(path):
    text = path.read_text()
    cls = DSparkConfig if json.loads(text)["architectures"] == ["Qwen3DSparkModel"] else DFlash2Config
    assert json.dumps(cls.from_dict(json.loads(text)).to_dict(), indent=2) + "\n" == text


def test_engine_draft_tokens_and_block_size_refusal():
    d = DFlash2Config.from_dict(json.loads(SHIPPED[0].read_text()))
    s = DSparkConfig.from_dict(json.loads(SHIPPED[1].read_text()))
    assert (d.block_size, d.engine_draft_tokens()) == (8, (8, 7))  # the card's --speculative-num-draft-tokens 8
    assert (s.block_size, s.engine_draft_tokens()) == (7, (8, 7))
    with pytest.raises(ValueError, match=r"^DFlash2Config\.block_size: 1 gives vLLM num_speculative_tokens 0"):
        dataclasses.replace(d, block_size=1).for_engines()
    with pytest.raises(ValueError, match=r"^DSparkConfig\.block_size: 0 gives vLLM num_speculative_tokens 0"):
        dataclasses.replace(s, block_size=0).for_engines()


def test_writer_refuses_taps_and_mask_tokens_outside_the_target(tmp_path):
    d = DFlash2Config.from_dict(json.loads(SHIPPED[0].read_text()))
    assert d.for_engines(30, 49152) == (d, None)
    with pytest.raises(ValueError, match=r"^DFlash2Config\.target_layer_ids: \[1, 8, 14, 21, 27\] .* which has 24"):
        d.for_engines(target_layers=24)
    with pytest.raises(ValueError, match=r"^DFlash2Config\.target_layer_ids: \[1, 30\]"):
        dataclasses.replace(d, target_layer_ids=[1, 30]).for_engines()
    with pytest.raises(ValueError, match=r"^DFlash2Config\.vocab_size: 49152, but the target's vocabulary has 32000"):
        d.for_engines(target_vocab=32000)
    with pytest.raises(ValueError, match=r"^DSparkConfig\.mask_token_id: 49152"):
        dataclasses.replace(DSparkConfig.from_dict(json.loads(SHIPPED[1].read_text())), mask_token_id=49152).for_engines()
    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 24, "vocab_size": 49152}))
    with pytest.raises(SystemExit, match="target_layer_ids"):  # the command says it in one line
        export.main(["dflash2-smollm2-135m", str(tmp_path / "out-dflash2"), "--target-config", str(tmp_path)])
    assert not (tmp_path / "out-dflash2").exists()


def windowless(d, **edits):
    """The shipped DFlash 2 config with its sliding layers' window flag off (and edits)."""
    return dataclasses.replace(d, use_sliding_window=False, **edits)


def test_sliding_layers_without_a_window_are_rewritten_with_their_causality_or_refused():
    """Both engines refuse a sliding layer with no window; we run it as full attention, causal as layer_causal says.
    The rewrite keeps (window, causal) of every layer; mixed causality has no single is_causal, so it is refused."""
    d = DFlash2Config.from_dict(json.loads(SHIPPED[0].read_text()))
    for config in (windowless(d), windowless(d, is_causal=None), windowless(d, is_causal=True),
                   dataclasses.replace(d, sliding_window=None, is_causal=None)):
        written, note = config.for_engines()
        assert "written as full_attention" in note and written.layer_types == ["full_attention"] * 2
        assert written.is_causal is not None
        n = config.num_hidden_layers
        read_back = DFlash2Config.from_dict(written.to_dict())
        assert [(read_back.layer_window(i), read_back.layer_causal(i)) for i in range(n)] == \
               [(config.layer_window(i), config.layer_causal(i)) for i in range(n)]
    with pytest.raises(ValueError, match=r"^DFlash2Config\.use_sliding_window: layers \[0\]"):
        windowless(d, is_causal=None, layer_types=["sliding_attention", "full_attention"]).for_engines()
    s = DSparkConfig.from_dict(json.loads(SHIPPED[1].read_text()))
    written, note = dataclasses.replace(s, layer_types=["sliding_attention"] * 2).for_engines()
    assert written.layer_types == ["full_attention"] * 2 and "bidirectional" in note
    with pytest.raises(ValueError, match=r"^DSparkConfig\.layer_types: .* causal"):
        dataclasses.replace(s, layer_types=["sliding_attention"] * 2, use_sliding_window=True,
                            sliding_window=64).for_engines()


def test_export_writes_the_shipped_bytes_a_readme_and_refuses_a_misread_path(tmp_path, capsys):
    for name, out in (("dflash2-smollm2-135m", "smollm2-dflash2"), ("dspark-smollm2-135m", "smollm2-ds")):
        export.main([name, str(tmp_path / out)])
        shipped = ROOT / "dflash2" / "checkpoints" / name
        assert sorted(p.name for p in (tmp_path / out).iterdir()) == ["README.md", "config.json", "model.safetensors"]
        for f in ("config.json", "model.safetensors"):
            assert (tmp_path / out / f).read_bytes() == (shipped / f).read_bytes()
        text = (tmp_path / out / "README.md").read_text()
        sglang, vllm = capsys.readouterr().out.splitlines()[1:]
        assert sglang.removeprefix("SGLang: ") in text and vllm.removeprefix("vLLM:   ") in text
        assert "HuggingFaceTB/SmolLM2-135M-Instruct" in text and "block size" in text
    assert "--speculative-algorithm DFLASH --speculative-draft-attention-backend fa4" in (
        tmp_path / "smollm2-dflash2" / "README.md").read_text()
    assert '"method": "dspark"' in (tmp_path / "smollm2-ds" / "README.md").read_text()
    for bad in ("dflash-runs/smollm2", "EAGLE3-x/smollm2"):
        with pytest.raises(SystemExit, match="vLLM reads a drafter under this path as method"):
            export.main(["dspark-smollm2-135m", str(tmp_path / bad)])
        assert not (tmp_path / bad).exists()
    with pytest.raises(SystemExit, match="'eagle'"):
        export.main(["dflash2-smollm2-135m", str(tmp_path / "my-eagle-dflash2")])
    with pytest.raises(SystemExit, match="as method None, not 'dflash'.*must contain 'dflash'"):
        export.main(["dflash2-smollm2-135m", str(tmp_path / "smollm2-d2")])


# ---- the engines' own readers (tests/engines.py): vLLM 0.33.0 and SGLang 0.5.23 from their wheels ----

def trained(root, arch):
    """`train train --steps 2` on the tiny test pair (tests/test_train.py's), then exported: the served directory."""
    from tiny_tokenizer import tiny_tokenizer

    from dflash2 import distill, train
    from targets import tiny_target

    model = tiny_target("llama", vocab=64, hidden=32, layers=3)
    if not (root / "target").exists():
        model.save_pretrained(root / "target")
        tiny_tokenizer(64).save_pretrained(root / "target")
        prompts = [[1 + i, 5, 9, 2 + i] for i in range(4)]
        rows = distill.generate_with_features(model, prompts, [0, 2], 16, stop_ids=set(), pad_id=0)
        (root / "data").mkdir()
        torch.save({"ids": [r[0] for r in rows], "features": [r[1] for r in rows],
                    "prompt_lens": [len(p) for p in prompts]}, root / "data" / "shard_00000.pt")
        (root / "data" / "meta.json").write_text(json.dumps({"target": str(root / "target"), "taps": [0, 2]}))
    run = root / f"run-{arch}"
    run.mkdir()
    (run / "data").symlink_to(root / "data")
    train.main(["train", "--out", str(run), "--arch", arch, "--steps", "2", "--batch-seqs", "2", "--anchors", "4",
                "--block-size", "4", "--layers", "2", "--intermediate-size", "32", "--rank", "8", "--top-k", "4",
                "--mask-token-id", "63", "--no-bf16", "--threads", "1", "--save-every", "2"])
    out = root / f"tiny-{arch}"
    export.main([str(run / "drafter"), str(out), "--target", str(root / "target"), "--target-config", str(root / "target")])
    return out


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """{name: (served directory, target layers, target vocab)}: both shipped drafters and two freshly trained."""
    root = tmp_path_factory.mktemp("served")  # a path without "dflash": vLLM reads the whole path
    for name, out in (("dflash2-smollm2-135m", "smollm2-dflash2"), ("dspark-smollm2-135m", "smollm2-ds")):
        export.main([name, str(root / out)])
    return {"shipped DFlash 2": (root / "smollm2-dflash2", 30, 49152), "shipped DSpark": (root / "smollm2-ds", 30, 49152),
            "trained DFlash 2": (trained(root, "dflash2"), 3, 64), "trained DSpark": (trained(root, "dspark"), 3, 64)}


def ours(directory):
    d = json.loads((Path(directory) / "config.json").read_text())
    return (DSparkConfig if d["architectures"] == ["Qwen3DSparkModel"] else DFlash2Config).from_dict(d)


@pytest.mark.engines
@pytest.mark.parametrize("name", ["shipped DFlash 2", "shipped DSpark", "trained DFlash 2", "trained DSpark"])
def test_engines_read_our_drafters_as_we_do(served, name):
    """vLLM's path guess, architecture, per-layer (window, causal), captured target layers (the tap + 1: index 0 is
    the embedding), draft-token counts, and every tensor name mapped onto the engine's modules, against ours."""
    directory, layers, vocab = served[name]
    config, seen = ours(directory), engines.read(directory, layers, vocab)
    n = config.num_hidden_layers
    method = "dspark" if isinstance(config, DSparkConfig) else "dflash"
    assert seen["vllm_method"] == method
    assert seen["vllm_arch"][1][0] == ("qwen3_dspark" if method == "dspark" else "qwen3_dflash2")
    assert seen["vllm_layers"] == [(config.layer_window(i), config.layer_causal(i)) for i in range(n)]
    assert seen["sglang_layers"] == [(-1 if config.layer_window(i) is None else config.layer_window(i) - 1,
                                      "causal" if config.layer_causal(i) else "bidirectional") for i in range(n)]
    assert seen["vllm_capture"] == seen["sglang_capture"] == [i + 1 for i in config.target_layer_ids]
    assert (seen["sglang_draft_tokens"], seen["vllm_num_speculative_tokens"]) == config.engine_draft_tokens()
    assert seen["unmapped"] == {"vllm": [], "sglang": []}


@pytest.mark.engines
def test_engines_refuse_the_planted_bad_drafters(served, tmp_path_factory, capsys):
    """The engine check fails where an engine would: a sliding layer with no window flag (both refuse it; our
    writer's rewrite they accept, with our causality), a DSpark drafter under a path vLLM takes for DFlash, and a
    tensor no engine module holds."""
    import shutil

    root = tmp_path_factory.mktemp("planted")
    good, layers, vocab = served["shipped DFlash 2"]
    bad = root / "smollm2-dflash2-windowless"
    shutil.copytree(good, bad)
    d = json.loads((bad / "config.json").read_text())
    (bad / "config.json").write_text(json.dumps({**d, "use_sliding_window": False}))
    with pytest.raises(ValueError, match="window"):
        engines.read(bad, layers, vocab)
    export.main([str(bad), str(root / "smollm2-dflash2-rewritten")])
    assert capsys.readouterr().err.count("written as full_attention with is_causal False") == 1
    seen = engines.read(root / "smollm2-dflash2-rewritten", layers, vocab)
    assert seen["vllm_layers"] == [(None, False)] * 2 and seen["sglang_layers"] == [(-1, "bidirectional")] * 2

    dspark, _, _ = served["shipped DSpark"]
    misread = root / "dflash-exports" / "smollm2-ds"
    shutil.copytree(dspark, misread)
    with pytest.raises(ValueError, match="DFlashQwen3DSparkModel"):
        engines.read(misread, layers, vocab)
    assert engines.read(misread, layers, vocab, method="dspark")["vllm_method"] == "dspark"  # naming it works

    from safetensors.torch import load_file, save_file
    state = load_file(dspark / "model.safetensors")
    renamed = root / "smollm2-renamed"
    shutil.copytree(dspark, renamed)
    state["markov_head.bigram.weight"] = state.pop("markov_head.markov_w1.weight")
    save_file(state, renamed / "model.safetensors")
    assert engines.read(renamed, layers, vocab)["unmapped"] == {"vllm": ["markov_head.bigram.weight"],
                                                                "sglang": ["markov_head.bigram.weight"]}


@pytest.mark.engines
@pytest.mark.parametrize("arch", ["DFlash2DraftModel", "Qwen3DSparkModel"])
@pytest.mark.parametrize("path", ["/srv/smollm2-dflash2", "/home/u/dflash2-ref/serve/smollm2-dspark", "/srv/EAGLE3-x/d",
                                  "/srv/my-eagle-dflash2", "/srv/smollm2-d2", "/srv/DSpark-x", "relative/x"])
def test_our_reading_of_vllms_path_guess_is_vllms(path, arch):
    """export.vllm_method_from_path, which the writer's refusal uses, against vLLM's own if-chain (None: it raises)."""
    import types

    draft = types.SimpleNamespace(model=path, architectures=[arch], hf_config=types.SimpleNamespace(model_type="qwen3"))
    try:
        theirs = engines.engines().guess(types.SimpleNamespace(method=None, draft_model_config=draft), False)
    except NotImplementedError:
        theirs = None
    assert export.vllm_method_from_path(path, arch) == theirs
