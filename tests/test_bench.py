"""bench.py follows the model card's protocol: the SPEC §8 prompt strings, and a complete, sane report."""
import gzip
import importlib.util
import json
import sys
import types
from pathlib import Path

import pytest

from dflash2 import bench
from targets import DATA_DIR, tiny_drafter, tiny_target
from tiny_tokenizer import tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]

needs_data = pytest.mark.skipif(not DATA_DIR.is_dir(), reason=f"benchmark data not found at {DATA_DIR} "
                                "(set DFLASH2_DATA_DIR to a copy of the ../shared/data layout)")


def first_row(path):
    with (gzip.open if path.suffix == ".gz" else open)(path, "rt") as f:
        return json.loads(f.readline())


@needs_data
def test_prompts_are_the_spec_strings():
    texts = bench.load_tasks(bench.TASKS, DATA_DIR, 1)
    user_turn = {task: bench.format_prompt(task, ts[0]) for task, ts in texts.items()}
    gsm8k = first_row(DATA_DIR / "gsm8k/test.jsonl")["question"]
    math500 = first_row(DATA_DIR / "math500/test.jsonl")["question"]
    humaneval = first_row(DATA_DIR / "humaneval/HumanEval.jsonl.gz")["prompt"]
    mbpp = next(r for r in json.loads((DATA_DIR / "mbpp/sanitized-mbpp.json").read_text()) if r["task_id"] == 11)
    mt_bench = first_row(DATA_DIR / "mt_bench/question.jsonl")["turns"][0]
    assert user_turn["gsm8k"] == gsm8k + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert user_turn["math500"] == math500 + "\nPlease reason step by step, and put your final answer within \\boxed{}."
    assert user_turn["humaneval"] == ("Write a solution to the following problem and make sure that it passes the tests:\n"
                                      "```python\n" + humaneval + "\n```")
    assert user_turn["mbpp"] == mbpp["prompt"]  # the first row of the test split (task_id 11), as is
    assert user_turn["mt-bench"] == mt_bench


