"""StepFeed: step results reach the training loop in order, up to the final item, with at most one
wake-up of the consumer per flush interval, and none waits much longer than that interval."""
import threading
import time

from asyncpp_ext.pipeline.step_feed import StepFeed

DONE = object()


class _CountingQueue:
    """A wake-up queue that counts its puts."""

    def __init__(self, inner):
        self.inner, self.puts = inner, 0

    def put(self, item):
        self.puts += 1
        self.inner.put(item)

    def get(self, timeout=None):
        return self.inner.get(timeout=timeout)


def test_every_item_arrives_in_order_and_wake_ups_are_bounded_by_the_interval():
    feed = StepFeed(flush_s=0.05)
    feed._wake = wakes = _CountingQueue(feed._wake)
    n = 20000

    def produce():
        for i in range(n):
            feed.put(i)
        feed.finish(DONE)

    begin = time.monotonic()
    producer = threading.Thread(target=produce)
    producer.start()
    got = list(feed.items())
    producer.join()
    elapsed = time.monotonic() - begin
    assert got == list(range(n)) + [DONE]
    # One wake-up per put would be n; the rule allows one per interval, plus the final one.
    assert wakes.puts <= elapsed / feed.flush_s + 2, (wakes.puts, elapsed)


def test_an_exception_ends_the_items():
    feed = StepFeed(flush_s=0.01)
    feed.put(1)
    error = RuntimeError("stage failed")
    feed.finish(error)
    feed.put(2)  # never reached: the consumer stops at the final item
    assert list(feed.items()) == [1, error]


def test_an_item_is_seen_within_about_the_interval_while_the_producer_is_busy():
    feed = StepFeed(flush_s=0.02)
    seen = []
    feed.put("first")  # wakes the consumer (none before)
    feed.put("second")  # within the interval: no wake-up; the consumer must find it on its own

    def slow_finish():
        time.sleep(1.0)
        feed.finish(DONE)

    producer = threading.Thread(target=slow_finish)
    begin = time.monotonic()
    producer.start()
    for item in feed.items():
        seen.append((item, time.monotonic() - begin))
        if item == "second":
            break
    producer.join()
    assert [s[0] for s in seen] == ["first", "second"]
    assert seen[1][1] < 0.5, seen  # not held until the producer's next wake-up 1 s later
