"""A vLLM worker's pod as a local process: every difference from a GPU node, in one place.

The operator builds a vLLM worker's pod for a GPU node: vLLM's image, whose entrypoint
is ``vllm serve``, with the model name and the serving flags as arguments. The pod
backer runs that container with the real vLLM installed by ``make e2e-vllm-tools``
(``e2e/vllm/install.py``: vLLM's CPU build and a tiny local model), passing on the
arguments the operator wrote, except where this machine cannot take them:

* the image's entrypoint: ``<env>/bin/vllm serve`` from the cached install (no
  container runtime here);
* ``MODEL``, the first argument: the local tiny model's path (no model hub);
  ``--served-model-name`` keeps the name clients and the router use;
* ``--host=0.0.0.0``: ``--host=<pod IP>``. Every pod shares this machine's network,
  and each serves at its own 127.x pod IP;
* ``--tensor-parallel-size=N``: kept for 1, refused for more (tensor parallelism
  needs N GPUs);
* ``--kv-transfer-config``: kept for sessionfleet's own connector (the image has the
  package; here ``PYTHONPATH`` names this checkout's), refused for any other (LMCache
  does not install here; vLLM's OffloadingConnector refuses to start on CPU);
* added: ``--enforce-eager`` (starts in about 30 s instead of 70 s: no
  torch.compile), ``--kv-cache-memory-bytes`` 64 MiB (65,536 tokens, so two engines
  fit beside the suite), ``--max-model-len=4096`` and ``--dtype=bfloat16`` (the tiny
  model's);
* a lower CPU priority (``nice`` 10, :func:`lower_priority`): in a cluster the
  engines run on GPU nodes and the control plane on others; here all share two cores,
  and an engine starting (tens of seconds of a core) must not starve the API server of
  the time it needs to answer a Lease renewal;
* added to the environment: ``HF_HUB_OFFLINE=1`` and ``TRANSFORMERS_OFFLINE=1``
  (nothing is fetched); ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and
  ``OMP_NUM_THREADS=1`` (a kubelet gives each pod CPUs of its own; here every engine
  shares two cores, and vLLM would pin each to the same one); ``VLLM_CACHE_ROOT`` in
  the cluster's state directory, ``TMPDIR`` a directory of the pod's own (removed when
  its process is gone).

A failure here is the kubelet's ``CreateContainerConfigError``: the pod is marked
terminated with the reason, and nothing is started. An argument the user added
(``engine.args``) that sets an added one wins over it.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import sessionfleet
from sessionfleet.engines.kvstore_wire import CONNECTOR_CLASS

from ._podspec import PodSpecError
from ._tools import cache_dir

VLLM_CPU_VERSION = "0.32.0"
MODEL_NAME = "tiny-llama"
KV_CACHE_BYTES = 64 * 2**20
MAX_MODEL_LEN = 4096

#: The last path component of the images whose entrypoint is ``vllm serve``: the
#: upstream image and the project's own (Dockerfile.vllm, vLLM's image plus LMCache).
VLLM_IMAGE_NAMES = frozenset({"vllm-openai", "sessionfleet-vllm"})

#: Flags added for this machine unless the pod sets them itself.
CPU_FLAGS: tuple[tuple[str, str | None], ...] = (
    ("--enforce-eager", None),
    ("--kv-cache-memory-bytes", str(KV_CACHE_BYTES)),
    ("--max-model-len", str(MAX_MODEL_LEN)),
    ("--dtype", "bfloat16"),
)


def vllm_root() -> Path:
    """``$SESSIONFLEET_VLLM_ENV``, else ``<cache>/sessionfleet/vllm-cpu-<version>``.

    ``<cache>`` is ``$XDG_CACHE_HOME`` or ``~/.cache``, as for the Go tools.
    """
    return cache_dir("SESSIONFLEET_VLLM_ENV", f"vllm-cpu-{VLLM_CPU_VERSION}")


@dataclass(frozen=True)
class VllmInstall:
    """Where ``make e2e-vllm-tools`` put vLLM and the tiny model."""

    root: Path

    @property
    def env(self) -> Path:
        """The virtual environment holding vllm-cpu and torch."""
        return self.root / "env"

    @property
    def vllm(self) -> Path:
        """vLLM's command line (the image's entrypoint is ``vllm serve``)."""
        return self.env / "bin" / "vllm"

    @property
    def python(self) -> Path:
        """The environment's Python."""
        return self.env / "bin" / "python"

    @property
    def model_dir(self) -> Path:
        """The tiny model and its tokenizer."""
        return self.root / "models" / MODEL_NAME

    @property
    def stamp(self) -> Path:
        """Written last by a complete install."""
        return self.root / "STAMP"

    def missing(self) -> str | None:
        """Why this install cannot serve, or None when it can."""
        if not self.stamp.is_file() or not os.access(self.vllm, os.X_OK):
            return (
                f"vLLM is not installed in {self.root}: run `make e2e-vllm-tools` "
                "(about 3 minutes and 2.3 GB of downloads, once per machine)"
            )
        if not (self.model_dir / "config.json").is_file():
            return f"the tiny model is missing from {self.model_dir}: run `make e2e-vllm-tools`"
        return None


