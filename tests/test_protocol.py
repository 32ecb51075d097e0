"""DataProto: exact rows after each operation, and clear errors on inconsistent input."""

import pickle
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch
from tensordict import TensorDict

import verl_megatron
from verl_megatron.protocol import (
    DataProto,
    DataProtoFuture,
    DataProtoItem,
    deserialize_single_tensor,
    deserialize_tensordict,
    fold_batch_dim,
    pad_dataproto_to_divisor,
    serialize_single_tensor,
    serialize_tensordict,
    unfold_batch_dim,
    union_numpy_dict,
    unpad_dataproto,
)


def make(n: int = 4) -> DataProto:
    """Rows i = 0..n-1: obs [i*10, i*10+1], uid f"u{i}", meta {"temperature": 1.0}."""
    obs = torch.stack([torch.arange(n) * 10, torch.arange(n) * 10 + 1], dim=1)
    return DataProto.from_dict(
        tensors={"obs": obs, "score": torch.arange(n, dtype=torch.float32) / 2},
        non_tensors={"uid": [f"u{i}" for i in range(n)], "info": [{"k": i} for i in range(n)]},
        meta_info={"temperature": 1.0},
    )


def uids(data: DataProto) -> list[str]:
    return data.non_tensor_batch["uid"].tolist()


def test_from_dict_builds_batch_and_object_arrays():
    data = make(3)
    assert len(data) == 3
    assert list(data.batch.batch_size) == [3]
    assert data.batch["obs"].tolist() == [[0, 1], [10, 11], [20, 21]]
    assert data.non_tensor_batch["uid"].dtype == object
    assert uids(data) == ["u0", "u1", "u2"]
    assert data.meta_info == {"temperature": 1.0}


def test_from_dict_keeps_equal_length_lists_one_entry_per_sample():
    data = DataProto.from_dict(non_tensors={"pair": [[1, 2], [3, 4]]})
    assert data.non_tensor_batch["pair"].shape == (2,)
    assert data.non_tensor_batch["pair"][1] == [3, 4]
    assert data.batch is None and len(data) == 2


def test_from_single_dict_routes_by_type():
    data = DataProto.from_single_dict({"x": torch.ones(2, 3), "uid": np.array(["a", "b"], dtype=object)})
    assert list(data.batch.keys()) == ["x"]
    assert list(data.non_tensor_batch) == ["uid"]
    with pytest.raises(TypeError, match=r"'bad' must be a torch\.Tensor or numpy\.ndarray"):
        DataProto.from_single_dict({"bad": [1, 2]})


def test_length_mismatch_errors_name_key_and_both_lengths():
    with pytest.raises(ValueError, match=r"non_tensor 'uid' has 3 rows but batch has 4"):
        DataProto.from_dict(tensors={"x": torch.zeros(4, 2)}, non_tensors={"uid": ["a", "b", "c"]})
    with pytest.raises(ValueError, match=r"tensor 'b' has 3 rows but tensor 'a' has 4"):
        DataProto.from_dict(tensors={"a": torch.zeros(4), "b": torch.zeros(3)})
    with pytest.raises(ValueError, match=r"non_tensor 'y' has 1 rows but non_tensor 'x' has 2"):
        DataProto.from_dict(non_tensors={"x": [1, 2], "y": [1]})
    data = make(4)
    data.non_tensor_batch["uid"] = data.non_tensor_batch["uid"][:3]
    with pytest.raises(ValueError, match=r"non_tensor 'uid' has 3 rows but batch has 4"):
        data.check_consistency()
    with pytest.raises(TypeError, match="non_tensor 'uid' must be a numpy array"):
        DataProto(batch=None, non_tensor_batch={"uid": ["a"]})


