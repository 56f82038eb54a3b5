"""`train train --arch dspark`: DeepSpec's DSpark loss term by term and block by block, the target's distribution
from its stored final hidden state, a short run that learns and writes a drafter sharing the target's embedding and
LM head (lossless in the loop, loadable beside DeepSpec's layout), `train --minutes` and `run --arch dspark`."""
import argparse
import json
import math
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dflash2 import distill, fit, train
from dflash2 import spec_decode as sd
from dflash2.dspark import DSparkDrafter, dspark_logits
from dflash2.target import Target
from targets import tiny_target
from test_train import _tiny_data_dir, _tiny_target_dir

TAPS = [0, 2]


def _setup(tmp_path, n_seqs=6):
    """Greedy responses of a tiny target stored as `data` stores them (features and final hidden states), and the
    trainer's arguments for a small DSpark drafter (block 3, Markov rank 8)."""
    model = tiny_target("llama", vocab=64, hidden=32, layers=3)
    prompts = [[1 + i, 5, 9, 2 + i] for i in range(n_seqs)]
    rows = distill.generate_with_features(model, prompts, TAPS, 24, stop_ids=set(), pad_id=0, last_hidden=True)
    data = tmp_path / "data"
    data.mkdir(parents=True)
    distill.save_shard(data / "shard_00000.pt", rows, [len(p) for p in prompts])
    (data / "meta.json").write_text(json.dumps({"target": "tiny", "taps": TAPS}))
    args = argparse.Namespace(
        out=str(tmp_path), arch="dspark", steps=40, batch_seqs=4, anchors=6, block_size=3, gamma=None, layers=1,
        intermediate_size=32, rank=8, top_k=4, mask_token_id=63, lr=3e-3, warmup=3, weight_decay=0.0, clip=1.0,
        bf16=False, save_every=10, snapshot_every=0, resume=False, threads=1, seed=0)
    return model, rows, args


def test_loss_terms_by_hand():
    """One slot, a vocabulary of 3: q = (1/4, 1/2, 1/4), p = (1/2, 1/4, 1/4), gold 1, confidence sigma(c) = 3/4.
    CE = ln 2, L1 = 1/4 + 1/4 + 0 = 1/2, TV = 1/4, so the head's target is 3/4 and BCE = -(3/4 ln 3/4 + 1/4 ln 1/4)."""
    z = torch.log(torch.tensor([[[1.0, 2.0, 1.0]]])).requires_grad_()
    p = torch.log(torch.tensor([[[2.0, 1.0, 1.0]]]))
    c = torch.tensor([[math.log(3.0)]], requires_grad=True)
    ce, l1, bce = fit.dspark_loss_terms(z, p, c, torch.tensor([[1]]), torch.tensor([1.0]))
    assert math.isclose(ce.item(), math.log(2), rel_tol=1e-5)
    assert math.isclose(l1.item(), 0.5, rel_tol=1e-5)
    assert math.isclose(bce.item(), -(0.75 * math.log(0.75) + 0.25 * math.log(0.25)), rel_tol=1e-5)
    assert fit.DSPARK_ALPHAS == (0.1, 0.9, 1.0)
    bce.backward()  # the head's target 1 - TV is detached: BCE moves the confidence, never the drafts
    assert z.grad is None and c.grad is not None

    # Three slots weighted exp(-k/4), k = 0, 1, 2; the third has no label (past the sequence's end) and counts nothing.
    z3 = torch.cat([z.detach(), torch.zeros(1, 2, 3)], dim=1)  # slots 1 and 2: q uniform
    p3 = torch.cat([p, torch.log(torch.tensor([[[1.0, 1.0, 2.0]], [[1.0, 1.0, 1.0]]])).transpose(0, 1)], dim=1)
    c3 = torch.tensor([[math.log(3.0), 0.0, 5.0]])
    w = fit.position_weights(4, 4.0)
    assert torch.allclose(w, torch.tensor([1.0, math.exp(-0.25), math.exp(-0.5)]))
    ce3, l13, bce3 = fit.dspark_loss_terms(z3, p3, c3, torch.tensor([[1, 2, -100]]), w)
    ce_1, l1_1 = -math.log(1 / 3), 2 * (1 / 3 - 1 / 4) + (1 / 2 - 1 / 3)  # slot 1: gold 2, p = (1/4, 1/4, 1/2)
    a_1 = 1 - l1_1 / 2
    bce_1 = -(a_1 * math.log(0.5) + (1 - a_1) * math.log(0.5))  # sigma(0) = 1/2
    den = 1 + math.exp(-0.25)
    assert math.isclose(ce3.item(), (math.log(2) + math.exp(-0.25) * ce_1) / den, rel_tol=1e-5)
    assert math.isclose(l13.item(), (0.5 + math.exp(-0.25) * l1_1) / den, rel_tol=1e-5)
    assert math.isclose(bce3.item(), (bce.item() + math.exp(-0.25) * bce_1) / den, rel_tol=1e-5)


