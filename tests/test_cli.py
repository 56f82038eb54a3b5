"""The command line end to end on the tiny golden pair: reports, streaming, and one clear line per bad input."""
import argparse
import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash2_ref
from dflash2 import policy, settings
from dflash2.model import DFlash2Drafter
from targets import synthetic_costs, tiny_glm_config

ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
PAIR = ["--target", str(GOLDEN / "target"), "--draft", str(GOLDEN / "draft")]
JSON_KEYS = {"text", "completion_tokens", "verify_steps", "acceptance_length", "tokens_per_s", "method", "target",
             "draft"}


def cli(capsys, *argv):
    rc = dflash2_ref.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def drafter_dir(directory, **overrides):
    """A drafter shaped like the golden one, with some fields changed to make it not fit the target."""
    base = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, vocab_size=64, num_target_layers=3, target_layer_ids=[0, 1],
                mask_token_id=63, layer_types=["sliding_attention"], block_size=6, selector_top_k=4,
                conv_group_size=8, selector_rank=8)
    torch.manual_seed(0)
    DFlash2Drafter(tiny_glm_config(**{**base, **overrides})).save_pretrained(directory)
    return str(directory)


def test_greedy_baseline_json_reports_identical_outputs(capsys):
    rc, out, err = cli(capsys, *PAIR, "--prompt", "the time of day", "--max-new-tokens", "12", "--baseline", "--json")
    assert rc == 0, err
    report = json.loads(out)  # exactly one JSON object on stdout
    assert set(report) >= JSON_KEYS | {"ar_text", "ar_tokens_per_s", "speedup", "identical"}
    assert report["identical"] is True and report["text"] == report["ar_text"]
    assert report["method"] == "dflash2" and report["draft"] == str(GOLDEN / "draft")
    assert 1 <= report["acceptance_length"] <= 6
    # the authors' definition: tokens per decode step, the prefill (step 1 of verify_steps) and its token excluded
    assert ((report["completion_tokens"] - 1) / (report["verify_steps"] - 1)
            == pytest.approx(report["acceptance_length"]))


