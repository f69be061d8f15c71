"""A thread that names itself shows that name to the OS (``/proc``), shortened to what the kernel keeps."""

from __future__ import annotations

import threading

from kvxferd.xfer.osutil.osthreads import MAX_NAME_BYTES, name_this_thread, os_thread_name


def test_names_are_shortened_to_what_the_kernel_keeps():
    assert os_thread_name("kvxferd-dataplane") == b"kvx-dataplane"
    assert os_thread_name("a-very-long-thread-name") == b"a-very-long-thr"
    assert all(len(os_thread_name(name)) <= MAX_NAME_BYTES for name in ("kvxferd-fd-inbox", "x" * 40, "ü" * 20))


def test_a_thread_that_names_itself_shows_the_name_in_proc():
    seen = []

    def target():
        name_this_thread("kvxferd-probe")
        with open(f"/proc/self/task/{threading.get_native_id()}/comm") as comm:
            seen.append(comm.read().strip())

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    assert seen == ["kvx-probe"]
