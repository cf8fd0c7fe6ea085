"""A bad batch on ONE rank is every rank's error: each rank raises the same named error (the bad rank, the feature,
what is wrong) within seconds, and no rank waits in an all-to-all its bad peer never joins.

For each check the input validator makes (IDs out of range, negative IDs, uint8 / int16 / float IDs, lengths that
disagree with the values or the weights, negative lengths, a missing feature, NaN and Inf per-sample weights,
per-sample weights missing on a weighted module or given to an unweighted one, a batch that is no KJT, 2-D IDs, more
lengths than keys x batch, a feature given twice, VBE inverse indices out of range or missing, int32 IDs among int64
ones), one rank feeds the bad batch and the
others good ones, on a module of each sharding type: TorchRec's table-wise, column-wise, row-wise, table-row-wise and
data-parallel run under our sharder, and our grid (flat and hierarchical) and unique-based types; weighted
EmbeddingBagCollections with one batch size and with a variable batch per feature (VBE; on data-parallel tables, whose
VBE output TorchRec 1.8 cannot expand, a VBE batch is refused by name), unweighted ones (only the weights given to
them), and EmbeddingCollections (TorchRec's sequence table-wise and row-wise, our sequence grid and unique-based).
At 2 ranks and at 4 (2 nodes x 2). The bad rank either stops (it waits, out of every collective, until the others
have reported their error: a peer that needed it would deadlock, and the test fail on its short timeouts) or catches
the error and goes on: then every rank runs the next good batch, which must give what it gave before. The modules run
on a process group with a short timeout, so a regression fails in seconds instead of hanging.
"""

from __future__ import annotations

import math
import os
import time
from datetime import timedelta
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist
from torchrec.modules.embedding_configs import EmbeddingBagConfig, EmbeddingConfig
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from embark_torchrec.plan.layout.groups import sharding_group
from embark_torchrec.plan.layout.torchrec_types import ceil_row_bounds
from embark_torchrec.plan.layout.tables import TableLayout
from embark_torchrec.sharding.torchrec_compat import module_sharding_types, sequence_sharding_types
from embark_torchrec.sharding.validation import InputFault, InputValidator, InvalidInputError, not_a_kjt
from embark_torchrec.testing import run_ranks
from embark_torchrec.testing.sequence import sharded_sequence_model
from embark_torchrec.testing.training import sharded_model

ROWS, DIM, LWS = 40, 8, 2
KEYS = ["a", "b"]
PG_TIMEOUT_S = 20.0  # the modules' process group: a rank left waiting fails after this, not after 30 minutes
WITHIN_S = 5.0  # every rank must have its error this soon after feeding the batch
WORLDS = (2, 4)


def _layouts(ws: int) -> dict[str, TableLayout]:
    """One layout per sharding type; the two tables of a module share it."""
    layouts = {
        "table_wise": TableLayout.table_wise(ROWS, DIM, ws - 1),
        "column_wise": TableLayout("rb", (0, ROWS), (0, 4, DIM), ((0, ws - 1),)),
        "row_wise": TableLayout("rb", ceil_row_bounds(ROWS, ws), (0, DIM), tuple((k,) for k in range(ws))),
        "data_parallel": TableLayout.data_parallel(),
        "grid": TableLayout("rb", (0, 13, ROWS), (0, 4, DIM), ((0, ws - 1), (ws - 1, 0))),
        "ub": TableLayout("ub", (0, 20, ROWS), (0, DIM), ((ws - 1,), (0,))),
    }
    if ws == 4:
        layouts["table_row_wise"] = TableLayout(
            "rb", ceil_row_bounds(ROWS, LWS), (0, DIM), ((2,), (3,)), hierarchical=True
        )
        layouts["grid_hier"] = TableLayout("rb", (0, 20, ROWS), (0, 4, DIM), ((1, 2), (3, 0)), hierarchical=True)
    return layouts


SEQUENCE_TYPES = ("table_wise", "row_wise", "grid", "ub")


