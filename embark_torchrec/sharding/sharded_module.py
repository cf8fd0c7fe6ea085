"""What our sharded EmbeddingBagCollection and EmbeddingCollection add to TorchRec's, in one place.

Both run TorchRec's sharded module with our sharding types among its own (sharded_ebc.py, sharded_ec.py), and add the
same things to it: the checked door and split exchange (input_exchange.CheckedInput), byte counting
(comm_stats.CountedModule), each of our shardings' own context for a batch (filed once TorchRec's input dist has run,
read back when the batch is looked up), and the cell-wise load of weights. Only what differs between pooled and
sequence embeddings (the contexts our input dists fill, TorchRec's MEAN fix-up, the load hook's end) stays in each
module.
"""

from __future__ import annotations

import abc
from typing import Any, Dict, List, Sequence, Tuple

import torch
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torchrec.distributed.embedding_sharding import KJTList
from torchrec.modules.embedding_modules import get_embedding_names_by_table

from .comm_stats import CountedModule, CountsComm
from .grid import BaseGridEmbeddingSharding
from .input_exchange import CheckedInput, defer_kjt_all_to_alls
from .torchrec_compat import (
    is_virtual_table,
    local_shards_by_table,
    module_input_dists,
    module_lookups,
    skip_missing_weight,
)
from .torchrec_counting import KJTCounter, count_borrowed_dists
from .unique import BaseUniqueEmbeddingSharding
from .validation import InputValidator


def key_tables(configs: Sequence[Any]) -> Dict[str, str]:
    """The table each KJT key the dists send stands for: features, and TorchRec's embedding names
    ("feature@table") that our cells use for a feature read by several tables (the feature itself
    then counts to the first of them)."""
    keys: Dict[str, str] = {}
    for config, names in zip(configs, get_embedding_names_by_table(configs)):
        for feature, name in zip(config.feature_names, names):
            keys.setdefault(feature, config.name)
            keys[name] = config.name
    return keys


