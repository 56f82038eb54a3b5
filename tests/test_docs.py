"""docs/SPEC.md is the section list the code cites: every "SPEC §n" in the package, the CLI, the tests,
README.md and docs/*.md names a section it has, and its sections are numbered 1..N without gaps. And every name
of the code the docs cite, `module.name`, `module.Class.attr` or `module.py: name`, exists there."""
import importlib
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPEC = Path("docs") / "SPEC.md"

HEADING = re.compile(r"^## §(\d+) ", re.M)
# "SPEC §3", "SPEC.md §5", "[SPEC.md](SPEC.md) §5", "SPEC §1-4", "SPEC §3-§5", "SPEC §3, §5 and §7":
# after a range dash the § is optional, after a comma or "and"/"or" it is required (so "SPEC §6, 4 runs"
# cites §6 only).
CITATION = re.compile(r"\bSPEC(?:\.md)?(?:\]\([^)\s]*\))?\s*"
                      r"(§\s*\d+(?:\s*(?:(?:[-–—]|to)\s*§?|(?:,|and|or)\s*§)\s*\d+)*)")
PART = re.compile(r"(\d+)(?:\s*(?:[-–—]|to)\s*§?\s*(\d+))?")
BARE = re.compile(r"§\s*(\d+)(?:\s*[-–—]\s*§?\s*(\d+))?")


def spec_sections(text):
    """Section numbers of a SPEC.md text, in order of appearance."""
    return [int(n) for n in HEADING.findall(text)]


def numbering_problems(sections):
    """Why a list of section numbers is not 1..N (empty when it is)."""
    if not sections:
        return ["no '## §n ' headings at all"]
    expected = list(range(1, len(sections) + 1))
    if sections == expected:
        return []
    missing = sorted(set(range(1, max(sections) + 1)) - set(sections))
    dupes = sorted({n for n in sections if sections.count(n) > 1})
    return [f"sections {sections} are not 1..{len(sections)}"
            + (f"; missing §{', §'.join(map(str, missing))}" if missing else "")
            + (f"; repeated §{', §'.join(map(str, dupes))}" if dupes else "")]


def _expand(match_text, part=PART):
    """The section numbers a citation's § part names: '§3-§5' -> [3, 4, 5], '§3, §7' -> [3, 7]."""
    out = []
    for m in part.finditer(match_text):
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        out += list(range(lo, hi + 1)) if lo <= hi else [lo, hi]
    return out


def cited_sections(line):
    """[(citation text, [section numbers])] for every SPEC citation in one line."""
    return [(m.group(0), _expand(m.group(1))) for m in CITATION.finditer(line)]


def citing_files(root):
    """The files whose citations must resolve: dflash2/**.py, dflash2_ref.py, tests/**.py, README.md, docs/*.md."""
    root = Path(root)
    files = sorted((root / "dflash2").rglob("*.py")) + [root / "dflash2_ref.py"]
    files += sorted((root / "tests").rglob("*.py")) + [root / "README.md"] + sorted((root / "docs").glob("*.md"))
    return [f for f in files if f.is_file()]


def citation_problems(root):
    """'file:line: citation names §n, which docs/SPEC.md lacks' for every unresolved citation under root,
    plus unresolved bare §n cross-references inside docs/SPEC.md itself."""
    root = Path(root)
    spec_text = (root / SPEC).read_text(encoding="utf-8")
    have = set(spec_sections(spec_text))
    problems = []
    for path in citing_files(root):
        rel = path.relative_to(root).as_posix()
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            found = cited_sections(line)
            if path == root / SPEC and not HEADING.match(line + " "):
                found += [(m.group(0), _expand(m.group(0), BARE)) for m in BARE.finditer(line)]
            for text, numbers in found:
                for n in numbers:
                    if n not in have:
                        problems.append(f"{rel}:{lineno}: {text!r} names §{n}, which {SPEC.as_posix()} does not have "
                                        f"(its sections: {', '.join(map(str, sorted(have))) or 'none'})")
    return problems


