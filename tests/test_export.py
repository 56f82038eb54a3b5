"""Serving-ready exports: the shipped configs read and write back byte-identical, and the export writer
refuses (or faithfully rewrites) what an engine would misread."""
import json
from pathlib import Path

import pytest

from dflash2.checkpoint import DFlash2Config
from dflash2.dspark import DSparkConfig

ROOT = Path(__file__).resolve().parents[1]
SHIPPED = sorted((ROOT / "dflash2" / "checkpoints").glob("*/config.json"))


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.parent.name)
def test_shipped_configs_write_back_byte_identical(path):
    text = path.read_text()
    cls = DSparkConfig if json.loads(text)["architectures"] == ["Qwen3DSparkModel"] else DFlash2Config
    assert json.dumps(cls.from_dict(json.loads(text)).to_dict(), indent=2) + "\n" == text
