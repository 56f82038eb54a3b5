"""No test measures this machine: generate, the CLI and the bench run their default policy on injected costs (a
test that measures would see how busy the machine is). A test marked measures_costs reaches the real
spec_decode.machine_costs, with its own measure function or cache."""
import pytest

from targets import synthetic_costs


@pytest.fixture(autouse=True)
def injected_costs(request, monkeypatch):
    """spec_decode.machine_costs returns synthetic costs (targets.synthetic_costs) for every pair."""
    if request.node.get_closest_marker("measures_costs") is None:
        from dflash2 import spec_decode

        monkeypatch.setattr(spec_decode, "machine_costs", lambda target, drafter: synthetic_costs())