def write_tiny_data(root):
    """A few short rows per task in the ../shared/data layout (characters the tiny tokenizer knows)."""
    (root / "gsm8k").mkdir(parents=True)
    (root / "gsm8k/test.jsonl").write_text("".join(json.dumps({"question": f"what is {i} plus {i}", "answer": "x"}) + "\n"
                                                  for i in range(4)))
    (root / "math500").mkdir()
    (root / "math500/test.jsonl").write_text(json.dumps({"question": "solve x", "answer": "1"}) + "\n")
    (root / "humaneval").mkdir()
    with gzip.open(root / "humaneval/HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"task_id": "HumanEval/0", "prompt": "def f(x):\n"}) + "\n")
    (root / "mbpp").mkdir()
    mbpp = [{"task_id": t, "prompt": f"write task {t}", "code": ""} for t in (2, 11, 12, 13, 600)]
    (root / "mbpp/sanitized-mbpp.json").write_text(json.dumps(mbpp))
    (root / "mt_bench").mkdir()
    (root / "mt_bench/question.jsonl").write_text(json.dumps({"question_id": 81, "turns": ["first turn", "second"]}) + "\n")


def test_load_tasks_takes_the_test_split_and_first_turns(tmp_path):
    write_tiny_data(tmp_path)
    texts = bench.load_tasks(bench.TASKS, tmp_path, 3)
    assert texts["mbpp"] == ["write task 11", "write task 12", "write task 13"]
    assert texts["mt-bench"] == ["first turn"]
    assert texts["math500"] == ["solve x"]
    assert len(texts["gsm8k"]) == 3


def test_heldout_chat_set_ships_with_the_package_and_is_read_as_typed(tmp_path):
    texts = bench.load_tasks(["chat-heldout"], tmp_path / "no data needed", 1000)["chat-heldout"]
    assert len(texts) >= 100 and len(set(texts)) == len(texts) and all(t == t.strip() and t for t in texts)
    assert bench.format_prompt("chat-heldout", texts[0]) == texts[0]
    assert "chat-heldout" not in bench.TASKS  # named explicitly, never in the five-task default
    with pytest.raises(SystemExit):
        bench.main(["--tasks", "gsm8k,nonsense"])


def test_missing_data_is_a_clear_error(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # as if `datasets` were not installed
    with pytest.raises(SystemExit, match="no local copy.*datasets"):
        bench.load_tasks(["gsm8k"], tmp_path / "absent", 1)


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    model = tiny_target("llama")
    model.save_pretrained(root / "target")
    tiny_tokenizer(model.config.vocab_size).save_pretrained(root / "target")
    tiny_drafter(model).save_pretrained(root / "draft")
    return root / "target", root / "draft"


def test_tiny_run_reports_every_field(tiny_pair, tmp_path, capsys):
    target_dir, draft_dir = tiny_pair
    write_tiny_data(tmp_path / "data")
    out = tmp_path / "results.json"
    # 3 prompts at concurrency 2: a full batch, then a ragged one.
    bench.main(["--target", str(target_dir), "--draft", str(draft_dir), "--data-dir", str(tmp_path / "data"),
                "--tasks", "gsm8k,mbpp", "--methods", "ar,dflash2", "--concurrency", "1,2", "--num-prompts", "3",
                "--max-new-tokens", "12", "--device", "cpu", "--profile", "--out", str(out)])
    report = json.loads(out.read_text())
    profiled = [r for r in report["results"] if "step_ms" in r]
    assert {(r["task"], r["method"], r["concurrency"]) for r in profiled} == {
        (t, m, c) for t in ("gsm8k", "mbpp") for m in ("ar", "dflash2") for c in (1, 2)}
    assert all(r["step_ms"]["verify"] > 0 for r in profiled)
    assert all(r["step_ms"]["drafter"] > 0 for r in profiled if r["method"] == "dflash2")
    assert report["config"]["block_size"] == 8 and report["config"]["methods"] == ["ar", "dflash2"]
    rows = report["results"]
    assert {(r["task"], r["method"], r["concurrency"]) for r in rows} == {
        (t, m, c) for t in ("gsm8k", "mbpp") for m in ("ar", "dflash2") for c in (1, 2)}
    for r in rows:
        assert set(r) - {"step_ms", "widths"} == {"task", "method", "concurrency", "temperature", "top_p",
                                                  "num_prompts", "acceptance_length",
                                        "throughput_tok_s", "speedup_vs_ar", "speedup_vs_hf", "completion_tokens",
                                        "wall_s", "identical_to_ar", "cannot_run"}
        assert r["num_prompts"] == 3 and r["identical_to_ar"] is True and r["cannot_run"] is None
        assert 1 <= r["acceptance_length"] <= (1 if r["method"] == "ar" else 8)
        assert r["throughput_tok_s"] > 0 and r["wall_s"] > 0 and r["speedup_vs_ar"] > 0
        assert 3 <= r["completion_tokens"] <= 3 * 12
    printed = capsys.readouterr().out
    assert "Acceptance length τ" in printed and "| gsm8k |" in printed and "| mean |" in printed
    # the split's last column: a dflash2 step's time in ar steps at the same task and concurrency
    split = {(r["task"], r["method"], r["concurrency"]): sum(r["step_ms"].values()) for r in profiled}
    for task, c in [("gsm8k", 1), ("mbpp", 2)]:
        cost = split[task, "dflash2", c] / split[task, "ar", c]
        assert f"| {task} | {c} | dflash2 | " in printed and printed.split(f"| {task} | {c} | dflash2 | ")[1].split(
            "\n")[0].endswith(f"| {cost:.2f} |")
    assert "dflash2 c=2" in printed and "×)" in printed and "WARNING" not in printed


def test_greedy_mismatch_is_reported_loudly(tiny_pair, tmp_path, capsys, monkeypatch):
    def corrupted(target, drafter, prompts, settings, **kwargs):
        results = bench_generate(target, drafter, prompts, settings, **kwargs)
        if settings.method == "dflash2":
            results[0].tokens[-1] ^= 1
        return results

    bench_generate = bench.generate
    monkeypatch.setattr(bench, "generate", corrupted)
    write_tiny_data(tmp_path / "data")
    target_dir, draft_dir = tiny_pair
    report = bench.main(["--target", str(target_dir), "--draft", str(draft_dir), "--data-dir", str(tmp_path / "data"),
                         "--tasks", "mt-bench", "--methods", "ar,dflash2", "--concurrency", "1", "--num-prompts", "1",
                         "--max-new-tokens", "4", "--device", "cpu", "--out", str(tmp_path / "r.json")])
    assert [r["identical_to_ar"] for r in report["results"]] == [True, False]
    assert "WARNING: dflash2 greedy output differs from ar on mt-bench" in capsys.readouterr().out


def test_plot_draws_tau_and_throughput(tmp_path):
    pytest.importorskip("matplotlib", reason="--plot needs the optional matplotlib")
    rows = [dict(task=t, method=m, concurrency=c, acceptance_length=1.0 if m == "ar" else 3.0,
                 throughput_tok_s=100.0 * c) for t in ("gsm8k", "mbpp") for m in ("ar", "dflash2") for c in (1, 2)]
    bench.report.plot(rows, ["gsm8k", "mbpp"], ["ar", "dflash2"], [1, 2], tmp_path / "bench.png")
    assert (tmp_path / "bench.png").stat().st_size > 0


@pytest.mark.slow
def test_compiled_run_is_lossless(tiny_pair, tmp_path):
    """--compile runs the compiled core with static shapes: same greedy outputs as ar."""
    target_dir, draft_dir = tiny_pair
    write_tiny_data(tmp_path / "data")
    report = bench.main(["--target", str(target_dir), "--draft", str(draft_dir), "--data-dir", str(tmp_path / "data"),
                         "--tasks", "gsm8k", "--methods", "ar,dflash2", "--concurrency", "1", "--num-prompts", "2",
                         "--max-new-tokens", "12", "--device", "cpu", "--compile", "--out", str(tmp_path / "r.json")])
    assert [r["identical_to_ar"] for r in report["results"]] == [True, True]
    assert report["config"]["compile"] is True


def test_synthetic_pair_is_timed_without_checkpoints_and_stays_lossless(tmp_path):
    """--synthetic builds a random MiniMax-M3-layout target and a published-shape drafter: no files needed,
    every request runs to max_new_tokens, the step split is reported, and greedy drafting still equals ar."""
    report = bench.main(["--synthetic", "tiny", "--methods", "ar,dflash2", "--concurrency", "1,2", "--num-prompts",
                         "2", "--max-new-tokens", "12", "--profile", "--out", str(tmp_path / "syn.json")])
    assert report["config"]["synthetic"] == "tiny" and report["config"]["attn_backend"] == "sdpa"
    rows = {(r["method"], r["concurrency"]): r for r in report["results"]}
    assert all(r["task"] == "synthetic" and r["completion_tokens"] == 24 for r in rows.values())
    assert rows["dflash2", 1]["identical_to_ar"] and rows["dflash2", 2]["identical_to_ar"]
    split = rows["dflash2", 1]["step_ms"]
    assert split["verify"] > 0 and split["drafter"] > 0 and split["selector"] > 0


def test_attention_backend_that_cannot_run_here_is_refused_before_loading(tmp_path):
    import torch

    from dflash2.kernels import attention_backends

    if "flash" in attention_backends(torch.device("cuda" if torch.cuda.is_available() else "cpu")):
        pytest.skip("FA4 is available here")
    with pytest.raises(SystemExit, match="backend 'flash' cannot run"):
        bench.main(["--target", str(tmp_path / "never-loaded"), "--attn-backend", "flash", "--tasks", "gsm8k",
                    "--out", str(tmp_path / "x.json")])


def test_synthetic_minimax_shape_is_the_documented_one():
    """The GPU check's pair, built on the meta device (no memory): MiniMax-M3 layout with M2's attention widths,
    and a published-shape drafter tapping five layers spread over the target."""
    import torch

    model, drafter = bench.synthetic_pair("minimax-m3", 8, "meta", torch.bfloat16, None, "sdpa", prepack=False)
    cfg = model.config
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (3072, 48, 8, 128)
    assert cfg.layer_types == ["full_attention"] * 3 + ["minimax_m3_sparse"] * 5
    assert cfg.num_local_experts == 128 and cfg.num_experts_per_tok == 4
    d = drafter.config
    assert (d.num_hidden_layers, d.hidden_size, d.intermediate_size, d.head_dim) == (5, 3072, 9216, 128)
    assert d.target_layer_ids == [0, 2, 4, 5, 7] and d.block_size == 8 and d.selector_top_k == 16
    with pytest.raises(SystemExit, match="must exceed the 3 dense layers"):
        bench.synthetic_pair("minimax-m3", 3, "meta", torch.bfloat16, None, "sdpa", prepack=False)


@pytest.mark.slow
def test_alternate_runs_eager_and_compiled_in_turn(tiny_pair, tmp_path, capsys):
    """--alternate N: N rounds of eager then compiled in one process, every output equal to the first ar run."""
    target_dir, draft_dir = tiny_pair
    write_tiny_data(tmp_path / "data")
    report = bench.main(["--target", str(target_dir), "--draft", str(draft_dir), "--data-dir", str(tmp_path / "data"),
                         "--tasks", "gsm8k", "--methods", "ar,dflash2", "--concurrency", "1", "--num-prompts", "2",
                         "--max-new-tokens", "12", "--device", "cpu", "--compile", "--alternate", "2", "--profile",
                         "--out", str(tmp_path / "r.json")])
    rows = report["alternate"]
    assert [(r["round"], r["mode"], r["method"]) for r in rows] == [
        (k, mode, m) for k in (1, 2) for mode in ("eager", "compiled") for m in ("ar", "dflash2")]
    assert all(r["identical_to_ar"] is True and r["throughput_tok_s"] > 0 for r in rows)
    # --profile: every run's step split; ar has no drafter phase
    assert all(r["step_ms"]["verify"] > 0 and ("drafter" in r["step_ms"]) == (r["method"] == "dflash2") for r in rows)
    out = capsys.readouterr().out
    assert "| gsm8k | dflash2 | 1 |" in out and "| 2 | compiled | gsm8k | dflash2 |" in out
    with pytest.raises(SystemExit, match="--alternate N needs"):
        bench.main(["--alternate", "2", "--out", str(tmp_path / "x.json")])


def _bench(tiny_pair, data, out, *flags):
    target_dir, draft_dir = tiny_pair
    return bench.main(["--target", str(target_dir), "--draft", str(draft_dir), "--data-dir", str(data),
                       "--device", "cpu", "--out", str(out), *flags])


def test_peers_reproduce_our_greedy_output_and_say_what_they_cannot_run(tiny_pair, tmp_path, capsys):
    """hf, hf-pld and (when installed) zlab decode the same prompts on the same target object: their greedy
    outputs equal ar's; at concurrency 2 their rows say in words why they did not run."""
    write_tiny_data(tmp_path / "data")
    peers = ["hf", "hf-pld"] + (["zlab"] if importlib.util.find_spec("dflash") else [])
    methods = ["ar", "dflash2"] + peers
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "gsm8k,mbpp", "--methods",
                    ",".join(methods), "--concurrency", "1,2", "--num-prompts", "2", "--max-new-tokens", "12",
                    "--pld-num-tokens", "3", "--pld-ngram", "1", "--profile")
    rows = {(r["task"], r["method"], r["concurrency"]): r for r in report["results"]}
    assert set(rows) == {(t, m, c) for t in ("gsm8k", "mbpp") for m in methods for c in (1, 2)}
    assert report["config"]["pld_num_tokens"] == 3 and report["config"]["pld_ngram"] == 1
    for (task, m, c), r in rows.items():
        assert set(r) - {"step_ms", "widths"} == {"task", "method", "concurrency", "temperature", "top_p",
                                                  "num_prompts", "acceptance_length",
                                        "throughput_tok_s", "speedup_vs_ar", "speedup_vs_hf", "completion_tokens",
                                        "wall_s", "identical_to_ar", "cannot_run"}
        if m in peers and c == 2:
            assert "batch 1" in r["cannot_run"] and r["throughput_tok_s"] is None and r["identical_to_ar"] is None
            continue
        assert r["cannot_run"] is None and r["identical_to_ar"] is True and r["throughput_tok_s"] > 0
        assert r["completion_tokens"] == rows[task, "ar", c]["completion_tokens"]
        assert (r["speedup_vs_hf"] is not None) == (c == 1)
    assert all(rows[t, "hf", 1]["acceptance_length"] == 1 for t in ("gsm8k", "mbpp"))  # one token per forward
    for m in peers:  # the profile splits a peer's step too
        assert rows["gsm8k", m, 1]["step_ms"]["verify"] > 0
    assert rows["gsm8k", "hf-pld", 1]["step_ms"]["drafter"] > 0  # prompt lookup's candidate search
    printed = capsys.readouterr().out
    assert "| not run: batch 1 here" in printed and "| cannot run: batch 1 only" in printed
    assert "Side by side at concurrency 1" in printed and "dflash2 / hf-pld (goal ≥ 1.8×)" in printed
    assert "WARNING" not in printed


def test_peer_greedy_mismatch_is_reported_loudly(tiny_pair, tmp_path, capsys, monkeypatch):
    def corrupted(*args, **kwargs):
        results, wall = bench_run_peer(*args, **kwargs)
        results[0].tokens[-1] ^= 1
        return results, wall

    bench_run_peer = bench.run_peer
    monkeypatch.setattr(bench, "run_peer", corrupted)
    write_tiny_data(tmp_path / "data")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "mt-bench", "--methods",
                    "ar,hf-pld", "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "4")
    assert [r["identical_to_ar"] for r in report["results"]] == [True, False]
    printed = capsys.readouterr().out
    assert "WARNING: hf-pld greedy output differs from ar on mt-bench" in printed and "DIFFERS from ar" in printed


def test_zlab_is_skipped_with_a_clear_message_when_dflash_is_missing(tiny_pair, tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "dflash", None)  # as if the authors' package were not installed
    monkeypatch.setitem(sys.modules, "dflash.model", None)
    write_tiny_data(tmp_path / "data")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "gsm8k", "--methods",
                    "ar,dflash2,zlab", "--concurrency", "1,2", "--num-prompts", "1", "--max-new-tokens", "4")
    rows = {(r["method"], r["concurrency"]): r for r in report["results"]}
    assert all(rows["zlab", c]["cannot_run"].startswith("skipped: the authors' dflash is not importable")
               and rows["zlab", c]["throughput_tok_s"] is None for c in (1, 2))
    assert rows["dflash2", 1]["identical_to_ar"] is True
    printed = capsys.readouterr().out
    assert "zlab skipped" in printed and "pip install dflash==0.1.0" in printed and "| skipped: the authors'" in printed