class EmbarkShardedModule(CheckedInput, CountedModule):
    """Mixed in before TorchRec's ShardedEmbeddingBagCollection or ShardedEmbeddingCollection, whose constructor
    runs first; the subclass then calls `_init_embark`.

    A batch's sharding contexts: TorchRec's input_dist appends one per sharding, in the module's order, to the
    batch's fresh context, and its compute_and_output_dist and output_dist hand the i-th to sharding i's lookup and
    output dist. Ours carry what our input dists cut from the batch (de-duplication, placement) to their output
    dists, so they are read and swapped in only through `sharding_contexts`, which holds us to TorchRec's indexing."""

    _unique_lookup: str  # UB lookups' input mode (the sharder's unique_lookup)
    _kjt_counters: Dict[int, KJTCounter]  # sharding index -> its input KJT all-to-all's counter
    _embark_shardings: List[int]  # the indices of our shardings
    _unique_shardings: List[Tuple[int, BaseUniqueEmbeddingSharding]]
    _counts_torchrec_shardings: bool  # whether TorchRec's own shardings count their bytes too, or only ours

    @abc.abstractmethod
    def embedding_configs(self) -> List[Any]:
        """The collection's table configs (EmbeddingBagConfig or EmbeddingConfig)."""

    @abc.abstractmethod
    def embedding_shardings(self) -> List[Any]:
        """One EmbeddingSharding per sharding type, in the module's order."""

    @abc.abstractmethod
    def _own_context(self, ctx: Any, index: int, torchrec_context: Any) -> Any:
        """Our sharding `index`'s context for this batch, from the one TorchRec's input dist made for it."""

    def _init_embark(self, invalid_ids: str, unique_lookup: str, **checks: Any) -> None:
        """What the module adds once TorchRec's constructor has built its shardings: the input check
        (InputValidator's `invalid_ids` and `checks`) and UB lookups' `unique_lookup`."""
        configs = self.embedding_configs()
        shardings = self.embedding_shardings()
        self.comm_stats = None
        self._unique_lookup = unique_lookup
        self._kjt_counters = {}
        self._validate = InputValidator(
            {c.name: list(c.feature_names) for c in configs},
            {c.name: c.num_embeddings for c in configs},
            invalid_ids,
            **checks,
        )
        self._embark_shardings = [i for i, s in enumerate(shardings) if isinstance(s, BaseGridEmbeddingSharding)]
        self._unique_shardings = [(i, s) for i, s in enumerate(shardings) if isinstance(s, BaseUniqueEmbeddingSharding)]

    def sharding_contexts(self, ctx: Any) -> List[Any]:
        """This batch's sharding contexts, sharding i's at index i (the class docstring); a batch context holding
        any other number is refused, since our state would reach another sharding's output dist."""
        contexts = ctx.sharding_contexts
        shardings = len(module_input_dists(self))
        if len(contexts) != shardings:
            raise RuntimeError(
                f"{type(self).__name__}: the batch's context holds {len(contexts)} sharding contexts for this "
                f"module's {shardings} shardings; TorchRec's input_dist fills a fresh one (create_context()) per "
                "batch and module, and its output dists read them by sharding index"
            )
        return contexts

    def _after_input_dist(self, ctx: Any) -> None:
        """Each of our shardings' context swapped for its own, carrying what its input dist cut from this batch."""
        contexts = self.sharding_contexts(ctx)
        for i in self._embark_shardings:
            contexts[i] = self._own_context(ctx, i, contexts[i])

    def _create_input_dist(self, *args: Any, **kwargs: Any) -> None:
        """TorchRec's, built on the first batch; then their KJT all-to-alls deferred to the split exchange, and
        counted if the module counts."""
        super()._create_input_dist(*args, **kwargs)  # type: ignore[misc]
        defer_kjt_all_to_alls(module_input_dists(self))
        if self.comm_stats is not None:
            self._count_dists(module_input_dists(self))

    def _count_dists(self, dists: Sequence[torch.nn.Module]) -> None:
        assert self.comm_stats is not None
        feature_table = key_tables(self.embedding_configs())
        types, shardings = self.embedding_sharding_types(), self.embedding_shardings()
        for i, dist_module in enumerate(dists):
            if not self._counts_torchrec_shardings and i not in self._embark_shardings:
                continue
            for m in dist_module.modules():
                if isinstance(m, CountsComm):
                    m.comm_stats, m.comm_sharding_type = self.comm_stats, types[i]
            counter = count_borrowed_dists(shardings[i], dist_module, self.comm_stats, types[i], feature_table)
            if counter is not None:
                self._kjt_counters[i] = counter

    def compute_and_output_dist(self, ctx: Any, input: KJTList) -> Any:
        """TorchRec's; when counting, the KJT all-to-alls' received bytes are read off their output here (the same
        path with and without TrainPipelineSparseDist). UB groups turn the distinct IDs they received into their
        lookup's input here, and file the received counts in the batch's context for their output dist."""
        contexts = self.sharding_contexts(ctx)
        for i, counter in self._kjt_counters.items():
            counter.record_received(input[i], contexts[i].batch_size_per_rank if contexts[i] is not None else None)
        if self._unique_shardings:
            features = list(input)
            for i, sharding in self._unique_shardings:
                features[i], contexts[i].received_counts = sharding.lookup_input(
                    features[i], module_lookups(self)[i], self._unique_lookup
                )
            input = KJTList(features)
        return super().compute_and_output_dist(ctx, input)  # type: ignore[misc]

    def load_cells(self, state_dict: Dict[str, Any], table_prefix: str) -> None:
        """Copies each of the module's local cells from its own region of the incoming weight (a
        ShardedTensor from any plan, matched by offsets, or a full tensor) and takes the weight out of
        `state_dict`. TorchRec's load hooks view a rank's shards of a table as rows of the first shard's
        width, which our cells of other rows and widths break. Virtual tables stay with TorchRec."""
        for table, local_shards in local_shards_by_table(self).items():
            key = f"{table_prefix}{table}.weight"
            value = state_dict.get(key)
            if is_virtual_table(self, table) or not isinstance(value, torch.Tensor):
                continue
            incoming = (
                {tuple(s.metadata.shard_offsets): s.tensor for s in value.local_shards()}
                if isinstance(value, ShardedTensor)
                else None
            )
            with torch.no_grad():
                for shard in local_shards:
                    offsets, sizes = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    if incoming is None:
                        source = value[offsets[0] : offsets[0] + sizes[0], offsets[1] : offsets[1] + sizes[1]]
                    else:
                        source = incoming.get(tuple(offsets))
                    if source is None or tuple(source.shape) != tuple(sizes):
                        raise ValueError(
                            f"table {table!r}: the state dict has no shard of shape {list(sizes)} "
                            f"at offsets {list(offsets)} "
                            "for this rank; was it saved with another plan? load it with torch.distributed.checkpoint"
                        )
                    shard.tensor.copy_(source)
            del state_dict[key]
            skip_missing_weight(self, key)