def test_getitem_int_returns_item_with_same_fields():
    item = make(4)[2]
    assert isinstance(item, DataProtoItem)
    assert item.batch["obs"].tolist() == [20, 21]
    assert item.batch["score"].item() == 1.0
    assert item.non_tensor_batch == {"uid": "u2", "info": {"k": 2}}
    assert item.meta_info == {"temperature": 1.0}
    assert make(4)[-1].non_tensor_batch["uid"] == "u3"
    assert make(4)[np.int64(1)].non_tensor_batch["uid"] == "u1"
    with pytest.raises(IndexError, match="index 4 is out of range for a DataProto of length 4"):
        make(4)[4]


def test_getitem_slice_list_tensor_and_mask_return_dataproto():
    data = make(5)
    assert uids(data[1:4]) == ["u1", "u2", "u3"]
    assert data[::2].batch["obs"][:, 0].tolist() == [0, 20, 40]
    assert uids(data[[4, 0]]) == ["u4", "u0"]
    picked = data[torch.tensor([3, 3, 1])]
    assert picked.batch["obs"][:, 1].tolist() == [31, 31, 11]
    assert uids(picked) == ["u3", "u3", "u1"]
    masked = data[np.array([True, False, False, True, True])]
    assert uids(masked) == ["u0", "u3", "u4"]
    assert masked.batch["score"].tolist() == [0.0, 1.5, 2.0]
    assert masked.meta_info == {"temperature": 1.0}
    with pytest.raises(IndexError, match="bool mask has 2 entries but the DataProto has 5 rows"):
        data[[True, False]]
    with pytest.raises(TypeError, match="indexing with str"):
        data["obs"]


def test_select_keeps_requested_keys_and_deepcopy_detaches():
    data = make(2)
    sub = data.select(batch_keys=["obs"], non_tensor_batch_keys=["uid"], meta_info_keys=[])
    assert list(sub.batch.keys()) == ["obs"]
    assert list(sub.non_tensor_batch) == ["uid"]
    assert sub.meta_info == {}
    shared = data.select()
    shared.batch["obs"][0, 0] = 99  # no deepcopy: same storage
    assert data.batch["obs"][0, 0].item() == 99
    copied = data.select(deepcopy=True)
    copied.batch["obs"][0, 0] = -1
    copied.non_tensor_batch["info"][0]["k"] = 7
    assert data.batch["obs"][0, 0].item() == 99
    assert data.non_tensor_batch["info"][0] == {"k": 0}
    with pytest.raises(KeyError, match=r"batch keys \['missing'\] not found"):
        data.select(batch_keys=["missing"])


def test_pop_removes_keys_from_source():
    data = make(3)
    popped = data.pop(batch_keys=["score"], non_tensor_batch_keys=["info"], meta_info_keys=["temperature"])
    assert list(data.batch.keys()) == ["obs"]
    assert list(data.non_tensor_batch) == ["uid"]
    assert data.meta_info == {}
    assert popped.batch["score"].tolist() == [0.0, 0.5, 1.0]
    assert popped.non_tensor_batch["info"][2] == {"k": 2}
    assert popped.meta_info == {"temperature": 1.0}


def test_union_merges_and_rejects_conflicts():
    data = make(3)
    other = DataProto.from_dict(
        tensors={"obs": data.batch["obs"].clone(), "adv": torch.tensor([1.0, 2.0, 3.0])},
        non_tensors={"uid": ["u0", "u1", "u2"], "source": ["a", "b", "c"]},
        meta_info={"temperature": 1.0, "step": 7},
    )
    out = data.union(other)
    assert out is data
    assert sorted(data.batch.keys()) == ["adv", "obs", "score"]
    assert data.batch["adv"].tolist() == [1.0, 2.0, 3.0]
    assert data.non_tensor_batch["source"].tolist() == ["a", "b", "c"]
    assert data.meta_info == {"temperature": 1.0, "step": 7}

    clash = DataProto.from_dict(tensors={"obs": torch.zeros(3, 2, dtype=torch.int64)})
    with pytest.raises(ValueError, match="batch key 'obs' holds different values"):
        make(3).union(clash)
    with pytest.raises(ValueError, match="non_tensor_batch key 'uid' holds different values"):
        make(3).union(DataProto.from_dict(non_tensors={"uid": ["x", "y", "z"]}))
    with pytest.raises(ValueError, match="meta_info key 'temperature' holds different values"):
        make(3).union(DataProto.from_dict(tensors={"z": torch.zeros(3)}, meta_info={"temperature": 0.5}))
    with pytest.raises(ValueError, match="DataProto of length 3 with one of length 2"):
        make(3).union(make(2))
    with pytest.raises(ValueError, match="DataProto of length 3 with one of length 4"):
        make(3).union(DataProto.from_dict(non_tensors={"uid2": ["a", "b", "c", "d"]}))