def test_peers_sample_too(tiny_pair, tmp_path):
    """Sampled runs: hf and hf-pld sample (their own random draws, so no identity check), zlab too if installed."""
    write_tiny_data(tmp_path / "data")
    peers = ["hf", "hf-pld"] + (["zlab"] if importlib.util.find_spec("dflash") else [])
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "gsm8k", "--methods",
                    ",".join(["ar"] + peers), "--concurrency", "1", "--num-prompts", "1", "--max-new-tokens", "6",
                    "--temperature", "1.0", "--top-p", "0.95")
    for r in report["results"]:
        assert r["cannot_run"] is None and r["identical_to_ar"] is None and 1 <= r["completion_tokens"] <= 6


def test_pld_sweep_times_each_setting(tiny_pair, tmp_path, capsys):
    write_tiny_data(tmp_path / "data")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "gsm8k,mbpp", "--num-prompts", "1",
                    "--max-new-tokens", "8", "--pld-sweep", "2:1,4:2")
    assert [(r["task"], r["pld_num_tokens"], r["pld_ngram"]) for r in report["pld_sweep"]] == [
        (t, n, g) for t in ("gsm8k", "mbpp") for n, g in ((2, 1), (4, 2))]
    assert all(r["throughput_tok_s"] > 0 for r in report["pld_sweep"])
    assert f"best: --pld-num-tokens {report['best'][0]} --pld-ngram {report['best'][1]}" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        bench.main(["--pld-sweep", "10", "--out", str(tmp_path / "x.json")])


