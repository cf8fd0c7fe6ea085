"""scripts/wheelhouse.py: the offline wheelhouse a GPU host without internet installs from.

The fast tests check the pieces (which stack a torch maps to, the platform tags, the stand-in torch, install.sh's
refusals); the slow one builds the CPU wheelhouse for this environment's torch from the index, makes a clean venv
that holds only that torch, installs the wheelhouse there with the network cut off (a network namespace of its own,
where the box allows one) and plans a model with the installed package."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.processes import ROOT, checkout_env

sys.path.insert(0, str(ROOT / "scripts"))

import wheelhouse  # noqa: E402


def test_each_tested_torch_maps_to_its_stack_and_an_untested_one_is_refused_by_name() -> None:
    """--torch picks the stack whose torch has the same major.minor, so 2.11 and 2.11.0 give torchrec 1.6.1."""
    assert wheelhouse.stack_for_torch("2.11")["torchrec"] == "1.6.1"
    assert wheelhouse.stack_for_torch("2.14.0")["fbgemm"] == "1.9.0"
    with pytest.raises(wheelhouse.WheelhouseError, match=r"--torch 2\.10.*tested torch: 2\.11\.0"):
        wheelhouse.stack_for_torch("2.10")


def test_another_cuda_than_pypis_needs_an_index_that_has_it(tmp_path: Path) -> None:
    """PyPI's fbgemm-gpu is one CUDA build: asking for CUDA 12 from PyPI is refused with the index to use, before
    anything is downloaded."""
    with pytest.raises(wheelhouse.WheelhouseError, match=r"CUDA 13.*download\.pytorch\.org/whl/cu12"):
        wheelhouse.build("2.11", "12", "3.12", tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_platform_tags_include_the_older_manylinux_tags_a_host_also_runs() -> None:
    """pip's --platform matches literally; a manylinux_2_28 host also runs manylinux_2_27 ... manylinux2014 wheels
    (nvidia's and numpy's carry such tags)."""
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_27_x86_64" in tags
    assert tags[-1] == "manylinux2014_x86_64" and "manylinux_2_29_x86_64" not in tags
    assert wheelhouse.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_stand_in_torch_is_a_wheel_of_that_version_without_dependencies(tmp_path: Path) -> None:
    """The stand-in resolves `torch>=...` requirements at the host's version and brings in none of torch's own."""
    path = wheelhouse.stub_torch_wheel(tmp_path, "2.11.0")
    meta = wheelhouse.wheel_metadata(path)
    assert meta == {"name": "torch", "version": f"2.11.0+{wheelhouse.STUB}", "requires": []}
    with zipfile.ZipFile(path) as z:
        assert sorted(n.rsplit("/", 1)[1] for n in z.namelist()) == ["METADATA", "RECORD", "WHEEL"]


def test_requirement_names_are_read_and_normalised() -> None:
    assert wheelhouse.requirement_name("fbgemm_gpu>=1.6") == "fbgemm-gpu"
    assert wheelhouse.requirement_name('typing_extensions>=4.0; python_version < "3.11"') == "typing-extensions"
    with pytest.raises(wheelhouse.WheelhouseError, match="'; bad'"):
        wheelhouse.requirement_name("; bad")


def _manifest() -> dict[str, object]:
    return {
        "torch": "2.11.0",
        "cuda": "13",
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        "platform": "manylinux_2_28_x86_64",
        "fbgemm": "fbgemm-gpu==1.6.0",
        "torchrec": "1.6.1",
        "embark_torchrec": "0.1.0",
        "wheels": [],
    }


def test_install_script_refuses_a_python_without_torch_or_of_another_version(tmp_path: Path) -> None:
    """install.sh names what is wrong with the python it was given, before pip runs."""
    script = tmp_path / "install.sh"
    script.write_text(wheelhouse.install_script(_manifest()))
    bare = tmp_path / "bare"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(bare)], check=True)
    proc = subprocess.run(
        ["bash", str(script), "--python", str(bare / "bin" / "python")], capture_output=True, text=True
    )
    assert proc.returncode != 0 and "has no torch; install torch 2.11 first" in proc.stderr, proc.stderr
    other = dict(_manifest(), python="3.99")
    script.write_text(wheelhouse.install_script(other))
    proc = subprocess.run(["bash", str(script), "--python", sys.executable], capture_output=True, text=True)
    assert proc.returncode != 0 and "this wheelhouse is for Python 3.99" in proc.stderr, proc.stderr
    proc = subprocess.run(["bash", str(script), "--bogus"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown argument '--bogus'" in proc.stderr


def _no_network_prefix() -> list[str]:
    """`unshare -n`, a network namespace with no interfaces, where this box may make one; else nothing (the install
    is offline by --no-index and no pip configuration)."""
    unshare = shutil.which("unshare")
    if unshare and subprocess.run([unshare, "-n", "true"], capture_output=True).returncode == 0:
        return [unshare, "-n"]
    return []


@pytest.mark.slow
def test_offline_install_into_a_venv_with_only_torch(tmp_path: Path) -> None:
    """The CPU wheelhouse for this environment's torch and Python installs with no network into a clean venv that
    has only that torch, and the installed package imports and plans."""
    import torch

    torch_version = torch.__version__.split("+")[0]
    python = f"{sys.version_info[0]}.{sys.version_info[1]}"
    out = tmp_path / "wheelhouse"
    try:
        manifest = wheelhouse.build(torch_version, "cpu", python, out)
    except wheelhouse.WheelhouseError as e:
        if "Could not" in str(e) or "connection" in str(e).lower():
            pytest.skip(f"no package index reachable: {str(e)[:200]}")
        raise
    host = tmp_path / "host"
    subprocess.run([sys.executable, "-m", "venv", str(host)], check=True)
    py = str(host / "bin" / "python")
    # the host's torch, installed as a user would (pip's own configuration: a local wheel of it where there is one)
    subprocess.run([py, "-m", "pip", "install", "--quiet", f"torch=={torch_version}"], check=True)
    before = {d.name for d in (host / "lib").glob("python*/site-packages/*.dist-info")}
    proc = subprocess.run(
        [*_no_network_prefix(), "bash", str(out / "install.sh"), "--python", py],
        capture_output=True,
        text=True,
        env={k: v for k, v in os.environ.items() if not k.startswith("PIP_")},
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert f"torchrec {manifest['torchrec']}" in proc.stdout and "embark_torchrec from" in proc.stdout
    assert str(host) in proc.stdout.split("embark_torchrec from", 1)[1]  # the installed copy, not this checkout
    after = {d.name for d in (host / "lib").glob("python*/site-packages/*.dist-info")}
    assert not any(name.startswith(("torch-", "nvidia")) for name in after - before)  # torch's own stay as they were
    plan = subprocess.run(
        [py, "-m", "embark_torchrec.plan", "dcnv2", "--world-size", "4", "--local-world-size", "2", "--json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
    )
    assert plan.returncode == 0, plan.stderr[-2000:]
    assert json.loads(plan.stdout)["world_size"] == 4


def test_gpu_check_offline_joins_the_parts_installs_and_checks(tmp_path: Path) -> None:
    """scripts/gpu_check_offline.sh (docs/gpu-check.md) joins a wheelhouse cut into parts, runs its install.sh with the
    python it is given and then the GPU check, whose summary lands in $OUT; here the wheelhouse is a stand-in whose
    install.sh records its arguments, and the check is the dry run's lookup part."""
    house = tmp_path / "house" / "torch2.11-cu13-py3.12"
    house.mkdir(parents=True)
    record = tmp_path / "install-args"
    (house / "install.sh").write_text(f'echo "$@" > {record}\n')
    (house / "padding.bin").write_bytes(os.urandom(5000))  # several parts
    parts = tmp_path / "parts"
    parts.mkdir()
    subprocess.run(f"tar -C {house.parent} -cf - {house.name} | split -b 2k - {parts}/wh.tar.", shell=True, check=True)
    assert len(list(parts.iterdir())) > 3
    env = checkout_env(PYTHON=sys.executable, OUT=str(tmp_path))
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "gpu_check_offline.sh"), str(parts), "--dry-run-cpu", "--parts", "d"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert record.read_text().split() == ["--python", sys.executable]
    rows = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [r["check"] for r in rows] == ["d/lookups:exact_sgd", "d/lookups:exact_rowwise_adagrad"]
    assert all(r["status"] == "pass" for r in rows)
