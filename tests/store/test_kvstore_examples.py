"""The `>>>` examples of KVStore's docstrings run, as one session in source order (the class's
example builds the store the methods' examples use), and print what their docstrings say."""

import doctest

import kvtier.store.kvstore as kvstore


def test_the_docstring_examples_run_as_written():
    tests = [t for t in doctest.DocTestFinder().find(kvstore) if t.examples]
    tests.sort(key=lambda t: t.lineno)
    assert tests[0].name == "kvtier.store.kvstore.KVStore"  # it makes the store the others use
    names = {t.name.rsplit(".", 1)[-1] for t in tests}
    assert {"lookup", "save", "load", "prefetch", "evict", "keys", "close"} <= names
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    session: dict = {}
    for t in tests:
        t.globs = session  # one namespace: each example continues the one before
        runner.run(t, clear_globs=False)
    assert runner.summarize(verbose=False).failed == 0
