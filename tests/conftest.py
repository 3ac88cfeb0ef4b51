import pytest

from distributed import DistributedRunner


@pytest.fixture(scope="session")
def dist_run():
    """``dist_run(fn, world_size, *args, timeout=...)``: run ``fn`` on that many gloo ranks."""
    runner = DistributedRunner()
    yield runner
    runner.close()
