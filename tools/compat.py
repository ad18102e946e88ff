"""Run shardflow on other versions of torch: each in a scratch virtual environment, never the project's ``.venv``.

    python tools/compat.py --versions 2.11.0,2.12.1,2.13.0,2.14.1,2.15.0 [--python python3.11] [--work DIR]

For each version: a new venv under ``--work`` (default ``/tmp/shardflow-compat``), that torch installed, shardflow's
other requirements at the versions ``constraints.txt`` pins, the repository installed editable (``--no-deps``: pip
never sees a torch requirement, so it cannot replace the chosen torch), then

* the fast tier, exactly as ``make test-fast`` runs it (``pytest -n 2 --dist loadfile -m unit``), and
* ``shardflow train --nproc 2 --steps 20 --check`` (a small model, its run directory under ``--work``),

and a table: version, install, fast tier passed/failed, the train check, seconds. Exit status 0 when every version
installed and passed both.

**Which torch.** A CPU wheel where one can be had: the ``find-links``/index pip is set up with (``constraints.txt``
pins the local ``torch==2.13.0`` CPU build), else PyTorch's CPU index. Where neither has the version, the default
registry's Linux wheel is the CUDA build, whose requirements are gigabytes of ``nvidia-*`` packages: it is installed
``--no-deps`` with torch's own small requirements (sympy, networkx, ...) and none of ``nvidia-*``, ``cuda-*`` or
``triton``. Its libraries still name the CUDA libraries they link to (``libcudnn.so.9``, ``libnccl.so.2``, ...), so
the dynamic loader refuses to load torch; for each library ``ldd`` does not find, a **stub** of the same soname is
compiled (``cc``) into ``torch/lib`` (on torch's ``$ORIGIN`` rpath) defining the symbols torch takes from it, each a
function returning 100 (``cudaErrorNoDevice``) — the same torch, run on the CPU, where none of them is called. The
table says which build ran (``+cpu`` or ``pypi, CUDA libs stubbed``). This needs ``cc``, ``ldd``, ``readelf`` and
``objdump`` (binutils), only for such a wheel.

The machine's pip configuration may cap torch (a global ``constraint`` file); each pip call here gets its own
constraints file through ``PIP_CONSTRAINT`` (the project's pins with torch replaced by the version under test), which
takes the place of the configured one.
"""

from __future__ import annotations

import argparse
import email.parser
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
import tomllib
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# torch's requirements that are the CUDA build's (gigabytes): never installed here
CUDA_REQUIREMENT = re.compile(r"^(nvidia-|cuda-|triton\b)", re.IGNORECASE)
# what `make test-fast` runs (Makefile)
FAST_TIER = ["-m", "pytest", "-n", "2", "--dist", "loadfile", "-m", "unit", "-p", "no:cacheprovider"]
TRAIN = ["train", "--nproc", "2", "--steps", "20", "--check"]
# tp: the default (all-reduces); fsdp: the all-gathers and reduce-scatters (shardflow.runtime.torch_compat)
TRAIN_STRATEGIES = ("tp", "fsdp")
# the tests' tiny model (tests/conftest.py TINY) on the default data
TRAIN_SMALL = [
    "--layers",
    "1",
    "--heads",
    "2",
    "--embd",
    "16",
    "--seq-len",
    "16",
    "--batch-size",
    "8",
    "--peak-tflops",
    "0.1",
    "--timeout",
    "300",
]


@dataclass
class Result:
    version: str
    build: str = "-"
    install: str = "-"
    passed: int = 0
    failed: int = 0
    errors: int = 0
    fast_tier: str = "-"
    train: str = "-"
    train_ok: bool = False
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.install == "ok" and self.fast_tier in ("ok", "skipped") and self.train_ok


