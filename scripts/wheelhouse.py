"""Builds an offline wheelhouse: every wheel embark-torchrec needs beside a given torch, for one platform.

    python3 scripts/wheelhouse.py --torch 2.11 --cuda 13 --python 3.12          # (make wheelhouse TORCH=2.11 ...)
    python3 scripts/wheelhouse.py --torch 2.11 --cuda cpu --python 3.12         # fbgemm-gpu-cpu instead

Run it on a machine that reaches the package index.  The folder it writes (default
wheelhouse/torch2.11-cu13-py3.12) holds our wheel, the torchrec and fbgemm-gpu releases built for that torch
(pyproject.toml's [tool.embark-torchrec.stacks]), their pure-Python dependencies and none of torch's own, plus
install.sh, which installs exactly those wheels with `pip install --no-index --find-links` into a Python
environment that already has that torch (or into a --target folder), then checks the imports.  Copy the folder to
the host and run `bash install.sh --python /path/to/python`.

How torch is left out: the dependencies are resolved by pip for the target platform against a stand-in torch wheel
of the same version that declares no dependencies, so what torch alone needs (the CUDA libraries, triton, sympy ...)
stays out, while what our stack needs besides torch comes in, whatever the host's torch brought.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYPI = "https://pypi.org/simple"
STUB = "embarkstub"  # the local version label of the stand-in torch wheel
MIN_GLIBC = 17  # the oldest manylinux_2_x tag accepted besides the one asked for (manylinux2014 = manylinux_2_17)


class WheelhouseError(RuntimeError):
    """A request this script cannot turn into a wheelhouse (an untested torch, a CUDA PyPI has no build for)."""


def stacks(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, dict[str, str]]:
    """The tested TorchRec stacks by TorchRec release, as pyproject.toml lists them."""
    with pyproject.open("rb") as f:
        return tomllib.load(f)["tool"]["embark-torchrec"]["stacks"]


def stack_for_torch(torch: str) -> dict[str, str]:
    """The tested stack whose torch has the same major.minor as `torch` ("2.11" or "2.11.0")."""
    minor = ".".join(torch.split(".")[:2])
    for stack in stacks().values():
        if stack["torch"].startswith(minor + "."):
            return stack
    known = ", ".join(sorted(s["torch"] for s in stacks().values()))
    raise WheelhouseError(f"--torch {torch}: no tested TorchRec stack is built for it (tested torch: {known})")


def platform_tags(platform: str) -> list[str]:
    """`platform` and the older manylinux tags a host that runs it also runs (pip takes --platform literally)."""
    match = re.fullmatch(r"manylinux_2_(\d+)_(\w+)", platform)
    if match is None:
        return [platform]
    glibc, arch = int(match.group(1)), match.group(2)
    return [f"manylinux_2_{v}_{arch}" for v in range(glibc, MIN_GLIBC - 1, -1)] + [f"manylinux2014_{arch}"]


def stub_torch_wheel(folder: Path, version: str) -> Path:
    """A wheel named torch at `version`+embarkstub that declares no dependencies and installs nothing."""
    name = f"torch-{version}+{STUB}"
    dist_info = f"{name}.dist-info"
    files = {
        f"{dist_info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {version}+{STUB}\n",
        f"{dist_info}/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: embark-wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }

    def record_line(path: str, data: bytes) -> str:
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        return f"{path},sha256={digest},{len(data)}"

    record = "\n".join(record_line(p, t.encode()) for p, t in files.items()) + f"\n{dist_info}/RECORD,,\n"
    path = folder / f"{name}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for p, text in files.items():
            z.writestr(p, text)
        z.writestr(f"{dist_info}/RECORD", record)
    return path


def wheel_metadata(path: Path) -> dict[str, object]:
    """A wheel's name, version and Requires-Dist, read off its METADATA."""
    with zipfile.ZipFile(path) as z:
        (member,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1]
        message = Parser().parsestr(z.read(member).decode())
    return {"name": message["Name"], "version": message["Version"], "requires": message.get_all("Requires-Dist") or []}


def requirement_name(requirement: str) -> str:
    """The normalised project name a requirement string starts with."""
    match = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", requirement)
    if match is None:
        raise WheelhouseError(f"cannot read a project name in the requirement {requirement!r}")
    return re.sub(r"[-_.]+", "-", match.group(1)).lower()


