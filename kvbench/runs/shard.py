"""`shard=i/n`: which samples of a run one worker owns, and the file names its shard writes.

The split depends only on the set of sample ids, which the config fixes (the dataset, its options, `limit`): ids are
ordered by their sha256 and dealt round-robin, so every machine computes the same partition, shard sizes differ by at
most one, and a rerun or requeue of shard i sees exactly the samples it saw before. All shards write into the same
run directory, each into its own predictions file under its own lock; `kvbench.merge` puts them back together.
"""
from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from typing import Iterable, Sequence, TypeVar

T = TypeVar("T")
SHARD_FILE = re.compile(r"^predictions\.shard-(\d+)-of-(\d+)\.jsonl$")


@dataclass(frozen=True)
class Shard:
    """Shard `index` of `count` (0-based)."""

    index: int
    count: int

    def __post_init__(self):
        if not (self.count >= 1 and 0 <= self.index < self.count):
            raise ValueError(f"shard={self.index}/{self.count} must be i/n with n >= 1 and 0 <= i < n, e.g. 0/4")

    @classmethod
    def parse(cls, text) -> "Shard | None":
        """`None`/"" -> no sharding; "i/n" -> Shard(i, n); anything else is a one-line ValueError."""
        if text is None or text == "":
            return None
        m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", str(text))
        if m is None:
            raise ValueError(f"shard={text!r} must be i/n (0-based shard i of n), e.g. shard=0/4; "
                             f"sweep with -m shard=0/4,1/4,2/4,3/4")
        return cls(int(m.group(1)), int(m.group(2)))

    @property
    def tag(self) -> str:
        """`shard-1-of-4`: the suffix of this shard's files (predictions, manifest, lock, log)."""
        return f"shard-{self.index}-of-{self.count}"

    @property
    def predictions_name(self) -> str:
        return f"predictions.{self.tag}.jsonl"

    @property
    def manifest_name(self) -> str:
        return f"manifest.{self.tag}.json"

    def select(self, samples: Sequence[T], key=lambda s: s.id) -> list[T]:
        """The samples this shard owns, in the dataset's own order."""
        mine = set(assign([key(s) for s in samples], self.count)[self.index])
        return [s for s in samples if key(s) in mine]


def _id_hash(sample_id: str) -> str:
    return hashlib.sha256(sample_id.encode("utf-8")).hexdigest()


def assign(ids: Iterable[str], count: int) -> list[list[str]]:
    """Partition ids into `count` shards: sort by sha256(id), deal round-robin. Duplicate ids are an error."""
    ids = list(ids)
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})[:3]
        raise ValueError(f"shard: sample ids must be unique to shard a run; repeated: {', '.join(dup)}")
    ordered = sorted(ids, key=lambda i: (_id_hash(i), i))
    return [ordered[k::count] for k in range(count)]
