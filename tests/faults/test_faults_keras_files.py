"""Damaged ``.keras`` and ``.weights.h5`` files, and files of other models, loaded into models
with de_store layers: the load fails with an error naming the layer and what it expected, and
no table changes (a layer keeps exactly its rows; an empty one stays empty).

A ``.keras`` file is a zip whose members carry a CRC-32; ``zipfile`` checks it when a member
is read to its end. A ``.weights.h5`` file carries no checksum of its data, and a zip CRC
cannot see damage done before the file was zipped: the layer's own crc32c of its keys and
values is what finds a flipped bit there.
"""

from __future__ import annotations

import zipfile
from pathlib import Path
from typing import Any

import h5py
import keras
import numpy as np
import pytest
import tensorflow as tf

import de_store.keras

WEIGHTS = "model.weights.h5"  # the member of a .keras zip holding the weights
KEYS = np.arange(1000, 1300, dtype=np.int64)
VALUES = (KEYS[:, None] * np.arange(1, 5) / 8 + 0.25).astype(np.float32)


def model(name: str, dim: int = 4, key_dtype: Any = tf.int64) -> keras.Model:
    ids = keras.Input(shape=(2,), dtype=tf.as_dtype(key_dtype).name)
    rows = de_store.keras.Embedding(dim, key_dtype=key_dtype, name=name)(ids)
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))


def refill(built: keras.Model, keys: np.ndarray, values: np.ndarray) -> keras.Model:
    """``built``'s de_store layer holding only ``keys`` and ``values``, and Adam slots for
    every second key."""
    variable = built.layers[1].params
    variable.clear()
    variable.upsert(keys, values)
    slots = variable.companion("adam_m", values.shape[1], tf.float32)
    slots.upsert(keys[::2], values[::2] * 2)
    return built


def filled(name: str, keys: np.ndarray = KEYS, values: np.ndarray = VALUES) -> keras.Model:
    return refill(model(name, dim=values.shape[1]), keys, values)


#: What a layer holds when a load into it fails: nothing (as a fresh model's layer), or
#: rows other than the file's.
STATES = {"empty": (KEYS[:0], VALUES[:0]), "other rows": (KEYS[:7], VALUES[:7] - 1)}


def rows(variable: Any) -> dict[int, tuple[float, ...]]:
    keys, values = (t.numpy() for t in variable.export())
    return {int(k): tuple(v) for k, v in zip(keys.tolist(), values.tolist(), strict=True)}


def tables(layer: Any) -> dict[str, dict[int, tuple[float, ...]]]:
    """The rows of the layer's table and of each of its companions."""
    companions = layer.params.companions()
    return {"": rows(layer.params), **{c: rows(v) for c, v in sorted(companions.items())}}


def flip(data: bytes, at: int) -> bytes:
    return data[:at] + bytes([data[at] ^ 0x10]) + data[at + 1 :]


def inside(data: bytes, part: str) -> int:
    """Offset of a byte in the middle of the layer's keys or values as the file stores them
    (row 151: its key has no Adam slot, so its bytes are found once)."""
    row = (KEYS if part == "keys" else VALUES)[151].tobytes()
    at = data.find(row)
    assert at > 0 and data.find(row, at + 1) < 0
    return at + 1


def rezipped(path: Path, weights: bytes) -> None:
    """``path`` with its weights member replaced: the zip's CRC-32 is that of ``weights``."""
    with zipfile.ZipFile(path) as zf:
        members = {i.filename: zf.read(i) for i in zf.infolist()}
    members[WEIGHTS] = weights
    with zipfile.ZipFile(path, "w") as zf:
        for member, data in members.items():
            zf.writestr(member, data)


def weights_member(path: Path) -> bytes:
    with zipfile.ZipFile(path) as zf:
        return zf.read(WEIGHTS)


def rewritten(path: Path, entry: str, value: np.ndarray) -> None:
    """The entry ``entry`` of the de_store layer's weights in ``path`` (a .weights.h5 file)
    replaced by ``value``."""
    with h5py.File(path, "a") as f:
        group = f["layers/embedding/vars"]
        del group[entry]
        group[entry] = value


def load(how: str, path: Path, target: keras.Model) -> None:
    if how == "load_model":
        keras.models.load_model(path)  # its layer gets the Variable of ``target``'s
    else:
        target.load_weights(path)


LOADS = ["load_model", "load_weights"]
#: The error Keras raises (a ValueError wrapping the layer's) when the layer refuses.
REFUSED = "could not be loaded"