def log(msg: str) -> None:
    print(f"[compat {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run(
    cmd: list[str],
    *,
    env: dict[str, str] | None = None,
    cwd: Path | None = None,
    out: Path | None = None,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run ``cmd``; its output goes to ``out`` (appended) when given, and comes back in the result as well."""
    proc = subprocess.run(cmd, env=env, cwd=cwd, text=True, capture_output=True, timeout=timeout)
    if out is not None:
        with out.open("a") as f:
            f.write(f"$ {shlex.join(cmd)}\n{proc.stdout}{proc.stderr}[exit {proc.returncode}]\n")
    return proc


def constraints_for(version: str, path: Path) -> Path:
    """The project's constraints.txt with its torch pin replaced by ``torch==version``."""
    lines = [
        ln for ln in (ROOT / "constraints.txt").read_text().splitlines() if not re.match(r"^\s*torch\s*[=<>!~]", ln)
    ]
    path.write_text("\n".join([*lines, f"torch=={version}", ""]))
    return path


def other_requirements() -> list[str]:
    """pyproject's dependencies and its ``test`` extra, torch left out (the version under test is installed first).

    ``safetensors[torch]`` becomes ``safetensors`` + ``numpy``: its torch extra is exactly those two, and naming
    torch here would let pip resolve torch's own requirements (the CUDA packages) again."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = []
    for req in [*project["dependencies"], *project["optional-dependencies"]["test"]]:
        name = re.match(r"[A-Za-z0-9_.-]+", req)
        assert name is not None, req
        if name.group(0).lower() == "torch":
            continue
        if re.search(r"\[[^\]]*\btorch\b[^\]]*\]", req):
            req = re.sub(r"\[[^\]]*\]", "", req)
            reqs.append("numpy")
        reqs.append(req)
    return reqs


def fetch_wheel(python: Path, version: str, wheels: Path, env: dict[str, str], logf: Path) -> Path | None:
    """The wheel of ``torch==version`` for this interpreter: a CPU build where one can be had, else the registry's."""
    wheels.mkdir(parents=True, exist_ok=True)
    tag = run([str(python), "-c", "import sys; print(f'cp{sys.version_info[0]}{sys.version_info[1]}')"]).stdout.strip()

    def have() -> list[Path]:  # CPU builds first
        got = [*wheels.glob(f"torch-{version}-{tag}-*.whl"), *wheels.glob(f"torch-{version}+*-{tag}-*.whl")]
        return sorted(got, key=lambda p: "+cpu" not in p.name)

    for extra in (
        ["--only-binary", ":all:"],  # the configured index and find-links (a local +cpu build, if there is one)
        ["--index-url", CPU_INDEX, "--timeout", "15", "--retries", "0"],  # PyTorch's CPU builds
    ):
        if any("+cpu" in p.name for p in have()):
            break
        run(
            [str(python), "-m", "pip", "download", "--no-deps", "-d", str(wheels), f"torch=={version}", *extra],
            env=env,
            out=logf,
        )
    return next(iter(have()), None)


def wheel_requirements(wheel: Path) -> tuple[list[str], list[str]]:
    """(the wheel's plain requirements without the CUDA ones, the CUDA ones it names)."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        msg = email.parser.Parser().parsestr(z.read(meta).decode())
    keep, cuda = [], []
    for req in msg.get_all("Requires-Dist") or []:
        if "extra ==" in req:
            continue
        (cuda if CUDA_REQUIREMENT.match(req) else keep).append(req)
    return keep, cuda


def _undefined(lib: Path) -> list[tuple[bool, str, str]]:
    """``(is_object, version, name)`` of each strong undefined dynamic symbol of ``lib``."""
    out = subprocess.run(["objdump", "-T", str(lib)], text=True, capture_output=True).stdout
    syms = []
    for line in out.splitlines():
        if "*UND*" not in line:
            continue
        flags, rest = line[8:].split("*UND*", 1)
        if "w" in flags:
            continue  # weak: may stay unresolved
        parts = rest.split()
        if len(parts) < 3:
            continue
        version, name = parts[-2].strip("()"), parts[-1]
        syms.append(("O" in flags, version, name))
    return syms


def _defined(lib: str) -> set[str]:
    out = subprocess.run(["nm", "-D", "--defined-only", lib], text=True, capture_output=True).stdout
    return {ln.split()[-1].split("@")[0] for ln in out.splitlines() if ln.strip()}


def stub_missing_libraries(torch_dir: Path, logf: Path) -> list[str]:
    """Compile a stub into ``torch/lib`` for each library torch's ELF files link to that the loader cannot find."""
    libs = [p for p in [*torch_dir.glob("lib/*.so*"), *torch_dir.glob("*.so")] if p.is_file()]
    missing: dict[Path, list[str]] = {}
    found: set[str] = set()
    for lib in libs:
        out = subprocess.run(["ldd", str(lib)], text=True, capture_output=True).stdout
        for so, where in re.findall(r"^\s*(\S+) => (.*?)(?: \(0x[0-9a-f]+\))?$", out, re.M):
            if where.strip() == "not found":
                missing.setdefault(lib, []).append(so)
            elif where.startswith("/"):
                found.add(where.strip())
    if not missing:
        return []
    sonames = sorted({so for sos in missing.values() for so in sos})
    defined: set[str] = set()
    for path in found | {str(p) for p in libs}:
        defined |= _defined(path)
    # soname -> version node -> {name: is_object}
    stubs: dict[str, dict[str, dict[str, bool]]] = {so: {} for so in sonames}
    for lib, sos in missing.items():
        needed = re.findall(
            r"\(NEEDED\)\s+Shared library: \[(.+?)\]",
            subprocess.run(["readelf", "-d", str(lib)], text=True, capture_output=True).stdout,
        )
        direct = [so for so in sos if so in needed]
        for is_obj, version, name in _undefined(lib):
            if version in stubs:  # versioned by a missing library's own version node
                stubs[version].setdefault(version, {})[name] = is_obj
            elif name not in defined:  # unversioned, or a version of its own (NVSHMEM): none found defines it
                for so in direct:
                    stubs[so].setdefault(so if version == "Base" else version, {})[name] = is_obj
    build = torch_dir / "lib" / "_compat_stubs"
    build.mkdir(exist_ok=True)
    for so, nodes in stubs.items():
        c_src, script = ["/* generated by tools/compat.py: a CPU-only stand-in */"], []
        for node, names in sorted(nodes.items()):
            script.append(f"{node} {{ global: {'; '.join(sorted(names))}; }};" if names else f"{node} {{ }};")
            for i, (name, is_obj) in enumerate(sorted(names.items())):
                ident = f"s_{len(c_src)}_{i}"
                if is_obj:
                    c_src.append(f'char {ident}[256] __asm__("{name}") __attribute__((aligned(64)));')
                else:
                    c_src.append(f'long {ident}(void) __asm__("{name}");\nlong {ident}(void) {{ return 100; }}')
        if not script:
            script.append(f"{so} {{ }};")
        (build / f"{so}.c").write_text("\n".join(c_src) + "\n")
        (build / f"{so}.map").write_text("\n".join(script) + "\n")
        proc = run(
            [
                "cc",
                "-shared",
                "-fPIC",
                "-o",
                str(torch_dir / "lib" / so),
                str(build / f"{so}.c"),
                f"-Wl,-soname,{so}",
                f"-Wl,--version-script={build / f'{so}.map'}",
            ],
            out=logf,
        )
        if proc.returncode != 0:
            raise RuntimeError(f"compiling the stub {so} failed: {proc.stderr[-2000:]}")
    return sonames


def install(res: Result, python: str, venv: Path, wheels: Path, logf: Path) -> Path:
    """Make ``venv`` with ``torch==res.version`` and the rest; its interpreter."""
    if venv.exists():
        shutil.rmtree(venv)
    proc = run([python, "-m", "venv", str(venv)], out=logf)
    if proc.returncode != 0:
        raise RuntimeError(f"{python} -m venv failed: {proc.stderr.strip()[-500:]}")
    py = venv / "bin" / "python"
    env = {
        **os.environ,
        "PIP_CONSTRAINT": str(constraints_for(res.version, venv / "constraints.txt")),
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    }
    env.pop("VIRTUAL_ENV", None)
    pip = [str(py), "-m", "pip", "install", "--quiet"]
    wheel = fetch_wheel(py, res.version, wheels, env, logf)
    if wheel is None:
        raise RuntimeError(f"no wheel of torch=={res.version} for {python} (see {logf})")
    keep, cuda = wheel_requirements(wheel)
    if run([*pip, "--no-deps", str(wheel)], env=env, out=logf).returncode != 0:
        raise RuntimeError(f"installing {wheel.name} failed (see {logf})")
    if keep and run([*pip, *keep], env=env, out=logf).returncode != 0:
        raise RuntimeError(f"installing torch's requirements failed (see {logf})")
    res.build = "+cpu" if "+cpu" in wheel.name else ("cpu" if not cuda else "pypi, CUDA libs stubbed")
    if cuda:
        torch_dir = next((venv / "lib").glob("python3*/site-packages/torch"))
        stubbed = stub_missing_libraries(torch_dir, logf)
        res.notes.append(f"stubbed {len(stubbed)} CUDA libraries: {' '.join(stubbed)}")
    if run([*pip, *other_requirements()], env=env, out=logf).returncode != 0:
        raise RuntimeError(f"installing shardflow's other requirements failed (see {logf})")
    if run([*pip, "--no-deps", "-e", str(ROOT)], env=env, out=logf).returncode != 0:
        raise RuntimeError(f"pip install -e failed (see {logf})")
    got = run([str(py), "-c", "import torch; print(torch.__version__)"], env=env, out=logf)
    if got.returncode != 0 or got.stdout.strip().split("+")[0] != res.version:
        raise RuntimeError(f"import torch gives {got.stdout.strip() or got.stderr.strip()[-300:]!r}")
    return py


def summary_counts(text: str) -> dict[str, int]:
    """pytest's closing line, e.g. ``3 failed, 1890 passed, 4 skipped, 1200 deselected in 200.1s``."""
    last = [ln for ln in text.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    counts: dict[str, int] = {}
    for n, word in re.findall(r"(\d+) (\w+)", last[-1] if last else ""):
        counts[word.rstrip("s") if word == "errors" else word] = int(n)
    return counts


def check(res: Result, py: Path, work: Path, logf: Path, skip_tests: bool) -> None:
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "VIRTUAL_ENV": str(py.parent.parent),
        "PATH": f"{py.parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("PYTHONPATH", None)
    if skip_tests:
        res.fast_tier = "skipped"
    else:
        proc = run([str(py), *FAST_TIER], env=env, cwd=ROOT, out=logf)
        counts = summary_counts(proc.stdout)
        res.passed, res.failed, res.errors = counts.get("passed", 0), counts.get("failed", 0), counts.get("error", 0)
        res.fast_tier = "ok" if proc.returncode == 0 else f"FAIL (exit {proc.returncode})"
        for line in proc.stdout.splitlines():
            if line.startswith(("FAILED ", "ERROR ")):
                res.notes.append(line[:300])
    results = []
    for strategy in TRAIN_STRATEGIES:
        run_dir = work / f"run-{res.version}-{strategy}"
        cmd = [
            str(py.parent / "shardflow"),
            *TRAIN,
            "--strategy",
            strategy,
            *TRAIN_SMALL,
            "--run-dir",
            str(run_dir),
            "--overwrite",
            "--checkpoint-every",
            "0",
        ]
        proc = run(cmd, env=env, cwd=work, out=logf, timeout=900)
        results.append(f"{strategy} {'ok' if proc.returncode == 0 else f'FAIL (exit {proc.returncode})'}")
        if proc.returncode != 0:
            tail = [ln for ln in (proc.stderr or proc.stdout).splitlines() if ln.strip()][-2:]
            res.notes.append(f"train --strategy {strategy}: " + " | ".join(t.strip()[:300] for t in tail))
    res.train = ", ".join(results)
    res.train_ok = all(r.endswith(" ok") for r in results)


def table(results: list[Result], python: str) -> str:
    rows = [
        "| torch | build | install | fast tier (passed / failed / errors) | train --check | seconds |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in results:
        tier = f"{r.passed} / {r.failed} / {r.errors}" if r.fast_tier != "-" else "-"
        rows.append(
            f"| {r.version} | {r.build} | {r.install} | {tier} {'' if r.fast_tier in ('ok', '-') else '✗'} "
            f"| {r.train} | {r.seconds:.0f} |"
        )
    return f"Python: {python}\n" + "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--versions", required=True, help="comma-separated torch versions, e.g. 2.11.0,2.12.1,2.13.0")
    ap.add_argument("--python", default="python3", help="the interpreter of the scratch venvs (default python3)")
    ap.add_argument(
        "--work",
        type=Path,
        default=Path("/tmp/shardflow-compat"),
        help="venvs, wheels, logs and run directories (default /tmp/shardflow-compat)",
    )
    ap.add_argument("--skip-tests", action="store_true", help="install and train --check only")
    ap.add_argument("--keep", action="store_true", help="keep each venv afterwards (default: removed)")
    args = ap.parse_args(argv)
    work: Path = args.work.resolve()
    work.mkdir(parents=True, exist_ok=True)
    pyver = run([args.python, "-c", "import sys; print(sys.version.split()[0])"]).stdout.strip()
    results = []
    for version in [v.strip() for v in args.versions.split(",") if v.strip()]:
        res = Result(version)
        results.append(res)
        logf = work / f"torch-{version}.log"
        logf.write_text("")
        venv = work / f"venv-{version}"
        t0 = time.monotonic()
        log(f"torch {version}: installing into {venv} (log {logf})")
        try:
            py = install(res, args.python, venv, work / "wheels", logf)
            res.install = "ok"
            log(f"torch {version}: {res.build}; running the fast tier and train --check")
            check(res, py, work, logf, args.skip_tests)
        except Exception as e:  # noqa: BLE001 - one version's failure is a row of the table
            res.install = res.install if res.install == "ok" else "FAIL"
            res.notes.append(f"{type(e).__name__}: {e}")
        res.seconds = time.monotonic() - t0
        log(
            f"torch {version}: install {res.install}, fast tier {res.fast_tier} ({res.passed} passed, "
            f"{res.failed} failed, {res.errors} errors), train --check {res.train}, {res.seconds:.0f}s"
        )
        if not args.keep:
            shutil.rmtree(venv, ignore_errors=True)
    print()
    print(table(results, f"{args.python} ({pyver})"))
    for r in results:
        for note in r.notes:
            print(f"  {r.version}: {note}")
    return 0 if all(r.ok for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