def is_vllm_image(image: str) -> bool:
    """Whether the image's entrypoint is ``vllm serve`` (by its repository's last component)."""
    repository = image.split("@", 1)[0]
    name = repository.rsplit("/", 1)[-1]
    return name.split(":", 1)[0] in VLLM_IMAGE_NAMES


def _flag(arg: str) -> str:
    return arg.split("=", 1)[0]


def vllm_argv(install: VllmInstall, args: Sequence[str], pod_ip: str) -> list[str]:
    """``vllm serve`` with the pod's arguments, mapped as the module's table says.

    Raises:
        PodSpecError: for an argument this machine cannot honour.
    """
    if not args or args[0].startswith("-"):
        raise PodSpecError("a vLLM container's first argument must be the model")
    mapped = [str(install.vllm), "serve", str(install.model_dir)]
    rest = list(args[1:])
    index = 0
    while index < len(rest):
        arg = rest[index]
        flag = _flag(arg)
        following = rest[index + 1] if index + 1 < len(rest) else None
        takes_next = "=" not in arg and following is not None and not following.startswith("-")
        value = arg.split("=", 1)[1] if "=" in arg else (following if takes_next else None)
        step = 2 if takes_next else 1
        if flag == "--kv-transfer-config":
            _check_connector(arg, value)
        if flag == "--host":
            mapped.append(f"--host={pod_ip}")
        elif flag in ("--tensor-parallel-size", "-tp"):
            if value != "1":
                raise PodSpecError(f"{arg}: tensor parallelism needs GPUs (vLLM runs on CPU here)")
            mapped.append("--tensor-parallel-size=1")
        else:
            mapped.extend(rest[index : index + step])
        index += step
    given = {_flag(arg) for arg in rest}
    for flag, value in CPU_FLAGS:
        if flag not in given:
            mapped.append(flag if value is None else f"{flag}={value}")
    return mapped


def _check_connector(arg: str, value: str | None) -> None:
    try:
        config = json.loads(value or "")
    except ValueError as error:
        raise PodSpecError(f"{arg}: not JSON: {error}") from error
    connector = config.get("kv_connector") if isinstance(config, dict) else None
    if connector != CONNECTOR_CLASS:
        raise PodSpecError(
            f"--kv-transfer-config: {connector!r} does not run here (LMCache does not "
            "install with vLLM's CPU build; vLLM's OffloadingConnector needs a GPU); "
            f"{CONNECTOR_CLASS} does"
        )


ENGINE_NICENESS = 10
"""How much lower than the control plane the engines run (module docstring)."""


def lower_priority(pid: int) -> None:
    """Run the engine at :data:`ENGINE_NICENESS`; its processes inherit it as they start.

    Set right after the start: vLLM starts its engine core and worker processes seconds
    later, after its imports, and they inherit the priority then.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, pid, ENGINE_NICENESS)
    except OSError:
        pass  # gone already: the backer sees it exit


def scratch_dir(pod_uid: str) -> Path:
    """The pod's temporary directory: short, because vLLM puts its ZeroMQ sockets there.

    A Unix socket's path has at most 107 bytes; one under the state directory (pods
    are named after their tests) is longer.
    """
    return Path(tempfile.gettempdir()) / "sessionfleet-vllm" / pod_uid[:13]


def vllm_env(install: VllmInstall, scratch: Path, state_dir: Path) -> Mapping[str, str]:
    """Environment added to a vLLM container's own (which wins where both set a name)."""
    scratch.mkdir(parents=True, exist_ok=True)
    return {
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_CPU_OMP_THREADS_BIND": "nobind",
        "OMP_NUM_THREADS": "1",
        "VLLM_CACHE_ROOT": str(state_dir / "vllm-cache"),
        "TMPDIR": str(scratch),
        # The image installs the package; here vLLM imports the connector from this
        # checkout, the same source the operator under test runs.
        "PYTHONPATH": str(Path(sessionfleet.__file__).parent.parent),
    }
