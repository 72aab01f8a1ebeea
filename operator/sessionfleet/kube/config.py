"""Where the API server is and how to authenticate: kubeconfig or in-cluster."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

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
        return cls(
            server=f"https://{host}:{port}",
            token_file=SERVICE_ACCOUNT_DIR / "token",
            ca_file=str(SERVICE_ACCOUNT_DIR / "ca.crt"),
        )

    @classmethod
    def from_kubeconfig(cls, path: str | None = None, context: str | None = None) -> KubeConfig:
        """Return settings from a kubeconfig file (``$KUBECONFIG`` or ``~/.kube/config``)."""
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
        )

    @classmethod
    def load(cls, path: str | None = None) -> KubeConfig:
        """In-cluster settings inside a pod unless a kubeconfig is named or present."""
        if (
            path is None
            and "KUBERNETES_SERVICE_HOST" in os.environ
            and not os.environ.get("KUBECONFIG")
        ):
            return cls.in_cluster()
        return cls.from_kubeconfig(path)
