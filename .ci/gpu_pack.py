"""`.ci/gpu pack`: the wheels kvwire needs on the GPU machine, downloaded into `.gpu/` (git-ignored).

The GPU machine (issue 27; /work/.library/device) runs CPython 3.12 with PyTorch 2.11 for CUDA 13 and the
packages in IMAGE, and reaches no package registry: whatever else kvwire needs travels in `.gpu/`, carried
with the working tree (64 MiB in all, the tree included), so `.gpu/` is kept under BUDGET_MIB.

1. One pip resolution (`--dry-run --report`, nothing installed) for that interpreter and platform of what
   `.ci/gpu run` installs, the CUDA 13 extras (`kvwire[all-cu13,bench-cu13]`: `ucxx-cu13`, `nixl-cu13`),
   and of the test extra's own packages: UCX pinned to the release whose wheel is smallest (LIBUCX: 1.21's
   ships static archives and perftest, 40 MiB against 27), and never torch.
2. Groups, in the order they are packed: kvwire's own dependencies (all-cu13: the base, node, ucx-cu13,
   local), then NIXL (bench-cu13's: `kvwire bench transfer`'s peer rows), then each package of the test
   extra in pyproject order; a group is what it needs beyond the image and the groups before it.
3. Each group's wheels are fetched (sha256 checked) into a cache outside the tree, and those in gpu_strip.TRIMS
   trimmed to what the run loads (libucx-cu13 27 -> 17 MiB, nixl-cu13 56 -> 14 MiB); a group goes into
   `.gpu/wheels/` whole if it fits in what is left of the budget, else it is left out and named with its size.
4. `.gpu/manifest.json` says what was packed (and trimmed) and left out, and the extras `.ci/gpu run` installs
   kvwire with; `.ci/gpu run` reads it and skips the tests that need what was left out, saying so (without
   NIXL the bench says its rows were skipped).

Standard library only (and pip's vendored `packaging`, to read requirements as pip does).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import tomllib
import urllib.request
from datetime import UTC, datetime
from pathlib import Path

from pip._vendor.packaging.markers import Marker
from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT / ".ci"), str(ROOT / "deploy" / "docker")]
from gpu_strip import TRIMS, trim_wheel  # noqa: E402 - a sibling script, not a package
from requirements import requirements  # noqa: E402 - the Dockerfiles' reader of pyproject's extras

BUDGET_MIB = 60.0
LIBUCX = "libucx-cu13==1.20.*"
EXTRAS = ["all-cu13"]  # kvwire's extras on the GPU machine; `.ci/gpu run` adds bench-cu13 where NIXL was packed
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_26_x86_64", "manylinux_2_24_x86_64",
             "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_12_x86_64", "manylinux2010_x86_64",
             "manylinux1_x86_64"]
CACHE = Path.home() / ".cache" / "kvwire-gpu-pack"
# The GPU image's packages, as /work/.library/device/KINDS.md read them on 2026-11-17 (names only): never
# packed. What kvwire needs of them at other versions shows in `.ci/gpu run`'s `pip check`.
IMAGE = """absl-py accelerate aiofiles aiohappyeyeballs aiohttp aiosignal annotated-doc anyio attrs botorch build
certifi charset-normalizer chex click cloudpickle cmake colorama contourpy coverage cuda-bindings cuda-core
cuda-pathfinder cuda-toolkit cupy-cuda13x cycler cython diffrax e3nn einops equinox etils execnet filelock
flatbuffers flax fonttools formulaic frozenlist fsspec gpytorch grpcio h11 h5py hf-xet httpcore httpx humanize
huggingface-hub hypothesis idna imageio iniconfig interface-meta jax jax-cuda13-pjrt jax-cuda13-plugin jaxlib
jaxtyping jinja2 joblib kiwisolver lazy-loader lightning lightning-utilities linear-operator lineax llvmlite lxml
markdown markdown-it-py markupsafe matplotlib mdurl meson ml-dtypes mpi4py mpmath msgpack multidict
multipledispatch mypy-extensions nanobind narwhals networkx ninja numba numba-cuda numpy numpyro nvidia-cublas
nvidia-cuda-cupti nvidia-cuda-nvrtc nvidia-cuda-runtime nvidia-cudnn-cu13 nvidia-cufft nvidia-cufile nvidia-curand
nvidia-cusolver nvidia-cusparse nvidia-cusparselt-cu13 nvidia-ml-py nvidia-nccl-cu13 nvidia-nvjitlink
nvidia-nvshmem-cu13 nvidia-nvtx onnx onnx-ir onnxruntime onnxscript opencv-python-headless optax opt-einsum
opt-einsum-fx optimistix orbax-checkpoint packaging pandas pathspec patsy peft pillow pip pluggy portalocker
prometheus-client propcache protobuf psutil pyarrow pybind11 py-cpuinfo pygments pyparsing pyproject-hooks
pyre-extensions pytest pytest-benchmark pytest-cov pytest-mock pytest-timeout pytest-xdist python-dateutil
pytorch-lightning pyyaml regex requests rich sacrebleu safetensors scikit-build-core scikit-image scikit-learn
scipy seaborn sentencepiece sentence-transformers setuptools shellingham simplejson six sortedcontainers
statsmodels sympy tabulate tensorboard tensorboard-data-server tensorstore threadpoolctl tifffile tiktoken timm
tokenizers toolz torch torchaudio torchdiffeq torch-geometric torchmetrics torchvision tqdm transformers treescope
triton typer typing-extensions typing-inspect urllib3 uvloop wadler-lindig werkzeug wheel wrapt xarray xxhash
yarl zipp"""


def main() -> int:
    args = _args()
    py = args.python
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    groups = pack_groups(project)
    print(f"resolving kvwire + test extra for CPython {py}, manylinux x86_64 ...", flush=True)
    report = _resolve([r for _, reqs in groups for r in reqs], py)
    image = {canonicalize_name(n) for n in IMAGE.split()}
    chosen = _group_wheels(groups, report, image, py)
    packed, left_out = _fit(chosen, report, args.budget_mib)
    _write(packed, left_out, report, py, args.budget_mib)
    return 0


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=".ci/gpu pack", description=__doc__.split("\n\n")[0])
    p.add_argument("--python", default="3.12", help="the GPU machine's CPython (3.12); another version only to "
                   "rehearse `.ci/gpu run --rehearse` on this machine")
    p.add_argument("--budget-mib", type=float, default=BUDGET_MIB, help=f"size limit of .gpu/ ({BUDGET_MIB:g})")
    return p.parse_args()


def pack_groups(project: dict) -> list[tuple[str, list[str]]]:
    """(group, requirements) in packing order: kvwire's CUDA 13 install, NIXL, each test package."""
    runtime = [r for r in requirements(project, EXTRAS) if canonicalize_name(Requirement(r).name) != "torch"]
    nixl = [r for r in requirements(project, ["bench-cu13"], base=False) if Requirement(r).name.startswith("nixl")]
    tests = [r for r in project["optional-dependencies"]["test"] if Requirement(r).name != project["name"]]
    assert not [r for r in runtime + nixl if "-cu12" in r], "the GPU image is CUDA 13's"
    return [("kvwire", runtime + [LIBUCX]), ("nixl", nixl)] + [(Requirement(r).name, [r]) for r in tests]


