"""One virtual environment per library==version (``.venv-libraries/<name>-<version>``), holding
what a user's environment holds: the project's requirements.lock, torch included, plus the library,
with the lock as pip's constraints so that the library can change no pinned version (torch above
all: the CPU torch==2.13.0 the suite runs on stays; a library that asks for another torch fails to
install, and says so). The lock is installed once, in the project's own venv (scripts/bootstrap.sh),
and a library's venv sees it through a .pth file: its own site-packages holds only the library and
what the lock lacks, so making one takes seconds of pip instead of a minute of installing torch again
(deepspeed 0.19.8: 10 s against 60 s and more), and the packages it imports are the same files.
A library whose own dependencies cannot meet one of the lock's pins names it in its table entry
(``Library.unconstrained``, with why): its venv is constrained by the lock less those lines (written
into the venv as ``requirements.lock``), pip installs the version the library allows into the venv's
own site-packages, which comes first on sys.path, and torch is never one of them. A package the
library imports and does not declare, which the user's environment brings (triton, with CUDA torch),
is named in ``Library.extra_requirements`` and installed beside the library under the same
constraints. Made once, then reused while the lock, the base's site-packages, the lines left out and
the requirements are unchanged (a stamp).
The Debian packages a library needs come from apt where a command is missing."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from parallelism_conformance.harness.driver.libraries.table import Library

ROOT = Path(__file__).resolve().parents[3]
LOCK = ROOT / "requirements.lock"
HOME = ROOT / ".venv-libraries"


@dataclass(frozen=True)
class Venv:
    library: Library
    version: str
    path: Path

    @property
    def python(self) -> Path:
        return self.path / "bin" / "python"

    def environment(self, base: dict) -> dict:
        """``base`` with the library's variables and this venv's own op cache: torch's JIT-built
        extensions (DeepSpeed's deepspeed_shm_comm) are cached by name in ~/.cache/torch_extensions,
        so two versions there rebuild each other's op at every switch, and a run waits on the other's
        build lock; TORCH_EXTENSIONS_DIR (torch.utils.cpp_extension's) keeps each version's apart. The
        venv's bin comes first on PATH, for the warm-up and the suite's ranks alike: the ninja that pip
        installs there (1.13) and Debian's (1.11) each take the other's build for out of date, so a
        warm-up with the one made the ranks rebuild DeepSpeed's op with the other inside the first
        audited task, and the audit counted its 3 MB of compiler output as communication."""
        return {
            **base,
            **self.library.environment,
            "TORCH_EXTENSIONS_DIR": str(self.path / "torch_extensions"),
            "PATH": f"{self.path / 'bin'}{os.pathsep}{base.get('PATH', '')}",
        }


class InstallFailed(Exception):
    """One line saying why a library==version cannot be installed or imported."""


def venv_of(library: Library, version: str, home: Path = HOME) -> Venv:
    return Venv(library, version, home / f"{library.name}-{version}")


def _pip_name(line: str) -> str:
    """The normalised project name of a lock line ("Jinja2==3.1.6" -> "jinja2"), PEP 503's."""
    return re.sub(r"[-_.]+", "-", re.split(r"[=<>!~\[; ]", line.strip(), maxsplit=1)[0]).lower()


def lock_lines(library: Library) -> str:
    """requirements.lock without the lines the library may not be constrained by (torch never)."""
    left_out = {_pip_name(name) for name in library.unconstrained}
    if "torch" in left_out:
        raise InstallFailed(f"{library.name}: torch cannot be left out of the lock's constraints (the suite runs on the lock's torch)")
    lines = LOCK.read_text().splitlines(keepends=True)
    return "".join(line for line in lines if line.lstrip().startswith("#") or _pip_name(line) not in left_out)


def _requirements(venv: Venv) -> list[str]:
    """What pip installs over the lock: the library==version, then its extra requirements."""
    return [venv.library.requirement(venv.version), *venv.library.extra_requirements]


def base_site_packages() -> list[str]:
    """The site-packages of the interpreter running this (the project's venv, which holds the lock),
    as sys.path orders them: a venv made with --system-site-packages (a GPU image's CUDA torch) adds
    the system's, and bootstrap's .pth file a parent venv's."""
    return [entry for entry in sys.path if Path(entry).name in ("site-packages", "dist-packages") and Path(entry).is_dir()]


def _stamp(venv: Venv) -> Path:
    requirements = " ".join(_requirements(venv))
    base = "\n".join(base_site_packages())
    digest = hashlib.sha1(lock_lines(venv.library).encode() + requirements.encode() + base.encode()).hexdigest()[:12]
    return venv.path / f".libraries-installed-{digest}"


def _tail(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip() and not line.startswith("WARNING: Location")]
    return lines[-1].strip() if lines else "(no output)"


def system_packages(library: Library, log=print) -> None:
    """apt-get install the Debian packages whose commands are missing (once: ``apt-get update`` first)."""
    missing = sorted({package for command, package in library.system_packages.items() if shutil.which(command) is None})
    if not missing:
        return
    if shutil.which("apt-get") is None or os.geteuid() != 0:
        raise InstallFailed(
            f"{library.name} needs {', '.join(missing)} (Debian packages) and this machine has no apt-get run as root to install them"
        )
    log(f"[libraries] apt-get install {' '.join(missing)} (for {library.name})")
    for command in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *missing]):
        done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode:
            raise InstallFailed(f"{' '.join(command)} failed: {_tail(done.stderr or done.stdout)}")


