"""The emulated cluster (embark_torchrec.cluster): the CLI runs the unchanged DLRM example across namespaces and
leaves nothing behind (also when the script fails or is interrupted), and the bytes our counters report crossing
nodes are what the kernel counts on the links.

The byte check is independent of our code: the kernel's veth counters see every byte a node sends or receives
across nodes, headers included. TCP/IP's overhead is measured on the same links by a bare gloo all-to-all of
known size (embark_torchrec.testing.link_probe); gloo's all-reduce, which DDP runs for the dense gradients and
which our counters leave out, is checked there against the cost model's ring formula. The example's counted
inter-node bytes plus its all-reduce's ring bytes, times that overhead, must then equal what the kernel counted,
per step: the difference of a long and a short run, so that start-up (rendezvous, plan broadcast, DDP's first
broadcast) and the held-out evaluation cancel.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from embark_torchrec import cluster
from embark_torchrec.plan.cost.model import CostModel
from embark_torchrec.plan.model.spec import ModelSpec, TableSpec
from embark_torchrec.plan.model.topology import Topology
from tests.support.processes import ROOT, checkout_env

TRAIN = ROOT / "examples" / "dlrm" / "train.py"
PLANS = ROOT / "tests" / "plans"
NODES, RANKS = 2, 2
LINK_MBIT = 1000.0  # shaped, but fast: these tests check what crosses, not how long it takes
SHORT, LONG = 4, 12  # steps of the two runs whose difference is compared
# The probe's overhead is that of megabyte messages (GSO packets of up to 64 KiB carry one set of headers); a
# training step also sends small messages (lengths, splits, counts, barriers), each with ~66 bytes of
# Ethernet/IP/TCP headers and an acknowledgement of as many. They add about 0.5% of the example's bytes here;
# a message our counters missed or counted twice (the smallest, one feature's lengths, is 4% of a step's) would
# move the ratio by more than this.
TOLERANCE = 0.02


def _cluster_or_skip() -> cluster.EmulatedCluster:
    try:
        cluster.preflight()
    except cluster.ClusterError as e:
        pytest.skip(f"no emulated cluster here: {e}")
    return cluster.EmulatedCluster(cluster.ClusterSpec(nodes=NODES, gpus_per_node=RANKS, link_mbit=LINK_MBIT))


@pytest.fixture(scope="module")
def emulated() -> Iterator[cluster.EmulatedCluster]:
    made = _cluster_or_skip()
    try:
        made.__enter__()
    except cluster.ClusterError as e:
        pytest.skip(f"network namespaces cannot be made here: {e}")
    try:
        yield made
    finally:
        made.teardown()


def _tagged_line(path: Path, tag: str) -> dict[str, Any]:
    (line,) = [x for x in path.read_text().splitlines() if x.startswith(tag + " ")]
    return json.loads(line[len(tag) + 1 :])


def _run(emulated: cluster.EmulatedCluster, script: list[str], tmp: Path, tag: str) -> tuple[dict[str, Any], list[int]]:
    """Run `script` on the cluster; its `tag` line, and each node's link bytes (sent + received) over the run."""
    tmp.mkdir(parents=True, exist_ok=True)
    before = [sum(emulated.link_bytes(n)) for n in range(NODES)]
    out = tmp / "out.txt"
    with open(out, "w") as f:
        code = emulated.run(script, timeout_s=300, log_dir=tmp / "logs", stdout=f.fileno())
    assert code == 0, out.read_text()[-3000:]
    after = [sum(emulated.link_bytes(n)) for n in range(NODES)]
    return _tagged_line(out, tag), [a - b for a, b in zip(after, before)]


