"""The bench's tables, from its results JSON: what a run prints, and what `python -m dflash2.bench --report FILE`
prints again from the file, so a table in the docs and its data cannot disagree.

Sections (SECTIONS, each optional): the machine's measured costs; per sampling (greedy, or T / top-p), the model
card's layout (tau per task, throughput with the speedup over ar, the speedup's range over the tasks), each
wave's speedup (--interleave), each cell's verified widths with its tau and speedup, the peers side by side at
concurrency 1, and the per-step time split (--profile). An --alternate run has its own table, as has --pld-sweep.
"""
import statistics

SECTIONS = ("costs", "tau", "speed", "range", "waves", "widths", "peers", "profile")
PHASES = ["drafter", "selector", "verify", "bookkeeping"]  # the phases the bench's --profile times in each step
GOALS = {"hf-pld": 1.8, "hf": 2.5}  # issue 22: dflash2's speedup over each peer at concurrency 1, on every task
WIDTH_BUCKETS = ((1, 1), (2, 4), (5, 8), (9, 16), (17, 64))  # verified block with its anchor; 1 = a plain step


def _fmt(x, spec=".2f"):
    return "–" if x is None else format(x, spec)


def _shown(r, text):
    """A table cell: the figure, or in words why the method did not run there."""
    return text if r.get("cannot_run") is None else r["cannot_run"].split(" (")[0]


def sampling_name(temperature, top_p, top_k=0):
    if temperature == 0:
        return "greedy"
    return f"T = {temperature:g}" + (f", top-p {top_p:g}" if top_p < 1 else "") + (f", top-k {top_k}" if top_k else "")


def costs_lines(config):
    """The machine as the run saw it, and its measured costs the policy ran with, one line per drafter (older files:
    one, unnamed)."""
    costs = config.get("costs") or {}
    named = {"": costs} if "verify" in costs else costs
    torch = f"; torch {config['torch']}" if config.get("torch") else ""
    machine = [f"machine: {config['machine']}{torch}"] if config.get("machine") and costs else []
    return machine + [(f"{name} " if name else "") + "costs (units of a one-token forward): verify "
            + ", ".join(f"V({w}) {v}" for w, v in c["verify"].items())
            + f"; draft {c['draft']}, tree draft {c['draft_tree']}; V(1) = {c['one_token_forward_ms']} ms"
            + "".join(f"; {b} rows: " + ", ".join(f"V({w}) {v}" for w, v in at["verify"].items()) + f", draft {at['draft']}"
                      for b, at in (c.get("batches") or {}).items())
            + ("" if c.get("steady", True) else " (UNSTEADY: no two measurements agreed; not cached)")
            for name, c in named.items()]


