"""Other machines, seen from this one: the probe overridden, and oneDNN made to raise as it does on a CPU
without native bf16 (AMD Zen 2/3, Intel client CPUs) or in a torch without oneDNN. Every entry point
(the CLI, `train run`, the bench with the chain and the tree) must run there, in float32 where bf16
would be emulated, and say so."""
import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import dflash2_ref
from dflash2 import bench, kernels, machine, train
from dflash2.model import DFlash2Drafter
from targets import tiny_drafter, tiny_target
from tiny_tokenizer import tiny_tokenizer

ROOT = Path(__file__).resolve().parent.parent
# What an AVX2-only CPU does with torch 2.13's oneDNN bf16 kernels (the message is torch's own).
NO_BF16 = "mkldnn_reorder_linear_weight: bf16 path needs the cpu support avx_ne_convert or avx512bw, avx512vl and avx512dq"
EMULATE = f"""
import runpy, sys, torch
ns = torch.ops.mkldnn
def raising(real):
    def f(x, *a, **k):
        if x.dtype == torch.bfloat16:
            raise RuntimeError({NO_BF16!r})
        return real(x, *a, **k)
    return f
ns._reorder_linear_weight = raising(ns._reorder_linear_weight)
ns._linear_pointwise = raising(ns._linear_pointwise)
ns._is_mkldnn_bf16_supported = lambda: False
sys.argv = ["dflash2_ref.py"] + sys.argv[1:]
runpy.run_path("dflash2_ref.py", run_name="__main__")
"""
MACHINES = ("avx2", "no-onednn")


@contextlib.contextmanager
def emulated(kind, monkeypatch):
    """This process as on another CPU: "avx2" (oneDNN without bf16 kernels) or "no-onednn" (a torch built
    without it). oneDNN's ops raise where that machine's would, so code that ignores the probe fails here."""
    ns = torch.ops.mkldnn

    def raising(real, everything):
        def f(x, *a, **k):
            if everything or x.dtype == torch.bfloat16:
                raise RuntimeError(NO_BF16 if not everything else "oneDNN is not available in this torch (emulated)")
            return real(x, *a, **k)
        return f

    everything = kind == "no-onednn"
    monkeypatch.setattr(ns, "_reorder_linear_weight", raising(ns._reorder_linear_weight, everything))
    monkeypatch.setattr(ns, "_linear_pointwise", raising(ns._linear_pointwise, everything))
    monkeypatch.setattr(ns, "_is_mkldnn_bf16_supported", lambda: False)
    with machine.override(cpu_capability="AVX2", native_bf16=False, onednn=kind != "no-onednn") as m:
        yield m


@pytest.fixture(scope="module")
def bf16_pair(tmp_path_factory):
    """A tiny target and a drafter saved in bfloat16, as published drafters are."""
    root = tmp_path_factory.mktemp("bf16pair")
    model = tiny_target("llama")
    model.save_pretrained(root / "target")
    tiny_tokenizer(model.config.vocab_size).save_pretrained(root / "target")
    tiny_drafter(model).save_pretrained(root / "draft", dtype=torch.bfloat16)
    return root / "target", root / "draft"


def test_native_bf16_probe_agrees_with_a_trial_bf16_reorder():
    """probe()'s native_bf16 is what oneDNN does on the CPU the suite runs on: a bf16 weight reorder and a packed
    bf16 linear (what kernels.PackedLinear runs) succeed, and compute x W^T, exactly where it says native bf16;
    on a CPU without bf16 kernels they raise (NO_BF16)."""
    m = machine.probe()
    if not m.onednn:
        pytest.skip("this torch has no oneDNN packed linear")
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(8, 16, generator=g).bfloat16(), torch.randn(3, 16, generator=g).bfloat16()
    try:
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 3)
        y = torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        works = torch.allclose(y.float(), x.float() @ w.float().T, atol=0.05, rtol=0.02)
    except RuntimeError:
        works = False
    assert m.native_bf16 == works, f"probe says native bf16 {m.native_bf16}, a trial bf16 reorder {works}"


