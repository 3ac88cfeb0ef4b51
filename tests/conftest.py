"""What every test may use: the gloo harness, the FSDP implementation switch, the ``distributed`` mark.

``--fsdp-impl=torch|vescale`` picks which ``fully_shard`` the ``impl`` fixture names (default
``vescale``, ours; ``torch`` is FSDP2 itself, the baseline a compatibility case must pass
first). Known gaps of ours are marked ``@vescale_xfail(reason)``: for ``vescale`` only they
become ``xfail(strict=True)``, so a fix flips them to a failure until the mark is removed.
``@vescale_differs(reason)`` marks a deliberate difference from FSDP2, proven elsewhere: the
case is skipped for ``vescale``.

``distributed`` marks every test that starts processes or process groups, so that
``pytest -m "not distributed"`` runs the single-process rest in well under a minute. Tests
that use ``dist_run`` get it here; a test that launches processes itself (a launcher, a
subprocess) carries the mark, and one that forgets fails with a message saying so.
"""

import multiprocessing.process
import subprocess
from contextlib import contextmanager

import pytest
import torch.distributed as dist

from tests.support.distributed import DistributedRunner, build_one_vescale_unit

IMPLS = ("torch", "vescale")


def pytest_addoption(parser):
    parser.addoption(
        "--fsdp-impl",
        choices=IMPLS,
        default="vescale",
        help="fully_shard implementation the ``impl`` fixture gives, e.g. to the FSDP2 compatibility suite (default: vescale)",
    )


@pytest.fixture(scope="session")
def impl(request) -> str:
    return request.config.getoption("--fsdp-impl")


_runner = DistributedRunner()


def pytest_configure(config):
    global _runner
    if config.getoption("--fsdp-impl") == "torch":
        # FSDP2's own side runs with our package imported and one unit of ours built in every
        # worker, so that whatever we change in torch for the process is in place.
        _runner = DistributedRunner(prepare=build_one_vescale_unit)


@pytest.fixture(scope="session")
def dist_run():
    """``dist_run(fn, world_size, *args, timeout=...)``: run ``fn`` on that many gloo ranks.

    Under ``--fsdp-impl=torch`` every worker first builds one unit of ours
    (``build_one_vescale_unit``)."""
    yield _runner
    _runner.close()


def pytest_terminal_summary(terminalreporter):
    if _runner.starts:
        per_size = ", ".join(f"{n} at W={w}" for w, n in sorted(_runner.starts.items()))
        terminalreporter.write_line(f"gloo worker pools started: {sum(_runner.starts.values())} ({per_size})")


@pytest.hookimpl(tryfirst=True)  # before ``-m`` deselects by mark
def pytest_collection_modifyitems(config, items):
    vescale = config.getoption("--fsdp-impl") == "vescale"
    for item in items:
        if "dist_run" in item.fixturenames:
            item.add_marker(pytest.mark.distributed)
        if vescale:
            for mark in item.iter_markers("vescale_xfail"):
                item.add_marker(pytest.mark.xfail(strict=True, reason=mark.args[0]))
            for mark in item.iter_markers("vescale_differs"):
                item.add_marker(pytest.mark.skip(reason=mark.args[0]))


@contextmanager
def _processes_refused_unless_distributed(item):
    """Inside, starting a process or a process group fails, naming the mark ``item`` lacks."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        if item.get_closest_marker("distributed") is None:

            def refuse(*args, **kwargs):
                pytest.fail(
                    f"{item.nodeid} starts a process or a process group: mark it @pytest.mark.distributed",
                    pytrace=False,
                )

            monkeypatch.setattr(subprocess.Popen, "_execute_child", refuse)
            monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", refuse)
            monkeypatch.setattr(dist, "init_process_group", refuse)
        yield


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    # Setup too: a module fixture that launches processes runs in its first test's setup.
    with _processes_refused_unless_distributed(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _processes_refused_unless_distributed(item):
        return (yield)