def _resolve(reqs: list[str], py: str) -> dict[str, dict]:
    """pip's resolution for CPython `py` on manylinux x86_64: {canonical name: report item}."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
               "--disable-pip-version-check", "--only-binary=:all:", "--python-version", py,
               "--implementation", "cp", "--target", tmp, "--report", f"{tmp}/report.json"]
        cmd += [arg for plat in PLATFORMS for arg in ("--platform", plat)] + reqs
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0:
            sys.exit(f"pip could not resolve kvwire's wheels for CPython {py}:\n{done.stderr}")
        items = json.loads(Path(f"{tmp}/report.json").read_text())["install"]
    return {canonicalize_name(i["metadata"]["name"]): i for i in items}


def _group_wheels(groups: list[tuple[str, list[str]]], report: dict[str, dict], image: set[str],
                  py: str) -> list[tuple[str, list[str]]]:
    """Each group's packages beyond the image and the groups before it (names, resolution order)."""
    env = {"python_version": py, "python_full_version": f"{py}.0", "sys_platform": "linux",
           "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
           "implementation_name": "cpython", "platform_python_implementation": "CPython", "extra": ""}
    seen: set[str] = set()
    out = []
    for group, reqs in groups:
        todo = [Requirement(r) for r in reqs]
        names: list[str] = []
        while todo:
            req = todo.pop()
            name = canonicalize_name(req.name)
            if name in image or name in seen or name not in report:
                continue
            seen.add(name)
            names.append(name)
            for dep in report[name]["metadata"].get("requires_dist", []):
                d = Requirement(dep)
                if d.marker is None or any(Marker(str(d.marker)).evaluate({**env, "extra": e})
                                           for e in [""] + sorted(req.extras)):
                    todo.append(d)
        out.append((group, names))
    return out


