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
    "greedy": ["--temperature", "0", "--block-size", "6"],  # full blocks (the policy's traces: test_policy.py)
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


def _edit(value):
    """A different value of the same shape: the first number in it moved (a bool flipped, None made 0)."""
    if isinstance(value, list):
        return [_edit(value[0])] + value[1:] if value else [0]
    if isinstance(value, bool):
        return not value
    if isinstance(value, (int, float)):
        return value + 1
    return 0 if value is None else None


@pytest.mark.parametrize("setting, name", [("sampled", "sampled_dflash2"), ("greedy", "greedy_dflash2")])
def test_trace_checker_compares_every_recorded_field(tmp_path, setting, name):
    """Each field of a step, edited alone (a draft after the first rejection too), is reported by name."""
    records = [json.loads(line) for line in (GOLDEN / f"{name}.jsonl").read_text().splitlines()]
    i, step = next((i, r) for i, r in enumerate(records)
                   if r["type"] == "step" and r["num_accepted"] + 1 < len(r["drafts"]))
    fields = [f for f in step if f not in ("type", "request", "step")]
    for field in fields + ["drafts after the rejection"]:
        edited = json.loads(json.dumps(records))
        if field == "drafts after the rejection":
            field, slot = "drafts", step["num_accepted"] + 1
            edited[i]["drafts"][slot] += 1
        else:
            edited[i][field] = _edit(step[field])
        save(tmp_path / "t.jsonl", edited)
        agree, line = check(tmp_path / "t.jsonl")
        assert not agree and f"field {field}" in line, (field, line)


def test_tree_trace_replays_and_an_edited_node_is_reported(capsys, tmp_path):
    rc = dflash2_ref.main([*PAIR, "--prompt", "what is it that", "--max-new-tokens", "20", "--json", "--method",
                           "dflash2-tree", "--tree-budget", "10", "--trace", str(tmp_path / "t.jsonl")])
    capsys.readouterr()
    assert rc == 0
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    assert records[0]["tree_budget"] == 10 and records[0]["tree_scores"] == "selector"
    steps = [r for r in records if r["type"] == "tree_step"]
    assert steps and all(len(s["tree_tokens"]) == 10 and len(s["target_y"]) == s["num_accepted"] + 1 for s in steps)
    assert check(tmp_path / "t.jsonl")[0]
    steps[1]["tree_tokens"][4] += 1
    save(tmp_path / "e.jsonl", records)
    agree, line = check(tmp_path / "e.jsonl")
    assert not agree and line == (f"divergence: request 0 step {steps[1]['step']} node 5 field tree_tokens: "
                                  f"reference {steps[1]['tree_tokens'][4] - 1} vs trace {steps[1]['tree_tokens'][4]}")
