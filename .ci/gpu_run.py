"""`.ci/gpu run`: on a lent GPU machine, install kvwire from `.gpu/` and measure every CUDA path in one go.

Run from the repository root with `.gpu/` (made by `.ci/gpu pack`) carried. Lifecycle:

1. Preflight, in seconds: an NVIDIA device that torch sees (else it stops, exit 2, naming what is missing) and
   a `.gpu/manifest.json` packed for this interpreter.
2. install: a venv under VENV made with `--system-site-packages`; where `python3` is itself a venv (the GPU
   image's is /opt/torch/.venv) its site-packages are added by a .pth, since a venv made from a venv sees
   only the base interpreter's. Then `.gpu/wheels/*` with `--no-index`, kvwire editable with the CUDA 13
   extras the manifest names (`[all-cu13,bench-cu13]`: pip checks that `.gpu` and the image hold all they
   need), and `pip check`, whose output the report keeps.
3. bench, demo, tests: each a subprocess in its own session, killed at its time limit; the last step gets
   whatever is left of `--budget-s`, so the whole run ends inside one device call (600 s).
4. `$OUT/gpu-report.md` (device, driver, torch, commit, every test count and bench row) is rewritten after
   every step, so a run cut short still leaves what it measured; each step's output is `$OUT/<step>.log`.

`--rehearse` runs the same steps on a machine with no GPU (bench and demo on the CPU, the GPU tests
skipping), to check this command itself; its report says so in its title.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import site
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_report import Report, StepResult  # noqa: E402 - a sibling script, not a package

ROOT = Path(__file__).resolve().parent.parent
VENV = Path(os.environ.get("KVWIRE_GPU_VENV", "/tmp/kvwire-gpu/venv"))
BUDGET_S = 560  # one device call runs 600 s at most; a step past its limit gets GRACE_S more
# Test paths whose modules need a package `.ci/gpu pack` may leave out: skipped, and the report says so.
NEEDS = {"kubernetes-validate": ["tests/deploy"]}
# `kvwire bench transfer`, one command per entry, in order, so a step cut short keeps the commands done:
# (tokens, methods, pools). NIXL (VRAM, READ) runs beside kvwire's methods with cuda_ipc's get enabled
# (`nixl`), and on UCX's defaults (`nixl-defaults`) at the reference size; at 16,384 tokens NIXL
# runs on vLLM's pool only (2 GiB and 65,536 pieces a run: the step's time goes there).
KVWIRE_METHODS = "limit-memcpy,limit-gather,ucx,shm,tcp,auto"
BENCH = [(128, f"{KVWIRE_METHODS},nixl", "kvwire,vllm"), (2048, f"{KVWIRE_METHODS},nixl,nixl-defaults", "kvwire,vllm"),
         (16384, f"{KVWIRE_METHODS},nixl", "vllm"), (16384, KVWIRE_METHODS, "kvwire")]
# DEBUG: each UCX pull's breakdown on both sides (messages, packing's share) in bench.log, a few lines a row
BENCH_ARGS = ["--layouts", "scattered", "--runs", "3", "--warmup", "1", "--log-level", "DEBUG"]
BENCH_REHEARSAL = [(128, f"{KVWIRE_METHODS},nixl", "kvwire,vllm"), (2048, f"{KVWIRE_METHODS},nixl", "kvwire,vllm")]
BENCH_REHEARSAL_ARGS = ["--layouts", "scattered", "--runs", "1", "--warmup", "0", "--log-level", "DEBUG"]
BENCH_LIMIT_S = 360
STEPS = ("bench", "demo", "tests")
OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}  # the GPU machine reaches nothing outside
GRACE_S = 15  # a step past its limit gets SIGINT (pytest then writes its JUnit XML), then SIGKILL after this


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    limit_s: float
    env: dict[str, str] = field(default_factory=dict)


def main() -> int:
    args = _args()
    out = Path(args.out or os.environ.get("OUT") or ROOT / ".gpu" / "out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    if not args.rehearse and (missing := _missing_device()):
        print(f".ci/gpu run: {missing}. It measures kvwire's CUDA paths and needs an NVIDIA GPU; "
              "`--rehearse` runs its steps on the CPU to check the command itself.", file=sys.stderr)
        return 2
    manifest = _manifest()
    report = Report(out / "gpu-report.md", rehearsal=args.rehearse, commit=_commit(args.commit, manifest),
                    manifest=manifest)
    report.add(_install(out, manifest))
    report.facts = _facts()
    report.write()
    if report.steps[-1].ok:
        by_name = {s.name: s for s in _steps(args.rehearse, out, manifest, args.bench_tokens)}
        for step in [by_name[name] for name in args.steps]:
            left = args.budget_s - (time.monotonic() - started)
            if left < 20:
                report.add(StepResult(step.name, ok=False, seconds=0.0, note="not run: the time budget was spent"))
                continue
            report.add(_run(step, out, min(step.limit_s, left)))
    report.write()
    print(report.text())
    print(f"\n.ci/gpu run: {time.monotonic() - started:.0f} s; report and logs in {out}")
    return 0 if all(s.ok for s in report.steps) else 1


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=".ci/gpu run", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", help="where logs and gpu-report.md go ($OUT, else .gpu/out)")
    p.add_argument("--commit", help="the commit under test, where the tree came without .git (the device tool's)")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help=f"the whole run's time ({BUDGET_S} s)")
    p.add_argument("--steps", type=lambda v: v.split(","), default=list(STEPS),
                   help=f"which of {','.join(STEPS)} to run after the install, in the order given (all, in that "
                   "order); to finish, in a second device call, what a first one's budget cut short")
    p.add_argument("--bench-tokens", type=lambda v: [int(t) for t in v.split(",")], default=None,
                   help="the bench step runs only the entries of these request sizes (all: "
                   f"{','.join(sorted({str(t) for t, _, _ in BENCH}, key=int))})")
    p.add_argument("--rehearse", action="store_true", help="no GPU: the same steps on the CPU, to check this "
                   "command (pack with `.ci/gpu pack --python` this interpreter's version first)")
    args = p.parse_args()
    if unknown := set(args.steps) - set(STEPS):
        p.error(f"--steps: no step {', '.join(sorted(unknown))} (of {', '.join(STEPS)})")
    return args


def _missing_device() -> str | None:
    """Why this machine cannot run the GPU steps, or None; a quick look before torch's slow import."""
    if not Path("/dev/nvidia0").exists() and shutil.which("nvidia-smi") is None:
        return "no CUDA device on this machine (no /dev/nvidia0, no nvidia-smi)"
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.__version__, "
                            "torch.cuda.is_available() and torch.cuda.device_count())"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"{sys.executable} cannot import torch: {probe.stderr.strip().splitlines()[-1:]}"
    version, count = probe.stdout.split()
    if count in ("False", "0"):
        return f"torch {version} sees no CUDA device (torch.cuda.is_available() is False)"
    return None


