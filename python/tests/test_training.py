"""Training through the service: the zoo MLP on the digits data
(tests/data/digits.csv.gz, as tests/digits.rs) lowers its loss and reaches
95 % held-out accuracy, evaluated in a second, inference session holding the
trained variables."""

import gzip

import numpy as np

from conftest import DATA

import lanes

BATCH, EPOCHS = 64, 25


def load_digits():
    with gzip.open(DATA / "digits.csv.gz", "rt") as f:
        rows = np.loadtxt(f, delimiter=",", dtype=np.float32)
    assert rows.shape == (1797, 65)
    return (rows[:, :64] / 16.0).astype(np.float32), rows[:, 64].astype(np.int64)


def test_mlp_learns_digits(client):
    x, y = load_digits()
    rng = np.random.default_rng(2024)
    perm = rng.permutation(len(x))
    test, train = perm[: len(x) // 5], perm[len(x) // 5 :]
    losses = []
    with client.session("digits-mlp", kind="training") as s:
        s.load_zoo("mlp", batch=BATCH, optimizer=lanes.Adam(lr=1e-2), seed=1, hidden=[64])
        assert s.outputs == ["loss"]
        for epoch in range(EPOCHS):
            order = np.random.default_rng(epoch).permutation(train)
            for i in range(0, len(order) - BATCH + 1, BATCH):
                idx = order[i : i + BATCH]
                losses.append(float(s.run({"input": x[idx], "labels": y[idx]})["loss"]))
        trained = s.read_variables()
    assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), (losses[:10], losses[-10:])

    with client.session("digits-eval") as e:
        e.load_zoo("mlp", batch=len(test), hidden=[64])
        params = e.read_variables()
        assert set(params) <= set(trained)
        e.write_variables({k: trained[k] for k in params})
        logits = e.run({"input": x[test]}, fetch="output")
    acc = float((logits.argmax(axis=1) == y[test]).mean())
    assert acc >= 0.95, acc


def test_sgd_momentum_resnet18_cifar_steps(client):
    """A zoo CNN trains with SGD + momentum: repeating one batch lowers its loss."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 3, 32, 32)).astype(np.float32)
    labels = np.arange(4, dtype=np.int64)
    with client.session("resnet-steps", kind="training", priority=1) as s:
        s.load_zoo("resnet18_cifar", batch=4, optimizer=lanes.SGD(lr=0.05, momentum=0.9))
        losses = [float(s.run({"input": x, "labels": labels}, fetch="loss")) for _ in range(6)]
    assert losses[-1] < losses[0], losses