def test_stored_final_hidden_state_gives_the_targets_logits(tmp_path):
    """`data` stores the target's final normed hidden state of every fed token: through the LM head it is the
    target's next-token logits there; computed on the fly (no feature shards) it is the same."""
    model, rows, _ = _setup(tmp_path, n_seqs=3)
    W = model.get_output_embeddings().weight
    for ids, feats, last in rows:
        with torch.no_grad():
            out = model(ids[None, :-1], output_hidden_states=True)
        assert last.shape == (len(ids) - 1, 32) and feats.shape == (len(ids) - 1, 64)
        logits = F.linear(last.float(), W)
        assert torch.allclose(logits, out.logits[0], atol=0.03 * out.logits.abs().max().item())  # stored in bf16
    seqs = distill.load_shards(tmp_path / "data", last_hidden=True)
    computed = distill.target_features(model, seqs, TAPS, bf16=False, last_hidden=True)
    for s, (_, f, _) in enumerate(seqs):
        assert f.shape[-1] == 96 and torch.allclose(computed[s, : len(f)], f.float(), atol=0.05 * f.float().abs().max())
    assert all(f.shape[-1] == 64 for _, f, _ in distill.load_shards(tmp_path / "data"))  # DFlash 2 reads the taps only


def test_loss_matches_direct_computation(tmp_path):
    """The batched loss equals DeepSpec's rule computed block by block through the inference path: the block
    [anchor, MASK, MASK] sees only the context before its anchor, slot k is labelled with the token at a+k+1, its
    Markov head reads the previous true token, p is the target's own softmax at position a+k."""
    model, rows, args = _setup(tmp_path)
    args.taps = TAPS
    seqs = [(ids, None, 4) for ids, _, _ in rows[:3]]
    drafter = DSparkDrafter(fit.dspark_config_for(model.config, args)).float()
    with torch.no_grad():
        for p in drafter.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    feats = distill.target_features(model, seqs, TAPS, bf16=False, last_hidden=True)
    B = args.block_size
    batch = fit.make_batch(seqs, B + 1, 30, 63, torch.Generator().manual_seed(0), feats)  # every anchor
    _, seq_idx, anchor_pos, _, gold = batch
    assert (gold == -100).any()  # blocks that run past the end
    weights = fit.position_weights(B + 1, 4.0)
    embed, W = model.get_input_embeddings(), model.get_output_embeddings().weight
    loss, ce, l1, bce, _ = fit.dspark_loss(drafter, embed, W, batch, weights)

    terms = {"ce": [], "l1": [], "bce": []}
    den = 0.0
    for j in range(len(gold)):
        s, a = int(seq_idx[j]), int(anchor_pos[j])
        ids = seqs[s][0]
        with torch.no_grad():
            out = model(ids[None], output_hidden_states=True)
        ctx = torch.cat([out.hidden_states[t + 1] for t in TAPS], -1)[:, :a]
        h = drafter(drafter.embed_block(ids[a : a + 1], embed, B), torch.arange(a, a + B)[None],
                    drafter.context_kv(ctx, torch.arange(a)[None]), torch.ones(1, a, dtype=torch.bool))
        prev = ids[a : a + B].clone()
        prev = torch.cat([prev, prev.new_zeros(B - len(prev))])[None]
        z, conf = dspark_logits(drafter, h, prev, W)[0], drafter.confidence_logits(h, prev)[0]
        for k in range(B):
            if a + k + 1 >= len(ids):
                break
            q, p = z[k].softmax(-1), out.logits[0, a + k].softmax(-1)
            dist = (q - p).abs().sum()
            terms["ce"].append(weights[k] * F.cross_entropy(z[k : k + 1], ids[a + k + 1 : a + k + 2]))
            terms["l1"].append(weights[k] * dist)
            terms["bce"].append(weights[k] * F.binary_cross_entropy_with_logits(conf[k], (1 - dist / 2).clamp(0, 1)))
            den += float(weights[k])
    for name, got in (("ce", ce), ("l1", l1), ("bce", bce)):
        assert torch.allclose(got, sum(terms[name]) / den, atol=1e-5), name
    assert torch.allclose(loss, 0.1 * ce + 0.9 * l1 + bce)