def test_peers_refuse_settings_they_have_no_meaning_in(tmp_path):
    with pytest.raises(SystemExit, match="peers run on a real pair"):
        bench.main(["--synthetic", "tiny", "--methods", "ar,hf", "--out", str(tmp_path / "x.json")])


def test_profile_times_every_phase_without_timers_in_the_loop():
    """--profile wraps the loop's step functions: every phase gets time, the wrappers come off after the
    run, and the output is the same as without the profile."""
    import argparse

    from dflash2 import proposers, spec_decode as sd
    from dflash2.target import Target

    model = tiny_target("llama")
    drafter = tiny_drafter(model)
    target = Target(model, drafter.config.target_layer_ids)
    args = argparse.Namespace(max_new_tokens=16, temperature=0.0, top_k=0, top_p=1.0, seed=0, block_size=None,
                              compile=False, tree_scores="selector", policy="fixed", walk="sample")
    plain, _ = bench.run_method(target, drafter, [[1, 2]], "dflash2", 1, args, [], "plain")
    timings = {}
    profiled, wall = bench.run_method(target, drafter, [[1, 2]], "dflash2", 1, args, [], "profiled", timings)
    assert set(timings) == {"prefill", "drafter", "selector", "verify", "bookkeeping"}
    assert all(v > 0 for v in timings.values()) and abs(sum(timings.values()) - wall) < 1e-9
    assert [r.tokens for r in profiled] == [r.tokens for r in plain]
    assert "forward" not in vars(target) and proposers.draft.__name__ == "draft" and sd._prefill.__name__ == "_prefill"