def _manifest() -> dict:
    path = ROOT / ".gpu" / "manifest.json"
    if not path.exists():
        sys.exit(f".ci/gpu run: {path} is missing: run `.ci/gpu pack` where the registries are, and carry .gpu")
    manifest = json.loads(path.read_text())
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if manifest["python"] != here:
        sys.exit(f".ci/gpu run: .gpu/ holds wheels for CPython {manifest['python']}, this python3 is {here}: "
                 f"`.ci/gpu pack --python {here}`")
    return manifest


def _commit(given: str | None, manifest: dict) -> str:
    if given:
        return given
    if shutil.which("git") is None:
        return f"unknown: no git here and no --commit (.gpu packed at {manifest.get('commit')})"
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode == 0:
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True).stdout.strip()
        return head.stdout.strip() + (" (with uncommitted changes)" if dirty else "")
    return f"unknown: no .git here and no --commit (.gpu packed at {manifest.get('commit')})"


def _install(out: Path, manifest: dict) -> StepResult:
    """The venv: the image's packages visible, .gpu's wheels and kvwire installed, `pip check` kept."""
    start = time.monotonic()
    py = str(VENV / "bin" / "python")
    wheels = sorted(str(p) for p in (ROOT / ".gpu" / "wheels").glob("*.whl"))
    log = out / "install.log"
    with open(log, "w") as f:
        pip = _make_venv(py, f)
        ok = pip is not None and _logged(pip + ["install", "--no-index", "--no-deps", "--no-compile", *wheels], f)
        pip = pip or [py, "-m", "pip"]
        how = _install_kvwire(pip, py, manifest.get("extras") or ["all-cu13"], f) if ok else "not installed"
        check = subprocess.run(pip + ["check"], capture_output=True, text=True)
        f.write(f"$ pip check\n{check.stdout}{check.stderr}")
        ok = ok and _logged([py, "-c", "import kvwire.connectors.factory, kvwire.cli.main, torch, ucxx"], f)
        nixl = _nixl_check(py, f) if any(p["group"] == "nixl" for p in manifest["packed"]) else "not packed"
    ours = {"kvwire"} | {p["name"].lower().replace("_", "-") for p in manifest["packed"]}
    lines = [line for line in check.stdout.splitlines() if line.strip() and "No broken" not in line]
    problems = [line for line in lines if any(name in line.lower().replace("_", "-") for name in ours)]
    extra = len(lines) - len(problems)
    others = f" ({extra} more among the image's own packages)" if extra else ""
    note = (f"{len(wheels)} wheels from .gpu ({sum(p['bytes'] for p in manifest['packed']) / 2**20:.1f} MiB); "
            f"kvwire {how}; NIXL {nixl}; pip check: " + ("; ".join(problems) or "nothing of kvwire's broken") +
            others)
    return StepResult("install", ok=ok, seconds=time.monotonic() - start, note=note, log=log.name,
                      stdout=f"$ pip check\n{check.stdout}{check.stderr}")