def tables(rows, tasks, methods, concurrencies, sections=SECTIONS):
    """The model card's layout: tau per task, throughput per task x (concurrency, method), speedup ranges."""
    cell = {(r["task"], r["method"], r["concurrency"]): r for r in rows}
    drafts = [m for m in methods if m not in ("ar", "hf")]  # hf's tau is 1 by definition
    out = []
    if drafts and "tau" in sections:
        c = min(concurrencies)
        out += [f"Acceptance length τ (concurrency {c})\n", "| task | " + " | ".join(drafts) + " |",
                "|---" * (len(drafts) + 1) + "|"]
        for task in tasks:
            out.append(f"| {task} | " + " | ".join(_shown(cell[task, m, c], _fmt(cell[task, m, c]["acceptance_length"]))
                                                  for m in drafts) + " |")
        means = [[cell[t, m, c]["acceptance_length"] for t in tasks] for m in drafts]
        out += ["| mean | " + " | ".join(_fmt(statistics.mean(x) if None not in x else None) for x in means) + " |", ""]
    if "speed" in sections:
        cols = [(c, m) for c in concurrencies for m in methods]
        out += ["Throughput tok/s (speedup vs ar)\n", "| task | " + " | ".join(f"{m} c={c}" for c, m in cols) + " |",
                "|---" * (len(cols) + 1) + "|"]
        for task in tasks:
            cells = []
            for c, m in cols:
                r = cell[task, m, c]
                speedup = f" ({r['speedup_vs_ar']:.2f}×)" if m != "ar" and r["speedup_vs_ar"] is not None else ""
                cells.append(_shown(r, f"{r['throughput_tok_s']:.1f}{speedup}" if r["throughput_tok_s"] else ""))
            out.append(f"| {task} | " + " | ".join(cells) + " |")
        out.append("")
    if "range" in sections and any(m != "ar" for m in methods) and "ar" in methods:
        out += ["Speedup over ar across tasks: min–max (mean)\n",
                "| method | " + " | ".join(f"c={c}" for c in concurrencies) + " |", "|---" * (len(concurrencies) + 1) + "|"]
        for m in methods:
            if m == "ar":
                continue
            cells = []
            for c in concurrencies:
                s = [cell[t, m, c]["speedup_vs_ar"] for t in tasks]
                cells.append(f"{min(s):.2f}×–{max(s):.2f}× ({statistics.mean(s):.2f}×)" if None not in s
                             else _shown(cell[tasks[0], m, c], "–"))
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        out.append("")
    per_wave = [r for r in rows if r.get("wave_speedups") and r["method"] != "ar"]
    if per_wave and "waves" in sections:  # --interleave
        turns = ("the methods decode a wave of `c` prompts at once, taking turns step by step"
                 if per_wave[0].get("lockstep")
                 else "each method timed on a wave of `c` prompts in turn")
        out += [f"Each wave's speedup over ar (--interleave: {turns}, one prompt at c = 1; pooled over "
                f"{per_wave[0].get('rounds', 1)} round(s)): lowest, median, waves below 0.95× and below 1.0×\n",
                "| task | c | method | lowest | median | < 0.95× | < 1.0× |", "|---|---|---|---|---|---|---|"]
        for r in per_wave:
            x = r["wave_speedups"]
            out.append(f"| {r['task']} | {r['concurrency']} | {r['method']} | {min(x):.2f}× | "
                       f"{statistics.median(x):.2f}× | {sum(v < 0.95 for v in x)} of {len(x)} | "
                       f"{sum(v < 1.0 for v in x)} of {len(x)} |")
        out.append("")
    reasons = sorted({r["cannot_run"] for r in rows if r.get("cannot_run")})
    if reasons:
        out += ["Not run:"] + [f"- {why}" for why in reasons] + [""]
    return "\n".join(out).rstrip("\n")


def widths_table(rows):
    """Each drafting cell: tau, tok/s (speedup over ar), and the share of decode steps at each verified width."""
    drafted = [r for r in rows if r.get("widths")]
    if not drafted:
        return ""
    share = [{b: sum(s for w, s in r["widths"].items() if b[0] <= int(w) <= b[1]) for b in WIDTH_BUCKETS} for r in drafted]
    buckets = [b for b in WIDTH_BUCKETS if any(s[b] for s in share)]
    names = ["plain (1)" if b == (1, 1) else f"{b[0]}–{b[1]}" if b[1] < 64 else f"{b[0]}+" for b in buckets]
    out = ["Verified widths (anchor included; 1 = a plain step): share of each cell's decode steps\n",
           "| task | method | c | τ | tok/s (vs ar) | " + " | ".join(names) + " |", "|---" * (5 + len(buckets)) + "|"]
    for r, s in zip(drafted, share):
        speed = _fmt(r["throughput_tok_s"], ".1f") + (f" ({r['speedup_vs_ar']:.2f}×)" if r["speedup_vs_ar"] else "")
        out.append(f"| {r['task']} | {r['method']} | {r['concurrency']} | {_fmt(r['acceptance_length'])} | {speed} | "
                   + " | ".join(f"{s[b]:.2f}" for b in buckets) + " |")
    return "\n".join(out)