# `policy.Policy.cut_chain`, `dflash2.spec_decode.generate(...)`: a package module, then attributes
DOTTED = re.compile(r"`(?:dflash2\.)?([a-z_][a-z0-9_]*)((?:\.[A-Za-z_][A-Za-z0-9_]*)+)(?=[`( \[:,])")
# `spec_decode.py: decode_step`, `model.py: DraftContext.write`: the README's guided reading
IN_FILE = re.compile(r"`(?:dflash2/)?([a-z_][a-z0-9_]*)\.py: ([A-Za-z_][A-Za-z0-9_.]*)`")
FILE_NAMES = ("py", "md", "json", "jsonl", "safetensors", "png")  # `model.safetensors` names a file


def package_modules(root):
    return {p.stem for p in (Path(root) / "dflash2").glob("*.py") if p.stem != "__init__"}


def cited_names(line, modules):
    """[(module, [attribute, ...])] for every backticked name of a package module in one line."""
    out = [(m.group(1), m.group(2)[1:].split(".")) for m in DOTTED.finditer(line)]
    out += [(m.group(1), m.group(2).split(".")) for m in IN_FILE.finditer(line)]
    return [(mod, parts) for mod, parts in out if mod in modules and parts[-1] not in FILE_NAMES]


def resolves(module, parts):
    obj = importlib.import_module(f"dflash2.{module}")
    for p in parts:
        if not hasattr(obj, p):
            return False
        obj = getattr(obj, p)
    return True


def name_problems(root):
    """'file:line: `module.name` does not exist' for every cited name of README.md and docs/*.md that the code
    (this checkout's dflash2) does not have."""
    root, modules = Path(root), package_modules(ROOT)
    problems = []
    for path in [root / "README.md"] + sorted((root / "docs").glob("*.md")):
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for module, parts in cited_names(line, modules):
                if not resolves(module, parts):
                    problems.append(f"{path.relative_to(root).as_posix()}:{lineno}: `{'.'.join([module] + parts)}` "
                                    "does not exist")
    return problems


# --- the repository ---