def test_weights_files_still_round_trip_exactly(tmp_path: Path) -> None:
    source = filled("kf_round")
    before = tables(source.layers[1])
    source.save_weights(tmp_path / "m.weights.h5")
    source.save(tmp_path / "m.keras")
    for path in ("m.weights.h5", "m.keras"):
        refill(source, *STATES["other rows"])
        source.load_weights(tmp_path / path)
        assert tables(source.layers[1]) == before


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("part", ["keys", "values"])
@pytest.mark.parametrize("how", LOADS)
def test_a_bit_flipped_in_a_keras_file_is_refused_and_no_table_changes(
    tmp_path: Path, how: str, part: str, state: str
) -> None:
    """The flip lies inside the zip: its CRC-32 finds it whenever zipfile reads the weights
    member to its end; the layer's crc32c finds it when a reader seeks past it unchecked."""
    name = f"kf_flip_{how}_{part}_{state[0]}"
    source = filled(name)
    path = tmp_path / "m.keras"
    source.save(path)
    data = path.read_bytes()
    path.write_bytes(flip(data, inside(data, part)))
    before = tables(refill(source, *STATES[state]).layers[1])
    with pytest.raises(
        (zipfile.BadZipFile, ValueError),
        match=rf"Bad CRC-32 for file '{WEIGHTS}'|layer '{name}': .*crc32c",
    ):
        load(how, path, source)
    assert tables(source.layers[1]) == before


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("part", ["keys", "values"])
@pytest.mark.parametrize("how", LOADS)
def test_table_data_damaged_before_zipping_is_found_by_the_layers_checksum(
    tmp_path: Path, how: str, part: str, state: str
) -> None:
    name = f"kf_rezip_{how}_{part}_{state[0]}"
    source = filled(name)
    path = tmp_path / "m.keras"
    source.save(path)
    weights = weights_member(path)
    rezipped(path, flip(weights, inside(weights, part)))
    before = tables(refill(source, *STATES[state]).layers[1])
    with pytest.raises(ValueError, match=REFUSED) as raised:
        load(how, path, source)
    message = (
        rf"layer '{name}': the {part} of its table in the weights file do not match the "
        rf"crc32c saved with them \(expected 0x[0-9a-f]{{8}}, found 0x[0-9a-f]{{8}}\)"
    )
    assert raised.match(message)
    assert tables(source.layers[1]) == before


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize("part", ["keys", "values"])
def test_a_bit_flipped_in_a_weights_h5_file_is_refused_and_no_table_changes(
    tmp_path: Path, part: str, state: str
) -> None:
    """A .weights.h5 file has no checksum of its own: the layer's crc32c is the only one."""
    name = f"kf_h5_{part}_{state[0]}"
    source = filled(name)
    path = tmp_path / "m.weights.h5"
    source.save_weights(path)
    data = path.read_bytes()
    path.write_bytes(flip(data, inside(data, part)))
    before = tables(refill(source, *STATES[state]).layers[1])
    with pytest.raises(ValueError, match=rf"layer '{name}': the {part} of its table .*crc32c"):
        source.load_weights(path)
    assert tables(source.layers[1]) == before


#: How each loader refuses a file cut in half, before any layer sees it: Keras finds no zip
#: (its message says "File not found", naming the file), zipfile no central directory, HDF5
#: an end of file before the one its superblock records.
TRUNCATED = {
    ("load_model", "keras"): (ValueError, r"filepath=.*m\.keras"),
    ("load_weights", "keras"): (zipfile.BadZipFile, "File is not a zip file"),
    ("load_weights", "weights.h5"): (OSError, "truncated file"),
}


@pytest.mark.parametrize("state", list(STATES))
@pytest.mark.parametrize(("how", "container"), list(TRUNCATED))
def test_a_truncated_file_is_refused_and_no_table_changes(
    tmp_path: Path, how: str, container: str, state: str
) -> None:
    name = f"kf_cut_{how}_{container.replace('.', '_')}_{state[0]}"
    source = filled(name)
    path = tmp_path / f"m.{container}"
    if container == "keras":
        source.save(path)
    else:
        source.save_weights(path)
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    before = tables(refill(source, *STATES[state]).layers[1])
    error, message = TRUNCATED[(how, container)]
    with pytest.raises(error, match=message):
        load(how, path, source)
    assert tables(source.layers[1]) == before


