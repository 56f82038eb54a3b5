"""The installed package: our import names are ours alone, and the command line works from anywhere."""
import importlib.metadata
import json
import subprocess
import sys
import zipfile
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent
GOLDEN = ROOT / "tests" / "golden"
OURS = {"dflash2", "dflash2_ref"}


def test_our_import_names_are_ours_alone():
    """Every top-level name dflash2-ref installs is one of ours, and no other distribution provides it."""
    providers = importlib.metadata.packages_distributions()
    installed = {name for name, dists in providers.items() if "dflash2-ref" in dists}
    assert installed == OURS, f"dflash2-ref installs {sorted(installed)}; expected only {sorted(OURS)}"
    for name in OURS:
        assert set(providers[name]) == {"dflash2-ref"}, f"{name} is also provided by {providers[name]}"


def test_wheel_holds_one_package_and_the_embedded_drafter(tmp_path):
    """A non-editable install gets the package with its drafter as package data, and nothing else at top level."""
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert build.returncode == 0, build.stderr
    [wheel] = tmp_path.glob("dflash2_ref-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    top = {n.split("/")[0].removesuffix(".py") for n in names if ".dist-info" not in n.split("/")[0]}
    assert top == OURS, sorted(top)
    assert {"dflash2/checkpoints/dflash2-smollm2-135m/config.json",
            "dflash2/checkpoints/dflash2-smollm2-135m/model.safetensors"} <= set(names)


def console_script():
    script = Path(sys.executable).parent / "dflash2-ref"
    assert script.exists(), f"the console script {script} is missing: install with pip install -e ."
    return str(script)


def test_help_and_usage_errors_do_not_import_torch():
    """--help and bad settings are answered before torch (seconds to import) is loaded."""
    probe = ("import sys, dflash2_ref\n"
             "rc = dflash2_ref.main(['--prompt', 'x', '--top-p', '2'])\n"
             "print(rc, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.stdout.split() == ["2", "False", "False"], out.stderr


def test_command_line_from_outside_the_checkout(tmp_path):
    """The installed dflash2-ref: --help lists every default, and a short decode of the tiny pair runs."""
    script = console_script()
    help_ = subprocess.run([script, "--help"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert help_.returncode == 0 and "(default: 256)" in help_.stdout and "--attn-backend" in help_.stdout
    run = subprocess.run([script, "--target", str(GOLDEN / "target"), "--draft", str(GOLDEN / "draft"),
                          "--prompt", "the time", "--max-new-tokens", "8", "--block-size", "4", "--baseline", "--json"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    report = json.loads(run.stdout)
    assert report["identical"] is True and report["completion_tokens"] >= 1