def test_probe_describes_this_machine_and_overrides_nest():
    m = machine.machine()
    assert m == machine._probed() and m.cpu_capability == torch.backends.cpu.get_cpu_capability()
    with machine.override(native_bf16=False, cpu_capability="AVX2") as avx2:
        assert machine.machine() is avx2 and "CPU AVX2, no native bf16" in avx2.describe()
        with machine.override(onednn=False):
            assert not machine.machine().packs(torch.float32)
        assert avx2.packs(torch.float32) == m.onednn and not avx2.packs(torch.bfloat16)
    assert machine.machine() == m


def test_environment_overrides_the_probe(monkeypatch):
    monkeypatch.setenv("DFLASH2_MACHINE", "native_bf16=0, cpu_capability=AVX2")
    m = machine._from_env(machine.probe())
    assert (m.native_bf16, m.cpu_capability) == (False, "AVX2")
    monkeypatch.setenv("DFLASH2_MACHINE", "avx512=1")
    with pytest.raises(ValueError, match="unknown field 'avx512'"):
        machine._from_env(machine.probe())


@pytest.mark.parametrize("native", [True, False])
def test_draft_dtype_follows_native_bf16_and_says_why(native):
    with machine.override(native_bf16=native, cpu_capability="AVX512" if native else "AVX2"):
        dtype, why = machine.draft_dtype("cpu", torch.bfloat16)
        assert dtype == (torch.bfloat16 if native else torch.float32)
        assert why == "the checkpoint's" if native else "the checkpoint's bfloat16 runs emulated" in why
        asked, note = machine.draft_dtype("cpu", torch.bfloat16, torch.bfloat16)
        assert asked == torch.bfloat16 and ("slowly" in note) != native
        assert machine.draft_dtype("cpu", torch.float32) == (torch.float32, "the checkpoint's")
        assert machine.draft_dtype("meta", torch.bfloat16)[0] == torch.bfloat16  # not a CPU: its dtype
        assert kernels.can_prepack(torch.zeros(2, 2, dtype=torch.bfloat16)) == (native and machine.machine().onednn)
        assert machine.half_dtype("cpu") == (torch.bfloat16 if native else torch.float32)


@pytest.mark.parametrize("kind", MACHINES)
def test_cli_runs_lossless_in_float32_and_says_why(kind, bf16_pair, monkeypatch, capsys, tmp_path):
    target_dir, draft_dir = bf16_pair
    argv = ["--target", str(target_dir), "--draft", str(draft_dir), "--prompt", "the time of day",
            "--max-new-tokens", "12", "--baseline"]
    with emulated(kind, monkeypatch):
        rc = dflash2_ref.main(argv + ["--json", "--trace", str(tmp_path / "t.jsonl")])
        out, err = capsys.readouterr()
        assert rc == 0, err
        report = json.loads(out)
        assert report["identical"] is True and report["draft_dtype"] == "float32"
        assert "emulated on this CPU (AVX2" in report["draft_dtype_reason"]
        assert report["machine"].startswith("CPU AVX2, no native bf16")
        config = json.loads((tmp_path / "t.jsonl").read_text().splitlines()[0])
        assert config["draft_dtype"] == "float32" and config["draft_dtype_reason"] == report["draft_dtype_reason"]
        assert config["machine"]["native_bf16"] is False
        for method in ("dflash2", "dflash2-tree"):  # the stats line names the dtype and the machine
            rc = dflash2_ref.main(argv[:-1] + ["--method", method])
            out, err = capsys.readouterr()
            assert rc == 0, err
            assert f"[{method}] draft_dtype float32 (the checkpoint's bfloat16 runs emulated" in err
        # asked for bf16 anyway: it runs, unpacked, with a one-line note
        rc = dflash2_ref.main(argv[:-1] + ["--draft-dtype", "bfloat16"])
        out, err = capsys.readouterr()
        assert rc == 0, err
        assert "note: --draft-dtype bfloat16: asked for; this CPU has no native bfloat16, so it runs unpacked" in err
        assert "draft_dtype bfloat16 (asked for" in err


@pytest.mark.parametrize("kind", MACHINES)
def test_bench_runs_chain_and_tree_lossless(kind, bf16_pair, monkeypatch, tmp_path):
    from test_bench import write_tiny_data

    target_dir, draft_dir = bf16_pair
    write_tiny_data(tmp_path / "data")
    with emulated(kind, monkeypatch):
        bench.main(["--target", str(target_dir), "--draft", str(draft_dir), "--data-dir", str(tmp_path / "data"),
                    "--tasks", "gsm8k", "--methods", "ar,dflash2,dflash2-tree", "--num-prompts", "2",
                    "--max-new-tokens", "10", "--out", str(tmp_path / "r.json")])
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["config"]["draft_dtype"] == "float32" and report["config"]["machine"].startswith("CPU AVX2")
    assert all(r["identical_to_ar"] for r in report["results"])


