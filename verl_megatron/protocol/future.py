"""``DataProtoFuture``: a batch several workers are still producing (verl's API, without Ray)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from verl_megatron.errors import VerlCompatError
from verl_megatron.protocol.data_proto import DataProto

__all__ = ["DataProtoFuture"]


class DataProtoFuture:
    """A DataProto still being produced by several workers, resolved by ``get()``.

    ``futures`` are ``concurrent.futures.Future`` objects or anything with ``result()`` (plain
    DataProtos are taken as they are); ``collect_fn`` joins the results (``DataProto.concat`` in
    verl) and ``dispatch_fn`` picks this future's share of the joined batch. Without Ray there is
    no remote handle: a worker pool (``concurrent.futures``) plays that role.
    """

    def __init__(
        self,
        collect_fn: Callable[[list[DataProto]], DataProto],
        futures: list[Any],
        dispatch_fn: Callable[[DataProto], DataProto] | None = None,
    ) -> None:
        self.collect_fn = collect_fn
        self.futures = list(futures)
        self.dispatch_fn = dispatch_fn

    @staticmethod
    def concat(data: list[Any]) -> DataProtoFuture:
        """A future joining ``data`` (futures of DataProtos) with ``DataProto.concat``."""
        return DataProtoFuture(collect_fn=DataProto.concat, futures=data)

    def chunk(self, chunks: int) -> list[DataProtoFuture]:
        """``chunks`` futures, the ``i``-th resolving to ``get().chunk(chunks)[i]``."""
        if self.dispatch_fn is not None:
            raise VerlCompatError("DataProtoFuture.chunk: this future is already a chunk of another one")
        return [
            DataProtoFuture(self.collect_fn, self.futures, dispatch_fn=lambda x, i=i: x.chunk(chunks)[i])
            for i in range(chunks)
        ]

    def get(self) -> DataProto:
        """Wait for every future, join the results and apply ``dispatch_fn``."""
        results = [f.result() if hasattr(f, "result") else f for f in self.futures]
        for i, result in enumerate(results):
            if not isinstance(result, DataProto):
                raise TypeError(
                    f"DataProtoFuture: future {i} produced a {type(result).__name__}, not a DataProto"
                )
        output = self.collect_fn(results)
        return self.dispatch_fn(output) if self.dispatch_fn is not None else output
