"""The wheels the GPU image lacks, for Python 3.12 on manylinux x86-64: download them, then check them.

    python bench/gpu_wheels.py [--dest .whl] [--check-only]

(``make gpu-wheels``.) The GPU machines have no package index. What hypertron needs there beyond
the image's packages (``bench/gpu_image.txt``) is downloaded here, with everything those need
that the image lacks, into ``--dest`` (ignored by git; the device call carries it and installs
it with ``--no-deps``). Then three checks, each printed, any failure an exit status of 1:

1. the set is within 64 MiB (what one device call may carry, the checkout included);
2. ``pip install --dry-run --no-index --no-deps`` accepts every wheel for CPython 3.12 on
   manylinux x86-64 (tags, one version per project);
3. every requirement of every wheel, and of hypertron itself (runtime, less ``NOT_CARRIED``, and
   ``openai``), for Python 3.12 on Linux without extras, is met by a wheel in the set or by the
   image (with the version, where the image list records one).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import tomllib
import zipfile
from email.parser import Parser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

REPO = Path(__file__).resolve().parent.parent
# hypertron's runtime needs the image lacks, and the server tests' client; pinned to what was checked.
WANTED = ("grain==0.2.18", "array-record==0.8.6", "fastapi==0.165.0", "starlette==1.10.0",
          "pydantic==2.14.3", "pydantic-core==2.50.4", "uvicorn==0.54.0", "openai==3.54.0",
          # the t3.diffuse rows' reference (bench/diffuse_gpu.py); diffusers needs importlib_metadata
          "diffusers==0.42.1", "importlib-metadata==10.2.0")
# hypertron's runtime needs the campaign never uses, left out of the set (the T0 import of every module does not
# import them).
NOT_CARRIED = {
    "plotly": "the dashboard page's script (hypertron monitor --serve); the campaign serves no page",
    "kubernetes": "hypertron workload / cluster talk to a cluster; the campaign runs on one machine",
    "kubernetes-validate": "validates what hypertron workload renders; not used on the GPU machine",
    "kubeflow-trainer-api": "the JobSet models hypertron workload validates with; not used on the GPU machine",
    "llguidance": "structured output's grammars (serve/structured.py, imported when a request asks for one); the "
                  "campaign sends no guided request",
}
TARGET = ["--python-version", "3.12", "--implementation", "cp", "--only-binary=:all:"] + [
    a for p in ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64")
    for a in ("--platform", p)]
MARKERS = {"python_version": "3.12", "python_full_version": "3.12.3", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
LIMIT = 64 * 2**20


def image_packages() -> dict[str, str | None]:
    """{canonical name: version or None} of the GPU image."""
    out = {}
    for line in (REPO / "bench" / "gpu_image.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            out[canonicalize_name(name)] = version or None
    return out


def download(dest: Path, image: dict) -> None:
    """WANTED and what they need, less what the image has, into ``dest`` (replacing its wheels)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "-q", "-d", tmp, *TARGET, *WANTED]
        if subprocess.run(cmd).returncode != 0:
            sys.exit("error: pip download failed (its message is above)")
        dest.mkdir(parents=True, exist_ok=True)
        for old in dest.glob("*.whl"):
            old.unlink()
        for whl in sorted(Path(tmp).glob("*.whl")):
            if canonicalize_name(parse_wheel_filename(whl.name)[0]) not in image:
                shutil.copy2(whl, dest / whl.name)


def requirements(whl: Path) -> list[Requirement]:
    with zipfile.ZipFile(whl) as z:
        meta = next(n for n in z.namelist() if re.fullmatch(r"[^/]+\.dist-info/METADATA", n))
        msg = Parser().parsestr(z.read(meta).decode())
    return [Requirement(r) for r in msg.get_all("Requires-Dist") or []]


def check(dest: Path, image: dict) -> list[str]:
    wheels = sorted(dest.glob("*.whl"))
    problems = []
    if not wheels:
        return [f"no wheels in {dest} (run without --check-only)"]
    total = sum(w.stat().st_size for w in wheels)
    print(f"{len(wheels)} wheels, {total / 2**20:.1f} MiB in {dest}:")
    for w in wheels:
        print(f"  {w.stat().st_size / 2**20:6.2f} MiB  {w.name}")
    if total > LIMIT:
        problems.append(f"{total / 2**20:.1f} MiB is over the 64 MiB a device call carries")

    with tempfile.TemporaryDirectory() as tmp:
        dry = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-index", "--no-deps",
                              "--target", tmp, *TARGET, *map(str, wheels)], capture_output=True, text=True)
    if dry.returncode != 0:
        problems.append("pip install --dry-run --no-index refused the set: " + dry.stderr.strip().splitlines()[-1])
    else:
        print("pip install --dry-run --no-index --no-deps (cp312, manylinux x86-64): " +
              dry.stdout.strip().splitlines()[-1])

    have = {canonicalize_name(parse_wheel_filename(w.name)[0]): str(parse_wheel_filename(w.name)[1]) for w in wheels}
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    needs = [("hypertron", Requirement(r)) for r in project["dependencies"]
             if canonicalize_name(Requirement(r).name) not in NOT_CARRIED]
    needs += [("hypertron[test]", Requirement(r)) for r in project["optional-dependencies"]["test"]
              if canonicalize_name(Requirement(r).name) == "openai"]
    needs += [(w.name, r) for w in wheels for r in requirements(w)]
    for who, req in needs:
        if req.marker is not None and not req.marker.evaluate(MARKERS):
            continue
        name = canonicalize_name(req.name)
        if name in have:
            version, where = have[name], "the wheels"
        elif name in image:
            version, where = image[name], "the image"
        else:
            problems.append(f"{who} needs {req}: neither in the wheels nor in the image")
            continue
        if version is not None and req.specifier and not req.specifier.contains(version, prereleases=True):
            problems.append(f"{who} needs {req}: {where} {'have' if where == 'the wheels' else 'has'} {version}")
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dest", default=str(REPO / ".whl"))
    p.add_argument("--check-only", action="store_true", help="check the wheels already in --dest")
    args = p.parse_args(argv)
    image, dest = image_packages(), Path(args.dest)
    if not args.check_only:
        download(dest, image)
    problems = check(dest, image)
    for line in problems:
        print(f"error: {line}", file=sys.stderr)
    if not problems:
        print("ok: every requirement is met by the wheels or the image")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