def test_interleave_times_wave_by_wave_in_rotating_order(tiny_pair, tmp_path, capsys, monkeypatch):
    """--interleave decodes a wave at a time (one prompt at c = 1, c prompts as one batch at c > 1) with every
    method on it in turn, the first method rotating from wave to wave and round to round, and from cell to cell;
    cells pool the waves' tokens and walls over the rounds, and each wave's speedup over ar is kept. Before any
    of it, every method decodes a batch of each concurrency untimed (warm-up)."""
    calls, warm = [], []
    real, real_generate = bench.run_method, bench.generate

    def spy(target, drafter, prompts, method, concurrency, *args, **kwargs):
        calls.append((method, concurrency, len(prompts)))
        return real(target, drafter, prompts, method, concurrency, *args, **kwargs)

    def spy_generate(target, drafter, prompts, settings, **kwargs):
        if not calls:
            warm.append((settings.method, settings.max_batch, len(prompts)))
        return real_generate(target, drafter, prompts, settings, **kwargs)

    monkeypatch.setattr(bench, "run_method", spy)
    monkeypatch.setattr(bench, "generate", spy_generate)
    write_tiny_data(tmp_path / "data")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "gsm8k", "--methods",
                    "ar,dflash2,dflash2@2", "--concurrency", "1,2", "--num-prompts", "3", "--max-new-tokens", "10",
                    "--interleave", "--rounds", "2", "--profile")
    a, b, c = "ar", "dflash2", "dflash2@2"
    one = [a, b, c, b, c, a, c, a, b] + [b, c, a, c, a, b, a, b, c]  # 3 waves of 1 prompt, 2 rounds
    two = [b, c, a, c, a, b] + [c, a, b, a, b, c]  # waves of 2 prompts and of 1, 2 rounds; the second cell
    assert warm == [("ar", 1, 1), ("ar", 2, 2), ("dflash2", 1, 1), ("dflash2", 2, 2)] * 1 + [
        ("dflash2", 1, 1), ("dflash2", 2, 2)]  # dflash2@2 is method dflash2 at width 2
    assert calls == [(m, 1, 1) for m in one] + [(m, 2, n) for m, n in zip(two, [2, 2, 2, 1, 1, 1] * 2)]
    rows = {(r["method"], r["concurrency"]): r for r in report["results"]}
    for (m, conc), r in rows.items():
        assert r["identical_to_ar"] is True and len(r["wave_tok_s"]) == 4 - conc and r["step_ms"]["verify"] > 0
        assert r["rounds"] == 2 and r["completion_tokens"] * 2 == pytest.approx(r["throughput_tok_s"] * r["wall_s"])
        # pooled tokens over pooled walls: a weighted mean of the waves' rates
        assert min(r["wave_tok_s"]) <= r["throughput_tok_s"] <= max(r["wave_tok_s"])
    for (m, conc), r in rows.items():
        if m != "ar":
            assert r["wave_speedups"] == pytest.approx(
                [x / y for x, y in zip(r["wave_tok_s"], rows["ar", conc]["wave_tok_s"])])
    printed = capsys.readouterr().out
    assert "Each wave's speedup over ar" in printed and "| gsm8k | 2 | dflash2 |" in printed
    with pytest.raises(SystemExit, match="--interleave"):
        _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--interleave", "--compile", "--alternate", "1")
    with pytest.raises(SystemExit, match="--rounds"):
        _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--rounds", "0")