def test_union_treats_nan_as_equal():
    a = DataProto.from_dict(
        tensors={"v": torch.tensor([float("nan"), 1.0])}, non_tensors={"s": [float("nan"), 2]}
    )
    b = DataProto.from_dict(
        tensors={"v": torch.tensor([float("nan"), 1.0])}, non_tensors={"s": [float("nan"), 2]}
    )
    assert len(a.union(b)) == 2


def test_chunk_split_concat_roundtrip():
    data = make(6)
    parts = data.chunk(3)
    assert [uids(p) for p in parts] == [["u0", "u1"], ["u2", "u3"], ["u4", "u5"]]
    assert all(p.meta_info == {"temperature": 1.0} for p in parts)
    with pytest.raises(ValueError, match="length 6 is not divisible into 4 equal chunks"):
        data.chunk(4)
    splits = data.split(4)
    assert [len(p) for p in splits] == [4, 2]
    joined = DataProto.concat(splits)
    assert torch.equal(joined.batch["obs"], data.batch["obs"])
    assert uids(joined) == uids(data)
    assert joined.meta_info == {"temperature": 1.0}
    with pytest.raises(
        ValueError, match=r"part 1 has non_tensor keys \['uid'\] but part 0 has \['info', 'uid'\]"
    ):
        DataProto.concat([data, data.select(non_tensor_batch_keys=["uid"])])
    with pytest.raises(ValueError, match="empty list"):
        DataProto.concat([])


def test_repeat_interleave_and_tile():
    data = make(2)
    inter = data.repeat(3, interleave=True)
    assert inter.batch["obs"][:, 0].tolist() == [0, 0, 0, 10, 10, 10]
    assert uids(inter) == ["u0", "u0", "u0", "u1", "u1", "u1"]
    tiled = data.repeat(2, interleave=False)
    assert tiled.batch["obs"].tolist() == [[0, 1], [10, 11], [0, 1], [10, 11]]
    assert uids(tiled) == ["u0", "u1", "u0", "u1"]
    assert data.repeat().batch["score"].tolist() == [0.0, 0.0, 0.5, 0.5]


def test_reorder_is_in_place():
    data = make(4)
    data.reorder(torch.tensor([2, 0, 3, 1]))
    assert data.batch["obs"][:, 0].tolist() == [20, 0, 30, 10]
    assert uids(data) == ["u2", "u0", "u3", "u1"]
    assert data.non_tensor_batch["info"][0] == {"k": 2}


def test_rename_and_to():
    data = make(2)
    assert data.rename("obs", "observations") is data
    assert sorted(data.batch.keys()) == ["observations", "score"]
    data.rename(["observations", "score"], ["o", "s"])
    assert sorted(data.batch.keys()) == ["o", "s"]
    with pytest.raises(ValueError, match="2 old keys but 1 new keys"):
        data.rename(["o", "s"], ["x"])
    with pytest.raises(KeyError, match="missing"):
        data.rename("missing", "x")
    data.rename(["o", "s"], ["s", "o"])  # a swap
    assert data.batch["s"].tolist() == [[0, 1], [10, 11]]
    with pytest.raises(ValueError, match="collide"):
        data.rename("o", "s")
    moved = data.to("cpu")
    assert moved is data and data.batch["o"].device.type == "cpu"