def test_short_dspark_run_learns_and_writes_a_drafter_that_shares_the_targets_tables(tmp_path):
    """A few steps lower the loss; OUT/drafter holds no embed_tokens / lm_head (the target's are used), loads through
    load_pair and decodes exactly the target's greedy output; a copy in DeepSpec's layout (with the tables) loads and
    drafts alike, and `--init` from it fine-tunes without keeping the copies."""
    from dflash2.pair import load_pair

    model, _, args = _setup(tmp_path)
    drafter, history = fit.train(args, target=model)
    assert sum(h["loss"] for h in history[-5:]) < 0.8 * sum(h["loss"] for h in history[:5])
    assert sum(h["ce"] for h in history[-5:]) < 0.8 * sum(h["ce"] for h in history[:5])
    assert set(history[0]) >= {"ce", "l1", "confidence_bce", "acc", "lr"} and len(history[0]["acc"]) == 3
    state = load_file(tmp_path / "drafter" / "model.safetensors")
    assert "embed_tokens.weight" not in state and "lm_head.weight" not in state
    assert "markov_head.markov_w1.weight" in state and "confidence_head.proj.weight" in state
    config = json.loads((tmp_path / "drafter" / "config.json").read_text())
    assert config["architectures"] == ["Qwen3DSparkModel"] and config["markov_rank"] == 8 and config["block_size"] == 3

    _, target_dir = _tiny_target_dir(tmp_path)  # the same tiny target, saved with a tokenizer
    pair = load_pair(str(target_dir), str(tmp_path / "drafter"), prepack=False, draft_dtype=torch.float32)
    assert isinstance(pair.drafter, DSparkDrafter) and not pair.drafter.own_embeddings
    prompts = [[3, 5, 9, 4], [7, 1, 1, 2, 8, 30]]
    res = sd.generate(pair.target, pair.drafter, prompts, method="dspark", max_new_tokens=16)
    ar = sd.generate(pair.target, None, prompts, method="ar", max_new_tokens=16)
    assert [r.tokens for r in res] == [r.tokens for r in ar]

    # DeepSpec's layout: the same drafter with copies of the target's tables in the file
    full = DSparkDrafter(pair.drafter.config, own_embeddings=True)
    full.load_state_dict({**pair.drafter.state_dict(), "embed_tokens.weight": model.get_input_embeddings().weight,
                          "lm_head.weight": model.get_output_embeddings().weight})
    full.save_pretrained(tmp_path / "deepspec", dtype=torch.float32)
    assert {"embed_tokens.weight", "lm_head.weight"} <= set(load_file(tmp_path / "deepspec" / "model.safetensors"))
    copy = load_pair(str(target_dir), str(tmp_path / "deepspec"), prepack=False, draft_dtype=torch.float32).drafter
    assert copy.own_embeddings
    again = sd.generate(pair.target, copy, prompts, method="dspark", max_new_tokens=16)
    assert [(r.tokens, r.accepted) for r in again] == [(r.tokens, r.accepted) for r in res]

    fine = tmp_path / "fine"
    fine.mkdir()
    (fine / "data").symlink_to(tmp_path / "data")
    args2 = argparse.Namespace(**{**vars(args), "out": str(fine), "steps": 1, "lr": 1e-12, "warmup": 1,
                                  "init": str(tmp_path / "deepspec"), "block_size": None, "rank": 2})
    tuned, _ = fit.train(args2, target=model)
    assert not tuned.own_embeddings and tuned.config.markov_rank == 8 and args2.block_size == 3
    for name, p in copy.state_dict().items():
        if name not in ("embed_tokens.weight", "lm_head.weight"):
            assert torch.allclose(p, tuned.state_dict()[name], atol=1e-6), name
    assert "lm_head.weight" not in load_file(fine / "drafter" / "model.safetensors")