def test_lockstep_takes_turns_step_by_step_and_bills_each_method_its_own_steps(tiny_pair, tmp_path, monkeypatch):
    """--lockstep --interleave: our methods decode each wave at once, one step each in the wave's rotating order (a
    method that has ended drops out), a peer decodes the wave on its own; each method's wall is the time of its own
    steps only (a clock that ticks once per reading: one tick per step, and one for the call that finds it ended).
    Outputs are the sequential run's. --lockstep alone decodes each cell's prompts at once, c in flight (continuous
    batching, one policy for the cell). --lockstep refuses --profile and --alternate."""
    yields, waves = [], []
    real_steps = bench.decode_steps

    def spy_steps(target, drafter, prompts, settings, **kwargs):
        tag = (settings.method, settings.block_size)
        for book in real_steps(target, drafter, prompts, settings, **kwargs):
            yields.append(tag)
            yield book

    real_lockstep = bench.in_lockstep

    def spy_lockstep(run, args, methods, c, batch, desc):
        start = len(yields)
        out = real_lockstep(run, args, methods, c, batch, desc)
        waves.append((methods, yields[start:], {m: wall for m, (_, wall, _) in out.items()}))
        return out

    ticks = iter(range(10**6))
    monkeypatch.setattr(bench, "decode_steps", spy_steps)
    monkeypatch.setattr(bench, "in_lockstep", spy_lockstep)
    monkeypatch.setattr(bench, "time", types.SimpleNamespace(perf_counter=lambda: float(next(ticks))))
    write_tiny_data(tmp_path / "data")
    flags = ("--tasks", "gsm8k", "--methods", "ar,dflash2,dflash2@2,hf", "--concurrency", "1,2", "--num-prompts",
             "3", "--max-new-tokens", "10", "--rounds", "2")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", *flags, "--lockstep", "--interleave")
    tag = {"ar": ("ar", None), "dflash2": ("dflash2", None), "dflash2@2": ("dflash2", 2)}
    assert len(waves) == 2 * (3 + 2)  # 2 rounds of 3 waves at c = 1 and 2 waves at c = 2
    for methods, seen, wall in waves:
        assert set(methods) == set(tag) and "hf" not in methods
        n = {m: seen.count(tag[m]) for m in methods}
        assert all(k > 1 for k in n.values())  # a prefill and steps
        assert seen == [tag[m] for t in range(max(n.values())) for m in methods if t < n[m]]
        assert wall == {m: n[m] + 1.0 for m in methods}
    assert [w[0] for w in waves[:3]] == [["ar", "dflash2", "dflash2@2"], ["dflash2", "dflash2@2", "ar"],
                                         ["dflash2@2", "ar", "dflash2"]]  # hf's turns fall out of the rotation
    rows = {(r["method"], r["concurrency"]): r for r in report["results"]}
    for c, cell in ((1, waves[:6]), (2, waves[6:])):
        for m in tag:
            assert rows[m, c]["wall_s"] == sum(w[m] for _, _, w in cell) and rows[m, c]["lockstep"] is True
    assert all(r["identical_to_ar"] is True for r in report["results"] if r["cannot_run"] is None)
    assert rows["hf", 1]["wall_s"] > 0
    sequential = _bench(tiny_pair, tmp_path / "data", tmp_path / "s.json", *flags, "--interleave")
    assert {(r["method"], r["concurrency"]): r["completion_tokens"] for r in sequential["results"]} == {
        k: r["completion_tokens"] for k, r in rows.items()}
    sizes, waves[:] = [], []
    real_generate_steps = spy_steps

    def sized_steps(target, drafter, prompts, settings, **kwargs):
        sizes.append((len(prompts), settings.max_batch))
        return real_generate_steps(target, drafter, prompts, settings, **kwargs)

    monkeypatch.setattr(bench, "decode_steps", sized_steps)
    whole = _bench(tiny_pair, tmp_path / "data", tmp_path / "w.json", *flags, "--lockstep")
    assert len(waves) == 2 * 2 and sizes == [(3, c) for c in (1, 1, 2, 2) for _ in range(3)]  # a cell: one decode
    assert {(r["method"], r["concurrency"]): r["completion_tokens"] for r in whole["results"]} == {
        k: r["completion_tokens"] for k, r in rows.items()} and "wave_tok_s" not in whole["results"][0]
    for bad in (["--profile"], ["--compile", "--alternate", "1"]):
        with pytest.raises(SystemExit, match="--lockstep"):
            _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--lockstep", *bad)