def _kjt(
    keys: list[str], values: torch.Tensor, lengths: torch.Tensor, weights: torch.Tensor | None, variable: bool
) -> KeyedJaggedTensor:
    """Two samples; under VBE feature "a" has 2 bags and "b" 1, which both samples read."""
    if variable:
        strides = [[2], [1]][: len(keys)]
        inverse = torch.tensor([[0, 1], [0, 0]][: len(keys)])
        return KeyedJaggedTensor(
            keys=keys,
            values=values,
            lengths=lengths,
            weights=weights,
            stride_per_key_per_rank=strides,
            inverse_indices=(keys, inverse),
        )
    return KeyedJaggedTensor(keys=keys, values=values, lengths=lengths, weights=weights, stride=2)


def _good(rank: int, step: int, weighted: bool, variable: bool) -> KeyedJaggedTensor:
    lengths = [1, 2, 2] if variable else [1, 2, 2, 1]  # feature "a": its first 3 IDs
    g = torch.Generator().manual_seed(100 * rank + step)
    values = torch.randint(0, ROWS, (sum(lengths),), generator=g)
    weights = torch.rand(sum(lengths), generator=g) + 0.5 if weighted else None
    return _kjt(KEYS, values, torch.tensor(lengths), weights, variable)


def _with(kjt: KeyedJaggedTensor, variable: bool, **change: Any) -> KeyedJaggedTensor:
    parts = {"keys": kjt.keys(), "values": kjt.values(), "lengths": kjt.lengths(), "weights": kjt.weights_or_none()}
    parts.update(change)
    return _kjt(parts["keys"], parts["values"], parts["lengths"], parts["weights"], variable)


def _set(t: torch.Tensor, i: int, value: float) -> torch.Tensor:
    t = t.clone()
    t[i] = value
    return t


def _first(t: torch.Tensor | None, n: int) -> torch.Tensor | None:
    return None if t is None else t[:n]


def _duplicated(k: KeyedJaggedTensor, variable: bool) -> KeyedJaggedTensor:
    """Feature "a" given again after "b", with its bags and IDs (TorchRec would read one "a" and drop the other)."""
    ids = int(k.lengths()[:2].sum())  # feature "a" has 2 bags in both layouts
    keys = ["a", "b", "a"]
    parts: dict[str, Any] = {
        "keys": keys,
        "values": torch.cat([k.values(), k.values()[:ids]]),
        "lengths": torch.cat([k.lengths(), k.lengths()[:2]]),
        "weights": None if k.weights_or_none() is None else torch.cat([k.weights(), k.weights()[:ids]]),
    }
    if variable:
        inverse = torch.tensor([[0, 1], [0, 0], [0, 1]])
        return KeyedJaggedTensor(**parts, stride_per_key_per_rank=[[2], [1], [2]], inverse_indices=(keys, inverse))
    return KeyedJaggedTensor(**parts, stride=2)


def _no_lengths(k: KeyedJaggedTensor, variable: bool) -> KeyedJaggedTensor:
    """The batch's IDs without lengths or offsets: TorchRec's KJT takes it, and asserts when asked its lengths."""
    layout: dict[str, Any] = (
        {"stride_per_key_per_rank": k.stride_per_key_per_rank(), "inverse_indices": k.inverse_indices()}
        if variable
        else {"stride": k.stride()}
    )
    return KeyedJaggedTensor(keys=k.keys(), values=k.values(), weights=k.weights_or_none(), **layout)


def _inverse(k: KeyedJaggedTensor, inverse: torch.Tensor | None) -> KeyedJaggedTensor:
    """A VBE batch with other inverse indices (None: without them)."""
    return KeyedJaggedTensor(
        keys=k.keys(),
        values=k.values(),
        lengths=k.lengths(),
        weights=k.weights_or_none(),
        stride_per_key_per_rank=k.stride_per_key_per_rank(),
        inverse_indices=None if inverse is None else (k.keys(), inverse),
    )


