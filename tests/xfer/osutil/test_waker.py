"""The data plane's wakeable sleep: no lost wake-up, a timeout when nobody sets it."""

import threading
import time

from kvxferd.xfer.osutil.waker import Waker


def test_a_set_before_the_wait_is_not_lost():
    waker = Waker()
    waker.set()
    waker.set()  # twice: one wake-up, not two
    start = time.perf_counter()
    assert waker.wait(5.0) is True
    assert time.perf_counter() - start < 1.0
    assert waker.wait(0.01) is False


def test_a_set_from_another_thread_cuts_the_sleep_short():
    waker = Waker()
    timer = threading.Timer(0.05, waker.set)
    timer.start()
    start = time.perf_counter()
    assert waker.wait(10.0) is True
    assert 0.03 < time.perf_counter() - start < 5.0
    timer.join()


def test_many_sets_racing_the_waiter_all_end_in_a_wake_up():
    waker, stop, woken = Waker(), threading.Event(), []

    def setter():
        while not stop.is_set():
            waker.set()

    thread = threading.Thread(target=setter)
    thread.start()
    try:
        for _ in range(200):  # the spinning setter holds the GIL: each wait costs a switch interval
            woken.append(waker.wait(5.0))
    finally:
        stop.set()
        thread.join()
    assert all(woken)
