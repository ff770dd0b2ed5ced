"""nox sessions: ``parity`` (the smoke matrix, per torch version), ``gate`` (GO / NO-GO per
model on the default matrix, per torch version), ``models`` (real Hugging Face model classes
through the gate), ``bench`` (collectives, bytes, packing, memory, step time per path),
``report`` (the HTML report, checked in headless Chromium), ``fuzz`` (the generated-model
campaign), ``merge`` (join a sharded run's parts), ``device`` (the prepared GPU check) and
``tests``.

``nox -s parity`` runs the smoke matrix under torch 2.15.0 (native API present) and 2.13.0
(no ``param_dtype_override_fn``: every native cell must fall back to legacy and still pass).
Extra arguments go to ``python -m parity run``: ``nox -s parity -- --matrix default``.
"""

import os

import nox

nox.options.default_venv_backend = "uv"
# Installs write bytecode: this machine (and CI's image) sets PYTHONDONTWRITEBYTECODE, so
# without it every process that imports torch compiles ~2,000 sources again (6.8 s -> 2.3 s
# per import here), and a run starts one such process per rank.
os.environ.setdefault("UV_COMPILE_BYTECODE", "1")
nox.options.sessions = ["parity", "tests"]

TORCH_VERSIONS = ["2.15.0", "2.13.0"]
LOCAL_WHEELS = "/opt/wheels"  # some machines keep torch wheels here; harmless elsewhere


def _install_torch(session, version: str) -> None:
    args = ["--find-links", LOCAL_WHEELS] if os.path.isdir(LOCAL_WHEELS) else []
    session.install(*args, f"torch=={version}")


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def parity(session, torch):
    """Run a matrix (default: smoke) and write results/torch-<version>/. A given ``--out`` is used as
    is, by every torch version this session runs: name one (``nox -s "parity(torch='2.15.0')"``)."""
    _install_torch(session, torch)
    session.install("numpy", "pandas")
    session.install("--no-deps", ".")  # torch is pinned above, even below the package's floor
    args = session.posargs or ["--matrix", "smoke", "--fp64"]
    if not any(a.startswith("--out") for a in args):
        args = [*args, "--out", f"results/torch-{torch}", "--overwrite"]
    session.run("python", "-m", "parity", "run", *args)


@nox.session
@nox.parametrize("torch", TORCH_VERSIONS)
def gate(session, torch):
    """The gate on the default matrix: results/gate-torch-<version>/gate.md; exit 0 only on GO."""
    _install_torch(session, torch)
    session.install("numpy", "pandas")
    session.install("--no-deps", ".")
    args = session.posargs or []
    if not any(a.startswith("--out") or a.startswith("--from") for a in args):
        args = [*args, "--out", f"results/gate-torch-{torch}", "--overwrite"]
    session.run("python", "-m", "parity", "gate", *args)


@nox.session
def models(session):
    """Real model classes (Hugging Face, tiny configs) through the gate on the ``models``
    matrix: results/models/gate.md; exit 0 only on GO / NOT APPLICABLE for every model."""
    _install_torch(session, TORCH_VERSIONS[0])
    session.install("numpy", "pandas", "transformers==5.24.0")
    session.install("--no-deps", ".")
    args = session.posargs or []
    if not any(a.startswith("--out") or a.startswith("--from") for a in args):
        args = [*args, "--out", "results/models", "--overwrite"]
    session.run("python", "-m", "parity", "gate", "--matrix", "models", *args)


@nox.session
def bench(session):
    """Collectives, bytes, packing time, memory and step time per fixture x path:
    results/bench/bench.md, bench.csv and PNG plots (the ``plot`` extra)."""
    _install_torch(session, TORCH_VERSIONS[0])
    session.install("numpy", "pandas", "matplotlib")
    session.install("--no-deps", ".")
    args = session.posargs or ["--plot", "--harness", "smoke"]  # and parity's own cost per cell
    session.run("python", "-m", "parity", "bench", *args)


@nox.session
def report(session):
    """report.html rendered in headless Chromium (apt-get install chromium); fails without it."""
    _install_torch(session, TORCH_VERSIONS[0])
    session.install("-e", ".[test]")
    session.run("pytest", "-m", "browser", "tests/test_report.py", env={"PARITY_REQUIRE_BROWSER": "1"})


@nox.session
def fuzz(session):
    """Hypothesis-generated models on both paths: ``nox -s fuzz -- --examples 500``."""
    _install_torch(session, TORCH_VERSIONS[0])
    session.install("-e", ".[test]")
    session.run("python", "-m", "parity", "fuzz", *(session.posargs or ["--examples", "100"]))


@nox.session
def merge(session):
    """Join the parts of a sharded run: ``nox -s merge -- results/full-part-* --out results/full --gate``."""
    _install_torch(session, TORCH_VERSIONS[0])
    session.install("numpy", "pandas")
    session.install("--no-deps", ".")
    session.run("python", "-m", "parity", "merge", *session.posargs)


@nox.session
def device(session):
    """The prepared GPU check (docs/ci.md, "The GPU check"): the smoke matrix on CUDA with every visible
    GPU as a rank (cells needing more GPUs are SKIP), bench on CUDA with as many ranks as fit, the
    verdict counts and the records closest to their allowances (CUDA's kernels in the sharded run
    against the reference, which runs on cuda:0 too), printed from results/device/smoke/summary.md;
    the bench in results/device/bench/. The session fails when either command does (exit 1 included:
    a failing CUDA run is not a green check), after printing what it found."""
    import nox.command

    _install_torch(session, TORCH_VERSIONS[0])
    session.install("numpy", "pandas")
    session.install("--no-deps", ".")
    said = session.run("python", "-c", "import torch; print(torch.cuda.device_count())", silent=True)
    gpus = int(said.strip().splitlines()[-1])
    if gpus < 1:
        session.error("no GPU visible to torch: the device check needs at least one")
    out, failed = "results/device", []
    commands = {
        "smoke": ["run", "--matrix", "smoke", "--device", "cuda", "--fp64", "--out", f"{out}/smoke", "--overwrite",
                  "--junit", f"{out}/smoke/junit.xml"],
        "bench": ["bench", "--device", "cuda", "--ranks", "1" if gpus == 1 else "2", "--out", f"{out}/bench"],
    }
    for name, argv in commands.items():
        try:
            session.run("python", "-m", "parity", *argv)
        except nox.command.CommandFailed:
            failed.append(name)
    try:
        with open(f"{out}/smoke/summary.md") as fh:  # what to report: verdicts, how near CUDA comes to the allowances
            summary = fh.read()
        session.log(summary[summary.find("| verdict |"):summary.find("## Worst ratio per check")])
        session.log(summary[summary.find("## Closest to the allowance"):summary.find("## Ratio distribution")])
    except OSError as exc:
        failed.append(f"smoke's summary ({exc.strerror})")
    if failed:
        session.error(f"device check: {', '.join(failed)} did not pass; see {out}/")


@nox.session
def tests(session):
    """The test suite, parallel with pytest-xdist."""
    _install_torch(session, TORCH_VERSIONS[0])
    session.install("-e", ".[test,hf]")  # hf: the real model classes (tests/test_configs.py)
    # the package's and tests' own bytecode is written too (each pytest worker and rank imports them)
    session.run("pytest", "-n", "2", "--dist", "loadgroup", *session.posargs, env={"PYTHONDONTWRITEBYTECODE": ""})