def test_ignore_eos_gives_every_method_the_same_tokens_to_make(tiny_pair, tmp_path, monkeypatch):
    """--ignore-eos: the loop is given no stop tokens, so every request makes --max-new-tokens tokens with every
    method, at T = 1 too; without it the target's stop tokens are passed; peers refuse it."""
    seen = []
    real = bench.run_method

    def spy(target, drafter, prompts, method, concurrency, args, stop_ids, *rest, **kwargs):
        seen.append(list(stop_ids))
        return real(target, drafter, prompts, method, concurrency, args, stop_ids, *rest, **kwargs)

    monkeypatch.setattr(bench, "run_method", spy)
    write_tiny_data(tmp_path / "data")
    flags = ("--tasks", "gsm8k", "--methods", "ar,dflash2", "--num-prompts", "3", "--max-new-tokens", "6",
             "--temperature", "1")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", *flags, "--ignore-eos")
    assert seen and all(s == [] for s in seen)
    assert report["results"] and all(r["completion_tokens"] == 18 for r in report["results"])
    seen.clear()
    _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", *flags)
    assert seen and all(s for s in seen)
    with pytest.raises(SystemExit, match="--ignore-eos"):
        _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--methods", "ar,hf", "--ignore-eos")


def test_rounds_take_turns_cell_by_cell(tiny_pair, tmp_path, monkeypatch):
    """--rounds N without --interleave: each cell's methods decode all its prompts in turn, the first method rotating
    from round to round and from cell to cell, and a cell's throughput pools every round's tokens and wall."""
    calls = []
    real = bench.run_method

    def spy(target, drafter, prompts, method, concurrency, *args, **kwargs):
        calls.append((method, concurrency, len(prompts)))
        return real(target, drafter, prompts, method, concurrency, *args, **kwargs)

    monkeypatch.setattr(bench, "run_method", spy)
    write_tiny_data(tmp_path / "data")
    report = _bench(tiny_pair, tmp_path / "data", tmp_path / "r.json", "--tasks", "gsm8k", "--methods", "ar,dflash2",
                    "--concurrency", "1,2", "--num-prompts", "3", "--max-new-tokens", "8", "--rounds", "2")
    assert calls == [(m, 1, 3) for m in ("ar", "dflash2", "dflash2", "ar")] + [
        (m, 2, 3) for m in ("dflash2", "ar", "ar", "dflash2")]
    for r in report["results"]:
        assert r["rounds"] == 2 and r["completion_tokens"] * 2 == pytest.approx(r["throughput_tok_s"] * r["wall_s"])
        assert r["identical_to_ar"] is True


