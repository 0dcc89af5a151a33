"""The profiler's compile threads (``hybrid.planning.compiling``): every item compiled before it
is measured, measured in submission order on the calling thread, never while a program runs,
and a compile's error raised to the caller."""

import sys
import threading

import pytest

from hybrid.planning.compiling import Compiler, DeviceGate

import runner


def test_items_are_measured_in_order_alone_after_their_compile():
    compiled, measured, overlaps = set(), [], []
    lock = threading.Lock()
    main = threading.get_ident()

    def compile(item, gate):
        for _ in range(3):  # three programs, each run beside the others
            with gate.shared():
                sum(range(20000))
        with lock:
            compiled.add(item)

    def measure(item):
        assert threading.get_ident() == main
        with lock:
            overlaps.append(compiler.gate._running)
            assert item in compiled
        measured.append(item)

    with Compiler(compile, measure, threads=2) as compiler:
        seen = []
        for item in range(12):
            seen += compiler.submit(item)
        seen += compiler.finish()
    assert measured == seen == list(range(12))
    assert overlaps == [0] * 12


def test_a_compile_error_reaches_the_caller():
    def compile(item, gate):
        if item == 1:
            raise ValueError("cannot compile item 1")

    with pytest.raises(ValueError, match="cannot compile item 1"):
        with Compiler(compile, lambda item: None, threads=2) as compiler:
            for item in range(3):
                compiler.submit(item)
            compiler.finish()


def test_a_waiting_measurement_holds_new_programs_back():
    gate = DeviceGate()
    inside, release, order = threading.Event(), threading.Event(), []

    def program(name):
        with gate.shared():
            order.append(name)
            inside.set()
            release.wait(60)

    first = threading.Thread(target=program, args=("first",))
    first.start()
    assert inside.wait(60)

    def measurement():
        with gate.alone():
            order.append("measure")

    measuring = threading.Thread(target=measurement)
    measuring.start()
    while not gate._measuring:  # the measurement is waiting for "first"
        threading.Event().wait(0.001)
    later = threading.Thread(target=lambda: (gate.shared().__enter__(), order.append("later")))
    later.start()
    release.set()
    for thread in (first, measuring, later):
        thread.join(60)
    assert order == ["first", "measure", "later"]


if __name__ == "__main__":
    sys.exit(runner.main(__file__))
