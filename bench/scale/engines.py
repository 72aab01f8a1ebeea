"""One process serving the simulated engines of many workers: one listener per pod IP.

The scale benchmark runs 500 InferenceWorkers. One ``sessionfleet sim-engine`` process
per worker pod (what the e2e pod backer does) is about 60 MiB each: 500 of them would
not fit beside a control plane holding 100,000 sessions on a 24 GiB machine. So the
benchmark's worker pods are left to KWOK alone (no backer label: KWOK marks them
Running and Ready and gives each an IP from its loopback range), and this process
follows the namespace's worker pods and serves each pod's engine at ``<podIP>:8000``
with a simulated engine of its own (its own prefix cache and metrics), all in one
event loop. To the operator (which scrapes ``/metrics``) and to the routers (which
send turns) each worker is an engine at its pod's address, as in a cluster.

Run by ``bench/scale/run.py``::

    python bench/scale/engines.py --kubeconfig K --namespace NS --model m
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
sys.path.append(str(REPO))  # after the standard library: see e2e/localcluster/__main__.py

from aiohttp import web  # noqa: E402

from sessionfleet.api.labels import WORKER_LABEL  # noqa: E402
from sessionfleet.kube import PODS, Gone, Kube, KubeConfig, KubeError  # noqa: E402
from sessionfleet.simengine.engine import EngineConfig  # noqa: E402
from sessionfleet.simengine.server import build_app  # noqa: E402

ENGINE_PORT = 8000
log = logging.getLogger("bench.scale.engines")


class EngineHost:
    """The engines of a namespace's worker pods, one aiohttp site per pod IP."""

    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.runners: dict[str, tuple[str, web.AppRunner]] = {}
        """Pod name to (pod IP, the runner serving it)."""

    async def observe(self, kind: str, pod: dict[str, Any]) -> None:
        """Serve a Running pod's IP; stop serving a pod that is gone or going."""
        name = pod["metadata"]["name"]
        ip = (pod.get("status") or {}).get("podIP")
        going = kind == "DELETED" or pod["metadata"].get("deletionTimestamp")
        served = self.runners.get(name)
        if served is not None and (going or served[0] != ip):
            await self._stop(name)
            served = None
        if served is None and ip and not going:
            await self._start(name, ip)

    async def sync(self, pods: list[dict[str, Any]]) -> None:
        """Serve exactly the listed pods (after a list)."""
        names = {pod["metadata"]["name"] for pod in pods}
        for name in [n for n in self.runners if n not in names]:
            await self._stop(name)
        for pod in pods:
            await self.observe("ADDED", pod)

    async def _start(self, name: str, ip: str) -> None:
        runner = web.AppRunner(build_app(self.config), access_log=None, handle_signals=False)
        await runner.setup()
        try:
            await web.TCPSite(runner, ip, ENGINE_PORT, reuse_address=True).start()
        except OSError as error:  # the address is taken: say so, serve the others
            log.warning("pod %s: cannot listen on %s:%d: %s", name, ip, ENGINE_PORT, error)
            await runner.cleanup()
            return
        self.runners[name] = (ip, runner)

    async def _stop(self, name: str) -> None:
        _, runner = self.runners.pop(name)
        await runner.cleanup()

    async def close(self) -> None:
        """Stop every engine."""
        for name in list(self.runners):
            await self._stop(name)


async def follow(kube: Kube, namespace: str, host: EngineHost, stop: asyncio.Event) -> None:
    """List and watch the namespace's worker pods until ``stop`` is set."""
    version = ""
    while not stop.is_set():
        try:
            if not version:
                pods, version = await kube.list(PODS, namespace, label_selector=WORKER_LABEL)
                await host.sync(pods)
                log.info("serving %d engines", len(host.runners))
            async for kind, pod in kube.watch(
                PODS, namespace, resource_version=version, label_selector=WORKER_LABEL
            ):
                version = pod["metadata"].get("resourceVersion", version)
                if kind != "BOOKMARK":
                    await host.observe(kind, pod)
                if stop.is_set():
                    return
        except Gone:
            version = ""
        except KubeError as error:
            log.warning("pod watch interrupted (%s); watching again", error)
            await asyncio.sleep(1.0)


async def serve(args: argparse.Namespace) -> None:
    """Serve until SIGTERM or SIGINT."""
    kube = Kube(KubeConfig.load(str(args.kubeconfig)), user_agent="bench-scale-engines")
    host = EngineHost(EngineConfig(model=args.model, kv_tokens=args.kv_tokens))
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    task = asyncio.create_task(follow(kube, args.namespace, host, stop))
    await stop.wait()
    task.cancel()
    await host.close()
    await kube.aclose()


def main() -> int:
    """Parse the flags and serve."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--kubeconfig", type=Path, required=True)
    parser.add_argument("--namespace", required=True)
    parser.add_argument("--model", default="m")
    parser.add_argument("--kv-tokens", type=int, default=1 << 18, help="each engine's KV size")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    asyncio.run(serve(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