@pytest.mark.parametrize("method", ["dflash2", "dflash", "ar"])
def test_streamed_text_is_the_decoded_completion(capsys, method):
    rc, out, err = cli(capsys, *PAIR, "--prompt", "what is it", "--max-new-tokens", "10", "--method", method,
                       "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "5", "--block-size", "4")
    assert rc == 0, err
    rc, js, _ = cli(capsys, *PAIR, "--prompt", "what is it", "--max-new-tokens", "10", "--method", method,
                    "--temperature", "0.8", "--top-p", "0.9", "--top-k", "20", "--seed", "5", "--block-size", "4",
                    "--json")
    assert out == json.loads(js)["text"] + "\n"
    assert f"[{method}]" in err and "acceptance_length" in err and "tokens_per_s" in err


def test_system_message_and_raw_completion_change_the_prompt(capsys):
    runs = [cli(capsys, *PAIR, "--prompt", "the", "--max-new-tokens", "6", "--json", *extra)
            for extra in ([], ["--system", "you are a thing"], ["--no-chat-template"])]
    assert all(rc == 0 for rc, _, _ in runs)
    assert len({json.loads(out)["text"] for _, out, _ in runs}) > 1


def test_prompt_file_is_the_same_prompt(capsys, tmp_path):
    (tmp_path / "p.txt").write_text("the time of day")
    _, from_file, _ = cli(capsys, *PAIR, "--prompt-file", str(tmp_path / "p.txt"), "--max-new-tokens", "6", "--json")
    _, from_flag, _ = cli(capsys, *PAIR, "--prompt", "the time of day", "--max-new-tokens", "6", "--json")
    assert json.loads(from_file)["text"] == json.loads(from_flag)["text"]


def test_command_line_subprocess():
    """The real entry point: one JSON object on stdout, nothing on stderr, and exit 2 for a bad setting (a fixed
    block: a subprocess would measure this machine's costs under the policy)."""
    cmd = [sys.executable, "dflash2_ref.py", *PAIR, "--prompt", "the time", "--max-new-tokens", "8", "--block-size", "4"]
    ok = subprocess.run(cmd + ["--baseline", "--json"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["identical"] is True
    assert ok.stderr == ""
    bad = subprocess.run(cmd + ["--temperature", "-1"], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()] and "--temperature" in bad.stderr


def bad_inputs(tmp):
    corrupt = tmp / "corrupt"
    shutil.copytree(GOLDEN / "draft", corrupt)
    (corrupt / "model.safetensors").write_bytes(b"not a safetensors file")
    bad_json = tmp / "bad_json"
    shutil.copytree(GOLDEN / "draft", bad_json)
    (bad_json / "config.json").write_text("{ not json")
    (tmp / "empty").mkdir()
    return [
        # (argv, exit code, phrase of the one error line)
        (["--prompt", "  "], 2, "prompt is empty"),
        ([], 2, "--prompt"),
        (["--prompt", "the " * 600], 2, "prompt too long"),
        (["--prompt", "the", "--max-new-tokens", "600"], 2, "prompt too long"),
        (["--prompt", "the", "--temperature", "-0.5"], 2, "--temperature must be >= 0"),
        (["--prompt", "the", "--top-p", "0"], 2, "--top-p must be in (0, 1]"),
        (["--prompt", "the", "--top-p", "1.5"], 2, "--top-p must be in (0, 1]"),
        (["--prompt", "the", "--top-k", "-1"], 2, "--top-k must be >= 0"),
        (["--prompt", "the", "--temperature", "warm"], 2, "--temperature"),
        (["--prompt-file", str(tmp / "missing.txt")], 2, "--prompt-file"),
        (["--prompt", "the", "--prompt-file", str(tmp / "missing.txt")], 2, "not both"),
        (["--prompt", "the", "--block-size", "7"], 2, "larger than the drafter's block size 6"),
        (["--prompt", "the", "--block-size", "1"], 2, "--block-size must be >= 2"),
        (["--prompt", "the", "--method", "dflash2-tree", "--tree-budget", "0"], 2, "--tree-budget must be >= 1"),
        (["--prompt", "the", "--dspark-threshold", "1.5"], 2, "--dspark-threshold must be in [0, 1]"),
        (["--prompt", "the", "--dspark-threshold", "0.5"], 2, "--dspark-threshold is DSpark's cut: it needs method"),
        (["--prompt", "the", "--device", "tpu9"], 2, "--device 'tpu9' is not usable"),
        (["--prompt", "the", "--draft", drafter_dir(tmp / "h", hidden_size=48)], 2,
         "hidden_size 48 does not match the target's 32"),
        (["--prompt", "the", "--draft", drafter_dir(tmp / "v", vocab_size=128)], 2,
         "vocab_size 128 does not match the target's LM head (64 rows)"),
        (["--prompt", "the", "--draft", drafter_dir(tmp / "l", num_target_layers=9, target_layer_ids=[1, 5])], 2,
         "target_layer_ids [5] do not exist in a target with 3 layers"),
        (["--prompt", "the", "--draft", str(tmp / "missing")], 2, "no such checkpoint directory"),
        (["--prompt", "the", "--draft", str(corrupt)], 1, "cannot load drafter"),
        (["--prompt", "the", "--draft", str(bad_json)], 1, "config.json is not readable JSON"),
        (["--prompt", "the", "--draft", str(tmp / "empty")], 2, "no config.json"),
        (["--prompt", "the", "--target", str(tmp / "missing"), "--draft", str(GOLDEN / "draft")], 2,
         "no such model directory"),
        (["--check-trace", str(tmp / "missing.jsonl")], 2, "not a readable JSON Lines trace"),
        (["--prompt", "the", "--trace", str(tmp / "missing" / "t.jsonl")], 2, "its folder does not exist"),
        (["--prompt", "the", "--attn-backend", "flash"], 2, "attention backend 'flash' cannot run on cpu"),
        (["--prompt", "the", "--attn-backend", "flex", "--compile"], 2, "'flex' cannot be compiled into the drafter on CPU"),
    ]


def _command_lines():
    from dflash2 import bench, train
    yield "dflash2-ref", dflash2_ref.build_parser()
    yield "dflash2-bench", bench.build_parser()
    sub = next(a for a in train.build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    for name, parser in sub.choices.items():
        yield f"dflash2-train {name}", parser


def test_every_option_is_documented_with_its_default():
    """All three command lines: every option has a help text, and the text shows the default where there is one."""
    seen = set()
    for name, parser in _command_lines():
        seen.add(name)
        formatter = parser._get_formatter()
        for action in parser._actions:
            if not action.option_strings or isinstance(action, argparse._HelpAction):
                continue
            assert action.help, f"{name} {action.option_strings[0]} has no help text"
            if action.default not in (None, False, [], argparse.SUPPRESS):
                assert "default" in formatter._get_help_string(action), f"{name} {action.option_strings[0]}"
        text = parser.format_help()  # every %(default)s expands
        assert "%(" not in text
    assert seen == {"dflash2-ref", "dflash2-bench", "dflash2-train data", "dflash2-train prompts",
                    "dflash2-train train", "dflash2-train plot", "dflash2-train run"}
    concurrency = next(a for a in dict(_command_lines())["dflash2-bench"]._actions if a.dest == "concurrency")
    assert "(default: 1,8,32)" in settings.HelpFormatter("x")._get_help_string(concurrency)


def never_measured(target, drafter):
    raise AssertionError("the costs were read or measured before every input was checked")


@pytest.mark.measures_costs
def test_bad_inputs_exit_with_one_clear_line(capsys, tmp_path, monkeypatch):
    """Each bad input is one line, found before the costs are read from the cache or measured."""
    from dflash2 import spec_decode

    monkeypatch.setattr(spec_decode, "machine_costs", never_measured)
    monkeypatch.setattr(policy, "machine_costs", never_measured)
    monkeypatch.setattr(policy, "measure_costs", never_measured)
    for argv, code, phrase in bad_inputs(tmp_path):
        if "--target" not in argv and "--check-trace" not in argv:  # the golden pair unless the case names its own
            argv = PAIR + argv if "--draft" not in argv else ["--target", str(GOLDEN / "target")] + argv
        rc, out, err = cli(capsys, *argv)
        assert (rc, out) == (code, ""), (argv[-2:], err)
        assert err.startswith("error: ") and err.count("\n") == 1 and phrase in err, (argv[-2:], err)


def test_bad_inputs_are_refused_before_the_target_loads(capsys, tmp_path, monkeypatch):
    """Start-up's slow part is the target's weights: every bad input but an unreadable drafter file is refused from
    config.json and the tokenizer alone, and that one from the drafter's file, still before the target's."""
    from dflash2 import pair

    def no_weights(*args, **kwargs):
        raise AssertionError("weights were loaded for a bad input")

    monkeypatch.setattr(pair, "load_target", no_weights)
    for argv, code, phrase in bad_inputs(tmp_path):
        if "--target" not in argv and "--check-trace" not in argv:
            argv = PAIR + argv if "--draft" not in argv else ["--target", str(GOLDEN / "target")] + argv
        if "cannot load drafter" not in phrase or "not readable JSON" in phrase:
            monkeypatch.setattr(pair, "load_drafter", no_weights)
        else:
            monkeypatch.undo()
            monkeypatch.setattr(pair, "load_target", no_weights)
        rc, out, err = cli(capsys, *argv)
        assert rc == code and phrase in err, (argv[-2:], err)


@pytest.mark.measures_costs
def test_generate_checks_its_inputs_before_the_costs(monkeypatch):
    """generate under the policy: a prompt too long for the target is refused before any cost is read."""
    from dflash2 import pair as pair_module, spec_decode

    monkeypatch.setattr(spec_decode, "machine_costs", never_measured)
    monkeypatch.setattr(policy, "machine_costs", never_measured)
    monkeypatch.setattr(policy, "measure_costs", never_measured)
    loaded = pair_module.load_pair(str(GOLDEN / "target"), str(GOLDEN / "draft"), torch.device("cpu"), torch.float32)
    with pytest.raises(settings.InputError, match="prompt too long"):
        spec_decode.generate(loaded.target, loaded.drafter, [[1] * 1100], max_new_tokens=8, policy="auto")


def test_debug_shows_the_traceback(capsys):
    rc, _, err = cli(capsys, *PAIR, "--prompt", "the", "--block-size", "7", "--debug")
    assert rc == 2 and "Traceback" in err and err.strip().endswith("drafter's block size 6")


def test_missing_embedded_drafter_is_one_line(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(settings, "DEFAULT_DRAFT", tmp_path / "dflash2-smollm2-135m")
    rc, _, err = cli(capsys, "--target", str(GOLDEN / "target"), "--prompt", "the")
    assert rc == 2 and err.startswith("error: drafter dflash2-smollm2-135m: no such checkpoint directory")
    assert err.count("\n") == 1


@pytest.mark.slow
def test_default_pair_greedy_matches_autoregressive(capsys):
    if not settings.DEFAULT_DRAFT.is_dir():
        pytest.skip(f"the embedded drafter {settings.DEFAULT_DRAFT} has not been trained yet")
    rc, out, err = cli(capsys, "--prompt", "What is 12 + 30?", "--max-new-tokens", "16", "--baseline", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["identical"] is True and report["completion_tokens"] >= 1
    assert report["target"] == settings.DEFAULT_TARGET


@pytest.mark.slow
def test_default_dspark_pair_greedy_matches_autoregressive(capsys):
    """--method dspark with no --draft runs the embedded DSpark drafter on the embedded target, losslessly."""
    rc, out, err = cli(capsys, "--method", "dspark", "--prompt", "What is 12 + 30?", "--max-new-tokens", "16",
                       "--baseline", "--json")
    assert rc == 0, err
    report = json.loads(out)
    assert report["identical"] is True and report["completion_tokens"] >= 1
    assert report["method"] == "dspark" and report["draft"] == settings.DEFAULT_DSPARK_DRAFT.name


@pytest.mark.measures_costs
def test_measured_costs_are_said_once_and_cached(capsys, monkeypatch, tmp_path):
    """An empty cost cache: the CLI says it measures (injected, steady measurements), caches them, and the next run
    reads them without a word."""
    from dflash2 import policy, spec_decode

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    policy._MEMO.clear()
    calls = []

    def steady(target, drafter):
        calls.append(1)
        return dataclasses.replace(synthetic_costs(), key=policy.cost_key(target, drafter))

    monkeypatch.setattr(policy, "measure_costs", steady)
    rc, _, err = cli(capsys, *PAIR, "--prompt", "the time of day", "--max-new-tokens", "6")
    assert rc == 0, err
    assert "measuring this machine's verify and draft costs" in err and "unsteady" not in err
    assert len(calls) == 2 and (tmp_path / "costs.json").is_file()
    policy._MEMO.clear()
    rc, _, err = cli(capsys, *PAIR, "--prompt", "the time of day", "--max-new-tokens", "6")
    policy._MEMO.clear()
    assert rc == 0 and "[policy]" not in err and len(calls) == 2


@pytest.mark.measures_costs
def test_unsteady_costs_are_said_and_not_cached(capsys, monkeypatch, tmp_path):
    """A busy machine while the costs are measured (no two measurements agree): the CLI says so on stderr, the
    run goes on with them, and nothing is cached."""
    from dflash2 import policy

    monkeypatch.setenv("DFLASH2_CACHE", str(tmp_path))
    policy._MEMO.clear()
    calls = []

    def jumpy(target, drafter):
        calls.append(1)
        return dataclasses.replace(synthetic_costs(per_token=0.5 * len(calls)), key=policy.cost_key(target, drafter))

    monkeypatch.setattr(policy, "measure_costs", jumpy)
    rc, out, err = cli(capsys, *PAIR, "--prompt", "the time of day", "--max-new-tokens", "6")
    policy._MEMO.clear()
    assert rc == 0, err
    assert "measuring this machine's verify and draft costs" in err and "unsteady" in err
    assert len(calls) == policy.MAX_PASSES and not (tmp_path / "costs.json").exists()
