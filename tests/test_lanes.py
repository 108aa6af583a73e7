"""`Lane`, the one writer-queue mechanism (every off-thread writer's, TensorBoard's included): batches, syncs,
falling behind and catching up, and what close() counts when its thread is stuck."""

from __future__ import annotations

import threading
import time
from typing import Any

from gradlog.writers.lanes import Lane


class Recorder(Lane):
    """Keeps every batch it is handed; an item is (name, records); "block" waits for `release`."""

    def __init__(self, max_queue: int = 100, timeout: float = 0.3, max_batch: int = 1) -> None:
        super().__init__("gradlog-test-lane", max_queue, timeout)
        self.max_batch = max_batch
        self.batches: list[tuple[list[str], bool]] = []
        self.release = threading.Event()
        self.entered = threading.Event()
        self.behind_why: list[str] = []
        self.stops = 0

    def consume(self, items: list[Any], durable: bool) -> None:
        if any(name == "block" for name, _ in items):
            self.entered.set()
            self.release.wait(10)
        self.batches.append(([name for name, _ in items], durable))

    def weight(self, item: Any) -> int:
        return int(item[1])

    def fell_behind(self, why: str) -> None:
        self.behind_why.append(why)

    def stopped(self) -> None:
        self.stops += 1


def test_items_queued_behind_a_busy_call_are_consumed_as_one_batch_up_to_a_sync() -> None:
    lane = Recorder(max_batch=4096)
    lane.submit(("block", 1))
    assert lane.entered.wait(5)
    for name in ("a", "b", "c"):
        lane.submit((name, 1))
    threading.Timer(0.2, lane.release.set).start()  # sync() queues its marker while "block" still runs
    assert lane.sync(time.monotonic() + 5, patience=5)
    assert lane.close(time.monotonic() + 5) is None
    # the three queued while "block" ran come in one batch, durable (a sync waits for them); a stop alone is no call
    assert lane.batches == [(["block"], False), (["a", "b", "c"], True)]
    assert lane.stops == 1 and lane.dropped == 0 and lane.thread is not None and not lane.thread.is_alive()


def test_a_stuck_call_drops_and_counts_records_until_the_lane_catches_up() -> None:
    lane = Recorder(timeout=0.2)
    lane.submit(("block", 1))
    assert lane.entered.wait(5)
    time.sleep(0.3)  # the call has now run longer than `timeout`
    lane.submit(("lost", 3))
    assert lane.dropped == 3 and lane.behind and lane.behind_why == ["one call has run for more than 0.2 s"]
    assert lane.sync(time.monotonic() + 5, patience=5) is False  # not waited for while behind
    lane.release.set()
    deadline = time.monotonic() + 5
    while not lane.caught_up() and time.monotonic() < deadline:
        time.sleep(0.01)
    lane.submit(("kept", 1))
    assert lane.sync(time.monotonic() + 5, patience=5)
    # (an empty durable batch: the sync's marker came after "kept" was taken; a file writer syncs there)
    assert [names for names, _ in lane.batches if names] == [["block"], ["kept"]] and lane.dropped == 3
    lane.close(time.monotonic() + 5)


def test_close_gives_up_at_its_deadline_and_counts_what_is_queued_and_in_progress() -> None:
    lane = Recorder(timeout=60.0)
    lane.submit(("block", 2))
    assert lane.entered.wait(5)
    lane.submit(("queued", 5))
    t0 = time.monotonic()
    lost = lane.close(t0 + 0.3)
    waited = time.monotonic() - t0
    lane.release.set()
    assert lost == 7 and lane.dropped == 7  # 5 queued + 2 in the call that never returned
    assert 0.25 < waited < 2.0


def test_a_full_queue_drops_and_a_lane_with_no_thread_is_still_closed() -> None:
    lane = Recorder(max_queue=1, timeout=60.0)
    lane.submit(("block", 1))
    assert lane.entered.wait(5)
    lane.submit(("fits", 1))
    lane.submit(("overflows", 4))
    assert lane.dropped == 4 and lane.behind_why == ["1 calls are waiting for it"]
    lane.release.set()
    assert lane.close(time.monotonic() + 5) is None
    idle = Recorder()
    assert idle.close(time.monotonic() + 1) is None and idle.stops == 1 and idle.thread is None
