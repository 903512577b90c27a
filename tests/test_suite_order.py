"""conftest.long_first: the long tests start first under xdist, the rest keep their order."""

from types import SimpleNamespace

from conftest import long_first


def test_long_first_moves_the_listed_tests_ahead_in_list_order_and_keeps_the_rest():
    ids = ["a.py::t1", "b.py::slow[x]", "a.py::t2", "c.py::t", "b.py::slow[y]", "d.py::big"]
    items = [SimpleNamespace(nodeid=i) for i in ids]
    ordered = [item.nodeid for item in long_first(items, ("d.py::big", "b.py::slow", "gone.py"))]
    assert ordered == [
        "d.py::big",
        "b.py::slow[x]",
        "b.py::slow[y]",
        "a.py::t1",
        "a.py::t2",
        "c.py::t",
    ]
