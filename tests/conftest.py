"""No test measures this machine: generate, the CLI and the bench run their default policy on injected costs
(targets.synthetic_costs, a made-up steady machine), so no result depends on how fast or how busy the machine running
the suite is. A test that drives the cost cache or the CLI's notes on measuring itself is marked `measures_costs` and
injects its own measurement."""
import pytest

from targets import synthetic_costs


@pytest.fixture(autouse=True)
def injected_costs(request, monkeypatch):
    """policy.machine_costs (and generate's name for it) returns synthetic costs for every pair, and the CLI does not
    announce a measurement."""
    if request.node.get_closest_marker("measures_costs") is None:
        import dflash2_ref
        from dflash2 import policy, spec_decode

        monkeypatch.setattr(policy, "machine_costs", lambda target, drafter: synthetic_costs())
        monkeypatch.setattr(spec_decode, "machine_costs", lambda target, drafter: synthetic_costs())
        monkeypatch.setattr(dflash2_ref, "costs_file_keys", lambda path: Everything())  # nothing measured: no note


class Everything:
    """Holds every cost key (the CLI's check whether it is about to measure)."""

    def __contains__(self, key):
        return True
