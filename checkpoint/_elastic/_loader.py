"""`ElasticLoader`: a thin data loader over an `ElasticSampler` that counts what it delivered.

    loader = ElasticLoader(dataset, sampler, num_workers=2)        # map-style: a torch DataLoader inside
    save_training_state(path, model, optim, step=step, data=loader)

Workers fetch ahead, so the loader's ``DataLoader`` reads the sampler's remaining indices without
moving it and moves it one micro-batch per batch handed out: a saved state names exactly the next
global batch. An iterable dataset needs ``iter_from(position)`` (the same stream from
``position`` on) and ``__len__``; each rank reads only its share, in the main process.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Callable

from torch.utils.data import DataLoader, IterableDataset, default_collate

from ._sampler import ElasticSampler

__all__ = ["ElasticLoader"]


class _Remaining:
    """The sampler's remaining micro-batches as a batch sampler that moves nothing."""

    def __init__(self, sampler: ElasticSampler) -> None:
        self.sampler = sampler

    def __iter__(self) -> Iterator[list[int]]:
        return self.sampler.indices()

    def __len__(self) -> int:
        return len(self.sampler)


class ElasticLoader:
    """Iterate ``dataset`` in ``sampler``'s micro-batches (``collate_fn``: torch's default);
    ``state_dict`` / ``load_state_dict`` are the sampler's. Other keywords go to the
    ``DataLoader`` of a map-style dataset."""

    def __init__(self, dataset: Any, sampler: ElasticSampler, *, collate_fn: Callable[[list], Any] | None = None,
                 **dataloader_kwargs: Any) -> None:
        if len(dataset) != sampler.num_samples:
            raise ValueError(f"ElasticLoader: the dataset has {len(dataset)} samples but the sampler was built for "
                             f"{sampler.num_samples}; build the sampler from this dataset")
        self.dataset, self.sampler = dataset, sampler
        self.collate_fn = default_collate if collate_fn is None else collate_fn
        self.iterable = isinstance(dataset, IterableDataset) or not hasattr(dataset, "__getitem__")
        if self.iterable:
            if not callable(getattr(dataset, "iter_from", None)):
                raise TypeError(f"ElasticLoader: the iterable dataset {type(dataset).__name__} has no "
                                "iter_from(position) method; an iterable dataset must be able to seek to resume")
            if dataloader_kwargs.get("num_workers", 0):
                raise ValueError("ElasticLoader: an iterable dataset is read in the main process; pass "
                                 "num_workers=0 (or give a map-style dataset to use workers)")
            if sampler.shuffle:
                raise ValueError("ElasticLoader: an iterable dataset is read in its own order; build its sampler "
                                 "with shuffle=False")
        self.dataloader_kwargs = dataloader_kwargs

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Iterator[Any]:
        source = self._read_stream() if self.iterable else iter(
            DataLoader(self.dataset, batch_sampler=_Remaining(self.sampler), collate_fn=self.collate_fn,
                       **self.dataloader_kwargs))
        for batch in source:
            self.sampler.advance()
            yield batch

    def _read_stream(self) -> Iterator[Any]:
        n = self.sampler.num_samples
        stream: Iterator[Any] | None = None
        at = -1  # the stream position ``stream`` yields next
        for pos in list(self.sampler.positions()):
            samples = []
            for p in pos:
                p %= n  # the padded tail wraps to the start of the stream
                if stream is None or p != at:
                    stream, at = iter(self.dataset.iter_from(p)), p
                try:
                    samples.append(next(stream))
                except StopIteration:
                    raise RuntimeError(f"ElasticLoader: {type(self.dataset).__name__}.iter_from({p}) yielded "
                                       f"nothing, but the dataset has {n} samples") from None
                at += 1
            yield self.collate_fn(samples)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
