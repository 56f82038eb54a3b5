"""Experiment, not a feature: propose from softmax(S / (T * F)) instead of SPEC §4's softmax(S / T) at T > 0.

Verification divides by the same q, so the output keeps the target's law for any F; only tau changes.
F = 1 is the specification, F = 0 a greedy walk (one-hot q). It runs bench.py with select_path patched:

    python docs/results/draft_temperature.py F  [bench.py's arguments ...]
"""

import runpy
import sys

import dflash2.proposers as proposers

F = float(sys.argv[1])
_select_path = proposers.select_path


def scaled_select_path(selector, h, U, anchor, temperature, generator):
    return _select_path(selector, h, U, anchor, temperature * F, generator)


proposers.select_path = scaled_select_path  # looked up as a module global by DFlash2Walk
sys.argv = ["dflash2.bench"] + sys.argv[2:]
runpy.run_module("dflash2.bench", run_name="__main__")