def test_a_model_with_its_tables_in_another_order_is_refused(tmp_path: Path) -> None:
    """Keras finds weights by layer class and position: the file's first table would go to
    the other layer. Both layers refuse, and keep their rows."""

    def two_tables(first: str, second: str) -> keras.Model:
        ids = keras.Input(shape=(2,), dtype="int64")
        rows = [de_store.keras.Embedding(4, name=n)(ids) for n in (first, second)]
        flat = keras.layers.Flatten()(keras.layers.Concatenate()(rows))
        return keras.Model(ids, keras.layers.Dense(1)(flat))

    saved = two_tables("kf_user", "kf_item")
    saved.get_layer("kf_user").params.upsert(KEYS[:3], VALUES[:3])
    saved.get_layer("kf_item").params.upsert(KEYS[3:5], VALUES[3:5])
    saved.save_weights(tmp_path / "m.weights.h5")
    reordered = two_tables("kf_item", "kf_user")  # the same Variables, found by name
    before = [tables(reordered.get_layer(n)) for n in ("kf_user", "kf_item")]
    message = (
        r"(?s)A total of 2 objects could not be loaded.*layer 'kf_item': the weights file holds "
        r"the table of layer 'kf_user' here \(Keras matches weights by layer class and "
        r"position, not by name\): expected layer 'kf_item'"
    )
    with pytest.raises(ValueError, match=message):
        reordered.load_weights(tmp_path / "m.weights.h5")
    assert [tables(reordered.get_layer(n)) for n in ("kf_user", "kf_item")] == before


def test_a_file_of_another_dim_is_refused_and_no_table_changes(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    filled("kf_dim8", KEYS, np.repeat(VALUES, 2, axis=1)).save_weights(path)
    rewritten(path, "layer", np.frombuffer(b"kf_dim4", np.uint8))  # as kf_dim4 of dim 8 would
    target = filled("kf_dim4", KEYS[:9], VALUES[:9])
    before = tables(target.layers[1])
    message = (
        r"layer 'kf_dim4': the weights file holds table rows of 8 float32 values, "
        r"expected embedding_size 4 float32 values"
    )
    with pytest.raises(ValueError, match=message):
        target.load_weights(path)
    assert tables(target.layers[1]) == before


def test_a_file_of_another_key_dtype_is_refused_and_no_table_changes(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    source = model("kf_int32", key_dtype=tf.int32)
    source.layers[1].params.upsert(KEYS[:3].astype(np.int32), VALUES[:3])
    source.save_weights(path)
    rewritten(path, "layer", np.frombuffer(b"kf_int64", np.uint8))
    target = filled("kf_int64", KEYS[:4], VALUES[:4])
    before = tables(target.layers[1])
    with pytest.raises(
        ValueError, match=r"layer 'kf_int64': the weights file holds int32 keys, expected int64"
    ):
        target.load_weights(path)
    assert tables(target.layers[1]) == before


def _keras_embedding_model() -> keras.Model:
    """The same structure with Keras' own Embedding: its weights sit where the de_store
    layer's table would."""
    ids = keras.Input(shape=(2,), dtype="int64")
    rows = keras.layers.Embedding(2000, 4)(ids)
    return keras.Model(ids, keras.layers.Dense(1)(keras.layers.Flatten()(rows)))


def _dense_model() -> keras.Model:
    ids = keras.Input(shape=(8,), dtype="float32")
    return keras.Model(ids, keras.layers.Dense(1)(ids))


@pytest.mark.parametrize(
    ("source", "found"),
    [(_keras_embedding_model, r"found \['0'\]"), (_dense_model, "found none")],
)
def test_a_file_of_a_model_without_this_table_is_refused_and_no_table_changes(
    tmp_path: Path, source: Any, found: str
) -> None:
    path = tmp_path / "m.weights.h5"
    source().save_weights(path)
    name = f"kf_other_{source.__name__.strip('_')}"
    target = filled(name, KEYS[:6], VALUES[:6])
    before = tables(target.layers[1])
    message = rf"layer '{name}': expected the entries layer, keys, values, crc32c .*{found}"
    with pytest.raises(ValueError, match=message):
        target.load_weights(path)
    assert tables(target.layers[1]) == before


def test_keys_and_values_of_different_lengths_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "m.weights.h5"
    source = filled("kf_short")
    source.save_weights(path)
    rewritten(path, "values", VALUES[:-1])
    before = tables(refill(source, *STATES["other rows"]).layers[1])
    with pytest.raises(
        ValueError, match=r"layer 'kf_short': the weights file holds 300 keys and 299 rows"
    ):
        source.load_weights(path)
    assert tables(source.layers[1]) == before


def test_a_file_saved_before_the_checksums_still_loads(tmp_path: Path) -> None:
    """Files of earlier de_store versions hold each table's keys and values only."""
    path = tmp_path / "m.weights.h5"
    source = filled("kf_legacy")
    saved = tables(source.layers[1])
    source.save_weights(path)
    with h5py.File(path, "a") as f:
        group = f["layers/embedding/vars"]
        for entry in [e for e in group if e == "layer" or e.endswith("crc32c")]:
            del group[entry]
        assert sorted(group) == ["adam_m.keys", "adam_m.values", "keys", "values"]
    refill(source, *STATES["other rows"])
    source.load_weights(path)
    assert tables(source.layers[1]) == saved
