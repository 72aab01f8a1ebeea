"""Where the e2e tool binaries live and a check that they are all there.

The binaries are built by ``e2e/build-tools.sh`` (``make e2e-tools``) into a cache
outside the repository; this module computes the same location so that the harness
and the build script agree without passing paths around.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

#: The control plane the e2e suite runs on unless ``K8S_VERSION`` names another; the
#: default of ``e2e/build-tools.sh`` too.
DEFAULT_K8S_VERSION = "v1.36.3"


def _k8s_version_from_env() -> str:
    """``$K8S_VERSION`` (a release such as ``v1.37.2``), else the default."""
    version = os.environ.get("K8S_VERSION") or DEFAULT_K8S_VERSION
    if not re.fullmatch(r"v1\.\d+\.\d+", version):
        raise ValueError(f"K8S_VERSION={version!r} is not a release such as v1.37.2")
    return version


#: The control plane's version: every binary comes from ``k8s-<version>`` in the cache,
#: built by ``K8S_VERSION=<version> e2e/build-tools.sh`` from e2e/tools/k8s/<version>/.
K8S_VERSION = _k8s_version_from_env()

#: Every binary the harness or the tests run; ``build-tools.sh`` builds exactly these.
BINARIES = (
    "etcd",
    "kube-apiserver",
    "kube-controller-manager",
    "kube-scheduler",
    "kubectl",
    "kwok",
    "helm",
    "promtool",
    "karpenter",
)


class ToolsMissingError(RuntimeError):
    """A tool binary, the KWOK stage files or a CRD folder are missing from the tools cache."""


def cache_dir(override_variable: str, name: str) -> Path:
    """``$<override_variable>``, else ``${XDG_CACHE_HOME:-~/.cache}/sessionfleet/<name>``."""
    override = os.environ.get(override_variable)
    if override:
        return Path(override).expanduser()
    cache_home = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache_home) / "sessionfleet" / name


def tools_root() -> Path:
    """Return the tools cache directory, honouring ``SESSIONFLEET_E2E_TOOLS``.

    Mirrors the default of ``e2e/build-tools.sh``:
    ``${XDG_CACHE_HOME:-~/.cache}/sessionfleet/k8s-${K8S_VERSION}``.
    """
    return cache_dir("SESSIONFLEET_E2E_TOOLS", f"k8s-{K8S_VERSION}")


@dataclass(frozen=True)
class Tools:
    """Paths of the built tools: binaries under ``bin/``, KWOK's Stage YAMLs, CRDs."""

    root: Path

    @property
    def bin_dir(self) -> Path:
        """Directory holding the binaries."""
        return self.root / "bin"

    @property
    def stages_dir(self) -> Path:
        """Directory holding KWOK's shipped Stage YAMLs (``node/...``, ``pod/...``)."""
        return self.root / "kwok-stages"

    @property
    def gaie_crds_dir(self) -> Path:
        """The Gateway API Inference Extension's CRDs (InferencePool), from its Go module.

        Copied from ``config/crd/bases/`` of the release pinned in
        ``e2e/tools/gaie/go.mod``; ``VERSION`` beside them names it.
        """
        return self.root / "gaie-crds"

    @property
    def karpenter_crds_dir(self) -> Path:
        """Karpenter's CRDs (NodePool, NodeClaim, KWOKNodeClass, ...), from its Go module.

        Copied from ``kwok/charts/crds/`` and ``kwok/apis/crds/`` of the release pinned
        in ``e2e/tools/karpenter/go.mod``; ``VERSION`` beside them names it.
        """
        return self.root / "karpenter-crds"

    def binary(self, name: str) -> Path:
        """Return the path of one binary (see ``BINARIES``)."""
        return self.bin_dir / name

    @property
    def kubectl(self) -> Path:
        """The kubectl built from the same Kubernetes release as the API server."""
        return self.binary("kubectl")

    @property
    def helm(self) -> Path:
        """The pinned helm."""
        return self.binary("helm")

    @property
    def promtool(self) -> Path:
        """The pinned promtool (Prometheus's rule checker and rule unit-test runner)."""
        return self.binary("promtool")

    @property
    def karpenter(self) -> Path:
        """Karpenter built with its KWOK cloud provider (``sigs.k8s.io/karpenter/kwok``)."""
        return self.binary("karpenter")


def find_tools() -> Tools:
    """Locate the tools cache and check that every binary and the stages exist.

    Raises:
        ToolsMissingError: naming what is missing and the command that builds it.
    """
    tools = Tools(tools_root())
    missing = [name for name in BINARIES if not os.access(tools.binary(name), os.X_OK)]
    if not (tools.stages_dir / "pod").is_dir():
        missing.append("kwok-stages")
    if not (tools.gaie_crds_dir / "VERSION").is_file():
        missing.append("gaie-crds")
    if not (tools.karpenter_crds_dir / "VERSION").is_file():
        missing.append("karpenter-crds")
    if missing:
        raise ToolsMissingError(
            f"e2e tools missing from {tools.root}: {', '.join(missing)}; "
            f"build them with `make e2e-tools K8S_VERSION={K8S_VERSION}` "
            "(a cold build takes about 15-20 minutes)"
        )
    return tools