def _fetch(item: dict) -> Path:
    """The wheel of one report item, from the cache or its index, its sha256 checked."""
    url = item["download_info"]["url"]
    want = item["download_info"].get("archive_info", {}).get("hashes", {}).get("sha256")
    path = CACHE / url.rsplit("/", 1)[-1]
    if not (path.exists() and (want is None or _sha256(path) == want)):
        CACHE.mkdir(parents=True, exist_ok=True)
        with urllib.request.urlopen(url) as resp, open(f"{path}.part", "wb") as f:
            shutil.copyfileobj(resp, f)
        Path(f"{path}.part").rename(path)
        if want is not None and _sha256(path) != want:
            path.unlink()
            sys.exit(f"{url}: sha256 differs from the index's")
    return path


def _trimmed(name: str, wheel: Path) -> tuple[Path, dict]:
    """The wheel to pack for package `name`, trimmed where TRIMS says so, and the manifest's note of it."""
    if (trim := TRIMS.get(name)) is None:
        return wheel, {}
    done = trim_wheel(wheel, trim, CACHE / "trimmed")
    return done.path, {"trimmed": {"from_bytes": done.from_bytes, "dropped_files": done.dropped, "what": trim.why}}


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fit(chosen: list[tuple[str, list[str]]], report: dict[str, dict],
         budget_mib: float) -> tuple[list[dict], list[dict]]:
    """Whole groups in order while they fit the budget (manifest.json's own bytes kept aside)."""
    room = budget_mib * 2**20 - 64 * 1024
    packed, left_out = [], []
    for group, names in chosen:
        wheels = [(name, *_trimmed(name, _fetch(report[name]))) for name in names]
        size = sum(p.stat().st_size for _, p, _ in wheels)
        rows = [{"name": report[n]["metadata"]["name"], "version": report[n]["metadata"]["version"],
                 "file": p.name, "bytes": p.stat().st_size, "group": group, **trimmed} for n, p, trimmed in wheels]
        if size <= room:
            room -= size
            packed += [dict(r, path=str(p)) for r, (_, p, _) in zip(rows, wheels)]
        else:
            left_out.append({"group": group, "bytes": size, "packages": [f"{r['name']}=={r['version']}"
                                                                         for r in rows]})
    return packed, left_out


def _write(packed: list[dict], left_out: list[dict], report: dict[str, dict], py: str, budget_mib: float) -> None:
    gpu = ROOT / ".gpu"
    shutil.rmtree(gpu, ignore_errors=True)
    (gpu / "wheels").mkdir(parents=True)
    for row in packed:
        shutil.copyfile(row.pop("path"), gpu / "wheels" / row["file"])
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    extras = EXTRAS + (["bench-cu13"] if any(row["group"] == "nixl" for row in packed) else [])
    manifest = {"python": py, "platforms": PLATFORMS, "made": datetime.now(UTC).isoformat(timespec="seconds"),
                "commit": head.stdout.strip() or None, "budget_mib": budget_mib, "extras": extras, "packed": packed,
                "left_out": left_out}
    (gpu / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum(f.stat().st_size for f in gpu.rglob("*") if f.is_file())
    print(f"{'package':<28} {'version':<14} {'MiB':>6}  group")
    for row in packed:
        cut = f" (trimmed from {t['from_bytes'] / 2**20:.1f}: {t['what']})" if (t := row.get("trimmed")) else ""
        print(f"{row['name']:<28} {row['version']:<14} {row['bytes'] / 2**20:>6.2f}  {row['group']}{cut}")
    for gone in left_out:
        print(f"LEFT OUT: {gone['group']} ({gone['bytes'] / 2**20:.1f} MiB: {', '.join(gone['packages'])}): "
              f"over the {budget_mib:g} MiB budget; `.ci/gpu run` skips what needs it")
    print(f".gpu/: {len(packed)} wheels for CPython {py}, {total / 2**20:.1f} MiB of {budget_mib:g} MiB")
    if total > budget_mib * 2**20:
        sys.exit(f".gpu/ is {total / 2**20:.1f} MiB, over the {budget_mib:g} MiB budget")


if __name__ == "__main__":
    sys.exit(main())