def _install_kvwire(pip: list[str], py: str, extras: list[str], f) -> str:
    """kvwire editable into the venv, with `extras` resolved from .gpu's wheels and the image's packages
    (none fetched); without them where that fails, or as a .pth view where pip cannot install it at all.
    Returns: how it was installed, for the report."""
    named = ",".join(extras)
    install = pip + ["install", "--no-index", "--no-build-isolation"]
    if _logged(install + ["--find-links", str(ROOT / ".gpu" / "wheels"), "-e", f"{ROOT}[{named}]"], f):
        return f"editable, [{named}] satisfied"
    if _logged(install + ["--no-deps", "-e", str(ROOT)], f):
        return f"editable without its dependencies: [{named}] not satisfied (install.log)"
    view = VENV / "kvwire-view"
    view.mkdir()
    (view / "kvwire").symlink_to(ROOT)
    Path(_purelib(py), "_kvwire_view.pth").write_text(f"{view}\n")
    return "a .pth view (the editable install failed: install.log)"


def _nixl_check(py: str, f) -> str:
    """Whether the packed NIXL loads and starts its UCX backend (the pack trimmed it: gpu_strip.py)."""
    code = ("import importlib; api = importlib.import_module('nixl_cu13._api'); "
            "agent = api.nixl_agent('check', api.nixl_agent_config(enable_prog_thread=False, backends=[])); "
            "agent.create_backend('UCX', {})")
    return "loads" if _logged([py, "-c", code], f) else "does not load (install.log; its bench rows say why)"


def _make_venv(py: str, f) -> list[str] | None:
    """A fresh venv at VENV that sees this interpreter's packages (torch above all); the pip that installs
    into it (this interpreter's, `--python`, where the base interpreter has no ensurepip), or None."""
    shutil.rmtree(VENV, ignore_errors=True)
    make = [sys.executable, "-m", "venv", "--system-site-packages", str(VENV)]
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    if not _logged(make, f):
        shutil.rmtree(VENV, ignore_errors=True)
        if not _logged(make + ["--without-pip"], f):
            return None
        pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--python", py]
    purelib = _purelib(py)
    if sys.prefix != sys.base_prefix:  # python3 is a venv: a venv made from it sees the base's packages only
        dirs = ", ".join(repr(d) for d in site.getsitepackages())  # addsitedir: their own .pth files run too
        Path(purelib, "_image_site.pth").write_text(f"import site; list(map(site.addsitedir, ({dirs},)))\n")
        f.write(f"# {sys.executable} is a venv: its site-packages added by {purelib}/_image_site.pth\n")
    if Path(purelib, "setuptools").exists():  # CPython < 3.12 seeds an old one; the image's builds kvwire (>= 68)
        return pip if _logged(pip + ["uninstall", "--yes", "setuptools"], f) else None
    return pip


def _purelib(py: str) -> str:
    return subprocess.run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()


def _logged(cmd: list[str], f) -> bool:
    f.write(f"$ {' '.join(cmd)}\n")
    f.flush()
    return subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode == 0


