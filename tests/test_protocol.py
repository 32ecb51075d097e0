"""DataProto: exact rows after each operation, and clear errors on inconsistent input."""

import pickle

import numpy as np
import pytest
import torch

from verl_megatron.protocol import DataProto, DataProtoItem, pad_dataproto_to_divisor, unpad_dataproto


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