@pytest.fixture(scope="module")
def overhead(emulated: cluster.EmulatedCluster, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    probe, _ = _run(emulated, ["-m", "embark_torchrec.testing.link_probe"], tmp_path_factory.mktemp("probe"), "PROBE")
    return probe


def _ring_bytes_per_node(nbytes: int) -> float:
    """Bytes a node sends + receives across nodes to all-reduce `nbytes`, by the cost model's ring formula."""
    spec = ModelSpec("ring", NODES * RANKS, (TableSpec("t", 4, 4, 1.0),))
    per_rank = CostModel(spec, Topology(NODES * RANKS, RANKS)).ring_allreduce_bytes(nbytes)[1]
    return 2 * RANKS * per_rank  # the node's ranks, sent and received


def test_probe_measures_tcp_overhead_and_the_ring_all_reduce(overhead: dict[str, Any]) -> None:
    """The bare all-to-all's link bytes exceed its payload by TCP/IP's overhead only (a few per cent at most), and
    gloo's all-reduce sends across nodes what the cost model's ring formula says (NCCL's ring; gloo's too)."""
    payload = overhead["alltoall_payload_per_node"]
    for node, counted in enumerate(overhead["alltoall_link_bytes"]):
        assert payload <= counted <= 1.05 * payload, (node, counted, payload)
    factor = overhead["alltoall_link_bytes"][0] / payload
    predicted = _ring_bytes_per_node(overhead["allreduce_bytes"]) * overhead["repeats"]
    for node, counted in enumerate(overhead["allreduce_link_bytes"]):
        assert counted / factor == pytest.approx(predicted, rel=TOLERANCE), (node, counted, predicted)


# embark's fp16 plan of the multi-hot model (7 data-parallel tables, 3 row-wise), so DDP's fp16 all-reduce of
# data-parallel tables, which TorchRec runs in a DDP of its own, is checked too
DP_FP16_PLAN = (
    "--model",
    str(ROOT / "benchmarks/models/multihot_zipf.json"),
    "--plan-in",
    str(PLANS / "multihot_zipf_fp16_dp.plan.json"),
)


@pytest.mark.parametrize(
    "planner",
    [("--planner", "embark"), ("--planner", "embark", "--wire-precision", "fp16"), DP_FP16_PLAN, ("--planner", "trw")],
    ids=["embark", "embark-fp16", "embark-fp16-dp", "trw"],
)
def test_counted_inter_node_bytes_match_the_kernel(
    emulated: cluster.EmulatedCluster, overhead: dict[str, Any], tmp_path: Path, planner: tuple[str, ...]
) -> None:
    """Per step and node: (our counted inter-node bytes + DDP's all-reduce ring bytes) x TCP/IP overhead equals
    the bytes the kernel counted on the node's link, within TOLERANCE."""
    factor = overhead["alltoall_link_bytes"][0] / overhead["alltoall_payload_per_node"]
    runs = {}
    for steps in (SHORT, LONG):
        script = [str(TRAIN), *planner, "--steps", str(steps), "--warmup-steps", "1", "--log-every", "100"]
        runs[steps] = _run(emulated, [*script, "--eval-batches", "1"], tmp_path / str(steps), "RESULT")
    (short, short_link), (long, long_link) = runs[SHORT], runs[LONG]
    assert long["allreduce_bytes_per_step"] == short["allreduce_bytes_per_step"] > 0
    allreduce = _ring_bytes_per_node(long["allreduce_bytes_per_step"])
    for node in range(NODES):
        ranks = slice(node * RANKS, (node + 1) * RANKS)
        counted = (sum(long["inter_node_bytes_by_rank"][ranks]) - sum(short["inter_node_bytes_by_rank"][ranks])) / (
            LONG - SHORT
        )
        assert counted > 0
        expected = (counted + allreduce) * factor
        kernel = (long_link[node] - short_link[node]) / (LONG - SHORT)
        assert kernel == pytest.approx(expected, rel=TOLERANCE), (node, kernel, expected, counted)


# ---------------------------------------------------------------- the CLI leaves nothing behind


def _network_state() -> tuple[str, str]:
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=True).stdout
    return netns, "\n".join(sorted(line.split(":")[1] for line in links.splitlines()))


def _processes_running(script: Path) -> list[str]:
    """Command lines of the processes whose arguments name `script`."""
    found = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            args = cmdline.read_bytes().split(b"\0")
        except OSError:  # the process ended meanwhile
            continue
        if str(script).encode() in args:
            found.append(b" ".join(args).decode(errors="replace"))
    return found


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "embark_torchrec.cluster", "--nodes", str(NODES), "--gpus-per-node", "1",
            "--link-mbit", str(LINK_MBIT), *args]  # fmt: skip


def test_cli_runs_the_example_and_leaves_nothing(emulated: cluster.EmulatedCluster) -> None:
    """The unchanged example across 2 emulated nodes: rank 0's RESULT streamed, exit 0, no namespace or link left."""
    before = _network_state()
    proc = subprocess.run(
        _cli("--", str(TRAIN), "--steps", "3", "--warmup-steps", "1", "--eval-batches", "1"),
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads([x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][0][len("RESULT ") :])
    assert result["world_size"] == NODES and result["local_world_size"] == 1 and result["inter_node_bytes"] > 0
    assert _network_state() == before


def test_cli_failing_script_returns_its_code_and_leaves_nothing(
    emulated: cluster.EmulatedCluster, tmp_path: Path
) -> None:
    """A rank that fails on node 1 ends the run at once with the worst exit code, and everything is removed."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys, time\nif os.environ['RANK'] == '1':\n    sys.exit(3)\ntime.sleep(120)\n")
    before = _network_state()
    start = time.monotonic()
    proc = subprocess.run(_cli("--", str(script)), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and time.monotonic() - start < 60, proc.stderr[-3000:]
    assert "node 1's torchrun exited 3" in proc.stderr
    assert _network_state() == before


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)])
def test_cli_interrupted_leaves_nothing(
    emulated: cluster.EmulatedCluster, tmp_path: Path, sig: signal.Signals, code: int
) -> None:
    """Ctrl-C (SIGINT) or SIGTERM while the script runs: exit 128 + the signal (SIGTERM exited 130), no namespace,
    link or process left; also when the CLI starts with SIGINT ignored, as a shell's background job (and all it
    starts) does."""
    script = tmp_path / "sleep.py"
    script.write_text("import time\ntime.sleep(120)\n")
    before = _network_state()
    proc = subprocess.Popen(
        _cli("--", str(script)),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    deadline = time.monotonic() + 60
    while _network_state() == before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _network_state() != before, "the cluster never came up"
    time.sleep(3)  # the agents start
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == code, err
    assert _network_state() == before
    assert not _processes_running(script)


def test_refusals_name_the_fix(monkeypatch: pytest.MonkeyPatch) -> None:
    """Not root, or no ip/tc: a named refusal with the fix, before anything is made."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    with pytest.raises(cluster.ClusterError, match="needs root"):
        cluster.preflight()
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    monkeypatch.setattr(cluster.shutil, "which", lambda tool: None if tool == "tc" else "/usr/sbin/ip")
    with pytest.raises(cluster.ClusterError, match="needs tc .*install"):
        cluster.preflight()
    with pytest.raises(ValueError, match="--link-mbit"):
        cluster.ClusterSpec(nodes=2, gpus_per_node=1, link_mbit=0)