def _facts() -> dict:
    """Device, driver, torch, CUDA, UCX: what the report's head says."""
    code = """if True:
        import json, platform, torch
        facts = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
        if torch.cuda.is_available():
            p = torch.cuda.get_device_properties(0)
            facts |= {"gpus": torch.cuda.device_count(), "gpu": p.name, "memory_gib": round(p.total_memory / 2**30, 1),
                      "capability": f"{p.major}.{p.minor}", "sms": p.multi_processor_count}
        try:
            import ucxx
            facts |= {"ucxx": ucxx.__version__, "ucx": ".".join(map(str, ucxx.get_ucx_version()))}
        except Exception as exc:
            facts |= {"ucxx": f"does not import: {exc}", "ucx": "-"}
        import importlib.metadata, importlib.util
        nixl = [d for m, d in (("nixl_cu13", "nixl-cu13"), ("nixl_cu12", "nixl-cu12")) if importlib.util.find_spec(m)]
        facts["nixl"] = f"{nixl[0]} {importlib.metadata.version(nixl[0])}" if nixl else "not installed"
        print(json.dumps(facts))"""
    py = VENV / "bin" / "python"
    done = subprocess.run([str(py) if py.exists() else sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    facts = json.loads(done.stdout) if done.returncode == 0 else {"error": done.stderr.strip()[-500:]}
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                         capture_output=True, text=True) if shutil.which("nvidia-smi") else None
    facts["nvidia_smi"] = smi.stdout.strip() if smi is not None and smi.returncode == 0 else "not available"
    facts["cores"] = os.cpu_count()
    facts["date"] = datetime.now(UTC).strftime("%Y-%m-%d %H:%M UTC")
    return facts


def _steps(rehearse: bool, out: Path, manifest: dict, bench_tokens: list[int] | None = None) -> list[Step]:
    """bench (one command per BENCH entry, so a cut-short step keeps the entries done), demo, then the tests."""
    py = str(VENV / "bin" / "python")
    kvwire = [py, "-m", "kvwire.cli.main"]
    bench = ["bash", "-c", bench_script(kvwire, rehearse, bench_tokens)]
    demo = kvwire + ["demo", "--device", "cpu" if rehearse else "cuda:0"]
    left_out = {g["group"] for g in manifest["left_out"]}
    ignores = [arg for pkg, paths in NEEDS.items() if pkg in left_out for path in paths for arg in ("--ignore", path)]
    timeout = ["--timeout", "180"] if _has_pytest_timeout(py) else []
    tests = [py, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rfEs", "-p", "no:cacheprovider",
             "--continue-on-collection-errors", f"--junitxml={out / 'tests.xml'}", *timeout, *ignores]
    return [Step("bench", bench, BENCH_LIMIT_S), Step("demo", demo, 90), Step("tests", tests, BUDGET_S)]


def bench_script(kvwire: list[str], rehearse: bool, tokens: list[int] | None = None) -> str:
    """The bench step as a shell script: every BENCH entry's command in turn (those of `tokens`, where given);
    exit 1 if any failed."""
    entries, args = (BENCH_REHEARSAL, BENCH_REHEARSAL_ARGS) if rehearse else (BENCH, BENCH_ARGS)
    entries = [e for e in entries if tokens is None or e[0] in tokens]
    device = "cpu" if rehearse else "cuda"
    commands = [shlex.join(kvwire + ["bench", "transfer", "--device", device, "--tokens", str(tokens),
                                     "--methods", methods, "--pools", pools, *args]) + " || rc=1"
                for tokens, methods, pools in entries]
    return "; ".join(["rc=0", *commands, "exit $rc"])


def _has_pytest_timeout(py: str) -> bool:
    return subprocess.run([py, "-c", "import pytest_timeout"], capture_output=True).returncode == 0


def _run(step: Step, out: Path, limit_s: float) -> StepResult:
    """`step` in its own session, stdout and stderr kept apart; at `limit_s` interrupted, then killed."""
    start = time.monotonic()
    log = out / f"{step.name}.log"
    with tempfile.TemporaryFile("w+") as stdout, tempfile.TemporaryFile("w+") as stderr:
        proc = subprocess.Popen(step.argv, cwd=ROOT, stdout=stdout, stderr=stderr, start_new_session=True,
                                env={**os.environ, **OFFLINE, "PYTHONUNBUFFERED": "1", **step.env},
                                preexec_fn=_interruptible)
        rc = _wait(proc, limit_s)
        _kill_group(proc.pid, signal.SIGKILL)  # whatever the step left running
        stdout.seek(0)
        stderr.seek(0)
        text, err = stdout.read(), stderr.read()
    log.write_text(f"$ {shlex.join(step.argv)}\n{text}\n--- stderr ---\n{err}")
    seconds = time.monotonic() - start
    note = f"stopped at its {limit_s:.0f} s limit" if rc is None else f"exit {rc}"
    print(f"[{step.name}] {note} after {seconds:.0f} s", flush=True)
    return StepResult(step.name, ok=rc == 0, seconds=seconds, note=note, log=log.name, stdout=text)


def _wait(proc: subprocess.Popen, limit_s: float) -> int | None:
    """The exit status, or None once the step was stopped at its limit."""
    try:
        return proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid, signal.SIGINT)
        try:
            proc.wait(timeout=GRACE_S)
        except subprocess.TimeoutExpired:
            _kill_group(proc.pid, signal.SIGKILL)
            proc.wait()
        return None


def _interruptible() -> None:
    """In the step's process before it runs: SIGINT back to its default. A runner started in the background
    (`cmd &` in a script, nohup) has SIGINT ignored, and a step would inherit that, never see the interrupt at
    its limit, and lose its summary to the SIGKILL GRACE_S later."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _kill_group(pgid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    sys.exit(main())