# case -> (the bad batch from a good one, VBE or not; for weighted modules only (True), unweighted ones only (False)
# or any (None); error class; words every message has)
Corrupt = Callable[[KeyedJaggedTensor, bool], KeyedJaggedTensor]
CASES: dict[str, tuple[Corrupt, bool | None, str, list[str]]] = {
    "id_too_big": (
        lambda k, v: _with(k, v, values=_set(k.values(), 0, ROWS)),
        None,
        "InvalidIdError",
        ["feature 'a' of table 'ta'", f"[{ROWS}] outside [0, {ROWS})"],
    ),
    "id_negative": (
        lambda k, v: _with(k, v, values=_set(k.values(), 1, -1)),
        None,
        "InvalidIdError",
        ["feature 'a'", "[-1]"],
    ),
    "ids_uint8": (lambda k, v: _with(k, v, values=k.values().to(torch.uint8)), None, "InvalidInputError", ["uint8"]),
    "ids_int16": (lambda k, v: _with(k, v, values=k.values().to(torch.int16)), None, "InvalidInputError", ["int16"]),
    "ids_float": (lambda k, v: _with(k, v, values=k.values().float()), None, "InvalidInputError", ["float32"]),
    "lengths_exceed_values": (
        lambda k, v: _with(k, v, values=k.values()[:-1], weights=_first(k.weights_or_none(), k.values().numel() - 1)),
        None,
        "InvalidInputError",
        ["the bag lengths add up to"],
    ),
    "negative_length": (
        lambda k, v: _with(k, v, lengths=torch.tensor([-1, 4, 2] if v else [1, 3, 3, -1])),
        None,
        "InvalidInputError",
        ["negative bag lengths"],
    ),
    "missing_feature": (
        lambda k, v: _with(
            k, v, keys=["a"], values=k.values()[:3], weights=_first(k.weights_or_none(), 3), lengths=k.lengths()[:2]
        ),
        None,
        "InvalidInputError",
        ["features ['b'] are missing"],
    ),
    "weights_disagree": (
        lambda k, v: _with(k, v, weights=k.weights()[:-1]),
        True,
        "InvalidInputError",
        ["weights"],
    ),
    "weight_nan": (
        lambda k, v: _with(k, v, weights=_set(k.weights(), 0, math.nan)),
        True,
        "InvalidInputError",
        ["feature 'a' of table 'ta' has non-finite per-sample weights (1 NaN"],
    ),
    "weight_inf": (
        lambda k, v: _with(k, v, weights=_set(k.weights(), 3, math.inf)),
        True,
        "InvalidInputError",
        ["feature 'b' of table 'tb' has non-finite per-sample weights (1 +Inf"],
    ),
    "weights_dropped": (
        lambda k, v: _with(k, v, weights=None),
        True,
        "InvalidInputError",
        ["features ['a', 'b'] of a weighted EmbeddingBagCollection got no per-sample weights", "is_weighted=True"],
    ),
    "weights_given": (
        lambda k, v: _with(k, v, weights=torch.ones(k.values().numel())),
        False,
        "InvalidInputError",
        ["features ['a', 'b']", "got per-sample weights"],
    ),
    "weights_float16": (
        lambda k, v: _with(k, v, weights=k.weights().half()),
        True,
        "InvalidInputError",
        ["weights are torch.float16; per-sample weights must be torch.float32 or torch.float64"],
    ),
    "not_a_kjt": (lambda k, v: None, None, "InvalidInputError", ["was given None; it takes a KeyedJaggedTensor"]),
    "ids_2d": (
        lambda k, v: _with(k, v, values=k.values().view(-1, 1)),
        None,
        "InvalidInputError",
        ["tensors must be 1-D, got IDs 2-D, lengths 1-D"],
    ),
    "lengths_count": (
        lambda k, v: _with(k, v, lengths=torch.cat([k.lengths(), torch.tensor([0])])),
        None,
        "InvalidInputError",
        ["bag lengths, but its 2 keys and batch size (stride) make"],
    ),
    "duplicate_key": (_duplicated, None, "InvalidInputError", ["keys give feature 'a' twice"]),
    "no_lengths": (_no_lengths, None, "InvalidInputError", ["the KeyedJaggedTensor has neither lengths nor offsets"]),
    "inverse_out_of_range": (
        lambda k, v: _inverse(k, torch.tensor([[0, 2], [0, 0]])),
        None,
        "InvalidInputError",
        ["feature 'a' of table 'ta' has inverse indices [2] outside its [0, 2) bags"],
    ),
    "inverse_missing": (
        lambda k, v: _inverse(k, None),
        None,
        "InvalidInputError",
        ["a variable batch per feature (VBE) but no inverse indices"],
    ),
}
VBE_ONLY = {"inverse_out_of_range", "inverse_missing"}  # cases of a variable batch per feature alone


