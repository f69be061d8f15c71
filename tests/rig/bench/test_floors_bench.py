"""``kvxferd bench floors``: each step is measured and printed."""

from kvxferd.rig.bench import floors, nixl_progress


def test_each_floor_is_measured():
    wakeups = floors.wakeups(seconds=0.2)
    assert set(wakeups) == {"threading.Event.wait", "Waker.wait (eventfd + select)", "time.sleep"}
    assert all(row["interval_us"] >= 100 and row["cpu_us_per_wake"] > 0 for row in wakeups.values())
    figures = {"wakeups_100us": wakeups, "thread_hop": floors.thread_hop(50), "udp_wakeup": floors.udp_wakeup(50),
               "nixl": floors.nixl_notifications(100), "grpc_stream": floors.grpc_stream(80),
               "grpc_engine_client": floors.grpc_stream_engine_client(80, gap_s=1e-3),
               "socket_engine_client": floors.socket_engine_client(80, gap_s=1e-3), "planning_us": floors.planning(10),
               "digests": floors.digests(1)}
    assert figures["nixl"]["notification_one_way"]["p50_us"] > 0
    assert figures["udp_wakeup"]["one_way"]["p99_us"] >= figures["udp_wakeup"]["one_way"]["p50_us"] > 0
    assert figures["udp_wakeup"]["send_and_read_us"] > 0
    assert figures["grpc_stream"]["round_trip"]["p50_us"] > 0
    assert set(figures["grpc_engine_client"]) == {"back_to_back", "every_1_ms"}
    for key in ("grpc_engine_client", "socket_engine_client"):
        assert set(figures[key]) == {"back_to_back", "every_1_ms"}
        assert all(row["p99_us"] >= row["p50_us"] > 0 for row in figures[key].values())
    assert all(row["digest_gbps"] > 0 and row["copy_gbps"] > 0 for row in figures["digests"].values())
    text = floors.format_table(figures)
    assert "digest of 100 held blocks, packed_HND" in text
    assert "gRPC aio stream" in text and "plan_request" in text and "UDP datagram" in text
    assert "gRPC stream, sync client, other process, every 1 ms" in text
    assert "reads socket, sync client, other process, every 1 ms" in text


def test_nixl_progress_thread_is_measured_and_printed():
    figures = nixl_progress.run(seconds=0.2, repeat=30)
    idle = figures["idle_core_percent"]
    assert set(idle) == {"alone", "peer_added_silent", "after_traffic"} and all(v >= 0 for v in idle.values())
    for row in figures["idle_owner_read"].values():
        assert 0 <= row["completed"] <= row["tried"] == 3
        assert (row["median_us"] is None) == (row["completed"] == 0)
    # With the thread, the owner's agent makes progress on its own: this is the one thing it is for.
    assert figures["idle_owner_read"]["with"]["completed"] == 3
    assert all(row["p50_us"] > 0 for row in figures["trip_polling_100us"].values())
    # What a holder that polls rarely would rely on: a READ does not wait for its owner, unless a
    # notification went to the owner before it on the same pair of agents.
    behind = figures["reads_behind_notifications"]
    assert behind["alone"]["completed"] == behind["alone"]["tried"] == 30
    assert behind["after another agent's notification"]["completed"] == 30
    assert behind["after the reader's notification"]["completed"] < 30
    assert behind["a board check (2 x 64 B), alone"]["completed"] == 30  # what every read's hold check relies on
    text = "\n".join(nixl_progress.format_lines(figures))
    assert "never polls" in text and "% of a core" in text and "after another agent's notification" in text
