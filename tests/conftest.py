import pytest

from harness import Pools


@pytest.fixture(scope="session")
def pools():
    """pools(n): a pool of n gloo processes, started on first use and shared by the session."""
    p = Pools()
    yield p
    p.close()
