"""Where the API server is and how to authenticate: kubeconfig or in-cluster."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SERVICE_ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


@dataclass
class KubeConfig:
    """Connection settings, read once; bound ServiceAccount tokens are re-read as they rotate."""

    server: str
    token: str | None = None
    token_file: Path | None = None
    cert_file: str | None = None
    key_file: str | None = None
    ca_file: str | None = None
    verify: bool = True
    namespace: str | None = None
    """The default namespace: the kubeconfig context's, or the pod's in a cluster."""
    _token_read_at: float = field(default=0.0, repr=False)

    # Kubelet rotates projected tokens well before expiry; re-reading each minute
    # is what client-go does too.
    TOKEN_REREAD_SECONDS = 60.0

    def bearer_token(self) -> str | None:
        """Return the current bearer token, re-reading a token file when it is due."""
        if self.token_file is not None and (
            self.token is None or time.monotonic() - self._token_read_at > self.TOKEN_REREAD_SECONDS
        ):
            self.token = self.token_file.read_text().strip()
            self._token_read_at = time.monotonic()
        return self.token

    @classmethod
    def in_cluster(cls) -> KubeConfig:
        """Return settings for a pod: the ServiceAccount token and the cluster CA."""
        host = os.environ["KUBERNETES_SERVICE_HOST"]
        port = os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if ":" in host:
            host = f"[{host}]"
        namespace_file = SERVICE_ACCOUNT_DIR / "namespace"
        namespace = namespace_file.read_text().strip() if namespace_file.exists() else None
        return cls(
            server=f"https://{host}:{port}",
            token_file=SERVICE_ACCOUNT_DIR / "token",
            ca_file=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
            namespace=namespace or None,
        )

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> KubeConfig:
        """Return settings from a kubeconfig file (``$KUBECONFIG`` or ``~/.kube/config``).

        ``context`` names the context to use; unset, the file's current context. Its
        namespace, when it sets one, becomes :attr:`namespace`.
        """
        # The kubernetes package resolves contexts, exec plugins and embedded
        # certificates (written to temporary files); only its result is used here.
        from kubernetes import client, config

        settings = client.Configuration()
        config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=path, context=context, client_configuration=settings, persist_config=False
        )
        # The kubernetes client keeps a kubeconfig's token under "BearerToken" (older
        # releases used "authorization"); either way it may carry the "Bearer " prefix.
        api_key = settings.api_key or {}
        auth = str(api_key.get("BearerToken") or api_key.get("authorization") or "")
        return cls(
            server=str(settings.host).rstrip("/"),
            token=auth.removeprefix("Bearer ").strip() or None,
            cert_file=settings.cert_file,
            key_file=settings.key_file,
            ca_file=settings.ssl_ca_cert,
            verify=bool(settings.verify_ssl),
            namespace=_context_namespace(config, path, context),
        )

    @classmethod
    def load(cls, path: str | None = None, context: str | None = None) -> KubeConfig:
        """In-cluster settings inside a pod unless a kubeconfig or a context is named or present."""
        if (
            path is None
            and context is None
            and "KUBERNETES_SERVICE_HOST" in os.environ
            and not os.environ.get("KUBECONFIG")
        ):
            return cls.in_cluster()
        return cls.from_kubeconfig(path, context)


def _context_namespace(config: Any, path: str | None, context: str | None) -> str | None:
    """Return the namespace the kubeconfig's context (``context``, else the current) sets."""
    contexts, current = config.list_kube_config_contexts(config_file=path)
    chosen = (
        current
        if context is None
        else next((c for c in contexts or [] if c.get("name") == context), None)
    )
    namespace = ((chosen or {}).get("context") or {}).get("namespace")
    return str(namespace) if namespace else None
