"""python -m embark_torchrec.cluster: try your plan on a model of your cluster, on one Linux box.

    python -m embark_torchrec.cluster --nodes 2 --gpus-per-node 2 --link-mbit 100 -- examples/dlrm/train.py [args]
    python -m embark_torchrec.cluster --nodes 2 --gpus-per-node 2 --link-mbit 50 -- -m embark_torchrec.calibrate

Each emulated node is a network namespace whose ranks reach each other over the namespace's own loopback
(fast; `--link-mbit-intra` shapes it too), while nodes reach each other only through one veth link each to a
bridge in a hub namespace, shaped by a token bucket (`tc ... tbf`) at `--link-mbit` in each direction (both
ends of the veth: node -> hub and hub -> node), whose queue is deep enough that no packet is dropped: the fabrics
it models (InfiniBand, NVLink) are lossless, and a dropped segment at a message's tail would stall TCP for its
200 ms retransmission timeout. One torchrun agent per node joins a static rendezvous on node
0's address, with GLOO_SOCKET_IFNAME (and NCCL's and TensorPipe's) set to the node's veth, so a script runs
unchanged as it would on N machines. It streams node 0's output (rank 0's lines; other ranks of node 0 print
only on error, as the examples do), keeps the other nodes' output in log files (their tail is printed when
they fail), returns the worst exit code of any rank (each agent exits with its ranks' worst: cluster_agent.py; 124
on --timeout-s; 128 + the signal that stopped it: 130 on Ctrl-C, 143 on SIGTERM) and always removes what it made: on
success, error, timeout, SIGTERM or Ctrl-C. A user error (a flag, --log-dir naming a file, not root) is one line on
stderr and exit 2.

Everything it makes carries a per-run prefix (`ebk` + 6 hex digits): namespaces `<prefix>-hub`,
`<prefix>-n<i>`; links `<prefix>n<i>` (node end) and `<prefix>h<i>` (hub end), bridge `<prefix>br`. Links are
created directly inside its own namespaces and addresses (one /24, `SUBNET`) exist only there, so nothing of
the host's network is touched. Needs root (namespaces), `ip` and `tc` (iproute2) and the `tbf` qdisc.

The kernel counts every byte that crosses a node's link (`EmulatedCluster.link_bytes`), an independent check of
the bytes our counters report (tests/test_cluster_bytes.py).
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from types import FrameType, TracebackType
from typing import NoReturn

SUBNET = "10.213.0"  # node i is SUBNET.(i + 1)/24, inside this run's namespaces only
MASTER_PORT = 29500
QUEUE_BYTES = 64 * 1024 * 1024  # tbf queue: TCP's small queues keep each socket's share far below this
BURST_S = 0.01  # tbf bucket: 10 ms of the rate (at least MIN_BURST_BYTES), so that short messages see the rate too
MIN_BURST_BYTES = 32 * 1024  # above one GSO-less packet; tbf splits larger GSO packets itself
LOOPBACK_MIN_BURST_BYTES = 128 * 1024  # the loopback's 64 KiB MTU must fit the bucket
TERM_GRACE_S = 10.0  # SIGTERM to SIGKILL when stopping the agents
IFNAME_ENV = "EMBARK_CLUSTER_IFNAME"  # set for every rank: its node's veth (where the kernel counts inter-node bytes)
TIMEOUT_EXIT = 124


class ClusterError(RuntimeError):
    """The emulated cluster cannot be made here (not root, a tool or kernel feature missing, a command failed)."""


@dataclass(frozen=True, kw_only=True)
class ClusterSpec:
    """An emulated cluster: `nodes` namespaces of `gpus_per_node` ranks; each node's link to the others carries
    `link_mbit` Mbit/s per direction; the ranks inside a node share `link_mbit_intra` (None: unshaped)."""

    nodes: int
    gpus_per_node: int
    link_mbit: float
    link_mbit_intra: float | None = None

    def __post_init__(self) -> None:
        if self.nodes < 1 or self.nodes > 250:
            raise ValueError(f"--nodes must be 1..250, got {self.nodes}")
        if self.gpus_per_node < 1:
            raise ValueError(f"--gpus-per-node must be >= 1, got {self.gpus_per_node}")
        for name, rate in (("--link-mbit", self.link_mbit), ("--link-mbit-intra", self.link_mbit_intra)):
            if rate is not None and not (0.01 <= rate <= 1_000_000):
                raise ValueError(f"{name} must be a rate in Mbit/s between 0.01 and 1e6, got {rate}")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node


def _burst_bytes(mbit: float, floor: int) -> int:
    return max(floor, int(mbit * 1e6 / 8 * BURST_S))


def preflight() -> None:
    """Refuse, naming the fix, where namespaces and shaped links cannot be made."""
    if os.geteuid() != 0:
        raise ClusterError(
            "embark_torchrec.cluster makes network namespaces, which needs root: run it as root "
            "(e.g. sudo -E env PATH=$PATH python -m embark_torchrec.cluster ...)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise ClusterError(
            f"embark_torchrec.cluster needs {' and '.join(missing)} (iproute2) on PATH: "
            "install it (apt-get install iproute2, dnf install iproute-tc)"
        )


def _run(argv: Sequence[str]) -> str:
    proc = subprocess.run(list(argv), capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise ClusterError(f"`{' '.join(argv)}` failed (exit {proc.returncode}): {proc.stderr.strip()}")
    return proc.stdout


class EmulatedCluster:
    """The namespaces and links of one ClusterSpec, made on entering and removed on leaving (a context manager).
    Only names with this run's prefix are ever created or deleted."""

    def __init__(self, spec: ClusterSpec, prefix: str | None = None) -> None:
        self.spec = spec
        self.prefix = prefix or f"ebk{secrets.token_hex(3)}"
        self._made: list[str] = []  # namespaces this object created, in creation order

    # names and addresses
    @property
    def hub(self) -> str:
        return f"{self.prefix}-hub"

    def namespace(self, node: int) -> str:
        return f"{self.prefix}-n{node}"

    def ifname(self, node: int) -> str:
        """The node's end of its link: what it sends across nodes leaves here."""
        return f"{self.prefix}n{node}"

    def address(self, node: int) -> str:
        return f"{SUBNET}.{node + 1}"

    # life cycle
    def __enter__(self) -> "EmulatedCluster":
        preflight()
        taken = set(_run(["ip", "netns", "list"]).split())
        names = [self.hub, *(self.namespace(i) for i in range(self.spec.nodes))]
        if taken & set(names):
            raise ClusterError(f"namespaces {sorted(taken & set(names))} exist already; choose another prefix")
        try:
            self._build(names)
        except BaseException:
            self.teardown()
            raise
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self.teardown()

    def _build(self, names: list[str]) -> None:
        for ns in names:
            _run(["ip", "netns", "add", ns])
            self._made.append(ns)
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
        bridge = f"{self.prefix}br"
        _run(["ip", "-n", self.hub, "link", "add", bridge, "type", "bridge"])
        _run(["ip", "-n", self.hub, "link", "set", bridge, "up"])
        rate = self.spec.link_mbit
        for i in range(self.spec.nodes):
            ns, node_end, hub_end = self.namespace(i), self.ifname(i), f"{self.prefix}h{i}"
            _run(["ip", "link", "add", "name", node_end, "netns", ns, "type", "veth", "peer", "name", hub_end,
                  "netns", self.hub])  # fmt: skip
            _run(["ip", "-n", self.hub, "link", "set", hub_end, "master", bridge])
            _run(["ip", "-n", ns, "addr", "add", f"{self.address(i)}/24", "dev", node_end])
            for where, dev in ((ns, node_end), (self.hub, hub_end)):
                _run(["ip", "-n", where, "link", "set", dev, "up"])
                self._shape(where, dev, rate, MIN_BURST_BYTES)
            if self.spec.link_mbit_intra is not None:
                self._shape(ns, "lo", self.spec.link_mbit_intra, LOOPBACK_MIN_BURST_BYTES)

    @staticmethod
    def _shape(ns: str, dev: str, mbit: float, floor: int) -> None:
        burst = _burst_bytes(mbit, floor)
        try:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", f"{mbit * 1000:.0f}kbit",
                  "burst", str(burst), "limit", str(QUEUE_BYTES)])  # fmt: skip
        except ClusterError as e:
            raise ClusterError(f"shaping {dev} with tc's tbf failed (is the sch_tbf kernel module available?): {e}")

    def teardown(self) -> None:
        """Kill whatever still runs in this run's namespaces, then delete them (their links go with them); a
        second Ctrl-C or SIGTERM meanwhile waits until they are gone."""
        with _signals_deferred():
            self._remove()

    def _remove(self) -> None:
        for ns in reversed(self._made):
            pids = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True, check=False).stdout
            for pid in pids.split():
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        for ns in reversed(self._made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, check=False)
        self._made.clear()

    # what crosses the links
    def link_bytes(self, node: int) -> tuple[int, int]:
        """(sent, received) bytes the kernel counted on the node's link so far: headers included."""
        stats = Path("/sys/class/net") / self.ifname(node) / "statistics"
        counters = [str(stats / "tx_bytes"), str(stats / "rx_bytes")]
        out = _run(["ip", "netns", "exec", self.namespace(node), "cat", *counters])
        tx, rx = out.split()
        return int(tx), int(rx)

    # running a job
    def torchrun(self, node: int, script: Sequence[str], torchrun_args: Sequence[str] = ()) -> list[str]:
        """The command that starts node `node`'s torchrun agent inside its namespace."""
        module = ["--module", *script[1:]] if script and script[0] == "-m" else list(script)
        return [
            "ip", "netns", "exec", self.namespace(node),
            sys.executable, "-m", "embark_torchrec.cluster_agent",  # torchrun, exiting with its worst rank's code
            "--nnodes", str(self.spec.nodes), "--node-rank", str(node),
            "--nproc-per-node", str(self.spec.gpus_per_node),
            "--master-addr", self.address(0), "--master-port", str(MASTER_PORT), *torchrun_args, *module,
        ]  # fmt: skip

    def environment(self, node: int) -> dict[str, str]:
        """The ranks' environment: the node's link for every transport, so that cross-node traffic takes it."""
        env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE")}
        dev = self.ifname(node)
        env.update(GLOO_SOCKET_IFNAME=dev, NCCL_SOCKET_IFNAME=dev, TP_SOCKET_IFNAME=dev)
        env[IFNAME_ENV] = dev
        return env

    def run(
        self,
        script: Sequence[str],
        *,
        timeout_s: float | None = None,
        log_dir: Path,
        stdout: int | None = None,
    ) -> int:
        """Run `script` (a path and its arguments, or -m module ...) on every node, one torchrun agent each; node
        0's output goes to `stdout` (None: ours), node i's to log_dir/node<i>.log. The worst exit code (124 on
        timeout); the first node to fail ends the run, and the agents are stopped however this returns."""
        log_dir.mkdir(parents=True, exist_ok=True)
        agents: list[subprocess.Popen[bytes]] = []
        logs = []
        try:
            for node in range(self.spec.nodes):
                if node == 0:
                    out = stdout
                else:
                    logs.append(open(log_dir / f"node{node}.log", "wb"))
                    out = logs[-1].fileno()
                agents.append(
                    subprocess.Popen(
                        self.torchrun(node, script),
                        env=self.environment(node),
                        stdout=out,
                        stderr=subprocess.STDOUT if node else None,
                        start_new_session=True,  # our signals reach them through _stop, not the terminal
                    )
                )
            return self._wait(agents, timeout_s, log_dir)
        finally:
            _stop(agents)
            for f in logs:
                f.close()

    def _wait(self, agents: list[subprocess.Popen[bytes]], timeout_s: float | None, log_dir: Path) -> int:
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        codes: dict[int, int] = {}
        while len(codes) < len(agents):
            for node, agent in enumerate(agents):
                if node not in codes and agent.poll() is not None:
                    codes[node] = exit_code(agent.returncode)
                    if codes[node] != 0:  # the other nodes' agents would wait out torchrun's exit barrier
                        self._report(node, codes[node], log_dir)
                        return max(codes.values())
            if deadline is not None and time.monotonic() > deadline:
                print(f"embark_torchrec.cluster: timed out after {timeout_s:g} s; stopping every node", file=sys.stderr)
                return TIMEOUT_EXIT
            time.sleep(0.2)
        return max(codes.values())

    def _report(self, node: int, code: int, log_dir: Path) -> None:
        where = "" if node == 0 else f"; its output: {log_dir / f'node{node}.log'}"
        print(f"embark_torchrec.cluster: node {node}'s torchrun exited {code}{where}", file=sys.stderr)
        if node:
            tail = (log_dir / f"node{node}.log").read_text(errors="replace").splitlines()[-30:]
            print("\n".join(f"[node {node}] {line}" for line in tail), file=sys.stderr)


