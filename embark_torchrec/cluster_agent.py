"""One node's torchrun agent for embark_torchrec.cluster, exiting with its worst rank's exit code.

torchrun exits 1 whatever its failed ranks exited with (a rank's sys.exit(3), a SIGKILL), so the cluster CLI could
not return the job's worst code. This runs torchrun's own launcher (torch.distributed.run, same arguments) and exits
with the largest exit code among its failed ranks, a signal's death as the shell reports it (128 + signal).

    python -m embark_torchrec.cluster_agent [torchrun's arguments] SCRIPT [ARGS]
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from .cluster import exit_code


def main(argv: Sequence[str] | None = None) -> int:
    try:
        run(parse_args(list(argv) if argv is not None else sys.argv[1:]))
    except ChildFailedError as e:
        print(e.format_msg(), file=sys.stderr, flush=True)  # torchrun's own summary of the failed ranks
        return max(exit_code(f.exitcode) for f in e.failures.values()) or 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
