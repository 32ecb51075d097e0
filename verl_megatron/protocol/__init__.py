"""The batch container passed between trainer stages, compatible with verl's ``DataProto``.

A ``DataProto`` holds three things about the same ``B`` samples:

- ``batch``: a ``TensorDict`` with ``batch_size == [B]`` (e.g. ``prompts`` [B, Tp], ``responses``
  [B, Tr], ``attention_mask`` [B, Tp+Tr]) or ``None`` when there are no tensors;
- ``non_tensor_batch``: a dict of numpy arrays (usually ``dtype=object``) whose first axis has
  length ``B`` (e.g. ``uid``, ``data_source``, ``reward_model``);
- ``meta_info``: a plain dict shared by the whole batch (e.g. ``temperature``).

User code written against ``verl.protocol`` ports by changing the import. Unlike verl, bad input
raises an error naming the offending key and sizes instead of a bare ``assert``; where verl
asserts, the error is a ``VerlCompatError`` (both ``ValueError`` and ``AssertionError``) so code
catching either keeps working.
"""

from verl_megatron.protocol.data_proto import (
    AUTO_PADDING_KEY,
    DataProto,
    DataProtoItem,
    pad_dataproto_to_divisor,
    unpad_dataproto,
)
from verl_megatron.protocol.dicts import union_numpy_dict, union_tensor_dict
from verl_megatron.protocol.future import DataProtoFuture
from verl_megatron.protocol.ops import fold_batch_dim, unfold_batch_dim
from verl_megatron.utils.tensor_serde import (
    deserialize_single_tensor,
    deserialize_tensordict,
    serialize_single_tensor,
    serialize_tensordict,
)

__all__ = [
    "AUTO_PADDING_KEY",
    "DataProto",
    "DataProtoFuture",
    "DataProtoItem",
    "deserialize_single_tensor",
    "deserialize_tensordict",
    "fold_batch_dim",
    "pad_dataproto_to_divisor",
    "serialize_single_tensor",
    "serialize_tensordict",
    "unfold_batch_dim",
    "union_numpy_dict",
    "union_tensor_dict",
    "unpad_dataproto",
]
