"""Traces are an oracle: a replay through the reference agrees with what it recorded, an edit is found
at its step and slot, and the golden vectors (regenerate with `python tests/make_golden.py`) reproduce."""
import json
from pathlib import Path

import pytest

import dflash2_ref
from dflash2.trace import check_trace

GOLDEN = Path(__file__).resolve().parent / "golden"
PAIR = ["--target", str(GOLDEN / "target"), "--draft", str(GOLDEN / "draft")]
SETTINGS = {
    "greedy": ["--temperature", "0"],
    "sampled": ["--temperature", "0.9", "--top-p", "0.95", "--top-k", "30", "--seed", "11", "--block-size", "4"],
}


def write_trace(capsys, path, setting):
    rc = dflash2_ref.main([*PAIR, "--prompt", "what is it that", "--max-new-tokens", "20", "--json",
                           "--trace", str(path), *SETTINGS[setting]])
    capsys.readouterr()
    assert rc == 0
    return [json.loads(line) for line in path.read_text().splitlines()]


def check(path, atol=1e-4):
    return check_trace(path, str(GOLDEN / "target"), str(GOLDEN / "draft"), atol=atol)


def save(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


@pytest.mark.parametrize("setting", SETTINGS)
def test_trace_round_trip_agrees(capsys, tmp_path, setting):
    records = write_trace(capsys, tmp_path / "t.jsonl", setting)
    config, steps = records[0], [r for r in records if r["type"] == "step"]
    assert config["type"] == "config" and config["block_size"] == (6 if setting == "greedy" else 4)
    assert set(config["draft"]["sha256"]) == {"config.json", "model.safetensors"}
    # a block shrinks to what is left of the budget: the anchor plus at most the tokens still to make
    to_go = [config["max_new_tokens"] - (s["anchor_pos"] - len(config["prompts"][0]) + 1) for s in steps]
    assert all(len(s["drafts"]) == min(config["block_size"] - 1, n) and len(s["out"]) == s["num_accepted"] + 1
               for s, n in zip(steps, to_go))
    assert all(s["context_len"] == s["anchor_pos"] for s in steps)
    assert (steps[0]["u_accept"] is None) == (setting == "greedy")
    agree, line = check(tmp_path / "t.jsonl")
    assert agree, line
    rc = dflash2_ref.main(["--check-trace", str(tmp_path / "t.jsonl"), *PAIR])
    assert rc == 0 and capsys.readouterr().out.startswith("agree:")


@pytest.mark.parametrize("setting", SETTINGS)
def test_edited_trace_is_reported_at_its_step_and_slot(capsys, tmp_path, setting):
    records = write_trace(capsys, tmp_path / "t.jsonl", setting)
    steps = [r for r in records if r["type"] == "step"]
    assert len(steps) >= 4

    edited = json.loads(json.dumps(records))
    step = [r for r in edited if r["type"] == "step"][2]
    step["candidates"][1][2] += 1  # slot 2, third candidate
    save(tmp_path / "cand.jsonl", edited)
    agree, line = check(tmp_path / "cand.jsonl")
    assert not agree
    assert line == (f"divergence: request 0 step {step['step']} slot 2 field candidates[2]: "
                    f"reference {step['candidates'][1][2] - 1} vs trace {step['candidates'][1][2]}")

    edited = json.loads(json.dumps(records))
    step = [r for r in edited if r["type"] == "step"][3]
    step["num_accepted"] += 1
    save(tmp_path / "acc.jsonl", edited)
    agree, line = check(tmp_path / "acc.jsonl")
    assert not agree and line.startswith(f"divergence: request 0 step {step['step']} field num_accepted: ")
    assert dflash2_ref.main(["--check-trace", str(tmp_path / "acc.jsonl"), *PAIR]) == 1


def test_float_fields_diverge_only_beyond_atol(tmp_path):
    records = [json.loads(line) for line in (GOLDEN / "sampled_dflash2.jsonl").read_text().splitlines()]
    step = next(r for r in records if r["type"] == "step" and r["step"] == 2)
    step["cand_logits"][0][0] += 1e-3
    save(tmp_path / "t.jsonl", records)
    assert check(tmp_path / "t.jsonl", atol=1e-2)[0]
    agree, line = check(tmp_path / "t.jsonl", atol=1e-4)
    assert not agree
    assert f"request {step['request']} step 2 slot 1 field cand_logits[0]" in line and "> atol 0.0001" in line


@pytest.mark.parametrize("name", sorted(p.stem for p in GOLDEN.glob("*.jsonl")))
def test_golden_vectors_reproduce(name):
    agree, line = check(GOLDEN / f"{name}.jsonl")
    assert agree, f"{line}\n(if the math was meant to change: python tests/make_golden.py, and review the diff)"


def test_regenerated_goldens_must_keep_acceptance_counts(tmp_path):
    """make_golden's guard: traces whose num_accepted per step and request moved are not written
    unless a reason is given, and then the reason and the changed traces are logged in CHANGES.md."""
    import make_golden

    golden, staging = tmp_path / "golden", tmp_path / "staging"
    for d in (golden, staging):
        for name in ("target", "draft"):
            (d / name).mkdir(parents=True)
            (d / name / "config.json").write_text(d.name)
    committed = [json.loads(line) for line in (GOLDEN / "greedy_dflash2.jsonl").read_text().splitlines()]
    save(golden / "greedy_dflash2.jsonl", committed)
    same = json.loads(json.dumps(committed))
    same[1]["cand_logits"][0][0] += 1.0  # a change that keeps every acceptance count
    save(staging / "greedy_dflash2.jsonl", same)
    assert make_golden.install(staging, golden, None) == (True, {})
    assert (golden / "greedy_dflash2.jsonl").read_text() == (staging / "greedy_dflash2.jsonl").read_text()
    assert (golden / "target" / "config.json").read_text() == "staging" and not (golden / "CHANGES.md").exists()

    moved = json.loads(json.dumps(committed))
    step = next(r for r in moved if r["type"] == "step" and r["request"] == 1 and r["step"] == 3)
    step["num_accepted"] += 1
    save(staging / "greedy_dflash2.jsonl", moved)
    before = (golden / "greedy_dflash2.jsonl").read_text()
    written, changes = make_golden.install(staging, golden, None)
    assert not written and list(changes) == ["greedy_dflash2"] and changes["greedy_dflash2"].startswith("request 1 ")
    assert (golden / "greedy_dflash2.jsonl").read_text() == before and not (golden / "CHANGES.md").exists()

    assert make_golden.install(staging, golden, "drafts shrink at the end of the budget", today="2026-12-04")[0]
    assert (golden / "greedy_dflash2.jsonl").read_text() == (staging / "greedy_dflash2.jsonl").read_text()
    log = (golden / "CHANGES.md").read_text().splitlines()
    assert log[-1].startswith("- 2026-12-04: drafts shrink at the end of the budget (changed: greedy_dflash2: request 1 ")
    with pytest.raises(SystemExit):
        make_golden.main(["--accept-change", " "])
