"""The GIL is released while a call waits on the service: another Python
thread keeps running during a Run."""

import threading
import time

import numpy as np


def test_other_threads_run_during_a_run(client):
    with client.session("gil") as s:
        s.load_zoo("resnet18_cifar", batch=16)
        x = np.random.default_rng(0).standard_normal((16, 3, 32, 32)).astype(np.float32)
        s.run({"input": x}, fetch="output")  # warm
        ticks = 0
        stop = threading.Event()

        def count():
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                time.sleep(0.001)

        t = threading.Thread(target=count)
        t.start()
        time.sleep(0.05)
        before = ticks
        start = time.perf_counter()
        s.run({"input": x}, fetch="output")
        elapsed = time.perf_counter() - start
        during = ticks - before
        stop.set()
        t.join()
    # With the GIL held for the whole Run the counter could not advance.
    assert elapsed > 0.02, f"run too short to tell ({elapsed:.3f} s)"
    assert during >= 5, f"{during} ticks in a {elapsed:.3f} s run"


def test_two_threads_share_a_client(client):
    results = {}

    def job(k):
        with client.session(f"thread-{k}") as s:
            s.load_zoo("mlp", batch=4, seed=k)
            x = np.full((4, 64), k, np.float32)
            results[k] = [s.run({"input": x}, fetch="output") for _ in range(20)]

    threads = [threading.Thread(target=job, args=(k,)) for k in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2]
    for outs in results.values():
        for o in outs:
            np.testing.assert_array_equal(o, outs[0])
