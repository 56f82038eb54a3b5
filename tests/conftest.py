"""No test measures this machine: the speculation policy's costs are injected (a made-up, steady machine), so no
result depends on how fast or how busy the machine running the suite is. A test that drives the cost cache or the
CLI's notes on measuring itself is marked `measures_costs` and injects its own measurement."""
import pytest

from dflash2 import policy, spec_decode

# V(w) = 1 + 0.05 (w - 1), a draft 0.2: drafting pays from tau 1.3, so the policy drafts on the tiny pairs and
# decodes plainly where they accept nothing (both paths run).
INJECTED = policy.Costs([1 + 0.05 * (w - 1) for w in range(1, 65)], 0.2, 0.3, "injected for the tests", 1.0)


def injected_costs(target, drafter):
    return INJECTED


@pytest.fixture(autouse=True)
def machine_costs_injected(request, monkeypatch):
    """Every test reads INJECTED where the loop, the CLI and the bench would read this machine's costs."""
    if request.node.get_closest_marker("measures_costs") is None:
        monkeypatch.setattr(policy, "machine_costs", injected_costs)
        monkeypatch.setattr(spec_decode, "machine_costs", injected_costs)  # generate's own name for it