def test_pad_and_unpad_to_divisor():
    data = make(3)
    padded, pad = pad_dataproto_to_divisor(data, 8)
    assert pad == 5 and len(padded) == 8
    assert uids(padded) == ["u0", "u1", "u2", "u0", "u1", "u2", "u0", "u1"]
    assert padded.batch["obs"][:, 0].tolist() == [0, 10, 20, 0, 10, 20, 0, 10]
    restored = unpad_dataproto(padded, pad)
    assert uids(restored) == ["u0", "u1", "u2"]
    same, zero = pad_dataproto_to_divisor(data, 3)
    assert zero == 0 and same is data
    assert unpad_dataproto(data, 0) is data
    with pytest.raises(ValueError, match="size_divisor must be positive"):
        pad_dataproto_to_divisor(data, 0)


def test_pickle_roundtrip():
    data = make(2)
    back = pickle.loads(pickle.dumps(data))
    assert torch.equal(back.batch["obs"], data.batch["obs"])
    assert uids(back) == ["u0", "u1"]
    assert back.meta_info == {"temperature": 1.0}


# ---------------------------------------------------------------- verl 0.9 API surface


def test_package_root_exports_dataproto_like_verl():
    assert verl_megatron.DataProto is DataProto
    assert verl_megatron.DataProtoFuture is DataProtoFuture
    with pytest.raises(AttributeError, match="has no attribute 'DataProtoo'"):
        _ = verl_megatron.DataProtoo


def test_concat_merges_meta_info_of_every_part_and_gathers_metrics():
    parts = [
        DataProto.from_dict(tensors={"x": torch.tensor([0])}, meta_info={"step": 3}),
        DataProto.from_dict(
            tensors={"x": torch.tensor([1])}, meta_info={"metrics": {"loss": 1.0, "acc": 0.5}, "step": 3}
        ),
        DataProto.from_dict(
            tensors={"x": torch.tensor([2])},
            meta_info={"metrics": [{"loss": 2.0, "acc": 0.25}, {"loss": 3.0, "acc": 0.0}], "extra": "e"},
        ),
    ]
    joined = DataProto.concat(parts)
    assert joined.batch["x"].tolist() == [0, 1, 2]
    assert joined.meta_info == {
        "step": 3,
        "metrics": {"loss": [1.0, 2.0, 3.0], "acc": [0.5, 0.25, 0.0]},
        "extra": "e",
    }
    # Equal values of different numeric types (or NaN) are not a conflict.
    same = [
        DataProto.from_dict(tensors={"x": torch.tensor([i])}, meta_info={"t": v})
        for i, v in enumerate([1, 1.0])
    ]
    assert DataProto.concat(same).meta_info == {"t": 1}


def test_concat_refuses_a_conflicting_meta_key_as_assertion_and_value_error():
    a = DataProto.from_dict(tensors={"x": torch.tensor([0])}, meta_info={"temperature": 1.0})
    b = DataProto.from_dict(tensors={"x": torch.tensor([1])}, meta_info={"temperature": 0.7})
    for error in (AssertionError, ValueError):
        with pytest.raises(
            error, match=r"Conflicting values for meta_info key 'temperature': part 1 has 0\.7"
        ):
            DataProto.concat([a, b])
    odd = DataProto.from_dict(tensors={"x": torch.tensor([1])}, meta_info={"metrics": {"other": 1.0}})
    first = DataProto.from_dict(tensors={"x": torch.tensor([0])}, meta_info={"metrics": {"loss": 1.0}})
    with pytest.raises(AssertionError, match=r"metric 'other' .* missing from the first metrics dict"):
        DataProto.concat([first, odd])


