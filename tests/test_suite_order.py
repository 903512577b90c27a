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


def test_every_long_first_entry_names_a_test_that_exists():
    """A stale entry (a renamed test, a docs block that moved) would silently start nothing first:
    each names a test file, a test function defined in it, and a docs block's fence line."""
    import re

    from conftest import LONG_FIRST, REPO

    for prefix in LONG_FIRST:
        path, _, name = prefix.partition("::")
        source = (REPO / path).read_text()
        function = name.split("[")[0]
        if function:
            assert re.search(rf"^def {re.escape(function)}", source, re.M), prefix
        block = re.fullmatch(r"test_documented_example_runs\[(.+):(\d+)\]", name)
        if block:
            lines = (REPO / block[1]).read_text().splitlines()
            assert lines[int(block[2]) - 1].startswith("```"), prefix
