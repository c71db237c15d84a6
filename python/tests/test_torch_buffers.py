"""`lanes.torch.inference_job` calls through the session's feed buffers:
each input copied once from the caller's tensor into its buffer."""

import threading

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import lanes  # noqa: E402
import lanes.torch as lt  # noqa: E402


def mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3)).eval()


def test_calls_write_into_the_buffers(client):
    m = mlp()
    x = torch.randn(2, 4)
    with lt.inference_job(client, m, x) as job:
        bufs = job.buffers
        assert isinstance(bufs, lanes.Buffers)
        assert bufs["input_0"].shape == (2, 4) and bufs["input_0"].dtype == np.float32
        for k in range(3):
            xk = torch.randn(2, 4)
            got = job(xk)
            with torch.no_grad():
                assert torch.allclose(got, m(xk), atol=1e-5)
            # The call's input is what the buffer holds.
            np.testing.assert_array_equal(bufs["input_0"], xk.numpy())
        # Converted on the way: float64, non-contiguous, NumPy.
        wide = torch.randn(4, 4, dtype=torch.float64)
        with torch.no_grad():
            want = m(wide[::2].float())
        assert torch.allclose(job(wide[::2]), want, atol=1e-5)
        assert torch.allclose(job(wide[::2].numpy()), want, atol=1e-5)
        with pytest.raises(lanes.FeedError, match=r"captured at \[2, 4\]"):
            job(torch.randn(3, 4))
        with pytest.raises(TypeError):
            job(x, x)
    with pytest.raises(lanes.SessionClosedError):
        job(x)


def test_without_shared_memory_calls_send_their_inputs(endpoint):
    m = mlp()
    x = torch.randn(2, 4)
    with lanes.Client(endpoint, shared_memory=False) as c, lt.inference_job(c, m, x) as job:
        assert job.buffers is None
        with torch.no_grad():
            assert torch.allclose(job(x), m(x), atol=1e-5)


def test_calls_from_threads_take_turns(client):
    m = mlp()
    xs = [torch.randn(2, 4) for _ in range(4)]
    with torch.no_grad():
        wants = [m(x) for x in xs]
    bad = []
    with lt.inference_job(client, m, xs[0]) as job:
        def calls(k):
            for _ in range(25):
                if not torch.allclose(job(xs[k]), wants[k], atol=1e-5):
                    bad.append(k)

        threads = [threading.Thread(target=calls, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert bad == []