def _pip(args: list[str], cwd: Path = ROOT) -> None:
    """pip of this interpreter with no configuration file (so a machine's own find-links or indexes play no part)."""
    env = {**os.environ, "PIP_CONFIG_FILE": os.devnull, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    proc = subprocess.run([sys.executable, "-m", "pip", *args], cwd=cwd, env=env, text=True, capture_output=True)
    if proc.returncode:
        raise WheelhouseError(f"pip {' '.join(args[:2])} failed:\n{(proc.stdout + proc.stderr)[-3000:]}")


def build(
    torch: str, cuda: str, python: str, out: Path, platform: str = "manylinux_2_28_x86_64", index_url: str = PYPI
) -> dict[str, object]:
    """Downloads the wheelhouse into `out` and writes install.sh and wheelhouse.json there; returns the manifest."""
    stack = stack_for_torch(torch)
    if cuda != "cpu" and cuda != stack["pypi_cuda"] and index_url == PYPI:
        raise WheelhouseError(
            f"--cuda {cuda}: PyPI's fbgemm-gpu {stack['fbgemm']} is built for CUDA {stack['pypi_cuda']}; for another "
            f"CUDA pass the PyTorch index that has it, e.g. --index-url https://download.pytorch.org/whl/cu{cuda}"
        )
    if not re.fullmatch(r"3\.\d+", python):
        raise WheelhouseError(f"--python {python}: expected <major>.<minor>, e.g. 3.12")
    fbgemm = "fbgemm-gpu-cpu" if cuda == "cpu" else "fbgemm-gpu"
    out.mkdir(parents=True, exist_ok=True)
    stale = sorted(p.name for p in out.glob("*.whl"))
    if stale:
        raise WheelhouseError(f"{out} already holds wheels ({', '.join(stale[:3])} ...): give an empty or new folder")
    target = ["--python-version", python, "--implementation", "cp", "--abi", "cp" + python.replace(".", "")]
    target += [arg for tag in platform_tags(platform) for arg in ("--platform", tag)]
    with tempfile.TemporaryDirectory() as tmp:
        scratch = Path(tmp)
        _pip(["wheel", "--no-deps", "--quiet", "--wheel-dir", str(out), str(ROOT)])
        _pip(["download", "--no-deps", "--quiet", "--only-binary=:all:", "--index-url", index_url, "--dest", str(out)]
             + target + [f"torchrec=={stack['torchrec']}"])  # fmt: skip
        ours = wheel_metadata(next(out.glob("embark_torchrec-*.whl")))
        torchrec = wheel_metadata(next(out.glob("torchrec-*.whl")))
        skip = {"torch", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu"}
        needs = [r for r in [*ours["requires"], *torchrec["requires"]] if requirement_name(r) not in skip]  # type: ignore[misc]
        stub = stub_torch_wheel(scratch, stack["torch"])
        (scratch / "constraints.txt").write_text(f"torch=={stack['torch']}+{STUB}\n")
        _pip(
            ["download", "--quiet", "--only-binary=:all:", "--index-url", index_url, "--find-links", str(scratch)]
            + ["--constraint", str(scratch / "constraints.txt"), "--dest", str(out)]
            + target
            + [f"{fbgemm}=={stack['fbgemm']}", *needs]
        )
    (out / stub.name).unlink()
    wheels = sorted(p.name for p in out.glob("*.whl"))
    manifest = {
        "torch": stack["torch"],
        "cuda": cuda,
        "python": python,
        "platform": platform,
        "fbgemm": f"{fbgemm}=={stack['fbgemm']}",
        "torchrec": stack["torchrec"],
        "embark_torchrec": ours["version"],
        "wheels": wheels,
    }
    (out / "wheelhouse.json").write_text(json.dumps(manifest, indent=1) + "\n")
    (out / "install.sh").write_text(install_script(manifest))
    (out / "install.sh").chmod(0o755)
    return manifest


def install_script(manifest: dict[str, object]) -> str:
    """install.sh: the offline install of exactly the wheelhouse's wheels beside the host's torch, then the imports."""
    torch_minor = ".".join(str(manifest["torch"]).split(".")[:2])
    driver = "" if manifest["cuda"] == "cpu" else " (the CUDA build needs the host's NVIDIA driver)"
    return f"""#!/usr/bin/env bash
# Installs this wheelhouse with no network: bash install.sh [--python PYTHON] [--target DIR]
# Made by scripts/wheelhouse.py for torch {manifest["torch"]} (CUDA {manifest["cuda"]}), Python {manifest["python"]},
# {manifest["platform"]}: {manifest["fbgemm"]}, torchrec {manifest["torchrec"]},
# embark-torchrec {manifest["embark_torchrec"]}.
# The python named must already have torch {torch_minor}; --target installs into a folder (put it on PYTHONPATH).
set -euo pipefail
here=$(cd "$(dirname "${{BASH_SOURCE[0]}}")" && pwd)
python=python3
target=""
while [ $# -gt 0 ]; do
    case "$1" in
        --python) python=${{2:?--python needs a value}}; shift 2 ;;
        --target) target=${{2:?--target needs a value}}; shift 2 ;;
        -h|--help) sed -n '2,6p' "$0"; exit 0 ;;
        *) echo "install.sh: unknown argument '$1' (expected --python PYTHON or --target DIR)" >&2; exit 2 ;;
    esac
done
"$python" - <<'EOF'
import sys
want_python, want_torch = "{manifest["python"]}", "{torch_minor}"
have_python = "%d.%d" % sys.version_info[:2]
if have_python != want_python:
    sys.exit(f"install.sh: {{sys.executable}} is Python {{have_python}}; this wheelhouse is for Python {{want_python}}")
try:
    import torch
except ImportError:
    sys.exit(f"install.sh: {{sys.executable}} has no torch; install torch {{want_torch}} first (this goes beside it)")
if not torch.__version__.startswith(want_torch + "."):
    sys.exit(f"install.sh: {{sys.executable}} has torch {{torch.__version__}}; this wheelhouse is for {{want_torch}}")
EOF
args=(--no-index --find-links "$here" --no-deps)
if [ -n "$target" ]; then
    args+=(--target "$target")
fi
PIP_CONFIG_FILE=/dev/null "$python" -m pip install --disable-pip-version-check "${{args[@]}}" "$here"/*.whl
if [ -n "$target" ]; then
    export PYTHONPATH="$target${{PYTHONPATH:+:$PYTHONPATH}}"
fi
cd "$here"  # not where a checkout of embark-torchrec may lie, so the import finds the installed copy
"$python" - <<'EOF'
import sys
import torch
try:
    import fbgemm_gpu
except OSError as e:
    sys.exit(f"install.sh: the wheels are installed, but fbgemm_gpu does not load{driver}: {{e.__cause__ or e}}")
import torchrec
import embark_torchrec
import embark_torchrec.plan

print("installed: torch", torch.__version__, f"(cuda {{torch.version.cuda}})", "fbgemm_gpu", fbgemm_gpu.__version__,
      "torchrec", torchrec.__version__, "embark_torchrec from", embark_torchrec.__file__)
EOF
"""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--torch", required=True, help="the host's torch release, e.g. 2.11 (a tested stack's)")
    p.add_argument("--cuda", required=True, help="the host's CUDA major (13), or cpu for fbgemm-gpu-cpu")
    p.add_argument("--python", required=True, help="the host's Python, e.g. 3.12")
    p.add_argument("--platform", default="manylinux_2_28_x86_64", help="the host's wheel platform tag")
    p.add_argument("--index-url", default=PYPI, help="the package index to download from")
    p.add_argument("--out", type=Path, help="the folder to write (default wheelhouse/torch<T>-cu<C>-py<P>)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    cuda = args.cuda if args.cuda == "cpu" else args.cuda.removeprefix("cu")
    out = (
        args.out or ROOT / "wheelhouse" / f"torch{args.torch}-{'cpu' if cuda == 'cpu' else 'cu' + cuda}-py{args.python}"
    )
    try:
        manifest = build(args.torch, cuda, args.python, out, args.platform, args.index_url)
    except WheelhouseError as e:
        print(f"wheelhouse: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in out.glob("*.whl")) / 1e6
    print(f"wheelhouse: {len(manifest['wheels'])} wheels, {size:.0f} MB, in {out}")  # type: ignore[arg-type]
    print(f"on the host: bash {out}/install.sh --python /path/to/python{manifest['python']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
