"""Our sequence shardings and dists are siblings of the pooled ones on generic bases, as TorchRec's are
(tw_sequence_sharding.py's TwSequenceEmbeddingSharding and tw_sharding.py's TwPooledEmbeddingSharding both
derive BaseTwEmbeddingSharding): a change to a pooled class cannot reach a sequence one, and the other way round.
"""

from __future__ import annotations

import inspect

import pytest
from torchrec.distributed.sharding.tw_sharding import TwPooledEmbeddingSharding

from embark_torchrec.sharding.grid import BaseGridEmbeddingSharding, GridPooledEmbeddingSharding
from embark_torchrec.sharding.sequence import (
    GridSequenceEmbeddingSharding,
    UniqueSequenceEmbeddingDist,
    UniqueSequenceEmbeddingSharding,
)
from embark_torchrec.sharding.unique import (
    BaseUniqueEmbeddingDist,
    BaseUniqueEmbeddingSharding,
    UniquePooledEmbeddingDist,
    UniquePooledEmbeddingSharding,
)

pytestmark = pytest.mark.torchrec_version

POOLED = (GridPooledEmbeddingSharding, UniquePooledEmbeddingSharding, UniquePooledEmbeddingDist)
SEQUENCE = (GridSequenceEmbeddingSharding, UniqueSequenceEmbeddingSharding, UniqueSequenceEmbeddingDist)
SIBLINGS = [
    (GridPooledEmbeddingSharding, GridSequenceEmbeddingSharding, BaseGridEmbeddingSharding),
    (UniquePooledEmbeddingSharding, UniqueSequenceEmbeddingSharding, BaseUniqueEmbeddingSharding),
    (UniquePooledEmbeddingDist, UniqueSequenceEmbeddingDist, BaseUniqueEmbeddingDist),
]


@pytest.mark.parametrize("pooled,sequence,base", SIBLINGS, ids=lambda c: c.__name__)
def test_sequence_and_pooled_classes_are_siblings_on_one_base(pooled: type, sequence: type, base: type) -> None:
    """Each pair derives the same generic base, and neither class's MRO holds any class of the other kind
    (nor TorchRec's pooled table-wise sharding, which the sequence tables must not inherit either)."""
    assert issubclass(pooled, base) and issubclass(sequence, base)
    assert not set(sequence.__mro__) & set(POOLED) and not set(pooled.__mro__) & set(SEQUENCE)
    assert TwPooledEmbeddingSharding not in sequence.__mro__ and TwPooledEmbeddingSharding not in pooled.__mro__


@pytest.mark.parametrize("base", [BaseGridEmbeddingSharding, BaseUniqueEmbeddingSharding, BaseUniqueEmbeddingDist])
def test_the_generic_bases_leave_lookups_and_output_dists_to_each_kind(base: type) -> None:
    """A base cannot be built: what differs between pooled and sequence (the lookup, the output dist, the
    sender's expansion) stays abstract there, so a new kind has to say which it takes."""
    assert inspect.isabstract(base)