def side_by_side(rows, tasks, methods):
    """Concurrency 1, every method on the same target object: tok/s (speedup vs hf), and dflash2's ratio to each
    peer against its goal. A cell whose greedy output differs from ar's says so."""
    cell = {(r["task"], r["method"]): r for r in rows if r["concurrency"] == 1}
    ratios = [p for p in GOALS if p in methods and "dflash2" in methods]
    out = ["Side by side at concurrency 1 on the same target object: tok/s (speedup vs hf); "
           "greedy outputs checked against ar's\n",
           "| task | " + " | ".join(methods) + "".join(f" | dflash2 / {p} (goal ≥ {GOALS[p]}×)" for p in ratios) + " |",
           "|---" * (len(methods) + len(ratios) + 1) + "|"]
    for task in tasks:
        cells = []
        for m in methods:
            r = cell[task, m]
            vs = f" ({r['speedup_vs_hf']:.2f}×)" if r.get("speedup_vs_hf") is not None and m != "hf" else ""
            differs = " DIFFERS from ar" if r["identical_to_ar"] is False else ""
            cells.append(_shown(r, f"{_fmt(r['throughput_tok_s'], '.1f')}{vs}{differs}"))
        for p in ratios:
            ours, peer = cell[task, "dflash2"]["throughput_tok_s"], cell[task, p]["throughput_tok_s"]
            cells.append(f"{ours / peer:.2f}× ({'met' if ours / peer >= GOALS[p] else 'not met'})" if ours and peer else "–")
        out.append(f"| {task} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def profile_table(rows):
    """Milliseconds per request-step by phase (a batched step's time shared among its rows); the drafting overhead
    relative to verification; and what a step costs in ar steps at the same task and concurrency. That cost is the
    tau a method needs to break even there: its speedup over ar is about tau / cost (prefill aside)."""
    out = ["Per-step time split, ms per request-step: a batched step's time shared among its rows (overhead = "
           "drafter + selector + bookkeeping, as a share of verify; ar steps = this step's time / an ar step's at "
           "the same task and concurrency: the tau that breaks even)\n",
           "| task | concurrency | method | " + " | ".join(PHASES) + " | overhead | ar steps |",
           "|---" * (len(PHASES) + 5) + "|"]
    total = {(r["task"], r["concurrency"], r["method"]): sum(r["step_ms"].values()) for r in rows if "step_ms" in r}
    for r in rows:
        t = r.get("step_ms")
        if not t or not t.get("verify"):  # not profiled, or every request ended at its prefill
            continue
        overhead = sum(t.get(k, 0.0) for k in ("drafter", "selector", "bookkeeping")) / t["verify"]
        ar = total.get((r["task"], r["concurrency"], "ar"))
        cost = f"{sum(t.values()) / ar:.2f}" if ar else "–"
        out.append(f"| {r['task']} | {r['concurrency']} | {r['method']} | "
                   + " | ".join(f"{t.get(k, 0.0):.1f}" for k in PHASES) + f" | {100 * overhead:.0f}% | {cost} |")
    return "\n".join(out)


def alternate_table(rows, config, sections=SECTIONS):
    """--alternate: tok/s per round of each mode (eager, compiled), and compiled / eager; with --profile the split."""
    n = config["alternate"]
    out = ["Eager vs compiled, alternating in one process: tok/s per round\n",
           "| task | method | c | " + " | ".join(f"eager {i + 1} | compiled {i + 1}" for i in range(n))
           + " | compiled / eager (mean) |", "|---" * (4 + 2 * n) + "|"]
    for task in config["tasks"]:
        for c in config["concurrency"]:
            for m in config["methods"]:
                mine = [r for r in rows if (r["task"], r["method"], r["concurrency"]) == (task, m, c)]
                tok = {mode: [r["throughput_tok_s"] for r in mine if r["mode"] == mode] for mode in ("eager", "compiled")}
                cells = [f"{e:.1f} | {k:.1f}" for e, k in zip(tok["eager"], tok["compiled"])]
                ratio = statistics.mean(tok["compiled"]) / statistics.mean(tok["eager"])
                out.append(f"| {task} | {m} | {c} | " + " | ".join(cells) + f" | {ratio:.2f}× |")
    if config.get("profile") and "profile" in sections:
        out += ["", "Per-step time split by round, ms (--profile)\n",
                "| round | mode | task | method | " + " | ".join(PHASES) + " |", "|---" * (4 + len(PHASES)) + "|"]
        for r in rows:
            t = r["step_ms"]
            out.append(f"| {r['round']} | {r['mode']} | {r['task']} | {r['method']} | "
                       + " | ".join(f"{t[k]:.1f}" if k in t else "–" for k in PHASES) + " |")
    return "\n".join(out)


def pld_means(rows, config):
    """--pld-sweep: {(num_tokens, ngram): mean tok/s over the tasks}, in the sweep's order."""
    cell = {(r["task"], r["pld_num_tokens"], r["pld_ngram"]): r for r in rows}
    return {(n, g): statistics.mean(cell[t, n, g]["throughput_tok_s"] for t in config["tasks"])
            for n, g in map(tuple, config["pld_sweep"])}


def pld_table(rows, config):
    """--pld-sweep: tok/s (tau) of prompt lookup at each setting per task, the mean, and the best setting."""
    tasks, settings = config["tasks"], [tuple(p) for p in config["pld_sweep"]]
    cell = {(r["task"], r["pld_num_tokens"], r["pld_ngram"]): r for r in rows}
    mean = pld_means(rows, config)
    out = ["hf-pld sweep at concurrency 1: tok/s (τ)\n",
           "| num_tokens | ngram | " + " | ".join(tasks) + " | mean tok/s |", "|---" * (len(tasks) + 3) + "|"]
    for n, g in settings:
        out.append(f"| {n} | {g} | " + " | ".join(f"{cell[t, n, g]['throughput_tok_s']:.1f} "
                                                  f"({_fmt(cell[t, n, g]['acceptance_length'])})" for t in tasks)
                   + f" | {mean[n, g]:.1f} |")
    best = max(mean, key=mean.get)
    return "\n".join(out + [f"\nbest: --pld-num-tokens {best[0]} --pld-ngram {best[1]}"])


def samplings(data):
    """The results' rows grouped by sampling, in run order: [((temperature, top_p), rows)]."""
    config, groups = data["config"], {}
    for r in data["results"]:
        groups.setdefault((r.get("temperature", config["temperature"]), r.get("top_p", config["top_p"])), []).append(r)
    return list(groups.items())


def only_concurrencies(data, concurrencies, name):
    """A results JSON cut to the cells at these concurrencies (--report FILE --concurrency ...); each must be one the
    run measured."""
    ran = data["config"]["concurrency"]
    missing = [c for c in concurrencies if c not in ran]
    if missing:
        raise SystemExit(f"--concurrency {','.join(map(str, missing))}: {name} has concurrency "
                         f"{','.join(map(str, ran))} only")
    keep = [c for c in ran if c in concurrencies]
    return {**data, "config": {**data["config"], "concurrency": keep},
            **{k: [r for r in data[k] if r["concurrency"] in keep] for k in ("results", "alternate") if k in data}}


def text(data, sections=SECTIONS):
    """Every table of a bench results JSON (the dict the bench wrote), in the order the run printed them."""
    config = data["config"]
    if "alternate" in data:
        return alternate_table(data["alternate"], config, sections)
    if "pld_sweep" in data:
        return pld_table(data["pld_sweep"], config)
    out = []
    if "costs" in sections:
        out += costs_lines(config)
    groups = samplings(data)
    for (temperature, top_p), rows in groups:
        parts = [tables(rows, config["tasks"], config["methods"], config["concurrency"], sections)]
        if "widths" in sections:
            parts.append(widths_table(rows))
        if "peers" in sections and any(m in GOALS or m == "zlab" for m in config["methods"]) and 1 in config["concurrency"]:
            parts.append(side_by_side(rows, config["tasks"], config["methods"]))
        if "profile" in sections and any("step_ms" in r for r in rows):
            parts.append(profile_table(rows))
        parts = [p for p in parts if p]
        if len(groups) > 1 and parts:
            parts.insert(0, f"**{sampling_name(temperature, top_p, config.get('top_k', 0))}**")
        out += parts
    return "\n\n".join(out)


def plot(rows, tasks, methods, concurrencies, path):
    """Left: tau per task and drafting method (lowest concurrency); right: mean throughput vs concurrency."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cell = {(r["task"], r["method"], r["concurrency"]): r for r in rows}
    drafts = [m for m in methods if m not in ("ar", "hf")]

    def value(task, m, c, key):  # a gap where the method did not run
        x = cell[task, m, c][key]
        return float("nan") if x is None else x

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / max(len(drafts), 1)
    for k, m in enumerate(drafts):
        ax1.bar([i + k * width for i in range(len(tasks))],
                [value(t, m, min(concurrencies), "acceptance_length") for t in tasks], width, label=m)
    ax1.set_xticks([i + width * (len(drafts) - 1) / 2 for i in range(len(tasks))], tasks)
    ax1.set_ylabel("acceptance length τ")
    ax1.legend()
    for m in methods:
        ax2.plot(concurrencies, [statistics.mean(value(t, m, c, "throughput_tok_s") for t in tasks)
                                 for c in concurrencies], marker="o", label=m)
    ax2.set_xscale("log", base=2)
    ax2.set_xticks(concurrencies, [str(c) for c in concurrencies])
    ax2.set_xlabel("concurrency")
    ax2.set_ylabel("throughput tok/s (mean over tasks)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path)
