"""Plans a fixed sweep of model / world / wire-precision cases and records each plan's hash: the check that a
refactor of the planner left every plan bit-identical.

A refactor that must not change plans (the cluster-kind registry, a faster search) is checked by running this at
the revision before and the revision after, each from its own checkout, and comparing the two files:

    git worktree add /tmp/before <rev>
    PYTHONPATH=/tmp/before python benchmarks/plan_identity.py --out before.json
    PYTHONPATH=. python benchmarks/plan_identity.py --out after.json --compare before.json

The package planned is the one on PYTHONPATH (the script itself uses only the planner's public entry points:
`plan_model`, `SearchConfig(precision=...)`, `Plan.to_dict`, `CostModel.evaluate`). Each case records the SHA-256
of the plan's JSON (sorted keys) and its estimated step; a case whose model does not fit records the error's text,
so "fails to fit in both" compares equal too. --compare exits 1 when any case differs.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import Any

from embark_torchrec.plan import (
    PRESETS,
    CostModel,
    ModelSpec,
    SearchConfig,
    Topology,
    WirePrecision,
    builtin_model,
    load_model_spec,
    plan_model,
)

MODELS_DIR = Path(__file__).resolve().parent / "models"
BUILTIN_MODELS = ("dcnv2", "t180", "t200", "t510")
OWN_MODELS = ("skewed_dcnv2", "tiny_big", "mixed300", "dlrm_main", "multihot_zipf", "dlrm_main_multihot")
WORLDS = ((8, 8), (16, 4), (32, 8), (64, 8))  # (world size, GPUs per node)
PRECISIONS = ("fp32", "fp8")
EXTRA = (("dcnv2", 128, 8, "fp32"), ("dcnv2", 128, 8, "fp16"), ("skewed_dcnv2", 128, 8, "fp16"))
BATCH_SIZE = 65536


def cases() -> list[tuple[str, int, int, str]]:
    """(model, world size, GPUs per node, wire precision): 10 models x 4 worlds x 2 precisions, and 3 more (83)."""
    sweep = [
        (model, ws, lws, precision)
        for model in (*BUILTIN_MODELS, *OWN_MODELS)
        for ws, lws in WORLDS
        for precision in PRECISIONS
    ]
    return sweep + list(EXTRA)


def model_spec(model: str, world_size: int) -> ModelSpec:
    path = MODELS_DIR / f"{model}.json"
    spec = load_model_spec(path) if path.exists() else builtin_model(model)
    return spec.with_batch_size(BATCH_SIZE // world_size * world_size)


def plan_case(model: str, world_size: int, local_world_size: int, precision: str, hardware: str) -> dict[str, Any]:
    spec = model_spec(model, world_size)
    topology = Topology(world_size, local_world_size, PRESETS[hardware])
    wire = WirePrecision(precision, precision)
    config = SearchConfig(precision={"rb": wire, "ub": wire})
    start = time.perf_counter()
    try:
        plan = plan_model(spec, topology, config=config, progress=False).plan
    except ValueError as e:  # the model does not fit: a result to compare, not a crash
        return {"error": str(e), "seconds": round(time.perf_counter() - start, 2)}
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return {
        "sha256": hashlib.sha256(text.encode()).hexdigest(),
        "step_ms": CostModel(spec, topology).evaluate(plan).step_ms,
        "seconds": round(time.perf_counter() - start, 2),
    }


def differences(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    """The cases whose plan (or error) differs, or that only one file has."""
    out = []
    for key in sorted(set(before) | set(after)):
        b, a = before.get(key), after.get(key)
        if b is None or a is None:
            out.append(f"{key}: only in {'after' if b is None else 'before'}")
        elif (b.get("sha256"), b.get("error")) != (a.get("sha256"), a.get("error")):
            out.append(f"{key}: step {b.get('step_ms', b.get('error'))} -> {a.get('step_ms', a.get('error'))}")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON file of {case: plan hash, step or error}")
    parser.add_argument("--compare", type=Path, help="an earlier --out file: list the cases that differ")
    parser.add_argument("--hardware", default="dgx-h100", choices=sorted(PRESETS))
    args = parser.parse_args(argv)
    results: dict[str, Any] = {}
    for model, ws, lws, precision in cases():
        key = f"{model}@{ws}x{lws}:{precision}"
        results[key] = plan_case(model, ws, lws, precision, args.hardware)
        print(f"{key}: {results[key].get('step_ms', results[key].get('error'))}", file=sys.stderr, flush=True)
    args.out.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n")
    if args.compare is None:
        return 0
    diff = differences(json.loads(args.compare.read_text()), results)
    planned = sum("sha256" in r for r in results.values())
    print(f"{len(results) - len(diff)} of {len(results)} cases identical ({planned} planned, the rest fail to fit)")
    for line in diff:
        print("  differs: " + line)
    return 1 if diff else 0


if __name__ == "__main__":
    sys.exit(main())
