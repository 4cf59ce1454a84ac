"""The scheduler `conftest.py` gives xdist, which reruns a test whose worker crashed: a worker
started after a crash always holds enough tests to start on, so the session cannot wait
forever for it. (A worker runs a test only once it holds the next one or is told to stop.)"""

import types

import conftest
import pytest

pytest.importorskip("xdist")
COLLECTION = ["a.py::t1", "a.py::t2", "a.py::t3", "s.py::t", "u.py::t1", "u.py::t2"]


class FakeWorker:
    def __init__(self, name):
        self.gateway, self.shutting_down, self.sent = types.SimpleNamespace(id=name), False, []

    def send_runtest_some(self, indices):
        self.sent += list(indices)

    def shutdown(self):
        self.shutting_down = True


def test_a_worker_started_after_a_crash_holds_two_tests_while_files_wait():
    config = types.SimpleNamespace(getvalue=lambda name: "loadfile",
                                   option=types.SimpleNamespace(loadscopereorder=False))
    scheduler = conftest.pytest_xdist_make_scheduler(config, None)
    scheduler.numnodes = 2
    first, second = FakeWorker("gw0"), FakeWorker("gw1")
    for worker in (first, second):
        scheduler.add_node(worker)
    for worker in (first, second):
        scheduler.add_node_collection(worker, COLLECTION)
    scheduler.schedule()
    assert first.sent == [0, 1, 2] and second.sent == [3, 4, 5]
    # The second worker crashes on its first test, a file of one, with another file queued
    # behind it; the first has been told to stop.
    first.shutdown()
    assert scheduler.remove_node(second) == "s.py::t"
    fresh = FakeWorker("gw2")
    scheduler.add_node(fresh)
    scheduler.add_node_collection(fresh, COLLECTION)
    scheduler.schedule()
    assert fresh.sent == [3, 4, 5] and not scheduler.workqueue