def test_union_numpy_dict_deep_equality():
    nested = np.empty(2, dtype=object)
    nested[0], nested[1] = np.array([1.0, np.nan]), {"k": [1, 2]}
    twin = np.empty(2, dtype=object)
    twin[0], twin[1] = np.array([1.0, np.nan]), {"k": [1, 2]}
    merged = union_numpy_dict({"a": nested}, {"a": twin, "b": np.arange(2)})
    assert sorted(merged) == ["a", "b"]
    ring1, ring2 = np.empty(1, dtype=object), np.empty(1, dtype=object)
    ring1[0], ring2[0] = ring1, ring2  # arrays that contain themselves
    union_numpy_dict({"r": ring1}, {"r": ring2})
    changed = np.empty(2, dtype=object)
    changed[0], changed[1] = np.array([1.0, 2.0]), {"k": [1, 2]}
    with pytest.raises(
        AssertionError, match=r"`a` in tensor_dict1 and tensor_dict2 are not the same object\."
    ):
        union_numpy_dict({"a": nested}, {"a": changed})
    with pytest.raises(ValueError, match="`a` in tensor_dict2 is a list, not a numpy array"):
        union_numpy_dict({"a": nested}, {"a": [1, 2]})
    with pytest.raises(AssertionError, match="not the same object"):
        union_numpy_dict({"a": np.arange(3, dtype=np.int32)}, {"a": np.arange(3, dtype=np.int64)})


def test_fold_and_unfold_batch_dim():
    data = make(6)
    folded = fold_batch_dim(data, new_batch_size=2)
    assert list(folded.batch.batch_size) == [2]
    assert folded.batch["obs"][:, :, 0].tolist() == [[0, 10, 20], [30, 40, 50]]
    assert folded.non_tensor_batch["uid"].tolist() == [["u0", "u1", "u2"], ["u3", "u4", "u5"]]
    folded.reorder(torch.tensor([1, 0]))
    flat = unfold_batch_dim(folded, batch_dims=2)
    assert flat.batch["obs"][:, 0].tolist() == [30, 40, 50, 0, 10, 20]
    assert uids(flat) == ["u3", "u4", "u5", "u0", "u1", "u2"]
    assert flat.meta_info == {"temperature": 1.0}
    assert len(data) == 6 and uids(data)[0] == "u0"  # the source is left as it was
    with pytest.raises(AssertionError, match="6 rows do not fold into 4 equal groups"):
        fold_batch_dim(data, 4)


def test_from_dict_has_one_batch_dim_and_auto_padding_allows_unequal_chunks():
    with pytest.raises(AssertionError, match="num_batch_dims=2"):
        DataProto.from_dict(tensors={"x": torch.zeros(2, 3)}, num_batch_dims=2)
    with pytest.raises(AssertionError, match="length 5 is not divisible into 2 equal chunks"):
        DataProto.from_dict(tensors={"x": torch.arange(5)}).chunk(2)
    padded = DataProto.from_dict(tensors={"x": torch.arange(5)}, meta_info={"a": 1}, auto_padding=True)
    assert padded.is_padding_enabled()
    assert [p.batch["x"].tolist() for p in padded.chunk(2)] == [[0, 1, 2], [3, 4]]
    assert [len(p) for p in padded.chunk(4)] == [2, 2, 1, 0]
    padded.padding(2, "first")
    assert padded.batch["x"].tolist() == [0, 1, 2, 3, 4, 0, 0]
    single = DataProto.from_single_dict({"x": torch.arange(3)}, auto_padding=True)
    assert single.is_padding_enabled() and not make(2).is_padding_enabled()


