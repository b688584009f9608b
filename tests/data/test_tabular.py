"""Tabular data as Keras and scikit-learn users bring it: ``fit(model, (x, y))`` with arrays or
tensors, and ``--dataset file.csv`` with a target column by name.

Why it exists: both were read as something else (an ``(x, y)`` pair as a ``(train, test)`` pair
of datasets; a ``.csv`` as an unknown dataset name). The references are written by hand: the
CSV's numbers as `csv` reads them, the held-out split as ``torch.randperm`` with the seed.
"""

from __future__ import annotations

import functools

import numpy as np
import pytest
import torch

from partrain import UsageError
from partrain.data.datasets import DataSpec, load_csv, load_dataset
from partrain.train.prepare import resolve_data

CSV = "a,price,b\n1,0.5,2\n3,1.5,4\n5,2.5,6\n7,3.5,8\n9,4.5,10\n"


def _csv(tmp_path, text=CSV, name="table.csv"):
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def _rows(train, test):
    """Every (features, target) row of a split, in a fixed order, to compare with a hand-made table."""
    x = torch.cat([train.tensors[0], test.tensors[0]])
    y = torch.cat([train.tensors[1], test.tensors[1]])
    order = torch.argsort(x[:, 0])
    return x[order], y[order]


def test_a_csv_target_by_name_is_regression_for_fractions(tmp_path):
    x, y = _rows(*load_csv(_csv(tmp_path), "price"))
    assert x.dtype == torch.float32 and y.dtype == torch.float32
    assert x.tolist() == [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]]  # every column but the target
    assert y.tolist() == [0.5, 1.5, 2.5, 3.5, 4.5]


def test_words_are_classes_numbered_in_sorted_order_and_the_default_target_is_the_last_column(tmp_path):
    text = "a,b,label\n1,2,cat\n3,4,dog\n5,6,cat\n7,8,bird\n9,10,dog\n"
    x, y = _rows(*load_csv(_csv(tmp_path, text)))
    assert y.dtype == torch.int64 and y.tolist() == [1, 2, 1, 0, 2]  # bird 0, cat 1, dog 2
    text = "a,b,label\n1,2,3\n3,4,0\n5,6,1\n"
    assert _rows(*load_csv(_csv(tmp_path, text)))[1].tolist() == [3, 0, 1]  # integers are classes as they are


@pytest.mark.parametrize(("text", "target", "line"), [
    (CSV, "nope", "Expected a target column among ['a', 'price', 'b'] in {p}. Received: target='nope'"),
    ("id,a,y\nx1,1,0\n", "y", "Expected numeric features in {p}. Received: 'x1' in line 2, column 'id'"),
    ("a,b\n1,x\n", "a", "Expected numeric features in {p}. Received: 'x' in line 2, column 'b'"),
    ("a,b\n1,2\n3\n", None, "Expected 2 cells in every row of {p} (the header's). Received: 1 in line 3"),
    ("a,b\n", None, "Expected {p} to hold a header row, at least two columns and at least one row of data. "
                    "Received: 1 row(s) of 2 column(s)"),
    ("a,b\n1,\n2,3\n", None, "Expected a value in every row of the target column 'b' of {p}. Received: 1 empty "
                             "cell(s)"),
])
def test_a_bad_csv_is_one_line_naming_what_was_expected(tmp_path, text, target, line):
    path = _csv(tmp_path, text)
    with pytest.raises(UsageError) as e:
        load_dataset(DataSpec(name=path, target=target))
    assert str(e.value) == line.format(p=repr(path))


def test_x_y_arrays_are_one_dataset_split_for_evaluation_as_torch_randperm_says():
    x = np.arange(40, dtype=np.float64).reshape(20, 2)
    y = np.arange(20) % 3
    train, test = resolve_data((x, y), test_fraction=0.2, seed=7)
    perm = torch.randperm(20, generator=torch.Generator().manual_seed(7))
    assert test.tensors[0].tolist() == x[perm[:4].numpy()].tolist()
    assert train.tensors[0].tolist() == x[perm[4:].numpy()].tolist()
    assert train.tensors[0].dtype == torch.float64 and train.tensors[1].dtype == torch.int64  # float64 stays


@pytest.mark.parametrize(("data", "line"), [
    ((np.zeros((5, 2)), np.zeros(4)), "Expected x shaped (N, ...) and y shaped (N, ...). Received: x (5, 2), y (4,)"),
    ((np.zeros((5, 2)), "y"), "Expected data as (train, test) datasets or (x, y) arrays. Received: a pair of "
                              "ndarray and str"),
    ((np.array([["a"]], dtype=object), np.zeros(1)), "Expected numeric arrays or tensors x and y."),
])
def test_bad_x_y_pairs_are_one_line(data, line):
    with pytest.raises(UsageError) as e:
        resolve_data(data)
    assert str(e.value).startswith(line)


def _linear64():
    return torch.nn.Linear(3, 1).double()


def test_fit_on_x_y_equals_fit_on_the_datasets_it_stands_for():
    """``fit(model, (x, y))`` trains on the same samples as the (train, test) pair made by hand."""
    from partrain.train.fit import fit

    g = torch.Generator().manual_seed(0)
    x = torch.randn(50, 3, generator=g, dtype=torch.float64)
    y = x @ torch.tensor([1.0, -2.0, 0.5], dtype=torch.float64) + 0.1
    sgd = functools.partial(torch.optim.SGD, lr=0.1)
    options = dict(strategy="single", epochs=2, batch_size=8, quiet=True, workers=1)
    by_arrays = fit(_linear64, (x.numpy(), y.numpy()), sgd, **options)
    perm = torch.randperm(50, generator=torch.Generator().manual_seed(0))
    pair = (torch.utils.data.TensorDataset(x[perm[10:]], y[perm[10:]]),
            torch.utils.data.TensorDataset(x[perm[:10]], y[perm[:10]]))
    by_hand = fit(_linear64, pair, sgd, **options)
    for k, v in by_hand.model_state.items():
        torch.testing.assert_close(by_arrays.model_state[k], v, rtol=0, atol=1e-12)
    assert by_arrays.final["test_loss"] == pytest.approx(by_hand.final["test_loss"], rel=1e-12)


def test_partrain_train_on_a_csv_with_a_named_target_column(tmp_path, capsys):
    from partrain.checkpoint import load_checkpoint
    from partrain.cli import main

    g = np.random.default_rng(0)
    xs = g.random((120, 2))
    rows = ["x1,kind,x2"] + [f"{a:.4f},{'big' if a + b > 1 else 'small'},{b:.4f}" for a, b in xs]
    path = _csv(tmp_path, "\n".join(rows) + "\n")
    code = main(["train", "--quiet", "--dataset", path, "--target", "kind", "--model", "mlp", "--strategy", "single",
                 "--epochs", "1", "--out", str(tmp_path / "run")])
    assert code == 0
    assert "test accuracy:" in capsys.readouterr().out
    spec = load_checkpoint(str(tmp_path / "run" / "checkpoint.pt"))["model_spec"]
    assert spec["input_shape"] == [2] and spec["num_classes"] == 2