@pytest.mark.parametrize("kind", MACHINES)
def test_train_run_trains_in_float32(kind, monkeypatch, tmp_path, capsys):
    from test_train import _tiny_data_dir, _tiny_target_dir

    _, target_dir = _tiny_target_dir(tmp_path)
    with emulated(kind, monkeypatch):
        train.main(["run", "--minutes", "0.1", "--out", str(tmp_path / "run"), "--target", str(target_dir),
                    "--data-dir", str(_tiny_data_dir(tmp_path)), "--sources", "gsm8k", "--self-instruct", "4",
                    "--max-new-tokens", "16", "--batch-seqs", "2", "--threads", "1"])
    assert (tmp_path / "run" / "run.json").is_file()
    DFlash2Drafter.from_pretrained(tmp_path / "run" / "drafter")


def test_cli_subprocess_on_an_avx2_cpu(bf16_pair):
    """The real entry point with torch's kernels pinned to AVX2, the probe forced by the environment, and oneDNN's
    bf16 kernels raising as on such a CPU."""
    target_dir, draft_dir = bf16_pair
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2", DFLASH2_MACHINE="native_bf16=0,cpu_capability=AVX2")
    cmd = [sys.executable, "-c", EMULATE, "--target", str(target_dir), "--draft", str(draft_dir),
           "--prompt", "the time", "--max-new-tokens", "8", "--block-size", "4", "--baseline", "--json"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["identical"] is True and report["draft_dtype"] == "float32"
    assert report["machine"].startswith("CPU AVX2, no native bf16")


@pytest.mark.slow
def test_embedded_pair_on_an_avx2_cpu(monkeypatch, capsys):
    """README's command on the embedded pair (its drafter is a bf16 checkpoint), as on an AVX2-only CPU."""
    with emulated("avx2", monkeypatch):
        rc = dflash2_ref.main(["--prompt", "What is 2 + 3?", "--max-new-tokens", "12", "--baseline", "--json"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    report = json.loads(out)
    assert report["identical"] is True and report["draft_dtype"] == "float32"


def test_gpu_check_script_rehearses_on_the_cpu(bf16_pair, tmp_path):
    """docs/gpu_check.sh, rehearsed on the CPU with the tiny pair: every check it names runs with a time limit and
    lands in one JSON under 1 MiB; what a CPU cannot run (FA4) is recorded with its one-line error, not lost."""
    from test_bench import write_tiny_data

    target_dir, draft_dir = bf16_pair
    write_tiny_data(tmp_path / "data")
    env = dict(os.environ, NO_JOIN="1", DEVICE="cpu", TARGET=str(target_dir), DRAFT=str(draft_dir),
               DATA_DIR=str(tmp_path / "data"), OUT=str(tmp_path / "out"), STASH=str(tmp_path / "stash"),
               PYTHON=sys.executable, CHECKS="cli_flash,cli_tree32,bench", BUDGET_S="200", OMP_NUM_THREADS="1")
    done = subprocess.run(["bash", "docs/gpu_check.sh", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    text = (tmp_path / "out" / "gpu_check.json").read_text()
    report = json.loads(text)
    assert len(text) < 1 << 20 and report["device"] == "cpu" and list(report["checks"]) == ["cli_flash", "cli_tree32", "bench"]
    flash, tree, cells = (report["checks"][n] for n in ("cli_flash", "cli_tree32", "bench"))
    assert flash["rc"] == 2 and "attention backend 'flash' cannot run on cpu" in flash["stderr_tail"]
    assert tree["rc"] == 0 and tree["report"]["identical"] is True and tree["report"]["method"] == "dflash2-tree"
    assert cells["rc"] == 0 and {(r["method"], r["concurrency"]) for r in cells["results"]} == {
        (m, c) for m in ("ar", "dflash2", "dflash2-tree") for c in (1, 8)}
    assert all(r["identical_to_ar"] for r in cells["results"])