def ensure(venv: Venv, log=print) -> Venv:
    """The venv, made and installed if its stamp is missing; InstallFailed with one line if pip or
    the import fails, or if the installed torch is not the lock's."""
    make(venv, log)
    check(venv)
    stamp = _stamp(venv)
    if venv.library.warm_up and not stamp.exists():
        log(f"[libraries] {venv.library.name}=={venv.version}: warming up ({venv.library.warm_up})")
        done = subprocess.run(
            [str(venv.python), "-c", venv.library.warm_up], capture_output=True, text=True, cwd=ROOT, env=venv.environment(dict(os.environ))
        )
        if done.returncode:
            raise InstallFailed(f"{venv.library.name}=={venv.version}'s warm-up failed: {_tail(done.stderr)}")
    stamp.touch()
    return venv


def make(venv: Venv, log=print) -> None:
    """pip install the library (and its extra requirements) into the venv over the base's lock, unless
    its stamp says that is done; InstallFailed with one line where pip fails or torch would change."""
    system_packages(venv.library, log)
    if _stamp(venv).exists():
        return
    left_out = ", ".join(venv.library.unconstrained)
    log(
        f"[libraries] installing {' '.join(_requirements(venv))} into {venv.path.relative_to(ROOT)} (over the project's venv, "
        + "the lock as constraints"
        + (f", less {left_out}: see its table entry)" if left_out else ")")
    )
    base = base_site_packages()
    if not base:
        raise InstallFailed(f"{sys.executable} has no site-packages on sys.path: run scripts/libraries, which makes the project's venv first")
    if not venv.python.exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(venv.path)], capture_output=True, text=True)
        if made.returncode:
            raise InstallFailed(f"python -m venv failed: {_tail(made.stderr)}")
    own = subprocess.run([str(venv.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"], capture_output=True, text=True)
    # after the venv's own site-packages on sys.path (site reads .pth files in order, appending)
    (Path(own.stdout.strip()) / "conformance-base.pth").write_text("\n".join(base) + "\n")
    lock = LOCK
    if venv.library.unconstrained:
        lock = venv.path / "requirements.lock"
        lock.write_text(lock_lines(venv.library))
    torch_before = _torch_build(venv)
    pip = [str(venv.python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check"]
    done = subprocess.run([*pip, "-c", str(lock), *_requirements(venv)], capture_output=True, text=True)
    if done.returncode:
        raise InstallFailed(f"pip cannot install {' '.join(_requirements(venv))} beside requirements.lock: {_tail(done.stderr)}")
    if _torch_build(venv) != torch_before:
        raise InstallFailed(f"installing {venv.library.requirement(venv.version)} changed torch {torch_before} into {_torch_build(venv)}")


def _torch_build(venv: Venv) -> str:
    """torch's version as the venv's pip recorded it, with its local label ("2.13.0+cpu")."""
    done = subprocess.run([str(venv.python), "-m", "pip", "show", "torch"], capture_output=True, text=True)
    return next((line.split(":", 1)[1].strip() for line in done.stdout.splitlines() if line.startswith("Version:")), "none")


def check(venv: Venv) -> None:
    """The library imports, at the version asked, on the lock's torch (CPU or CUDA as the lock's is)."""
    want_torch = next(line.split("==")[1].strip() for line in LOCK.read_text().splitlines() if line.startswith("torch=="))
    probe = (
        "import importlib.metadata as m, torch; import "
        + venv.library.module
        + f"; print(torch.__version__.split('+')[0], m.version({venv.library.name!r}))"
    )
    done = subprocess.run([str(venv.python), "-c", probe], capture_output=True, text=True, cwd=ROOT)
    if done.returncode:
        raise InstallFailed(f"{venv.library.name}=={venv.version} does not import: {_tail(done.stderr)}")
    torch_version, version = done.stdout.strip().splitlines()[-1].split()
    if torch_version != want_torch:
        raise InstallFailed(f"{venv.library.name}=={venv.version} brought torch {torch_version}, not the lock's {want_torch}")
    if version != venv.version:
        raise InstallFailed(f"{venv.library.name} {version} is installed, not {venv.version}")