def test_sample_level_repeat_and_unfold_column_chunks():
    data = make(3)
    for counts in ([2, 0, 1], (2, 0, 1), np.array([2, 0, 1]), torch.tensor([2, 0, 1])):
        out = data.sample_level_repeat(counts)
        assert out.batch["obs"][:, 0].tolist() == [0, 0, 20]
        assert uids(out) == ["u0", "u0", "u2"]
    with pytest.raises(AssertionError, match="one non-negative count per row"):
        data.sample_level_repeat([1, 1])

    wide = DataProto.from_dict(
        tensors={"ids": torch.arange(12).reshape(3, 4), "score": torch.tensor([1.0, 2.0, 3.0])},
        non_tensors={"pairs": [["a", "b"], ["c", "d"], ["e", "f"]], "uid": ["u0", "u1", "u2"]},
    )
    out = wide.unfold_column_chunks(2, split_keys=["ids", "pairs"])
    assert out.batch["ids"].tolist() == [[0, 1], [2, 3], [4, 5], [6, 7], [8, 9], [10, 11]]
    assert out.batch["score"].tolist() == [1.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    assert out.non_tensor_batch["pairs"].tolist() == [["a"], ["b"], ["c"], ["d"], ["e"], ["f"]]
    assert uids(out) == ["u0", "u0", "u1", "u1", "u2", "u2"]
    with pytest.raises(AssertionError, match="'ids' of shape \\(3, 4\\) cannot split dim 1 into 3"):
        wide.unfold_column_chunks(3, split_keys=["ids"])
    with pytest.raises(KeyError, match="split_keys \\['nope'\\] not found"):
        wide.unfold_column_chunks(2, split_keys=["nope"])


def test_make_iterator_order_epochs_and_seed():
    data = make(4)
    in_order = [p.batch["obs"][:, 0].tolist() for p in data.make_iterator(mini_batch_size=2, epochs=2)]
    assert in_order == [[0, 10], [20, 30], [0, 10], [20, 30]]
    batches = list(data.make_iterator(2, epochs=1, seed=5, dataloader_kwargs={"shuffle": True}))
    assert all(b.meta_info == {"temperature": 1.0} and isinstance(b, DataProto) for b in batches)
    shuffled = [u for b in batches for u in uids(b)]
    assert sorted(shuffled) == ["u0", "u1", "u2", "u3"] and shuffled != sorted(shuffled)
    again = list(data.make_iterator(2, epochs=1, seed=5, dataloader_kwargs={"shuffle": True}))
    assert [uids(b) for b in again] == [uids(b) for b in batches]
    with pytest.raises(AssertionError, match="4 rows are not a multiple of mini_batch_size=3"):
        data.make_iterator(3, epochs=1)


def test_tensor_serialisation_roundtrips_dtypes_nested_and_empty():
    for tensor in (
        torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16),
        torch.tensor([True, False]),
        torch.arange(6, dtype=torch.int32).reshape(2, 3).t(),  # not contiguous
        torch.zeros(0, 3),
    ):
        dtype, shape, raw = serialize_single_tensor(tensor)
        assert dtype == str(tensor.dtype).removeprefix("torch.") and shape == tuple(tensor.shape)
        back = deserialize_single_tensor((dtype, shape, raw))
        assert back.dtype == tensor.dtype and torch.equal(back, tensor)
    nested = torch.nested.as_nested_tensor([torch.ones(2), torch.zeros(3)], layout=torch.jagged)
    td = TensorDict({"n": nested, "d": torch.arange(2)}, batch_size=[2])
    back = deserialize_tensordict(serialize_tensordict(td))
    assert back.batch_size == td.batch_size and back["d"].tolist() == [0, 1]
    assert [t.tolist() for t in back["n"].unbind()] == [[1.0, 1.0], [0.0, 0.0, 0.0]]
    with pytest.raises(AssertionError, match="'float99' is not a torch dtype"):
        deserialize_single_tensor(("float99", (1,), np.zeros(4, dtype=np.uint8)))