def exit_code(returncode: int) -> int:
    """A signal's death as the shell reports it (128 + signal), so that the worst code is the largest."""
    return 128 - returncode if returncode < 0 else returncode


def _stop(agents: Sequence[subprocess.Popen[bytes]]) -> None:
    """SIGTERM each running agent's process group (torchrun stops its workers), SIGKILL after a grace period."""
    running = [a for a in agents if a.poll() is None]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for agent in running:
            try:
                os.killpg(agent.pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + TERM_GRACE_S
        while running and time.monotonic() < deadline:
            running = [a for a in running if a.poll() is None]
            time.sleep(0.1)
        if not running:
            return


@contextmanager
def _signals_deferred() -> Iterator[None]:
    """Ctrl-C and SIGTERM held off (main thread only, where Python delivers them) while the body runs."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    held = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, signal.SIG_IGN) for sig in held}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Signalled(KeyboardInterrupt):
    """A signal that stops the CLI as Ctrl-C does; it exits as the shell reports a death by it (128 + signal)."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"signal {signal.Signals(signum).name}")
        self.signum = signum


def _raise_on_signal(signum: int, frame: FrameType | None) -> None:
    raise _Signalled(signum)


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line (no usage dump), exit 2, as every other user error of the CLI."""

    def error(self, message: str) -> NoReturn:
        _user_error(message)


def _user_error(message: str) -> NoReturn:
    print(f"embark_torchrec.cluster: {message}", file=sys.stderr)
    sys.exit(2)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = _Parser(
        prog="python -m embark_torchrec.cluster",
        description=__doc__.split("\n\n")[0],
        usage="%(prog)s --nodes N --gpus-per-node G --link-mbit R [options] -- SCRIPT [ARGS] | -m MODULE [ARGS]",
    )
    p.add_argument("--nodes", type=int, required=True, help="emulated nodes (network namespaces)")
    p.add_argument("--gpus-per-node", type=int, required=True, help="ranks per node (torchrun's --nproc-per-node)")
    p.add_argument("--link-mbit", type=float, required=True, help="each node's link, Mbit/s per direction")
    p.add_argument(
        "--link-mbit-intra",
        type=float,
        help="Mbit/s of a node's loopback, shared by all traffic between its ranks (default: unshaped)",
    )
    p.add_argument("--timeout-s", type=float, help="stop every node after this many seconds (exit 124)")
    p.add_argument("--log-dir", type=Path, help="keep every node's output here (default: a temporary directory)")
    p.add_argument("script", nargs=argparse.REMAINDER, help="after --: the script and its arguments, or -m MODULE")
    args = p.parse_args(argv)
    args.script = args.script[1:] if args.script[:1] == ["--"] else args.script
    if not args.script or args.script == ["-m"]:
        p.error("give the script to run after --, e.g. -- examples/dlrm/train.py, or -- -m embark_torchrec.calibrate")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        spec = ClusterSpec(
            nodes=args.nodes, gpus_per_node=args.gpus_per_node, link_mbit=args.link_mbit,
            link_mbit_intra=args.link_mbit_intra,
        )  # fmt: skip
    except ValueError as e:
        _user_error(str(e))
    if args.log_dir is not None and (args.log_dir.exists() or args.log_dir.is_symlink()) and not args.log_dir.is_dir():
        _user_error(f"--log-dir {args.log_dir}: is not a folder")
    try:
        if args.log_dir is not None:
            args.log_dir.mkdir(parents=True, exist_ok=True)
        log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="embark_cluster_"))
    except OSError as e:
        _user_error(f"--log-dir {args.log_dir or tempfile.gettempdir()}: cannot be made: {e.strerror or e}")
    # SIGINT too: a shell's background job (and what it starts) inherits SIGINT ignored, and Python then keeps it so
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, _raise_on_signal)
    keep = args.log_dir is not None
    code = 1
    try:
        with EmulatedCluster(spec) as cluster:
            intra = "unshaped" if spec.link_mbit_intra is None else f"{spec.link_mbit_intra:g} Mbit/s"
            print(
                f"embark_torchrec.cluster: {spec.nodes} nodes x {spec.gpus_per_node} ranks ({cluster.prefix}-*), "
                f"{spec.link_mbit:g} Mbit/s per node link and direction, intra-node {intra}",
                file=sys.stderr,
                flush=True,
            )
            code = cluster.run(args.script, timeout_s=args.timeout_s, log_dir=log_dir)
    except ClusterError as e:
        print(f"embark_torchrec.cluster: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt as e:
        print(f"embark_torchrec.cluster: interrupted ({str(e) or 'Ctrl-C'}); stopped every node", file=sys.stderr)
        code = 128 + (e.signum if isinstance(e, _Signalled) else signal.SIGINT)
    finally:
        if not keep and (code == 0 or not any(log_dir.iterdir())):  # nothing to keep: a clean run, or none ran
            shutil.rmtree(log_dir, ignore_errors=True)
        elif not keep:
            print(f"embark_torchrec.cluster: the nodes' output is kept in {log_dir}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
