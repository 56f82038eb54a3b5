"""No test measures this machine: generate, the CLI and the bench run their default policy on injected costs (a
test that measures would see how busy the machine is). A test marked measures_costs reaches the real
spec_decode.machine_costs, with its own measure function or cache."""
import pytest

from targets import synthetic_costs


@pytest.fixture(autouse=True)
def injected_costs(request, monkeypatch):
    """spec_decode.machine_costs returns synthetic costs (targets.synthetic_costs) for every pair, and the CLI
    does not announce a measurement."""
    if request.node.get_closest_marker("measures_costs") is None:
        import dflash2_ref
        from dflash2 import spec_decode

        monkeypatch.setattr(spec_decode, "machine_costs", lambda target, drafter: synthetic_costs())
        monkeypatch.setattr(dflash2_ref, "costs_file_keys", lambda path: Everything())  # nothing measured: no note


class Everything:
    """Holds every cost key (the CLI's check whether it is about to measure)."""

    def __contains__(self, key):
        return True
