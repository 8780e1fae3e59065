"""nox sessions: `nox -s lint tests` is the gate; `nox -s bench` runs the benchmarks."""

import nox

nox.options.sessions = ["lint", "tests"]
nox.options.default_venv_backend = "venv"

TORCH = "torch==2.13.0"  # the CPU build available on this team's machines; users bring their own


@nox.session
def lint(session: nox.Session) -> None:
    session.install("ruff==0.17.6", "mypy==2.4.1", TORCH, "numpy", "h5py", "pytest")
    session.run("ruff", "check", "activation_guard", "tests", "benchmarks", "docs", "conftest.py", "noxfile.py",
                "setup.py")
    session.run("mypy", "activation_guard")


@nox.session
def tests(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "-m", "pytest", "-n", "2", *session.posargs)


@nox.session
def bench(session: nox.Session) -> None:
    session.install(TORCH)
    session.install("-e", ".[test]")
    session.run("python", "benchmarks/run.py", *session.posargs)