def test_every_cited_name_exists():
    problems = name_problems(ROOT)
    assert not problems, "names in the docs that the code lacks:\n  " + "\n  ".join(problems)
    cited = [n for f in [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
             for line in f.read_text(encoding="utf-8").splitlines() for n in cited_names(line, package_modules(ROOT))]
    assert len(cited) > 50  # the scan sees the docs' names (a pattern that matched nothing would pass vacuously)


def test_a_stale_name_is_reported(tmp_path):
    (tmp_path / "docs").mkdir()
    (tmp_path / "README.md").write_text("Runs `spec_decode.generate(...)`, `policy.Policy.cut_chain` and\n"
                                        "`model.py: DraftContext.write`; reads `model.safetensors`.\n"
                                        "Gone: `train.drafter_loss`, `spec_decode.py: draft_confidence`.\n")
    (tmp_path / "docs" / "X.md").write_text("`policy.Policy.no_such_method`, `torch.compile`\n")
    assert name_problems(tmp_path) == [
        "README.md:3: `train.drafter_loss` does not exist", "README.md:3: `spec_decode.draft_confidence` does not exist",
        "docs/X.md:1: `policy.Policy.no_such_method` does not exist"]


def test_spec_sections_are_numbered_without_gaps():
    sections = spec_sections((ROOT / SPEC).read_text(encoding="utf-8"))
    assert not numbering_problems(sections), numbering_problems(sections)


def test_every_spec_citation_names_a_section():
    problems = citation_problems(ROOT)
    assert not problems, "SPEC citations without a section in docs/SPEC.md:\n  " + "\n  ".join(problems)


def test_the_citations_are_found():
    """The scan sees the citations it should (a regex that matched nothing would pass vacuously)."""
    files = {f.relative_to(ROOT).as_posix() for f in citing_files(ROOT)}
    assert {"dflash2/model.py", "dflash2_ref.py", "README.md", "docs/SPEC.md", "docs/SPEC_NOTES.md"} <= files
    cited = {n for f in citing_files(ROOT) for line in f.read_text(encoding="utf-8").splitlines()
             for _, numbers in cited_sections(line) for n in numbers}
    assert {2, 3, 4, 5, 7, 8} <= cited


# --- the checks can fail ---


def test_citation_forms():
    s = "SPEC " + "§"  # built, so that this file's own citations stay the real ones
    assert cited_sections(f"x ({s}3) y") == [(f"{s}3", [3])]
    assert cited_sections(f"({s}1-4)")[0][1] == [1, 2, 3, 4]
    assert cited_sections(f"as in {s}3-§5: slot")[0][1] == [3, 4, 5]
    assert cited_sections(f"{s}3, §5 and §7")[0][1] == [3, 5, 7]
    assert cited_sections(f"{s}6, 4 runs")[0][1] == [6]
    assert cited_sections("docs/SPEC.md " + "§5, torch only")[0][1] == [5]
    assert cited_sections("[SPEC.md](SPEC.md) " + "§5)")[0][1] == [5]
    assert cited_sections("SPEC_NOTES.md " + "§5, SPECIALS §2, SPEC.md, (SPEC)") == []


def test_a_missing_section_is_reported(tmp_path):
    """A copy of the repository's SPEC.md with §7 cut out: the numbering check names the gap and the
    citation check names each file, line and citation that pointed at §7."""
    text = (ROOT / SPEC).read_text(encoding="utf-8")
    start = text.index("\n## §7 ")
    end = text.index("\n## §8 ")
    (tmp_path / "docs").mkdir()
    (tmp_path / SPEC).write_text(text[:start] + text[end:], encoding="utf-8")
    s = "SPEC " + "§"
    (tmp_path / "dflash2").mkdir()
    (tmp_path / "dflash2" / "mod.py").write_text(f'"""A module.\n\nTargets ({s}7).\n"""\n', encoding="utf-8")
    (tmp_path / "README.md").write_text(f"# r\n\nFine ({s}5); a range ({s}6-§8).\n", encoding="utf-8")

    gaps = numbering_problems(spec_sections((tmp_path / SPEC).read_text(encoding="utf-8")))
    assert len(gaps) == 1 and "missing §7" in gaps[0], gaps

    problems = citation_problems(tmp_path)
    assert len(problems) == 2, problems
    assert problems[0].startswith("dflash2/mod.py:3: ") and "§7" in problems[0], problems
    assert problems[1].startswith("README.md:3: ") and f"'{s}6-§8' names §7" in problems[1], problems

    # bare cross-references inside SPEC.md are checked too
    with open(tmp_path / SPEC, "a", encoding="utf-8") as f:
        f.write("\nSee §7 for targets.\n")
    assert any(p.startswith("docs/SPEC.md:") and "'§7'" in p for p in citation_problems(tmp_path))


def test_numbering_problems():
    assert numbering_problems([1, 2, 3]) == []
    assert "missing §2" in numbering_problems([1, 3])[0]
    assert "repeated §2" in numbering_problems([1, 2, 2])[0]
    assert numbering_problems([2, 1])  # out of order
    assert numbering_problems([])


# --- the benchmark tables and the scripts under docs/ ---

# A generated table: the report command closes a bash block; the table follows, up to the end marker.
GENERATED = re.compile(r"^(python -m dflash2\.bench --report [^\n]+)\n```\n\n(.*?)\n\n<!-- end of table -->$", re.M | re.S)
RESULTS_DOCS = ["README.md", "docs/BENCHMARKS.md"]


def generated_tables(text):
    """[(report command, the table text below it)] in a markdown text."""
    return GENERATED.findall(text)


def printed_table(command, root=ROOT):
    """What the report command prints, run in-process from the repository root."""
    import shlex

    from dflash2 import bench

    args = bench.build_parser().parse_args(shlex.split(command)[3:])
    args.report = str(root / args.report)
    return bench.reported(args)[1]


def test_every_benchmark_table_is_printed_from_its_results_file():
    seen = 0
    for doc in RESULTS_DOCS:
        text = (ROOT / doc).read_text(encoding="utf-8")
        for command, table in generated_tables(text):
            assert printed_table(command) == table, f"{doc}: the table below `{command}` is not what it prints"
            seen += 1
        hand = [line for line in GENERATED.sub("", text).splitlines() if line.startswith("|")]
        assert doc == "README.md" or not hand, f"{doc} has a table no command prints: {hand[0]}"
    assert seen >= 8


def test_a_table_that_disagrees_with_its_file_is_caught():
    text = (ROOT / "docs" / "BENCHMARKS.md").read_text(encoding="utf-8")
    command, table = generated_tables(text)[0]
    changed = table.replace("×", "1×", 1)  # one speedup with a digit added
    assert changed != table and printed_table(command) != changed


def test_the_records_stay_short():
    for doc, most in (("docs/BENCHMARKS.md", 265), ("README.md", 280)):
        n = len((ROOT / doc).read_text(encoding="utf-8").splitlines())
        assert n <= most, f"{doc} has {n} lines (at most about {most})"


def current_docs_text(root=ROOT):
    return "\n".join(p.read_text(encoding="utf-8") for p in [root / "README.md", *sorted((root / "docs").glob("*.md"))])


def test_every_results_file_is_named_in_a_current_doc():
    text = current_docs_text()
    results = ROOT / "docs" / "results"
    unnamed = [p.relative_to(ROOT).as_posix() for p in sorted(results.rglob("*")) if p.is_file() and p.name not in text
               and (p.parent == results or f"results/{p.relative_to(results).parts[0]}" not in text)]
    assert not unnamed, f"docs/results files no current doc names: {unnamed}"


def docs_scripts(root=ROOT):
    return sorted(p for p in (root / "docs").rglob("*") if p.suffix in (".py", ".sh"))


def attribute_writes(source):
    """Where a Python script assigns to an attribute of a dflash2 module (or setattr's one): ['line: text']."""
    import ast

    tree = ast.parse(source)
    modules = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules |= {(a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] == "dflash2"}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "dflash2":
            modules |= {a.asname or a.name for a in node.names}

    def base(node):
        while isinstance(node, ast.Attribute):
            node = node.value
        return node.id if isinstance(node, ast.Name) else None

    found = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        if any(isinstance(t, ast.Attribute) and base(t) in modules for t in targets):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("setattr", "delattr") \
                and node.args and base(node.args[0]) in modules:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_docs_scripts_are_tested_tools_that_use_public_hooks():
    """Every script under docs/ is run by a test (named outside a comment in tests/), and none patches the package's
    modules."""
    tests = "\n".join(line.split("#")[0] for p in sorted((ROOT / "tests").glob("*.py"))
                      for line in p.read_text(encoding="utf-8").splitlines())
    for script in docs_scripts():
        rel = script.relative_to(ROOT).as_posix()
        assert f'"{script.name}"' in tests or rel in tests, f"{rel} has no smoke test in tests/"
        if script.suffix == ".py":
            writes = attribute_writes(script.read_text(encoding="utf-8"))
            assert not writes, f"{rel} assigns to a dflash2 module's attribute: {writes}"


def test_a_script_that_patches_the_loop_is_caught():
    bad = ("from dflash2 import spec_decode as sd\nimport dflash2.policy\nsd.draft = None\n"
           "setattr(dflash2.policy, 'x', 1)\nx = sd.draft\n")
    assert [w.split(":")[0] for w in attribute_writes(bad)] == ["3", "4"]
