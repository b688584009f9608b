"""The built-in digits come from scikit-learn's data file read directly (no sklearn import in
every worker): they must be scikit-learn's ``load_digits`` exactly."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pytest

from partrain.data.datasets import _digits_arrays


def test_digits_equal_scikit_learns_loader():
    sk_datasets = pytest.importorskip("sklearn.datasets")
    images, target = _digits_arrays()
    bunch = sk_datasets.load_digits()
    np.testing.assert_array_equal(images, bunch.images)
    np.testing.assert_array_equal(target, bunch.target)
    assert images.dtype == bunch.images.dtype and target.dtype == np.int64


def test_loading_digits_does_not_import_scikit_learn():
    code = "import sys; from partrain.data.datasets import load_digits; load_digits(); print('sklearn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"