# ---------------------------------------------------------------- the CLI's edges, without namespaces


def _one_line_exit_2(capsys: pytest.CaptureFixture[str], argv: list[str], *words: str) -> None:
    with pytest.raises(SystemExit) as raised:
        cluster.main(argv)
    out, err = capsys.readouterr()
    assert raised.value.code == 2 and out == "", (raised.value.code, out, err)
    assert err.count("\n") == 1 and err.startswith("embark_torchrec.cluster: ") and "Traceback" not in err, err
    for word in words:
        assert word in err, err


def test_user_errors_are_one_line_exit_2_before_anything_is_made(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """--log-dir naming a file (a FileExistsError traceback before), a missing or bad flag, no script, not root: one
    line on stderr (no "output is kept in" line after it), exit 2, and no cluster made."""

    def made(*args: Any) -> None:
        raise AssertionError("made a cluster before refusing the arguments")

    monkeypatch.setattr(cluster.EmulatedCluster, "__enter__", made)
    a_file = tmp_path / "taken"
    a_file.write_text("")
    sizes = ["--nodes", "2", "--gpus-per-node", "1", "--link-mbit", "100"]
    _one_line_exit_2(capsys, [*sizes, "--log-dir", str(a_file), "--", "x.py"], "--log-dir", str(a_file), "not a folder")
    _one_line_exit_2(capsys, [*sizes, "--log-dir", str(a_file / "sub"), "--", "x.py"], "--log-dir", "cannot be made")
    _one_line_exit_2(capsys, ["--gpus-per-node", "1", "--link-mbit", "100", "--", "x.py"], "--nodes")
    _one_line_exit_2(capsys, ["--nodes", "two", "--gpus-per-node", "1", "--link-mbit", "1", "--", "x.py"], "--nodes")
    _one_line_exit_2(capsys, [*sizes[:4], "--link-mbit", "0", "--", "x.py"], "--link-mbit")
    _one_line_exit_2(capsys, sizes, "give the script")
    monkeypatch.undo()  # not root: refused by __enter__'s preflight, before anything is made
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert cluster.main([*sizes, "--", "x.py"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "needs root" in err, err


def test_a_signal_exits_128_plus_its_number(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """SIGTERM while the job runs: exit 143 (it was 130, as for Ctrl-C); SIGHUP 129; the cluster is left."""

    class Signalling:
        """Stands in for the namespaces: the job receives `sig` while it runs."""

        left = False

        def __init__(self, spec: cluster.ClusterSpec) -> None:
            self.prefix = "fake"

        def __enter__(self) -> "Signalling":
            return self

        def __exit__(self, *exc: Any) -> None:
            Signalling.left = True

        def run(self, script: list[str], **kwargs: Any) -> int:
            os.kill(os.getpid(), sig)
            time.sleep(10)
            return 0

    monkeypatch.setattr(cluster, "EmulatedCluster", Signalling)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    try:
        for sig, code in ((signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)):
            Signalling.left = False
            argv = ["--nodes", "1", "--gpus-per-node", "1", "--link-mbit", "1", "--log-dir", str(tmp_path), "--", "x"]
            assert cluster.main(argv) == code, sig
            assert Signalling.left
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)


def test_the_agent_exits_with_its_worst_ranks_code(tmp_path: Path) -> None:
    """torchrun exits 1 for any failed rank; the cluster's agent (torchrun's launcher) exits with the rank's own
    code, 3 here, so that the CLI can return the worst one."""
    script = tmp_path / "fail.py"
    script.write_text("import os, sys\nsys.exit(3 if os.environ['RANK'] == '1' else 0)\n")
    cmd = [sys.executable, "-m", "embark_torchrec.cluster_agent", "--standalone", "--nproc-per-node", "2", str(script)]
    env = checkout_env()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 3, proc.stderr[-3000:]
    assert "exitcode  : 3" in proc.stderr, proc.stderr[-3000:]
