"""The TFRA sample of ``de_store.testing``: TFRA's layout, the documented rows, no TensorFlow."""

from __future__ import annotations

import pathlib
import subprocess
import sys

import numpy as np
import pytest

from de_store.formats import batch_to_numpy, tfra
from de_store.testing.tfra_sample import tfra_sample

# files TFRA 0.8.1 wrote, in the shared/ folder beside the checkout
REAL = pathlib.Path(__file__).resolve().parents[2] / "shared" / "interop" / "tfra-0.8.1"
if not REAL.is_dir():
    REAL = pathlib.Path("/work/shared/interop/tfra-0.8.1")
REAL = REAL / "basic" / "TFRADynamicEmbedding"


def test_files_are_named_as_tfra_names_them(tmp_path: pathlib.Path) -> None:
    folder = pathlib.Path(tfra_sample(str(tmp_path)))
    assert folder == tmp_path / "TFRADynamicEmbedding"
    # TFRA 0.8.1 wrote REAL for user_emb, dim 8, two devices, one process
    assert sorted(p.name for p in folder.iterdir()) == sorted(p.name for p in REAL.iterdir())


def test_keys_and_values_are_as_documented(tmp_path: pathlib.Path) -> None:
    folder = tfra_sample(str(tmp_path), name="a/b", rows=7, dim=3, num_tables=2)
    for table, remainder in ((1, 0), (2, 1)):
        prefix = f"{folder}/a_b_mht_{table}of2_rank0_size1"
        keys = np.fromfile(f"{prefix}-keys", "<i8")
        assert keys.tolist() == [k for k in range(-3, 4) if k % 2 == remainder]
        values = np.fromfile(f"{prefix}-values", "<f4").reshape(-1, 3)
        assert np.array_equal(values, np.repeat((keys / 1000).astype(np.float32)[:, None], 3, 1))
    keys, values, _ = batch_to_numpy(tfra.read_table(folder, "a/b", dim=3))
    assert sorted(keys.tolist()) == list(range(-3, 4))


def test_bad_sizes_are_named(tmp_path: pathlib.Path) -> None:
    with pytest.raises(ValueError, match=r"rows >= 0 and dim >= 1, got rows=5, dim=0"):
        tfra_sample(str(tmp_path), rows=5, dim=0)


def test_writing_it_imports_no_tensorflow(tmp_path: pathlib.Path) -> None:
    script = (
        "import sys\nfrom de_store.testing.tfra_sample import tfra_sample\n"
        f"tfra_sample({str(tmp_path)!r})\nprint('tensorflow' in sys.modules)"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert (result.returncode, result.stdout) == (0, "False\n"), result.stderr
