"""Loading credentials from a kubeconfig: tokens and client certificates."""

from __future__ import annotations

from pathlib import Path

import yaml

from sessionfleet.kube import KubeConfig


def write(tmp_path: Path, user: dict[str, str]) -> Path:
    config = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "c",
                "cluster": {"server": "https://127.0.0.1:6443", "insecure-skip-tls-verify": True},
            }
        ],
        "users": [{"name": "u", "user": user}],
        "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
        "current-context": "x",
    }
    path = tmp_path / "kubeconfig"
    path.write_text(yaml.safe_dump(config))
    return path


def test_a_token_kubeconfig_yields_the_bearer_token(tmp_path: Path) -> None:
    config = KubeConfig.from_kubeconfig(str(write(tmp_path, {"token": "sa-token-123"})))
    assert config.server == "https://127.0.0.1:6443"
    assert config.bearer_token() == "sa-token-123"
    assert config.verify is False


def test_a_certificate_kubeconfig_has_no_token(tmp_path: Path) -> None:
    (tmp_path / "c.crt").write_text("x")
    (tmp_path / "c.key").write_text("x")
    user = {"client-certificate": str(tmp_path / "c.crt"), "client-key": str(tmp_path / "c.key")}
    config = KubeConfig.from_kubeconfig(str(write(tmp_path, user)))
    assert config.bearer_token() is None
    assert config.cert_file == str(tmp_path / "c.crt")