def _outputs(model: Any, kjt: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
    out = model(kjt)
    out = out.wait() if hasattr(out, "wait") else out
    if isinstance(out, dict):  # an EmbeddingCollection's: a JaggedTensor per feature
        return {k: jt.values().detach().clone() for k, jt in out.items()}
    return {k: v.detach().clone() for k, v in out.to_dict().items()}


def _feed_bad(
    model: Any, store: dist.Store, tag: str, bad: int, stops: bool, good: KeyedJaggedTensor, bad_kjt: Any
) -> dict[str, Any]:
    """One rank's side of one case: its error (class and text) and how long it took to come."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    start = time.monotonic()
    try:
        _outputs(model, bad_kjt if rank == bad else good)
        error = "no error"
    except InvalidInputError as exc:
        error = f"{type(exc).__name__}: {exc}"
    elapsed = time.monotonic() - start
    if stops:  # the bad rank takes no part in anything until every other rank has its error
        if rank == bad:
            store.wait([f"{tag}/{r}" for r in range(ws) if r != bad], timedelta(seconds=PG_TIMEOUT_S))
        else:
            store.set(f"{tag}/{rank}", "1")
    return {"error": error, "seconds": elapsed}


def _applies(for_weighted: bool | None, weighted: bool, only_weighting: bool) -> bool:
    """Whether a case runs on a module (weighted or not; an unweighted EBC runs only the weighting case)."""
    return for_weighted == weighted if only_weighting else for_weighted in (None, weighted)


def _run_module(
    model: Any,
    runs_as: list[str],
    name: str,
    weighted: bool,
    variable: bool,
    store: dist.Store,
    only_weighting: bool = False,
) -> dict[str, Any]:
    rank, ws = dist.get_rank(), dist.get_world_size()
    good = _good(rank, 0, weighted, variable)
    want = _outputs(model, good)
    out: dict[str, Any] = {"runs_as": runs_as}
    for i, (case, (corrupt, for_weighted, _, _)) in enumerate(CASES.items()):
        if not _applies(for_weighted, weighted, only_weighting) or (case in VBE_ONLY and not variable):
            continue
        bad_kjt = corrupt(_good(rank, 1, weighted, variable), variable)
        for stops in (True, False):
            bad = (i + stops) % ws
            tag = f"{name}/{case}/{stops}"
            result = _feed_bad(model, store, tag, bad, stops, good, bad_kjt)
            result["bad"] = bad
            if not stops:  # everyone caught it and goes on: the next good batch runs as before
                got = _outputs(model, good)
                result["after"] = max(float((got[k] - want[k]).abs().max()) for k in want)
            out[f"{case}/{'stops' if stops else 'continues'}"] = result
    if not only_weighting:  # one rank's batch is fine by itself, but its IDs are int32 among int64 ones
        bad, mixed = ws - 1, _good(rank, 1, weighted, variable)
        mixed = _with(mixed, variable, values=mixed.values().int())
        result = _feed_bad(model, store, f"{name}/int32", bad, False, good, mixed)
        got = _outputs(model, good)
        out["int32_on_one_rank"] = {
            **result,
            "bad": bad,
            "after": max(float((got[k] - want[k]).abs().max()) for k in want),
        }
    if variable:  # a valid batch whose inverse indices are a strided view of the same ones, trained a step (last:
        # the step updates the tables)
        bad, inverse = ws - 1, good.inverse_indices()[1]
        sliced = _inverse(good, torch.cat([inverse, inverse], dim=1)[:, : inverse.shape[1]])  # rows 2x apart: no view
        try:
            pooled = model(sliced if rank == bad else good)
            pooled = pooled.wait() if hasattr(pooled, "wait") else pooled
            pooled.values().sum().backward()
            error = "no error"
        except RuntimeError as exc:
            error = f"{type(exc).__name__}: {exc}"
        out["sliced_inverse_on_one_rank"] = {"error": error, "bad": bad}
    if weighted and not variable:  # one rank's batch is fine by itself, but a VBE one among uniform ones
        bad = ws - 1
        result = _feed_bad(model, store, f"{name}/vbe", bad, False, good, _good(rank, 1, weighted, True))
        got = _outputs(model, good)
        out["vbe_on_one_rank"] = {
            **result,
            "bad": bad,
            "after": max(float((got[k] - want[k]).abs().max()) for k in want),
        }
    return out


def _all_modules() -> dict[str, Any]:
    ws = dist.get_world_size()
    pg = dist.new_group(backend="gloo", timeout=timedelta(seconds=PG_TIMEOUT_S))
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timedelta(seconds=60)
    )
    results: dict[str, Any] = {}
    for kind, layout in _layouts(ws).items():
        tables = [
            EmbeddingBagConfig(name=f"t{f}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f]) for f in KEYS
        ]
        for variable in (False, True) if kind != "data_parallel" else (False,):  # TorchRec's DP takes no VBE
            torch.manual_seed(0)
            model = sharded_model(tables, {t.name: layout for t in tables}, LWS, weighted=True, pg=pg)
            name = f"ebc/{kind}/{'vbe' if variable else 'uniform'}"
            results[name] = _run_module(model, module_sharding_types(model.module.ebc), name, True, variable, store)
        torch.manual_seed(0)
        model = sharded_model(tables, {t.name: layout for t in tables}, LWS, pg=pg)
        name = f"ebc_unweighted/{kind}/uniform"
        results[name] = _run_module(model, module_sharding_types(model.module.ebc), name, False, False, store, True)
    for kind in SEQUENCE_TYPES:
        layout = _layouts(ws)[kind]
        tables = [
            EmbeddingConfig(name=f"t{f}", num_embeddings=ROWS, embedding_dim=DIM, feature_names=[f]) for f in KEYS
        ]
        torch.manual_seed(0)
        model = sharded_sequence_model(tables, {t.name: layout for t in tables}, LWS, pg=pg)
        name = f"ec/{kind}"
        results[name] = _run_module(model, sequence_sharding_types(model.module.ec), name, False, False, store)
        results[name] |= _ec_only_cases(model, name, store)
    return results


def _ec_only_cases(model: Any, name: str, store: dist.Store) -> dict[str, Any]:
    """What an EC cannot take though an EBC can (TorchRec's EC fails on that rank alone after the all-to-alls): a
    batch of no samples (its output is built by viewing the lengths by the batch size), and a VBE batch without
    inverse indices (it asserts them)."""
    rank, ws = dist.get_rank(), dist.get_world_size()
    good, bad = _good(rank, 0, False, False), ws - 1
    no_ids = torch.empty(0, dtype=torch.long)
    empty = KeyedJaggedTensor(keys=KEYS, values=no_ids, lengths=no_ids, stride=0)
    variable = _inverse(_good(rank, 1, False, True), None)
    return {
        case: {**_feed_bad(model, store, f"{name}/{case}", bad, False, good, kjt), "bad": bad}
        for case, kjt in (("empty_batch", empty), ("vbe_without_inverse", variable))
    }


@pytest.fixture(scope="module", params=WORLDS)
def results(request: pytest.FixtureRequest) -> tuple[int, list[dict[str, Any]]]:
    ws = request.param
    return ws, run_ranks(_all_modules, ws, local_world_size=LWS, timeout_s=600)


def test_each_module_runs_the_sharding_type_it_stands_for(results: tuple[int, list[dict[str, Any]]]) -> None:
    """The matrix covers what it says: TorchRec's own types by their names, ours as embark types."""
    ws, per_rank = results
    for name, r in per_rank[0].items():
        kind = name.split("/")[1]
        layout = _layouts(ws)[kind]
        want = sharding_group(layout, ROWS, ws, LWS, sequence=name.startswith("ec")).name
        assert r["runs_as"] == [want], (name, r["runs_as"], want)
        if kind in ("grid", "grid_hier", "ub"):
            assert want.startswith("embark_"), (name, want)


@pytest.mark.parametrize("case", sorted(CASES))
def test_one_bad_rank_gives_every_rank_the_same_named_error(
    results: tuple[int, list[dict[str, Any]]], case: str
) -> None:
    """Every rank raises the same error, of the check's class, naming the bad rank and what is wrong, within
    seconds, whether the bad rank stops or goes on; after it, the next good batch gives what it gave before."""
    ws, per_rank = results
    _, for_weighted, error_class, words = CASES[case]
    checked = 0
    for name in per_rank[0]:
        weighted, only_weighting = name.startswith("ebc/"), name.startswith("ebc_unweighted/")
        if not _applies(for_weighted, weighted, only_weighting):
            continue
        if case in VBE_ONLY and not name.endswith("/vbe"):
            continue
        for variant in ("stops", "continues"):
            key = f"{case}/{variant}"
            assert key in per_rank[0][name], (ws, name, key)
            got = [r[name][key] for r in per_rank]
            bad = got[0]["bad"]
            texts = {g["error"] for g in got}
            assert len(texts) == 1, (ws, name, key, texts)
            (text,) = texts
            assert text.startswith(f"{error_class}: rank {bad}: "), (ws, name, key, text)
            for w in words:
                assert w in text, (ws, name, key, w, text)
            slow = {rank: g["seconds"] for rank, g in enumerate(got) if g["seconds"] > WITHIN_S}
            assert not slow, (ws, name, key, slow)
            if variant == "continues":
                assert all(g["after"] == 0.0 for g in got), (ws, name, key, [g["after"] for g in got])
            checked += 1
    assert checked >= 2 * len(SEQUENCE_TYPES), (ws, case, checked)


def test_int32_ids_on_one_rank_among_int64_ones_are_refused_alike(results: tuple[int, list[dict[str, Any]]]) -> None:
    """int32 IDs are fine, but one rank's int32 among its peers' int64 makes TorchRec's KJT all-to-alls exchange
    tensors of two sizes (gloo aborts the process, or waits forever; float16 weights among float32 ones hang our
    grid): on every type every rank raises the same error naming each rank's dtypes, and the next good batch runs
    as before."""
    ws, per_rank = results
    checked = 0
    for name in per_rank[0]:
        if "int32_on_one_rank" not in per_rank[0][name]:
            continue
        got = [r[name]["int32_on_one_rank"] for r in per_rank]
        texts = {g["error"] for g in got}
        assert len(texts) == 1, (ws, name, texts)
        (text,) = texts
        assert text.startswith("InvalidInputError: the ranks' KeyedJaggedTensors differ in dtypes"), (name, text)
        assert f"rank {got[0]['bad']}: IDs torch.int32, lengths torch.int64" in text, (name, text)
        assert "rank 0: IDs torch.int64, lengths torch.int64" in text, (name, text)
        assert all(g["seconds"] < WITHIN_S for g in got), (ws, name, [g["seconds"] for g in got])
        assert all(g["after"] == 0.0 for g in got), (ws, name, [g["after"] for g in got])
        checked += 1
    assert checked >= 2 * len(_layouts(ws)), (ws, checked)


KJT_TYPES = ("table_wise", "column_wise", "row_wise", "table_row_wise")


def test_a_variable_batch_on_one_rank_only_is_refused_alike_or_runs(results: tuple[int, list[dict[str, Any]]]) -> None:
    """A VBE batch on one rank among uniform ones: TorchRec's KJT all-to-alls would send another set of tensors from
    it (its per-key strides, no batch size), so on those types every rank raises the same error naming each rank's
    layout; TorchRec's data-parallel sharding cannot expand a VBE output at all, so it is refused by name (on every
    rank); our types pad it to a uniform batch, so there it runs. Either way every rank ends alike, and the next good
    batch runs as before."""
    ws, per_rank = results
    for name in per_rank[0]:
        if "vbe_on_one_rank" not in per_rank[0][name]:
            continue
        got = [r[name]["vbe_on_one_rank"] for r in per_rank]
        texts = {g["error"] for g in got}
        assert len(texts) == 1, (ws, name, texts)
        (text,) = texts
        kind, bad = name.split("/")[1], got[0]["bad"]
        if kind in KJT_TYPES:
            assert text.startswith("InvalidInputError: the ranks' KeyedJaggedTensors differ in layout"), (name, text)
            assert f"rank {bad}: with weights, a variable batch per feature" in text, (name, text)
        elif kind == "data_parallel":
            assert text.startswith(f"InvalidInputError: rank {bad}: the KeyedJaggedTensor has a variable batch"), text
            assert "data-parallel sharding of feature 'a' of table 'ta' cannot expand" in text, text
        else:
            assert text == "no error", (ws, name, text)
        assert all(g["after"] == 0.0 for g in got), (ws, name, [g["after"] for g in got])


def test_inverse_indices_that_are_a_strided_view_run_on_every_type(results: tuple[int, list[dict[str, Any]]]) -> None:
    """A VBE batch whose inverse indices are a slice (the same indices, not contiguous) on one rank runs on every
    type: TorchRec views them after the output dist, which failed on that rank alone while its peers waited in the
    backward's all-to-all; the check hands TorchRec a contiguous copy."""
    ws, per_rank = results
    ran = [name for name in per_rank[0] if "sliced_inverse_on_one_rank" in per_rank[0][name]]
    assert ran, "no module ran the case"
    for name in ran:
        got = [r[name]["sliced_inverse_on_one_rank"] for r in per_rank]
        assert all(g["error"] == "no error" for g in got), (ws, name, got)


def test_what_an_embedding_collection_cannot_take_is_every_ranks_named_error(
    results: tuple[int, list[dict[str, Any]]],
) -> None:
    """An empty batch, or a VBE batch without inverse indices, on one rank of an EC (TorchRec's or ours): every rank
    raises the same named error; before, that rank failed inside TorchRec after the all-to-alls and its peers hung."""
    ws, per_rank = results
    words = {
        "empty_batch": "holds no samples (batch size 0), for which TorchRec's EmbeddingCollection cannot build",
        "vbe_without_inverse": "(VBE) but no inverse indices, which the EmbeddingCollection needs",
    }
    ran = [name for name in per_rank[0] if name.startswith("ec/")]
    assert ran, "no EmbeddingCollection ran"
    for name in ran:
        for case, text in words.items():
            got = {r[name][case]["error"] for r in per_rank}
            assert len(got) == 1, (ws, name, case, got)
            (error,) = got
            bad = per_rank[0][name][case]["bad"]
            assert error.startswith(f"InvalidInputError: rank {bad}: ") and text in error, (ws, name, case, error)


def test_validator_faults_travel_as_integers_and_read_the_same() -> None:
    """Each fault survives the round trip through the exchange's integers and reads as the same words; NaN weights
    or negative-free IDs of a key the module does not read are not this module's fault (no process group needed)."""
    validators = {
        weighted: InputValidator({"ta": ["a"], "tb": ["b"]}, {"ta": ROWS, "tb": ROWS}, weighted=weighted)
        for weighted in (True, False)
    }
    for weighted, validator in validators.items():
        assert validator.check(_good(0, 0, weighted, False))[1] is None
    for case, (corrupt, for_weighted, error_class, words) in CASES.items():
        weighted = for_weighted is not False
        validator = validators[weighted]
        variable = case in VBE_ONLY
        batch = corrupt(_good(0, 0, weighted, variable), variable)
        _, fault = validator.check(batch) if batch is not None else (None, not_a_kjt(batch))
        assert fault is not None, case
        back = InputFault.from_ints(fault.to_ints())
        assert back == fault and len(fault.to_ints()) == InputFault.FIELDS, case
        error = validator.error({3: back})
        assert type(error).__name__ == error_class and str(error).startswith("rank 3: "), (case, error)
        assert all(w in str(error) for w in words), (case, error)
    other = KeyedJaggedTensor(
        keys=["a", "b", "x"],
        values=torch.tensor([1, 2, 3]),
        lengths=torch.tensor([1, 0, 1, 0, 1, 0]),
        weights=torch.tensor([1.0, 1.0, math.nan]),
        stride=2,
    )
    assert validators[True].check(other)[1] is None