def test_pickle_uses_raw_buffers_and_disk_roundtrip(tmp_path, monkeypatch):
    def refuse(*args, **kwargs):
        raise AssertionError("TensorDict.consolidate must not run when pickling")

    monkeypatch.setattr(TensorDict, "consolidate", refuse)
    data = make(3)
    state = data.__getstate__()
    assert isinstance(state[0], tuple)  # (batch_size, device, encoded tensors)
    back = DataProto()
    back.__setstate__(state)
    assert torch.equal(back.batch["obs"], data.batch["obs"]) and uids(back) == ["u0", "u1", "u2"]
    legacy = DataProto()
    legacy.__setstate__(dict(vars(make(2))))  # the attribute dict of a pickle made before __getstate__
    assert uids(legacy) == ["u0", "u1"] and legacy.batch["obs"][:, 0].tolist() == [0, 10]
    empty = pickle.loads(pickle.dumps(DataProto(batch=TensorDict({}, batch_size=[4]))))
    assert list(empty.batch.keys()) == [] and list(empty.batch.batch_size) == [4]
    data.save_to_disk(tmp_path / "batch.pkl")
    loaded = DataProto.load_from_disk(tmp_path / "batch.pkl")
    assert torch.equal(loaded.batch["score"], data.batch["score"]) and loaded.meta_info == {
        "temperature": 1.0
    }
    (tmp_path / "other.pkl").write_bytes(pickle.dumps({"not": "a batch"}))
    with pytest.raises(TypeError, match="holds a dict, not a DataProto"):
        DataProto.load_from_disk(tmp_path / "other.pkl")


def test_tensordict_roundtrip_keeps_nested_objects_and_meta():
    data = DataProto.from_dict(
        tensors={"obs": torch.tensor([1, 2])},
        non_tensors={"turns": [[], [0.5, 0.8]], "info": [{"acc": 1.0}, {"acc": 0.0}], "uid": ["a", "b"]},
        meta_info={"step": 4},
    )
    td = data.to_tensordict()
    assert td["obs"].tolist() == [1, 2] and td["step"] == 4
    assert list(td["turns"][1]) == [0.5, 0.8] and dict(td["info"][0]) == {"acc": 1.0}
    back = DataProto.from_tensordict(td)
    assert back.batch["obs"].tolist() == [1, 2]
    assert back.non_tensor_batch["turns"].tolist() == [[], [0.5, 0.8]]
    assert back.non_tensor_batch["info"].tolist() == [{"acc": 1.0}, {"acc": 0.0}]
    assert back.non_tensor_batch["uid"].tolist() == ["a", "b"] and back.meta_info == {"step": 4}
    clash = DataProto.from_dict(tensors={"k": torch.zeros(1)}, non_tensors={"k": ["x"]})
    with pytest.raises(AssertionError, match=r"keys \['k'\] are in both"):
        clash.to_tensordict()


def test_get_data_info_lists_keys_and_meta_types():
    data = DataProto.from_dict(
        tensors={"obs": torch.zeros(2, 3, dtype=torch.int64)},
        non_tensors={"uid": ["a", "b"]},
        meta_info={"temperature": 1.0, "ids": [1, 2], "m": {"a": 0.5}, "t": (1, "x"), "e": []},
    )
    assert data.get_data_info().splitlines() == [
        "batch",
        "  obs: (2, 3) (torch.int64) cpu",
        "non_tensor_batch",
        "  uid: ndarray(2,) (object)",
        "meta_info",
        "  temperature: float",
        "  ids: list[int]",
        "  m: dict[str: float]",
        "  t: tuple(int, str)",
        "  e: list[...]",
    ]


def test_dataproto_future_joins_worker_results_and_chunks():
    parts = [DataProto.from_dict(tensors={"x": torch.tensor([i, i + 10])}) for i in range(2)]
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = [pool.submit(lambda d=d: d) for d in parts]
        joined = DataProtoFuture.concat(futures)
        assert joined.get().batch["x"].tolist() == [0, 10, 1, 11]
        assert [c.get().batch["x"].tolist() for c in joined.chunk(2)] == [[0, 10], [1, 11]]
        bad = DataProtoFuture.concat([pool.submit(lambda: 3)])
        with pytest.raises(TypeError, match="future 0 produced a int"):
            bad.get()