def test_protocol_runs_the_cards_cells_and_reports_them_again_from_its_file(tiny_pair, tmp_path, capsys):
    """--protocol: ar, dflash2 and dspark at c = 1, 8 and 32 on the six tasks, greedy and at T = 1 / top-p 0.95; the
    run prints each cell's widths, tau and speedup and the costs line, and --report FILE prints the same tables."""
    from test_dspark import tiny_dspark

    target_dir, _ = tiny_pair
    from transformers import AutoModelForCausalLM

    tiny_dspark(AutoModelForCausalLM.from_pretrained(target_dir)).save_pretrained(tmp_path / "dspark")
    write_tiny_data(tmp_path / "data")
    out = tmp_path / "card.json"
    data = _bench(tiny_pair, tmp_path / "data", out, "--protocol", "--dspark-draft", str(tmp_path / "dspark"),
                  "--num-prompts", "1", "--max-new-tokens", "4", "--rounds", "1")
    printed = capsys.readouterr().out
    rows = {(r["temperature"], r["top_p"], r["task"], r["method"], r["concurrency"]): r for r in data["results"]}
    assert set(rows) == {(t, p, task, m, c) for t, p in ((0.0, 1.0), (1.0, 0.95)) for task in bench.SIX_TASKS
                         for m in ("ar", "dflash2", "dspark") for c in (1, 8, 32)}
    for (t, _, _, m, _), r in rows.items():
        assert r["identical_to_ar"] is (True if t == 0 else None) and r["throughput_tok_s"] > 0
        assert (m == "ar") == ("widths" not in r) and r["speedup_vs_ar"] > 0
    assert set(data["config"]["costs"]) == {"dflash2", "dspark"} and "WARNING" not in printed
    tables = bench.report.text(data)
    assert printed.endswith(tables + "\n")
    assert "**greedy**" in tables and "**T = 1, top-p 0.95**" in tables and "dspark costs (units" in tables
    assert "| chat-heldout | dspark | 32 |" in tables  # a cell of the widths table
    capsys.readouterr()
    bench.main(["--report", str(out)])
    assert capsys.readouterr().out == tables + "\n"
    bench.main(["--report", str(out), "--sections", "widths"])
    assert "Verified widths" in capsys.readouterr().out
    bench.main(["--report", str(out), "--concurrency", "8", "--sections", "speed"])  # one column of the run's three
    only8 = capsys.readouterr().out
    assert "| task | ar c=8 | dflash2 c=8 | dspark c=8 |" in only8 and "c=1" not in only8 and "c=32" not in only8
    with pytest.raises(SystemExit, match="card.json has concurrency 1,8,32 only"):
        bench.main(["--report", str(out), "--concurrency", "8,4"])
    with pytest.raises(SystemExit, match="not a readable results JSON"):
        bench.main(["--report", str(tmp_path / "missing.json")])


@pytest.mark.skipif(not (ROOT / ".git").exists(), reason="needs the git history (a checkout, not an sdist)")
def test_compare_commits_runs_two_copies_side_by_side(tmp_path):
    """docs/compare_commits.py on the golden pair: HEAD against itself, one round; the table says the outputs agree."""
    import subprocess

    write_tiny_data(tmp_path / "data")
    golden = ROOT / "tests" / "golden"
    done = subprocess.run([sys.executable, str(ROOT / "docs" / "compare_commits.py"), "--old", "HEAD", "--new", "HEAD",
                           "--target", str(golden / "target"), "--draft", str(golden / "draft"), "--data-dir",
                           str(tmp_path / "data"), "--num-prompts", "1", "--max-new-tokens", "6", "--rounds", "1",
                           "--methods", "ar,dflash2", "--block-size", "4"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| ar |", "| dflash2 |"))]
    assert len(rows) == 2 and all(line.endswith("| True |") for line in rows), done.stdout