def test_train_minutes_stops_at_the_deadline_with_the_schedule_ended(tmp_path):
    """`train --minutes M` (both architectures): the steps stop at the deadline, counted from the first step, and the
    cosine schedule is stretched to it: late steps run near the floor (lr/10), early ones near the peak."""
    model, _, args = _setup(tmp_path)
    args.steps, args.minutes, args.warmup = 5, 0.05, 1  # --steps is ignored under a deadline
    for arch in ("dspark", "dflash2"):
        args.arch, args.block_size = arch, None
        _, history = fit.train(args, target=model)
        wall = [h["wall_s"] for h in history]
        assert len(wall) > 10 and wall[-2] < 3.0  # every step but the last ended before the deadline,
        assert wall[-1] + (wall[-1] - wall[-2]) > 2.9  # and the last stopped because one more would end past it
        assert history[-1]["lr"] < 0.2 * args.lr and history[len(history) // 5]["lr"] > 0.5 * args.lr
        assert len(history[-1]["acc"]) == 7  # the default blocks, DSpark's 7 and DFlash 2's 8: 7 drafts each
    parsed = train.build_parser().parse_args(["train", "--arch", "dspark", "--minutes", "1"])
    assert (parsed.arch, parsed.minutes, parsed.block_size, parsed.rank) == ("dspark", 1.0, None, 24)


def test_run_dspark_on_a_tiny_target_writes_a_lossless_drafter(tmp_path, capsys):
    """`run --arch dspark` on a CPU: the shards hold the features and the final hidden states, the drafter written
    is DSpark's without the target's tables, τ is measured with the dspark loop, and it decodes the target's greedy
    output."""
    model, target_dir = _tiny_target_dir(tmp_path)
    minutes = 0.25
    start = time.monotonic()
    train.main(["run", "--arch", "dspark", "--minutes", str(minutes), "--out", str(tmp_path / "run"), "--target",
                str(target_dir), "--data-dir", str(_tiny_data_dir(tmp_path)), "--sources", "gsm8k,chat",
                "--self-instruct", "16", "--max-new-tokens", "32", "--batch-seqs", "4", "--threads", "1"])
    assert time.monotonic() - start <= 1.1 * minutes * 60
    assert "DSpark drafter" in capsys.readouterr().out
    shard = torch.load(sorted((tmp_path / "run" / "data").glob("shard_*.pt"))[0])
    assert len(shard["last_hidden"]) == len(shard["features"]) == len(shard["ids"])
    report = json.loads((tmp_path / "run" / "run.json").read_text())
    assert report["arch"] == "dspark" and all(r["tau"] >= 1 for r in report["tau_by_task"].values())
    assert "lm_head.weight" not in load_file(tmp_path / "run" / "drafter" / "model.safetensors")
    loaded = DSparkDrafter.from_pretrained(tmp_path / "run" / "drafter", dtype=torch.float32)
    target = Target(model, loaded.config.target_layer_ids)
    for prompt in ([3, 5, 9, 4], [7, 1, 1, 2, 8, 30]):
        res = sd.generate(target, loaded, [prompt], method="dspark", max_new_tokens=24)[0]
        assert res.tokens == sd.generate(target, None, [prompt], method="ar", max_new_tokens=24)[0].tokens


def test_init_of_the_other_architecture_is_refused(tmp_path):
    """`train --arch dspark --init` a DFlash 2 checkpoint, or the reverse, stops with one line naming --arch."""
    model, _, args = _setup(tmp_path)
    args.steps = 1
    for arch, other in (("dflash2", "dspark"), ("dspark", "dflash2")):
        args.arch, args.init, args.block_size = arch, None, None
        fit.train(args, target=model)
        (tmp_path / arch).mkdir()
        for f in (tmp_path / "drafter").iterdir():
            (tmp_path / arch / f.name).write_bytes(f.read_bytes())
        wrong = argparse.Namespace(**{**vars(args), "arch": other, "init": str(tmp_path / arch)})
        with pytest.raises(SystemExit, match=f"--arch {arch}"):
            fit.train(wrong, target=model)
